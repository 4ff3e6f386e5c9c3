"""What the KV cache asks of a tier (`Tier`), and the object that owns a
pool's tiers (`Tiers`, `pool.tiers`).

A tier keeps KV blocks beside the pool for one pool object of this process:
the DRAM hot tier in front of it (copies of pool blocks), the spill store
and the remote tier behind it (blocks the pool no longer or never held).
The KV cache reaches a tier only through `pool.tiers.get(kind)` and the
methods below; each method has a default that does nothing, so a tier
implements the part it plays and stats() and close().

    in front of the pool   copies(), keep()          the hot tier
    behind the pool        held(), fetch(),          spill, remote
                           promoted(), promote_failed(),
                           register_namespace()
    on eviction            take()                    spill
"""
from __future__ import annotations

import abc
import threading

from cxlkv.errors import UsageError

#: the kinds of tier, one of each per pool object
KINDS = ("hot", "spill", "remote")


class Tier(abc.ABC):
    """A tier of one pool object's KV cache in this process."""

    #: one of KINDS
    kind: str = ""

    # -- in front of the pool: copies of pool blocks --------------------------------------
    def copies(self, keys, idx, ctl, n: int, block_bytes: int) -> list | None:
        """For the first n pinned blocks (their entry indexes idx and
        versions ctl): a copy of each the tier holds for that same entry and
        version (a read-only buffer of block_bytes), else None; or None for
        all."""
        return None

    def keep(self, keys, idx, ctl, sources) -> None:
        """Remember blocks read from the pool (sources: a buffer each, or
        None to skip it; copied before this returns) as of entries idx,
        versions ctl."""

    # -- behind the pool: blocks the pool misses --------------------------------------------
    def register_namespace(self, ns_digest: bytes, name: str) -> None:
        """A KV cache of namespace `name` (digest ns_digest) reads through
        this tier."""

    def held(self, keys) -> int:
        """How many leading `keys` (rows of 16 bytes) the tier holds, without
        reading them (what `match` counts)."""
        return 0

    def fetch(self, keys, ns_digest: bytes, block_bytes: int,
              budget_s: float | None = None) -> list:
        """The leading run of `keys` the tier holds, read and verified: a
        list of buffers of block_bytes each, shorter than keys where the run
        ends.  At most budget_s seconds where the tier may wait; never raises
        (a failure is a miss)."""
        return []

    def promoted(self, blocks: int) -> None:
        """The cache stored `blocks` fetched blocks into the pool (counted)."""

    def promote_failed(self, err: Exception) -> None:
        """The pool refused fetched blocks (full of pinned blocks, quota):
        counted; the blocks stay in the tier."""

    # -- on eviction: blocks leaving the pool -------------------------------------------------
    def take(self, key: bytes, nbytes: int, copy) -> bool:
        """A published block of nbytes leaves the pool (called by the
        evictor under the pool lock: memory work only, no I/O, never
        raises).  `copy(dst)` copies it out of the pool into `dst` (a
        writable buffer of nbytes) and returns its namespace digest; the
        tier calls it only for a block it keeps.
        Returns whether the block was taken."""
        return False

    # -- every tier -------------------------------------------------------------------------
    @abc.abstractmethod
    def stats(self) -> dict:
        """The tier's figures and counters (what its collector exports)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release what the tier holds (disable calls it)."""


class Tiers:
    """The tiers of one pool object in this process, at most one per kind.
    Made empty with the pool object (`pool.tiers`); the tiers' modules
    enable and disable theirs (`cxlkv.kv.tiers.spill.enable(pool, ...)`,
    `pool.kv(..., spill_dir=...)`).

    Guarded by its own lock (enable / disable against each other); readers
    take a reference with get() and use it without the lock."""

    def __init__(self):
        self._mu = threading.Lock()
        self._by_kind: dict[str, Tier] = {}

    def get(self, kind: str) -> Tier | None:
        """The tier of that kind, or None."""
        return self._by_kind.get(kind)

    def enable(self, tier: Tier) -> Tier:
        """Own `tier`.  Refused when another tier of its kind is enabled
        (disable that one first); enabling the same tier again is a no-op."""
        if not isinstance(tier, Tier) or tier.kind not in KINDS:
            raise UsageError(f"a tier is a cxlkv.kv.tiers.base.Tier of kind "
                             f"{', '.join(KINDS)}, not {tier!r}")
        with self._mu:
            cur = self._by_kind.get(tier.kind)
            if cur is not None and cur is not tier:
                raise UsageError(f"this pool already has a {tier.kind} tier",
                                 hint="disable it first")
            self._by_kind[tier.kind] = tier
        return tier

    def remove(self, kind: str) -> Tier | None:
        """Stop owning the tier of that kind (not closed); returns it, or None."""
        with self._mu:
            return self._by_kind.pop(kind, None)

    def disable(self, kind: str) -> Tier | None:
        """Remove the tier of that kind and close it; returns it, or None."""
        tier = self.remove(kind)
        if tier is not None:
            tier.close()
        return tier

    def __iter__(self):
        return iter(list(self._by_kind.values()))

    def __repr__(self) -> str:
        return f"<cxlkv.kv.tiers.Tiers {sorted(self._by_kind)}>"
