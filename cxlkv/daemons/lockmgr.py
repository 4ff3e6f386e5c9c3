"""`cxlkv lock-manager`: the arbiter of sync mode `manager` (TraCT's global lock).

For non-coherent multi-host CXL memory, where hosts have no cross-host
atomics, every shared word has exactly one writer and every cross-host
exchange is a plain store + flush answered by invalidate + load:

* the manager lease (lock header): written by the one active manager;
* node slots: line 0 (claim token, heartbeat, the node's acknowledgement) by
  the node, line 7 (the slot's authoritative state and epoch, the granted
  claim) by the manager;
* lock entries: line 0 (request and release sequence numbers) by the node,
  line 1 (grant and revoke sequence numbers) by the manager.

The manager grants slots to claimants, grants the pool lock round-robin
among waiting nodes, judges node liveness (heartbeats on its own clock, pids
on its own host), revokes a dead holder's lock and runs the dead node's
recovery while it grants nothing, then frees the slot.

Exactly one manager is active per pool: a contender writes its token into
the lease, waits long enough for any other contender's write to land, and
reads it back (Fischer's algorithm); the active manager re-reads the lease
every round and steps down when it finds another token.  A second manager
refuses to start unless --standby, which waits for the active one's
heartbeat to stop for a lease and then takes over.  All state lives in the
pool, so a restarted manager carries on where the last one stopped.

The loop's hot part is C (Mapping.mgr_loop, cxlkv/_core/src/lockmgr.c):
the lock rounds (a release seen, the next waiter granted round-robin), the
heartbeat while the superblock bytes are the ones last validated here, and a
look at the node slots every SLOT_SCAN_S that comes back to Python only for
a slot that needs a decision (a claim, an attach or detach acknowledgement,
a local process gone - a pidfd says so at once - a remote heartbeat still
for a lease, a fenced slot).  Python keeps the decisions: step() and _slot()
are the reference, run as they are whenever C comes back (a lock line of
another epoch, a recovery pending, the lease guard), and the whole loop with
CXLKV_LOCKMGR_PY=1.

A manager knows the pool by the superblock it opened: it re-reads the
superblock with every heartbeat (and a standby before every bid for the
lease) and steps down - exits with PoolReformatted - when the uuid or the
geometry changed (the pool was reformatted under it: its words now lie in
other structures, so it must not write another one).
"""
from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import socket
import sys
import time
import uuid as uuidlib

import numpy as np

from cxlkv.api import Pool, check_uuid
from cxlkv.errors import CxlkvError, ManagerExists, PoolReformatted, RefusedError
from cxlkv.pool import layout, superblock
from cxlkv.pool.image import read_superblocks
from cxlkv.state import nodes as node_table
from cxlkv.state import protocol

log = logging.getLogger(__name__)

#: a contender's write must land before anyone reads the lease back
CONTEND_WAIT_S = 0.2
SLEEP_MAX_S = 0.002
#: the C loop's sleep when nothing happens (backoff from 50 us): a request
#: waits at most this long for a manager that was idle; after C_IDLE_AFTER_S
#: without a grant or release, up to C_IDLE_SLEEP_MAX_S (each wake-up, ~20 us
#: of CPU on a VM, is what an idle manager costs)
C_SLEEP_MAX_S = 0.001
C_IDLE_AFTER_S = 1.0
C_IDLE_SLEEP_MAX_S = 0.01
#: the C loop comes back to Python at least this often (a signal is handled then)
C_RETURN_EVERY_S = 0.25
#: keep polling without sleeping this long after the last grant or release
SPIN_S = 0.02
#: node slots (claims, detaches, liveness) are looked at this often
SLOT_SCAN_S = 0.01


_REASONS = {"gone": "its process is gone", "acknowledged": "it acknowledged its fencing",
            "grace": "its quarantine grace passed"}


def _identity(sb) -> tuple:
    return (sb.uuid, sb.sync, sb.pool_size, sb.chunk_size, sb.max_nodes, sb.hash_slots,
            tuple(sorted(sb.regions.items())))


