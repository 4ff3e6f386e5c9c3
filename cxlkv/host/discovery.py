"""Host discovery: what this host has for CXL memory, and how it is set up.

Two sources, each through its seam:

* the tools (`cxl list -vvv`, `ndctl list -vvv`, `daxctl list -D -R -M -i`)
  through cxlkv.host.tools - the documented, stable interface to CXL
  memdevs, ports, decoders, regions, namespaces and DAX devices;
* sysfs / procfs through cxlkv.host.sysfs (redirectable) - NUMA nodes,
  distances, memory tiers, THP, NUMA balancing, memory blocks and the
  auto-online policy, kernel version and loaded modules, and what the tools
  do not print (memdev firmware version, a DAX device's NUMA node).

NUMA topology is read from sysfs, the files libnuma itself parses, so that
tests can point it at trees captured in a guest; py-libnuma (`numa`) is used
where cxlkv acts on the topology (cxlkv.host.numa).

`discover()` returns one JSON-ready dict; nothing here prints or raises for
a host without CXL: that host gets `"cxl": {"present": false, ...}`.
"""
from __future__ import annotations

import grp
import os
import re
import stat
from pathlib import Path

from cxlkv.host import sysfs
from cxlkv.host import tools

#: the commands discovery runs (tests/fixtures/lab/commands has each, per state)
CXL_LIST = ["cxl", "list", "-vvv"]
NDCTL_LIST = ["ndctl", "list", "-vvv"]
DAXCTL_LIST = ["daxctl", "list", "-D", "-R", "-M", "-i"]

#: kernel modules of the CXL memory stack, and what each is for
CXL_MODULES = {
    "cxl_acpi": "CXL host bridges and windows from ACPI (CEDT)",
    "cxl_pci": "the CXL memory device's PCI driver",
    "cxl_mem": "binds memdevs (endpoint ports)",
    "cxl_port": "CXL switch and endpoint ports",
    "cxl_pmem": "persistent regions as nvdimm regions",
    "libnvdimm": "nvdimm core (pmem regions, namespaces)",
    "nd_pmem": "pmem namespaces",
    "dax_pmem": "devdax namespaces on pmem regions",
    "dax_cxl": "DAX devices on CXL RAM regions (kernel 6.3+)",
    "device_dax": "/dev/daxX.Y character devices",
    "kmem": "onlining DAX memory as system RAM (system-ram mode)",
}
#: modules without which there is no CXL memory at all
CORE_MODULES = ("cxl_acpi", "cxl_pci", "cxl_mem")
#: ... and without which there is no /dev/daxX.Y
DAX_MODULES = ("device_dax",)

HEALTH_ALARMS = ("maintenance_needed", "performance_degraded", "hw_replacement_needed",
                 "media_not_ready", "media_persistence_lost", "media_data_lost",
                 "media_powerloss_persistence_loss", "media_shutdown_persistence_loss",
                 "media_persistence_loss_imminent", "media_powerloss_data_loss",
                 "media_shutdown_data_loss", "media_data_loss_imminent")


# --------------------------------------------------------------------------
# small sysfs helpers

def parse_list(text: str | None) -> list[int]:
    """A kernel cpu/node list ("0-3,8,10-11") -> [0, 1, 2, 3, 8, 10, 11]."""
    out: list[int] = []
    for part in (text or "").strip().split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            out.extend(range(int(lo), int(hi) + 1))
        else:
            out.append(int(part))
    return out


def bracketed(text: str | None) -> str | None:
    """The [selected] word of a sysfs choice ("always [madvise] never" -> "madvise")."""
    if text is None:
        return None
    m = re.search(r"\[([^\]]+)\]", text)
    return m.group(1) if m else text.strip() or None


def meminfo(path: Path) -> dict[str, int]:
    """/proc/meminfo or nodeN/meminfo -> {"MemTotal": bytes, ...}."""
    out = {}
    for line in (sysfs.read_attr(path) or "").splitlines():
        m = re.match(r"(?:Node \d+ )?([\w()]+):\s+(\d+)(?:\s+kB)?", line.strip())
        if m:
            out[m.group(1)] = int(m.group(2)) * (1024 if line.rstrip().endswith("kB") else 1)
    return out


