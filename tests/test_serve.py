"""cxlkv serve: SIGTERM detaches and exits 0; a second SIGTERM exits at once;
a kill -9'd node is reaped within its lease plus one scan and its memory
returns; metrics over loopback HTTP parse and count a known workload;
/healthz flips to 503 and back; the config file; the hosted lock manager."""
from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid

import pytest
from prometheus_client.parser import text_string_to_metric_families

import cxlkv
from cxlkv.kv.area import AGENT_WATERMARK
from cxlkv.pool import layout
from cxlkv.ops.init import init_pool
from cxlkv.api import Pool
from cxlkv.state import nodes as node_table
from cxlkv.ops.fsck import check

from cxlkv.testing.checks import wait_for
from cxlkv.testing.data import pattern_bytes
from cxlkv.testing.nodes import NodeProc

MiB = 1 << 20
BLOCK = 64 * 1024


class Serve:
    """`cxlkv serve` in a child process; its JSON log lines are read as they come."""

    def __init__(self, path=None, *args, log_json=True, argv=None):
        """argv: the arguments after `cxlkv serve` instead of the usual ones
        (then nothing waits for the log)."""
        if argv is not None:
            argv, log_json = [sys.executable, "-m", "cxlkv", "serve", *argv], False
        else:
            argv = [sys.executable, "-m", "cxlkv", "serve", "--pool", path, "--interval", "0.1",
                    "--metrics-addr", "127.0.0.1:0", *args]
        if log_json:
            argv.append("--log-json")
        self.p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue = queue.Queue()
        self.log: list = []
        threading.Thread(target=self._read, daemon=True).start()
        self.url = None
        if log_json:
            ready = self.wait_log(lambda d: d["msg"] == "ready")
            self.url = next(d["metrics_url"] for d in self.log if "metrics_url" in d)
            assert ready["pool"] == path

    def _read(self):
        for line in self.p.stderr:
            self.lines.put(line)
        self.lines.put(None)

    def wait_log(self, pred, timeout=30.0):
        deadline = time.monotonic() + timeout
        while True:
            for d in self.log:
                if isinstance(d, dict) and pred(d):
                    return d
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                line = ""
            if line is None or time.monotonic() > deadline:
                raise AssertionError(f"serve log never matched; rc={self.p.poll()} "
                                     f"log={self.log}")
            if line:
                try:
                    self.log.append(json.loads(line))
                except json.JSONDecodeError:
                    self.log.append(line)

    def drain(self) -> list:
        """The log so far, with every line already written read in (no wait)."""
        while True:
            try:
                line = self.lines.get_nowait()
            except queue.Empty:
                return self.log
            if line is None:                    # the end: left for wait_log to see
                self.lines.put(None)
                return self.log
            if line:
                try:
                    self.log.append(json.loads(line))
                except json.JSONDecodeError:
                    self.log.append(line)

    def get(self, path):
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def metrics(self) -> dict:
        """{(name, labels): value}; every series carries the pool's UUID as label
        `pool` (checked here, then left out of the key)."""
        code, text = self.get("/metrics")
        assert code == 200
        out, pools = {}, set()
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                labels = dict(s.labels)
                pools.add(labels.pop("pool", None))
                out[(s.name, tuple(sorted(labels.items())))] = s.value
        assert len(pools) == 1 and None not in pools, pools
        return out

    def stop(self, timeout=10.0) -> int:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"serve did not stop {timeout} s after SIGTERM; "
                                 f"its threads:\n{stacks(self.p, self.lines)}") from None

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(30)


def stacks(p, lines: queue.Queue) -> str:
    """The stack of every thread of a running serve (its SIGUSR1 dump), from
    the queue its stderr is read into."""
    p.send_signal(signal.SIGUSR1)
    out, deadline = [], time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.2)
        except queue.Empty:
            if any(x.startswith("Current thread") or x.startswith("Thread 0x") for x in out):
                break
            continue
        if line is None:
            break
        out.append(line)
    return "".join(out)


def sample(m, name, **labels):
    return m.get((name, tuple(sorted(labels.items()))))


@pytest.fixture
def serve():
    running = []

    def start(*a, **kw):
        s = Serve(*a, **kw)
        running.append(s)
        return s

    yield start
    for s in running:
        s.kill()


def attached(path):
    with Pool.open(path, writable=False) as p:
        return [n for n in node_table.read_nodes(p) if n.state != "free"]


def test_sigterm_detaches_and_exits_0(spool, serve):
    s = serve(spool)
    nodes = attached(spool)
    assert [n.pid for n in nodes] == [s.p.pid]
    t0 = time.monotonic()
    assert s.stop() == 0
    assert time.monotonic() - t0 < 5
    assert attached(spool) == []
    s.wait_log(lambda d: d["msg"] == "stopped")
    assert [d["msg"] for d in s.log if d["msg"] in ("detached", "stopped")] == \
        ["detached", "stopped"]
    with Pool.open(spool, writable=False) as p:
        assert check(p).clean


