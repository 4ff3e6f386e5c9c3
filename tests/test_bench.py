"""cxlkv bench: every figure is reported with its baseline, in one JSON document."""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import types

import numpy as np
import pytest

import cxlkv
from cxlkv.bench import handoff, harness, scale, suite
from cxlkv.bench import spill as spill_bench
from cxlkv.ops.lockmgr import ensure_manager
from cxlkv.errors import EXIT_REFUSED
from cxlkv.kv.cache import kv_report
from cxlkv.ops.init import init_pool

MiB = 1 << 20

#: every figure `cxlkv bench --json` promises (a number > 0, or None with a note)
FIGURES = ("memcpy_gbps", "pool_write_gbps", "pool_read_gbps", "lock_cas_us",
           "lock_manager_us", "alloc_ops_per_s", "alloc_utilisation", "buddy_utilisation",
           "put_gbps", "get_gbps", "tcp_gbps", "redis_gbps", "shm_handoff_gbps",
           "handoff_gbps", "handoff_vs_tcp", "handoff_vs_redis", "handoff_vs_shm",
           "lookup_32k_ms", "lookup_32k_list_ms", "put_vs_memcpy", "get_vs_memcpy",
           "put_manager_gbps", "get_manager_gbps", "lookup_32k_manager_ms")


