"""Opening a formatted pool: probe, permission check, map, choose a superblock."""
from __future__ import annotations

import gc
import os
import sys
import threading
import traceback

from cxlkv.errors import PoolTruncated
from cxlkv.pool import device, layout as L, superblock
from cxlkv.pool.superblock import Superblock

#: makes the first pool.lock() of a pool once, when threads race to it
_LOCK_INIT = threading.Lock()


def read_superblocks(m) -> tuple[bytes, bytes]:
    """Both superblock copies, read from memory (invalidated first)."""
    n = L.SB_COPIES * L.SB_SIZE
    if m.size < n:
        return m.read(0, m.size), b""
    m.invalidate(0, n)
    return m.read(L.SB_OFFSETS[0], L.SB_SIZE), m.read(L.SB_OFFSETS[1], L.SB_SIZE)


class Pool:
    """An open, formatted pool; `attach()` makes this process a node.

    `warnings` collects what --force overrode.
    """

    def __init__(self, target: device.Target, mapping, selection: superblock.Selection,
                 read_only: bool, warnings: list[str]):
        self.target = target
        self.mapping = mapping
        self._sel = selection
        self.read_only = read_only
        self.warnings = warnings
        self.node = None          # Attachment once attached
        self._lock = None
        self._alloc = None

    @property
    def allocator(self):
        if self._alloc is None:
            from cxlkv.state.alloc import Allocator

            self._alloc = Allocator(self)
        return self._alloc

    def _section(self, fn, *args):
        """fn(*args) as a section of this node in flight (Attachment.enter): a
        node fenced meanwhile acknowledges its fencing only once it returned,
        and no section starts after that."""
        node, m = self.node, self.mapping
        if not m.section_begin():           # the allocator's hot path: no extra frames
            node.enter()                    # raises NodeFenced
        try:
            return fn(*args)
        finally:
            m.section_end()
            if node.fenced:
                node.acknowledge_if_idle()

    def alloc(self, nbytes: int, zero: bool = True) -> int:
        """Reserve a slot of at least nbytes (64-byte aligned); returns its offset."""
        return self._section(self.allocator.alloc, nbytes, zero)

    def alloc_batch(self, nbytes: int, count: int, zero: bool = True):
        """Reserve `count` slots of one size; a numpy uint64 array of offsets."""
        return self._section(self.allocator.alloc_batch, nbytes, count, zero)

    def free(self, offset: int, zero: bool = True) -> None:
        """Free a slot (zeroed now, or with zero=False before its next use)."""
        self._section(self.allocator.free, offset, zero)

    def free_batch(self, offsets, zero: bool = True) -> int:
        return self._section(self.allocator.free_batch, offsets, zero)

    def publish(self, offsets) -> int:
        """Mark reserved slots published: they outlive this node."""
        return self._section(self.allocator.publish, offsets)

    def kv(self, *, model: str, block_bytes: int, block_tokens: int = 16, salt=None,
           hash: str = "xxh3_128", hash_seed: str | None = None, quota: int | None = None,
           spill_dir: str | None = None, spill_bytes: int | None = None,
           hot_bytes: int | None = None, remote_read: bool = False,
           remote_budget_s: float | None = None):
        """The KV cache namespace `model` as the tenant named by `salt` (see cxlkv.kv.cache).

        hash="sha256_cbor" keys blocks as vLLM does (seed: hash_seed or
        PYTHONHASHSEED); quota sets the tenant's byte quota (0 = none);
        spill_dir / spill_bytes give this process a spill tier on local disk
        for what it evicts (cxlkv.kv.spill); hot_bytes gives this process a
        DRAM hot tier of recently loaded blocks (cxlkv.kv.hot); remote_read
        lets lookups of this namespace read through the pool's remote tier,
        waiting at most remote_budget_s for it (cxlkv.kv.remote)."""
        from cxlkv.kv.cache import KVCache

        return KVCache(self, model=model, block_tokens=block_tokens, block_bytes=block_bytes,
                       salt=salt, hash=hash, hash_seed=hash_seed, quota=quota,
                       spill_dir=spill_dir, spill_bytes=spill_bytes, hot_bytes=hot_bytes,
                       remote_read=remote_read, remote_budget_s=remote_budget_s)

    def lock(self, timeout: float | None = None):
        """The pool lock as a context manager: `with pool.lock(): ...`.

        Needs an attached node (cxlkv.open_pool).  timeout=None waits for ever
        (a dead holder's lock is broken once its node is reaped).
        """
        if self._lock is None:
            from cxlkv.state.locks import ManagerLock, PoolLock

            with _LOCK_INIT:        # two threads' first calls: one lock object, not two
                if self._lock is None:
                    self._lock = (ManagerLock if self.sb.sync == "manager" else PoolLock)(self)
        if timeout is None:
            return self._lock
        return _TimedLock(self._lock, timeout)

    def attach(self, numa_node=None, **kw):
        """Attach as a node: claim a slot and start heartbeating (see state.nodes).

        numa_node: first bind this process's CPUs and memory policy to a NUMA
        node - a number, or "auto" for the node of the pool's DAX device - and
        verify it (cxlkv.host.numa; the result is `pool.numa`).  Threads started
        afterwards (the heartbeat among them) inherit the binding.
        """
        from cxlkv.state.nodes import Attachment

        if numa_node is not None and self.node is None:
            from cxlkv.host import numa

            self.numa = numa.bind(numa_node, pool_path=self.path)
            numa.bind_mapping(self.numa, self.mapping, self.target.kind)
        if self.node is None:
            node = Attachment(self, **kw)
            self.node = node
            try:
                node.start()
            except BaseException:
                self.node = None
                node.detach()
                raise
        return self.node

    # -- opening -------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike, *, writable: bool = True, force: bool = False,
             populate: bool = False) -> "Pool":
        """Open a formatted pool.

        Raises PoolNotFound, UnsafePermissions (world-readable or -writable,
        unless force), PoolInvalid subclasses, PoolIncompatible, DeviceError.
        An unknown ro_compat feature opens the pool read-only.
        """
        t = device.probe(path)
        warnings = []
        w = device.check_permissions(t, force)
        if w:
            warnings.append(w)
        if t.size < L.SB_COPIES * L.SB_SIZE:
            raise PoolTruncated(
                f"{t.path} is {t.size} bytes: too small to hold a pool "
                f"(the superblocks alone take {L.SB_COPIES * L.SB_SIZE})", path=t.path)
        m = device.map_target(t, writable=writable, populate=populate)
        try:
            sel = superblock.select(*read_superblocks(m))
            sb = sel.sb
            if sb.pool_size > t.size:
                raise PoolTruncated(
                    f"{t.path} is {t.size} bytes but its superblock says the pool is "
                    f"{sb.pool_size} bytes: the file or device was truncated", path=t.path,
                    hint="restore the original size, or reformat with cxlkv format --force")
            if writable and sb.read_only_features:
                warnings.append(f"{t.path}: unknown read-only-compatible features "
                                f"{sb.read_only_features:#x}; opened read-only")
                m.close()
                m = device.map_target(t, writable=False, populate=populate)
                writable = False
            for copy, problem in sel.problems.items():
                warnings.append(f"superblock copy {copy} is bad ({problem}); "
                                f"using copy {sel.copy}")
        except BaseException:
            m.close()
            raise
        return cls(t, m, sel, not writable, warnings)

    # -- properties ----------------------------------------------------
    @property
    def path(self) -> str:
        return self.target.path

    @property
    def sb(self) -> Superblock:
        return self._sel.sb

    @property
    def superblock_copy(self) -> str:
        return self._sel.copy

    @property
    def superblock_problems(self) -> dict[str, str]:
        return dict(self._sel.problems)

    def region(self, name: str) -> tuple[int, int]:
        return self.sb.regions[name]

    # -- superblock update ------------------------------------------------
    def update_superblock(self, **changes) -> Superblock:
        """Write a new superblock generation into the copy that is not current.

        The current copy stays intact until the new one is written and
        flushed, so a torn write leaves the old generation readable.
        """
        if self.read_only:
            raise PermissionError(f"{self.path}: pool is open read-only")
        new = self.sb.replace(seq=self.sb.seq + 1, **changes)
        target = "B" if self._sel.copy == "A" else "A"
        self.mapping.write(L.SB_OFFSETS["AB".index(target)], new.encode())
        self._sel = superblock.Selection(new, target, {})
        return new

    # -- lifetime --------------------------------------------------------
    def close(self) -> None:
        handling = sys.exc_info()[1]        # closing from an except block?
        if self.node is not None:
            self.node.detach()
            self.node = None
            self._lock = self._alloc = None
        if self.mapping is not None and not self.mapping.closed:
            try:
                self.mapping.close()
            except BufferError:
                if handling is None:
                    raise
                # an error raised from inside cxlkv (NodeFenced mid-allocation,
                # say) keeps the frames it passed alive, and with them views
                # of the pool they held: let them go, then close
                e = handling
                while e is not None:
                    traceback.clear_frames(e.__traceback__)
                    e = e.__context__
                gc.collect()
                self.mapping.close()

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<cxlkv.Pool {self.path} {self.sb.sync} {self.sb.pool_size} bytes>"


class _TimedLock:
    __slots__ = ("_lock", "_timeout")

    def __init__(self, lock, timeout):
        self._lock, self._timeout = lock, timeout

    def __enter__(self):
        self._lock.acquire(self._timeout)
        return self._lock

    def __exit__(self, *exc):
        self._lock.release()


def open_pool(path: str | os.PathLike, *, force: bool = False, heartbeat: bool = True,
              populate: bool = False, numa_node=None) -> Pool:
    """Open a pool read-write and attach this process as a node.

    The returned Pool is a context manager; leaving it (or close()) detaches.
    numa_node (a node number or "auto"): bind first, see Pool.attach.
    """
    pool = Pool.open(path, writable=True, force=force, populate=populate)
    try:
        pool.attach(heartbeat=heartbeat, numa_node=numa_node)
    except BaseException:
        pool.close()
        raise
    return pool
