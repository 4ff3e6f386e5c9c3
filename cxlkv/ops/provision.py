"""`cxlkv provision`: raw CXL capacity -> a region -> a devdax device -> a formatted pool.

A plan is computed from what the host has now (host discovery), as ordered
steps, each either already in place ("done") or to run ("todo"), with the
exact command, why, and how to undo it.  `apply` runs the first todo step,
discovers again, checks the step took effect (ndctl 76.1's exit codes lie:
listing is the only proof), plans again, and so on - so a second `apply`
finds everything done and changes nothing, and the first failure stops the
run with the tool's stderr, the state left behind and the commands that undo
what was done.

Rules it keeps:
* memory is onlined as system RAM only with mode "system-ram";
* memory in use is never reconfigured or destroyed: a DAX device some
  process maps, a pool with live nodes, system RAM with pages in use;
* existing data is never overwritten: a namespace in another mode, or a
  device holding something else, stops the plan (cxlkv init refuses foreign
  data on its own).
"""
from __future__ import annotations

import grp
import os
import re
import time
from dataclasses import asdict, dataclass, field

from cxlkv.api import Pool
from cxlkv.errors import CxlkvError, InUse, NotFormatted, PlanError, ProvisionFailed, UsageError
from cxlkv.errors import CxlkvError as Err
from cxlkv.host import discovery
from cxlkv.host import sysfs
from cxlkv.host import tools as host_tools
from cxlkv.ops.init import init_pool
from cxlkv.state import nodes
from cxlkv.util.sizes import human_size

MODES = ("devdax", "system-ram")
SYNC_MODES = ("manager", "cas")
DEFAULT_ALIGN = "2M"


@dataclass
class Options:
    mode: str = "devdax"
    memdevs: list[str] = field(default_factory=list)   # empty: every enabled memdev
    decoder: str | None = None                          # root decoder; None: the first that fits
    region: str | None = None                           # teardown: this region
    align: str = DEFAULT_ALIGN
    group: str | None = None
    sync: str = "manager"
    format: bool = True

    def check(self) -> None:
        if self.mode not in MODES:
            raise UsageError(f"--mode must be one of {', '.join(MODES)}")
        if self.sync not in SYNC_MODES:
            raise UsageError(f"--sync must be one of {', '.join(SYNC_MODES)}")
        if not re.fullmatch(r"\d+[KMG]?", self.align):
            raise UsageError(f"--align {self.align!r}: a size such as 4K, 2M or 1G")
        if self.group is not None:
            try:
                grp.getgrnam(self.group)
            except KeyError:
                raise UsageError(f"--group {self.group}: no such group",
                                 hint=f"groupadd {self.group}") from None


@dataclass
class Step:
    id: str
    title: str
    command: str
    status: str                      # "done" | "todo"
    why: str
    undo: str | None = None
    argv: list[str] | None = None    # a tool to run through the seam; None: done in-process

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class Plan:
    action: str                      # "apply" | "teardown"
    options: dict
    steps: list[Step]
    device: str | None               # /dev/daxX.Y when known
    region: str | None
    notes: list[str] = field(default_factory=list)

    @property
    def todo(self) -> list[Step]:
        return [s for s in self.steps if s.status == "todo"]

    def to_json(self) -> dict:
        return {"action": self.action, "options": self.options,
                "steps": [s.to_json() for s in self.steps], "device": self.device,
                "region": self.region, "notes": self.notes,
                "changes": len(self.todo)}


def _hs(n) -> str:
    return human_size(n) if isinstance(n, int) and n > 0 else f"{n} bytes"


def align_bytes(text: str) -> int:
    m = re.fullmatch(r"(\d+)([KMG]?)", text)
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2)]


# --------------------------------------------------------------------------
# what is in use

def mappers(dax: str) -> list[dict]:
    """Processes that map or hold open /dev/DAX (procfs maps and fds)."""
    out, path = [], f"/dev/{dax}"
    root = sysfs.proc_root()
    try:
        pids = [p for p in os.listdir(root) if p.isdigit()]
    except OSError:
        return out
    for pid in pids:
        hit = False
        try:
            with open(root / pid / "maps") as f:
                hit = any(line.rstrip().endswith(" " + path) for line in f)
        except OSError:
            pass
        if not hit:
            try:
                fds = os.listdir(root / pid / "fd")
            except OSError:
                fds = []
            for fd in fds:
                try:
                    if os.readlink(root / pid / "fd" / fd) == path:
                        hit = True
                        break
                except OSError:
                    continue
        if hit:
            comm = (sysfs.read_attr(root / pid / "comm") or "?")
            out.append({"pid": int(pid), "comm": comm})
    return out