def link_name(path: Path) -> str | None:
    try:
        return os.path.basename(os.readlink(path))
    except OSError:
        return None


# --------------------------------------------------------------------------
# kernel, modules, memory policy

def kernel() -> dict:
    text = sysfs.read_attr(sysfs.proc_path("version")) or ""
    m = re.match(r"Linux version (\S+)", text)
    release = m.group(1) if m else None
    return {"release": release, "version": version_tuple(release), "proc_version": text or None}


def version_tuple(release: str | None) -> list[int] | None:
    m = re.match(r"(\d+)\.(\d+)", release or "")
    return [int(m.group(1)), int(m.group(2))] if m else None


def modules() -> dict:
    """CXL-stack modules: "loaded" (/proc/modules), "builtin" (/sys/module only), or None."""
    loaded = set()
    for line in (sysfs.read_attr(sysfs.proc_path("modules")) or "").splitlines():
        if line.split():
            loaded.add(line.split()[0])
    out = {}
    for name in CXL_MODULES:
        if name in loaded:
            out[name] = "loaded"
        elif sysfs.sys_path("module", name).is_dir():
            out[name] = "builtin"
        else:
            out[name] = None
    return out


def thp() -> dict:
    base = sysfs.sys_path("kernel", "mm", "transparent_hugepage")
    return {"enabled": bracketed(sysfs.read_attr(base / "enabled")),
            "defrag": bracketed(sysfs.read_attr(base / "defrag"))}


def numa_policy() -> dict:
    """NUMA balancing (0 off, 1 normal, 2 memory tiering) and demotion."""
    bal = sysfs.read_int(sysfs.proc_path("sys", "kernel", "numa_balancing"))
    dem = sysfs.read_attr(sysfs.sys_path("kernel", "mm", "numa", "demotion_enabled"))
    names = {0: "disabled", 1: "normal", 2: "memory-tiering", 3: "normal+memory-tiering"}
    return {"numa_balancing": bal,
            "numa_balancing_mode": names.get(bal) if bal is not None else None,
            "demotion_enabled": None if dem is None else dem.strip() in ("true", "1", "Y", "y")}


def memory_blocks() -> dict:
    """Memory hotplug: the auto-online policy and the memory blocks by node and state."""
    base = sysfs.sys_path("devices", "system", "memory")
    out = {"auto_online_blocks": sysfs.read_attr(base / "auto_online_blocks"),
           "block_size": None, "blocks": {}, "by_node": {}}
    bs = sysfs.read_attr(base / "block_size_bytes")
    if bs:
        try:
            out["block_size"] = int(bs, 16)
        except ValueError:
            pass
    if not base.is_dir():
        return out
    for name in sorted(os.listdir(base)):
        if not re.match(r"memory\d+$", name):
            continue
        d = base / name
        state = sysfs.read_attr(d / "state") or "unknown"
        node = next((int(n[4:]) for n in _listdir(d) if re.match(r"node\d+$", n)), None)
        out["blocks"][state] = out["blocks"].get(state, 0) + 1
        per = out["by_node"].setdefault(str(node), {})
        per[state] = per.get(state, 0) + 1
    return out


def _listdir(p: Path) -> list[str]:
    try:
        return sorted(os.listdir(p))
    except OSError:
        return []


# --------------------------------------------------------------------------
# NUMA nodes and memory tiers

def memory_tiers() -> list[dict]:
    """[{"tier": 4, "nodes": [0]}, {"tier": 22, "nodes": [1]}]: lower tier id = faster."""
    base = sysfs.sys_path("devices", "virtual", "memory_tiering")
    tiers = []
    for name in _listdir(base):
        m = re.match(r"memory_tier(\d+)$", name)
        if m:
            tiers.append({"tier": int(m.group(1)),
                          "nodes": parse_list(sysfs.read_attr(base / name / "nodelist"))})
    return sorted(tiers, key=lambda t: t["tier"])


