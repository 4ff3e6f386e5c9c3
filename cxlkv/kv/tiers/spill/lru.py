"""The spill store's index of its files, least recently used first.

The owner's index holds every file it knows of (rebuilt from the directory,
oldest mtime first, when it opens the store; touched by its hits and
writes; readers' files folded in from DIR/.usage): key -> [file bytes,
mtime_ns it recorded].  Its victims get a second chance when a reader used
them since (their file's mtime is newer than recorded).  A reader's index is
the files it has seen, bounded (`READER_INDEX`).

Not thread-safe: the store's lock guards it.
"""
from __future__ import annotations

import collections
import os

#: files a reader remembers having seen (its lookups stat the rest)
READER_INDEX = 1 << 16


class Index:
    """key -> [file bytes, mtime_ns recorded], least recently used first."""

    def __init__(self, bound: int | None = None):
        self.bound = bound                       # None: unbounded (the owner's)
        self._d: collections.OrderedDict[bytes, list] = collections.OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self._d

    def __len__(self) -> int:
        return len(self._d)

    def __bool__(self) -> bool:
        return bool(self._d)

    def remember(self, key: bytes, size: int, mtime: int = 0) -> None:
        """`key` at the most recent end (the oldest dropped past the bound)."""
        self._d[key] = [size, mtime]
        self._d.move_to_end(key)
        if self.bound is not None and len(self._d) > self.bound:
            self._d.popitem(last=False)

    def touch(self, key: bytes) -> bool:
        """Move `key` to the most recent end; False: not indexed."""
        if key not in self._d:
            return False
        self._d.move_to_end(key)
        return True

    def pop(self, key: bytes) -> list | None:
        return self._d.pop(key, None)

    def clear(self) -> None:
        self._d.clear()

    def oldest(self, need: int) -> list[tuple[bytes, list]]:
        """Take least recently used entries out until their bytes reach `need`."""
        out, got = [], 0
        while self._d and got < need:
            k, e = self._d.popitem(last=False)
            out.append((k, e))
            got += e[0]
        return out

    def put_back(self, entries) -> None:
        """Entries given a second chance, at the most recent end (unless
        indexed again meanwhile)."""
        for k, e in entries:
            if k not in self._d:
                self._d[k] = e

    def run(self, keys) -> int:
        """How many leading keys are indexed."""
        n = 0
        for k in keys:
            if bytes(k) not in self._d:
                break
            n += 1
        return n


def second_chance(cands, chanced: set, path_of) -> tuple[list, list]:
    """Split LRU victims `cands` ([(key, [size, mtime])]) into those a reader
    used since the owner recorded them (a newer mtime; once per make-room,
    tracked in `chanced`): (key, [size, new mtime]) to put back, and those
    to remove: (key, size).  Files already gone are in neither (a reader
    removed them, and their bytes)."""
    back, dead = [], []
    for k, (sz, mt) in cands:
        try:
            st = os.stat(path_of(k))
        except FileNotFoundError:
            continue
        except OSError:
            dead.append((k, sz))
            continue
        if st.st_mtime_ns > mt and k not in chanced:
            chanced.add(k)
            back.append((k, [sz, st.st_mtime_ns]))
        else:
            dead.append((k, sz))
    return back, dead
