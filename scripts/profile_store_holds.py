"""Hold-time profile of kv.store's two pool-lock holds (reserve, publish).

    PYTHONPATH=. python scripts/profile_store_holds.py K SECONDS [--plain]
    PROF_PERF=out.data ...   also `perf record -e cpu-clock` the workers in the window

K worker processes (spawned, one node each) store 8 x 16 KiB blocks of
distinct prefixes into a fresh 4 GiB cas pool in /dev/shm for SECONDS, as
`cxlkv bench --scale --scale-only procs` does; each records, with
perf_counter_ns, the wait for and the hold of every pool-lock hold, split by
section (wrappers installed in the worker only: a measuring tool, it patches
private methods; each wrapper adds ~0.4 us).  --plain: no section wrappers
(hold and wait only).  Also printed: CPU us per store (getrusage), context
switches per store, the machine's idle share in the window (/proc/stat), GC
passes inside holds and holds over 1 ms (preempted holders).
"""
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from time import perf_counter_ns as ns

import numpy as np


def worker(path, seed, tq, seconds, plain, q):
    import cxlkv
    from cxlkv.kv import cache
    from cxlkv.state import locks, nodes

    rec = defaultdict(list)
    st = {"phase": None, "t_acq": 0, "in": False}

    PL = locks.PoolLock
    oacq, orel = PL.acquire, PL.release

    def acq(self, timeout=None):
        t = ns()
        r = oacq(self, timeout)
        t1 = ns()
        st["t_acq"] = t1
        st["in"] = True
        st["phase"] = "other"
        st["wait"] = t1 - t
        return r

    def rel(self):
        t = ns()
        ph = st["phase"]
        rec["hold." + ph].append(t - st["t_acq"])
        rec["wait." + ph].append(st["wait"])
        st["in"] = False
        orel(self)
        rec["release." + ph].append(ns() - t)

    PL.acquire = PL.__enter__ = acq
    PL.release = rel
    PL.__exit__ = lambda self, *e: rel(self)

    def timed(name, fn, phase=None):
        def w(*a, **k):
            if phase and st["in"]:
                st["phase"] = phase
            t = ns()
            try:
                return fn(*a, **k)
            finally:
                if st["in"]:
                    rec[f"{st['phase']}.{name}"].append(ns() - t)
                else:
                    rec[f"nolock.{name}"].append(ns() - t)
        return w

    import gc
    gcst = {}

    def gccb(phase, info):
        if phase == "start":
            gcst["t"] = ns()
            gcst["in"] = st["in"]
        else:
            d = ns() - gcst.get("t", ns())
            rec[f"gc{info['generation']}.{'inlock' if gcst.get('in') else 'nolock'}"].append(d)
    gc.callbacks.append(gccb)
    pool = cxlkv.open_pool(path)
    if not plain:
        K = cache.KVCache
        K._check_namespace = timed("check_namespace", K._check_namespace, "reserve")
        K._check_tenant = timed("check_tenant", K._check_tenant)
        K._make_room = timed("make_room", K._make_room)
        K._account = timed("account", K._account)
        K._alloc = timed("alloc", K._alloc)
        nodes.Attachment.guard = timed("guard", nodes.Attachment.guard)
    kv = pool.kv(model="prof", block_tokens=16, block_bytes=16384)
    if not plain:
        class MProxy:
            def __init__(self, m):
                self._m = m
                self.kv_insert = timed("kv_insert", m.kv_insert)
                self.kv_set_state = timed("kv_set_state", m.kv_set_state)

            def __getattr__(self, a):
                return getattr(self._m, a)
        kv.m = MProxy(kv.m)
        pool.publish = timed("pool.publish", pool.publish, "publish")
        al = pool.allocator
        if hasattr(al, "publish_guarded"):
            al.publish_guarded = timed("pool.publish", al.publish_guarded, "publish")
        kv.area.journal.append = timed("journal.append", kv.area.journal.append)
    data = np.frombuffer(np.random.default_rng(seed).bytes(16384 * 8), dtype=np.uint8)
    ntok = 128
    base = seed << 24
    kv.store(np.arange(base, base + ntok, dtype=np.uint32), data)
    rec.clear()
    q.put(("ready", seed))
    t0 = tq.get()
    d = t0 - time.monotonic()
    if d > 0:
        time.sleep(d)
    end = t0 + seconds
    n = 1
    store_ns = []
    import resource
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    while time.monotonic() < end:
        s = base + n * ntok
        t = ns()
        kv.store(np.arange(s, s + ntok, dtype=np.uint32), data)
        store_ns.append(ns() - t)
        n += 1
    rec["store"] = store_ns
    for key in [k for k in rec if k.startswith("hold.")]:
        v = np.array(rec[key])
        rec["long." + key + ">1ms"] = list(v[v > 1_000_000])
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    rec["_cpu_s"] = [r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime]
    rec["_sys_s"] = [r1.ru_stime - r0.ru_stime]
    rec["_vcsw"] = [r1.ru_nvcsw - r0.ru_nvcsw]
    rec["_ivcsw"] = [r1.ru_nivcsw - r0.ru_nivcsw]
    pool.close()
    q.put(dict(rec))


