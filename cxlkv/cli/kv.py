"""`cxlkv kv stats|ls|drop|secret|quarantine`: the KV cache in a pool, for operators."""
from __future__ import annotations

import click
from rich.table import Table

from cxlkv.cli.app import Application, exit_codes_epilog, json_option, pass_app, pool_option
from cxlkv.util.sizes import human_size


@click.group("kv", epilog=exit_codes_epilog())
def kv_group():
    """The KV cache in a pool: usage, namespaces, blocks; drop a namespace;
    the tenant secret.

    A namespace holds one model's blocks (model, dtype and layout, as the
    serving engine names it); `drop` removes a namespace's blocks, e.g. after
    a model update; `secret` shows, exports or imports the tenant secret that
    racks sharing blocks must hold in common.  stats and ls only read the pool.
    """


namespace_option = click.option("--namespace", "-n", "namespace", metavar="NAME",
                                 help="Only this namespace.")


def _open_ro(pool, force):
    from cxlkv.api import Pool

    return Pool.open(pool, writable=False, force=force)


force_option = click.option("--force", is_flag=True,
                            help="Open a world-readable or world-writable pool.")


def _pick(spaces, namespace):
    from cxlkv.errors import UsageError

    if namespace is None:
        return spaces
    got = [s for s in spaces if s["namespace"] == namespace]
    if not got:
        raise UsageError(f"no KV namespace {namespace!r} in this pool "
                         f"(there are: {', '.join(s['namespace'] for s in spaces) or 'none'})")
    return got


@kv_group.command("stats")
@pool_option(required=True)
@namespace_option
@force_option
@json_option
@pass_app
def stats_cmd(app: Application, pool, namespace, force, as_json):
    """Usage of the KV cache: table load, bytes, and per namespace hits,
    misses, stores, evictions (counters of attached nodes included)."""
    from cxlkv.kv.area import pins_by_node
    from cxlkv.kv.cache import kv_report

    with _open_ro(pool, force) as p:
        rep = kv_report(p)
        rep["namespaces"] = _pick(rep["namespaces"], namespace)
        ns = rep["namespaces"][0]["index"] if namespace is not None else None
        rep["pins"] = pins_by_node(p, ns)
    if app.json:
        app.emit_json({"pool": pool, "kv": rep})
        return 0
    app.out.print(f"{pool}: {rep['entries']} of {rep['max_entries']} entries "
                  f"({rep['load_pct']}% of {rep['hash_slots']} slots, "
                  f"{rep['tombstones']} tombstones), {human_size(rep['used_bytes'])} in blocks, "
                  f"{rep['evictions']} evictions")
    ret = rep["retired"]
    app.out.print(f"retired (poison): {ret['chunks']} chunk(s), {human_size(ret['bytes'])}"
                  + (f", {ret['metadata_hits']} METADATA hit(s): see cxlkv-runbook(7)"
                     if ret["metadata_hits"] else ""))
    t = Table(title="namespaces", title_justify="left")
    for col in ("namespace", "blocks", "bytes", "hits", "misses", "hit %", "stores",
                "evictions"):
        t.add_column(col, justify="left" if col == "namespace" else "right",
                     overflow="fold")
    for s in rep["namespaces"]:
        asked = s["hits"] + s["misses"]
        t.add_row(s["namespace"], str(s["blocks"]), human_size(s["bytes"]), str(s["hits"]),
                  str(s["misses"]), f"{100 * s['hits'] / asked:.1f}" if asked else "-",
                  str(s["stores"]), str(s["evictions"]))
    app.out.print(t)
    busy = [x for x in rep["pins"] if x["pinned_blocks"]]
    if not busy:
        app.out.print("pinned: no node pins a block" + (f" of {namespace!r}" if namespace else ""))
        return 0
    pt = Table(title="pinned by node (readers holding blocks: not evictable)",
               title_justify="left")
    for col in ("node", "state", "host", "pid", "blocks", "bytes"):
        pt.add_column(col, justify="left" if col in ("state", "host") else "right",
                      overflow="fold")
    for x in busy:
        pt.add_row(str(x["slot"]), x["state"], x["hostname"], str(x["pid"]),
                   str(x["pinned_blocks"]), human_size(x["pinned_bytes"]))
    app.out.print(pt)
    return 0