def redis_children() -> list[int]:
    """Pids of redis-server processes whose parent is this process."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        if ppid == os.getpid() and comm.startswith("redis-server"):
            found.append(int(pid))
    return found


@pytest.fixture
def scratch(monkeypatch, tmp_path):
    d = tmp_path / "scratch"
    d.mkdir()
    monkeypatch.setattr(harness, "scratch_dir", lambda *a, **kw: str(d))
    return d


@pytest.fixture
def redis_procs(monkeypatch):
    """The redis-servers the bench starts (their processes)."""
    started = []
    real = harness.start_redis

    def start(*a, **kw):
        server, port = real(*a, **kw)
        started.append(server.nodes[0].proc)
        return server, port

    monkeypatch.setattr(harness, "start_redis", start)
    return started


def check_figures(res: dict) -> None:
    for key in FIGURES:
        v = res[key]
        if v is None:
            assert res["notes"].get(key), f"{key} is None without a reason"
        else:
            assert isinstance(v, float) and v > 0 and math.isfinite(v), key


def test_quick_bench_reports_every_figure(scratch, redis_procs):
    steps = []
    res = suite.run(steps.append, quick=True)
    check_figures(res)
    assert res["pool_write_vs_memcpy"] == res["pool_write_gbps"] / res["memcpy_gbps"]
    # put and get: the median of each rep's ratio to the memcpy timed beside it
    assert res["kv_memcpy_gbps"] > 0
    for fig in ("put", "get"):
        lo, hi = sorted((res[f"{fig}_gbps"] / res["kv_memcpy_gbps"], res[f"{fig}_vs_memcpy"]))
        assert res[f"{fig}_vs_memcpy"] > 0 and hi / lo < 3, (fig, res)
    assert res["handoff_vs_shm"] == res["handoff_gbps"] / res["shm_handoff_gbps"]
    assert res["handoff_vs_tcp"] == res["handoff_gbps"] / res["tcp_gbps"]
    assert res["lock_manager_us"] > 0
    assert set(res["targets"]) == set(suite.TARGETS)
    assert steps == list(suite.STEPS)                  # the CLI's progress bar
    assert not scratch.exists()                             # scratch pools removed
    assert res["kv_pool"] is None
    # the redis-server it started (when installed) is stopped, and no child is left
    if shutil.which("redis-server"):
        assert res["redis_gbps"] is not None, res["notes"]
        assert len(redis_procs) == 1 and redis_procs[0].poll() is not None
    else:
        assert not redis_procs
    assert redis_children() == []


def test_put_get_ratios_pair_each_rep_with_the_memcpy_before_it(tmp_path):
    """put_vs_memcpy is the median of per-rep ratios: a baseline that halves
    between reps halves the ratio of its own rep only."""
    from cxlkv.bench import kv as kvbench

    class Drifting:
        speeds = iter([1.0, 100.0, 1.0, 100.0, 1.0])

        def gbps(self):
            return next(self.speeds)

    path = str(tmp_path / "pg.pool")
    init_pool(path, {"size": 64 << 20})
    with cxlkv.open_pool(path) as pool:
        r = kvbench.kv_put_get_paired(pool, "pg", 4 << 20, reps=5, memcpy=Drifting())
        assert r["reps"]["memcpy"] == [1.0, 100.0, 1.0, 100.0, 1.0]
        ratios = sorted(p / m for p, m in zip(r["reps"]["put"], r["reps"]["memcpy"]))
        assert r["put_vs_memcpy"] == ratios[2]
        assert r["put_gbps"] == statistics.median(r["reps"]["put"])
        assert r["memcpy_gbps"] == 1.0
        assert kv_report(pool)["namespaces"] == []                   # dropped


def test_redis_missing_is_none_with_reason(scratch, monkeypatch):
    monkeypatch.setattr(harness.shutil, "which", lambda name: None)
    with pytest.raises(harness.Unavailable, match="redis-server is not installed"):
        harness.start_redis()


def test_handoff_kinds_move_the_bytes(scratch):
    """Each handoff kind delivers exactly the producer's bytes (checked by
    the consumer on the warm-up transfer), and the processes end."""
    with handoff.HandoffPair() as pair:
        shm = scratch / "h.shm"
        shm.write_bytes(bytes(MiB))
        gbps = handoff.handoff_gbps(pair, {"kind": "shm", "path": str(shm), "total": MiB,
                                           "block": 64 * 1024}, reps=1)
        assert gbps > 0
        gbps = handoff.handoff_gbps(pair, {"kind": "tcp", "total": MiB}, reps=1)
        assert gbps > 0
        procs = list(pair.proc.values())
    assert all(p.poll() == 0 for p in procs)


@contextlib.contextmanager
def manager_for(path: str):
    """A lock manager while the block runs, for a pool in sync mode manager."""
    with cxlkv.Pool.open(path, writable=False) as p:
        managed = p.sb.sync == "manager"
    stop = ensure_manager(path)[1] if managed else (lambda: None)
    try:
        yield
    finally:
        stop()


def store_other(path: str) -> tuple[np.ndarray, np.ndarray]:
    toks = np.arange(64, dtype=np.uint32) + 7
    data = np.frombuffer(np.random.default_rng(9).bytes(4 * 4096), dtype=np.uint8)
    with cxlkv.open_pool(path) as pool:
        kv = pool.kv(model="someone-else", block_tokens=16, block_bytes=4096)
        assert kv.store(toks, data) == 4
    return toks, data


def other_intact(path: str, toks, data) -> dict:
    with cxlkv.open_pool(path) as pool:
        rep = kv_report(pool)
        kv = pool.kv(model="someone-else", block_tokens=16, block_bytes=4096)
        assert kv.match(toks) == len(toks)
        out = np.zeros(len(data), dtype=np.uint8)
        assert kv.load_into(toks, out) == 4 and np.array_equal(out, data)
    return rep


@pytest.mark.parametrize("sync", ["cas", "manager"])
def test_pool_option_uses_own_namespace_and_drops_it(scratch, tmp_path, monkeypatch, sync):
    path = str(tmp_path / "shared.pool")
    init_pool(path, {"size": 96 * MiB, "sync": sync})
    with manager_for(path):
        toks, data = store_other(path)
    which = shutil.which                    # and: no redis-server here
    monkeypatch.setattr(harness.shutil, "which",
                        lambda name: None if name == "redis-server" else which(name))
    res = suite.run(quick=True, pool_path=path)      # starts its own lock manager
    check_figures(res)
    assert res["redis_gbps"] is None and "not installed" in res["notes"]["redis_gbps"]
    assert res["handoff_vs_redis"] is None and res["targets"]["handoff_vs_redis"] is None
    assert res["kv_pool"] == path and res["kv_namespace"].startswith("cxlkv-bench-")
    with manager_for(path):
        rep = other_intact(path, toks, data)
    assert [(n["namespace"], n["blocks"], n["evictions"]) for n in rep["namespaces"]] == [
        ("someone-else", 4, 0)]
    assert rep["entries"] == 4                  # the bench's own entries are gone


def test_pool_without_room_is_refused(cli, scratch, tmp_path):
    path = str(tmp_path / "small.pool")
    init_pool(path, {"size": 16 * MiB})
    toks, data = store_other(path)
    r = cli("bench", "--pool", path, "--json")
    assert r.code == EXIT_REFUSED
    err = r.json()["error"]
    assert err["kind"] == "bench-no-room" and "without evicting" in err["message"]
    rep = other_intact(path, toks, data)
    assert [n["namespace"] for n in rep["namespaces"]] == ["someone-else"]


def test_bench_json_is_one_document(cli, monkeypatch):
    monkeypatch.setattr(suite, "run", lambda progress, quick=False, pool_path=None: {
        "memcpy_gbps": 1.0, "notes": {}, "targets": {}})
    r = cli("bench", "--json")
    assert r.code == 0 and r.json()["memcpy_gbps"] == 1.0 and r.err == ""


def test_bench_table_passes_pool_and_shows_missing_figures(cli, monkeypatch):
    seen = {}
    res = {k: 1.5 for k in FIGURES}
    res.update(redis_gbps=None, handoff_vs_redis=None, lookup_tokens=32768,
               kv_pool="/dev/shm/p.pool", kv_namespace="cxlkv-bench-1",
               notes={"redis_gbps": "redis-server is not installed"},
               targets={k: (None if k == "handoff_vs_redis" else True)
                        for k in suite.TARGETS})

    def fake_run(progress, quick=False, pool_path=None):
        seen["pool"] = pool_path
        for step in suite.STEPS:
            progress(step)
        return res

    monkeypatch.setattr(suite, "run", fake_run)
    r = cli("bench", "--pool", "/dev/shm/p.pool")
    assert r.code == 0 and seen["pool"] == "/dev/shm/p.pool"
    assert "n/a" in r.out and "redis-server is not installed" in r.out
    assert "cxlkv-bench-1" in r.out
    assert "bench: handoff through redis" in r.err          # stderr is not a terminal here


def test_pool_without_free_node_slots_is_refused(cli, scratch, tmp_path):
    path = str(tmp_path / "few-nodes.pool")
    init_pool(path, {"size": 96 * MiB, "max_nodes": 2})
    r = cli("bench", "--pool", path, "--json")
    assert r.code == EXIT_REFUSED
    assert "free node slots" in r.json()["error"]["message"]
    with cxlkv.open_pool(path) as pool:
        assert kv_report(pool)["namespaces"] == []


# -- cxlkv bench --scale ------------------------------------------------------------------
def scale_children() -> list[int]:
    """Pids of this process's children still running (workers, lock managers)."""
    import psutil

    return [p.pid for p in psutil.Process().children(recursive=True)
            if p.status() != psutil.STATUS_ZOMBIE]


