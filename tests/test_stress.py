"""`cxlkv stress`: clean runs, runs with kill -9, and proof that its checks can fail."""
from __future__ import annotations


import pytest

import cxlkv
from cxlkv import errors
from cxlkv.ops.init import init_pool
from cxlkv.ops import lockmgr, stress

MiB = 1 << 20


@pytest.fixture
def stress_pool(pool_path):
    init_pool(pool_path, {"size": 64 * MiB, "chunk_size": MiB, "max_nodes": 16, "lease_ms": 300})
    return pool_path


def assert_empty(path):
    from cxlkv.api import Pool
    from cxlkv.ops.fsck import check

    with Pool.open(path, writable=False) as p:
        rep = check(p)
    assert rep.clean, rep.to_json()
    assert rep.stats["allocator"]["slots_allocated"] == rep.stats["allocator"]["chunks_used"] == 0


def test_clean_run_passes_and_reports(cli, stress_pool):
    r = cli("stress", "--pool", stress_pool, "--nodes", "4", "--seconds", "2", "--seed", "7", "--json")
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
    assert_empty(stress_pool)


def test_kills_are_survived(cli, stress_pool):
    r = cli("stress", "--pool", stress_pool, "--nodes", "4", "--seconds", "3", "--kill-rate", "3",
            "--seed", "11", "--json")
    assert r.code == 0, r.err
    doc = r.json()
    assert doc["kills"] > 0 and doc["kills"] == doc["restarts"]
    assert doc["passed"], doc["violations"]
    assert_empty(stress_pool)


def test_human_output_and_ops_limit(cli, stress_pool):
    r = cli("stress", "--pool", stress_pool, "--nodes", "2", "--ops", "300", "--mix", "alloc=1,lock=1")
    assert r.code == 0, r.err
    assert f"stress {stress_pool}: passed" in r.out
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


def _overwrite_kv_block(pool, sup):
    """Another block's bytes over one published block (what a stalled writer
    resuming into a reused slot does)."""
    from cxlkv.kv.area import Area
    from cxlkv.pool import layout

    t = Area(pool).entries()
    pub = t[(t["ctl"] & 0xFF) == layout.KV_PUBLISHED]
    assert len(pub) >= 2, "no KV blocks to damage"
    victim, other = pub[0], pub[1]
    n = int(victim["length"])
    pool.mapping.write(int(victim["payload"]), pool.mapping.read(int(other["payload"]), n))


@pytest.mark.parametrize("damage,kind", [(_corrupt_one_payload, "checksum-mismatch"),
                                         (_leak_unowned_payload, "unowned-payload"),
                                         (_skip_lock, "lost-update"),
                                         (_overwrite_kv_block, "kv-mismatch")])
def test_checks_catch_damage(cli, stress_pool, monkeypatch, damage, kind):
    """Damage the pool after the workers stopped, before the end checks."""
    check_pool = stress.Supervisor.check_pool

    def damaged(self):
        with cxlkv.open_pool(self.opts.pool) as pool:
            damage(pool, self)
        check_pool(self)

    monkeypatch.setattr(stress.Supervisor, "check_pool", damaged)
    r = cli("stress", "--pool", stress_pool, "--nodes", "2", "--ops", "400",
            "--mix", "alloc=3,free=1,lock=1,kv=1", "--json")
    assert r.code == 1, r.err
    doc = r.json()
    assert not doc["passed"] and [v["kind"] for v in doc["violations"]] == [kind]
    assert f"violation: {kind}" in r.err
    assert_empty(stress_pool)                        # the supervisor still cleans up


