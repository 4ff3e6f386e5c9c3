"""`cxlkv fsck --repair`: put a damaged pool's shared state right.

Repairs are idempotent fixers, each rescanning what it fixes (they do not
trust the read-only check's findings); `cxlkv fsck` runs the check before
and after.  In order:
 1. superblock: a bad copy is rewritten from the good one (same generation);
 2. nodes: every slot that is not a live node is reaped - fenced, its
    recoveries run (its lock turn passed on, its pins dropped, its KV
    reservations and unpublished slots reclaimed), freed; a slot with an
    invalid state word is freed;
 3. the lock area (cas mode): an owner or lock entries of nodes that are gone
    are cleared; with nobody attached, the ticket counters are made equal;
 4. the allocator: invalid descriptors cleared; half-released slabs
    finished; slabs with impossible geometry dissolved (their chunks zeroed:
    what they held cannot be trusted); missing tails and bitmap bits of
    good slabs restored; tails without a head and bits without a slab
    freed; slot bits made consistent (published implies allocated, nothing
    past the last slot); interrupted frees finished;
 5. the KV cache (cxlkv.kv.check.repair_kv): entries left half written, half
    evicted or reserved by dead nodes undone; inconsistent entries dropped
    (unreachable, duplicate keys, shared payloads, unknown namespace or
    tenant, wrong length, a payload that is a free or foreign slot); pins of
    nodes that are gone cleared; counters recomputed;
 6. slabs owned by tokens that are not attached nodes: their unpublished
    slots freed, the slab orphaned (any node adopts it), released if empty.

Liveness is judged once, before anything is written: nodes of this host at
once, nodes of other hosts by watching their heartbeats for up to a lease.
A node still undecided when the watch ends counts as alive.  Only slots
judged dead are reaped, each with the control word that was judged (a slot
that changed since - a node that re-attached - is never fenced); the node
table is read again before acting and the repair stops with an operational
error naming the node when a slot changed under it.

Without live nodes this runs on its own (nothing else writes the pool).  In
sync mode cas it first blocks new attaches: every free slot is taken by a
placeholder node of this process (a process that tries to attach meanwhile
finds the table full; a placeholder left by a repair that was killed is
judged dead at once on this host and reaped), and they are freed at the end.
In sync mode manager the lock manager grants slots, so new attaches are only
detected: the repair stops with an operational error when a node attached
while it ran (run it again).  With --live and live nodes it attaches as a
node and runs 3-6 under the pool lock (2 takes the lock itself, per node);
nodes attaching meanwhile are left alone.  Attaching is recorded in
`attached`, not as a repair.
"""
from __future__ import annotations

import socket
import time
import uuid as uuidlib
from dataclasses import dataclass, field

import numpy as np

from cxlkv.api import Pool
from cxlkv.errors import LiveNodesError, PoolChanged
from cxlkv.kv.check import repair_kv
from cxlkv.ops import fsck
from cxlkv.pool import layout
from cxlkv.state import alloc, locks, nodes, protocol
from cxlkv.version import __version__

#: the chunk descriptor's field offsets
_F = {name: off for name, (off, _size) in layout.field_layout(layout.ChunkStruct).items()}
_CONTROL = layout.field_offset(layout.NodeStruct, "control")
_HEARTBEAT = layout.field_offset(layout.NodeStruct, "heartbeat")
_MGR_LINE = layout.field_offset(layout.NodeStruct, "mgr_control")


@dataclass
class Repair:
    before: fsck.Report
    after: fsck.Report | None = None
    actions: list[dict] = field(default_factory=list)
    attached: bool = False
    #: slot -> verdict ("alive", "dead", "undecided": counted as alive) of every
    #: slot in use when the repair began
    verdicts: dict = field(default_factory=dict)
    #: free slots held by placeholders while an offline repair runs (sync mode cas)
    blocked: set = field(default_factory=set)
    #: what this repair could not do, and why (exit 4 like errors left)
    left: list[dict] = field(default_factory=list)

    def did(self, code: str, where: str, message: str) -> None:
        self.actions.append({"code": code, "where": where, "message": message})

    def could_not(self, code: str, where: str, message: str) -> None:
        self.left.append({"code": code, "where": where, "message": message})

    @property
    def exit_code(self) -> int:
        """e2fsck: 0 clean, 1 errors corrected, 4 errors left (or a repair
        this run could not make)."""
        if (self.after is not None and not self.after.clean) or self.left:
            return 4
        return 1 if (self.before.errors or self.actions) else 0

    def to_json(self) -> dict:
        return {"clean": self.after.clean if self.after else self.before.clean,
                "exit_code": self.exit_code, "attached": self.attached,
                "nodes": {str(k): v for k, v in sorted(self.verdicts.items())},
                "before": self.before.to_json(), "repairs": self.actions, "left": self.left,
                "after": self.after.to_json() if self.after else None}


