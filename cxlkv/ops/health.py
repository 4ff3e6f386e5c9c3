"""Pool health: what `cxlkv health` (cron, Nagios) and the agent's /healthz judge.

Everything here only reads the pool: it never attaches and never repairs.
Checks and their statuses (Nagios: 0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN):
  pool        cannot be opened: missing, corrupt, unformatted -> CRITICAL;
              unreadable, needs a newer cxlkv -> UNKNOWN
  superblock  one copy bad (the other is used) -> WARNING
  usage       unevictable bytes (everything allocated except published,
              unpinned KV blocks the evictor may take) as a share of the data
              area: >= warn -> WARNING, >= crit -> CRITICAL.  A warm cache
              sitting full is healthy: its blocks are evictable.
  kv          the KV header cannot be read (corrupt) -> CRITICAL
  nodes       dead nodes not yet reaped -> WARNING; a one-shot check (cxlkv
              health) whose deadline came before it could judge a node of
              another host (that takes a lease of watching) -> WARNING
  lock-manager  sync mode manager and no lock manager heartbeat -> CRITICAL
  poison      retired (poisoned) chunks in the pool's list >= warn / crit ->
              WARNING / CRITICAL; any poisoned range in pool metadata -> CRITICAL
  device      CXL device temperature >= warn / crit, health alarms -> WARNING /
              CRITICAL; life used, dirty shutdowns, volatile errors (cxl list
              -H) against their thresholds; unknown (a file-backed pool, a device reporting no
              health, tools that did not answer within the time left) adds
              nothing: it never hides the pool's own verdict
  (the agent adds `agent`: its own node fenced or its threads gone -> CRITICAL)

Liveness of remote nodes and of the lock manager is judged by watching
their heartbeats on this process's clock (see state.nodes); a one-shot check
watches until its deadline, the agent across its ticks.
"""
from __future__ import annotations

import copy
import math
import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from cxlkv import errors
from cxlkv.api import Pool
from cxlkv.host import discovery, numa, tools
from cxlkv.kv.area import Area, describe_holders, pins_by_node, quarantine_report
from cxlkv.ops.init import format_running
from cxlkv.pool import device as pooldevice
from cxlkv.pool import layout
from cxlkv.state import alloc, nodes, protocol

OK, WARNING, CRITICAL, UNKNOWN = 0, 1, 2, 3
STATUS_NAMES = {OK: "OK", WARNING: "WARNING", CRITICAL: "CRITICAL", UNKNOWN: "UNKNOWN"}

#: defaults: unevictable share of the data area, device temperature (C)
WARN_USED_PCT = 80.0
#: above 1 - LOW_WATERMARK unevictable, stores cannot get the low watermark back
CRIT_USED_PCT = 95.0
WARN_TEMP_C = 70.0            # above 70 C latency doubles (as cxlkv doctor)
CRIT_TEMP_C = 85.0
#: device wear and errors (cxl list -H: life_used_percent, dirty_shutdowns,
#: volatile_errors); retired poisoned chunks of the pool (on media)
WARN_LIFE_PCT = 80.0
CRIT_LIFE_PCT = 95.0
WARN_DIRTY_SHUTDOWNS = 1      # any unclean power loss of a persistent device
WARN_VOLATILE_ERRORS = 1
CRIT_VOLATILE_ERRORS = 100
WARN_RETIRED_CHUNKS = 1       # any retired chunk: the device is losing cells
CRIT_RETIRED_CHUNKS = 16


@dataclass
class Check:
    id: str
    status: int
    text: str

    def to_json(self) -> dict:
        return {"check": self.id, "status": STATUS_NAMES[self.status], "exit_code": self.status,
                "text": self.text}


