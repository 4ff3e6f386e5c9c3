"""Consistency check of the KV region and hash table (part of `cxlkv fsck`),
and its repair (`cxlkv fsck --repair`, called by cxlkv.ops.repair)."""
from __future__ import annotations

import numpy as np

from cxlkv.errors import CxlkvError
from cxlkv.kv import journal
from cxlkv.kv.area import Area
from cxlkv.pool import layout
from cxlkv.state import alloc
from cxlkv.state import nodes


def check_kv(pool, rep, live: set[int]) -> None:
    if not pool.sb.compat & layout.COMPAT_KV:
        rep.stats["kv"] = {"present": False}
        return
    try:
        a = Area(pool)
    except CxlkvError as e:
        rep.error("kv-header", "kv header", str(e))
        return
    journal.check(pool, rep)
    t = a.entries()
    st = (t["ctl"] & 0xFF).astype(np.int64)
    n = a.nslots
    bad = np.flatnonzero(st > layout.KV_TOMBSTONE)
    for i in bad[:20]:
        rep.error("kv-entry-state", f"entry {i}", f"invalid state {st[i]}")
    livem = (st == layout.KV_PENDING) | (st == layout.KV_PUBLISHED) | (st == layout.KV_EVICTING)
    for s, name in ((layout.KV_WRITING, "being written"), (layout.KV_EVICTING, "being evicted")):
        for i in np.flatnonzero(st == s)[:20]:
            rep.error("kv-unrecovered", f"entry {i}", f"left {name} by a dead lock holder")
    for i in np.flatnonzero((st == layout.KV_PENDING) & ~np.isin(t["owner"], list(live)))[:20]:
        rep.error("kv-unrecovered", f"entry {i}",
                  f"reserved by token {int(t['owner'][i]):#x}, which is not an attached node")
    ns_recs = a.ns_records()
    ten_recs = a.tenant_records()
    idx = np.flatnonzero(livem)
    # every live entry reachable from its home slot (no EMPTY in between)
    empty = st == layout.KV_EMPTY
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
        if ns >= a.max_ns or ns_recs[ns].state != layout.KV_REC_ACTIVE:
            rep.error("kv-namespace", where, f"belongs to namespace {ns}, which is not in use")
        else:
            ns_blocks[ns] += 1
            if int(e["length"]) != ns_recs[ns].block_bytes:
                rep.error("kv-length", where, f"{int(e['length'])} bytes, its namespace's blocks "
                                              f"are {ns_recs[ns].block_bytes}")
        if tn >= a.max_tenants or ten_recs[tn].state != layout.KV_REC_ACTIVE:
            rep.error("kv-tenant", where, f"belongs to tenant {tn}, which is not in use")
        else:
            ten_used[tn] += alloc.slot_size_for(pool, max(1, int(e["length"])))
        par = int(e["parent"])
        if par > n or (par and not livem[par - 1]):
            rep.error("kv-parent", where, f"its parent entry {par - 1} is not live")
        if int(e["children"]) != int(children[i]):
            rep.error("kv-children", where, f"records {int(e['children'])} children, "
                                            f"{int(children[i])} point to it")
        bits = alloc.slot_bits(pool, int(e["payload"]))
        if bits is None or not bits[0]:
            rep.error("kv-payload", where, f"payload {int(e['payload']):#x} is not an "
                                           "allocated slot")
        elif st[i] == layout.KV_PUBLISHED and not bits[1]:
            rep.error("kv-payload", where, "published block in an unpublished slot")
        elif bits[2]:
            rep.error("kv-payload", where, f"payload {int(e['payload']):#x} is a slot whose free "
                                           "has begun (its bytes may be zeroed)")
    for slot in _dead_pin_slots(a):
        rep.error("kv-dead-pins", f"node {slot}", "pins blocks but the node is not attached "
                                                  "(its recovery did not finish)")
    h = a.header()
    if h.live != len(idx) or h.tombstones != int((st == layout.KV_TOMBSTONE).sum()):
        rep.error("kv-counters", "kv header", f"counts {h.live} live / {h.tombstones} "
                                              f"tombstones, the table holds {len(idx)} / "
                                              f"{int((st == layout.KV_TOMBSTONE).sum())}")
    for i, r in enumerate(ns_recs):
        if r.state == layout.KV_REC_ACTIVE and r.blocks != ns_blocks[i]:
            rep.error("kv-counters", f"namespace {i}", f"counts {r.blocks} blocks, the table "
                                                       f"holds {int(ns_blocks[i])}")
    for i, r in enumerate(ten_recs):
        if r.state == layout.KV_REC_ACTIVE and r.used != ten_used[i]:
            rep.error("kv-counters", f"tenant {i}", f"counts {r.used} bytes used, the table "
                                                    f"holds {int(ten_used[i])}")
    # the leaf LRU lists: every published leaf on exactly its tenant's list,
    # nothing else on one, links in range and mutual, no cycle
    problems, first, on_lists, _leaves = a.m.kv_lru_check()
    if problems:
        rep.error("kv-lru", "eviction lists", f"{problems} problem(s); the first: {first}")
    if h.live > a.max_used:
        rep.warn("kv-load", "hash table", f"{h.live} entries exceed the maximum load "
                                          f"({a.max_used})")
    rep.stats["kv"] = {"present": True, "entries": int(len(idx)),
                       "published": int((st == layout.KV_PUBLISHED).sum()),
                       "tombstones": int((st == layout.KV_TOMBSTONE).sum()),
                       "namespaces": int(sum(r.state == layout.KV_REC_ACTIVE for r in ns_recs)),
                       "hash_slots": n, "lru_leaves": int(on_lists)}


