"""`cxlkv bench`: what the pool gives, each figure beside a baseline measured
in the same run (these machines are shared and noisy; ratios are what count).

Scenarios run on scratch pools made for the run (in /dev/shm) and removed
after; with pool_path the KV scenarios run on that pool instead, in a
namespace of their own that is dropped after.  Each returns its figures;
`run()` collects them into one dict with stable keys.  A scenario that
cannot run reports None and the reason (in "notes").

The handoff scenarios move one prefix's KV (64 MiB in 256 KiB blocks) from a
producer process to a consumer process: through the pool (kv.store, then
kv.match + kv.load_into), through a plain /dev/shm mapping (numpy copies in
and out), over a loopback TCP stream, and through a redis-server started for
the run.  Both processes are started once (spawn) and serve every kind; each
transfer is timed from the producer's start to the consumer's finish on the
system-wide monotonic clock.
"""
from __future__ import annotations

import contextlib
import os
import select
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Callable

import numpy as np

from cxlkv.errors import RefusedError

MiB = 1 << 20
KiB = 1 << 10

#: the KV scenarios' shape: one prefix of 64 MiB in 256 KiB blocks of 16 tokens
KV_TOTAL = 64 * MiB
KV_BLOCK = 256 * KiB
KV_BLOCK_TOKENS = 16
#: lookup: 32768 tokens = 2048 blocks of 16, small blocks
LOOKUP_TOKENS = 32768
LOOKUP_BLOCK = 4096

#: the targets the issues set (figure -> (comparison, value))
TARGETS = {
    "lock_cas_us": ("<=", 1.0),
    "lock_manager_us": ("<=", 50.0),
    "alloc_ops_per_s": (">=", 2_000_000),
    "alloc_utilisation": (">=", 0.92),
    "put_vs_memcpy": (">=", 0.8),
    "get_vs_memcpy": (">=", 0.8),
    "handoff_vs_tcp": (">=", 4.0),
    "handoff_vs_redis": (">=", 15.0),
    "handoff_vs_shm": (">=", 1.0),
    "lookup_32k_ms": ("<=", 2.0),
}

#: the steps run() reports through progress(), in order (the CLI's progress bar)
STEPS = ("memcpy baseline", "pool writes and reads", "cas lock", "alloc + free",
         "manager lock", "kv in manager mode", "utilisation trace", "kv put and get",
         "kv lookup of 32K tokens",
         "handoff through the pool", "handoff through /dev/shm", "handoff over TCP",
         "handoff through redis")


class BenchRefused(RefusedError):
    """The pool given with --pool lacks room for the bench (it never evicts)."""

    kind = "bench-no-room"


class Unavailable(Exception):
    """A baseline that cannot run here (reported as None with this reason)."""


def _scratch_dir() -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return tempfile.mkdtemp(prefix="cxlkv-bench-", dir=base)


def _median(fn: Callable[[], float], repeat: int = 5) -> float:
    return statistics.median(fn() for _ in range(repeat))


def buffer(nbytes: int, seed: int | None = None) -> np.ndarray:
    """A 4 KiB-aligned uint8 array, touched: zeros, or seeded random bytes."""
    raw = np.empty(nbytes + 4096, dtype=np.uint8)
    off = (-raw.ctypes.data) % 4096
    a = raw[off:off + nbytes]
    if seed is None:
        a.fill(0)
    else:
        a[:] = np.frombuffer(np.random.default_rng(seed).bytes(nbytes), dtype=np.uint8)
    return a


def memcpy_gbps(total: int = 64 * MiB, block: int = 256 * 1024) -> float:
    """Baseline: numpy copies of `total` bytes in `block` pieces between touched,
    4 KiB-aligned buffers."""
    src = buffer(total, seed=0)
    dst = buffer(total)

    def once():
        t = time.perf_counter()
        for off in range(0, total, block):
            dst[off:off + block] = src[off:off + block]
        return total / (time.perf_counter() - t) / 1e9

    return _median(once)