@dataclass
class Health:
    """The verdict: worst status, the checks, performance data."""

    pool: str
    checks: list[Check] = field(default_factory=list)
    perf: list[tuple[str, object, str, str, str, str, str]] = field(default_factory=list)
    data: dict = field(default_factory=dict)

    def add(self, id: str, status: int, text: str) -> None:
        self.checks.append(Check(id, status, text))

    def metric(self, label: str, value, uom: str = "", warn="", crit="", lo="", hi="") -> None:
        self.perf.append((label, value, uom, *(f"{x:g}" if isinstance(x, float) else str(x)
                                               for x in (warn, crit, lo, hi))))

    @property
    def status(self) -> int:
        worst = [c.status for c in self.checks]
        if not worst:
            return UNKNOWN
        # CRITICAL outranks UNKNOWN outranks WARNING (Nagios plugin guidelines)
        for s in (CRITICAL, UNKNOWN, WARNING):
            if s in worst:
                return s
        return OK

    def line(self) -> str:
        """One Nagios status line: `CXLKV STATUS - text | perfdata`."""
        st = self.status
        bad = [c.text for c in self.checks if c.status == st and st != OK]
        text = "; ".join(bad) if bad else "; ".join(c.text for c in self.checks
                                                    if c.id in ("usage", "nodes"))
        out = f"CXLKV {STATUS_NAMES[st]} - {self.pool}: {text or 'ok'}"
        if self.perf:
            out += " | " + " ".join(_perf(p) for p in self.perf)
        return out

    def to_json(self) -> dict:
        return {"pool": self.pool, "status": STATUS_NAMES[self.status],
                "exit_code": self.status, "summary": self.line(),
                "checks": [c.to_json() for c in self.checks],
                "perfdata": {p[0]: {"value": p[1], "uom": p[2], "warn": p[3] or None,
                                    "crit": p[4] or None} for p in self.perf},
                **self.data}


def _perf(p) -> str:
    label, value, uom, warn, crit, lo, hi = p
    if isinstance(value, float):
        value = f"{value:.2f}"
    s = f"{label}={value}{uom};{warn};{crit};{lo};{hi}"
    return s.rstrip(";")


# -- usage ---------------------------------------------------------------------------

def usage(pool) -> dict:
    """Bytes of the data area by state (slot bytes, as the allocator counts them).

    free            in no allocated slot
    kv_evictable    published KV blocks that nothing pins (the evictor's victims)
    kv_unevictable  other KV blocks: pinned by a reader, being stored, or an
                    ancestor of one (eviction is leaf first)
    other           allocated slots the KV cache does not reference
    """

    data_size = pool.sb.regions["data"][1]
    d = alloc.descriptors(pool)
    try:
        kind = d["control"] & 0xFF
        heads = np.flatnonzero(kind == layout.CHUNK_HEAD)
        ok = (d["nslots"][heads] <= layout.SLAB_MAX_SLOTS) & (d["slot_size"][heads] % 64 == 0)
        heads = heads[ok]
        allocated = int((alloc.used_slots(d, heads).astype(np.int64)
                         * d["slot_size"][heads].astype(np.int64)).sum()) if len(heads) else 0
    finally:
        del d
    out = {"data_bytes": data_size, "allocated_bytes": allocated, "kv_bytes": 0,
           "kv_evictable_bytes": 0, "kv_entries": 0, "kv_evictable_entries": 0}
    if pool.sb.compat & layout.COMPAT_KV:
        try:
            a = Area(pool)
        except errors.CxlkvError as e:
            a = None
            out["kv_error"] = e.message
        if a is not None:
            t = a.entries()
            st = t["ctl"] & 0xFF
            live = np.flatnonzero((st == layout.KV_PENDING) | (st == layout.KV_PUBLISHED)
                                  | (st == layout.KV_EVICTING))
            victims = a.victims(t)                         # exactly what evict() may take
            out["kv_entries"] = int(len(live))
            out["kv_evictable_entries"] = int(len(victims))
            out["kv_bytes"] = int(a.slot_sizes(t["length"][live]).sum())
            out["kv_evictable_bytes"] = int(a.slot_sizes(t["length"][victims]).sum())
    kv = min(out["kv_bytes"], allocated)
    evictable = min(out["kv_evictable_bytes"], kv)
    out["bytes"] = {"free": max(0, data_size - allocated), "kv_evictable": evictable,
                    "kv_unevictable": kv - evictable, "other": max(0, allocated - kv)}
    out["unevictable_bytes"] = allocated - evictable
    out["unevictable_pct"] = round(100.0 * out["unevictable_bytes"] / data_size, 2) \
        if data_size else 0.0
    out["free_pct"] = round(100.0 * out["bytes"]["free"] / data_size, 2) if data_size else 0.0
    return out


