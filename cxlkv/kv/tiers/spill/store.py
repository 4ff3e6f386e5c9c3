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
  kind (on stderr, or through ``logger=``), never an error to the caller.
* Files: ``DIR/<2 hex>/<32 hex key>.blk``: a 72-byte header (magic, format
  version, pool key, namespace digest, payload length, xxh3-64 of the
  payload, xxh3-64 of the header) then the payload.  Written to a temporary
  name and renamed, so a crash never leaves a torn ``.blk``.  A file whose
  header, length, key, namespace or checksum does not verify is a miss and
  is removed.
* The size limit is the owner's (``max_bytes``, file bytes), kept with a
  shared counter in ``DIR/.usage``: every writer publishes a file (the
  rename) and adds its bytes under a short flock on that file, and only
  when the total stays within the limit; whoever removes a file (the
  owner's LRU, or any process finding it corrupt) subtracts its bytes, and
  only the remover whose unlink succeeded does.  So the published total
  never exceeds the limit; what can be on disk beyond it are the
  temporaries being written (at most ``writers`` blocks per process) and,
  for each process killed between a rename and its count, that one file,
  until the next owner's start recounts the directory (under the flock:
  exact).
* Readers' files are discovered by the owner through a journal (24-byte
  records appended to ``DIR/.usage`` under the same flock), folded into the
  owner's index every ``MAINTAIN_S`` and before it makes room.
* The owner's LRU: an in-memory index (rebuilt from the directory, oldest
  mtime first, when it opens the store) touched by its hits and writes.
  Readers' hits set the file's mtime; when the owner's least recently used
  file turns out newer than the owner recorded, it gets a second chance
  (moved to the most recent end) instead of being removed.  While readers
  are attached (each holds a shared flock on ``DIR/.readers``; the owner
  probes it every ``MAINTAIN_S``) the owner keeps ``reader_room`` (1/8) of
  the limit free for their writes; a reader's write that does not fit is
  dropped (``store-full``).