def test_sigusr1_dumps_every_thread_and_runs_on(spool, serve):
    """kill -USR1: the stack of every thread on stderr (the heartbeat's among
    them), and the agent goes on serving and stops cleanly."""
    s = serve(spool)
    dump = stacks(s.p, s.lines)
    assert "Current thread" in dump or "Thread 0x" in dump, dump
    assert "_run" in dump and "nodes.py" in dump, dump       # the heartbeat thread
    assert s.p.poll() is None
    assert s.get("/healthz")[0] == 200
    assert s.stop() == 0


def test_first_sigterm_under_lock_contention_exits_within_the_deadline(spool, serve):
    """Another node holds the pool lock the detach's own recovery needs: the
    agent still exits 0 within --stop-timeout, with a warning, and its node
    (no longer heartbeating) is reaped by the others."""
    s = serve(spool, "--stop-timeout", "1")
    q = NodeProc()
    try:
        q.attach(spool)
        agent_slot = next(n.slot for n in attached(spool) if n.slot != q.slot)
        assert q.call(op="lock") == {"locked": True}
        wait_for(lambda: sample(s.metrics(), "cxlkv_agent_ticks_total") > 3, what="ticks")
        t0 = time.monotonic()
        assert s.stop() == 0
        assert time.monotonic() - t0 < 3.0             # 1 s, plus starting to stop
        s.wait_log(lambda d: d["msg"] == "stopped")
        warn = s.wait_log(lambda d: d["level"] == "warning" and "could not detach" in d["msg"])
        assert f"node {agent_slot}" in warn["msg"] and f"node {q.slot}" in warn["msg"]
        assert q.call(op="unlock") == {"unlocked": True}
        # the tickets the agent gave up cost nothing: the lock is free at once
        # (a ticket nobody claims would hold every waiter up for a lease)
        t1 = time.monotonic()
        assert q.call(op="lock", timeout=0.9) == {"locked": True}
        assert time.monotonic() - t1 < 0.9
        assert q.call(op="unlock") == {"unlocked": True}
        # q's reaper finds the agent's process gone (same host) and reaps it
        wait_for(lambda: [n.slot for n in attached(spool)] == [q.slot], what="reaped")
        r = q.call(op="alloc_publish", nbytes=4096, reserved=0, published=1)
        assert r.get("published"), r
    finally:
        q.close()
    with Pool.open(spool, writable=False) as p:
        assert check(p).clean


def test_second_sigterm_exits_at_once(spool, serve):
    """With the pool lock held elsewhere the clean detach waits for it (up
    to --stop-timeout); a second SIGTERM ends the agent at once (its node is
    reaped later)."""
    s = serve(spool, "--stop-timeout", "120")
    q = NodeProc()
    try:
        q.attach(spool)
        assert q.call(op="lock") == {"locked": True}
        s.p.send_signal(signal.SIGTERM)
        s.wait_log(lambda d: d["msg"].startswith("stopping"))
        assert s.p.poll() is None                      # waiting for the lock to detach
        t0 = time.monotonic()
        s.p.send_signal(signal.SIGTERM)
        assert s.p.wait(5) == -signal.SIGTERM
        assert time.monotonic() - t0 < 2
        assert q.call(op="unlock") == {"unlocked": True}
    finally:
        q.close()
    import cxlkv

    with cxlkv.open_pool(spool):                       # attaching reaps the agent's node
        pass
    with Pool.open(spool, writable=False) as p:
        assert check(p).clean


def _make_remote(path, slot):
    """Make a node look like one of another host (other boot id): its death
    is then judged by its heartbeat, on the agent's clock, after a lease."""
    with Pool.open(path) as p:
        off = node_table.node_offset(p, slot) + layout.field_offset(layout.NodeStruct, "boot_id")
        p.mapping.write(off, uuid.uuid4().bytes)


def _reserved_slots(path):
    from cxlkv.state import alloc

    with Pool.open(path, writable=False) as p:
        d = alloc.descriptors(p)
        heads = (d["control"] & 0xFF) == layout.CHUNK_HEAD
        n = sum((int(a) & ~int(b)).bit_count() for aa, bb in
                zip(d["alloc_bits"][heads], d["pub_bits"][heads]) for a, b in zip(aa, bb))
        del d
        return n


