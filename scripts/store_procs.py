"""kv.store by K processes into one shared pool, or each into a pool of its own.

    PYTHONPATH=. python scripts/store_procs.py K SECONDS [--separate] [--runs N]

K worker processes (spawned, one node each) store 8 x 16 KiB blocks of
distinct prefixes for SECONDS, all starting at one instant, as `cxlkv bench
--scale --scale-only procs` does; the pools are cas-mode files in /dev/shm
given their memory first (4 GiB in all: with --separate, K pools of 4/K GiB,
so nothing is shared between the processes - no pool lock, no host lock, no
cache line of pool metadata).  Prints stores/s of all processes together,
and per store: CPU (user, sys), page faults, voluntary and involuntary
context switches; and how idle the CPUs were over the window.  Comparing
K=8 with K=2, shared and --separate, tells the cost of sharing a pool apart
from what running four times more processes than cores costs by itself.
SECONDS 0.5 as the bench: at 25-30 K stores/s of 128 KiB the 4 GiB fill
past the low watermark in about a second, and stores then evict.
"""
import argparse
import multiprocessing as mp
import os
import resource
import tempfile
import time

import numpy as np

GiB = 1 << 30
BLOCK, BLOCKS, TOKENS = 16 << 10, 8, 16


def _switches() -> tuple[int, int]:
    v = n = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches"):
                v = int(line.split(":")[1])
            elif line.startswith("nonvoluntary_ctxt_switches"):
                n = int(line.split(":")[1])
    return v, n


def worker(path: str, i: int, t0: float, seconds: float, q) -> None:
    import cxlkv

    with cxlkv.open_pool(path) as pool:
        kv = pool.kv(model="store-procs", block_tokens=TOKENS, block_bytes=BLOCK)
        data = np.frombuffer(np.random.default_rng(i + 1).bytes(BLOCK * BLOCKS), dtype=np.uint8)
        ntok, base = TOKENS * BLOCKS, (i + 1) << 24
        kv.store(np.arange(base, base + ntok, dtype=np.uint32), data)            # warm
        while time.time() < t0:
            time.sleep(0.001)
        v0, n0 = _switches()
        r0, f0 = os.times(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        end, n = t0 + seconds, 1
        while time.time() < end:
            s = base + n * ntok
            kv.store(np.arange(s, s + ntok, dtype=np.uint32), data)
            n += 1
        v1, n1 = _switches()
        r1, f1 = os.times(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        q.put((n - 1, r1.user - r0.user, r1.system - r0.system, f1 - f0, v1 - v0, n1 - n0))


def one_run(k: int, seconds: float, separate: bool, d: str) -> dict:
    from cxlkv.bench import harness
    from cxlkv.ops.init import init_pool

    paths = [os.path.join(d, f"p{i}.pool") for i in range(k if separate else 1)]
    for p in paths:
        init_pool(p, {"size": 4 * GiB // len(paths), "sync": "cas"})
        harness.materialize(p)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    t0 = time.time() + 2.0 + 0.3 * k
    procs = [ctx.Process(target=worker, args=(paths[i % len(paths)], i, t0, seconds, q))
             for i in range(k)]
    for p in procs:
        p.start()
    # the CPUs' idle share over the window (all processes blocked at once:
    # a lock convoy leaves a CPU idle although there is work)
    time.sleep(max(0.0, t0 + 0.05 * seconds - time.time()))
    i0 = _cpu_idle()
    time.sleep(0.9 * seconds)
    i1 = _cpu_idle()
    res = [q.get() for _ in procs]
    for p in procs:
        p.join()
    for p in paths:
        os.unlink(p)
    n = sum(r[0] for r in res)
    per = lambda j, scale=1.0: sum(r[j] for r in res) / n * scale   # noqa: E731
    return {"stores_per_s": n / seconds, "user_us": per(1, 1e6), "sys_us": per(2, 1e6),
            "faults": per(3), "vol_csw": per(4), "invol_csw": per(5),
            "idle": (i1[0] - i0[0]) / max(1, i1[1] - i0[1])}


def _cpu_idle() -> tuple[int, int]:
    """(idle + iowait ticks, all ticks) of all CPUs so far (/proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return v[3] + v[4], sum(v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("k", type=int)
    ap.add_argument("seconds", type=float)
    ap.add_argument("--separate", action="store_true", help="a pool of its own per process")
    ap.add_argument("--runs", type=int, default=1)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="store-procs-") as d:
        for _ in range(a.runs):
            r = one_run(a.k, a.seconds, a.separate, d)
            print(f"K={a.k} {'separate' if a.separate else 'shared'} "
                  f"stores/s={r['stores_per_s']:.0f} per store: user {r['user_us']:.1f} us "
                  f"sys {r['sys_us']:.1f} us faults {r['faults']:.1f} "
                  f"vol csw {r['vol_csw']:.3f} invol csw {r['invol_csw']:.3f} "
                  f"CPUs idle {r['idle']:.1%}", flush=True)


if __name__ == "__main__":
    main()
