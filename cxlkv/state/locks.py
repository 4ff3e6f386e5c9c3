"""The pool lock, `pool.lock()`.

Two tiers as in TraCT.  Tier 1: a process-local threading.Lock (one thread
per node), then the host-local lock (state.hostlock: a futex word in host
memory, one process per host); only its holder goes on to tier 2, the pool
lock proper, so contention in the pool is bounded by hosts, not processes.
Tier 2 alone makes the mutual exclusion; tier 1 only thins the crowd.

cas mode (coherent memory): tier 2 is a ticket lock in the lock area.  Each node records the ticket it holds or waits for in
its own lock entry, so waiters can tell a live holder from a dead one:

* the holder (or the waiter whose turn it is) is alive as long as its node
  slot still shows ATTACHED with the entry's epoch;
* once its node is fenced (reaped after its lease, or at once when the
  process is certainly gone from this host), the waiters skip its ticket;
* a ticket given up after a timeout (entry ABANDONED) is skipped at once;
* a ticket that no entry claims (its taker died between taking the number
  and recording it) is skipped after one lease.

Spinning is bounded: the C core spins a few thousand times with the GIL
released, then the waiter sleeps with exponential backoff (capped at 1 ms),
so contention never pins a core.  Lock words that no run of the protocol can
produce (now_serving past next_ticket, or further behind it than MAX_QUEUE)
raise PoolCorrupt instead of being waited out.

Stalls (both modes).  A holder paused past its lease is fenced and its turn
passed on; when it resumes it must not act as the holder.  Every write a
node makes in the lock area is checked against its epoch (cas: release
writes nothing once the node's control word is no longer its own; manager:
the manager ignores lines of another epoch), the lock counts as a section
in flight for the fencing acknowledgement (Attachment.enter / leave), and
the holder learns: `guard()` mid-section and the end of `with pool.lock():`
raise LockLost when the lock was taken from it - never silence.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from threading import get_ident

import numpy as np

from cxlkv._core import CRASH_ENABLED, crashpoint

# LockLost is public here too (cxlkv.state.locks, named in the README)
from cxlkv.errors import CxlkvError, LockLost, LockTimeout, NoLockManager, PoolCorrupt
from cxlkv.pool import layout
from cxlkv.state import hostlock, nodes, protocol
from cxlkv.state.protocol import entry_offset, lock_offsets, read_entries

log = logging.getLogger(__name__)

SPINS = 4000
BACKOFF_MAX = 0.001
#: manager mode: a waiter polls its grant line this long without sleeping,
#: then sleeps with backoff (2 us doubling) up to MGR_SLEEP_MAX_NS
MGR_SPIN_NS = 20_000
MGR_SLEEP_MAX_NS = int(BACKOFF_MAX * 1e9)
MGR_WAIT_SLICE_S = 0.1
#: most tickets that can be outstanding at once (taken, not yet served): one
#: per node, plus the few abandoned or taken by nodes that died recording
#: them; a larger gap is a corrupt word
MAX_QUEUE = 1 << 20

_SERVING = layout.field_offset(layout.LockHdrStruct, "now_serving")
_OWNER = layout.field_offset(layout.LockHdrStruct, "owner")
_NEXT = layout.field_offset(layout.LockHdrStruct, "next_ticket")


def _take_local(local: threading.Lock, host: hostlock.HostLock | None, path: str,
                timeout: float | None) -> float | None:
    """Tier 1: the process-local lock, then this host's lock (state.hostlock)
    when there is one; returns the deadline for tier 2.  On any failure
    neither is left held."""
    deadline = None if timeout is None else time.monotonic() + timeout
    if timeout is None:
        local.acquire()
    elif not local.acquire(timeout=timeout):
        raise LockTimeout(f"{path}: timed out waiting for the pool lock "
                          "(held by another thread of this process)")
    if host is None:
        return deadline
    try:
        got = host.acquire(deadline)
    except BaseException:
        local.release()
        raise
    if not got:
        local.release()
        raise LockTimeout(f"{path}: timed out waiting for the pool lock: this host's lock "
                          f"({host.path}) is held by {host.describe()}")
    return deadline


def _leave_local(local: threading.Lock, host: hostlock.HostLock | None) -> None:
    """Leave tier 1: this host's lock (a no-op when it was taken over from
    us - our node was fenced, and the pool lock's release says so), then the
    process-local lock."""
    try:
        if host is not None:
            host.release()
    finally:
        local.release()


def _host_lock(pool) -> hostlock.HostLock | None:
    """This node's host lock, or None (tier 1 is then process-local only)
    when the host lock file cannot be used - the pool lock stays correct,
    the processes of this host just all compete for it."""
    try:
        return hostlock.HostLock(pool, pool.node)
    except (OSError, CxlkvError) as e:
        log.warning("%s: no host-local lock tier (%s); every process of this host "
                    "competes for the pool lock", pool.path, e)
        return None


def _granted() -> None:
    if CRASH_ENABLED:
        crashpoint("lock.held")


def _corrupt_tickets(pool, serving: int, nxt: int) -> PoolCorrupt:
    return PoolCorrupt(
        f"{pool.path}: the pool lock's ticket words are corrupt (now serving {serving}, next "
        f"ticket {nxt}): no run of the lock produces them; repair with `cxlkv fsck --repair "
        f"--pool {pool.path}`", path=pool.path,
        hint="stop every node of the pool first (cxlkv-runbook(7))")


def check_tickets(pool, serving: int | None = None) -> None:
    """Raise PoolCorrupt when now_serving / next_ticket cannot be real."""
    hdr, _ = lock_offsets(pool)
    m = pool.mapping
    m.invalidate(hdr, 128)
    nxt = m.load64(hdr + _NEXT)
    serving = m.load64(hdr + _SERVING) if serving is None else serving
    if serving > nxt or nxt - serving > MAX_QUEUE:
        raise _corrupt_tickets(pool, serving, nxt)


def guard(pool) -> None:
    """Before a step of a critical section: raise NodeFenced unless this
    process's node (if it has one) may still write (Attachment.guard)."""
    if pool.node is not None:
        pool.node.guard()