# -- liveness of nodes and of the lock manager ---------------------------------------

class ManagerWatch:
    """Is a lock manager heartbeating?  Judged on this process's clock: its
    lease word changing within one lease means alive."""

    def __init__(self, pool, clock=time.monotonic):
        self.pool, self.clock = pool, clock
        self.seen: tuple[int, int] | None = None
        self.since = clock()

    def verdict(self) -> str:
        m, h = self.pool.mapping, protocol.lock_header(self.pool)
        m.invalidate(h + protocol.MGR_TOKEN, 64)
        cur = (m.load64(h + protocol.MGR_TOKEN), m.load64(h + protocol.MGR_HEARTBEAT))
        now = self.clock()
        if cur[0] == 0:
            return "dead"                     # the lease was handed back: nobody is active
        if cur != self.seen:
            first = self.seen is None
            self.seen, self.since = cur, now
            return "unknown" if first else "alive"
        return "dead" if now - self.since >= self.pool.sb.lease_ms / 1000.0 else "unknown"


def node_verdicts(pool, observer, deadline: float | None, clock=time.monotonic,
                  sleep=time.sleep) -> list[tuple[object, str]]:
    """(NodeInfo, verdict) for every non-free slot, watching undecided ones
    until they are decided or `deadline` (None: do not wait)."""

    res = dict((n.slot, (n, v)) for n, v in observer.scan())
    while deadline is not None and clock() < deadline and any(
            v == "unknown" for _, v in res.values()):
        sleep(min(0.02, max(0.0, deadline - clock())))
        for slot, (n, v) in list(res.items()):
            if v == "unknown":
                n2 = nodes.read_slot(pool, slot)
                res[slot] = (n2, observer.verdict(n2))
    return [res[s] for s in sorted(res)]


# -- device health -------------------------------------------------------------------

def device_health(path: str, timeout: float = 5.0) -> dict | None:
    """Temperature and alarms of the CXL memdevs behind a /dev/daxX.Y pool.

    None when the pool is not a DAX device (an emulated pool in a file).
    Otherwise {"device", "memdevs": [{memdev, temperature_c, alarms}],
    "temperature_c": the hottest, or None when no memdev reports one}.
    Uses cxlkv.host (the tool seam: `cxl list`, `ndctl list`, `daxctl list`);
    `timeout` bounds them all together (they run in a thread that is given
    up when it has not answered by then).  On any failure, or no answer in
    time, the figures are unknown ("error" says why).
    """


    dax = numa.dax_of(path)
    if dax is None:
        return None
    out = {"device": dax, "memdevs": [], "temperature_c": None, "alarms": [], "error": None}
    box: dict = {}

    def work():
        try:
            r = copy.copy(tools.runner())      # the seam tests replace, with our time limit
            r.timeout = max(0.1, timeout)
            box["inv"] = discovery.cxl_inventory(r)
        except (errors.CxlkvError, OSError, ValueError, KeyError) as e:
            box["e"] = str(e)
        except Exception as e:                 # noqa: BLE001 - figures unknown, not a crash
            box["e"] = f"{type(e).__name__}: {e}"

    t = threading.Thread(target=work, name="cxlkv-device-health", daemon=True)
    t.start()
    t.join(max(0.0, timeout))
    if t.is_alive():
        out["error"] = f"the device tools did not answer within {timeout:.1f} s"
        return out
    if "e" in box:
        out["error"] = box["e"]
        return out
    try:
        return _device_figures(out, box["inv"], dax)
    except (TypeError, KeyError, ValueError, AttributeError) as e:
        out.update(memdevs=[], alarms=[], temperature_c=None,
                   error=f"unexpected output of the device tools ({type(e).__name__}: {e})")
        return out