def repair(path: str, *, force: bool = False, live: bool | None = None,
           notice=None) -> Repair:
    """Check, repair and check again (see the module docstring).

    force: open a world-readable or world-writable pool; live: repair while
    live nodes are attached (under the pool lock, attached as a node) - None
    takes force's value (the library's old single switch).  Raises
    LiveNodesError when live nodes are attached and not live; CxlkvError
    subclasses when the pool cannot be opened writable.
    """
    live = force if live is None else live
    pool = Pool.open(path, writable=True, force=force)
    try:
        rep = Repair(fsck.check(pool))
        judged = judge_nodes(pool, notice=notice)
        rep.verdicts = {slot: v for slot, (_, v) in judged.items()}
        live_nodes = [n for n, v in judged.values() if v != "dead"]
        if live_nodes and not live:
            names = ", ".join(n.describe() + ("" if judged[n.slot][1] == "alive"
                                              else " (not judged yet: counted as alive)")
                              for n in live_nodes)
            raise LiveNodesError(
                f"refusing to repair {path}: {len(live_nodes)} live node(s) attached: {names}",
                [n.to_json() for n in live_nodes], path=path,
                hint="stop them (systemctl stop cxlkv-serve@POOL, the serving engines) and "
                     "run again, or add --live to repair under the pool lock")
        m = pool.mapping
        m.set_geometry(*alloc.geometry(pool))
        m.flush_meta = pool.sb.sync == "manager" or m.noncoherent
        _superblock(pool, rep)
        try:
            if live_nodes:
                pool.attach()                   # the pool lock, for 3-6
                rep.attached = True
            elif pool.sb.sync == "cas":
                _block_attaches(pool, rep)
            _verify_unchanged(pool, rep, judged)
            _nodes(pool, rep, judged)
            if not rep.attached:
                if pool.sb.sync == "cas":
                    _block_attaches(pool, rep)      # the slots just freed, too
                _verify_unchanged(pool, rep, judged, after_reaping=True)
            lock = pool.lock() if rep.attached else None
            if lock is not None:
                lock.acquire()
            try:
                tokens = alloc.live_tokens(pool) - _placeholder_tokens(pool, rep)
                _locks(pool, rep, tokens, offline=not rep.attached)
                _allocator(pool, rep, tokens)

                repair_kv(pool, rep, tokens)
                _dead_owner_slabs(pool, rep, tokens)
            finally:
                if lock is not None:
                    lock.release()
            if not rep.attached:
                _verify_unchanged(pool, rep, judged, after_reaping=True)
        finally:
            _unblock_attaches(pool, rep)
    finally:
        pool.close()
    with Pool.open(path, writable=False, force=force) as p:
        rep.after = fsck.check(p)
    return rep


# -- 0. who is alive ---------------------------------------------------------------------

def judge_nodes(pool, *, notice=None, clock=time.monotonic,
                sleep=time.sleep) -> dict[int, tuple]:
    """{slot: (NodeInfo as judged, verdict)} for every slot in use.

    Local nodes are decided at once; other hosts' nodes are watched for up
    to a lease (notice(count, seconds) is called first).  Verdicts: "alive",
    "dead", or "undecided" (still not judged when the watch ended: never
    treated as dead).  The NodeInfo of a dead verdict carries the control
    word that was judged dead.
    """
    obs = nodes.Observer(pool, clock=clock)
    res = {n.slot: (n, v) for n, v in obs.scan()}
    pending = {s for s, (_, v) in res.items() if v == "unknown"}
    lease = pool.sb.lease_ms / 1000.0
    if pending and notice is not None:
        notice(len(pending), lease)
    deadline = clock() + lease + 0.05
    while pending and clock() < deadline:
        sleep(min(0.05, lease / 20))
        for slot in list(pending):
            n = nodes.read_slot(pool, slot)
            v = obs.verdict(n)
            res[slot] = (n, v)
            if v != "unknown":
                pending.discard(slot)
    return {s: (n, "undecided" if v == "unknown" else v) for s, (n, v) in sorted(res.items())}


