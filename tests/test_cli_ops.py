"""What an operator trips over: documented exit codes for
operational states, clean stops, one JSON document, messages that name the
cause and the next step, liveness and the lock manager in inspect, the
units' sandbox."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cxlkv import errors
from cxlkv.ops.init import init_pool
from cxlkv.pool import layout
from cxlkv.testing.damage import patch_bytes
from cxlkv.testing.nodes import Manager

MiB = 1 << 20


@pytest.fixture
def mgr_pool(pool_path):
    """A small pool in sync mode manager with a short lease (0.3 s)."""
    init_pool(pool_path, {"size": 16 * MiB, "chunk_size": 256 * 1024, "max_nodes": 8,
                          "sync": "manager", "lease_ms": 300})
    return pool_path


@pytest.fixture
def cas_pool(pool_path):
    init_pool(pool_path, {"size": 16 * MiB, "chunk_size": 256 * 1024, "max_nodes": 8,
                          "lease_ms": 300})
    return pool_path


# -- exit codes of operational states -------------------------------------------------

def test_no_lock_manager_is_a_documented_exit_code_not_a_bug(cli, mgr_pool):
    r = cli("kv", "drop", "--pool", mgr_pool, "--namespace", "m", "--json")
    assert r.code == errors.EXIT_NO_MANAGER == 9, (r.out, r.err)
    doc = r.json()["error"]
    assert doc["kind"] == "no-lock-manager" and doc["exit_code"] == 9
    assert "cxlkv lock-manager --pool" in doc["message"]
    assert "internal error" not in r.err and "a bug" not in r.err
    assert r.err.startswith("cxlkv kv drop: error:")
    # documented where an operator looks
    assert any(code == 9 for code, _ in errors.EXIT_CODES)
    root = Path(__file__).resolve().parent.parent
    assert ".B 9\n" in (root / "man" / "cxlkv.1").read_text()
    assert "| 9 |" in (root / "README.md").read_text()


@pytest.mark.parametrize("cmd", ["serve", "snapshot"])
def test_serve_and_snapshot_without_a_lock_manager_exit_9(cli, mgr_pool, tmp_path, cmd):
    """The other two commands that attach: the same exit code and remedy."""
    args = {"serve": ["serve", "--pool", mgr_pool],
            "snapshot": ["snapshot", "--pool", mgr_pool, "--to", tmp_path / "snap"]}[cmd]
    t0 = time.monotonic()
    r = cli(*args)
    assert r.code == errors.EXIT_NO_MANAGER, (r.out, r.err)
    assert f"cxlkv {cmd}: error:" in r.err and "cxlkv lock-manager --pool" in r.err, r.err
    assert "internal error" not in r.err
    assert time.monotonic() - t0 < 30


def test_standby_stopped_before_it_became_active_exits_0(mgr_pool):
    active = Manager(mgr_pool)
    standby = None
    try:
        assert "active for" in active.line()
        standby = Manager(mgr_pool, "--standby")
        line = standby.wait_for("standing by")
        assert "holds the lease" in line and f"pid {active.p.pid}" in line
        standby.p.send_signal(signal.SIGTERM)
        assert standby.p.wait(20) == 0
        assert "stopped while standing by" in standby.p.stderr.read()
    finally:
        for m in (standby, active):
            if m is not None:
                m.stop()
    assert active.p.returncode == 0


# -- health ---------------------------------------------------------------------------

@pytest.mark.parametrize("args", [("--json",), ("--timeout", "0", "--json"),
                                  ("--json", "--warn-unevictable", "x")])
def test_health_json_usage_errors_are_one_json_document(cli, cas_pool, args):
    extra = () if args == ("--json",) else ("--pool", cas_pool)
    r = cli("health", *extra, *args)
    assert r.code == 3
    doc = json.loads(r.out)                      # the whole of stdout is one document
    assert doc["error"]["exit_code"] == 3 and "CXLKV UNKNOWN" not in r.out


def test_health_on_a_world_writable_pool_says_what_to_fix(cli, cas_pool):
    os.chmod(cas_pool, 0o666)
    r = cli("health", "--pool", cas_pool)
    assert r.code == 1 and "world-writable" in r.out
    assert "--force" not in r.out and f"chmod 0660 {cas_pool}" in r.out


def test_health_during_a_format_says_a_format_is_running(cli, pool_path):
    import fcntl

    with open(pool_path, "wb") as f:
        f.truncate(16 * MiB)                      # not formatted (yet)
    with open(pool_path, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)          # what a running format holds
        r = cli("health", "--pool", pool_path)
        assert r.code == 3 and "format or init" in r.out and "running" in r.out
    r = cli("health", "--pool", pool_path)
    assert r.code == 2 and "running" not in r.out   # no format: unformatted is CRITICAL


def test_fsck_with_both_superblock_copies_bad_names_the_path_and_next_step(cli, cas_pool):
    for off in layout.SB_OFFSETS:
        patch_bytes(cas_pool, off + 64, b"\xff" * 32)
    r = cli("fsck", "--pool", cas_pool)
    assert r.code == 8
    assert cas_pool in r.err and "cxlkv format --pool" in r.err and "--force" in r.err


# -- inspect: the lock manager ----------------------------------------------------------

def test_inspect_shows_the_lock_manager(cli, mgr_pool):
    doc = cli("inspect", "--pool", mgr_pool, "--json").json()["pool"]
    assert doc["lock_manager"]["state"] == "none"
    assert "none active" in cli("inspect", "--pool", mgr_pool).out
    m = Manager(mgr_pool)
    try:
        assert "active for" in m.line()
        lm = cli("inspect", "--pool", mgr_pool, "--json").json()["pool"]["lock_manager"]
        assert (lm["state"], lm["pid"]) == ("active", m.p.pid) and lm["epoch"] >= 1
        assert f"active: pid {m.p.pid}" in cli("inspect", "--pool", mgr_pool).out
    finally:
        m.stop()


# -- units -----------------------------------------------------------------------------

def test_install_units_warns_about_a_missing_exe(cli, tmp_path):
    r = cli("install-units", "--dest", tmp_path / "u", "--confdir", tmp_path / "etc",
            "--exe", tmp_path / "nope" / "cxlkv", "--group", "root", "--json")
    assert r.code == 0
    assert any("does not exist" in w for w in r.json()["warnings"])


def _units(cli, tmp_path) -> Path:
    r = cli("install-units", "--dest", tmp_path / "u", "--confdir", tmp_path / "etc",
            "--exe", sys.executable, "--group", "root", "--json")
    assert r.code == 0, r.err
    return tmp_path / "u"


def test_lock_manager_unit_counts_a_stop_as_success(cli, tmp_path):
    text = (_units(cli, tmp_path) / "cxlkv-lock-manager@.service").read_text()
    assert "\nSuccessExitStatus=SIGTERM SIGINT\n" in text


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed (apt-get install systemd)")
def test_units_exposure_at_most_2(cli, tmp_path):
    """systemd-analyze security --offline: every service unit <= 2.0, and still
    free to see other users' processes and the boot id (liveness needs them)."""
    units = _units(cli, tmp_path)
    for name in ("cxlkv-serve@", "cxlkv-lock-manager@", "cxlkv-health@"):
        inst = tmp_path / f"{name}kv0.service"
        text = (units / f"{name}.service").read_text()
        settings = [x for x in text.splitlines() if not x.startswith("#")]
        assert not [x for x in settings if x.startswith(("ProtectProc=", "ProcSubset="))]
        inst.write_text(text)
        r = subprocess.run(["systemd-analyze", "security", "--offline=true", "--no-pager",
                            str(inst)], capture_output=True, text=True, timeout=120)
        last = [x for x in r.stdout.splitlines() if "Overall exposure level" in x]
        assert last, r.stdout + r.stderr
        score = float(last[0].split(":")[1].split()[0])
        assert score <= 2.0, (name, last[0])


