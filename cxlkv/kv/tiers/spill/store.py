"""The spill store (`SpillStore`): a bounded directory of spilled blocks on
local disk, owned by one process of the host and shared with its readers;
the "spill" tier of a pool object (cxlkv.kv.tiers.base.Tier).  The whole
design is in the package doc (cxlkv.kv.tiers.spill).

Locks: `_mu` guards the index, the writer queue's bookkeeping (`_pending`,
`_queued`) and `_closed`; `_cmu` the counters; DIR/.usage has its own
(`Usage.locked`, taken without `_mu` held).  The evictor calls reserve / put
/ take under the pool lock: they do memory work only.
"""
from __future__ import annotations

import collections
import fcntl
import logging
import os
import queue
import threading
import time
from pathlib import Path

from cxlkv.errors import SpillDirBusy, UsageError
from cxlkv.kv.tiers.base import Tier
from cxlkv.kv.tiers.spill import files
from cxlkv.kv.tiers.spill.files import HDR_SIZE
from cxlkv.kv.tiers.spill.lru import READER_INDEX, Index, second_chance
from cxlkv.kv.tiers.spill.usage import Usage, owner_pid

log = logging.getLogger(__name__)

#: default bound of the writer queue (payload bytes waiting for the disk)
QUEUE_BYTES = 64 << 20
#: writer threads (file creation dominates on ext4: two threads about double it)
WRITERS = 2
#: share of the limit the owner keeps free for readers' writes while any is attached
READER_ROOM = 0.125
#: the owner folds the readers' journal in and keeps their room this often
MAINTAIN_S = 0.25
#: how long a reader waits for a starting owner to write DIR/.usage
HEADER_WAIT_S = 2.0
MODES = ("auto", "owner", "reader")