def live_pool_nodes(path: str) -> list[str]:
    """Live nodes of the pool at path ([] when it is not a pool or cannot be read)."""

    try:
        with Pool.open(path, writable=False, force=True) as pool:
            return [n.describe() for n in nodes.live_nodes(pool, observe=True)]
    except (Err, OSError):
        return []


def node_memory_used(node: int | None) -> int | None:
    if node is None:
        return None
    mi = discovery.meminfo(sysfs.sys_path("devices", "system", "node", f"node{node}", "meminfo"))
    if "MemUsed" in mi:
        return mi["MemUsed"]
    if "MemTotal" in mi and "MemFree" in mi:
        return mi["MemTotal"] - mi["MemFree"]
    return None


def in_use(dev: dict, *, pool_check: bool = True) -> tuple[str, str] | None:
    """(why, what to do) when something uses the DAX device `dev` (a discovery
    dax_devices entry), else None."""
    name = dev["chardev"]
    users = mappers(name)
    if users:
        return (f"/dev/{name} is in use by "
                + ", ".join(f"pid {u['pid']} ({u['comm']})" for u in users),
                "stop those processes first (they map the device)")
    if dev["mode"] == "system-ram":
        used = node_memory_used(dev["target_node"])
        if used:
            return (f"{name} is system RAM on node {dev['target_node']} with {used} bytes in "
                    "use; taking it offline would have to migrate them",
                    f"move the users off node {dev['target_node']} (numactl, migratepages) "
                    "first")
    if pool_check and dev["mode"] == "devdax" and dev["device"]["exists"]:
        live = live_pool_nodes(str(sysfs.dev_path(name)))
        if live:
            return (f"the pool on /dev/{name} has live nodes: {', '.join(live)}",
                    "detach them (stop the serving processes) first")
    return None


def refuse_if_in_use(dev: dict, *, what: str, pool_check: bool = True) -> None:
    busy = in_use(dev, pool_check=pool_check)
    if busy:
        raise InUse(f"{what}: {busy[0]}", hint=busy[1])


# --------------------------------------------------------------------------
# planning

def _need_tools(h: dict, tools=("cxl", "ndctl", "daxctl")) -> None:
    missing = [t for t in tools if not h["cxl"]["tools"][t]]
    if missing:
        raise host_tools.not_found(missing[0])


def _memdevs(h: dict, opts: Options) -> list[dict]:
    all_ = {m["memdev"]: m for m in h["cxl"]["memdevs"]}
    if not all_:
        raise PlanError("no CXL memory devices to provision",
                        hint="cxlkv doctor says why (modules, BIOS)")
    if opts.memdevs:
        unknown = [m for m in opts.memdevs if m not in all_]
        if unknown:
            raise UsageError(f"--memdev {', '.join(unknown)}: no such memdev "
                             f"(there are {', '.join(all_)})")
        return [all_[m] for m in opts.memdevs]
    return [m for m in all_.values() if m["enabled"] is not False]


def _root_decoder(h: dict, opts: Options, rtype: str, size: int, nways: int) -> str:
    roots = [d for d in h["cxl"]["decoders"] if d["kind"] == "root"]
    cap = "pmem_capable" if rtype == "pmem" else "volatile_capable"
    if opts.decoder:
        if opts.decoder not in {d["decoder"] for d in roots}:
            raise UsageError(f"--decoder {opts.decoder}: not a root decoder (there are "
                             f"{', '.join(d['decoder'] for d in roots) or 'none'})")
        return opts.decoder
    for d in roots:
        if d.get(cap) and (d.get("max_available_extent") or 0) >= size \
                and (d.get("interleave_ways") or 1) <= nways:
            return d["decoder"]
    raise PlanError(f"no root decoder (CXL window) can hold a {rtype} region of {size} bytes "
                    f"over {nways} memdev(s)",
                    hint="cxlkv inspect shows the root decoders; name one with --decoder")


