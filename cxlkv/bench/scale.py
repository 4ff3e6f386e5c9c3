"""`cxlkv bench --scale`: the rack-scale costs, each figure beside
a baseline measured in the same run, with its target.

Scenarios (each on a scratch pool in /dev/shm, removed after):

full-pool   a pool whose hash table holds `entries` slots, filled past its
            capacity with small blocks (256 B payloads, 64 KiB chunks), then
            stores of 64 blocks that each evict: store p50/p90/p99, and the
            pool-lock wait of another node process sampling pool.lock()
            every millisecond meanwhile.  Baseline of the largest table: the
            smallest table's figures.
procs       kv.store of 8 x 16 KiB blocks and `with pool.lock(): pass` for a
            fixed time in 1, 2, 4, 8 processes (cas mode), and the lock in
            manager mode; baseline of 4 and 8: the best of 1-2 processes.
manager     the lock manager's round trip (acquire + release) p50 with 8
            client processes, and its CPU use while idle (psutil).
attach      cxlkv.open_pool of a 16 GiB pool (a file in the temporary
            directory, on disk): the first call in a fresh interpreter
            (cxlkv and numpy imported, as in an engine; what the call itself
            imports counts), with compiled bytecode (as installed) and
            without (compiled at import); the median of later calls.
recovery    a node process holds `slabs` one-chunk slabs (published 64 KiB
            KV blocks), is killed with SIGKILL, and the next open_pool
            recovers it (cas mode: an attaching node reaps dead nodes of its
            host).  Baseline: the next open_pool, with nothing to recover.

Only public interfaces are used (open_pool, pool.kv, pool.lock(), the lock
manager, kill -9), so the figures stay comparable across implementations.
Worker processes are fresh interpreters started once and reused; a timed
phase starts at one monotonic instant for all of them (after each reported
ready), and each counts what it completed inside the window.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import statistics
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import Connection
from typing import Callable

import numpy as np

import cxlkv
from cxlkv.bench import harness
from cxlkv.daemons.lockmgr import C_IDLE_AFTER_S
from cxlkv.errors import CxlkvError
from cxlkv.kv.cache import drop_namespace, kv_report
from cxlkv.ops.init import init_pool
from cxlkv.state.nodes import read_nodes

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

#: the targets: key -> (comparison, value)
TARGETS = {
    "store_p90_big_vs_small": ("<=", 2.0),
    "lock_wait_p99_big_ms": ("<=", 1.0),
    "store_ops_4_vs_best12": (">=", 0.8),
    "store_ops_8_vs_best12": (">=", 0.8),
    "lock_ops_4_vs_best12": (">=", 0.5),
    "lock_ops_8_vs_best12": (">=", 0.5),
    "manager_rtt_p50_us": ("<=", 20.0),
    "manager_idle_cpu_pct": ("<", 1.0),
    "attach_ms": ("<=", 10.0),
    "recovery_ms": ("<=", 50.0),
}

SCENARIOS = ("full-pool", "procs", "manager", "attach", "recovery")

#: full-pool: block payload, chunk size, blocks per store, tokens per block
FP_BLOCK = 256
FP_CHUNK = 64 * KiB
FP_STORE_BLOCKS = 64
FP_BLOCK_TOKENS = 16
#: procs: kv.store of 8 x 16 KiB blocks
PR_BLOCK = 16 * KiB
PR_BLOCKS = 8


def steps(only=SCENARIOS, entries=(65536, 1 << 20), procs=(1, 2, 4, 8),
          rounds: int = 3) -> list[str]:
    """The steps run() reports through progress(), in order."""
    out = []
    if "full-pool" in only:
        out += [f"full-pool store, {e:,} slots" for e in entries]
    if "procs" in only:
        for r in range(rounds):
            order = procs if r % 2 == 0 else tuple(reversed(procs))
            out += [f"store and lock, {k} processes, round {r + 1} of {rounds}"
                    for k in order]
    if "manager" in only:
        out += ["lock manager"]
    if "attach" in only:
        out += ["attach"]
    if "recovery" in only:
        out += ["recovery"]
    return out


# -- worker processes -------------------------------------------------------------------
class _State:
    def __init__(self, conn):
        self.conn = conn
        self.pool = None

    def close(self):
        if self.pool is not None:
            p, self.pool = self.pool, None
            p.close()


def _until(t0: float) -> None:
    delay = t0 - time.monotonic()
    if delay > 0:
        time.sleep(delay)


def _op_open(st: _State, arg):
    st.close()
    st.pool = cxlkv.open_pool(arg["path"])
    return st.pool.node.slot


def _op_close(st: _State, arg):
    st.close()


def _op_store_loop(st: _State, arg):
    """kv.store of distinct prefixes until the window ends; returns stores done."""
    bb, nb, bt = arg["block_bytes"], arg["blocks"], 16
    kv = st.pool.kv(model=arg["ns"], block_tokens=bt, block_bytes=bb)
    data = np.frombuffer(np.random.default_rng(arg["seed"]).bytes(bb * nb), dtype=np.uint8)
    ntok = bt * nb
    base = arg["seed"] << 24
    kv.store(np.arange(base, base + ntok, dtype=np.uint32), data)       # warm
    _until(arg["t0"])
    end = arg["t0"] + arg["seconds"]
    n = 1
    while time.monotonic() < end:
        s = base + n * ntok
        kv.store(np.arange(s, s + ntok, dtype=np.uint32), data)
        n += 1
    return n - 1


def _op_lock_loop(st: _State, arg):
    """`with pool.lock(): pass` until the window ends: (count, latencies in
    seconds when asked for)."""
    lk = st.pool.lock()
    for _ in range(100):
        with lk:
            pass
    lat = arg.get("latencies")
    clock = time.perf_counter
    _until(arg["t0"])
    end = arg["t0"] + arg["seconds"]
    n = 0
    if lat:
        out = []
        t = clock()
        while True:                         # one at least: a latency even in a tiny window
            with lk:
                pass
            t1 = clock()
            out.append(t1 - t)
            t = t1
            if time.monotonic() >= end:
                break
        return len(out), out
    while time.monotonic() < end:
        for _ in range(16):
            with lk:
                pass
        n += 16
    return n, None


def _op_lock_watch(st: _State, arg):
    """Another node: acquire + release pool.lock() every gap seconds until the
    bench sends anything; returns the waits (seconds)."""
    lk = st.pool.lock()
    gap = arg["gap"]
    waits = []
    st.conn.send(("ok", "watching"))
    while not st.conn.poll(0):
        t = time.perf_counter()
        with lk:
            waits.append(time.perf_counter() - t)
        time.sleep(gap)
    st.conn.recv()
    return waits


def _op_hold_slabs(st: _State, arg):
    """Store `blocks` chunk-sized KV blocks (one one-chunk slab each) and stay."""
    bb = arg["block_bytes"]
    kv = st.pool.kv(model="cxlkv-bench-recovery", block_tokens=16, block_bytes=bb)
    per = 256
    data = np.zeros(bb * per, dtype=np.uint8)
    done = stored = 0
    while done < arg["blocks"]:
        n = min(per, arg["blocks"] - done)
        toks = np.arange(done * 16, (done + n) * 16, dtype=np.uint32) + (1 << 28)
        stored += kv.store(toks, data[:n * bb])
        done += n
    return stored


_OPS = {"open": _op_open, "close": _op_close, "store_loop": _op_store_loop,
        "lock_loop": _op_lock_loop, "lock_watch": _op_lock_watch,
        "hold_slabs": _op_hold_slabs}


def _serve(conn) -> None:
    st = _State(conn)
    try:
        while True:
            op, arg = conn.recv()
            if op == "stop":
                break
            try:
                res = _OPS[op](st, arg)
            except Exception:                       # noqa: BLE001 - reported to the bench
                conn.send(("error", traceback.format_exc()))
            else:
                conn.send(("ok", res))
    finally:
        st.close()


def _child_main(argv: list[str]) -> None:
    """Entry of a worker: python -c ... CTRL_FD."""
    _serve(Connection(int(argv[0])))


class Workers:
    """`n` worker processes (fresh interpreters), each with a control connection."""

    def __init__(self, n: int, timeout: float = 600.0):
        self.timeout = timeout
        self.conn, self.proc = [], []
        env = harness.child_env()
        try:
            for _ in range(n):
                mine, theirs = socket.socketpair()
                try:
                    self.proc.append(subprocess.Popen(
                        [sys.executable, "-c", "import sys; from cxlkv.bench.scale import "
                         "_child_main; _child_main(sys.argv[1:])", str(theirs.fileno())],
                        pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env))
                finally:
                    theirs.close()
                self.conn.append(Connection(mine.detach()))
        except BaseException:
            self.close()
            raise

    def send(self, i: int, op: str, arg=None) -> None:
        self.conn[i].send((op, arg))

    def reply(self, i: int):
        c, p = self.conn[i], self.proc[i]
        deadline = time.monotonic() + self.timeout
        while not c.poll(0.5):
            if p.poll() is not None and not c.poll(0):
                raise RuntimeError(f"bench worker {i} exited (status {p.returncode})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"bench worker {i} did not answer in {self.timeout:.0f} s")
        try:
            status, res = c.recv()
        except EOFError:
            raise RuntimeError(f"bench worker {i} exited (status {p.wait(10)})") from None
        if status == "error":
            raise RuntimeError(f"bench worker {i} failed:\n{res}")
        return res

    def call(self, i: int, op: str, arg=None):
        self.send(i, op, arg)
        return self.reply(i)

    def all(self, k: int, op: str, args: Callable[[int], dict] | dict | None = None) -> list:
        """The same op on workers 0..k-1 at once; their replies in order."""
        for i in range(k):
            self.send(i, op, args(i) if callable(args) else args)
        return [self.reply(i) for i in range(k)]

    def kill(self, i: int) -> None:
        """SIGKILL worker i and wait for it (it is gone when this returns)."""
        self.proc[i].send_signal(signal.SIGKILL)
        self.proc[i].wait(30)

    def close(self) -> None:
        for c, p in zip(self.conn, self.proc):
            if p.poll() is None:
                with contextlib.suppress(Exception):
                    c.send(("stop", None))
        for p in self.proc:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:   # pragma: no cover - a hung worker
                p.kill()
                p.wait(10)
        for c in self.conn:
            c.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# -- scenarios ----------------------------------------------------------------------------
def full_pool(workers: Workers, d: str, entries: int, stores: int) -> dict:
    """Stores of 64 blocks into a pool filled past its table's capacity, each
    evicting, while worker 0 (another node) samples the pool lock."""
    path = os.path.join(d, f"full-{entries}.pool")
    # the table is what fills: data room for every slot plus the watermarks
    size = entries * (L_ENTRY + 2 * FP_BLOCK) + 64 * MiB
    size = -(-size // (4 * MiB)) * (4 * MiB)
    init_pool(path, {"size": size, "chunk_size": FP_CHUNK, "hash_slots": entries})
    try:
        ntok = FP_STORE_BLOCKS * FP_BLOCK_TOKENS
        data = np.frombuffer(np.random.default_rng(3).bytes(FP_BLOCK * FP_STORE_BLOCKS),
                             dtype=np.uint8)
        with cxlkv.open_pool(path) as pool:
            kv = pool.kv(model="cxlkv-bench-scale", block_tokens=FP_BLOCK_TOKENS,
                         block_bytes=FP_BLOCK)
            cap = kv_report(pool)["max_entries"]
            t = time.perf_counter()
            chains = cap // FP_STORE_BLOCKS + 2             # past capacity: the last evict
            for c in range(chains):
                kv.store(np.arange(c * ntok, (c + 1) * ntok, dtype=np.uint32), data)
            fill_s = time.perf_counter() - t
            workers.call(0, "open", {"path": path})
            workers.send(0, "lock_watch", {"gap": 0.001})
            if workers.reply(0) != "watching":
                raise RuntimeError("the lock watcher did not start")
            times = []
            try:
                for s in range(stores):
                    c = chains + s
                    toks = np.arange(c * ntok, (c + 1) * ntok, dtype=np.uint32)
                    t = time.perf_counter()
                    kv.store(toks, data)
                    times.append(time.perf_counter() - t)
                    time.sleep(0.002)                   # let the watcher sample between
            finally:
                workers.send(0, "stop-watching")
                waits = workers.reply(0)
                workers.call(0, "close")
            rep = kv_report(pool)
        ms = [x * 1e3 for x in times]
        wms = [x * 1e3 for x in waits]
        return {"slots": entries, "max_entries": cap, "entries": rep["entries"],
                "evictions": sum(n["evictions"] for n in rep["namespaces"]),
                "fill_s": fill_s, "stores": len(ms),
                "store_p50_ms": harness.pct(ms, 50), "store_p90_ms": harness.pct(ms, 90),
                "store_p99_ms": harness.pct(ms, 99), "lock_waits": len(wms),
                "lock_wait_p50_ms": harness.pct(wms, 50), "lock_wait_p99_ms": harness.pct(wms, 99),
                "lock_wait_max_ms": max(wms) if wms else None}
    finally:
        os.unlink(path)


L_ENTRY = 64        # bytes of one hash table slot (layout.HASH_ENTRY_SIZE)


def _window(workers: Workers, k: int, op: str, arg: Callable[[int], dict],
            seconds: float) -> list:
    t0 = time.monotonic() + 0.1 + 0.02 * k
    return workers.all(k, op, lambda i: dict(arg(i), t0=t0, seconds=seconds))


def _median_rounds(rounds: list[dict]) -> dict:
    """One process count over its rounds: each figure's median, and under
    `rounds` every round's figures."""
    out = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    out["rounds"] = {key: [r[key] for r in rounds] for key in rounds[0]}
    return out


