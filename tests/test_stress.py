"""`cxlkv stress`: clean runs, runs with kill -9, and proof that its checks can fail."""
from __future__ import annotations

import sys
import types

import pytest

import cxlkv
from cxlkv import errors as E
from cxlkv.pool.admin import init_pool
from cxlkv.state import stress

MiB = 1 << 20


@pytest.fixture
def spool(pool_path):
    init_pool(pool_path, {"size": 64 * MiB, "chunk_size": MiB, "max_nodes": 16, "lease_ms": 300})
    return pool_path


def assert_empty(path):
    from cxlkv.pool.pool import Pool
    from cxlkv.state.fsck import check

    with Pool.open(path, writable=False) as p:
        rep = check(p)
    assert rep.clean, rep.to_json()
    assert rep.stats["allocator"]["slots_allocated"] == rep.stats["allocator"]["chunks_used"] == 0


def test_clean_run_passes_and_reports(cli, spool):
    r = cli("stress", "--pool", spool, "--nodes", "4", "--seconds", "2", "--seed", "7", "--json")
    assert r.code == 0, r.err
    doc = r.json()
    assert doc["passed"] and doc["violations"] == []
    assert doc["nodes"] == 4 and doc["seed"] == 7 and doc["kills"] == doc["restarts"] == 0
    assert doc["memory_model"] == "coherent" and doc["sync"] == "cas"
    assert doc["ops"]["total"] == sum(doc["ops"][k] for k in stress.OPS) > 0
    assert all(doc["ops"][k] > 0 for k in stress.OPS)
    assert doc["ops_per_s"] > 0 and 2 <= doc["seconds"] < 10
    for kind in ("lock", "alloc"):
        q = doc["latency_us"][kind]
        assert 0 < q["p50"] <= q["p99"]
    assert set(doc["checks"]) == set(stress.CHECKS)
    assert all(c["passed"] for c in doc["checks"].values())
    assert_empty(spool)


def test_kills_are_survived(cli, spool):
    r = cli("stress", "--pool", spool, "--nodes", "4", "--seconds", "3", "--kill-rate", "3",
            "--seed", "11", "--json")
    assert r.code == 0, r.err
    doc = r.json()
    assert doc["kills"] > 0 and doc["kills"] == doc["restarts"]
    assert doc["passed"], doc["violations"]
    assert_empty(spool)


def test_human_output_and_ops_limit(cli, spool):
    r = cli("stress", "--pool", spool, "--nodes", "2", "--ops", "300", "--mix", "alloc=1,lock=1")
    assert r.code == 0, r.err
    assert f"stress {spool}: passed" in r.out
    assert "verify 0" in r.out and "lock" in r.out and "p99" in r.out
    assert r.err == ""


def _corrupt_one_payload(pool, sup):
    for off, _, published in stress.allocated_slots(pool):
        _, p = stress.read_payload(pool.mapping, off, 1 << 30)
        if published and p is not None:
            b = pool.mapping.read(off + stress.HEADER.size, 1)
            pool.mapping.write(off + stress.HEADER.size, bytes([b[0] ^ 0xFF]))
            return p
    raise AssertionError("no payload to corrupt")


def _leak_unowned_payload(pool, sup):
    p = stress.Payload(pool.alloc(4096), 1, 1 << 40, 4096)
    stress.write_payload(pool.mapping, p, bytes(4096 - stress.HEADER.size))
    pool.publish(p.offset)


def _skip_lock(pool, sup):
    pool.mapping.store64(sup.control, pool.mapping.load64(sup.control) - 1)


@pytest.mark.parametrize("damage,kind", [(_corrupt_one_payload, "checksum-mismatch"),
                                         (_leak_unowned_payload, "unowned-payload"),
                                         (_skip_lock, "lost-update")])
