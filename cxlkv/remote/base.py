"""What the remote tier's client asks of a store (`RemoteTier`, asyncio),
and the answer of a batch (`Batch`).  The Redis Cluster implementation is
cxlkv.remote.redis_cluster; cxlkv.remote.tier's RemoteClient drives one."""
from __future__ import annotations

import abc


class Batch(list):
    """A tier's answer for a batch: one entry per key, in order.  `failed`:
    how many keys got no answer (their entry is None); `error`: the first
    failure, as text.  put_many entries are True (stored), False (the key
    was there already: NX) or None (failed); `replicated[i]` is True when
    WAIT confirmed the replicas asked for after the write."""

    def __init__(self, items=(), failed: int = 0, error: str | None = None,
                 replicated: list | None = None):
        super().__init__(items)
        self.failed = failed
        self.error = error
        self.replicated = replicated


class RemoteTier(abc.ABC):
    """A key-value store shared by racks (cluster key names and values as
    bytes).  Methods raise RemoteUnavailable when nothing can be reached; a
    partial failure is reported in the returned Batch."""

    @abc.abstractmethod
    async def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        """The values of `keys` (None: absent or failed)."""

    @abc.abstractmethod
    async def put_many(self, items: list[tuple[bytes, bytes]], ttl_s: int, *,
                       wait_replicas: int = 0, wait_timeout_s: float = 1.0) -> list[bool]:
        """SET each (key, value) if absent (NX), with expiry ttl_s (0: none).
        With wait_replicas > 0, wait for that many replicas of every master
        written to (at most wait_timeout_s) and report it in `replicated`."""

    @abc.abstractmethod
    async def exists_many(self, keys: list[bytes]) -> list[bool]:
        """Whether each key is present (False: absent or failed)."""

    async def delete_many(self, keys: list[bytes]) -> int:
        """Delete keys; how many were there."""
        raise NotImplementedError

    async def set_names(self, hash_key: bytes, mapping: dict[str, str]) -> None:
        """HSETNX each field of `mapping` into the hash `hash_key`."""
        raise NotImplementedError

    async def used_memory(self) -> int:
        """Memory the store uses, in bytes (Redis: used_memory summed over masters)."""
        raise NotImplementedError

    @abc.abstractmethod
    async def close(self) -> None:
        """Release every connection."""
