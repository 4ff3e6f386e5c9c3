"""Node membership: attach, heartbeat, liveness, fencing, reaping."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import cxlkv
from cxlkv.errors import LiveNodesError, NodeTableFull
from cxlkv.pool import layout
from cxlkv.ops.init import format_pool
from cxlkv.api import Pool
from cxlkv.state import nodes

from cxlkv.testing.checks import wait_for
from cxlkv.testing.damage import fake_node

CHILD = """
import sys, cxlkv
pool = cxlkv.open_pool(sys.argv[1])
print(pool.node.slot, pool.node.epoch, flush=True)
sys.stdin.read()          # hold the slot until the parent closes stdin
pool.close()
print("detached", flush=True)
"""


class Child:
    """A separate process attached as its own node."""

    def __init__(self, path):
        self.p = subprocess.Popen([sys.executable, "-c", CHILD, path], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.p.stdout.readline()
        if not line:
            raise AssertionError(self.p.stderr.read())
        self.slot, self.epoch = map(int, line.split())

    def detach(self):
        self.p.stdin.close()
        assert self.p.stdout.readline().strip() == "detached"
        assert self.p.wait(30) == 0

    def kill(self):
        self.p.kill()
        self.p.wait(30)
        self.p.stdin.close()


def test_attach_detach(small_pool):
    with cxlkv.open_pool(small_pool) as pool:
        node = pool.node
        info = nodes.read_slot(pool, node.slot)
        assert info.state == "attached" and info.epoch == node.epoch >= 1
        assert info.pid == os.getpid() and info.boot_id == nodes.local_boot_id()
        assert info.sw_version.startswith("cxlkv ")
        slot = node.slot
    with Pool.open(small_pool) as p:
        assert nodes.read_slot(p, slot).state == "free"


def test_read_nodes_decodes_as_read_slot_does(small_pool):
    """The table read in one piece gives what slot-by-slot reads give; free
    slots are left out unless asked for."""
    fake_node(small_pool, 3, pid=999_999, start_time_ns=5,     # a node of another host
              boot_id="0b5e55ed-0000-4000-8000-000000000003")
    with cxlkv.open_pool(small_pool) as pool:
        every = nodes.read_nodes(pool, include_free=True)
        assert every == [nodes.read_slot(pool, i) for i in range(pool.sb.max_nodes)]
        assert nodes.read_nodes(pool) == [n for n in every if n.state != "free"]
        assert {n.slot for n in nodes.read_nodes(pool)} == {3, pool.node.slot}


def test_epoch_bumps_on_every_attach(pool_path):
    from cxlkv.ops.init import init_pool

    init_pool(pool_path, {"size": 8 << 20, "chunk_size": 64 << 10, "max_nodes": 1})
    epochs = []
    for _ in range(3):
        with cxlkv.open_pool(pool_path) as pool:
            assert pool.node.slot == 0
            epochs.append(pool.node.epoch)
    assert epochs == sorted(set(epochs)) and len(epochs) == 3


def test_heartbeat_advances(small_pool):
    with cxlkv.open_pool(small_pool) as pool:
        pool.node.interval = 0.01
        first = nodes.read_slot(pool, pool.node.slot).heartbeat
        wait_for(lambda: nodes.read_slot(pool, pool.node.slot).heartbeat >= first + 3,
                 what="three heartbeats")


def test_four_processes_get_distinct_slots_and_are_live(small_pool):
    kids = [Child(small_pool) for _ in range(4)]
    try:
        assert len({k.slot for k in kids}) == 4
        with Pool.open(small_pool) as p:
            live = nodes.live_nodes(p, observe=False)
            assert {n.slot for n in live} == {k.slot for k in kids}
            assert {n.pid for n in live} == {k.p.pid for k in kids}
        # format --force names them and refuses
        with pytest.raises(LiveNodesError) as e:
            format_pool(small_pool, {"chunk_size": 64 << 10}, force=True)
        assert len(e.value.nodes) == 4
    finally:
        for k in kids:
            k.detach()
    with Pool.open(small_pool) as p:
        assert nodes.read_nodes(p) == []


def test_pool_full_is_the_deprecated_name_of_node_table_full():
    with pytest.warns(DeprecationWarning, match="NodeTableFull"):
        assert nodes.PoolFull is NodeTableFull
    with pytest.raises(AttributeError):
        nodes.NoSuchName


def test_full_table_then_a_dead_node_is_reaped_on_attach(pool_path):
    from cxlkv.ops.init import init_pool

    init_pool(pool_path, {"size": 8 << 20, "chunk_size": 64 << 10, "max_nodes": 2})
    a, b = Child(pool_path), Child(pool_path)
    try:
        with pytest.raises(NodeTableFull, match="all 2 node slots"):
            cxlkv.open_pool(pool_path)
        b.kill()                       # kill -9: the slot stays ATTACHED in the pool
        with Pool.open(pool_path) as p:
            assert nodes.read_slot(p, b.slot).state == "attached"
        with cxlkv.open_pool(pool_path) as pool:   # reaps b (same host, pid gone)
            assert pool.node.slot == b.slot
            assert pool.node.epoch == b.epoch + 1
    finally:
        a.detach()


def test_killed_node_is_reaped_by_a_live_nodes_heartbeat(small_pool):
    with cxlkv.open_pool(small_pool) as pool:
        pool.node.interval = 0.01
        k = Child(small_pool)
        k.kill()
        wait_for(lambda: nodes.read_slot(pool, k.slot).state == "free", what="reap")


def test_pid_reuse_is_not_alive(small_pool):
    fake_node(small_pool, 0, pid=os.getpid(), start_time_ns=1, boot_id=nodes.local_boot_id())
    with Pool.open(small_pool) as p:
        assert nodes.Observer(p).verdict(nodes.read_slot(p, 0)) == "dead"


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_remote_liveness_uses_the_observers_clock(small_pool):
    fake_node(small_pool, 5, pid=1, start_time_ns=1, hostname="far",
              boot_id="00000000-0000-0000-0000-0000000000ff", heartbeat=10)
    with Pool.open(small_pool) as p:
        clock = FakeClock()
        obs = nodes.Observer(p, clock=clock)
        lease = p.sb.lease_ms / 1000
        assert obs.verdict(nodes.read_slot(p, 5)) == "unknown"     # first sight
        clock.t += lease * 0.9
        assert obs.verdict(nodes.read_slot(p, 5)) == "unknown"     # not a lease yet
        # its heartbeat moves: alive, and the lease restarts
        off = nodes.node_offset(p, 5) + layout.field_offset(layout.NodeStruct, "heartbeat")
        p.mapping.store64(off, 11)
        assert obs.verdict(nodes.read_slot(p, 5)) == "alive"
        clock.t += lease * 0.9
        assert obs.verdict(nodes.read_slot(p, 5)) == "unknown"
        clock.t += lease * 0.2
        assert obs.verdict(nodes.read_slot(p, 5)) == "dead"        # a whole lease unchanged


def test_reaped_node_is_fenced(small_pool):
    with cxlkv.open_pool(small_pool, heartbeat=False) as pool:
        node = pool.node
        node.check()
        # another party judged us dead and reaped our slot
        with Pool.open(small_pool) as other:
            assert nodes.reap(other, node.slot, node.control)
        with pytest.raises(nodes.NodeFenced, match="reattach"):
            node.check()
        with pytest.raises(nodes.NodeFenced):
            node.beat()
    with Pool.open(small_pool) as p:
        assert nodes.read_slot(p, node.slot).state == "free"


def test_reap_is_a_no_op_on_a_changed_slot(small_pool):
    with cxlkv.open_pool(small_pool, heartbeat=False) as pool:
        stale = layout.node_control(layout.NODE_ATTACHED,
                                    pool.node.epoch - 1 if pool.node.epoch > 1 else 99)
        assert not nodes.reap(pool, pool.node.slot, stale)
        pool.node.check()


def test_recovery_hooks_run_for_the_dead_node(small_pool):
    seen = []
    hook = nodes.register_recovery(lambda pool, slot, epoch: seen.append((slot, epoch)))
    try:
        k = Child(small_pool)
        k.kill()
        with cxlkv.open_pool(small_pool, heartbeat=False):
            pass
        assert (k.slot, k.epoch) in seen
    finally:
        nodes._recoveries.remove(hook)


def test_read_only_pool_cannot_attach(small_pool):
    with Pool.open(small_pool, writable=False) as p:
        with pytest.raises(cxlkv.errors.RefusedError, match="read-only"):
            p.attach()
