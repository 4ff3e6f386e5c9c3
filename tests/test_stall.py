"""Stalled nodes: a node paused past its lease - SIGSTOP here, as a
GC pause or a VM migration would - is judged dead by heartbeat (each paused
process is made to look like another host), fenced, and resumed later.
Whatever it still had in flight must not land on memory another node owns,
the pool lock must keep being granted, other nodes' pins must survive, and
the paused node must be told.  Each test pauses at one exact step
(CXLKV_PAUSE_AT=site:N, or SIGSTOP while it waits for the next command), in
sync mode cas, manager, and manager under the non-coherence emulation."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import numpy as np
import psutil
import pytest

import cxlkv
from cxlkv.errors import PoolCorrupt, PoolFullError
from cxlkv.pool import layout
from cxlkv.ops.init import init_pool
from cxlkv.api import Pool
from cxlkv.ops import fsck
from cxlkv.kv.area import quarantine_report
from cxlkv.state import alloc, locks
from cxlkv.state import nodes as node_table

from cxlkv.testing.checks import wait_for
from cxlkv.testing.damage import fake_node
from cxlkv.testing.data import pattern
from cxlkv.testing.nodes import NodeProc
from cxlkv.testing.pools import MiB

LEASE_MS = 300
GRACE_MS = 900
BLOCK = 64 * 1024
KV_ARGS = {"model": "stall-test", "block_bytes": BLOCK, "block_tokens": 16}
MODES = ["cas", "manager", "manager-nc"]


class Rack:
    """A pool in one sync mode, its lock manager (manager modes), and the
    environment its processes run with."""

    def __init__(self, path: str, mode: str, monkeypatch, *, max_nodes: int = 8,
                 grace_ms: int = GRACE_MS):
        self.path, self.mode = path, mode
        self.sync = "cas" if mode == "cas" else "manager"
        self.env = {"CXLKV_NONCOHERENT": "1"} if mode == "manager-nc" else {}
        for k, v in self.env.items():
            monkeypatch.setenv(k, v)        # this process's own mapping too
        init_pool(path, {"size": 16 * MiB, "chunk_size": 256 * 1024, "max_nodes": max_nodes,
                         "sync": self.sync, "lease_ms": LEASE_MS, "grace_ms": grace_ms})
        self.manager = None
        if self.sync == "manager":
            self.manager = subprocess.Popen(
                [sys.executable, "-m", "cxlkv", "lock-manager", "--pool", path],
                stderr=subprocess.PIPE, text=True, env={**os.environ, **self.env})
            assert "active" in self.manager.stderr.readline()

    def node(self, remote_env) -> NodeProc:
        """A process attached as a node that every other node judges by heartbeat."""
        p = NodeProc(env=remote_env(**self.env))
        p.attach(self.path)
        return p

    def close(self) -> None:
        if self.manager is not None and self.manager.poll() is None:
            self.manager.terminate()
            self.manager.wait(10)


@pytest.fixture(params=MODES)
def rack(request, pool_path, monkeypatch):
    r = Rack(pool_path, request.param, monkeypatch)
    yield r
    r.close()


def stopped(p: NodeProc) -> bool:
    return psutil.Process(p.p.pid).status() == psutil.STATUS_STOPPED


def slot_state(path: str, slot: int) -> node_table.NodeInfo:
    with Pool.open(path, writable=False) as p:
        return node_table.read_slot(p, slot)


def fenced(path: str, p: NodeProc) -> bool:
    n = slot_state(path, p.slot)
    return n.epoch == p.epoch and n.state == "fenced"


def freed(path: str, p: NodeProc) -> bool:
    n = slot_state(path, p.slot)
    return n.epoch != p.epoch or n.state == "free"


def assert_clean(path: str) -> None:
    with Pool.open(path, writable=False) as p:
        rep = fsck.check(p)
    assert rep.clean, [f.to_json() for f in rep.errors]


def toks(tag: int, blocks: int) -> np.ndarray:
    return np.arange(blocks * 16, dtype=np.int64) + tag * 1_000_000


def fill_with_published(pool, nb: int) -> dict:
    """Allocate slots of nb bytes until the pool is full, fill each with a
    pattern of its own offset, publish them all: {offset: bytes}."""
    mine = []
    with pytest.raises(PoolFullError):
        while True:
            mine.append(pool.alloc(nb))
    data = {o: o.to_bytes(8, "little") * (nb // 8) for o in mine}
    for o, b in data.items():
        pool.mapping.write(o, b)
    pool.publish(mine)
    return data


def overwritten(pool, data: dict) -> list:
    """The slots of fill_with_published whose bytes changed."""
    return [o for o, b in data.items() if pool.mapping.read(o, len(b)) != b]


# -- 1. a writer paused between reserving and copying ---------------------------------

def test_writer_paused_before_its_copy_cannot_overwrite_others_blocks(rack, remote_env):
    w = NodeProc(env=remote_env(CXLKV_PAUSE_AT="kv.reserved:1", **rack.env))
    w.attach(rack.path)
    assert "ns" in w.call(op="kv_open", args=KV_ARGS)
    mine = toks(1, 8)
    w.send(op="kv_store", tokens=mine.tolist())          # stops after reserving
    wait_for(lambda: stopped(w), what="the writer to stop at kv.reserved")
    with cxlkv.open_pool(rack.path) as pool:
        kv = pool.kv(**KV_ARGS)
        wait_for(lambda: fenced(rack.path, w), what="the writer to be fenced")
        # fill the pool: had the writer's slots been freed, these would get them
        stored = []
        for t in range(2, 40):
            ts = toks(t, 4)
            kv.store(ts, b"".join(pattern(kv, ts)))
            stored.append(ts)
        os.kill(w.p.pid, signal.SIGCONT)
        r = w.reply()
        assert r.get("error") == "NodeFenced", r          # told, and wrote nothing more
        for ts in stored:
            with kv.load(ts) as views:
                assert [bytes(v) for v in views] == pattern(kv, ts)[:len(views)]
        assert kv.match(mine) == 0                        # its blocks were never published
        # nor their names (written before the publish, with the same freshness
        # checks): every stored block is still named by its own hash
        from cxlkv.kv import journal

        state = journal.JournalReader(pool).poll().records
        named = {bytes(r["name"][:int(r["name_len"])]) for r in state}
        for ts in stored:
            present = kv.match(ts) // 16
            assert set(kv.block_hashes(ts)[:present]) <= named
        wait_for(lambda: freed(rack.path, w), what="the writer's quarantine to end")
    w.close()
    assert_clean(rack.path)


def test_writer_paused_before_its_names_cannot_rename_others_blocks(rack, remote_env):
    """Paused after its copy, before writing its blocks' names: fenced, its
    entries reaped and reused by other stores; resumed, it writes no name
    over theirs (the names are written with the payloads' freshness checks)."""
    from cxlkv.kv import journal, names

    w = NodeProc(env=remote_env(CXLKV_PAUSE_AT="kv.naming:1", **rack.env))
    w.attach(rack.path)
    assert "ns" in w.call(op="kv_open", args=KV_ARGS)
    mine = toks(1, 8)
    w.send(op="kv_store", tokens=mine.tolist())          # stops before its names
    wait_for(lambda: stopped(w), what="the writer to stop at kv.naming")
    with cxlkv.open_pool(rack.path) as pool:
        kv = pool.kv(**KV_ARGS)
        wait_for(lambda: fenced(rack.path, w), what="the writer to be fenced")
        wait_for(lambda: freed(rack.path, w), what="the writer's quarantine to end")
        stored = []
        for t in range(2, 40):                            # its entries go to other blocks
            ts = toks(t, 4)
            kv.store(ts, b"".join(pattern(kv, ts)))
            stored.append(ts)
        nm = names.Names.of(pool)
        table = nm.table, nm.nslots * nm.entry_size
        pool.mapping.invalidate(*table)
        before = pool.mapping.read(*table)
        os.kill(w.p.pid, signal.SIGCONT)
        r = w.reply()
        assert r.get("error") == "NodeFenced", r
        pool.mapping.invalidate(*table)
        assert pool.mapping.read(*table) == before        # not a byte of names written
        assert kv.match(mine) == 0
        state = journal.JournalReader(pool).poll().records
        assert (state["name_len"] > 0).all()              # every published block named
        named = {bytes(r["name"][:int(r["name_len"])]) for r in state}
        assert not set(kv.block_hashes(mine)) & named     # none by the paused writer's hashes
        for ts in stored:
            present = kv.match(ts) // 16
            assert set(kv.block_hashes(ts)[:present]) <= named
    w.close()
    assert_clean(rack.path)


# -- 3. a lock holder paused inside its critical section ----------------------------------

@pytest.mark.parametrize("guard", [True, False], ids=["guard-mid-section", "at-the-end"])
def test_lock_holder_paused_is_told_and_the_lock_keeps_being_granted(rack, remote_env, guard):
    h = rack.node(remote_env)
    assert h.call(op="lock") == {"locked": True}
    os.kill(h.p.pid, signal.SIGSTOP)
    with cxlkv.open_pool(rack.path) as pool:
        with pool.lock(timeout=30):                       # granted once the holder is fenced
            assert fenced(rack.path, h)
        os.kill(h.p.pid, signal.SIGCONT)
        if guard:                                         # mid-section: the guard says so
            assert h.call(op="guard").get("error") == "LockLost"
        r = h.call(op="unlock")                           # and the end of the section too
        assert r.get("error") == "LockLost", r
        for _ in range(20):                               # its late release blocked nothing
            with pool.lock(timeout=10):
                pass
        other = rack.node(remote_env)
        for _ in range(3):
            assert other.call(op="lock", timeout=10) == {"locked": True}
            assert other.call(op="unlock") == {"unlocked": True}
        other.close()
        wait_for(lambda: freed(rack.path, h), what="the holder's quarantine to end")
    h.close()
    assert_clean(rack.path)


# -- 4. a fenced node resuming straight into close() --------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_fenced_node_closing_leaves_the_slots_new_owner_alone(pool_path, mode, monkeypatch,
                                                               remote_env):
    rack = Rack(pool_path, mode, monkeypatch, max_nodes=3)
    try:
        with cxlkv.open_pool(rack.path) as pool:          # node 1 of 3: the reaper
            kv = pool.kv(**KV_ARGS)
            a = rack.node(remote_env)                     # node 2 of 3: will stall
            filler = rack.node(remote_env)                # node 3 of 3
            os.kill(a.p.pid, signal.SIGSTOP)
            a.send(op="exit")                             # what it does first on resuming
            wait_for(lambda: freed(rack.path, a), what="the grace to end the quarantine")
            filler.close()
            c = rack.node(remote_env)                     # a new owner of a's slot...
            if c.slot != a.slot:                          # (the free slots: a's and filler's)
                c2 = rack.node(remote_env)
                c.close()
                c = c2
            assert c.slot == a.slot and c.epoch > a.epoch
            ts = toks(7, 4)
            kv.store(ts, b"".join(pattern(kv, ts)))
            assert c.call(op="kv_open", args=KV_ARGS)["ns"] == kv.ns
            assert c.call(op="kv_hold", tokens=ts.tolist()) == {"blocks": 4}  # ...pins them
            os.kill(a.p.pid, signal.SIGCONT)
            assert a.reply() == {"bye": True}             # closed: must not recover c's slot
            a.p.wait(30)
            assert node_table.read_slot(pool, c.slot).state == "attached"
            kv.drop()                                     # evict everything unpinned
            assert kv.match(ts) == 4 * 16                 # c's pins held
            assert c.call(op="kv_verify", tokens=ts.tolist()) == {"blocks": 4, "bad": 0}
            assert c.call(op="kv_release") == {"released": True}
            c.close()
        assert_clean(rack.path)
    finally:
        rack.close()


