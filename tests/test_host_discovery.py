"""Host discovery and `cxlkv inspect` without a pool, on a real kernel CXL stack's output:
tool output and sysfs/procfs trees captured in a QEMU guest in each state
(tests/fixtures/lab), replayed through the two seams (cxlkv.host.tools,
$CXLKV_SYSFS_ROOT)."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from cxlkv.host import discovery
from cxlkv.host import tools
from cxlkv.testing.replay import ReplayRunner, install_sysfs

LAB = Path(__file__).resolve().parent / "fixtures" / "lab"


@pytest.fixture
def host(tmp_path, monkeypatch, tool_seam):
    """host(state) -> a ReplayRunner in that state, installed as the tool seam, with the
    state's sysfs/procfs as the roots (switched as the runner's state moves)."""
    runners = []

    def make(state: str, **kw) -> ReplayRunner:
        r = ReplayRunner(LAB, state, sysfs_dest=tmp_path / "root", setenv=monkeypatch.setenv, **kw)
        tool_seam(r)
        monkeypatch.setenv("CXLKV_DEV_ROOT", str(tmp_path / "dev"))
        monkeypatch.setenv("COLUMNS", "200")          # tables unwrapped, for asserting text
        (tmp_path / "dev").mkdir(exist_ok=True)
        runners.append(r)
        return r

    return make


# -- discovery, state by state ---------------------------------------------------

def test_raw_memdev_no_region(host):
    host("raw")
    h = discovery.discover()
    c = h["cxl"]
    assert c["present"] and not c["regions"] and not c["dax_devices"] and not c["errors"]
    (m,) = c["memdevs"]
    assert m["memdev"] == "mem0" and m["host"] == "0000:0d:00.0" and m["serial"] == 0
    assert (m["ram_size"], m["pmem_size"]) == (0, 256 << 20)
    assert m["firmware_version"] == "BWFW VERSION 00"       # sysfs: cxl list 76.1 has no -F
    assert m["driver"] == "cxl_mem" and m["enabled"]
    assert m["partition"]["persistent_only_size"] == 256 << 20
    # QEMU's device reports no health: everything unknown, nothing invented
    assert m["health"]["reported"] is False and m["health"]["temperature_c"] is None
    assert [p["port"] for p in c["ports"]] == ["port1"] and c["buses"][0]["provider"] == "ACPI.CXL"
    kinds = {d["decoder"]: d["kind"] for d in c["decoders"]}
    assert kinds == {"decoder0.0": "root", "decoder1.0": "switch", "decoder2.0": "endpoint"}
    root = next(d for d in c["decoders"] if d["kind"] == "root")
    assert root["pmem_capable"] and root["size"] == 4 << 30 and root["targets"] == ["ACPI0016:00"]
    # the host side
    assert h["kernel"]["release"] == "6.1.0-57-amd64" and h["kernel"]["version"] == [6, 1]
    assert h["modules"]["cxl_acpi"] == "loaded" and h["modules"]["dax_cxl"] is None
    assert h["thp"] == {"enabled": "always", "defrag": "madvise"}
    assert h["numa_policy"] == {"numa_balancing": 0, "numa_balancing_mode": "disabled",
                                "demotion_enabled": False}
    assert h["memory"]["auto_online_blocks"] == "offline"
    assert h["memory"]["block_size"] == 128 << 20 and h["memory"]["blocks"] == {"online": 16}
    (n0,) = h["numa"]["nodes"]
    assert n0["node"] == 0 and n0["cpus"] == [0, 1] and n0["distances"] == {"0": 10}
    assert n0["tier"] == 4 and h["memory_tiers"] == [{"tier": 4, "nodes": [0]}]
    assert h["numa"]["possible"] == [0, 1]           # the CXL window's node, not yet online


def test_region_state(host):
    host("region")
    c = discovery.discover()["cxl"]
    (r,) = c["regions"]
    assert r["region"] == "region0" and r["type"] == "pmem" and r["size"] == 256 << 20
    assert r["decode_state"] == "commit" and r["state"] == "enabled"
    assert r["interleave_ways"] == 1 and r["interleave_granularity"] == 256
    assert r["memdevs"] == ["mem0"] and r["root_decoder"] == "decoder0.0"
    assert r["nd_region"] == "region0" and r["dax_devices"] == []
    (g,) = c["nd_regions"]
    assert g["cxl_region"] == "region0" and g["type"] == "pmem" and g["target_node"] == 1


def test_devdax_state(host, tmp_path):
    host("devdax")
    dev = tmp_path / "dev" / "dax0.0"
    dev.write_bytes(b"")
    os.chmod(dev, 0o660)
    c = discovery.discover()["cxl"]
    (d,) = c["dax_devices"]
    assert d["chardev"] == "dax0.0" and d["mode"] == "devdax" and d["size"] == 250 << 20
    assert d["align"] == 2 << 20 and d["target_node"] == 1 and d["numa_node"] == 0
    assert d["cxl_region"] == "region0" and c["regions"][0]["dax_devices"] == ["dax0.0"]
    assert d["device"]["exists"] and d["device"]["mode"] == "0660"
    ns = {n["dev"]: n for n in c["namespaces"]}
    assert ns["namespace0.0"]["mode"] == "devdax" and ns["namespace0.0"]["chardev"] == "dax0.0"


def test_system_ram_state(host):
    host("system-ram")
    h = discovery.discover()
    (d,) = h["cxl"]["dax_devices"]
    assert d["mode"] == "system-ram" and d["online_memblocks"] == 1 and d["movable"] is True
    # the kmem node: CPU-less, in a slower tier than DRAM
    assert h["cxl_memory_nodes"] == [1]
    n1 = next(n for n in h["numa"]["nodes"] if n["node"] == 1)
    assert n1["cpus"] == [] and n1["memory_total"] == 128 << 20 and n1["tier"] == 22
    assert n1["distances"] == {"0": 20, "1": 10}
    assert h["memory_tiers"] == [{"tier": 4, "nodes": [0]}, {"tier": 22, "nodes": [1]}]
    assert h["memory"]["by_node"]["1"] == {"online": 1}


def test_teardown_states(host):
    r = host("teardown-namespace")
    c = discovery.discover()["cxl"]
    assert [x["region"] for x in c["regions"]] == ["region0"] and not c["dax_devices"]
    r.enter("teardown")
    c = discovery.discover()["cxl"]
    assert not c["regions"] and [m["memdev"] for m in c["memdevs"]] == ["mem0"]


def test_health_in_the_documented_shape(host, monkeypatch):
    """QEMU 7.2's type-3 device answers no Get Health Info, so no guest output has
    "health".  The shape below is the `-H` example of ndctl's cxl-list(1)
    (ndctl v76.1, Documentation/cxl/cxl-list.txt, "-H, --health"), copied verbatim
    and added to the captured memdev."""
    documented = json.loads("""{
        "maintenance_needed":true, "performance_degraded":true,
        "hw_replacement_needed":true, "media_normal":false, "media_not_ready":false,
        "media_persistence_lost":false, "media_data_lost":true,
        "media_powerloss_persistence_loss":false, "media_shutdown_persistence_loss":false,
        "media_persistence_loss_imminent":false, "media_powerloss_data_loss":false,
        "media_shutdown_data_loss":false, "media_data_loss_imminent":false,
        "ext_life_used":"normal", "ext_temperature":"critical",
        "ext_corrected_volatile":"warning", "ext_corrected_persistent":"normal",
        "life_used_percent":15, "temperature":25, "dirty_shutdowns":10,
        "volatile_errors":20, "pmem_errors":30}""")
    h = discovery.health({"memdev": "mem0", "health": documented})
    assert h["reported"] and h["temperature_c"] == 25 and h["life_used_percent"] == 15
    assert h["ext_temperature"] == "critical" and h["ext_life_used"] == "normal"
    assert h["alarms"] == ["maintenance_needed", "performance_degraded",
                           "hw_replacement_needed", "media_data_lost"]
    assert h["dirty_shutdowns"] == 10 and h["pmem_errors"] == 30
    # a device that leaves a field out (ndctl omits temperature when it is not valid)
    partial = {k: v for k, v in documented.items() if k not in ("temperature", "life_used_percent")}
    h = discovery.health({"memdev": "mem0", "health": partial})
    assert h["temperature_c"] is None and h["life_used_percent"] is None
    assert discovery.health({"memdev": "mem0"})["reported"] is False


def test_tools_missing_still_reports_the_host(host):
    host("devdax", missing={"cxl", "ndctl", "daxctl"})
    h = discovery.discover()
    c = h["cxl"]
    assert c["tools"] == {"cxl": False, "ndctl": False, "daxctl": False}
    assert not c["memdevs"] and c["sysfs_memdevs"] == ["mem0"] and c["present"]
    assert h["numa"]["nodes"] and h["thp"]["enabled"] == "always"


def test_a_failing_tool_is_recorded_not_fatal(host):
    # inject a real failure (daxctl usage error, rc 129) for the listing discovery runs
    host("devdax", inject={tuple(discovery.DAXCTL_LIST): ("devdax", "daxctl-list-vvv")})
    c = discovery.discover()["cxl"]
    (err,) = c["errors"]
    assert err["command"] == "daxctl list -D -R -M -i" and "unknown switch" in err["message"]
    assert c["regions"] and not c["dax_devices"]


def test_parse_helpers():
    assert discovery.parse_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert discovery.parse_list("") == [] and discovery.parse_list(None) == []
    assert discovery.bracketed("always defer defer+madvise [madvise] never") == "madvise"
    assert discovery.version_tuple("6.12.57+deb13-amd64") == [6, 12]


# -- cxlkv inspect -----------------------------------------------------------------

def test_inspect_json_host_only(cli, host):
    host("devdax")
    r = cli("inspect", "--json")
    assert r.code == 0, r.err
    doc = r.json()
    assert set(doc) == {"host", "pool"} and doc["pool"] is None
    assert doc["host"]["cxl"]["dax_devices"][0]["chardev"] == "dax0.0"


def test_inspect_human_tables(cli, host):
    host("devdax")
    r = cli("inspect")
    assert r.code == 0, r.err
    for text in ("CXL memory devices", "mem0", "BWFW VERSION 00", "unknown", "topology",
                 "decoder0.0", "root decoder", "regions", "region0", "pmem", "commit",
                 "DAX devices", "dax0.0", "devdax", "2 MiB", "NUMA nodes", "tier 4: node 0",
                 "6.1.0-57-amd64", "auto-online", "offline"):
        assert text in r.out, text


def test_inspect_system_ram_shows_the_cxl_node(cli, host):
    host("system-ram")
    r = cli("inspect")
    assert r.code == 0
    assert "system-ram (1/1 blocks online)" in r.out
    assert "CXL memory online as system RAM on node(s) 1" in r.out
    assert "tier 22: node 1" in r.out


def test_inspect_on_a_host_without_cxl(cli, tmp_path, monkeypatch, tool_seam):
    """No CXL (no /sys/bus/cxl, no tools): said plainly, NUMA/THP/tiers still shown, exit 0."""
    root = install_sysfs(LAB, "raw", tmp_path / "root", monkeypatch.setenv)
    shutil.rmtree(root / "sys" / "bus" / "cxl")
    tool_seam(tools.Runner(path=str(tmp_path / "empty-path")))
    r = cli("inspect")
    assert r.code == 0, r.err
    assert "CXL: no CXL memory devices on this host." in r.out
    assert "NUMA nodes" in r.out and "THP" in r.out and "tier 4: node 0" in r.out
    assert "cxl MISSING" in r.out
    doc = cli("inspect", "--json").json()["host"]
    assert doc["cxl"]["present"] is False and doc["numa"]["nodes"][0]["cpus"] == [0, 1]


def test_inspect_this_machine(cli):
    """The real host through the real seams (no CXL here: said so plainly)."""
    if any(n.startswith("mem") for n in (os.listdir("/sys/bus/cxl/devices")
                                         if os.path.isdir("/sys/bus/cxl/devices") else [])):
        pytest.skip("this machine has CXL memdevs; the no-CXL wording does not apply")
    r = cli("inspect")
    assert r.code == 0, r.err
    assert "no CXL memory devices" in r.out and "NUMA nodes" in r.out
    doc = cli("inspect", "--json").json()
    assert doc["host"]["numa"]["nodes"] and doc["pool"] is None


def test_inspect_with_pool_shows_both(cli, host, small_pool):
    host("devdax")
    doc = cli("inspect", "--pool", small_pool, "--json").json()
    assert doc["pool"]["path"] == small_pool and doc["host"]["cxl"]["regions"]
    r = cli("inspect", "--pool", small_pool)
    assert "CXL memory devices" in r.out and f"pool {small_pool}" in r.out


def test_inspect_watch_redraws_on_events(cli, host, monkeypatch):
    """--watch draws, then redraws after each batch of events; the state changes between."""
    from cxlkv.host import watch

    runner = host("region")

    def events(*a, **kw):
        runner.enter("devdax")           # a namespace appeared
        yield [{"action": "add", "subsystem": "dax", "device": "dax0.0"},
               {"action": "add", "subsystem": "nd", "device": "namespace0.0"}]
        runner.enter("teardown")
        yield [{"action": "remove", "subsystem": "cxl", "device": "region0"}]

    monkeypatch.setattr(watch, "events", events)
    r = cli("inspect", "--watch")
    assert r.code == 0, r.err
    first, second, third = r.out.split("\n-- ")
    assert "region0" in first and "DAX devices" not in first
    assert second.split("\n")[0].endswith("add dax/dax0.0, add nd/namespace0.0")
    assert "DAX devices" in second and "dax0.0" in second
    assert "remove cxl/region0" in third and "regions: none" in third
    assert "watching cxl, dax, nd, memory events" in r.err


def test_inspect_watch_ctrl_c_exits_0(cli, host, monkeypatch):
    from cxlkv.host import watch

    host("raw")

    def events(*a, **kw):
        raise KeyboardInterrupt
        yield  # pragma: no cover

    monkeypatch.setattr(watch, "events", events)
    assert cli("inspect", "--watch").code == 0


def test_inspect_watch_refuses_json(cli, host):
    host("raw")
    r = cli("inspect", "--watch", "--json")
    assert r.code == 2 and "--watch" in r.json()["error"]["message"]


def test_watch_receives_real_kernel_uevents():
    """pyudev on the kernel's netlink: a synthetic "change" uevent on a memory block."""
    import threading

    from cxlkv.host import watch

    target = "/sys/devices/system/memory/memory0/uevent"
    if not os.access(target, os.W_OK):
        pytest.skip(f"cannot write {target} (needs root) to make a uevent")
    gen = watch.events(settle=0.2, source="kernel")     # listening from here on
    got = []
    t = threading.Thread(target=lambda: got.append(next(gen)), daemon=True)
    t.start()
    try:
        with open(target, "w") as f:
            f.write("change")
    except OSError as e:
        pytest.skip(f"writing {target}: {e}")
    t.join(10)
    assert got, "no uevent arrived within 10 s"
    assert {(e["action"], e["subsystem"], e["device"]) for e in got[0]} == \
        {("change", "memory", "memory0")}
