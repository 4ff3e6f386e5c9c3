"""The pool lock in cas mode: mutual exclusion across processes, dead holders,
timeouts, fencing."""
from __future__ import annotations

import time

import pytest

import cxlkv
from cxlkv.pool import layout
from cxlkv.ops.init import init_pool
from cxlkv.api import Pool
from cxlkv.state import locks
from cxlkv.state import nodes

from cxlkv.testing.damage import fake_node
from cxlkv.testing.nodes import NodeProc, incr_together, lock_turn_gaps
from cxlkv.testing.pools import data_word

LEASE_MS = 300
FAIR_LEASE_MS = 10_000


@pytest.fixture
def lease_pool(pool_path):
    init_pool(pool_path, {"size": 8 << 20, "chunk_size": 64 << 10, "max_nodes": 8,
                          "lease_ms": LEASE_MS})
    return pool_path


@pytest.fixture
def fair_pool(pool_path):
    """For the fairness tests: a lease long enough that a loaded machine taking
    a node off the CPU for a while does not get it fenced (order is measured,
    not liveness)."""
    init_pool(pool_path, {"size": 8 << 20, "chunk_size": 64 << 10, "max_nodes": 8,
                          "lease_ms": FAIR_LEASE_MS})
    return pool_path


def test_mutual_exclusion_four_processes(lease_pool):
    off = data_word(lease_pool)
    assert incr_together(lease_pool, off, 3000) == [{"done": 3000}] * 4
    with Pool.open(lease_pool) as pool:
        assert pool.mapping.load64(off) == 4 * 3000
        hdr, _ = locks.lock_offsets(pool)
        # every ticket handed out was served (detaching takes the lock once more
        # for the allocator's recovery); nobody holds the lock
        assert pool.mapping.load64(hdr) == pool.mapping.load64(hdr + 64) >= 4 * 3000
        assert pool.mapping.load64(hdr + 72) == 0


def test_holder_killed_lock_is_broken(lease_pool):
    holder = NodeProc()
    holder.attach(lease_pool)
    assert holder.call(op="lock") == {"locked": True}
    holder.kill()                                   # dies holding the lock
    with cxlkv.open_pool(lease_pool) as pool:
        pool.node.interval = 0.02
        with pool.lock(timeout=30):
            assert locks.describe_owner(pool).startswith(f"node {pool.node.slot}")
        assert nodes.read_slot(pool, holder.slot).state == "free"


def test_remote_holder_broken_after_its_lease_never_before(lease_pool):
    # a node on another host holds ticket 0; its heartbeat never moves
    fake_node(lease_pool, 7, pid=1, start_time_ns=1, hostname="far-host",
              boot_id="00000000-0000-0000-0000-0000000000aa")
    with Pool.open(lease_pool) as p:
        hdr, _ = locks.lock_offsets(p)
        m = p.mapping
        m.store64(hdr, 1)                                     # next_ticket
        m.store64(hdr + 72, (7 + 1) | 1 << 16)                # owner
        e = locks.entry_offset(p, 7)
        m.store64(e + 8, 0)                                   # ticket 0
        m.store64(e + 16, 1)                                  # epoch 1
        m.store64(e, layout.LOCK_LOCKED)
    with cxlkv.open_pool(lease_pool) as pool:
        pool.node.interval = 0.02
        t0 = time.monotonic()
        with pytest.raises(locks.LockTimeout, match="far-host"):
            with pool.lock(timeout=LEASE_MS / 1000 / 3):
                pass
        with pool.lock(timeout=30):
            waited = time.monotonic() - t0
        assert waited >= LEASE_MS / 1000                      # not broken before the lease
        # fenced by the waiter; reaped (recovered, freed) by a heartbeat soon after
        deadline = time.monotonic() + 30
        while nodes.read_slot(pool, 7).state != "free" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert nodes.read_slot(pool, 7).state == "free"


