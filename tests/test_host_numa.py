"""NUMA placement (`numa_node=N|"auto"`): where a process is bound, on captured guest
topologies; and that the binding is really applied - allowed CPUs, the memory policy
of the process and of the pool mapping - checked on this machine (one node, so the
binding, not the latency gain, is what can be tested)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cxlkv.host import numa as host_numa
from cxlkv.testing.replay import install_sysfs

LAB = Path(__file__).resolve().parent / "fixtures" / "lab"
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def topology(tmp_path, monkeypatch):
    return lambda state: install_sysfs(LAB, state, tmp_path / state, monkeypatch.setenv)


def numa_usable() -> str | None:
    try:
        host_numa.libnuma()
    except host_numa.NumaError as e:
        return e.message
    return None


needs_libnuma = pytest.mark.skipif(numa_usable() is not None,
                                   reason=f"libnuma not usable here: {numa_usable()}")


# -- resolving: captured topologies -------------------------------------------------

def test_auto_on_devdax_binds_to_the_node_the_device_hangs_off(topology):
    """devdax: target_node 1 is the device's memory, offline (not system RAM) and
    CPU-less; the device is attached to node 0 (its numa_node)."""
    topology("devdax")
    p = host_numa.resolve("auto", dax="dax0.0")
    assert (p.cpu_node, p.mem_node, p.target_node, p.device) == (0, 0, 1, "dax0.0")
    assert any("no CPUs: CPUs of node 0, the node dax0.0 is attached to" in r for r in p.reasons)
    assert any("no memory online" in r for r in p.reasons)


def test_auto_with_the_cxl_memory_online(topology):
    """system-ram: node 1 has the CXL memory online (no CPUs): memory there, CPUs on 0."""
    topology("system-ram")
    p = host_numa.resolve("auto", dax="dax0.0")
    assert (p.cpu_node, p.mem_node, p.target_node) == (0, 1, 1)


def test_explicit_cpu_less_node_uses_the_nearest_cpus(topology):
    topology("system-ram")
    p = host_numa.resolve("1")
    assert (p.cpu_node, p.mem_node) == (0, 1)
    assert any("nearest by distance" in r for r in p.reasons)
    assert (host_numa.resolve(0).cpu_node, host_numa.resolve(0).mem_node) == (0, 0)


def test_bad_requests(topology):
    topology("devdax")
    with pytest.raises(host_numa.NumaUsage, match="no such node"):
        host_numa.resolve("7")
    with pytest.raises(host_numa.NumaUsage, match="node number or auto"):
        host_numa.resolve("near")
    with pytest.raises(host_numa.NumaUsage, match="needs a device-dax pool"):
        host_numa.resolve("auto")
    with pytest.raises(host_numa.NumaUsage, match="no such DAX device"):
        host_numa.resolve("auto", dax="dax9.9")
    assert host_numa.NumaUsage("x").exit_code == 2 and host_numa.NumaError("x").exit_code == 7


def test_auto_when_the_kernel_knows_no_node(topology):
    root = topology("devdax")
    d = root / "sys/bus/dax/devices/dax0.0"
    for attr in ("target_node", "numa_node"):
        (d / attr).write_text("-1\n")
    with pytest.raises(host_numa.NumaError, match="no NUMA node"):
        host_numa.resolve("auto", dax="dax0.0")


# -- applying and verifying on this machine -----------------------------------------

CHILD = r"""
import json, os, sys
import cxlkv
from cxlkv.host import numa
path, spec = sys.argv[1], sys.argv[2]
if len(sys.argv) > 3:
    os.sched_setaffinity(0, {int(c) for c in sys.argv[3].split(",")})
before = sorted(os.sched_getaffinity(0))
with cxlkv.open_pool(path, numa_node=spec) as pool:
    b = pool.numa.to_json()
    mode, nodes = numa.mempolicy_of()
    maps = open("/proc/self/numa_maps").read()
    line = next((l for l in maps.splitlines() if path in l), "")
    tasks = {t: numa.status_lists(f"/proc/self/task/{t}/status")["Cpus_allowed_list"]
             for t in os.listdir("/proc/self/task")}
    print(json.dumps({"binding": b, "before": before, "policy": [mode, nodes],
                      "numa_maps": line, "tasks": tasks,
                      "status": numa.status_lists(),
                      "heartbeat_alive": pool.node._thread.is_alive()}))
"""


def run_child(path, spec, cpus=None):
    args = [sys.executable, "-c", CHILD, path, str(spec)] + ([cpus] if cpus else [])
    r = subprocess.run(args, capture_output=True, text=True, timeout=60, cwd=REPO)
    return r


@needs_libnuma
def test_binding_is_applied_and_read_back(small_pool):
    node0 = host_numa.node_cpus(0)
    r = run_child(small_pool, 0)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    b = doc["binding"]
    assert (b["cpu_node"], b["mem_node"], b["membind"]) == (0, 0, [0])
    # the process's policy: MPOL_BIND to node 0 (not the default policy)
    assert doc["policy"] == [host_numa.MPOL_BIND, [0]]
    # allowed CPUs, of the process and of every thread (the heartbeat thread included)
    assert b["cpus"] == node0 and doc["status"]["Cpus_allowed_list"] == node0
    assert len(doc["tasks"]) >= 2 and all(c == node0 for c in doc["tasks"].values())
    assert doc["heartbeat_alive"]
    # a pool in a file gets its pages preferred on the memory node
    assert b["mapping_policy"]["policy"] == "preferred" and b["mapping_policy"]["node"] == 0
    assert "prefer:0" in doc["numa_maps"]


@needs_libnuma
def test_binding_changes_what_was_there(small_pool):
    """Started on one CPU, the process runs on all of node 0's CPUs after binding."""
    node0 = host_numa.node_cpus(0)
    if len(node0) < 2:
        pytest.skip("node 0 has one CPU: nothing to widen")
    r = run_child(small_pool, 0, cpus=str(node0[-1]))
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["before"] == [node0[-1]] and doc["binding"]["cpus"] == node0


@needs_libnuma
def test_auto_needs_a_dax_pool(small_pool):
    r = run_child(small_pool, "auto")
    assert r.returncode != 0 and "needs a device-dax pool" in r.stderr


@needs_libnuma
def test_verify_catches_a_binding_that_did_not_happen(monkeypatch):
    import numa

    monkeypatch.setattr(numa.memory, "set_membind_nodes", lambda *nodes: None)
    try:
        with pytest.raises(host_numa.NumaError, match="memory binding not applied"):
            host_numa.apply(host_numa.resolve(0))
    finally:
        host_numa.unbind()
    assert host_numa.mempolicy_of()[0] != host_numa.MPOL_BIND


@needs_libnuma
def test_unknown_node_is_refused_before_libnuma_sees_it():
    with pytest.raises(host_numa.NumaUsage):
        host_numa.bind(max(host_numa.nodes_with("possible") or [0]) + 64)


def test_without_libnuma_the_error_says_what_to_install(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_numa(name, *a, **kw):
        if name == "numa":
            raise OSError("libnuma.so.1: cannot open shared object file")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_numa)
    with pytest.raises(host_numa.NumaError) as ei:
        host_numa.libnuma()
    assert "libnuma1" in ei.value.hint
