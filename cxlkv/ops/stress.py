"""`cxlkv stress`: a torture test of the pool's shared state (nodes, lock, allocator, KV cache).

A supervisor starts N worker processes (`python -m cxlkv.ops.stress worker
CONFIG`), each attached as its own node.  Workers allocate, write checksummed
payloads and publish them, verify and free them, take the pool lock for a
read-modify-write of a shared counter, and store and load KV blocks whose
bytes are derived from their keys.  With a kill rate the supervisor kill -9s
random workers at random moments and starts a replacement for each.  With a
pause rate it SIGSTOPs random workers for longer than the lease and SIGCONTs
them later: every worker then looks like a host of its own (see
make_host_root), so the others judge it by its heartbeat, fence it and reap
it while it is stopped, and when it resumes whatever it had in flight must
not land on memory another node now owns.  A resumed worker that finds
itself fenced closes the pool and attaches again as a new incarnation.

At the end, with every worker resumed and stopped, the supervisor attaches,
waits (a bounded poll) until the node table holds no node but its own - the
dead ones reaped, the fenced ones out of quarantine - and checks the pool:
fsck, no overlapping slots, every slot a published payload that verifies and
that a worker owns, every published KV block's bytes match its key, the lock
counter, and that freeing all of it leaves the pool empty.  A watchdog
reports a worker that makes no progress within a deadline (and kills and
replaces it) instead of hanging the run.

Payload: a header (magic, worker, seq, length, xxh64 of the body seeded with
worker and seq, so a body cannot pass for another payload's) and a body.
KV block: its 16-byte pool key repeated (kv_pattern), so any reader can tell
whether a block holds what its key says and whose block overwrote it.

The control slot, allocated by the supervisor before the workers start, has
one 64-byte line per worker after the shared counter (line 0):
  word 0  lock ops this worker id completed (all its incarnations)
  word 1  the offset it is freeing right now, 0 when none
so a replacement knows which slot its predecessor died freeing: that slot
may still be allocated, even published (recovery finishes a free only once
it has begun), but it is nobody's payload any more.  The replacement reports
it to the supervisor and adopts the predecessor's other payloads.  Worker
ids start at 1, so a header that reads as zeros never names one.

Workers report on stdout, one JSON line each: "attached" (slot, epoch) for
every incarnation, cumulative "stats" every REPORT_S (a killed worker loses
only its last interval), "busy" while one operation takes longer than
BUSY_S, "fenced" when it found itself fenced and attaches again,
"violation", "interrupted-free", and "final" (with the payloads it owns)
after it detached.  Closing a worker's stdin asks it to stop.
"""
from __future__ import annotations

import json
import logging
import math
import os
import queue
import random
import shutil
import signal
import struct
import sys
import tempfile
import threading
import time
import uuid as uuidlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter_ns

import numpy as np
import xxhash

from cxlkv.api import Pool, open_pool
from cxlkv.errors import (CxlkvError, KVPoolFull, KVTableFull, LockLost, PoolCorrupt, RefusedError,
                          UsageError)
from cxlkv.host import spawn
from cxlkv.kv.area import Area
from cxlkv.kv.cache import drop_namespace, kv_report
from cxlkv.ops import fsck, lockmgr
from cxlkv.pool import layout
from cxlkv.state import alloc as allocator
from cxlkv.state import nodes as node_table

log = logging.getLogger(__name__)

OPS = ("alloc", "free", "verify", "lock", "kv")
SIZES = (4096, 65536, 200_000, 3 << 20)      # payload sizes (multiples of 64), scaled down
REPORT_S = 0.2
BUSY_S = 1.0
TICK_S = 0.05
CHECKS = ("workers", "hang", "fsck", "overlap", "payloads", "ownership", "lock-counter",
          "kv-blocks", "quarantine", "empty")
#: what a worker treats as "this node was reaped": close the pool, attach again
FENCED = (node_table.NodeFenced, LockLost)
#: default pause, in leases: long enough to be judged dead, shorter than the grace
PAUSE_LEASES = (1.5, 3.0)

MAGIC = int.from_bytes(b"CXLKVSTR", "little")
HEADER = struct.Struct("<QQQQQ")             # magic, worker, seq, length, digest
LINE = 64

# the KV workload: sequences of KV_STEMS shared stems of KV_STEM_BLOCKS blocks,
# each followed by one of KV_VARIANTS tails of 1..KV_MAX_TAIL blocks
KV_NAMESPACE = "cxlkv-stress"
KV_BLOCK_TOKENS = 16
KV_STEMS, KV_STEM_BLOCKS, KV_VARIANTS, KV_MAX_TAIL = 8, 2, 12, 5
KV_UNIVERSE = KV_STEMS * (KV_STEM_BLOCKS + KV_VARIANTS * KV_MAX_TAIL)   # distinct blocks


def memory_model() -> str:
    return "noncoherent-emulated" if os.environ.get("CXLKV_NONCOHERENT") == "1" else "coherent"