def _device_figures(out: dict, inv: dict, dax: str) -> dict:
    """device_health's answer from the tools' inventory."""
    dev = next((d for d in inv["dax_devices"] if d["chardev"] == dax), None)
    region = next((x for x in inv["regions"] if dev and x["region"] == dev.get("cxl_region")),
                  None)
    names = set(region["memdevs"]) if region else set()
    temps = []
    for m in inv["memdevs"]:
        if names and m["memdev"] not in names:
            continue
        h = m["health"]
        out["memdevs"].append({"memdev": m["memdev"], "temperature_c": h["temperature_c"],
                               "alarms": h["alarms"], "life_used_percent":
                                   h.get("life_used_percent"),
                               "dirty_shutdowns": h.get("dirty_shutdowns"),
                               "volatile_errors": h.get("volatile_errors")})
        out["alarms"] += [f"{m['memdev']}: {a}" for a in h["alarms"]]
        if isinstance(h["temperature_c"], (int, float)):
            temps.append(float(h["temperature_c"]))
    out["temperature_c"] = max(temps) if temps else None
    return out


# -- the verdict ---------------------------------------------------------------------

@dataclass
class Thresholds:
    warn_used: float = WARN_USED_PCT
    crit_used: float = CRIT_USED_PCT
    warn_temp: float = WARN_TEMP_C
    crit_temp: float = CRIT_TEMP_C
    warn_life: float = WARN_LIFE_PCT
    crit_life: float = CRIT_LIFE_PCT
    warn_dirty: int = WARN_DIRTY_SHUTDOWNS
    warn_volatile: int = WARN_VOLATILE_ERRORS
    crit_volatile: int = CRIT_VOLATILE_ERRORS
    warn_retired: int = WARN_RETIRED_CHUNKS
    crit_retired: int = CRIT_RETIRED_CHUNKS


def open_failure(path: str, exc: errors.CxlkvError) -> Health:
    """The verdict when the pool cannot be opened at all."""
    h = Health(path)
    if isinstance(exc, (errors.PoolIncompatible,)):
        h.add("pool", UNKNOWN, f"cannot check: {exc.message}")
    elif isinstance(exc, errors.PoolNotFound) and os.path.lexists(path):
        h.add("pool", UNKNOWN, f"cannot check: {exc.message}")   # permissions, not absence
    elif isinstance(exc, errors.PoolInvalid) and format_running(path):
        h.add("pool", UNKNOWN, f"cannot check: a cxlkv format or init of {path} is running on "
                               f"this host ({exc.message} meanwhile); check again when it ends")
    elif isinstance(exc, (errors.PoolNotFound, errors.PoolInvalid)):
        h.add("pool", CRITICAL, exc.message)
    else:
        h.add("pool", UNKNOWN, f"cannot check: {exc.message}")
    return h


def judge_timeout(lease_s: float) -> float:
    """The --timeout a one-shot check needs to judge a node of another host
    (watched for a lease within 80 % of the timeout)."""

    return float(math.ceil(1.25 * lease_s + 1.0))