@kv_group.command("ls")
@pool_option(required=True)
@namespace_option
@click.option("--limit", type=click.IntRange(min=0), default=100, show_default=True,
              help="With --namespace: list at most this many blocks (0 = all).")
@force_option
@json_option
@pass_app
def ls_cmd(app: Application, pool, namespace, limit, force, as_json):
    """List namespaces; with --namespace, that namespace's blocks (entry,
    key, state, bytes, parent, children, last use)."""
    from cxlkv.kv.cache import kv_report
    from cxlkv.ops.report import kv_blocks

    with _open_ro(pool, force) as p:
        rep = kv_report(p)
        spaces = _pick(rep["namespaces"], namespace)
        blocks = kv_blocks(p, spaces[0]["index"], limit) if namespace is not None else []
    if app.json:
        doc = {"pool": pool, "namespaces": spaces}
        if namespace is not None:
            doc["blocks"] = blocks
        app.emit_json(doc)
        return 0
    t = Table(title="namespaces", title_justify="left")
    for col in ("namespace", "hash", "block tokens", "block bytes", "blocks", "bytes"):
        t.add_column(col, justify="left" if col in ("namespace", "hash") else "right")
    for s in spaces:
        t.add_row(s["namespace"], s["hash"], str(s["block_tokens"]), human_size(s["block_bytes"]),
                  str(s["blocks"]), human_size(s["bytes"]))
    app.out.print(t)
    if namespace is not None:
        b = Table(title=f"blocks of {namespace}", title_justify="left")
        for col in ("entry", "key", "state", "parent", "children"):
            b.add_column(col, justify="left" if col in ("key", "state") else "right")
        for x in blocks:
            b.add_row(str(x["entry"]), x["key"], x["state"],
                      "-" if x["parent"] is None else str(x["parent"]), str(x["children"]))
        app.out.print(b)
    return 0


@kv_group.command("drop")
@pool_option(required=True)
@click.option("--namespace", "-n", "namespace", metavar="NAME", required=True,
              help="The namespace to drop.")
@force_option
@json_option
@pass_app
def drop_cmd(app: Application, pool, namespace, force, as_json):
    """Remove a namespace's blocks (e.g. after a model update).

    Blocks pinned by a reader that is still attached are kept (they are in
    use); the command then says how many and exits 1 - run it again when the
    readers are done.  The namespace itself goes once it holds no block.
    """
    import cxlkv
    from cxlkv.kv.area import describe_holders, pins_by_node
    from cxlkv.kv.cache import drop_namespace, kv_report

    with cxlkv.open_pool(pool, force=force) as p:
        r = drop_namespace(p, namespace)
        holders = []
        if not r["dropped"]:
            ns = [s["index"] for s in kv_report(p)["namespaces"] if s["namespace"] == namespace]
            me = p.node.slot if p.node is not None else None
            holders = [x for x in pins_by_node(p, ns[0]) if x["pinned_blocks"]
                       and x["slot"] != me] if ns else []
    r["pinned_by"] = holders
    removed = f"{r['evicted']} blocks ({human_size(r['evicted_bytes'])}) removed"
    if r["dropped"]:
        if app.json:
            app.emit_json({"pool": pool, **r})
        else:
            app.out.print(f"{pool}: dropped namespace {namespace!r}: {removed}")
        return 0
    if app.json:
        app.emit_json({"pool": pool, **r})
    say = app.err.print if app.json else app.out.print
    left = []
    if r["pinned_left"]:
        left.append(f"{r['pinned_left']} blocks pinned by "
                    + (describe_holders(holders, top=8) or "readers that are gone now"))
    if r["pending_left"]:
        left.append(f"{r['pending_left']} blocks being stored")
    say(f"{pool}: namespace {namespace!r} not dropped: {'; '.join(left)} "
                  f"({removed}); run the command again when they are released")
    return 1


