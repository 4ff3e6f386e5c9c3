"""`cxlkv doctor`: the known operational pitfalls of CXL memory pools, as checks.

Each check is pass / warn / fail (with a remedy: a command or a sentence),
skip (does not apply here) or unknown (the host does not say: a device that
reports no health).  The inputs are host discovery (cxlkv.host.discovery)
and, when there is one, the pool - nothing here changes anything, but for
the visibility challenge: a nonce in each other node's challenge line, which
only probers write (challenge=False: none).

Pitfalls, and why each is checked:
  kernel, modules       memory tiers from HMAT/CDAT need kernel >= 6.6 (6.1 runs a pool)
  memdev, region        "CXL memory not recognised": BIOS settings, interleave
  devdax                a RAM region auto-onlined as system-ram is the classic trap
  alignment             mmap sizes in 2 MiB multiples
  permissions           0666 is not for production: KV blocks are tenant data
  thp                   huge pages off halves performance (TLB misses)
  numa-balancing,
  demotion, tiers       tiering and demotion for CXL NUMA nodes
  cxl-mode              pool (devdax) vs kernel tiering (NUMA node) - which one
  auto-online           auto-onlined memory, daxctl 76.1 refusing to reconfigure
  temperature           above 70 C latency doubles
  life-used, alarms     cxl-list(1) -H health fields
  pool, heartbeats,
  lock-manager          cxlkv's own: formatted and readable, nodes alive, manager running
  visibility            the other hosts' nodes seen from here both ways (heartbeats
                        advancing here, a challenge written here echoed): the same
                        memory, not a wrong region or a stale mapping
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from cxlkv import api, errors
from cxlkv.api import Pool
from cxlkv.host import discovery
from cxlkv.ops.init import DEFAULT_POOL_PATH
from cxlkv.pool import device
from cxlkv.pool.image import PoolImage
from cxlkv.state import nodes, protocol, visibility

PASS, WARN, FAIL, SKIP, UNKNOWN = "pass", "warn", "fail", "skip", "unknown"
TEMP_WARN_C = 70          # latency 200 -> 400+ ns above 70 C
LIFE_WARN_PCT = 90
MIN_KERNEL = (6, 0)       # CXL regions (cxl create-region) need 6.0+
GOOD_KERNEL = (6, 6)      # 6.6+: memory tiers from HMAT/CDAT
GOOD_ALIGN = 2 << 20


@dataclass
class Check:
    id: str
    title: str
    status: str
    detail: str
    remedy: str | None = None
    subject: str | None = None     # the device or object checked, when there are several
    data: dict | None = None       # what the check saw, for --json (visibility: every node)

    def to_json(self) -> dict:
        d = asdict(self)
        if d["data"] is None:
            del d["data"]
        return d


def exit_code(checks: list[Check]) -> int:
    """0 all pass (skip/unknown count as pass), 1 a warning, 2 a failure."""
    st = {c.status for c in checks}
    return 2 if FAIL in st else 1 if WARN in st else 0


# --------------------------------------------------------------------------
# host checks

def check_host(h: dict, *, emulated: bool = False) -> list[Check]:
    """Checks of the host (discovery dict).  emulated: the pool is a file, so the CXL
    device checks do not apply (skip) when there is no CXL hardware."""
    out: list[Check] = []
    cxl = h["cxl"]
    has_cxl = bool(cxl["memdevs"] or cxl["sysfs_memdevs"])
    out.append(_kernel(h["kernel"]))
    if not has_cxl and emulated:
        out.append(Check("cxl", "CXL memory devices", SKIP,
                         "no CXL memory devices; the pool is an emulated one in a file"))
    else:
        out += _cxl_stack(h)
    out += _memory_policy(h)
    out.append(host_mode_check(h))
    return out


def host_mode(h: dict) -> str:
    """Which of the two setups this host is in: "pool" (CXL memory as devdax,
    mapped by cxlkv as a shared pool), "tiering" (CXL memory online as CPU-less
    NUMA nodes, placed by the kernel's demotion and promotion), "mixed" (both),
    or "none" (no CXL memory in use)."""
    pool = any(d.get("mode") == "devdax" for d in h["cxl"]["dax_devices"])
    tiering = bool(h["cxl_memory_nodes"])
    return {(True, True): "mixed", (True, False): "pool", (False, True): "tiering",
            (False, False): "none"}[(pool, tiering)]


MODE_GUIDANCE = {
    "pool": "CXL memory is a devdax device: cxlkv maps it as the rack's shared KV pool; the "
            "kernel's tiering does not touch it (demotion and NUMA balancing apply to DRAM only)",
    "tiering": "CXL memory is online as NUMA node(s): the kernel demotes cold pages to it and "
               "promotes hot ones (numa_balancing=2); it is this host's memory, not a shared pool "
               "- for cxlkv's pool reconfigure it to devdax (cxlkv provision plan)",
    "mixed": "part of the CXL memory is a devdax pool and part is online as NUMA node(s) for "
             "kernel tiering: keep the pool's device in devdax, and check demotion for the rest",
    "none": "no CXL memory in use: a pool here is emulated in a file",
}


def host_mode_check(h: dict) -> Check:
    mode = host_mode(h)
    return Check("cxl-mode", "how CXL memory is used", PASS, f"{mode}: {MODE_GUIDANCE[mode]}")


def _kernel(k: dict) -> Check:
    v = tuple(k["version"] or ())
    rel = k["release"] or "unknown"
    if not v:
        return Check("kernel", "kernel version", UNKNOWN, f"cannot read the kernel version ({rel})")
    if v < MIN_KERNEL:
        return Check("kernel", "kernel version", FAIL,
                     f"kernel {rel}: CXL regions need 6.0 or newer",
                     "boot a kernel >= 6.6 with CONFIG_CXL_REGION and CONFIG_ACPI_HMAT")
    if v < GOOD_KERNEL:
        return Check("kernel", "kernel version", WARN,
                     f"kernel {rel}: CXL pmem regions and devdax work, but RAM regions (6.3) "
                     "and memory tiers from HMAT/CDAT (6.6) are missing or young",
                     "use a kernel >= 6.6 with CONFIG_ACPI_HMAT")
    return Check("kernel", "kernel version", PASS, f"kernel {rel}")


def _cxl_stack(h: dict) -> list[Check]:
    cxl, mods = h["cxl"], h["modules"]
    out = []
    missing = [m for m in discovery.CORE_MODULES if not mods.get(m)]
    out.append(Check("modules", "CXL kernel modules", FAIL if missing else PASS,
                     (f"not loaded: {', '.join(missing)}" if missing else
                      "loaded: " + ", ".join(m for m, st in mods.items() if st)),
                     f"modprobe -a {' '.join(missing)}" if missing else None))
    tools = [t for t, ok in cxl["tools"].items() if not ok]
    out.append(Check("tools", "cxl, ndctl, daxctl installed", FAIL if tools else PASS,
                     f"missing: {', '.join(tools)}" if tools else "all three on PATH",
                     "apt-get install ndctl daxctl" if tools else None))
    for e in cxl["errors"]:
        out.append(Check("tools", "tool output", FAIL, e["message"],
                         "run the command by hand to see why", e["command"]))
    memdevs = cxl["memdevs"]
    if not memdevs and not cxl["sysfs_memdevs"]:
        out.append(Check("memdev", "CXL memory devices", FAIL,
                         "no CXL memory devices (nothing in /sys/bus/cxl/devices)",
                         "check the BIOS: CXL enabled, memory map and interleave set; the card "
                         "seen by lspci; firmware matching the board"))
        return out
    for m in memdevs:
        if m["enabled"] is False:
            out.append(Check("memdev", "memdev bound to cxl_mem", FAIL,
                             f"{m['memdev']} has no driver", "modprobe cxl_mem", m["memdev"]))
        else:
            cap = (f"ram {m['ram_size']}, pmem {m['pmem_size']} bytes; "
                   f"firmware {m['firmware_version'] or 'unknown'}")
            out.append(Check("memdev", "memdev bound to cxl_mem", PASS, cap, None, m["memdev"]))
        out += _health(m)
    regions = cxl["regions"]
    if not regions:
        out.append(Check("region", "CXL region", FAIL, "no region: the capacity is not mapped",
                         "cxlkv provision plan (then apply --yes)"))
    for r in regions:
        ok = r["decode_state"] in (None, "commit") and r["state"] != "disabled"
        out.append(Check("region", "CXL region", PASS if ok else FAIL,
                         f"{r['type'] or 'unknown'} region, {r['size']} bytes, "
                         f"{r['interleave_ways']}-way, decode {r['decode_state']}, {r['state']}",
                         None if ok else f"cxl enable-region {r['region']} (or provision again)",
                         r["region"]))
    out += _dax(h)
    return out


def _health(m: dict) -> list[Check]:
    hl, name = m["health"], m["memdev"]
    out = []
    t = hl["temperature_c"]
    ext = hl.get("ext_temperature")
    if t is None and ext is None:
        out.append(Check("temperature", "device temperature", UNKNOWN,
                         "unknown: the device reports no health (cxl list -H)", None, name))
    elif ext == "critical" or (t is not None and t > TEMP_WARN_C + 15):
        out.append(Check("temperature", "device temperature", FAIL,
                         f"{_unk(t, ' C')} (device says {ext or 'n/a'})",
                         "cool the card: airflow, not next to a GPU", name))
    elif ext == "warning" or (t is not None and t > TEMP_WARN_C):
        out.append(Check("temperature", "device temperature", WARN,
                         f"{_unk(t, ' C')} is over {TEMP_WARN_C} C: latency doubles",
                         "improve airflow around the CXL card; keep it away from GPUs", name))
    else:
        out.append(Check("temperature", "device temperature", PASS, f"{_unk(t, ' C')}",
                         None, name))
    life, ext_life = hl["life_used_percent"], hl.get("ext_life_used")
    if life is None and ext_life is None:
        out.append(Check("life-used", "device life used", UNKNOWN,
                         "unknown: the device reports no health", None, name))
    elif ext_life == "critical" or (life is not None and life >= 100):
        out.append(Check("life-used", "device life used", FAIL, f"{_unk(life, '%')} used",
                         "plan the replacement of this device", name))
    elif ext_life == "warning" or (life is not None and life >= LIFE_WARN_PCT):
        out.append(Check("life-used", "device life used", WARN, f"{_unk(life, '%')} used",
                         "plan the replacement of this device", name))
    else:
        out.append(Check("life-used", "device life used", PASS, f"{_unk(life, '%')} used",
                         None, name))
    if hl["reported"]:
        bad = [a for a in hl["alarms"] if a in ("hw_replacement_needed", "media_data_lost",
                                               "media_persistence_lost", "media_not_ready")]
        if bad:
            out.append(Check("alarms", "device alarms", FAIL, ", ".join(hl["alarms"]),
                             "replace the device; data on it may be lost", name))
        elif hl["alarms"]:
            out.append(Check("alarms", "device alarms", WARN, ", ".join(hl["alarms"]),
                             "schedule maintenance (cxl list -H shows the health)", name))
        else:
            out.append(Check("alarms", "device alarms", PASS, "none", None, name))
    else:
        out.append(Check("alarms", "device alarms", UNKNOWN,
                         "unknown: the device reports no health", None, name))
    return out


def _unk(v, unit="") -> str:
    return "unknown" if v is None else f"{v}{unit}"


def _dax(h: dict) -> list[Check]:
    cxl = h["cxl"]
    out = []
    missing = [m for m in discovery.DAX_MODULES if not h["modules"].get(m)]
    if missing:
        out.append(Check("modules", "DAX kernel modules", FAIL, f"not loaded: {', '.join(missing)}",
                         f"modprobe -a {' '.join(missing)}"))
    if not cxl["dax_devices"]:
        if cxl["regions"]:
            out.append(Check("devdax", "DAX device in devdax mode", FAIL,
                             "a region but no DAX device on it",
                             "cxlkv provision apply --yes (creates the devdax namespace)"))
        return out
    for d in cxl["dax_devices"]:
        name = d["chardev"]
        if d["mode"] == "system-ram":
            out.append(Check(
                "devdax", "DAX device in devdax mode", FAIL,
                f"{name} is online as system RAM (node {d['target_node']}, "
                f"{d['online_memblocks']}/{d['total_memblocks']} blocks): the kernel owns it, "
                "a pool cannot map it - the classic trap of auto-onlined CXL memory",
                f"daxctl reconfigure-device -m devdax -f {name} (only when nothing uses that "
                "memory: cxlkv provision apply checks), and set auto_online_blocks to offline",
                name))
            continue
        if d["mode"] != "devdax":
            out.append(Check("devdax", "DAX device in devdax mode", WARN,
                             f"{name} mode {d['mode'] or 'unknown'}",
                             f"daxctl reconfigure-device -m devdax {name}", name))
        else:
            out.append(Check("devdax", "DAX device in devdax mode", PASS,
                             f"{name}: devdax, {d['size']} bytes", None, name))
        out.append(_alignment(d))
        out.append(permissions(d["device"], name))
    return out


def _alignment(d: dict) -> Check:
    name, align, size = d["chardev"], d["align"], d["size"]
    if not align or not size:
        return Check("alignment", "DAX alignment", UNKNOWN, f"{name}: alignment not reported",
                     None, name)
    if size % align:
        return Check("alignment", "DAX alignment", FAIL,
                     f"{name}: size {size} is not a multiple of its alignment {align}: only "
                     "whole units can be mapped",
                     "recreate the namespace with a size that is a multiple of the alignment",
                     name)
    if align < GOOD_ALIGN:
        return Check("alignment", "DAX alignment", WARN,
                     f"{name}: {align}-byte pages: TLB misses cost (use 2 MiB pages)",
                     "recreate the namespace with -a 2M (cxlkv provision uses 2M)", name)
    return Check("alignment", "DAX alignment", PASS, f"{name}: {align} bytes", None, name)


def permissions(dev: dict, name: str, *, device: bool = True) -> Check:
    """/dev/daxX.Y: 0660 with a group; never world-accessible (KV blocks are tenant data).
    A pool file needs only the last part."""
    if not dev.get("exists"):
        return Check("permissions", "device permissions", FAIL,
                     f"{dev['path']} does not exist (no devtmpfs/udev node)",
                     f"check udev; ls -l {dev['path']}", name)
    mode = int(dev["mode"], 8)
    if mode & 0o006:
        return Check("permissions", "device permissions", FAIL,
                     f"{dev['path']} is mode {dev['mode']}: world-"
                     f"{'writable' if mode & 0o002 else 'readable'}; pools hold tenant data",
                     f"chmod 0660 {dev['path']}; chgrp <serving group> {dev['path']}"
                     + ("; and a udev rule so it stays so" if device else ""), name)
    if not device:
        return Check("permissions", "pool file permissions", PASS,
                     f"{dev['path']} mode {dev['mode']} group {dev['group']}", None, name)
    if dev["gid"] == 0 or not mode & 0o060:
        return Check("permissions", "device permissions", WARN,
                     f"{dev['path']} is mode {dev['mode']} group {dev['group']}: only root "
                     "can map it",
                     f"cxlkv provision apply --yes --group <serving group> (or chgrp GROUP "
                     f"{dev['path']}; chmod 0660 {dev['path']}, and a udev rule to keep it)", name)
    return Check("permissions", "device permissions", PASS,
                 f"{dev['path']} mode {dev['mode']} group {dev['group']}", None, name)


def _memory_policy(h: dict) -> list[Check]:
    out = []
    thp = h["thp"]["enabled"]
    if thp is None:
        out.append(Check("thp", "transparent huge pages", UNKNOWN, "no THP setting in sysfs"))
    elif thp == "never":
        out.append(Check("thp", "transparent huge pages", WARN,
                         "THP is off: 4 KiB pages for emulated pools and staging buffers "
                         "(TLB misses halve performance)",
                         "echo always > /sys/kernel/mm/transparent_hugepage/enabled "
                         "(or madvise: cxlkv asks for huge pages with MADV_HUGEPAGE)"))
    else:
        out.append(Check("thp", "transparent huge pages", PASS,
                         thp + (" (cxlkv asks with MADV_HUGEPAGE)" if thp == "madvise"
                                else "")))
    cxl_nodes = h["cxl_memory_nodes"]
    pol = h["numa_policy"]
    bal = pol["numa_balancing"]
    if bal is None:
        out.append(Check("numa-balancing", "NUMA balancing", UNKNOWN,
                         "no /proc/sys/kernel/numa_balancing"))
    elif cxl_nodes and not bal & 2:
        out.append(Check("numa-balancing", "NUMA balancing", WARN,
                         f"mode {pol['numa_balancing_mode']} with CXL memory online as node(s) "
                         f"{cxl_nodes}: hot pages on CXL are not promoted",
                         "sysctl kernel.numa_balancing=2 (memory tiering mode)"))
    else:
        out.append(Check("numa-balancing", "NUMA balancing", PASS,
                         f"{pol['numa_balancing_mode']}"
                         + ("" if cxl_nodes else " (no CXL memory online as a NUMA node)")))
    dem = pol["demotion_enabled"]
    if cxl_nodes and dem is False:
        out.append(Check("demotion", "demotion to CXL memory", WARN,
                         f"demotion is off with CXL memory online as node(s) {cxl_nodes}",
                         "echo true > /sys/kernel/mm/numa/demotion_enabled"))
    elif dem is None:
        out.append(Check("demotion", "demotion to CXL memory", UNKNOWN,
                         "no /sys/kernel/mm/numa/demotion_enabled (kernel without tiering)"))
    else:
        out.append(Check("demotion", "demotion to CXL memory", PASS,
                         f"{'on' if dem else 'off'}"
                         + ("" if cxl_nodes else " (no CXL memory online as a NUMA node)")))
    tiers = h["memory_tiers"]
    if not tiers:
        out.append(Check("tiers", "memory tiers", WARN,
                         "no memory tiers in sysfs: the kernel cannot tell CXL from DRAM",
                         "use a kernel >= 6.1 (tiers) or >= 6.6 with CONFIG_ACPI_HMAT"))
    else:
        tier_of = {n: t["tier"] for t in tiers for n in t["nodes"]}
        dram = {tier_of.get(n) for n in h["numa"]["has_cpu"]}
        flat = [n for n in cxl_nodes if tier_of.get(n) in dram]
        desc = "; ".join(f"tier {t['tier']}: nodes {t['nodes']}" for t in tiers)
        if flat:
            out.append(Check("tiers", "memory tiers", WARN,
                             f"CXL node(s) {flat} share a tier with DRAM ({desc}): demotion will "
                             "not use them", "use a kernel and firmware with HMAT/CDAT "
                             "(CONFIG_ACPI_HMAT), so CXL memory gets its own tier"))
        else:
            out.append(Check("tiers", "memory tiers", PASS, desc))
    auto = h["memory"]["auto_online_blocks"]
    if auto is None:
        out.append(Check("auto-online", "memory auto-online policy", UNKNOWN,
                         "no /sys/devices/system/memory/auto_online_blocks"))
    elif auto != "offline":
        out.append(Check(
            "auto-online", "memory auto-online policy", WARN,
            f"auto_online_blocks is {auto}: new CXL RAM goes online as system RAM before it can "
            "be claimed as devdax (and daxctl 76.1 refuses to reconfigure under this policy)",
            "echo offline > /sys/devices/system/memory/auto_online_blocks (and "
            "memhp_default_state=offline on the kernel command line)"))
    else:
        out.append(Check("auto-online", "memory auto-online policy", PASS, "offline"))
    return out


# --------------------------------------------------------------------------
# pool checks

def default_pool(h: dict) -> str | None:
    """The pool to check when none is named: the one devdax device, else the default
    emulated pool when it exists."""

    devs = [d for d in h["cxl"]["dax_devices"] if d["mode"] == "devdax" and d["device"]["exists"]]
    if len(devs) == 1:
        return devs[0]["device"]["path"]
    if os.path.lexists(DEFAULT_POOL_PATH):
        return DEFAULT_POOL_PATH
    return None


def check_pool(path: str | None, *, challenge: bool = True) -> list[Check]:
    if path is None:
        return [Check("pool", "pool formatted and readable", SKIP,
                      "no pool given and none found (--pool PATH or CXLKV_POOL)")]

    out = []
    try:
        t = device.probe(path)
    except errors.CxlkvError as e:
        return [Check("pool", "pool formatted and readable", FAIL, e.message,
                      e.hint or f"cxlkv init --pool {path}", path)]
    if t.kind == "file":
        out.append(permissions({"path": path, "exists": True, "mode": f"{t.mode:04o}",
                                "gid": t.gid, "group": t.to_json()["group"]}, path, device=False))
    try:
        pool = Pool.open(path, writable=False, force=True)
    except errors.NotFormatted as e:
        return out + [Check("pool", "pool formatted and readable", FAIL, e.message,
                            f"cxlkv init {'--device' if t.kind == 'devdax' else '--pool'} {path}",
                            path)]
    except errors.CxlkvError as e:
        return out + [Check("pool", "pool formatted and readable", FAIL, e.message,
                            e.hint or f"cxlkv fsck --pool {path}", path)]
    with pool:
        sb = pool.sb
        bad = pool.superblock_problems
        detail = (f"{sb.sync} mode, {sb.pool_size} bytes, format version {sb.version}, "
                  f"superblock copy {pool.superblock_copy}")
        if bad:
            out.append(Check("pool", "pool formatted and readable", WARN,
                             detail + "; damaged copy: " + "; ".join(f"{k}: {v}" for k, v in
                                                                      bad.items()),
                             f"cxlkv fsck --pool {path}", path))
        else:
            out.append(Check("pool", "pool formatted and readable", PASS, detail, None, path))
        out.append(_pinned_uuid(pool, path))
        out.append(_heartbeats(pool, path))
        out.append(_lock_manager(pool, path))
        out.append(shared_visibility(pool, path, challenge=challenge))
    return out


def shared_visibility(pool, path: str, *, challenge: bool = True,
                      timeout: float | None = None) -> Check:
    """Every other attached node seen from this host both ways: its heartbeat
    advancing here, and a challenge written here echoed (state.visibility).
    challenge=False (or no write access): heartbeats only."""
    writer = None
    if challenge and visibility.writable(path):
        try:
            writer = PoolImage.open(path, writable=True, force=True)
        except errors.CxlkvError:
            writer = None
    try:
        pr = visibility.probe(pool, timeout=timeout, challenge_pool=writer)
    finally:
        if writer is not None:
            writer.close()
    data = pr.to_json()
    if not pr.sights:
        return Check("visibility", "same pool memory as the other hosts", PASS,
                     "no other node attached: nothing to compare with", None, path, data=data)
    lines = "; ".join(s.describe() for s in pr.sights)
    hosts = len({s.boot_id for s in pr.sights if not s.same_host})
    if all(s.proven for s in pr.sights):
        return Check("visibility", "same pool memory as the other hosts", PASS,
                     f"{len(pr.sights)} node(s) ({hosts} other host(s)) proven both ways "
                     f"in {pr.seconds:.2f} s: {lines}", None, path, data=data)
    if not challenge and all(s.advanced for s in pr.sights):
        return Check("visibility", "same pool memory as the other hosts", PASS,
                     f"heartbeats of {len(pr.sights)} node(s) seen advancing here (not "
                     f"challenged): {lines}", None, path, data=data)
    return Check("visibility", "same pool memory as the other hosts", WARN, lines,
                 "run cxlkv doctor --pool on the other hosts too: a node every other host "
                 "sees but this one does not means this host maps other memory (check the "
                 "region and device with cxlkv inspect; pin the pool with CXLKV_POOL_UUID)",
                 path, data=data)


def _pinned_uuid(pool, path: str) -> Check:
    pin = os.environ.get(api.POOL_UUID_ENV, "").strip()
    if not pin:
        return Check("pool-uuid", "the pool this host pins", SKIP,
                     f"no pool uuid pinned (${api.POOL_UUID_ENV}); this pool is {pool.sb.uuid}",
                     None, path)
    try:
        api.check_uuid(pool)
    except errors.CxlkvError as e:
        return Check("pool-uuid", "the pool this host pins", FAIL, e.message, e.hint, path)
    return Check("pool-uuid", "the pool this host pins", PASS, f"pool {pool.sb.uuid}, as pinned",
                 None, path)


def _heartbeats(pool, path: str) -> Check:
    table = [n for n in nodes.read_nodes(pool) if n.state == "attached"]
    if not table:
        return Check("heartbeats", "node heartbeats fresh", PASS, "no nodes attached", None, path)
    alive = {n.slot for n in nodes.live_nodes(pool, observe=True)}
    stale = [n for n in table if n.slot not in alive]
    if stale:
        return Check("heartbeats", "node heartbeats fresh", WARN,
                     "no heartbeat for a lease from " + ", ".join(n.describe() for n in stale),
                     "dead nodes are reaped by the next node that attaches, or by the lock "
                     "manager in manager mode; cxlkv fsck shows what they hold", path)
    return Check("heartbeats", "node heartbeats fresh", PASS,
                 f"{len(table)} node(s) attached, all heartbeating", None, path)


def _lock_manager(pool, path: str) -> Check:
    if pool.sb.sync != "manager":
        return Check("lock-manager", "lock manager running", SKIP,
                     f"sync mode {pool.sb.sync} needs no lock manager", None, path)

    if protocol.manager_alive(pool):
        return Check("lock-manager", "lock manager running", PASS,
                     "a lock manager is heartbeating", None, path)
    return Check("lock-manager", "lock manager running", FAIL,
                 "sync mode manager and no lock manager heartbeats: nodes cannot attach or "
                 "take the lock", f"cxlkv lock-manager --pool {path} (one host; --standby on "
                 "the others)", path)


def run(*, pool: str | None = None, host: dict | None = None, challenge: bool = True) -> dict:
    """All checks; {"checks": [...], "summary": {...}, "pool": path, "exit_code": n}.
    challenge=False: the visibility check writes no challenge into the pool."""
    h = host if host is not None else discovery.discover()
    path = pool if pool is not None else default_pool(h)
    emulated = path is not None and not path.startswith("/dev/dax")
    checks = check_host(h, emulated=emulated) + check_pool(path, challenge=challenge)
    summary = {s: sum(c.status == s for c in checks) for s in (PASS, WARN, FAIL, SKIP, UNKNOWN)}
    return {"checks": [c.to_json() for c in checks], "summary": summary, "pool": path,
            "exit_code": exit_code(checks)}