class SpillStore(Tier):
    """A bounded directory of spilled blocks, owned by one process and shared
    with the readers of the host (see the package doc)."""

    kind = "spill"

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
        # owner: every file it knows of; reader: the files it has seen (bounded)
        self._index = Index(READER_INDEX if self.mode == "reader" else None)
        self._pending = 0                 # payload bytes queued, not yet written
        self._queued: set[bytes] = set()
        self._logged: set[str] = set()
        self.counters = collections.Counter()
        self._cmu = threading.Lock()           # counters (bumped with or without _mu)
        self._lockfd = self._rfd = None
        self._usage: Usage | None = None       # DIR/.usage
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
        # other users in the pool's group: see the package doc)
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
                pid = owner_pid(self.path / ".usage")
                raise SpillDirBusy(
                    f"spill directory {self.path} is owned by another process"
                    + (f" (pid {pid})" if pid else ""), path=str(self.path),
                    hint="stop that process, attach as a reader (mode 'reader' or 'auto'), "
                         "or give this one another directory")
        self.mode = "owner" if own else "reader"
        self._index.bound = None if own else READER_INDEX
        try:
            self._usage = Usage(os.open(self.path / ".usage", os.O_RDWR | os.O_CREAT, 0o660))
        except PermissionError:
            if own:
                raise
            # a reader of another user without write access: lookups and
            # loads only; its evictions are dropped
            self._usage = Usage(os.open(self.path / ".usage", os.O_RDONLY))
            self._broken = True
            self._log_once("disk", "directory not writable by this process: reading only, "
                                   "dropping evicted blocks")
        self._rfd = os.open(self.path / ".readers", os.O_RDONLY | os.O_CREAT, 0o660)
        if own:
            with self._usage.locked():
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
                        pid = files.tmp_pid(f.name)
                        if pid is None or pid == me or not _alive(pid):
                            f.unlink()
                        continue
                    key = files.block_key(f.name)
                    if key is None:
                        continue
                    st = f.stat()
                    found.append((st.st_mtime_ns, key, st.st_size))
                    total += st.st_size
                except (OSError, ValueError):
                    continue
        found.sort()
        with self._mu:
            self._index.clear()
            for mt, key, size in found:
                self._index.remember(key, size, mt)
        self._usage.reset(total, self.max_bytes)    # the journal: every file is indexed

    # -- the shared counter and journal ----------------------------------------------------
    def _header(self) -> tuple[int, int] | None:
        """(published bytes, limit) from DIR/.usage, or None when it is not
        set up (or from a newer cxlkv).  A plain read: exact when locked."""
        return None if self._usage is None else self._usage.header()

    def _fold_journal(self) -> None:
        """Owner: index the files readers published since the last fold (at
        the most recent end, stamped now: their writers just evicted them)."""
        try:
            recs = self._usage.take_records()
        except OSError as e:
            self._fail("disk", e, count=False)
            return
        if not recs:
            return
        now = time.time_ns()
        n = 0
        with self._mu:
            for key, size in recs:
                if not HDR_SIZE < size <= max(self.max_bytes, HDR_SIZE + 1):
                    continue                     # a torn or foreign record
                self._index.remember(key, size, now)
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
        return files.block_path(self.path, key)

    def _bump(self, name: str, n: int = 1) -> None:
        if n:
            with self._cmu:
                self.counters[name] += n

    def _log(self, kind: str, msg: str) -> None:
        (self._logger or log).log(logging.WARNING, f"spill: {msg}",
                                  extra={"fields": {"spill_dir": str(self.path), "reason": kind}})

    def _log_once(self, kind: str, msg: str) -> None:
        if kind not in self._logged:           # one log line per kind
            self._logged.add(kind)
            self._log(kind, f"{self.path}: {msg}; counted in stats(), logged once")

    def _fail(self, kind: str, err=None, count: bool = True) -> None:
        if count:
            self._bump(f"dropped_{kind}", 1)
        self._log_once(kind, f"dropping evicted blocks ({kind}{': ' + str(err) if err else ''})")

    def _remember(self, key: bytes, size: int, mtime: int = 0) -> None:
        """Index `key` at the most recent end (a reader's index is bounded)."""
        with self._mu:
            self._index.remember(key, size, mtime)

    def _remove(self, key: bytes, size: int) -> bool:
        """Remove a bad file; whoever's unlink succeeds takes its bytes off
        the shared count (DIR/.usage locked: a recount never sees half of it)."""
        with self._mu:
            e = self._index.pop(key)
        if e is not None and self.mode == "owner":
            size = e[0]
        if self._usage is None:                 # an unusable directory: nothing to count
            return False
        try:
            with self._usage.locked():
                os.unlink(self._file(key))
                self._usage.add_used(-size)
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
                cands = self._index.oldest(need)
            if not cands:
                return False
            back, dead = second_chance(cands, chanced, self._file)
            if back:
                with self._mu:
                    self._index.put_back(back)
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
                    with self._usage.locked():
                        self._usage.add_used(-freed)
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
            if self._index.touch(key):            # already on disk: nothing to write
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

    def take(self, key: bytes, nbytes: int, copy) -> bool:
        """The Tier's eviction hand-off: reserve, copy out of the pool, queue
        (a failed copy is dropped, counted `dropped_copy`)."""
        try:
            if not self.reserve(key, nbytes):
                return False
        except Exception:                             # pragma: no cover - defensive
            return False
        try:
            ns_digest, data = copy()
        except Exception as err:                      # pragma: no cover - defensive
            self.unreserve(key, nbytes)
            self._fail("copy", err)
            return False
        self.put(key, ns_digest, data)
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
                    self._index.pop(key)
                self._bump("already", -1)
                self._fail("gone", "the owner removed a file this reader had seen")
            return
        if self._broken:
            self._fail("disk")
            return
        owner = self.mode == "owner"
        if owner:
            with self._mu:
                if self._index.touch(key):
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
        tmp = files.tmp_path(path, threading.get_ident(), self._tmpn)
        try:
            try:
                path.parent.mkdir(exist_ok=True, mode=0o770)
                hdr = files.header(key, ns_digest, payload)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o660)
                try:
                    files.write_all(fd, hdr)
                    files.write_all(fd, payload)
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
        u = self._usage
        with u.locked():
            h = u.header()
            if h is None:
                raise OSError(f"{self.path / '.usage'} is damaged")
            if os.path.exists(path):
                return "already"
            if h[0] + size > h[1]:
                return "full"
            os.replace(tmp, path)
            u.set_used(h[0] + size)
            if self.mode == "reader":
                u.append(key, size)
        return "ok"

    # -- the reader's side ---------------------------------------------------------------
    def run(self, keys) -> int:
        """How many leading `keys` (rows of 16 bytes) the store holds: the
        owner's index; a reader's index, then one stat per key."""
        if self.mode == "owner":
            with self._mu:
                return self._index.run(keys)
        n = 0
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
                if not self._index.touch(key):
                    self._bump("misses", 1)
                    return None
        path = self._file(key)
        try:
            with open(path, "rb") as f:
                raw = f.read(HDR_SIZE + length + 1)
                st = None if owner else os.fstat(f.fileno())
        except FileNotFoundError:
            with self._mu:                      # removed by the owner or a reader
                self._index.pop(key)
            self._bump("misses", 1)
            return None
        except OSError:
            if owner:
                self._remove(key, HDR_SIZE + length)
            self._bump("misses", 1)
            return None
        if not files.verify(raw, key, ns_digest, length):
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

    # -- the Tier's part behind the pool ---------------------------------------------------
    held = run

    def fetch(self, keys, ns_digest: bytes, block_bytes: int,
              budget_s: float | None = None) -> list:
        """The leading run of `keys` the store holds, read and verified."""
        out: list = []
        if not self.run(keys[:1]):
            return out
        for k in keys:
            b = self.get(bytes(k), ns_digest, block_bytes)
            if b is None:
                break
            out.append(b)
        return out

    def promoted(self, blocks: int) -> None:
        self._bump("promoted", blocks)

    def promote_failed(self, err) -> None:
        """The pool refused a promotion (full of pinned blocks, quota): the
        caller gets the pool's run only; the block stays on disk."""
        self._bump("promote_failed", 1)
        self._log_once("promote", f"could not promote spilled blocks into the pool ({err})")

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
        for attr in ("_lockfd", "_rfd"):
            fd = getattr(self, attr)
            if fd is not None:
                setattr(self, attr, None)
                try:
                    os.close(fd)
                except OSError:
                    pass
        u, self._usage = self._usage, None
        if u is not None:
            u.close()


#: the counters stats() reports (beside the figures and "dropped", their sum)
COUNTERS = ("written", "written_bytes", "hits", "misses", "corrupt", "evicted", "second_chance",
            "discovered", "already", "promoted", "promote_failed", "dropped_queue-full",
            "dropped_store-full", "dropped_disk", "dropped_copy", "dropped_gone")
DROP_REASONS = ("queue-full", "store-full", "disk", "copy", "gone")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
