"""`cxlkv inspect`: what this host has for CXL memory, and what a pool is and holds.

The JSON document has one key per subject: "host" (CXL devices, regions, DAX,
NUMA, tiers, THP, ...: cxlkv.host.discovery) and "pool" (the pool given with
--pool, $CXLKV_POOL or the default emulated pool when it exists; null when
there is none), so both fit one command.
"""
from __future__ import annotations

import datetime
import os

import click
from rich.table import Table

from cxlkv.cli.app import NO_ATTACH, Application, exit_codes_epilog, json_option, pass_app
from cxlkv.errors import UsageError


@click.command("inspect", epilog=exit_codes_epilog(only=NO_ATTACH))
@click.option("--pool", "pool", metavar="PATH", envvar="CXLKV_POOL",
              help="Pool file or /dev/daxX.Y device [env: CXLKV_POOL; default: "
                   "/dev/shm/cxlkv-default.pool when it exists].")
@click.option("--force", is_flag=True, help="Inspect a world-readable or world-writable pool.")
@click.option("--watch", is_flag=True,
              help="Redraw on device events (cxl, dax, nd, memory) and when the pool "
                   "changes (nodes, usage, pins; looked at every second); Ctrl-C stops.")
@json_option
@pass_app
def inspect_cmd(app: Application, pool, force, watch, as_json):
    """Show this host's CXL memory and, when there is one, a pool.

    Host: CXL memdevs (capacity, firmware, health), ports, decoders, regions,
    DAX devices (mode, alignment, NUMA node, permissions), NUMA nodes and
    distances, memory tiers, THP, NUMA balancing and demotion, the memory
    auto-online policy, kernel and CXL modules.  A host without CXL is said
    so plainly (exit 0).

    Pool: superblock, features, sync mode, region layout, usage, KV cache and
    nodes.  Read-only: the pool is mapped read-only and nothing is written.
    """
    from cxlkv.ops.init import DEFAULT_POOL_PATH

    if pool == "":
        raise UsageError("empty path given to --pool")
    if watch and app.json:
        raise UsageError("--watch redraws tables for people; scripts run inspect --json "
                         "when they need a fresh document")
    if pool is None and os.path.lexists(DEFAULT_POOL_PATH):
        # the one rule (cxlkv(1)): --pool, else $CXLKV_POOL; only init and inspect,
        # the commands about the default pool, fall back to it - and say so
        pool = DEFAULT_POOL_PATH
        app.info(f"{app.command}: no --pool or CXLKV_POOL: showing the default pool {pool}")
    if watch:
        return watch_loop(app, pool, force)
    host, rep = gather(pool, force)
    for w in (rep or {}).get("warnings", []):
        app.warn(w)
    if app.json:
        app.emit_json({"host": host, "pool": rep})
        return
    render_host(app, host)
    if rep is not None:
        app.out.print()
        render(app, rep)


def gather(pool, force):
    from cxlkv._core import copymode
    from cxlkv.ops.report import full_report, host_report

    host = host_report()
    host["copy_modes"] = copymode.modes()   # this process's bulk-copy modes (calibrated per host)
    return host, (full_report(pool, force) if pool is not None else None)


#: how often --watch looks at the pool for changes (node table, usage, pins)
POOL_POLL_S = 1.0