def evaluate(pool, th: Thresholds, *, observer, manager: ManagerWatch | None,
             deadline: float | None, device: dict | None = None,
             clock=time.monotonic, figures: dict | None = None) -> Health:
    """Judge an open pool (read-only use of it).  `deadline` bounds how long
    undecided heartbeats are watched (None: judge from what was seen; the
    agent, which watches across its ticks).  `figures`: usage(pool), when the
    caller already has it."""
    h = Health(pool.path)
    sb = pool.sb
    for which, problem in sorted(pool.superblock_problems.items()):
        h.add("superblock", WARNING, f"superblock copy {which} is bad ({problem}); "
                                     f"run cxlkv fsck --repair")
    if not pool.superblock_problems:
        h.add("superblock", OK, f"both superblock copies good (seq {sb.seq})")

    u = usage(pool) if figures is None else figures
    h.data["usage"] = u
    add_poison(h, pool, th)
    if u.get("kv_error"):
        h.add("kv", CRITICAL, f"KV header corrupt: run cxlkv fsck ({u['kv_error']})")
    pct = u["unevictable_pct"]
    st = CRITICAL if pct >= th.crit_used else WARNING if pct >= th.warn_used else OK
    holders = ""
    if st != OK:
        # who pins what: the engine to restart is named, not guessed
        pins = pins_by_node(pool)
        h.data["pins"] = pins
        holders = describe_holders(pins)
    h.add("usage", st, f"{pct:.1f}% unevictable ({u['unevictable_bytes']} of "
                       f"{u['data_bytes']} bytes; {u['bytes']['kv_evictable']} evictable)"
                       + (f"; top pin holders: {holders}" if holders else ""))

    verdicts = node_verdicts(pool, observer, deadline, clock=clock)
    counts = {"alive": 0, "dead": 0, "unknown": 0}
    dead = []
    for n, v in verdicts:
        if v == "dead" and n.state != "free":
            dead.append(n)
        counts[v if v in counts else "unknown"] += 1
    versions = sorted({n.sw_version for n, v in verdicts if n.state == "attached"})
    h.data["nodes"] = {**counts, "max": sb.max_nodes, "versions": versions,
                       "dead_nodes": [n.to_json() for n in dead]}
    if dead:
        h.add("nodes", WARNING, f"{len(dead)} dead node(s) not reaped yet: "
                                + ", ".join(n.describe() for n in dead))
    elif counts["unknown"] and deadline is not None:
        lease = sb.lease_ms / 1000.0
        h.add("nodes", WARNING, f"{counts['unknown']} node(s) not yet judged: run with "
                                f"--timeout >= {judge_timeout(lease):g} (1.25 x the lease of "
                                f"{lease:g} s, plus 1)")
    else:
        extra = f", {counts['unknown']} not yet judged" if counts["unknown"] else ""
        mixed = f", mixed versions {', '.join(versions)}" if len(versions) > 1 else ""
        h.add("nodes", OK, f"{counts['alive']} node(s) alive{extra}{mixed}")

    add_quarantine(h, pool, observer)

    if sb.sync == "manager" and manager is not None:
        v = manager.verdict()
        while v == "unknown" and deadline is not None and clock() < deadline:
            time.sleep(min(0.02, max(0.0, deadline - clock())))
            v = manager.verdict()
        h.data["lock_manager"] = v
        if v == "dead":
            h.add("lock-manager", CRITICAL,
                  "no lock manager heartbeat for a lease (sync mode manager): nodes cannot "
                  f"attach or lock; start cxlkv lock-manager --pool {pool.path}")
        elif v == "alive":
            h.add("lock-manager", OK, "lock manager heartbeating")
        else:
            h.add("lock-manager", UNKNOWN if deadline is not None else OK,
                  "lock manager heartbeat not judged yet" + (
                      f": run with --timeout >= {judge_timeout(sb.lease_ms / 1000.0):g}"
                      if deadline is not None else ""))

    # one word, one meaning: "unevictable" is what the thresholds judge; inspect's
    # "chunks in use" counts allocated chunks, which no perfdata label reports
    h.metric("unevictable_pct", pct, "%", th.warn_used, th.crit_used, 0, 100)
    h.metric("unevictable_bytes", u["unevictable_bytes"], "B", "", "", 0, u["data_bytes"])
    h.metric("evictable_bytes", u["bytes"]["kv_evictable"], "B", "", "", 0, u["data_bytes"])
    h.metric("nodes", counts["alive"], "", "", "", 0, sb.max_nodes)
    h.metric("dead", len(dead), "", 0, "", 0, sb.max_nodes)
    add_device(h, device, th)
    return h


