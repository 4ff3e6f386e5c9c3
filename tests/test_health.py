"""cxlkv health: each Nagios exit code driven by a real pool state; one
status line with perfdata; read-only; never past --timeout."""
from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cxlkv.api import Pool
from cxlkv.ops.init import init_pool
from cxlkv.pool import layout
from cxlkv.testing.checks import digest
from cxlkv.testing.damage import fake_node, patch_bytes, rewrite_superblock
from cxlkv.testing.nodes import NodeProc

MiB = 1 << 20
BLOCK = 64 * 1024
LAB = Path(__file__).resolve().parent / "fixtures" / "lab"
LINE = re.compile(r"^CXLKV (OK|WARNING|CRITICAL|UNKNOWN) - (.*?)(?: \| (.*))?$")


@pytest.fixture
def hpool(pool_path):
    init_pool(pool_path, {"size": 16 * MiB, "chunk_size": BLOCK, "max_nodes": 8,
                          "lease_ms": 400, "hash_slots": 512})
    return pool_path


def health(cli, path, *extra):
    r = cli("health", "--pool", path, *extra)
    lines = r.out.splitlines()
    assert len(lines) == 1, r.out                 # exactly one status line
    m = LINE.match(lines[0])
    assert m, lines[0]
    perf = {}
    for item in (m.group(3) or "").split():
        label, rest = item.split("=", 1)
        perf[label] = rest.split(";")
    return r.code, m.group(1), m.group(2), perf


def data_bytes(path):
    with Pool.open(path, writable=False) as p:
        return p.sb.regions["data"][1]


def store_blocks(q: NodeProc, path: str, share: float, hold: bool):
    """Store blocks filling `share` of the data area through node q; pin them if hold."""
    n = int(share * data_bytes(path)) // BLOCK
    q.call(op="kv_open", args=dict(model="m", block_tokens=4, block_bytes=BLOCK))
    toks = list(range(4 * n))
    r = q.call(op="kv_store", tokens=toks)
    assert r.get("stored") == n, r
    if hold:
        assert q.call(op="kv_hold", tokens=toks) == {"blocks": n}
    return n


def test_ok_on_a_fresh_pool(cli, hpool):
    code, st, text, perf = health(cli, hpool)
    assert (code, st) == (0, "OK")
    assert perf["unevictable_pct"][:3] == ["0.00%", "80", "95"]
    assert perf["nodes"][0] == "0" and perf["dead"][0] == "0"
    r = cli("health", "--pool", hpool, "--json")
    doc = r.json()
    assert r.code == 0 and doc["status"] == "OK" and doc["exit_code"] == 0
    assert {c["check"] for c in doc["checks"]} >= {"superblock", "usage", "nodes"}
    assert doc["summary"].startswith("CXLKV OK - ")


def test_a_warm_cache_sitting_full_is_healthy(cli, hpool):
    """90 % of the data area in unpinned KV blocks: evictable, so OK."""
    q = NodeProc()
    try:
        q.attach(hpool)
        store_blocks(q, hpool, 0.90, hold=False)
        code, st, text, perf = health(cli, hpool)
        assert (code, st) == (0, "OK"), text
        assert float(perf["unevictable_pct"][0].rstrip("%")) < 5
        assert int(perf["evictable_bytes"][0].rstrip("B")) >= 0.85 * data_bytes(hpool)
        assert perf["nodes"][0] == "1"
    finally:
        q.close()