# -- serve: the metrics address is bound before anything attaches -----------------------

def _epochs(path):
    from cxlkv.api import Pool
    from cxlkv.state import nodes

    with Pool.open(path, writable=False) as p:
        return [(n.slot, n.epoch, n.state) for n in nodes.read_nodes(p, include_free=True)]


def test_serve_with_its_metrics_port_in_use_fails_before_attaching(cli, cas_pool):
    import socket

    before = _epochs(cas_pool)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = cli("serve", "--pool", cas_pool, "--metrics-addr", f"127.0.0.1:{port}")
    assert r.code == 1 and "choose another --metrics-addr port" in r.err
    assert _epochs(cas_pool) == before           # no node attached and detached meanwhile
    r = cli("serve", "--pool", cas_pool, "--metrics-addr", "192.0.2.1:9464")   # TEST-NET-1
    assert r.code == 1 and "choose an address of this host" in r.err
    assert "another port" not in r.err and _epochs(cas_pool) == before


# -- messages ----------------------------------------------------------------------------

def test_cli_messages_name_the_command_and_the_way_out(cli, cas_pool):
    r = cli()
    assert r.code == 0 and r.out.startswith("Usage: cxlkv") and "error" not in r.err
    r = cli("inspct")
    assert r.code == 2 and "Did you mean inspect" in r.err and "inspct --help" not in r.err
    assert "(see cxlkv --help)" in r.err
    r = cli("kv", "drop", "--namespace", "x")
    assert r.code == 2 and r.err.startswith("cxlkv kv drop: error:")
    assert "CXLKV_POOL" in r.err and "cxlkv kv drop --help" in r.err
    r = cli("health")
    assert r.code == 3 and "CXLKV_POOL" in r.out
    # --help lists the codes a command can return, not every pool code
    text = cli("install-units", "--help").out
    assert "  2   usage error" in text and "unsafe permissions" not in text
    assert "no lock manager" not in cli("inspect", "--help").out
    assert "no lock manager" in cli("kv", "drop", "--help").out or \
        "no lock manager" in cli("kv", "--help").out


