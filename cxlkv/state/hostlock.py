"""The host-local tier of the pool lock (TraCT's two tiers).

Processes of one host first take a lock in host memory, so at most one of
them at a time competes for the pool lock (cas: a ticket; manager: a request
line).  The lock is a futex word in a small file per pool and host:

    $CXLKV_HOSTLOCK_DIR (default /dev/shm/cxlkv)/<pool uuid>-<boot id>-<pidns>.lock

mode 0660 (group: the pool file's group when this process may set it).  "One
host" is what cxlkv can check pids in: the same boot id and pid namespace
(state.nodes; tests give a process a boot id of its own with
CXLKV_PROCFS_ROOT, so simulated hosts get separate files).

File layout (host memory; every process of the host that attaches the pool
writes it, no pool lock involved):

    0       header: magic, version, max_nodes, pool uuid   (written once, at creation)
    64      the lock word (hostlock.c): holder slot + 1, WAITERS, HANDOFF, holder epoch
    72      the spinner word: the deadline of the one waiter spinning (0: none)
    128     one record per node slot: epoch, pid, process start time (ns), written
            by the node of that slot (seqlock: epoch 0 while it changes) before it
            first takes the lock

Waiters spin briefly, then sleep in FUTEX_WAIT - except one, which spins up
to 150 us more (the lock then goes to a running process, not to a sleeper
still to be scheduled); the lock barges (a running
process gets a free word at once), so a preempted waiter stalls nobody, and
a waiter that has waited 4 ms asks for a hand-off, so nobody starves.

Dead and stalled holders.  A waiter whose timed wait ends with the same
holder judges it and takes the lock over by CAS on the word it saw when
* the holder's node slot no longer shows it attached with its epoch (it was
  fenced - e.g. paused past its lease - or detached), or
* its record says its process (pid + start time) is gone from this host.
A holder taken over learns it at release: the CAS from its own word fails,
nothing is written (hostlock_release returns False); its pool-lock release
then raises LockLost or NodeFenced (its node was fenced).  Mutual exclusion
of what the pool lock protects never rests on this tier: it is the pool
lock's (tier 2); this tier only keeps the processes of a host from
competing there.

Threads: the pool lock's process-local threading.Lock stays in front, so
one thread per node uses this word (holders are named by node, whose fencing
and pool-lock entry are per node too).
"""
from __future__ import annotations

import logging
import mmap
import os
import secrets
import time

from cxlkv._core import Mapping
from cxlkv.errors import HostLockError
from cxlkv.state import nodes

log = logging.getLogger(__name__)

DEFAULT_DIR = "/dev/shm/cxlkv"
ENV_DIR = "CXLKV_HOSTLOCK_DIR"
MAGIC = int.from_bytes(b"CXLKVHL1", "little")
VERSION = 1
WORD = 64
RECORDS = 128
RECORD_SIZE = 64
HOLDER = 0xFFFFFFFF0000FFFF
WAITERS = 1 << 31
HANDOFF = 1 << 30
SPINS = 200
MODE = 0o660
_M32 = 0xFFFFFFFF


def lock_dir() -> str:
    return os.environ.get(ENV_DIR) or DEFAULT_DIR


def word_of(slot: int, epoch: int) -> int:
    """The lock word naming node `slot` of `epoch` as the holder."""
    return (epoch & _M32) << 32 | (slot + 1)


def file_size(max_nodes: int) -> int:
    need = RECORDS + max_nodes * RECORD_SIZE
    return (need + 4095) // 4096 * 4096


