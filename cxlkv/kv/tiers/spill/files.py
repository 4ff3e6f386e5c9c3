"""The spill store's slot files: one preallocated file per slot size,
``DIR/slots-<slot bytes>.dat``, holding fixed-size slots, their headers and
a hash index of them.

A slot file::

    0           file header (FILE_HDR, padded to 4 KiB): magic, version,
                slot bytes, slots, index entries, probe window
    4096        the index: `entries + window` u64 words, each 0 (empty) or
                (key fingerprint << 32 | slot + 1); a key's entry is in the
                `window` words from (key's first 8 bytes mod entries)
    ...         the slot headers: `slots` x 72 bytes (HDR)
    ...         the payloads: `slots` x slot bytes, from a 2 MiB aligned
                offset (DATA_ALIGN; a hole before it)

The payload area starts on a 2 MiB boundary so that a slot's payload lies
at file offsets the page cache's large folios cover whole: at the 4 KiB
aligned offset of version 2 (right after the headers) buffered writes made
small folios, and reading them back cost more CPU (README, Spill at line
rate).

The first three parts (the metadata) are mapped by every process of the
store; payloads are read and written with preadv / pwritev.

A slot header (HDR, 72 bytes; defined in cxlkv/_core/src/spill_format.h,
mirrored here and checked against it at import): magic, format version,
state (FREE, WRITING, LIVE), reserved, payload length, reserved, the pool
key, the namespace digest, the xxh3-64 of the payload; the xxh3-64 of those
56 bytes (state LIVE); and the stamp (outside the checksum): for a LIVE slot
when it was last written or used (ns), for a WRITING one the writer's pid.

Every change to the metadata (claiming, publishing and freeing slots, the
index) is made under the exclusive flock of DIR/.usage; reads take no lock
and verify: a slot is a block only when its header is LIVE, its checksum
verifies, its key, namespace and length are the ones asked for and the
payload's checksum verifies, with the header unchanged across the payload
read (runs of slots are read and verified in one C call, the GIL
released: `SlotFile.read_run`, cxlkv/_core/src/spill.c).  A torn write is
therefore a miss, never a wrong block: the payload is written before its
header turns LIVE, and a crash between the two leaves a WRITING slot, freed
by the next owner's recount.

Older formats are migrated by the owner when it opens the directory: one
``DIR/<2 hex>/<key>.blk`` file per block (version 1, `legacy_*`), and slot
files of version 2 (the same headers, the payloads right after them: moved
aside to ``DIR/.v2-slots-<bytes>.dat``, their verified blocks written into
version 3 files, then removed: `old_slot_files`, `old_blocks`).  A slot
file of any other version is refused (`SlotFile.open` raises) and left
alone.
"""
from __future__ import annotations

import mmap
import os
import struct
import time
from pathlib import Path

import numpy as np
import xxhash

from cxlkv import _core
from cxlkv.errors import SpillOldFormat

#: a slot file's header: magic, version, reserved, slot bytes, slots, index
#: entries (a power of two), probe window
FILE_MAGIC = b"CXLKVSF\0"
FILE_HDR = struct.Struct("<8sIIQQQQ")
#: a slot header's magic and the format version (1 was one file per block,
#: 2 the payloads 4 KiB aligned right after the headers)
MAGIC = b"CXSB"
VERSION = 3
OLD_VERSION = 2
FREE, WRITING, LIVE = 0, 1, 2
#: the checksummed fields, in order (| xxh3-64 of those 56 bytes | stamp)
_FIELDS = (("magic", "4s"), ("version", "B"), ("state", "B"), ("reserved0", "H"),
           ("length", "I"), ("reserved1", "I"), ("key", "16s"), ("ns_digest", "16s"),
           ("psum", "Q"))
HDR = struct.Struct("<" + "".join(code for _, code in _FIELDS))
HDR_SIZE = HDR.size + 16                     # 72
_SUM = HDR.size                              # offset of the header checksum
_STAMP = HDR.size + 8                        # offset of the stamp
#: what read_run compares across a payload read (the header and its sum)
SNAP = _STAMP


