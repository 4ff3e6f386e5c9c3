"""`cxlkv doctor`: one test per pitfall, each on the sysfs/procfs tree and tool output
captured in a QEMU guest (tests/fixtures/lab), with the one attribute the pitfall is
about set the way a misconfigured host has it."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cxlkv.host import discovery
from cxlkv.ops import doctor
from cxlkv.testing.damage import fake_node
from cxlkv.testing.replay import ReplayRunner

LAB = Path(__file__).resolve().parent / "fixtures" / "lab"


class Host:
    """A captured guest state as this test's host: tool replay + a writable sysfs copy."""

    def __init__(self, tmp_path, monkeypatch, tool_seam, state, **kw):
        self.root = tmp_path / "root"
        self.dev = tmp_path / "dev"
        self.dev.mkdir(exist_ok=True)
        self.runner = ReplayRunner(LAB, state, sysfs_dest=self.root,
                                   setenv=monkeypatch.setenv, **kw)
        tool_seam(self.runner)
        monkeypatch.setenv("CXLKV_DEV_ROOT", str(self.dev))
        monkeypatch.setenv("COLUMNS", "200")

    def write(self, rel: str, text: str) -> None:
        """Set one sysfs/procfs attribute of the copied tree (rel: sys/... or proc/...)."""
        p = self.root / rel
        if p.is_symlink():
            p.unlink()
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)

    def device(self, name="dax0.0", mode=0o660):
        p = self.dev / name
        p.write_bytes(b"")
        os.chmod(p, mode)
        return p

    def checks(self, **kw) -> list[dict]:
        return doctor.run(**kw)["checks"]


@pytest.fixture
def host(tmp_path, monkeypatch, tool_seam):
    return lambda state="devdax", **kw: Host(tmp_path, monkeypatch, tool_seam, state, **kw)


def only(checks, cid, subject=None):
    found = [c for c in checks if c["id"] == cid and (subject is None or c["subject"] == subject)]
    assert len(found) == 1, (cid, found)
    return found[0]


# -- kernel and modules ------------------------------------------------------------

@pytest.mark.parametrize("release,status", [("5.15.0-91-generic", "fail"),
                                            ("6.1.0-57-amd64", "warn"),
                                            ("6.8.0-31-generic", "pass")])
def test_kernel_version(host, release, status):
    h = host()
    h.write("proc/version", f"Linux version {release} (builder) #1 SMP\n")
    c = only(h.checks(), "kernel")
    assert c["status"] == status and release in c["detail"]
    if status != "pass":
        assert "6.6" in c["remedy"]


def test_cxl_modules_not_loaded(host):
    h = host()
    mods = (h.root / "proc" / "modules").read_text().splitlines()
    h.write("proc/modules", "\n".join(m for m in mods if not m.startswith("cxl_mem ")) + "\n")
    c = next(c for c in h.checks() if c["id"] == "modules")
    assert c["status"] == "fail" and "cxl_mem" in c["detail"]
    assert c["remedy"] == "modprobe -a cxl_mem"


def test_dax_module_not_loaded(host):
    h = host()
    mods = (h.root / "proc" / "modules").read_text().splitlines()
    h.write("proc/modules", "\n".join(m for m in mods if not m.startswith("device_dax ")) + "\n")
    c = [c for c in h.checks() if c["id"] == "modules"][-1]
    assert c["status"] == "fail" and c["remedy"] == "modprobe -a device_dax"


def test_tools_missing(host):
    h = host(missing={"daxctl"})
    c = only(h.checks(), "tools")
    assert c["status"] == "fail" and c["detail"] == "missing: daxctl"
    assert c["remedy"] == "apt-get install ndctl daxctl"


def test_no_cxl_device(host, tmp_path):
    """Nothing enumerated -> BIOS (CXL enable, memory map, interleave)."""
    import shutil

    h = host("raw", missing={"cxl", "ndctl", "daxctl"})
    shutil.rmtree(h.root / "sys" / "bus" / "cxl")
    c = only(h.checks(), "memdev")
    assert c["status"] == "fail" and "BIOS" in c["remedy"]


def test_no_cxl_device_with_an_emulated_pool_is_not_applicable(host, small_pool):
    import shutil

    h = host("raw", missing={"cxl", "ndctl", "daxctl"})
    shutil.rmtree(h.root / "sys" / "bus" / "cxl")
    checks = h.checks(pool=small_pool)
    assert only(checks, "cxl")["status"] == "skip"
    assert not [c for c in checks if c["id"] in ("memdev", "region", "devdax")]


