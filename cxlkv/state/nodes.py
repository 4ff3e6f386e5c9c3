"""Node table: slots, attaching, heartbeats, liveness and reaping.

Every attached process owns one slot.  A slot's control word packs its state
with its epoch (layout.node_control); the epoch is bumped on every attach, so
a holder that was reaped and wakes up later finds a different epoch and knows
it is fenced.

Liveness is never judged by comparing wall clocks across hosts:
* a node on this host (same boot id) is dead as soon as its pid is gone or
  belongs to a process with another start time (pid reuse) - that is certain;
* any other node is dead when this observer, on its own monotonic clock, has
  not seen its control word or heartbeat change for a whole lease.

cas mode claims and fences slots with compare-and-swap on the control word;
in manager mode the lock manager grants, fences and frees slots (line 7).

Stalls.  A node judged dead by heartbeat may only be paused (a GC or
page-reclaim pause, SIGSTOP, a VM migration) and resume later with writes
in flight.  So a dead verdict *fences* the node (state FENCED: its lock turn
is passed on at once) but what it held - reserved entries and payload slots,
slabs, pins, its lock entry, its node slot - stays *quarantined*: nobody
reuses it until the node is proven gone (same host: its pid and start time
are gone), has acknowledged its fencing (ack_epoch == its epoch: it wrote
that only once none of its threads could write any more), or the pool's
grace period has passed on the reaper's clock.  Then the reaper runs the
recoveries, under the pool lock, after re-checking the slot's epoch, and
frees the slot.

The node side of the bargain (Attachment): before every phase that writes
shared memory a node re-reads its state word and proves its own heartbeat
fresh (`guard()`: its last successful beat is less than FRESH_SHARE of a
lease old, else it beats now); every write primitive of the C core checks
the mapping's write deadline and calls guard() once it has passed
(Mapping.set_guard) - a long write or zeroing between its 1 MiB pieces too -
and the C loops that copy blocks, insert entries, free slots (also between
the 256 KiB pieces a slot is zeroed in) or release slabs stop before each
one once it has passed - a reaper stalled in a recovery
writes nothing after its lock turn went to another reaper.  Remaining
window: a pause between the check and the store itself (nanoseconds in the
C loops, one Python statement for a guarded step).  A write landing there goes into memory that is still quarantined -
harmless - unless the pause outlasts the grace as well; the grace is a
generous multiple of the lease for that.
"""
from __future__ import annotations

import contextlib
import logging
import os
import random
import struct
import threading
import time
import uuid as uuidlib
import warnings
from dataclasses import dataclass, field
from typing import Callable

# NodeFenced is public here too (cxlkv.state.nodes, named in the README)
from cxlkv.errors import CxlkvError, NodeFenced, NodeTableFull, NoLockManager, RefusedError
from cxlkv.host import procs, sysfs
from cxlkv.pool import layout
from cxlkv.state import protocol
from cxlkv.version import __version__

_CONTROL = layout.field_offset(layout.NodeStruct, "control")
#: owner tokens are (slot + 1) | epoch << 16 in 64 bits
MAX_EPOCH = 1 << 48
_MGR_LINE = layout.field_offset(layout.NodeStruct, "mgr_control")
_HEARTBEAT = layout.field_offset(layout.NodeStruct, "heartbeat")
_ACK = layout.field_offset(layout.NodeStruct, "ack_epoch")
_CHALLENGE = layout.field_offset(layout.NodeStruct, "challenge")
_ANSWER = layout.field_offset(layout.NodeStruct, "answer")
#: a node writes only while its last heartbeat is younger than this share of the lease
FRESH_SHARE = 0.5
#: claim tokens (os.urandom; the secrets module would load OpenSSL at attach)
_RNG = random.SystemRandom()
log = logging.getLogger(__name__)


def __getattr__(name):
    # PoolFull: the old name of NodeTableFull (the node table is full, not the pool)
    if name == "PoolFull":
        warnings.warn("cxlkv.state.nodes.PoolFull is deprecated: use cxlkv.errors.NodeTableFull",
                      DeprecationWarning, stacklevel=2)
        return NodeTableFull
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class NodeInfo:
    slot: int
    state: str
    epoch: int
    heartbeat: int
    pid: int
    start_time_ns: int
    attach_time_ns: int
    format_version: int
    boot_id: str
    hostname: str
    sw_version: str
    control: int = 0
    pidns: int = 0
    ident_epoch: int = 0
    ack_epoch: int = 0

    def same_process_space(self, boot_id: str, pidns: int, *, fenced: bool = False) -> bool:
        """Can this node's pid be checked from an observer with these ids?  Only
        on the same boot, in the same pid namespace, and when the identity was
        written for the slot's current epoch (not a stale or half-written one)
        - of an attached node, or with fenced=True also of a fenced one."""
        states = ("attached", "fenced") if fenced else ("attached",)
        return (self.boot_id == boot_id and self.pidns == pidns and self.pid > 0
                and self.ident_epoch == self.epoch and self.state in states)

    @property
    def acknowledged(self) -> bool:
        """A fenced node that wrote it has stopped writing (see Attachment)."""
        return self.state == "fenced" and self.ack_epoch == self.epoch

    def to_json(self) -> dict:
        return {"slot": self.slot, "state": self.state, "epoch": self.epoch,
                "heartbeat": self.heartbeat, "pid": self.pid, "hostname": self.hostname,
                "boot_id": self.boot_id, "sw_version": self.sw_version,
                "format_version": self.format_version, "attach_time_ns": self.attach_time_ns,
                "acknowledged": self.acknowledged}

    def describe(self) -> str:
        """"node 3 (host-a pid 812)"; a slot whose identity was never written
        (claimed, abandoned): "node 3 (identity not written)"."""
        if not self.hostname and not self.pid:
            return f"node {self.slot} (identity not written)"
        return f"node {self.slot} ({self.hostname or 'unknown host'} pid {self.pid})"


