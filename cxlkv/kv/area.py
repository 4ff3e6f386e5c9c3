"""The KV region and hash table of one pool: geometry, records, eviction and
recovery.  Everything that writes entries or records here runs under the
pool lock; readers (cxlkv.kv.cache) are lock-free.

Eviction costs O(victims), not O(table): the pool keeps, per tenant, a
doubly-linked LRU list of the *leaf* entries (PUBLISHED, no live children:
the only ones leaf-first eviction may take), links in an array of the KV
region (u64 per hash slot; the 64-byte entry is full), heads in the KV
header (cxlkv_format.h, INCOMPAT_KV_LRU).  The C writers (kv_insert,
kv_set_state, kv_stamp, kv_remove; cxlkv/_core/src/lru.c) keep the lists
as entries are published, gain or lose children, are touched and removed,
all under the pool lock, with a dirty word around each edit: a holder that
dies mid-edit leaves it set and the next holder rebuilds the lists from the
table (also recount(), fsck --repair).

Why an exact LRU list over leaves rather than CLOCK or segmented LRU: the
victim order must stay leaf first and least recently used first, as the old
whole-table order was (subtree's newest use); a list of leaves gives that
directly - a parent joins its list when its last child goes, placed by its
subtree's newest stamp - and a pick is a walk from the head(s) that costs
the victims plus the pinned or kept leaves it passes.  CLOCK would need a
hand sweeping the table (reference bits written on hits, or O(table) sweeps
when most entries are interior), and readers must not write shared lines:
they append to per-node touch rings, which the evictor applies (drain_rings:
O(touches), each touched leaf moves to its list's tail).  One list per
tenant makes quota eviction O(victims) too; a global eviction takes the
oldest of the list heads.  Dropping a namespace (everything=True) stays a
table scan: it is an operator command, not on a store's path.
"""
from __future__ import annotations

import logging
import time
import weakref

import numpy as np

# KVPoolFull, KVTableFull, QuotaExceeded and TooManyPins are public here too (cxlkv.kv.area)
from cxlkv.errors import (  # noqa: F401
    CxlkvError,
    KVError,
    KVPoolFull,
    KVTableFull,
    PoolIncompatible,
    QuotaExceeded,
    TooManyPins,
)
from cxlkv.kv import journal
from cxlkv.pool import layout
from cxlkv.state import alloc, protocol
from cxlkv.state import nodes as node_table
from cxlkv.state.locks import entry_offset as lock_entry_offset
from cxlkv.state.locks import guard, held_lock
from cxlkv.util.sizes import human_size

log = logging.getLogger(__name__)

ENTRY = np.dtype([("ctl", "<u8"), ("key_lo", "<u8"), ("key_hi", "<u8"), ("payload", "<u8"),
                  ("length", "<u4"), ("ns", "<u2"), ("tenant", "<u2"), ("parent", "<u4"),
                  ("children", "<u4"), ("owner", "<u8"), ("lru", "<u8")])
assert ENTRY.itemsize == layout.HASH_ENTRY_SIZE
STATS = np.dtype([(n, "<u8") for n in layout.KV_STAT_NAMES])
TENANT = np.dtype([("salt", "V16"), ("state", "<u4"), ("reserved0", "<u4"), ("quota", "<u8"),
                   ("used", "<u8"), ("blocks", "<u8"), ("rejected", "<u8"), ("reserved1", "<u8")])
assert TENANT.itemsize == layout.KV_TENANT_SIZE
_FREEING = layout.field_offset(layout.LockEntryStruct, "freeing")
_MGR_CONTROL = layout.field_offset(layout.NodeStruct, "mgr_control")
_LRU = layout.field_offset(layout.HashEntryStruct, "lru")
_HDR = {f: layout.field_offset(layout.KVHdrStruct, f) for f, *_ in layout.KVHdrStruct._fields_}

#: free space (share of the data area) under which store evicts, and up to which
LOW_WATERMARK = 0.05
HIGH_WATERMARK = 0.10
#: free space under which the node agent starts evicting (in the background, in
#: batches of AGENT_BATCH blocks per lock hold, up to HIGH_WATERMARK), so that
#: stores rarely reach LOW_WATERMARK and evict inline
AGENT_WATERMARK = 0.075
AGENT_BATCH = 256
#: blocks a store evicts beyond what it needs when it must evict inline
INLINE_SLACK = 64
#: victims freed per pick (one round of evict(); the lock stays held across rounds)
EVICT_BATCH = 1024
#: slots the background tombstone purge looks at per call (bounded lock hold)
PURGE_BUDGET = 8192
#: ... and after an eviction, per victim (at least PURGE_MIN): the sweep keeps
#: pace with the tombstones evictions leave, at a cost in proportion to them
PURGE_PER_VICTIM = 16
PURGE_MIN = 256


#: pools whose KV counters an interrupted eviction may have left behind the
#: table (their freed entries not yet subtracted): recounted at detach
_COUNTS_SUSPECT: "weakref.WeakSet" = weakref.WeakSet()


def now_us() -> int:
    return time.time_ns() // 1000


def stamp() -> int:
    return max(1, now_us())


