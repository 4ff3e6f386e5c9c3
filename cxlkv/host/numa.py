"""NUMA placement of processes that attach a pool (`--numa-node N|auto`).

A process bound to the node of the CXL device reaches the pool with lower
latency (about 30 % lower where it was measured).  Node numbers can change
across reboots, hence `auto`: the node of the pool's DAX device, read from
sysfs at bind time.

What a binding does (applied, then verified, or NumaError):

* CPUs: the process's threads run only on the chosen node's CPUs
  (numa_run_on_node_mask for the calling thread - which threads it starts
  later inherit - and sched_setaffinity for the threads already running).
  CXL memory is normally a CPU-less node, so the CPU node is the memory
  node when it has CPUs, else the node the device hangs off (its sysfs
  `numa_node`: the host bridge's socket), else the CPU node nearest to it
  by the kernel's distance table.
* memory policy: MPOL_BIND of the calling thread to the memory node when
  that node has memory online, else to the CPU node (local DRAM).  A DAX
  device in devdax mode has its `target_node` offline (its memory is not
  system RAM), so `auto` binds memory to the socket the device is attached
  to; device-dax pages themselves are the device's and need no policy.
* a pool in a file (tmpfs, hugetlbfs) whose pages can live on the chosen
  memory node also gets `mbind(MPOL_PREFERRED, MPOL_MF_MOVE)` on its
  mapping, falling back to no MF flags.

py-libnuma (`numa`) does the node masks, CPU binding and process memory
policy; it has no mbind/get_mempolicy, so those are bound here with ctypes
from the same libnuma (a SIGNATURES table, pyudev-style).
"""
from __future__ import annotations

import ctypes
import errno
import os
import re
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cxlkv.errors import NumaError, NumaUsage
from cxlkv.host import sysfs
from cxlkv.host.discovery import parse_list

MPOL_DEFAULT, MPOL_PREFERRED, MPOL_BIND = 0, 1, 2
MPOL_F_ADDR = 1 << 1
MPOL_MF_STRICT, MPOL_MF_MOVE = 1 << 0, 1 << 1
MAX_NODES = 1024


# --------------------------------------------------------------------------
# libnuma: py-libnuma's handle, plus the calls it does not wrap

#: name -> (restype, argtypes); bound onto numa.LIBNUMA on first use
SIGNATURES = {
    "mbind": (ctypes.c_long, [ctypes.c_void_p, ctypes.c_ulong, ctypes.c_int,
                              ctypes.POINTER(ctypes.c_ulong), ctypes.c_ulong, ctypes.c_uint]),
    "get_mempolicy": (ctypes.c_long, [ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_ulong),
                                      ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong]),
    "numa_num_task_cpus": (ctypes.c_int, []),
}


_extra = None


def libnuma():
    """py-libnuma's module; NumaError when libnuma is missing or NUMA is not supported."""
    try:
        import numa
    except (ImportError, OSError, AttributeError, TypeError) as e:
        raise NumaError(f"libnuma is not usable ({e})",
                        hint="apt-get install libnuma1 (py-libnuma loads it)") from None
    if numa.LIBNUMA.numa_available() < 0:
        raise NumaError("the kernel has no NUMA support (numa_available() < 0)")
    return numa


def extra():
    """The same libnuma, opened with errno kept, with SIGNATURES bound."""
    global _extra
    if _extra is None:
        lib = ctypes.CDLL(libnuma().LIBNUMA._name, use_errno=True)
        for name, (res, args) in SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        _extra = lib
    return _extra


# --------------------------------------------------------------------------
# topology (sysfs, redirectable)

def _node_dir(n: int):
    return sysfs.sys_path("devices", "system", "node", f"node{n}")


def node_cpus(n: int) -> list[int]:
    return parse_list(sysfs.read_attr(_node_dir(n) / "cpulist"))


def nodes_with(kind: str) -> list[int]:
    """Nodes in has_cpu / has_memory / online."""
    return parse_list(sysfs.read_attr(sysfs.sys_path("devices", "system", "node", kind)))


def distances(n: int) -> dict[int, int]:
    online = nodes_with("online")
    row = [int(x) for x in (sysfs.read_attr(_node_dir(n) / "distance") or "").split()]
    return {m: row[i] for i, m in enumerate(online) if i < len(row)}


def dax_nodes(dax: str) -> tuple[int | None, int | None]:
    """(target_node, numa_node) of a DAX device; None for -1 or unreadable."""
    d = sysfs.sys_path("bus", "dax", "devices", dax)
    if not d.exists():
        raise NumaUsage(f"{dax}: no such DAX device in {d.parent}",
                        hint="daxctl list shows the DAX devices")
    t, a = sysfs.read_int(d / "target_node"), sysfs.read_int(d / "numa_node")
    return (None if t is None or t < 0 else t), (None if a is None or a < 0 else a)


