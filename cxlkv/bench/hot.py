"""DRAM hot tier figures (issue 8 item 3): `load_into` of a hot working set
with and without the tier, same run, in both sync modes (manager mode under
the non-coherence emulation: every pool read invalidates its cache lines
first, as on non-coherent CXL memory, which the DRAM copies skip).

    .venv/bin/python bench/hot.py [--blocks N] [--kib K] [--rounds R] [--json]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import cxlkv
from cxlkv.pool.admin import init_pool

MiB = 1 << 20


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
            assert kv.load_into(toks, out) == blocks
            times.append(time.perf_counter() - t0)
        kv.drop()
    return blocks * bb / statistics.median(times) / 1e9


def run_mode(sync, bb, blocks, rounds):
    d = tempfile.mkdtemp(prefix="cxlkv-bench-hot-", dir="/dev/shm")
    path = os.path.join(d, "pool")
    init_pool(path, {"size": max(64 * MiB, 4 * blocks * bb), "chunk_size": 1 * MiB,
                     "max_nodes": 8, "lease_ms": 2000, "sync": sync})
    mgr = None
    if sync == "manager":
        env = {k: v for k, v in os.environ.items() if not k.startswith("CXLKV_N")}
        mgr = subprocess.Popen([sys.executable, "-m", "cxlkv", "lock-manager", "--pool", path],
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        res = {}
        for hot in (False, True, False, True):         # interleaved
            res.setdefault(hot, []).append(measure(path, bb, blocks, rounds, hot))
        return {"pool_gbps": max(res[False]), "hot_gbps": max(res[True]),
                "ratio": max(res[True]) / max(res[False])}
    finally:
        if mgr:
            mgr.terminate()
            mgr.wait(30)
        os.unlink(path)
        os.rmdir(d)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--kib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    bb = a.kib * 1024
    out = {"block_bytes": bb, "blocks": a.blocks,
           "cas": run_mode("cas", bb, a.blocks, a.rounds)}
    os.environ["CXLKV_NONCOHERENT"] = "1"
    out["manager_noncoherent"] = run_mode("manager", bb, a.blocks, a.rounds)
    if a.json:
        print(json.dumps(out, indent=2))
    else:
        for k in ("cas", "manager_noncoherent"):
            r = out[k]
            print(f"{k:20s} load_into from the pool {r['pool_gbps']:6.2f} GB/s, "
                  f"from the hot tier {r['hot_gbps']:6.2f} GB/s = {r['ratio']:.2f}x")


if __name__ == "__main__":
    main()