def test_pinned_blocks_warn_then_critical(cli, hpool):
    q = NodeProc()
    try:
        q.attach(hpool)
        store_blocks(q, hpool, 0.85, hold=True)
        code, st, text, perf = health(cli, hpool)
        assert (code, st) == (1, "WARNING"), text
        assert "unevictable" in text
        # who pins what: the holder named, so the operator knows which engine to restart
        assert f"top pin holders: node {q.slot} (" in text and f"pid {q.p.pid}:" in text
        assert "used=" not in " ".join(perf) and set(perf) >= {
            "unevictable_pct", "unevictable_bytes", "evictable_bytes"}
        assert 84 <= float(perf["unevictable_pct"][0].rstrip("%")) < 95
        code, st, text, _ = health(cli, hpool, "--crit-unevictable", "84")
        assert (code, st) == (2, "CRITICAL"), text
        q.call(op="kv_release")                   # unpinned: evictable again
        code, st, _, _ = health(cli, hpool)
        assert (code, st) == (0, "OK")
    finally:
        q.close()


def test_dead_node_not_reaped_warns_and_health_does_not_reap(cli, hpool):
    q = NodeProc()
    q.attach(hpool)
    q.kill()
    before = digest(hpool)
    code, st, text, perf = health(cli, hpool)
    assert (code, st) == (1, "WARNING"), text
    assert f"node {q.slot}" in text and "dead" in text
    assert perf["dead"][0] == "1"
    assert digest(hpool) == before                # read-only: never attaches, never reaps


def test_bad_superblock_copy_warns(cli, hpool):
    patch_bytes(hpool, 4096 + 200, b"\x01")
    code, st, text, _ = health(cli, hpool)
    assert (code, st) == (1, "WARNING") and "superblock copy B" in text and "--repair" in text


def test_manager_mode_without_a_lock_manager_is_critical(cli, pool_path):
    init_pool(pool_path, {"size": 16 * MiB, "chunk_size": BLOCK, "max_nodes": 8,
                          "lease_ms": 300, "sync": "manager"})
    code, st, text, _ = health(cli, pool_path)
    assert (code, st) == (2, "CRITICAL") and "lock manager" in text
    mgr = subprocess.Popen([sys.executable, "-m", "cxlkv", "lock-manager", "--pool", pool_path],
                           stderr=subprocess.PIPE, text=True)
    try:
        assert "active" in mgr.stderr.readline()
        code, st, text, _ = health(cli, pool_path)
        assert (code, st) == (0, "OK"), text
    finally:
        mgr.terminate()
        assert mgr.wait(30) == 0


def test_missing_or_corrupt_pool_is_critical(cli, hpool, tmp_path):
    code, st, text, _ = health(cli, str(tmp_path / "nothing.pool"))
    assert (code, st) == (2, "CRITICAL") and "no such file" in text
    patch_bytes(hpool, 0, b"\0" * 8192)          # both superblocks gone
    code, st, text, _ = health(cli, hpool)
    assert (code, st) == (2, "CRITICAL") and "not a formatted pool" in text


def test_newer_format_is_unknown(cli, hpool):
    for copy in "AB":
        rewrite_superblock(hpool, copy, version=layout.FORMAT_VERSION + 1)
    code, st, text, _ = health(cli, hpool)
    assert (code, st) == (3, "UNKNOWN") and "newer" in text


def test_usage_errors_are_unknown(cli, hpool):
    r = cli("health", "--pool", hpool, "--warn-used", "90", "--crit-used", "80")
    assert r.code == 3
    r = cli("health", "--pool", hpool, "--bogus")
    assert r.code == 3 and r.out.startswith("CXLKV UNKNOWN - usage error")
    r = cli("health")
    assert r.code == 3


def test_never_blocks_past_timeout(cli, hpool, monkeypatch):
    """A check stuck anywhere (here: a device that never answers) -> UNKNOWN in time."""
    from cxlkv.ops import health as ops_health

    release = threading.Event()
    monkeypatch.setattr(ops_health, "check_pool", lambda *a, **kw: release.wait(60))
    t0 = time.monotonic()
    try:
        code, st, text, _ = health(cli, hpool, "--timeout", "0.5")
    finally:
        release.set()
    assert time.monotonic() - t0 < 1.5
    assert (code, st) == (3, "UNKNOWN") and "--timeout" in text


