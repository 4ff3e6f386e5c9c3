"""Change-journal figures (issue 15): what the appends cost the store path,
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

    .venv/bin/python bench/journal.py [--rounds N] [--stores N] [--rate N] [--json]

Pools are files in /dev/shm (or --dir).  Figures on a shared machine are noisy.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import cxlkv
from cxlkv.kv import journal as J
from cxlkv.pool.admin import init_pool
from cxlkv.pool.pool import Pool

MiB = 1 << 20
BB = 4096
PER = 8                     # blocks per store


def fresh(path):
    if os.path.exists(path):
        os.unlink(path)
    init_pool(path, {"size": 256 * MiB, "chunk_size": 2 * MiB, "max_nodes": 8,
                     "hash_slots": 1 << 17})


def store_rate(path, stores, journal: bool) -> float:
    fresh(path)
    real = J.Writer.append
    if not journal:
        J.Writer.append = lambda self, *a, **k: 0
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
        J.Writer.append = real


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
    w = subprocess.Popen([sys.executable, "-c", WRITER, path, str(rate), str(seconds)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert w.stdout.readline().strip() == "ready"
    with Pool.open(path) as pool:
        r = J.JournalReader(pool, start="now")
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
            "lag_ms_p50": round(float(np.percentile(lags, 50)), 2),
            "lag_ms_p99": round(float(np.percentile(lags, 99)), 2),
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
                w.append(J.STORED, idx)
            return (time.perf_counter() - t0) / n * 1e6


def capacity(path):
    fresh(path)
    with cxlkv.open_pool(path) as pool:
        r = J.JournalReader(pool, start="now")
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--stores", type=int, default=1500)
    ap.add_argument("--rate", type=float, default=10_000, help="writer blocks/s")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--poll-ms", type=float, default=5.0)
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    d = tempfile.mkdtemp(prefix="cxlkv-journal-bench-", dir=a.dir)
    path = os.path.join(d, "bench.pool")
    try:
        on, off = [], []
        for _ in range(a.rounds):
            off.append(store_rate(path, a.stores, False))
            on.append(store_rate(path, a.stores, True))
        out = {"stores": {"blocks_per_store": PER, "block_bytes": BB, "stores": a.stores,
                          "with_journal_ops_s": round(statistics.median(on)),
                          "without_journal_ops_s": round(statistics.median(off)),
                          "ratio": round(statistics.median(on) / statistics.median(off), 3),
                          "rounds_with": [round(x) for x in on],
                          "rounds_without": [round(x) for x in off],
                          "append_us": round(append_cost(path), 2),
                          "store_us_with_journal": round(1e6 / statistics.median(on), 1)},
               "follow": follow(path, a.rate, a.seconds, a.poll_ms),
               "capacity": capacity(path)}
    finally:
        if os.path.exists(path):
            os.unlink(path)
        os.rmdir(d)
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        s = out["stores"]
        print(f"store ops/s ({PER} x {BB} B): with journal {s['with_journal_ops_s']}, without "
              f"{s['without_journal_ops_s']}, ratio {s['ratio']}; one append of {PER} records "
              f"{s['append_us']} us vs {s['store_us_with_journal']} us per store")
        f = out["follow"]
        print(f"reader at {f['target_blocks_per_s']:.0f} blocks/s (writer reached "
              f"{f['writer_blocks_per_s']}): {f['records_per_s']} records/s, resyncs "
              f"{f['resyncs']}, lag p50 {f['lag_ms_p50']} ms p99 {f['lag_ms_p99']} ms, "
              f"{f['reader_cpu_us_per_record']} us CPU/record")
        c = out["capacity"]
        print(f"reader capacity: {c['records_per_s']} records/s ({c['records_per_poll']} per poll)")


if __name__ == "__main__":
    main()