@pytest.mark.parametrize("args,words", [
    ([], "either --seconds or --ops"),
    (["--seconds", "1", "--ops", "5"], "either --seconds or --ops"),
    (["--seconds", "1", "--nodes", "0"], "--nodes"),
    (["--seconds", "0"], "--seconds"),
    (["--seconds", "1", "--mix", "alloc=1,steal=2"], "invalid --mix"),
    (["--seconds", "1", "--mix", "alloc=x"], "invalid --mix"),
    (["--seconds", "1", "--mix", "alloc=0"], "every weight is zero"),
    (["--seconds", "1", "--kill-rate", "-1"], "--kill-rate"),
    (["--seconds", "1", "--pause-rate", "-1"], "--pause-rate"),
    (["--seconds", "1", "--pause-seconds", "3:1"], "invalid --pause-seconds"),
    (["--seconds", "1", "--pause-seconds", "0:1"], "invalid --pause-seconds"),
    (["--seconds", "1", "--pause-seconds", "a:b"], "invalid --pause-seconds"),
    (["--seconds", "1", "--nodes", "17"], "16 slots"),
])
def test_usage_errors(cli, stress_pool, args, words):
    r = cli("stress", "--pool", stress_pool, *args, "--json")
    assert r.code == 2, (r.out, r.err)
    assert r.json()["error"]["kind"] == "usage"
    assert words in r.err


def test_refuses_a_pool_in_use(cli, stress_pool):
    with cxlkv.open_pool(stress_pool) as pool:
        r = cli("stress", "--pool", stress_pool, "--seconds", "1")
        assert r.code == 1 and "in use by node" in r.err, r.err
        pool.publish(pool.alloc(4096))
    r = cli("stress", "--pool", stress_pool, "--seconds", "1")
    assert r.code == 1 and "holds 1 allocated slot" in r.err, r.err


@pytest.fixture
def manager_pool(pool_path):
    init_pool(pool_path, {"size": 64 * MiB, "sync": "manager"})
    return pool_path


def test_manager_pool_gets_a_manager_for_the_run(cli, manager_pool, monkeypatch):
    stopped = []
    monkeypatch.setattr(lockmgr, "ensure_manager",
                        lambda path: (True, lambda: stopped.append(path)))

    def refuse(self, opts, sync):
        raise errors.RefusedError("no attaching in this test")

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


# -- pauses: workers stopped past their lease ---------------------------------

class _Inbox:
    """A worker's messages, read until one of a type; keeps them all."""

    def __init__(self):
        import queue

        self.q = queue.SimpleQueue()
        self.all = []

    def until(self, want: str, deadline_s: float = 30.0) -> dict:
        import queue
        import time

        deadline = time.monotonic() + deadline_s
        while True:
            try:
                _, msg = self.q.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {want!r} message within {deadline_s} s; got "
                                     f"{self.all}") from None
            self.all.append(msg)
            if msg["t"] == want:
                return msg


def _poll(cond, deadline_s, what):
    import time

    deadline = time.monotonic() + deadline_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_host_root_gives_a_boot_id_of_its_own(tmp_path, monkeypatch):
    from cxlkv.state import nodes

    root, boot_id = stress.make_host_root(tmp_path)
    assert boot_id != nodes.local_boot_id()
    monkeypatch.setenv("CXLKV_PROCFS_ROOT", root)
    assert nodes.local_boot_id() == boot_id
    assert nodes.local_pidns() != 0                 # what a process reads about itself holds


def test_a_paused_worker_is_judged_by_heartbeat_reaped_and_fenced(stress_pool, tmp_path):
    """The pause machinery: a worker with a host root of its own, SIGSTOPped,
    is judged dead by another node's heartbeat observer (its process still
    exists, so a pid check would call it alive) and reaped; after SIGCONT it
    reports that it was fenced and attaches again as a new node."""
    from cxlkv.state import nodes

    with cxlkv.open_pool(stress_pool) as pool:            # the observer: a node whose reaper judges
        control = pool.alloc(stress.LINE * 2)
        pool.publish(control)
        cfg = stress.worker_config(pool, control, 1, {"alloc": 1, "free": 1, "verify": 1,
                                                      "lock": 0, "kv": 0}, 5, 10.0)
        inbox = _Inbox()
        host, boot_id = stress.make_host_root(tmp_path)
        w = stress.WorkerProcess(1, 0, cfg, inbox.q, host)
        try:
            first = inbox.until("attached")
            slot, epoch = first["slot"], first["epoch"]
            n = nodes.read_slot(pool, slot)
            assert (n.state, n.epoch, n.pid, n.boot_id) == ("attached", epoch, w.proc.pid,
                                                            boot_id)
            assert pool.node.observer.boot_id != boot_id
            inbox.until("stats")                    # it is at work
            w.pause(until=0)
            _poll(lambda: (nodes.read_slot(pool, slot).state,
                           nodes.read_slot(pool, slot).epoch) != ("attached", epoch),
                  20 * pool.sb.lease_ms / 1000, "the paused worker was not reaped")
            assert w.proc.poll() is None            # reaped while its process was alive
            w.resume()
            fenced = inbox.until("fenced")
            assert fenced["kind"] in ("fenced", "lock-lost"), fenced
            again = inbox.until("attached")
            assert (again["slot"], again["epoch"]) != (slot, epoch)
            assert nodes.read_slot(pool, again["slot"]).state == "attached"
            w.stop()
            final = inbox.until("final")
            assert final["fenced"] == 1 and final["ops"]["alloc"] > 0
            assert w.proc.wait(30) == 0, w.why()
            assert [m for m in inbox.all if m["t"] == "violation"] == []
        finally:
            if w.proc.poll() is None:
                w.resume()
                w.proc.kill()
                w.proc.wait(10)


