"""DRAM hot tier figures: `load_into` of a hot working set with and without
the tier, same run, in both sync modes (manager mode under the non-coherence
emulation: every pool read invalidates its cache lines first, as on
non-coherent CXL memory, which the DRAM copies skip).

    cxlkv bench run hot [--blocks N] [--kib K] [--rounds R] [--json]
"""
from __future__ import annotations

import os
import time

import numpy as np

import cxlkv
from cxlkv.bench import harness

MiB = harness.MiB


def measure(path, bb, blocks, rounds, hot):
    toks = list(range(16 * blocks))
    with cxlkv.open_pool(path) as pool:
        kv = pool.kv(model=f"bench-hot-{hot}", block_bytes=bb,
                     hot_bytes=(2 * blocks * bb) if hot else None)
        kv.store(toks, np.random.default_rng(1).integers(0, 256, blocks * bb, dtype=np.uint8))
        out = np.empty(blocks * bb, dtype=np.uint8)
        kv.load_into(toks, out)                       # warm: fills the tier
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            if kv.load_into(toks, out) != blocks:
                raise RuntimeError("hot bench: load_into found fewer blocks than stored")
            times.append(time.perf_counter() - t0)
        kv.drop()
    return blocks * bb / harness.median(times) / 1e9


def run_mode(sync, bb, blocks, rounds):
    with harness.scratch("cxlkv-bench-hot-") as d:
        path = harness.scratch_pool(os.path.join(d, "pool"), max(64 * MiB, 4 * blocks * bb),
                                    chunk_size=1 * MiB, max_nodes=8, lease_ms=2000, sync=sync)
        mgr = None
        if sync == "manager":
            # the manager starts without this process's CXLKV_N* settings
            env = {k: v for k, v in os.environ.items() if not k.startswith("CXLKV_N")}
            mgr = harness.start_lock_manager(path, env=harness.child_env(base=env))
        try:
            res = {}
            for hot in (False, True, False, True):         # interleaved
                res.setdefault(hot, []).append(measure(path, bb, blocks, rounds, hot))
            return {"pool_gbps": max(res[False]), "hot_gbps": max(res[True]),
                    "ratio": max(res[True]) / max(res[False])}
        finally:
            if mgr:
                harness.stop_process(mgr, 30)


def add_arguments(ap) -> None:
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--kib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=20)


def run(args, progress) -> dict:
    bb = args.kib * 1024
    progress("cas")
    out = {"block_bytes": bb, "blocks": args.blocks,
           "cas": run_mode("cas", bb, args.blocks, args.rounds)}
    progress("manager, non-coherent")
    before = os.environ.get("CXLKV_NONCOHERENT")
    os.environ["CXLKV_NONCOHERENT"] = "1"
    try:
        out["manager_noncoherent"] = run_mode("manager", bb, args.blocks, args.rounds)
    finally:
        if before is None:
            del os.environ["CXLKV_NONCOHERENT"]
        else:
            os.environ["CXLKV_NONCOHERENT"] = before
    return out


def render(out: dict) -> str:
    lines = []
    for k in ("cas", "manager_noncoherent"):
        r = out[k]
        lines.append(f"{k:20s} load_into from the pool {r['pool_gbps']:6.2f} GB/s, "
                     f"from the hot tier {r['hot_gbps']:6.2f} GB/s = {r['ratio']:.2f}x")
    return "\n".join(lines)
