"""Full-pool store latency and another node's pool-lock wait, at two table sizes.

For each table size (default 64K and 1M hash slots): format a pool in
/dev/shm whose data area holds about 70 % of the table's slots in small
blocks (256 B payloads, 64 KiB chunks), fill it past full with stores of
64-block chains, then time `--stores` more stores (each one evicts, inline,
at the low watermark) while another process attached as a node takes
`with pool.lock(): pass` in a loop and records how long each acquisition
waited.  Prints p50/p90/p99 of the store and the lock wait p99, and with
--json one JSON document.

    cxlkv bench run evict-scale [--slots 65536 1048576] [--stores 300] [--json]
"""
from __future__ import annotations

import json
import os
import time

import numpy as np

import cxlkv
from cxlkv.bench import harness
from cxlkv.kv.area import Area
from cxlkv.ops.init import init_pool
from cxlkv.pool.format import FormatParams, compute_layout

BB = 256
BLOCK_TOKENS = 4
PER_STORE = 64

WAITER = r'''
import json, os, sys, time
import cxlkv
path, go, stop, out = sys.argv[1:5]
pool = cxlkv.open_pool(path)
open(go + ".ready", "w").close()
while not os.path.exists(go):
    time.sleep(0.001)
waits = []
while not os.path.exists(stop):
    t0 = time.perf_counter()
    with pool.lock():
        t1 = time.perf_counter()
    waits.append(t1 - t0)
    time.sleep(0.0005)
json.dump(waits, open(out, "w"))
pool.close()
'''


def pct(xs, q) -> float:
    v = harness.pct(xs, q)
    return float("nan") if v is None else v