# -- 5. a reader paused while it holds views ------------------------------------------------

@pytest.mark.parametrize("past_grace", [False, True], ids=["within-grace", "past-grace"])
def test_reader_paused_with_views_keeps_its_pins_and_is_told(rack, remote_env, past_grace):
    """Within the grace its pins hold (quarantined) and the release says nothing
    changed; past it they went with the quarantine, and the release names the
    views that went stale."""
    with cxlkv.open_pool(rack.path) as pool:
        kv = pool.kv(**KV_ARGS)
        ts = toks(3, 4)
        kv.store(ts, b"".join(pattern(kv, ts)))
        r = rack.node(remote_env)
        r.call(op="kv_open", args=KV_ARGS)
        assert r.call(op="kv_hold", tokens=ts.tolist()) == {"blocks": 4}
        os.kill(r.p.pid, signal.SIGSTOP)
        wait_for(lambda: (freed if past_grace else fenced)(rack.path, r),
                 what="the reader to be fenced (past the grace: freed)")
        kv.drop()
        assert kv.match(ts) == (0 if past_grace else 4 * 16)
        os.kill(r.p.pid, signal.SIGCONT)
        out = r.call(op="kv_release")
        told = "[0, 1, 2, 3]" if past_grace else "none of them changed"
        assert out.get("error") == "StaleViews" and told in out["message"], out
        wait_for(lambda: freed(rack.path, r), what="the reader's quarantine to end")
        if not past_grace:
            kv.drop()                                     # now they may go
            assert kv.match(ts) == 0
    r.close()
    assert_clean(rack.path)


