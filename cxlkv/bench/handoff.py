"""The handoff scenarios of `cxlkv bench`: one prefix's KV moved from a
producer process to a consumer process through the pool - two-phase (kind
"kv": kv.store of everything, a notification, then kv.match + kv.load_into)
and streamed (kind "kv-stream": kv.store in steps of `step` blocks, each
followed by cxlkv.kv.stream.notify, while the consumer copies what is
published with cxlkv.kv.stream.follow_into, asleep on a futex in between) -
through a plain /dev/shm mapping (numpy copies in and out), over a loopback
TCP stream, and through a redis-server started for the run.  Both processes are started once (fresh interpreters) and serve every
kind; each transfer is timed from the producer's start to the consumer's
finish on the system-wide monotonic clock.
"""
from __future__ import annotations

import contextlib
import mmap
import os
import socket
import subprocess
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import Callable

import numpy as np

import cxlkv
from cxlkv.bench import harness
from cxlkv.bench.kv import KV_BLOCK, KV_BLOCK_TOKENS, KV_TOTAL, drop, tokens
from cxlkv.kv import stream

#: bytes per store of the streamed handoff (kind "kv-stream"): 4 steps for
#: 64 MiB.  Each step costs the producer one kv.store call (0.3-0.5 ms of CPU
#: here besides the copy) and the consumer one wake-up; what the consumer
#: still copies after the producer's last store is one step.  k steps cost
#: about k x call + copy / k: fewest at k = sqrt(copy / call), 3-4 here.
STREAM_STEP_BYTES = 16 << 20


class _Side:
    """One side (producer or consumer) of one handoff kind, in a worker process.

    run() returns perf_counter marks: the producer's "start" and "sent" (its
    work done, before it notifies), the consumer's "woke", "matched" and
    "done"; and each side's CPU time in its thread ("pcpu", "ccpu": what it
    would take on a CPU of its own, whatever else the machine runs)."""

    info = None
    stream = False                      # the data itself wakes the consumer (TCP)

    def __init__(self, role: str, cfg: dict, peer):
        self.role, self.cfg, self.peer = role, cfg, peer
        self.total, self.block = cfg["total"], cfg["block"]
        self.buf = harness.buffer(self.total, seed=cfg["seed"]) if role == "producer" \
            else harness.buffer(self.total)

    def connect(self, info) -> None:
        pass

    def prep(self, rep: int) -> None:
        pass

    def run(self, rep: int) -> dict:
        now, cpu = time.perf_counter, time.thread_time
        if self.role == "producer":
            c0, t0 = cpu(), now()
            self.produce()
            sent = now()
            c1 = cpu()
            if not self.stream:
                self.peer.send_bytes(b"1")
            return {"start": t0, "sent": sent, "pcpu": c1 - c0}
        if not self.stream:
            self.peer.recv_bytes()
        woke, c0 = now(), cpu()
        matched = self.consume() or woke
        done = now()
        return {"woke": woke, "matched": matched, "done": done, "ccpu": cpu() - c0}

    def produce(self) -> None:
        raise NotImplementedError

    def consume(self) -> float | None:
        """Copy the data in; returns when the lookup ended (if there is one)."""
        raise NotImplementedError

    def check(self) -> bool:
        return bool(np.array_equal(self.buf, harness.buffer(self.total, seed=self.cfg["seed"])))

    def close(self) -> None:
        pass


class _KVSide(_Side):
    """kv.store by the producer; kv.match + kv.load_into by the consumer."""

    def __init__(self, role, cfg, peer):
        super().__init__(role, cfg, peer)
        self.n = self.total // self.block
        # populated: pool pages mapped at open, as a serving process maps them
        # (first-touch faults would otherwise be paid inside the timed copies)
        self.pool = cxlkv.open_pool(cfg["path"], populate=True)
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


class _KVStreamSide(_KVSide):
    """kv.store in steps of cfg["step"] blocks (default STREAM_STEP_BYTES of
    them), each followed by a futex wake
    (stream.notify); the consumer copies each step as it is published
    (stream.follow_into), asleep on the journal's word in between.  The
    consumer's "matched" mark is when its first block was copied."""

    stream = True

    def produce(self):
        bt, bb = KV_BLOCK_TOKENS, self.block
        step = self.cfg.get("step") or max(1, STREAM_STEP_BYTES // bb)
        stored = 0
        for i in range(0, self.n, step):
            j = min(self.n, i + step)
            stored += self.kv.store(self.toks[:j * bt], self.buf[:j * bb])
            stream.notify(self.pool)
        if stored != self.n:
            raise RuntimeError(f"handoff: stored {stored} of {self.n} blocks")

    def consume(self):
        first = []

        def mark(n):
            if not first:
                first.append(time.perf_counter())

        got = stream.follow_into(self.kv, self.toks, self.buf, idle_s=30.0, on_blocks=mark)
        if got != self.n:
            raise RuntimeError(f"handoff: streamed {got} of {self.n} blocks")
        return first[0]


class _ShmSide(_Side):
    """numpy copies in `block` pieces into and out of a shared /dev/shm mapping."""

    def __init__(self, role, cfg, peer):
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
        # optional dependency: only this kind needs the redis client (start_redis checks it)
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


_SIDES = {"kv": _KVSide, "kv-stream": _KVStreamSide, "shm": _ShmSide, "tcp": _TcpSide, "redis": _RedisSide}


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
    role, ctrl, peer = argv[0], int(argv[1]), int(argv[2])
    _worker(role, Connection(ctrl), Connection(peer, readable=role == "consumer",
                                               writable=role == "producer"))


class HandoffPair:
    """The producer and consumer processes (fresh interpreters, so no pool
    state or threads are inherited), each with a control connection to the
    bench, and a pipe from producer to consumer for the notification."""

    def __init__(self, timeout: float = 300.0):
        self.timeout = timeout
        self.conn, self.proc = {}, {}
        env = harness.child_env()
        rd, wr = os.pipe()
        try:
            for role, peer in (("consumer", rd), ("producer", wr)):
                mine, theirs = socket.socketpair()
                try:
                    self.proc[role] = subprocess.Popen(
                        [sys.executable, "-c", "import sys; from cxlkv.bench.handoff import "
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
    and "receive" (its copy); for a streamed kind "send", "first" (the
    producer's start to the consumer's first block) and "tail" (the end of
    the producer's work to the consumer's last block), with "total"; and
    "producer_cpu" / "consumer_cpu", each side's CPU time."""
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
        parts = ((("send", "start", "sent"), ("first", "start", "matched"),
                  ("tail", "sent", "done")) if _SIDES[cfg["kind"]].stream else
                 (("send", "start", "sent"), ("wake", "sent", "woke"),
                  ("match", "woke", "matched"), ("receive", "matched", "done")))
        for name, a, b in parts + (("total", "start", "done"),):
            phases[name] = harness.median(t[b] - t[a] for t in times) * 1e3
        for name, k in (("producer_cpu", "pcpu"), ("consumer_cpu", "ccpu")):
            phases[name] = harness.median(t[k] for t in times) * 1e3
    return cfg["total"] / harness.median(t["done"] - t["start"] for t in times) / 1e9