def test_piped_tables_keep_whole_names(cli, pool_path):
    """stdout not a terminal: no wrapping, no folding, whatever the name's length."""
    import cxlkv

    init_pool(pool_path, {"size": 16 * MiB, "chunk_size": 256 * 1024, "max_nodes": 8})
    name = "org-with-a-long-name/" + "model-" * 14 + "bf16"
    with cxlkv.open_pool(pool_path) as pool:
        pool.kv(model=name, block_tokens=4, block_bytes=4096).store(list(range(8)),
                                                                     bytes(2 * 4096))
    out = cli("kv", "stats", "--pool", pool_path).out
    assert any(name in line for line in out.splitlines()), out
    out = cli("kv", "ls", "--pool", pool_path).out
    assert any(name in line for line in out.splitlines()), out


def test_inspect_says_when_it_falls_back_to_the_default_pool(cli, tmp_path, monkeypatch):
    from cxlkv.ops import init as admin

    default = str(tmp_path / "cxlkv-default.pool")
    monkeypatch.setattr(admin, "DEFAULT_POOL_PATH", default)
    init_pool(default, {"size": 16 * MiB, "chunk_size": 256 * 1024, "max_nodes": 8})
    r = cli("inspect", "--json")
    assert r.code == 0 and r.json()["pool"]["path"] == default
    assert f"showing the default pool {default}" in r.err


def test_inspect_watch_redraws_when_the_pool_changes(cas_pool):
    """No device event at all: a node attaching is enough for a redraw."""
    import io
    import threading

    from rich.console import Console

    import cxlkv
    from cxlkv.cli.app import Application
    from cxlkv.cli.inspect import watch_loop
    from cxlkv.testing.checks import wait_for

    app = Application()
    buf = io.StringIO()
    app.out = Console(file=buf, markup=False, highlight=False, soft_wrap=True, width=4096)
    app.err = Console(file=io.StringIO())
    quiet = threading.Event()

    def no_events():                              # a host where no device event ever comes
        quiet.wait()
        return
        yield

    t = threading.Thread(target=watch_loop, args=(app, cas_pool, False),
                         kwargs={"events": no_events(), "poll": 0.05, "draws": 2}, daemon=True)
    t.start()
    try:
        wait_for(lambda: "chunks in use" in buf.getvalue(), what="the first draw")
        assert buf.getvalue().count("chunks in use") == 1
        with cxlkv.open_pool(cas_pool):
            t.join(30)
            assert not t.is_alive()
        text = buf.getvalue()
        assert text.count("chunks in use") == 2 and "change pool/" in text
    finally:
        quiet.set()


# -- init, format: messages and modes ------------------------------------------------------

def test_init_of_a_missing_dax_device_points_at_provisioning(cli):
    r = cli("init", "--device", "/dev/dax97.3")
    assert r.code == errors.EXIT_NOT_FOUND
    assert "no such DAX device" in r.err and "cxlkv provision plan" in r.err
    assert "init --pool /dev/dax" not in r.err


def test_init_on_a_disk_backed_file_system_warns(cli, tmp_path):
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    mounts = (f"22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
              f"23 22 0:5 / {tmp_path}/shm rw shared:2 - tmpfs tmpfs rw\n")
    (proc / "self" / "mountinfo").write_text(mounts)
    (tmp_path / "shm").mkdir()
    env = {"CXLKV_PROCFS_ROOT": str(proc)}
    r = cli("init", "--pool", tmp_path / "disk.pool", "--size", "16M", env=env)
    assert r.code == 0 and "ext4 file system backed by a disk" in r.err and "page cache" in r.err
    r = cli("init", "--pool", tmp_path / "shm" / "mem.pool", "--size", "16M", env=env)
    assert r.code == 0 and "backed by a disk" not in r.err


