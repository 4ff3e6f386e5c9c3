"""The pool allocator: a global chunk bitmap plus per-node slabs of exact-size slots.

Segregated fit (as TraCT allocates): a request of n bytes gets a slot of
slot_size = n rounded up to 64 bytes (at least chunk_size / 512).  Slots of
one size live in slabs: runs of contiguous chunks chosen so the slab wastes
as little as possible (a 3 MiB slot in 2 MiB chunks gets a 3-chunk slab with
two slots, not a 2-chunk slab with one).  Each node allocates from its own
slabs with compare-and-swap on the slab's slot bitmap (C hot path), so
allocation and free are O(1) and nodes rarely contend; only creating or
releasing a slab - touching the global bitmap - takes the pool lock.

Ownership lives in the pool: a slab records its owner node token, and each
slot is reserved (alloc bit) or published (alloc + pub bit).  When a node
dies, recovery frees its reserved-but-unpublished slots (zeroed), returns
its empty slabs to the bitmap and orphans the rest, which any node may
adopt.  Freed slots are zeroed, or marked dirty and zeroed before they are
handed out again (zero=False on free: for callers whose next writer
overwrites the whole slot).

Releases and lock-free allocation: any node may release any empty slab
(under the pool lock), while owners take slots from their slabs without it.
An allocator first names the slab in a hazard word of its node's heap header
(L.HeapStruct), then checks the slab is its own; release_slab marks the slab
RELEASING, then refuses while the owner's hazard words name it or any slot is
allocated.  So a slab never changes under an allocator that has checked it,
and a slot bit once set is the allocator's (nothing takes it back); a slot's
holder may publish or free it while a release looks at its slab (RELEASING
goes back to HEAD).

Crash order: a new slab's descriptors are written before its bitmap bits are
set; a released slab's descriptors are cleared before its bits are.  So a
crash leaves at worst descriptors without bits (an owned slab recovery
releases) or bits without descriptors (a leak recovery reclaims).

Costs that do not grow with the pool (pool lock held for all of them):
making a slab searches the chunk bitmap in C (chunk_find_run: next fit from
where this process made its last slab, full bitmap words skipped 64 chunks
at a time, then the k descriptors of the run and the 64 before it checked -
a dead node's half-made slab has a head and no bits), so the descriptor
table is never read whole; the bitmap itself is the free-chunk index, and
nothing is added on media.  Room in this node's slabs comes from a process
hint (slabs made or adopted and not yet found full, and those this
process's frees freed a slot in: slab_free records them), checked against
the descriptors.  release_empty() releases only the slabs this process's
frees emptied since its last call.  What no process here saw - another
node's slabs emptied by its own frees, orphans with room - is found by a
sweep of at most SWEEP_CHUNKS descriptors per pass (cursor going round the
table), run only when no free run is left.  Recovery makes one pass over
the descriptors in C (slab_census) and then works on the slabs concerned
in batches (slabs_release, slabs_set_owner, slab_free).

Descriptors that cannot be right raise MetadataCorrupt (naming
`cxlkv fsck --repair`) before anything is written.
"""
from __future__ import annotations

import contextlib
import ctypes
import re
import threading
import time

import numpy as np

from cxlkv._core import crashpoint, fence
# PoolFullError is public here too (cxlkv.state.alloc, named in the README)
from cxlkv.errors import (AllocError, CxlkvError, MetadataCorrupt, PoolFullError, RetiredSlots,
                          UsageError)
from cxlkv.pool import layout
from cxlkv.state import nodes
from cxlkv.state.locks import entry_offset as lock_entry_offset
from cxlkv.state.locks import guard, held_lock

_DESC = np.dtype([("control", "<u8"), ("owner", "<u8"), ("slot_size", "<u8"),
                  ("nslots", "<u8"), ("nchunks", "<u8"), ("pad", "V24"),
                  ("alloc_bits", "<u8", 8), ("pub_bits", "<u8", 8), ("dirty_bits", "<u8", 8)])
assert _DESC.itemsize == layout.CHUNK_DESC_SIZE

_F = {name: layout.field_offset(layout.ChunkStruct, name) for name,
      *_ in layout.ChunkStruct._fields_}
_FREEING = layout.field_offset(layout.LockEntryStruct, "freeing")
MAX_SLAB_CHUNKS = 64          # slabs.c MAX_SPAN
SWEEP_CHUNKS = 16384          # descriptors one _sweep looks at


def heap_offset(pool, slot: int) -> int:
    """Pool offset of node slot `slot`'s heap header (its hazard words)."""
    return pool.region("heaps")[0] + slot * layout.HEAP_SIZE


def _hazard_on(pool, head: int, owner: int) -> bool:
    """Whether an allocator of the node that owner token `owner` names has
    slab `head` in a hazard word.  Only the owner allocates from a slab
    without the pool lock, so only its hazard words matter."""
    slot = (owner & 0xFFFF) - 1
    if not 0 <= slot < pool.sb.max_nodes:
        return False                          # orphan (0), or no node's token
    m, off = pool.mapping, heap_offset(pool, slot)
    m.invalidate(off, 8 * layout.HEAP_HAZARDS)
    return any(m.load64(off + 8 * i) == head + 1 for i in range(layout.HEAP_HAZARDS))


def clear_hazards(pool, slot: int) -> None:
    """Drop every hazard word of node slot `slot` (its node is gone)."""
    m, off = pool.mapping, heap_offset(pool, slot)
    for i in range(layout.HEAP_HAZARDS):
        m.store64(off + 8 * i, 0)
    m.flush(off, 8 * layout.HEAP_HAZARDS)


def geometry(pool) -> tuple[int, int, int, int]:
    """(data offset, chunk size, nchunks, descriptor table offset)."""
    sb = pool.sb
    heaps_off, _ = pool.region("heaps")
    return (pool.region("data")[0], sb.chunk_size, sb.nchunks,
            heaps_off + sb.max_nodes * layout.HEAP_SIZE)


def descriptors(pool) -> np.ndarray:
    """The chunk descriptor table as a numpy view of pool memory (zero-copy)."""
    _, _, n, base = geometry(pool)
    pool.mapping.invalidate(base, n * layout.CHUNK_DESC_SIZE)
    return np.frombuffer(pool.mapping.view(base, n * layout.CHUNK_DESC_SIZE), dtype=_DESC)


def used_slots(d: np.ndarray, idx: np.ndarray | None = None) -> np.ndarray:
    """Allocated slots per descriptor (popcount of its alloc bitmap), for all
    descriptors or only those at `idx` (cheaper on big pools)."""
    words = d["alloc_bits"] if idx is None else d["alloc_bits"][idx]
    if hasattr(np, "bitwise_count"):                     # numpy >= 2
        return np.bitwise_count(words).sum(axis=1, dtype=np.int64)
    bits = np.ascontiguousarray(words).view(np.uint8).reshape(len(words), 64)
    return np.unpackbits(bits, axis=1).sum(axis=1)


