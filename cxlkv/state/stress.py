"""`cxlkv stress`: a torture test of the pool's shared state (nodes, lock, allocator).

A supervisor starts N worker processes (`python -m cxlkv.state.stress worker
CONFIG`), each attached as its own node.  Workers allocate, write checksummed
payloads and publish them, verify and free them, and take the pool lock for a
read-modify-write of a shared counter.  With a kill rate the supervisor
kill -9s random workers at random moments and starts a replacement for each.
At the end, with every worker gone and the dead ones reaped, it checks the
pool: fsck, no overlapping slots, every slot a published payload that
verifies and that a worker owns, the lock counter, and that freeing all of
it leaves the pool empty.

Payload: a header (magic, worker, seq, length, xxh64 of the body seeded with
worker and seq, so a body cannot pass for another payload's) and a body.

The control slot, allocated by the supervisor before the workers start, has
one 64-byte line per worker after the shared counter (line 0):
  word 0  lock ops this worker id completed (all its incarnations)
  word 1  the offset it is freeing right now, 0 when none
so a replacement knows which slot its predecessor died freeing: that slot
may still be allocated, even published (recovery finishes a free only once
it has begun), but it is nobody's payload any more.  The replacement reports
it to the supervisor and adopts the predecessor's other payloads.  Worker
ids start at 1, so a header that reads as zeros never names one.

Workers report on stdout, one JSON line each: cumulative "stats" every
REPORT_S (a killed worker loses only its last interval), "violation",
"interrupted-free", and "final" (with the payloads it owns) after it
detached.  Closing a worker's stdin asks it to stop.
"""
from __future__ import annotations

import json
import math
import os
import queue
import random
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from time import perf_counter_ns

import numpy as np
import xxhash

from cxlkv.errors import PoolCorrupt, PoolIncompatible, RefusedError, UsageError
from cxlkv.pool import layout as L
from cxlkv.pool.pool import Pool, open_pool
from cxlkv.state import alloc as A
from cxlkv.state import fsck
from cxlkv.state import nodes as N

OPS = ("alloc", "free", "verify", "lock")
SIZES = (4096, 65536, 200_000, 3 << 20)      # payload sizes (multiples of 64), scaled down
REPORT_S = 0.2
TICK_S = 0.05
CHECKS = ("workers", "fsck", "overlap", "payloads", "ownership", "lock-counter", "empty")

MAGIC = int.from_bytes(b"CXLKVSTR", "little")
HEADER = struct.Struct("<QQQQQ")             # magic, worker, seq, length, digest
LINE = 64


def memory_model() -> str:
    return "noncoherent-emulated" if os.environ.get("CXLKV_NONCOHERENT") == "1" else "coherent"


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


