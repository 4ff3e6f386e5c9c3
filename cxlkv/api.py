"""The pool as a program uses it: cxlkv.open_pool and the Pool facade.

A Pool is an open pool image (cxlkv.pool.image.PoolImage: the mapping and
the superblock) plus what an attached node does with it: the node itself
(state.nodes.Attachment), the pool lock (state.locks), the slot allocator
(state.alloc), KV cache namespaces (kv.cache) and the KV cache's tiers of
this pool object (`tiers`: kv.tiers.base.Tiers).  Lower layers get a Pool
passed in and call these methods; none of them imports this module.
"""
from __future__ import annotations

import os
import threading
import uuid as uuidlib

from cxlkv.errors import UsageError, WrongPool
from cxlkv.host import numa
from cxlkv.kv import area  # noqa: F401  (registers the KV part of a dead node's recovery)
from cxlkv.kv.cache import KVCache
from cxlkv.kv.tiers.base import Tiers
from cxlkv.pool.image import PoolImage
from cxlkv.state.alloc import Allocator, geometry
from cxlkv.state.locks import ManagerLock, PoolLock
from cxlkv.state.nodes import Attachment

#: makes the first pool.lock() of a pool once, when threads race to it
_LOCK_INIT = threading.Lock()


#: the pool this host pins: attaches to any other pool are refused
POOL_UUID_ENV = "CXLKV_POOL_UUID"
#: "0": no background warm-up of the pool's metadata (Pool.warm_metadata)
WARM_ENV = "CXLKV_WARM_METADATA"
#: bytes of metadata mapped per call of the warm-up (the GIL released)
WARM_STEP = 8 << 20