def _check_layout(c: dict) -> None:
    """This mirror against the C definition (spill_format.h): every field's
    offset and size, the constants.  A mismatch is a stale or foreign build."""
    mine, off = {}, 0
    for name, code in _FIELDS + (("hsum", "Q"), ("stamp", "Q")):
        size = struct.calcsize("<" + code)
        mine[name] = (off, size)
        off += size
    if (mine != c["fields"] or c["size"] != HDR_SIZE or c["snap"] != SNAP or c["magic"] != MAGIC
            or c["version"] != VERSION or c["states"] != {"free": FREE, "writing": WRITING,
                                                          "live": LIVE}):
        raise ImportError("the spill slot header in cxlkv/kv/tiers/spill/files.py does not match "
                          "the C core's (spill_format.h): rebuild with `pip install -e .`")


_check_layout(_core.spill_layout())
#: read_run's per-slot statuses (spill.c): a good block; a miss (freed or
#: reused, I/O error, changed while read); damaged (freed by the reader)
STATUS = _core.spill_layout()["status"]
OK = STATUS["ok"]
MISS = frozenset(STATUS[k] for k in ("gone", "ioerr", "changed"))
TORN = STATUS["torn"]
IOERR = STATUS["ioerr"]
#: read_run reads adjacent full slots together, up to this many bytes
READ_BYTES = 1 << 20
#: read_run copies payloads out of a mapping of the file, each hashed in the
#: same pass (False: preadv, then a second pass to hash; spill.c) - unless
#: its caller says which (SpillStore learns which is faster: readpath.py)
READ_MAPPED = True
ALIGN = 4096
#: where the payload area starts (a multiple of; version 3)
DATA_ALIGN = 2 << 20
#: index entries per slot (a load of at most 1/4) and the probe window
INDEX_PER_SLOT = 4
WINDOW = 64
PREFIX = "slots-"
SUFFIX = ".dat"