def plan_apply(h: dict, opts: Options) -> Plan:
    opts.check()
    _need_tools(h)
    cxl = h["cxl"]
    devs = _memdevs(h, opts)
    names = [m["memdev"] for m in devs]
    steps: list[Step] = []
    notes: list[str] = []

    # 1. the region
    containing = {r["region"]: r for r in cxl["regions"] if set(r["memdevs"]) & set(names)}
    region = None
    if len(containing) > 1 or (containing and set(next(iter(containing.values()))["memdevs"])
                               != set(names)):
        raise PlanError(f"{', '.join(names)} are spread over region(s) "
                        f"{', '.join(containing)} that map other memdevs",
                        hint="name the memdevs of one region with --memdev")
    if containing:
        region = next(iter(containing.values()))
        steps.append(Step("region", f"a {region['type'] or ''} region over {', '.join(names)}",
                          f"cxl create-region ... {' '.join(names)}", "done",
                          f"{region['region']} already maps {', '.join(names)} "
                          f"({_hs(region['size'])}, decode {region['decode_state']})",
                          f"cxl destroy-region -f {region['region']}"))
        rtype = region["type"] or "pmem"
    else:
        rtype = "pmem" if all(m["pmem_size"] for m in devs) else "ram"
        size = sum(m["pmem_size"] if rtype == "pmem" else m["ram_size"] for m in devs)
        if not size:
            raise PlanError(f"{', '.join(names)} report no capacity")
        dec = _root_decoder(h, opts, rtype, size, len(devs))
        argv = ["cxl", "create-region", "-m", "-d", dec, "-w", str(len(devs)), "-t", rtype] + names
        steps.append(Step("region", f"create a {rtype} region of {_hs(size)} over "
                          f"{', '.join(names)} in the CXL window {dec}", " ".join(argv), "todo",
                          "the capacity is not mapped into the host's address space yet",
                          "cxl destroy-region -f REGION (the region this creates)", argv))
        if rtype == "ram":
            notes.append("RAM regions: cxl 76.1 cannot create them ('region type 'ram' not "
                         "supported yet'); platform firmware usually creates them at boot")

    # 2. the DAX device
    dax = None
    if region is not None:
        daxes = [d for d in cxl["dax_devices"] if d["cxl_region"] == region["region"]]
        dax = daxes[0] if daxes else None
    if rtype == "pmem":
        steps.append(_namespace_step(cxl, region, dax, opts))
    elif dax is None:
        steps.append(Step("dax", "a DAX device on the RAM region", "(created by dax_cxl)",
                          "todo", "the kernel makes it when dax_cxl binds the region",
                          None, None))
    devpath = f"/dev/{dax['chardev']}" if dax else None

    # 3. the mode
    if dax is not None and opts.mode == "devdax" and dax["mode"] == "system-ram":
        argv = ["daxctl", "reconfigure-device", "-m", "devdax", "-f", dax["chardev"]]
        busy = in_use(dax, pool_check=False)
        busy = f" (apply refuses it now: {busy[0]})" if busy else ""
        steps.append(Step("mode", f"take {dax['chardev']} back from system RAM to devdax",
                          " ".join(argv), "todo",
                          f"{dax['chardev']} is online as system RAM on node "
                          f"{dax['target_node']}: a pool cannot map it{busy}",
                          f"daxctl reconfigure-device -m system-ram {dax['chardev']}", argv))
    elif opts.mode == "system-ram":
        name = dax["chardev"] if dax else "DAX"
        argv = ["daxctl", "reconfigure-device", "-m", "system-ram", name]
        done = dax is not None and dax["mode"] == "system-ram"
        steps.append(Step("mode", f"online {name} as system RAM (a CPU-less NUMA node)",
                          " ".join(argv), "done" if done else "todo",
                          (f"{name} is system RAM on node {dax['target_node']}" if done else
                           "asked for with --mode system-ram: the memory becomes a NUMA node "
                           "for the kernel, not a pool"),
                          f"daxctl reconfigure-device -m devdax -f {name}",
                          None if done or dax is None else argv))
        if h["memory"]["auto_online_blocks"] not in (None, "offline"):
            notes.append("auto_online_blocks is not offline: daxctl 76.1 refuses to reconfigure "
                         "(write offline to /sys/devices/system/memory/auto_online_blocks)")
        if dax is not None and dax["size"] and h["memory"]["block_size"]:
            whole = dax["size"] // h["memory"]["block_size"]
            notes.append(f"only whole {h['memory']['block_size'] >> 20} MiB memory blocks go "
                         f"online: {whole} of them")
        return Plan("apply", asdict(opts), steps, devpath, region and region["region"], notes)
    else:
        if dax is not None:
            steps.append(Step("mode", f"{dax['chardev']} in devdax mode",
                              f"daxctl reconfigure-device -m devdax {dax['chardev']}", "done",
                              f"{dax['chardev']} is in {dax['mode']} mode", None))

    # 4. ownership and mode of the device node
    steps.append(_permissions_step(dax, opts))
    # 5. the pool
    if opts.format:
        steps.append(_format_step(dax, opts))
    notes.append("device ownership and mode do not survive a reboot by themselves: add a udev "
                 "rule, e.g. SUBSYSTEM==\"dax\", GROUP=\"%s\", MODE=\"0660\""
                 % (opts.group or "GROUP"))
    return Plan("apply", asdict(opts), steps, devpath, region and region["region"], notes)