def test_init_sync_manager_next_steps_start_a_lock_manager(cli, pool_path):
    r = cli("init", "--pool", pool_path, "--size", "16M", "--sync", "manager")
    assert r.code == 0
    nxt = r.out.split("next:", 1)[1]
    assert f"cxlkv lock-manager --pool {pool_path}" in nxt
    r = cli("init", "--pool", pool_path + "2", "--size", "16M")
    assert "lock-manager" not in r.out


@pytest.mark.parametrize("verb,mode,want", [("init", 0o666, 0o660), ("format", 0o666, 0o660),
                                            ("format", 0o440, 0o660), ("init", 0o640, 0o660),
                                            ("format", 0o600, 0o600)])
def test_force_gives_every_pool_file_one_mode(cli, pool_path, verb, mode, want):
    """init --force and format --force apply one rule: 0660 (0600 stays private)."""
    init_pool(pool_path, {"size": 16 * MiB, "chunk_size": 256 * 1024, "max_nodes": 8})
    os.chmod(pool_path, mode)
    r = cli(verb, "--pool", pool_path, "--force")
    assert r.code == 0, r.err
    assert os.stat(pool_path).st_mode & 0o7777 == want
    assert ("changed mode" in r.err) == (mode != want)


def test_secret_import_of_a_missing_file_and_junk_pools_read_plainly(cli, cas_pool, tmp_path):
    r = cli("kv", "secret", "--pool", cas_pool, "--import", tmp_path / "nope")
    assert r.code == 2 and "No such file or directory" in r.err and "[Errno" not in r.err
    junk = tmp_path / "junk"
    junk.write_bytes((bytes(range(200, 256)) * 1200)[:65536])
    os.chmod(junk, 0o660)
    r = cli("inspect", "--pool", junk)
    assert r.code == errors.EXIT_INVALID and str(junk) in r.err
    assert "b'" not in r.err and "\\x" not in r.err and "wrong magic 0x" in r.err
    r = cli("fsck", "--pool", junk)
    assert r.code == 8 and "check the path" in r.err and "--force" not in r.err


# -- logs: the real cause, who was reaped --------------------------------------------------

def test_serve_stopped_after_the_lock_managers_says_so(pool_path):
    """SIGTERM to an agent whose lock managers were stopped first, with a
    --stop-timeout shorter than the lease it would take to notice: the
    warning names the missing lock manager, not a node holding the lock."""
    from test_serve import Serve

    init_pool(pool_path, {"size": 16 * MiB, "chunk_size": 256 * 1024, "max_nodes": 8,
                          "sync": "manager", "lease_ms": 4000})
    mgr_pool = pool_path
    mgr = Manager(mgr_pool)
    try:
        assert "active for" in mgr.line()
        s = Serve(mgr_pool, "--stop-timeout", "1")
        mgr.stop()                                # the wrong order: managers first
        s.p.send_signal(signal.SIGTERM)
        d = s.wait_log(lambda d: d.get("level") == "warning" and "could not detach" in d["msg"])
        assert "no lock manager is running" in d["msg"], d
        assert "held by another node" not in d["msg"]
        assert s.p.wait(30) == 0
    finally:
        mgr.stop()


def test_abandoned_attaches_and_reaps_are_named_plainly():
    from types import SimpleNamespace

    from cxlkv.daemons.lockmgr import describe_node

    claimed = SimpleNamespace(slot=48, pid=0, hostname="")
    assert describe_node(claimed) == \
        "node 48 (an abandoned attach: claimed, no process recorded)"
    assert describe_node(SimpleNamespace(slot=3, pid=812, hostname="host-a")) == \
        "node 3 (host-a pid 812)"


def test_fsck_force_and_live_each_mean_one_thing(cli, cas_pool):
    from cxlkv.testing.nodes import NodeProc

    assert cli("fsck", "--pool", cas_pool, "--live").code == 16     # --live goes with --repair
    q = NodeProc()
    try:
        q.attach(cas_pool)
        r = cli("fsck", "--pool", cas_pool, "--repair", "--force")     # mode only: still refused
        assert r.code == 8 and "live node" in r.err and "--live" in r.err
        r = cli("fsck", "--pool", cas_pool, "--repair", "--live", "--json")
        assert r.code == 0 and r.json()["attached"] is True
    finally:
        q.close()