@pytest.mark.parametrize("where", ["local", "remote"])
def test_killed_node_is_reaped_within_lease_plus_one_scan(spool, serve, where):
    s = serve(spool)
    lease, scan = 1.0, 1.0 / 4
    q = NodeProc()
    q.attach(spool)
    r = q.call(op="alloc_publish", nbytes=8192, reserved=3, published=2)
    q.call(op="kv_open", args=dict(model="m", block_tokens=4, block_bytes=BLOCK))
    assert q.call(op="kv_store", tokens=list(range(8)))["stored"] == 2
    assert q.call(op="kv_hold", tokens=list(range(8))) == {"blocks": 2}
    assert _reserved_slots(spool) == 3
    if where == "remote":
        _make_remote(spool, q.slot)
    q.kill()
    t0 = time.monotonic()
    # local: fenced and freed at once (its pid is gone); remote: fenced after a lease
    wait_for(lambda: q.slot not in {n.slot for n in attached(spool)
                                    if where == "local" or n.state == "attached"},
             what="the reap")
    took = time.monotonic() - t0
    bound = (lease if where == "remote" else 0) + scan
    assert took <= bound + 0.75, f"fenced after {took:.2f} s (bound {bound:.2f} s)"
    if where == "remote":
        assert took >= lease - scan, f"fenced after {took:.2f} s: before its lease ran out"
        # a node of another host cannot be proven gone and never acknowledges:
        # what it held stays quarantined for the pool's grace
        assert _reserved_slots(spool) == 3
        with Pool.open(spool, writable=False) as p:
            grace = p.sb.quarantine_grace_ms / 1000
        wait_for(lambda: q.slot not in {n.slot for n in attached(spool)},
                 timeout=grace + 10, what="the end of the quarantine")
        took = time.monotonic() - t0
        assert lease + grace - scan <= took <= lease + grace + scan + 1.5, took
    # its memory returned: reservations freed, pins dropped; published data kept
    assert _reserved_slots(spool) == 0
    with Pool.open(spool, writable=False) as p:
        rep = check(p)
        assert rep.clean, [f.to_json() for f in rep.errors]
        for off in r["published"]:
            assert p.mapping.read(off, 4) == b"PUBL"
    # counted, and the next snapshot shows the pins gone
    wait_for(lambda: (lambda m: sample(m, "cxlkv_reaps_total") == 1 and sample(
        m, "cxlkv_pool_bytes", state="kv_unevictable") == 0)(s.metrics()), what="metrics")
    # the log names who it was
    s.wait_log(lambda d: d["msg"] == "reaped a dead node" and d["node"] == q.slot
               and d.get("pid") == q.p.pid and d.get("host"))
    assert s.stop() == 0


def test_metrics_after_a_known_workload(spool, serve):
    s = serve(spool)
    q = NodeProc()
    try:
        q.attach(spool)
        q.call(op="kv_open", args=dict(model="llama", block_tokens=4, block_bytes=BLOCK))
        assert q.call(op="kv_store", tokens=list(range(20)))["stored"] == 5
        assert q.call(op="kv_match", tokens=list(range(28)))["matched"] == 20
        assert q.call(op="kv_hold", tokens=list(range(8))) == {"blocks": 2}

        # a snapshot taken wholly after the workload: two ticks after now (one
        # taken between the store and the match would show the store alone)
        after = (sample(s.metrics(), "cxlkv_agent_ticks_total") or 0) + 2

        def settled():
            m = s.metrics()
            return m if (sample(m, "cxlkv_agent_ticks_total") or 0) >= after and \
                sample(m, "cxlkv_nodes", state="alive") == 2 else None

        m = wait_for(settled, what="the workload in the metrics")
        assert sample(m, "cxlkv_kv_stores_total", namespace="llama") == 5
        ns = dict(namespace="llama")
        assert sample(m, "cxlkv_kv_hits_total", **ns) == 5 + 2      # match, then load
        assert sample(m, "cxlkv_kv_misses_total", **ns) == 2
        assert sample(m, "cxlkv_kv_evictions_total", **ns) == 0
        assert sample(m, "cxlkv_kv_blocks", **ns) == 5
        # 5 blocks: the first two pinned (and so unevictable), the last three evictable
        assert sample(m, "cxlkv_pool_bytes", state="kv_evictable") == 3 * BLOCK
        assert sample(m, "cxlkv_pool_bytes", state="kv_unevictable") == 2 * BLOCK
        data = sample(m, "cxlkv_pool_data_bytes")
        assert sum(sample(m, "cxlkv_pool_bytes", state=st) for st in
                   ("free", "kv_evictable", "kv_unevictable", "other")) == data
        assert sample(m, "cxlkv_nodes", state="free") == 6
        assert sample(m, "cxlkv_nodes_by_version", sw_version=cxlkv.__version__,
                      format_version="1") == 2
        assert sample(m, "cxlkv_lock_wait_seconds_count") >= 1
        assert sample(m, "cxlkv_reaps_total") == 0
        assert sample(m, "cxlkv_health_status") == 0
    finally:
        q.close()
    assert s.stop() == 0