@kv_group.command("secret")
@pool_option(required=True)
@click.option("--export", "export", metavar="FILE",
              help="Write the pool's tenant secret to FILE (created mode 0600; an existing "
                   "file is refused).")
@click.option("--import", "import_", metavar="FILE",
              help="Make the secret in FILE (64 hex digits, as --export writes it) the pool's "
                   "tenant secret.")
@force_option
@json_option
@pass_app
def secret_cmd(app: Application, pool, export, import_, force, as_json):
    """Show, export or import the pool's tenant secret.

    Salted tenants' block keys are derived under the pool's tenant secret
    (HMAC of the tenant's salt), so pools of different racks that share
    blocks through the remote tier (cxlkv-remote(1)) must hold the same
    secret: export it from one pool and import it into the others. Without
    options it prints the secret's fingerprint only, to compare racks.
    --import is refused while another node is attached or the pool already
    has salted tenants (their blocks would become unreachable): import into
    a freshly formatted pool before the serving processes start.
    """
    import os

    import cxlkv
    from cxlkv.errors import RefusedError, UsageError
    from cxlkv.kv.cache import secret_fingerprint, set_tenant_secret

    if export and import_:
        raise UsageError("give --export or --import, not both")
    changed = None
    if import_:
        try:
            text = open(import_, encoding="ascii").read().strip()
            secret = bytes.fromhex(text)
        except OSError as e:
            raise UsageError(f"{import_}: cannot read the tenant secret file: "
                             f"{e.strerror or e}",
                             hint="cxlkv kv secret --export FILE writes one") from None
        except (UnicodeDecodeError, ValueError):
            raise UsageError(f"{import_}: not a tenant secret file (64 hex digits expected)",
                             hint="cxlkv kv secret --export FILE writes one") from None
        if len(secret) != 32:
            raise UsageError(f"{import_}: a tenant secret is 64 hex digits, not {len(text)}")
        with cxlkv.open_pool(pool, force=force) as p:
            changed = set_tenant_secret(p, secret, why="the tenant secret")
            fp = secret_fingerprint(p.sb.tenant_secret)
    else:
        with _open_ro(pool, force) as p:
            secret = bytes(p.sb.tenant_secret)
        fp = secret_fingerprint(secret)
        if export:
            try:
                fd = os.open(export, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                raise RefusedError(f"{export} exists: not overwriting it",
                                   hint="remove it or choose another file") from None
            with os.fdopen(fd, "w") as f:
                f.write(secret.hex() + "\n")
    if app.json:
        doc = {"pool": pool, "fingerprint": fp}
        if export:
            doc["exported"] = export
        if import_:
            doc["imported"] = import_
            doc["changed"] = changed
        app.emit_json(doc)
    else:
        if export:
            app.out.print(f"{pool}: tenant secret written to {export} (mode 0600)")
        if import_:
            app.out.print(f"{pool}: tenant secret {'replaced' if changed else 'unchanged (same)'}"
                          f" from {import_}")
        app.out.print(f"fingerprint {fp}")
    return 0


@kv_group.command("quarantine")
@pool_option(required=True)
@click.option("--offset", metavar="OFF", help="Pool offset of the bad range (0x.. or decimal).")
@click.option("--length", metavar="LEN", default="64", show_default=True,
              help="Bytes of the bad range (with --offset).")
@click.option("--trace", "trace_file", metavar="FILE",
              help="Poison records as tracefs printed them (cxl_poison events, e.g. a copy "
                   "of /sys/kernel/tracing/trace), translated DPA -> HPA -> pool offset "
                   "through this host's sysfs ('-' = stdin).")
@click.option("--monitor", "monitor_file", metavar="FILE",
              help="Poison records as `cxl monitor` printed them (JSON per line).")
@click.option("--reason", type=click.Choice(["poison", "media-error", "manual"]),
              default="poison", show_default=True)
@click.option("--dry-run", is_flag=True, help="Translate and show; change nothing.")
@force_option
@json_option
@pass_app
def quarantine_cmd(app: Application, pool, offset, length, trace_file, monitor_file, reason,
                   dry_run, force, as_json):
    """Take poisoned pool memory out of use: evict the KV blocks on it and
    retire its chunks for good (the on-media retired-chunk list, which the
    allocator never reuses; `cxlkv fsck` checks it, `inspect` and `kv stats`
    show the retired bytes).

    Give the range as --offset/--length, or poison records (--trace,
    --monitor) that are translated through this host's CXL region decoders
    and DAX device - run it on a host that maps the pool's device.  `cxlkv
    serve` does this by itself for every cxl_poison event.  A range in pool
    metadata exits 2 (CRITICAL): see cxlkv-runbook(7), "Poison and media
    errors".  Blocks on the range that readers still pin stay until they let
    go: exit 1, run it again.  Idempotent.
    """
    import sys

    import cxlkv
    from cxlkv.errors import UsageError
    from cxlkv.host import numa, poison
    from cxlkv.kv.cache import quarantine

    if sum(x is not None for x in (offset, trace_file, monitor_file)) != 1:
        raise UsageError("give one of --offset, --trace, --monitor")
    ranges, skipped = [], []
    if offset is not None:
        try:
            ranges.append((int(offset, 0), int(length, 0), None))
        except ValueError:
            raise UsageError(f"--offset {offset} / --length {length}: not numbers") from None
    else:
        src = trace_file or monitor_file
        try:
            text = sys.stdin.read() if src == "-" else open(src, encoding="utf-8",
                                                             errors="replace").read()
        except OSError as e:
            raise UsageError(f"{src}: {e.strerror or e}") from None
        recs = poison.parse_trace(text) if trace_file else poison.parse_monitor(text)
        recs = poison.current_poison(recs)
        with _open_ro(pool, force) as p:
            size = p.sb.pool_size
        tr = poison.Translator(pool_dax=numa.dax_of(pool), pool_size=size)
        for t in tr.ranges(recs):
            if t.pool_offset is None:
                skipped.append(t.to_json())
            else:
                ranges.append((t.pool_offset, t.length, t.to_json()))
    results = []
    if not dry_run and ranges:
        with cxlkv.open_pool(pool, force=force) as p:
            for off, ln, src in ranges:
                r = quarantine(p, off, ln, reason)
                r["translation"] = src
                results.append(r)
    critical = any(r["critical"] for r in results)
    if app.json:
        app.emit_json({"pool": pool, "dry_run": dry_run,
                       "ranges": [{"offset": o, "length": n, "translation": s}
                                  for o, n, s in ranges],
                       "outside_pool": skipped, "results": results})
    else:
        for t in skipped:
            app.out.print(f"not in the pool: {t['record']['memdev']} dpa "
                          f"{t['record']['dpa']:#x} ({t['note'] or t['dax']})")
        for o, n, _ in ranges if dry_run else []:
            app.out.print(f"would quarantine pool offset {o:#x} (+{n:#x})")
        for r in results:
            app.out.print(f"pool offset {r['offset']:#x} (+{r['length']:#x}): region "
                          f"{r['region']}, {r['evicted_blocks']} block(s) evicted, chunks "
                          f"{r['retired_chunks'] or '-'} retired"
                          + (f" (already: {r['already_retired']})" if r["already_retired"]
                             else "")
                          + ("  CRITICAL: metadata hit, see cxlkv-runbook(7)" if r["critical"]
                             else ""))
            if r["pinned"]:
                app.out.print(f"  not finished: {r['pinned']} block(s) on the range pinned by "
                              "readers stay until they let go; run this again (cxlkv serve "
                              "retries by itself)")
    if critical:
        return 2
    return 1 if any(r["pinned"] for r in results) else 0
