"""Pool lock and KV store throughput at 1, 2, 4, 8 processes (contention
bounded by hosts, not processes), in sync modes cas and manager.

Every point runs N processes attached to a fresh pool (in /dev/shm), all
started together for --seconds; the figure is the total ops/s.
`lock`: `with pool.lock(): pass`.  `store`: kv.store of 8 x 16 KiB blocks,
new keys every time (the pool is sized so nothing is evicted).

    cxlkv bench run lock-scale [--procs 1,2,4,8] [--modes cas,manager]
                               [--what lock,store] [--seconds 0.5] [--compare] [--json]

--compare measures every point without the host-local lock tier too (its
directory made unusable: the pool lock falls back to tier 1 = process-local
only), interleaved with the figures with it.  Another checkout's `cxlkv bench
run lock-scale` measures that checkout's code.
"""
from __future__ import annotations

import os
import subprocess
import time

import cxlkv
from cxlkv.bench import harness

MiB = harness.MiB
BLOCK = 16 * 1024
BLOCKS = 8

WORKER = r'''
import sys, time
import numpy as np
import cxlkv
path, what, wid, secs = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
pool = cxlkv.open_pool(path)
n = 0
if what == "lock":
    lk = pool.lock()
    with lk:
        pass
    print("ready", flush=True)
    start = float(sys.stdin.readline())
    while time.monotonic() < start:
        time.sleep(0.0005)
    end = start + secs
    while True:
        for _ in range(200):
            with lk:
                pass
        n += 200
        if time.monotonic() >= end:
            break
else:
    kv = pool.kv(model="lock-scale", block_bytes=%d, block_tokens=16)
    data = np.random.default_rng(wid).integers(0, 256, %d * %d, dtype=np.uint8)
    tail = list(range(126))
    kv.store([wid, 1 << 31] + tail, data)
    print("ready", flush=True)
    start = float(sys.stdin.readline())
    while time.monotonic() < start:
        time.sleep(0.0005)
    end = start + secs
    while time.monotonic() < end:
        kv.store([wid, n] + tail, data)          # a new first block: all 8 new
        n += 1
t = time.monotonic() - start
print(n, t, flush=True)
pool.close()
''' % (BLOCK, BLOCKS, BLOCK)


#: a directory no host lock file can be made in: the pool lock then runs
#: without its host-local tier (tier 1 process-local only: the code before it)
NO_HOST_TIER = {"CXLKV_HOSTLOCK_DIR": "/dev/null/no-host-tier"}


def point(mode: str, what: str, procs: int, secs: float, env: dict | None = None) -> float:
    with harness.scratch("lock-scale-") as d:
        # store: room for every block stored (no eviction in the figure)
        size = 64 * MiB if what == "lock" else 1536 * MiB
        path = harness.scratch_pool(os.path.join(d, "p.pool"), size, chunk_size=1 * MiB,
                                    max_nodes=16, sync=mode)
        mgr = harness.start_lock_manager(path) if mode == "manager" else None
        try:
            return _point(path, what, procs, secs, env)
        finally:
            if mgr is not None:
                harness.stop_process(mgr)


def _point(path: str, what: str, procs: int, secs: float, env: dict | None) -> float:
    ws = [harness.python(WORKER, path, what, i, secs, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL if env else None,
                         text=True, env=harness.child_env(env))
          for i in range(procs)]
    try:
        for w in ws:                                  # all attached and warm
            if w.stdout.readline().strip() != "ready":
                raise RuntimeError("lock-scale: a worker did not start")
        start = time.monotonic() + 0.1
        for w in ws:
            w.stdin.write(f"{start}\n")
            w.stdin.flush()
        total = 0.0
        for w in ws:
            out, _ = w.communicate(timeout=120)
            n, t = out.split()
            total += int(n) / float(t)
        return total
    finally:
        for w in ws:
            if w.poll() is None:
                w.kill()
                w.wait()


def add_arguments(ap) -> None:
    ap.add_argument("--procs", default="1,2,4,8")
    ap.add_argument("--modes", default="cas,manager")
    ap.add_argument("--what", default="lock,store")
    ap.add_argument("--seconds", type=float, default=0.5)
    ap.add_argument("--compare", action="store_true",
                    help="each point without the host-local tier (off), then with it (on)")


def run(a, progress) -> dict:
    procs = [int(x) for x in a.procs.split(",")]
    res = {"cxlkv": os.path.dirname(cxlkv.__file__), "load": os.getloadavg()[0]}
    variants = [("off", NO_HOST_TIER), ("on", None)] if a.compare else [("", None)]
    for mode in a.modes.split(","):
        for what in a.what.split(","):
            rows = {v: {} for v, _ in variants}
            for p in procs:                 # interleaved: the machine's load drifts
                for v, env in variants:
                    progress(f"{mode} {what} {p} processes" + (f" host tier {v}" if v else ""))
                    rows[v][p] = point(mode, what, p, a.seconds, env)
            for v, row in rows.items():
                best = max(row.get(1, 0), row.get(2, 0))
                key = f"{mode}_{what}" + (f"_host_tier_{v}" if v else "")
                res[key] = {"ops_s": row,
                            "ratio_4": row.get(4, 0) / best if best else None,
                            "ratio_8": row.get(8, 0) / best if best else None}
    res["load_after"] = os.getloadavg()[0]
    return res


def render(res: dict) -> str:
    lines = []
    for key, r in res.items():
        if not isinstance(r, dict):
            continue
        row = r["ops_s"]
        best = max(row.get(1, 0), row.get(2, 0))
        mode, what, *tier = key.split("_", 2)
        v = tier[0].rsplit("_", 1)[-1] if tier else ""
        lines.append(f"{mode:8s} {what:6s} {v:3s} " + "  ".join(
            f"{p}: {x:>10,.0f}" for p, x in row.items()) +
            (f"   4/best12 {row.get(4, 0) / best:.2f}  8/best12 "
             f"{row.get(8, 0) / best:.2f}" if best else ""))
    lines.append(f"load average {res['load']:.1f} before, {res['load_after']:.1f} after")
    return "\n".join(lines)