# -- 6. a reaper paused in the middle of a dead node's recovery ------------------------------

def reaper_stopped_recovering(rack: Rack, remote_env, site: str, nb: int, left_by_d: str):
    """Node D leaves memory for its recovery and dies - slots of nb bytes
    reserved and unpublished ("reserved": 4, or 2 of a MiB and more), or an
    empty slab of several chunks, dirty ("dirty-slab") - then node R attaches
    (and so recovers D), stopping itself at crash point `site`.
    Returns (D, D's offsets, R) once R is stopped."""
    d = rack.node(remote_env)
    if left_by_d == "reserved":
        left = d.call(op="alloc_publish", nbytes=nb, reserved=4 if nb < MiB else 2,
                      published=0)["reserved"]
    else:
        left = d.call(op="alloc_publish", nbytes=nb, reserved=1, published=0)["reserved"]
        assert d.call(op="free_all", offsets=left, zero=False) == {"freed": 1}
    d.kill()
    r = NodeProc(env=remote_env(CXLKV_PAUSE_AT=site))
    r.attach(rack.path)
    try:
        wait_for(lambda: stopped(r), what=f"the reaper to stop at {site} recovering D")
    except BaseException:
        r.close()
        raise
    return d, left, r


@pytest.mark.parametrize("site,nb,left_by_d", [
    ("free.next:2", 64 * 1024, "reserved"),        # freeing its slots: between two of them
    ("free.piece:1", MiB, "reserved"),             # zeroing the first, between two pieces
    ("release.zero:2", MiB, "dirty-slab"),         # releasing its slab: between two chunks
], ids=["free-between-slots", "free-inside-a-slot", "release-inside-a-slab"])
def test_a_reaper_paused_in_a_dead_nodes_recovery_writes_nothing_after_it(
        pool_path, monkeypatch, remote_env, site, nb, left_by_d):
    """Node R is recovering dead node D - freeing D's unpublished slots, or
    releasing D's empty slab whose chunks it must zero, under the pool lock
    in one C call - and is stopped there, past its lease.  R is fenced, its
    lock turn passes on, another reaper recovers D again and finishes the
    work, and the memory is handed out and published.  Resumed, R must write
    nothing more: the C loops stop at its stale write deadline, before a
    slot, between the pieces a slot is zeroed in, and between the chunks of
    a slab (they once went on, zeroing and freeing the new owner's memory -
    the stress run's "overwritten" payloads and their later double free)."""
    rack = Rack(pool_path, "cas", monkeypatch)
    d, left, r = reaper_stopped_recovering(rack, remote_env, site, nb, left_by_d)
    try:
        if left_by_d == "reserved":
            with Pool.open(rack.path, writable=False) as p:
                allocated = [alloc.slot_bits(p, o)[0] for o in left]
            assert allocated == [False] * (site == "free.next:2") + \
                [True] * (len(left) - (site == "free.next:2")), allocated
        with cxlkv.open_pool(rack.path) as pool:
            wait_for(lambda: fenced(rack.path, r), what="the paused reaper to be fenced")
            wait_for(lambda: freed(rack.path, d), what="D to be recovered by this node")
            data = fill_with_published(pool, nb)
            mine = list(data)
            assert set(left) <= set(mine), "D's memory was not handed out again"
            os.kill(r.p.pid, signal.SIGCONT)
            wait_for(lambda: freed(rack.path, r), what="the resumed reaper's quarantine to end")
            bad = overwritten(pool, data)
            assert bad == [], f"{len(bad)} published slots overwritten, D's among them: " \
                              f"{sorted(set(bad) & set(left))}"
            with Pool.open(rack.path, writable=False) as p:
                rep = fsck.check(p)
            assert rep.clean, [f.to_json() for f in rep.errors]
            assert pool.free_batch(mine) == len(mine)           # none freed under us
    finally:
        if r.p.poll() is None:
            os.kill(r.p.pid, signal.SIGCONT)
        r.close()
        rack.close()
    assert_clean(rack.path)


@pytest.mark.parametrize("site,left_by_d", [
    ("free.pub:1", "reserved"),                   # past the check, before zeroing D's slot
    ("release.zeroing:1", "dirty-slab"),          # past the check, before zeroing a chunk
], ids=["free-past-its-check", "release-past-its-check"])
def test_no_recovery_runs_while_a_reaper_fenced_inside_one_may_still_write(
        pool_path, monkeypatch, remote_env, site, left_by_d):
    """Node R is recovering dead node D and is stopped inside one C call
    after that call's last freshness check, before it zeroes D's slot (or a
    chunk of D's slab) - what it stores when it resumes no check can stop.
    R was fenced holding the pool lock: the lock goes on, but D's recovery
    does not run again until R's quarantine ends (R acknowledges once the
    call returned), so D's memory is handed out only after R's last write
    (it once was at once, and R's late zeroing wiped a payload published
    there: the stress run's "body does not match its checksum")."""
    nb = MiB
    rack = Rack(pool_path, "cas", monkeypatch)
    d, left, r = reaper_stopped_recovering(rack, remote_env, site, nb, left_by_d)
    try:
        with cxlkv.open_pool(rack.path) as pool:
            wait_for(lambda: fenced(rack.path, r), what="the paused reaper to be fenced")
            held = [n.slot for n in node_table.fenced_holders(pool)]
            assert held == [r.slot], held
            by = [n.slot for n in node_table.recovered_by_fenced(pool, d.slot, d.epoch)]
            assert by == [r.slot], by
            q = quarantine_report(pool)
            assert {x["slot"]: x["held_pool_lock"] for x in q["nodes"]} == \
                {r.slot: True, d.slot: False}
            dn = node_table.read_slot(pool, d.slot)
            assert dn.state == "fenced" and dn.epoch == d.epoch
            assert not node_table.release(pool, d.slot, dn.control), \
                "D recovered while R may still write into its memory"
            with pool.lock(timeout=10):         # the lock itself goes on
                pass
            data = fill_with_published(pool, nb)      # everything but D's memory
            assert not set(left) & set(data), "D's memory handed out while R is stopped"
            os.kill(r.p.pid, signal.SIGCONT)
            wait_for(lambda: freed(rack.path, r), what="the resumed reaper's quarantine to end")
            wait_for(lambda: freed(rack.path, d), what="D to be recovered after R")
            bad = overwritten(pool, data)
            assert bad == [], f"{len(bad)} published slots overwritten, D's among them: " \
                              f"{sorted(set(bad) & set(left))}"
            more = fill_with_published(pool, nb)
            assert set(left) <= set(more), "D's memory was not handed out after R's recovery"
            assert pool.free_batch(list(data) + list(more)) == len(data) + len(more)
    finally:
        if r.p.poll() is None:
            os.kill(r.p.pid, signal.SIGCONT)
        r.close()
        rack.close()
    assert_clean(rack.path)