@pytest.fixture(params=["cas", "manager"])
def pause_pool(request, pool_path, monkeypatch):
    """A pool with a short lease (300 ms: pauses of 0.45-0.9 s) in each sync
    mode; manager mode under the non-coherence emulation, as hosts without
    cross-host coherence would see it."""
    init_pool(pool_path, {"size": 64 * MiB, "chunk_size": MiB, "max_nodes": 16,
                          "lease_ms": 300, "sync": request.param})
    if request.param == "manager":
        monkeypatch.setenv("CXLKV_NONCOHERENT", "1")
    return pool_path


def test_pauses_and_kills_are_survived(cli, pause_pool):
    """Workers stopped past their lease at random moments (and some killed):
    nothing they had in flight lands on another node's memory."""
    r = cli("stress", "--pool", pause_pool, "--nodes", "4", "--seconds", "3",
            "--pause-rate", "3", "--kill-rate", "0.5", "--seed", "4", "--json")
    doc = r.json()
    assert doc["violations"] == [] and doc["passed"] and r.code == 0, r.err
    assert doc["pauses"] > 0 and doc["resumes"] + doc["paused_kills"] == doc["pauses"]
    assert doc["kills"] == doc["restarts"] and doc["hangs"] == 0
    # how many pauses got their worker reaped depends on how busy the machine is
    # (the long run asserts that some did)
    assert doc["pauses_reaped"] <= doc["pauses"]
    assert doc["ops"]["kv"] > 0 and doc["kv"]["loaded_blocks"] > 0
    assert all(c["passed"] for c in doc["checks"].values())
    assert_empty(pause_pool)


def test_damaged_payload_bodies_say_what_landed_on_them():
    import numpy as np

    class Buf:
        def __init__(self, b):
            self.b = b

        def view(self, off, n):
            return memoryview(self.b)[off:off + n]

    h = stress.HEADER.size
    p = stress.Payload(0, 1, 7, h + 8 * 4096)
    buf = bytearray(np.random.default_rng(1).bytes(p.length))
    assert stress.describe_body(Buf(buf), p) == "no page of zeros or of a KV pattern"
    buf[h + 2 * 4096:h + 5 * 4096] = bytes(3 * 4096)
    buf[h + 6 * 4096:h + 7 * 4096] = bytes(range(16)) * 256
    said = stress.describe_body(Buf(buf), p)
    assert said.startswith("3 of 8 pages zeros (pages 2-4, body bytes 0x2000-0x5000)"), said
    assert "1 of 8 pages a KV block's pattern (pages 6-6" in said


def test_kv_blocks_name_what_overwrote_them():
    import numpy as np

    keys = np.frombuffer(bytes(range(32)), dtype=np.uint8).reshape(2, 16)
    blocks = stress.kv_pattern(keys, 64)
    assert blocks.shape == (2, 64) and blocks[1].tobytes() == bytes(range(16, 32)) * 4
    key = bytes(range(16))
    assert stress.describe_block(blocks[0].tobytes(), key) == "its own pattern"
    assert "zeros" in stress.describe_block(bytes(64), key)
    assert "another key (101112" in stress.describe_block(blocks[1].tobytes(), key)
    mixed = key * 2 + bytes(range(16, 32)) * 2
    assert stress.describe_block(mixed, key).startswith("bytes from 32 on are the pattern")
    payload = stress.HEADER.pack(stress.MAGIC, 3, 1, 64, 0) + bytes(24)
    assert "stress payload of worker 3" in stress.describe_block(payload, key)
    assert stress.kv_block_bytes(62 * MiB) == 256 * 1024
    assert stress.kv_block_bytes(MiB) == 4096 and stress.kv_block_bytes(1 << 40) == MiB