def watch_loop(app: Application, pool, force, *, events=None, poll: float = POOL_POLL_S,
               draws: int | None = None) -> int:
    """Draw, then redraw on every batch of device events and whenever the
    pool changes (nodes come, go or die, chunks, KV entries, pins; looked at
    every `poll` s) until Ctrl-C (exit 0).  `events`: the device-event batches
    (default cxlkv.host.watch.events()); `draws`: stop after that many."""
    import queue
    import threading

    from cxlkv.host import watch
    from cxlkv.ops.report import pool_fingerprint

    def draw(batch):
        host, rep = gather(pool, force)
        if app.out.is_terminal:
            app.out.clear()
        elif batch is not None:
            app.out.print()
        if batch is not None:
            what = ", ".join(f"{e['action']} {e['subsystem']}/{e['device']}" for e in batch[:6])
            more = f" (+{len(batch) - 6} more)" if len(batch) > 6 else ""
            app.out.print(f"-- {datetime.datetime.now().strftime('%H:%M:%S')} {what}{more}")
        render_host(app, host)
        if rep is not None:
            app.out.print()
            render(app, rep)
        app.err.print(f"watching {', '.join(watch.SUBSYSTEMS)} events; Ctrl-C stops")

    box: queue.Queue = queue.Queue()
    drawn = threading.Event()                 # the next batch is asked for once this one is
    end = object()                            # drawn, as a plain loop over events() would

    def follow():
        try:
            for b in (watch.events() if events is None else events):
                drawn.clear()
                box.put(b)
                drawn.wait()
            box.put(end)
        except BaseException as e:            # noqa: BLE001 - raised in the drawing thread
            box.put(e)

    def fingerprint():
        from cxlkv.errors import CxlkvError

        try:
            return pool_fingerprint(pool, force) if pool is not None else None
        except CxlkvError as e:                 # being formatted, removed...: a change too
            return ("unreadable", e.message)

    done = 0
    try:
        last = fingerprint()
        draw(None)
        done += 1
        threading.Thread(target=follow, name="cxlkv-inspect-watch", daemon=True).start()
        while draws is None or done < draws:
            device = False
            try:
                batch = box.get(timeout=poll)
                device = True
            except queue.Empty:
                now = fingerprint()
                if now == last:
                    continue
                last = now
                batch = [{"action": "change", "subsystem": "pool", "device": pool}]
            else:
                if batch is end:
                    break                       # no more device events (a test's source)
                if isinstance(batch, BaseException):
                    raise batch
                last = fingerprint()
            draw(batch)
            done += 1
            if device:
                drawn.set()
    except KeyboardInterrupt:
        pass
    return 0


# -- host rendering ----------------------------------------------------------

