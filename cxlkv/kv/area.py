"""The KV region and hash table of one pool: geometry, records, eviction and
recovery.  Everything that writes entries or records here runs under the
pool lock; readers (cxlkv.kv.cache) are lock-free.
"""
from __future__ import annotations

import contextlib
import sys
import time

import numpy as np

from cxlkv.errors import CxlkvError, PoolIncompatible, RefusedError
from cxlkv.pool import layout as L
from cxlkv.state import alloc as A
from cxlkv.state import nodes as N
from cxlkv.state.locks import entry_offset as lock_entry_offset

ENTRY = np.dtype([("ctl", "<u8"), ("key_lo", "<u8"), ("key_hi", "<u8"), ("payload", "<u8"),
                  ("length", "<u4"), ("ns", "<u2"), ("tenant", "<u2"), ("parent", "<u4"),
                  ("children", "<u4"), ("owner", "<u8"), ("lru", "<u8")])
assert ENTRY.itemsize == L.HASH_ENTRY_SIZE
STATS = np.dtype([(n, "<u8") for n in L.KV_STAT_NAMES])
_FREEING = L.field_offset(L.LockEntryStruct, "freeing")
_LRU = L.field_offset(L.HashEntryStruct, "lru")
_HDR = {f: L.field_offset(L.KVHdrStruct, f) for f, *_ in L.KVHdrStruct._fields_}

#: free space (share of the data area) under which store evicts, and up to which
LOW_WATERMARK = 0.05
HIGH_WATERMARK = 0.10


class KVError(CxlkvError):
    exit_code = 1


class KVPoolFull(A.PoolFullError):
    """No room for the blocks even after evicting every unpinned block."""

    kind = "pool-full"


class KVTableFull(RefusedError):
    """The hash table is at its maximum load and nothing can be evicted."""

    kind = "table-full"


class QuotaExceeded(RefusedError):
    kind = "quota"


class TooManyPins(RefusedError):
    kind = "pins"


def now_us() -> int:
    return time.time_ns() // 1000


def stamp() -> int:
    return max(1, now_us())