def pct(a, p):
    return float(np.percentile(a, p)) / 1000 if len(a) else float("nan")


def main():
    k, seconds = int(sys.argv[1]), float(sys.argv[2])
    plain = "--plain" in sys.argv
    sys.path.insert(0, os.environ.get("PYTHONPATH", "."))
    from cxlkv.ops.init import init_pool
    d = tempfile.mkdtemp(prefix="cxlkv-prof-", dir="/dev/shm")
    path = os.path.join(d, "p.pool")
    try:
        init_pool(path, {"size": 4 << 30, "sync": "cas"})
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        tqs = [ctx.Queue() for _ in range(k)]
        ps = [ctx.Process(target=worker, args=(path, i + 1, tqs[i], seconds, plain, q))
              for i in range(k)]
        for p in ps:
            p.start()
        for _ in ps:                            # a worker that died: queue.Empty, not a hang
            assert q.get(timeout=300)[0] == "ready"
        t0 = time.monotonic() + 0.2
        for tq in tqs:
            tq.put(t0)

        def cpu_idle():
            f = open("/proc/stat").readline().split()[1:]
            v = list(map(int, f))
            return v[3] + v[4], sum(v)
        time.sleep(max(0, t0 - time.monotonic()))
        i0, a0 = cpu_idle()
        time.sleep(seconds)
        i1, a1 = cpu_idle()
        idle_frac = (i1 - i0) / max(1, a1 - a0)
        perf_out = os.environ.get("PROF_PERF")
        if perf_out:
            import subprocess
            time.sleep(max(0, t0 - time.monotonic() + 0.05))
            subprocess.run(["perf", "record", "-q", "-e", "cpu-clock", "-F", "4000", "-g", "-o", perf_out,
                            "-p", ",".join(str(p.pid) for p in ps), "--", "sleep",
                            str(seconds - 0.1)], check=True)
        res = [q.get(timeout=300 + seconds) for _ in ps]
        for p in ps:
            p.join()
    finally:
        shutil.rmtree(d)
    allr = defaultdict(list)
    for r in res:
        for key, v in r.items():
            allr[key] += v
    print(f"K={k} seconds={seconds} stores={len(allr['store'])} "
          f"ops/s={len(allr['store']) / seconds:.0f} load={os.getloadavg()[0]:.2f} machine idle={idle_frac:.1%}")
    ns_ = len(allr['store'])
    print(f"cpu us/store={sum(allr['_cpu_s']) / ns_ * 1e6:.1f} (sys {sum(allr['_sys_s']) / ns_ * 1e6:.1f}) "
          f"cpu share={sum(allr['_cpu_s']) / seconds:.2f} CPUs  vol csw/store={sum(allr['_vcsw']) / ns_:.2f} "
          f"invol csw/store={sum(allr['_ivcsw']) / ns_:.2f}")
    for key in [k for k in allr if k.startswith("_")]:
        del allr[key]
    print(f"{'section':32} {'n':>7} {'p50us':>8} {'p90us':>8} {'p99us':>8} {'mean':>8}")
    for key in sorted(allr):
        v = allr[key]
        print(f"{key:32} {len(v):7d} {pct(v, 50):8.1f} {pct(v, 90):8.1f} {pct(v, 99):8.1f} "
              f"{np.mean(v) / 1000:8.1f}")


if __name__ == "__main__":
    main()