def add_quarantine(h: Health, pool, observer) -> None:
    """Fenced nodes whose quarantine has not ended: WARNING - a node stalled
    past its lease (or died on another host); its memory comes back when it
    acknowledges, is proven gone, or after the grace."""

    q = quarantine_report(pool, observer)
    h.data["quarantine"] = q
    h.metric("quarantined", len(q["nodes"]), "", "", "", 0, pool.sb.max_nodes)
    h.metric("quarantined_bytes", q["bytes"], "B", "", "", 0, pool.sb.regions["data"][1])
    if not q["nodes"]:
        return
    held = ", ".join(f"node {x['slot']} ({x['hostname']} pid {x['pid']}"
                     + (", acknowledged" if x["acknowledged"] else "")
                     + (f", fenced while recovering node {x['recovering']}, which waits for it"
                        if x.get("recovering") is not None else "")
                     + f": {x['reserved_bytes'] + x['pinned_bytes']} bytes)"
                     for x in q["nodes"])
    h.add("quarantine", WARNING,
          f"{len(q['nodes'])} fenced node(s) quarantined: {held}; released when each "
          f"acknowledges, is proven gone, or after the grace of {q['grace_ms'] / 1000:g} s")


def add_device(h: Health, device: dict | None, th: Thresholds) -> None:
    """The device check (temperature, alarms) from device_health()'s answer."""
    h.data["device"] = device
    if device is not None:
        t = device.get("temperature_c")
        if t is not None:
            st = CRITICAL if t >= th.crit_temp else WARNING if t >= th.warn_temp else OK
            h.add("device", st, f"{device['device']} temperature {t:g} C")
        elif device.get("error"):
            h.add("device", OK, f"{device['device']} device unknown ({device['error']})")
        else:
            h.add("device", OK, f"{device['device']} reports no temperature")
        if device.get("alarms"):
            h.add("device", WARNING, "device alarms: " + ", ".join(device["alarms"]))
        if t is not None:
            h.metric("temp", t, "", th.warn_temp, th.crit_temp)
        add_wear(h, device, th)


