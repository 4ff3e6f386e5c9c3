"""`cxlkv provision plan|apply|teardown` against a replayed real guest: every cxl/ndctl/
daxctl call is answered with what the tools printed in a QEMU guest, and the machine
moves to the state the guest was in after that call (cxlkv.testing.replay).  The same
flow runs on a live guest in tests/test_lab.py."""
from __future__ import annotations

import io
import os
import sys
from pathlib import Path

import pytest

from cxlkv import errors
from cxlkv.testing.replay import ReplayRunner

LAB = Path(__file__).resolve().parent / "fixtures" / "lab"
CREATE_REGION = ["cxl", "create-region", "-m", "-d", "decoder0.0", "-w", "1", "-t", "pmem", "mem0"]
CREATE_NS = ["ndctl", "create-namespace", "-r", "region0", "-m", "devdax", "-a", "2M"]
TO_DEVDAX = ["daxctl", "reconfigure-device", "-m", "devdax", "-f", "dax0.0"]
TO_RAM = ["daxctl", "reconfigure-device", "-m", "system-ram", "dax0.0"]
DESTROY_NS = ["ndctl", "destroy-namespace", "-f", "namespace0.0"]
DESTROY_REGION = ["cxl", "destroy-region", "-f", "region0"]
MUTATING = {"create-region", "create-namespace", "reconfigure-device", "destroy-namespace",
            "destroy-region"}


class Machine:
    def __init__(self, tmp_path, monkeypatch, tool_seam, state, **kw):
        self.dev = tmp_path / "dev"
        self.root = tmp_path / "root"
        self.r = ReplayRunner(LAB, state, sysfs_dest=self.root, setenv=monkeypatch.setenv,
                              dev_dest=self.dev, **kw)
        tool_seam(self.r)
        monkeypatch.setenv("CXLKV_DEV_ROOT", str(self.dev))
        monkeypatch.setenv("COLUMNS", "200")

    @property
    def changes(self) -> list[list[str]]:
        """The calls that change the machine, in order."""
        return [c for c in self.r.calls if len(c) > 1 and c[1] in MUTATING]

    @property
    def state(self) -> str:
        return self.r.state


@pytest.fixture
def machine(tmp_path, monkeypatch, tool_seam):
    return lambda state="raw", **kw: Machine(tmp_path, monkeypatch, tool_seam, state, **kw)


@pytest.fixture(autouse=True)
def no_tty(monkeypatch):
    monkeypatch.setattr(sys.stdin, "isatty", lambda: False, raising=False)


# -- plan ------------------------------------------------------------------------------

def test_plan_on_a_raw_host_changes_nothing(cli, machine):
    m = machine("raw")
    r = cli("provision", "plan")
    assert r.code == 0, r.err
    out = r.out
    # the exact ordered steps a newcomer reads before anything changes
    lines = [ln.strip() for ln in out.splitlines()]
    assert lines[1] == ("1. [will run] create a pmem region of 256 MiB over mem0 in the CXL "
                        "window decoder0.0")
    assert "$ cxl create-region -m -d decoder0.0 -w 1 -t pmem mem0" in lines
    assert "$ ndctl create-namespace -r NDREGION -m devdax -a 2M" in lines
    assert "$ chmod 0660 /dev/daxX.Y" in lines
    assert "$ cxlkv init --device /dev/daxX.Y --sync manager" in lines
    assert "undo: cxl destroy-region -f REGION (the region this creates)" in lines
    assert "Nothing has been changed." in out and "4 step(s)" in out
    assert m.changes == [] and m.state == "raw"


def test_plan_json(cli, machine):
    machine("devdax")
    doc = cli("provision", "plan", "--json").json()
    assert [(s["id"], s["status"]) for s in doc["steps"]] == [
        ("region", "done"), ("namespace", "done"), ("mode", "done"), ("permissions", "todo"),
        ("format", "todo")]
    assert doc["device"] == "/dev/dax0.0" and doc["region"] == "region0" and doc["changes"] == 2
    ns = doc["steps"][1]
    assert ns["command"] == " ".join(CREATE_NS) and "250 MiB, 2 MiB pages" in ns["why"]


def test_plan_with_a_group(cli, machine):
    import grp

    machine("devdax")
    group = grp.getgrgid(os.getgid()).gr_name
    doc = cli("provision", "plan", "--group", group, "--json").json()
    perm = next(s for s in doc["steps"] if s["id"] == "permissions")
    assert perm["command"] == f"chgrp {group} /dev/dax0.0; chmod 0660 /dev/dax0.0"
    assert cli("provision", "plan", "--group", "no-such-group-x").code == 2


# -- apply: the whole path, then idempotent --------------------------------------------