def attach_dirs() -> set[str]:
    return {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("cxlkv-bench-attach-")}


def test_scale_bench_at_tiny_sizes_reports_every_figure(monkeypatch, tmp_path):
    d = tmp_path / "scratch"
    d.mkdir()
    monkeypatch.setattr(harness, "scratch_dir", lambda *a, **kw: str(d))
    before = attach_dirs()
    # children an earlier test left (multiprocessing's resource tracker) are not the bench's
    kids_before = set(scale_children())
    steps = []
    res = scale.run(steps.append, entries=(1024, 2048), procs=(1, 2, 4), stores=4,
                    seconds=0.1, attach_size=64 * MiB, slabs=40, idle_seconds=0.1, rounds=2)
    assert steps == scale.steps(scale.SCENARIOS, (1024, 2048), (1, 2, 4), 2)
    # the second round runs the counts the other way round
    pr_steps = [s for s in steps if s.startswith("store and lock")]
    assert [s.split(",")[1] for s in pr_steps] == [" 1 processes", " 2 processes",
                                                    " 4 processes", " 4 processes",
                                                    " 2 processes", " 1 processes"]
    assert set(res["targets"]) == set(scale.TARGETS)
    for key in scale.TARGETS:
        v = res[key]
        if v is None:
            assert res["notes"].get(key), f"{key} is None without a reason"
            assert res["targets"][key] is None
        else:
            assert isinstance(v, float) and math.isfinite(v) and v >= 0, key
            assert isinstance(res["targets"][key], bool), key
    # 8 processes were not asked for: no figure, and a note saying why
    assert res["store_ops_8_vs_best12"] is None and res["notes"]["store_ops_8_vs_best12"]
    for slots in ("1024", "2048"):
        fp = res["full_pool"][slots]
        assert fp["slots"] == int(slots) and fp["stores"] == 4
        # the pool was past capacity: the timed stores evicted (64 blocks each)
        assert fp["evictions"] >= 4 * scale.FP_STORE_BLOCKS
        assert fp["entries"] <= fp["max_entries"]
        assert 0 < fp["store_p50_ms"] <= fp["store_p90_ms"] <= fp["store_p99_ms"]
        assert fp["lock_waits"] > 0 and fp["lock_wait_p99_ms"] >= fp["lock_wait_p50_ms"] > 0
    fp = res["full_pool"]
    assert res["store_p90_big_vs_small"] == fp["2048"]["store_p90_ms"] / fp["1024"]["store_p90_ms"]
    assert res["lock_wait_p99_big_ms"] == fp["2048"]["lock_wait_p99_ms"]
    pr = res["procs"]
    assert set(pr) == {"1", "2", "4"}
    for k in pr.values():
        assert k["store_ops_per_s"] > 0 and k["lock_ops_per_s"] > 0
        assert k["manager_lock_ops_per_s"] > 0 and k["manager_rtt_p50_us"] > 0
        # each figure is the median of its rounds
        assert len(k["rounds"]["store_ops_per_s"]) == 2
        assert k["store_ops_per_s"] == statistics.median(k["rounds"]["store_ops_per_s"])
    assert res["procs_rounds"] == 2 and res["procs_seconds"] == 0.1
    best = max(pr["1"]["lock_ops_per_s"], pr["2"]["lock_ops_per_s"])
    assert res["lock_ops_4_vs_best12"] == pr["4"]["lock_ops_per_s"] / best
    assert res["manager_clients"] == 4 and res["manager_rtt_p50_us"] == pr["4"]["manager_rtt_p50_us"]
    assert res["manager_cooldown_cpu_pct"] >= 0 and res["manager_idle_cpu_pct"] >= 0
    assert res["attach_size"] == 64 * MiB and res["attach_warm_ms"] > 0
    assert res["attach_uncached_ms"] > 0 and res["detach_ms"] > 0
    assert res["attach_imports_ms"] > 0 and res["attach_uncached_imports_ms"] > 0
    assert res["recovery_slabs"] == 40 and res["recovered"] is True
    assert res["recovery_attach_ms"] > 0
    json.dumps(res)                                         # one JSON document
    assert not d.exists()                                   # scratch pools removed
    assert attach_dirs() == before
    assert set(scale_children()) - kids_before == set()     # workers and manager ended