* Lookups (``match``): the owner reads its index only; a reader its own
  index of files it has seen, then one stat per key (stopping at the first
  miss).  A reader's index can still hold a file the owner removed since:
  its match then counts a block that ``load`` finds missing (as a pool
  match can count a block evicted before the load), and an evicted block
  it believes on disk is not copied, only touched - or, when the file is
  gone after all, dropped (``dropped_gone``).  ``load``/``load_into``
  read and verify the files, store the blocks through the normal store path
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
"""
from __future__ import annotations

import collections
import contextlib
import fcntl
import logging
import os
import queue
import struct
import sys
import threading
import time
import weakref
from pathlib import Path

import xxhash

from cxlkv.util.stats import StatsCollector
from cxlkv.errors import RefusedError, UsageError

MAGIC = b"CXLKVSP\0"
VERSION = 1
# magic, version, reserved, key, ns digest, length, xxh3-64 of the payload; then
# an xxh3-64 of those 64 bytes: a 72-byte header
HDR = struct.Struct("<8sII16s16sQQ")
HDR_SIZE = HDR.size + 8

# DIR/.usage: a 64-byte header (magic, version, reserved, published file
# bytes, the owner's limit, the owner's pid), then the readers' journal:
# records of (key, file bytes) of the files they published
USAGE_MAGIC = b"CXLKVSU\0"
USAGE_VERSION = 1
USAGE = struct.Struct("<8sIIQQQ")
USAGE_SIZE = 64
_USED = 16
REC = struct.Struct("<16sQ")

#: default bound of the writer queue (payload bytes waiting for the disk)
QUEUE_BYTES = 64 << 20
#: writer threads (file creation dominates on ext4: two threads about double it)
WRITERS = 2
#: share of the limit the owner keeps free for readers' writes while any is attached
READER_ROOM = 0.125
#: the owner folds the readers' journal in and keeps their room this often
MAINTAIN_S = 0.25
#: files a reader remembers having seen (its lookups stat the rest)
READER_INDEX = 1 << 16
#: how long a reader waits for a starting owner to write DIR/.usage
HEADER_WAIT_S = 2.0
MODES = ("auto", "owner", "reader")

_ATTR = "_kv_spill"


class SpillDirBusy(RefusedError):
    """mode="owner" on a directory another live process owns."""

    kind = "spill-busy"


class SpillStore:
    """A bounded directory of spilled blocks, owned by one process and shared
    with the readers of the host (see the module doc)."""

    def __init__(self, path, max_bytes: int, *, queue_bytes: int = QUEUE_BYTES,
                 writers: int = WRITERS, mode: str = "auto", logger: logging.Logger | None = None,
                 reader_room: float = READER_ROOM):
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise UsageError("spill_bytes must be a byte count >= 0")
        if not isinstance(queue_bytes, int) or queue_bytes < 0:
            raise UsageError("queue_bytes must be a byte count >= 0")
        if mode not in MODES:
            raise UsageError(f"spill mode must be one of {', '.join(MODES)}, not {mode!r}")
        if not 0 <= reader_room < 1:
            raise UsageError("reader_room must be a share of the limit in [0, 1)")
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.queue_bytes = queue_bytes
        self.reader_room = reader_room
        self.mode = "reader" if mode == "reader" else "owner"
        self._logger = logger
        self._mu = threading.Lock()
        # owner: key -> [file bytes, mtime_ns it recorded], least recently used first;
        # reader: the files it has seen (bounded by READER_INDEX)
        self._index: collections.OrderedDict[bytes, list] = collections.OrderedDict()
        self._pending = 0                 # payload bytes queued, not yet written
        self._queued: set[bytes] = set()
        self._logged: set[str] = set()
        self.counters = collections.Counter()
        self._cmu = threading.Lock()           # counters (bumped with or without _mu)
        self._umu = threading.Lock()           # this process's turn at DIR/.usage's flock
        self._lockfd = self._ufd = self._rfd = None
        self._with_readers = False             # owner: as probed at the last maintenance
        self._q: queue.Queue = queue.Queue()
        self._closed = False
        self._stop = threading.Event()
        self._broken = False
        self._tmpn = 0
        try:
            self._open(mode)
        except SpillDirBusy:
            self._close_fds()
            raise
        except OSError as e:
            # an unusable directory: the store stays empty and drops everything
            self._close_fds()
            self._broken = True
            self._log_once("disk", f"directory unusable ({e}): dropping evicted blocks")
        self._threads = [threading.Thread(target=self._writer, name=f"cxlkv-spill-{i}",
                                          daemon=True) for i in range(max(1, writers))]
        if self.mode == "owner" and not self._broken:
            self._threads.append(threading.Thread(target=self._maintainer, daemon=True,
                                                  name="cxlkv-spill-maintain"))
        for th in self._threads:
            th.start()

    # -- opening ---------------------------------------------------------------------
    def _open(self, mode: str) -> None:
        # never world access; the group's as the umask allows (readers of
        # other users in the pool's group: see the module doc)
        self.path.mkdir(parents=True, exist_ok=True, mode=0o770)
        own = False
        if mode != "reader":
            fd = os.open(self.path / ".lock", os.O_RDONLY | os.O_CREAT, 0o660)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                own = True
                self._lockfd = fd
            except BlockingIOError:
                os.close(fd)
            except OSError:
                os.close(fd)
                raise
            if not own and mode == "owner":
                pid = self._owner_pid()
                raise SpillDirBusy(
                    f"spill directory {self.path} is owned by another process"
                    + (f" (pid {pid})" if pid else ""), path=str(self.path),
                    hint="stop that process, attach as a reader (mode 'reader' or 'auto'), "
                         "or give this one another directory")
        self.mode = "owner" if own else "reader"
        try:
            self._ufd = os.open(self.path / ".usage", os.O_RDWR | os.O_CREAT, 0o660)
        except PermissionError:
            if own:
                raise
            # a reader of another user without write access: lookups and
            # loads only; its evictions are dropped
            self._ufd = os.open(self.path / ".usage", os.O_RDONLY)
            self._broken = True
            self._log_once("disk", "directory not writable by this process: reading only, "
                                   "dropping evicted blocks")
        self._rfd = os.open(self.path / ".readers", os.O_RDONLY | os.O_CREAT, 0o660)
        if own:
            with self._shared():
                self._recount()
            self.maintain()
        else:
            # held while attached: the owner sees that readers need room
            fcntl.flock(self._rfd, fcntl.LOCK_SH)
            deadline = time.monotonic() + HEADER_WAIT_S
            while self._header() is None:       # an owner just took the lock: let it start
                if time.monotonic() >= deadline:
                    raise OSError(f"{self.path / '.usage'} is not set up by an owner "
                                  "(start `cxlkv serve --spill-dir` or enable it as owner)")
                time.sleep(0.01)

    def _owner_pid(self) -> int:
        try:
            with open(self.path / ".usage", "rb") as f:
                raw = f.read(USAGE.size)
        except OSError:
            return 0
        if len(raw) < USAGE.size:
            return 0
        magic, ver, _, _, _, pid = USAGE.unpack(raw)
        return pid if magic == USAGE_MAGIC else 0

    def _recount(self) -> None:
        """Owner, DIR/.usage locked: rebuild the index from the files (oldest
        first), recount the published bytes, start an empty journal; remove
        temporaries of processes that are gone."""
        found = []
        total = 0
        me = os.getpid()
        for sub in self.path.iterdir():
            if len(sub.name) != 2 or not sub.is_dir():
                continue
            for f in sub.iterdir():
                try:
                    if f.name.endswith(".tmp"):
                        pid = _tmp_pid(f.name)
                        if pid is None or pid == me or not _alive(pid):
                            f.unlink()
                        continue
                    if not f.name.endswith(".blk") or len(f.name) != 36:
                        continue
                    st = f.stat()
                    found.append((st.st_mtime_ns, bytes.fromhex(f.name[:32]), st.st_size))
                    total += st.st_size
                except (OSError, ValueError):
                    continue
        found.sort()
        with self._mu:
            self._index.clear()
            for mt, key, size in found:
                self._index[key] = [size, mt]
        os.pwrite(self._ufd, USAGE.pack(USAGE_MAGIC, USAGE_VERSION, 0, total, self.max_bytes,
                                        os.getpid()).ljust(USAGE_SIZE, b"\0"), 0)
        os.ftruncate(self._ufd, USAGE_SIZE)          # the journal: every file is indexed

    # -- the shared counter and journal ----------------------------------------------------
    @contextlib.contextmanager
    def _shared(self):
        """DIR/.usage locked: by one thread of this process, and one process."""
        with self._umu:
            fcntl.flock(self._ufd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._ufd, fcntl.LOCK_UN)

    def _header(self) -> tuple[int, int] | None:
        """(published bytes, limit) from DIR/.usage, or None when it is not
        set up (or from a newer cxlkv).  A plain read: exact under _shared."""
        if self._ufd is None:
            return None
        try:
            raw = os.pread(self._ufd, USAGE.size, 0)
        except OSError:
            return None
        if len(raw) < USAGE.size:
            return None
        magic, ver, _, used, limit, _ = USAGE.unpack(raw)
        if magic != USAGE_MAGIC or ver != USAGE_VERSION:
            return None
        return used, limit

    def _add_used(self, delta: int) -> None:
        """DIR/.usage locked."""
        h = self._header()
        used = h[0] if h else 0
        os.pwrite(self._ufd, struct.pack("<Q", max(0, used + delta)), _USED)

    def _fold_journal(self) -> None:
        """Owner: index the files readers published since the last fold (at
        the most recent end, stamped now: their writers just evicted them)."""
        try:
            if os.fstat(self._ufd).st_size <= USAGE_SIZE:
                return
            with self._shared():
                end = os.fstat(self._ufd).st_size
                raw = os.pread(self._ufd, end - USAGE_SIZE, USAGE_SIZE)
                os.ftruncate(self._ufd, USAGE_SIZE)
        except OSError as e:
            self._fail("disk", e, count=False)
            return
        now = time.time_ns()
        n = 0
        with self._mu:
            for i in range(0, len(raw) - REC.size + 1, REC.size):
                key, size = REC.unpack_from(raw, i)
                if not HDR_SIZE < size <= max(self.max_bytes, HDR_SIZE + 1):
                    continue                     # a torn or foreign record
                self._index[key] = [size, now]
                self._index.move_to_end(key)
                n += 1
        self._bump("discovered", n)

    def _readers(self) -> bool:
        """Owner: is any reader attached (holding DIR/.readers shared)?  Two
        syscalls; a reader attaching meanwhile waits for the second."""
        try:
            fcntl.flock(self._rfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            return False
        fcntl.flock(self._rfd, fcntl.LOCK_UN)
        return False

    def _target(self) -> int:
        """Owner: how full it lets the store get (the limit, less the readers'
        room while readers were attached at the last maintenance)."""
        if self._with_readers:
            return self.max_bytes - int(self.max_bytes * self.reader_room)
        return self.max_bytes

    # -- bookkeeping -------------------------------------------------------------------
    def _file(self, key: bytes) -> Path:
        h = key.hex()
        return self.path / h[:2] / (h + ".blk")

    def _bump(self, name: str, n: int = 1) -> None:
        if n:
            with self._cmu:
                self.counters[name] += n

    def _log(self, kind: str, msg: str) -> None:
        if self._logger is None:
            sys.stderr.write(f"cxlkv: spill: {msg}\n")
        else:
            self._logger.log(logging.WARNING, f"spill: {msg}",
                             extra={"fields": {"spill_dir": str(self.path), "reason": kind}})

    def _log_once(self, kind: str, msg: str) -> None:
        if kind not in self._logged:           # one log line per kind
            self._logged.add(kind)
            self._log(kind, f"{self.path}: {msg}; counted in stats(), logged once")

    def _fail(self, kind: str, err=None, count: bool = True) -> None:
        if count:
            self._bump(f"dropped_{kind}", 1)
        self._log_once(kind, f"dropping evicted blocks ({kind}{': ' + str(err) if err else ''})")

    def promote_failed(self, err) -> None:
        """The pool refused a promotion (full of pinned blocks, quota): the
        caller gets the pool's run only; the block stays on disk."""
        self._bump("promote_failed", 1)
        self._log_once("promote", f"could not promote spilled blocks into the pool ({err})")

    def _remember(self, key: bytes, size: int, mtime: int = 0) -> None:
        """Index `key` at the most recent end (a reader's index is bounded)."""
        with self._mu:
            self._index[key] = [size, mtime]
            self._index.move_to_end(key)
            if self.mode == "reader" and len(self._index) > READER_INDEX:
                self._index.popitem(last=False)

    def _remove(self, key: bytes, size: int) -> bool:
        """Remove a bad file; whoever's unlink succeeds takes its bytes off
        the shared count (DIR/.usage locked: a recount never sees half of it)."""
        with self._mu:
            e = self._index.pop(key, None)
        if e is not None and self.mode == "owner":
            size = e[0]
        if self._ufd is None:                   # an unusable directory: nothing to count
            return False
        try:
            with self._shared():
                os.unlink(self._file(key))
                self._add_used(-size)
        except OSError:
            return False
        return True

    def _make_room(self, size: int, target: int) -> bool:
        """Owner: remove least recently used files until `size` more bytes
        fit under `target`; a file a reader used since the owner last saw it
        (newer mtime) gets one second chance instead.  No lock is held while
        it stats and unlinks.  False: it cannot fit."""
        if size > self.max_bytes:
            return False
        chanced: set[bytes] = set()
        folded = False
        while True:
            h = self._header()
            if h is None:
                return False
            need = h[0] + size - target
            if need <= 0:
                return True
            if not folded:                    # readers' files are candidates too
                folded = True
                self._fold_journal()
            with self._mu:
                cands, got = [], 0
                while self._index and got < need:
                    k, e = self._index.popitem(last=False)
                    cands.append((k, e))
                    got += e[0]
            if not cands:
                return False
            back, dead = [], []
            for k, (sz, mt) in cands:
                try:
                    st = os.stat(self._file(k))
                except FileNotFoundError:
                    continue                     # a reader removed it (and its bytes)
                except OSError:
                    dead.append((k, sz))
                    continue
                if st.st_mtime_ns > mt and k not in chanced:
                    chanced.add(k)
                    back.append((k, [sz, st.st_mtime_ns]))
                else:
                    dead.append((k, sz))
            if back:
                with self._mu:
                    for k, e in back:
                        if k not in self._index:          # not re-added meanwhile
                            self._index[k] = e
                self._bump("second_chance", len(back))
            freed = n = 0
            for k, sz in dead:
                try:
                    os.unlink(self._file(k))
                except FileNotFoundError:
                    continue
                except OSError as e:
                    self._log_once("unlink", f"cannot remove {self._file(k)} ({e})")
                    continue
                freed += sz
                n += 1
            if freed:
                try:
                    with self._shared():
                        self._add_used(-freed)
                except OSError as e:
                    self._fail("disk", e, count=False)
                    return False
            self._bump("evicted", n)

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
                if self.mode == "reader" and key not in self._queued:
                    # ... as far as a reader knows: its writer touches the file
                    # (the owner's LRU sees the use) or finds it gone
                    self._queued.add(key)
                    self._q.put((key, None, b""))
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

    # -- the writer threads and the owner's maintenance -------------------------------------
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

    def _maintainer(self) -> None:
        while not self._stop.wait(MAINTAIN_S):
            try:
                self.maintain()
            except Exception as e:                     # noqa: BLE001 - never raise
                self._log_once("maintain", f"maintenance failed ({type(e).__name__}: {e})")

    def maintain(self) -> None:
        """Owner: see whether readers are attached, fold their journal in
        and, while any is, free their room (runs every MAINTAIN_S by itself)."""
        if self.mode != "owner" or self._broken or self._closed or self._rfd is None:
            return
        self._with_readers = self._readers()
        self._fold_journal()
        self._make_room(0, self._target())

    def _touch(self, path: Path, st) -> None:
        """A reader used the file: set its mtime past what anyone recorded
        (a file of another user: to the kernel's now, which needs only write
        access)."""
        t = max(time.time_ns(), st.st_mtime_ns + 1)
        try:
            os.utime(path, ns=(t, t))
        except PermissionError:
            try:
                os.utime(path)
            except OSError:
                pass
        except OSError:
            pass

    def _write(self, key: bytes, ns_digest: bytes | None, payload: bytes) -> None:
        size = HDR_SIZE + len(payload)
        path = self._file(key)
        if ns_digest is None:                        # a reader's touch (see reserve)
            try:
                self._touch(path, os.stat(path))
            except OSError:
                with self._mu:                       # the owner removed it meanwhile
                    self._index.pop(key, None)
                self._bump("already", -1)
                self._fail("gone", "the owner removed a file this reader had seen")
            return
        if self._broken:
            self._fail("disk")
            return
        owner = self.mode == "owner"
        if owner:
            with self._mu:
                if key in self._index:
                    self._index.move_to_end(key)
                    return
            if not self._make_room(size, self._target()):
                self._fail("store-full")
                return
        else:
            try:
                st = os.stat(path)
            except FileNotFoundError:
                st = None
            except OSError as e:
                self._fail("disk", e)
                return
            if st is not None:                       # on disk: mark it used
                self._touch(path, st)
                self._remember(key, st.st_size)
                self._bump("already", 1)
                return
            h = self._header()
            if h is None or h[0] + size > h[1]:
                self._fail("store-full")
                return
        self._tmpn += 1
        tmp = path.with_name(f"{path.name[:-4]}.{os.getpid()}.{threading.get_ident()}"
                             f".{self._tmpn}.tmp")
        try:
            try:
                path.parent.mkdir(exist_ok=True, mode=0o770)
                hdr = HDR.pack(MAGIC, VERSION, 0, key, ns_digest, len(payload),
                               xxhash.xxh3_64_intdigest(payload))
                hdr += struct.pack("<Q", xxhash.xxh3_64_intdigest(hdr))
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o660)
                try:
                    _write_all(fd, hdr)
                    _write_all(fd, payload)
                finally:
                    os.close(fd)
                # not before the file's own (coarse) mtime: an untouched file
                # never looks used; a reader's touch comes later
                mtime = time.time_ns()
                res = self._publish(key, tmp, path, size)
                if res == "full" and owner:          # others took the room meanwhile
                    res = self._publish(key, tmp, path, size) \
                        if self._make_room(size, self.max_bytes) else "full"
            except OSError as e:
                self._fail("disk", e)
                return
        finally:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        if res == "full":
            self._fail("store-full")
            return
        if res == "already":                         # a reader's, not folded in yet
            self._bump("already", 1)
            return
        self._remember(key, size, mtime)
        self._bump("written", 1)
        self._bump("written_bytes", len(payload))

    def _publish(self, key: bytes, tmp: Path, path: Path, size: int) -> str:
        """Rename the written temporary into place and count it, if no file
        of that key is there and the shared total stays within the limit:
        "ok", "already" or "full".  A reader also journals it for the owner."""
        with self._shared():
            h = self._header()
            if h is None:
                raise OSError(f"{self.path / '.usage'} is damaged")
            if os.path.exists(path):
                return "already"
            if h[0] + size > h[1]:
                return "full"
            os.replace(tmp, path)
            os.pwrite(self._ufd, struct.pack("<Q", h[0] + size), _USED)
            if self.mode == "reader":
                end = os.fstat(self._ufd).st_size
                end = USAGE_SIZE + max(0, end - USAGE_SIZE) // REC.size * REC.size
                os.pwrite(self._ufd, REC.pack(key, size), end)
        return "ok"

    # -- the reader's side ---------------------------------------------------------------
    def run(self, keys) -> int:
        """How many leading `keys` (rows of 16 bytes) the store holds: the
        owner's index; a reader's index, then one stat per key."""
        n = 0
        if self.mode == "owner":
            with self._mu:
                for k in keys:
                    if bytes(k) not in self._index:
                        break
                    n += 1
            return n
        for k in keys:
            kb = bytes(k)
            with self._mu:
                if kb in self._index:
                    n += 1
                    continue
            try:
                st = os.stat(self._file(kb))
            except OSError:
                break
            self._remember(kb, st.st_size)
            n += 1
        return n

    def get(self, key: bytes, ns_digest: bytes, length: int) -> memoryview | None:
        """The payload of `key`, verified, or None (a bad file is removed)."""
        owner = self.mode == "owner"
        if owner:
            with self._mu:
                if key not in self._index:
                    self._bump("misses", 1)
                    return None
                self._index.move_to_end(key)
        path = self._file(key)
        try:
            with open(path, "rb") as f:
                raw = f.read(HDR_SIZE + length + 1)
                st = None if owner else os.fstat(f.fileno())
        except FileNotFoundError:
            with self._mu:                      # removed by the owner or a reader
                self._index.pop(key, None)
            self._bump("misses", 1)
            return None
        except OSError:
            if owner:
                self._remove(key, HDR_SIZE + length)
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
            self._remove(key, HDR_SIZE + length)
            self._bump("corrupt", 1)
            if "corrupt" not in self._logged:
                self._logged.add("corrupt")
                self._log("corrupt", f"{path}: corrupt or truncated spilled block removed (a "
                                     "miss; further ones are counted in stats(), not logged)")
            return None
        if not owner:
            self._touch(path, st)
            self._remember(key, len(raw))
        self._bump("hits", 1)
        return memoryview(raw)[HDR_SIZE:]

    # -- management ----------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued block is written (or dropped)."""
        self._q.join()

    def stats(self) -> dict:
        h = self._header()
        with self._mu:
            out = {"path": str(self.path), "mode": self.mode,
                   "max_bytes": h[1] if h else self.max_bytes, "used_bytes": h[0] if h else 0,
                   "blocks": len(self._index), "queued_bytes": self._pending,
                   "queue_bytes": self.queue_bytes}
        with self._cmu:
            counters = dict(self.counters)
        for k in COUNTERS:
            out[k] = counters.get(k, 0)
        out["dropped"] = sum(v for k, v in counters.items() if k.startswith("dropped_"))
        return out

    def close(self, timeout: float | None = None) -> bool:
        """Write what is queued, stop the threads, release the directory.
        With a timeout, what is not written by then is left to the daemon
        threads (the process is exiting); returns False then."""
        if self._closed:
            return True
        self._closed = True
        self._stop.set()
        for _ in range(sum(1 for th in self._threads if th.name != "cxlkv-spill-maintain")):
            self._q.put(None)
        end = None if timeout is None else time.monotonic() + timeout
        for th in self._threads:
            th.join(None if end is None else max(0.0, end - time.monotonic()))
        if any(th.is_alive() for th in self._threads):
            return False
        self._close_fds()
        return True

    def _close_fds(self) -> None:
        for attr in ("_lockfd", "_ufd", "_rfd"):
            fd = getattr(self, attr)
            if fd is not None:
                setattr(self, attr, None)
                try:
                    os.close(fd)
                except OSError:
                    pass


