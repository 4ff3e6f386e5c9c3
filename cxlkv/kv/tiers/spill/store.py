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
import sys
import threading
import time
from pathlib import Path

import numpy as np
import xxhash

from cxlkv import _core
from cxlkv.errors import SpillDirBusy, SpillOldFormat, UsageError
from cxlkv.kv.tiers.base import Tier
from cxlkv.kv.tiers.spill import files, readpath
from cxlkv.kv.tiers.spill.lru import READER_INDEX, Index, second_chance
from cxlkv.kv.tiers.spill.usage import Usage, owner_pid

log = logging.getLogger(__name__)

#: default bound of the writer queue (payload bytes waiting for the disk)
QUEUE_BYTES = 64 << 20
#: writer threads (each writes batches; two keep the disk busy while one hashes)
WRITERS = 2
#: a writer takes up to this many queued blocks / bytes at once (one flock to
#: claim their slots, one to publish them; adjacent slots in one pwritev)
BATCH_BLOCKS = 32
BATCH_BYTES = 8 << 20
#: adjacent slots are written with one pwritev up to this many bytes.  Larger
#: calls met the kernel's dirty-page throttling here: bursts of 1 MiB calls
#: were paused 2.4-4.7 ms a call from 160-320 MiB dirty on (about 0.4 GiB/s),
#: in 5 of 11 bursts of 256 MiB and 2 of 2 of 1 GiB, calls of 256 or 512 KiB
#: in none (Linux 6.18, ext4, 2026-12-07: scripts/write_sizes.py); 8 MiB
#: calls were worse still
WRITE_BYTES = 512 << 10
#: buffers fetch keeps per block size for reuse (see SpillStore._buffers)
FETCH_BUFFERS = 64
#: fetch's buffers start on a page (4 KiB) boundary: the kernel's copy into
#: them ran 5-15 % faster than into numpy's default (16 bytes past a page)
BUF_ALIGN = 4096
#: helper threads that read and verify a run's units beside the caller (C,
#: process-wide: cxlkv/_core/src/spill_pool.c).  None by default: on the
#: 2-vCPU VM this was measured on, a helper made back-to-back runs 1.3-1.6x
#: faster but the bench's runs (after other I/O) 15-25 % slower (README)
READ_HELPERS = 0
MAX_READ_HELPERS = 8
#: disk blocks of a slot file are reserved (posix_fallocate) this much at a time
PREALLOC = 64 << 20
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
                 reader_room: float = READER_ROOM, read_helpers: int | None = None,
                 read_path: str | None = None):
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise UsageError("spill_bytes must be a byte count >= 0")
        if not isinstance(queue_bytes, int) or queue_bytes < 0:
            raise UsageError("queue_bytes must be a byte count >= 0")
        if mode not in MODES:
            raise UsageError(f"spill mode must be one of {', '.join(MODES)}, not {mode!r}")
        if not 0 <= reader_room < 1:
            raise UsageError("reader_room must be a share of the limit in [0, 1)")
        if read_helpers is None:
            read_helpers = READ_HELPERS
        if not isinstance(read_helpers, int) or not 0 <= read_helpers <= MAX_READ_HELPERS:
            raise UsageError(f"read_helpers must be 0..{MAX_READ_HELPERS}")
        self._paths = readpath.ReadPaths(readpath.from_env(read_path))
        # the helpers are the process's: as many as the store that asked most wants
        if read_helpers > _core.spill_helper_stats()["helpers"]:
            _core.spill_helpers(read_helpers)
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
        # key -> (namespace digest, payload) of the blocks put() queued and
        # the writers have not finished: a hit from memory meanwhile
        self._inflight: dict[bytes, tuple] = {}
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
        self._writable = True
        self._files: dict[int, files.SlotFile] = {}   # slot bytes -> its slot file
        self._retired: list[files.SlotFile] = []      # replaced (made again): closed at close
        self._gen = -1                          # DIR/.usage's slot-file generation seen
        self._bmu = threading.Lock()            # guards _bufs and _spare
        self._bufs: dict[int, list] = {}        # fetch's reusable buffers, by size
        # take()'s copy buffers back from the writers, by size (at most
        # queue_bytes of them): a copy under the pool lock into fresh memory
        # faults every page in (2 GB/s here), into a reused one it does not
        self._spare: dict[int, list] = {}
        self._spare_bytes = 0
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
            self._writable = False
            self._broken = True
            self._log_once("disk", "directory not writable by this process: reading only, "
                                   "dropping evicted blocks")
        self._rfd = os.open(self.path / ".readers", os.O_RDONLY | os.O_CREAT, 0o660)
        if own:
            with self._usage.locked():
                self._recount()
            self._migrate()
            self._migrate_v2()
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
            self._scan()

    def _scan(self) -> None:
        """Open the slot files this process has not open (or that were
        made again since); remembers the generation it saw."""
        gen = self._usage.gen() if self._usage is not None else 0
        for f in self.path.iterdir():
            sb = files.file_slot_bytes(f.name)
            if sb is None:
                continue
            cur = self._files.get(sb)
            try:
                if cur is not None and os.stat(f).st_ino == cur.ino:
                    continue
                sf = files.SlotFile.open(f, self._writable)
            except SpillOldFormat as e:
                if self.mode != "owner":              # the owner migrates it (_migrate)
                    self._log_once("slot-file", f"cannot use {f} ({e})")
                continue
            except OSError as e:
                self._log_once("slot-file", f"cannot use {f} ({e})")
                continue
            self._files[sb] = sf
            if cur is not None:
                self._retired.append(cur)
        self._gen = gen

    def _rescan_if_new(self) -> None:
        """A slot file was made since this process looked: open it."""
        if self._usage is not None and self._usage.gen() != self._gen:
            self._scan()

    def _class(self, sbytes: int) -> files.SlotFile | None:
        """DIR/.usage locked: the slot file of `sbytes` slots, made when
        there is none (its slots: as many as the limit holds)."""
        sf = self._files.get(sbytes)
        if sf is not None:
            return sf
        self._rescan_if_new()
        sf = self._files.get(sbytes)
        if sf is not None:
            return sf
        h = self._usage.header()
        nslots = (h[1] if h else self.max_bytes) // (files.HDR_SIZE + sbytes)
        if nslots < 1:
            return None
        path = self.path / files.file_name(sbytes)
        if path.exists():
            sf = files.SlotFile.open(path, self._writable)
        else:
            sf = files.SlotFile.create(path, sbytes, nslots)
            self._usage.bump_gen()
        self._files[sbytes] = sf
        self._gen = self._usage.gen()
        return sf

    def _recount(self) -> None:
        """Owner, DIR/.usage locked: open the slot files, free the slots of
        writers that are gone (WRITING) and the headers that do not verify,
        rebuild each file's index and this process's LRU (oldest stamp
        first) from the slot headers, recount the published bytes, start an
        empty journal."""
        self._scan()
        me = os.getpid()
        found = []
        total = 0
        for sb, sf in self._files.items():
            fp = files.HDR_SIZE + sb
            for slot in np.flatnonzero(sf.states != files.FREE).tolist():
                state = sf.states[slot]
                raw = sf.raw_header(slot)
                key = raw[16:32]
                if state == files.WRITING:
                    pid = int(sf.stamps[slot])
                    if pid == me or not 0 < pid < 1 << 22 or not _alive(pid):
                        sf.release(slot, key)
                    else:
                        total += fp            # still being written by a live reader
                    continue
                p = files.parse(raw)
                if p is None or files.slot_bytes(p[2]) != sb:
                    sf.release(slot, key)      # torn: a miss
                    continue
                found.append((int(sf.stamps[slot]), key, fp, (sb, slot)))
                total += fp
            sf.reindex()
        found.sort()
        with self._mu:
            self._index.clear()
            for stamp, key, size, loc in found:
                self._index.remember(key, size, stamp, loc)
        self._usage.reset(total, self.max_bytes)    # the journal: every block is indexed
        self._gen = self._usage.gen()

    def _migrate(self) -> None:
        """Owner: move the blocks of the old one-file-per-block format
        (DIR/<2 hex>/<key>.blk, version 1) into the slot files, verified
        (what does not verify or fit is dropped), and remove the old files."""
        try:
            old = files.legacy_files(self.path)
        except OSError:
            return
        if not old:
            return
        moved = dropped = 0
        for f in old:
            try:
                blk = files.legacy_read(f) if f.name.endswith(".blk") else None
                if blk is not None:
                    before = self.counters["written"]
                    self._write_batch([blk])
                    if self.counters["written"] > before:
                        moved += 1
                    else:
                        dropped += 1
                elif f.name.endswith(".blk"):
                    dropped += 1
                f.unlink()
            except OSError:
                dropped += 1
        for sub in {f.parent for f in old}:
            try:
                sub.rmdir()
            except OSError:
                pass
        self._log("migrate", f"{self.path}: migrated {moved} spilled blocks from the "
                             f"one-file-per-block format into slot files ({dropped} dropped: "
                             "not verifying or not fitting)")

    def _migrate_v2(self) -> None:
        """Owner: move the verified blocks of version 2 slot files (payloads
        4 KiB aligned) into version 3 ones.  Each is first renamed aside
        (DIR/.v2-slots-N.dat, under DIR/.usage's lock: a new file of its
        name can then be made), then read with plain preads and removed; an
        owner stopped meanwhile leaves the file aside and the next one
        finishes it (blocks already moved are found there)."""
        try:
            old = files.old_slot_files(self.path)
        except OSError:
            return
        for f in old:
            aside = f if f.name.startswith(files.OLD_PREFIX) \
                else f.with_name(files.OLD_PREFIX + f.name)
            before = self.counters["written"]
            found = 0
            try:
                if aside != f:
                    with self._usage.locked():
                        os.replace(f, aside)
                for blocks in files.old_blocks(aside, BATCH_BLOCKS):
                    found += len(blocks)
                    self._write_batch(blocks)
                aside.unlink()
            except OSError as e:
                self._log_once("migrate", f"cannot migrate {f} ({e})")
                continue
            moved = self.counters["written"] - before
            self._log("migrate", f"{f}: migrated {moved} of its {found} verified spilled "
                                 f"blocks from slot file format version {files.OLD_VERSION} "
                                 "(the rest did not fit or were there already)")

    # -- the shared counter and journal ----------------------------------------------------
    def _header(self) -> tuple[int, int] | None:
        """(published bytes, limit) from DIR/.usage, or None when it is not
        set up (or from a newer cxlkv).  A plain read: exact when locked."""
        return None if self._usage is None else self._usage.header()

    def _fold_journal(self) -> None:
        """Owner: index the blocks readers published since the last fold (at
        the most recent end, stamped now: their writers just evicted them)."""
        try:
            recs = self._usage.take_records()
        except OSError as e:
            self._fail("disk", e, count=False)
            return
        if not recs:
            return
        self._rescan_if_new()
        now = time.time_ns()
        n = 0
        with self._mu:
            for key, size in recs:
                sf = self._files.get(size - files.HDR_SIZE)
                slot = None if sf is None else sf.find(key)
                if slot is None:
                    continue                     # gone already, or a torn record
                self._index.remember(key, size, now, (sf.sbytes, slot))
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
    def locate(self, key: bytes, length: int | None = None) -> tuple | None:
        """(slot file path, payload offset, header offset) of the LIVE slot
        holding `key` (of `length` payload bytes when given), or None."""
        self._rescan_if_new()
        cands = [self._files.get(files.slot_bytes(length))] if length is not None \
            else list(self._files.values())
        for sf in cands:
            slot = None if sf is None else sf.find(key)
            if slot is not None:
                return sf.path, sf.payload_off(slot), sf.hdr_off(slot)
        return None

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

    def _fail(self, kind: str, err=None, count: bool = True, n: int = 1) -> None:
        if count:
            self._bump(f"dropped_{kind}", n)
        self._log_once(kind, f"dropping evicted blocks ({kind}{': ' + str(err) if err else ''})")

    def _remember(self, key: bytes, size: int, stamp: int = 0, loc=None) -> None:
        """Index `key` at the most recent end (a reader's index is bounded)."""
        with self._mu:
            self._index.remember(key, size, stamp, loc)

    def _where(self, key: bytes, length: int) -> tuple | None:
        """(slot file, slot) this process believes holds `key`: its index
        (the owner's: touched), else a reader's probe of the slot index."""
        sb = files.slot_bytes(length)
        with self._mu:
            e = self._index.get(key) if self.mode == "reader" else None
            if self.mode == "owner":
                if not self._index.touch(key):
                    return None
                e = self._index.get(key)
        if e is not None and e[2] is not None:
            sf = self._files.get(e[2][0])
            if sf is not None:
                return sf, e[2][1]
        if self.mode == "owner":
            return None
        sf = self._files.get(sb)
        if sf is None:
            self._rescan_if_new()
            sf = self._files.get(sb)
        slot = None if sf is None else sf.find(key)
        return None if slot is None else (sf, slot)

    def _locate_run(self, keys: list, i: int, length: int) -> tuple:
        """(slot file, [slot]) of the leading run of keys[i:] that this
        process knows where they are, in one slot file, as _where finds
        each (the owner's index under one lock, its entries touched)."""
        if self.mode == "owner":
            with self._mu:
                locs = self._index.touch_run(keys, i)
            slots = [loc[1] for loc in locs]
            sf = self._files.get(locs[0][0]) if locs else None
            return (sf, slots) if sf is not None else (None, [])
        sf, slots = None, []
        for k in keys[i:]:
            where = self._where(k, length)
            if where is None or (sf is not None and where[0] is not sf):
                break
            sf = where[0]
            slots.append(where[1])
        return sf, slots

    def _remove(self, key: bytes, sf, slot: int, bad: bytes | None = None) -> bool:
        """Free a slot whose block failed verification (header `bad` as
        read, or any when None): whoever frees it takes its bytes off the
        shared count (DIR/.usage locked).  False: it changed meanwhile."""
        with self._mu:
            self._index.pop(key)
        if self._usage is None or not self._writable:
            return False
        try:
            with self._usage.locked():
                if bad is not None and sf.raw_header(slot) != bad:
                    return False                 # rewritten meanwhile: not this block
                o = sf.hdr_off(slot)
                if sf.mm[o + 5] == files.FREE:
                    return False
                sf.release(slot, bytes(sf.mm[o + 16:o + 32]))
                self._usage.add_used(-(files.HDR_SIZE + sf.sbytes))
        except (OSError, ValueError, TypeError):
            return False
        return True

    def _stamp_of(self, key: bytes, e: list) -> int | None:
        sf = self._files.get(e[2][0]) if e[2] else None
        if sf is None or not sf.holds(e[2][1], key):
            return None
        return int(sf.stamps[e[2][1]])

    def _make_room(self, size: int, target: int) -> bool:
        """Owner: free least recently used slots until `size` more bytes
        fit under `target`; a block a reader used since the owner last saw
        it (newer stamp) gets one second chance instead.  False: it cannot
        fit."""
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
            if not folded:                    # readers' blocks are candidates too
                folded = True
                self._fold_journal()
            with self._mu:
                cands = self._index.oldest(need)
            if not cands:
                return False
            back, dead = second_chance(cands, chanced, self._stamp_of)
            if back:
                with self._mu:
                    self._index.put_back(back)
                self._bump("second_chance", len(back))
            freed = n = 0
            if dead:
                try:
                    with self._usage.locked():
                        for k, e in dead:
                            sf = self._files.get(e[2][0])
                            if sf is not None and sf.free_if(e[2][1], k):
                                freed += sf.sbytes + files.HDR_SIZE
                                n += 1
                        if freed:
                            self._usage.add_used(-freed)
                except OSError as e:
                    self._fail("disk", e, count=False)
                    return False
            self._bump("evicted", n)

    def _free_room(self, sbytes: int) -> bool:
        """Owner: no free slot of `sbytes` (its file is full): free its
        least recently used block (others' blocks first go through their
        second chance as in _make_room).  False: none to free."""
        with self._mu:
            victim = next(((k, e) for k, e in self._index.items() if e[2] and e[2][0] == sbytes),
                          None)
            if victim is not None:
                self._index.pop(victim[0])
        if victim is None:
            return False
        k, e = victim
        sf = self._files.get(sbytes)
        with self._usage.locked():
            if sf is not None and sf.free_if(e[2][1], k):
                self._usage.add_used(-(sbytes + files.HDR_SIZE))
                self._bump("evicted", 1)
        return True

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
                    # ... as far as a reader knows: its writer marks the slot
                    # used (the owner's LRU sees the use) or finds it gone
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
        """Hand a reserved block's bytes to the writer thread (never blocks);
        until it is written (or dropped) a fetch of it reads it from here."""
        with self._mu:
            self._inflight[key] = (ns_digest, payload)
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
        """The Tier's eviction hand-off: reserve, copy out of the pool into
        a buffer the writers gave back (or a new one), queue (a failed copy
        is dropped, counted `dropped_copy`)."""
        try:
            if not self.reserve(key, nbytes):
                return False
        except Exception:                             # pragma: no cover - defensive
            return False
        buf = self._spare_buffer(nbytes)
        try:
            ns_digest = copy(buf)
        except Exception as err:                      # pragma: no cover - defensive
            self._give_back([buf])
            self.unreserve(key, nbytes)
            self._fail("copy", err)
            return False
        self.put(key, ns_digest, buf)
        return True

    def _spare_buffer(self, nbytes: int) -> "_CopyBuffer":
        with self._bmu:
            free = self._spare.get(nbytes)
            if free:
                self._spare_bytes -= nbytes
                return free.pop()
        return _CopyBuffer.make(nbytes)

    def _give_back(self, payloads) -> None:
        """take()'s buffers among `payloads` (written or dropped: nothing
        refers to them any more) to the spare list, up to queue_bytes."""
        with self._bmu:
            for b in payloads:
                if type(b) is _CopyBuffer and self._spare_bytes + len(b) <= self.queue_bytes:
                    self._spare.setdefault(len(b), []).append(b)
                    self._spare_bytes += len(b)

    # -- the writer threads and the owner's maintenance -------------------------------------
    def _writer(self) -> None:
        while True:
            item = self._q.get()
            batch = [item]
            if item is not None:                   # more that is waiting, up to a batch
                nb = len(item[2])
                while nb < BATCH_BYTES and len(batch) < BATCH_BLOCKS:
                    try:
                        nxt = self._q.get_nowait()
                    except queue.Empty:
                        break
                    batch.append(nxt)
                    if nxt is None:                # one stop per thread
                        break
                    nb += len(nxt[2])
            items = [b for b in batch if b is not None]
            t0 = time.perf_counter()
            try:
                if items:
                    self._write_batch(items)
            except Exception as e:                     # pragma: no cover - never raise
                self._fail("disk", e, n=len(items))
            finally:
                self._bump("write_s", time.perf_counter() - t0)
                with self._mu:
                    for it in items:
                        self._pending -= len(it[2])
                        self._queued.discard(it[0])
                        self._inflight.pop(it[0], None)
                self._give_back([it[2] for it in items])
                for _ in batch:
                    self._q.task_done()
            if len(items) < len(batch):
                return

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

    def _touch_seen(self, key: bytes) -> None:
        """A reader's eviction of a block it has seen in the store: mark
        the slot used (the owner's LRU sees it), or drop it when gone."""
        with self._mu:
            e = self._index.get(key)
        sf = self._files.get(e[2][0]) if e is not None and e[2] else None
        if sf is not None and sf.holds(e[2][1], key):
            sf.touch(e[2][1])
            return
        with self._mu:                               # the owner removed it meanwhile
            self._index.pop(key)
        self._bump("already", -1)
        self._fail("gone", "the owner removed a block this reader had seen")

    def _write_batch(self, items) -> None:
        """Write evicted blocks ((key, ns digest, payload) each): claim a slot
        each (one flock), write the payloads (pwritev, adjacent slots in one
        call), publish their headers (one flock)."""
        owner = self.mode == "owner"
        todo = []
        for key, nsd, payload in items:
            if nsd is None:
                self._touch_seen(key)
            elif self._broken:
                self._fail("disk")
            elif owner and self._index_touch(key):
                continue
            elif files.footprint(len(payload)) > self.max_bytes and owner:
                self._fail("store-full")                 # bigger than the whole store
            else:
                todo.append((key, nsd, payload))
        if not todo:
            return
        full = []
        if not owner:
            try:
                claimed, full, already = self._claim(todo)
                self._already(already)
                self._write_claimed(claimed)
            except OSError as e:
                self._fail("disk", e, n=len(todo))
                return
            todo = []
        while todo:
                # a chunk that is small against the target (a batch is, but
                # for tiny stores): room made for it by the LRU, its slots
                # claimed, written and indexed before the next chunk
                target = self._target()
                n, size = 0, 0
                while n < len(todo) and (n == 0 or size + files.footprint(len(todo[n][2]))
                                         <= target // 4):
                    size += files.footprint(len(todo[n][2]))
                    n += 1
                chunk, todo = todo[:n], todo[n:]
                try:
                    self._chunk(chunk, size, target, full)
                except OSError as e:
                    self._fail("disk", e, n=len(chunk))
        if full:
            self._fail("store-full", n=len(full))

    def _chunk(self, chunk, size: int, target: int, full: list) -> None:
        """Owner: write a chunk of blocks, making room for them first (the
        ones that do not fit are added to `full`)."""
        self._make_room(size, target)
        claimed, left, already = self._claim(chunk, target)
        for it in left:                      # one by one, as before
            fp = files.footprint(len(it[2]))
            c, f, a = self._claim([it], target) if self._make_room(fp, target) \
                else ([], [it], [])
            if f and self._make_room(fp, self.max_bytes):   # others took the room
                c, f, a = self._claim([it])
            if f and self._free_room(files.slot_bytes(len(it[2]))):   # no free slot
                c, f, a = self._claim([it])
            claimed += c
            already += a
            full += f
        self._already(already)
        self._write_claimed(claimed)

    def _already(self, already) -> None:
        """Blocks another process stored meanwhile: a reader marks them used."""
        for key, _, _ in already:
            self._bump("already", 1)
            if self.mode == "reader":
                loc = self.locate_slot(key)
                if loc is not None:
                    loc[0].touch(loc[1])
                    self._remember(key, files.HDR_SIZE + loc[0].sbytes, 0,
                                   (loc[0].sbytes, loc[1]))

    def _write_claimed(self, claimed) -> None:
        """Write the payloads of claimed slots (adjacent slots in one
        pwritev), publish their headers (one flock), index them."""
        if not claimed:
            return
        owner = self.mode == "owner"
        now = time.time_ns()
        done, bad = [], []
        i = 0
        # written in slot order (adjacent slots in one call), but stamped
        # and indexed in the order they came: the LRU order is the offer
        # order, whichever slots the claims happened to get
        order = sorted(range(len(claimed)), key=lambda n: (claimed[n][0].sbytes, claimed[n][1]))
        while i < len(order):                        # runs of adjacent slots: one pwritev
            j = i + 1
            sf = claimed[order[i]][0]
            while (j < len(order) and claimed[order[j]][0] is sf
                   and claimed[order[j]][1] == claimed[order[j - 1]][1] + 1
                   and len(claimed[order[j - 1]][4]) == sf.sbytes
                   and (j - i + 1) * sf.sbytes <= WRITE_BYTES):
                j += 1
            run = order[i:j]
            try:
                sf.preallocate(claimed[run[-1]][1], PREALLOC)
                files.write_all(sf.fd, [claimed[n][4] for n in run],
                                sf.payload_off(claimed[run[0]][1]))
                done.extend(run)
            except OSError as e:
                bad.extend(claimed[n] for n in run)
                self._fail("disk", e, n=len(run))
            i = j
        done = [claimed[n] for n in sorted(done)]
        hdrs = [files.header(key, nsd, len(p), xxhash.xxh3_64_intdigest(p), now + i)
                for i, (_, _, key, nsd, p) in enumerate(done)]
        with self._usage.locked():
            for (sf, slot, _, _, _), hdr in zip(done, hdrs):
                sf.publish(slot, hdr)
            freed = 0
            for sf, slot, key, _, _ in bad:
                sf.release(slot, key)
                freed += files.HDR_SIZE + sf.sbytes
            if freed:
                self._usage.add_used(-freed)
            if not owner:
                self._usage.append_many([(key, files.HDR_SIZE + sf.sbytes)
                                         for sf, _, key, _, _ in done])
        with self._mu:
            for i, (sf, slot, key, _, _) in enumerate(done):
                self._index.remember(key, files.HDR_SIZE + sf.sbytes, now + i, (sf.sbytes, slot))
        self._bump("written", len(done))
        self._bump("written_bytes", sum(len(p) for *_, p in done))

    def _index_touch(self, key: bytes) -> bool:
        with self._mu:
            return self._index.touch(key)

    def _claim(self, todo, cap: int | None = None) -> tuple[list, list, list]:
        """DIR/.usage locked once: a slot for each block that fits under the
        limit (and `cap`), counted now: ([(slot file, slot, key, ns digest,
        payload)], the blocks that do not fit, those already stored)."""
        claimed, full, already = [], [], []
        me = os.getpid()
        with self._usage.locked():
            h = self._usage.header()
            if h is None:
                raise OSError(f"{self.path / '.usage'} is damaged")
            used, limit = h
            if cap is not None:
                limit = min(limit, cap)
            for key, nsd, payload in todo:
                fp = files.footprint(len(payload))
                sf = self._class(files.slot_bytes(len(payload)))
                r = "full" if sf is None else sf.claim(key, me)
                if r == "already":
                    already.append((key, nsd, payload))
                elif r == "full" or used + fp > limit:
                    if r != "full":
                        sf.release(r, key)
                    full.append((key, nsd, payload))
                else:
                    used += fp
                    claimed.append((sf, r, key, nsd, payload))
            if claimed:
                self._usage.set_used(used)
        return claimed, full, already

    def locate_slot(self, key: bytes, length: int | None = None) -> tuple | None:
        """(slot file, slot) holding `key` as the slot index says, or None."""
        self._rescan_if_new()
        cands = [self._files.get(files.slot_bytes(length))] if length is not None \
            else list(self._files.values())
        for sf in cands:
            slot = None if sf is None else sf.find(key)
            if slot is not None:
                return sf, slot
        return None

    # -- the reader's side ---------------------------------------------------------------
    def run(self, keys) -> int:
        """How many leading `keys` (rows of 16 bytes) the store holds: the
        owner's index; a reader's index, then a probe of the slot index
        per key."""
        if self.mode == "owner":
            with self._mu:
                n = self._index.run(keys)
                while n < len(keys) and self._inflight:
                    m = n
                    while m < len(keys) and bytes(keys[m]) in self._inflight:
                        m += 1
                    if m == n:
                        break
                    n = m + self._index.run(keys[m:])
                return n
        n = 0
        for k in keys:
            kb = bytes(k)
            with self._mu:
                if kb in self._index or kb in self._inflight:
                    n += 1
                    continue
            loc = self.locate_slot(kb)
            if loc is None:
                break
            self._remember(kb, files.HDR_SIZE + loc[0].sbytes, 0, (loc[0].sbytes, loc[1]))
            n += 1
        return n

    def get(self, key: bytes, ns_digest: bytes, length: int) -> memoryview | None:
        """The payload of `key`, verified, or None (a block that fails
        verification is removed)."""
        t0 = time.perf_counter()
        try:
            return self._get(key, ns_digest, length)
        finally:
            self._bump("read_s", time.perf_counter() - t0)

    def _queued_copy(self, key: bytes, ns_digest: bytes, length: int) -> memoryview | None:
        """A copy of block `key` while it waits for the writers (the bytes
        the evictor copied out of the pool), or None.  Copied under the
        lock: the writers take the entry out under it before the buffer is
        reused."""
        with self._mu:
            ent = self._inflight.get(key)
            if ent is None or ent[0] != ns_digest or len(ent[1]) != length:
                return None
            buf = aligned_buffer(length)
            buf[:] = np.frombuffer(ent[1], dtype=np.uint8)
        self._bump("hits", 1)
        self._bump("queued_hits", 1)
        return memoryview(buf)

    def _get(self, key: bytes, ns_digest: bytes, length: int) -> memoryview | None:
        where = self._where(key, length)
        if where is None:
            b = self._queued_copy(key, ns_digest, length)
            if b is None:
                self._bump("misses", 1)
            return b
        sf, slot = where
        buf = np.empty(length, dtype=np.uint8)       # not zeroed: read over at once
        snap = bytearray(files.SNAP)
        try:
            ok, status, err = sf.read_run(np.array([slot], dtype=np.uint64), key, ns_digest,
                                          length, [buf], snap)
        except (OSError, ValueError) as e:
            self._log_once("read", f"cannot read {sf.path} ({e})")
            self._bump("misses", 1)
            return None
        if not ok:
            self._failed(key, sf, slot, status, err, bytes(snap))
            return None
        if self.mode == "reader":
            sf.touch(slot)
            self._remember(key, files.HDR_SIZE + sf.sbytes, 0, (sf.sbytes, slot))
        self._bump("hits", 1)
        return memoryview(buf)

    def _failed(self, key: bytes, sf, slot: int, status: int, err: int, raw: bytes) -> None:
        """A slot read_run stopped at (its header `raw` as checked): a miss,
        or a damaged block freed (whoever frees it counts it corrupt)."""
        if status == files.IOERR:
            self._log_once("read", f"cannot read {sf.path} ({os.strerror(err)})")
        elif status == files.TORN:                 # a LIVE header that does not verify
            if self._remove(key, sf, slot, raw):
                self._corrupt(sf, slot)
                return
            with self._mu:                          # removed, or the slot reused
                self._index.pop(key)
        elif status in files.MISS:                  # freed or reused, or changed while read
            with self._mu:
                self._index.pop(key)
        else:                                       # another namespace or length, cut, bad sum
            self._remove(key, sf, slot, raw)
            self._corrupt(sf, slot)
            return
        self._bump("misses", 1)

    def _corrupt(self, sf, slot: int) -> None:
        self._bump("corrupt", 1)
        if "corrupt" not in self._logged:
            self._logged.add("corrupt")
            self._log("corrupt", f"{sf.path}: slot {slot}: corrupt or truncated spilled block "
                                 "freed (a miss; further ones are counted in stats(), not "
                                 "logged)")

    # -- the Tier's part behind the pool ---------------------------------------------------
    held = run

    def fetch(self, keys, ns_digest: bytes, block_bytes: int,
              budget_s: float | None = None) -> list:
        """The leading run of `keys` the store holds, read and verified in
        one C call per run of slots this process knows of (copied out of
        the slot file's mapping, checksummed in the same pass, into buffers
        reused across calls); the first block
        that does not verify goes through get() (a miss, freed when
        corrupt; the run ends there unless get() finds it after all), as
        does one still waiting for this process's writers (copied from
        the queue)."""
        out: list = []
        if not self.run(keys[:1]):
            return out
        t0 = time.perf_counter()
        try:
            return self._fetch([bytes(k) for k in keys], ns_digest, block_bytes)
        finally:
            self._bump("read_s", time.perf_counter() - t0)

    def _buffers(self, length: int, n: int) -> list:
        """n buffers of `length` bytes for fetch: reused ones no view of
        which is alive any more (a returned memoryview holds a reference to
        its array), else new ones (kept up to FETCH_BUFFERS per size).
        Fresh buffers for a run of blocks would be fresh pages, faulted in
        on every read: slower than the read itself."""
        out = []
        with self._bmu:
            pool = self._bufs.setdefault(length, [])
            for a in pool:
                if len(out) == n:
                    break
                if sys.getrefcount(a) <= 3:          # the pool, `a`, the call's argument
                    out.append(a)
            while len(out) < n:
                a = aligned_buffer(length)
                if len(pool) < FETCH_BUFFERS:
                    pool.append(a)
                out.append(a)
        return out

    def _fetch(self, keys: list, ns_digest: bytes, length: int) -> list:
        out: list = []
        i = 0
        while i < len(keys):
            sf, slots = self._locate_run(keys, i, length)
            ok = 0
            if slots:
                bufs = self._buffers(length, len(slots))
                path = self._paths.pick()
                t0 = time.perf_counter()
                try:
                    ok, _, _ = sf.read_run(np.array(slots, dtype=np.uint64),
                                           b"".join(keys[i:i + len(slots)]), ns_digest,
                                           length, bufs, mapped=path == "mapped")
                except (OSError, ValueError):
                    ok = 0
                if ok == len(slots):
                    self._paths.record(path, ok * length, time.perf_counter() - t0)
                for m in range(ok):
                    if self.mode == "reader":
                        sf.touch(slots[m])
                        self._remember(keys[i + m], files.HDR_SIZE + sf.sbytes, 0,
                                       (sf.sbytes, slots[m]))
                    out.append(memoryview(bufs[m]))
                self._bump("hits", ok)
                i += ok
            if i == len(keys):
                break
            b = self._get(keys[i], ns_digest, length)   # the careful path: a miss (the run
            if b is None:                                # ends), freed when damaged
                break
            out.append(b)
            i += 1
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
        # seconds this process's writers spent writing batches (summed over
        # threads) and its readers reading and verifying blocks
        out["write_s"] = counters.get("write_s", 0.0)
        out["read_s"] = counters.get("read_s", 0.0)
        # the read path fetch takes and what each measured (readpath.py)
        out.update(self._paths.stats())
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
        for sf in list(self._files.values()) + self._retired:
            sf.close()
        self._files.clear()
        self._retired.clear()
        u, self._usage = self._usage, None
        if u is not None:
            u.close()


#: the counters stats() reports (beside the figures and "dropped", their sum)
COUNTERS = ("written", "written_bytes", "hits", "queued_hits", "misses", "corrupt", "evicted",
            "second_chance", "discovered", "already", "promoted", "promote_failed",
            "dropped_queue-full",
            "dropped_store-full", "dropped_disk", "dropped_copy", "dropped_gone")
DROP_REASONS = ("queue-full", "store-full", "disk", "copy", "gone")


class _CopyBuffer(np.ndarray):
    """A buffer take() copied an evicted block into: given back to the
    store's spare list once written or dropped."""

    @staticmethod
    def make(nbytes: int) -> "_CopyBuffer":
        return np.empty(nbytes, dtype=np.uint8).view(_CopyBuffer)


def aligned_buffer(length: int) -> np.ndarray:
    """`length` bytes (uint8, not zeroed) starting on a BUF_ALIGN boundary:
    a view of a slightly larger array (its base keeps the memory alive)."""
    raw = np.empty(length + BUF_ALIGN, dtype=np.uint8)
    o = -raw.ctypes.data % BUF_ALIGN
    return raw[o:o + length]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
