"""The NVMe spill tier: blocks evicted from the pool go to a bounded store on
local disk instead of being dropped, and come back on a later hit.

    from cxlkv.kv import spill
    spill.enable(pool, "/var/lib/cxlkv/spill", 64 << 30)   # this process, this pool
    kv = pool.kv(...)            # match sees pool then spill; load promotes

(or ``KVCache(pool, ..., spill_dir=PATH, spill_bytes=N)``, which does the same).

* One store per host directory, used by one process at a time (an exclusive
  flock on ``DIR/.lock``); every KVCache of that pool object in the process
  shares it, and every eviction this process makes (under the pool lock, for
  whichever namespace) offers the evicted blocks to it.  Evictions made by
  other nodes go to their own hosts' stores.
* The evictor copies the payload out of the pool before the slot is freed
  and hands the bytes to a bounded in-process queue (``queue_bytes``); a
  background writer thread does the disk I/O.  Nothing touches the disk
  under the pool lock.  A full queue, a full store that cannot make room, or
  a failing disk (any OSError) drops the block: counted in ``stats()`` and
  logged once per kind on stderr, never an error to the caller.
* Files: ``DIR/<2 hex>/<32 hex key>.blk``: a 64-byte header (magic, format
  version, pool key, namespace digest, payload length, xxh3-64 of the
  payload, xxh3-64 of the header) then the payload.  Written to a temporary
  name and renamed, so a crash never leaves a torn ``.blk``.  A file whose
  header, length, key, namespace or checksum does not verify is a miss and
  is removed.
* Its own size limit (``max_bytes``, file bytes) and its own LRU: an
  in-memory index (rebuilt from the directory, oldest mtime first, on
  open) touched by hits and writes; the least recently used files go first
  to make room.
* Lookups (``match``) read only the in-memory index; ``load``/``load_into``
  read and verify the files, store the blocks through the normal store path
  (promotion) and serve them from the pool.  A promoted block stays in the
  store (a later eviction of it costs no write).
"""
from __future__ import annotations

import collections
import fcntl
import os
import queue
import struct
import sys
import threading
import weakref
from pathlib import Path

import xxhash

from cxlkv.errors import UsageError

MAGIC = b"CXLKVSP\0"
VERSION = 1
# magic, version, reserved, key, ns digest, length, xxh3-64 of the payload; then
# an xxh3-64 of those 64 bytes: a 72-byte header
HDR = struct.Struct("<8sII16s16sQQ")
HDR_SIZE = HDR.size + 8

#: default bound of the writer queue (payload bytes waiting for the disk)
QUEUE_BYTES = 64 << 20
#: writer threads (file creation dominates on ext4: two threads about double it)
WRITERS = 2

_ATTR = "_kv_spill"


def _log(msg: str) -> None:
    sys.stderr.write(f"cxlkv: spill: {msg}\n")