#: the counters stats() reports (beside the figures and "dropped", their sum)
COUNTERS = ("written", "written_bytes", "hits", "misses", "corrupt", "evicted", "second_chance",
            "discovered", "already", "promoted", "promote_failed", "dropped_queue-full",
            "dropped_store-full", "dropped_disk", "dropped_copy", "dropped_gone")
DROP_REASONS = ("queue-full", "store-full", "disk", "copy", "gone")


def _tmp_pid(name: str) -> int | None:
    """The writer's pid in a temporary's name (KEY.PID.THREAD.N.tmp)."""
    parts = name.split(".")
    if len(parts) == 5 and parts[1].isdigit():
        return int(parts[1])
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_all(fd: int, data) -> None:
    mv = memoryview(data)
    while mv:
        n = os.write(fd, mv)
        mv = mv[n:]


# -- Prometheus --------------------------------------------------------------------------

#: cxlkv_spill_* counters: (name, stats key, help)
METRIC_COUNTERS = (
    ("written_blocks", "written", "Blocks this process wrote to the spill store."),
    ("written_bytes", "written_bytes", "Payload bytes this process wrote to the spill store."),
    ("hits", "hits", "Spilled blocks this process read back and verified."),
    ("misses", "misses", "Spilled blocks looked for and not found."),
    ("promoted_blocks", "promoted", "Spilled blocks stored back into the pool."),
    ("promote_failed", "promote_failed", "Promotions the pool refused (pinned full, quota)."),
    ("corrupt", "corrupt", "Spilled files that failed verification (removed)."),
    ("evicted_blocks", "evicted", "Files the owner removed to make room (its LRU)."),
    ("second_chances", "second_chance", "LRU victims kept because a reader used them since."),
    ("already_on_disk", "already", "Evicted blocks already on disk (not written again)."),
)
METRIC_GAUGES = (
    ("store_bytes", "used_bytes", "File bytes in the spill store (all processes)."),
    ("limit_bytes", "max_bytes", "The spill store's size limit (the owner's)."),
    ("queue_bytes", "queued_bytes", "Payload bytes waiting for this process's spill writers."),
    ("queue_limit_bytes", "queue_bytes", "Bound of the spill writer queue."),
    ("blocks", "blocks", "Files indexed by this process (the owner: all it knows of)."),
    ("owner", lambda s: 1 if s["mode"] == "owner" else 0,
     "1 when this process owns the spill directory, 0 a reader."),
)


