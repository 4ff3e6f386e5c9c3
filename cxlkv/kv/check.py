"""Read-only consistency check of the KV region and hash table (part of `cxlkv fsck`)."""
from __future__ import annotations

import numpy as np

from cxlkv.errors import CxlkvError
from cxlkv.pool import layout as L
from cxlkv.state import alloc as A


def check_kv(pool, rep, live: set[int]) -> None:
    from cxlkv.kv.area import Area

    if not pool.sb.compat & L.COMPAT_KV:
        rep.stats["kv"] = {"present": False}
        return
    try:
        a = Area(pool)
    except CxlkvError as e:
        rep.error("kv-header", "kv header", str(e))
        return
    t = a.entries()
    st = (t["ctl"] & 0xFF).astype(np.int64)
    n = a.nslots
    bad = np.flatnonzero(st > L.KV_TOMBSTONE)
    for i in bad[:20]:
        rep.error("kv-entry-state", f"entry {i}", f"invalid state {st[i]}")
    livem = (st == L.KV_PENDING) | (st == L.KV_PUBLISHED) | (st == L.KV_EVICTING)
    for s, name in ((L.KV_WRITING, "being written"), (L.KV_EVICTING, "being evicted")):
        for i in np.flatnonzero(st == s)[:20]:
            rep.error("kv-unrecovered", f"entry {i}", f"left {name} by a dead lock holder")
    for i in np.flatnonzero((st == L.KV_PENDING) & ~np.isin(t["owner"], list(live)))[:20]:
        rep.error("kv-unrecovered", f"entry {i}",
                  f"reserved by token {int(t['owner'][i]):#x}, which is not an attached node")
    ns_recs = a.ns_records()
    ten_recs = a.tenant_records()
    idx = np.flatnonzero(livem)
    # every live entry reachable from its home slot (no EMPTY in between)
    empty = st == L.KV_EMPTY
    csum = np.concatenate([[0], np.cumsum(np.concatenate([empty, empty]))])
    home = (t["key_lo"][idx] & np.uint64(n - 1)).astype(np.int64)
    end = np.where(idx >= home, idx, idx + n)
    unreachable = idx[(csum[end] - csum[home]) > 0]
    for i in unreachable[:20]:
        rep.error("kv-probe-chain", f"entry {i}", "an empty slot lies between the entry and "
                                                  "its home slot: lookups cannot find it")
    keys = t["key_lo"][idx].astype(object) * (1 << 64) + t["key_hi"][idx].astype(object)
    if len(set(keys.tolist())) != len(idx):
        rep.error("kv-duplicate-key", "hash table", "a key is stored twice")
    pays = t["payload"][idx]
    uniq, counts = np.unique(pays, return_counts=True)
    for p in uniq[counts > 1][:20]:
        rep.error("kv-shared-payload", f"payload {int(p):#x}", "referenced by two entries")
    children = np.bincount(t["parent"][idx][(t["parent"][idx] > 0)
                                            & (t["parent"][idx] <= n)].astype(np.int64) - 1,
                           minlength=n)
    ns_blocks = np.zeros(a.max_ns, dtype=np.int64)
    ten_used = np.zeros(a.max_tenants, dtype=np.int64)
    for i in idx:
        e = t[i]
        where = f"entry {i}"
        ns, tn = int(e["ns"]), int(e["tenant"])
        if ns >= a.max_ns or ns_recs[ns].state != L.KV_REC_ACTIVE:
            rep.error("kv-namespace", where, f"belongs to namespace {ns}, which is not in use")
        else:
            ns_blocks[ns] += 1
            if int(e["length"]) != ns_recs[ns].block_bytes:
                rep.error("kv-length", where, f"{int(e['length'])} bytes, its namespace's blocks "
                                              f"are {ns_recs[ns].block_bytes}")
        if tn >= a.max_tenants or ten_recs[tn].state != L.KV_REC_ACTIVE:
            rep.error("kv-tenant", where, f"belongs to tenant {tn}, which is not in use")
        else:
            ten_used[tn] += A.slot_size_for(pool, max(1, int(e["length"])))
        par = int(e["parent"])
        if par > n or (par and not livem[par - 1]):
            rep.error("kv-parent", where, f"its parent entry {par - 1} is not live")
        if int(e["children"]) != int(children[i]):
            rep.error("kv-children", where, f"records {int(e['children'])} children, "
                                            f"{int(children[i])} point to it")
        bits = A.slot_bits(pool, int(e["payload"]))
        if bits is None or not bits[0]:
            rep.error("kv-payload", where, f"payload {int(e['payload']):#x} is not an "
                                           "allocated slot")
        elif st[i] == L.KV_PUBLISHED and not bits[1]:
            rep.error("kv-payload", where, "published block in an unpublished slot")
    h = a.header()
    if h.live != len(idx) or h.tombstones != int((st == L.KV_TOMBSTONE).sum()):
        rep.error("kv-counters", "kv header", f"counts {h.live} live / {h.tombstones} "
                                              f"tombstones, the table holds {len(idx)} / "
                                              f"{int((st == L.KV_TOMBSTONE).sum())}")
    for i, r in enumerate(ns_recs):
        if r.state == L.KV_REC_ACTIVE and r.blocks != ns_blocks[i]:
            rep.error("kv-counters", f"namespace {i}", f"counts {r.blocks} blocks, the table "
                                                       f"holds {int(ns_blocks[i])}")
    for i, r in enumerate(ten_recs):
        if r.state == L.KV_REC_ACTIVE and r.used != ten_used[i]:
            rep.error("kv-counters", f"tenant {i}", f"counts {r.used} bytes used, the table "
                                                    f"holds {int(ten_used[i])}")
    if h.live > a.max_used:
        rep.warn("kv-load", "hash table", f"{h.live} entries exceed the maximum load "
                                          f"({a.max_used})")
    rep.stats["kv"] = {"present": True, "entries": int(len(idx)),
                       "published": int((st == L.KV_PUBLISHED).sum()),
                       "tombstones": int((st == L.KV_TOMBSTONE).sum()),
                       "namespaces": int(sum(r.state == L.KV_REC_ACTIVE for r in ns_recs)),
                       "hash_slots": n}