@contextlib.contextmanager
def paused_at(rack: Rack, remote_env, site: str):
    """A node process attached to the rack's pool that stops itself
    (SIGSTOP) the Nth time it passes crash point `site` ("name:N"); resumed
    if need be and closed on exit."""
    p = NodeProc(env=remote_env(CXLKV_PAUSE_AT=site, **rack.env))
    p.attach(rack.path)
    try:
        yield p
    finally:
        if p.p.poll() is None:
            os.kill(p.p.pid, signal.SIGCONT)
        p.close()


def resume(p: NodeProc, told=("NodeFenced", "LockLost")) -> dict:
    """SIGCONT a paused node; the call it was stopped in must fail, as fenced."""
    os.kill(p.p.pid, signal.SIGCONT)
    out = p.reply()
    assert out.get("error") in told, out
    return out


def stop_in(e: NodeProc, op: str, what: str, args=KV_ARGS, **kw) -> None:
    """Open the KV cache in paused-to-be node E, send it `op` and wait until
    it stopped at its crash point in it."""
    e.call(op="kv_open", args=args)
    e.send(op=op, **kw)
    wait_for(lambda: stopped(e), what=what)


def store_leaves(kv, first: int, n: int) -> list:
    """n one-block prefixes (n leaves: one eviction batch)."""
    prefixes = [toks(first + i, 1) for i in range(n)]
    for ts in prefixes:
        kv.store(ts, b"".join(pattern(kv, ts)))
    return prefixes


def assert_intact(kv, prefixes) -> None:
    for ts in prefixes:
        with kv.load(ts) as views:
            assert len(views) == len(ts) // 16
            assert [bytes(v) for v in views] == pattern(kv, ts)


@pytest.fixture
def cas_rack(pool_path, monkeypatch):
    r = Rack(pool_path, "cas", monkeypatch)
    yield r
    r.close()
    assert_clean(r.path)


def test_an_evictor_paused_marking_its_victims_marks_no_further_entry(cas_rack, remote_env):
    """E drops a namespace: under the pool lock it marks the victims
    EVICTING in one C call and is stopped there, between two entries, past
    its lease.  Fenced, its lock turn passes on.  Resumed, E must mark no
    further entry: the loop proves E fresh before each one (it once went on
    marking the rest - other nodes' published blocks turned into misses
    until E's quarantine ended and its recovery put them back)."""
    with paused_at(cas_rack, remote_env, "kv.state.next:4") as e, \
            cxlkv.open_pool(cas_rack.path) as pool:
        kv = pool.kv(**KV_ARGS)
        prefixes = store_leaves(kv, 10, 12)
        before = kv.area.entries()["ctl"].copy()
        stop_in(e, "kv_drop", "the evictor to stop between two victims")
        wait_for(lambda: fenced(cas_rack.path, e), what="the paused evictor to be fenced")
        with pool.lock():                           # its turn passed on
            pass
        resume(e)
        wait_for(lambda: freed(cas_rack.path, e), what="the evictor's quarantine to end")
        changed = np.flatnonzero(kv.area.entries()["ctl"] != before)
        # the 3 marked before the stop (put back by E's recovery), no more
        assert len(changed) == 3, f"{len(changed)} entries changed: {changed.tolist()}"
        assert_intact(kv, prefixes)


def test_a_node_paused_purging_tombstones_writes_no_further_slot(cas_rack, remote_env):
    """E turns tombstones back into EMPTY slots (pool lock held, one C call
    over the table's clusters) and is stopped between two of them, past its
    lease.  Fenced, its lock turn passes on.  Resumed, its view of the
    clusters is stale (a tombstone may hold another node's entry by then):
    it must write no further slot, and its recovery recounts the header."""
    args = {"model": "purge", "block_bytes": 1024, "block_tokens": 16}
    with paused_at(cas_rack, remote_env, "kv.purge.next:2") as e, \
            cxlkv.open_pool(cas_rack.path) as pool:
        kv = pool.kv(**args)
        prefixes = store_leaves(kv, 20, int(kv.area.nslots * 0.3))
        # tombstones no live entry's probe path crosses, as removals leave
        # them when the entries after them go too: EMPTY slots followed by
        # an EMPTY one, turned into tombstones (and counted)
        a = kv.area
        with pool.lock():
            ctl = a.entries()["ctl"]
            empty = (ctl & 0xFF) == layout.KV_EMPTY
            ends = np.flatnonzero(empty & np.roll(empty, -1))[::7][:24]
            for i in ends.tolist():
                off = a.table + i * layout.HASH_ENTRY_SIZE
                a.m.store64(off, layout.KV_TOMBSTONE | (((int(ctl[i]) >> 8) + 1) << 8))
                a.m.flush(off, 8)
            a.set_hdr(tombstones=a.header().tombstones + len(ends))
        assert len(ends) == 24
        stop_in(e, "kv_purge", "the purger to stop between two tombstones", args=args)
        wait_for(lambda: fenced(cas_rack.path, e), what="the paused purger to be fenced")
        before = a.entries()["ctl"].copy()
        with pool.lock():                           # its turn passed on
            pass
        resume(e)
        wait_for(lambda: freed(cas_rack.path, e), what="the purger's quarantine to end")
        changed = np.flatnonzero(a.entries()["ctl"] != before)
        assert len(changed) == 0, f"{len(changed)} slots written after the fencing"
        assert_intact(kv, prefixes)


def test_a_node_paused_rebuilding_the_lru_lists_relinks_nothing_after_it(cas_rack, remote_env):
    """E relinks every leaf of the table into the LRU lists (a recount, pool
    lock held) and is stopped between sorting the leaves and writing the
    links, past its lease.  Fenced, its lock turn passes on; this node
    stores and evicts, which rebuilds the lists E left dirty.  Resumed, E
    must not write its stale links over them."""
    with paused_at(cas_rack, remote_env, "kv.lru.rebuild:1") as e, \
            cxlkv.open_pool(cas_rack.path) as pool:
        kv = pool.kv(**KV_ARGS)
        prefixes = store_leaves(kv, 30, 40)
        stop_in(e, "kv_recount", "the node to stop in its rebuild")
        wait_for(lambda: fenced(cas_rack.path, e), what="the paused node to be fenced")
        prefixes += store_leaves(kv, 70, 40)        # new leaves, linked by this node
        with pool.lock():
            assert kv.area.evict(need_entries=16)[0] == 16
        with pool.lock():                           # no recovery of E meanwhile
            assert kv.area.m.kv_lru_check()[0] == 0
            resume(e)
            problems, first, _, _ = kv.area.m.kv_lru_check()
            assert problems == 0, f"{problems} problems in the LRU lists ({first})"
        wait_for(lambda: freed(cas_rack.path, e), what="the node's quarantine to end")
        assert_intact(kv, [ts for ts in prefixes if kv.match(ts)])
        assert sum(kv.match(ts) == 16 for ts in prefixes) == 80 - 16