def numa_nodes(tiers: list[dict] | None = None) -> dict:
    base = sysfs.sys_path("devices", "system", "node")
    tiers = memory_tiers() if tiers is None else tiers
    tier_of = {n: t["tier"] for t in tiers for n in t["nodes"]}
    online = parse_list(sysfs.read_attr(base / "online"))
    nodes = []
    for n in online:
        d = base / f"node{n}"
        mi = meminfo(d / "meminfo")
        dist = [int(x) for x in (sysfs.read_attr(d / "distance") or "").split()]
        nodes.append({
            "node": n,
            "cpus": parse_list(sysfs.read_attr(d / "cpulist")),
            "memory_total": mi.get("MemTotal"),
            "memory_free": mi.get("MemFree"),
            "memory_used": mi.get("MemUsed"),
            "distances": {str(m): dist[i] for i, m in enumerate(online) if i < len(dist)},
            "tier": tier_of.get(n),
        })
    return {
        "online": online,
        "possible": parse_list(sysfs.read_attr(base / "possible")),
        "has_cpu": parse_list(sysfs.read_attr(base / "has_cpu")),
        "has_memory": parse_list(sysfs.read_attr(base / "has_memory")),
        "nodes": nodes,
    }


# --------------------------------------------------------------------------
# CXL objects (tools) and their sysfs extras

def health(memdev: dict) -> dict:
    """A memdev's health in the shape of ndctl's cxl-list(1) `-H` listing.

    Keys the device did not report (QEMU's emulated device reports none)
    are None, shown as "unknown".
    """
    h = memdev.get("health")
    if not isinstance(h, dict):
        return {"reported": False, "temperature_c": None, "life_used_percent": None,
                "ext_temperature": None, "ext_life_used": None, "alarms": [],
                "media_normal": None, "dirty_shutdowns": None}
    return {
        "reported": True,
        "temperature_c": h.get("temperature"),
        "life_used_percent": h.get("life_used_percent"),
        "ext_temperature": h.get("ext_temperature"),
        "ext_life_used": h.get("ext_life_used"),
        "ext_corrected_volatile": h.get("ext_corrected_volatile"),
        "ext_corrected_persistent": h.get("ext_corrected_persistent"),
        "alarms": [a for a in HEALTH_ALARMS if h.get(a) is True],
        "media_normal": h.get("media_normal"),
        "dirty_shutdowns": h.get("dirty_shutdowns"),
        "volatile_errors": h.get("volatile_errors"),
        "pmem_errors": h.get("pmem_errors"),
    }


def _memdev(m: dict) -> dict:
    d = sysfs.sys_path("bus", "cxl", "devices", m["memdev"])
    pi = m.get("partition_info") or {}
    return {
        "memdev": m["memdev"],
        "host": m.get("host"),
        "serial": m.get("serial"),
        "ram_size": m.get("ram_size", 0),
        "pmem_size": m.get("pmem_size", 0),
        "partition": pi or None,
        "firmware_version": sysfs.read_attr(d / "firmware_version"),
        "numa_node": _node_or_none(sysfs.read_int(d / "numa_node")),
        "driver": link_name(d / "driver"),
        "enabled": (d / "driver").is_symlink() if d.exists() else None,
        "parent": m.get("parent"),
        "health": health(m),
    }


def _node_or_none(n: int | None) -> int | None:
    return None if n is None or n < 0 else n


def _region_type(r: dict, decoders: dict[str, dict]) -> str | None:
    """pmem or ram: the mode of the endpoint decoders it maps (cxl 76.1 prints no type)."""
    modes = {decoders.get(mp.get("decoder"), {}).get("mode") for mp in r.get("mappings") or []}
    modes.discard(None)
    if len(modes) == 1:
        return modes.pop()
    d = sysfs.sys_path("bus", "cxl", "devices", r["region"])
    mode = sysfs.read_attr(d / "mode")
    if mode:
        return mode
    if any(n.startswith("pmem_region") for n in _listdir(d)):
        return "pmem"
    if any(n.startswith("dax_region") for n in _listdir(d)):
        return "ram"
    return None