def slot_bytes(length: int) -> int:
    """The slot size of a payload of `length` bytes (4 KiB aligned)."""
    return max(ALIGN, -(-length // ALIGN) * ALIGN)


def footprint(length: int) -> int:
    """The bytes a block of `length` payload bytes counts against the size
    limit: its slot and its header."""
    return HDR_SIZE + slot_bytes(length)


def file_name(sbytes: int) -> str:
    return f"{PREFIX}{sbytes}{SUFFIX}"


def file_slot_bytes(name: str) -> int | None:
    """The slot size in a slot file's name, or None for another name."""
    if not (name.startswith(PREFIX) and name.endswith(SUFFIX)):
        return None
    mid = name[len(PREFIX):-len(SUFFIX)]
    return int(mid) if mid.isdigit() and int(mid) % ALIGN == 0 and int(mid) > 0 else None


def _up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


def geometry(sbytes: int, nslots: int, version: int = VERSION) -> dict:
    """Offsets of a slot file of `nslots` slots of `sbytes` (of format
    `version`: this one, or OLD_VERSION to migrate one)."""
    entries = 1
    while entries < INDEX_PER_SLOT * max(1, nslots):
        entries <<= 1
    window = min(WINDOW, entries)
    tbl = ALIGN
    hdr = tbl + _up((entries + window) * 8)
    data = _up(hdr + nslots * HDR_SIZE, DATA_ALIGN if version == VERSION else ALIGN)
    return {"slot_bytes": sbytes, "slots": nslots, "entries": entries, "window": window,
            "index_off": tbl, "hdr_off": hdr, "data_off": data,
            "size": data + nslots * sbytes}


def header(key: bytes, ns_digest: bytes, length: int, psum: int, stamp: int) -> bytes:
    """The 72-byte header of a LIVE slot."""
    h = HDR.pack(MAGIC, VERSION, LIVE, 0, length, 0, key, ns_digest, psum)
    return h + struct.pack("<QQ", xxhash.xxh3_64_intdigest(h), stamp)


def parse(raw, version: int = VERSION) -> tuple | None:
    """(key, ns digest, length, payload checksum) of a LIVE header of
    format `version` that verifies, else None."""
    magic, ver, state, _, length, _, key, nsd, psum = HDR.unpack_from(raw)
    if magic != MAGIC or ver != version or state != LIVE:
        return None
    if struct.unpack_from("<Q", raw, _SUM)[0] != xxhash.xxh3_64_intdigest(bytes(raw[:_SUM])):
        return None
    return key, nsd, length, psum


#: a key's index position comes from its first 8 bytes, its fingerprint is
#: bytes 8-12 (keys are uniform hashes); an index word: slot + 1, fingerprint
_POS = struct.Struct("<Q")
_WORD = struct.Struct("<I4s")
_EMPTY = bytes(8)


class SlotFile:
    """One slot file open in this process: its metadata mapped, its
    payloads read and written through `fd`.  Changes to the metadata are
    made under DIR/.usage's flock (the callers hold it); reads take none."""

    def __init__(self, path: Path, fd: int, geo: dict, writable: bool):
        self.path = path
        self.fd = fd
        self.geo = geo
        self.sbytes = geo["slot_bytes"]
        self.nslots = geo["slots"]
        self.mask = geo["entries"] - 1
        self.window = geo["window"]
        self.data_off = geo["data_off"]
        self.index_off = geo["index_off"]
        self.ino = os.fstat(fd).st_ino
        self.writable = writable
        self.mm = mmap.mmap(fd, geo["hdr_off"] + _up(self.nslots * HDR_SIZE),
                            prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
        self._data: mmap.mmap | None = None    # the whole file, read-only, for read_run
        self._data_tried = False
        self.index = np.frombuffer(self.mm, dtype="<u8", count=geo["entries"] + self.window,
                                   offset=geo["index_off"])
        raw = np.frombuffer(self.mm, dtype=np.uint8, count=self.nslots * HDR_SIZE,
                            offset=geo["hdr_off"])
        self.states = raw[5::HDR_SIZE]
        self.stamps = np.frombuffer(self.mm, dtype="<u8", count=self.nslots * HDR_SIZE // 8,
                                    offset=geo["hdr_off"])[_STAMP // 8::HDR_SIZE // 8]
        self.cursor = 0                       # where this process looks for a free slot next
        self.prealloc = geo["data_off"]       # payload bytes this process preallocated up to

    # -- opening --------------------------------------------------------------------------
    @classmethod
    def create(cls, path: Path, sbytes: int, nslots: int) -> "SlotFile":
        """A new slot file (DIR/.usage locked): written under a temporary
        name, its metadata zeroed (a sparse file), renamed into place."""
        geo = geometry(sbytes, nslots)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o660)
        try:
            os.ftruncate(fd, geo["size"])
            os.pwrite(fd, FILE_HDR.pack(FILE_MAGIC, VERSION, 0, sbytes, nslots, geo["entries"],
                                        geo["window"]), 0)
            os.replace(tmp, path)
        except BaseException:
            os.close(fd)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        return cls(path, fd, geo, True)

    @classmethod
    def open(cls, path: Path, writable: bool = True) -> "SlotFile":
        """An existing slot file; OSError when it is not one (or truncated)."""
        try:
            fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        except PermissionError:
            fd, writable = os.open(path, os.O_RDONLY), False
        try:
            raw = os.pread(fd, FILE_HDR.size, 0)
            if len(raw) < FILE_HDR.size:
                raise OSError(f"{path}: not a spill slot file (truncated header)")
            magic, ver, _, sb, ns, ent, win = FILE_HDR.unpack(raw)
            if magic == FILE_MAGIC and ver == OLD_VERSION:
                raise SpillOldFormat(f"{path}: a spill slot file of version {ver} (migrated by "
                                     "the store's owner when it opens the directory)",
                                     path=str(path))
            if magic != FILE_MAGIC or ver != VERSION:
                raise OSError(f"{path}: not a spill slot file of version {VERSION}"
                              + (f" (version {ver})" if magic == FILE_MAGIC else ""))
            geo = geometry(sb, ns)
            if (sb, ent, win) != (file_slot_bytes(path.name), geo["entries"], geo["window"]):
                raise OSError(f"{path}: inconsistent slot file header")
            if os.fstat(fd).st_size < geo["data_off"]:
                raise OSError(f"{path}: truncated slot file")
            return cls(path, fd, geo, writable)
        except BaseException:
            os.close(fd)
            raise

    def close(self) -> None:
        self.index = self.states = self.stamps = None
        for m in (self.mm, self._data):
            try:
                if m is not None:
                    m.close()
            except (BufferError, ValueError):    # a view still exported: left to the GC
                pass
        self._data = None
        try:
            os.close(self.fd)
        except OSError:
            pass

    # -- reading ----------------------------------------------------------------------------
    def hdr_off(self, slot: int) -> int:
        return self.geo["hdr_off"] + slot * HDR_SIZE

    def payload_off(self, slot: int) -> int:
        return self.data_off + slot * self.sbytes

    def raw_header(self, slot: int) -> bytes:
        o = self.hdr_off(slot)
        return self.mm[o:o + _STAMP]

    def holds(self, slot: int, key: bytes) -> bool:
        """Whether `slot`'s header is LIVE with `key` (not verified)."""
        if not 0 <= slot < self.nslots:
            return False
        o = self.hdr_off(slot)
        return self.mm[o + 5] == LIVE and self.mm[o + 16:o + 32] == key

    def touch(self, slot: int) -> None:
        """A use of `slot` (a reader's hit): its stamp past any recorded
        (not by a process that may only read the store)."""
        if not self.writable:
            return
        t = time.time_ns()
        old = int(self.stamps[slot])
        self.stamps[slot] = t if t > old else old + 1

    def _stale(self, w: int) -> bool:
        """An index word that points at no block of its fingerprint."""
        s = (w & 0xFFFFFFFF) - 1
        if not 0 <= s < self.nslots:
            return True
        o = self.hdr_off(s)
        return self.mm[o + 5] == FREE or int.from_bytes(self.mm[o + 24:o + 28], "little") != w >> 32

    def find(self, key: bytes) -> int | None:
        """The slot whose LIVE header has `key`, through the index, or None."""
        for slot in self._candidates(key):
            if self.holds(slot, key):
                return slot
        return None

    def _window(self, key: bytes) -> tuple[int, bytes]:
        """(offset, bytes) of `key`'s window of the index."""
        a = self.index_off + (_POS.unpack_from(key)[0] & self.mask) * 8
        return a, self.mm[a:a + self.window * 8]

    def _candidates(self, key: bytes) -> list[int]:
        """The slots the index words of `key`'s window with its fingerprint
        point at (a byte search: the fingerprint is each word's high half)."""
        _, raw = self._window(key)
        fpb = key[8:12]
        out = []
        i = raw.find(fpb, 4)
        while i >= 0:
            if i % 8 == 4:
                w = int.from_bytes(raw[i - 4:i], "little")
                if w:
                    out.append(w - 1)
                i = raw.find(fpb, i + 8)
            else:
                i = raw.find(fpb, i + 1)
        return out

    def read_run(self, slots, keys: bytes, ns_digest: bytes, length: int, bufs,
                 snap=None, mapped: bool | None = None) -> tuple[int, int, int]:
        """Read and verify `slots` (uint64 array) into `bufs` (a writable
        buffer of >= length bytes each), block i expected to hold key
        keys[16i:16i+16] of namespace ns_digest and `length` payload bytes:
        (good leading blocks, the status of the slot it stopped at, errno).
        `snap` (64 bytes) receives that slot's header as checked.  `mapped`:
        copy out of the file's mapping (True) or preadv (False); None:
        READ_MAPPED.  Raises ValueError for out-of-range arguments or a
        closed file."""
        return _core.spill_read(self.fd, self.mm, self.geo["hdr_off"], self.nslots,
                                self.data_off, self.sbytes, slots, keys, ns_digest, length,
                                bufs, READ_BYTES, snap,
                                self.data_map() if (READ_MAPPED if mapped is None else mapped)
                                else None)

    def data_map(self) -> mmap.mmap | None:
        """The file mapped read-only from offset 0 to its current end, made
        on first use (read_run copies payloads out of it); None where it
        cannot be mapped (then read_run preads)."""
        if self._data is None and not self._data_tried:
            self._data_tried = True
            try:
                size = os.fstat(self.fd).st_size
                if size > self.data_off:
                    self._data = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED,
                                           prot=mmap.PROT_READ)
            except (OSError, ValueError):
                self._data = None
        return self._data

    def live(self) -> list[tuple[bytes, int, int, int]]:
        """(key, slot, length, stamp) of every LIVE slot whose header verifies."""
        out = []
        for slot in np.flatnonzero(self.states == LIVE).tolist():
            p = parse(self.raw_header(slot))
            if p is not None and p[2] <= self.sbytes:
                out.append((p[0], slot, p[2], int(self.stamps[slot])))
        return out

    # -- changing (DIR/.usage locked) ---------------------------------------------------
    def _index_put(self, key: bytes, slot: int) -> bool:
        a, raw = self._window(key)
        word = _WORD.pack(slot + 1, key[8:12])
        i = raw.find(_EMPTY)
        while i >= 0 and i % 8:
            i = raw.find(_EMPTY, i + 1)
        if i < 0:                                 # no empty word: a stale one
            i = next((j * 8 for j in range(self.window)
                      if self._stale(int.from_bytes(raw[j * 8:j * 8 + 8], "little"))), -1)
        if i < 0:
            return False
        self.mm[a + i:a + i + 8] = word
        return True

    def _index_drop(self, key: bytes, slot: int) -> None:
        a, raw = self._window(key)
        word = _WORD.pack(slot + 1, key[8:12])
        i = raw.find(word)
        while i >= 0:
            if i % 8 == 0:
                self.mm[a + i:a + i + 8] = _EMPTY
            i = raw.find(word, i + 1)

    def claim(self, key: bytes, pid: int) -> int | str:
        """A FREE slot for `key`, marked WRITING (stamp: the writer's pid)
        and indexed; or "already" (a LIVE or WRITING slot has the key) or
        "full" (no free slot, or the index window is full)."""
        if self._busy(key):
            return "already"
        slot = self._free_slot()
        if slot is None:
            return "full"
        o = self.hdr_off(slot)
        self.mm[o:o + HDR_SIZE] = HDR.pack(MAGIC, VERSION, WRITING, 0, 0, 0, key, bytes(16), 0) \
            + struct.pack("<QQ", 0, pid)
        if not self._index_put(key, slot):
            self.mm[o + 5] = FREE
            return "full"
        self.cursor = slot + 1 if slot + 1 < self.nslots else 0
        return slot

    def _free_slot(self) -> int | None:
        """The first FREE slot from this process's cursor on (wrapping)."""
        c = self.cursor
        if self.states[c] == FREE:               # filling: the next slot
            return c
        start, seen = c, 0
        while seen < self.nslots:
            end = min(self.nslots, start + 4096)
            free = np.flatnonzero(self.states[start:end] == FREE)
            if len(free):
                return start + int(free[0])
            seen += end - start
            start = 0 if end == self.nslots else end
        return None

    def _busy(self, key: bytes) -> bool:
        for s in self._candidates(key):
            if 0 <= s < self.nslots:
                o = self.hdr_off(s)
                if self.mm[o + 5] in (LIVE, WRITING) and self.mm[o + 16:o + 32] == key:
                    return True
        return False

    def publish(self, slot: int, hdr: bytes) -> None:
        """A claimed slot's payload is written: its LIVE header."""
        o = self.hdr_off(slot)
        self.mm[o:o + HDR_SIZE] = hdr

    def release(self, slot: int, key: bytes) -> None:
        """Free a slot this process claimed or whose block it removes."""
        o = self.hdr_off(slot)
        self.mm[o + 5] = FREE
        self._index_drop(key, slot)

    def free_if(self, slot: int, key: bytes) -> bool:
        """Free `slot` if it still holds `key` (LIVE or not verifying);
        False: it holds another block now (or nothing)."""
        o = self.hdr_off(slot)
        if self.mm[o + 16:o + 32] != key or self.mm[o + 5] == FREE:
            return False
        self.release(slot, key)
        return True

    def reindex(self) -> None:
        """Rebuild the index from the slot headers (owner, at its start)."""
        self.index[:] = 0
        for key, slot, _, _ in self.live():
            self._index_put(key, slot)

    def preallocate(self, slot: int, step: int) -> None:
        """Reserve disk blocks up to past `slot`'s payload, `step` bytes (at
        most a sixteenth of the payload area) at a time."""
        end = self.payload_off(slot + 1)
        if end <= self.prealloc:
            return
        step = min(step, max(self.sbytes, self.nslots * self.sbytes // 16))
        new = min(self.geo["size"], max(end, self.prealloc + step))
        try:
            os.posix_fallocate(self.fd, self.prealloc, new - self.prealloc)
        except OSError:                       # not supported here (a sparse file then)
            pass
        self.prealloc = new


def write_all(fd: int, bufs, off: int) -> None:
    """pwritev all of `bufs` at `off` (short writes continued)."""
    views = [memoryview(b) for b in bufs]
    while views:
        n = os.pwritev(fd, views, off)
        off += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


# -- version 2 slot files: migrated by the owner ------------------------------------------
#: a version 2 slot file moved aside by the owner migrating it
OLD_PREFIX = ".v2-"


def old_slot_files(root: Path) -> list[Path]:
    """Version 2 slot files under `root`: by a slot file's name, or one
    moved aside (OLD_PREFIX) by an owner that stopped while migrating it."""
    out = []
    for f in root.iterdir():
        name = f.name[len(OLD_PREFIX):] if f.name.startswith(OLD_PREFIX) else f.name
        if file_slot_bytes(name) is None:
            continue
        try:
            with open(f, "rb") as fh:
                raw = fh.read(FILE_HDR.size)
        except OSError:
            continue
        if len(raw) == FILE_HDR.size and FILE_HDR.unpack(raw)[:2] == (FILE_MAGIC, OLD_VERSION):
            out.append(f)
    return out


def old_blocks(path: Path, batch: int):
    """The blocks of a version 2 slot file that verify (header and payload
    checksums, a length that fits the slot), in lists of up to `batch`
    (key, ns digest, payload); what does not verify is skipped, as is what
    lies past the end of a truncated file.  Plain preads, no mapping."""
    fd = os.open(path, os.O_RDONLY)
    try:
        _, _, _, sb, ns, _, _ = FILE_HDR.unpack(os.pread(fd, FILE_HDR.size, 0))
        if sb <= 0 or sb % ALIGN or sb >= 1 << 32 or ns >= 1 << 32:
            return
        geo = geometry(sb, ns, OLD_VERSION)
        hdrs = os.pread(fd, ns * HDR_SIZE, geo["hdr_off"])
        out = []
        for slot in range(len(hdrs) // HDR_SIZE):
            p = parse(hdrs[slot * HDR_SIZE:(slot + 1) * HDR_SIZE], OLD_VERSION)
            if p is None or p[2] > sb:
                continue
            data = os.pread(fd, p[2], geo["data_off"] + slot * sb)
            if len(data) != p[2] or xxhash.xxh3_64_intdigest(data) != p[3]:
                continue
            out.append((p[0], p[1], data))
            if len(out) == batch:
                yield out
                out = []
        if out:
            yield out
    finally:
        os.close(fd)


# -- the old format (version 1, one file per block): migrated by the owner -----------------
LEGACY_MAGIC = b"CXLKVSP\0"
LEGACY_HDR = struct.Struct("<8sII16s16sQQ")
LEGACY_HDR_SIZE = LEGACY_HDR.size + 8


def legacy_files(root: Path) -> list[Path]:
    """The old format's block files and temporaries under `root`."""
    out = []
    for sub in root.iterdir():
        if len(sub.name) == 2 and sub.is_dir():
            out.extend(f for f in sub.iterdir() if f.name.endswith((".blk", ".tmp")))
    return out


def legacy_read(path: Path) -> tuple[bytes, bytes, bytes] | None:
    """(key, ns digest, payload) of an old-format block file that verifies."""
    if not path.name.endswith(".blk") or len(path.name) != 36:
        return None
    raw = path.read_bytes()
    if len(raw) < LEGACY_HDR_SIZE:
        return None
    magic, ver, _, key, nsd, ln, xs = LEGACY_HDR.unpack_from(raw)
    hsum = struct.unpack_from("<Q", raw, LEGACY_HDR.size)[0]
    ok = (magic == LEGACY_MAGIC and ver == 1 and key.hex() == path.name[:32]
          and len(raw) == LEGACY_HDR_SIZE + ln
          and hsum == xxhash.xxh3_64_intdigest(raw[:LEGACY_HDR.size])
          and xs == xxhash.xxh3_64_intdigest(memoryview(raw)[LEGACY_HDR_SIZE:]))
    return (key, nsd, raw[LEGACY_HDR_SIZE:]) if ok else None