def test_an_evictor_paused_marking_its_frees_marks_no_slot_after_its_recovery(
        cas_rack, remote_env):
    """E drops a namespace: it marks its victims EVICTING, then marks their
    slots "free begun" in one C call and is stopped there, between two
    slots, past the grace: its quarantine ends, its recovery finishes the
    two frees it marked and publishes the other victims again.  Resumed, E
    must mark no further slot: each is a published block again, and a
    begun-free mark on it would have its owner's recovery free it."""
    with paused_at(cas_rack, remote_env, "slot.bits.next:3") as e, \
            cxlkv.open_pool(cas_rack.path) as pool:
        kv = pool.kv(**KV_ARGS)
        prefixes = store_leaves(kv, 50, 12)
        stop_in(e, "kv_drop", "the evictor to stop between two slots")
        wait_for(lambda: freed(cas_rack.path, e), what="the evictor's quarantine to end")
        left = [ts for ts in prefixes if kv.match(ts)]
        assert len(left) == 10
        resume(e)
        t = kv.area.entries()
        pub = t[(t["ctl"] & 0xFF) == layout.KV_PUBLISHED]
        with Pool.open(cas_rack.path, writable=False) as p:
            marked = [int(o) for o in pub["payload"] if alloc.slot_bits(p, int(o))[2]]
        assert marked == [], f"{len(marked)} published slots marked free-begun"
        assert_intact(kv, left)


def test_a_reader_paused_pinning_past_the_grace_pins_nothing_in_its_slots_next_holder(
        pool_path, monkeypatch, remote_env):
    """E pins a prefix's blocks (one C call, a record per block in its
    slot's pin area) and is stopped between two of them past the grace: its
    quarantine ends, its pins are cleared and its slot goes to a new node N,
    which pins the same blocks in that area.  Resumed, E must pin nothing
    more: a record it wrote there would be a pin nobody owns, keeping the
    block from eviction for as long as N lives."""
    rack = Rack(pool_path, "cas", monkeypatch, max_nodes=2)     # N must take E's slot
    try:
        with paused_at(rack, remote_env, "kv.pin.next:3") as e, \
                cxlkv.open_pool(rack.path) as pool:
            kv = pool.kv(**KV_ARGS)
            ts = toks(60, 4)
            kv.store(ts, b"".join(pattern(kv, ts)))
            stop_in(e, "kv_hold", "the reader to stop between two pins", tokens=ts.tolist())
            wait_for(lambda: freed(rack.path, e), what="the reader's quarantine to end")
            assert len(kv.area.pinned()) == 0
            n = rack.node(remote_env)
            try:
                assert n.slot == e.slot, (n.slot, e.slot)
                n.call(op="kv_open", args=KV_ARGS)
                assert n.call(op="kv_hold", tokens=ts.tolist()) == {"blocks": 4}
                resume(e, told=("NodeFenced", "LockLost", "StaleViews"))
                assert n.call(op="kv_release") == {"released": True}
            finally:
                n.close()
            left = kv.area.pinned()
            assert len(left) == 0, f"entries {left.tolist()} still pinned by nobody"
            with pool.lock():
                assert kv.area.evict(need_entries=4)[0] == 4       # nothing holds them
    finally:
        rack.close()
    assert_clean(rack.path)


def test_a_node_paused_making_a_slab_does_not_make_it_over_another_nodes(cas_rack, remote_env):
    """Stopped past its lease between finding free chunks and writing the new
    slab's descriptors (pool lock held): fenced, the lock goes on, another
    node makes its slabs there.  Resumed, it writes nothing and is told."""
    with paused_at(cas_rack, remote_env, "slab.search:1") as r:
        r.send(op="alloc_publish", nbytes=64 * 1024, reserved=0, published=1)
        wait_for(lambda: stopped(r), what="the node to stop making its slab")
        with cxlkv.open_pool(cas_rack.path) as pool:
            wait_for(lambda: fenced(cas_rack.path, r), what="the paused node to be fenced")
            data = fill_with_published(pool, 64 * 1024)
            mine = list(data)
            resume(r)
            wait_for(lambda: freed(cas_rack.path, r), what="the resumed node's quarantine to end")
            assert overwritten(pool, data) == []
            assert_clean(cas_rack.path)
            assert pool.free_batch(mine) == len(mine)


def test_a_writer_paused_in_a_long_write_past_the_grace_writes_no_further_piece(
        cas_rack, remote_env):
    """Stopped in the middle of writing 4 MiB into its reserved slot, for
    longer than the grace: its quarantine ends, the slot is freed and handed
    out again.  Resumed, it writes nothing more than the piece it was in
    (writes go in 1 MiB pieces, the deadline checked between them)."""
    nb = 4 * MiB
    with paused_at(cas_rack, remote_env, "write.piece:1") as r:
        r.send(op="alloc_publish", nbytes=nb, reserved=1, published=0)
        wait_for(lambda: stopped(r), what="the writer to stop between two pieces")
        with cxlkv.open_pool(cas_rack.path) as pool:
            wait_for(lambda: freed(cas_rack.path, r), what="the writer's quarantine to end")
            data = fill_with_published(pool, nb)
            mine = list(data)
            resume(r, told=("NodeFenced",))
            bad = overwritten(pool, data)
            assert bad == [], f"{len(bad)} of {len(mine)} published slots overwritten"
            assert pool.free_batch(mine) == len(mine)


# -- the node side: guard, acknowledgement, the C copy deadline -----------------------------

def test_guard_beats_when_stale_and_acknowledges_fencing(small_pool):
    with cxlkv.open_pool(small_pool, heartbeat=False) as pool:
        node = pool.node
        hb = layout.field_offset(layout.NodeStruct, "heartbeat")
        before = pool.mapping.load64(node_table.node_offset(pool, node.slot) + hb)
        node.guard()                                       # fresh: no beat
        assert pool.mapping.load64(node_table.node_offset(pool, node.slot) + hb) == before
        node._deadline_ns = 0                              # as after a stall
        node.guard()                                       # stale: it beats, and is fresh
        assert pool.mapping.load64(node_table.node_offset(pool, node.slot) + hb) == before + 1
        with Pool.open(small_pool) as other:               # fenced by another party
            assert node_table.fence(other, node.slot, node.control)
            node.enter()                                   # a section in flight
            node._deadline_ns = 0
            with pytest.raises(node_table.NodeFenced):
                node.guard()
            assert not node_table.read_slot(other, node.slot).acknowledged   # not while in flight
            node.leave()
            n = node_table.read_slot(other, node.slot)
            assert n.state == "fenced" and n.acknowledged
            assert node_table.Observer(other).release_reason(n) == "acknowledged"
            with pytest.raises(node_table.NodeFenced):
                node.enter()