def _changed(pool, n, why: str) -> PoolChanged:
    return PoolChanged(
        f"{pool.path}: {n.describe()} {why} while fsck --repair ran; stopped before touching "
        "it", path=pool.path,
        hint="nothing else may attach during an offline repair: stop the engines and "
             "cxlkv-serve on every host (or use --live) and run fsck --repair again")


def _verify_unchanged(pool, rep: Repair, judged: dict, after_reaping: bool = False) -> None:
    """Read the node table again and stop (PoolChanged) when a node attached
    since liveness was judged.

    Before reaping: a slot judged dead must still hold the judged word (or
    be fenced or freed, same epoch, by another reaper); a slot that was free
    and is in use now is a node that attached meanwhile - an error offline,
    left alone with --live (we work under the pool lock then; so is a dead
    slot the live nodes reaped and a new node took).  After
    reaping (offline only): every slot in use must be one judged dead, same
    epoch (left for the check after), or a placeholder of ours.
    """
    own = pool.node.slot if pool.node is not None else -1
    for n in nodes.read_nodes(pool):
        if n.slot == own or n.slot in rep.blocked:
            continue
        was = judged.get(n.slot)
        if was is None:
            if not rep.attached:
                raise _changed(pool, n, "attached")
            continue
        j, v = was
        if v != "dead":
            continue
        if n.epoch != j.epoch:
            if rep.attached:
                continue                # reaped by a live node's reaper, taken by a new node
            raise _changed(pool, n, "attached")
        if after_reaping or n.control == j.control or n.state == "fenced":
            continue
        raise _changed(pool, n, f"(judged dead with state word {j.control:#x}, now "
                                f"{n.control:#x}) changed")


def _block_attaches(pool, rep: Repair) -> None:
    """Offline repair, sync mode cas: take every free slot with a placeholder
    node (this process's identity), so nothing attaches while we repair."""
    m = pool.mapping
    pid, start = nodes.my_identity()
    boot, pidns = nodes.local_boot_id(), nodes.local_pidns()
    for slot in range(pool.sb.max_nodes):
        off = nodes.node_offset(pool, slot)
        m.invalidate(off, 64)
        cur = m.load64(off + _CONTROL)
        state, epoch = layout.node_state(cur)
        if state != layout.NODE_FREE or epoch + 1 >= nodes.MAX_EPOCH:
            continue
        claimed = layout.node_control(layout.NODE_CLAIMED, epoch + 1)
        if m.cas64(off + _CONTROL, cur, claimed) != cur:
            continue                            # taken meanwhile: _verify_unchanged says so
        s = layout.NodeStruct()
        s.pidns, s.ident_epoch = pidns, epoch + 1
        s.pid, s.start_time_ns, s.attach_time_ns = pid, start, time.time_ns()
        s.format_version = layout.FORMAT_VERSION
        s.boot_id[:] = uuidlib.UUID(boot).bytes
        s.hostname = socket.gethostname().encode()[:63]
        s.sw_version = f"cxlkv {__version__} fsck".encode()[:31]
        m.write(off + 64, bytes(s)[64:_MGR_LINE])
        m.store64(off + _HEARTBEAT, 0)
        m.flush(off, layout.NODE_SIZE)
        attached = layout.node_control(layout.NODE_ATTACHED, epoch + 1)
        m.cas64(off + _CONTROL, claimed, attached)
        m.flush(off, 64)
        rep.blocked.add(slot)


