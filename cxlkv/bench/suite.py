"""`cxlkv bench`: what the pool gives, each figure beside a baseline measured
in the same run (these machines are shared and noisy; ratios are what count).

Scenarios run on scratch pools made for the run (harness.scratch_dir(), in
/dev/shm) and removed after; with pool_path the KV scenarios run on that pool
instead, in a namespace of their own that is dropped after.  Each returns its
figures (cxlkv.bench.poolops, .kv, .handoff, .trace); `run()` collects them into
one dict with stable keys.  A scenario that cannot run reports None and the
reason (in "notes").
"""
from __future__ import annotations

import os
import shutil
from typing import Callable

import numpy as np

import cxlkv
from cxlkv._core import copymode
from cxlkv.bench import handoff, harness, kv, poolops, trace
from cxlkv.bench.kv import KV_BLOCK, KV_BLOCK_TOKENS, LOOKUP_BLOCK, LOOKUP_TOKENS
from cxlkv.errors import BenchRefused
from cxlkv.kv.area import LOW_WATERMARK, Area
from cxlkv.ops.init import init_pool
from cxlkv.ops.lockmgr import ensure_manager
from cxlkv.state import alloc
from cxlkv.state.nodes import read_nodes

MiB = harness.MiB

#: the targets: figure -> (comparison, value)
TARGETS = {
    "lock_cas_us": ("<=", 1.0),
    "lock_manager_us": ("<=", 50.0),
    "alloc_ops_per_s": (">=", 2_000_000),
    "alloc_utilisation": (">=", 0.92),
    "put_vs_memcpy": (">=", 0.8),
    "get_vs_memcpy": (">=", 0.8),
    "handoff_vs_tcp": (">=", 4.0),
    "handoff_stream_vs_tcp": (">=", 4.0),
    "handoff_vs_redis": (">=", 15.0),
    "handoff_vs_shm": (">=", 1.0),
    "lookup_32k_ms": ("<=", 2.0),
}

#: the steps run() reports through progress(), in order (the CLI's progress bar)
STEPS = ("memcpy baseline", "pool writes and reads", "cas lock", "alloc + free",
         "manager lock", "kv in manager mode", "utilisation trace", "kv put and get",
         "kv lookup of 32K tokens",
         "handoff through the pool", "handoff through the pool, streamed",
         "handoff through /dev/shm", "handoff over TCP",
         "handoff through redis")