class Pool(PoolImage):
    """An open, formatted pool; `attach()` makes this process a node.

    `warnings` collects what --force overrode.  `tiers`: the KV cache's
    tiers of this pool object in this process (hot, spill, remote), none
    until enabled (cxlkv.kv.tiers).
    """

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.node = None          # Attachment once attached
        self._lock = None
        self._alloc = None
        self.tiers = Tiers()
        self._warm: tuple[int, threading.Thread, threading.Event] | None = None

    @property
    def allocator(self):
        if self._alloc is None:
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
        for what it evicts (cxlkv.kv.tiers.spill); hot_bytes gives this process a
        DRAM hot tier of recently loaded blocks (cxlkv.kv.tiers.hot); remote_read
        lets lookups of this namespace read through the pool's remote tier,
        waiting at most remote_budget_s for it (cxlkv.kv.tiers.remote)."""
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
            with _LOCK_INIT:        # two threads' first calls: one lock object, not two
                if self._lock is None:
                    self._lock = (ManagerLock if self.sb.sync == "manager" else PoolLock)(self)
        if timeout is None:
            return self._lock
        return _TimedLock(self._lock, timeout)

    @property
    def existing_lock(self):
        """The pool lock object pool.lock() made in this process (since the
        attach), or None: asks without making one."""
        return self._lock

    def attach(self, numa_node=None, expect_uuid: str | None = None, **kw):
        """Attach as a node: claim a slot and start heartbeating (see state.nodes).

        numa_node: first bind this process's CPUs and memory policy to a NUMA
        node - a number, or "auto" for the node of the pool's DAX device - and
        verify it (cxlkv.host.numa; the result is `pool.numa`).  Threads started
        afterwards (the heartbeat among them) inherit the binding.
        expect_uuid: the pool this host pins (default: $CXLKV_POOL_UUID, when
        set); any other pool at the path is refused (WrongPool) before a slot
        is claimed.
        """
        if self.node is None:
            check_uuid(self, expect_uuid)
        if numa_node is not None and self.node is None:
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

    def warm_metadata(self) -> bool:
        """Map the pool's metadata (everything before the data area: the
        node, lock and chunk tables, the KV hash table, its lists and block
        names) into this process in the background, WARM_STEP bytes per call
        with the GIL released, on thread "cxlkv-warm"; started once per
        process by the first KV cache, stopped by close().

        A process that attached maps none of the shared metadata: without
        this, its stores and lookups take a minor page fault for each page
        of the hash table and name table they first touch (a write fault per
        4 KiB page of tmpfs) until they have touched them all - most of them,
        as keys hash at random.  Cost: one pass of MADV_POPULATE_READ over
        the metadata (about 40 ms of one CPU for the 472 MiB of a 16 GiB
        pool on a 2-vCPU VM) and the page tables that map it.  False: not
        started ($CXLKV_WARM_METADATA=0, not attached, or prefaulting off)."""
        if os.environ.get(WARM_ENV, "").strip() == "0" or self.node is None or \
                not self.mapping.prefault:
            return False
        with _LOCK_INIT:
            if self._warm is not None and self._warm[0] == os.getpid():
                return True                 # (a forked child warms its own mapping)
            end = geometry(self)[0]
            stop = threading.Event()
            t = threading.Thread(target=self._warm_run, args=(end, stop), name="cxlkv-warm",
                                 daemon=True)
            self._warm = (os.getpid(), t, stop)
            t.start()
        return True

    def _warm_run(self, end: int, stop: threading.Event) -> None:
        m, off = self.mapping, 0
        try:
            while off < end and not stop.is_set():
                if not m.prefault_range(off, min(WARM_STEP, end - off)):
                    return
                off += WARM_STEP
        except (ValueError, OSError):       # unmapped under us: nothing to warm
            return

    def close(self) -> None:
        """Detach (when attached), then unmap."""
        w, self._warm = self._warm, None
        if w is not None and w[0] == os.getpid():
            w[2].set()
            w[1].join()
        if self.node is not None:
            self.node.detach()
            self.node = None
            self._lock = self._alloc = None
        super().close()


class _TimedLock:
    __slots__ = ("_lock", "_timeout")

    def __init__(self, lock, timeout):
        self._lock, self._timeout = lock, timeout

    def __enter__(self):
        self._lock.acquire(self._timeout)
        return self._lock

    def __exit__(self, *exc):
        self._lock.release()


def check_uuid(pool: PoolImage, expect: str | None = None) -> None:
    """WrongPool unless the pool's uuid is `expect` (default: $CXLKV_POOL_UUID;
    nothing pinned: nothing to check).  UsageError for a pin that is no uuid."""
    source = "the pin given" if expect else f"${POOL_UUID_ENV}"
    expect = expect or os.environ.get(POOL_UUID_ENV, "").strip()
    if not expect:
        return
    try:
        want = uuidlib.UUID(expect)
    except ValueError:
        raise UsageError(f"{source}: {expect!r} is not a pool uuid (cxlkv inspect shows "
                         "the pool's)") from None
    if pool.sb.uuid != want:
        raise WrongPool(f"{pool.path} holds pool {pool.sb.uuid}, not pool {want} that this "
                        f"host pins ({source}): another region, device or format is mapped "
                        "at this path", path=pool.path,
                        hint="check the path (cxlkv doctor --pool), or pin the new uuid "
                             "after a deliberate re-format")


def open_pool(path: str | os.PathLike, *, force: bool = False, heartbeat: bool = True,
              populate: bool = False, numa_node=None, expect_uuid: str | None = None) -> Pool:
    """Open a pool read-write and attach this process as a node.

    The returned Pool is a context manager; leaving it (or close()) detaches.
    numa_node (a node number or "auto"): bind first, see Pool.attach.
    expect_uuid: refuse any other pool (default $CXLKV_POOL_UUID), see Pool.attach.
    """
    pool = Pool.open(path, writable=True, force=force, populate=populate)
    try:
        pool.attach(heartbeat=heartbeat, numa_node=numa_node, expect_uuid=expect_uuid)
    except BaseException:
        pool.close()
        raise
    return pool
