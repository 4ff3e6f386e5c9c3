"""Benchmarks: one harness and the scenarios that use it.

    harness      scratch pools in /dev/shm, same-run baselines, medians and
                 percentiles, targets, child processes, the lock manager and
                 redis-server launchers, the scenario registry and JSON output
    suite        `cxlkv bench`: pool copies, locks and allocator (poolops), the
                 allocation trace (trace), the KV cache (kv), and the
                 producer -> consumer handoff (handoff), each beside its baseline
    scale        `cxlkv bench --scale`: the rack-scale costs
    alloc_scale, evict_scale, hot, journal, kv_events, lock_scale, lockmgr_rt, remote,
    remote_ttft, spill, ttft
                 `cxlkv bench run NAME [ARGS]` (harness.SCENARIOS): one figure
                 family each, `--json` for one JSON document

Layering: this package may import any part of cxlkv; nothing in cxlkv imports
it but the `cxlkv bench` command.
"""