def _region(r: dict, decoders: dict[str, dict]) -> dict:
    d = sysfs.sys_path("bus", "cxl", "devices", r["region"])
    return {
        "region": r["region"],
        "type": _region_type(r, decoders),
        "size": r.get("size"),
        "resource": r.get("resource"),
        "interleave_ways": r.get("interleave_ways"),
        "interleave_granularity": r.get("interleave_granularity"),
        "decode_state": r.get("decode_state"),
        "state": r.get("state", "enabled" if (d / "driver").is_symlink() else
                       ("disabled" if d.exists() else None)),
        "root_decoder": r.get("parent"),
        "memdevs": [mp.get("memdev") for mp in r.get("mappings") or []],
        "nd_region": None,
        "dax_devices": [],
    }


def _decoder(dec: dict) -> dict:
    keep = ("decoder", "resource", "size", "interleave_ways", "interleave_granularity", "region",
            "mode", "dpa_resource", "dpa_size", "max_available_extent", "pmem_capable",
            "volatile_capable", "nr_targets", "state", "parent")
    out = {k: dec.get(k) for k in keep if k in dec}
    out["targets"] = [t.get("target") for t in dec.get("targets") or []]
    parent = dec.get("parent") or ""
    if parent.startswith("root") or (not parent and "pmem_capable" in dec):
        out["kind"] = "root"
    elif parent.startswith("endpoint") or (not parent and ("dpa_size" in dec or "mode" in dec)):
        out["kind"] = "endpoint"
    else:
        out["kind"] = "switch"
    return out


def _dax_sysfs(name: str) -> dict:
    d = sysfs.sys_path("bus", "dax", "devices", name)
    real = os.path.realpath(d) if d.exists() else ""
    return {"numa_node": _node_or_none(sysfs.read_int(d / "numa_node")),
            "sysfs_path": real.split("/sys/", 1)[-1] if real else None,
            "resource": sysfs.read_int(d / "resource")}


def dev_node(name: str) -> dict:
    """/dev/NAME: mode, owner, group (through the redirectable /dev root)."""
    p = sysfs.dev_path(name)
    try:
        st = os.stat(p)
    except OSError:
        return {"path": f"/dev/{name}", "exists": False}
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    return {"path": f"/dev/{name}", "exists": True, "mode": f"{stat.S_IMODE(st.st_mode):04o}",
            "uid": st.st_uid, "gid": st.st_gid, "group": group,
            "char_device": stat.S_ISCHR(st.st_mode)}


def _nd_region_resources() -> dict[str, int]:
    base = sysfs.sys_path("bus", "nd", "devices")
    return {n: sysfs.read_int(base / n / "resource") for n in _listdir(base)
            if re.match(r"region\d+$", n)}