# -- regions and DAX ----------------------------------------------------------------

def test_no_region(host):
    c = only(host("raw").checks(), "region")
    assert c["status"] == "fail" and "cxlkv provision" in c["remedy"]


def test_region_committed(host):
    checks = host("region").checks()
    c = only(checks, "region", "region0")
    assert c["status"] == "pass" and "decode commit" in c["detail"]
    d = only(checks, "devdax")
    assert d["status"] == "fail" and "no DAX device" in d["detail"]


def test_dax_online_as_system_ram_is_the_classic_trap(host):
    c = only(host("system-ram").checks(), "devdax", "dax0.0")
    assert c["status"] == "fail" and "system RAM" in c["detail"] and "classic trap" in c["detail"]
    assert c["remedy"].startswith("daxctl reconfigure-device -m devdax -f dax0.0")


def test_devdax_passes(host):
    h = host()
    h.device()
    checks = h.checks()
    assert only(checks, "devdax", "dax0.0")["status"] == "pass"
    assert only(checks, "alignment", "dax0.0")["status"] == "pass"


def test_alignment():
    """daxctl's `align` and `size` of the captured dax0.0, and the two bad cases."""
    dev = json.loads((LAB / "commands/devdax/daxctl-list-D-R-M-i.json").read_text())["stdout"]
    d = json.loads(dev)[0]["devices"][0] | {"device": {}}
    assert doctor._alignment(d).status == "pass"
    assert doctor._alignment({**d, "align": 4096}).status == "warn"
    bad = doctor._alignment({**d, "align": 1 << 30})         # 250 MiB is not whole 1 GiB units
    assert bad.status == "fail" and "not a multiple" in bad.detail


@pytest.mark.parametrize("mode,status", [(0o666, "fail"), (0o644, "fail"), (0o600, "warn"),
                                         (0o660, None)])
def test_device_permissions(host, mode, status):
    h = host()
    p = h.device(mode=mode)
    c = only(h.checks(), "permissions", "dax0.0")
    if status is None:      # 0660: passes with a non-root group, warns with root's
        status = "warn" if os.stat(p).st_gid == 0 else "pass"
    assert c["status"] == status, c
    if mode & 0o006:
        assert "world-" in c["detail"] and "chmod 0660" in c["remedy"]


def test_device_permissions_group(host):
    h = host()
    p = h.device(mode=0o660)
    if os.geteuid() == 0:
        os.chown(p, 0, 1)                         # a non-root group
    assert only(h.checks(), "permissions", "dax0.0")["status"] == "pass"


def test_device_node_missing(host):
    c = only(host().checks(), "permissions", "dax0.0")
    assert c["status"] == "fail" and "does not exist" in c["detail"]


# -- memory policy --------------------------------------------------------------------

def test_thp_off(host):
    h = host()
    h.write("sys/kernel/mm/transparent_hugepage/enabled", "always madvise [never]\n")
    c = only(h.checks(), "thp")
    assert c["status"] == "warn" and "transparent_hugepage/enabled" in c["remedy"]
    h.write("sys/kernel/mm/transparent_hugepage/enabled", "always [madvise] never\n")
    assert only(h.checks(), "thp")["status"] == "pass"


def test_numa_balancing_with_cxl_memory_online(host):
    h = host("system-ram")                         # captured: numa_balancing 0, node 1 is CXL
    c = only(h.checks(), "numa-balancing")
    assert c["status"] == "warn" and c["remedy"].startswith("sysctl kernel.numa_balancing=2")
    h.write("proc/sys/kernel/numa_balancing", "2\n")
    assert only(h.checks(), "numa-balancing")["status"] == "pass"
    # without CXL memory as a node, balancing mode does not matter
    assert only(host().checks(), "numa-balancing")["status"] == "pass"


def test_demotion(host):
    h = host("system-ram")                         # captured: demotion_enabled false
    c = only(h.checks(), "demotion")
    assert c["status"] == "warn" and "demotion_enabled" in c["remedy"]
    h.write("sys/kernel/mm/numa/demotion_enabled", "true\n")
    assert only(h.checks(), "demotion")["status"] == "pass"