def _namespace_step(cxl: dict, region: dict | None, dax: dict | None, opts: Options) -> Step:
    nd = region["nd_region"] if region else None
    argv = ["ndctl", "create-namespace", "-r", nd or "NDREGION", "-m", "devdax",
            "-a", opts.align]
    if dax is not None:
        want = align_bytes(opts.align)
        why = f"{dax['chardev']}: {_hs(dax['size'])}, {_hs(dax['align'])} pages"
        if dax["align"] and dax["align"] != want:
            why += f" (not the {opts.align} asked for; kept: recreating would lose data)"
        ns = next((n for n in cxl["namespaces"] if n["chardev"] == dax["chardev"]), None)
        return Step("namespace", f"a devdax namespace on {nd}", " ".join(argv), "done", why,
                    f"ndctl destroy-namespace -f {ns['dev'] if ns else 'NAMESPACE'}")
    if nd is not None:
        other = [n for n in cxl["namespaces"] if n["region"] == nd and n["size"]
                 and n["mode"] != "devdax"]
        if other:
            n = other[0]
            raise PlanError(f"{nd} holds {n['dev']} in {n['mode']} mode ({n['size']} bytes): "
                            "it may hold data, so provision does not replace it",
                            hint=f"if it is not needed: ndctl destroy-namespace -f {n['dev']}")
    return Step("namespace", f"create a devdax namespace ({opts.align} pages) on "
                f"{nd or 'the new region'}", " ".join(argv), "todo",
                "a /dev/daxX.Y character device is how a pool maps CXL memory"
                + ("" if nd else " (NDREGION: the nvdimm region the new CXL region appears as)"),
                "ndctl destroy-namespace -f NAMESPACE (the namespace this creates)",
                argv if nd else None)


def _permissions_step(dax: dict | None, opts: Options) -> Step:
    name = dax["chardev"] if dax else "daxX.Y"
    path = f"/dev/{name}"
    cmd = (f"chgrp {opts.group} {path}; " if opts.group else "") + f"chmod 0660 {path}"
    title = f"{path} mode 0660" + (f", group {opts.group}" if opts.group else "")
    if dax is None or not dax["device"]["exists"]:
        return Step("permissions", title, cmd, "todo",
                    "serving processes of the group map the device; nobody else may",
                    f"chmod 0600 {path}")
    dev = dax["device"]
    ok = dev["mode"] == "0660" and (opts.group is None or dev["group"] == opts.group)
    return Step("permissions", title, cmd, "done" if ok else "todo",
                f"now mode {dev['mode']} group {dev['group']}",
                f"chgrp {dev['group']} {path}; chmod {dev['mode']} {path}")


def _format_step(dax: dict | None, opts: Options) -> Step:
    name = dax["chardev"] if dax else "daxX.Y"
    path = f"/dev/{name}"
    cmd = f"cxlkv init --device {path} --sync {opts.sync}" + (
        f" --group {opts.group}" if opts.group else "")
    title = f"format a cxlkv pool (sync mode {opts.sync}) on {path}"
    undo = ("nothing to undo in place: the pool stays on the media; destroying the namespace "
            "removes the device")
    if dax is None or not dax["device"]["exists"]:
        return Step("format", title, cmd, "todo", "the device does not exist yet", undo)
    state = pool_state(str(sysfs.dev_path(name)))
    if state["formatted"]:
        if state["sync"] != opts.sync:
            raise PlanError(f"{path} holds a cxlkv pool in sync mode {state['sync']}, not "
                            f"{opts.sync}", hint=f"keep it (--sync {state['sync']}), or "
                            f"cxlkv init --device {path} --sync {opts.sync} --force "
                            "(erases the pool)")
        return Step("format", title, cmd, "done",
                    f"{path} holds a cxlkv pool ({state['sync']}, {_hs(state['size'])})", undo)
    return Step("format", title, cmd, "todo", state["why"], undo)