def kv_block_bytes(data_bytes: int) -> int:
    """Block size of the KV workload: a power of two (4 KiB .. 1 MiB) such that
    the distinct blocks would fill about twice the data area (so stores evict)."""
    want = max(1, 2 * data_bytes // KV_UNIVERSE)
    return 1 << max(12, min(20, want.bit_length() - 1))


def kv_pattern(keys: np.ndarray, block_bytes: int) -> np.ndarray:
    """The bytes of the blocks with these pool keys ((n, 16) uint8): each key
    repeated to fill its block; shape (n, block_bytes)."""
    return np.tile(keys, (1, block_bytes // 16))


def describe_block(data: bytes, key: bytes) -> str:
    """What a KV block that should hold `key` repeated holds instead."""
    want = key * (len(data) // 16)
    first = next((i for i in range(0, len(data), 16) if data[i:i + 16] != want[i:i + 16]), None)
    if first is None:
        return "its own pattern"
    chunk = data[first:first + 16]
    if not any(data):
        what = "zeros"
    elif first == 0 and len(data) >= HEADER.size and \
            HEADER.unpack_from(data)[0] == MAGIC:
        what = f"a stress payload of worker {HEADER.unpack_from(data)[1]}"
    elif data[first:] == chunk * ((len(data) - first) // 16):
        what = f"the pattern of another key ({chunk.hex()})"
    else:
        what = f"other bytes ({chunk.hex()})"
    return f"bytes from {first} on are {what}"


def make_host_root(parent: str | os.PathLike) -> tuple[str, str]:
    """A procfs root (for CXLKV_PROCFS_ROOT) that makes a process look like a
    host of its own: sys/kernel/random/boot_id holds a fresh boot id, so every
    other node judges it by its heartbeat, as a remote host is judged; self
    (and thread-self) lead to this host's /proc, so what a process reads about
    itself stays true.  Anything else cxlkv reads there is absent, which it
    treats as unknown.  Returns (root, boot id)."""
    root = Path(tempfile.mkdtemp(prefix="host-", dir=parent))
    boot_id = str(uuidlib.uuid4())
    (root / "sys" / "kernel" / "random").mkdir(parents=True)
    (root / "sys" / "kernel" / "random" / "boot_id").write_text(boot_id + "\n")
    for name in ("self", "thread-self"):
        (root / name).symlink_to(Path("/proc") / name)
    return str(root), boot_id


# -- payloads ------------------------------------------------------------------------

@dataclass(frozen=True)
class Payload:
    offset: int
    worker: int
    seq: int
    length: int

    @property
    def seed(self) -> int:
        return (self.worker << 48 ^ self.seq) & 0xFFFFFFFFFFFFFFFF

    def describe(self) -> str:
        return (f"payload {self.offset:#x} (worker {self.worker}, seq {self.seq}, "
                f"{self.length} bytes)")


def write_payload(m, p: Payload, body) -> None:
    m.write(p.offset + HEADER.size, body)
    m.write(p.offset, HEADER.pack(MAGIC, p.worker, p.seq, p.length,
                                  xxhash.xxh64_intdigest(body, seed=p.seed)))


def read_payload(m, off: int, room: int) -> tuple[str, Payload | None]:
    """('ok' | 'checksum-mismatch', header) of the payload at off, or
    ('not-a-payload', None).  room: the bytes it may span (its slot)."""
    m.invalidate(off, HEADER.size)
    magic, worker, seq, length, digest = HEADER.unpack(m.read(off, HEADER.size))
    if magic != MAGIC or not HEADER.size <= length <= room:
        return "not-a-payload", None
    p = Payload(off, worker, seq, length)
    m.invalidate(off + HEADER.size, length - HEADER.size)
    with m.view(off + HEADER.size, length - HEADER.size) as body:
        ok = xxhash.xxh64_intdigest(body, seed=p.seed) == digest
    return ("ok" if ok else "checksum-mismatch"), p


def describe_body(m, p: Payload) -> str:
    """What a payload body that fails its checksum holds: its 4 KiB pages of
    zeros (a late zeroing: a free or a release that landed on it) or of a KV
    block's pattern (a late block copy); a body of random bytes has none."""
    n = (p.length - HEADER.size) // 4096
    if n == 0:
        return "less than a page"
    with m.view(p.offset + HEADER.size, n * 4096) as body:
        pages = np.frombuffer(body, dtype=np.uint8).reshape(n, 4096)
        zero = np.flatnonzero(~pages.any(axis=1))
        kv = np.flatnonzero((pages[:, 16:] == pages[:, :-16]).all(axis=1) & pages.any(axis=1))
        del pages
    what = [f"{len(idx)} of {n} pages {name} (pages {idx[0]}-{idx[-1]}, body bytes "
            f"{idx[0] * 4096:#x}-{(idx[-1] + 1) * 4096:#x})"
            for idx, name in ((zero, "zeros"), (kv, "a KV block's pattern")) if len(idx)]
    return "; ".join(what) or "no page of zeros or of a KV pattern"


def allocated_slots(pool) -> list[tuple[int, int, bool]]:
    """(offset, slot size, published) of every allocated slot, from the slab descriptors."""
    data_off, chunk, _, _ = allocator.geometry(pool)
    d = allocator.descriptors(pool)
    try:
        slabs = [(int(h), int(d["slot_size"][h]), int(d["nslots"][h]),
                  d["alloc_bits"][h].copy(), d["pub_bits"][h].copy())
                 for h in np.flatnonzero((d["control"] & 0xFF) == layout.CHUNK_HEAD)]
    finally:
        del d
    out = []
    for head, ss, ns, alloc, pub in slabs:
        a = np.unpackbits(alloc.view(np.uint8), bitorder="little")[:ns]
        p = np.unpackbits(pub.view(np.uint8), bitorder="little")
        base = data_off + head * chunk
        out += [(base + int(i) * ss, ss, bool(p[i])) for i in np.flatnonzero(a)]
    return out


# -- latency histogram ---------------------------------------------------------------

class Histogram:
    """Log-scale histogram of nanoseconds, 16 buckets per power of two (about 4 %
    wide); histograms merge by adding counts."""

    SUB = 16

    def __init__(self, counts: dict | None = None):
        self.counts = Counter({int(k): v for k, v in (counts or {}).items()})

    def add(self, ns: int) -> None:
        self.counts[int(math.log2(max(ns, 1)) * self.SUB)] += 1

    def merge(self, other: "Histogram") -> None:
        self.counts.update(other.counts)

    def percentile_us(self, q: float) -> float | None:
        total = sum(self.counts.values())
        acc = 0
        for b in sorted(self.counts):
            acc += self.counts[b]
            if acc >= q * total:
                return round(2 ** ((b + 0.5) / self.SUB) / 1000, 1)
        return None

    def to_json(self) -> dict:
        return dict(self.counts)


# -- the worker process --------------------------------------------------------------

class Worker:
    """One worker process: its counters (kept across incarnations of its node),
    and while attached its pool, node and the payloads it owns."""

    def __init__(self, cfg: dict, emit):
        self.emit = emit
        self.path = cfg["pool"]
        self.id = cfg["worker"]
        self.counter = cfg["control"]
        self.tally = cfg["control"] + LINE * self.id
        self.freeing = self.tally + 8
        self.sizes, self.budget = cfg["sizes"], cfg["budget"]
        self.kinds, self.weights = list(cfg["mix"]), list(cfg["mix"].values())
        self.lock_timeout = cfg["lock_timeout"]
        self.kv_block = cfg["kv_block"]
        seed = [cfg["seed"], self.id, cfg["incarnation"]]
        self.rng = random.Random(repr(seed))
        self.noise = np.random.default_rng(seed).bytes(2 * max(self.sizes))
        self.seq = cfg["incarnation"] << 32
        self.ops = dict.fromkeys(OPS, 0)
        self.full = 0
        self.fenced = 0
        self.kv_blocks = {"stored": 0, "loaded": 0}
        self.lat = {"lock": Histogram(), "alloc": Histogram()}
        self.current: tuple[str, float] | None = None     # (op, monotonic start)
        self.pool = None
        self.kv = None
        self.owned: list[Payload] = []
        self.live_bytes = 0

    # -- attaching ---------------------------------------------------------------
    def attach(self) -> None:
        """Attach a new node and take over what this worker id left: after a
        kill or a fencing nothing is trusted that is not read back and verified."""
        self.current = ("attach", time.monotonic())
        self.pool = open_pool(self.path)
        self.m = self.pool.mapping
        self.owned, self.live_bytes = [], 0
        self.kv = None
        node = self.pool.node
        self.emit({"t": "attached", "slot": node.slot, "epoch": node.epoch, "pid": os.getpid()})
        if "kv" in self.kinds and self.weights[self.kinds.index("kv")]:
            self.kv = self.pool.kv(model=KV_NAMESPACE, block_tokens=KV_BLOCK_TOKENS,
                                   block_bytes=self.kv_block)
        self.adopt()

    def close(self) -> None:
        """Detach (for a fenced node too: closing must not raise)."""
        pool, self.pool, self.kv = self.pool, None, None
        if pool is None:
            return
        node = pool.node
        slot, fenced = (node.slot, node.fenced) if node is not None else (-1, False)
        try:
            pool.close()
        except Exception as e:      # noqa: BLE001 - reported, then the mapping closed anyway
            known = "fenced" if fenced else "not known to be fenced"
            self.violation("workers", "close-raised", f"closing the pool as node {slot} "
                           f"({known}) raised {type(e).__name__}: {e}")
            if not pool.mapping.closed:
                pool.mapping.close()

    def _load(self, off: int) -> int:
        self.m.invalidate(off, 8)
        return self.m.load64(off)

    def _store(self, off: int, value: int) -> None:
        self.m.store64(off, value)
        self.m.flush(off, 8)

    def violation(self, check: str, kind: str, detail: str) -> None:
        self.emit({"t": "violation", "check": check, "kind": kind,
                   "detail": f"worker {self.id}: {detail}"})

    def stats(self) -> dict:
        return {"ops": self.ops, "full": self.full, "fenced": self.fenced,
                "kv_blocks": self.kv_blocks,
                "lat": {k: h.to_json() for k, h in self.lat.items()}}

    def adopt(self) -> None:
        """Take over what earlier incarnations of this worker id left: report the
        slot one died (or was fenced) freeing, own their published payloads."""
        dying = self._load(self.freeing)
        if dying:
            self.emit({"t": "interrupted-free", "offset": dying})
            self._store(self.freeing, 0)
        for off, ss, published in allocated_slots(self.pool):
            if not published or off in (dying, self.counter):
                continue
            verdict, p = read_payload(self.m, off, ss)
            if p is None or p.worker != self.id:
                continue
            if verdict != "ok":
                self.violation("payloads", verdict, f"adopting {p.describe()}: body does not "
                                                    f"match its checksum: {describe_body(self.m, p)}")
            self.owned.append(p)
            self.live_bytes += p.length

    # -- the operations ----------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Operations until `stop`; NodeFenced / LockLost propagate."""
        next_report = time.monotonic() + REPORT_S
        while not stop.is_set():
            kind = self.rng.choices(self.kinds, self.weights)[0]
            if kind in ("free", "verify") and not self.owned:
                kind = "alloc"
            elif kind == "alloc" and self.owned and \
                    self.live_bytes + self.sizes[-1] > self.budget:
                kind = "free"
            self.current = (kind, time.monotonic())
            done = getattr(self, "_" + kind)()
            self.current = None
            if done:
                self.ops[done] += 1
            if time.monotonic() >= next_report:
                self.emit({"t": "stats", **self.stats()})
                next_report = time.monotonic() + REPORT_S

    def _alloc(self) -> str | None:
        length = self.rng.choice(self.sizes)
        t0 = perf_counter_ns()
        try:
            off = self.pool.alloc(length)
        except allocator.PoolFullError:
            self.full += 1
            return self._free()
        self.lat["alloc"].add(perf_counter_ns() - t0)
        self.seq += 1
        p = Payload(off, self.id, self.seq, length)
        start = self.rng.randrange(len(self.noise) // 2)
        write_payload(self.m, p, memoryview(self.noise)[start:start + length - HEADER.size])
        self.pool.publish(off)
        self.owned.append(p)
        self.live_bytes += length
        return "alloc"

    def _free(self) -> str | None:
        if not self.owned:
            return None
        i = self.rng.randrange(len(self.owned))
        p = self.owned[i]
        self.owned[i] = self.owned[-1]
        self.owned.pop()
        self.live_bytes -= p.length
        self._check(p)
        self._store(self.freeing, p.offset)
        self.pool.free(p.offset)
        self._store(self.freeing, 0)
        return "free"

    def _verify(self) -> str:
        self._check(self.rng.choice(self.owned))
        return "verify"

    def _check(self, p: Payload) -> None:
        verdict, got = read_payload(self.m, p.offset, p.length)
        if got != p:
            self.violation("payloads", "overwritten", f"{p.describe()} now reads as "
                           f"{got.describe() if got else 'something else'}")
        elif verdict != "ok":
            self.violation("payloads", verdict, f"{p.describe()}: body does not match its "
                                                f"checksum: {describe_body(self.m, p)}")

    def _lock(self) -> str:
        """A read-modify-write of the shared counter under the pool lock; the
        increment counts once its store ran, even if leaving the lock then says
        the lock was lost."""
        stored = False
        t0 = perf_counter_ns()
        try:
            with self.pool.lock(self.lock_timeout) as lk:
                t1 = perf_counter_ns()
                value = self._load(self.counter) + 1
                lk.guard()
                self._store(self.counter, value)
                self._store(self.tally, self._load(self.tally) + 1)
                stored = True
                t2 = perf_counter_ns()
        except LockLost:
            if stored:
                self.ops["lock"] += 1
            raise
        self.lat["lock"].add(t1 - t0 + perf_counter_ns() - t2)
        return "lock"

    def _kv_tokens(self) -> list[int]:
        """A sequence of the KV workload: a shared stem, then one of its tails."""
        stem, tail = self.rng.randrange(KV_STEMS), self.rng.randrange(KV_VARIANTS)
        n = KV_BLOCK_TOKENS * self.rng.randint(1, KV_MAX_TAIL)
        base = stem << 20
        return ([base + j for j in range(KV_STEM_BLOCKS * KV_BLOCK_TOKENS)]
                + [base + (tail + 1 << 12) + j for j in range(n)])

    def _kv(self) -> str:
        """Store a sequence's blocks (half the time), then load them back - with
        load_into or through the pinned zero-copy views - and check each block
        holds its key's pattern."""
        kv, bb = self.kv, self.kv_block
        toks = self._kv_tokens()
        keys = kv.keys_for_hashes(kv.block_hashes(toks))
        want = kv_pattern(keys, bb)
        if self.rng.random() < 0.5:
            try:
                self.kv_blocks["stored"] += kv.store(toks, want)
            except (KVPoolFull, KVTableFull):
                self.full += 1
        if self.rng.random() < 0.5:
            out = np.empty_like(want)
            n = kv.load_into(toks, out)
            got = [out[i].tobytes() for i in range(n)]
            how = "load_into"
        else:
            with kv.load(toks) as views:
                got = [bytes(v) for v in views]
            how = "load"
        self.kv_blocks["loaded"] += len(got)
        for i, data in enumerate(got):
            if data != want[i].tobytes():
                fenced = self.pool.node.fenced
                self.violation("kv-blocks", "kv-read-mismatch",
                               f"block {i} of a sequence read with {how} (key "
                               f"{bytes(keys[i]).hex()}): {describe_block(data, bytes(keys[i]))}"
                               + (" (this node was fenced meanwhile)" if fenced else ""))
        return "kv"


class _Emitter:
    """One JSON line per message on stdout, whole lines from any thread."""

    def __init__(self):
        self._mu = threading.Lock()

    def __call__(self, doc: dict) -> None:
        line = json.dumps(doc) + "\n"
        with self._mu:
            sys.stdout.write(line)
            sys.stdout.flush()


def worker_main(cfg: dict) -> int:
    emit = _Emitter()
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    w = Worker(cfg, emit)

    def watch():                # says what a long operation is, for the supervisor's watchdog
        while not stop.wait(BUSY_S / 2):
            cur = w.current
            if cur is not None and time.monotonic() - cur[1] > BUSY_S:
                emit({"t": "busy", "op": cur[0], "s": round(time.monotonic() - cur[1], 1)})

    threading.Thread(target=watch, daemon=True).start()
    while True:
        try:
            w.attach()
            w.run(stop)
            w.pool.node.check()         # fenced while stopping: verify before reporting
        except FENCED as e:
            op = w.current[0] if w.current else "-"
            w.close()
            w.fenced += 1
            emit({"t": "fenced", "kind": e.kind, "op": op, "detail": str(e)})
            continue
        w.close()
        break
    w.current = None
    emit({"t": "final", **w.stats(), "owned": [[p.offset, p.seq] for p in w.owned]})
    return 0


# -- the supervisor ------------------------------------------------------------------

@dataclass
class Options:
    pool: str
    nodes: int
    mix: dict                   # op -> weight
    seconds: float | None = None
    ops: int | None = None
    kill_rate: float = 0.0
    seed: int | None = None
    pause_rate: float = 0.0
    pause_seconds: tuple[float, float] | None = None    # None: PAUSE_LEASES leases
    op_timeout: float | None = None     # watchdog: None = derived from the lease


@dataclass
class Result:
    pool: str
    nodes: int
    seed: int
    sync: str
    memory_model: str
    seconds: float = 0.0
    ops: dict = field(default_factory=dict)
    pool_full: int = 0
    interrupted_frees: int = 0
    kills: int = 0
    restarts: int = 0
    pauses: int = 0
    resumes: int = 0
    paused_kills: int = 0
    pauses_reaped: int = 0      # pauses that ended with the node reaped
    pauses_skipped: int = 0     # pause times at which half the workers were paused
    reaps: int = 0
    fenced: int = 0
    fenced_in: Counter = field(default_factory=Counter)    # "op:kind" -> fencings seen there
    hangs: int = 0
    lease_s: float = 0.0
    grace_s: float = 0.0
    pause_seconds: tuple[float, float] | None = None
    kv: dict = field(default_factory=dict)
    latency: dict = field(default_factory=dict)
    checks: dict = field(default_factory=dict)
    violations: list = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.violations

    @property
    def ops_per_s(self) -> float:
        return round(self.ops.get("total", 0) / self.seconds, 1) if self.seconds else 0.0

    def to_json(self) -> dict:
        return {"pool": self.pool, "nodes": self.nodes, "seconds": round(self.seconds, 3),
                "seed": self.seed, "ops": self.ops, "ops_per_s": self.ops_per_s,
                "pool_full": self.pool_full, "interrupted_frees": self.interrupted_frees,
                "kills": self.kills, "restarts": self.restarts,
                "pauses": self.pauses, "resumes": self.resumes,
                "paused_kills": self.paused_kills, "pauses_reaped": self.pauses_reaped,
                "pauses_skipped": self.pauses_skipped,
                "reaps": self.reaps,
                "fenced": self.fenced, "fenced_in": dict(self.fenced_in), "hangs": self.hangs,
                "lease_s": self.lease_s, "grace_s": self.grace_s,
                "pause_seconds": list(self.pause_seconds) if self.pause_seconds else None,
                "kv": self.kv, "memory_model": self.memory_model, "sync": self.sync,
                "latency_us": self.latency, "checks": self.checks,
                "violations": self.violations, "passed": self.passed}


class WorkerProcess:
    """The supervisor's end of one worker process (one incarnation of a worker id,
    which may attach several nodes in turn).  host: a procfs root from
    make_host_root, making the worker look like another host."""

    def __init__(self, wid: int, inc: int, cfg: dict, inbox: queue.SimpleQueue,
                 host: str | None = None):
        self.id, self.inc = wid, inc
        self.err = tempfile.TemporaryFile()
        cfg = {**cfg, "worker": wid, "incarnation": inc}
        env = dict(os.environ)
        if host is not None:
            env["CXLKV_PROCFS_ROOT"] = host
        self.proc = spawn.python_module(
            "cxlkv.ops.stress", "worker", json.dumps(cfg),
            stdin=spawn.PIPE, stdout=spawn.PIPE, stderr=self.err, text=True,
            start_new_session=True, env=env)    # Ctrl-C reaches the supervisor only
        self.paused_until: float | None = None
        self.progress_at = time.monotonic()     # watchdog: last progress seen
        self.ops_total = 0
        self.doing = ""                          # its last "busy" report
        self.node: tuple[int, int] | None = None     # (slot, epoch) it attached last
        self.reader = threading.Thread(target=self._read, args=(inbox,), daemon=True)
        self.reader.start()

    def _read(self, inbox) -> None:
        for line in self.proc.stdout:
            try:
                inbox.put((self, json.loads(line)))
            except ValueError:
                pass                        # a line cut short by kill -9

    @property
    def paused(self) -> bool:
        return self.paused_until is not None

    def pause(self, until: float) -> None:
        """SIGSTOP: every thread stops, its heartbeat too."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.paused_until = until

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)
        self.paused_until = None
        self.progress_at = time.monotonic()

    def stop(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass

    def why(self) -> str:
        self.err.seek(0)
        lines = self.err.read().decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else "no message"


class NodeWatch:
    """Counts reaps during a run: a node seen attached with an epoch that is
    later not attached with that epoch (fenced, freed or re-used) was reaped -
    during the run no worker detaches on its own."""

    def __init__(self, path: str):
        self.pool = Pool.open(path, writable=False)
        self.seen: dict[int, int] = {}
        self.reaps = 0

    def poll(self) -> None:
        now = {n.slot: n for n in node_table.read_nodes(self.pool)}
        for slot, epoch in list(self.seen.items()):
            n = now.get(slot)
            if n is None or (n.state, n.epoch) != ("attached", epoch):
                self.reaps += 1
                del self.seen[slot]
        self.seen.update({n.slot: n.epoch for n in now.values() if n.state == "attached"})

    def reaped(self, node: tuple[int, int] | None) -> bool:
        """Is the node (slot, epoch) no longer attached with that epoch?"""
        if node is None:
            return False
        n = node_table.read_slot(self.pool, node[0])
        return (n.state, n.epoch) != ("attached", node[1])

    def close(self) -> None:
        self.pool.close()


def worker_config(pool, control: int, nodes: int, mix: dict, seed: int,
                  lock_timeout: float) -> dict:
    """What every worker is started with (its id and incarnation are added)."""
    data = pool.region("data")[1]
    cap = max(SIZES[0], data // (16 * nodes) // 64 * 64)
    return {"pool": pool.path, "control": control, "mix": mix, "seed": seed,
            "sizes": sorted({min(s, cap) for s in SIZES}),
            "budget": data // (2 * nodes), "lock_timeout": lock_timeout,
            "kv_block": kv_block_bytes(data)}


class Supervisor:
    def __init__(self, opts: Options, sync: str):
        self.opts = opts
        seed = opts.seed if opts.seed is not None else random.SystemRandom().randrange(1 << 32)
        self.rng = random.Random(seed)
        self.res = Result(opts.pool, opts.nodes, seed, sync, memory_model())
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.workers: dict[int, WorkerProcess] = {}
        self.stats: dict[tuple[int, int], dict] = {}
        self.finals: dict[int, dict] = {}
        self.interrupted: set[int] = set()
        self.hosts: str | None = None           # folder of the workers' procfs roots
        with open_pool(opts.pool) as pool:   # attaching reaps dead nodes of this host
            self._refuse_busy(pool)
            if opts.mix.get("kv"):
                Area(pool)                   # a pool without a KV region: refused here
            self.lease = pool.sb.lease_ms / 1000
            self.grace = pool.sb.quarantine_grace_ms / 1000.0
            self.pause_s = opts.pause_seconds or tuple(k * self.lease for k in PAUSE_LEASES)
            pause_max = self.pause_s[1] if opts.pause_rate else 0.0
            # a waiter may wait out a paused holder: its pause, then a lease to be judged
            self.lock_timeout = max(10.0, 3 * self.lease, pause_max + 3 * self.lease)
            self.op_timeout = opts.op_timeout or self.lock_timeout + max(5.0, 2 * self.lease)
            self.control = pool.alloc(LINE * (opts.nodes + 1))
            pool.publish(self.control)
            self.cfg = worker_config(pool, self.control, opts.nodes, opts.mix, seed,
                                     self.lock_timeout)
        self.res.lease_s, self.res.grace_s = self.lease, self.grace
        if opts.pause_rate:
            self.res.pause_seconds = self.pause_s
            self.hosts = tempfile.mkdtemp(prefix="cxlkv-stress-hosts-")

    def _refuse_busy(self, pool) -> None:
        if self.opts.nodes > pool.sb.max_nodes:
            raise UsageError(f"{self.opts.nodes} worker nodes asked for, but the node table of "
                             f"{pool.path} has {pool.sb.max_nodes} slots")
        others = [n.describe() for n in node_table.read_nodes(pool) if n.slot != pool.node.slot]
        if others:
            raise RefusedError(f"{pool.path} is in use by {', '.join(others)}; stress needs a "
                               "pool nobody else is attached to", path=pool.path)
        rep = fsck.check(pool)
        if not rep.clean:
            e = rep.errors[0]
            raise PoolCorrupt(f"{pool.path}: fsck finds {len(rep.errors)} error(s) before the "
                              f"run, first: {e.where}: {e.message}", path=pool.path,
                              hint=f"run cxlkv fsck --pool {pool.path}")
        if rep.stats["allocator"]["slots_allocated"]:
            raise RefusedError(
                f"{pool.path} holds {rep.stats['allocator']['slots_allocated']} allocated "
                "slot(s); stress needs an empty pool (it checks that everything it allocates "
                "is freed)", path=pool.path,
                hint=f"reformat it with cxlkv format --pool {pool.path} --force")

    def cleanup(self) -> None:
        if self.hosts is not None:
            shutil.rmtree(self.hosts, ignore_errors=True)

    # -- results --------------------------------------------------------------
    def fail(self, check: str, kind: str, detail: str) -> None:
        log.info("violation (%s) %s: %s", check, kind, detail)
        self.res.violations.append({"check": check, "kind": kind, "detail": detail})

    def total_ops(self) -> int:
        return sum(sum(s["ops"].values()) for s in self.stats.values())

    def _drain(self) -> None:
        while True:
            try:
                h, msg = self.inbox.get_nowait()
            except queue.Empty:
                return
            t = msg.pop("t")
            if t in ("stats", "final"):
                self.stats[h.id, h.inc] = msg
                total = sum(msg["ops"].values())
                if total != h.ops_total:
                    h.ops_total, h.progress_at = total, time.monotonic()
            if t == "final":
                self.finals[h.id] = msg
            elif t == "attached":
                h.node = (msg["slot"], msg["epoch"])
                h.progress_at = time.monotonic()
            elif t == "fenced":
                self.res.fenced_in[f"{msg['op']}:{msg['kind']}"] += 1
            elif t == "busy":
                h.doing = f"{msg['op']} for {msg['s']:g} s"
            elif t == "interrupted-free":
                self.interrupted.add(msg["offset"])
            elif t == "violation":
                self.fail(msg["check"], msg["kind"], msg["detail"])

    # -- the run ----------------------------------------------------------------
    def _start(self, wid: int, inc: int) -> None:
        host = make_host_root(self.hosts)[0] if self.hosts is not None else None
        self.workers[wid] = WorkerProcess(wid, inc, self.cfg, self.inbox, host)

    def _failed(self, h: WorkerProcess) -> None:
        self.fail("workers", "worker-failed", f"worker {h.id} exited with status "
                                              f"{h.proc.returncode}: {h.why()}")

    def _kill(self, h: WorkerProcess) -> bool:
        """SIGKILL (a paused process dies too); False if it had exited already."""
        h.proc.kill()
        try:
            h.proc.wait(10)
        except spawn.TimeoutExpired:
            self.fail("hang", "worker-hang", f"worker {h.id} did not die within 10 s of "
                                             "SIGKILL")
            return False
        if h.proc.returncode != -signal.SIGKILL:
            self._failed(h)                 # it had exited on its own: not a kill
            return False
        return True

    def _kill_one(self) -> None:
        h = self.workers.pop(self.rng.choice(sorted(self.workers)))
        paused = h.paused
        if not self._kill(h):
            return
        self.res.kills += 1
        self.res.paused_kills += paused
        self._start(h.id, h.inc + 1)
        self.res.restarts += 1

    def _pause_one(self, now: float) -> None:
        """Pause a random running worker - unless half of them are paused
        already: the others must be left running to judge it."""
        running = [w for w in sorted(self.workers) if not self.workers[w].paused]
        if len(self.workers) - len(running) >= max(1, len(self.workers) // 2):
            self.res.pauses_skipped += 1
            return
        h = self.workers[self.rng.choice(running)]
        h.pause(now + self.rng.uniform(*self.pause_s))
        self.res.pauses += 1

    def _resume(self, h: WorkerProcess, watch: NodeWatch | None) -> None:
        if watch is not None and watch.reaped(h.node):
            self.res.pauses_reaped += 1
        h.resume()
        self.res.resumes += 1

    def _watchdog(self, now: float) -> None:
        """A running worker with no progress for op_timeout is stuck: say which
        and what it was doing, then kill it and start a replacement."""
        for h in [h for h in self.workers.values()
                  if not h.paused and now - h.progress_at > self.op_timeout]:
            self.fail("hang", "worker-hang",
                      f"worker {h.id} (pid {h.proc.pid}, node {h.node}) made no progress for "
                      f"{now - h.progress_at:.1f} s (op deadline {self.op_timeout:g} s)"
                      + (f"; it reported doing {h.doing}" if h.doing else ""))
            del self.workers[h.id]
            if self._kill(h):
                self.res.hangs += 1
                self._start(h.id, h.inc + 1)

    def _await_attached(self) -> None:
        """Until every worker attached (or exited, or op_timeout passed): kills
        and pauses of processes still starting would test nothing."""
        deadline = time.monotonic() + self.op_timeout
        while time.monotonic() < deadline and any(
                h.node is None and h.proc.poll() is None for h in self.workers.values()):
            time.sleep(TICK_S)
            self._drain()

    def run_workers(self, progress=None) -> None:
        o = self.opts
        stall = max(30.0, self.lock_timeout + 5)
        watch = NodeWatch(o.pool)
        try:
            for wid in range(1, o.nodes + 1):
                self._start(wid, 0)
            self._await_attached()
            start = time.monotonic()        # the clock runs once every worker is at work
            next_kill = start + self.rng.expovariate(o.kill_rate) if o.kill_rate else math.inf
            next_pause = (start + self.rng.expovariate(o.pause_rate) if o.pause_rate
                          else math.inf)
            last_total, last_change = 0, start
            while self.workers:
                now = time.monotonic()
                self._drain()
                watch.poll()
                for h in [h for h in self.workers.values() if h.proc.poll() is not None]:
                    del self.workers[h.id]
                    self._failed(h)
                for h in [h for h in self.workers.values() if h.paused_until is not None
                          and h.paused_until <= now]:
                    self._resume(h, watch)
                total = self.total_ops()
                if total != last_total:
                    last_total, last_change = total, now
                if progress is not None:
                    progress(now - start, total, self.res.kills)
                if (o.seconds is not None and now - start >= o.seconds) or \
                        (o.ops is not None and total >= o.ops):
                    break
                if now - last_change > stall:
                    self.fail("hang", "stall", f"no operation completed for {stall:g} s")
                    break
                self._watchdog(now)
                if now >= next_kill and self.workers:
                    self._kill_one()
                    next_kill += self.rng.expovariate(o.kill_rate)
                if now >= next_pause:
                    self._pause_one(now)
                    next_pause += self.rng.expovariate(o.pause_rate)
                end = start + o.seconds if o.seconds is not None else math.inf
                wake = min([now + TICK_S, next_kill, next_pause, end]
                           + [h.paused_until for h in self.workers.values() if h.paused])
                time.sleep(max(0.0, wake - time.monotonic()))
            self._drain()
            watch.poll()
            self.res.seconds = time.monotonic() - start
        finally:
            self.res.reaps = watch.reaps
            watch.close()

    def stop_workers(self) -> None:
        """Resume the paused workers, ask every worker to stop (they finish their
        op and detach); kill the ones that do not within the timeout."""
        paused = [h for h in self.workers.values() if h.paused]
        if paused:
            watch = NodeWatch(self.opts.pool)
            try:
                for h in paused:
                    self._resume(h, watch)
            finally:
                watch.close()
        for h in self.workers.values():
            h.stop()
        limit = self.op_timeout + 10
        deadline = time.monotonic() + limit
        for h in self.workers.values():
            try:
                h.proc.wait(max(0.1, deadline - time.monotonic()))
            except spawn.TimeoutExpired:
                self._drain()
                h.proc.kill()
                h.proc.wait(10)
                self.fail("hang", "worker-hang", f"worker {h.id} (pid {h.proc.pid}, node "
                          f"{h.node}) did not stop within {limit:g} s; killed"
                          + (f"; it reported doing {h.doing}" if h.doing else ""))
                self.res.hangs += 1
                continue
            h.reader.join(10)
            if h.proc.returncode != 0:
                self._failed(h)
        self.workers.clear()
        self._drain()

    # -- the end checks -----------------------------------------------------------
    def check_pool(self) -> None:
        """With every worker gone: attach, wait for the node table to drain
        (dead nodes reaped, fenced ones out of quarantine), check, free
        everything, detach, and check the pool is empty."""
        with open_pool(self.opts.pool) as pool:
            self._check_drained(pool)
            for e in fsck.check(pool).errors:
                self.fail("fsck", e.code, f"{e.where}: {e.message}")
            slots = allocated_slots(pool)
            self._check_overlap(slots)
            kv_slots = self._check_kv(pool, slots)
            self._check_payloads(pool.mapping, [s for s in slots if s[0] not in kv_slots])
            self._check_counter(pool.mapping)
            try:
                pool.free_batch([off for off, _, _ in slots if off not in kv_slots])
                if self.opts.mix.get("kv"):
                    self.res.kv["evictions"] = kv_report(pool)["evictions"]
                    drop_namespace(pool, KV_NAMESPACE)
            except (allocator.AllocError, CxlkvError) as e:
                self.fail("empty", "free-failed", str(e))
        with Pool.open(self.opts.pool, writable=False) as pool:
            rep = fsck.check(pool)
        for e in rep.errors:
            self.fail("empty", e.code, f"after freeing everything: {e.where}: {e.message}")
        a = rep.stats["allocator"]
        if a["slots_allocated"] or a["chunks_used"]:
            self.fail("empty", "not-empty", f"{a['slots_allocated']} slot(s) and "
                      f"{a['chunks_used']} chunk(s) still in use after everything was freed")

    def _check_drained(self, pool) -> None:
        """Poll the node table until no node but ours is left; the bound: a
        lease to judge the last dead worker, the quarantine grace, and a lease
        of slack for the reaper's rounds."""
        bound = self.grace + 2 * self.lease
        deadline = time.monotonic() + bound
        while True:
            left = [n for n in node_table.read_nodes(pool) if n.slot != pool.node.slot]
            if not left or time.monotonic() >= deadline:
                break
            time.sleep(min(0.05, self.lease / 10))
        for n in left:
            self.fail("quarantine", "not-drained",
                      f"{n.describe()} is still {n.state} (epoch {n.epoch}) {bound:g} s after "
                      f"every worker stopped (grace {self.grace:g} s + 2 leases)")

    def _check_kv(self, pool, slots) -> set[int]:
        """Every published KV entry's payload holds its key's pattern, in a
        published slot of its own; returns the payload offsets of live entries."""
        payloads: set[int] = set()
        if not pool.sb.compat & layout.COMPAT_KV:
            return payloads
        area = Area(pool)
        t = area.entries()
        st = t["ctl"] & 0xFF
        live = np.flatnonzero((st != layout.KV_EMPTY) & (st != layout.KV_TOMBSTONE))
        alloc = {off: (ss, pub) for off, ss, pub in slots}
        seen: dict[int, int] = {}
        m = pool.mapping
        for i in live:
            e = t[i]
            state, off, length = int(st[i]), int(e["payload"]), int(e["length"])
            key = int(e["key_lo"]).to_bytes(8, "little") + int(e["key_hi"]).to_bytes(8, "little")
            where = f"KV entry {int(i)} (key {key.hex()}, payload {off:#x})"
            payloads.add(off)
            if state != layout.KV_PUBLISHED:
                self.fail("kv-blocks", "kv-entry-left", f"{where} is "
                          f"{layout.KV_STATE_NAMES.get(state, state)} after every node stopped")
                continue
            if off in seen:
                self.fail("kv-blocks", "kv-shared-payload",
                          f"{where} shares its payload with entry {seen[off]}")
            seen[off] = int(i)
            ss, pub = alloc.get(off, (0, False))
            if not pub or length > ss:
                self.fail("kv-blocks", "kv-dangling",
                          f"{where} ({length} bytes) points at a slot that is "
                          + ("not allocated" if not ss else "not published" if not pub
                             else f"{ss} bytes"))
                continue
            m.invalidate(off, length)
            data = m.read(off, length)
            if length % 16 or data != key * (length // 16):
                self.fail("kv-blocks", "kv-mismatch", f"{where}: {describe_block(data, key)}")
        return payloads

    def _check_overlap(self, slots) -> None:
        prev_end, prev = 0, None
        for off, ss, _ in sorted(slots):
            if off < prev_end:
                self.fail("overlap", "overlap", f"slot {off:#x} ({ss} bytes) overlaps slot "
                                                f"{prev:#x}")
            prev_end, prev = max(prev_end, off + ss), off

    def _check_payloads(self, m, slots) -> None:
        owned = {off: (wid, seq) for wid, f in self.finals.items() for off, seq in f["owned"]}
        for off, ss, published in slots:
            if off == self.control:
                continue
            if not published:          # what a dead node reserved must be freed by recovery
                self.fail("payloads", "unpublished-slot",
                          f"slot {off:#x} ({ss} bytes) is reserved but not published after "
                          "recovery: leaked")
                continue
            verdict, p = read_payload(m, off, ss)
            if off in owned:
                wid, seq = owned.pop(off)
                if p is None or (p.worker, p.seq) != (wid, seq):
                    self.fail("ownership", "overwritten", f"worker {wid}'s payload seq {seq} at "
                              f"{off:#x} now reads as {p.describe() if p else 'something else'}")
                elif verdict != "ok":
                    self.fail("payloads", verdict, f"{p.describe()}: body does not match its "
                                                   f"checksum: {describe_body(m, p)}")
            elif off in self.interrupted:
                self.res.interrupted_frees += 1
            elif p is None:
                self.fail("payloads", "not-a-payload",
                          f"published slot {off:#x} ({ss} bytes) holds no payload")
            elif verdict != "ok":
                self.fail("payloads", verdict, f"{p.describe()}: body does not match its "
                                               f"checksum: {describe_body(m, p)}")
            elif p.worker in self.finals:
                self.fail("ownership", "unowned-payload",
                          f"{p.describe()} is owned by no worker: leaked")
        for off, (wid, seq) in owned.items():
            self.fail("ownership", "lost-payload",
                      f"worker {wid}'s payload seq {seq} at {off:#x} is no longer allocated")

    def _check_counter(self, m) -> None:
        n = self.opts.nodes
        m.invalidate(self.control, LINE * (n + 1))
        counter = m.load64(self.control)
        tallies = sum(m.load64(self.control + LINE * w) for w in range(1, n + 1))
        reported = sum(s["ops"]["lock"] for s in self.stats.values())
        killed = self.res.kills + self.res.hangs
        # a worker killed inside the lock may have bumped the counter, not its tally
        if not reported <= tallies <= counter <= tallies + killed:
            self.fail("lock-counter", "lost-update" if counter < tallies else "lock-counter",
                      f"shared counter {counter}, per-worker tallies {tallies}, lock ops "
                      f"reported {reported}, workers killed {killed}: the lock did not "
                      "exclude")

    def result(self) -> Result:
        r = self.res
        ops = Counter()
        kv = Counter()
        lat = {"lock": Histogram(), "alloc": Histogram()}
        for s in self.stats.values():
            ops.update(s["ops"])
            kv.update(s["kv_blocks"])
            r.pool_full += s["full"]
            r.fenced += s["fenced"]
            for k, h in lat.items():
                h.merge(Histogram(s["lat"][k]))
        r.ops = {"total": sum(ops.values()), **{k: ops[k] for k in OPS}}
        r.kv = {"stored_blocks": kv["stored"], "loaded_blocks": kv["loaded"],
                "evictions": r.kv.get("evictions", 0)}
        r.latency = {k: {"p50": h.percentile_us(0.5), "p99": h.percentile_us(0.99)}
                     for k, h in lat.items()}
        details = {
            "workers": f"{r.nodes} workers, {r.kills} killed and replaced"
                       + (f", {r.pauses} paused, {r.fenced} found themselves fenced and "
                          "attached again" if self.opts.pause_rate else ""),
            "hang": f"every operation finished within {self.op_timeout:g} s and every worker "
                    "stopped when asked",
            "fsck": "clean after the dead nodes were reaped",
            "overlap": "no two allocated slots overlap",
            "payloads": "every allocated slot is a published payload whose checksum matches"
                        + (f" ({r.interrupted_frees} left by frees a kill interrupted)"
                           if r.interrupted_frees else ""),
            "ownership": "every payload belongs to the worker that reported it, none lost",
            "lock-counter": "the counter matches the lock ops done under the lock",
            "kv-blocks": "every KV block read, and every published one at the end, holds "
                         "its key's pattern",
            "quarantine": f"no node left (dead ones reaped, fenced ones released) within "
                          f"{self.grace + 2 * self.lease:g} s",
            "empty": "no slot or chunk in use after freeing everything",
        }
        failed = Counter(v["check"] for v in r.violations)
        r.checks = {c: {"passed": not failed[c],
                        "detail": f"{failed[c]} violation(s)" if failed[c] else details[c]}
                    for c in CHECKS}
        return r


def _ensure_manager(path: str, sync: str, notice):
    """Start a lock manager for the run when a manager-mode pool has none; returns
    the callable that stops it."""
    if sync != "manager":
        return lambda: None
    started, stop = lockmgr.ensure_manager(path)
    if started and notice is not None:
        notice("started a lock manager for this run")
    return stop


def run(opts: Options, *, progress=None, notice=None) -> Result:
    """Run the stress test; progress(seconds, ops, kills) is called while it runs."""
    with Pool.open(opts.pool, writable=False) as p:
        sync = p.sb.sync
    stop_manager = _ensure_manager(opts.pool, sync, notice)
    try:
        sup = Supervisor(opts, sync)
        if opts.pause_rate and sup.pause_s[1] >= sup.grace and notice is not None:
            notice(f"pauses of up to {sup.pause_s[1]:g} s reach the quarantine grace "
                   f"({sup.grace:g} s): what a worker paused that long held may be reused "
                   "under it, which no lease-based design can prevent")
        try:
            try:
                sup.run_workers(progress)
            finally:
                sup.stop_workers()
            sup.check_pool()
        finally:
            sup.cleanup()
        return sup.result()
    finally:
        stop_manager()


if __name__ == "__main__":
    if sys.argv[1:2] != ["worker"] or len(sys.argv) != 3:
        sys.exit("usage: python -m cxlkv.ops.stress worker CONFIG_JSON")
    sys.exit(worker_main(json.loads(sys.argv[2])))