def test_memory_tiers(host):
    import shutil

    h = host("system-ram")
    assert only(h.checks(), "tiers")["status"] == "pass"        # node 1 in tier 22, DRAM in 4
    # no HMAT/CDAT: the kernel puts the CXL node in DRAM's tier
    shutil.rmtree(h.root / "sys/devices/virtual/memory_tiering/memory_tier22")
    h.write("sys/devices/virtual/memory_tiering/memory_tier4/nodelist", "0-1\n")
    c = only(h.checks(), "tiers")
    assert c["status"] == "warn" and "share a tier with DRAM" in c["detail"]
    shutil.rmtree(h.root / "sys/devices/virtual/memory_tiering")
    assert only(h.checks(), "tiers")["status"] == "warn"


def test_auto_online(host):
    h = host()
    assert only(h.checks(), "auto-online")["status"] == "pass"   # captured: offline
    h.write("sys/devices/system/memory/auto_online_blocks", "online_movable\n")
    c = only(h.checks(), "auto-online")
    assert c["status"] == "warn" and "echo offline" in c["remedy"]


# -- device health (the shape documented in ndctl's cxl-list(1), see test_host_discovery) --

DOCUMENTED_HEALTH = {
    "maintenance_needed": False, "performance_degraded": False, "hw_replacement_needed": False,
    "media_normal": True, "media_not_ready": False, "media_persistence_lost": False,
    "media_data_lost": False, "ext_life_used": "normal", "ext_temperature": "normal",
    "life_used_percent": 15, "temperature": 25, "dirty_shutdowns": 0}


def with_health(host, monkeypatch, **changes):
    h = host()
    real = discovery.cxl_inventory

    def inventory(r):
        inv = real(r)
        for m in inv["memdevs"]:
            m["health"] = discovery.health({"health": {**DOCUMENTED_HEALTH, **changes}})
        return inv

    monkeypatch.setattr(discovery, "cxl_inventory", inventory)
    return h.checks()


def test_health_unknown_on_qemu(host):
    checks = host().checks()
    for cid in ("temperature", "life-used", "alarms"):
        c = only(checks, cid, "mem0")
        assert c["status"] == "unknown" and "unknown" in c["detail"]
    assert doctor.exit_code([doctor.Check(**c) for c in checks if c["id"] in
                         ("temperature", "life-used", "alarms")]) == 0


@pytest.mark.parametrize("changes,status", [
    ({}, "pass"),
    ({"temperature": 71}, "warn"),                       # over 70 C
    ({"temperature": 60, "ext_temperature": "warning"}, "warn"),
    ({"temperature": 95}, "fail"),
    ({"ext_temperature": "critical"}, "fail")])
def test_temperature(host, monkeypatch, changes, status):
    c = only(with_health(host, monkeypatch, **changes), "temperature", "mem0")
    assert c["status"] == status


@pytest.mark.parametrize("changes,status", [({"life_used_percent": 15}, "pass"),
                                            ({"life_used_percent": 92}, "warn"),
                                            ({"ext_life_used": "critical"}, "fail")])
def test_life_used(host, monkeypatch, changes, status):
    assert only(with_health(host, monkeypatch, **changes), "life-used", "mem0")["status"] == status


@pytest.mark.parametrize("changes,status", [({}, "pass"),
                                            ({"maintenance_needed": True}, "warn"),
                                            ({"media_data_lost": True}, "fail")])
def test_alarms(host, monkeypatch, changes, status):
    assert only(with_health(host, monkeypatch, **changes), "alarms", "mem0")["status"] == status


# -- the pool ---------------------------------------------------------------------------

def test_pool_not_formatted(host, tmp_path):
    h = host()
    blank = tmp_path / "blank.pool"
    blank.write_bytes(b"\0" * (8 << 20))
    os.chmod(blank, 0o660)
    c = only(h.checks(pool=str(blank)), "pool")
    assert c["status"] == "fail" and c["remedy"] == f"cxlkv init --pool {blank}"


def test_pool_missing(host, tmp_path):
    c = only(host().checks(pool=str(tmp_path / "nope")), "pool")
    assert c["status"] == "fail" and "no such file" in c["detail"]


def test_pool_world_readable(host, small_pool):
    os.chmod(small_pool, 0o664)
    c = only(host().checks(pool=small_pool), "permissions", small_pool)
    assert c["status"] == "fail" and "world-readable" in c["detail"]


