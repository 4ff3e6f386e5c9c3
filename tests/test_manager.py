"""Sync mode manager: the lock manager, node slots granted by it, the pool lock
without cross-host atomics - also under the non-coherence emulation."""
from __future__ import annotations

import os
import time

import pytest

import cxlkv
from cxlkv.api import Pool
from cxlkv.errors import CxlkvError
from cxlkv.ops import lockmgr
from cxlkv.ops.init import init_pool
from cxlkv.state import nodes, protocol
from cxlkv.testing.nodes import Manager, NodeProc, incr_together, lock_turn_gaps
from cxlkv.testing.pools import data_word

LEASE_MS = 400
# every line cached from the start (CXLKV_NC_PRELOAD): a read never preceded by an
# invalidate sees the pool as it was when the process mapped it
NC = {"CXLKV_NONCOHERENT": "1", "CXLKV_NC_PRELOAD": "1"}


@pytest.fixture
def mpool(pool_path):
    init_pool(pool_path, {"size": 16 << 20, "chunk_size": 1 << 20, "max_nodes": 8,
                          "sync": "manager", "lease_ms": LEASE_MS})
    return pool_path


@pytest.fixture
def manager(mpool):
    mgrs = []

    def start(*args, env=None, wait=True):
        m = Manager(mpool, *args, env=env)
        mgrs.append(m)
        if wait:
            assert "active" in m.line()
        return m

    yield start
    for m in mgrs:
        m.stop()


def run_incr(path, env, op="incr_nc", n=300, procs=4, hosts=None):
    """`procs` nodes each add 1 to a pool word `n` times under the lock;
    hosts: a remote_env, to make each node a host of its own (else they are
    processes of this host, behind its host-local lock)."""
    off = data_word(path)
    replies = incr_together(path, off, n, procs, op,
                            (lambda: {**env, **hosts()}) if hosts else env)
    with Pool.open(path) as p:
        p.mapping.invalidate(off, 8)
        return replies, p.mapping.load64(off)


def test_mutual_exclusion_four_nodes(mpool, manager):
    manager()
    replies, total = run_incr(mpool, {}, op="incr")
    assert replies == [{"done": 300}] * 4 and total == 1200


def test_mutual_exclusion_under_the_noncoherence_emulation(mpool, manager):
    manager(env=NC)
    replies, total = run_incr(mpool, NC)
    assert replies == [{"done": 300}] * 4
    assert total == 1200


def test_a_forgotten_flush_is_caught(mpool, manager, remote_env):
    """The same workload with its flush and invalidate left out (op "incr")
    loses updates under the emulation: proof that the test above would catch
    a missing flush (nodes as hosts of their own, as below)."""
    manager(env=NC)
    env = {**NC, "CXLKV_NC_EVICT_EVERY": "0"}
    replies, total = run_incr(mpool, env, op="incr", n=100, hosts=remote_env)
    assert replies == [{"done": 100}] * 4
    assert total < 400


def test_a_forgotten_invalidate_is_caught(mpool, manager, remote_env):
    """The right workload (op "incr_nc": invalidate before reading the counter,
    flush after writing it) with every 3rd invalidate of each node made a
    no-op (CXLKV_NC_DROP_INVALIDATE) reads stale counters and loses updates:
    proof that the emulation catches a missing invalidate.  The nodes are
    hosts of their own (caches are per host), so the manager's turns
    alternate between them rather than a host lock's."""
    manager(env=NC)
    env = {**NC, "CXLKV_NC_EVICT_EVERY": "0", "CXLKV_NC_DROP_INVALIDATE": "3"}
    replies, total = run_incr(mpool, env, n=100, hosts=remote_env)
    assert replies == [{"done": 100}] * 4
    assert total < 400


def test_second_manager_refused(mpool, manager):
    manager()
    second = manager(wait=False)
    assert second.p.wait(30) == 1
    err = second.p.stderr.read()
    assert "already active" in err and "--standby" in err


def test_standby_takes_over_after_a_kill(mpool, manager):
    first = manager()
    standby = manager("--standby", wait=False)
    with cxlkv.open_pool(mpool) as pool:
        with pool.lock(timeout=10):
            pass
        first.p.kill()
        first.p.wait(10)
        assert standby.wait_for("active for")            # after the lease lapsed
        with pool.lock(timeout=30):                  # the new manager grants
            pass


def test_no_manager_is_a_clear_error(mpool):
    t0 = time.monotonic()
    with pytest.raises(cxlkv.CxlkvError, match="cxlkv lock-manager --pool"):
        cxlkv.open_pool(mpool)
    assert time.monotonic() - t0 < 30


def test_dead_holder_is_revoked_and_recovered(mpool, manager):
    manager()
    holder = NodeProc()
    holder.attach(mpool)
    holder.call(op="alloc_publish", nbytes=8192, reserved=2, published=1)
    assert holder.call(op="lock") == {"locked": True}
    holder.kill()
    with cxlkv.open_pool(mpool) as pool:
        with pool.lock(timeout=30):                  # revoked after the lease
            pass
        deadline = time.monotonic() + 30
        while nodes.read_slot(pool, holder.slot).state != "free" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert nodes.read_slot(pool, holder.slot).state == "free"
    from cxlkv.ops.fsck import check
    with Pool.open(mpool) as p:
        rep = check(p)
        assert rep.clean, [f.to_json() for f in rep.errors]
        assert rep.stats["allocator"]["slots_published"] == 1   # reserved ones reclaimed