# the C loop's state words and table columns (cxlkv/_core/src/lockmgr.c)
(_MS_HOLDER, _MS_LAST, _MS_GRANTS, _MS_RECOVER, _MS_BEAT_AT, _MS_RETURN_AT, _MS_BUSY_UNTIL,
 _MS_SLEEP, _MS_TOKEN, _MS_LEASE, _MS_SCAN_EVERY, _MS_SPIN, _MS_SLEEP_MAX, _MS_PIDNS,
 _MS_LAST_SCAN, _MS_REFRESH, _MS_SLOT, _MS_ROUNDS, _MS_IDLE_AFTER, _MS_IDLE_SLEEP_MAX,
 _MS_BEAT_DUE, _MS_BEAT_EVERY, _MS_BEATS, _MS_COUNT) = range(24)
_TB_CTL, _TB_HB, _TB_SINCE, _TB_PIDFD, _TB_LOCAL, _TB_WIDTH = 0, 1, 2, 3, 4, 8
#: why mgr_loop returned
R_BEAT, R_SLOTS, R_GUARD, R_STEPDOWN, R_PYSTEP = range(5)


class LockManager:
    def __init__(self, path: str, *, standby: bool = False, log=None):
        self.pool = Pool.open(path, writable=True)
        try:
            check_uuid(self.pool)               # the pool this host pins, if it pins one
        except BaseException:
            self.pool.close()
            raise
        if self.pool.sb.sync != "manager":
            self.pool.close()
            raise RefusedError(f"{path} is a pool in sync mode {self.pool.sb.sync!r}; the lock "
                               "manager serves pools formatted with --sync manager", path=path)
        self.path = path
        self.standby = standby
        self.m = self.pool.mapping
        self.lease = self.pool.sb.lease_ms / 1000.0
        self.token = secrets.randbits(63) | 1
        self.hdr = protocol.lock_header(self.pool)
        self.log = log or logging.getLogger(__name__).info
        self.observer = node_table.Observer(self.pool)
        self.holder = -1                       # slot holding the lock, -1 = none
        self.recover_pending = False           # a fenced slot waits for the lock to be free
        # (pid, boot id, pid namespace, until): the manager this one took over
        # from was stopped in a recovery - no recovery until it is gone or `until`
        self.recover_hold: tuple[int, bytes, int, float] | None = None
        self.beat_at = 0.0                     # monotonic time of the last heartbeat
        self.last = -1                         # last slot granted (round-robin)
        self.stop = False
        self.grants = 0
        self._nodes = None
        self._identity = _identity(self.pool.sb)
        self.reformatted = False
        self._sb_raw = None                    # superblock bytes last found to be ours
        # the C loop (cxlkv/_core/src/lockmgr.c): its state words and per-slot
        # table; CXLKV_LOCKMGR_PY=1 runs the Python reference loop instead
        self.use_c = os.environ.get("CXLKV_LOCKMGR_PY") != "1"
        self._st = np.zeros(_MS_COUNT, dtype=np.int64)
        self._tb = np.zeros((self.pool.sb.max_nodes, _TB_WIDTH), dtype=np.int64)
        self._tb[:, _TB_CTL] = -1
        self._tb[:, _TB_PIDFD] = -1

    # -- the superblock it was opened with -------------------------------------
    def check_superblock(self) -> None:
        """Raise PoolReformatted (and never write again) when neither superblock
        copy is the one this manager opened: same uuid and geometry."""

        if self.reformatted:
            raise PoolReformatted(f"{self.path} was reformatted under this lock manager",
                                  path=self.path)
        raws = read_superblocks(self.m)
        if raws == self._sb_raw:
            return                   # the very bytes found good last time: no decode
        seen = []
        for raw in raws:
            try:
                sb = superblock.decode(raw)
            except CxlkvError as e:
                seen.append(str(e))
                continue
            if _identity(sb) == self._identity:
                self._sb_raw = raws
                return
            seen.append(f"uuid {sb.uuid}, {sb.max_nodes} node slots, chunk {sb.chunk_size}")
        self.reformatted = True
        self.log(f"the superblock changed (was uuid {self.pool.sb.uuid}; now: "
                 f"{'; '.join(seen)}): the pool was reformatted - stepping down")
        raise PoolReformatted(
            f"{self.path} was reformatted under this lock manager (superblock uuid "
            f"{self.pool.sb.uuid} or its geometry changed): stepped down; start it again "
            "for the new pool", path=self.path,
            hint="reformat only with every cxlkv-lock-manager@ unit stopped (cxlkv-runbook(7))")

    # -- the lease ---------------------------------------------------------------
    def _lease(self) -> tuple[int, int]:
        self.m.invalidate(self.hdr + protocol.MGR_TOKEN, 64)
        return (self.m.load64(self.hdr + protocol.MGR_TOKEN),
                self.m.load64(self.hdr + protocol.MGR_HEARTBEAT))

    def acquire_lease(self) -> bool:
        """Become the active manager; False when stopped first (a standby
        stopped while standing by: a clean stop, not an error)."""
        standing_by = None
        while not self.stop:
            self.check_superblock()
            token, _ = self._lease()
            if token and protocol.heartbeating(self.pool, token):
                if not self.standby:
                    raise ManagerExists(
                        f"a lock manager is already active for {self.path} "
                        f"({protocol.describe_manager(self.pool)}); run another with --standby to "
                        "take over when it stops", path=self.path)
                who = protocol.describe_manager(self.pool)
                if who != standing_by:       # once per active manager, not per lease
                    standing_by = who
                    self.log(f"standing by for {self.path}: the lock manager {who} holds the lease; "
                             "taking over when its heartbeat stops for a lease")
                continue                     # heartbeating() waited up to a lease
            # free, or its holder stopped heartbeating for a lease: contend
            self.m.store64(self.hdr + protocol.MGR_TOKEN, self.token)
            self.m.flush(self.hdr + protocol.MGR_TOKEN, 8)
            time.sleep(CONTEND_WAIT_S)
            if self._lease()[0] == self.token:
                self.check_superblock()
                self._take_office()
                return True
        return False

    def _take_office(self) -> None:
        m, h = self.m, self.hdr
        m.invalidate(h + protocol.MGR_TOKEN, 128)
        if m.load64(h + protocol.MGR_RECOVERING) not in (0, self.token):
            # the last manager stopped (or died) inside a recovery, perhaps past
            # the last freshness check of a C call zeroing a dead node's slot:
            # resumed, it finishes that piece - so nothing it was recovering is
            # recovered again and handed out before it is gone or the grace passed
            grace = self.pool.sb.quarantine_grace_ms / 1000.0
            self.recover_hold = (m.load64(h + protocol.MGR_PID), m.read(h + protocol.MGR_BOOT, 16),
                                 m.load64(h + protocol.MGR_PIDNS), time.monotonic() + grace)
            self.log(f"the last lock manager ({protocol.describe_manager(self.pool)}) stopped "
                     f"in a recovery: no node is recovered until it is gone or {grace:g} s "
                     "have passed")
        m.store64(h + protocol.MGR_EPOCH, m.load64(h + protocol.MGR_EPOCH) + 1)
        m.store64(h + protocol.MGR_PID, os.getpid())
        m.store64(h + protocol.MGR_PIDNS, self.observer.pidns)
        m.write(h + protocol.MGR_BOOT, uuidlib.UUID(self.observer.boot_id).bytes)
        m.write(h + protocol.MGR_HOST, socket.gethostname().encode()[:63].ljust(64, b"\0"))
        m.flush(h + protocol.MGR_TOKEN, 128)
        self.holder = protocol.current_holder(self.pool)
        self.log(f"active for {self.path} (epoch {m.load64(h + protocol.MGR_EPOCH)}"
                 + (f", node {self.holder} holds the lock" if self.holder >= 0 else "") + ")")

    def still_active(self) -> bool:
        token, _ = self._lease()
        return token == self.token

    def beat(self) -> None:
        off = self.hdr + protocol.MGR_HEARTBEAT
        self.m.store64(off, self.m.load64(off) + 1)
        self.m.flush(off, 8)
        self.beat_at = time.monotonic()

    def guard(self) -> None:
        """Before a write to a node's or a lock entry's line: a manager that
        was paused (and may have been replaced by a standby meanwhile) proves
        it still holds the lease - a standby takes over only after a lease
        without a heartbeat - or steps down (ManagerExists)."""
        if time.monotonic() - self.beat_at < self.lease / 2:
            return
        if not self.still_active():
            self.log("another manager holds the lease: stepping down")
            raise ManagerExists("another lock manager took over", path=self.path)
        self.beat()

    @contextlib.contextmanager
    def _recovery_deadline(self):
        """A recovery's writes under the manager's lease, as a node's under its
        heartbeat: the mapping's write deadline is half a lease after the last
        beat, and once it passes every write primitive - and the C loops,
        before each slot, chunk or 1 MiB piece - calls guard(), which beats
        while this manager still holds the lease or steps down.  A manager
        paused in a recovery, whose standby took over, redid the recovery and
        handed the memory out again, writes nothing more when it resumes."""
        m = self.m

        def renew():
            self.guard()
            m.write_deadline_ns = int((self.beat_at + self.lease / 2) * 1e9)

        renew()
        m.set_guard(renew)
        try:
            yield
        finally:
            m.set_guard(None)
            m.write_deadline_ns = 0

    # -- one round -----------------------------------------------------------------
    def step(self, slots: bool = True) -> bool:
        """One round: node slots (claims, liveness) when `slots`, then the lock.
        True if anything changed."""
        pool = self.pool
        ents = protocol.read_entries(pool)
        changed = False
        if slots or self._nodes is None:
            self._nodes = protocol.read_node_lines(pool)
            for slot in range(pool.sb.max_nodes):
                changed |= self._slot(slot, self._nodes[slot], ents[slot])
            if changed:
                self._nodes = protocol.read_node_lines(pool)
        nodes = self._nodes
        # the lock
        if self.holder >= 0:
            e = ents[self.holder]
            # the epoch read again, after the release words (in `ents`): a line
            # rewritten epoch first, then release, is judged by the epoch its
            # release came with, never the one from before it
            off = protocol.entry_offset(pool, self.holder) + protocol.E_EPOCH
            self.m.invalidate(off, 8)
            if self.m.load64(off) != int(e["grant_epoch"]):
                # the holder's line now carries another epoch: a stale
                # incarnation of the slot wrote it (paused past its quarantine)
                # or it is damaged - its release can no longer be told, so the
                # hold is revoked (the holder learns LockLost) rather than the
                # lock never being granted again
                self.log(f"node {self.holder}'s lock line shows epoch {self.m.load64(off)}, "
                         f"granted to epoch {int(e['grant_epoch'])}: revoking the hold")
                self.guard()
                protocol.revoke(pool, self.holder, int(e["grant_seq"]))
                self.holder = -1
                changed = True
            elif int(e["release_seq"]) >= int(e["grant_seq"]) or \
                    int(e["revoke_seq"]) >= int(e["grant_seq"]):
                self.holder = -1
                changed = True
        if self.holder < 0 and self.recover_pending:
            # a fenced node's quarantine may end: recover it before the next
            # grant (under contention the lock is never otherwise free)
            self._nodes = protocol.read_node_lines(pool)
            self.recover_pending = False
            for slot in range(pool.sb.max_nodes):
                changed |= self._slot(slot, self._nodes[slot], ents[slot])
            self._nodes = protocol.read_node_lines(pool)
            nodes = self._nodes
        if self.holder < 0 and not self.recover_pending:
            req = ents["req_seq"]
            waiting = np.flatnonzero(req > np.maximum(np.maximum(ents["grant_seq"],
                                                                 ents["revoke_seq"]),
                                                      ents["release_seq"]))
            if len(waiting):
                # round-robin: the first waiter after the last one served
                n = pool.sb.max_nodes
                for slot in sorted(waiting.tolist(), key=lambda s: (s - self.last - 1) % n):
                    e = ents[slot]
                    if protocol.mgr_state(nodes[slot]) != (layout.NODE_ATTACHED, int(e["epoch"])):
                        continue            # not (yet) an attached node of that epoch
                    if not self.still_active():
                        raise ManagerExists("another lock manager took over")
                    self.guard()
                    protocol.grant(pool, slot, int(e["req_seq"]), int(e["epoch"]))
                    self.holder, self.last = slot, slot
                    self.grants += 1
                    changed = True
                    break
        return changed

    def _slot(self, slot: int, line, ent) -> bool:
        pool = self.pool
        state, epoch = protocol.mgr_state(line)
        claim, granted = int(line["claim_token"]), int(line["mgr_grant_token"])
        ack_state, ack_epoch = layout.node_state(int(line["control"]))
        if state == layout.NODE_FREE:
            if claim and claim != granted:
                self.guard()
                protocol.set_mgr(pool, slot, layout.node_control(layout.NODE_CLAIMED, epoch + 1),
                                 claim)
                return True
            return False
        if state == layout.NODE_CLAIMED and (ack_state, ack_epoch) == (layout.NODE_ATTACHED, epoch):
            self.guard()
            protocol.set_mgr(pool, slot, layout.node_control(layout.NODE_ATTACHED, epoch), granted)
            return True
        if state == layout.NODE_ATTACHED and (ack_state, ack_epoch) == (layout.NODE_FREE, epoch):
            self.guard()
            protocol.set_mgr(pool, slot, layout.node_control(layout.NODE_FREE, epoch),
                             granted)   # detached
            return True
        changed = False
        if state in (layout.NODE_CLAIMED, layout.NODE_ATTACHED):
            n = node_table.read_slot(pool, slot)
            if self.observer.verdict(n) != "dead":
                return False
            self.guard()
            protocol.set_mgr(pool, slot, layout.node_control(layout.NODE_FENCED, epoch), granted)
            if node_table.read_slot(pool, slot).heartbeat != n.heartbeat:
                # it beat after the verdict was made (this manager was slow):
                # alive after all - the fence is taken back before it counts
                protocol.set_mgr(pool, slot, layout.node_control(state, epoch), granted)
                return False
            self.log(f"{describe_node(n)} is dead: fencing it")
            state, changed = layout.NODE_FENCED, True
        if state != layout.NODE_FENCED:
            return changed
        # fenced: its hold of the lock (or its request) is revoked at once ...
        e = ent
        if int(e["grant_seq"]) > max(int(e["release_seq"]), int(e["revoke_seq"])) or \
                int(e["req_seq"]) > max(int(e["grant_seq"]), int(e["revoke_seq"])):
            self.guard()
            if int(e["grant_seq"]) > max(int(e["release_seq"]), int(e["revoke_seq"])):
                # it holds the lock: nobody else is recovered until it is
                protocol.mark_held_when_fenced(pool, slot, (slot + 1) | epoch << 16)
            protocol.revoke(pool, slot, max(int(e["req_seq"]), int(e["grant_seq"])))
            if self.holder == slot:
                self.holder = -1
            changed = True
        # ... what else it held stays quarantined until it may be reused
        n = node_table.read_slot(pool, slot)
        reason = self.observer.release_reason(n)
        if reason is None:
            return changed
        if self.holder >= 0:
            self.recover_pending = True             # recover only while nobody holds the
            return changed                          # lock: step() grants nothing until then
        if self._held_by_last_manager():
            return changed
        self.guard()
        self._recovering(self.token)
        with self._recovery_deadline():
            node_table.run_recoveries(pool, slot, epoch)
        self._recovering(0)
        protocol.set_mgr(pool, slot, layout.node_control(layout.NODE_FREE, epoch), granted)
        self.log(f"node {slot} recovered and freed ({_REASONS[reason]})")
        return True

    def _recovering(self, token: int) -> None:
        off = self.hdr + protocol.MGR_RECOVERING
        self.m.store64(off, token)
        self.m.flush(off, 8)

    def _held_by_last_manager(self) -> bool:
        """Recoveries wait while the manager this one took over from, stopped
        in a recovery, may still resume: until its process is seen gone (same
        host) or the pool's grace has passed since the take-over."""
        if self.recover_hold is None:
            return False
        pid, boot, pidns, until = self.recover_hold
        gone = bool(pid) and (boot, pidns) == (uuidlib.UUID(self.observer.boot_id).bytes,
                                               self.observer.pidns) and \
            node_table.process_start_ns(pid) is None
        if gone or time.monotonic() >= until:
            self.recover_hold = None
            self.log("recovering nodes again: the last lock manager is "
                     + ("gone" if gone else "past its grace"))
            return False
        return True

    # -- the loop --------------------------------------------------------------------
    def run(self) -> None:
        if not self.acquire_lease():
            self.log("stopped while standing by (never active)")
            return
        if self.use_c:
            return self._run_c()
        sleep, busy_until = 0.0, 0.0
        last_beat = last_slots = 0.0
        while not self.stop:
            now = time.monotonic()
            if now - last_beat >= min(0.05, self.lease / 10):
                self._heartbeat()
                last_beat = now
            scan_slots = now - last_slots >= SLOT_SCAN_S
            if scan_slots:
                last_slots = now
            if self.step(scan_slots):
                sleep, busy_until = 0.0, now + SPIN_S
                continue
            if now < busy_until:
                continue                 # spin for a while after activity: grants stay fast
            sleep = min(SLEEP_MAX_S, max(sleep * 2, 0.0001))
            time.sleep(sleep)            # then sleep: an idle manager costs nothing
        self.log("stopped")

    def _heartbeat(self) -> None:
        self.check_superblock()
        if not self.still_active():
            self.log("another manager holds the lease: stepping down")
            raise ManagerExists("another lock manager took over", path=self.path)
        self.beat()

    def _run_c(self) -> None:
        """The same loop with its hot part in C (mgr_loop): the lock rounds,
        the heartbeat and a cheap look at the node slots stay in C; whatever
        the Python reference (step, _slot, guard) decides is done here, then
        C resumes."""
        self._c_setup()
        while not self.stop:
            self._c_step(time.monotonic() + C_RETURN_EVERY_S)
        self.log("stopped")

    def _c_setup(self) -> None:
        st, pool = self._st, self.pool
        self._beat_every = min(0.05, self.lease / 10)
        self._c_args = (self.hdr, pool.region("nodes")[0], pool.sb.max_nodes, st, self._tb,
                        uuidlib.UUID(self.observer.boot_id).bytes)
        st[_MS_TOKEN] = self.token               # < 2**63
        st[_MS_LEASE] = int(self.lease * 1e9)
        st[_MS_SCAN_EVERY] = int(SLOT_SCAN_S * 1e9)
        st[_MS_SPIN] = int(SPIN_S * 1e9)
        st[_MS_SLEEP_MAX] = int(C_SLEEP_MAX_S * 1e9)
        st[_MS_IDLE_AFTER] = int(C_IDLE_AFTER_S * 1e9)
        st[_MS_IDLE_SLEEP_MAX] = int(C_IDLE_SLEEP_MAX_S * 1e9)
        st[_MS_PIDNS] = self.observer.pidns
        st[_MS_REFRESH] = 1
        st[_MS_BEAT_EVERY] = int(self._beat_every * 1e9)

    def _c_step(self, return_at: float) -> int:
        """Run the C loop until it needs Python (or until `return_at`), and
        do what it came back for.  Returns its reason (R_*)."""
        st = self._st
        if time.monotonic() - self.beat_at >= self._beat_every:
            self._heartbeat()                # C could not: Python checks (and may step down)
        st[_MS_HOLDER], st[_MS_LAST] = self.holder, self.last
        st[_MS_RECOVER] = int(self.recover_pending)
        st[_MS_GRANTS] = self.grants
        st[_MS_BEAT_AT] = int(self.beat_at * 1e9)
        st[_MS_BEAT_DUE] = int((self.beat_at + self._beat_every) * 1e9)
        st[_MS_RETURN_AT] = int(return_at * 1e9)
        # C beats while the superblock bytes are the ones found good here
        sb = b"".join(self._sb_raw) if self._sb_raw else b""
        r = self.m.mgr_loop(*self._c_args, sb)
        self.holder, self.last = int(st[_MS_HOLDER]), int(st[_MS_LAST])
        self.grants = int(st[_MS_GRANTS])
        self.beat_at = st[_MS_BEAT_AT] / 1e9
        if r == R_BEAT:
            return r
        if r == R_GUARD:
            self.guard()
            return r
        if r == R_STEPDOWN:
            raise ManagerExists("another lock manager took over")
        if r == R_SLOTS:
            self._seed_observer()
            changed = self.step(True)
            st[_MS_REFRESH] = 1                  # C re-reads the slots Python changed
        else:                                    # R_PYSTEP: the lock, the reference way
            changed = self.step(False)
        if changed:
            st[_MS_SLEEP] = 0
            st[_MS_BUSY_UNTIL] = int((time.monotonic() + SPIN_S) * 1e9)
        return r

    def _seed_observer(self) -> None:
        """Remote nodes are watched by C between Python's looks: give the
        observer what C saw (control, heartbeat and since when on the same
        monotonic clock), so its verdict is the one it would have reached
        watching every scan itself."""
        tb, saw = self._tb, self.observer.saw
        local = tb[:, _TB_LOCAL]
        for slot in np.flatnonzero((tb[:, _TB_CTL] >= 0) & ((local == 0) | (local == 3))).tolist():
            ctl, hb, since = (int(x) & 0xFFFFFFFFFFFFFFFF for x in tb[slot, :_TB_PIDFD])
            saw(slot, ctl, hb, since / 1e9)

    def close(self) -> None:
        for fd in self._tb[:, _TB_PIDFD].tolist():
            if fd >= 0:
                os.close(fd)
        self._tb[:, _TB_PIDFD] = -1
        if not self.reformatted and self.still_active():
            self.m.store64(self.hdr + protocol.MGR_TOKEN,
                           0)   # hand over at once, not after a lease
            self.m.flush(self.hdr + protocol.MGR_TOKEN, 8)
        self.pool.close()