@contextlib.contextmanager
def held_lock(pool, slot: int):
    """The pool lock for recovering node `slot`, as this process's own node.

    No node of ours (the lock manager, an offline repair): no lock - that
    caller is the only writer.  Our node usable: its lock (unless this thread
    holds it already), then guard().  Our node fenced: NodeFenced - a fenced
    node recovers nothing, not even its own slot (that is the reaper's, at
    the end of its quarantine)."""
    node = pool.node
    if node is None:
        yield
        return
    lock = pool.lock()
    if lock.held_by_me():
        node.guard()
        yield
        return
    with lock:
        node.guard()
        yield


nodes.register_held_lock(held_lock)


def _holder_alive(pool, slot: int, epoch: int, observer: nodes.Observer | None) -> bool:
    """Is the node that took a ticket still the live holder of that slot?

    Fences it (so recovery runs) when this waiter can tell it is dead: a
    local process that is gone, or - with an observer - a node whose control
    word and heartbeat have not moved for a whole lease on our clock.
    """
    off = nodes.node_offset(pool, slot) + layout.field_offset(layout.NodeStruct, "control")
    pool.mapping.invalidate(off, 8)
    control = layout.node_control(layout.NODE_ATTACHED, epoch)
    if pool.mapping.load64(off) != control:
        return False
    n = nodes.read_slot(pool, slot)
    verdict = (observer or nodes.Observer(pool)).verdict(n)
    if verdict == "dead" and n.control == control:
        # fenced unless it beat meanwhile (a stale verdict): then it lives on
        return not nodes.fence(pool, slot, control, n.heartbeat) and \
            nodes.read_slot(pool, slot).control == control
    return True