def _placeholder_tokens(pool, rep: Repair) -> set[int]:
    """Owner tokens of our placeholders: they own nothing, and phases 3-6 must
    not take a stray token that happens to equal one for a live node's."""
    return {(n.slot + 1) | n.epoch << 16 for n in nodes.read_nodes(pool)
            if n.slot in rep.blocked}


def _unblock_attaches(pool, rep: Repair) -> None:
    m = pool.mapping
    for slot in sorted(rep.blocked):
        off = nodes.node_offset(pool, slot) + _CONTROL
        m.invalidate(off, 8)
        cur = m.load64(off)
        state, epoch = layout.node_state(cur)
        if state == layout.NODE_ATTACHED:
            m.cas64(off, cur, layout.node_control(layout.NODE_FREE, epoch))
            m.flush(off, 8)
    rep.blocked.clear()


# -- 1. superblock ---------------------------------------------------------------------

def _superblock(pool, rep: Repair) -> None:
    good, copy = pool.sb, pool.superblock_copy
    for bad, problem in sorted(pool.superblock_problems.items()):
        off = layout.SB_OFFSETS["AB".index(bad)]
        pool.mapping.write(off, good.encode())
        pool.mapping.flush(off, layout.SB_SIZE)
        rep.did("superblock-copy", f"superblock {bad}",
                f"rewritten from copy {copy} (generation {good.seq}); it was: {problem}")


# -- 2. nodes --------------------------------------------------------------------------

def _nodes(pool, rep: Repair, judged: dict) -> None:
    """Reap the slots judged dead, each with the control word that was judged:
    fenced nodes that were recovering another node first (that node waits
    for them: nodes.recovered_by_fenced)."""
    ents = protocol.read_entries(pool)
    first = {x.slot for x in nodes.read_nodes(pool)
             if x.state == "fenced" and int(ents["recovering"][x.slot])}
    for slot, (n, v) in sorted(judged.items(), key=lambda kv: kv[0] not in first):
        if v != "dead":
            continue
        where = f"node {n.slot}"
        if n.state.startswith("unknown"):
            if _force_free(pool, n):
                rep.did("node-state", where, f"invalid state word {n.control:#x}: slot freed")
            continue
        if pool.sb.sync == "manager":
            done = _reap_managed(pool, n)
            if not done:
                # the running lock manager owns its nodes' lines and did not
                # reap this one (a quarantine it ends only after its grace)
                rep.could_not("node-not-reaped", where,
                              f"{n.describe()} ({n.state}, epoch {n.epoch}) was not alive, but "
                              "the running lock manager did not reap it within two leases: "
                              "stop the lock managers (active and standby), run "
                              "`cxlkv fsck --repair` again, then start them")
        else:
            cur = nodes.read_slot(pool, n.slot)
            if cur.epoch == n.epoch and cur.state == "fenced":
                done = nodes.reap(pool, n.slot, cur.control)    # another reaper stopped half way
            else:
                done = nodes.reap(pool, n.slot, n.control)
            if not done:
                cur = nodes.read_slot(pool, n.slot)
                if rep.attached and cur.epoch != n.epoch:
                    continue            # reaped by a live node's reaper, taken by a new node
                if cur.epoch != n.epoch or cur.state not in ("free", "fenced"):
                    raise _changed(pool, cur, f"(judged dead with state word {n.control:#x}, "
                                              f"now {cur.control:#x}) changed")
                done = cur.state == "free"          # another reaper freed it
        if done:
            rep.did("node-reaped", where, f"{n.describe()} ({n.state}, epoch {n.epoch}) was "
                                          "not alive: fenced, recovered and freed")


def _force_free(pool, n) -> bool:
    """Free a slot with an invalid state word, unless the word changed since
    it was judged."""
    m = pool.mapping
    off = nodes.node_offset(pool, n.slot)
    free = layout.node_control(layout.NODE_FREE, n.epoch)
    if pool.sb.sync == "manager":
        if nodes.read_slot(pool, n.slot).control != n.control:
            raise _changed(pool, n, "changed")
        protocol.set_mgr(pool, n.slot, free, 0)
        m.store64(off + _CONTROL, free)
    elif m.cas64(off + _CONTROL, n.control, free) != n.control:
        raise _changed(pool, nodes.read_slot(pool, n.slot), "changed")
    m.flush(off, 64)
    return True