def bitmap(pool) -> np.ndarray:
    """The global chunk bitmap as a bool array (True = in a slab)."""
    off, _ = pool.region("bitmap")
    n = pool.sb.nchunks
    nbytes = (n + 7) // 8
    pool.mapping.invalidate(off, nbytes)
    raw = np.frombuffer(pool.mapping.read(off, nbytes), dtype=np.uint8)
    return np.unpackbits(raw, bitorder="little")[:n].astype(bool)


def slot_bits(pool, off: int) -> tuple[bool, bool, bool] | None:
    """(allocated, published, dirty) of the slot at pool offset `off`, or None
    when `off` is not the start of a slot in a slab."""
    data_off, chunk, nchunks, base = geometry(pool)
    if not data_off <= off < data_off + chunk * nchunks:
        return None
    m = pool.mapping
    idx = (off - data_off) // chunk
    m.invalidate(base + idx * layout.CHUNK_DESC_SIZE, layout.CHUNK_DESC_SIZE)
    ctl = m.load64(base + idx * layout.CHUNK_DESC_SIZE)
    head = ctl >> 8 if ctl & 0xFF == layout.CHUNK_TAIL else idx
    if head > idx:                                  # corrupt tail
        return None
    h = base + head * layout.CHUNK_DESC_SIZE
    m.invalidate(h, layout.CHUNK_DESC_SIZE)
    if m.load64(h) & 0xFF != layout.CHUNK_HEAD:
        return None
    ss, ns = m.load64(h + _F["slot_size"]), m.load64(h + _F["nslots"])
    rel = off - (data_off + head * chunk)
    if not ss or rel % ss or rel // ss >= min(ns, layout.SLAB_MAX_SLOTS):
        return None
    i = rel // ss
    w, b = i // 64, 1 << (i % 64)
    return tuple(bool(m.load64(h + _F[f] + 8 * w) & b)
                 for f in ("alloc_bits", "pub_bits", "dirty_bits"))