def dax_of(path: str) -> str | None:
    """The DAX device name of a /dev/daxX.Y path; None for anything else."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISCHR(st.st_mode):
        return None
    d = sysfs.char_device_dir(os.major(st.st_rdev), os.minor(st.st_rdev))
    name = os.path.basename(os.path.realpath(d)) if d.exists() else ""
    return name if name.startswith("dax") else None


@dataclass
class Placement:
    """Where a process should run and allocate, and why."""

    requested: str
    cpu_node: int
    mem_node: int
    target_node: int | None = None
    device: str | None = None
    reasons: list[str] = field(default_factory=list)


def _nearest_cpu_node(n: int) -> int | None:
    with_cpu = nodes_with("has_cpu")
    if n in nodes_with("online"):
        d = distances(n)
        cands = sorted((d.get(c, 1 << 30), c) for c in with_cpu)
        if cands:
            return cands[0][1]
    return None


#: for a command's --numa-node option (a CLI passes parse_spec as its check)
SPEC_HELP = ("Bind CPUs and memory policy to NUMA node N, or auto: the node of the pool's "
             "DAX device (node numbers can change across reboots).")


def parse_spec(text) -> int | str:
    """--numa-node's value: an int, or "auto"; NumaUsage (exit 2) for anything else."""
    t = str(text).strip()
    if t == "auto":
        return t
    if re.fullmatch(r"\d+", t):
        return int(t)
    raise NumaUsage(f"--numa-node {t!r}: give a node number or auto")


def resolve(spec, *, dax: str | None = None) -> Placement:
    """Turn `--numa-node` (an int, "N" or "auto") into a Placement.

    auto needs `dax` (the pool's DAX device); a number is a node that must
    be online or possible on this host.
    """
    spec = str(parse_spec(spec))
    with_cpu, with_mem = nodes_with("has_cpu"), nodes_with("has_memory")
    online = nodes_with("online")
    reasons: list[str] = []
    attach = None
    if spec == "auto":
        if dax is None:
            raise NumaUsage("--numa-node auto needs a device-dax pool (/dev/daxX.Y): it binds "
                            "to the node of the pool's DAX device",
                            hint="give a node number for a pool in a file")
        target, attach = dax_nodes(dax)
        if target is None and attach is None:
            raise NumaError(f"{dax}: the kernel reports no NUMA node for it "
                            "(target_node and numa_node are -1)",
                            hint="give a node number: --numa-node N")
        node = target if target is not None else attach
        reasons.append(f"auto: {dax} target_node {target}, attached to node {attach}")
    else:
        node, target = int(spec), None
        if node not in online and node not in nodes_with("possible"):
            raise NumaUsage(f"--numa-node {node}: no such node (online: "
                            f"{','.join(map(str, online)) or 'none'})",
                            hint="cxlkv inspect lists the NUMA nodes")
    # CPUs
    if node in with_cpu:
        cpu = node
    elif attach is not None and attach in with_cpu:
        cpu = attach
        reasons.append(f"node {node} has no CPUs: CPUs of node {attach}, the node "
                       f"{dax} is attached to")
    else:
        cpu = _nearest_cpu_node(node)
        if cpu is None:
            raise NumaError(f"node {node} has no CPUs and no online node is known to be near it",
                            hint="give a node with CPUs: --numa-node N (cxlkv inspect)")
        reasons.append(f"node {node} has no CPUs: CPUs of node {cpu}, the nearest by distance")
    # memory
    if node in with_mem:
        mem = node
    else:
        mem = cpu
        reasons.append(f"node {node} has no memory online: memory policy on node {cpu}")
    return Placement(spec, cpu, mem, target, dax, reasons)


# --------------------------------------------------------------------------
# applying and verifying

@dataclass
class Binding:
    requested: str
    cpu_node: int
    mem_node: int
    target_node: int | None
    device: str | None
    reasons: list[str]
    cpus: list[int]             # this process's allowed CPUs, read back
    thread_cpus: dict[str, list[int]]
    membind: list[int]          # the calling thread's MPOL_BIND nodes (get_mempolicy)
    mems_allowed: list[int]     # the cpuset's memory nodes (/proc/self/status)
    mapping_policy: dict | None = None

    def to_json(self) -> dict:
        return asdict(self)


def status_lists(path=None) -> dict[str, list[int]]:
    """Cpus_allowed_list and Mems_allowed_list of /proc/self/status (or a task's)."""
    path = Path(path) if path else sysfs.proc_path("self", "status")
    out = {}
    for line in (sysfs.read_attr(path) or "").splitlines():
        k, _, v = line.partition(":")
        if k in ("Cpus_allowed_list", "Mems_allowed_list"):
            out[k] = parse_list(v.strip())
    return out


def _tasks() -> list[int]:
    try:
        return sorted(int(t) for t in os.listdir(sysfs.proc_path("self", "task")))
    except OSError:
        return [0]


