"""``DIR/.usage``: the spill store's shared byte count and the readers'
journal, one file the processes of the host share.

A 64-byte header (magic, version, the generation of the slot files -
bumped whenever one is made, so that every process opens it -, published
bytes (slots and their headers), the owner's limit, the owner's pid), then
the readers' journal: 24-byte records of (key, bytes) of the blocks they
published, which the owner folds into its index.  Every change is made
under an exclusive flock of the file (`Usage.locked`), held briefly and by
one thread of the process at a time.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import threading

USAGE_MAGIC = b"CXLKVSU\0"
USAGE_VERSION = 2                  # 1: the one-file-per-block store
USAGE = struct.Struct("<8sIIQQQ")
USAGE_SIZE = 64
_GEN = 12
_USED = 16
REC = struct.Struct("<16sQ")


class Usage:
    """``DIR/.usage`` open in this process (`fd`: read-write, or read-only
    for a reader without write access)."""

    def __init__(self, fd: int):
        self.fd = fd
        self._mu = threading.Lock()           # this process's turn at the flock

    @contextlib.contextmanager
    def locked(self):
        """The file locked: by one thread of this process, and one process."""
        with self._mu:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self.fd, fcntl.LOCK_UN)

    def header(self) -> tuple[int, int] | None:
        """(published bytes, limit), or None when it is not set up (or from a
        newer cxlkv).  A plain read: exact when locked."""
        try:
            raw = os.pread(self.fd, USAGE.size, 0)
        except OSError:
            return None
        if len(raw) < USAGE.size:
            return None
        magic, ver, _, used, limit, _ = USAGE.unpack(raw)
        if magic != USAGE_MAGIC or ver != USAGE_VERSION:
            return None
        return used, limit

    def gen(self) -> int:
        """The slot files' generation (0 when not set up)."""
        try:
            raw = os.pread(self.fd, 4, _GEN)
        except OSError:
            return 0
        return struct.unpack("<I", raw)[0] if len(raw) == 4 else 0

    def bump_gen(self) -> None:
        """Locked: a slot file was made."""
        os.pwrite(self.fd, struct.pack("<I", (self.gen() + 1) & 0xFFFFFFFF), _GEN)

    def set_used(self, used: int) -> None:
        """Locked."""
        os.pwrite(self.fd, struct.pack("<Q", used), _USED)

    def add_used(self, delta: int) -> None:
        """Locked."""
        h = self.header()
        self.set_used(max(0, (h[0] if h else 0) + delta))

    def reset(self, used: int, limit: int) -> None:
        """The owner, locked: a new header (this process the owner) and an
        empty journal."""
        gen = (self.gen() + 1) & 0xFFFFFFFF
        os.pwrite(self.fd, USAGE.pack(USAGE_MAGIC, USAGE_VERSION, gen, used, limit,
                                      os.getpid()).ljust(USAGE_SIZE, b"\0"), 0)
        os.ftruncate(self.fd, USAGE_SIZE)

    def append(self, key: bytes, size: int) -> None:
        """A reader, locked: journal a block it published."""
        end = os.fstat(self.fd).st_size
        end = USAGE_SIZE + max(0, end - USAGE_SIZE) // REC.size * REC.size
        os.pwrite(self.fd, REC.pack(key, size), end)

    def append_many(self, recs) -> None:
        """A reader, locked: journal blocks it published ((key, bytes) each)."""
        if not recs:
            return
        end = os.fstat(self.fd).st_size
        end = USAGE_SIZE + max(0, end - USAGE_SIZE) // REC.size * REC.size
        os.pwrite(self.fd, b"".join(REC.pack(k, n) for k, n in recs), end)

    def take_records(self) -> list[tuple[bytes, int]]:
        """The owner: the journal's records, emptying it (locks the file
        when there are any).  Raises OSError."""
        if os.fstat(self.fd).st_size <= USAGE_SIZE:
            return []
        with self.locked():
            end = os.fstat(self.fd).st_size
            raw = os.pread(self.fd, end - USAGE_SIZE, USAGE_SIZE)
            os.ftruncate(self.fd, USAGE_SIZE)
        return [REC.unpack_from(raw, i) for i in range(0, len(raw) - REC.size + 1, REC.size)]

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


def owner_pid(path) -> int:
    """The pid of the owner named in the file at `path` (0: none)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(USAGE.size)
    except OSError:
        return 0
    if len(raw) < USAGE.size:
        return 0
    magic, _, _, _, _, pid = USAGE.unpack(raw)
    return pid if magic == USAGE_MAGIC else 0