def test_apply_then_apply_again_changes_nothing(cli, machine):
    m = machine("raw")
    r = cli("provision", "apply", "--yes", "--json")
    assert r.code == 0, r.err
    doc = r.json()
    assert doc["changed"] is True
    assert [s["id"] for s in doc["ran"]] == ["region", "namespace", "permissions", "format"]
    assert m.changes == [CREATE_REGION, CREATE_NS] and m.state == "devdax"
    # what was done names what it made, for undoing it
    assert doc["ran"][0]["undo"] == "cxl destroy-region -f region0"
    assert doc["ran"][1]["undo"] == "ndctl destroy-namespace -f namespace0.0"
    dev = m.dev / "dax0.0"
    assert oct(os.stat(dev).st_mode & 0o777) == "0o660"
    from cxlkv.api import Pool

    with Pool.open(str(dev), writable=False) as p:
        assert p.sb.sync == "manager"
    # a second apply finds everything in place and changes nothing
    calls = len(m.changes)
    r = cli("provision", "apply", "--yes", "--json")
    assert r.code == 0 and r.json()["changed"] is False and r.json()["ran"] == []
    assert len(m.changes) == calls
    r = cli("provision", "apply", "--yes")
    assert r.code == 0 and "nothing to do: everything is in place" in r.out
    assert "Everything is in place" in cli("provision", "plan").out


def test_apply_shows_progress(cli, machine):
    machine("raw")
    r = cli("provision", "apply", "--yes")
    assert r.code == 0, r.err
    assert "[1/4] create a pmem region of 256 MiB over mem0" in r.err
    assert f"$ {' '.join(CREATE_REGION)}" in r.err and "ok (" in r.err
    assert "[4/4] format a cxlkv pool (sync mode manager) on /dev/dax0.0" in r.err
    assert "/dev/dax0.0 ready: 4 step(s) run" in r.out


def test_apply_no_format(cli, machine):
    m = machine("raw")
    doc = cli("provision", "apply", "--yes", "--no-format", "--json").json()
    assert [s["id"] for s in doc["ran"]] == ["region", "namespace", "permissions"]
    assert m.changes == [CREATE_REGION, CREATE_NS]


def test_never_onlines_system_ram_unless_asked(cli, machine):
    m = machine("raw")
    assert cli("provision", "apply", "--yes").code == 0
    assert TO_RAM not in m.changes
    r = cli("provision", "apply", "--yes", "--mode", "system-ram", "--json")
    assert r.code == 0, r.err
    assert m.changes[-1] == TO_RAM and m.state == "system-ram"
    assert [s["id"] for s in r.json()["ran"]] == ["mode"]
    # and again: in place
    assert cli("provision", "apply", "--yes", "--mode", "system-ram", "--json").json()[
        "changed"] is False


def test_takes_system_ram_back_when_unused(cli, machine):
    m = machine("system-ram")            # captured: node 1 MemUsed 0 kB
    r = cli("provision", "apply", "--yes", "--json")
    assert r.code == 0, r.err
    assert m.changes[0] == TO_DEVDAX and m.state == "devdax"
    assert [s["id"] for s in r.json()["ran"]] == ["mode", "permissions", "format"]


def test_refuses_to_take_system_ram_in_use(cli, machine):
    m = machine("system-ram")
    mi = m.root / "sys/devices/system/node/node1/meminfo"
    mi.write_text(mi.read_text().replace("Node 1 MemUsed:               0 kB",
                                         "Node 1 MemUsed:           65536 kB"))
    r = cli("provision", "apply", "--yes", "--json")
    assert r.code == errors.EXIT_REFUSED
    err = r.json()["error"]
    assert err["kind"] == "in-use" and "67108864 bytes in use" in err["message"]
    assert m.changes == []


# -- failures: stop at the first, with the tool's stderr, the state, the undo ----------

def test_exit_code_that_lies_is_caught_by_listing(cli, machine):
    """create-region exits 0 having created nothing ("could not get a free decoder")."""
    m = machine("raw", inject={tuple(CREATE_REGION): ("region", "err-create-region-second")})
    r = cli("provision", "apply", "--yes")
    assert r.code == errors.EXIT_DEVICE
    assert "exited 0 but changed nothing" in r.err
    assert "could not get a free decoder for mem0" in r.err       # the tool's stderr, verbatim
    assert "nothing was changed before it" in r.err
    assert "regions: none" in r.err
    assert m.changes == [CREATE_REGION]                            # stopped there