def test_checks_catch_damage(cli, spool, monkeypatch, damage, kind):
    """Damage the pool after the workers stopped, before the end checks."""
    check_pool = stress.Supervisor.check_pool

    def damaged(self):
        with cxlkv.open_pool(self.opts.pool) as pool:
            damage(pool, self)
        check_pool(self)

    monkeypatch.setattr(stress.Supervisor, "check_pool", damaged)
    r = cli("stress", "--pool", spool, "--nodes", "2", "--ops", "400",
            "--mix", "alloc=3,free=1,lock=1", "--json")
    assert r.code == 1, r.err
    doc = r.json()
    assert not doc["passed"] and [v["kind"] for v in doc["violations"]] == [kind]
    assert f"violation: {kind}" in r.err
    assert_empty(spool)                        # the supervisor still cleans up


@pytest.mark.parametrize("args,words", [
    ([], "either --seconds or --ops"),
    (["--seconds", "1", "--ops", "5"], "either --seconds or --ops"),
    (["--seconds", "1", "--nodes", "0"], "--nodes"),
    (["--seconds", "0"], "--seconds"),
    (["--seconds", "1", "--mix", "alloc=1,steal=2"], "invalid --mix"),
    (["--seconds", "1", "--mix", "alloc=x"], "invalid --mix"),
    (["--seconds", "1", "--mix", "alloc=0"], "every weight is zero"),
    (["--seconds", "1", "--kill-rate", "-1"], "--kill-rate"),
    (["--seconds", "1", "--nodes", "17"], "16 slots"),
])
def test_usage_errors(cli, spool, args, words):
    r = cli("stress", "--pool", spool, *args, "--json")
    assert r.code == 2, (r.out, r.err)
    assert r.json()["error"]["kind"] == "usage"
    assert words in r.err


def test_refuses_a_pool_in_use(cli, spool):
    with cxlkv.open_pool(spool) as pool:
        r = cli("stress", "--pool", spool, "--seconds", "1")
        assert r.code == 1 and "in use by node" in r.err, r.err
        pool.publish(pool.alloc(4096))
    r = cli("stress", "--pool", spool, "--seconds", "1")
    assert r.code == 1 and "holds 1 allocated slot" in r.err, r.err


@pytest.fixture
def manager_pool(pool_path):
    init_pool(pool_path, {"size": 64 * MiB, "sync": "manager"})
    return pool_path


def test_manager_pool_without_lock_manager(cli, manager_pool, monkeypatch):
    monkeypatch.setitem(sys.modules, "cxlkv.daemons.lockmgr", None)     # a build without it
    r = cli("stress", "--pool", manager_pool, "--seconds", "1", "--json")
    assert r.code == 5, r.err
    assert "needs the lock manager" in r.json()["error"]["message"]


def test_manager_pool_gets_a_manager_for_the_run(cli, manager_pool, monkeypatch):
    stopped = []
    lockmgr = types.ModuleType("cxlkv.daemons.lockmgr")
    lockmgr.ensure_manager = lambda path: (True, lambda: stopped.append(path))
    monkeypatch.setitem(sys.modules, "cxlkv.daemons", types.ModuleType("cxlkv.daemons"))
    monkeypatch.setitem(sys.modules, "cxlkv.daemons.lockmgr", lockmgr)

    def refuse(self, opts, sync):
        raise E.RefusedError("no attaching in this test")

    monkeypatch.setattr(stress.Supervisor, "__init__", refuse)
    r = cli("stress", "--pool", manager_pool, "--seconds", "1")
    assert r.code == 1 and "started a lock manager for this run" in r.err, r.err
    assert stopped == [manager_pool]             # stopped even though the run failed


def test_memory_model_follows_the_environment(monkeypatch):
    monkeypatch.setenv("CXLKV_NONCOHERENT", "1")
    assert stress.memory_model() == "noncoherent-emulated"
    monkeypatch.delenv("CXLKV_NONCOHERENT")
    assert stress.memory_model() == "coherent"


def test_histogram_merges_and_ranks():
    a, b = stress.Histogram(), stress.Histogram()
    for ns in range(1000, 2000):
        a.add(ns)
    b.add(1_000_000)
    a.merge(stress.Histogram(b.to_json()))
    assert 1.3 < a.percentile_us(0.5) < 1.6
    assert a.percentile_us(0.99) < 2.1 and 950 < a.percentile_us(1.0) < 1050
    assert stress.Histogram().percentile_us(0.5) is None