class HostLock:
    """This node's handle on its host's lock word for one pool."""

    def __init__(self, pool, node):
        if node.slot >= 0xFFFF:
            raise HostLockError(f"{pool.path}: node slot {node.slot} does not fit a host lock word")
        self.pool, self.node = pool, node
        self.max_nodes = pool.sb.max_nodes
        self.path = os.path.join(lock_dir(), f"{pool.sb.uuid}-{node.observer.boot_id}-"
                                             f"{node.observer.pidns}.lock")
        self._mm = _open(self.path, pool)
        self.m = Mapping.from_buffer(self._mm)
        self.m.host_memory()                    # coherent, even under CXLKV_NONCOHERENT=1
        self.mine = word_of(node.slot, node.epoch)
        lease = pool.sb.lease_ms / 1000.0
        #: how long a waiter sleeps before it judges an unchanged holder
        self.check_s = min(max(lease / 16, 0.002), 0.02)
        self._check_ns = int(self.check_s * 1e9)
        self.fast_acquire = self.m.hostlock_acquire
        self.fast_release = self.m.hostlock_release
        self._write_record()

    # -- records ---------------------------------------------------------------
    def _write_record(self) -> None:
        off = RECORDS + self.node.slot * RECORD_SIZE
        pid, start = nodes.my_identity()
        m = self.m
        m.store64(off, 0)                       # changing
        m.store64(off + 8, pid)
        m.store64(off + 16, start)
        m.store64(off + 0, self.node.epoch)

    def record(self, slot: int) -> tuple[int, int, int] | None:
        """(epoch, pid, start_time_ns) of slot's record, None while it changes."""
        if not 0 <= slot < self.max_nodes:
            return None
        off = RECORDS + slot * RECORD_SIZE
        m = self.m
        e1, pid, start = m.load64(off), m.load64(off + 8), m.load64(off + 16)
        if e1 == 0 or m.load64(off) != e1:
            return None
        return e1, pid, start

    # -- the lock ----------------------------------------------------------------
    def acquire(self, deadline: float | None) -> bool:
        """Take the host lock by `deadline` (time.monotonic(); None: for ever);
        False on timeout.  Raises NodeFenced when this node was fenced while
        it waited."""
        wait_ns = self._wait_ns(deadline)
        if self.fast_acquire(WORD, self.mine, SPINS, wait_ns, 0) == 0:
            return True
        return self.wait(deadline, wait_ns)

    def _wait_ns(self, deadline: float | None) -> int:
        if deadline is None:
            return self._check_ns
        return max(0, min(self._check_ns, int((deadline - time.monotonic()) * 1e9)))

    def wait(self, deadline: float | None, waited_ns: int) -> bool:
        """The slow path, after a first fast_acquire(..., waited_ns, 0) that
        did not get the lock (it returns only once it waited that long)."""
        since = time.monotonic_ns() - waited_ns
        while True:
            word = self.m.load64(WORD)
            if word & HOLDER and self.take_over(word):
                return True
            self.node.check()                   # NodeFenced: stop waiting
            if deadline is not None and time.monotonic() >= deadline:
                # handed to us (reserved) as we give up: free it for the others
                if word & HOLDER == 0 and word & HANDOFF:
                    self.m.cas64(WORD, word, 0)
                return False
            word = self.fast_acquire(WORD, self.mine, SPINS, self._wait_ns(deadline), since)
            if word == 0:
                return True

    def take_over(self, word: int) -> bool:
        """Take the lock from the holder named in `word` if it is dead or fenced
        (CAS on exactly that word); True when it is ours now."""
        reason = self.holder_gone(word)
        if reason is None:
            return False
        if self.m.cas64(WORD, word, self.mine | WAITERS) != word:
            return False
        log.info("%s: took the host lock over from %s (%s)", self.path,
                 self.describe(word), reason)
        return True

    def holder_gone(self, word: int) -> str | None:
        """Why the holder named in `word` holds it no more, or None (alive)."""
        slot, elo = (word & 0xFFFF) - 1, word >> 32
        if not 0 <= slot < self.max_nodes:
            return f"the word names no node slot ({word:#x})"
        n = nodes.read_slot(self.pool, slot)
        if n.state not in ("attached", "claimed") or n.epoch & _M32 != elo:
            return f"node {slot} epoch {elo} is {n.state} now (epoch {n.epoch})"
        rec = self.record(slot)
        if rec is not None and rec[0] & _M32 == elo and \
                not nodes.local_process_alive(rec[1], rec[2]):
            return f"its process {rec[1]} is gone"
        return None

    def release(self) -> bool:
        """False when the lock had been taken over (nothing written)."""
        return self.fast_release(WORD, self.mine)

    def holder(self) -> int:
        """The lock word now (0: free)."""
        return self.m.load64(WORD)

    def describe(self, word: int | None = None) -> str:
        word = self.holder() if word is None else word
        if not word & HOLDER:
            return "nobody"
        slot, elo = (word & 0xFFFF) - 1, word >> 32
        try:
            return f"{nodes.read_slot(self.pool, slot).describe()} epoch {elo}"
        except Exception:   # noqa: BLE001 - a damaged word still gets a message
            return f"node {slot} epoch {elo}"

    def close(self) -> None:
        try:
            self.m.close()
            self._mm.close()
        except (BufferError, ValueError):
            pass


def _open(path: str, pool) -> mmap.mmap:
    """Map the host lock file, creating it (complete, mode 0660) if missing."""
    size = file_size(pool.sb.max_nodes)
    d = os.path.dirname(path)
    if not os.path.isdir(d):
        try:
            os.mkdir(d, 0o770)
            os.chmod(d, 0o770)
            _group_of(pool, d)
        except FileExistsError:
            pass
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        fd = _create(path, pool, size)
    try:
        st = os.fstat(fd)
        if st.st_size < size:
            raise HostLockError(f"{path}: host lock file of {st.st_size} bytes, needs {size}",
                                hint="remove it while no process of this host uses the pool")
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    hdr = bytes(mm[:32])
    want = _header(pool)
    if hdr != want:
        mm.close()
        raise HostLockError(f"{path}: not a host lock file of pool {pool.sb.uuid}",
                            hint="remove it while no process of this host uses the pool")
    return mm


def _header(pool) -> bytes:
    return (MAGIC.to_bytes(8, "little") + VERSION.to_bytes(4, "little") +
            pool.sb.max_nodes.to_bytes(4, "little") + pool.sb.uuid.bytes)


def _create(path: str, pool, size: int) -> int:
    """Write a complete file under a temporary name, then link it into place
    (someone else's link first: use theirs).  Returns an open fd."""
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, MODE)
    try:
        os.fchmod(fd, MODE)                     # not narrowed by the umask
        _group_of(pool, fd)
        os.ftruncate(fd, size)
        os.pwrite(fd, _header(pool), 0)
        try:
            os.link(tmp, path)
        except FileExistsError:
            os.close(fd)
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except BaseException:
        os.close(fd)
        raise
    finally:
        os.unlink(tmp)
    return fd


def _group_of(pool, target) -> None:
    """Give `target` (a path or fd) the pool file's group, so every process
    that may open the pool may use the lock; best effort."""
    try:
        gid = os.stat(pool.path).st_gid
        if isinstance(target, int):
            os.fchown(target, -1, gid)
        else:
            os.chown(target, -1, gid)
    except OSError:
        pass