def test_scale_cli_json_and_table(cli, monkeypatch):
    from cxlkv.cli.bench import SCALE_SCENARIOS

    assert SCALE_SCENARIOS == scale.SCENARIOS
    seen = {}
    res = {"scale": True, "notes": {"attach_ms": "no room"}, "attach_ms": None,
           "targets": {k: None for k in scale.TARGETS},
           "full_pool": {"65536": {"store_p50_ms": 0.1, "store_p90_ms": 0.2,
                                   "store_p99_ms": 0.3, "lock_wait_p50_ms": 0.01,
                                   "lock_wait_p99_ms": 0.02}},
           "procs": {"1": {"store_ops_per_s": 10.0, "lock_ops_per_s": 20.0}}}

    def fake_run(progress, **kw):
        seen.update(kw)
        for step in scale.steps(kw["only"], kw["entries"], kw["procs"], kw["rounds"]):
            progress(step)
        return res

    monkeypatch.setattr(scale, "run", fake_run)
    r = cli("bench", "--scale", "--json", "--scale-only", "full-pool,procs",
            "--scale-entries", "65536", "--scale-procs", "1,8", "--scale-attach-size", "1G",
            "--scale-rounds", "2")
    assert r.code == 0 and r.json()["scale"] is True and r.err == ""
    assert seen["only"] == ("full-pool", "procs") and seen["entries"] == (65536,)
    assert seen["procs"] == (1, 8) and seen["attach_size"] == 1 << 30 and seen["rounds"] == 2
    r = cli("bench", "--scale", "--scale-only", "full-pool")
    assert r.code == 0 and "65536 slots" in r.out and "no room" in r.out
    assert "bench: full-pool store, 65,536 slots" in r.err
    # one scenario alone: the rows of the others are not drawn
    res.update({"full_pool": None, "procs": None, "manager_rtt_p50_us": None,
                "attach_size": 1 << 30, "attach_ms": 2.0, "attach_warm_ms": 1.5,
                "attach_uncached_ms": 3.0, "detach_ms": 20.0, "attach_imports_ms": 50.0,
                "attach_uncached_imports_ms": 120.0})
    del res["full_pool"], res["procs"]
    r = cli("bench", "--scale", "--scale-only", "attach")
    assert r.code == 0 and "import of cxlkv.api" in r.out and "manager rtt" not in r.out, r.err
    r = cli("bench", "--scale", "--scale-only", "nothing")
    assert r.code != 0 and "unknown --scale-only scenario nothing" in r.err
    r = cli("bench", "--scale", "--scale-entries", "1000")
    assert r.code != 0 and "powers of two" in r.err
    r = cli("bench", "--scale", "--pool", "/dev/shm/p.pool")
    assert r.code != 0 and "--pool does not apply to --scale" in r.err