def one_size(slots: int, stores: int, tmp: str) -> dict:
    path = os.path.join(tmp, f"evict-{slots}.pool")
    chunk = 64 << 10
    data = -(-int(0.7 * slots) * BB // chunk) * chunk
    params = {"chunk_size": chunk, "max_nodes": 8, "lease_ms": 2000, "hash_slots": slots}
    meta = compute_layout(FormatParams(size=data * 4 + slots * 256, **params)).regions["data"][0]
    init_pool(path, {"size": meta + data, **params})
    payload = b"\7" * (PER_STORE * BB)
    n_tok = PER_STORE * BLOCK_TOKENS
    with cxlkv.open_pool(path) as pool:
        kv = pool.kv(model="bench", block_tokens=BLOCK_TOKENS, block_bytes=BB)
        a = Area(pool)
        cap = pool.sb.regions["data"][1] // kv.slot_size
        t0 = time.perf_counter()
        seq = 0
        while seq * PER_STORE < 1.05 * cap:
            kv.store(list(range(seq * 1000, seq * 1000 + n_tok)), payload)
            seq += 1
        fill_s = time.perf_counter() - t0
        live = a.header().live
        go, stop, out = (os.path.join(tmp, f"{x}-{slots}") for x in ("go", "stop", "waits.json"))
        w = harness.python(WAITER, path, go, stop, out)
        while not os.path.exists(go + ".ready"):
            time.sleep(0.01)
        open(go, "w").close()
        lat = []
        holds = []
        inner = Area.evict

        def timed(self, *args, **kw):                 # the eviction's share of the lock hold
            t = time.perf_counter()
            try:
                return inner(self, *args, **kw)
            finally:
                holds.append(time.perf_counter() - t)

        Area.evict = timed
        rel = []
        alloc = pool.allocator
        release = alloc.release_empty

        def timed_release(*args, **kw):               # the allocator's share (not eviction's)
            t = time.perf_counter()
            try:
                return release(*args, **kw)
            finally:
                rel.append(time.perf_counter() - t)

        alloc.release_empty = timed_release
        ev0 = a.header().evictions
        for i in range(stores):
            toks = list(range((seq + i) * 1000, (seq + i) * 1000 + n_tok))
            t1 = time.perf_counter()
            kv.store(toks, payload)
            lat.append(time.perf_counter() - t1)
        evicted = a.header().evictions - ev0
        Area.evict = inner
        del alloc.release_empty
        open(stop, "w").close()
        w.wait(60)
        waits = json.load(open(out))
        with pool.lock():                             # what the old eviction did per call
            t1 = time.perf_counter()
            a.victims(a.entries())
            scan_ms = (time.perf_counter() - t1) * 1e3
    os.unlink(path)
    ms = 1e3
    return {"slots": slots, "entries": int(live), "fill_s": round(fill_s, 1), "stores": stores,
            "evicted_blocks": int(evicted),
            "store_ms": {"p50": pct(lat, 50) * ms, "p90": pct(lat, 90) * ms,
                         "p99": pct(lat, 99) * ms},
            "evict_ms": {"n": len(holds), "p50": pct(holds, 50) * ms, "p99": pct(holds, 99) * ms},
            "release_empty_ms": {"n": len(rel), "p50": pct(rel, 50) * ms, "p99": pct(rel, 99) * ms},
            # eviction without the allocator's release (one release per eviction here)
            "evict_own_ms": ({"p50": pct(np.subtract(holds, rel), 50) * ms,
                              "p90": pct(np.subtract(holds, rel), 90) * ms,
                              "p99": pct(np.subtract(holds, rel), 99) * ms}
                             if len(holds) == len(rel) else None),
            "old_scan_ms": scan_ms,
            "lock_wait_ms": {"n": len(waits), "p50": pct(waits, 50) * ms,
                             "p99": pct(waits, 99) * ms, "max": max(waits) * ms}}


def add_arguments(ap) -> None:
    ap.add_argument("--slots", type=int, nargs="+", default=[1 << 16, 1 << 20])
    ap.add_argument("--stores", type=int, default=300)
    ap.add_argument("--dir", default=None, help="where the pools go (default /dev/shm)")


def run(args, progress) -> dict:
    res = []
    with harness.scratch("cxlkv-bench-evict-", args.dir) as tmp:
        for s in args.slots:
            progress(f"{s} slots")
            res.append(one_size(s, args.stores, tmp))
    if len(res) >= 2:
        doc = {"runs": res,
               "p90_ratio": res[-1]["store_ms"]["p90"] / res[0]["store_ms"]["p90"]}
        if res[0]["evict_own_ms"] and res[-1]["evict_own_ms"]:
            doc["evict_own_p90_ratio"] = (res[-1]["evict_own_ms"]["p90"]
                                          / res[0]["evict_own_ms"]["p90"])
    else:
        doc = {"runs": res}
    return doc


def render(doc: dict) -> str:
    lines = []
    for r in doc["runs"]:
        s, w = r["store_ms"], r["lock_wait_ms"]
        lines.append(
            f"{r['slots']:>8} slots {r['entries']:>8} entries  store p50 {s['p50']:.3f} "
            f"p90 {s['p90']:.3f} p99 {s['p99']:.3f} ms  ({r['evicted_blocks']} evicted)  "
            f"other node lock wait p50 {w['p50']:.3f} p99 {w['p99']:.3f} "
            f"max {w['max']:.3f} ms (n={w['n']})")
        e = r["evict_ms"]
        x = r["release_empty_ms"]
        lines.append(
            f"{'':>8}       inline evictions n={e['n']} p50 {e['p50']:.3f} p99 {e['p99']:.3f} "
            f"ms (of which allocator release_empty p50 {x['p50']:.3f} p99 {x['p99']:.3f} ms); "
            f"the old whole-table order alone: {r['old_scan_ms']:.1f} ms")
        if r["evict_own_ms"]:
            o = r["evict_own_ms"]
            lines.append(f"{'':>8}       eviction without release_empty p50 {o['p50']:.3f} "
                         f"p90 {o['p90']:.3f} p99 {o['p99']:.3f} ms")
    if "p90_ratio" in doc:
        lines.append(f"store p90 ratio {doc['p90_ratio']:.2f}; eviction without release_empty "
                     f"p90 ratio {doc.get('evict_own_p90_ratio', float('nan')):.2f}")
    return "\n".join(lines)