def test_healthz_flips_to_503_and_back(spool, serve):
    s = serve(spool, "--warn-used", "30", "--crit-used", "50")
    assert s.get("/healthz")[0] == 200
    q = NodeProc()
    try:
        q.attach(spool)
        q.call(op="kv_open", args=dict(model="m", block_tokens=4, block_bytes=BLOCK))
        with Pool.open(spool, writable=False) as p:
            n = int(0.6 * p.sb.regions["data"][1]) // BLOCK
        toks = list(range(4 * n))
        assert q.call(op="kv_store", tokens=toks)["stored"] == n
        assert q.call(op="kv_hold", tokens=toks) == {"blocks": n}     # pinned: unevictable
        code, body = wait_for(lambda: (lambda r: r if r[0] == 503 else None)(s.get("/healthz")),
                              what="503")
        assert body.startswith("CXLKV CRITICAL") and "unevictable" in body
        q.call(op="kv_release")
        wait_for(lambda: s.get("/healthz")[0] == 200, what="200 again")
    finally:
        q.close()
    assert s.stop() == 0


def test_watermark_kept_in_the_background(spool, serve):
    """KV blocks fill the pool, then other allocations push free space under
    the low watermark: the agent evicts (LRU) until 10 % is free again."""
    s = serve(spool)
    q = NodeProc()
    try:
        q.attach(spool)
        q.call(op="kv_open", args=dict(model="m", block_tokens=4, block_bytes=BLOCK))
        with Pool.open(spool, writable=False) as p:
            data = p.sb.regions["data"][1]
        n = int(0.7 * data) // BLOCK
        assert q.call(op="kv_store", tokens=list(range(4 * n)))["stored"] == n
        other = int(0.27 * data) // 8192
        q.call(op="alloc_publish", nbytes=8192, reserved=0, published=other)
        ev = s.wait_log(lambda d: d["msg"].startswith("evicted"))
        # a tick may come while the allocations are still going on: any free
        # space under the agent's watermark makes it evict
        assert ev["blocks"] > 0 and ev["free_before"] < AGENT_WATERMARK * data

        def evicted() -> int:           # every round logged so far (one or more)
            return sum(d["blocks"] for d in s.drain()
                       if isinstance(d, dict) and d["msg"].startswith("evicted"))

        # the snapshot after the last round: free space back over 10 %, evictions counted
        wait_for(lambda: (lambda m, n: sample(m, "cxlkv_pool_bytes", state="free")
                          >= 0.095 * data and sample(m, "cxlkv_agent_evicted_blocks_total") == n
                          and sample(m, "cxlkv_kv_evictions_total", namespace="m") == n)(
                              s.metrics(), evicted()), what="free space")
    finally:
        q.close()
    assert s.stop() == 0


def test_config_file_and_flags_win(spool, tmp_path, serve):
    cfg = tmp_path / "serve.toml"
    cfg.write_text(f'pool = "{spool}"\ninterval = 0.2\nlog-json = true\n'
                   '[serve]\nmetrics_addr = "127.0.0.1:0"\nwarn-used = 50\n')
    # the config's log-json is overridden by the flag --log-text
    s = serve(argv=["--config", str(cfg), "--log-text"])
    lines = []
    while not lines or "ready" not in lines[-1]:
        line = s.lines.get(timeout=30)
        assert line is not None, lines
        lines.append(line)
    assert lines[0].startswith("cxlkv serve: attached"), lines
    assert f"pool={spool}" in lines[-1] and "interval=0.2" in lines[-1]
    assert any("metrics on http://127.0.0.1:" in x for x in lines)
    assert s.stop() == 0