def test_copies_stop_at_the_write_deadline(small_pool):
    with cxlkv.open_pool(small_pool, heartbeat=False) as pool:
        offs = pool.alloc_batch(4096, 4)
        m = pool.mapping
        src = bytes(range(256)) * 64
        m.write_deadline_ns = 2                            # long past
        assert m.write_blocks(offs, src, 4096) == 0
        assert all(m.read(int(o), 4096) == bytes(4096) for o in offs)
        m.write_deadline_ns = 0                            # none
        assert m.write_blocks(offs, src, 4096) == 4
        assert m.read(int(offs[3]), 4096) == src[3 * 4096:]


_DEADLINE_RUN = """
import os, sys, time
import numpy as np
from cxlkv import _core
path = sys.argv[1]
fd = os.open(path, os.O_RDWR)
m = _core.Mapping(fd, os.path.getsize(path))
os.close(fd)
offs = np.arange(16, dtype=np.uint64) * 4096
src = bytes(range(256)) * 256
span = 30_000_000                           # the deadline, 30 ms ahead
d = time.monotonic_ns() + span
m.write_deadline_ns = d
calls = 0
while True:
    t0 = time.monotonic_ns()
    n = m.write_blocks(offs, src, 4096)
    calls += 1
    if n < len(offs):
        break
    # a copy that began after the deadline must not have written anything
    assert t0 <= d, ("wrote past the deadline", t0 - d)
early = d - t0
assert early <= span // 50, ("stopped too early", early)   # the TSC's margin is 1 %
# the guard's check agrees with the copies' from then on: stale, so it beats
# (a copy stopped at once and called again with the same deadline would spin)
assert not m.node_fresh(8 * 1024 * 16, 0, d)
# and while the copies go on, it says fresh
d2 = time.monotonic_ns() + span
m.write_deadline_ns = d2
assert m.write_blocks(offs, src, 4096) == len(offs) and m.node_fresh(8 * 1024 * 16, 0, d2)
print(_core.cpu_info()["deadline_clock"], calls)
"""


@pytest.mark.parametrize("clock", ["auto", "clock"])
def test_a_near_deadline_ends_copies_on_time_with_either_clock(tmp_path, clock):
    """A deadline 30 ms ahead: copies go on until it, none starts after it,
    and they stop no more than 2 % of it early, and the guard's freshness
    check (node_fresh) says stale as soon as they stop - checked with the
    TSC where the host allows it (auto) and with clock_gettime."""
    p = tmp_path / "m.bin"
    with open(p, "wb") as f:
        f.truncate(1 << 20)
    r = subprocess.run([sys.executable, "-c", _DEADLINE_RUN, str(p)], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "CXLKV_DEADLINE_CLOCK": clock})
    assert r.returncode == 0, r.stderr
    used, calls = r.stdout.split()
    assert int(calls) > 1
    if clock == "clock":
        assert used == "clock"
    else:
        with open("/sys/devices/system/clocksource/clocksource0/current_clocksource") as f:
            if f.read().strip() != "tsc":
                assert used == "clock"


def test_frees_stop_at_the_write_deadline_and_free_batch_goes_on_once_fresh(small_pool):
    with cxlkv.open_pool(small_pool, heartbeat=False) as pool:
        m = pool.mapping
        offs = pool.alloc_batch(4096, 4)
        for o in offs:
            m.write(int(o), b"x" * 4096)
        # as after a stall; without the guard that every write primitive calls
        # on entry once the deadline passed (it would beat), the loop is seen
        m.set_guard(None)
        pool.node._deadline_ns = 0
        m.write_deadline_ns = 2                            # long past
        assert m.slab_free(offs, True, pool.node.owner_token) == 0
        assert m.slab_free(offs, True, 0) == 0
        assert [alloc.slot_bits(pool, int(o))[0] for o in offs] == [True] * 4
        assert all(m.read(int(o), 4096) == b"x" * 4096 for o in offs)
        # free_batch: stopped, guard() beats (the node is stale, not fenced), on it goes
        assert pool.free_batch(offs) == 4
        assert [alloc.slot_bits(pool, int(o))[0] for o in offs] == [False] * 4
        assert m.write_deadline_ns > 2
        assert all(m.read(int(o), 4096) == bytes(4096) for o in offs)
        m.set_guard(pool.node.guard)


def test_quarantine_ends_only_when_gone_acknowledged_or_after_the_grace(small_pool):
    clock = type("Clock", (), {"t": 100.0, "__call__": lambda self: self.t})()
    with Pool.open(small_pool) as p:
        obs = node_table.Observer(p, clock=clock, boot_id="00000000-0000-0000-0000-00000000abcd")
        fake_node(small_pool, 2, pid=1, start_time_ns=1,
                  boot_id="00000000-0000-0000-0000-000000000002", hostname="elsewhere")
        n = node_table.read_slot(p, 2)
        assert node_table.fence(p, 2, n.control)
        n = node_table.read_slot(p, 2)
        assert obs.release_reason(n) is None               # first seen fenced now
        clock.t += p.sb.quarantine_grace_ms / 1000 * 0.9
        assert obs.release_reason(n) is None
        clock.t += p.sb.quarantine_grace_ms / 1000 * 0.2
        assert obs.release_reason(n) == "grace"


# -- 6. corrupt lock words fail fast --------------------------------------------------------

@pytest.mark.parametrize("word", ["now_serving", "next_ticket"])
def test_a_flipped_high_bit_in_the_ticket_words_is_an_error_not_a_spin(small_pool, word):
    with cxlkv.open_pool(small_pool, heartbeat=False) as pool:
        with pool.lock():
            pass
        hdr, _ = locks.lock_offsets(pool)
        off = hdr + layout.field_offset(layout.LockHdrStruct, word)
        good = pool.mapping.load64(off)
        pool.mapping.store64(off, good | 1 << 40)
        with pytest.raises(PoolCorrupt, match="fsck --repair"):
            with pool.lock(timeout=10):
                pass
        pool.mapping.store64(off, good)


# -- what a quarantine holds, as operators see it ----------------------------------------