def _manager_quiet(pid: int | None) -> None:
    """Wait until the scratch pool's lock manager has cooled down after its
    last grants (it serves a burst fast, waking every millisecond, for
    C_IDLE_AFTER_S): its CPU share, sampled every 0.1 s, under 1 % of a core
    (idle it takes 0.3 %), for at most C_IDLE_AFTER_S + 1 s (C_IDLE_AFTER_S
    without its pid).  Measured beside its cool-down, 8 processes stored
    0.79-0.82x the best of 1-2; after it 0.85-0.87x, as without manager
    windows at all (0.84-0.86x; 2026-12-07)."""
    if pid is None:
        time.sleep(C_IDLE_AFTER_S)
        return
    end = time.monotonic() + C_IDLE_AFTER_S + 1.0
    while time.monotonic() < end and harness.cpu_pct(pid, 0.1) >= 1.0:
        pass


def procs_round(workers: Workers, paths: dict, k: int, seconds: float,
                manager: bool, mgr_pid: int | None = None) -> dict:
    """One process count: kv.store ops/s and lock ops/s in cas mode, and lock
    ops/s (with latencies) in manager mode when asked (then waits for the lock
    manager to go quiet, so that the next count's windows do not share the
    CPUs with it)."""
    out = {}
    workers.all(k, "open", {"path": paths["cas"]})
    ns = f"cxlkv-bench-scale-{k}"
    counts = _window(workers, k, "store_loop",
                     lambda i: {"ns": ns, "block_bytes": PR_BLOCK, "blocks": PR_BLOCKS,
                                "seed": i + 1}, seconds)
    out["store_ops_per_s"] = sum(counts) / seconds
    res = _window(workers, k, "lock_loop", lambda i: {}, seconds)
    out["lock_ops_per_s"] = sum(n for n, _ in res) / seconds
    workers.all(k, "close")
    with cxlkv.open_pool(paths["cas"]) as pool:
        drop_namespace(pool, ns)
    if manager:
        workers.all(k, "open", {"path": paths["manager"]})
        res = _window(workers, k, "lock_loop", lambda i: {"latencies": True}, seconds)
        workers.all(k, "close")
        lat = [x * 1e6 for _, ls in res for x in ls]
        out["manager_lock_ops_per_s"] = sum(n for n, _ in res) / seconds
        out["manager_rtt_p50_us"] = harness.pct(lat, 50)
        out["manager_rtt_p99_us"] = harness.pct(lat, 99)
        _manager_quiet(mgr_pid)
    return out


