"""Same pool, same incarnation, on every host (cxlkv.state.visibility): the
other nodes seen from here both ways - heartbeats advancing here, a challenge
written here echoed - in both sync modes and through the non-coherence
emulation; a stalled node and a node whose flushes are lost are not proven;
a pinned pool uuid refuses any other pool."""
from __future__ import annotations

import os
import signal
import struct
import time

import pytest

import cxlkv
from cxlkv import errors
from cxlkv.api import Pool
from cxlkv.ops import doctor
from cxlkv.ops.init import init_pool
from cxlkv.pool import layout
from cxlkv.state import nodes, visibility
from cxlkv.testing.nodes import Manager, NodeProc

NC = {"CXLKV_NONCOHERENT": "1", "CXLKV_NC_EVICT_EVERY": "0"}


def _pool(path, sync="cas", lease_ms=800):
    init_pool(path, {"size": 16 << 20, "chunk_size": 1 << 20, "max_nodes": 8, "sync": sync,
                     "lease_ms": lease_ms})
    return path


@pytest.fixture
def procs():
    started = []

    def make(env=None):
        p = NodeProc(env)
        started.append(p)
        return p

    yield make
    for p in started:
        if p.p.poll() is None:
            os.kill(p.p.pid, signal.SIGCONT)
            p.close()


def _probe(path, **kw):
    with Pool.open(path, writable=True) as p:
        return visibility.probe(p, **kw)


@pytest.mark.parametrize("sync", ["cas", "manager"])
def test_other_hosts_are_proven_both_ways(pool_path, procs, remote_env, sync):
    path = _pool(pool_path, sync)
    mgr = Manager(path) if sync == "manager" else None
    try:
        if mgr:
            assert "active" in mgr.line()
        a, b = procs(remote_env()), procs(remote_env())
        slots = {a.attach(path, interval=0.05)["slot"], b.attach(path, interval=0.05)["slot"]}
        pr = _probe(path)
        assert {s.slot for s in pr.sights} == slots
        for s in pr.sights:
            assert s.proven and not s.same_host, s
            assert s.challenge == visibility.ANSWERED and s.answer_ms is not None
        assert pr.manager == ("advancing" if mgr else None)
        # the echo is the node's: its answer line holds our nonce for its epoch
        with Pool.open(path) as p:
            for s in pr.sights:
                off = nodes.node_offset(p, s.slot)
                p.mapping.invalidate(off, layout.NODE_SIZE)
                chal = struct.unpack_from("<QQ", p.mapping.read(off + 256, 16))
                ans = struct.unpack_from("<QQ", p.mapping.read(off + 320, 16))
                assert ans == chal and chal[1] == s.epoch and chal[0] != 0
    finally:
        if mgr:
            mgr.stop()


def test_through_non_coherent_memory(pool_path, procs, remote_env, monkeypatch):
    """Manager mode under the emulation (every process its own software cache):
    the probe reads through invalidates, and the echo needs the node's flush."""
    path = _pool(pool_path, "manager")
    mgr = Manager(path, env=NC)
    try:
        assert "active" in mgr.line()
        a = procs(remote_env(**NC))
        a.attach(path, interval=0.05)
        monkeypatch.setenv("CXLKV_NONCOHERENT", "1")
        monkeypatch.setenv("CXLKV_NC_EVICT_EVERY", "0")
        pr = _probe(path)
        assert [s.proven for s in pr.sights] == [True], pr
        # a node whose flushes are lost: neither its heartbeat nor its echo arrive
        lost = procs(remote_env(**NC, CXLKV_NC_DROP_FLUSH="1"))
        lost.send(op="attach", path=path, interval=0.05)
        # its attach itself needs the manager to see its claim: it may never
        # complete; whatever it got to, it is not proven from here
        pr = _probe(path, timeout=0.5)
        assert all(s.proven for s in pr.sights if s.pid != lost.p.pid)
        assert not any(s.proven for s in pr.sights if s.pid == lost.p.pid)
    finally:
        mgr.stop()


def test_a_paused_node_is_not_proven_and_is_again_once_resumed(pool_path, procs, remote_env):
    path = _pool(pool_path, lease_ms=5000)         # a pause shorter than its lease
    a = procs(remote_env())
    a.attach(path, interval=0.05)
    os.kill(a.p.pid, signal.SIGSTOP)
    try:
        pr = _probe(path, timeout=0.3)
        (s,) = pr.sights
        assert not s.advanced and s.challenge == visibility.UNANSWERED and not s.proven
        assert "not seen advancing" in s.describe()
    finally:
        os.kill(a.p.pid, signal.SIGCONT)
    (s,) = _probe(path).sights
    assert s.proven, s


def test_a_challenge_for_another_incarnation_is_not_answered(pool_path, procs, remote_env):
    path = _pool(pool_path)
    a = procs(remote_env())
    r = a.attach(path, interval=0.05)
    with Pool.open(path, writable=True) as p:
        m, off = p.mapping, nodes.node_offset(p, r["slot"])
        m.write(off + 256, struct.pack("<QQ", 12345, r["epoch"] + 1).ljust(64, b"\0"))
        hb = m.load64(off + 8)
        deadline = time.monotonic() + 10
        while m.load64(off + 8) < hb + 3:           # beats after the challenge was there
            assert time.monotonic() < deadline, "the node stopped beating"
        assert m.read(off + 320, 24) == bytes(24)   # not echoed: another epoch's
        (s,) = visibility.probe(p).sights           # the probe's own, this epoch: echoed
    assert s.proven