def slot_size_for(pool, nbytes: int) -> int:
    """The slot size a request of nbytes gets; UsageError for nbytes <= 0."""
    if nbytes <= 0:
        raise UsageError(f"cannot allocate {nbytes} bytes")
    min_slot = max(64, -(-pool.sb.chunk_size // layout.SLAB_MAX_SLOTS))
    min_slot = -(-min_slot // 64) * 64
    return max(min_slot, -(-nbytes // 64) * 64)


def slab_shape(chunk: int, slot: int, max_chunks: int) -> tuple[int, int]:
    """(chunks, slots) of the slab that wastes least for this slot size."""
    best = None
    kmin = max(1, -(-slot // chunk))
    for k in range(kmin, min(max_chunks, max(kmin * 4, 8), MAX_SLAB_CHUNKS) + 1):
        n = min(k * chunk // slot, layout.SLAB_MAX_SLOTS)
        if n == 0:
            continue
        waste = (k * chunk - n * slot) / (k * chunk)
        if best is None or waste < best[0] - 1e-9:
            best = (waste, k, n)
        if waste == 0:
            break
    if best is None:
        raise PoolFullError(f"a slot of {slot} bytes does not fit in this pool")
    return best[1], best[2]


def head_spans(d: np.ndarray, releasing: bool = True) -> np.ndarray:
    """Chunks covered by a slab head's run (made, half made or - releasing=True -
    being released).  A full-table computation: the reference chunk_find_run
    is tested against, not used on any allocation path."""
    n = len(d)
    kind = d["control"] & 0xFF
    heads = np.flatnonzero((kind == layout.CHUNK_HEAD)
                           | (releasing & (kind == layout.CHUNK_RELEASING)))
    cover = np.zeros(n + 1, dtype=np.int64)
    if len(heads):
        k = np.clip(d["nchunks"][heads].astype(np.int64), 1, None)
        np.add.at(cover, heads, 1)
        np.add.at(cover, np.minimum(heads + k, n), -1)
    return np.cumsum(cover[:n]) > 0


def _find_run(free: np.ndarray, k: int) -> int:
    """Index of the first run of k True values, or -1 (the full-scan reference
    of chunk_find_run, for tests)."""
    if k == 1:
        idx = np.flatnonzero(free)
        return int(idx[0]) if len(idx) else -1
    c = np.concatenate(([0], np.cumsum(free, dtype=np.int64)))
    ok = np.flatnonzero(c[k:] - c[:-k] == k)
    return int(ok[0]) if len(ok) else -1


class Allocator:
    """One attached node's view of the allocator (pool.alloc / pool.free)."""

    def __init__(self, pool):
        if pool.node is None:
            raise CxlkvError("allocation needs an attached node: use cxlkv.open_pool()")
        self.pool = pool
        self.m = pool.mapping
        self.data_off, self.chunk, self.nchunks, self.desc_base = geometry(pool)
        self.m.set_geometry(self.data_off, self.chunk, self.nchunks, self.desc_base)
        self.m.flush_meta = pool.sb.sync == "manager" or self.m.noncoherent
        # manager mode: no cross-host atomics, so every allocator step runs
        # under the pool lock (with invalidate before and flush after)
        self.managed = pool.sb.sync == "manager"
        self.token = pool.node.owner_token
        # cas mode: this node's hazard words (manager mode allocates under the lock)
        self.heap = 0 if self.managed else heap_offset(pool, pool.node.slot)
        self.bitmap_off = pool.region("bitmap")[0]
        self.heaps_off = pool.region("heaps")[0]
        self._current: dict[int, int] = {}      # slot size -> head chunk of the slab in use
        # slot size -> slabs of this node that may have room (made or adopted
        # and not yet found full, or freed in since): a hint, each checked
        # against its descriptor before use (process memory, pool lock)
        self._mine: dict[int, set[int]] = {}
        self._hint = 0                          # next fit: the chunk after the last slab made
        self._sweep_at = 0                      # where the next _sweep starts
        self._spare: dict[int, list[int]] = {}  # slot size -> slabs made ahead for a batch
        self._slow = threading.Lock()
        self._tls = threading.local()           # per-thread scratch (_scratch)
        # the retired-chunk list as last read: (entry count, chunk indices)
        self._retired: tuple[int, np.ndarray] = (0, np.zeros(0, dtype=np.int64))
        self._bc_off = _badlist_off(pool)

    # -- public ----------------------------------------------------------------
    def _locked(self):
        """The pool lock, unless this thread holds it already."""
        lk = self.pool.lock()
        return contextlib.nullcontext() if lk.held_by_me() else lk

    def alloc(self, nbytes: int, zero: bool = True) -> int:
        """Reserve a slot of at least nbytes; returns its pool offset.

        zero=False: the caller overwrites the whole slot before anyone reads it
        (a dirty slot is then not zeroed first).
        """
        if self.managed:
            with self._locked():
                return int(self.alloc_batch(nbytes, 1, zero)[0])
        ss = slot_size_for(self.pool, nbytes)
        head = self._current.get(ss)
        if head is not None:
            one = self._scratch()
            if self._slab_alloc(head, one, 1, zero, ss) == 1:
                return int(one[0])
        return int(self.alloc_batch(nbytes, 1, zero)[0])

    def alloc_batch(self, nbytes: int, count: int, zero: bool = True) -> np.ndarray:
        """Reserve `count` slots of one size; returns a uint64 array of offsets.

        All or nothing: on PoolFullError the slots taken so far are freed.
        """
        if self.managed and not self.pool.lock().held_by_me():
            with self.pool.lock():
                return self.alloc_batch(nbytes, count, zero)
        ss = slot_size_for(self.pool, nbytes)
        out = np.empty(count, dtype=np.uint64)
        got = 0
        try:
            while got < count:
                head = self._current.get(ss)
                if head is not None:
                    r = self._slab_alloc(head, out[got:], count - got, zero, ss)
                    if r > 0:
                        got += r
                        continue
                with self._slow:
                    if self._current.get(ss) == head:
                        spare = self._spare.get(ss)
                        self._current[ss] = spare.pop() if spare else \
                            self._find_slab(ss, count - got)
        except BaseException:
            if got:
                self.free_batch(out[:got], True)
            raise
        return out

    def _slab_alloc(self, head: int, out: np.ndarray, count: int, zero: bool, ss: int) -> int:
        """Slots from slab `head` (see Mapping.slab_alloc): -1 when the slab is
        not this node's active slab of size ss."""
        try:
            r = self.m.slab_alloc(head, self.token, out, count, zero, ss, self.heap)
            if r == -2:             # other threads of this node hold every hazard word
                with self._locked():
                    r = self.m.slab_alloc(head, self.token, out, count, zero, ss, 0)
        except MetadataCorrupt as e:
            raise self._corrupt(e) from None
        return r

    def _corrupt(self, e: MetadataCorrupt) -> MetadataCorrupt:
        return MetadataCorrupt(f"{self.pool.path}: {e}", path=self.pool.path)

    def free(self, offset: int, zero: bool = True) -> None:
        one = self._scratch()
        one[0] = offset
        self.free_batch(one, zero)

    def _scratch(self) -> np.ndarray:
        """A one-slot buffer of the calling thread (threads of a node must not
        share one: each call's result lives there until it returns)."""
        try:
            return self._tls.one
        except AttributeError:
            self._tls.one = np.empty(1, dtype=np.uint64)
            return self._tls.one

    def free_batch(self, offsets, zero: bool = True) -> int:
        """Free slots (any node's).  zero=True zeroes them now; False marks them
        dirty (zeroed before reuse unless the next owner overwrites them).

        Slots in this node's slabs are freed without the pool lock; slots in
        other slabs (orphaned, or another node's) under it, so recovery never
        races with a half-done free there."""
        arr = np.ascontiguousarray(np.atleast_1d(offsets), dtype=np.uint64)
        if self.managed and not self.pool.lock().held_by_me():
            with self.pool.lock():
                return self.free_batch(arr, zero)
        done = 0
        try:
            while done < len(arr):
                n = self.m.slab_free(arr[done:], zero, self.token)
                done += n
                if done < len(arr):
                    # a slot in a slab not ours, or the write deadline passed
                    # (a stall): prove this node fresh, then go on - in our
                    # own slabs without the lock, in another's under it
                    self.pool.node.guard()
                    if n == 0:
                        with self._locked():
                            done += self._free_foreign(int(arr[done]), zero)
        except MetadataCorrupt as e:
            raise self._corrupt(e) from None
        except ValueError as e:
            raise AllocError(str(e)) from None
        return done

    def _free_foreign(self, offset: int, zero: bool) -> int:
        """Free a slot in a slab this node does not own (caller holds the lock).

        The slot is recorded in our lock entry first, so that if we die half
        way the reaper finishes the free (the slab's owner may be alive and
        would not know)."""
        rec = lock_entry_offset(self.pool, self.pool.node.slot) + _FREEING
        one = np.array([offset], dtype=np.uint64)
        self.m.store64(rec, offset)
        self.m.flush(rec, 8)
        try:
            self.m.slab_mark_freeing(one)          # recovery finishes marked slots only
            while not self.m.slab_free(one, zero, 0):
                self.pool.node.guard()             # stopped at the write deadline
            return 1
        finally:
            self.m.store64(rec, 0)
            self.m.flush(rec, 8)

    def _retired_entries(self) -> int:
        """The retired-chunk list's entry count, read from the pool (0: no
        list) - the store path's check, so three C calls and nothing else."""
        m, off = self.m, self._bc_off
        m.invalidate(off, 16)
        if m.load64(off) != layout.BADCHUNK_MAGIC:
            return 0
        return m.load64(off + _BC_COUNT) & 0xFFFF_FFFF

    def retired_mask(self, offsets) -> np.ndarray:
        """Which of these slot offsets lie in a retired (poisoned) chunk: one
        read of the list's entry count from the pool, the list itself read
        again only when the count changed (it only grows)."""
        arr = np.atleast_1d(np.asarray(offsets, dtype=np.uint64))
        n = self._retired_entries()
        if not n:
            return np.zeros(len(arr), dtype=bool)
        if n != self._retired[0]:
            self._retired = (n, retired_chunks(self.pool))
        chunks = (arr.astype(np.int64) - self.data_off) // self.chunk
        return np.isin(chunks, self._retired[1])

    def check_retired(self, offsets) -> None:
        """Raise RetiredSlots if any reserved slot lies in a retired chunk
        (quarantine retired it after the slot was handed out)."""
        if not self._retired_entries():
            return                              # no list, or an empty one: the common case
        arr = np.atleast_1d(np.asarray(offsets, dtype=np.uint64))
        bad = self.retired_mask(arr)
        if bad.any():
            raise RetiredSlots(f"{self.pool.path}: {int(bad.sum())} reserved slot(s) lie in "
                               "chunks retired for poison since they were handed out",
                               arr[bad], path=self.pool.path)

    def publish(self, offsets) -> int:
        """Mark reserved slots published: they survive this node's death.

        A slot in a chunk retired since it was reserved is refused
        (RetiredSlots, nothing published): KV stores publish under the pool
        lock, which quarantine holds from the retirement to the eviction of
        the blocks on the range, so a block is either seen and evicted by
        the quarantine or refused here."""
        arr = np.ascontiguousarray(np.atleast_1d(offsets), dtype=np.uint64)
        if self.managed and not self.pool.lock().held_by_me():
            with self.pool.lock():
                return self.publish(arr)
        self.pool.node.guard()             # a fenced node publishes nothing
        return self.publish_guarded(arr)

    def publish_guarded(self, arr: np.ndarray) -> int:
        """publish() for a caller that holds the pool lock and has just
        proved this node fresh (guard()) in the same hold, inside a section
        in flight (Attachment.enter): `arr` a contiguous uint64 array."""
        self.check_retired(arr)
        try:
            return self.m.slab_publish(arr)
        except MetadataCorrupt as e:
            raise self._corrupt(e) from None
        except ValueError as e:
            raise AllocError(str(e)) from None

    # -- slow path (pool lock) ---------------------------------------------------
    # Nothing here reads the whole descriptor table: a new slab's chunks come
    # from the bitmap through chunk_find_run (C, next fit from a hint, full
    # bitmap words skipped 64 chunks at a time), room in slabs of this node
    # from self._mine (checked against their descriptors), empty slabs from
    # what this process's frees emptied (slab_take_emptied), and everything
    # else - other nodes' empty slabs, orphans to adopt - from a sweep of at
    # most SWEEP_CHUNKS descriptors per call whose cursor goes round the table.
    def _find_slab(self, ss: int, want: int = 1) -> int:
        """A slab with room for slots of size ss (pool lock).  For a batch
        needing `want` more slots, the further slabs it will need are made in
        the same lock hold and kept for it."""
        self.pool.node.guard()
        with self._locked():
            head = self._reuse(None, ss)
            if head < 0:
                head = self._new_slab(None, ss)
            if head < 0 and self.release_empty():
                head = self._new_slab(None, ss)
            if head < 0:
                head = self._sweep(ss)
                if head < 0:
                    head = self._new_slab(None, ss)
            if head >= 0 and want > 1:
                per = self.m.load64(self.desc_base + head * layout.CHUNK_DESC_SIZE + _F["nslots"])
                more = []
                for _ in range(min(64, -(-want // max(1, per)) - 1)):
                    h = self._new_slab(None, ss)
                    if h < 0:
                        break
                    more.append(h)
                if more:
                    self._spare.setdefault(ss, []).extend(reversed(more))
        if head < 0:
            raise PoolFullError(
                f"{self.pool.path}: pool full: no room for a {ss}-byte slot "
                f"({self.nchunks} chunks of {self.chunk} bytes, all in use)",
                path=self.pool.path, hint="free or evict blocks, or use a larger pool")
        return head

    def _reuse(self, d, ss: int) -> int:
        """A slab of this node's of size ss with room, other than the one in
        use, which the caller found full (pool lock).  self._mine holds the
        slabs of ours that may have room: those made or adopted and not yet
        found full, and those this process's frees freed a slot in since
        (slab_take_emptied(True)); each is checked against its descriptor, and
        those that are full or no longer ours drop out.  `d` is unused."""
        raw, _ = self.m.slab_take_emptied(True)
        if raw:
            freed = np.array(sorted(set(np.frombuffer(raw, dtype=np.uint64).tolist())),
                             dtype=np.int64)
            rows = self._rows(freed)
            ours = (((rows["control"] & 0xFF) == layout.CHUNK_HEAD) & (rows["owner"] == self.token))
            for h, size in zip(freed[ours].tolist(), rows["slot_size"][ours].tolist()):
                self._mine.setdefault(int(size), set()).add(h)
        mine = self._mine.get(ss)
        if not mine:
            return -1
        cur = self._current.get(ss)
        mine.discard(cur)
        idx = np.fromiter(mine, dtype=np.int64, count=len(mine))
        if not len(idx):
            return -1
        rows = self._rows(idx)
        room = (((rows["control"] & 0xFF) == layout.CHUNK_HEAD) & (rows["owner"] == self.token)
                & (rows["slot_size"] == ss) & (used_slots(rows) < rows["nslots"]))
        mine.difference_update(idx[~room].tolist())
        hit = np.flatnonzero(room)
        return int(idx[hit[0]]) if len(hit) else -1

    def _rows(self, idx: np.ndarray) -> np.ndarray:
        return desc_rows(self.pool, idx)

    def _sweep(self, ss: int) -> int:
        """Look at the next SWEEP_CHUNKS descriptors (pool lock): release the
        empty slabs there (any node's), note slabs of ours with room (other
        nodes' frees made it), and adopt an orphan of size ss with room if
        there is one (-> its head, else -1).  A pool of at most
        SWEEP_CHUNKS chunks is swept whole every call."""
        lo = self._sweep_at if self._sweep_at < self.nchunks else 0
        hi = min(self.nchunks, lo + SWEEP_CHUNKS)
        self._sweep_at = hi
        base = self.desc_base + lo * layout.CHUNK_DESC_SIZE
        if self.m.flush_meta:
            self.m.invalidate(base, (hi - lo) * layout.CHUNK_DESC_SIZE)
        view = self.m.view(base, (hi - lo) * layout.CHUNK_DESC_SIZE)
        try:
            d = np.frombuffer(view, dtype=_DESC)
            heads = np.flatnonzero((d["control"] & 0xFF) == layout.CHUNK_HEAD)
            used = used_slots(d, heads)
            empty = heads[used == 0] + lo
            some = (used > 0) & (used < d["nslots"][heads])
            room = heads[some & (d["owner"][heads] == 0) & (d["slot_size"][heads] == ss)] + lo
            mine = some & (d["owner"][heads] == self.token)
            for h, size in zip((heads[mine] + lo).tolist(), d["slot_size"][heads[mine]].tolist()):
                self._mine.setdefault(int(size), set()).add(h)   # room others' frees made
        finally:
            del d, view
        self._release(empty)
        for h in room:
            one = np.array([h], dtype=np.uint64)
            if self.m.slabs_set_owner(one, 0, self.token):
                self._mine.setdefault(ss, set()).add(int(h))
                return int(h)
        return -1

    def _new_slab(self, d, ss: int) -> int:
        """Make a slab of size ss in the first free run of chunks from the
        next-fit hint (pool lock; one C call: Mapping.slab_make writes the
        head, the tails and the bitmap in the order recovery relies on); -1
        when there is none.  `d` is unused."""
        k, nslots = slab_shape(self.chunk, ss, self.nchunks)
        while (head := self.m.slab_make(self.bitmap_off, k, self._hint, self.token, ss,
                                        nslots)) == -2:
            self.pool.node.guard()          # stalled in the search: fresh again, or fenced
        if head < 0:
            return -1
        self._hint = head + k if head + k < self.nchunks else 0
        self._mine.setdefault(ss, set()).add(head)
        return head

    def release_empty(self) -> int:
        """Return to the bitmap the slabs this process's frees emptied since
        the last call (pool lock held) - whichever node owns them: after an
        evictor freed slots in other nodes' slabs, their chunks serve any size.
        Costs what was freed, not the pool's size (slab_free records the slabs
        it empties); if that record overflowed, a sweep stands in."""
        raw, overflow = self.m.slab_take_emptied()
        heads = np.frombuffer(raw, dtype=np.uint64)    # repeats: released once, then refused
        n = self._release(heads)
        if overflow:
            self._sweep(0)
        return n

    def _release(self, heads: np.ndarray) -> int:
        """Release the empty slabs among `heads` (release_slab's protocol, in
        C; pool lock held): any node's, and safe for a slab another thread or
        node is allocating from (the RELEASING/hazard check makes exactly one
        of them back off)."""
        if not len(heads):
            return 0
        arr = np.array(heads, dtype=np.uint64)
        gone: set[int] = set()
        try:
            while len(arr):
                self.pool.node.guard()           # stops here once fenced
                n, seen = self.m.slabs_release(arr, self.bitmap_off, self.heaps_off,
                                               self.pool.sb.max_nodes)
                gone.update(arr[:n].tolist())
                arr = arr[seen:].copy()
        except MetadataCorrupt as e:
            raise self._corrupt(e) from None
        n = len(gone)
        if n:
            keep_retired(self.pool)
        for ss, h in list(self._current.items()):
            if h in gone:
                del self._current[ss]
        for s in self._mine.values():
            s.difference_update(gone)
        return n


def set_bits(pool, first: int, count: int, value: bool) -> None:
    """Set or clear bitmap bits [first, first+count) with atomic word updates."""
    off, _ = pool.region("bitmap")
    m = pool.mapping
    i = first
    while i < first + count:
        w = i // 64
        lo, hi = i % 64, min(64, first + count - w * 64)
        mask = ((1 << (hi - lo)) - 1) << lo
        woff = off + w * 8
        m.invalidate(woff, 8)
        cur = m.load64(woff)
        # only pool-lock holders change the bitmap: a retry means a word
        # changing under the lock, which a few tries cannot outlast
        for _ in range(64):
            new = cur | mask if value else cur & ~mask & 0xFFFFFFFFFFFFFFFF
            old = m.cas64(woff, cur, new)
            if old == cur:
                break
            cur = old
        else:
            raise MetadataCorrupt(f"{pool.path}: chunk bitmap word {w} keeps changing under "
                                  "the pool lock", path=pool.path)
        i = w * 64 + hi
    m.flush(off + first // 64 * 8, ((first + count + 63) // 64 - first // 64) * 8)


def release_slab(pool, head: int, *, resume: bool = False) -> bool:
    """Return an empty slab's chunks to the bitmap (caller holds the pool lock).

    Refused (False) while any slot is allocated or the owner's allocator has
    the slab in a hazard word: allocators set their hazard, then check the
    slab is a HEAD; we set RELEASING, then check hazards and bits.
    resume=True finishes a release a dead lock holder left half done.
    Raises MetadataCorrupt for a slab of impossible geometry (a release
    could clear chunks that are not its own).
    """
    data_off, chunk, nchunks, base = geometry(pool)
    m = pool.mapping
    h = base + head * layout.CHUNK_DESC_SIZE
    if not (resume and m.load64(h) & 0xFF == layout.CHUNK_RELEASING):
        m.invalidate(h, layout.CHUNK_DESC_SIZE)
        d = np.frombuffer(m.read(h, layout.CHUNK_DESC_SIZE), dtype=_DESC)
        if m.load64(h) & 0xFF == layout.CHUNK_HEAD and not _geometry_ok(d[0], head, nchunks, chunk):
            raise MetadataCorrupt(
                f"{pool.path}: chunk {head}: slab descriptor is corrupt (slot "
                f"{int(d['slot_size'][0])} x {int(d['nslots'][0])} in "
                f"{int(d['nchunks'][0])} chunks)", path=pool.path)
        if m.cas64(h, layout.CHUNK_HEAD, layout.CHUNK_RELEASING) != layout.CHUNK_HEAD:
            return False
    fence()                 # RELEASING is visible before the hazards are read
    m.flush(h, 8)
    crashpoint("release.releasing")
    m.invalidate(h, layout.CHUNK_DESC_SIZE)
    if _hazard_on(pool, head, m.load64(h + _F["owner"])) or any(m.read(h + _F["alloc_bits"], 64)):
        m.store64(h, layout.CHUNK_HEAD)
        m.flush(h, 8)
        return False
    k = max(1, min(m.load64(h + _F["nchunks"]), nchunks - head))
    # only this slab's own tails: a chunk in the span may already belong to
    # someone else if this slab was never finished
    ours = [i for i in range(head + 1, head + k)
            if m.load64(base + i * layout.CHUNK_DESC_SIZE) == layout.CHUNK_TAIL | head << 8]
    if any(m.read(h + _F["dirty_bits"], 64)):
        for i in [head] + ours:                  # stale bytes never outlive a slab
            m.zero(data_off + i * chunk, chunk)
    for i in reversed(ours):
        m.store64(base + i * layout.CHUNK_DESC_SIZE, layout.CHUNK_FREE)
    m.flush(h, k * layout.CHUNK_DESC_SIZE)
    crashpoint("release.tails")
    m.zero(h + 8, layout.CHUNK_DESC_SIZE - 8)
    m.store64(h, layout.CHUNK_FREE)
    m.flush(h, 8)
    crashpoint("release.head")
    for i in [head] + ours:
        set_bits(pool, i, 1, False)
    keep_retired(pool)
    return True


def _geometry_ok(desc, i: int, nchunks: int, chunk: int) -> bool:
    """Whether one descriptor (a _DESC record) at chunk i has a possible slab geometry."""
    ss, ns, nc = int(desc["slot_size"]), int(desc["nslots"]), int(desc["nchunks"])
    return bool(ss and ss % 64 == 0 and 0 < ns <= layout.SLAB_MAX_SLOTS and 0 < nc
                and i + nc <= nchunks and ns * ss <= nc * chunk)


@nodes.register_recovery(order=20, part="alloc")
def _recover_allocations(pool, slot: int, epoch: int) -> None:
    """What a dead node left in the allocator, under the pool lock:
    its hazard words are dropped, its unpublished slots freed (zeroed), its
    empty slabs released, the rest orphaned (any node may adopt them); then
    whatever a dead lock holder left half done - a release, tails without a
    head, bits without a slab.  Slabs of impossible geometry are left for
    fsck to report."""
    token = (slot + 1) | epoch << 16
    pool.mapping.flush_meta = pool.sb.sync == "manager" or pool.mapping.noncoherent
    with held_lock(pool, slot):
        data_off, chunk, nchunks, base = geometry(pool)
        pool.mapping.set_geometry(data_off, chunk, nchunks, base)
        m = pool.mapping
        clear_hazards(pool, slot)
        rec = lock_entry_offset(pool, slot) + _FREEING
        m.invalidate(rec, 8)
        freeing = m.load64(rec)
        if freeing:                         # died freeing a slot in someone else's slab
            bits = slot_bits(pool, freeing)
            # the free had begun (the slot is marked dirty) and not finished;
            # a slot freed and handed out again has its dirty bit clear, and
            # one whose free had not begun is still live data
            if bits is not None and bits[0] and bits[2]:
                # (not allocated by then: the free had got as far as the alloc bit)
                free_slots(pool, [freeing])
            m.store64(rec, 0)
            m.flush(rec, 8)
        live = live_tokens(pool)
        releasing, mine, interrupted, dangling, leaked, empty = census(pool, token, live)
        # a node fenced holding the pool lock may still be finishing what it
        # left half done (a release, a free): only this node's own things then
        others = not nodes.fenced_holders(pool, but=slot)
        if not others:
            releasing, empty = releasing[:0], empty[:0]
        for head in releasing:                  # only a dead lock holder leaves these
            if not release_slab(pool, int(head), resume=True) and \
                    m.load64(base + int(head) * layout.CHUNK_DESC_SIZE + _F["owner"]) == token:
                mine = np.append(mine, head)    # back to HEAD: slots remain
        rows = desc_rows(pool, mine)            # a copy: what the dead node left
        ok = _geometry_ok_all(rows, np.arange(len(mine)), nchunks - mine, chunk)
        mine, rows = mine[ok], rows[ok]         # corrupt: left for fsck to report
        guard(pool)
        # unpublished, or published but being freed (dirty): not data any more
        gone = rows["alloc_bits"] & (~rows["pub_bits"] | rows["dirty_bits"])
        if not others:          # a begun free may be that node's (its `freeing`): it waits
            gone &= ~rows["dirty_bits"]
        offs = _slot_offsets(rows, mine, gone, data_off, chunk)
        held = _held_elsewhere(pool)
        if len(held) and len(offs):
            offs = offs[~np.isin(offs, held)]       # another evictor's, still EVICTING
        if len(offs):
            free_slots(pool, offs)
        m.slabs_set_owner(mine.astype(np.uint64), token, 0)
        # refused while published slots remain; with them, what this process's
        # frees emptied (a detaching node's last frees in orphans, say), and
        # every empty slab no live node owns (orphans emptied by nodes that
        # died before releasing them: nobody else would, short of a sweep)
        raw, _ = m.slab_take_emptied()
        _release_batch(pool, np.concatenate((mine.astype(np.uint64),
                                             np.frombuffer(raw, dtype=np.uint64),
                                             empty.astype(np.uint64))))
        if others:
            finish_interrupted_frees(pool, live, heads=interrupted)
            repair_dangling(pool, dangling=dangling, leaked=leaked)


def census(pool, token: int = 0, live=()) -> tuple[np.ndarray, ...]:
    """(releasing, mine, interrupted, dangling, leaked, empty) chunk indices
    from one pass over the descriptor table in C (Mapping.slab_census):
    RELEASING heads; HEADs owned by `token`; HEADs owned by no token in
    `live` with a slot both allocated and dirty; TAILs in no head's span;
    bitmap bits over FREE descriptors; HEADs owned by no token in `live` with
    no slot allocated.  Pool lock held (or no node attached)."""
    m = pool.mapping
    m.set_geometry(*geometry(pool))
    raw = m.slab_census(pool.region("bitmap")[0], token,
                        np.array(sorted(live), dtype=np.uint64))
    out = [np.frombuffer(b, dtype=np.uint64).astype(np.int64) for b in raw]
    if len(out[4]):
        out[4] = out[4][~np.isin(out[4], retired_chunks(pool))]   # retired: not leaked
    return tuple(out)


def desc_rows(pool, idx: np.ndarray) -> np.ndarray:
    """A copy of the descriptors at chunk indices idx, each invalidated first
    where other hosts' writes need it (manager mode, non-coherent memory)."""
    _, _, n, base = geometry(pool)
    m = pool.mapping
    if m.flush_meta or m.noncoherent:
        for h in idx:
            m.invalidate(base + int(h) * layout.CHUNK_DESC_SIZE, layout.CHUNK_DESC_SIZE)
    view = m.view(base, n * layout.CHUNK_DESC_SIZE)
    try:
        return np.frombuffer(view, dtype=_DESC)[np.asarray(idx, dtype=np.int64)]
    finally:
        del view


#: callables (pool) -> payload offsets that recovery must not free although
#: their slots are marked: frees an evictor began whose entries still say
#: EVICTING (cxlkv.kv.area registers one).  Finishing such a free is the KV
#: recovery of that evictor's node (it removes the entry first); freed here,
#: a slot could be handed out again under an entry that goes back to PUBLISHED.
_in_use_hooks: list = []


def register_in_use(fn):
    """Register a (pool) -> offsets callable (see _in_use_hooks).  A decorator."""
    if fn not in _in_use_hooks:
        _in_use_hooks.append(fn)
    return fn


def _held_elsewhere(pool) -> np.ndarray:
    got = [np.asarray(fn(pool), dtype=np.uint64) for fn in _in_use_hooks]
    return np.concatenate(got) if got else np.zeros(0, dtype=np.uint64)


def free_slots(pool, offsets, *, skip: tuple = (MetadataCorrupt, ValueError)) -> int:
    """Free slots of any slab, zeroed (pool lock held, or no node attached):
    for recovery, repairs and evictions.  slab_free stops once this node's
    write deadline has passed (a stall: see Mapping.slab_free); guard()
    then proves the node fresh again, and the rest is freed, or raises
    NodeFenced and nothing more is.  A slot that raises one of `skip` is
    skipped: ValueError, not allocated (freed meanwhile by another reaper);
    MetadataCorrupt, impossible descriptors (left for fsck to report).
    Returns the slots freed."""
    m = pool.mapping
    arr = np.ascontiguousarray(np.atleast_1d(offsets), dtype=np.uint64)
    done = freed = 0
    while done < len(arr):
        try:
            n = m.slab_free(arr[done:], True, 0)
        except skip as e:
            # slab_free names the bad one's place in what it was given: skip it
            n = int(re.search(r"\(item (\d+)\)", str(e)).group(1))
            done += n + 1
            freed += n
            continue
        done += n
        freed += n
        if done < len(arr):
            guard(pool)                     # stopped at the write deadline
    return freed


def _geometry_ok_all(d: np.ndarray, idx: np.ndarray, nchunks, chunk: int) -> np.ndarray:
    """_geometry_ok for the descriptors d[idx], vectorised (a bool mask);
    nchunks: the chunks from each one's index to the end of the pool (an
    int, minus idx, or an array)."""
    ss = d["slot_size"][idx].astype(np.uint64)
    ns = d["nslots"][idx].astype(np.uint64)
    nc = d["nchunks"][idx].astype(np.uint64)
    room = np.asarray(nchunks, dtype=np.int64)
    if room.ndim == 0:
        room = int(room) - np.asarray(idx, dtype=np.int64)
    with np.errstate(over="ignore"):
        return ((ss > 0) & (ss % 64 == 0) & (ns > 0) & (ns <= layout.SLAB_MAX_SLOTS) & (nc > 0)
                & (nc <= room.astype(np.uint64))
                & (ss <= nc * np.uint64(chunk) // np.maximum(ns, np.uint64(1))))


def _slot_offsets(rows: np.ndarray, heads: np.ndarray, bits: np.ndarray,
                  data_off: int, chunk: int) -> np.ndarray:
    """Pool offsets of the slots whose bit is set in `bits` (8 words per slab,
    rows[i] the descriptor of slab heads[i]), slots past nslots ignored.
    Work in proportion to the slabs with a bit set in each word."""
    out = []
    for w in range(bits.shape[1] if len(heads) else 0):
        col = np.ascontiguousarray(bits[:, w], dtype="<u8")
        r = np.flatnonzero(col)
        if not len(r):
            continue
        b = np.unpackbits(col[r].view(np.uint8).reshape(len(r), 8), axis=1, bitorder="little")
        rr, i = np.nonzero(b)
        r = r[rr]
        slot = (i + 64 * w).astype(np.uint64)
        keep = slot < rows["nslots"][r]
        r, slot = r[keep], slot[keep]
        out.append(np.uint64(data_off) + heads[r].astype(np.uint64) * np.uint64(chunk)
                   + slot * rows["slot_size"][r].astype(np.uint64))
    return np.concatenate(out) if out else np.empty(0, dtype=np.uint64)


def _release_batch(pool, heads) -> int:
    """Release the empty slabs among `heads` (pool lock held; release_slab's
    protocol, in C).  A slab of impossible geometry is skipped (fsck's)."""
    m = pool.mapping
    arr = np.array(heads, dtype=np.uint64)
    bitmap_off, heaps_off = pool.region("bitmap")[0], pool.region("heaps")[0]
    done = 0
    while len(arr):
        guard(pool)                              # stops here once fenced
        try:
            n, seen = m.slabs_release(arr, bitmap_off, heaps_off, pool.sb.max_nodes)
            done += n
            arr = arr[seen:].copy()
        except MetadataCorrupt as e:
            found = re.search(r"chunk (\d+): .*\((\d+) slabs released", str(e))
            bad, before = int(found.group(1)), int(found.group(2))
            done += before
            arr = arr[np.flatnonzero(arr == bad)[0] + 1:].copy()
    if done:
        keep_retired(pool)
    return done


def live_tokens(pool) -> set[int]:
    """Owner tokens of nodes that still hold what they own: attached ones and
    fenced ones (quarantined: a fenced node may still be finishing a step)."""
    return {(n.slot + 1) | n.epoch << 16 for n in nodes.read_nodes(pool)
            if n.state in ("attached", "fenced")}


def finish_interrupted_frees(pool, live_owner: set[int], heads=None) -> None:
    """Allocated slots with their dirty bit set are frees a dead node began;
    finish them - in slabs no live node owns (a live owner frees its own
    slots without the lock, and its own recovery finishes them) - and return
    empty ones of those slabs to the bitmap.  Caller holds the pool lock.
    heads: the candidates (census()'s `interrupted`), else found here."""
    data_off, chunk, nchunks, _ = geometry(pool)
    if heads is None:
        heads = census(pool, 0, live_owner)[2]
    rows = desc_rows(pool, heads)
    ok = ((rows["control"] & 0xFF) == layout.CHUNK_HEAD) & \
        _geometry_ok_all(rows, np.arange(len(heads)), nchunks - heads, chunk)
    heads, rows = heads[ok], rows[ok]           # corrupt: left for fsck to report
    hit = rows["alloc_bits"] & rows["dirty_bits"]
    has = hit.any(axis=1)
    heads, rows, hit = heads[has], rows[has], hit[has]
    todo = _slot_offsets(rows, heads, hit, data_off, chunk)
    empty = heads[(rows["alloc_bits"] == hit).all(axis=1)]
    held = _held_elsewhere(pool)
    if len(held) and len(todo):
        todo = todo[~np.isin(todo, held)]           # their evictor's recovery finishes them
    if len(todo):
        free_slots(pool, todo)
    _release_batch(pool, empty)                     # refused while a slot stays allocated


def repair_dangling(pool, dangling=None, leaked=None) -> None:
    """Tails whose head does not cover them, and bitmap bits with no slab
    behind them, left by a node that died making or releasing a slab.
    Caller holds the pool lock (so no slab is being made right now).
    dangling, leaked: census()'s, else found here."""
    _, _, nchunks, base = geometry(pool)
    m = pool.mapping
    if dangling is None:
        _, _, _, dangling, leaked, _ = census(pool)
    for i in dangling:
        m.store64(base + int(i) * layout.CHUNK_DESC_SIZE, layout.CHUNK_FREE)
        m.flush(base + int(i) * layout.CHUNK_DESC_SIZE, 8)
    for i in leaked:
        set_bits(pool, int(i), 1, False)


def _reclaim_leaked_chunks(pool) -> int:
    """Bitmap bits with no slab behind them (a crash between the two steps of a
    release) go back to the free pool.  Caller holds the pool lock."""
    leaked = census(pool)[4]
    for i in leaked:
        set_bits(pool, int(i), 1, False)
    return len(leaked)


def reserved_by_owner(pool, tokens) -> dict[int, tuple[int, int]]:
    """Allocated, unpublished slots (count, bytes) in the slabs each owner
    token in `tokens` owns - what a fenced node's quarantine keeps (read only)."""
    want = {int(t) for t in tokens}
    out = {t: (0, 0) for t in want}
    if not want:
        return out
    d = descriptors(pool)
    try:
        kind = d["control"] & 0xFF
        heads = np.flatnonzero((kind == layout.CHUNK_HEAD) & np.isin(d["owner"], list(want)))
        for h in heads:
            ns, ss = int(d["nslots"][h]), int(d["slot_size"][h])
            if not 0 < ns <= layout.SLAB_MAX_SLOTS:
                continue                        # corrupt: fsck's to report
            n = sum((int(a) & ~int(p)).bit_count()
                    for a, p in zip(d["alloc_bits"][h], d["pub_bits"][h]))
            c, b = out[int(d["owner"][h])]
            out[int(d["owner"][h])] = (c + n, b + n * ss)
    finally:
        del d
    return out


# -- retired (poisoned) chunks: incompat BADCHUNKS ------------------------------------
# The list (layout.BadChunk*) sits in the lock header page; only pool-lock
# holders write it.  A retired data chunk keeps its bitmap bit set for ever:
# chunk_find_run never returns it, census() never calls it leaked, and every
# release re-sets its bit (keep_retired).  Its slab (if it was in one) gets
# the owner RETIRED_OWNER - no node's token (low 16 bits 0), so no allocator
# takes slots from it and nobody adopts it; it is released once empty.
RETIRED_OWNER = 0xBAD0_C4C4_0000_0000

_BC_HDR = layout.BadChunkHdrStruct
_BC = layout.BadChunkStruct
_BC_COUNT = _BC_HDR.count.offset


def _badlist_off(pool) -> int:
    return pool.region("locks")[0] + layout.BADCHUNK_LIST_OFF


def retired(pool) -> list[dict]:
    """The retired-chunk list, oldest first ([] for a pool without one).

    Read from the pool, not gated on this process's copy of the superblock:
    another node may have retired the first chunk since we opened it."""
    m, off = pool.mapping, _badlist_off(pool)
    m.invalidate(off, ctypes.sizeof(_BC_HDR))
    if m.load64(off) != layout.BADCHUNK_MAGIC:
        if pool.sb.incompat & layout.INCOMPAT_BADCHUNKS:
            raise MetadataCorrupt(f"{pool.path}: retired-chunk list header is damaged "
                                  f"(magic {m.load64(off):#x})", path=pool.path)
        return []
    size = layout.LOCK_HDR_SIZE - layout.BADCHUNK_LIST_OFF
    m.invalidate(off, size)
    raw = m.read(off, size)
    hdr = _BC_HDR.from_buffer_copy(raw)
    if hdr.magic != layout.BADCHUNK_MAGIC or hdr.count > layout.BADCHUNK_MAX:
        raise MetadataCorrupt(f"{pool.path}: retired-chunk list header is damaged "
                              f"(magic {hdr.magic:#x}, count {hdr.count})", path=pool.path)
    out = []
    base = ctypes.sizeof(_BC_HDR)
    for i in range(hdr.count):
        e = _BC.from_buffer_copy(raw, base + i * ctypes.sizeof(_BC))
        out.append({"chunk": None if e.chunk == layout.BADCHUNK_NO_CHUNK else int(e.chunk),
                    "offset": int(e.offset), "length": int(e.length),
                    "reason": layout.BADCHUNK_REASONS.get(e.reason, f"reason-{e.reason}"),
                    "region": (layout.REGION_NAMES[e.region]
                               if e.region < len(layout.REGION_NAMES) else "none"),
                    "time_ns": int(e.time_ns)})
    return out


def retired_count(pool) -> int:
    """Entries in the retired-chunk list, read from the pool (0: no list)."""
    m, off = pool.mapping, _badlist_off(pool)
    m.invalidate(off, 16)
    if m.load64(off) != layout.BADCHUNK_MAGIC:
        return 0
    return m.load64(off + _BC_COUNT) & 0xFFFF_FFFF


def retired_summary(pool) -> dict:
    """{"chunks", "bytes", "metadata_hits", "entries"} for inspect / kv stats / health."""
    ents = retired(pool)
    chunks = sorted({e["chunk"] for e in ents if e["chunk"] is not None})
    return {"chunks": len(chunks), "bytes": len(chunks) * pool.sb.chunk_size,
            "metadata_hits": sum(1 for e in ents if e["chunk"] is None), "entries": ents}


def retired_chunks(pool) -> np.ndarray:
    """Indices of the retired data chunks (int64, sorted, unique)."""
    ents = retired(pool)
    return np.array(sorted({e["chunk"] for e in ents if e["chunk"] is not None}),
                    dtype=np.int64)


def _bit(pool, i: int) -> bool:
    off, _ = pool.region("bitmap")
    m = pool.mapping
    m.invalidate(off + (i // 64) * 8, 8)
    return bool(m.load64(off + (i // 64) * 8) >> (i % 64) & 1)


def keep_retired(pool) -> int:
    """Re-set the bitmap bit of every retired chunk a release cleared (pool
    lock held).  Returns how many were set."""
    n = 0
    for i in retired_chunks(pool).tolist():
        if not _bit(pool, i):
            set_bits(pool, i, 1, True)
            n += 1
    return n


def region_of(pool, offset: int) -> str | None:
    """The region a pool offset lies in (None: outside every region)."""
    for name in layout.REGION_NAMES:
        off, size = pool.region(name)
        if size and off <= offset < off + size:
            return name
    if offset < layout.SB_SIZE * layout.SB_COPIES:
        return "superblock"
    return None


def retire_range(pool, offset: int, length: int, reason: str = "poison",
                 now_ns: int | None = None) -> dict:
    """Retire the chunks a bad range [offset, offset+length) of the pool
    touches (caller holds the pool lock; the KV blocks on them are evicted
    afterwards: cxlkv.kv.cache.quarantine does both, retiring first so that
    no slot freed by the evictions is handed out again).  Idempotent: a chunk
    already retired is not added twice.  A range outside the data region is
    recorded as a metadata hit (no chunk) and reported critical.

    Returns {"chunks": [new chunk indices], "already": [...], "region",
    "critical": bool}."""
    if length <= 0 or offset < 0 or offset + length > pool.sb.pool_size:
        raise UsageError(f"{pool.path}: bad range {offset:#x}+{length:#x} "
                         f"(pool size {pool.sb.pool_size:#x})")
    codes = {v: k for k, v in layout.BADCHUNK_REASONS.items()}
    if reason not in codes:
        raise UsageError(f"unknown retire reason {reason!r} "
                         f"(one of {', '.join(sorted(codes))})")
    data_off, chunk, nchunks, base = geometry(pool)
    # the slab-owner edit below is C's, which needs the geometry even where
    # this process has not allocated yet (`cxlkv kv quarantine`)
    pool.mapping.set_geometry(data_off, chunk, nchunks, base)
    region = region_of(pool, offset) or "none"
    now_ns = time.time_ns() if now_ns is None else now_ns
    ents = retired(pool)
    have = {e["chunk"] for e in ents}
    m, off = pool.mapping, _badlist_off(pool)
    m.invalidate(off, ctypes.sizeof(_BC_HDR))
    if m.load64(off) != layout.BADCHUNK_MAGIC:
        hdr = _BC_HDR(magic=layout.BADCHUNK_MAGIC, count=0, capacity=layout.BADCHUNK_MAX)
        m.write(off, bytes(hdr))
        m.flush(off, ctypes.sizeof(_BC_HDR))
        fence()
    if not pool.sb.incompat & layout.INCOMPAT_BADCHUNKS:
        # the list exists before the bit that makes older cxlkv refuse the pool
        pool.update_superblock(incompat=pool.sb.incompat | layout.INCOMPAT_BADCHUNKS)
    hdr = _BC_HDR.from_buffer_copy(m.read(off, ctypes.sizeof(_BC_HDR)))
    new, already = [], []
    if region == "data":
        first = (offset - data_off) // chunk
        last = (offset + length - 1 - data_off) // chunk
        targets = [c for c in range(first, min(last, nchunks - 1) + 1)]
    else:
        targets = [None]
    for c in targets:
        if c in have and c is not None:
            already.append(c)
            continue
        if c is None and any(e["chunk"] is None and e["offset"] == offset for e in ents):
            already.append(c)
            continue
        if hdr.count >= layout.BADCHUNK_MAX:
            raise AllocError(f"{pool.path}: the retired-chunk list is full "
                             f"({layout.BADCHUNK_MAX} entries): the device needs replacing "
                             "(see cxlkv-runbook(7), 'Poison and media errors')")
        if c is not None:
            d = base + c * layout.CHUNK_DESC_SIZE
            m.invalidate(d, layout.CHUNK_DESC_SIZE)
            ctl = m.load64(d)
            kind = ctl & 0xFF
            head = c if kind in (layout.CHUNK_HEAD, layout.CHUNK_RELEASING) else \
                (ctl >> 8 if kind == layout.CHUNK_TAIL else None)
            if head is not None:
                # no node allocates from this slab again; it goes once empty
                h = base + head * layout.CHUNK_DESC_SIZE
                m.invalidate(h, layout.CHUNK_DESC_SIZE)
                owner = m.load64(h + _F["owner"])
                if owner != RETIRED_OWNER:
                    m.slabs_set_owner(np.array([head], dtype=np.uint64), owner, RETIRED_OWNER)
        e = _BC(chunk=layout.BADCHUNK_NO_CHUNK if c is None else c,
                offset=offset, length=length, reason=codes[reason],
                region=layout.REGION_INDEX.get(region, 0xFFFF), time_ns=now_ns)
        eoff = off + ctypes.sizeof(_BC_HDR) + hdr.count * ctypes.sizeof(_BC)
        m.write(eoff, bytes(e))
        m.flush(eoff, ctypes.sizeof(_BC))
        fence()
        hdr.count += 1
        if c is None:
            hdr.metadata_hits += 1
        else:
            hdr.retired_bytes += chunk
            set_bits(pool, c, 1, True)
        m.write(off, bytes(hdr))
        m.flush(off, ctypes.sizeof(_BC_HDR))
        new.append(c)
    return {"chunks": [c for c in new if c is not None],
            "already": [c for c in already if c is not None], "region": region,
            "critical": region != "data"}