def mempolicy_of(address: int | None = None) -> tuple[int, list[int]]:
    """(mode, nodes) of the calling thread's policy, or with `address` of the
    page there (get_mempolicy, MPOL_F_ADDR)."""
    lib = extra()
    mode = ctypes.c_int(-1)
    mask = (ctypes.c_ulong * (MAX_NODES // 64))()
    flags = 0 if address is None else MPOL_F_ADDR
    if lib.get_mempolicy(ctypes.byref(mode), mask, MAX_NODES, ctypes.c_void_p(address or 0),
                         flags) != 0:
        e = ctypes.get_errno() or errno.EINVAL
        where = "of this thread" if address is None else f"at {address:#x}"
        raise NumaError(f"get_mempolicy {where}: {os.strerror(e)}")
    nodes = [i for i in range(MAX_NODES) if mask[i // 64] >> (i % 64) & 1]
    return mode.value, nodes


MODE_NAMES = {MPOL_DEFAULT: "default", MPOL_PREFERRED: "preferred", MPOL_BIND: "bind",
              3: "interleave", 4: "local"}


def mbind_preferred(address: int, length: int, node: int) -> dict:
    """mbind(MPOL_PREFERRED, node) on a mapping: MF_MOVE first, then no flags."""
    lib = extra()
    mask = (ctypes.c_ulong * (MAX_NODES // 64))()
    mask[node // 64] |= 1 << (node % 64)
    tried = []
    for flags, name in ((MPOL_MF_MOVE, "MPOL_MF_MOVE"), (0, "none")):
        r = lib.mbind(ctypes.c_void_p(address), length, MPOL_PREFERRED, mask, MAX_NODES, flags)
        if r == 0:
            mode, nodes = mempolicy_of(address)
            if mode != MPOL_PREFERRED or nodes != [node]:
                raise NumaError(f"mbind said yes but the mapping's policy reads back as mode "
                                f"{mode} nodes {nodes}")
            return {"policy": "preferred", "node": node, "flags": name, "tried": tried}
        tried.append(f"{name}: {os.strerror(ctypes.get_errno() or errno.EINVAL)}")
    raise NumaError(f"mbind(MPOL_PREFERRED, node {node}) failed: {'; '.join(tried)}")


def apply(p: Placement) -> Binding:
    """Bind this process as `p` says, then read the binding back (NumaError if it differs)."""
    numa = libnuma()
    cpus = node_cpus(p.cpu_node)
    if not cpus:
        raise NumaError(f"node {p.cpu_node} lists no CPUs")
    try:
        numa.schedule.run_on_nodes(p.cpu_node)
    except Exception as e:  # py-libnuma raises bare Exception
        raise NumaError(f"binding CPUs to node {p.cpu_node}: {e}") from None
    allowed_here = set(os.sched_getaffinity(0))
    for tid in _tasks():
        try:
            os.sched_setaffinity(tid, allowed_here)
        except OSError:
            pass   # a thread that ended meanwhile
    try:
        numa.memory.set_membind_nodes(p.mem_node)
    except Exception as e:  # noqa: BLE001
        raise NumaError(f"binding memory to node {p.mem_node}: {e}") from None
    return verify(p)


def verify(p: Placement) -> Binding:
    want = set(node_cpus(p.cpu_node))
    got = set(os.sched_getaffinity(0))
    if not got or not got <= want:
        raise NumaError(f"CPU binding not applied: allowed CPUs {sorted(got)}, node "
                        f"{p.cpu_node} has {sorted(want)}")
    threads = {}
    for tid in _tasks():
        st = status_lists(sysfs.proc_path("self", "task", str(tid), "status"))
        threads[str(tid)] = st.get("Cpus_allowed_list", [])
        if threads[str(tid)] and not set(threads[str(tid)]) <= want:
            raise NumaError(f"thread {tid} still runs on CPUs {threads[str(tid)]}")
    mode, membind = mempolicy_of()
    if mode != MPOL_BIND or membind != [p.mem_node]:
        raise NumaError(f"memory binding not applied: policy {MODE_NAMES.get(mode, mode)} "
                        f"nodes {membind}, wanted bind to [{p.mem_node}]")
    st = status_lists()
    return Binding(p.requested, p.cpu_node, p.mem_node, p.target_node, p.device, p.reasons,
                   sorted(got), threads, membind, st.get("Mems_allowed_list", []))


def bind(spec, *, pool_path: str | None = None) -> Binding:
    """resolve + apply: the one call `open_pool(numa_node=...)` and the CLI make."""
    dax = dax_of(pool_path) if pool_path else None
    return apply(resolve(spec, dax=dax))


def bind_mapping(binding: Binding, mapping, kind: str) -> None:
    """A pool in a file: prefer the memory node for its pages (not for device-dax)."""
    if kind != "file" or binding.mem_node not in nodes_with("has_memory"):
        return
    binding.mapping_policy = mbind_preferred(mapping.address, mapping.size, binding.mem_node)


def unbind() -> None:
    """Undo: all CPUs and the default memory policy (tests, and `with` blocks)."""
    numa = libnuma()
    numa.schedule.run_on_all_nodes()
    numa.memory.set_local_alloc()
    allowed = set(os.sched_getaffinity(0))
    for tid in _tasks():
        try:
            os.sched_setaffinity(tid, allowed)
        except OSError:
            pass