def test_pool_ok_and_heartbeats(host, small_pool):
    checks = host().checks(pool=small_pool)
    assert only(checks, "pool")["status"] == "pass"
    assert only(checks, "heartbeats")["detail"] == "no nodes attached"
    assert only(checks, "lock-manager")["status"] == "skip"


def test_stale_heartbeat(host, small_pool, monkeypatch):
    from cxlkv.state.nodes import local_boot_id

    h = host()
    # node liveness reads this host's /proc (boot id, pid namespace, the pid's start time)
    monkeypatch.delenv("CXLKV_PROCFS_ROOT")
    # a node of this boot and pid namespace whose process is gone
    fake_node(small_pool, 3, pid=2 ** 22 - 3, start_time_ns=1, boot_id=local_boot_id())
    c = only(h.checks(pool=small_pool), "heartbeats")
    assert c["status"] == "warn" and "node 3" in c["detail"]


def test_live_node_heartbeats(host, small_pool, monkeypatch):
    import cxlkv

    h = host()
    monkeypatch.delenv("CXLKV_PROCFS_ROOT")
    with cxlkv.open_pool(small_pool):
        c = only(h.checks(pool=small_pool), "heartbeats")
    assert c["status"] == "pass" and "1 node(s) attached" in c["detail"]


def test_lock_manager(host, tmp_path):
    from cxlkv.ops.lockmgr import ensure_manager
    from cxlkv.ops.init import init_pool

    path = str(tmp_path / "mgr.pool")
    init_pool(path, {"size": 8 << 20, "chunk_size": 64 << 10, "max_nodes": 8,
                     "hash_slots": 256, "sync": "manager", "lease_ms": 300})
    h = host()
    c = only(h.checks(pool=path), "lock-manager")
    assert c["status"] == "fail" and c["remedy"].startswith(f"cxlkv lock-manager --pool {path}")
    started, stop = ensure_manager(path)
    try:
        assert started
        assert only(h.checks(pool=path), "lock-manager")["status"] == "pass"
    finally:
        stop()


# -- the command ---------------------------------------------------------------------------

def test_exit_codes_and_json(cli, host, small_pool):
    h = host()
    p = h.device(mode=0o660)
    if os.geteuid() == 0:
        os.chown(p, 0, 1)
    h.write("proc/version", "Linux version 6.8.0-31-generic (builder) #1 SMP\n")
    r = cli("doctor", "--pool", small_pool, "--json")
    doc = r.json()
    assert r.code == 0, [c for c in doc["checks"] if c["status"] in ("warn", "fail")]
    assert doc["exit_code"] == 0 and doc["summary"]["fail"] == 0 and doc["pool"] == small_pool
    assert {c["status"] for c in doc["checks"]} <= {"pass", "skip", "unknown"}
    h.write("sys/kernel/mm/transparent_hugepage/enabled", "always madvise [never]\n")
    assert cli("doctor", "--pool", small_pool, "--json").code == 1
    r = cli("doctor", "--pool", small_pool)
    assert r.code == 1 and "WARN" in r.out and "transparent huge pages" in r.out
    assert "1 warning(s), 0 failure(s)" in r.out
    host("system-ram")
    r = cli("doctor", "--pool", small_pool)
    assert r.code == 2 and "FAIL" in r.out and "classic trap" in r.out


def test_usage_error(cli):
    r = cli("doctor", "--pool", "", "--json")
    assert r.code == 2 and r.json()["error"]["kind"] == "usage"


@pytest.mark.parametrize("state,mode", [("devdax", "pool"), ("system-ram", "tiering"),
                                        ("raw", "none")])
def test_cxl_mode_says_pool_or_kernel_tiering(host, state, mode):
    """The two setups: CXL as a devdax pool vs CXL as a NUMA node tiered by the kernel."""
    c = only(host(state).checks(), "cxl-mode")
    assert c["status"] == "pass" and c["detail"].startswith(mode + ":")
    if mode == "tiering":
        assert "devdax" in c["detail"] and "numa_balancing" in c["detail"]


def test_inspect_names_the_cxl_mode(host, cli):
    host("system-ram")
    r = cli("inspect", "--json")
    assert r.code == 0, r.err
    assert r.json()["host"]["cxl_mode"] == "tiering"
    assert "CXL mode: tiering" in cli("inspect").out