def test_config_errors_are_usage_errors(cli, spool, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('pool = "x"\nmetrics-adr = "127.0.0.1:1"\n')
    r = cli("serve", "--config", str(bad))
    assert r.code == 2 and "unknown setting 'metrics-adr'" in r.err
    bad.write_text("interval = 'fast'\n")
    r = cli("serve", "--config", str(bad), "--pool", spool)
    assert r.code == 2 and "interval" in r.err
    bad.write_text("interval = \n")
    assert cli("serve", "--config", str(bad)).code == 2
    r = cli("serve", "--pool", spool, "--numa-node", "north")
    assert r.code == 2
    r = cli("serve", "--pool", spool, "--metrics-addr", "nowhere")
    assert r.code == 2 and "HOST:PORT" in r.err


def test_with_lock_manager_on_a_cas_pool_is_refused(cli, spool):
    r = cli("serve", "--pool", spool, "--with-lock-manager")
    assert r.code == 1 and "sync mode cas" in r.err and len(r.err.splitlines()) == 1
    assert attached(spool) == []


def test_with_lock_manager(pool_path, serve):
    init_pool(pool_path, {"size": 16 * MiB, "chunk_size": BLOCK, "max_nodes": 8,
                          "lease_ms": 500, "sync": "manager"})
    s = serve(pool_path, "--with-lock-manager")
    assert s.get("/healthz")[0] == 200
    wait_for(lambda: sample(s.metrics(), "cxlkv_lock_manager_active") == 1,
             what="the hosted manager active")
    q = NodeProc()                        # another node attaches through the hosted manager
    try:
        q.attach(pool_path)
        r = q.call(op="alloc_publish", nbytes=4096, reserved=0, published=2)   # takes the lock
        assert len(r["published"]) == 2, r
    finally:
        q.close()
    assert s.stop() == 0
    assert attached(pool_path) == []
    with Pool.open(pool_path, writable=False) as p:
        from cxlkv.state import protocol

        p.mapping.invalidate(protocol.lock_header(p) + protocol.MGR_TOKEN, 8)
        # the lease handed back
        assert p.mapping.load64(protocol.lock_header(p) + protocol.MGR_TOKEN) == 0


def test_numa_node(spool, serve):
    """--numa-node binds before attaching (cxlkv.host.numa) and says where."""
    p = subprocess.run([sys.executable, "-m", "cxlkv", "serve", "--pool", spool, "--numa-node",
                        "99999"], capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    if "libnuma" in p.stderr or "NUMA is not" in p.stderr:
        pytest.skip(f"no NUMA support here: {p.stderr.strip()}")
    s = serve(spool, "--numa-node", "0")
    att = s.wait_log(lambda d: d["msg"] == "attached")
    assert att["numa_cpu_node"] == 0
    assert s.stop() == 0


# -- the agent reports its own failures; /healthz does not serve a stale verdict --------------

@pytest.fixture
def agent(spool):
    """An agent in this process (ticks driven by the test)."""
    import io

    from cxlkv.daemons.agent import Agent
    from cxlkv.daemons.config import AgentConfig
    from cxlkv.daemons.service import make_logger

    made = []

    def make(path=spool, **kw):
        log = io.StringIO()
        a = Agent(AgentConfig(pool=path, interval=0.1, metrics_addr="127.0.0.1:0", **kw),
                  make_logger(True, log))
        a.logbuf = log
        a.start()
        made.append(a)
        return a

    yield make
    for a in made:
        a.shutdown()


def test_reaper_survives_a_failing_recovery(agent, spool):
    """A recovery that raises (damage a later round no longer trips over) used
    to end the reaper thread for good while /healthz stayed 200."""
    boom = {"on": True, "calls": 0}

    def damaged(pool, slot, epoch):
        if boom["on"]:
            boom["calls"] += 1
            raise ValueError("offset is not a slot of that slab")

    node_table.register_recovery(damaged, order=1)
    try:
        a = agent()
        q = NodeProc()
        q.attach(spool)
        q.kill()
        node = a.pool.node
        wait_for(lambda: boom["calls"] >= 2, what="the reaper retrying")
        assert node._reaper.is_alive() and "ValueError" in node.reap_error
        boom["on"] = False                          # the damage is gone: the next round reaps
        wait_for(lambda: q.slot not in {n.slot for n in attached(spool)}, what="the reap")
        assert node._reaper.is_alive()
        a.tick()
        assert a.healthz()[0]
    finally:
        node_table._recoveries.remove(damaged)


def test_dead_reaper_thread_is_critical(agent):
    import threading

    a = agent()
    gone = threading.Thread(target=lambda: None)
    gone.start()
    gone.join()
    a.pool.node._reaper, live = gone, a.pool.node._reaper
    try:
        a.tick()
        ok, line = a.healthz()
        assert not ok and line.startswith("CXLKV CRITICAL") and "reaper thread stopped" in line
    finally:
        a.pool.node._reaper = live


def test_dead_lock_manager_thread_is_critical(agent, tmp_path):
    pool_path = str(tmp_path / "manager.pool")
    init_pool(pool_path, {"size": 16 * MiB, "chunk_size": BLOCK, "max_nodes": 8,
                          "lease_ms": 300, "sync": "manager"})
    a = agent(pool_path, with_lock_manager=True)
    assert a.healthz()[0]

    def crash(*args, **kw):
        raise RuntimeError("a bug in the manager")

    a.manager.mgr.step = crash          # the Python loop's round
    a.manager.mgr._c_step = crash       # the C loop's return to Python (at least every C_RETURN_EVERY_S)
    wait_for(lambda: not a.manager.alive(), what="the manager thread to die")
    a.tick()
    ok, line = a.healthz()
    assert not ok and "CRITICAL" in line and "lock manager this agent hosts stopped" in line
    assert "a bug in the manager" in line


def test_healthz_503_when_the_snapshot_is_stale(agent):
    a = agent()
    assert a.healthz()[0]
    code = urllib.request.urlopen(a.server.url + "/healthz", timeout=10).status
    assert code == 200
    a.snapshot["at"] -= a.max_snapshot_age() + 1           # as if the tick had hung
    ok, line = a.healthz()
    assert not ok and "UNKNOWN" in line and "stuck" in line
    try:
        urllib.request.urlopen(a.server.url + "/healthz", timeout=10)
        raise AssertionError("expected 503")
    except urllib.error.HTTPError as e:
        assert e.code == 503


def test_tick_reads_usage_once(agent, monkeypatch):
    """usage() reads the descriptors and the whole hash table: once per tick."""
    from cxlkv.ops import health

    a = agent()
    calls = []
    real = health.usage
    monkeypatch.setattr(health, "usage", lambda pool: calls.append(1) or real(pool))
    a.tick()
    assert len(calls) == 1
    assert a.snapshot["usage"]["data_bytes"] > 0 and a.healthz()[0]


def test_slow_device_tools_never_delay_a_tick(agent, monkeypatch):
    """The device is read in a thread of its own: a `cxl list` that hangs
    leaves the ticks (and /healthz) going."""
    import threading

    from cxlkv.ops import health
    from cxlkv.host import numa

    release = threading.Event()
    started = threading.Event()

    def hung(path, timeout=5.0):
        started.set()
        release.wait(60)
        return None

    monkeypatch.setattr(numa, "dax_of", lambda path: "dax0.0")
    monkeypatch.setattr(health, "device_health", hung)
    try:
        a = agent()
        assert started.wait(10)
        t0 = time.monotonic()
        a.tick()
        a.tick()
        assert time.monotonic() - t0 < 2.0
        assert a.healthz()[0]
    finally:
        release.set()


def test_a_dax_pool_without_the_poison_trace_event_is_said(agent, monkeypatch, tmp_path):
    """On a DAX pool whose kernel offers no cxl_poison trace event (tracefs
    not mounted, an old kernel) the agent says it does not follow poison."""
    from cxlkv.host import numa

    monkeypatch.setenv("CXLKV_SYSFS_ROOT", str(tmp_path / "sys"))     # no tracefs in it
    monkeypatch.setattr(numa, "dax_of", lambda path: "dax0.0")
    a = agent()
    assert "poison: not following poison on dax0.0" in a.logbuf.getvalue()


# -- the spill store the agent owns -----------------------------------------------------------

def _fill_and_squeeze(q, spool, first: int, nseq: int, other: float):
    """q stores `nseq` sequences of 8 blocks (numbered from `first`), then
    allocates `other` of the data area outside the KV cache: free space
    drops under the low watermark and the agent evicts (LRU: the oldest
    sequences, whole)."""
    with Pool.open(spool, writable=False) as p:
        data = p.sb.regions["data"][1]
    seqs = [list(range(s * 1000, s * 1000 + 32)) for s in range(first, first + nseq)]
    for t in seqs:
        assert q.call(op="kv_store", tokens=t)["stored"] == 8
    if other:
        q.call(op="alloc_publish", nbytes=8192, reserved=0,
               published=int(other * data) // 8192)
    return seqs, data


def _to_3pct_free(nseq: int, data: int) -> float:
    """The share of the data area other allocations take so that, after
    `nseq` sequences of 8 blocks, 3 % is left free (under the low watermark
    whatever the metadata's size)."""
    return 0.97 - nseq * 8 * BLOCK / data


def _evicted(s, since=0):
    """Blocks the agent says it evicted (in log lines from `since` on)."""
    return sum(d["blocks"] for d in s.drain()[since:] if isinstance(d, dict)
               and d["msg"].startswith("evicted KV blocks"))


def test_agent_spills_its_evictions_and_a_reader_promotes_them(spool, serve, tmp_path):
    import cxlkv
    from cxlkv.kv.tiers import spill

    d = tmp_path / "spill"
    s = serve(spool, "--spill-dir", str(d), "--spill-bytes", "64M")
    opened = s.wait_log(lambda x: x["msg"] == "spill store open")
    assert opened["mode"] == "owner" and opened["max_bytes"] == 64 * MiB
    q = NodeProc()                                       # a serving process without a store
    try:
        q.attach(spool)
        q.call(op="kv_open", args=dict(model="m", block_tokens=4, block_bytes=BLOCK))
        with Pool.open(spool, writable=False) as p:
            nseq = int(0.7 * p.sb.regions["data"][1]) // (8 * BLOCK)
            other = _to_3pct_free(nseq, p.sb.regions["data"][1])
        seqs, data = _fill_and_squeeze(q, spool, 0, nseq, other)
        ev = s.wait_log(lambda x: x["msg"].startswith("evicted KV blocks"))
        assert ev["blocks"] >= 8
        # every block the agent evicted is written by its store's writers
        m = wait_for(lambda: (lambda m: m if sample(m, "cxlkv_spill_written_blocks_total")
                              == _evicted(s) else None)(s.metrics()), what="the spill writes")
        assert sample(m, "cxlkv_spill_store_bytes") == _evicted(s) * (BLOCK + spill.HDR_SIZE)
        assert sample(m, "cxlkv_spill_dropped_blocks_total", reason="queue-full") == 0
        # a serving process of this host attaches to the agent's directory as a reader
        with cxlkv.open_pool(spool) as pool:
            kv = pool.kv(model="m", block_tokens=4, block_bytes=BLOCK, spill_dir=str(d),
                         spill_bytes=1)
            sp = spill.store_of(pool)
            assert sp.mode == "reader" and sp.stats()["max_bytes"] == 64 * MiB
            cold = [t for t in seqs if kv._lookup(kv._keys(t))[0] < 8]
            assert cold and all(kv.match(t) == 32 for t in seqs)   # pool, then spill
            for t in cold[:2]:
                out = bytearray(8 * BLOCK)
                assert kv.load_into(t, out) == 8
                assert bytes(out) == pattern_bytes(kv, t)           # bit-exact
                assert kv._lookup(kv._keys(t))[0] == 8               # promoted into the pool
            st = sp.stats()
            assert st["promoted"] >= 1 and st["hits"] >= 1 and st["corrupt"] == 0
            spill.disable(pool)
    finally:
        q.close()
    assert s.stop() == 0
    assert list(d.glob("slots-*.dat"))                     # the store outlives the agent


def test_agent_spill_metrics_and_a_failing_disk(spool, serve, tmp_path):
    """A known workload: the first evictions meet a failing disk (a
    directory where the slot file goes: writes fail with an OSError), dropped with
    reason "disk" and one warning through the agent's JSON log; once the
    disk works again the next evictions are written.  The size options come
    from the config file, the flag wins."""
    d = tmp_path / "spill"
    from cxlkv.kv.tiers import spill

    d.mkdir()
    (d / spill.file_name(spill.slot_bytes(BLOCK))).mkdir()     # in the way
    cfg = tmp_path / "serve.toml"
    cfg.write_text(f'spill-dir = "{d}"\nspill-bytes = "1G"\nspill_queue_bytes = 8388608\n')
    s = serve(spool, "--config", str(cfg), "--spill-bytes", "32M")
    q = NodeProc()
    try:
        opened = s.wait_log(lambda x: x["msg"] == "spill store open")
        assert opened["max_bytes"] == 32 * MiB and opened["spill_dir"] == str(d)
        q.attach(spool)
        q.call(op="kv_open", args=dict(model="m", block_tokens=4, block_bytes=BLOCK))
        with Pool.open(spool, writable=False) as p:
            nseq = int(0.7 * p.sb.regions["data"][1]) // (8 * BLOCK)
            other = _to_3pct_free(nseq, p.sb.regions["data"][1])
        _, data = _fill_and_squeeze(q, spool, 0, nseq, other)
        s.wait_log(lambda x: x["msg"].startswith("evicted KV blocks"))
        e1 = _evicted(s)
        wait_for(lambda: sample(s.metrics(), "cxlkv_spill_dropped_blocks_total",
                                reason="disk") == e1, what="the drops")
        warn = s.wait_log(lambda x: x["level"] == "warning" and x.get("reason") == "disk")
        assert warn["msg"].startswith("spill: ") and warn["spill_dir"] == str(d)
        mark = len(s.log)
        (d / spill.file_name(spill.slot_bytes(BLOCK))).rmdir()   # the disk works again
        # more blocks: free space under the watermark again, the agent evicts again
        # (free is 10 % after the agent's eviction; 2 sequences leave about 4 %)
        _fill_and_squeeze(q, spool, 1000, 1 + int(0.06 * data) // (8 * BLOCK), 0)
        s.wait_log(lambda x: _evicted(s, mark) > 0)

        def settled():
            m = s.metrics()
            return m if sample(m, "cxlkv_spill_written_blocks_total") == _evicted(s, mark) \
                else None

        m = wait_for(settled, what="the spill writes")
        e2 = _evicted(s, mark)
        assert e2 > 0
        assert sample(m, "cxlkv_spill_dropped_blocks_total", reason="disk") == e1
        assert sample(m, "cxlkv_spill_dropped_blocks_total", reason="store-full") == 0
        assert sample(m, "cxlkv_spill_written_bytes_total") == e2 * BLOCK
        assert sample(m, "cxlkv_spill_store_bytes") == e2 * (BLOCK + 72)
        assert sample(m, "cxlkv_spill_limit_bytes") == 32 * MiB
        assert sample(m, "cxlkv_spill_queue_limit_bytes") == 8 * MiB
        assert sample(m, "cxlkv_spill_queue_bytes") == 0
        assert sample(m, "cxlkv_spill_evicted_blocks_total") == 0
        assert sample(m, "cxlkv_spill_owner") == 1
        assert sample(m, "cxlkv_agent_evicted_blocks_total") == e1 + e2
        assert len([x for x in s.log if isinstance(x, dict) and x.get("reason") == "disk"]) == 1
    finally:
        q.close()
    assert s.stop() == 0


def test_spill_dir_owned_by_another_process_is_refused(cli, spool, tmp_path):
    from cxlkv.kv.tiers import spill

    st = spill.SpillStore(tmp_path / "s", MiB)              # this process owns it
    try:
        r = cli("serve", "--pool", spool, "--spill-dir", str(tmp_path / "s"),
                "--spill-bytes", "1M")
        assert r.code == 1 and "owned by another process" in r.err, r.err
        assert attached(spool) == []
    finally:
        st.close()


def test_spill_usage_errors(cli, spool, tmp_path):
    r = cli("serve", "--pool", spool, "--spill-dir", str(tmp_path / "s"))
    assert r.code == 2 and "--spill-bytes" in r.err
    r = cli("serve", "--pool", spool, "--spill-dir", str(tmp_path / "s"), "--spill-bytes", "9Q")
    assert r.code == 2 and "--spill-bytes" in r.err
    r = cli("serve", "--pool", spool, "--spill-bytes", "1G")
    assert r.code == 2 and "--spill-dir" in r.err
    assert not (tmp_path / "s").exists() and attached(spool) == []


def test_a_paused_node_is_quarantined_in_the_metrics(spool, serve, remote_env):
    """A node of 'another host' stops with 3 reservations: the agent fences it
    after a lease and /metrics shows its quarantine until it resumes and
    acknowledges."""
    s = serve(spool)
    q = NodeProc(env=remote_env(CXLKV_PAUSE_AT="kv.reserved:1"))
    try:
        q.attach(spool)
        q.call(op="kv_open", args=dict(model="m", block_tokens=4, block_bytes=BLOCK))
        q.send(op="kv_store", tokens=list(range(12)))            # stops after reserving 3
        wait_for(lambda: (lambda m: sample(m, "cxlkv_quarantined_nodes") == 1
                          and sample(m, "cxlkv_quarantined_bytes") == 3 * BLOCK)(s.metrics()),
                 what="the quarantine in the metrics")
        q.p.send_signal(signal.SIGCONT)
        assert q.reply().get("error") == "NodeFenced"
        wait_for(lambda: sample(s.metrics(), "cxlkv_quarantined_nodes") == 0,
                 what="the quarantine to end")
        assert _reserved_slots(spool) == 0
    finally:
        q.close()
    assert s.stop() == 0


def test_one_tick_above_the_usage_threshold_is_no_verdict_yet(agent, spool):
    """A store in flight holds its blocks unevictable for a moment (the
    agent's health flapped to WARNING while another process stored): the
    agent's usage verdict stands on the second tick above the threshold in a
    row; the one-shot `cxlkv health` judges at once."""
    from cxlkv.ops import health

    a = agent(warn_used=30.0, crit_used=50.0)
    q = NodeProc()
    try:
        q.attach(spool)
        q.call(op="kv_open", args=dict(model="m", block_tokens=4, block_bytes=BLOCK))
        with Pool.open(spool, writable=False) as p:
            n = int(0.6 * p.sb.regions["data"][1]) // BLOCK
        toks = list(range(4 * n))
        assert q.call(op="kv_store", tokens=toks)["stored"] == n
        assert q.call(op="kv_hold", tokens=toks) == {"blocks": n}     # pinned: unevictable

        def usage():
            (c,) = [c for c in a.snapshot["health"].checks if c.id == "usage"]
            return c

        a.tick()
        assert usage().status == health.OK and "this tick only" in usage().text
        assert a.healthz()[0]
        a.tick()
        assert usage().status == health.CRITICAL and not a.healthz()[0]
        a.tick()
        assert usage().status == health.CRITICAL                     # it stands while it lasts
        q.call(op="kv_release")
        a.tick()
        assert usage().status == health.OK and "this tick only" not in usage().text
    finally:
        q.close()


_SIGNAL_IN_WAIT = """
import os, signal, sys
from cxlkv.daemons import agent
from cxlkv.daemons.config import AgentConfig

run = agent.Agent.run


def signalled_in_wait(self):
    # Event.wait() holds its condition's lock for a moment before it sleeps;
    # a SIGTERM whose handler runs in that moment (the CI failure) is sent
    # here, with the lock held, and handled at one of the bytecodes below
    with self.stop_event._cond:
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(200000):
            pass
    run(self)


agent.Agent.run = signalled_in_wait
sys.exit(agent.serve(AgentConfig(pool=sys.argv[1], interval=0.05)))
"""


def test_a_sigterm_handled_while_the_main_thread_holds_the_stop_events_lock_still_stops(spool):
    # the handler used to set the stop event itself: on the thread that held
    # its lock, it waited for itself forever
    p = subprocess.run([sys.executable, "-c", _SIGNAL_IN_WAIT, spool], capture_output=True,
                       text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr
    assert attached(spool) == []
    with Pool.open(spool, writable=False) as pl:
        assert check(pl).clean