def local_pidns() -> int:
    """Inode of this process's pid namespace (0 when it cannot be read)."""
    try:
        return os.stat(sysfs.proc_path("self", "ns", "pid")).st_ino
    except OSError:
        return 0


def local_boot_id() -> str:
    text = sysfs.read_attr(sysfs.proc_path("sys", "kernel", "random", "boot_id"))
    try:
        return str(uuidlib.UUID(text)) if text else _fallback_boot_id()
    except ValueError:
        return _fallback_boot_id()


def _fallback_boot_id() -> str:
    return str(uuidlib.uuid5(uuidlib.NAMESPACE_DNS,
                             f"{os.uname().nodename}-{procs.boot_time()}"))


def node_offset(pool, slot: int) -> int:
    off, _ = pool.sb.regions["nodes"]
    return off + slot * layout.NODE_SIZE


def _decode_str(b: bytes) -> str:
    return b.decode("utf-8", "replace")


def read_slot(pool, slot: int) -> NodeInfo:
    off = node_offset(pool, slot)
    m = pool.mapping
    m.invalidate(off, layout.NODE_SIZE)
    return _decode_slot(pool, slot, m.read(off, layout.NODE_SIZE))


def _decode_slot(pool, slot: int, raw, base: int = 0) -> NodeInfo:
    s = layout.NodeStruct.from_buffer_copy(raw, base)
    # manager mode: the lock manager's word (line 7) is the slot's state
    control = s.mgr_control if pool.sb.sync == "manager" else s.control
    state, epoch = layout.node_state(control)
    return NodeInfo(
        slot=slot, state=layout.NODE_STATE_NAMES.get(state, f"unknown({state})"), epoch=epoch,
        heartbeat=s.heartbeat, pid=s.pid, start_time_ns=s.start_time_ns,
        attach_time_ns=s.attach_time_ns, format_version=s.format_version,
        boot_id=str(uuidlib.UUID(bytes=bytes(s.boot_id))), hostname=_decode_str(s.hostname),
        sw_version=_decode_str(s.sw_version), control=control, pidns=s.pidns,
        ident_epoch=s.ident_epoch, ack_epoch=s.ack_epoch)


def read_nodes(pool, include_free: bool = False) -> list[NodeInfo]:
    """Every slot of the node table (one read of the region), or the slots
    that are not free.  Free slots are skipped before they are decoded: an
    attach scans the table, and it must cost what the live nodes cost."""
    off, _ = pool.sb.regions["nodes"]
    n, size, m = pool.sb.max_nodes, layout.NODE_SIZE, pool.mapping
    m.invalidate(off, n * size)
    raw = m.read(off, n * size)
    word = _MGR_LINE if pool.sb.sync == "manager" else _CONTROL
    return [_decode_slot(pool, i, raw, i * size) for i in range(n)
            if include_free or layout.node_state(int.from_bytes(
                raw[i * size + word:i * size + word + 8], "little"))[0] != layout.NODE_FREE]


def process_start_ns(pid: int) -> int | None:
    """Start time of a running local process in ns (as psutil's create_time);
    None if it does not exist or is a zombie (dead, not yet waited for); -1
    if we may not look."""
    return procs.start_time_ns(pid)


def local_process_alive(pid: int, start_time_ns: int) -> bool:
    if pid <= 0:
        return False
    start = process_start_ns(pid)
    if start == -1:
        return True                     # cannot tell: the cautious answer
    # the start time is boot time + clock ticks (as psutil computes it): equal for the
    # same process, different after pid reuse; allow rounding of 1 ms.
    return start is not None and abs(start - start_time_ns) < 1_000_000


def my_identity() -> tuple[int, int]:
    pid = os.getpid()
    return pid, process_start_ns(pid) or 0


# -- liveness ------------------------------------------------------------------

@dataclass
class _Seen:
    control: int
    heartbeat: int
    since: float          # observer's monotonic clock when they last changed