def test_a_read_only_prober_watches_heartbeats_only(pool_path, procs, remote_env):
    path = _pool(pool_path)
    procs(remote_env()).attach(path, interval=0.05)
    with Pool.open(path, writable=False) as p:
        (s,) = visibility.probe(p).sights
    assert s.advanced and s.challenge == visibility.NOT_ASKED
    assert s.why_not_asked == "no write access to the pool" and "not challenged" in s.describe()


def test_doctor_shows_the_other_hosts(pool_path, procs, remote_env, cli):
    path = _pool(pool_path)
    procs(remote_env()).attach(path, interval=0.05)
    checks = doctor.check_pool(path)
    (c,) = [c for c in checks if c.id == "visibility"]
    assert c.status == "pass" and "proven both ways" in c.detail and "1 other host" in c.detail
    (n,) = c.data["nodes"]
    assert n["proven"] and n["heartbeat_advanced"] and n["challenge"] == "answered"
    r = cli("doctor", "--pool", path, "--json")
    (v,) = [c for c in r.json()["checks"] if c["id"] == "visibility"]
    assert v["status"] == "pass" and v["data"]["nodes"][0]["proven"]


def test_doctor_warns_for_a_node_not_seen_here(pool_path, procs, remote_env):
    path = _pool(pool_path, lease_ms=5000)
    a = procs(remote_env())
    a.attach(path, interval=0.05)
    os.kill(a.p.pid, signal.SIGSTOP)
    try:
        with Pool.open(path, writable=False) as p:
            c = doctor.shared_visibility(p, path, timeout=0.3)
    finally:
        os.kill(a.p.pid, signal.SIGCONT)
    assert c.status == "warn" and "not seen advancing from this host" in c.detail
    assert "on the other hosts too" in c.remedy


# -- the pinned pool uuid ---------------------------------------------------------------

def test_a_pinned_uuid_refuses_another_pool(pool_path, tmp_path, monkeypatch):
    path = _pool(pool_path)
    other = _pool(str(tmp_path / "other.pool"))
    with Pool.open(path) as p:
        mine = str(p.sb.uuid)
    with Pool.open(other) as p:
        theirs = str(p.sb.uuid)
    with cxlkv.open_pool(path, expect_uuid=mine) as p:
        assert p.node is not None
    with pytest.raises(errors.WrongPool) as e:
        cxlkv.open_pool(other, expect_uuid=mine)
    assert mine in e.value.message and theirs in e.value.message
    assert e.value.exit_code == errors.EXIT_INVALID
    with Pool.open(other) as p:                       # no slot was claimed
        assert nodes.read_nodes(p) == []
    monkeypatch.setenv("CXLKV_POOL_UUID", mine)
    with pytest.raises(errors.WrongPool, match=r"\$CXLKV_POOL_UUID"):
        cxlkv.open_pool(other)
    cxlkv.open_pool(path).close()
    monkeypatch.setenv("CXLKV_POOL_UUID", "not-a-uuid")
    with pytest.raises(errors.UsageError, match="not a pool uuid"):
        cxlkv.open_pool(path)


def test_the_pin_in_the_cli_and_doctor(pool_path, tmp_path, cli, monkeypatch):
    path = _pool(pool_path)
    other = _pool(str(tmp_path / "other.pool"))
    with Pool.open(path) as p:
        mine = str(p.sb.uuid)
    monkeypatch.setenv("CXLKV_POOL_UUID", mine)
    r = cli("stress", "--pool", other, "--seconds", "0.2", "--json")
    assert r.code == errors.EXIT_INVALID, r.out + r.err
    assert mine in (r.out + r.err) and "pins" in (r.out + r.err)
    (c,) = [c for c in doctor.check_pool(other, challenge=False) if c.id == "pool-uuid"]
    assert c.status == "fail" and mine in c.detail
    (c,) = [c for c in doctor.check_pool(path, challenge=False) if c.id == "pool-uuid"]
    assert c.status == "pass"


def test_serve_and_the_lock_manager_refuse_a_pool_not_pinned(pool_path, tmp_path, cli,
                                                             monkeypatch):
    path = _pool(pool_path)
    other = _pool(str(tmp_path / "other.pool"), sync="manager")
    with Pool.open(path) as p:
        mine = str(p.sb.uuid)
    r = cli("serve", "--pool", other, "--pool-uuid", mine)
    assert r.code == errors.EXIT_INVALID and mine in r.err and "--pool-uuid" not in r.err
    with Pool.open(other) as p:
        assert nodes.read_nodes(p) == []
    monkeypatch.setenv("CXLKV_POOL_UUID", mine)
    r = cli("lock-manager", "--pool", other)
    assert r.code == errors.EXIT_INVALID and mine in r.err, r.err