def _dead_pin_slots(a, placeholders=frozenset()) -> list[int]:
    """Node slots that are not attached (or attaching) but still pin blocks.
    `placeholders`: slots an offline repair holds to block attaches (free
    slots, as far as pins go)."""

    out = []
    for n in nodes.read_nodes(a.pool, include_free=True):
        if n.state in ("attached", "claimed", "fenced") and n.slot not in placeholders:
            continue
        pins = np.frombuffer(a._read(a.pins_off(n.slot), a.npins * 8), dtype="<u8")
        if pins.any():
            out.append(n.slot)
    return out


def _slot_size(pool, off: int) -> int:
    """Slot size of the slab holding pool offset `off` (0 when none)."""
    data_off, chunk, nchunks, base = alloc.geometry(pool)
    if not data_off <= off < data_off + chunk * nchunks:
        return 0
    m = pool.mapping
    idx = (off - data_off) // chunk
    m.invalidate(base + idx * layout.CHUNK_DESC_SIZE, 8)
    ctl = m.load64(base + idx * layout.CHUNK_DESC_SIZE)
    head = ctl >> 8 if ctl & 0xFF == layout.CHUNK_TAIL else idx
    if head > idx:
        return 0
    m.invalidate(base + head * layout.CHUNK_DESC_SIZE, layout.CHUNK_DESC_SIZE)
    if m.load64(base + head * layout.CHUNK_DESC_SIZE) & 0xFF != layout.CHUNK_HEAD:
        return 0
    slot_size = layout.field_offset(layout.ChunkStruct, "slot_size")
    return int(m.load64(base + head * layout.CHUNK_DESC_SIZE + slot_size))