def skip_dead_ticket(pool, serving: int, unclaimed_for: float,
                     observer: nodes.Observer | None = None) -> bool:
    """Advance now_serving past `serving` if its holder is certainly gone.

    unclaimed_for: how long (observer's clock) now_serving has shown this
    ticket with no entry claiming it.  Returns True if this call skipped it.
    """
    hdr, _ = lock_offsets(pool)
    pool.mapping.invalidate(hdr, 8)
    if serving >= pool.mapping.load64(hdr + _NEXT):
        return False                     # nobody holds that ticket yet: nothing to skip
    ents = read_entries(pool)
    holders = np.nonzero((ents["ticket"] == serving)
                         & np.isin(ents["state"], (layout.LOCK_WAITING, layout.LOCK_LOCKED)))[0]
    m = pool.mapping
    for slot in holders:
        slot = int(slot)
        if _holder_alive(pool, slot, int(ents["epoch"][slot]), observer):
            return False
        # dead holder: drop whatever it owned, then pass its turn on
        token = (slot + 1) | int(ents["epoch"][slot]) << 16
        m.cas64(hdr + _OWNER, token, 0)
        return m.cas64(hdr + _SERVING, serving, serving + 1) == serving
    abandoned = np.nonzero((ents["ticket"] == serving) &
                           (ents["state"] == layout.LOCK_ABANDONED))[0]
    if len(abandoned) == 0 and unclaimed_for < pool.sb.lease_ms / 1000.0:
        return False
    return m.cas64(hdr + _SERVING, serving, serving + 1) == serving


@nodes.register_recovery(order=10, at_fence=True, part="locks")
def _recover_lock_entry(pool, slot: int, epoch: int) -> None:
    """A dead node's lock entry: pass its turn on if it is up, else mark its
    ticket abandoned so the waiters skip it when it comes up."""
    if pool.sb.sync != "cas":
        return
    off = entry_offset(pool, slot)
    m = pool.mapping
    e = layout.LockEntryStruct.from_buffer_copy(m.read(off, layout.LOCK_ENTRY_SIZE))
    if e.epoch != epoch or e.state == layout.LOCK_IDLE:
        return
    hdr, _ = lock_offsets(pool)
    token = (slot + 1) | epoch << 16
    m.invalidate(hdr + _OWNER, 8)
    if e.state == layout.LOCK_LOCKED or m.load64(hdr + _OWNER) == token:
        protocol.mark_held_when_fenced(pool, slot, token)   # before the turn passes on
    m.cas64(hdr + _OWNER, token, 0)
    m.store64(off, layout.LOCK_ABANDONED)
    m.cas64(hdr + _SERVING, e.ticket, e.ticket + 1)


@nodes.register_recovery(order=90)
def _forget_held_when_fenced(pool, slot: int, epoch: int) -> None:
    """The end of a recovery (its quarantine over, everything it held
    recovered): the node's mark of having been fenced holding the lock goes,
    so recoveries finish others' half-done work again (nodes.fenced_holders),
    and so does the node it was recovering (nodes.recovered_by_fenced)."""
    base = entry_offset(pool, slot)
    pool.mapping.invalidate(base + protocol.E_HELD_WHEN_FENCED, 16)
    if pool.mapping.load64(base + protocol.E_HELD_WHEN_FENCED):
        protocol.mark_held_when_fenced(pool, slot, 0)
    if pool.mapping.load64(base + protocol.E_RECOVERING):
        protocol.mark_recovering(pool, slot, 0)


def describe_owner(pool) -> str:
    hdr, _ = lock_offsets(pool)
    pool.mapping.invalidate(hdr + _OWNER, 8)
    owner = pool.mapping.load64(hdr + _OWNER)
    if not owner:
        return "nobody"
    slot, epoch = (owner & 0xFFFF) - 1, owner >> 16
    try:
        n = nodes.read_slot(pool, slot)
    except Exception:   # noqa: BLE001 - a damaged owner word still gets a message
        return f"slot {slot} epoch {epoch}"
    return f"{n.describe()} epoch {epoch}"


