"""`cxlkv inspect`: what a pool is and holds.

The JSON document has one key per subject - "pool" now; host discovery
(CXL devices, regions, DAX, NUMA) joins as "host" - so both fit one command.
"""
from __future__ import annotations

import datetime
import os

import click
from rich.table import Table

from cxlkv.cli.app import Application, exit_codes_epilog, json_option, pass_app
from cxlkv.errors import UsageError


@click.command("inspect", epilog=exit_codes_epilog())
@click.option("--pool", "pool", metavar="PATH", envvar="CXLKV_POOL",
              help="Pool file or /dev/daxX.Y device [env: CXLKV_POOL; default: "
                   "/dev/shm/cxlkv-default.pool when it exists].")
@click.option("--force", is_flag=True, help="Inspect a world-readable or world-writable pool.")
@json_option
@pass_app
def inspect_cmd(app: Application, pool, force, as_json):
    """Show a pool: superblock, features, sync mode, region layout, usage, KV cache and nodes.

    Read-only: the pool is mapped read-only and nothing is written.
    """
    from cxlkv.pool.pool import Pool
    from cxlkv.pool.report import pool_report

    from cxlkv.pool.admin import DEFAULT_POOL_PATH

    if pool == "":
        raise UsageError("empty path given to --pool")
    if pool is None:
        if not os.path.lexists(DEFAULT_POOL_PATH):
            raise UsageError("no pool given and no default pool: pass --pool PATH or set "
                             f"CXLKV_POOL (cxlkv init makes {DEFAULT_POOL_PATH})")
        pool = DEFAULT_POOL_PATH
    from cxlkv.kv.cache import kv_report
    from cxlkv.pool import layout as L

    with Pool.open(pool, writable=False, force=force) as p:
        rep = pool_report(p)
        # the KV cache's usage (None: a pool formatted before the KV region)
        rep["kv"] = kv_report(p) if p.sb.compat & L.COMPAT_KV else None
    for w in rep["warnings"]:
        app.warn(w)
    if app.json:
        app.emit_json({"pool": rep})
        return
    render(app, rep)


def render(app: Application, rep: dict) -> None:
    from cxlkv.pool.format import human_size

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
                   f"invalidate {rep['cpu']['invalidate']}"),
        ("chunks", f"{sb['nchunks']} x {human_size(sb['chunk_size'])}"),
        ("nodes", f"{use['nodes_in_table']} of {sb['max_nodes']} slots in use, "
                  f"lease {sb['lease_ms'] / 1000:g}s"),
        ("hash", f"{sb['hash_slots']} slots, max load {sb['hash_max_load_pct']}%"),
        ("used", f"{use['chunks_used']} of {use['chunks_total']} chunks "
                 f"({human_size(use['bytes_used'])} of {human_size(use['data_bytes'])})"),
    ]
    kv = rep.get("kv")
    if kv is None:
        rows.append(("kv", "none: formatted before the KV region (re-format to use it)"))
    else:
        rows.append(("kv", f"{kv['entries']} of {kv['max_entries']} entries "
                           f"({kv['load_pct']}% load), {human_size(kv['used_bytes'])} in "
                           f"{len(kv['namespaces'])} namespace(s), {kv['evictions']} evictions"))
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
        for col in ("slot", "state", "host", "pid", "epoch", "heartbeat", "version"):
            nodes.add_column(col)
        for n in rep["nodes"]:
            nodes.add_row(str(n["slot"]), n["state"], n["hostname"], str(n["pid"]),
                          str(n["epoch"]), str(n["heartbeat"]), n["sw_version"])
        app.out.print(nodes)