def test_inspect_health_and_fsck_show_a_quarantine(pool_path, monkeypatch, remote_env, cli):
    rack = Rack(pool_path, "cas", monkeypatch, grace_ms=60_000)
    with cxlkv.open_pool(rack.path):                          # the reaper
        w = NodeProc(env=remote_env(CXLKV_PAUSE_AT="kv.reserved:1"))
        w.attach(rack.path)
        w.call(op="kv_open", args=KV_ARGS)
        w.send(op="kv_store", tokens=toks(1, 3).tolist())    # stops holding 3 reservations
        wait_for(lambda: stopped(w), what="the writer to stop")
        wait_for(lambda: fenced(rack.path, w), what="the writer to be fenced")
        doc = cli("inspect", "--pool", rack.path, "--json").json()["pool"]["quarantine"]
        assert [(x["slot"], x["reserved_slots"], x["pending_entries"], x["acknowledged"])
                for x in doc["nodes"]] == [(w.slot, 3, 3, False)]
        assert doc["bytes"] == 3 * BLOCK and doc["grace_ms"] == 60_000
        assert "quarantine" in cli("inspect", "--pool", rack.path).out
        r = cli("health", "--pool", rack.path, "--json")
        assert r.code == 1, r.out                             # WARNING
        checks = {c["check"]: c for c in r.json()["checks"]}
        assert checks["quarantine"]["status"] == "WARNING"
        assert f"node {w.slot}" in checks["quarantine"]["text"]
        r = cli("fsck", "--pool", rack.path, "--json")
        assert r.code == 0 and "node-quarantined" in {f["code"] for f in r.json()["findings"]}
        os.kill(w.p.pid, signal.SIGCONT)                      # it resumes, is told, acknowledges
        assert w.reply().get("error") == "NodeFenced"
        wait_for(lambda: freed(rack.path, w), what="the quarantine to end (acknowledged)")
        assert cli("inspect", "--pool", rack.path, "--json").json()["pool"]["quarantine"] == \
            {"nodes": [], "grace_ms": 60_000, "bytes": 0}
    w.close()
    assert_clean(rack.path)


def test_a_paused_lock_manager_steps_down_when_it_resumes(pool_path, monkeypatch):
    """The active manager stalls: a standby takes over after a lease, the lock
    keeps being granted, and the old one steps down when it resumes instead of
    granting too (sync mode manager under the emulation)."""
    rack = Rack(pool_path, "manager-nc", monkeypatch)
    standby = subprocess.Popen([sys.executable, "-m", "cxlkv", "lock-manager", "--pool",
                                rack.path, "--standby"], stderr=subprocess.PIPE, text=True,
                               env={**os.environ, **rack.env})
    try:
        with cxlkv.open_pool(rack.path) as pool:
            os.kill(rack.manager.pid, signal.SIGSTOP)
            assert "active" in standby.stderr.readline()        # took over after a lease
            for _ in range(10):
                with pool.lock(timeout=10):
                    pass
            os.kill(rack.manager.pid, signal.SIGCONT)
            rack.manager.wait(30)
            assert "stepping down" in rack.manager.stderr.read()
            for _ in range(10):
                with pool.lock(timeout=10):
                    pass
            assert standby.poll() is None
    finally:
        standby.terminate()
        standby.wait(10)
        rack.close()
    assert_clean(rack.path)


def test_a_manager_paused_in_a_recovery_writes_nothing_after_its_standby_took_over(
        pool_path, remote_env):
    """Sync mode manager: the active lock manager recovers dead node D -
    freeing D's unpublished slots in one C call - and is stopped between two
    of them.  The standby takes over after a lease, recovers D again, and the
    slots are handed out and published.  Resumed, the old manager writes
    nothing more (its recovery runs under a write deadline half a lease after
    its last beat; the guard then finds the lease gone) and steps down."""
    init_pool(pool_path, {"size": 16 * MiB, "chunk_size": 256 * 1024, "max_nodes": 8,
                          "sync": "manager", "lease_ms": LEASE_MS, "grace_ms": GRACE_MS})
    cmd = [sys.executable, "-m", "cxlkv", "lock-manager", "--pool", pool_path]
    old = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "CXLKV_PAUSE_AT": "free.next:2"})
    assert "active" in old.stderr.readline()
    standby = subprocess.Popen(cmd + ["--standby"], stderr=subprocess.PIPE, text=True)
    d = NodeProc(env=remote_env())
    try:
        d.attach(pool_path)
        left = d.call(op="alloc_publish", nbytes=64 * 1024, reserved=4,
                      published=0)["reserved"]
        d.kill()
        wait_for(lambda: psutil.Process(old.pid).status() == psutil.STATUS_STOPPED,
                 what="the manager to stop between D's slots")
        lines = [standby.stderr.readline()]             # "standing by ...", then
        while lines[-1] and "active" not in lines[-1]:   # took over after a lease
            lines.append(standby.stderr.readline())
        assert "active" in lines[-1], lines
        with cxlkv.open_pool(pool_path) as pool:
            wait_for(lambda: freed(pool_path, d), what="the standby to recover D")
            data = fill_with_published(pool, 64 * 1024)
            mine = list(data)
            assert set(left) <= set(mine), "D's slots were not handed out again"
            os.kill(old.pid, signal.SIGCONT)
            old.wait(30)
            assert "stepping down" in old.stderr.read()
            bad = overwritten(pool, data)
            assert bad == [], f"{len(bad)} published slots overwritten"
            assert pool.free_batch(mine) == len(mine)
    finally:
        for p in (old, standby):
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.terminate()
                p.wait(10)
    assert_clean(pool_path)


def test_a_manager_stopped_past_its_check_in_a_recovery_holds_up_its_successors_recoveries(
        pool_path, remote_env):
    """Sync mode manager: the active lock manager recovers dead node D and is
    stopped inside the C call that frees D's slots, past its freshness check,
    before it zeroes the first (what it stores when it resumes no check can
    stop).  The standby takes over, sees that its predecessor stopped in a
    recovery (mgr_recovering) and recovers nobody until it is gone (or the
    grace passed: a minute here); only then is D's memory handed out."""
    init_pool(pool_path, {"size": 16 * MiB, "chunk_size": 256 * 1024, "max_nodes": 8,
                          "sync": "manager", "lease_ms": LEASE_MS, "grace_ms": 60_000})
    cmd = [sys.executable, "-m", "cxlkv", "lock-manager", "--pool", pool_path]
    old = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "CXLKV_PAUSE_AT": "free.pub:1"})
    assert "active" in old.stderr.readline()
    standby = subprocess.Popen(cmd + ["--standby"], stderr=subprocess.PIPE, text=True)
    d = NodeProc()           # of this host: recovered as soon as it is gone
    try:
        d.attach(pool_path)
        left = d.call(op="alloc_publish", nbytes=MiB, reserved=2, published=0)["reserved"]
        d.kill()
        wait_for(lambda: psutil.Process(old.pid).status() == psutil.STATUS_STOPPED,
                 what="the manager to stop before zeroing D's slot")
        lines = [standby.stderr.readline()]
        while lines[-1] and "active" not in lines[-1]:
            lines.append(standby.stderr.readline())
        assert "stopped in a recovery" in "".join(lines), lines
        with cxlkv.open_pool(pool_path) as pool:
            assert slot_state(pool_path, d.slot).state == "fenced"
            data = fill_with_published(pool, MiB)
            assert not set(left) & set(data), "D's memory handed out while the manager is stopped"
            os.kill(old.pid, signal.SIGCONT)
            old.wait(30)
            assert "stepping down" in old.stderr.read()
            line = standby.stderr.readline()
            assert "recovering nodes again" in line and "gone" in line, line
            wait_for(lambda: freed(pool_path, d), what="the standby to recover D")
            bad = overwritten(pool, data)
            assert bad == [], f"{len(bad)} published slots overwritten"
            more = fill_with_published(pool, MiB)
            assert set(left) <= set(more), "D's memory was not handed out after the old manager"
            assert pool.free_batch(list(data) + list(more)) == len(data) + len(more)
    finally:
        for p in (old, standby):
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.terminate()
                p.wait(10)
    assert_clean(pool_path)