@dataclass
class Observer:
    """Judges other nodes' liveness from what this process has seen change.

    One per observing process; `verdicts()` is cheap and may be called often.
    """

    pool: object
    clock: Callable[[], float] = time.monotonic
    boot_id: str = field(default_factory=local_boot_id)
    pidns: int = field(default_factory=local_pidns)
    _seen: dict[int, _Seen] = field(default_factory=dict)
    _fenced: dict[int, tuple[int, float]] = field(default_factory=dict)

    def verdict(self, n: NodeInfo, now: float | None = None) -> str:
        """'alive', 'dead' or 'unknown' (remote, not yet watched for a lease)."""
        now = self.clock() if now is None else now
        if n.state == "free":
            self._seen.pop(n.slot, None)
            return "dead"
        if n.state == "fenced":
            return "dead"
        if n.same_process_space(self.boot_id, self.pidns):
            return "alive" if local_process_alive(n.pid, n.start_time_ns) else "dead"
        seen = self._seen.get(n.slot)
        if seen is None or seen.control != n.control or seen.heartbeat != n.heartbeat:
            self._seen[n.slot] = _Seen(n.control, n.heartbeat, now)
            return "alive" if seen is not None else "unknown"
        lease = self.pool.sb.lease_ms / 1000.0
        return "dead" if now - seen.since >= lease else "unknown"

    def scan(self) -> list[tuple[NodeInfo, str]]:
        now = self.clock()
        return [(n, self.verdict(n, now)) for n in read_nodes(self.pool)]

    def release_reason(self, n: NodeInfo, now: float | None = None) -> str | None:
        """May what a fenced node held be reused?  'gone' (its process is
        certainly gone from this host), 'acknowledged' (it wrote that it
        stopped writing), 'grace' (this observer has seen it fenced for the
        pool's grace period), or None: it stays quarantined."""
        now = self.clock() if now is None else now
        if n.state != "fenced":
            self._fenced.pop(n.slot, None)
            return None
        if n.same_process_space(self.boot_id, self.pidns, fenced=True) and \
                not local_process_alive(n.pid, n.start_time_ns):
            return "gone"
        if n.acknowledged:
            return "acknowledged"
        seen = self._fenced.get(n.slot)
        if seen is None or seen[0] != n.control:
            self._fenced[n.slot] = (n.control, now)
            return None
        grace = self.pool.sb.quarantine_grace_ms / 1000.0
        return "grace" if now - seen[1] >= grace else None

    def saw(self, slot: int, control: int, heartbeat: int, since: float) -> None:
        """Another watcher (the lock manager's C loop) saw `slot` with this
        control word and heartbeat, unchanged since `since` (this observer's
        clock): judge it from that, unless this observer already saw the same
        words earlier."""
        prev = self._seen.get(slot)
        if prev is None or (prev.control, prev.heartbeat) != (control, heartbeat) or \
                prev.since > since:
            self._seen[slot] = _Seen(control, heartbeat, since)

    def quarantined_for(self, n: NodeInfo, now: float | None = None) -> float | None:
        """Seconds this observer has seen `n` fenced (None if it has not)."""
        seen = self._fenced.get(n.slot)
        if seen is None or seen[0] != n.control:
            return None
        return (self.clock() if now is None else now) - seen[1]


def live_nodes(pool, *, observe: bool = True, clock=time.monotonic,
               sleep=time.sleep, notice=None) -> list[NodeInfo]:
    """Nodes that are (or may be) alive.

    Local nodes are decided at once.  Remote nodes are watched for up to one
    lease (notice(count, seconds) is called first, so a CLI can say why it
    waits); with observe=False they count as alive (the cautious answer).
    """
    obs = Observer(pool, clock=clock)
    verdicts = obs.scan()
    alive = [n for n, v in verdicts if v == "alive"]
    pending = {n.slot for n, v in verdicts if v == "unknown"}
    if pending and not observe:
        alive += [n for n, v in verdicts if v == "unknown"]
        pending = set()
    if pending and notice is not None:
        notice(len(pending), pool.sb.lease_ms / 1000.0)
    deadline = clock() + pool.sb.lease_ms / 1000.0 + 0.05
    while pending and clock() < deadline:
        sleep(min(0.05, pool.sb.lease_ms / 20000.0))
        for slot in list(pending):
            n = read_slot(pool, slot)
            v = obs.verdict(n)
            if v != "unknown":
                pending.discard(slot)
                if v == "alive":
                    alive.append(n)
    return sorted(alive, key=lambda n: n.slot)


# -- attaching --------------------------------------------------------------------

Recovery = Callable[[object, int, int], None]   # (pool, slot, epoch) -> None
_recoveries: list[Recovery] = []
_order: dict[Recovery, int] = {}
_at_fence: set[Recovery] = set()
#: the parts of a dead node's recovery registered so far, by name
_parts: set[str] = set()
#: held_lock(pool, slot): the pool lock, for this process's own node's or on
#: behalf of `slot` (state.locks provides it when imported)
_held_lock: Callable | None = None


def _missing_parts(pool) -> set[str]:
    """The parts a recovery of this pool needs that nobody registered: the
    lock and the allocator always, the KV cache on a pool that has one.
    cxlkv.api imports every one of them, so a Pool always has them all."""
    need = {"locks", "alloc"} | ({"kv"} if pool.sb.compat & layout.COMPAT_KV else set())
    return need - _parts


def _require_parts(pool, slot: int) -> None:
    missing = _missing_parts(pool)
    if missing:
        raise CxlkvError(f"{pool.path}: the recovery of node {slot} needs the "
                         f"{', '.join(sorted(missing))} part(s), which this process did not "
                         "load (a bug: open pools through cxlkv.api)", path=pool.path)


def run_recoveries(pool, slot: int, epoch: int, *, fence_only: bool = False) -> None:
    """Everything subsystems registered, for one dead (or detaching) node;
    fence_only: just what must happen the moment it is fenced.  Refuses
    (CxlkvError) to run a partial recovery: one that skipped a part would
    leave that part's state of the dead node behind for good."""
    _require_parts(pool, slot)
    for fn in list(_recoveries):
        if not fence_only or fn in _at_fence:
            fn(pool, slot, epoch)