def test_manager_restart_carries_on(mpool, manager):
    first = manager()
    with cxlkv.open_pool(mpool) as pool:
        with pool.lock(timeout=10):
            first.stop()                              # the manager goes while we hold it
        manager()
        with pool.lock(timeout=10):                   # the new one picked up from the pool
            pass
        assert protocol.manager_alive(pool)


def test_stress_on_a_manager_pool(mpool, cli):
    r = cli("stress", "--pool", mpool, "--nodes", "3", "--seconds", "2", "--json")
    assert r.code == 0, r.err
    doc = r.json()
    assert doc["passed"] and doc["sync"] == "manager"


def test_stress_under_the_noncoherence_emulation(mpool, cli):
    """Allocate / write / verify / free / lock across 4 node processes that each
    see the pool through their own emulated non-coherent cache, with kills."""
    r = cli("stress", "--pool", mpool, "--nodes", "4", "--seconds", "3", "--kill-rate", "1",
            "--json", env=NC)
    assert r.code == 0, r.err
    doc = r.json()
    assert doc["passed"] and doc["memory_model"] == "noncoherent-emulated"
    assert doc["ops"]["total"] > 100


def test_manager_grants_round_robin(tmp_path, remote_env):
    """Four nodes (hosts of their own) keep asking: the manager serves them in
    turn, none starves.  A long lease: order is measured, not liveness (a
    loaded machine may take a node off the CPU for longer than a short one)."""
    path = str(tmp_path / "fair.pool")
    init_pool(path, {"size": 16 << 20, "chunk_size": 1 << 20, "max_nodes": 8,
                     "sync": "manager", "lease_ms": 10_000})
    m = Manager(path)
    try:
        assert "active" in m.line()
        t = lock_turn_gaps(path, n=150, hosts=remote_env)
    finally:
        m.stop()
    assert 3 <= t.mean_gap <= 5, t
    assert t.wait(95) <= 4 and max(t.waits) <= 75, sorted(t.waits)[-40:]


def test_detach_without_a_manager_leaves_recovery_to_the_next(mpool, manager):
    first = manager()
    node = NodeProc()
    node.attach(mpool)
    node.call(op="alloc_publish", nbytes=8192, reserved=2, published=0)
    first.stop()
    node.close()                                 # no manager: warns, exits cleanly
    assert node.p.returncode == 0
    assert "recovered by the next one" in node.p.stderr.read()
    manager()                                    # the next one reaps and recovers
    with Pool.open(mpool) as p:
        deadline = time.monotonic() + 30
        while nodes.read_slot(p, node.slot).state != "free" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert nodes.read_slot(p, node.slot).state == "free"
        from cxlkv.ops.fsck import check
        rep = check(p)
        assert rep.clean and rep.stats["allocator"]["slots_allocated"] == 0


def _maps(pid: int, path: str) -> bool:
    import psutil

    try:
        return any(m.path == os.path.realpath(path) for m in psutil.Process(pid).memory_maps())
    except psutil.Error:
        return False


def test_managers_step_down_when_the_pool_is_reformatted(mpool, manager, monkeypatch):
    """A pool reformatted under its lock managers (as the runbook once let
    happen): the active one and a standby notice the new superblock and exit
    with a clear error instead of writing old-geometry words into it."""
    from cxlkv.ops import init as admin

    active = manager()
    standby = manager("--standby", wait=False)
    deadline = time.monotonic() + 30
    while not _maps(standby.p.pid, mpool):               # it has opened the old pool
        assert time.monotonic() < deadline and standby.p.poll() is None
        time.sleep(0.01)
    with monkeypatch.context() as mp:                    # the format's refusal skipped:
        mp.setattr(protocol, "manager_alive", lambda pool: False)   # no manager seen
        admin.format_pool(mpool, {"sync": "manager", "max_nodes": 64, "chunk_size": 1 << 20,
                                  "lease_ms": LEASE_MS}, force=True, observe_remote=False)
    for m in (active, standby):
        assert m.p.wait(15) == 1
        err = m.p.stderr.read()
        assert "reformatted" in err and "stepping down" in err, err
    manager()                                             # a new one serves the new pool
    with cxlkv.open_pool(mpool) as pool:
        assert pool.sb.max_nodes == 64
        with pool.lock(timeout=10):
            pass


# -- a manager for one run (cxlkv.ops.lockmgr.ensure_manager: stress, bench) ----------------
def test_a_manager_for_a_run_that_cannot_start_says_why(pool_path):
    init_pool(pool_path, {"size": 16 << 20, "chunk_size": 1 << 20, "max_nodes": 8})   # cas
    with pytest.raises(CxlkvError) as e:
        lockmgr.ensure_manager(pool_path)
    assert "sync mode 'cas'" in str(e.value) and "Traceback" not in str(e.value)


def test_a_run_uses_a_manager_started_beside_it(mpool, manager, monkeypatch):
    """An operator's manager that became active between the run's check and
    its own manager's start: the run uses it (its own stops, refused)."""
    theirs = manager()
    real, calls = lockmgr.manager_running, []

    def first_none(path):
        calls.append(path)
        return False if len(calls) == 1 else real(path)

    monkeypatch.setattr(lockmgr, "manager_running", first_none)
    started, stop = lockmgr.ensure_manager(mpool)
    assert (started, len(calls)) == (False, 2)
    stop()
    assert theirs.p.poll() is None and real(mpool)        # theirs still serves the pool