class SpillStore:
    """A bounded directory of spilled blocks with its own LRU (see module doc)."""

    def __init__(self, path, max_bytes: int, *, queue_bytes: int = QUEUE_BYTES,
                 writers: int = WRITERS):
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise UsageError("spill_bytes must be a byte count >= 0")
        if not isinstance(queue_bytes, int) or queue_bytes < 0:
            raise UsageError("queue_bytes must be a byte count >= 0")
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.queue_bytes = queue_bytes
        self._mu = threading.Lock()
        self._index: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._used = 0
        self._pending = 0                 # payload bytes queued, not yet written
        self._queued: set[bytes] = set()
        self._logged: set[str] = set()
        self.counters = collections.Counter()
        self._cmu = threading.Lock()           # counters (bumped with or without _mu)
        self._lockfd = None
        self._q: queue.Queue = queue.Queue()
        self._closed = False
        try:
            self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(self.path / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            # an unusable directory: the store stays empty and drops everything
            self._log_once("disk", f"directory unusable ({e}): dropping evicted blocks")
            self._broken = True
        else:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                raise UsageError(f"spill directory {self.path} is in use by another process",
                                 hint="give each serving process its own spill directory")
            self._lockfd = fd
            self._broken = False
            self._scan()
        self._threads = [threading.Thread(target=self._writer, name=f"cxlkv-spill-{i}",
                                          daemon=True) for i in range(max(1, writers))]
        for th in self._threads:
            th.start()

    # -- bookkeeping -------------------------------------------------------------------
    def _file(self, key: bytes) -> Path:
        h = key.hex()
        return self.path / h[:2] / (h + ".blk")

    def _scan(self) -> None:
        """Rebuild the index from the directory (oldest first); remove temporaries."""
        found = []
        for sub in self.path.iterdir():
            if not sub.is_dir() or len(sub.name) != 2:
                continue
            for f in sub.iterdir():
                try:
                    if f.name.endswith(".tmp"):
                        f.unlink()
                        continue
                    if not f.name.endswith(".blk") or len(f.name) != 36:
                        continue
                    st = f.stat()
                    found.append((st.st_mtime_ns, bytes.fromhex(f.name[:32]), st.st_size))
                except (OSError, ValueError):
                    continue
        found.sort()
        for _, key, size in found:
            self._index[key] = size
            self._used += size
        with self._mu:
            gone = self._make_room(0)[1]
        _unlink(gone)

    def _bump(self, name: str, n: int = 1) -> None:
        with self._cmu:
            self.counters[name] += n

    def _log_once(self, kind: str, msg: str) -> None:
        if kind not in self._logged:           # one log line per kind
            self._logged.add(kind)
            _log(f"{self.path}: {msg}; counted in stats(), logged once")

    def _fail(self, kind: str, err=None) -> None:
        self._bump(f"dropped_{kind}", 1)
        self._log_once(kind, f"dropping evicted blocks ({kind}{': ' + str(err) if err else ''})")

    def promote_failed(self, err) -> None:
        """The pool refused a promotion (full of pinned blocks, quota): the
        caller gets the pool's run only; the block stays on disk."""
        self._bump("promote_failed", 1)
        self._log_once("promote", f"could not promote spilled blocks into the pool ({err})")

    def _forget(self, key: bytes) -> Path:
        """Drop `key` from the index (self._mu held); returns its file, for
        the caller to unlink after releasing the lock (the evictor takes
        self._mu under the pool lock: no disk I/O while holding it)."""
        size = self._index.pop(key, None)
        if size is not None:
            self._used -= size
        return self._file(key)

    def _remove(self, key: bytes) -> None:
        with self._mu:
            path = self._forget(key)
        _unlink([path])

    def _make_room(self, size: int) -> tuple[bool, list]:
        """Evict least recently used files from the index until `size` more
        fits (self._mu held); returns (fits, files to unlink)."""
        if size > self.max_bytes:
            return False, []
        gone = []
        while self._used + size > self.max_bytes and self._index:
            gone.append(self._forget(next(iter(self._index))))
            self._bump("evicted", 1)
        return self._used + size <= self.max_bytes, gone

    # -- the evictor's side (pool lock held: no disk I/O) --------------------------------
    def reserve(self, key: bytes, nbytes: int) -> bool:
        """Make room in the writer queue for one evicted block, before its
        payload is copied out of the pool (so a drop costs no copy).  False:
        nothing to do (already stored or queued) or dropped (counted)."""
        with self._mu:
            if self._closed or self._broken:
                self._fail("disk")
                return False
            if key in self._index:
                self._index.move_to_end(key)      # already on disk: nothing to write
                self._bump("already", 1)
                return False
            if key in self._queued:
                return False
            if self._pending + nbytes > self.queue_bytes:
                self._fail("queue-full")
                return False
            self._pending += nbytes
            self._queued.add(key)
            return True

    def put(self, key: bytes, ns_digest: bytes, payload: bytes) -> None:
        """Hand a reserved block's bytes to the writer thread (never blocks)."""
        self._q.put((key, ns_digest, payload))

    def unreserve(self, key: bytes, nbytes: int) -> None:
        with self._mu:
            self._pending -= nbytes
            self._queued.discard(key)

    def offer(self, key: bytes, ns_digest: bytes, payload: bytes) -> bool:
        if not self.reserve(key, len(payload)):
            return False
        self.put(key, ns_digest, payload)
        return True

    # -- the writer thread -----------------------------------------------------------
    def _writer(self) -> None:
        while True:
            item = self._q.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except Exception as e:                     # pragma: no cover - never raise
                self._fail("disk", e)
            finally:
                if item is not None:
                    with self._mu:
                        self._pending -= len(item[2])
                        self._queued.discard(item[0])
                self._q.task_done()

    def _write(self, key: bytes, ns_digest: bytes, payload: bytes) -> None:
        size = HDR_SIZE + len(payload)
        with self._mu:
            if self._broken:
                self._fail("disk")
                return
            if key in self._index:
                self._index.move_to_end(key)
                return
            fits, gone = self._make_room(size)
            if fits:
                # counted before the write so that concurrent writes cannot
                # overfill; indexed only once the file is complete
                self._used += size
        _unlink(gone)
        if not fits:
            self._fail("store-full")
            return
        path = self._file(key)
        tmp = path.with_name(path.name[:-4] + ".tmp")
        try:
            path.parent.mkdir(exist_ok=True, mode=0o700)
            hdr = HDR.pack(MAGIC, VERSION, 0, key, ns_digest, len(payload),
                           xxhash.xxh3_64_intdigest(payload))
            hdr += struct.pack("<Q", xxhash.xxh3_64_intdigest(hdr))
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                _write_all(fd, hdr)
                _write_all(fd, payload)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            with self._mu:
                self._used -= size
            self._fail("disk", e)
            return
        with self._mu:
            self._index[key] = size
        self._bump("written", 1)
        self._bump("written_bytes", len(payload))

    # -- the reader's side ---------------------------------------------------------------
    def run(self, keys) -> int:
        """How many leading `keys` (rows of 16 bytes) the store holds (index only)."""
        n = 0
        with self._mu:
            for k in keys:
                if bytes(k) not in self._index:
                    break
                n += 1
        return n

    def get(self, key: bytes, ns_digest: bytes, length: int) -> memoryview | None:
        """The payload of `key`, verified, or None (a bad file is removed)."""
        with self._mu:
            if key not in self._index:
                self._bump("misses", 1)
                return None
            self._index.move_to_end(key)
        path = self._file(key)
        try:
            with open(path, "rb") as f:
                raw = f.read(HDR_SIZE + length + 1)
        except OSError:
            self._remove(key)
            self._bump("misses", 1)
            return None
        ok = len(raw) == HDR_SIZE + length
        if ok:
            magic, ver, _, k, nsd, ln, xs = HDR.unpack_from(raw)
            hsum = struct.unpack_from("<Q", raw, HDR.size)[0]
            ok = (magic == MAGIC and ver == VERSION and k == key and nsd == ns_digest
                  and ln == length and hsum == xxhash.xxh3_64_intdigest(raw[:HDR.size])
                  and xs == xxhash.xxh3_64_intdigest(memoryview(raw)[HDR_SIZE:]))
        if not ok:
            self._remove(key)
            self._bump("corrupt", 1)
            if "corrupt" not in self._logged:
                self._logged.add("corrupt")
                _log(f"{path}: corrupt or truncated spilled block removed (a miss; "
                     "further ones are counted in stats(), not logged)")
            return None
        self._bump("hits", 1)
        return memoryview(raw)[HDR_SIZE:]

    # -- management ----------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued block is written (or dropped)."""
        self._q.join()

    def stats(self) -> dict:
        with self._mu:
            out = {"path": str(self.path), "max_bytes": self.max_bytes, "used_bytes": self._used,
                   "blocks": len(self._index), "queued_bytes": self._pending,
                   "queue_bytes": self.queue_bytes}
        with self._cmu:
            counters = dict(self.counters)
        for k in ("written", "written_bytes", "hits", "misses", "corrupt", "evicted",
                  "already", "promoted", "promote_failed", "dropped_queue-full",
                  "dropped_store-full", "dropped_disk", "dropped_copy"):
            out[k] = counters.get(k, 0)
        out["dropped"] = sum(v for k, v in counters.items() if k.startswith("dropped_"))
        return out

    def close(self) -> None:
        """Write what is queued, stop the writer, release the directory."""
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._q.put(None)
        for th in self._threads:
            th.join()
        if self._lockfd is not None:
            os.close(self._lockfd)
            self._lockfd = None


def _unlink(paths) -> None:
    for p in paths:
        try:
            os.unlink(p)
        except OSError:
            pass


def _write_all(fd: int, data) -> None:
    mv = memoryview(data)
    while mv:
        n = os.write(fd, mv)
        mv = mv[n:]


# -- per pool object ------------------------------------------------------------------------
#: stores open in this process by directory: (weak reference to the pool, store)
_OPEN: dict[Path, tuple] = {}


def enable(pool, path, max_bytes: int, *, queue_bytes: int = QUEUE_BYTES,
           writers: int = WRITERS) -> SpillStore:
    """Give this process's `pool` a spill store in directory `path` (idempotent
    for the same directory; another directory is refused while one is set).
    A store left by a pool object of this process that was closed since is
    closed (its queue written) and its directory taken over."""
    cur = pool.__dict__.get(_ATTR)
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
    store = SpillStore(path, max_bytes, queue_bytes=queue_bytes, writers=writers)
    pool.__dict__[_ATTR] = store
    _OPEN[real] = (weakref.ref(pool), store)
    weakref.finalize(pool, store.close)
    return store


def disable(pool) -> None:
    """Write what is queued and release the directory (before closing the pool)."""
    store = pool.__dict__.pop(_ATTR, None)
    if store is not None:
        store.close()
        _OPEN.pop(store.path.resolve(), None)


def store_of(pool) -> SpillStore | None:
    return pool.__dict__.get(_ATTR)