def test_hash_table_inserts_stop_at_the_write_deadline(small_pool):
    """kv_insert writes no entry once the node's freshness ran out (a stall in
    the middle of a long prefix); the store proves it fresh and carries on."""
    with cxlkv.open_pool(small_pool, heartbeat=False) as pool:
        kv = pool.kv(model="deadline", block_bytes=4096, block_tokens=16)
        a, m = kv.area, pool.mapping
        keys = kv.keys_for_hashes([bytes([i]) * 16 for i in range(4)])
        pay = pool.alloc_batch(4096, 4)
        slots, status = np.zeros(4, dtype=np.uint64), np.zeros(4, dtype=np.uint64)
        with pool.lock():
            m.write_deadline_ns = 2                          # long past, as after a stall
            done, used, full = m.kv_insert(a.table, a.nslots, a.hdr, a.max_used, kv.ns,
                                           kv.tenant, 4096, pool.node.owner_token, keys, 0,
                                           pay, slots, status)
            assert (done, used, full) == (0, 0, 4)
            assert a.header().live == 0
        pool.node._deadline_ns = 0                           # stale, not fenced
        pool.free_batch(pay)
        toks_ = np.arange(64, dtype=np.int64)
        assert kv.store(toks_, b"".join(pattern(kv, toks_))) == 4
        with kv.load(toks_) as views:
            assert [bytes(v) for v in views] == pattern(kv, toks_)


# -- review regressions -------------------------------------------------------------------

def test_a_fenced_waiter_never_takes_the_pool_lock(pool_path, monkeypatch, tmp_path):
    """F waits for the lock and is fenced meanwhile: when its turn comes it
    must not take the lock (its turn is skipped), and the lock goes on."""
    import threading

    from cxlkv.ops.stress import make_host_root

    init_pool(pool_path, {"size": 16 * MiB, "chunk_size": 256 * 1024, "max_nodes": 8,
                          "lease_ms": 10_000})
    # three nodes as three hosts: f waits for its ticket, not behind h in
    # their host's lock (tests/test_hostlock.py has a fenced host-lock waiter)
    nodes = []
    for _ in range(3):
        monkeypatch.setenv("CXLKV_PROCFS_ROOT", make_host_root(tmp_path)[0])
        nodes.append(cxlkv.open_pool(pool_path, heartbeat=False))
    monkeypatch.delenv("CXLKV_PROCFS_ROOT")
    h, f, w = nodes
    try:
        lk = h.lock()
        lk.acquire()
        got = {}

        def wait_f():
            try:
                f.lock().acquire()
                got["f"] = "acquired"
            except node_table.NodeFenced:
                got["f"] = "fenced"

        t = threading.Thread(target=wait_f)
        t.start()
        wait_for(lambda: locks.read_entries(h)["state"][f.node.slot] == layout.LOCK_WAITING,
                 what="f to wait for its turn")
        assert node_table.fence(h, f.node.slot, f.node.control)     # a reaper fences it
        lk.release()                                         # f's turn comes up
        t.join(30)
        assert got == {"f": "fenced"}
        with w.lock(timeout=10):
            assert locks.describe_owner(w).startswith(f"node {w.node.slot} ")
    finally:
        for p in (w, f, h):
            p.close()


def test_a_fresh_node_fenced_by_a_late_reaper_stops_at_its_next_guard(small_pool):
    """A reaper that judged the node on a read from before its last beat fences
    it while it still counts itself fresh: guard() re-reads the state word."""
    with cxlkv.open_pool(small_pool, heartbeat=False) as pool:
        pool.node.guard()                                    # fresh
        with Pool.open(small_pool) as reaper:
            assert node_table.fence(reaper, pool.node.slot, pool.node.control)
        with pytest.raises(node_table.NodeFenced):
            pool.node.guard()


def test_the_manager_recovers_an_acknowledged_node_under_lock_contention(
        pool_path, monkeypatch, remote_env):
    """With two nodes taking the lock back to back the lock is never free at a
    slot scan: the manager holds the next grant back to end a quarantine."""
    rack = Rack(pool_path, "manager", monkeypatch, grace_ms=60_000)   # only the ack ends it
    procs = []
    try:
        f = rack.node(remote_env)
        procs.append(f)
        with Pool.open(rack.path) as p:
            off = p.region("data")[0]               # a scratch word; no allocator in use
        for _ in range(2):
            w = rack.node(remote_env)
            procs.append(w)
            w.send(op="incr", offset=off, n=10 ** 7)
        os.kill(f.p.pid, signal.SIGSTOP)
        wait_for(lambda: fenced(rack.path, f), what="f to be fenced")
        os.kill(f.p.pid, signal.SIGCONT)                    # it acknowledges at once
        wait_for(lambda: freed(rack.path, f), timeout=20,
                 what="the quarantine to end (acknowledged) while the lock is busy")
    finally:
        for p in procs:
            p.kill()
        rack.close()


def test_a_stale_verdict_does_not_fence_a_node_that_beat_meanwhile(small_pool):
    """The reaper judged the node on a heartbeat it has since advanced (the
    reaper was slow between its read and its fence): the fence is taken back
    and the node's lock turn is not passed on."""
    with cxlkv.open_pool(small_pool, heartbeat=False) as pool:
        judged = node_table.read_slot(pool, pool.node.slot)
        pool.node.beat()                                     # it lives on
        with Pool.open(small_pool) as reaper:
            assert not node_table.fence(reaper, judged.slot, judged.control, judged.heartbeat)
            assert node_table.read_slot(reaper, judged.slot).state == "attached"
        pool.node.guard()
        with pool.lock(timeout=10):
            pass