def test_undecided_remote_node_within_timeout(cli, pool_path):
    """A node of another host needs a lease of watching to be judged dead; with
    a --timeout shorter than the lease health answers in time anyway - and
    does not say OK: WARNING, with the --timeout that would judge it."""
    init_pool(pool_path, {"size": 16 * MiB, "chunk_size": BLOCK, "max_nodes": 8,
                          "lease_ms": 30_000})
    fake_node(pool_path, 3, pid=1, start_time_ns=1, boot_id="12345678-1234-5678-1234-567812345678",
              hostname="elsewhere")
    t0 = time.monotonic()
    code, st, text, perf = health(cli, pool_path, "--timeout", "1")
    assert time.monotonic() - t0 < 2.0
    assert (code, st) == (1, "WARNING"), text
    assert "1 node(s) not yet judged" in text and "--timeout >= 39" in text


def test_default_timeout_judges_a_dead_node_of_another_host(cli, pool_path):
    """Without --timeout, health watches long enough for the pool's lease:
    a dead node of another host is reported (it was never, with 10 s against
    the default 10 s lease)."""
    init_pool(pool_path, {"size": 16 * MiB, "chunk_size": BLOCK, "max_nodes": 8,
                          "lease_ms": 1500})
    fake_node(pool_path, 3, pid=1, start_time_ns=1, boot_id="12345678-1234-5678-1234-567812345678",
              hostname="elsewhere")
    from cxlkv.ops import health as ops_health

    ops_health.DEFAULT_TIMEOUT, old = 1.0, ops_health.DEFAULT_TIMEOUT   # below 1.25 x lease
    try:
        t0 = time.monotonic()
        code, st, text, perf = health(cli, pool_path)
    finally:
        ops_health.DEFAULT_TIMEOUT = old
    assert time.monotonic() - t0 < 4.0           # judge_timeout(1.5) = 3 s at most
    assert (code, st) == (1, "WARNING") and "dead node" in text and "node 3" in text, text
    from cxlkv.ops import health as pool_health

    assert pool_health.judge_timeout(10.0) == 14.0         # the default lease: 10 s is too short


def test_slow_device_tools_do_not_hide_the_pool_verdict(cli, pool_path, monkeypatch):
    """Device tools that take longer than the time left make the device
    unknown, not the whole answer: the pool's own verdict stands, in time."""
    from cxlkv.host import numa
    from cxlkv.ops import health as pool_health

    init_pool(pool_path, {"size": 16 * MiB, "chunk_size": BLOCK, "max_nodes": 8,
                          "lease_ms": 300, "sync": "manager"})
    release = threading.Event()

    def slow(path, timeout=5.0):
        release.wait(timeout + 5)                 # a tool that outlives its budget
        return None

    monkeypatch.setattr(pool_health, "device_health", slow)
    monkeypatch.setattr(numa, "dax_of", lambda path: "dax0.0")
    t0 = time.monotonic()
    try:
        r = cli("health", "--pool", pool_path, "--timeout", "2", "--json")
    finally:
        release.set()
    assert time.monotonic() - t0 < 2.5
    doc = r.json()
    assert (r.code, doc["status"]) == (2, "CRITICAL") and "no lock manager" in doc["summary"]
    dev = [c for c in doc["checks"] if c["check"] == "device"]
    assert dev and "device unknown" in dev[0]["text"], r.out


def test_device_health_bounds_all_tools_together(monkeypatch):
    """device_health's timeout is one budget for all the tools."""
    from cxlkv.host import discovery, numa
    from cxlkv.ops import health as pool_health

    release = threading.Event()
    monkeypatch.setattr(numa, "dax_of", lambda path: "dax0.0")
    monkeypatch.setattr(discovery, "cxl_inventory", lambda r: release.wait(30))
    t0 = time.monotonic()
    try:
        d = pool_health.device_health("/dev/dax0.0", timeout=0.3)
    finally:
        release.set()
    assert time.monotonic() - t0 < 1.0
    assert d["temperature_c"] is None and "did not answer" in d["error"]