def repair_kv(pool, rep, live: set[int]) -> None:
    """Repair the KV structures (offline, or under the pool lock).  `rep` is a
    cxlkv.ops.repair.Repair: each fix is recorded with rep.did(code, where, message).

    Undoes what dead nodes left (entries half written, half evicted, reserved),
    drops inconsistent entries (freeing their payload when it is an allocated
    slot no other entry uses), clears dead nodes' pins and recomputes every
    counter.  A corrupt KV header is left (fsck keeps reporting it: re-format)."""

    if not pool.sb.compat & layout.COMPAT_KV:
        return
    try:
        a = Area(pool)
    except CxlkvError:
        return
    m, n = a.m, a.nslots
    one = np.zeros(1, dtype=np.uint64)
    journal.repair(pool, rep)
    lru_problems, lru_first = m.kv_lru_check()[:2]

    def free_payload(off: int) -> bool:
        bits = alloc.slot_bits(pool, off)
        if bits is None or not bits[0]:
            return False
        one[0] = off
        return alloc.free_slots(pool, one, skip=(ValueError,)) == 1

    def kv_block(i: int, off: int) -> bool:
        """Is entry i's payload a block only it refers to: an allocated,
        published slot of the size class of its namespace's blocks, which no
        other live entry uses?"""
        bits = alloc.slot_bits(pool, off)
        if bits is None or not (bits[0] and bits[1]) or refs.get(off, 0) != 1:
            return False
        ns = int(t["ns"][i])
        if ns >= a.max_ns or ns_recs[ns].state != layout.KV_REC_ACTIVE:
            return False
        return _slot_size(pool, off) == alloc.slot_size_for(pool, max(1, ns_recs[ns].block_bytes))

    def drop(i: int, code: str, why: str, free) -> None:
        off = int(t["payload"][i])
        if free == "kv-block":                  # decided before the entry goes
            free = kv_block(i, off)
        m.kv_remove(a.table, n, a.hdr, i)
        freed = free and free_payload(off)
        rep.did(code, f"entry {i}", f"dropped: {why}" + ("; its payload slot freed" if freed
                                                         else ""))

    t = a.entries()
    st = (t["ctl"] & 0xFF).astype(np.int64)
    # what dead nodes (or dead lock holders) left
    for i in np.flatnonzero(st > layout.KV_TOMBSTONE):
        drop(int(i), "kv-entry-state", f"invalid state {int(st[i])}", False)
    for i in np.flatnonzero(st == layout.KV_WRITING):
        drop(int(i), "kv-unrecovered", "left being written by a dead lock holder", True)
    for i in np.flatnonzero((st == layout.KV_PENDING) & ~np.isin(t["owner"], list(live))):
        drop(int(i), "kv-unrecovered", f"reserved by token {int(t['owner'][i]):#x}, which is "
                                       "not an attached node", True)
    for i in np.flatnonzero(st == layout.KV_EVICTING):
        bits = alloc.slot_bits(pool, int(t["payload"][i]))
        if bits is not None and bits[0] and bits[2]:
            drop(int(i), "kv-unrecovered", "left half evicted by a dead evictor", True)
        else:
            m.kv_set_state(a.table, n, np.array([i], dtype=np.uint64), layout.KV_EVICTING,
                           layout.KV_PUBLISHED, 0, 0)
            rep.did("kv-unrecovered", f"entry {int(i)}", "eviction a dead evictor had not "
                                                        "begun undone: published again")
    # inconsistent entries
    t = a.entries()
    st = (t["ctl"] & 0xFF).astype(np.int64)
    livem = (st == layout.KV_PENDING) | (st == layout.KV_PUBLISHED)
    idx = np.flatnonzero(livem)
    empty = st == layout.KV_EMPTY
    csum = np.concatenate([[0], np.cumsum(np.concatenate([empty, empty]))])
    home = (t["key_lo"][idx] & np.uint64(n - 1)).astype(np.int64)
    end = np.where(idx >= home, idx, idx + n)
    bad: dict[int, tuple[str, str, bool]] = {}
    for i in idx[(csum[end] - csum[home]) > 0]:
        bad[int(i)] = ("kv-probe-chain", "unreachable from its home slot", True)
    seen: dict[tuple[int, int], int] = {}
    dist = (idx - home) % n
    for i in idx[np.argsort(dist, kind="stable")]:          # lookups find the nearest first
        k = (int(t["key_lo"][i]), int(t["key_hi"][i]))
        if int(i) in bad:
            continue
        if k in seen:
            # lookups never reach it; its payload is freed when it is a KV block
            # that only this entry refers to (else it would leak for good)
            bad[int(i)] = ("kv-duplicate-key", f"same key as entry {seen[k]}", "kv-block")
        else:
            seen[k] = int(i)
    pays = t["payload"][idx]
    uniq, counts = np.unique(pays, return_counts=True)
    shared = set(int(p) for p in uniq[counts > 1])
    refs = {int(p): int(c) for p, c in zip(uniq, counts)}
    ns_recs, ten_recs = a.ns_records(), a.tenant_records()
    for i in idx:
        i = int(i)
        if i in bad:
            continue
        e = t[i]
        ns, tn, pay = int(e["ns"]), int(e["tenant"]), int(e["payload"])
        if pay in shared:
            bad[i] = ("kv-shared-payload", f"payload {pay:#x} is shared with another entry",
                      False)
        elif ns >= a.max_ns or ns_recs[ns].state != layout.KV_REC_ACTIVE:
            bad[i] = ("kv-namespace", f"namespace {ns} is not in use", True)
        elif tn >= a.max_tenants or ten_recs[tn].state != layout.KV_REC_ACTIVE:
            bad[i] = ("kv-tenant", f"tenant {tn} is not in use", True)
        elif int(e["length"]) != ns_recs[ns].block_bytes:
            bad[i] = ("kv-length", f"{int(e['length'])} bytes, its namespace's blocks are "
                                   f"{ns_recs[ns].block_bytes}", True)
        else:
            bits = alloc.slot_bits(pool, pay)
            if bits is None or not bits[0]:
                bad[i] = ("kv-payload", f"payload {pay:#x} is not an allocated slot", False)
            elif st[i] == layout.KV_PUBLISHED and not bits[1]:
                bad[i] = ("kv-payload", f"payload {pay:#x} is an unpublished slot (another "
                                        "node's reservation)", False)
            elif bits[2]:
                # a free begun on a live block (the slab repair, run first,
                # finishes such frees): the entry goes, the free is finished
                bad[i] = ("kv-payload", f"payload {pay:#x} is a slot whose free has begun",
                          True)
    for i, (code, why, free) in sorted(bad.items()):
        drop(i, code, why, free)
    for p in sorted(shared):                 # nobody refers to a shared payload any more
        if free_payload(p):
            rep.did("kv-shared-payload", f"payload {p:#x}", "freed (its entries were dropped)")
    # pins of nodes that are gone, then every derived counter
    for slot in _dead_pin_slots(a, getattr(rep, "blocked", frozenset())):
        a.fold_stats(slot)
        a.clear_node(slot)
        rep.did("kv-dead-pins", f"node {slot}", "pins of a node that is not attached cleared")
    def counters():
        h, tt = a.header(), a.entries()
        return ((h.live, h.tombstones), [(r.blocks,) for r in a.ns_records()],
                [(r.used, r.blocks) for r in a.tenant_records()],
                tt["parent"].tobytes() + tt["children"].tobytes())

    before = counters()
    a.purge_tombstones(force=True, budget=n)
    a.recount()                              # rebuilds the LRU lists from the table too
    if lru_problems:
        rep.did("kv-lru", "eviction lists", f"rebuilt from the table ({lru_problems} "
                                            f"problem(s); the first: {lru_first})")
    if counters()[1:] != before[1:] or a.header().live != before[0][0]:
        rep.did("kv-counters", "kv header", "live, child, namespace and tenant counters "
                                            "recomputed from the table")