class PoolLock:
    """The pool lock of one attached node: not reentrant; a context manager."""

    def __init__(self, pool):
        node = pool.node
        if node is None:
            raise CxlkvError("pool.lock() needs an attached node: use cxlkv.open_pool()")
        self.pool = pool
        self._local = threading.Lock()          # tier 1: one thread per node ...
        self._host = _host_lock(pool)           # ... then one process per host
        # the host lock's hot path, straight to C (None: no host tier)
        self._hl_acq = self._host.fast_acquire if self._host else None
        self._hl_rel = self._host.fast_release if self._host else None
        self._hl_mine = self._host.mine if self._host else 0
        self._hl_wait = self._host._check_ns if self._host else 0
        self._hdr, _ = lock_offsets(pool)
        # fixed while attached: the hot path passes them straight to C
        self._entry = entry_offset(pool, node.slot)
        self._token = node.owner_token
        self._epoch = node.epoch
        self._ctl = nodes.node_offset(pool, node.slot) + layout.field_offset(layout.NodeStruct,
                                                                             "control")
        self._ctl_val = node.control
        self._acquire = pool.mapping.ticket_acquire
        self._release = pool.mapping.ticket_release
        self._ticket = None
        self._holder = 0                        # thread id holding it, 0 = none
        self._observer = nodes.Observer(pool)

    def acquire(self, timeout: float | None = None) -> "PoolLock":
        if timeout is None:                  # the hot path: no helper call
            self._local.acquire()
            if self._hl_acq is not None and self._hl_acq(hostlock.WORD, self._hl_mine,
                                                         hostlock.SPINS,
                                                         self._hl_wait, 0):
                self._wait_host()
            deadline = None
        else:
            deadline = _take_local(self._local, self._host, self.pool.path, timeout)
        # held (or waited for): in flight for the fencing acknowledgement
        # (Attachment._in_flight) until release - set before the lock is ours
        self._holder = get_ident()
        try:
            r = self._acquire(self._hdr, self._entry, self._token, self._epoch, SPINS,
                              self._ctl, self._ctl_val)
            if type(r) is int:
                self._ticket = r
            elif r is None:
                self.pool.node.check()      # raises NodeFenced
            else:
                self._ticket = self._wait(r[0], r[1], deadline)
            _granted()
        except BaseException:
            self._holder = 0
            _leave_local(self._local, self._host)
            if self.pool.node.fenced:
                self.pool.node.acknowledge_if_idle()
            raise
        return self

    def _wait_host(self) -> None:
        """The host lock's slow path (waits for ever; see hostlock.HostLock)."""
        try:
            self._host.wait(None, self._hl_wait)
        except BaseException:
            self._local.release()
            raise

    def guard(self) -> None:
        """Inside `with pool.lock():` - raise LockLost unless this node still
        holds the lock and may write (its heartbeat is fresh: see
        Attachment.guard).  Call it before each step that writes what the
        lock protects; cxlkv's own critical sections do."""
        try:
            self.pool.node.guard()
        except nodes.NodeFenced as e:
            raise self._lost() from e
        m = self.pool.mapping
        if m.load64(self._hdr + _SERVING) != self._ticket or \
                m.load64(self._hdr + _OWNER) != self._token:
            raise self._lost()

    def _lost(self) -> "LockLost":
        return LockLost(f"{self.pool.path}: the pool lock was taken from node "
                        f"{self.pool.node.slot} while it held it (its lease lapsed)",
                        path=self.pool.path)

    def held_by_me(self) -> bool:
        return self._holder == get_ident()

    def held_here(self) -> bool:
        """A thread of this process holds the lock or is taking it (from
        acquire until release): a section in flight (Attachment._in_flight)."""
        return self._holder != 0

    def _wait(self, t: int, serving: int, deadline) -> int:
        m = self.pool.mapping
        backoff = 1e-5
        last, since = serving, time.monotonic()
        while True:
            r = m.ticket_wait(self._hdr, self._entry, t, self._token, SPINS, self._ctl,
                              self._ctl_val)
            if r is None:                   # our turn came, but we were fenced meanwhile
                self.pool.node.check()      # raises NodeFenced
            ok, serving = r
            if ok:
                return t
            if serving > t or t - serving > MAX_QUEUE:
                try:
                    check_tickets(self.pool, serving)
                except PoolCorrupt:
                    m.store64(self._entry, layout.LOCK_ABANDONED)    # give the ticket up
                    m.cas64(self._hdr + _SERVING, t, t + 1)
                    raise
                # our turn went by: we were judged dead (paused past our lease)
                # and skipped.  Fenced: stop.  Not fenced (we stalled between
                # taking the number and recording it): take a new ticket.
                self.pool.node.check()
                r = m.ticket_acquire(self._hdr, self._entry, self._token, self._epoch, SPINS,
                                     self._ctl, self._ctl_val)
                if r is None:
                    self.pool.node.check()  # raises NodeFenced
                if type(r) is int:
                    return r
                t, serving = r
                last, since = serving, time.monotonic()
                continue
            now = time.monotonic()
            if serving != last:
                last, since = serving, now
            elif now - since > 0.002:
                if skip_dead_ticket(self.pool, serving, now - since, self._observer):
                    continue
            if deadline is not None and now >= deadline:
                # give the ticket up: waiters skip it; if our turn came meanwhile, pass it on
                m.store64(self._entry, layout.LOCK_ABANDONED)
                m.cas64(self._hdr + _SERVING, t, t + 1)
                raise LockTimeout(
                    f"{self.pool.path}: timed out waiting for the pool lock (ticket {t}, "
                    f"now serving {serving}, held by {describe_owner(self.pool)})")
            time.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX)

    def release(self) -> None:
        """Leave the lock; LockLost if it had been taken from this node (a
        fenced node writes nothing: the C call checks its control word)."""
        t, self._ticket = self._ticket, None
        node = self.pool.node
        try:
            ok = t is None or (not node.fenced and self._release(
                self._hdr, self._entry, t, self._token, self._ctl, self._ctl_val))
        except nodes.NodeFenced:                # found fenced before anything was written
            ok = False
        finally:
            self._holder = 0
            try:
                if self._hl_rel is not None:
                    self._hl_rel(hostlock.WORD,
                                 self._hl_mine)     # False: taken over (we were fenced)
            finally:
                self._local.release()
        if not ok:
            node.acknowledge_if_idle()
            raise self._lost()

    __enter__ = acquire          # the uncontended path is one C call each way

    def __exit__(self, *exc) -> None:
        self.release()