def _reap_managed(pool, n) -> bool:
    """Sync mode manager: the lock manager reaps when one runs (wait for it);
    with none, do what it would (we are the only writer of its lines then)."""

    lease = pool.sb.lease_ms / 1000.0
    if protocol.manager_alive(pool):
        deadline = time.monotonic() + 2 * lease + 1.0
        while time.monotonic() < deadline:
            if nodes.read_slot(pool, n.slot).state == "free":
                return True
            time.sleep(min(0.05, lease / 10))
        return False
    line = protocol.read_node_lines(pool)[n.slot]
    granted = int(line["mgr_grant_token"])
    protocol.set_mgr(pool, n.slot, layout.node_control(layout.NODE_FENCED, n.epoch), granted)
    e = protocol.read_entries(pool)[n.slot]
    if int(e["grant_seq"]) > max(int(e["release_seq"]), int(e["revoke_seq"])) or \
            int(e["req_seq"]) > max(int(e["grant_seq"]), int(e["revoke_seq"])):
        protocol.revoke(pool, n.slot, int(e["req_seq"]))
    nodes.run_recoveries(pool, n.slot, n.epoch)
    protocol.set_mgr(pool, n.slot, layout.node_control(layout.NODE_FREE, n.epoch), granted)
    return True


# -- 3. the lock area ---------------------------------------------------------------------

def _locks(pool, rep: Repair, live: set[int], offline: bool) -> None:
    m = pool.mapping
    hdr, _ = locks.lock_offsets(pool)
    m.invalidate(hdr, 128)
    h = layout.LockHdrStruct.from_buffer_copy(m.read(hdr, layout.LOCK_HDR_SIZE))
    if pool.sb.sync == "cas":
        own_off = layout.field_offset(layout.LockHdrStruct, "owner")
        if h.owner and h.owner not in live:
            m.cas64(hdr + own_off, h.owner, 0)
            rep.did("lock-owner", "lock", f"owner token {h.owner:#x} (not an attached node) "
                                          "cleared")
        if offline and h.now_serving != h.next_ticket:
            top = max(h.now_serving, h.next_ticket)
            m.store64(hdr + layout.field_offset(layout.LockHdrStruct, "now_serving"), top)
            m.store64(hdr + layout.field_offset(layout.LockHdrStruct, "next_ticket"), top)
            m.flush(hdr, 128)
            rep.did("lock-tickets", "lock", f"ticket counters set to {top} (nobody holds or "
                                            "waits)")
    ents = locks.read_entries(pool)
    for slot in np.flatnonzero(ents["state"] != layout.LOCK_IDLE):
        slot = int(slot)
        st, ep = int(ents["state"][slot]), int(ents["epoch"][slot])
        if st == layout.LOCK_ABANDONED and not offline:
            continue
        if ((slot + 1) | ep << 16) in live and st in (layout.LOCK_WAITING, layout.LOCK_LOCKED):
            continue
        off = locks.entry_offset(pool, slot)
        new = layout.LOCK_IDLE if offline else layout.LOCK_ABANDONED
        m.store64(off, new)
        m.flush(off, 64)
        if st != layout.LOCK_ABANDONED:
            rep.did("lock-entry-dead", f"lock entry {slot}", f"state {st} of a node that is "
                                                             "not attached cleared")


# -- 4. the allocator -----------------------------------------------------------------------

def _desc(pool, i: int) -> int:
    return alloc.geometry(pool)[3] + i * layout.CHUNK_DESC_SIZE


def _good_geometry(pool, d, i: int) -> bool:
    chunk, nchunks = pool.sb.chunk_size, pool.sb.nchunks
    ss, ns, nc = int(d["slot_size"][i]), int(d["nslots"][i]), int(d["nchunks"][i])
    return bool(ss and ss % 64 == 0 and 0 < ns <= layout.SLAB_MAX_SLOTS and 0 < nc
                and i + nc <= nchunks and ns * ss <= nc * chunk)