def check_room(pool, block_bytes: int, blocks: int) -> None:
    """Refuse (BenchRefused) unless `blocks` blocks of `block_bytes` fit in the
    pool with a margin, without the store evicting anything: free chunks for
    the slots, KV usage staying above the low watermark, free hash entries."""
    a = Area(pool)
    h = a.header()
    size = a.data_size()
    chunk = pool.sb.chunk_size
    need = blocks * alloc.slot_size_for(pool, block_bytes)
    margin = max(4 * chunk, need // 8)
    free_chunks = int(np.count_nonzero(~alloc.bitmap(pool))) * chunk
    kv_used = a.used_bytes()
    problems = []
    if free_chunks < need + margin:
        problems.append(f"{free_chunks} bytes in free chunks")
    if size - kv_used - need - margin < LOW_WATERMARK * size:
        problems.append(f"{kv_used} of {size} data bytes used by KV blocks (a store evicts "
                        f"when less than {LOW_WATERMARK:.0%} would stay free)")
    if h.live + h.tombstones + blocks > a.max_used:
        problems.append(f"{h.live} live entries and {h.tombstones} tombstones of at most "
                        f"{a.max_used} in the hash table")
    if problems:
        raise BenchRefused(
            f"{pool.path}: no room for the bench's {blocks} blocks ({need} bytes + {margin} "
            f"margin) without evicting other blocks: {'; '.join(problems)}",
            path=pool.path,
            hint="free space in the pool (drop unused namespaces), or run `cxlkv bench` "
                 "without --pool (scratch pools)")


def check_nodes(pool, more: int) -> None:
    """Refuse unless `more` node slots are free (the handoff processes attach)."""
    free = sum(1 for n in read_nodes(pool, include_free=True) if n.state == "free")
    if free < more:
        raise BenchRefused(
            f"{pool.path}: the bench's handoff needs {more} free node slots and "
            f"{free} {'is' if free == 1 else 'are'} free (max nodes {pool.sb.max_nodes})",
            path=pool.path, hint="detach idle nodes, or run `cxlkv bench` without --pool")


# -- the whole bench ---------------------------------------------------------------------
def run(progress: Callable[[str], None] = lambda s: None, quick: bool = False,
        pool_path: str | None = None) -> dict:
    """Every scenario; one dict of figures with stable keys.

    quick=True shrinks every scenario (for tests: the figures mean little).
    pool_path: run the KV scenarios (put/get, lookup, handoff) on this
    existing pool, in a namespace of their own dropped after; refuses
    (BenchRefused) when the pool lacks room for them without evicting."""
    out: dict = {"version": cxlkv.__version__, "notes": {}}
    # the bulk-copy modes the figures below ran with (calibrated once per host)
    out["copy_modes"] = copymode.ensure()
    total = 8 * MiB if quick else 64 * MiB
    reps = 2 if quick else 5

    stop_manager = None
    if pool_path is not None:               # refuse before anything else runs
        with cxlkv.Pool.open(pool_path, writable=False) as p:
            managed = p.sb.sync == "manager"
        if managed:                         # a lock manager for the run, if none runs
            _, stop_manager = ensure_manager(pool_path)
    d = harness.scratch_dir()
    try:
        if pool_path is not None:
            with cxlkv.open_pool(pool_path) as kpool:
                check_room(kpool, KV_BLOCK, total // KV_BLOCK)
                check_room(kpool, LOOKUP_BLOCK, _lookup_tokens(quick) // KV_BLOCK_TOKENS)
                check_nodes(kpool, 2)

        progress("memcpy baseline")
        out["memcpy_gbps"] = harness.memcpy_gbps(total)

        path = os.path.join(d, "cas.pool")
        init_pool(path, {"size": (64 if quick else 512) * MiB, "sync": "cas"})
        with cxlkv.open_pool(path) as pool:
            progress("pool writes and reads")
            out["pool_write_gbps"], out["pool_read_gbps"] = poolops.pool_copy_gbps(pool, total)
            progress("cas lock")
            out["lock_cas_us"] = poolops.lock_us(pool, 2000 if quick else 100_000)
            progress("alloc + free")
            out["alloc_ops_per_s"] = poolops.alloc_ops(pool, rounds=20 if quick else 2000)
        progress("manager lock")
        path = os.path.join(d, "manager.pool")
        init_pool(path, {"size": (64 if quick else 256) * MiB, "sync": "manager",
                         "chunk_size": MiB})
        _, stop = ensure_manager(path)
        try:
            with cxlkv.open_pool(path) as pool:
                out["lock_manager_us"] = poolops.lock_us(pool, 200 if quick else 5000)
                # the KV cache in manager mode (every entry change through the
                # lock manager, flushes and invalidations included)
                progress("kv in manager mode")
                mtotal = total // 4
                out["put_manager_gbps"], out["get_manager_gbps"] = kv.kv_put_get(
                    pool, "cxlkv-bench-manager", mtotal, reps=reps)
                out["lookup_32k_manager_ms"], _ = kv.kv_lookup_ms(
                    pool, "cxlkv-bench-manager-lookup", _lookup_tokens(quick),
                    repeat=5 if quick else 20)
        finally:
            stop()

        progress("utilisation trace")
        path = os.path.join(d, "trace.pool")
        init_pool(path, {"size": (256 * MiB) if quick else (1 << 30)})
        with cxlkv.open_pool(path) as pool:
            tr = trace.run_trace(pool, seed=1)
        out["alloc_utilisation"] = tr["utilisation"]
        out["buddy_utilisation"] = tr["buddy_utilisation"]
        out["trace"] = {k: tr[k] for k in ("sequences", "payload_bytes", "data_bytes",
                                           "block_bytes", "blocks")}
        os.unlink(path)

        out.update(_kv_scenarios(progress, d, quick, pool_path, total, reps, out["notes"]))
    finally:
        shutil.rmtree(d, ignore_errors=True)
        if stop_manager is not None:
            stop_manager()
    m = out["memcpy_gbps"]
    out["pool_write_vs_memcpy"] = out["pool_write_gbps"] / m
    out["pool_read_vs_memcpy"] = out["pool_read_gbps"] / m
    for key, fig, base in (("handoff_vs_tcp", "handoff_gbps", "tcp_gbps"),
                           ("handoff_stream_vs_tcp", "handoff_stream_gbps", "tcp_gbps"),
                           ("handoff_vs_redis", "handoff_gbps", "redis_gbps"),
                           ("handoff_vs_shm", "handoff_gbps", "shm_handoff_gbps")):
        out[key] = None if out[base] is None else out[fig] / out[base]
        if out[base] is None:
            out["notes"][key] = f"no {base}: {out['notes'][base]}"
    out["utilisation_vs_buddy"] = out["alloc_utilisation"] / out["buddy_utilisation"]
    out["targets"] = {k: harness.meets(out.get(k), *t) for k, t in TARGETS.items()}
    return out


def _kv_scenarios(progress, d: str, quick: bool, pool_path: str | None, total: int,
                  reps: int, notes: dict) -> dict:
    out: dict = {}
    if pool_path is None:
        kv_path = os.path.join(d, "kv.pool")
        init_pool(kv_path, {"size": (128 if quick else 512) * MiB, "sync": "cas"})
        harness.materialize(kv_path)
    else:
        kv_path = pool_path
    ns = f"cxlkv-bench-{os.getpid()}"
    names = (ns, ns + "-lookup", ns + "-handoff")
    ntok = _lookup_tokens(quick)
    with cxlkv.open_pool(kv_path) as kpool:
        guard = None if pool_path is None else (lambda bb, n: check_room(kpool, bb, n))
        if pool_path is None:
            harness.map_in(kpool)           # the timed reps write pages never touched
        try:
            out["kv_pool"] = pool_path
            out["kv_namespace"] = ns
            progress("kv put and get")
            pg = kv.kv_put_get_paired(kpool, names[0], total, reps=reps, guard=guard)
            out["put_gbps"], out["get_gbps"] = pg["put_gbps"], pg["get_gbps"]
            # each rep's ratio to a memcpy timed just before it
            out["put_vs_memcpy"], out["get_vs_memcpy"] = pg["put_vs_memcpy"], pg["get_vs_memcpy"]
            out["kv_memcpy_gbps"] = pg["memcpy_gbps"]
            progress("kv lookup of 32K tokens")
            out["lookup_tokens"] = ntok
            out["lookup_32k_ms"], out["lookup_32k_list_ms"] = kv.kv_lookup_ms(
                kpool, names[1], ntok, repeat=10 if quick else 50, guard=guard)
            with handoff.HandoffPair() as pair:
                progress("handoff through the pool")

                def before():                   # last rep's blocks go, outside the timing
                    kv.drop(kpool, names[2])
                    if guard:
                        guard(KV_BLOCK, total // KV_BLOCK)

                out["handoff_phases_ms"] = {"pool": {}, "pool_stream": {}, "shm": {}}
                out["handoff_gbps"] = handoff.handoff_gbps(
                    pair, {"kind": "kv", "path": kv_path, "ns": names[2], "total": total},
                    reps, before, out["handoff_phases_ms"]["pool"])
                progress("handoff through the pool, streamed")
                out["handoff_stream_gbps"] = handoff.handoff_gbps(
                    pair, {"kind": "kv-stream", "path": kv_path, "ns": names[2],
                           "total": total}, reps, before,
                    out["handoff_phases_ms"]["pool_stream"])
                progress("handoff through /dev/shm")
                shm = os.path.join(d, "handoff.shm")
                with open(shm, "wb") as f:
                    f.truncate(total)
                out["shm_handoff_gbps"] = handoff.handoff_gbps(
                    pair, {"kind": "shm", "path": shm, "total": total}, reps,
                    phases=out["handoff_phases_ms"]["shm"])
                os.unlink(shm)
                progress("handoff over TCP")
                out["tcp_gbps"] = handoff.handoff_gbps(pair, {"kind": "tcp", "total": total}, reps)
                progress("handoff through redis")
                out["redis_gbps"] = None
                try:
                    proc, port = harness.start_redis()
                except harness.Unavailable as e:
                    notes["redis_gbps"] = str(e)
                else:
                    try:
                        out["redis_gbps"] = handoff.handoff_gbps(
                            pair, {"kind": "redis", "port": port, "total": total}, reps)
                    finally:
                        harness.stop_redis(proc)
        finally:
            for name in names:
                kv.drop(kpool, name)
    return out


def _lookup_tokens(quick: bool) -> int:
    return 4096 if quick else LOOKUP_TOKENS