# -- cxlkv bench run NAME: the scenarios -----------------------------------------------------
def test_run_lists_every_scenario(cli):
    r = cli("bench", "run")
    assert r.code == 0
    for name in harness.SCENARIOS:
        assert name in r.out
    r = cli("bench", "run", "--json")
    assert r.code == 0 and set(r.json()) == set(harness.SCENARIOS)
    r = cli("bench", "run", "spill", "--help")
    assert r.code == 0 and "--mib" in r.out and "--json" in r.out


def test_spill_rounds_time_every_phase_and_check_the_raw_reads(tmp_path, monkeypatch):
    """One interleaved round of the spill bench at a small size: every
    phase timed (the raw reads with an xxh3 of each block among them),
    and a raw read that comes back other bytes is an error, not a figure."""
    r = spill_bench.interleaved(str(tmp_path), 8 << 20, chunk=4 << 20)
    for k in ("raw_w", "store_w", "raw_r", "store_r", "bufs_r", "sum_r"):
        assert r[k] > 0, k
    real, calls = spill_bench.xxhash.xxh3_64_intdigest, []

    def wrong_after_first(b):                     # the expected sum right, the reads' not
        calls.append(1)
        return real(b) ^ (len(calls) > 1)

    monkeypatch.setattr(spill_bench, "xxhash", types.SimpleNamespace(
        xxh3_64_intdigest=wrong_after_first))
    with pytest.raises(RuntimeError, match="read back other bytes"):
        spill_bench.interleaved(str(tmp_path), 8 << 20, chunk=4 << 20)


def test_run_refuses_what_does_not_apply(cli):
    r = cli("bench", "run", "nothing")
    assert r.code == 2 and "unknown bench scenario 'nothing'" in r.err
    r = cli("bench", "run", "hot", "--bogus")
    assert r.code == 2 and "--bogus" in r.err
    r = cli("bench", "--scale", "run", "hot")
    assert r.code == 2 and "--scale does not apply to `cxlkv bench run`" in r.err


def test_run_names_a_missing_dependency_in_one_line(cli, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)           # import torch fails
    r = cli("bench", "run", "ttft", "--contexts", "64")
    assert r.code == 1 and r.out == ""
    assert "torch is not installed" in r.err and len(r.err.strip().splitlines()) == 1
    monkeypatch.setattr(harness.shutil, "which", lambda name: None)
    r = cli("bench", "run", "remote", "--json")
    err = r.json()["error"]
    assert r.code == 1 and err["kind"] == "bench-unavailable"
    assert "redis-server / redis-cli are not installed" in err["message"]


def test_run_a_scenario_at_a_tiny_size(cli, monkeypatch, tmp_path):
    """A scenario through the CLI: its figures as one JSON document with its
    keys, progress on stderr without --json, scratch pools removed."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(harness, "scratch_dir", lambda prefix="x", base=None:
                        tempfile.mkdtemp(prefix=prefix, dir=scratch))
    r = cli("bench", "run", "hot", "--blocks", "4", "--kib", "16", "--rounds", "2", "--json")
    assert r.code == 0, r.err
    doc = r.json()
    assert set(doc) == {"block_bytes", "blocks", "cas", "manager_noncoherent"}
    for mode in ("cas", "manager_noncoherent"):
        assert set(doc[mode]) == {"pool_gbps", "hot_gbps", "ratio"} and doc[mode]["ratio"] > 0
    assert "CXLKV_NONCOHERENT" not in os.environ
    assert list(scratch.iterdir()) == []
    r = cli("bench", "run", "hot", "--blocks", "4", "--kib", "16", "--rounds", "2")
    assert r.code == 0 and "from the hot tier" in r.out and "bench hot: cas" in r.err