def test_corrupt_kv_header_is_critical(cli, hpool):
    """usage() used to swallow the KV error: a corrupt KV header read OK."""
    import cxlkv

    with cxlkv.open_pool(hpool) as pool:
        pool.kv(model="m", block_tokens=4, block_bytes=BLOCK)
    with Pool.open(hpool, writable=False) as p:
        off = p.sb.regions["kv"][0]
    patch_bytes(hpool, off, b"\xff" * 8)
    code, st, text, perf = health(cli, hpool)
    assert (code, st) == (2, "CRITICAL") and "KV header corrupt: run cxlkv fsck" in text, text


def test_internal_errors_are_unknown(cli, hpool, monkeypatch):
    """Whatever goes wrong inside, a plugin exits 0-3: UNKNOWN."""
    from cxlkv.ops import health as pool_health

    def boom(*a, **kw):
        raise RuntimeError("a bug")

    monkeypatch.setattr(pool_health, "evaluate", boom)
    code, st, text, _ = health(cli, hpool)
    assert (code, st) == (3, "UNKNOWN") and "internal error: RuntimeError: a bug" in text


def test_device_temperature_thresholds(cli, hpool, monkeypatch):
    from cxlkv.ops import health as pool_health

    hot = {"device": "dax0.0", "memdevs": [{"memdev": "mem0", "temperature_c": 78,
                                            "alarms": []}],
           "temperature_c": 78, "alarms": [], "error": None}
    monkeypatch.setattr(pool_health, "device_health", lambda path, timeout=5.0: hot)
    code, st, text, perf = health(cli, hpool)
    assert (code, st) == (1, "WARNING") and "78 C" in text
    assert perf["temp"][:3] == ["78", "70", "85"]
    code, st, _, _ = health(cli, hpool, "--crit-temp", "75")
    assert (code, st) == (2, "CRITICAL")


def test_device_health_from_the_captured_guest(tmp_path, monkeypatch, tool_seam):
    """A DAX pool's memdevs, read through the tool seam (output of a real
    guest): QEMU's device reports no health, so the temperature is unknown."""
    from cxlkv.host import numa
    from cxlkv.ops import health as pool_health
    from cxlkv.testing.replay import ReplayRunner

    r = ReplayRunner(LAB, "devdax", sysfs_dest=tmp_path / "root", setenv=monkeypatch.setenv)
    tool_seam(r)
    monkeypatch.setattr(numa, "dax_of", lambda path: "dax0.0")
    d = pool_health.device_health("/dev/dax0.0", timeout=5)
    assert d["device"] == "dax0.0" and d["error"] is None
    assert [m["memdev"] for m in d["memdevs"]] == ["mem0"]
    assert d["temperature_c"] is None
    monkeypatch.setattr(numa, "dax_of", lambda path: None)
    assert pool_health.device_health("/tmp/x.pool") is None


def test_incompatible_pool_never_advises_an_older_cxlkv(cli, hpool):
    """A pool with features this cxlkv lacks, formatted by an older (or
    unparsable) version: the message asks for a newer cxlkv, never that one."""
    from cxlkv import __version__
    from cxlkv.pool.superblock import _needs

    for copy in "AB":
        rewrite_superblock(hpool, copy, incompat=1 << 40, creator=b"cxlkv 0.0.1")
    code, st, text, _ = health(cli, hpool)
    assert (code, st) == (3, "UNKNOWN") and "needs a newer cxlkv" in text, text
    assert "use cxlkv 0.0.1" not in text
    s = layout.SuperblockStruct()
    for creator, newer in ((b"cxlkv 99.0.0", True), (b"cxlkv 0.0.10", False),
                           (b"cxlkv " + __version__.encode(), False),
                           (b"cxlkv not-a-version", False)):
        s.creator = creator
        msg = _needs(s)
        assert ("use cxlkv 99.0.0 or later" in msg) == newer, (creator, msg)
        assert newer or "needs a newer cxlkv" in msg
