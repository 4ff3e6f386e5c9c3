"""The spill store's index of its blocks, least recently used first.

The owner's index holds every block it knows of (rebuilt from the slot
headers, oldest stamp first, when it opens the store; touched by its hits
and writes; readers' blocks folded in from DIR/.usage): key -> [bytes,
stamp it recorded, (slot bytes, slot)].  Its victims get a second chance
when a reader used them since (their slot's stamp is newer than recorded).
A reader's index is the blocks it has seen, bounded (`READER_INDEX`).

Not thread-safe: the store's lock guards it.
"""
from __future__ import annotations

import collections

#: blocks a reader remembers having seen (its lookups probe the slot index for the rest)
READER_INDEX = 1 << 16


class Index:
    """key -> [bytes, stamp recorded, (slot bytes, slot)], least recently used first."""

    def __init__(self, bound: int | None = None):
        self.bound = bound                       # None: unbounded (the owner's)
        self._d: collections.OrderedDict[bytes, list] = collections.OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self._d

    def __len__(self) -> int:
        return len(self._d)

    def __bool__(self) -> bool:
        return bool(self._d)

    def remember(self, key: bytes, size: int, stamp: int = 0, loc=None) -> None:
        """`key` at the most recent end (the oldest dropped past the bound)."""
        self._d[key] = [size, stamp, loc]
        self._d.move_to_end(key)
        if self.bound is not None and len(self._d) > self.bound:
            self._d.popitem(last=False)

    def touch(self, key: bytes) -> bool:
        """Move `key` to the most recent end; False: not indexed."""
        if key not in self._d:
            return False
        self._d.move_to_end(key)
        return True

    def touch_run(self, keys: list, start: int = 0) -> list:
        """The locations (slot bytes, slot) of the leading run of
        keys[start:] that are indexed with a location in one slot file
        (one slot size), each moved to the most recent end as touch()
        does: one call for a run instead of a touch and a get per key."""
        d, out, sb = self._d, [], None
        for i in range(start, len(keys)):
            e = d.get(keys[i])
            if e is None:
                break
            d.move_to_end(keys[i])
            loc = e[2]
            if loc is None or (sb is not None and loc[0] != sb):
                break
            sb = loc[0]
            out.append(loc)
        return out

    def get(self, key: bytes) -> list | None:
        return self._d.get(key)

    def items(self):
        """(key, entry) pairs, least recently used first."""
        return iter(self._d.items())

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


def second_chance(cands, chanced: set, stamp_of) -> tuple[list, list]:
    """Split LRU victims `cands` ([(key, [size, stamp, loc])]) into those a
    reader used since the owner recorded them (a newer stamp; once per
    make-room, tracked in `chanced`): (key, entry with the new stamp) to put
    back, and those to remove: (key, entry).  Blocks already gone (removed
    as corrupt by a reader) are in neither.  `stamp_of(key, entry)`: the
    slot's stamp while it holds the key, else None."""
    back, dead = [], []
    for k, e in cands:
        st = stamp_of(k, e)
        if st is None:
            continue
        if st > e[1] and k not in chanced:
            chanced.add(k)
            back.append((k, [e[0], st, e[2]]))
        else:
            dead.append((k, e))
    return back, dead