def test_quarantine_check_names_a_node_left(cli, stress_pool, monkeypatch):
    """A node that never leaves the table fails the drain check, within its bound."""
    import time

    check_pool = stress.Supervisor.check_pool
    took = []

    def with_a_node_left(self):
        with cxlkv.open_pool(self.opts.pool):          # alive: never reaped
            t0 = time.monotonic()
            check_pool(self)
            took.append(time.monotonic() - t0)

    monkeypatch.setattr(stress.Supervisor, "check_pool", with_a_node_left)
    r = cli("stress", "--pool", stress_pool, "--nodes", "2", "--ops", "200", "--json")
    assert r.code == 1, r.err
    doc = r.json()
    assert [(v["check"], v["kind"]) for v in doc["violations"]] == [("quarantine",
                                                                     "not-drained")]
    assert "is still attached" in doc["violations"][0]["detail"]
    bound = doc["grace_s"] + 2 * doc["lease_s"]
    assert bound <= took[0] < bound + 5
    assert_empty(stress_pool)


def test_watchdog_names_a_stuck_worker(stress_pool):
    """A worker stopped behind the supervisor's back (local, so never reaped:
    its pid lives) is reported as hung, killed and replaced; the run ends."""
    import os
    import signal
    import threading
    import time

    from cxlkv.api import Pool
    from cxlkv.state import nodes

    stopped = []

    def stop_one():
        deadline = time.monotonic() + 30
        with Pool.open(stress_pool, writable=False) as p:
            while time.monotonic() < deadline:
                workers = [n for n in nodes.read_nodes(p)
                           if n.state == "attached" and n.pid != os.getpid()]
                if len(workers) == 2:
                    time.sleep(0.3)                   # let them work a little
                    os.kill(workers[0].pid, signal.SIGSTOP)
                    stopped.append(workers[0].pid)
                    return
                time.sleep(0.02)

    t = threading.Thread(target=stop_one)
    t.start()
    res = stress.run(stress.Options(stress_pool, 2, {"alloc": 3, "free": 2, "verify": 1, "lock": 1,
                                               "kv": 1}, seconds=3, seed=3, op_timeout=2.0))
    t.join()
    assert stopped, "no worker to stop"
    hung = [v for v in res.violations if v["kind"] == "worker-hang"]
    assert hung and all(v["check"] == "hang" for v in hung)
    assert any(f"pid {stopped[0]}," in v["detail"] for v in hung), hung
    assert res.hangs >= 1 and not res.checks["hang"]["passed"]
    assert {v["check"] for v in res.violations} == {"hang"}, res.violations
    assert_empty(stress_pool)


@pytest.mark.long
def test_long_pause_run(cli, pause_pool):
    """Minutes of pauses and kills (CXLKV_STRESS_SECONDS, default 120) in each
    sync mode; prints the figures."""
    import os

    seconds = os.environ.get("CXLKV_STRESS_SECONDS", "120")
    r = cli("stress", "--pool", pause_pool, "--nodes", "4", "--seconds", seconds,
            "--pause-rate", "2", "--kill-rate", "0.5", "--json")
    doc = r.json()
    print(f"\n{doc['sync']}: {doc['ops']['total']} ops in {doc['seconds']:.0f} s, "
          f"{doc['pauses']} pauses ({doc['pauses_reaped']} reaped meanwhile), "
          f"{doc['reaps']} reaps, {doc['fenced']} fenced, {doc['kills']} kills, "
          f"{doc['kv']['evictions']} KV evictions, {len(doc['violations'])} violations")
    assert doc["violations"] == [] and r.code == 0, r.err
    assert doc["pauses_reaped"] > 0 and doc["fenced"] > 0 and doc["reaps"] > 0
    assert doc["kv"]["evictions"] > 0 and doc["ops"]["lock"] > 0
    assert_empty(pause_pool)