def describe_node(n) -> str:
    """"node 3 (host-a pid 812)"; a slot claimed by an attach that never
    wrote its identity (it died or gave up first) says so, not "( pid 0)"."""
    if not n.pid and not n.hostname:
        return f"node {n.slot} (an abandoned attach: claimed, no process recorded)"
    return f"node {n.slot} ({n.hostname or '?'} pid {n.pid})"


def serve(mgr: LockManager) -> None:
    """Run until SIGTERM or SIGINT, then hand the lease back."""
    def on_term(signum, frame):
        mgr.stop = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    try:
        mgr.run()
    finally:
        mgr.close()


def log_to_stderr() -> None:
    """The process's log lines on stderr: this manager's as "cxlkv lock-manager:
    MSG" (its first line says "active": cxlkv.ops.lockmgr waits for it), the
    library's warnings as "cxlkv: MSG".  Once per process."""
    if any(getattr(h, "_cxlkv_lockmgr", False) for h in log.handlers):
        return
    mine = logging.StreamHandler()
    mine._cxlkv_lockmgr = True
    mine.setFormatter(logging.Formatter("cxlkv lock-manager: %(message)s"))
    log.addHandler(mine)
    log.setLevel(logging.INFO)
    log.propagate = False
    lib = logging.StreamHandler()
    lib.setFormatter(logging.Formatter("cxlkv: %(message)s"))
    lib.setLevel(logging.WARNING)
    logging.getLogger("cxlkv").addHandler(lib)


def main(argv=None) -> int:  # python -m cxlkv.daemons.lockmgr POOL [--standby]
    args = sys.argv[1:] if argv is None else argv
    log_to_stderr()
    serve(LockManager(args[0], standby="--standby" in args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