def pool_state(path: str) -> dict:
    try:
        with Pool.open(path, writable=False, force=True) as p:
            return {"formatted": True, "sync": p.sb.sync, "size": p.sb.pool_size}
    except NotFormatted:
        return {"formatted": False, "why": "the device holds no cxlkv pool"}
    except (Err, OSError) as e:
        return {"formatted": False, "why": f"not a readable pool: {e}"}


def plan_teardown(h: dict, opts: Options) -> Plan:
    """Undo apply: system RAM back to devdax, destroy the namespace, destroy the region."""
    _need_tools(h)
    cxl = h["cxl"]
    regions = cxl["regions"]
    if opts.region:
        regions = [r for r in regions if r["region"] == opts.region]
        if not regions:
            raise UsageError(f"--region {opts.region}: no such region")
    elif opts.memdevs:
        regions = [r for r in regions if set(r["memdevs"]) & set(opts.memdevs)]
    steps: list[Step] = []
    if len(regions) > 1:
        raise UsageError("several regions: name one with --region "
                         f"({', '.join(r['region'] for r in regions)})")
    if not regions:
        steps.append(Step("region", "no region to tear down", "cxl destroy-region -f REGION",
                          "done", "there is no CXL region" + (
                              f" over {', '.join(opts.memdevs)}" if opts.memdevs else "")))
        return Plan("teardown", asdict(opts), steps, None, None, [])
    region = regions[0]
    daxes = [d for d in cxl["dax_devices"] if d["cxl_region"] == region["region"]]
    notes = ["the data stays on the media: re-creating the same region and namespace shows "
             "it again"]
    for d in daxes:
        refuse_if_in_use(d, what=f"tearing down {region['region']}")
        if d["mode"] == "system-ram":
            argv = ["daxctl", "reconfigure-device", "-m", "devdax", "-f", d["chardev"]]
            steps.append(Step("mode", f"take {d['chardev']} offline from system RAM",
                              " ".join(argv), "todo",
                              f"its memory is online on node {d['target_node']}",
                              f"daxctl reconfigure-device -m system-ram {d['chardev']}", argv))
    if region["type"] == "pmem" or region["nd_region"]:
        nss = [n for n in cxl["namespaces"] if n["region"] == region["nd_region"] and n["size"]]
        for n in nss:
            argv = ["ndctl", "destroy-namespace", "-f", n["dev"]]
            steps.append(Step("namespace", f"destroy {n['mode']} namespace {n['dev']}"
                              + (f" (/dev/{n['chardev']})" if n["chardev"] else ""),
                              " ".join(argv), "todo", f"{_hs(n['size'])} on {n['region']}",
                              f"ndctl create-namespace -r {n['region']} -m {n['mode']}", argv))
        if not nss:
            steps.append(Step("namespace", "no namespace", "ndctl destroy-namespace -f NAMESPACE",
                              "done", f"{region['nd_region']} holds no namespace"))
        argv = ["cxl", "destroy-region", "-f", region["region"]]
        steps.append(Step("region", f"destroy {region['region']}", " ".join(argv), "todo",
                          f"{_hs(region['size'])} over {', '.join(region['memdevs'])}",
                          f"cxl create-region -m -d {region['root_decoder']} -w "
                          f"{region['interleave_ways']} -t pmem {' '.join(region['memdevs'])}",
                          argv))
    else:
        notes.append(f"{region['region']} is a RAM region the platform firmware created: left "
                     "in place")
    return Plan("teardown", asdict(opts), steps, None, region["region"], notes)


# --------------------------------------------------------------------------
# applying

def state_summary(h: dict) -> dict:
    cxl = h["cxl"]
    return {"regions": [{"region": r["region"], "type": r["type"], "size": r["size"],
                         "decode_state": r["decode_state"], "dax_devices": r["dax_devices"]}
                        for r in cxl["regions"]],
            "namespaces": [{"dev": n["dev"], "mode": n["mode"], "size": n["size"]}
                           for n in cxl["namespaces"] if n["size"]],
            "dax_devices": [{"chardev": d["chardev"], "mode": d["mode"], "size": d["size"],
                             "device": d["device"]} for d in cxl["dax_devices"]]}


def _undo_list(completed: list[Step]) -> list[str]:
    return [s.undo for s in reversed(completed) if s.undo]