def cxl_inventory(r: tools.Runner) -> dict:
    """CXL memdevs, ports, decoders, regions, namespaces and DAX devices via the tools."""
    out = {"tools": {t: r.available(t) for t in ("cxl", "ndctl", "daxctl")},
           "buses": [], "ports": [], "endpoints": [], "decoders": [], "memdevs": [],
           "regions": [], "namespaces": [], "nd_regions": [], "dax_regions": [],
           "dax_devices": [], "errors": []}

    def call(argv):
        try:
            return r.json(argv)
        except tools.ToolNotFound:
            return None
        except tools.ToolFailed as e:
            out["errors"].append({"command": " ".join(argv), "message": e.message,
                                  "stderr": e.result.stderr.strip()})
            return None

    cx = call(CXL_LIST)
    if cx is not None:
        flat = tools.flatten_cxl(cx)
        decs = {d["decoder"]: d for d in flat["decoder"]}
        out["buses"] = [{"bus": b["bus"], "provider": b.get("provider"),
                         "dports": [p.get("dport") for p in b.get("dports") or []]}
                        for b in flat["bus"]]
        out["ports"] = [{"port": p["port"], "host": p.get("host"), "depth": p.get("depth"),
                         "parent": p.get("parent"),
                         "dports": [d.get("dport") for d in p.get("dports") or []]}
                        for p in flat["port"]]
        out["endpoints"] = [{"endpoint": e["endpoint"], "host": e.get("host"),
                             "parent": e.get("parent")} for e in flat["endpoint"]]
        out["decoders"] = [_decoder(d) for d in flat["decoder"]]
        out["memdevs"] = [_memdev(m) for m in flat["memdev"]]
        out["regions"] = [_region(x, decs) for x in flat["region"]]

    nd = call(NDCTL_LIST)
    if nd is not None:
        _, regs, nss = tools.flatten_nd(nd)
        out["nd_regions"] = [{k: g.get(k) for k in ("dev", "size", "available_size", "align",
                                                     "type", "numa_node", "target_node",
                                                     "persistence_domain")} for g in regs]
        out["namespaces"] = [{k: n.get(k) for k in ("dev", "mode", "size", "uuid", "align",
                                                     "region", "state", "numa_node",
                                                     "target_node")}
                             | {"chardev": _ns_chardev(n)} for n in nss]
        res = _nd_region_resources()
        by_res = {x["resource"]: x for x in out["regions"]}
        for g in out["nd_regions"]:
            g["resource"] = res.get(g["dev"])
            cx_region = by_res.get(g["resource"])
            g["cxl_region"] = cx_region["region"] if cx_region else None
            if cx_region:
                cx_region["nd_region"] = g["dev"]

    dx = call(DAXCTL_LIST)
    if dx is not None:
        dregs, ddevs = tools.flatten_dax(dx)
        out["dax_regions"] = dregs
        nd_to_cxl = {g["dev"]: g.get("cxl_region") for g in out["nd_regions"]}
        for dev in ddevs:
            name = dev["chardev"]
            reg = next((g for g in dregs if g.get("id") == dev.get("region_id")), {})
            path = reg.get("path") or ""
            m = re.search(r"/(region\d+)/", path + "/")
            owner = None
            if m and "/ndbus" in path:
                owner = nd_to_cxl.get(m.group(1))
            elif m:
                owner = m.group(1)
            extra = _dax_sysfs(name)
            out["dax_devices"].append({
                "chardev": name,
                "size": dev.get("size"),
                "align": dev.get("align"),
                "mode": dev.get("mode"),
                "target_node": _node_or_none(dev.get("target_node", -1)),
                "numa_node": extra["numa_node"],
                "online_memblocks": dev.get("online_memblocks"),
                "total_memblocks": dev.get("total_memblocks"),
                "movable": dev.get("movable"),
                "region_id": dev.get("region_id"),
                "cxl_region": owner,
                "device": dev_node(name),
            })
        for x in out["regions"]:
            x["dax_devices"] = [d["chardev"] for d in out["dax_devices"]
                                if d["cxl_region"] == x["region"]]
    out["present"] = bool(out["memdevs"]) or bool(_listdir(sysfs.sys_path("bus", "cxl", "devices")))
    out["sysfs_memdevs"] = [n for n in _listdir(sysfs.sys_path("bus", "cxl", "devices"))
                            if re.match(r"mem\d+$", n)]
    return out


def _ns_chardev(ns: dict) -> str | None:
    reg = ns.get("daxregion") or {}
    devs = reg.get("devices") or []
    return devs[0].get("chardev") if devs else ns.get("chardev")


# --------------------------------------------------------------------------

def discover(r: tools.Runner | None = None) -> dict:
    """Everything `cxlkv inspect` shows about the host, as one JSON-ready dict."""
    r = r or tools.runner()
    tiers = memory_tiers()
    cxl = cxl_inventory(r)
    numa = numa_nodes(tiers)
    cpu_nodes = set(numa["has_cpu"])
    cxl_nodes = sorted({d["target_node"] for d in cxl["dax_devices"]
                        if d["target_node"] is not None and d["mode"] == "system-ram"})
    return {
        "kernel": kernel(),
        "modules": modules(),
        "cxl": cxl,
        "numa": numa,
        "cxl_memory_nodes": [n for n in cxl_nodes if n not in cpu_nodes],
        "memory_tiers": tiers,
        "numa_policy": numa_policy(),
        "thp": thp(),
        "memory": memory_blocks(),
        "sysfs_root": str(sysfs.sys_root()),
    }
