"""Change-journal figures: what the appends cost the store path,
and how fast a reader follows the rack.

1. store ops/s with and without the journal append (the same stores on a
   fresh pool each round, rounds interleaved; the append is replaced by a
   no-op for "without"): the ratio of medians; and the time of one append
   call itself (less sensitive to a loaded machine than the ratio);
2. a writer process storing at a paced rate (default 10K blocks/s) while
   this process polls a JournalReader every --poll-ms: records/s received,
   resyncs, lag (record time to receipt) p50/p99, and the reader's CPU per
   record;
3. the reader's capacity: records/s one poll() decodes from full rings.

    cxlkv bench run journal [--rounds N] [--stores N] [--rate N] [--json]

Pools are files in /dev/shm (or --dir).  Figures on a shared machine are noisy.
"""
from __future__ import annotations

import os
import subprocess
import time

import numpy as np

import cxlkv
from cxlkv.bench import harness
from cxlkv.kv import journal
from cxlkv.api import Pool

MiB = harness.MiB
BB = 4096
PER = 8                     # blocks per store


def fresh(path):
    harness.scratch_pool(path, 256 * MiB, chunk_size=2 * MiB, max_nodes=8, hash_slots=1 << 17)


def store_rate(path, stores, with_journal: bool) -> float:
    fresh(path)
    real = journal.Writer.append
    if not with_journal:
        journal.Writer.append = lambda self, *a, **k: 0
    try:
        with cxlkv.open_pool(path) as pool:
            kv = pool.kv(model="bench", block_tokens=4, block_bytes=BB)
            blob = bytes(PER * BB)
            seqs = [np.arange(i * PER * 4, (i + 1) * PER * 4, dtype=np.int64) for i in range(stores)]
            t0 = time.perf_counter()
            for s in seqs:
                kv.store(s, blob)
            return stores / (time.perf_counter() - t0)
    finally:
        journal.Writer.append = real


WRITER = r'''
import sys, time, numpy as np, cxlkv
path, rate, seconds = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
with cxlkv.open_pool(path) as pool:
    kv = pool.kv(model="bench", block_tokens=4, block_bytes=%d)
    blob = bytes(%d * %d)
    print("ready", flush=True)
    sys.stdin.readline()
    t0 = time.perf_counter(); i = 0
    while time.perf_counter() - t0 < seconds:
        due = t0 + i * %d / rate
        while time.perf_counter() < due:
            pass
        kv.store(np.arange(i * 32, i * 32 + 32, dtype=np.int64) + 10**8, blob)
        i += 1
    print(i * %d / (time.perf_counter() - t0), flush=True)
''' % (BB, PER, BB, PER, PER)


def follow(path, rate, seconds, poll_ms):
    fresh(path)
    w = harness.python(WRITER, path, rate, seconds, stdin=subprocess.PIPE,
                       stdout=subprocess.PIPE, text=True)
    if w.stdout.readline().strip() != "ready":
        raise RuntimeError("journal bench: the writer process did not start")
    with Pool.open(path) as pool:
        r = journal.JournalReader(pool, start="now")
        got, lags, cpu = 0, [], 0.0
        w.stdin.write("go\n")
        w.stdin.flush()
        t0 = time.perf_counter()
        while w.poll() is None or r.lag():
            c0 = time.process_time()
            ch = r.poll()
            cpu += time.process_time() - c0
            if len(ch.records) and not ch.resync:
                got += len(ch.records)
                now = time.time_ns() // 1000
                lags.extend((now - ch.records["time_us"].astype(np.int64)).tolist())
            time.sleep(poll_ms / 1000)
            if time.perf_counter() - t0 > seconds + 30:
                break
        wall = time.perf_counter() - t0
        achieved = float(w.stdout.readline() or 0)
    w.wait(30)
    lags = np.array(lags or [0]) / 1000.0
    return {"target_blocks_per_s": rate, "writer_blocks_per_s": round(achieved),
            "records": got, "records_per_s": round(got / wall), "resyncs": r.resyncs,
            "lag_ms_p50": round(harness.pct(lags, 50), 2),
            "lag_ms_p99": round(harness.pct(lags, 99), 2),
            "reader_cpu_us_per_record": round(cpu / max(1, got) * 1e6, 2),
            "poll_ms": poll_ms}