def execute(planner, opts: Options, *, runner: host_tools.Runner | None = None, discover=None,
            on_step=None) -> dict:
    """Run the plan step by step (re-planning after each), verifying each took effect.

    planner: plan_apply or plan_teardown.  on_step(event, step, i, n) reports
    progress ("start", "done").  Returns {"changed", "ran", "plan"}.
    """
    r = runner or host_tools.runner()
    discover = discover or (lambda: discovery.discover(r))
    first = planner(discover(), opts)
    total = len(first.todo)
    ran: list[Step] = []
    plan = first
    for _ in range(total + 2):
        if not plan.todo:
            break
        step = plan.todo[0]
        if step.argv is None and step.id not in ("permissions", "format"):
            raise ProvisionFailed(f"cannot run step {step.id!r}: {step.why}", step=step.to_json(),
                                  result=None, completed=[s.to_json() for s in ran],
                                  state=state_summary(discover()), undo=_undo_list(ran))
        if on_step:
            on_step("start", step, len(ran) + 1, total)
        t0 = time.monotonic()
        res = _run_step(step, r, opts, plan, ran, discover)
        after = discover()
        plan = planner(after, opts)
        if any(s.status == "todo" and s.id == step.id and s.command == step.command
               for s in plan.steps):
            why = ("it exited 0 but changed nothing (ndctl's exit codes lie; its message: "
                   f"{res.stderr_gist() or 'none'})" if res is not None and res.rc == 0 else
                   "it did not take effect")
            raise ProvisionFailed(f"step {len(ran) + 1} ({step.title}): {why}",
                                  step=step.to_json(), result=res,
                                  completed=[s.to_json() for s in ran],
                                  state=state_summary(after), undo=_undo_list(ran))
        step.status = "done"
        # the undo of what now exists names it (the plan could only say "REGION")
        now = next((s for s in plan.steps if s.id == step.id and s.status == "done"), None)
        if now is not None and now.undo:
            step.undo = now.undo
        ran.append(step)
        if on_step:
            on_step("done", step, len(ran), total, time.monotonic() - t0)
    if plan.todo:      # steps keep appearing: never loop for ever on a host that changes
        raise ProvisionFailed(f"{len(plan.todo)} step(s) still to do after {len(ran)} run: "
                              + "; ".join(s.title for s in plan.todo),
                              step=plan.todo[0].to_json(), result=None,
                              completed=[s.to_json() for s in ran],
                              state=state_summary(discover()), undo=_undo_list(ran))
    return {"changed": bool(ran), "ran": [s.to_json() for s in ran], "plan": plan.to_json()}


def _run_step(step: Step, r: host_tools.Runner, opts: Options, plan: Plan, ran: list[Step],
              discover) -> host_tools.ToolResult | None:
    def fail(msg, res=None, hint=None):
        return ProvisionFailed(msg, step=step.to_json(), result=res,
                               completed=[s.to_json() for s in ran],
                               state=state_summary(discover()), undo=_undo_list(ran), hint=hint)

    if step.argv is not None:
        if step.id == "mode" and "devdax" in step.argv:
            # never take memory from under its users
            h = discover()
            dev = next((d for d in h["cxl"]["dax_devices"] if d["chardev"] == step.argv[-1]),
                       None)
            if dev is not None:
                refuse_if_in_use(dev, what=step.title, pool_check=False)
        res = r.run(step.argv, check=False)
        if res.rc != 0:
            raise fail(f"step {len(ran) + 1} ({step.title}) failed: {res.command} exited "
                       f"{res.rc}: {res.stderr_gist() or 'no message'}", res)
        return res
    if plan.device is None:
        raise fail(f"step {step.id}: the DAX device is not known")
    path = str(sysfs.dev_path(os.path.basename(plan.device)))
    if step.id == "permissions":
        try:
            if opts.group:
                os.chown(path, -1, grp.getgrnam(opts.group).gr_gid)
            os.chmod(path, 0o660)
        except OSError as e:
            raise fail(f"step {len(ran) + 1} ({step.title}): {e.strerror or e}",
                       hint="run as root") from None
        return None
    if step.id == "format":
        try:
            init_pool(path, {"sync": opts.sync}, group=opts.group, create=False)
        except CxlkvError as e:
            raise fail(f"step {len(ran) + 1} ({step.title}): {e.message}", hint=e.hint) from None
        return None
    raise fail(f"unknown step {step.id}")  # pragma: no cover
