"""A pool object's spill store: enable / use / disable it, find it, and a
collector of it.  The store is the pool object's "spill" tier
(`pool.tiers`); one store per directory is open in the process."""
from __future__ import annotations

import logging
import weakref
from pathlib import Path

from cxlkv.errors import UsageError
from cxlkv.kv.tiers.spill.metrics import Collector
from cxlkv.kv.tiers.spill.store import QUEUE_BYTES, WRITERS, SpillStore

#: stores open in this process by directory: (weak reference to the pool, store);
#: guarded by nothing: enable and disable run in the thread that opens the pool
_OPEN: dict[Path, tuple] = {}


def enable(pool, path, max_bytes: int, *, queue_bytes: int = QUEUE_BYTES,
           writers: int = WRITERS, mode: str = "auto",
           logger: logging.Logger | None = None) -> SpillStore:
    """Give this process's `pool` a spill store in directory `path` (idempotent
    for the same directory; another directory is refused while one is set).
    mode "auto": the owner when no live process holds the directory, else a
    reader (whose `max_bytes` is not used: the owner's limit applies).  A
    store left by a pool object of this process that was closed since is
    closed (its queue written) and its directory taken over."""
    cur = store_of(pool)
    if cur is not None:
        if Path(path).resolve() == cur.path.resolve():
            return cur
        raise UsageError(f"this pool already spills to {cur.path}",
                         hint="one spill directory per pool and process")
    real = Path(path).resolve()
    held = _OPEN.get(real)
    if held is not None:
        other = held[0]()
        if other is None or other.node is None:       # that pool was closed
            held[1].close()
            _OPEN.pop(real, None)
    store = SpillStore(path, max_bytes, queue_bytes=queue_bytes, writers=writers, mode=mode,
                       logger=logger)
    pool.tiers.enable(store)
    _OPEN[real] = (weakref.ref(pool), store)
    weakref.finalize(pool, store.close)
    return store


def use(pool, store: SpillStore) -> None:
    """Give `pool` a store its caller opened and closes (the node agent keeps
    one store across the pool objects of its re-attaches)."""
    cur = store_of(pool)
    if cur is not None and cur is not store:
        raise UsageError(f"this pool already spills to {cur.path}")
    pool.tiers.enable(store)


def disable(pool) -> None:
    """Write what is queued and release the directory (before closing the pool)."""
    store = pool.tiers.disable(SpillStore.kind)
    if store is not None:
        _OPEN.pop(store.path.resolve(), None)


def store_of(pool) -> SpillStore | None:
    return pool.tiers.get(SpillStore.kind)


def collector(pool) -> Collector:
    """A collector of `pool`'s spill store (whichever is enabled when scraped)."""
    return Collector(lambda: store_of(pool))