def _allocator(pool, rep: Repair, live: set[int]) -> None:
    m = pool.mapping
    data_off, chunk, nchunks, _ = alloc.geometry(pool)
    d = alloc.descriptors(pool)
    kind = (d["control"] & 0xFF).copy()
    try:
        for i in np.flatnonzero(~np.isin(kind,
                                         (layout.CHUNK_FREE, layout.CHUNK_HEAD, layout.CHUNK_TAIL,
                                                 layout.CHUNK_RELEASING))):
            i = int(i)
            m.zero(_desc(pool, i), layout.CHUNK_DESC_SIZE)
            m.flush(_desc(pool, i), layout.CHUNK_DESC_SIZE)
            rep.did("chunk-kind", f"chunk {i}", f"invalid descriptor kind {int(kind[i])} "
                                                "cleared")
        bad_heads = [int(i) for i in np.flatnonzero((kind == layout.CHUNK_HEAD)
                                                    | (kind == layout.CHUNK_RELEASING))
                     if not _good_geometry(pool, d, int(i))]
        releasing = [int(i) for i in np.flatnonzero(kind == layout.CHUNK_RELEASING)
                     if int(i) not in bad_heads]
    finally:
        del d
    for head in releasing:
        alloc.release_slab(pool, head, resume=True)
        rep.did("slab-releasing", f"chunk {head}", "half-released slab: release finished")
    for head in bad_heads:
        _dissolve(pool, head)
        rep.did("slab-geometry", f"chunk {head}", "slab with impossible geometry dissolved "
                                                  "(its chunks zeroed and freed)")
    # good slabs: their tails and bitmap bits
    d = alloc.descriptors(pool)
    try:
        kind = (d["control"] & 0xFF).copy()
        heads = [int(i) for i in np.flatnonzero(kind == layout.CHUNK_HEAD)]
        spans = {h: int(d["nchunks"][h]) for h in heads}
    finally:
        del d
    bits = alloc.bitmap(pool)

    def covered_by_other(j: int, named: int) -> bool:
        return named in spans and named < j < named + spans[named]

    for h, k in spans.items():
        for j in range(h + 1, h + k):
            if kind[j] == layout.CHUNK_FREE:
                m.store64(_desc(pool, j), layout.CHUNK_TAIL | h << 8)
                m.flush(_desc(pool, j), 8)
                kind[j] = layout.CHUNK_TAIL
                rep.did("slab-tail", f"chunk {j}", f"missing tail of slab {h} restored")
            elif kind[j] == layout.CHUNK_TAIL:
                named = int(m.load64(_desc(pool, j))) >> 8
                if named != h and not covered_by_other(j, named):
                    m.store64(_desc(pool, j), layout.CHUNK_TAIL | h << 8)
                    m.flush(_desc(pool, j), 8)
                    rep.did("slab-tail", f"chunk {j}", f"tail of slab {h} named chunk {named} "
                                                       "instead: restored")
        missing = [j for j in range(h, h + k) if not bits[j]
                   and (j == h or int(m.load64(_desc(pool, j))) == layout.CHUNK_TAIL | h << 8)]
        for j in missing:
            alloc.set_bits(pool, j, 1, True)
            rep.did("slab-bitmap", f"chunk {j}", f"slab {h}'s chunk marked used in the bitmap")
    before_tails = int(((alloc.descriptors(pool)["control"] & 0xFF) == layout.CHUNK_TAIL).sum())
    leaked = int((alloc.bitmap(pool) & ((alloc.descriptors(pool)["control"] & 0xFF)
                                    == layout.CHUNK_FREE)).sum())
    alloc.repair_dangling(pool)
    after_tails = int(((alloc.descriptors(pool)["control"] & 0xFF) == layout.CHUNK_TAIL).sum())
    if before_tails != after_tails:
        rep.did("chunk-orphan-tail", "chunks", f"{before_tails - after_tails} tail(s) without "
                                               "a head freed")
    if leaked:
        rep.did("chunk-leaked", "bitmap", f"{leaked} chunk(s) marked used with no slab freed")
    # slot bits
    d = alloc.descriptors(pool)
    try:
        heads = [int(i) for i in np.flatnonzero((d["control"] & 0xFF) == layout.CHUNK_HEAD)]
        words = {h: ([int(x) for x in d["alloc_bits"][h]], [int(x) for x in d["pub_bits"][h]],
                     int(d["nslots"][h])) for h in heads}
    finally:
        del d
    for h, (a, p, ns) in words.items():
        valid = [(1 << min(64, max(0, ns - 64 * w))) - 1 for w in range(8)]
        base = _desc(pool, h)
        for w in range(8):
            if a[w] & ~valid[w]:
                m.store64(base + _F["alloc_bits"] + 8 * w, a[w] & valid[w])
                rep.did("slab-bits", f"chunk {h}", "allocated bits past the last slot cleared")
                a[w] &= valid[w]
            if p[w] & ~a[w]:
                m.store64(base + _F["pub_bits"] + 8 * w, p[w] & a[w])
                rep.did("slab-pub", f"chunk {h}", "published bits of free slots cleared")
        m.flush(base, layout.CHUNK_DESC_SIZE)
    dirty_before = _count_dirty(pool, live)
    alloc.finish_interrupted_frees(pool, live_owner=live)
    if dirty_before:
        rep.did("slab-dirty", "slabs", f"{dirty_before} interrupted free(s) finished")