def pool_copy_gbps(pool, total: int = 64 * MiB, block: int = 256 * 1024) -> tuple[float, float]:
    """Writes (non-temporal, flushed) and reads of `block` pieces through the C core."""
    offs = pool.alloc_batch(block, total // block, zero=False)
    try:
        src = np.random.default_rng(1).integers(0, 256, block, dtype=np.uint8)
        dst = np.empty(block, dtype=np.uint8)
        m = pool.mapping
        for o in offs.tolist():          # prefault the pool pages once
            m.write(o, src)

        def w():
            t = time.perf_counter()
            for o in offs.tolist():
                m.write(o, src)
            return total / (time.perf_counter() - t) / 1e9

        def r():
            t = time.perf_counter()
            for o in offs.tolist():
                m.readinto(o, dst)
            return total / (time.perf_counter() - t) / 1e9

        return _median(w), _median(r)
    finally:
        pool.free_batch(offs, zero=False)


def lock_us(pool, n: int = 100_000) -> float:
    """Uncontended acquire + release of pool.lock(), through the public API."""
    lk = pool.lock()
    for _ in range(1000):
        with lk:
            pass

    def once():
        t = time.perf_counter()
        for _ in range(n):
            with lk:
                pass
        return (time.perf_counter() - t) / n * 1e6

    return _median(once)


def alloc_ops(pool, nbytes: int = 4096, batch: int = 256, rounds: int = 2000) -> float:
    """alloc + free pairs per second, batch forms, no zeroing (the caller overwrites)."""
    pool.free_batch(pool.alloc_batch(nbytes, batch, zero=False), zero=False)

    def once():
        t = time.perf_counter()
        for _ in range(rounds):
            pool.free_batch(pool.alloc_batch(nbytes, batch, zero=False), zero=False)
        return rounds * batch / (time.perf_counter() - t)

    return _median(once)


# -- KV scenarios -------------------------------------------------------------------------
def tokens(rep: int, ntokens: int, base: int = 0) -> np.ndarray:
    """Token ids distinct for every `rep` (so every store really writes)."""
    start = base + rep * ntokens
    return np.arange(start, start + ntokens, dtype=np.uint32)


def drop(pool, name: str) -> None:
    """Drop namespace `name` if it exists (its blocks only; never others')."""
    from cxlkv.errors import UsageError
    from cxlkv.kv.cache import drop_namespace

    try:
        drop_namespace(pool, name)
    except UsageError:
        pass                                            # not there: nothing to drop


def check_room(pool, block_bytes: int, blocks: int) -> None:
    """Refuse (BenchRefused) unless `blocks` blocks of `block_bytes` fit in the
    pool with a margin, without the store evicting anything: free chunks for
    the slots, KV usage staying above the low watermark, free hash entries."""
    from cxlkv.kv.area import LOW_WATERMARK, Area
    from cxlkv.state import alloc as A

    a = Area(pool)
    h = a.header()
    size = a.data_size()
    chunk = pool.sb.chunk_size
    need = blocks * A.slot_size_for(pool, block_bytes)
    margin = max(4 * chunk, need // 8)
    free_chunks = int(np.count_nonzero(~A.bitmap(pool))) * chunk
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
    from cxlkv.state.nodes import read_nodes

    free = sum(1 for n in read_nodes(pool, include_free=True) if n.state == "free")
    if free < more:
        raise BenchRefused(
            f"{pool.path}: the bench's handoff needs {more} free node slots and "
            f"{free} {'is' if free == 1 else 'are'} free (max nodes {pool.sb.max_nodes})",
            path=pool.path, hint="detach idle nodes, or run `cxlkv bench` without --pool")


def kv_put_get(pool, ns: str, total: int = KV_TOTAL, block: int = KV_BLOCK, reps: int = 5,
               guard: Callable[[int, int], None] | None = None) -> tuple[float, float]:
    """kv.store of `total` bytes in `block` blocks (fresh tokens every rep) and
    kv.load_into of them into a touched 4 KiB-aligned buffer: (put, get) GB/s,
    medians.  The namespace is dropped between reps (outside the timing); the
    first rep warms the pool pages and checks the bytes."""
    n = total // block
    src = buffer(total, seed=2)
    out = buffer(total)
    puts, gets = [], []
    try:
        for rep in range(reps + 1):
            drop(pool, ns)
            if guard:
                guard(block, n)
            kv = pool.kv(model=ns, block_tokens=KV_BLOCK_TOKENS, block_bytes=block)
            toks = tokens(rep, n * KV_BLOCK_TOKENS)
            t0 = time.perf_counter()
            stored = kv.store(toks, src)
            t1 = time.perf_counter()
            got = kv.load_into(toks, out)
            t2 = time.perf_counter()
            if stored != n or got != n:
                raise RuntimeError(f"kv bench: stored {stored} and loaded {got} of {n} blocks")
            if rep == 0:
                if not np.array_equal(out, src):
                    raise RuntimeError("kv bench: load_into gave other bytes than stored")
                continue
            puts.append(total / (t1 - t0) / 1e9)
            gets.append(total / (t2 - t1) / 1e9)
    finally:
        drop(pool, ns)
    return statistics.median(puts), statistics.median(gets)


def kv_lookup_ms(pool, ns: str, ntokens: int = LOOKUP_TOKENS, block: int = LOOKUP_BLOCK,
                 repeat: int = 50, guard: Callable[[int, int], None] | None = None
                 ) -> tuple[float, float]:
    """kv.match of `ntokens` tokens, every block present, hashing included:
    median milliseconds with the tokens as a uint32 array, and as a Python
    list of ints (what most callers hold)."""
    n = ntokens // KV_BLOCK_TOKENS
    drop(pool, ns)
    if guard:
        guard(block, n)
    try:
        kv = pool.kv(model=ns, block_tokens=KV_BLOCK_TOKENS, block_bytes=block)
        toks = tokens(0, ntokens)
        if kv.store(toks, buffer(n * block, seed=3)) != n:
            raise RuntimeError("kv bench: the lookup prefix was not stored whole")
        lst = toks.tolist()
        res = []
        for arg in (toks, lst):
            for _ in range(3):
                kv.match(arg)
            ts = []
            for _ in range(repeat):
                t = time.perf_counter()
                m = kv.match(arg)
                ts.append(time.perf_counter() - t)
                if m != ntokens:
                    raise RuntimeError(f"kv bench: match found {m} of {ntokens} tokens")
            res.append(statistics.median(ts) * 1e3)
        return res[0], res[1]
    finally:
        drop(pool, ns)


# -- handoff: a producer and a consumer process -------------------------------------------
class _Side:
    """One side (producer or consumer) of one handoff kind, in a worker process.

    run() returns perf_counter marks: the producer's "start" and "sent" (its
    work done, before it notifies), the consumer's "woke", "matched" and
    "done"."""

    info = None
    stream = False                      # the data itself wakes the consumer (TCP)

    def __init__(self, role: str, cfg: dict, peer):
        self.role, self.cfg, self.peer = role, cfg, peer
        self.total, self.block = cfg["total"], cfg["block"]
        self.buf = buffer(self.total, seed=cfg["seed"]) if role == "producer" \
            else buffer(self.total)

    def connect(self, info) -> None:
        pass

    def prep(self, rep: int) -> None:
        pass

    def run(self, rep: int) -> dict:
        now = time.perf_counter
        if self.role == "producer":
            t0 = now()
            self.produce()
            sent = now()
            if not self.stream:
                self.peer.send_bytes(b"1")
            return {"start": t0, "sent": sent}
        if not self.stream:
            self.peer.recv_bytes()
        woke = now()
        matched = self.consume() or woke
        return {"woke": woke, "matched": matched, "done": now()}

    def produce(self) -> None:
        raise NotImplementedError

    def consume(self) -> float | None:
        """Copy the data in; returns when the lookup ended (if there is one)."""
        raise NotImplementedError

    def check(self) -> bool:
        return bool(np.array_equal(self.buf, buffer(self.total, seed=self.cfg["seed"])))

    def close(self) -> None:
        pass


class _KVSide(_Side):
    """kv.store by the producer; kv.match + kv.load_into by the consumer."""

    def __init__(self, role, cfg, peer):
        import cxlkv

        super().__init__(role, cfg, peer)
        self.n = self.total // self.block
        self.pool = cxlkv.open_pool(cfg["path"])
        self.kv = None

    def prep(self, rep):
        self.kv = self.pool.kv(model=self.cfg["ns"], block_tokens=KV_BLOCK_TOKENS,
                               block_bytes=self.block)
        self.toks = tokens(rep, self.n * KV_BLOCK_TOKENS)

    def produce(self):
        stored = self.kv.store(self.toks, self.buf)
        if stored != self.n:
            raise RuntimeError(f"handoff: stored {stored} of {self.n} blocks")

    def consume(self):
        matched = self.kv.match(self.toks)
        t = time.perf_counter()
        got = self.kv.load_into(self.toks, self.buf)
        if matched != len(self.toks) or got != self.n:
            raise RuntimeError(f"handoff: matched {matched} tokens, loaded {got} of {self.n} "
                               "blocks")
        return t

    def close(self):
        try:
            if self.role == "producer":
                drop(self.pool, self.cfg["ns"])
        finally:
            self.pool.close()


class _ShmSide(_Side):
    """numpy copies in `block` pieces into and out of a shared /dev/shm mapping."""

    def __init__(self, role, cfg, peer):
        import mmap

        super().__init__(role, cfg, peer)
        fd = os.open(cfg["path"], os.O_RDWR)
        try:
            self.mm = mmap.mmap(fd, self.total)
        finally:
            os.close(fd)
        self.shared = np.frombuffer(self.mm, dtype=np.uint8)

    def produce(self):
        b, src, dst = self.block, self.buf, self.shared
        for off in range(0, self.total, b):
            dst[off:off + b] = src[off:off + b]

    def consume(self):
        b, src, dst = self.block, self.shared, self.buf
        for off in range(0, self.total, b):
            dst[off:off + b] = src[off:off + b]

    def close(self):
        del self.shared
        self.mm.close()


class _TcpSide(_Side):
    """One loopback TCP stream; the consumer receives into its buffer (recv_into)."""

    stream = True

    def __init__(self, role, cfg, peer):
        super().__init__(role, cfg, peer)
        self.sock = None
        self.listener = None
        if role == "consumer":
            self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self.listener.bind(("127.0.0.1", 0))
            self.listener.listen(1)
            self.info = self.listener.getsockname()[1]

    def connect(self, port):
        if self.role == "producer":
            self.sock = socket.create_connection(("127.0.0.1", port))

    def prep(self, rep):
        if self.role == "consumer" and self.sock is None:
            self.sock, _ = self.listener.accept()
            self.listener.close()
            self.listener = None

    def produce(self):
        mv, b = memoryview(self.buf), self.block
        for off in range(0, self.total, b):
            self.sock.sendall(mv[off:off + b])

    def consume(self):
        mv, got = memoryview(self.buf), 0
        while got < self.total:
            k = self.sock.recv_into(mv[got:])
            if not k:
                raise RuntimeError("handoff: the TCP producer closed the stream")
            got += k

    def close(self):
        for s in (self.sock, self.listener):
            if s is not None:
                s.close()


class _RedisSide(_Side):
    """Pipelined SETs of the blocks (producer), pipelined GETs into the buffer (consumer)."""

    def __init__(self, role, cfg, peer):
        import redis

        super().__init__(role, cfg, peer)
        self.r = redis.Redis(host="127.0.0.1", port=cfg["port"])
        self.keys = [f"cxlkv-bench:{i}" for i in range(self.total // self.block)]

    def prep(self, rep):
        if self.role == "producer":
            self.r.flushall()

    def produce(self):
        p = self.r.pipeline(transaction=False)
        mv, b = memoryview(self.buf), self.block
        for i, k in enumerate(self.keys):
            p.set(k, mv[i * b:(i + 1) * b])
        p.execute()

    def consume(self):
        p = self.r.pipeline(transaction=False)
        for k in self.keys:
            p.get(k)
        b, dst = self.block, self.buf
        for i, v in enumerate(p.execute()):
            if v is None or len(v) != b:
                raise RuntimeError(f"handoff: redis returned {None if v is None else len(v)} "
                                   f"bytes for block {i}")
            dst[i * b:(i + 1) * b] = np.frombuffer(v, dtype=np.uint8)

    def close(self):
        self.r.close()


_SIDES = {"kv": _KVSide, "shm": _ShmSide, "tcp": _TcpSide, "redis": _RedisSide}


def _worker(role: str, ctrl, peer) -> None:
    """A handoff process: serves (op, arg) requests from the bench until "stop"."""
    side = None
    try:
        while True:
            op, arg = ctrl.recv()
            if op == "stop":
                break
            if op == "setup":
                side = _SIDES[arg["kind"]](role, arg, peer)
                res = side.info
            elif op == "close":
                s, side = side, None
                res = s.close()
            else:                                   # connect, prep, run, check
                res = getattr(side, op)(arg) if op != "check" else side.check()
            ctrl.send(("ok", res))
    except BaseException:                           # noqa: BLE001 - reported to the bench
        with contextlib.suppress(Exception):
            ctrl.send(("error", traceback.format_exc()))
    finally:
        if side is not None:
            with contextlib.suppress(Exception):
                side.close()


def _child_main(argv: list[str]) -> None:
    """Entry of a handoff process: python -c ... ROLE CTRL_FD PEER_FD."""
    from multiprocessing.connection import Connection

    role, ctrl, peer = argv[0], int(argv[1]), int(argv[2])
    _worker(role, Connection(ctrl), Connection(peer, readable=role == "consumer",
                                               writable=role == "producer"))


class HandoffPair:
    """The producer and consumer processes (fresh interpreters, so no pool
    state or threads are inherited), each with a control connection to the
    bench, and a pipe from producer to consumer for the notification."""

    def __init__(self, timeout: float = 300.0):
        from multiprocessing.connection import Connection

        import cxlkv

        self.timeout = timeout
        self.conn, self.proc = {}, {}
        env = dict(os.environ)
        top = os.path.dirname(os.path.dirname(os.path.abspath(cxlkv.__file__)))
        env["PYTHONPATH"] = os.pathsep.join([top] + [p for p in
                                                     env.get("PYTHONPATH", "").split(os.pathsep)
                                                     if p])
        rd, wr = os.pipe()
        try:
            for role, peer in (("consumer", rd), ("producer", wr)):
                mine, theirs = socket.socketpair()
                try:
                    self.proc[role] = subprocess.Popen(
                        [sys.executable, "-c", "import sys; from cxlkv.benchmarks import "
                         "_child_main; _child_main(sys.argv[1:])", role,
                         str(theirs.fileno()), str(peer)],
                        pass_fds=(theirs.fileno(), peer), stdin=subprocess.DEVNULL, env=env)
                finally:
                    theirs.close()
                self.conn[role] = Connection(mine.detach())
        except BaseException:
            self.close()
            raise
        finally:
            os.close(rd)           # a side that dies leaves its peer an EOF, not a hang
            os.close(wr)

    def send(self, role: str, op: str, arg=None) -> None:
        self.conn[role].send((op, arg))

    def alive(self, role: str) -> bool:
        return self.proc[role].poll() is None

    def reply(self, role: str):
        c, p = self.conn[role], self.proc[role]
        deadline = time.monotonic() + self.timeout
        while not c.poll(1.0):
            if p.poll() is not None and not c.poll(0):
                raise RuntimeError(f"the handoff {role} exited (status {p.returncode})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the handoff {role} did not answer in {self.timeout:.0f} s")
        try:
            status, res = c.recv()
        except EOFError:
            raise RuntimeError(f"the handoff {role} exited (status {p.wait(10)})") from None
        if status == "error":
            raise RuntimeError(f"the handoff {role} failed:\n{res}")
        return res

    def call(self, role: str, op: str, arg=None):
        self.send(role, op, arg)
        return self.reply(role)

    def close(self) -> None:
        for role, p in self.proc.items():
            if p.poll() is None and role in self.conn:
                with contextlib.suppress(Exception):
                    self.conn[role].send(("stop", None))
        for role, p in self.proc.items():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:   # pragma: no cover - a hung worker
                p.terminate()
                p.wait(10)
        for c in self.conn.values():
            c.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def handoff_gbps(pair: HandoffPair, cfg: dict, reps: int = 5,
                 before: Callable[[], None] | None = None,
                 phases: dict | None = None) -> float:
    """One handoff kind, `reps` timed transfers after a checked warm-up one:
    median GB/s from the producer's start to the consumer's finish.  phases,
    if given, gets the median milliseconds of each part: "send" (the
    producer's work), "wake" (until the consumer runs), "match" (its lookup)
    and "receive" (its copy)."""
    cfg = {"total": KV_TOTAL, "block": KV_BLOCK, "seed": 4, **cfg}
    info = pair.call("consumer", "setup", cfg)
    try:
        pair.call("producer", "setup", cfg)
        pair.call("producer", "connect", info)
        times = []
        for rep in range(reps + 1):
            if before:
                before()
            pair.call("producer", "prep", rep)
            pair.call("consumer", "prep", rep)
            pair.send("consumer", "run", rep)       # waiting before the producer starts
            pair.send("producer", "run", rep)
            marks = pair.reply("producer")
            marks.update(pair.reply("consumer"))
            if rep == 0:
                if not pair.call("consumer", "check"):
                    raise RuntimeError(f"handoff {cfg['kind']}: the consumer got other bytes")
            else:
                times.append(marks)
    finally:
        for role in ("producer", "consumer"):
            with contextlib.suppress(RuntimeError):
                if pair.alive(role):
                    pair.call(role, "close")
    if phases is not None:
        for name, a, b in (("send", "start", "sent"), ("wake", "sent", "woke"),
                           ("match", "woke", "matched"), ("receive", "matched", "done")):
            phases[name] = statistics.median(t[b] - t[a] for t in times) * 1e3
    return cfg["total"] / statistics.median(t["done"] - t["start"] for t in times) / 1e9


# -- redis-server -----------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(timeout: float = 30.0) -> tuple[subprocess.Popen, int]:
    """A redis-server on 127.0.0.1 and a free port, without persistence; waits
    for its "Ready to accept connections".  Raises Unavailable."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise Unavailable("redis-server is not installed (Debian package redis-server; "
                          "scripts/setup installs it)")
    try:
        import redis  # noqa: F401
    except ImportError:
        raise Unavailable("the redis Python client is not installed (pip install redis "
                          "hiredis)") from None
    last = ""
    for _ in range(3):                      # another process may take the port meanwhile
        port = _free_port()
        proc = subprocess.Popen(
            [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
             "no", "--daemonize", "no", "--logfile", ""],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        fd = proc.stdout.fileno()           # raw reads: select() sees what is unread
        seen = b""
        deadline = time.monotonic() + timeout
        ready = False
        try:
            while time.monotonic() < deadline:
                r, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
                chunk = os.read(fd, 65536) if r else b""
                if not chunk:
                    break                               # it exited, or the deadline
                seen = (seen + chunk)[-8192:]
                if b"Ready to accept connections" in seen:
                    ready = True
                    break
        except BaseException:                           # interrupted: no server left behind
            stop_redis(proc)
            raise
        if ready:
            # keep draining its log so it never blocks on a full pipe
            proc.drain = threading.Thread(target=_drain, args=(fd,), daemon=True)
            proc.drain.start()
            return proc, port
        stop_redis(proc)
        last = " | ".join(seen.decode("utf-8", "replace").splitlines()[-8:]) or "no output"
        if "already in use" not in last:
            break
    raise Unavailable(f"redis-server did not start: {last}")


def _drain(fd: int) -> None:
    with contextlib.suppress(OSError):
        while os.read(fd, 65536):
            pass


def stop_redis(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:          # pragma: no cover - a hung server
            proc.kill()
            proc.wait()
    drain = getattr(proc, "drain", None)
    if drain is not None:
        drain.join(10)                              # EOF once the server has exited
    if proc.stdout is not None:
        with contextlib.suppress(Exception):
            proc.stdout.close()


# -- the whole bench ---------------------------------------------------------------------
def run(progress: Callable[[str], None] = lambda s: None, quick: bool = False,
        pool_path: str | None = None) -> dict:
    """Every scenario; one dict of figures with stable keys.

    quick=True shrinks every scenario (for tests: the figures mean little).
    pool_path: run the KV scenarios (put/get, lookup, handoff) on this
    existing pool, in a namespace of their own dropped after; refuses
    (BenchRefused) when the pool lacks room for them without evicting."""
    import cxlkv
    from cxlkv.pool.admin import init_pool
    from cxlkv.state.trace import run_trace

    out: dict = {"version": cxlkv.__version__, "notes": {}}
    total = 8 * MiB if quick else 64 * MiB
    reps = 2 if quick else 5
    from cxlkv.daemons.lockmgr import ensure_manager

    stop_manager = None
    if pool_path is not None:               # refuse before anything else runs
        with cxlkv.Pool.open(pool_path, writable=False) as p:
            managed = p.sb.sync == "manager"
        if managed:                         # a lock manager for the run, if none runs
            _, stop_manager = ensure_manager(pool_path)
    d = _scratch_dir()
    try:
        if pool_path is not None:
            with cxlkv.open_pool(pool_path) as kpool:
                check_room(kpool, KV_BLOCK, total // KV_BLOCK)
                check_room(kpool, LOOKUP_BLOCK, _lookup_tokens(quick) // KV_BLOCK_TOKENS)
                check_nodes(kpool, 2)

        progress("memcpy baseline")
        out["memcpy_gbps"] = memcpy_gbps(total)

        path = os.path.join(d, "cas.pool")
        init_pool(path, {"size": (64 if quick else 512) * MiB, "sync": "cas"})
        with cxlkv.open_pool(path) as pool:
            progress("pool writes and reads")
            out["pool_write_gbps"], out["pool_read_gbps"] = pool_copy_gbps(pool, total)
            progress("cas lock")
            out["lock_cas_us"] = lock_us(pool, 2000 if quick else 100_000)
            progress("alloc + free")
            out["alloc_ops_per_s"] = alloc_ops(pool, rounds=20 if quick else 2000)
        progress("manager lock")
        path = os.path.join(d, "manager.pool")
        init_pool(path, {"size": (64 if quick else 256) * MiB, "sync": "manager",
                         "chunk_size": MiB})
        _, stop = ensure_manager(path)
        try:
            with cxlkv.open_pool(path) as pool:
                out["lock_manager_us"] = lock_us(pool, 200 if quick else 5000)
                # the KV cache in manager mode (every entry change through the
                # lock manager, flushes and invalidations included)
                progress("kv in manager mode")
                mtotal = total // 4
                out["put_manager_gbps"], out["get_manager_gbps"] = kv_put_get(
                    pool, "cxlkv-bench-manager", mtotal, reps=reps)
                out["lookup_32k_manager_ms"], _ = kv_lookup_ms(
                    pool, "cxlkv-bench-manager-lookup", _lookup_tokens(quick),
                    repeat=5 if quick else 20)
        finally:
            stop()

        progress("utilisation trace")
        path = os.path.join(d, "trace.pool")
        init_pool(path, {"size": (256 * MiB) if quick else (1 << 30)})
        with cxlkv.open_pool(path) as pool:
            tr = run_trace(pool, seed=1)
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
    out["put_vs_memcpy"] = out["put_gbps"] / m
    out["get_vs_memcpy"] = out["get_gbps"] / m
    for key, base in (("handoff_vs_tcp", "tcp_gbps"), ("handoff_vs_redis", "redis_gbps"),
                      ("handoff_vs_shm", "shm_handoff_gbps")):
        out[key] = None if out[base] is None else out["handoff_gbps"] / out[base]
        if out[base] is None:
            out["notes"][key] = f"no {base}: {out['notes'][base]}"
    out["utilisation_vs_buddy"] = out["alloc_utilisation"] / out["buddy_utilisation"]
    out["targets"] = {k: _meets(out.get(k), *t) for k, t in TARGETS.items()}
    return out


def _kv_scenarios(progress, d: str, quick: bool, pool_path: str | None, total: int,
                  reps: int, notes: dict) -> dict:
    import cxlkv
    from cxlkv.pool.admin import init_pool

    out: dict = {}
    if pool_path is None:
        kv_path = os.path.join(d, "kv.pool")
        init_pool(kv_path, {"size": (128 if quick else 512) * MiB, "sync": "cas"})
    else:
        kv_path = pool_path
    ns = f"cxlkv-bench-{os.getpid()}"
    names = (ns, ns + "-lookup", ns + "-handoff")
    ntok = _lookup_tokens(quick)
    with cxlkv.open_pool(kv_path) as kpool:
        guard = None if pool_path is None else (lambda bb, n: check_room(kpool, bb, n))
        try:
            out["kv_pool"] = pool_path
            out["kv_namespace"] = ns
            progress("kv put and get")
            out["put_gbps"], out["get_gbps"] = kv_put_get(kpool, names[0], total, reps=reps,
                                                         guard=guard)
            progress("kv lookup of 32K tokens")
            out["lookup_tokens"] = ntok
            out["lookup_32k_ms"], out["lookup_32k_list_ms"] = kv_lookup_ms(
                kpool, names[1], ntok, repeat=10 if quick else 50, guard=guard)
            with HandoffPair() as pair:
                progress("handoff through the pool")

                def before():                   # last rep's blocks go, outside the timing
                    drop(kpool, names[2])
                    if guard:
                        guard(KV_BLOCK, total // KV_BLOCK)

                out["handoff_phases_ms"] = {"pool": {}, "shm": {}}
                out["handoff_gbps"] = handoff_gbps(
                    pair, {"kind": "kv", "path": kv_path, "ns": names[2], "total": total},
                    reps, before, out["handoff_phases_ms"]["pool"])
                progress("handoff through /dev/shm")
                shm = os.path.join(d, "handoff.shm")
                with open(shm, "wb") as f:
                    f.truncate(total)
                out["shm_handoff_gbps"] = handoff_gbps(
                    pair, {"kind": "shm", "path": shm, "total": total}, reps,
                    phases=out["handoff_phases_ms"]["shm"])
                os.unlink(shm)
                progress("handoff over TCP")
                out["tcp_gbps"] = handoff_gbps(pair, {"kind": "tcp", "total": total}, reps)
                progress("handoff through redis")
                out["redis_gbps"] = None
                try:
                    proc, port = start_redis()
                except Unavailable as e:
                    notes["redis_gbps"] = str(e)
                else:
                    try:
                        out["redis_gbps"] = handoff_gbps(
                            pair, {"kind": "redis", "port": port, "total": total}, reps)
                    finally:
                        stop_redis(proc)
        finally:
            for name in names:
                drop(kpool, name)
    return out


def _lookup_tokens(quick: bool) -> int:
    return 4096 if quick else LOOKUP_TOKENS


def _meets(value, op: str, target: float):
    if value is None:
        return None
    return value <= target if op == "<=" else value >= target