class ManagerLock:
    """The pool lock in sync mode `manager` (TraCT's two tiers).

    Tier 1: a process-local lock, then the host-local lock (state.hostlock),
    so one thread per host competes.  Tier 2:
    the node raises a request in its own lock-entry line (store + flush) and
    polls the line the lock manager writes (invalidate + load) until the
    request is granted; release is one more store + flush.  No cross-host
    atomics anywhere.
    """

    def __init__(self, pool):
        node = pool.node
        if node is None:
            raise CxlkvError("pool.lock() needs an attached node: use cxlkv.open_pool()")
        self.pool, self.P = pool, protocol
        self.m = pool.mapping
        self.e = protocol.entry_offset(pool, node.slot)
        self.m.invalidate(self.e, layout.LOCK_ENTRY_SIZE)
        self.seq = max(self.m.load64(self.e + o) for o in (protocol.E_REQ, protocol.E_RELEASE,
                                                           protocol.E_GRANT,
                                                            protocol.E_REVOKE))
        self._local = threading.Lock()          # tier 1: one thread per node ...
        self._host = _host_lock(pool)           # ... then one process per host
        self._holder = 0

    def acquire(self, timeout: float | None = None) -> "ManagerLock":
        protocol, m, e = self.P, self.m, self.e
        deadline = _take_local(self._local, self._host, self.pool.path, timeout)
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            node = self.pool.node
            node.check()
            self._holder = get_ident()      # in flight (Attachment._in_flight) until release
            self.seq += 1
            req = self.seq
            m.store64(e + protocol.E_EPOCH, node.epoch)
            m.store64(e + protocol.E_REQ, req)
            m.flush(e, 64)
            start = time.monotonic()
            deadline = None if timeout is None else start + timeout
            lease = self.pool.sb.lease_ms / 1000.0
            next_check = start + lease
            wait = m.mgr_wait
            while True:
                # C polls the manager's line (invalidate + load), spinning
                # briefly then sleeping with backoff, GIL released; it comes
                # back for the checks below at least every MGR_WAIT_SLICE_S
                # (so a signal is handled)
                until = min(next_check, time.monotonic() + MGR_WAIT_SLICE_S)
                if deadline is not None:
                    until = min(until, deadline)
                r = wait(e, req, MGR_SPIN_NS, MGR_SLEEP_MAX_NS, int(until * 1e9))
                if r == 1:
                    break
                if r == 2:
                    node.check()
                    raise LockLost(f"{self.pool.path}: the lock manager revoked our request")
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    self._withdraw(req)
                    raise LockTimeout(f"{self.pool.path}: timed out waiting for the pool lock "
                                      "(sync mode manager)")
                if now >= next_check:
                    if not protocol.manager_alive(self.pool):
                        self._withdraw(req)
                        raise NoLockManager(
                            f"{self.pool.path}: no lock manager is running (sync mode "
                            f"manager): start `cxlkv lock-manager --pool {self.pool.path}` "
                            "on any host")
                    next_check = time.monotonic() + lease
            _granted()
        except BaseException:
            self._holder = 0
            _leave_local(self._local, self._host)
            if self.pool.node.fenced:
                self.pool.node.acknowledge_if_idle()
            raise
        return self

    def guard(self) -> None:
        """Inside `with pool.lock():` - raise LockLost unless this node still
        holds the lock (not revoked) and may write (see Attachment.guard)."""
        try:
            self.pool.node.guard()
        except nodes.NodeFenced as e:
            raise self._lost() from e
        self.m.invalidate(self.e + self.P.E_REVOKE, 8)
        if self.m.load64(self.e + self.P.E_REVOKE) >= self.seq:
            raise self._lost()

    def _lost(self) -> "LockLost":
        return LockLost(f"{self.pool.path}: the lock manager revoked node "
                        f"{self.pool.node.slot}'s hold of the pool lock (its lease lapsed)",
                        path=self.pool.path)

    def _withdraw(self, req: int) -> None:
        """Give a request up: released before (or without) being granted."""
        self.m.store64(self.e + self.P.E_RELEASE, req)
        self.m.flush(self.e, 64)

    def release(self) -> None:
        """Write the release (with our epoch: the manager ignores lines of
        another epoch); LockLost if the hold had been revoked or this node
        fenced - a fenced node writes nothing."""
        node, protocol, m = self.pool.node, self.P, self.m
        lost = True
        try:
            try:
                node.check()
                m.invalidate(self.e + protocol.E_REVOKE, 8)
                lost = m.load64(self.e + protocol.E_REVOKE) >= self.seq
                m.store64(self.e + protocol.E_EPOCH, node.epoch)
                m.store64(self.e + protocol.E_RELEASE, self.seq)
                m.flush(self.e, 64)
            except nodes.NodeFenced:            # nothing of a fenced node's is written
                lost = True
        finally:
            self._holder = 0
            _leave_local(self._local, self._host)
        if lost:
            node.acknowledge_if_idle()
            raise self._lost()

    def held_by_me(self) -> bool:
        return self._holder == get_ident()

    def held_here(self) -> bool:
        """A thread of this process holds the lock or is taking it (from
        acquire until release): a section in flight (Attachment._in_flight)."""
        return self._holder != 0

    __enter__ = acquire

    def __exit__(self, *exc) -> None:
        self.release()