def append_cost(path, n=20000):
    """Microseconds one journal append of PER records takes (the call the
    store path adds, pool lock held), against one store of PER blocks."""
    fresh(path)
    with cxlkv.open_pool(path) as pool:
        kv = pool.kv(model="bench", block_tokens=4, block_bytes=BB)
        kv.store(np.arange(PER * 4, dtype=np.int64), bytes(PER * BB))
        idx = np.flatnonzero((kv.area.entries()["ctl"] & 0xFF) == 3).astype(np.uint64)[:PER]
        w = kv.area.journal
        with pool.lock():
            t0 = time.perf_counter()
            for _ in range(n):
                w.append(journal.STORED, idx)
            return (time.perf_counter() - t0) / n * 1e6


def capacity(path):
    fresh(path)
    with cxlkv.open_pool(path) as pool:
        r = journal.JournalReader(pool, start="now")
        kv = pool.kv(model="bench", block_tokens=4, block_bytes=BB)
        n = r.geo.nrec // PER - 1
        blob = bytes(PER * BB)
        total, spent = 0, 0.0
        for k in range(5):
            for i in range(n):
                kv.store(np.arange(i * 32, i * 32 + 32, dtype=np.int64) + k * 10**7, blob)
            t0 = time.perf_counter()
            total += len(r.poll().records)
            spent += time.perf_counter() - t0
        return {"ring_records": r.geo.nrec, "records_per_poll": total // 5,
                "records_per_s": round(total / spent)}


def add_arguments(ap) -> None:
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--stores", type=int, default=1500)
    ap.add_argument("--rate", type=float, default=10_000, help="writer blocks/s")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--poll-ms", type=float, default=5.0)
    ap.add_argument("--dir", default=None, help="where the pool goes (default /dev/shm)")


def run(a, progress) -> dict:
    with harness.scratch("cxlkv-journal-bench-", a.dir) as d:
        path = os.path.join(d, "bench.pool")
        on, off = [], []
        for r in range(a.rounds):
            progress(f"stores, round {r + 1}/{a.rounds}")
            off.append(store_rate(path, a.stores, False))
            on.append(store_rate(path, a.stores, True))
        progress("append")
        append_us = round(append_cost(path), 2)
        progress("follow")
        followed = follow(path, a.rate, a.seconds, a.poll_ms)
        progress("capacity")
        return {"stores": {"blocks_per_store": PER, "block_bytes": BB, "stores": a.stores,
                           "with_journal_ops_s": round(harness.median(on)),
                           "without_journal_ops_s": round(harness.median(off)),
                           "ratio": round(harness.median(on) / harness.median(off), 3),
                           "rounds_with": [round(x) for x in on],
                           "rounds_without": [round(x) for x in off],
                           "append_us": append_us,
                           "store_us_with_journal": round(1e6 / harness.median(on), 1)},
                "follow": followed,
                "capacity": capacity(path)}


def render(out: dict) -> str:
    s = out["stores"]
    f = out["follow"]
    c = out["capacity"]
    return "\n".join([
        f"store ops/s ({PER} x {BB} B): with journal {s['with_journal_ops_s']}, without "
        f"{s['without_journal_ops_s']}, ratio {s['ratio']}; one append of {PER} records "
        f"{s['append_us']} us vs {s['store_us_with_journal']} us per store",
        f"reader at {f['target_blocks_per_s']:.0f} blocks/s (writer reached "
        f"{f['writer_blocks_per_s']}): {f['records_per_s']} records/s, resyncs "
        f"{f['resyncs']}, lag p50 {f['lag_ms_p50']} ms p99 {f['lag_ms_p99']} ms, "
        f"{f['reader_cpu_us_per_record']} us CPU/record",
        f"reader capacity: {c['records_per_s']} records/s ({c['records_per_poll']} per poll)"])