class Area:
    """Geometry of the KV region of an open pool, and access to its records."""

    def __init__(self, pool):
        sb = pool.sb
        if not sb.compat & L.COMPAT_KV:
            raise PoolIncompatible(
                f"{pool.path} was formatted without a KV region (by cxlkv before 0.2)",
                hint="back up what it holds and re-format it with `cxlkv format --force`")
        self.pool = pool
        self.m = pool.mapping
        self.table, size = sb.regions["hash"]
        self.nslots = sb.hash_slots
        self.max_used = max(1, self.nslots * sb.hash_max_load_pct // 100)
        self.kv_off, kv_size = sb.regions["kv"]
        self.geo = L.kv_geometry(sb.max_nodes, sb.hash_slots)
        self.hdr = self.kv_off
        self.m.invalidate(self.hdr, 64)
        magic = self.m.load64(self.hdr)
        stored = L.KVHdrStruct.from_buffer_copy(self.m.read(self.hdr, L.KV_HDR_SIZE))
        if magic != L.KV_MAGIC or any(getattr(stored, f) != self.geo[f] for f in (
                "max_namespaces", "max_tenants", "pins_per_node", "ring_per_node", "ns_off",
                "tenant_off", "node_off", "node_stride")) or kv_size < self.geo["size"]:
            raise KVError(f"{pool.path}: the KV header is corrupt (magic or geometry)",
                          hint="run `cxlkv fsck` on the pool")
        self.max_ns = self.geo["max_namespaces"]
        self.max_tenants = self.geo["max_tenants"]
        self.npins = self.geo["pins_per_node"]
        self.nring = self.geo["ring_per_node"]
        self.managed = sb.sync == "manager"
        pool.mapping.set_geometry(*A.geometry(pool))      # payload frees go through C
        # manager mode / emulation: flush what we write, invalidate what we read
        self.m.flush_meta = self.managed or self.m.noncoherent

    # -- offsets ----------------------------------------------------------
    def ns_off(self, i: int) -> int:
        return self.kv_off + self.geo["ns_off"] + i * L.KV_NS_SIZE

    def tenant_off(self, i: int) -> int:
        return self.kv_off + self.geo["tenant_off"] + i * L.KV_TENANT_SIZE

    def node_base(self, slot: int) -> int:
        return self.kv_off + self.geo["node_off"] + slot * self.geo["node_stride"]

    def stats_off(self, slot: int, ns: int) -> int:
        return self.node_base(slot) + self.geo["stats_off"] + ns * STATS.itemsize

    def pins_off(self, slot: int) -> int:
        return self.node_base(slot) + self.geo["pins_off"]

    def ring_off(self, slot: int) -> int:
        return self.node_base(slot) + self.geo["ring_off"]

    def entry_off(self, i: int) -> int:
        return self.table + i * L.HASH_ENTRY_SIZE

    # -- reads -------------------------------------------------------------
    def _read(self, off: int, size: int) -> bytes:
        if self.m.flush_meta:
            self.m.invalidate(off, size)
        return self.m.read(off, size)

    def entries(self) -> np.ndarray:
        """A snapshot (copy) of the whole hash table."""
        return np.frombuffer(self._read(self.table, self.nslots * L.HASH_ENTRY_SIZE),
                             dtype=ENTRY)

    def header(self) -> L.KVHdrStruct:
        return L.KVHdrStruct.from_buffer_copy(self._read(self.hdr, L.KV_HDR_SIZE))

    def ns_record(self, i: int) -> L.KVNsStruct:
        return L.KVNsStruct.from_buffer_copy(self._read(self.ns_off(i), L.KV_NS_SIZE))

    def ns_records(self) -> list[L.KVNsStruct]:
        raw = self._read(self.ns_off(0), self.max_ns * L.KV_NS_SIZE)
        return [L.KVNsStruct.from_buffer_copy(raw, i * L.KV_NS_SIZE) for i in range(self.max_ns)]

    def tenant_record(self, i: int) -> L.KVTenantStruct:
        return L.KVTenantStruct.from_buffer_copy(self._read(self.tenant_off(i),
                                                            L.KV_TENANT_SIZE))

    def tenant_records(self) -> list[L.KVTenantStruct]:
        raw = self._read(self.tenant_off(0), self.max_tenants * L.KV_TENANT_SIZE)
        return [L.KVTenantStruct.from_buffer_copy(raw, i * L.KV_TENANT_SIZE)
                for i in range(self.max_tenants)]

    def node_stats(self, slot: int) -> np.ndarray:
        """A node's per-namespace counters, shape (max_ns,) of STATS."""
        return np.frombuffer(self._read(self.stats_off(slot, 0), self.max_ns * STATS.itemsize),
                             dtype=STATS)

    def pinned(self) -> np.ndarray:
        """Entry indices pinned by attached (or attaching) nodes."""
        out = []
        for n in N.read_nodes(self.pool):
            if n.state not in ("attached", "claimed"):
                continue
            p = np.frombuffer(self._read(self.pins_off(n.slot), self.npins * 8), dtype="<u8")
            out.append(p[p != 0] - 1)
        return np.unique(np.concatenate(out)) if out else np.zeros(0, dtype="<u8")

    # -- writes (pool lock held) ------------------------------------------------
    def write_record(self, off: int, rec) -> None:
        self.m.write(off, bytes(rec))

    def set_hdr(self, **fields) -> None:
        for f, v in fields.items():
            self.m.store64(self.hdr + _HDR[f], v)
        self.m.flush(self.hdr + 64, 64)

    def clear_node(self, slot: int) -> None:
        """Zero a node's pins, ring position and stats (the slot is being
        (re)used or was recovered)."""
        base = self.node_base(slot)
        self.m.zero(base, self.geo["node_stride"])

    def drain_rings(self) -> None:
        """Apply every node's recent touches to the entries' LRU stamps."""
        now = stamp()
        for n in N.read_nodes(self.pool):
            if n.state not in ("attached", "claimed"):
                continue
            base = self.node_base(n.slot)
            raw = self._read(base, 128)
            head = int.from_bytes(raw[0:8], "little")
            drained = int.from_bytes(raw[64:72], "little")
            if head == drained:
                continue
            k = min(head - drained, self.nring) if head > drained else 0
            ring = np.frombuffer(self._read(self.ring_off(n.slot), self.nring * 8), dtype="<u8")
            pos = (np.arange(head - k, head) % self.nring) if k else np.zeros(0, dtype=np.int64)
            idx = np.unique(ring[pos]) if k else ring[:0]
            for i in idx[(idx > 0) & (idx <= self.nslots)]:
                self.m.store64(self.entry_off(int(i) - 1) + _LRU, now)
                if self.m.flush_meta:
                    self.m.flush(self.entry_off(int(i) - 1), 64)
            self.m.store64(base + 64, head)
            self.m.flush(base + 64, 8)

    # -- eviction (pool lock held) -------------------------------------------------
    def evict(self, need_bytes: int = 0, need_entries: int = 0, *, tenant: int | None = None,
              ns: int | None = None, everything: bool = False) -> tuple[int, int]:
        """Evict unpinned published leaves, least recently used first, until
        `need_bytes` of slots and `need_entries` entries are free again (or,
        with everything=True, all that match).  Returns (blocks, bytes)."""
        self.drain_rings()
        done_blocks = done_bytes = 0
        while everything or done_bytes < need_bytes or done_blocks < need_entries:
            t = self.entries()
            st = t["ctl"] & 0xFF
            cand = (st == L.KV_PUBLISHED) & (t["children"] == 0)
            if tenant is not None:
                cand &= t["tenant"] == tenant
            if ns is not None:
                cand &= t["ns"] == ns
            idx = np.flatnonzero(cand)
            if len(idx):
                idx = idx[~np.isin(idx, self.pinned())]
            if not len(idx):
                break
            idx = idx[np.argsort(t["lru"][idx], kind="stable")]
            if not everything:
                sizes = self.slot_sizes(t["length"][idx])
                want_b = max(0, need_bytes - done_bytes)
                want_n = max(0, need_entries - done_blocks)
                k = max(int(np.searchsorted(np.cumsum(sizes), want_b)) + 1 if want_b else 0,
                        want_n)
                idx = idx[:max(1, min(k, len(idx)))]
            b, n = self._evict_batch(idx.astype(np.uint64), t)
            if not b:
                break
            done_blocks += b
            done_bytes += n
        return done_blocks, done_bytes

    def _evict_batch(self, idx: np.ndarray, t: np.ndarray) -> tuple[int, int]:
        m = self.m
        m.kv_set_state(self.table, self.nslots, idx, L.KV_PUBLISHED, L.KV_EVICTING, 0, 0)
        pinned = np.isin(idx, self.pinned())          # after the fence in kv_set_state
        if pinned.any():
            m.kv_set_state(self.table, self.nslots, idx[pinned], L.KV_EVICTING,
                           L.KV_PUBLISHED, 0, 0)
        victims = idx[~pinned]
        rec = lock_entry_offset(self.pool, self.pool.node.slot) + _FREEING
        nsd: dict[int, list[int]] = {}
        ten: dict[int, list[int]] = {}
        total = 0
        one = np.zeros(1, dtype=np.uint64)
        for i in victims:
            e = t[int(i)]
            pay = int(e["payload"])
            ss = A.slot_size_for(self.pool, int(e["length"]))
            m.store64(rec, pay)                        # recovery finishes the free
            m.flush(rec, 8)
            m.kv_remove(self.table, self.nslots, self.hdr, int(i))
            from cxlkv._core import CRASH_ENABLED, crashpoint
            if CRASH_ENABLED:
                crashpoint("kv.evict")
            one[0] = pay
            try:
                m.slab_free(one, True, 0)
            except ValueError:
                pass                                    # already free (fsck reports it)
            m.store64(rec, 0)
            m.flush(rec, 8)
            nsd.setdefault(int(e["ns"]), [0, 0])
            nsd[int(e["ns"])][0] += 1
            nsd[int(e["ns"])][1] += int(e["length"])
            ten.setdefault(int(e["tenant"]), [0, 0])
            ten[int(e["tenant"])][0] += 1
            ten[int(e["tenant"])][1] += ss
            total += ss
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
        h = self.header()
        self.set_hdr(evictions=h.evictions + len(victims),
                     evicted_bytes=h.evicted_bytes + sum(v[1] for v in nsd.values()))
        if len(victims):
            self.pool.allocator.release_empty()
        return len(victims), total

    def slot_sizes(self, lengths: np.ndarray) -> np.ndarray:
        """A.slot_size_for over an array of payload lengths (0 stays 0)."""
        lengths = lengths.astype(np.int64)
        smallest = A.slot_size_for(self.pool, 1)
        return np.where(lengths > 0, np.maximum(smallest, -(-lengths // 64) * 64), 0)

    def used_bytes(self) -> int:
        return sum(r.used for r in self.tenant_records() if r.state == L.KV_REC_ACTIVE)

    def data_size(self) -> int:
        return self.pool.sb.regions["data"][1]

    # -- recovery (pool lock held) ------------------------------------------------
    def recover(self, slot: int, epoch: int) -> None:
        """Undo what a dead (or detaching) node left in the KV area."""
        m = self.m
        token = (slot + 1) | epoch << 16
        t = self.entries()
        st = t["ctl"] & 0xFF
        rec = lock_entry_offset(self.pool, slot) + _FREEING
        m.invalidate(rec, 8)
        freeing = m.load64(rec)
        # a lock holder died writing an entry: nothing refers to it yet
        for i in np.flatnonzero(st == L.KV_WRITING):
            m.kv_remove(self.table, self.nslots, self.hdr, int(i))
        # blocks the node reserved and never published: their payloads lie in
        # its own slabs, which nobody allocates from until recovery orphans them
        mine = np.flatnonzero((st == L.KV_PENDING) & (t["owner"] == token))
        one = np.zeros(1, dtype=np.uint64)
        for i in mine:
            bits = A.slot_bits(self.pool, int(t["payload"][i]))
            if bits is not None and bits[0]:
                one[0] = int(t["payload"][i])
                try:
                    m.slab_free(one, True, 0)
                except ValueError:
                    pass
            m.kv_remove(self.table, self.nslots, self.hdr, int(i))
        # an evictor died: the entry whose payload it recorded is gone (the
        # allocator's recovery finishes the free); others go back to published
        ev = np.flatnonzero(st == L.KV_EVICTING)
        for i in ev:
            if freeing and int(t["payload"][i]) == freeing:
                m.kv_remove(self.table, self.nslots, self.hdr, int(i))
            else:
                m.kv_set_state(self.table, self.nslots, np.array([i], dtype=np.uint64),
                               L.KV_EVICTING, L.KV_PUBLISHED, 0, 0)
        if freeing:
            t2 = self.entries()
            live = (t2["ctl"] & 0xFF) != L.KV_EMPTY
            live &= (t2["ctl"] & 0xFF) != L.KV_TOMBSTONE
            if (t2["payload"][live] == freeing).any():
                # freed, then reused by another block: the free is complete
                m.store64(rec, 0)
                m.flush(rec, 8)
        self.fold_stats(slot)
        self.clear_node(slot)
        self.recount()

    def fold_stats(self, slot: int) -> None:
        """Add a node's per-namespace counters into the namespace records."""
        st = self.node_stats(slot)
        for i in np.flatnonzero(st.view("<u8").reshape(self.max_ns, -1).any(axis=1)):
            r = self.ns_record(int(i))
            if r.state != L.KV_REC_ACTIVE:
                continue
            for f in L.KV_STAT_NAMES:
                setattr(r.stats, f, getattr(r.stats, f) + int(st[f][i]))
            self.write_record(self.ns_off(int(i)), r)

    def recount(self) -> None:
        """Recompute every derived counter from the table: child counts, live
        and tombstone totals, namespace blocks, tenant usage."""
        m = self.m
        t = self.entries()
        st = t["ctl"] & 0xFF
        live = (st == L.KV_PENDING) | (st == L.KV_PUBLISHED) | (st == L.KV_EVICTING)
        par = t["parent"][live]
        counts = np.bincount(par[(par > 0) & (par <= self.nslots)].astype(np.int64) - 1,
                             minlength=self.nslots)
        off = L.field_offset(L.HashEntryStruct, "parent")
        for i in np.flatnonzero(live & (counts != t["children"])):
            w = int(t["parent"][i]) | int(counts[i]) << 32
            m.store64(self.entry_off(int(i)) + off, w)
            m.flush(self.entry_off(int(i)), 64)
        self.set_hdr(live=int(live.sum()), tombstones=int((st == L.KV_TOMBSTONE).sum()))
        ns_blocks = np.bincount(t["ns"][live], minlength=self.max_ns)
        for i, r in enumerate(self.ns_records()):
            if r.state == L.KV_REC_ACTIVE and r.blocks != ns_blocks[i]:
                r.blocks = int(ns_blocks[i])
                self.write_record(self.ns_off(i), r)
        sizes = self.slot_sizes(t["length"][live])
        ten = t["tenant"][live]
        used = np.bincount(ten, weights=sizes, minlength=self.max_tenants)
        blocks = np.bincount(ten, minlength=self.max_tenants)
        for i, r in enumerate(self.tenant_records()):
            if r.state == L.KV_REC_ACTIVE and (r.used != used[i] or r.blocks != blocks[i]):
                r.used, r.blocks = int(used[i]), int(blocks[i])
                self.write_record(self.tenant_off(i), r)


@contextlib.contextmanager
def recovery_lock(pool, slot: int):
    """The pool lock for recovering `slot` - taken by this process's own node
    when it has a usable one (see state.alloc's recovery)."""
    node = pool.node
    own = node is not None and node.slot >= 0 and not node.fenced and node.slot != slot
    lock = pool.lock() if own or (node is not None and node.slot == slot
                                   and A._still_attached(pool, node)) else None
    if lock is not None and lock.held_by_me():
        lock = None
    if lock is not None:
        lock.acquire()
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


@N.register_recovery(order=15)
def _recover_kv(pool, slot: int, epoch: int) -> None:
    if not pool.sb.compat & L.COMPAT_KV:
        return
    try:
        area = Area(pool)
    except KVError as e:
        sys.stderr.write(f"cxlkv: KV recovery of node {slot} skipped: {e}\n")
        return
    with recovery_lock(pool, slot):
        area.recover(slot, epoch)