def allocated_slots(pool) -> list[tuple[int, int, bool]]:
    """(offset, slot size, published) of every allocated slot, from the slab descriptors."""
    data_off, chunk, _, _ = A.geometry(pool)
    d = A.descriptors(pool)
    try:
        slabs = [(int(h), int(d["slot_size"][h]), int(d["nslots"][h]),
                  d["alloc_bits"][h].copy(), d["pub_bits"][h].copy())
                 for h in np.flatnonzero((d["control"] & 0xFF) == L.CHUNK_HEAD)]
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
    """One worker: its node, the payloads it owns, its counters."""

    def __init__(self, pool, cfg: dict, emit):
        self.pool, self.m, self.emit = pool, pool.mapping, emit
        self.id = cfg["worker"]
        self.counter = cfg["control"]
        self.tally = cfg["control"] + LINE * self.id
        self.freeing = self.tally + 8
        self.sizes, self.budget = cfg["sizes"], cfg["budget"]
        self.kinds, self.weights = list(cfg["mix"]), list(cfg["mix"].values())
        self.lock_timeout = cfg["lock_timeout"]
        seed = [cfg["seed"], self.id, cfg["incarnation"]]
        self.rng = random.Random(repr(seed))
        self.noise = np.random.default_rng(seed).bytes(2 * max(self.sizes))
        self.seq = cfg["incarnation"] << 32
        self.owned: list[Payload] = []
        self.live_bytes = 0
        self.ops = dict.fromkeys(OPS, 0)
        self.full = 0
        self.lat = {"lock": Histogram(), "alloc": Histogram()}
        self.lock = pool.lock()

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
        return {"ops": self.ops, "full": self.full,
                "lat": {k: h.to_json() for k, h in self.lat.items()}}

    def adopt(self) -> None:
        """Take over what earlier incarnations of this worker id left: report the
        slot one died freeing, own their published payloads."""
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
                                                    "match its checksum")
            self.owned.append(p)
            self.live_bytes += p.length

    def run(self, stop: threading.Event) -> None:
        next_report = time.monotonic() + REPORT_S
        while not stop.is_set():
            kind = self.rng.choices(self.kinds, self.weights)[0]
            if kind in ("free", "verify") and not self.owned:
                kind = "alloc"
            elif kind == "alloc" and self.owned and \
                    self.live_bytes + self.sizes[-1] > self.budget:
                kind = "free"
            done = getattr(self, "_" + kind)()
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
        except A.PoolFullError:
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
                                                "checksum")

    def _lock(self) -> str:
        t0 = perf_counter_ns()
        self.lock.acquire(self.lock_timeout)
        t1 = perf_counter_ns()
        try:
            self._store(self.counter, self._load(self.counter) + 1)
            self._store(self.tally, self._load(self.tally) + 1)
        finally:
            t2 = perf_counter_ns()
            self.lock.release()
        self.lat["lock"].add(t1 - t0 + perf_counter_ns() - t2)
        return "lock"


def worker_main(cfg: dict) -> int:
    def emit(doc):
        print(json.dumps(doc), flush=True)

    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    with open_pool(cfg["pool"]) as pool:
        w = Worker(pool, cfg, emit)
        w.adopt()
        w.run(stop)
        owned = [[p.offset, p.seq] for p in w.owned]
    emit({"t": "final", **w.stats(), "owned": owned})
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
                "memory_model": self.memory_model, "sync": self.sync,
                "latency_us": self.latency, "checks": self.checks,
                "violations": self.violations, "passed": self.passed}