_ATTACH_SCRIPT = """
import json, sys, time
import numpy
import cxlkv
t = time.perf_counter()
open_pool = cxlkv.open_pool          # imports cxlkv.api: the stack below it
imports = time.perf_counter() - t
path, n = sys.argv[1], int(sys.argv[2])
t = time.perf_counter()
pool = open_pool(path)
first = time.perf_counter() - t
t = time.perf_counter()
pool.close()
detach = time.perf_counter() - t
more = []
for _ in range(n):
    t = time.perf_counter()
    pool = open_pool(path)
    more.append(time.perf_counter() - t)
    pool.close()
print(json.dumps({"first": first, "detach": detach, "more": more, "imports": imports}))
"""


def _python(script: str, *args, pycache: str | None = None) -> dict:
    """Run `script` in a fresh interpreter; its last stdout line as JSON.
    pycache: a bytecode cache directory it uses and fills (as an installed
    package's compiled bytecode); None: no bytecode is written, so modules
    without it next to their source are compiled at import."""
    env = harness.child_env()
    if pycache is None:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    else:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = pycache
    r = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True,
                       text=True, env=env, timeout=600, stdin=subprocess.DEVNULL)
    if r.returncode:
        raise RuntimeError(f"attach probe failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def attach(size: int, repeat: int = 5, runs: int = 5) -> dict:
    """open_pool of a `size` pool: the first call in a fresh interpreter
    (median of `runs` interpreters), then the later calls in it.

    attach_imports_ms / attach_uncached_imports_ms: the import of cxlkv.api
    (the stack below it), which the first use of cxlkv.open_pool makes and
    attach_ms does not include.
    attach_ms: with compiled bytecode in a cache (as pip installs a package;
    one interpreter fills the cache first, untimed); attach_uncached_ms:
    without, so what the call imports is compiled (a source tree run with
    PYTHONDONTWRITEBYTECODE).  The pool is a file in the temporary directory
    (on disk: a pool file's space is reserved, and /dev/shm would hold all
    of it in memory)."""
    d = tempfile.mkdtemp(prefix="cxlkv-bench-attach-")
    path = os.path.join(d, "attach.pool")
    pyc = os.path.join(d, "pycache")
    t = time.perf_counter()
    try:
        init_pool(path, {"size": size})
        fmt = time.perf_counter() - t
        _python(_ATTACH_SCRIPT, path, 0, pycache=pyc)          # fills the cache
        res = {"attach_size": size, "attach_format_s": fmt}
        for key, cache in (("attach", pyc), ("attach_uncached", None)):
            firsts, mores, detach, imports = [], [], [], []
            for _ in range(runs):
                r = _python(_ATTACH_SCRIPT, path, repeat, pycache=cache)
                firsts.append(r["first"])
                mores += r["more"]
                detach.append(r["detach"])
                imports.append(r["imports"])
            res[f"{key}_ms"] = float(np.median(firsts)) * 1e3
            res[f"{key}_imports_ms"] = float(np.median(imports)) * 1e3
            if cache is not None:
                res["attach_warm_ms"] = float(np.median(mores)) * 1e3
                res["detach_ms"] = float(np.median(detach)) * 1e3
        return res
    finally:
        shutil.rmtree(d, ignore_errors=True)


def recovery(d: str, slabs: int) -> dict:
    """A node holding `slabs` one-chunk slabs is killed; the next open_pool
    reaps it (timed), then one with nothing to recover (the baseline)."""

    path = os.path.join(d, "recovery.pool")
    chunk = 64 * KiB
    size = -(-(slabs * chunk * 9 // 8 + 64 * MiB) // (4 * MiB)) * (4 * MiB)
    init_pool(path, {"size": size, "chunk_size": chunk})
    try:
        with Workers(1) as w:
            slot = w.call(0, "open", {"path": path})
            held = w.call(0, "hold_slabs", {"block_bytes": chunk, "blocks": slabs})
            w.kill(0)
        t = time.perf_counter()
        with cxlkv.open_pool(path) as pool:
            rec = time.perf_counter() - t
            dead = [n for n in read_nodes(pool) if n.slot == slot and n.state != "free"]
        t = time.perf_counter()
        with cxlkv.open_pool(path):
            base = time.perf_counter() - t
        return {"recovery_slabs": held, "recovery_ms": rec * 1e3,
                "recovery_attach_ms": base * 1e3, "recovered": not dead}
    finally:
        os.unlink(path)


# -- the whole run ------------------------------------------------------------------------
def run(progress: Callable[[str], None] = lambda s: None, *, only=SCENARIOS,
        entries=(65536, 1 << 20), procs=(1, 2, 4, 8), stores: int = 40,
        seconds: float = 0.5, attach_size: int = 16 * GiB, slabs: int = 10_000,
        manager: bool = True, idle_seconds: float = 2.0, rounds: int = 3) -> dict:
    """The scenarios in `only`; one dict with stable keys (None and a note
    for what did not run)."""
    out: dict = {"version": cxlkv.__version__, "scale": True, "notes": {},
                 "scenarios": list(only), "procs_rounds": rounds, "procs_seconds": seconds}
    entries = sorted(entries)
    procs = sorted(procs)
    d = harness.scratch_dir()
    try:
        nworkers = max(procs) if "procs" in only or "manager" in only else 1
        with Workers(nworkers if set(only) & {"procs", "manager", "full-pool"} else 0) as w:
            if "full-pool" in only:
                out["full_pool"] = {}
                for e in entries:
                    progress(f"full-pool store, {e:,} slots")
                    out["full_pool"][str(e)] = full_pool(w, d, e, stores)
            if "procs" in only or "manager" in only:
                paths = {"cas": os.path.join(d, "procs-cas.pool"),
                         "manager": os.path.join(d, "procs-manager.pool")}
                init_pool(paths["cas"], {"size": 4 * GiB, "sync": "cas"})
                harness.materialize(paths["cas"])     # no round pays tmpfs first touches
                init_pool(paths["manager"], {"size": 64 * MiB, "sync": "manager",
                                             "chunk_size": MiB})
                with harness.lock_manager(paths["manager"]) as mgr_pid:
                    if "procs" in only:
                        # rounds alternate the order of the counts and each
                        # count keeps its median: a slow second of a shared
                        # machine lands on one round of one count, not on
                        # the figure
                        per = {k: [] for k in procs}
                        for r in range(rounds):
                            order = procs if r % 2 == 0 else list(reversed(procs))
                            for k in order:
                                progress(f"store and lock, {k} processes, "
                                         f"round {r + 1} of {rounds}")
                                per[k].append(procs_round(w, paths, k, seconds, manager,
                                                          mgr_pid))
                        out["procs"] = {str(k): _median_rounds(v) for k, v in per.items()}
                    if "manager" in only:
                        progress("lock manager")
                        k = max(procs)
                        r = out.get("procs", {}).get(str(k))
                        if r is None or "manager_rtt_p50_us" not in r:
                            w.all(k, "open", {"path": paths["manager"]})
                            res = _window(w, k, "lock_loop", lambda i: {"latencies": True},
                                          seconds)
                            w.all(k, "close")
                            lat = [x * 1e6 for _, ls in res for x in ls]
                            r = {"manager_rtt_p50_us": harness.pct(lat, 50),
                                 "manager_rtt_p99_us": harness.pct(lat, 99)}
                        out["manager_clients"] = k
                        out["manager_rtt_p50_us"] = r["manager_rtt_p50_us"]
                        out["manager_rtt_p99_us"] = r["manager_rtt_p99_us"]
                        if mgr_pid is None:
                            out["manager_idle_cpu_pct"] = None
                            out["notes"]["manager_idle_cpu_pct"] = \
                                "a lock manager was already running for the scratch pool"
                        else:
                            with cxlkv.open_pool(paths["manager"]):   # one idle node
                                # the manager spins, then sleeps at most 1 ms for
                                # C_IDLE_AFTER_S after the last grant (so a burst is
                                # served fast), then up to 10 ms: both are reported
                                out["manager_cooldown_cpu_pct"] = harness.cpu_pct(
                                    mgr_pid, C_IDLE_AFTER_S + 0.5)
                                out["manager_idle_cpu_pct"] = harness.cpu_pct(
                                    mgr_pid, idle_seconds)
                for p in paths.values():
                    os.unlink(p)
        if "attach" in only:
            progress("attach")
            try:
                out.update(attach(attach_size))
            except CxlkvError as e:             # no room for the pool file, say
                out["attach_ms"] = None
                out["notes"]["attach_ms"] = str(e)
        if "recovery" in only:
            progress("recovery")
            try:
                out.update(recovery(d, slabs))
            except CxlkvError as e:
                out["recovery_ms"] = None
                out["notes"]["recovery_ms"] = str(e)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    _ratios(out, entries, procs)
    out["targets"] = {k: harness.meets(out.get(k), *t) for k, t in TARGETS.items()}
    return out


def _ratios(out: dict, entries, procs) -> None:
    """The same-run ratios the targets are stated on."""
    fp = out.get("full_pool")
    out["store_p90_big_vs_small"] = out["lock_wait_p99_big_ms"] = None
    if fp and len(entries) >= 2:
        small, big = fp[str(entries[0])], fp[str(entries[-1])]
        out["scale_small_slots"], out["scale_big_slots"] = entries[0], entries[-1]
        out["store_p90_big_vs_small"] = big["store_p90_ms"] / small["store_p90_ms"]
        out["lock_wait_p99_big_ms"] = big["lock_wait_p99_ms"]
    elif fp:
        out["notes"]["store_p90_big_vs_small"] = "one table size only"
    pr = out.get("procs")
    for what in ("store", "lock", "manager_lock"):
        for k in (4, 8):
            key = f"{what}_ops_{k}_vs_best12"
            out[key] = None
            if pr and str(k) in pr and any(str(j) in pr for j in (1, 2)):
                f = f"{what}_ops_per_s"
                base = [pr[str(j)][f] for j in (1, 2) if f in pr.get(str(j), {})]
                if base and f in pr[str(k)]:
                    out[key] = pr[str(k)][f] / max(base)
    for key in TARGETS:
        out.setdefault(key, None)
        if out[key] is None and key not in out["notes"]:
            out["notes"][key] = "not measured in this run (scenario or size not selected)"