def register_held_lock(fn: Callable) -> None:
    """state.locks hands over held_lock (see _held_lock) when it is imported."""
    global _held_lock
    _held_lock = fn


def register_recovery(fn: Recovery | None = None, *, order: int = 50, at_fence: bool = False,
                      part: str | None = None):
    """Subsystems (locks, allocator, KV pins) register what to undo for a dead node.

    Each is called with the pool, the dead slot and its epoch, while the slot
    is FENCED, once the quarantine is over (see the module docstring); with
    at_fence=True also the moment the node is fenced (passing its lock turn
    on: the only thing that cannot wait).  It must be idempotent (a reaper
    may die half way and another one repeat the work).  Lower `order` runs
    first (the lock first - a dead holder's turn is passed on - then the KV
    cache, then the allocator, which takes the lock).  `part` names a part
    every recovery needs ("locks", "alloc", "kv"; see _missing_parts).
    Usable as a decorator.
    """
    def add(f: Recovery) -> Recovery:
        if part is not None:
            _parts.add(part)
        if f not in _recoveries:
            _order[f] = order
            _recoveries.append(f)
            _recoveries.sort(key=lambda g: _order.get(g, 50))
        if at_fence:
            _at_fence.add(f)
        return f

    return add(fn) if fn is not None else add


def fence(pool, slot: int, control: int, heartbeat: int | None = None) -> bool:
    """Fence a node judged dead (cas mode): ATTACHED or CLAIMED -> FENCED, and
    pass its lock turn on.  Nothing else it held is touched: that waits for
    release().  `control` is the word that was judged; nothing happens if
    the slot changed since.  `heartbeat`: the counter the verdict was made
    on - if it moved by the time the fence lands, the verdict was stale (the
    reaper was slow, the node had resumed and beaten), and the fence is taken
    back before anyone acts on it.  True when this call fenced it."""
    state, epoch = layout.node_state(control)
    if state not in (layout.NODE_ATTACHED, layout.NODE_CLAIMED):
        return False
    m = pool.mapping
    off = node_offset(pool, slot)
    fenced = layout.node_control(layout.NODE_FENCED, epoch)
    if m.cas64(off + _CONTROL, control, fenced) != control:
        return False
    if heartbeat is not None:
        m.invalidate(off + _HEARTBEAT, 8)
        if m.load64(off + _HEARTBEAT) != heartbeat:
            m.cas64(off + _CONTROL, fenced, control)    # alive after all
            return False
    run_recoveries(pool, slot, epoch, fence_only=True)
    return True


def fenced_holders(pool, but: int = -1) -> list[NodeInfo]:
    """Fenced nodes, other than slot `but`, that were fenced while they held
    the pool lock (protocol.mark_held_when_fenced).  The lock went on to the
    next node at once, but such a node may have been stopped in the middle of
    one C call of lock work - zeroing the chunks of a slab it was releasing,
    a slot it was freeing - past that call's last freshness check: resumed,
    it finishes that piece.  Another recovery would finish the same work and
    hand the memory out first; so while one of these is fenced (quarantined)
    recoveries recover only their own node's things (state.alloc)."""
    ents = protocol.read_entries(pool)
    return [n for n in read_nodes(pool) if n.slot != but and n.state == "fenced" and
            int(ents["held_when_fenced"][n.slot]) == (n.slot + 1) | n.epoch << 16]


def recovered_by_fenced(pool, slot: int, epoch: int) -> list[NodeInfo]:
    """Fenced nodes that were recovering node (slot, epoch) when they were
    fenced (protocol.mark_recovering): stopped past a C call's last check,
    one may still zero that node's slots or chunks when it resumes, so the
    node is not recovered again - and its memory not handed out - until
    their quarantine ends."""
    token = (slot + 1) | epoch << 16
    ents = protocol.read_entries(pool)
    return [n for n in read_nodes(pool) if n.slot != slot and n.state == "fenced" and
            int(ents["recovering"][n.slot]) == token]


def release(pool, slot: int, control: int) -> bool:
    """End a fenced node's quarantine (cas mode): under the pool lock (this
    process's own node's, when it has a usable one), re-check that the slot
    still holds `control` (FENCED, same epoch), run every recovery, free the
    slot.  The caller decided the quarantine may end (Observer.release_reason).
    Nothing happens while a node fenced in the middle of recovering this one
    is quarantined (recovered_by_fenced).  True when this call freed the
    slot."""
    state, epoch = layout.node_state(control)
    if state != layout.NODE_FENCED:
        return False
    off = node_offset(pool, slot) + _CONTROL
    m = pool.mapping
    _require_parts(pool, slot)
    with _held_lock(pool, slot):
        m.invalidate(off, 8)
        if m.load64(off) != control:
            return False                # another reaper finished it, or it changed
        if recovered_by_fenced(pool, slot, epoch):
            return False                # one may still be zeroing its memory: it goes first
        me = pool.node
        mine = me is not None and me.slot >= 0
        if mine:
            protocol.mark_recovering(pool, me.slot, (slot + 1) | epoch << 16)
        try:
            run_recoveries(pool, slot, epoch)
            return m.cas64(off, control, layout.node_control(layout.NODE_FREE, epoch)) == control
        finally:
            if mine:
                with contextlib.suppress(NodeFenced):   # fenced: the mark stays, and counts
                    protocol.mark_recovering(pool, me.slot, 0)