class Area:
    """Geometry of the KV region of an open pool, and access to its records."""

    def __init__(self, pool):
        sb = pool.sb
        if not sb.compat & layout.COMPAT_KV:
            raise PoolIncompatible(
                f"{pool.path} was formatted without a KV region (by cxlkv before 0.2)",
                hint="back up what it holds and re-format it with `cxlkv format --force`")
        self.pool = pool
        self.m = pool.mapping
        self.table, size = sb.regions["hash"]
        self.nslots = sb.hash_slots
        self.max_used = max(1, self.nslots * sb.hash_max_load_pct // 100)
        self.kv_off, kv_size = sb.regions["kv"]
        missing = layout.missing_kv_features(sb.incompat)
        if missing:
            raise PoolIncompatible(
                f"{pool.path} was formatted without the feature"
                f"{'s' if len(missing) > 1 else ''} {' and '.join(missing)} (by cxlkv 0.1): "
                "its KV cache cannot be used by this version", path=pool.path,
                hint="snapshot its KV blocks with the cxlkv that formatted it, re-format "
                     "with `cxlkv format --force`, then restore them")
        self.geo = layout.kv_geometry(sb.max_nodes, sb.hash_slots)
        self.hdr = self.kv_off
        self.m.invalidate(self.hdr, 64)
        magic = self.m.load64(self.hdr)
        stored = layout.KVHdrStruct.from_buffer_copy(self.m.read(self.hdr, layout.KV_HDR_SIZE))
        if magic != layout.KV_MAGIC or any(getattr(stored, f) != self.geo[f] for f in (
                "max_namespaces", "max_tenants", "pins_per_node", "ring_per_node", "ns_off",
                "tenant_off", "node_off", "node_stride", "lru_off")) or kv_size < self.geo["size"]:
            raise KVError(f"{pool.path}: the KV header is corrupt (magic or geometry)",
                          hint="run `cxlkv fsck` on the pool")
        self.max_ns = self.geo["max_namespaces"]
        self.max_tenants = self.geo["max_tenants"]
        self.npins = self.geo["pins_per_node"]
        self.nring = self.geo["ring_per_node"]
        self.managed = sb.sync == "manager"
        pool.mapping.set_geometry(*alloc.geometry(pool))      # payload frees go through C
        # manager mode / emulation: flush what we write, invalidate what we read
        self.m.flush_meta = self.managed or self.m.noncoherent
        self.links = self.kv_off + self.geo["lru_off"]
        self.smallest = alloc.slot_size_for(pool, 1)
        self.m.kv_lru_setup(self.table, self.nslots, self.hdr, self.links)
        self.journal = journal.Writer(pool)        # this node's change journal ring

    # -- offsets ----------------------------------------------------------
    def ns_off(self, i: int) -> int:
        return self.kv_off + self.geo["ns_off"] + i * layout.KV_NS_SIZE

    def tenant_off(self, i: int) -> int:
        return self.kv_off + self.geo["tenant_off"] + i * layout.KV_TENANT_SIZE

    def node_base(self, slot: int) -> int:
        return self.kv_off + self.geo["node_off"] + slot * self.geo["node_stride"]

    def stats_off(self, slot: int, ns: int) -> int:
        return self.node_base(slot) + self.geo["stats_off"] + ns * STATS.itemsize

    def pins_off(self, slot: int) -> int:
        return self.node_base(slot) + self.geo["pins_off"]

    def ring_off(self, slot: int) -> int:
        return self.node_base(slot) + self.geo["ring_off"]

    def entry_off(self, i: int) -> int:
        return self.table + i * layout.HASH_ENTRY_SIZE

    # -- reads -------------------------------------------------------------
    def _read(self, off: int, size: int) -> bytes:
        if self.m.flush_meta:
            self.m.invalidate(off, size)
        return self.m.read(off, size)

    def _read_into(self, off: int, size: int, dst) -> None:
        """`size` bytes at pool offset `off` into `dst` (a writable buffer
        of exactly that size)."""
        if self.m.flush_meta:
            self.m.invalidate(off, size)
        if self.m.readinto(off, dst) != size:
            raise ValueError(f"copied {len(dst)} bytes of a {size}-byte block")

    def entries(self) -> np.ndarray:
        """A snapshot (copy) of the whole hash table."""
        return np.frombuffer(self._read(self.table, self.nslots * layout.HASH_ENTRY_SIZE),
                             dtype=ENTRY)

    def header(self) -> layout.KVHdrStruct:
        return layout.KVHdrStruct.from_buffer_copy(self._read(self.hdr, layout.KV_HDR_SIZE))

    def ns_record(self, i: int) -> layout.KVNsStruct:
        return layout.KVNsStruct.from_buffer_copy(self._read(self.ns_off(i), layout.KV_NS_SIZE))

    def ns_records(self) -> list[layout.KVNsStruct]:
        raw = self._read(self.ns_off(0), self.max_ns * layout.KV_NS_SIZE)
        return [layout.KVNsStruct.from_buffer_copy(raw, i * layout.KV_NS_SIZE)
                for i in range(self.max_ns)]

    def tenant_record(self, i: int) -> layout.KVTenantStruct:
        return layout.KVTenantStruct.from_buffer_copy(self._read(self.tenant_off(i),
                                                            layout.KV_TENANT_SIZE))

    def tenant_records(self) -> list[layout.KVTenantStruct]:
        raw = self._read(self.tenant_off(0), self.max_tenants * layout.KV_TENANT_SIZE)
        return [layout.KVTenantStruct.from_buffer_copy(raw, i * layout.KV_TENANT_SIZE)
                for i in range(self.max_tenants)]

    def node_stats(self, slot: int) -> np.ndarray:
        """A node's per-namespace counters, shape (max_ns,) of STATS."""
        return np.frombuffer(self._read(self.stats_off(slot, 0), self.max_ns * STATS.itemsize),
                             dtype=STATS)

    def _slots(self, *states: int) -> list[int]:
        """Node slots whose state is one of `states` (just the control words:
        the lock manager's in sync mode manager, as state.nodes reads them),
        read in one pass over the node table."""
        base = self.pool.sb.regions["nodes"][0] + (_MGR_CONTROL if self.managed else 0)
        n, step = self.pool.sb.max_nodes, layout.NODE_SIZE // 8
        span = (n - 1) * layout.NODE_SIZE + 8
        if self.m.flush_meta:
            self.m.invalidate(base, span)
        v = self.m.view(base, span)
        try:
            words = np.frombuffer(v, dtype="<u8")[::step] & layout.NODE_STATE_MASK
            hit = words == states[0]
            for st in states[1:]:
                hit |= words == st
            out = np.flatnonzero(hit).tolist()
            del words
        finally:
            v.release()
        return out

    def pinned(self) -> np.ndarray:
        """Entry indices pinned by attached (or attaching) nodes, and by fenced
        ones: their pins are quarantined with them (views may still be open)."""
        out = []
        for slot in self._slots(layout.NODE_ATTACHED, layout.NODE_CLAIMED, layout.NODE_FENCED):
            p = np.frombuffer(self._read(self.pins_off(slot), self.npins * 8), dtype="<u8")
            out.append(p[p != 0] - 1)
        return np.unique(np.concatenate(out)) if out else np.zeros(0, dtype="<u8")

    # -- writes (pool lock held) ------------------------------------------------
    def write_record(self, off: int, rec) -> None:
        self.m.write(off, bytes(rec))

    def set_hdr(self, **fields) -> None:
        self.m.invalidate(self.hdr + 64, 64)          # never write a stale copy back
        for f, v in fields.items():
            self.m.store64(self.hdr + _HDR[f], v)
        self.m.flush(self.hdr + 64, 64)

    def clear_node(self, slot: int) -> None:
        """Zero a node's pins, ring position and stats (the slot is being
        (re)used or was recovered)."""
        base = self.node_base(slot)
        self.m.zero(base, self.geo["node_stride"])

    def drain_rings(self) -> None:
        """Apply every node's recent touches to the entries' LRU stamps (a
        touched leaf moves to its list's tail): O(touches)."""
        now = stamp()
        for slot in self._slots(layout.NODE_ATTACHED, layout.NODE_CLAIMED):
            base = self.node_base(slot)
            raw = self._read(base, 128)
            head = int.from_bytes(raw[0:8], "little")
            drained = int.from_bytes(raw[64:72], "little")
            if head == drained:
                continue
            k = min(head - drained, self.nring) if head > drained else 0
            if k:
                ring = np.frombuffer(self._read(self.ring_off(slot), self.nring * 8),
                                     dtype="<u8")
                idx = np.unique(ring[np.arange(head - k, head) % self.nring])
                idx = idx[(idx > 0) & (idx <= self.nslots)] - 1
                self.m.kv_stamp(self.table, self.nslots, idx.astype(np.uint64), now)
            self.m.invalidate(base + 64, 64)
            self.m.store64(base + 64, head)
            self.m.flush(base + 64, 8)

    # -- eviction (pool lock held) -------------------------------------------------
    def evict(self, need_bytes: int = 0, need_entries: int = 0, *, tenant: int | None = None,
              ns: int | None = None, everything: bool = False,
              keep: np.ndarray | None = None, limit: int | None = None) -> tuple[int, int]:
        """Evict unpinned published blocks, least recently used first and
        leaf first, until `need_bytes` of slots and `need_entries` entries are
        free again (or, with everything=True, all that match), or `limit`
        blocks were evicted.  Entries in `keep` (and so their ancestors)
        stay.  Returns (blocks, bytes).

        Victims come from the leaf LRU lists (the tenant's, or the oldest
        heads of all): O(victims + pinned or kept leaves passed), never a
        scan.  `ns` (a namespace drop, with everything=True) scans."""
        self.drain_rings()
        if everything or ns is not None:
            return self._evict_scan(need_bytes, need_entries, tenant=tenant, ns=ns,
                                    everything=everything, keep=keep)
        kept = (np.unique(np.asarray(keep, dtype=np.uint64)) if keep is not None and len(keep)
                else np.zeros(0, dtype=np.uint64))
        who = 0xFFFF if tenant is None else int(tenant)
        done_blocks = done_bytes = idle = 0
        while ((done_bytes < need_bytes or done_blocks < need_entries)
               and (limit is None or done_blocks < limit) and idle < 8):
            guard(self.pool)                # the lock may have been taken from a stalled node
            want_n = max(0, need_entries - done_blocks)
            want_b = max(0, need_bytes - done_bytes)
            cap = min(EVICT_BATCH, max(1, want_n + -(-want_b // self.smallest)))
            if limit is not None:
                cap = min(cap, limit - done_blocks)
            out = np.zeros(cap, dtype=np.uint64)
            got = self.m.kv_lru_pick(who, want_n, want_b, self.smallest,
                                     self.pinned().astype(np.uint64), kept, out)
            if not got:
                break
            b, n, blocked = self._evict_batch(out[:got])
            done_blocks += b
            done_bytes += n
            if not b and not blocked:
                break
            idle = 0 if b else idle + 1             # every victim pinned meanwhile: retry
        self.purge_tombstones(budget=min(PURGE_BUDGET,
                                         max(PURGE_MIN, PURGE_PER_VICTIM * done_blocks)))
        return done_blocks, done_bytes

    def _evict_scan(self, need_bytes: int, need_entries: int, *, tenant, ns, everything,
                    keep) -> tuple[int, int]:
        """evict() by a whole-table order (namespace drop: an operator command)."""
        done_blocks = done_bytes = 0
        for _round in range(4):             # a victim found pinned late blocks its ancestors
            if not (everything or done_bytes < need_bytes or done_blocks < need_entries):
                break
            guard(self.pool)                # the lock may have been taken from a stalled node
            t = self.entries()
            order = self._victims(t, tenant, ns, keep)
            if not len(order):
                break
            if not everything:
                sizes = self.slot_sizes(t["length"][order])
                want_b = max(0, need_bytes - done_bytes)
                want_n = max(0, need_entries - done_blocks)
                k = max(int(np.searchsorted(np.cumsum(sizes), want_b)) + 1 if want_b else 0,
                        want_n)
                order = order[:max(1, min(k, len(order)))]
            b, n, blocked = self._evict_batch(order.astype(np.uint64), t,
                                              spill=not everything)
            done_blocks += b
            done_bytes += n
            if not blocked:
                if everything:
                    break
                continue
        self.purge_tombstones()
        return done_blocks, done_bytes

    def victims(self, t: np.ndarray | None = None) -> np.ndarray:
        """Entry indices evict() may take now, in its order (leaf first, least
        recently used first); t: a snapshot of the table (entries()), read
        when None."""
        return self._victims(self.entries() if t is None else t, None, None, None)

    def _victims(self, t: np.ndarray, tenant, ns, keep) -> np.ndarray:
        """Entry indices that may be evicted, in eviction order: a block only
        after all its descendants (leaf first), least recently used first.

        A block is evictable when it and its whole subtree are published,
        unpinned and not kept; its order key is the newest LRU stamp in its
        subtree (so a parent never sorts before a child), then depth."""
        n = self.nslots
        st = t["ctl"] & 0xFF
        live = (st == layout.KV_PENDING) | (st == layout.KV_PUBLISHED) | (st == layout.KV_EVICTING)
        par = t["parent"].astype(np.int64) - 1                 # -1: root
        par[~live | (par >= n)] = -1
        par[par >= 0] = np.where(live[par[par >= 0]], par[par >= 0], -1)
        ok = st == layout.KV_PUBLISHED
        ok[self.pinned().astype(np.int64)] = False
        if keep is not None and len(keep):
            ok[np.asarray(keep, dtype=np.int64)] = False
        depth = self._depths(par)
        eff = t["lru"].astype(np.int64).copy()
        blocked = ~ok & live
        lv = np.flatnonzero(live & (par >= 0))
        lv = lv[np.argsort(-depth[lv], kind="stable")]
        bounds = np.flatnonzero(np.diff(depth[lv])) + 1
        for kids in np.split(lv, bounds):             # deepest level first
            p = par[kids]
            np.maximum.at(eff, p, eff[kids])
            blocked[p[blocked[kids]]] = True
        cand = ok & ~blocked
        if tenant is not None:
            cand &= t["tenant"] == tenant
        if ns is not None:
            cand &= t["ns"] == ns
        idx = np.flatnonzero(cand)
        return idx[np.lexsort((-depth[idx], eff[idx]))]

    @staticmethod
    def _depths(par: np.ndarray) -> np.ndarray:
        """Hops from each entry to its chain's root (parents as indices, -1 =
        root), by pointer jumping; a corrupt cycle stops after 64 rounds."""
        dist = (par >= 0).astype(np.int64)
        anc = par.copy()
        for _ in range(64):
            has = anc >= 0
            if not has.any():
                break
            a = np.where(has, anc, 0)
            dist = dist + np.where(has, dist[a], 0)
            anc = np.where(has, anc[a], -1)
        return dist

    def _entry(self, i: int) -> np.void:
        return np.frombuffer(self._read(self.entry_off(i), layout.HASH_ENTRY_SIZE), dtype=ENTRY)[0]

    def _rows(self, idx: np.ndarray) -> np.ndarray:
        """Copies of the entries `idx` (pool lock held: they do not change)."""
        if self.m.flush_meta:                         # read through invalidated lines
            return np.array([self._entry(int(i)) for i in idx], dtype=ENTRY)
        v = self.m.view(self.table, self.nslots * layout.HASH_ENTRY_SIZE)
        try:
            whole = np.frombuffer(v, dtype=ENTRY)
            rows = whole[idx.astype(np.int64)]
            del whole
        finally:
            v.release()
        return rows

    def _slot_size(self, length: int) -> int:
        return max(self.smallest, -(-length // 64) * 64) if length > 0 else 0

    def _evict_batch(self, idx: np.ndarray, t: np.ndarray | None = None,
                     spill: bool = True, zero: bool = True) -> tuple[int, int, bool]:
        """Evict `idx` (in eviction order): the one place victims are freed.
        Returns (blocks, bytes, blocked): blocked when a victim turned out
        pinned (it and its ancestors stay).  `t`: a snapshot of the whole
        table, or None to read just the victims' entries.  With a spill tier
        on this pool object (pool.tiers, cxlkv.kv.tiers.spill) and spill true,
        the victims are handed to it (Tier.take) before the slots are freed.
        zero=False leaves the freed slots as they are (quarantine: a
        poisoned chunk is never written, and never reused)."""
        m = self.m
        rows = self._rows(idx) if t is None else t[idx.astype(np.int64)]
        if t is None:
            t = dict(zip(idx.tolist(), rows))
        # the evictor records itself: a recovery finishes only its own node's
        # evictions (a fenced evictor's are its own quarantine's to finish)
        evictor = self.pool.node.owner_token if self.pool.node is not None else 0
        m.kv_set_state(self.table, self.nslots, idx, layout.KV_PUBLISHED, layout.KV_EVICTING, 0, 0,
                       evictor)
        pinned = np.isin(idx, self.pinned())          # after the fence in kv_set_state
        if pinned.any():
            # a reader pinned it in the meantime: it and every ancestor stay
            stay = set(int(i) for i in idx[pinned])
            for i in idx[pinned]:
                p = int(t[int(i)]["parent"])
                while 0 < p <= self.nslots and p - 1 not in stay:
                    stay.add(p - 1)
                    p = int((t[p - 1] if isinstance(t, np.ndarray) else self._entry(p - 1))
                            ["parent"])
            go = np.array([int(i) not in stay for i in idx], dtype=bool)
            m.kv_set_state(self.table, self.nslots, idx[~go], layout.KV_EVICTING,
                           layout.KV_PUBLISHED, 0, 0)
            idx, rows = idx[go], rows[go]
        if spill and len(idx):
            sp = self.pool.tiers.get("spill")
            if sp is not None:
                self._spill_out(sp, idx, t)
        rec = lock_entry_offset(self.pool, self.pool.node.slot) + _FREEING
        # the frees are marked begun on the slots: from here a crash is
        # finished by recovery (an EVICTING entry with a marked slot goes)
        pays = np.ascontiguousarray(rows["payload"], dtype=np.uint64)
        try:
            m.slab_mark_freeing(pays)
        except ValueError:
            for k in range(len(idx)):                 # find and report the bad ones
                try:
                    m.slab_mark_freeing(pays[k:k + 1])
                except ValueError as err:
                    log.warning("evicting entry %d: %s (fsck will report it)", int(idx[k]), err)
        self.journal.append(journal.EVICTED, idx)          # the frees have begun: they go
        # then each victim in C, in order: the free recorded in our lock
        # entry, the entry removed, the slot freed, the record cleared
        # from the frees to the counters: an exception in between (SIGINT,
        # MemoryError) leaves the counters to a recount, which this node's
        # own detach then makes (see recover)
        _COUNTS_SUSPECT.add(self.pool)
        _, _, failed = m.kv_evict_free(self.hdr, rec, np.zeros(1, dtype=np.uint64), idx, zero)
        for i, why in failed:
            log.warning("evicting entry %d: free failed: %s (fsck will report it)", i, why)
        lengths = rows["length"].astype(np.int64)
        sizes = self.slot_sizes(lengths)
        nsd = {int(k): [int((rows["ns"] == k).sum()), int(lengths[rows["ns"] == k].sum())]
               for k in np.unique(rows["ns"])}
        ten = {int(k): [int((rows["tenant"] == k).sum()), int(sizes[rows["tenant"] == k].sum())]
               for k in np.unique(rows["tenant"])}
        total = int(sizes.sum())
        for i, (blocks, nbytes) in nsd.items():
            if i < self.max_ns:
                r = self.ns_record(i)
                r.blocks = max(0, r.blocks - blocks)
                r.evictions += blocks
                r.evicted_bytes += nbytes
                self.write_record(self.ns_off(i), r)
        for i, (blocks, nbytes) in ten.items():
            if i < self.max_tenants:
                r = self.tenant_record(i)
                r.blocks = max(0, r.blocks - blocks)
                r.used = max(0, r.used - nbytes)
                self.write_record(self.tenant_off(i), r)
        if len(idx):
            h = self.header()
            self.set_hdr(evictions=h.evictions + len(idx),
                         evicted_bytes=h.evicted_bytes + sum(v[1] for v in nsd.values()))
            self.pool.allocator.release_empty()
        _COUNTS_SUSPECT.discard(self.pool)
        return len(idx), total, bool(pinned.any())

    def _spill_out(self, tier, idx: np.ndarray, t: np.ndarray) -> None:
        """Hand the entries `idx` (EVICTING, unpinned) to the spill tier
        (Tier.take), which copies out of the pool what it keeps.  Memory
        copies only - no disk I/O under the pool lock - and never an error:
        what the tier refuses is dropped and counted there."""
        digests: dict[int, bytes] = {}

        def copy(ns: int, payload: int, ln: int, dst) -> bytes:
            d = digests.get(ns)
            if d is None:
                d = digests[ns] = (bytes(self.ns_record(ns).digest) if ns < self.max_ns
                                   else bytes(16))
            self._read_into(payload, ln, dst)
            return d

        for i in idx:
            e = t[int(i)]
            ln = int(e["length"])
            if not ln:
                continue
            key = int(e["key_lo"]).to_bytes(8, "little") + int(e["key_hi"]).to_bytes(8, "little")
            tier.take(key, ln,
                      lambda dst, e=e, ln=ln: copy(int(e["ns"]), int(e["payload"]), ln, dst))

    def evict_on_path(self, key_lo: int, keep=None) -> int:
        """Evict the least recently used evictable leaf on the probe path of
        a key (from its home slot to the first EMPTY): the one eviction that
        makes room for that key when tombstones fill the table.  O(path)."""
        guard(self.pool)
        kept = (np.unique(np.asarray(keep, dtype=np.uint64)) if keep is not None and len(keep)
                else np.zeros(0, dtype=np.uint64))
        v = self.m.kv_lru_path_victim(key_lo, self.pinned().astype(np.uint64), kept)
        if v < 0:
            return 0
        return self._evict_batch(np.array([v], dtype=np.uint64))[0]

    def purge_tombstones(self, force: bool = False, key_lo: int | None = None,
                         budget: int = PURGE_BUDGET) -> int:
        """Turn tombstones that no live entry's probe path crosses back into
        EMPTY slots (pool lock held), bounded per call: with `key_lo`, the
        cluster holding that key's home slot; otherwise, once tombstones are
        a sixteenth of the table (or with force), the clusters of the next
        `budget` slots from a cursor kept in the KV header.  Safe for
        lock-free readers: a reader looking for a present key never passes
        them."""
        h = self.header()
        if key_lo is None and not force and h.tombstones < max(16, self.nslots // 16):
            return 0
        guard(self.pool)
        if key_lo is not None:
            return self.m.kv_purge(key_lo & (self.nslots - 1), 1)[1]
        nxt, freed = self.m.kv_purge(h.purge_cursor % self.nslots, budget)
        line = self.hdr + 128
        self.m.invalidate(line, 64)                   # never write a stale copy back
        self.m.store64(self.hdr + _HDR["purge_cursor"], nxt)
        self.m.flush(line, 64)
        return freed

    def slot_sizes(self, lengths: np.ndarray) -> np.ndarray:
        """A.slot_size_for over an array of payload lengths (0 stays 0)."""
        lengths = lengths.astype(np.int64)
        smallest = alloc.slot_size_for(self.pool, 1)
        return np.where(lengths > 0, np.maximum(smallest, -(-lengths // 64) * 64), 0)

    def tenants(self) -> np.ndarray:
        """A copy of every tenant record (shape (max_tenants,) of TENANT), one read."""
        return np.frombuffer(self._read(self.tenant_off(0),
                                        self.max_tenants * layout.KV_TENANT_SIZE),
                             dtype=TENANT)

    def used_bytes(self, tenants: np.ndarray | None = None) -> int:
        """Bytes of slots the active tenants hold (from `tenants`, a copy
        tenants() made under the same lock hold, or read now)."""
        raw = self.tenants() if tenants is None else tenants
        return int(raw["used"][raw["state"] == layout.KV_REC_ACTIVE].sum())

    def data_size(self) -> int:
        return self.pool.sb.regions["data"][1]

    # -- recovery (pool lock held) ------------------------------------------------
    def in_flight(self) -> np.ndarray:
        """Indices of the entries left WRITING, PENDING or EVICTING (one C
        pass over the ctl words: no copy of the table)."""
        out = np.zeros(256, dtype=np.uint64)
        n = self.m.kv_in_flight(self.table, self.nslots, out)
        if n > len(out):
            out = np.zeros(n, dtype=np.uint64)
            n = min(n, self.m.kv_in_flight(self.table, self.nslots, out))
        return out[:n]

    def recover(self, slot: int, epoch: int) -> None:
        """Undo what a dead (or detaching) node left in the KV area.

        Only the entries left part way are looked at (`in_flight`); the
        derived counters are recomputed from the whole table (`recount`) when
        the node died (it may have died inside a writer's C call), not when a
        live node detaches with nothing part way: a clean detach costs one
        pass over the ctl words, not two table copies and a rebuild."""
        m = self.m
        token = (slot + 1) | epoch << 16
        idx = self.in_flight()
        rows = np.zeros(len(idx), dtype=ENTRY)
        for k, i in enumerate(idx):
            rows[k] = np.frombuffer(self._read(self.entry_off(int(i)), layout.HASH_ENTRY_SIZE),
                                    dtype=ENTRY)[0]
        st = rows["ctl"] & 0xFF
        one = np.zeros(1, dtype=np.uint64)
        # entries another node's recovery must leave alone: a fenced node's
        # half-written or half-evicted ones are its own quarantine's to finish
        others = {(n.slot + 1) | n.epoch << 16 for n in node_table.read_nodes(self.pool)
                  if n.state in ("attached", "fenced")} - {token}
        mine = ~np.isin(rows["owner"], list(others))
        # a lock holder died writing an entry: nothing refers to it yet (its
        # payload is an unpublished reservation the allocator reclaims)
        for k in np.flatnonzero((st == layout.KV_WRITING) & mine):
            m.kv_remove(self.table, self.nslots, self.hdr, int(idx[k]))
        # blocks the node reserved and never published: mark the payload's
        # free begun, drop the entry, free - each step finishable after a crash
        guard(self.pool)
        for k in np.flatnonzero((st == layout.KV_PENDING) & (rows["owner"] == token)):
            one[0] = int(rows["payload"][k])
            bits = alloc.slot_bits(self.pool, int(one[0]))
            if bits is not None and bits[0]:
                m.slab_mark_freeing(one)
            m.kv_remove(self.table, self.nslots, self.hdr, int(idx[k]))
            if bits is not None and bits[0]:
                alloc.free_slots(self.pool, one, skip=(ValueError,))   # or another reaper did
        # an evictor died: where it had begun freeing the payload (the slot is
        # marked) the entry goes and the free is finished; otherwise the block
        # is published again, untouched (only this node's evictions, or an
        # unknown evictor's)
        for k in np.flatnonzero((st == layout.KV_EVICTING) & mine):
            one[0] = int(rows["payload"][k])
            bits = alloc.slot_bits(self.pool, int(one[0]))
            if bits is not None and bits[0] and bits[2]:
                m.kv_remove(self.table, self.nslots, self.hdr, int(idx[k]))
                alloc.free_slots(self.pool, one, skip=(ValueError,))
            elif bits is None or not bits[0]:
                # the slot is free already (the free was finished elsewhere):
                # the eviction had been committed - never publish a free slot
                m.kv_remove(self.table, self.nslots, self.hdr, int(idx[k]))
            else:
                m.kv_set_state(self.table, self.nslots, idx[k:k + 1],
                               layout.KV_EVICTING, layout.KV_PUBLISHED, 0, 0)
        self.fold_stats(slot)
        self.clear_node(slot)
        me = self.pool.node
        detaching = me is not None and me.slot == slot and me.epoch == epoch
        if len(idx) or not detaching or self.pool in _COUNTS_SUSPECT:
            self.recount()
            _COUNTS_SUSPECT.discard(self.pool)

    def fold_stats(self, slot: int) -> None:
        """Add a node's per-namespace counters into the namespace records."""
        st = self.node_stats(slot)
        for i in np.flatnonzero(st.view("<u8").reshape(self.max_ns, -1).any(axis=1)):
            r = self.ns_record(int(i))
            if r.state != layout.KV_REC_ACTIVE:
                continue
            for f in layout.KV_STAT_NAMES:
                setattr(r.stats, f, getattr(r.stats, f) + int(st[f][i]))
            self.write_record(self.ns_off(int(i)), r)

    def recount(self) -> None:
        """Recompute every derived counter from the table: child counts, live
        and tombstone totals, namespace blocks, tenant usage."""
        m = self.m
        t = self.entries()
        st = t["ctl"] & 0xFF
        live = (st == layout.KV_PENDING) | (st == layout.KV_PUBLISHED) | (st == layout.KV_EVICTING)
        par = t["parent"].astype(np.int64)
        # a parent that is gone (or corrupt) leaves its child a chain root
        dangling = live & (par > 0) & ((par > self.nslots)
                                       | ~live[np.clip(par - 1, 0, self.nslots - 1)])
        par = np.where(dangling, 0, par)
        counts = np.bincount(par[live & (par > 0)] - 1, minlength=self.nslots)
        off = layout.field_offset(layout.HashEntryStruct, "parent")
        for i in np.flatnonzero(live & ((counts != t["children"]) | dangling)):
            w = int(par[i]) | int(counts[i]) << 32
            m.invalidate(self.entry_off(int(i)), 64)
            m.store64(self.entry_off(int(i)) + off, w)
            m.flush(self.entry_off(int(i)), 64)
        self.set_hdr(live=int(live.sum()), tombstones=int((st == layout.KV_TOMBSTONE).sum()))
        ns_blocks = np.bincount(t["ns"][live], minlength=self.max_ns)
        for i, r in enumerate(self.ns_records()):
            if r.state == layout.KV_REC_ACTIVE and r.blocks != ns_blocks[i]:
                r.blocks = int(ns_blocks[i])
                self.write_record(self.ns_off(i), r)
        sizes = self.slot_sizes(t["length"][live])
        ten = t["tenant"][live]
        used = np.bincount(ten, weights=sizes, minlength=self.max_tenants)
        blocks = np.bincount(ten, minlength=self.max_tenants)
        for i, r in enumerate(self.tenant_records()):
            if r.state == layout.KV_REC_ACTIVE and (r.used != used[i] or r.blocks != blocks[i]):
                r.used, r.blocks = int(used[i]), int(blocks[i])
                self.write_record(self.tenant_off(i), r)
        self.m.kv_lru_rebuild()                     # child counts may have changed


@alloc.register_in_use
def _evicting_payloads(pool) -> np.ndarray:
    """Payloads of entries still EVICTING: their frees may have begun (the
    slots marked), but only their evictor's KV recovery may finish them
    (alloc recovery leaves them; see alloc._in_use_hooks)."""
    if not pool.sb.compat & layout.COMPAT_KV or layout.missing_kv_features(pool.sb.incompat):
        return np.zeros(0, dtype=np.uint64)
    try:
        area = Area(pool)
    except CxlkvError:
        return np.zeros(0, dtype=np.uint64)
    idx = area.in_flight()
    pays = []
    for i in idx:
        e = np.frombuffer(area._read(area.entry_off(int(i)), layout.HASH_ENTRY_SIZE),
                          dtype=ENTRY)[0]
        if int(e["ctl"]) & 0xFF == layout.KV_EVICTING:
            pays.append(int(e["payload"]))
    return np.array(pays, dtype=np.uint64)


def _slot_of(token: int) -> int | None:
    return (token & 0xFFFF) - 1 if token else None


def quarantine_report(pool, observer: node_table.Observer | None = None) -> dict:
    """The fenced nodes and what their quarantine keeps from reuse: reserved
    payload slots, unpublished entries, pinned blocks (read only).  With an
    observer that watched them: how long each has been seen fenced."""
    fenced = [n for n in node_table.read_nodes(pool) if n.state == "fenced"]
    tokens = {(n.slot + 1) | n.epoch << 16: n for n in fenced}
    holders = {n.slot for n in node_table.fenced_holders(pool)} if fenced else set()
    ents = protocol.read_entries(pool) if fenced else None
    reserved = alloc.reserved_by_owner(pool, tokens)
    area = None
    if fenced and pool.sb.compat & layout.COMPAT_KV:
        try:
            area = Area(pool)
        except CxlkvError:
            area = None
    t = area.entries() if area is not None else None
    nodes = []
    for token, n in tokens.items():
        slots, nbytes = reserved[token]
        pending = pinned = pinned_bytes = 0
        if area is not None:
            pending = int((((t["ctl"] & 0xFF) == layout.KV_PENDING) & (t["owner"] == token)).sum())
            pins = np.frombuffer(area._read(area.pins_off(n.slot), area.npins * 8), dtype="<u8")
            idx = pins[(pins > 0) & (pins <= area.nslots)].astype(np.int64) - 1
            pinned = int(len(idx))
            pinned_bytes = int(area.slot_sizes(t["length"][idx]).sum()) if pinned else 0
        seen = None
        if observer is not None:
            observer.release_reason(n)          # starts its clock on first sight
            seen = observer.quarantined_for(n)
        nodes.append({"slot": n.slot, "epoch": n.epoch, "hostname": n.hostname, "pid": n.pid,
                      "acknowledged": n.acknowledged, "reserved_slots": slots,
                      # fenced holding the pool lock: recoveries finish no other
                      # node's half-done work until its own
                      "held_pool_lock": n.slot in holders,
                      # the slot of the node it was recovering (which waits for it)
                      "recovering": _slot_of(int(ents["recovering"][n.slot])),
                      "reserved_bytes": nbytes, "pending_entries": pending,
                      "pinned_blocks": pinned, "pinned_bytes": pinned_bytes,
                      "seen_fenced_s": None if seen is None else round(seen, 3)})
    return {"nodes": nodes, "grace_ms": pool.sb.quarantine_grace_ms,
            "bytes": sum(x["reserved_bytes"] + x["pinned_bytes"] for x in nodes)}


def pins_by_node(pool, ns: int | None = None) -> list[dict]:
    """Who pins what: per node that may hold pins (attached, claimed or
    fenced), the distinct KV blocks it pins and their slot bytes - of
    namespace index `ns` only when given.  Read only, no lock: a snapshot of
    each node's pin words (they change as readers come and go), O(nodes x
    pins_per_node).  Sorted by bytes, then blocks, largest first (the top
    holders first); nodes pinning nothing are included with zeros."""
    if not pool.sb.compat & layout.COMPAT_KV or layout.missing_kv_features(pool.sb.incompat):
        return []
    try:
        area = Area(pool)
    except CxlkvError:
        return []
    out = []
    for n in node_table.read_nodes(pool):
        if n.state not in ("attached", "claimed", "fenced"):
            continue
        pins = np.frombuffer(area._read(area.pins_off(n.slot), area.npins * 8), dtype="<u8")
        idx = np.unique(pins[(pins > 0) & (pins <= area.nslots)].astype(np.int64) - 1)
        rows = [area._entry(int(i)) for i in idx]
        if ns is not None:
            rows = [e for e in rows if int(e["ns"]) == ns]
        lengths = np.array([int(e["length"]) for e in rows], dtype=np.int64)
        out.append({"slot": n.slot, "state": n.state, "hostname": n.hostname, "pid": n.pid,
                    "epoch": n.epoch, "pinned_blocks": len(rows),
                    "pinned_bytes": int(area.slot_sizes(lengths).sum()) if len(rows) else 0})
    out.sort(key=lambda x: (-x["pinned_bytes"], -x["pinned_blocks"], x["slot"]))
    return out


def describe_holders(holders: list[dict], top: int = 3) -> str:
    """"node 3 (host-a pid 812): 40 blocks, 10 MiB; ..." for the `top`
    nodes pinning most (those pinning nothing are left out)."""
    busy = [h for h in holders if h["pinned_blocks"]]
    text = ", ".join(f"node {h['slot']} ({h['hostname']} pid {h['pid']}"
                     + (", fenced" if h["state"] == "fenced" else "")
                     + f": {h['pinned_blocks']} blocks, {human_size(h['pinned_bytes'])})"
                     for h in busy[:top])
    return text + (f" and {len(busy) - top} more" if len(busy) > top else "")


@node_table.register_recovery(order=15, part="kv")
def _recover_kv(pool, slot: int, epoch: int) -> None:
    if not pool.sb.compat & layout.COMPAT_KV:
        return
    try:
        area = Area(pool)
    except KVError as e:
        log.warning("KV recovery of node %d skipped: %s", slot, e)
        return
    with held_lock(pool, slot):
        area.recover(slot, epoch)
