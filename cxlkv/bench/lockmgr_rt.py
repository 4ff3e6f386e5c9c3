"""Lock manager figures: pool-lock round trip (acquire + release)
in sync mode manager, and the lock manager's CPU when idle.

Cases, same run: 1 client; 8 client processes each taking the lock with a
sleep between (`--think`, default 1 ms: the lock is mostly free, 8 clients
running); 8 clients back to back (contended: the figure includes waiting for
the others' turns).  Idle CPU: the manager process's psutil cpu_percent over
`--idle` seconds with no node attached, and with 8 attached idle nodes.

    cxlkv bench run lockmgr-rt [--seconds S] [--idle S] [--json]

Another checkout's `cxlkv bench run lockmgr-rt` measures that checkout's code.
CXLKV_LOCKMGR_PY=1 runs the manager's Python reference loop instead of the C
one (where the C one exists).
"""
from __future__ import annotations

import os
import subprocess
import time

import numpy as np
import psutil

import cxlkv
from cxlkv import _core
from cxlkv.bench import harness

MiB = harness.MiB

CLIENT = r'''
import sys, time, numpy as np, cxlkv
path, seconds, think, out = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
pool = cxlkv.open_pool(path)
lock = pool.lock()
for _ in range(200):                       # warm up
    with lock:
        pass
print("ready", flush=True)
sys.stdin.readline()
lat = []
end = time.monotonic() + seconds
pc = time.perf_counter
while time.monotonic() < end:
    t0 = pc()
    with lock:
        pass
    lat.append(pc() - t0)
    if think:
        time.sleep(think)                  # other work (on the GPU) between round trips
np.save(out, np.array(lat))
pool.close()
'''


def clients(path, n, seconds, think, tmp):
    outs = [os.path.join(tmp, f"lat{i}.npy") for i in range(n)]
    procs = [harness.python(CLIENT, path, seconds, think, o, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True) for o in outs]
    for p in procs:
        if p.stdout.readline().strip() != "ready":
            raise RuntimeError("lockmgr-rt: a client did not start")
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    for p in procs:
        if p.wait(seconds + 60) != 0:
            raise RuntimeError(f"lockmgr-rt: a client exited with status {p.returncode}")
    lat = np.concatenate([np.load(o) for o in outs]) * 1e6
    return {"clients": n, "think_ms": think * 1e3, "ops": int(len(lat)),
            "ops_per_s": round(len(lat) / seconds), "p50_us": round(harness.pct(lat, 50), 1),
            "p90_us": round(harness.pct(lat, 90), 1),
            "p99_us": round(harness.pct(lat, 99), 1)}


IDLE_NODE = r'''
import sys, cxlkv
pool = cxlkv.open_pool(sys.argv[1])
print("ready", flush=True)
sys.stdin.readline()
pool.close()
'''


def idle_cpu(mgr, seconds, path=None, nodes=0):
    procs = [harness.python(IDLE_NODE, path, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True) for _ in range(nodes)]
    try:
        for p in procs:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("lockmgr-rt: an idle node did not start")
        time.sleep(2.0)          # past the attaches (activity keeps a manager awake a while)
        ps = psutil.Process(mgr.pid)
        ps.cpu_percent()
        run0, t0 = harness.cpu_seconds(mgr.pid), time.monotonic()
        time.sleep(seconds)
        pct = ps.cpu_percent()
        # /proc/PID/schedstat: ns on a CPU (all threads), exact where psutil
        # counts clock ticks
        ran = (harness.cpu_seconds(mgr.pid) - run0) / (time.monotonic() - t0) * 100
        return {"psutil_pct": round(pct, 2), "schedstat_pct": round(ran, 3)}
    finally:
        for p in procs:
            p.stdin.write("\n")
            p.stdin.flush()
            p.wait(30)


def add_arguments(ap) -> None:
    ap.add_argument("--seconds", type=float, default=3.0, help="per round-trip case")
    ap.add_argument("--idle", type=float, default=3.0, help="seconds of idle CPU sampling")
    ap.add_argument("--think", type=float, default=0.001, help="pause between round trips (s)")
    ap.add_argument("--max-nodes", type=int, default=128)


def run(args, progress) -> dict:
    doc = {"cxlkv": os.path.dirname(cxlkv.__file__), "cpus": os.cpu_count(),
           "c_loop": hasattr(_core.Mapping, "mgr_loop"),
           "loadavg_start": os.getloadavg()[0],
           "loop": "python" if os.environ.get("CXLKV_LOCKMGR_PY") == "1" else "default",
           "noncoherent": os.environ.get("CXLKV_NONCOHERENT") == "1"}
    with harness.scratch("cxlkv-bench-lockmgr-") as tmp:
        path = harness.scratch_pool(os.path.join(tmp, "pool"), 64 * MiB, sync="manager",
                                    max_nodes=args.max_nodes)
        mgr = harness.start_lock_manager(path)
        try:
            progress("idle CPU")
            doc["idle_cpu_pct"] = idle_cpu(mgr, args.idle)
            progress("idle CPU, 8 nodes")
            doc["idle_cpu_pct_8_nodes"] = idle_cpu(mgr, args.idle, path, 8)
            progress("round trips")
            doc["rt"] = [clients(path, 1, args.seconds, 0.0, tmp),
                         clients(path, 8, args.seconds, args.think, tmp),
                         clients(path, 8, args.seconds, 0.0, tmp)]
        finally:
            harness.stop_process(mgr)
    doc["loadavg_end"] = os.getloadavg()[0]
    return doc


def render(doc: dict) -> str:
    lines = [f"cxlkv at {doc['cxlkv']} ({doc['loop']} loop, C loop built: {doc['c_loop']}), "
             f"{doc['cpus']} CPUs, load avg {doc['loadavg_start']:.2f} -> "
             f"{doc['loadavg_end']:.2f}"]
    for k, what in (("idle_cpu_pct", "no nodes"),
                    ("idle_cpu_pct_8_nodes", "8 idle nodes attached")):
        lines.append(f"idle manager CPU ({what}): {doc[k]['schedstat_pct']} % (schedstat), "
                     f"{doc[k]['psutil_pct']} % (psutil cpu_percent)")
    for r in doc["rt"]:
        lines.append(f"round trip, {r['clients']} client(s), pause {r['think_ms']:g} ms: "
                     f"p50 {r['p50_us']} us  p90 {r['p90_us']} us  p99 {r['p99_us']} us  "
                     f"({r['ops_per_s']} ops/s)")
    return "\n".join(lines)
