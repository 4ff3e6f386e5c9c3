"""The NVMe spill tier: blocks evicted from the pool go to a bounded store on
local disk instead of being dropped, and come back on a later hit.

    from cxlkv.kv.tiers import spill
    spill.enable(pool, "/var/lib/cxlkv/spill", 64 << 30)   # this process, this pool
    kv = pool.kv(...)            # match sees pool then spill; load promotes

(or ``KVCache(pool, ..., spill_dir=PATH, spill_bytes=N)``, which does the same).

* One store per host directory, shared by the processes of the host.  One
  process OWNS it (an exclusive flock on ``DIR/.lock``, held while it is
  open): normally the node agent (``cxlkv serve --spill-dir``), whose
  watermark evictions are where most blocks leave the pool.  Every other
  process that enables the same directory attaches as a READER
  (``mode="auto"``, the default: owner when the lock is free, reader when a
  live process holds it; ``"owner"`` / ``"reader"`` force one).  Every
  eviction a process makes (under the pool lock, for whichever namespace)
  offers the evicted blocks to its store, owner or reader alike.
* The evictor copies the payload out of the pool before the slot is freed
  and hands the bytes to a bounded in-process queue (``queue_bytes``); the
  process's background writer threads do the disk I/O.  Nothing touches the
  disk under the pool lock.  A full queue, a full store, or a failing disk
  (any OSError) drops the block: counted in ``stats()`` and logged once per
  kind (a warning through logging, or through ``logger=``), never an error
  to the caller.
* Slot files: one preallocated file per slot size,
  ``DIR/slots-<slot bytes>.dat`` (payloads rounded up to 4 KiB), made when
  the first block of that size is written with as many slots as the limit
  holds: a hash index of its slots, their 72-byte headers (magic, format
  version, state, payload length, pool key, namespace digest, xxh3-64 of
  the payload, xxh3-64 of the header, a stamp) and the payloads, from a
  2 MiB boundary on (format version 3; layout in `files`).  A writer thread takes a batch of queued blocks, claims a free
  slot for each (one flock of ``DIR/.usage``), writes the payloads with
  pwritev (adjacent slots in one call) and then publishes their headers
  (one flock).  Not fsynced: it is a cache.  A block is read back only when
  its header verifies, holds the key, namespace and length asked for, and
  the payload's checksum verifies with the header unchanged across the
  read: a torn write (a crash between payload and header, a damaged slot)
  is a miss, never a wrong block, and a slot that fails is freed.  The
  owner rebuilds the index from the slot headers when it opens the store
  (slots of writers that are gone freed).  A directory in the old
  one-file-per-block format (``DIR/<2 hex>/<key>.blk``) is migrated by the
  owner when it opens it (blocks verified, moved into slots, old files
  removed; logged), and so are slot files of format version 2 (payloads
  right after the headers).
* Reads (`fetch`, `get`): one C call per run of slots, the GIL released
  (`_core.spill_read`), into page-aligned buffers that fetch reuses; the
  payloads are copied out of a read-only mapping of the slot file with their
  checksum in the same pass (a file cut short under the copy is a miss, not
  a SIGBUS), or read with ``preadv`` and then checksummed - whichever the
  store's own reads time faster on this host (``read_path="auto"``;
  ``mapped``, ``pread`` or CXLKV_SPILL_READ fix it: readpath.py);
  ``read_helpers`` (0 by default) helper threads can share a run's units
  (cxlkv/_core/src/spill_pool.c; measured in the README).
* The size limit is the owner's (``max_bytes``: slot and header bytes),
  kept with a shared counter in ``DIR/.usage``: a writer claims its slots
  and adds their bytes under a short flock on that file, and only when the
  total stays within the limit; whoever frees a slot (the owner's LRU, or
  any process finding it corrupt) subtracts its bytes under the same flock.
  So the published total never exceeds the limit; a writer killed between
  claiming and publishing leaves its slots counted until the next owner's
  start recounts the slot headers (under the flock: exact).
* Readers' blocks are discovered by the owner through a journal (24-byte
  records appended to ``DIR/.usage`` under the same flock), folded into the
  owner's index every ``MAINTAIN_S`` and before it makes room.
* The owner's LRU: an in-memory index (rebuilt from the slot headers,
  oldest stamp first, when it opens the store) touched by its hits and
  writes.  Readers' hits set the slot's stamp; when the owner's least
  recently used block turns out newer than the owner recorded, it gets a
  second chance (moved to the most recent end) instead of being freed.
  While readers are attached (each holds a shared flock on ``DIR/.readers``; the owner
  probes it every ``MAINTAIN_S``) the owner keeps ``reader_room`` (1/8) of
  the limit free for their writes; a reader's write that does not fit is
  dropped (``store-full``).
* Lookups (``match``): the owner reads its index only; a reader its own
  index of blocks it has seen, then a probe of the slot files' index per
  key (memory reads, stopping at the first miss).  A reader's index can
  still hold a block the owner freed since:
  its match then counts a block that ``load`` finds missing (as a pool
  match can count a block evicted before the load), and an evicted block
  it believes on disk is not copied, only touched - or, when the block is
  gone after all, dropped (``dropped_gone``).  ``load``/``load_into``
  read and verify the blocks, store the blocks through the normal store path
  (promotion) and serve them from the pool.  A promoted block stays in the
  store (a later eviction of it costs no write, only a touch).
* Permissions: directories 0770 and files 0660 under the umask, never
  world access.  Readers of another user than the owner need the group:
  give DIR the pool's group with the setgid bit (``install -d -m 2770 -g
  GROUP DIR``) and run the owner with umask 0007 (the cxlkv-serve unit
  does); a reader without write access only reads.
* A reader stays a reader: if the owner dies, nothing trims the store any
  more (writes are refused once it is full; reads go on) until a process
  enables the directory as owner - in auto mode, the next ``enable`` after
  the lock was released.

The store is the pool object's "spill" tier (``pool.tiers.get("spill")``, a
cxlkv.kv.tiers.base.Tier).  Modules: `files` (the slot files' format),
`usage` (DIR/.usage: the shared count and the readers' journal), `lru` (the
index, least recently used first, with second chances), `store` (SpillStore:
the writers, the owner's maintenance, lookups), `metrics` (the Prometheus
collector), `registry` (enable / use / disable per pool object).
"""
from cxlkv.errors import SpillDirBusy
from cxlkv.kv.tiers.spill.files import (
    FILE_HDR,
    FILE_MAGIC,
    HDR,
    HDR_SIZE,
    MAGIC,
    VERSION,
    SlotFile,
    file_name,
    footprint,
    slot_bytes,
)
from cxlkv.kv.tiers.spill.lru import READER_INDEX
from cxlkv.kv.tiers.spill.metrics import METRIC_COUNTERS, METRIC_GAUGES, Collector
from cxlkv.kv.tiers.spill.registry import collector, disable, enable, store_of, use
from cxlkv.kv.tiers.spill.store import (
    BATCH_BLOCKS,
    BATCH_BYTES,
    COUNTERS,
    DROP_REASONS,
    HEADER_WAIT_S,
    MAINTAIN_S,
    MODES,
    PREALLOC,
    QUEUE_BYTES,
    READER_ROOM,
    WRITERS,
    SpillStore,
)
from cxlkv.kv.tiers.spill.usage import REC, USAGE, USAGE_MAGIC, USAGE_SIZE, USAGE_VERSION

__all__ = ["BATCH_BLOCKS", "BATCH_BYTES", "COUNTERS", "DROP_REASONS", "FILE_HDR", "FILE_MAGIC",
           "HDR", "HDR_SIZE", "HEADER_WAIT_S", "MAGIC", "MAINTAIN_S", "METRIC_COUNTERS",
           "METRIC_GAUGES", "MODES", "PREALLOC", "QUEUE_BYTES", "READER_INDEX", "READER_ROOM",
           "REC", "USAGE", "USAGE_MAGIC", "USAGE_SIZE", "USAGE_VERSION", "VERSION", "WRITERS",
           "Collector", "SlotFile", "SpillDirBusy", "SpillStore", "collector", "disable", "enable",
           "file_name", "footprint", "slot_bytes", "store_of", "use"]