class _Handle:
    """The supervisor's end of one worker process (one incarnation of a worker id)."""

    def __init__(self, wid: int, inc: int, cfg: dict, inbox: queue.SimpleQueue):
        self.id, self.inc = wid, inc
        self.err = tempfile.TemporaryFile()
        cfg = {**cfg, "worker": wid, "incarnation": inc}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cxlkv.state.stress", "worker", json.dumps(cfg)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True,
            start_new_session=True)         # Ctrl-C reaches the supervisor only
        self.reader = threading.Thread(target=self._read, args=(inbox,), daemon=True)
        self.reader.start()

    def _read(self, inbox) -> None:
        for line in self.proc.stdout:
            try:
                inbox.put((self, json.loads(line)))
            except ValueError:
                pass                        # a line cut short by kill -9

    def stop(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass

    def why(self) -> str:
        self.err.seek(0)
        lines = self.err.read().decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else "no message"


class Supervisor:
    def __init__(self, opts: Options, sync: str):
        self.opts = opts
        seed = opts.seed if opts.seed is not None else random.SystemRandom().randrange(1 << 32)
        self.rng = random.Random(seed)
        self.res = Result(opts.pool, opts.nodes, seed, sync, memory_model())
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.workers: dict[int, _Handle] = {}
        self.stats: dict[tuple[int, int], dict] = {}
        self.finals: dict[int, dict] = {}
        self.interrupted: set[int] = set()
        with open_pool(opts.pool) as pool:   # attaching reaps dead nodes of this host
            self._refuse_busy(pool)
            data = pool.region("data")[1]
            cap = max(SIZES[0], data // (16 * opts.nodes) // 64 * 64)
            self.control = pool.alloc(LINE * (opts.nodes + 1))
            pool.publish(self.control)
            lease = pool.sb.lease_ms / 1000
        self.lock_timeout = max(10.0, 3 * lease)
        self.cfg = {"pool": opts.pool, "control": self.control, "mix": opts.mix, "seed": seed,
                    "sizes": sorted({min(s, cap) for s in SIZES}),
                    "budget": data // (2 * opts.nodes), "lock_timeout": self.lock_timeout}

    def _refuse_busy(self, pool) -> None:
        if self.opts.nodes > pool.sb.max_nodes:
            raise UsageError(f"{self.opts.nodes} worker nodes asked for, but the node table of "
                             f"{pool.path} has {pool.sb.max_nodes} slots")
        others = [n.describe() for n in N.read_nodes(pool) if n.slot != pool.node.slot]
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

    # -- results --------------------------------------------------------------
    def fail(self, check: str, kind: str, detail: str) -> None:
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
            if t == "final":
                self.finals[h.id] = msg
            elif t == "interrupted-free":
                self.interrupted.add(msg["offset"])
            elif t == "violation":
                self.fail(msg["check"], msg["kind"], msg["detail"])

    # -- the run ----------------------------------------------------------------
    def _start(self, wid: int, inc: int) -> None:
        self.workers[wid] = _Handle(wid, inc, self.cfg, self.inbox)

    def _failed(self, h: _Handle) -> None:
        self.fail("workers", "worker-failed", f"worker {h.id} exited with status "
                                              f"{h.proc.returncode}: {h.why()}")

    def _kill_one(self) -> None:
        h = self.workers.pop(self.rng.choice(sorted(self.workers)))
        h.proc.kill()
        try:
            h.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.fail("workers", "worker-hang", f"worker {h.id} did not die within 10 s of "
                                                "SIGKILL")
            return
        if h.proc.returncode != -signal.SIGKILL:
            self._failed(h)                 # it had exited on its own: not a kill
            return
        self.res.kills += 1
        self._start(h.id, h.inc + 1)
        self.res.restarts += 1

    def run_workers(self, progress=None) -> None:
        o = self.opts
        stall = max(30.0, self.lock_timeout + 5)
        start = time.monotonic()
        for wid in range(1, o.nodes + 1):
            self._start(wid, 0)
        next_kill = start + self.rng.expovariate(o.kill_rate) if o.kill_rate else math.inf
        last_total, last_change = 0, start
        while self.workers:
            now = time.monotonic()
            self._drain()
            for h in [h for h in self.workers.values() if h.proc.poll() is not None]:
                del self.workers[h.id]
                self._failed(h)
            total = self.total_ops()
            if total != last_total:
                last_total, last_change = total, now
            if progress is not None:
                progress(now - start, total, self.res.kills)
            if (o.seconds is not None and now - start >= o.seconds) or \
                    (o.ops is not None and total >= o.ops):
                break
            if now - last_change > stall:
                self.fail("workers", "stall", f"no operation completed for {stall:g} s")
                break
            if now >= next_kill and self.workers:
                self._kill_one()
                next_kill += self.rng.expovariate(o.kill_rate)
            end = start + o.seconds if o.seconds is not None else math.inf
            time.sleep(max(0.0, min(now + TICK_S, next_kill, end) - time.monotonic()))
        self.res.seconds = time.monotonic() - start

    def stop_workers(self) -> None:
        """Ask every worker to stop (they finish their op and detach); kill the ones
        that do not within the timeout."""
        for h in self.workers.values():
            h.stop()
        deadline = time.monotonic() + self.lock_timeout + 10
        for h in self.workers.values():
            try:
                h.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                h.proc.kill()
                h.proc.wait(10)
                self.fail("workers", "worker-hang", f"worker {h.id} did not stop within "
                                                    f"{self.lock_timeout + 10:g} s; killed")
                continue
            h.reader.join(10)
            if h.proc.returncode != 0:
                self._failed(h)
        self.workers.clear()
        self._drain()

    # -- the end checks -----------------------------------------------------------
    def check_pool(self) -> None:
        """With every worker gone: attach (which reaps the dead ones), check, free
        everything, detach, and check the pool is empty."""
        with open_pool(self.opts.pool) as pool:
            for e in fsck.check(pool).errors:
                self.fail("fsck", e.code, f"{e.where}: {e.message}")
            slots = allocated_slots(pool)
            self._check_overlap(slots)
            self._check_payloads(pool.mapping, slots)
            self._check_counter(pool.mapping)
            try:
                pool.free_batch([off for off, _, _ in slots])
            except A.AllocError as e:
                self.fail("empty", "free-failed", str(e))
        with Pool.open(self.opts.pool, writable=False) as pool:
            rep = fsck.check(pool)
        for e in rep.errors:
            self.fail("empty", e.code, f"after freeing everything: {e.where}: {e.message}")
        a = rep.stats["allocator"]
        if a["slots_allocated"] or a["chunks_used"]:
            self.fail("empty", "not-empty", f"{a['slots_allocated']} slot(s) and "
                      f"{a['chunks_used']} chunk(s) still in use after everything was freed")

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
                                                   "checksum")
            elif off in self.interrupted:
                self.res.interrupted_frees += 1
            elif p is None:
                self.fail("payloads", "not-a-payload",
                          f"published slot {off:#x} ({ss} bytes) holds no payload")
            elif verdict != "ok":
                self.fail("payloads", verdict, f"{p.describe()}: body does not match its "
                                               "checksum")
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
        # a worker killed inside the lock may have bumped the counter, not its tally
        if not reported <= tallies <= counter <= tallies + self.res.kills:
            self.fail("lock-counter", "lost-update" if counter < tallies else "lock-counter",
                      f"shared counter {counter}, per-worker tallies {tallies}, lock ops "
                      f"reported {reported}, kills {self.res.kills}: the lock did not "
                      "exclude")

    def result(self) -> Result:
        r = self.res
        ops = Counter()
        lat = {"lock": Histogram(), "alloc": Histogram()}
        for s in self.stats.values():
            ops.update(s["ops"])
            r.pool_full += s["full"]
            for k, h in lat.items():
                h.merge(Histogram(s["lat"][k]))
        r.ops = {"total": sum(ops.values()), **{k: ops[k] for k in OPS}}
        r.latency = {k: {"p50": h.percentile_us(0.5), "p99": h.percentile_us(0.99)}
                     for k, h in lat.items()}
        details = {
            "workers": f"{r.nodes} workers, {r.kills} killed and replaced",
            "fsck": "clean after the dead nodes were reaped",
            "overlap": "no two allocated slots overlap",
            "payloads": "every allocated slot is a published payload whose checksum matches"
                        + (f" ({r.interrupted_frees} left by frees a kill interrupted)"
                           if r.interrupted_frees else ""),
            "ownership": "every payload belongs to the worker that reported it, none lost",
            "lock-counter": "the counter matches the lock ops done under the lock",
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
    try:
        from cxlkv.daemons.lockmgr import ensure_manager
    except ImportError:
        raise PoolIncompatible(
            f"{path}: a pool in sync mode manager needs the lock manager, which this build "
            "of cxlkv lacks", path=path, hint="use a pool formatted with --sync cas") from None
    started, stop = ensure_manager(path)
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
        try:
            sup.run_workers(progress)
        finally:
            sup.stop_workers()
        sup.check_pool()
        return sup.result()
    finally:
        stop_manager()


if __name__ == "__main__":
    if sys.argv[1:2] != ["worker"] or len(sys.argv) != 3:
        sys.exit("usage: python -m cxlkv.state.stress worker CONFIG_JSON")
    sys.exit(worker_main(json.loads(sys.argv[2])))