def reap(pool, slot: int, control: int) -> bool:
    """Fence a dead node and end its quarantine at once: for callers that know
    it is gone, or a repair the operator ordered (fsck --repair).  Returns
    True when this call freed the slot."""
    state, epoch = layout.node_state(control)
    if state in (layout.NODE_ATTACHED, layout.NODE_CLAIMED):
        if not fence(pool, slot, control):
            return False
        control = layout.node_control(layout.NODE_FENCED, epoch)
    elif state != layout.NODE_FENCED:
        return False
    return release(pool, slot, control)


class Attachment:
    """This process's slot in the node table, and its heartbeat thread."""

    def __init__(self, pool, *, heartbeat: bool = True, interval: float | None = None):
        if pool.read_only:
            raise RefusedError(f"{pool.path}: cannot attach to a pool opened read-only",
                               path=pool.path)
        if pool.sb.sync == "cas" and pool.mapping.noncoherent:
            raise RefusedError(
                f"{pool.path}: sync mode cas needs coherent memory, but this process sees the "
                "pool as non-coherent (CXLKV_NONCOHERENT=1); use a pool formatted with "
                "--sync manager", path=pool.path)
        self.pool = pool
        self.observer = Observer(pool)
        self._thread: threading.Thread | None = None
        self._reaper: threading.Thread | None = None
        self._pending: list[tuple[int, int]] = []
        self.reap_error = ""
        self.slot = -1
        self.epoch = 0
        self.fenced = False
        self.acknowledged = False
        self._stop = threading.Event()
        lease = pool.sb.lease_ms / 1000.0
        self.interval = interval if interval is not None else max(0.02, lease / 4)
        # freshness: writes need a beat younger than FRESH_SHARE of the lease
        self._fresh_ns = int(lease * FRESH_SHARE * 1e9)
        self._deadline_ns = 0               # monotonic ns; 0 until the slot is ours
        # guard()'s fast path: (offset, value) of the state word that shows this
        # node attached (set by start(), dropped at detach; None: always the
        # full check).  A fenced node's deadline is 0: never fresh there either
        self._guard_word: tuple[int, int] | None = None
        # beats come from two threads (guard(), heartbeat) and nest (a write in beat()
        # past the deadline calls guard() again from the C core): reentrant
        self._beat_lock = threading.RLock()
        # guards fenced / acknowledged; the sections in flight that the fencing
        # acknowledgement waits for are counted in the C core (enter / leave)
        self._state = threading.Lock()
        self._heartbeat = heartbeat
        self._answered = 0                  # the last challenge echoed (see _answer)
        self.managed = pool.sb.sync == "manager"
        if self.managed:
            self._claim_managed()
        else:
            self._claim()

    def start(self) -> None:
        """Recover what dead local nodes left, then start heartbeating.

        Called by Pool.attach once pool.node is set (recovery may take the
        pool lock, which needs this node).
        """
        for slot, epoch in self._pending:       # the dead node whose slot we took
            run_recoveries(self.pool, slot, epoch)
        self._pending.clear()
        self._fresh(time.monotonic_ns())
        self._guard_word = (node_offset(self.pool, self.slot) +
                            (_MGR_LINE if self.managed else _CONTROL), self.control)
        # every write through the mapping proves this node fresh first, once
        # the deadline passed (check_writable in the C core calls guard)
        self.pool.mapping.set_guard(self.guard)
        if not self.managed:                    # in manager mode the manager reaps
            self._reap_dead(local_only=True)
        if self._heartbeat and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="cxlkv-heartbeat",
                                            daemon=True)
            self._thread.start()
            if not self.managed:
                self._reaper = threading.Thread(target=self._reap_loop, name="cxlkv-reaper",
                                                daemon=True)
                self._reaper.start()

    def stop_heartbeats(self) -> None:
        """Stop beating and reaping (at the threads' next wake-up) without
        leaving the table: a detach given up on leaves the slot for others to
        reap."""
        self._stop.set()

    def stopped_threads(self) -> list[str]:
        """The threads start() began that have ended: "heartbeat", "reaper"."""
        return [name for name, t in (("heartbeat", self._thread), ("reaper", self._reaper))
                if t is not None and not t.is_alive()]

    # -- manager mode: slots are granted by the lock manager --------------------
    def _claim_managed(self) -> None:
        pool, m = self.pool, self.pool.mapping
        token = _RNG.getrandbits(62) | 1
        lines = protocol.read_node_lines(pool)
        free = [s for s in range(pool.sb.max_nodes)
                if protocol.mgr_state(lines[s])[0] == layout.NODE_FREE]
        random.shuffle(free)
        deadline = time.monotonic() + pool.sb.lease_ms / 1000.0 + 2.0
        for slot in free:
            off = protocol.node(pool, slot)
            m.store64(off + protocol.N_CLAIM, token)
            m.flush(off + protocol.N_CLAIM, 8)
            while True:
                m.invalidate(off + protocol.N_MGR_CONTROL, 16)
                state, epoch = layout.node_state(m.load64(off + protocol.N_MGR_CONTROL))
                granted = m.load64(off + protocol.N_MGR_GRANT)
                if state == layout.NODE_CLAIMED and granted == token:
                    if epoch >= MAX_EPOCH:
                        break
                    self._write_identity(off, epoch)
                    m.store64(off + protocol.N_CONTROL,
                              layout.node_control(layout.NODE_ATTACHED, epoch))
                    m.flush(off, 64)
                    self.slot, self.epoch = slot, epoch
                    return
                if state != layout.NODE_FREE:
                    break                       # granted to another claimant
                if time.monotonic() > deadline:
                    raise NoLockManager(
                        f"{pool.path}: no lock manager answered (sync mode manager): start "
                        f"one with `cxlkv lock-manager --pool {pool.path}` on any host",
                        hint="systemd: cxlkv-lock-manager@.service with --standby on every host")
                time.sleep(0.0005)
        raise NodeTableFull(f"{pool.path}: no free node slot was granted ({len(free)} looked free)",
                       path=pool.path)

    # -- slot claim -------------------------------------------------------
    def _claim(self) -> None:
        m, n = self.pool.mapping, self.pool.sb.max_nodes
        start = random.randrange(n)
        for attempt in range(2):
            # first pass: free slots; second (full table): slots of attached nodes
            # that are certainly dead (their pid is gone) - their recovery runs
            # in start(), under the pool lock, once we are attached.  Never a
            # fenced slot: its quarantine is a reaper's to end (release()),
            # which may be recovering it right now.
            dead = {} if attempt == 0 else {
                nd.slot: nd for nd, v in self.observer.scan()
                if v == "dead" and nd.state in ("attached", "claimed")
                and nd.same_process_space(self.observer.boot_id, self.observer.pidns)}
            for i in range(n):
                slot = (start + i) % n
                off = node_offset(self.pool, slot)
                m.invalidate(off, 64)
                cur = m.load64(off + _CONTROL)
                state, epoch = layout.node_state(cur)
                if state != layout.NODE_FREE and (slot not in dead or dead[slot].control != cur):
                    continue
                new_epoch = epoch + 1
                if new_epoch >= MAX_EPOCH:
                    continue                # owner tokens hold 48 epoch bits: slot worn out
                claimed = layout.node_control(layout.NODE_CLAIMED, new_epoch)
                if m.cas64(off + _CONTROL, cur, claimed) != cur:
                    continue
                self._write_identity(off, new_epoch)
                attached = layout.node_control(layout.NODE_ATTACHED, new_epoch)
                if m.cas64(off + _CONTROL, claimed, attached) != claimed:
                    continue      # reaped while claiming (took longer than a lease)
                self.slot, self.epoch = slot, new_epoch
                if state != layout.NODE_FREE:
                    self._pending.append((slot, epoch))
                return
        fenced = sum(1 for nd in read_nodes(self.pool) if nd.state == "fenced")
        raise NodeTableFull(f"{self.pool.path}: all {n} node slots are in use"
                       + (f" ({fenced} by fenced nodes in quarantine, freed by a reaper - "
                          "cxlkv serve - once each is gone, acknowledges or its grace passes)"
                          if fenced else " by live nodes"), path=self.pool.path,
                       hint="detach idle processes, or reformat with a larger --max-nodes")

    def _write_identity(self, off: int, epoch: int) -> None:
        """Lines 1-6 (node-owned identity); line 7 belongs to the lock manager."""
        s = layout.NodeStruct()
        pid, start = my_identity()
        s.pidns, s.ident_epoch = self.observer.pidns, epoch
        s.pid, s.start_time_ns, s.attach_time_ns = pid, start, time.time_ns()
        s.format_version = layout.FORMAT_VERSION
        s.boot_id[:] = uuidlib.UUID(self.observer.boot_id).bytes
        s.hostname = os.uname().nodename.encode()[:63]
        s.sw_version = f"cxlkv {__version__}".encode()[:31]
        ident = bytes(s)
        m = self.pool.mapping
        # lines 1-3, and 5-6 (answers start empty); line 4 is the probers' (a
        # challenge written meanwhile is answered only if meant for this epoch)
        m.write(off + 64, ident[64:_CHALLENGE])
        m.write(off + _ANSWER, ident[_ANSWER:_MGR_LINE])
        m.store64(off + _HEARTBEAT, 0)
        m.flush(off, layout.NODE_SIZE)

    def check(self) -> None:
        """Raise NodeFenced if this node was fenced (reads its state word now)."""
        if self.fenced or self.slot < 0:
            raise NodeFenced(f"{self.pool.path}: node {self.slot} is no longer attached "
                             "(its lease lapsed and it was fenced); reattach")
        m = self.pool.mapping
        if self.managed:                        # the manager's word is the authority
            off = node_offset(self.pool, self.slot) + _MGR_LINE
            m.invalidate(off, 8)
            ok = m.load64(off) in (layout.node_control(layout.NODE_CLAIMED, self.epoch),
                                   layout.node_control(layout.NODE_ATTACHED, self.epoch))
        else:
            off = node_offset(self.pool, self.slot) + _CONTROL
            m.invalidate(off, 8)
            ok = m.load64(off) == self.control
        if not ok:
            self._on_fenced()
            self.check()

    def beat(self) -> None:
        """One heartbeat: advance the counter, check we are still ourselves.
        A successful beat makes this node fresh for FRESH_SHARE of a lease."""
        t0 = time.monotonic_ns()
        self.check()            # a fenced node's slot may be another's: never bump it
        off = node_offset(self.pool, self.slot)
        m = self.pool.mapping
        with self._beat_lock:
            if self.managed:                    # no cross-host atomics: we are its only writer
                m.store64(off + _HEARTBEAT, m.load64(off + _HEARTBEAT) + 1)
            else:
                m.fetch_add64(off + _HEARTBEAT, 1)
            m.flush(off, 64)
        self.check()
        self._fresh(t0)

    def _answer(self) -> None:
        """Echo a prober's challenge meant for this incarnation (line 4) into
        this node's answer line (line 5), once: the proof, for a prober on
        another host, that its writes reach this node and this node's writes
        reach it (cxlkv.state.visibility).  The heartbeat thread's, after a
        successful beat (the node is fresh)."""
        m, off = self.pool.mapping, node_offset(self.pool, self.slot)
        m.invalidate(off + _CHALLENGE, 16)
        nonce = m.load64(off + _CHALLENGE)
        if not nonce or nonce == self._answered or m.load64(off + _CHALLENGE + 8) != self.epoch:
            return
        with self._beat_lock:
            m.write(off + _ANSWER, struct.pack("<QQQ", nonce, self.epoch,
                                               m.load64(off + _HEARTBEAT)))
            m.flush(off + _ANSWER, 64)
        self._answered = nonce

    def guard(self) -> None:
        """Prove this node may write shared memory now, or raise NodeFenced.

        Call before each phase that writes the pool.  It re-reads the node's
        state word (a reaper that judged us on a read from before our last
        beat may fence us any time), and when the last successful beat is
        older than FRESH_SHARE of the lease (the heartbeat thread was stalled
        with us, or starved) it beats first, so the C copies, which check
        only the clock, may go on.

        The common case - fresh, and the state word unchanged - is one C call
        (Mapping.node_fresh: our deadline, then the word); anything else
        takes the full path below."""
        gw = self._guard_word
        if gw is not None and self.pool.mapping.node_fresh(gw[0], gw[1], self._deadline_ns):
            return
        # within a fiftieth of the freshness of the deadline, beat: the C
        # core's TSC check may end a deadline up to 1 % of it early
        # (cxlkv/_core/deadline_clock.py), and a copy it stops must find a
        # new deadline, not the same one again
        if (self.fenced or self.slot < 0
                or time.monotonic_ns() > self._deadline_ns - self._fresh_ns // 50):
            self.beat()
        else:
            self.check()

    def write_blocks(self, offsets, src, block_bytes: int) -> None:
        """Block i of `src` into pool offset offsets[i], each block only while
        this node is known fresh: the C copy stops before a block once the
        freshness ran out (a stall); guard() then proves it fresh again - or
        raises NodeFenced, leaving the rest unwritten - and the copy goes on."""
        m, done, n = self.pool.mapping, 0, len(offsets)
        while done < n:
            self.guard()
            done += m.write_blocks(offsets[done:], src[done * block_bytes:n * block_bytes],
                                   block_bytes)

    def scatter_blocks(self, offsets, block_bytes: int, src_offset: int, buf, buf_offsets,
                       shape, src_strides, buf_strides, run: int) -> None:
        """A strided walk of `buf` into the pool slots at `offsets` (one per
        block: Mapping.kv_scatter, an engine's tensor written in place), each
        block only while this node is known fresh, as write_blocks."""
        m, done, n = self.pool.mapping, 0, len(offsets)
        while done < n:
            self.guard()
            done += m.kv_scatter(offsets[done:], block_bytes, src_offset, buf,
                                 buf_offsets[done:], shape, src_strides, buf_strides, run)

    def _fresh(self, t0_ns: int) -> None:
        with self._state:
            if self.fenced:
                return
            self._deadline_ns = max(self._deadline_ns, t0_ns + self._fresh_ns)
            self.pool.mapping.write_deadline_ns = self._deadline_ns

    # -- sections in flight, and the acknowledgement of fencing ---------------------
    def enter(self) -> None:
        """A section that writes shared memory (or holds views of it) begins:
        NodeFenced if this node is known fenced.  Pair with leave().  The count
        lives in the C core (Mapping.section_begin): one call, no lock."""
        if not self.pool.mapping.section_begin():
            raise NodeFenced(f"{self.pool.path}: node {self.slot} was fenced (its lease "
                             "lapsed); reattach")

    def leave(self) -> None:
        self.pool.mapping.section_end()
        if self.fenced:
            self.acknowledge_if_idle()

    def _in_flight(self) -> bool:
        """Sections begun and not ended, C calls running with the GIL released,
        or the pool lock held by a thread of this process (the lock keeps its
        holder itself, so its hot path pays no bookkeeping here)."""
        lk = self.pool.existing_lock
        return self.pool.mapping.in_flight > 0 or (lk is not None and lk.held_here())

    def acknowledge_if_idle(self) -> bool:
        """Acknowledge the fencing once nothing is in flight (called when a
        section ends or the pool lock is left); True when acknowledged."""
        with self._state:
            if not self.fenced or self.acknowledged or self._in_flight():
                return self.acknowledged
        self._acknowledge()
        return True


    def _on_fenced(self) -> None:
        """This process learnt that its node was fenced: no section starts any
        more and copies stop at their next block (the write deadline becomes
        the fenced sentinel, 1); once nothing is in flight the fencing is
        acknowledged (here, when the last section ends, or by the heartbeat
        thread), ending the quarantine early."""
        with self._state:
            if self.fenced:
                return
            self.fenced = True
            self._deadline_ns = 0
            self.pool.mapping.write_deadline_ns = 1     # before reading what is in flight
        self.acknowledge_if_idle()

    def _acknowledge(self) -> None:
        """Write ack_epoch (our own line 0) - only while the slot still shows
        this node fenced: once its quarantine ended the slot may be another
        node's."""
        with self._state:
            if self.acknowledged or self.slot < 0:
                return
            self.acknowledged = True
        m = self.pool.mapping
        off = node_offset(self.pool, self.slot)
        word = off + (_MGR_LINE if self.managed else _CONTROL)
        try:
            m.set_guard(None)               # the one write a fenced node makes ...
            m.invalidate(word, 8)
            if m.load64(word) == layout.node_control(layout.NODE_FENCED, self.epoch):
                m.store64(off + _ACK, self.epoch)
                m.flush(off, 64)
        except (ValueError, OSError):       # the mapping was closed under us
            pass
        finally:
            m.set_guard(self._refuse)       # ... and nothing after it

    def _refuse(self) -> None:
        raise NodeFenced(f"{self.pool.path}: node {self.slot} acknowledged its fencing: "
                         "it writes nothing more; reattach")

    # -- run time -----------------------------------------------------------
    @property
    def control(self) -> int:
        return layout.node_control(layout.NODE_ATTACHED, self.epoch)

    @property
    def owner_token(self) -> int:
        """(slot + 1) | epoch << 16: how locks and allocations name this node."""
        return (self.slot + 1) | self.epoch << 16

    def _reap_dead(self, local_only: bool = False) -> int:
        """Fence the nodes judged dead; end the quarantine of fenced nodes
        whose release_reason says so.  local_only: only nodes of this host
        (and already fenced ones).  Returns the slots freed."""
        freed = 0
        for n, verdict in self.observer.scan():
            if n.slot == self.slot or verdict != "dead" or n.state == "free":
                continue
            if local_only and n.state != "fenced" and not n.same_process_space(
                    self.observer.boot_id, self.observer.pidns):
                continue
            if n.state in ("attached", "claimed"):
                if not fence(self.pool, n.slot, n.control, n.heartbeat):
                    continue
                n = read_slot(self.pool, n.slot)
            reason = self.observer.release_reason(n)
            if reason is not None and release(self.pool, n.slot, n.control):
                freed += 1
        return freed

    def _run(self) -> None:
        """Heartbeat thread: only beats, so nothing (a recovery waiting for the
        pool lock, a slow scan) can stall it past our lease."""
        while not self._stop.wait(self.interval):
            try:
                if self.fenced:
                    if self.acknowledge_if_idle():
                        return              # until then, again every interval
                else:
                    self.beat()
                    self._answer()
            except NodeFenced:
                continue                    # acknowledged above once nothing is in flight
            except (ValueError, OSError):   # mapping closed under us
                return

    def _reap_loop(self) -> None:
        """Reaper thread: judges the other nodes and recovers the dead ones.

        It ends only when told to (detach sets the stop flag before the
        mapping is closed) or when this node is fenced; a failed round - a
        recovery tripping over damage, an I/O error - is logged (once per
        distinct error, in reap_error) and the next round tries again."""
        while not self._stop.wait(self.interval):
            if self.fenced:
                return
            try:
                self._reap_dead()
            except Exception as e:          # noqa: BLE001 - keep reaping; say why once
                if self._stop.is_set():
                    return                  # the mapping is being closed under us
                msg = f"{type(e).__name__}: {e}"
                if msg != self.reap_error:
                    self.reap_error = msg
                    log.warning("reaping in %s failed: %s", self.pool.path, msg)
            else:
                self.reap_error = ""

    def detach(self) -> None:
        """Leave the node table: recover what this node holds (under its pool
        lock, each step guarded) and free the slot.  A node found fenced
        recovers nothing - its quarantine is the reaper's - and only
        acknowledges the fencing."""
        lock = self.pool.existing_lock
        if lock is not None and lock.held_by_me():
            raise CxlkvError(f"{self.pool.path}: close the pool after leaving pool.lock(), "
                             "not inside it (detaching takes the lock)")
        self._stop.set()
        for t in (self._thread, self._reaper):
            if t is not None and t is not threading.current_thread():
                t.join()
        if self.slot < 0:
            return
        off = node_offset(self.pool, self.slot) + _CONTROL
        try:
            self.guard()
            # run our own recovery first: nothing of ours must outlive the slot
            run_recoveries(self.pool, self.slot, self.epoch)
        except NodeFenced:
            self.acknowledge_if_idle()
            self.slot, self._guard_word = -1, None
            return
        except CxlkvError as e:
            if not self.managed:
                raise
            # no lock manager to take the lock from: stay in the table,
            # silent; the next manager reaps this slot and recovers it
            log.warning("detaching from %s without a lock manager (%s); node %d will be "
                        "recovered by the next one", self.pool.path, e, self.slot)
            self.slot, self._guard_word = -1, None
            return
        free = layout.node_control(layout.NODE_FREE, self.epoch)
        try:
            if self.managed:                # ask the manager to free the slot
                self.pool.mapping.store64(off, free)
                self.pool.mapping.flush(off, 8)
            else:
                self.pool.mapping.cas64(off, self.control, free)
        except NodeFenced:
            pass                            # fenced meanwhile: the reaper's now
        self.slot, self._guard_word = -1, None
        self.pool.mapping.set_guard(None)
        self.pool.mapping.write_deadline_ns = 0