def ranges(nums) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (the kernel's list syntax)."""
    nums = sorted(nums)
    out, i = [], 0
    while i < len(nums):
        j = i
        while j + 1 < len(nums) and nums[j + 1] == nums[j] + 1:
            j += 1
        out.append(str(nums[i]) if i == j else f"{nums[i]}-{nums[j]}")
        i = j + 1
    return ",".join(out) or "-"


def _size(n) -> str:
    from cxlkv.util.sizes import human_size

    if not isinstance(n, int) or n < 0:
        return "-"
    if n >= 1 << 30 and n % (1 << 20):
        return f"{n / (1 << 30):.1f} GiB"
    return human_size(n) if n else "0"


def _unknown(v, unit="") -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    return "unknown" if v is None else f"{v}{unit}"


def _table(title: str, cols) -> Table:
    t = Table(title=title, title_justify="left")
    for c in cols:
        t.add_column(c)
    return t


def render_host(app: Application, h: dict) -> None:
    k, cxl, pol, mem = h["kernel"], h["cxl"], h["numa_policy"], h["memory"]
    head = Table(show_header=False, box=None, pad_edge=False, title="host", title_justify="left")
    head.add_column(style="bold")
    head.add_column()
    mods = h["modules"]
    loaded = [m for m, st in mods.items() if st]
    missing = [m for m, st in mods.items() if not st]
    tools = cxl["tools"]
    rows = [
        ("kernel", k["release"] or "unknown"),
        ("CXL modules", (", ".join(loaded) or "none loaded")
         + (f"; not loaded: {', '.join(missing)}" if missing else "")),
        ("tools", ", ".join(f"{t} {'yes' if ok else 'MISSING'}" for t, ok in tools.items())),
        ("THP", f"enabled {h['thp']['enabled'] or 'unknown'}, "
                f"defrag {h['thp']['defrag'] or 'unknown'}"),
        ("NUMA balancing", _unknown(pol["numa_balancing_mode"])),
        ("demotion", _unknown(pol["demotion_enabled"])),
        ("auto-online", _unknown(mem["auto_online_blocks"])
         + (f" (memory blocks of {_size(mem['block_size'])})" if mem["block_size"] else "")),
    ]
    cm = h.get("copy_modes")
    if cm:
        rows.append(("copy modes", f"read {cm['read']}, write {cm['write']} ({cm['source']})"))
    for key, val in rows:
        head.add_row(key, str(val))
    app.out.print(head)
    for e in cxl["errors"]:
        app.warn(f"{e['message']}")

    if not cxl["memdevs"]:
        why = ("no CXL memory devices on this host" if not cxl["sysfs_memdevs"] else
               f"CXL memdevs in sysfs ({', '.join(cxl['sysfs_memdevs'])}) but the cxl tool "
               "listed none"
               + ("" if tools["cxl"] else " (cxl is not installed: apt-get install ndctl)"))
        app.out.print(f"CXL: {why}.")
    else:
        t = _table("CXL memory devices", ("memdev", "host", "serial", "ram", "pmem", "firmware",
                                          "temperature", "life used", "alarms"))
        for m in cxl["memdevs"]:
            hl = m["health"]
            t.add_row(m["memdev"], str(m["host"]), str(m["serial"]), _size(m["ram_size"]),
                      _size(m["pmem_size"]), m["firmware_version"] or "unknown",
                      _unknown(hl["temperature_c"], " C"), _unknown(hl["life_used_percent"], "%"),
                      ", ".join(hl["alarms"]) or ("none" if hl["reported"] else "unknown"))
        app.out.print(t)
        t = _table("topology", ("object", "kind", "parent", "detail"))
        for b in cxl["buses"]:
            t.add_row(b["bus"], "bus", "-",
                      f"{b['provider']}; dports {', '.join(b['dports']) or '-'}")
        for p in cxl["ports"]:
            t.add_row(p["port"], "port", str(p["parent"] or "-"),
                      f"host {p['host']}; dports {', '.join(p['dports']) or '-'}")
        for e in cxl["endpoints"]:
            t.add_row(e["endpoint"], "endpoint", str(e["parent"] or "-"), f"memdev {e['host']}")
        for d in cxl["decoders"]:
            bits = [f"{d['kind']} decoder"]
            if d.get("size"):
                bits.append(_size(d["size"]))
            if d.get("mode"):
                bits.append(d["mode"])
            if d.get("interleave_ways"):
                bits.append(f"x{d['interleave_ways']}")
            if d.get("region"):
                bits.append(f"-> {d['region']}")
            if d.get("state"):
                bits.append(d["state"])
            t.add_row(d["decoder"], "decoder", str(d.get("parent") or "-"), ", ".join(bits))
        app.out.print(t)
        if cxl["regions"]:
            t = _table("regions", ("region", "type", "size", "interleave", "state", "memdevs",
                                   "DAX"))
            for r in cxl["regions"]:
                t.add_row(r["region"], r["type"] or "unknown", _size(r["size"]),
                          f"{r['interleave_ways']} x {r['interleave_granularity']}",
                          f"{r['decode_state'] or '-'}, {r['state'] or '-'}",
                          ", ".join(r["memdevs"]) or "-", ", ".join(r["dax_devices"]) or "-")
            app.out.print(t)
        else:
            app.out.print("regions: none (cxlkv provision plan shows how to create one)")
    if cxl["dax_devices"]:
        t = _table("DAX devices", ("device", "size", "align", "mode", "target node", "region",
                                   "permissions"))
        for d in cxl["dax_devices"]:
            dev = d["device"]
            perm = (f"{dev['mode']} uid {dev['uid']} group {dev['group']}" if dev["exists"]
                    else f"{dev['path']} missing")
            mode = d["mode"] or "unknown"
            if d["mode"] == "system-ram" and d["online_memblocks"] is not None:
                mode += f" ({d['online_memblocks']}/{d['total_memblocks']} blocks online)"
            t.add_row(d["chardev"], _size(d["size"]), _size(d["align"]), mode,
                      _unknown(d["target_node"]), d["cxl_region"] or "-", perm)
        app.out.print(t)

    numa = h["numa"]
    t = _table("NUMA nodes", ("node", "CPUs", "memory", "free", "tier", "distances"))
    for n in numa["nodes"]:
        t.add_row(str(n["node"]), ranges(n["cpus"]), _size(n["memory_total"]),
                  _size(n["memory_free"]), _unknown(n["tier"]),
                  " ".join(f"{m}:{d}" for m, d in n["distances"].items()))
    app.out.print(t)
    if h["memory_tiers"]:
        app.out.print("memory tiers: " + "; ".join(
            f"tier {x['tier']}: node {ranges(x['nodes'])}" for x in h["memory_tiers"])
            + " (lower tier = faster memory)")
    else:
        app.out.print("memory tiers: none (kernel without memory tiering)")
    if h["cxl_memory_nodes"]:
        app.out.print("CXL memory online as system RAM on node(s) "
                      f"{ranges(h['cxl_memory_nodes'])}")
    if h.get("cxl_mode"):
        from cxlkv.ops.doctor import MODE_GUIDANCE

        app.out.print(f"CXL mode: {h['cxl_mode']} - {MODE_GUIDANCE[h['cxl_mode']]}")


# -- pool rendering ----------------------------------------------------------

def render(app: Application, rep: dict) -> None:
    from cxlkv.util.sizes import human_size

    sb, use, t = rep["superblock"], rep["usage"], rep["target"]
    created = datetime.datetime.fromtimestamp(sb["created_ns"] / 1e9, datetime.timezone.utc)
    head = Table(show_header=False, box=None, pad_edge=False, title=f"pool {rep['path']}",
                 title_justify="left")
    head.add_column(style="bold")
    head.add_column()
    rows = [
        ("uuid", sb["uuid"]),
        ("label", sb["label"] or "-"),
        ("kind", f"{t['kind']}" + (f" ({t['device']})" if t["device"] else "")),
        ("mode", f"{t['mode']} uid {t['uid']} group {t['group']}"),
        ("format", f"version {sb['format_version']}, superblock copy "
                   f"{rep['superblock_copy']} (seq {sb['seq']})"),
        ("features", "compat {compat:#x} incompat {incompat:#x} ro_compat {ro_compat:#x}"
         .format(**sb["features"])),
        ("created", created.isoformat(timespec="seconds")),
        ("created by", sb["creator"]),
        ("size", f"{human_size(sb['pool_size'])} ({sb['pool_size']} bytes)"),
        ("sync", sb["sync"]),
        ("memory", f"{rep['memory_model']}; flush {rep['cpu']['flush']}, "
                   f"invalidate {rep['cpu']['invalidate']}; write deadlines by "
                   f"{rep['cpu']['deadline_clock']}"),
        ("chunks", f"{sb['nchunks']} x {human_size(sb['chunk_size'])}"),
        ("nodes", f"{use['nodes_in_table']} of {sb['max_nodes']} slots in use, "
                  f"lease {sb['lease_ms'] / 1000:g}s, quarantine grace "
                  f"{sb['grace_ms'] / 1000:g}s"),
        ("hash", f"{sb['hash_slots']} slots, max load {sb['hash_max_load_pct']}%"),
        ("chunks in use", f"{use['chunks_used']} of {use['chunks_total']} "
                          f"({human_size(use['bytes_used'])} of "
                          f"{human_size(use['data_bytes'])})"),
    ]
    lm = rep.get("lock_manager")
    if lm is not None:
        rows.append(("lock manager", _manager_text(lm, rep["path"])))
    pinned = [x for x in rep.get("pins", []) if x["pinned_blocks"]]
    rows.append(("pinned", "no node pins a block" if not pinned else
                 f"{sum(x['pinned_blocks'] for x in pinned)} blocks "
                 f"({human_size(sum(x['pinned_bytes'] for x in pinned))}) by "
                 f"{len(pinned)} node(s); see the nodes table"))
    kv = rep.get("kv")
    if kv is None:
        rows.append(("kv", "none: formatted before the KV region (re-format to use it)"))
    else:
        rows.append(("kv", f"{kv['entries']} of {kv['max_entries']} entries "
                           f"({kv['load_pct']}% load), {human_size(kv['used_bytes'])} in "
                           f"{len(kv['namespaces'])} namespace(s), {kv['evictions']} evictions"))
        ret = kv.get("retired") or {}
        rows.append(("retired", f"{ret.get('chunks', 0)} chunk(s), "
                                f"{human_size(ret.get('bytes', 0))} (poison / media errors)"
                     + (f"; {ret['metadata_hits']} METADATA hit(s): re-format, see "
                        "cxlkv-runbook(7)" if ret.get("metadata_hits") else "")))
    q = rep.get("quarantine")
    if q is not None:
        rows.append(("quarantine", f"{len(q['nodes'])} fenced node(s) holding "
                                   f"{human_size(q['bytes'])}" if q["nodes"] else "none"))
    if sb["features"]["ro_compat"]:
        rows.append(("read-only", "yes: the pool has features this cxlkv can only read"))
    for copy, problem in rep["superblock_problems"].items():
        rows.append((f"copy {copy}", f"BAD: {problem}"))
    for k, v in rows:
        head.add_row(k, str(v))
    app.out.print(head)

    regions = Table(title="layout", title_justify="left")
    for col in ("region", "offset", "size"):
        regions.add_column(col, justify="left" if col == "region" else "right")
    for name, r in sb["regions"].items():
        regions.add_row(name, f"{r['offset']:#x}", human_size(r["size"]))
    app.out.print(regions)

    if rep["nodes"]:
        nodes = Table(title="nodes", title_justify="left")
        for col in ("slot", "state", "liveness", "host", "pid", "epoch", "heartbeat",
                    "pinned", "version", "format"):
            nodes.add_column(col, overflow="fold")
        for n in rep["nodes"]:
            pins = (f"{n['pinned_blocks']} ({human_size(n['pinned_bytes'])})"
                    if n.get("pinned_blocks") else "0")
            nodes.add_row(str(n["slot"]), n["state"], _liveness_text(n), n["hostname"],
                          str(n["pid"]), str(n["epoch"]), str(n["heartbeat"]), pins,
                          n["sw_version"], str(n["format_version"]))
        app.out.print(nodes)
        if q and q["nodes"]:
            qt = Table(title="quarantine (fenced nodes: nothing they held is reused until "
                             "they acknowledge, are proven gone, or the grace passes)",
                       title_justify="left")
            for col in ("slot", "host", "pid", "acknowledged", "reserved", "pending", "pinned"):
                qt.add_column(col)
            for x in q["nodes"]:
                qt.add_row(str(x["slot"]), x["hostname"], str(x["pid"]),
                           "yes" if x["acknowledged"] else "no",
                           f"{x['reserved_slots']} ({human_size(x['reserved_bytes'])})",
                           str(x["pending_entries"]),
                           f"{x['pinned_blocks']} ({human_size(x['pinned_bytes'])})")
            app.out.print(qt)
        if len(rep.get("versions", {})) > 1:
            app.out.print("mixed versions: " + ", ".join(
                f"{k} x{v}" for k, v in rep["versions"].items())
                + " (a rolling upgrade in progress? see cxlkv-runbook(7))")


def _liveness_text(n: dict) -> str:
    """"alive (process)", "dead (no heartbeat for 0.5 s)", ... - the verdict
    and how it was judged."""
    v, how, age = n.get("liveness", "unknown"), n.get("judged_by"), n.get("heartbeat_age_s")
    if how == "process":
        return f"{v} (its process {'runs' if v == 'alive' else 'is gone'}, this host)"
    if how == "state":
        return f"{v} (fenced)"
    if age is None:
        return f"{v} (heartbeat not watched)"
    if v == "alive":
        return f"alive (heartbeat beat within {age:g} s)"
    return f"{v} (no heartbeat for {age:g} s)"


def _manager_text(lm: dict, path: str) -> str:
    who = f"pid {lm['pid']} on {lm['hostname'] or '?'}, epoch {lm['epoch']}"
    if lm["state"] == "active":
        return f"active: {who} (heartbeat beat within {lm['heartbeat_age_s']:g} s); " \
               "standbys are not recorded in the pool"
    if lm["state"] == "dead":
        return f"DEAD: {who} (no heartbeat for {lm['heartbeat_age_s']:g} s); start " \
               f"cxlkv lock-manager --pool {path}"
    if lm["state"] == "unknown":
        return f"{who}: heartbeat not judged yet (watched {lm['heartbeat_age_s']:g} s)"
    return f"none active (nodes cannot attach or lock): start cxlkv lock-manager --pool {path}"
