"""The host DRAM hot tier: a small per-process cache of recently loaded KV
blocks in local memory, in front of the pool.

    from cxlkv.kv.tiers import hot
    hot.enable(pool, 1 << 30)        # this process, this pool: 1 GiB of DRAM
    kv = pool.kv(...)                # load / load_into serve hot blocks from DRAM

(or ``pool.kv(..., hot_bytes=N)``, which does the same).

* Shared by every KVCache of the pool object in the process.  Filled by
  ``load_into`` (from the caller's buffer, after the copy out of the pool was
  validated) and by ``load`` (when the views are released, while the blocks
  are still pinned).
* Keyed by the block's pool key and remembers the hash-table entry the
  block was read from and that entry's control word (state | version).  The
  pool stays the authority: every load still looks the block up (lock-free)
  and pins it; the DRAM copy is used only when the entry found now is the one
  the copy came from, with the same version.  An entry that changed since
  (evicted, dropped, stored again) has a new version, so the stale copy is
  discarded and the block read from the pool again.
* Bounded by ``max_bytes`` of payload, least recently used first out.
* Owned by the pool object's tiers (``pool.tiers.get("hot")``, a
  cxlkv.kv.tiers.base.Tier: the cache calls its copies() and keep()).
"""
from __future__ import annotations

import collections
import threading
import weakref

import numpy as np

from cxlkv.errors import UsageError
from cxlkv.kv.tiers.base import Tier
from cxlkv.util.stats import StatsCollector


def _check_size(max_bytes) -> None:
    if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes <= 0:
        raise UsageError("hot_bytes must be a byte count > 0")


class HotTier(Tier):
    """A bounded LRU of block payloads, validated against the pool entry."""

    kind = "hot"

    def __init__(self, max_bytes: int):
        _check_size(max_bytes)
        self.max_bytes = max_bytes
        self._mu = threading.Lock()            # guards everything below
        # key -> (entry index, ctl, payload array)
        self._lru: collections.OrderedDict[bytes, tuple[int, int, np.ndarray]] = \
            collections.OrderedDict()
        self._bytes = 0
        self._stats = dict.fromkeys(
            ("hits", "misses", "stale", "inserted", "evicted", "hit_bytes"), 0)

    def lookup(self, keys: np.ndarray, idx: np.ndarray, ctl: np.ndarray, n: int,
               block_bytes: int) -> list:
        """For the first n blocks: the DRAM copy (a read-only array) where one
        is held for the same entry and version, else None."""
        out: list = [None] * n
        hits = stale = 0
        with self._mu:
            for j in range(n):
                k = keys[j].tobytes()
                got = self._lru.get(k)
                if got is None:
                    continue
                if got[0] != int(idx[j]) or got[1] != int(ctl[j]) or got[2].nbytes != block_bytes:
                    self._drop(k)
                    stale += 1
                    continue
                self._lru.move_to_end(k)
                out[j] = got[2]
                hits += 1
            s = self._stats
            s["hits"] += hits
            s["stale"] += stale
            s["misses"] += n - hits
            s["hit_bytes"] += hits * block_bytes
        return out

    def insert(self, keys: np.ndarray, idx: np.ndarray, ctl: np.ndarray, sources) -> None:
        """Remember the blocks (sources: buffers of block bytes, copied) read
        from entries idx with versions ctl."""
        for j, src in enumerate(sources):
            if src is None:
                continue
            a = np.frombuffer(src, dtype=np.uint8)
            if a.nbytes > self.max_bytes:
                continue
            copy = a.copy()
            copy.flags.writeable = False
            k = keys[j].tobytes()
            with self._mu:
                if k in self._lru:
                    self._drop(k)
                self._lru[k] = (int(idx[j]), int(ctl[j]), copy)
                self._bytes += copy.nbytes
                self._stats["inserted"] += 1
                while self._bytes > self.max_bytes:
                    self._drop(next(iter(self._lru)))
                    self._stats["evicted"] += 1

    # the Tier's part in front of the pool
    copies = lookup
    keep = insert

    def _drop(self, k: bytes) -> None:
        self._bytes -= self._lru.pop(k)[2].nbytes

    def resize(self, max_bytes: int) -> None:
        """A new size limit, dropping the least recently used to fit it."""
        _check_size(max_bytes)
        with self._mu:
            self.max_bytes = max_bytes
            while self._bytes > max_bytes:
                self._drop(next(iter(self._lru)))
                self._stats["evicted"] += 1

    def clear(self) -> None:
        with self._mu:
            self._lru.clear()
            self._bytes = 0

    def close(self) -> None:
        self.clear()

    def stats(self) -> dict:
        with self._mu:
            return dict(self._stats, blocks=len(self._lru), bytes=self._bytes,
                        max_bytes=self.max_bytes)


def enable(pool, max_bytes: int) -> HotTier:
    """Give this process's `pool` a DRAM hot tier of `max_bytes` (idempotent
    for the same size; a new size resizes it, dropping the least recently used)."""
    cur = pool.tiers.get(HotTier.kind)
    if cur is not None:
        if max_bytes != cur.max_bytes:
            cur.resize(max_bytes)
        return cur
    return pool.tiers.enable(HotTier(max_bytes))


def disable(pool) -> None:
    """Drop the hot tier (and what it holds)."""
    pool.tiers.disable(HotTier.kind)


def tier_of(pool) -> HotTier | None:
    return pool.tiers.get(HotTier.kind)


def collector(pool):
    """A prometheus_client collector of `pool`'s DRAM hot tier in this process
    (cxlkv_hot_*; register it in a serving process's registry)."""
    ref = weakref.ref(pool)
    return StatsCollector(
        "cxlkv_hot", lambda: None if ref() is None else tier_of(ref()),
        counters=(("hit_blocks", "hits", "Loaded blocks served from process memory."),
                  ("miss_blocks", "misses", "Loaded blocks read from the pool."),
                  ("stale_blocks", "stale", "DRAM copies dropped because the pool entry "
                                            "changed."),
                  ("inserted_blocks", "inserted", "Blocks copied into the hot tier."),
                  ("evicted_blocks", "evicted", "Blocks dropped to keep to the size limit."),
                  ("hit_bytes", "hit_bytes", "Bytes served from process memory.")),
        gauges=(("bytes", "bytes", "Payload bytes held."),
                ("limit_bytes", "max_bytes", "The hot tier's size limit."),
                ("blocks", "blocks", "Blocks held.")))