def _count_dirty(pool, live) -> int:
    d = alloc.descriptors(pool)
    try:
        heads = np.flatnonzero((d["control"] & 0xFF) == layout.CHUNK_HEAD)
        heads = [h for h in heads if int(d["owner"][h]) not in live]
        return int(sum((int(a) & int(b)).bit_count() for h in heads
                       for a, b in zip(d["alloc_bits"][h], d["dirty_bits"][h])))
    finally:
        del d


def _dissolve(pool, head: int) -> None:
    """Free a slab whose descriptor cannot be believed: its own tails, its
    chunks (zeroed) and bitmap bits."""
    data_off, chunk, nchunks, base = alloc.geometry(pool)
    m = pool.mapping
    ours = [head]
    j = head + 1
    tail = layout.CHUNK_TAIL | head << 8
    while j < nchunks and m.load64(base + j * layout.CHUNK_DESC_SIZE) == tail:
        ours.append(j)
        j += 1
    for i in reversed(ours):
        m.zero(data_off + i * chunk, chunk)
        m.zero(base + i * layout.CHUNK_DESC_SIZE, layout.CHUNK_DESC_SIZE)
        m.flush(base + i * layout.CHUNK_DESC_SIZE, layout.CHUNK_DESC_SIZE)
    for i in ours:
        alloc.set_bits(pool, i, 1, False)


# -- 6. slabs of nodes that are gone ------------------------------------------------------

def _dead_owner_slabs(pool, rep: Repair, live: set[int]) -> None:
    m = pool.mapping
    data_off, chunk, _, base = alloc.geometry(pool)
    d = alloc.descriptors(pool)
    try:
        heads = np.flatnonzero((d["control"] & 0xFF) == layout.CHUNK_HEAD)
        todo = []
        for h in heads:
            owner = int(d["owner"][h])
            if not owner or owner in live or owner == alloc.RETIRED_OWNER:
                continue                # a retired slab stays unadoptable (poison)
            ss, ns = int(d["slot_size"][h]), int(d["nslots"][h])
            a = [int(x) for x in d["alloc_bits"][h]]
            p = [int(x) for x in d["pub_bits"][h]]
            res = [i for i in range(min(ns, layout.SLAB_MAX_SLOTS))
                   if (a[i // 64] & ~p[i // 64]) >> (i % 64) & 1]
            todo.append((int(h), owner, [data_off + int(h) * chunk + i * ss for i in res]))
    finally:
        del d
    for h, owner, offs in todo:
        if offs:
            alloc.free_slots(pool, offs, skip=())
        m.store64(base + h * layout.CHUNK_DESC_SIZE + _F["owner"], 0)
        m.flush(base + h * layout.CHUNK_DESC_SIZE, 64)
        released = alloc.release_slab(pool, h)
        rep.did("slab-dead-owner", f"chunk {h}",
                f"slab of token {owner:#x} (not an attached node): {len(offs)} unpublished "
                f"slot(s) freed, " + ("empty slab released" if released else
                                      "published slots kept, slab orphaned"))