def test_timeout_gives_the_ticket_up(lease_pool):
    a = NodeProc()
    try:
        a.attach(lease_pool)
        assert a.call(op="lock") == {"locked": True}
        with cxlkv.open_pool(lease_pool) as pool:
            with pytest.raises(locks.LockTimeout, match=f"node {a.slot}"):
                with pool.lock(timeout=0.05):
                    pass
            # a third party queues behind our abandoned ticket
            b = NodeProc()
            b.attach(lease_pool)
            b.send(op="lock", timeout=LEASE_MS / 1000 / 2)
            assert a.call(op="unlock") == {"unlocked": True}
            # our abandoned ticket is skipped at once, well within a lease
            assert b.reply() == {"locked": True}
            assert b.call(op="unlock") == {"unlocked": True}
            b.close()
            with pool.lock(timeout=5):
                pass
    finally:
        a.close()


def test_fenced_node_cannot_take_the_lock(lease_pool):
    with cxlkv.open_pool(lease_pool, heartbeat=False) as pool:
        with pool.lock():
            pass
        with Pool.open(lease_pool) as other:            # another party reaps us
            nodes.reap(other, pool.node.slot, pool.node.control)
        with pytest.raises(nodes.NodeFenced):
            with pool.lock():
                pass


def test_lock_needs_an_attached_node(lease_pool):
    with Pool.open(lease_pool) as p:
        with pytest.raises(cxlkv.CxlkvError, match="attached node"):
            p.lock()


def test_no_waiter_starves(lease_pool):
    """A ticket lock serves in order: every process gets its share."""
    off = data_word(lease_pool) + 64
    assert incr_together(lease_pool, off, 500, procs=5) == [{"done": 500}] * 5


def test_zombie_holder_is_dead(lease_pool):
    """A node process that exited but was not waited for holds nothing (found in review)."""
    import subprocess
    import sys

    z = subprocess.Popen([sys.executable, "-c", "import os, sys, cxlkv\n"
                          "p = cxlkv.open_pool(sys.argv[1]); p.lock().acquire()\n"
                          "print('locked', flush=True); os._exit(0)", lease_pool],
                         stdout=subprocess.PIPE, text=True)
    assert z.stdout.readline().strip() == "locked"
    try:
        with cxlkv.open_pool(lease_pool) as pool:
            with pool.lock(timeout=LEASE_MS / 1000 / 2):   # well before any lease
                pass
    finally:
        z.wait()


def test_close_inside_the_lock_is_refused(lease_pool):
    pool = cxlkv.open_pool(lease_pool)
    with pool.lock():
        with pytest.raises(cxlkv.CxlkvError, match="after leaving pool.lock"):
            pool.close()
    pool.close()


def test_ticket_lock_is_fair_under_contention(fair_pool, remote_env):
    """While four nodes (hosts of their own) keep asking, each gets the lock
    again within a few turns of the others: tickets are served in order,
    nobody starves."""
    t = lock_turn_gaps(fair_pool, n=200, hosts=remote_env)
    # round-robin makes the mean gap the number of nodes; a lock that lets the
    # releasing node straight back in drags it towards 1 and starves the others
    assert 3 <= t.mean_gap <= 5, f"mean gap {t.mean_gap:.2f} turns (4 nodes)"
    # in order, a request waits for the three others at most (a node taken off
    # the CPU between reading the turn counter and asking can add a few)
    assert t.wait(95) <= 4, f"waits {sorted(t.waits)[-40:]}"
    assert max(t.waits) <= 100, f"a node waited {max(t.waits)} turns while others went"


def test_processes_of_one_host_do_not_starve_behind_its_host_lock(fair_pool):
    """Four processes of one host keep asking: the host lock lets a running
    process in first (not in order), but a waiter that has waited 4 ms gets
    a hand-off, so each still gets its turns."""
    t = lock_turn_gaps(fair_pool, n=200)
    assert 2 <= t.mean_gap <= 6
    assert max(t.waits) <= 100, f"a process waited {max(t.waits)} turns while others went"