def test_failure_midway_shows_state_and_undo(cli, machine):
    m = machine("raw", inject={tuple(CREATE_NS): ("devdax", "err-create-namespace-no-space")})
    r = cli("provision", "apply", "--yes")
    assert r.code == errors.EXIT_DEVICE
    assert "step 2 (create a devdax namespace (2M pages) on region0) failed" in r.err
    assert "exit status 237" in r.err and "failed to create namespace: No space left on device" \
        in r.err
    assert "regions: region0 (pmem, commit, DAX -)" in r.err
    assert "to undo them, in this order:" in r.err and "cxl destroy-region -f region0" in r.err
    assert m.changes == [CREATE_REGION, CREATE_NS]
    doc = cli("provision", "apply", "--yes", "--json").json()["error"]
    assert doc["kind"] == "provision-failed" and doc["tool"]["rc"] == 237
    assert "No space left on device" in doc["tool"]["stderr"]
    assert doc["state"]["regions"][0]["region"] == "region0"
    assert doc["completed"] == [] and doc["undo"] == []            # the region was there already


def test_tool_missing(cli, machine):
    machine("raw", missing={"ndctl"})
    r = cli("provision", "plan", "--json")
    assert r.code == errors.EXIT_NOT_FOUND and "apt-get install ndctl" in r.json()["error"]["hint"]


def test_bad_selection(cli, machine):
    machine("raw")
    assert cli("provision", "plan", "--memdev", "mem9").code == errors.EXIT_USAGE
    assert cli("provision", "plan", "--decoder", "decoder9.9").code == errors.EXIT_USAGE
    assert cli("provision", "plan", "--align", "huge").code == errors.EXIT_USAGE


def test_different_sync_is_refused(cli, machine):
    machine("raw")
    assert cli("provision", "apply", "--yes").code == 0
    r = cli("provision", "apply", "--yes", "--sync", "cas", "--json")
    assert r.code == errors.EXIT_DEVICE
    assert "sync mode manager, not cas" in r.json()["error"]["message"]


# -- asking -----------------------------------------------------------------------------

def test_without_yes_and_no_terminal_it_refuses(cli, machine):
    m = machine("raw")
    r = cli("provision", "apply")
    assert r.code == errors.EXIT_REFUSED and "pass --yes" in r.err
    assert m.changes == []


@pytest.mark.parametrize("answer,code", [("n\n", errors.EXIT_REFUSED), ("y\n", 0)])
def test_without_yes_it_asks(cli, machine, monkeypatch, answer, code):
    m = machine("raw")
    monkeypatch.setattr(sys, "stdin", io.StringIO(answer))
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)
    r = cli("provision", "apply")
    assert r.code == code, r.err
    assert "Run the 4 step(s) marked 'will run'?" in r.err
    assert "1. [will run] create a pmem region" in r.out         # the plan first
    assert bool(m.changes) == (code == 0)


# -- teardown ---------------------------------------------------------------------------

def test_teardown_then_again(cli, machine):
    m = machine("raw")
    assert cli("provision", "apply", "--yes", "--sync", "cas").code == 0
    plan = cli("provision", "plan", "--teardown", "--json").json()
    assert [s["command"] for s in plan["steps"]] == [" ".join(DESTROY_NS),
                                                     " ".join(DESTROY_REGION)]
    r = cli("provision", "teardown", "--yes", "--json")
    assert r.code == 0, r.err
    assert m.changes[-2:] == [DESTROY_NS, DESTROY_REGION] and m.state == "teardown"
    assert not (m.dev / "dax0.0").exists()
    r = cli("provision", "teardown", "--yes")
    assert r.code == 0 and "nothing to tear down: there is no CXL region" in r.out
    assert "everything is in place" not in r.out


def test_teardown_refuses_a_mapped_device(cli, machine):
    m = machine("devdax")
    pid = m.root / "proc" / "4242"
    pid.mkdir()
    (pid / "comm").write_text("vllm\n")
    (pid / "maps").write_text("7f0000000000-7f000fa00000 rw-s 00000000 00:06 5 "
                              "                         /dev/dax0.0\n")
    r = cli("provision", "teardown", "--yes", "--json")
    assert r.code == errors.EXIT_REFUSED
    assert "in use by pid 4242 (vllm)" in r.json()["error"]["message"]
    assert m.changes == []


def test_teardown_refuses_a_pool_with_live_nodes(cli, machine, monkeypatch):
    import cxlkv

    m = machine("raw")
    assert cli("provision", "apply", "--yes", "--sync", "cas").code == 0
    monkeypatch.delenv("CXLKV_PROCFS_ROOT")      # node liveness looks at this host's /proc
    with cxlkv.open_pool(str(m.dev / "dax0.0")):
        r = cli("provision", "teardown", "--yes", "--json")
    assert r.code == errors.EXIT_REFUSED and "live nodes" in r.json()["error"]["message"]
    assert DESTROY_NS not in m.changes


def test_teardown_of_system_ram_goes_offline_first(cli, machine):
    m = machine("system-ram")
    r = cli("provision", "teardown", "--yes", "--json")
    assert r.code == 0, r.err
    assert m.changes == [TO_DEVDAX, DESTROY_NS, DESTROY_REGION]