class Collector(StatsCollector):
    """A prometheus_client collector over a spill store's stats(): register
    it in a serving process's registry (``spill.collector(pool)``); the node
    agent registers one for the store it owns.  `source` is a SpillStore, or
    a callable returning one (or None: no samples)."""

    def __init__(self, source):
        super().__init__("cxlkv_spill", source, METRIC_COUNTERS, METRIC_GAUGES, [(
            "dropped_blocks", "Evicted blocks not spilled, by reason (queue-full, store-full, "
            "disk, copy, gone).", "reason", [(r, f"dropped_{r}") for r in DROP_REASONS])])


def collector(pool) -> Collector:
    """A collector of `pool`'s spill store (whichever is enabled when scraped)."""
    return Collector(lambda: store_of(pool))


# -- per pool object ------------------------------------------------------------------------
#: stores open in this process by directory: (weak reference to the pool, store)
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
    store = SpillStore(path, max_bytes, queue_bytes=queue_bytes, writers=writers, mode=mode,
                       logger=logger)
    pool.__dict__[_ATTR] = store
    _OPEN[real] = (weakref.ref(pool), store)
    weakref.finalize(pool, store.close)
    return store


def use(pool, store: SpillStore) -> None:
    """Give `pool` a store its caller opened and closes (the node agent keeps
    one store across the pool objects of its re-attaches)."""
    cur = pool.__dict__.get(_ATTR)
    if cur is not None and cur is not store:
        raise UsageError(f"this pool already spills to {cur.path}")
    pool.__dict__[_ATTR] = store


def disable(pool) -> None:
    """Write what is queued and release the directory (before closing the pool)."""
    store = pool.__dict__.pop(_ATTR, None)
    if store is not None:
        store.close()
        _OPEN.pop(store.path.resolve(), None)


def store_of(pool) -> SpillStore | None:
    return pool.__dict__.get(_ATTR)