def _worst(device: dict, key: str):
    vals = [m.get(key) for m in device.get("memdevs") or []]
    vals = [v for v in vals if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return max(vals) if vals else None


def add_wear(h: Health, device: dict, th: Thresholds) -> None:
    """Life used, dirty shutdowns and volatile errors (cxl list -H) of the
    pool's memdevs, the worst of them; a figure the device does not report
    (QEMU's reports none) adds nothing."""
    life = _worst(device, "life_used_percent")
    if life is not None:
        st = CRITICAL if life >= th.crit_life else WARNING if life >= th.warn_life else OK
        h.add("device", st, f"{device['device']} life used {life:g}%")
        h.metric("life_used", life, "%", th.warn_life, th.crit_life)
    dirty = _worst(device, "dirty_shutdowns")
    if dirty is not None:
        h.add("device", WARNING if dirty >= th.warn_dirty else OK,
              f"{device['device']} dirty shutdowns {dirty}")
        h.metric("dirty_shutdowns", dirty, "", th.warn_dirty)
    vol = _worst(device, "volatile_errors")
    if vol is not None:
        st = CRITICAL if vol >= th.crit_volatile else WARNING if vol >= th.warn_volatile else OK
        h.add("device", st, f"{device['device']} volatile errors {vol}")
        h.metric("volatile_errors", vol, "", th.warn_volatile, th.crit_volatile)


def add_poison(h: Health, pool, th: Thresholds) -> None:
    """Retired (poisoned) chunks in the pool's on-media list: any -> WARNING,
    crit_retired or more, or any hit in a metadata region -> CRITICAL."""
    try:
        r = alloc.retired_summary(pool)
    except errors.MetadataCorrupt as e:
        h.add("poison", CRITICAL, f"retired-chunk list unreadable: {e.message}")
        return
    h.data["poison"] = {k: v for k, v in r.items() if k != "entries"}
    if r["metadata_hits"]:
        h.add("poison", CRITICAL, f"{r['metadata_hits']} poisoned range(s) in pool metadata: "
                                  "snapshot what is readable and re-format "
                                  "(cxlkv-runbook(7), 'Poison and media errors')")
    n = r["chunks"]
    st = CRITICAL if n >= th.crit_retired else WARNING if n >= th.warn_retired else OK
    h.add("poison", st, f"{n} chunk(s) retired for poison ({r['bytes']} bytes)")
    h.metric("retired_chunks", n, "", th.warn_retired, th.crit_retired)


# -- one check of a pool, bounded in time (`cxlkv health`) -----------------------------
#: --timeout when none is given (longer when the pool's lease needs it)
DEFAULT_TIMEOUT = 10.0


def check_pool(path: str, th, start: float, limits: dict, derive: bool = False):
    """The checks themselves (run in a worker thread by run_checks): the pool
    first - heartbeats watched until 80 % of the time limit - while the
    device tools run alongside; the device gets what is left until 95 % of
    the limit, in all, and is reported unknown when it has not answered by
    then (the pool's verdict stands).  With `derive` the time limit grows to
    what judging a node of another host takes (judge_timeout of the lease)."""
    try:
        p = Pool.open(path, writable=False, force=True)
    except errors.CxlkvError as e:
        return open_failure(path, e)
    with p:
        if derive:
            limits["timeout"] = max(limits["timeout"], judge_timeout(p.sb.lease_ms / 1000.0))
        limit = limits["timeout"]
        dev_end = start + 0.95 * limit
        box: dict = {}

        def device():
            try:
                box["d"] = device_health(path, timeout=max(0.1, dev_end - time.monotonic()))
            except Exception as e:             # noqa: BLE001 - the device is unknown then
                box["e"] = f"{type(e).__name__}: {e}"

        dev_t = threading.Thread(target=device, name="cxlkv-health-device", daemon=True)
        dev_t.start()
        mgr = ManagerWatch(p) if p.sb.sync == "manager" else None
        h = evaluate(p, th, observer=nodes.Observer(p), manager=mgr, device=None,
                       deadline=start + 0.8 * limit)
        dev_t.join(max(0.0, dev_end - time.monotonic()))
        if "d" in box:
            add_device(h, box["d"], th)
        else:
            why = box.get("e") or "the device tools did not answer within the time left"
            try:
                dax = numa.dax_of(path)
            except Exception:                 # noqa: BLE001 - no device figures then
                dax = None
            if dax is not None:
                add_device(h, {"device": dax, "memdevs": [], "temperature_c": None,
                                 "alarms": [], "error": why}, th)
        forced = pooldevice.check_permissions(p.target, force=True)
        if forced is not None:
            # health reads any pool (it has no --force): say what to fix instead
            what = forced.rsplit("; continuing", 1)[0]
            h.add("permissions", WARNING, f"{what}: chmod 0660 {path} and chgrp it to the "
                                          "serving group")
        for w in p.warnings:
            if "superblock copy" not in w and w != forced:
                h.add("permissions", WARNING, w)
        return h


def run_checks(path: str, th, timeout: float | None):
    """check_pool in a daemon thread; UNKNOWN when it has not answered in time
    (whatever it is blocked on: a hung device, a tool that does not return)
    or failed.  timeout None: DEFAULT_TIMEOUT, or longer when the pool's
    lease needs it (see check_pool)."""
    start = time.monotonic()
    limits = {"timeout": DEFAULT_TIMEOUT if timeout is None else timeout}
    box: dict = {}

    def work():
        try:
            box["h"] = check_pool(path, th, start, limits, derive=timeout is None)
        except BaseException as e:        # noqa: BLE001 - reported by the caller
            box["e"] = e

    t = threading.Thread(target=work, name="cxlkv-health", daemon=True)
    t.start()
    while t.is_alive():
        left = start + limits["timeout"] - time.monotonic()
        if left <= 0:
            break
        t.join(min(left, 0.05))
    if "e" in box:
        return internal_failure(path, box["e"])
    if "h" not in box:
        h = Health(path)
        h.add("timeout", UNKNOWN, f"no answer within --timeout {limits['timeout']:g} s")
        return h
    return box["h"]


def internal_failure(path: str, e: BaseException):
    """A check that failed in an unforeseen way: UNKNOWN (3), never another code."""
    h = Health(path)
    what = (e.message if isinstance(e, errors.CxlkvError)
            else f"internal error: {type(e).__name__}: {e}")
    h.add("internal", UNKNOWN, f"cannot check: {what}")
    return h
