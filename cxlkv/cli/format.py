"""`cxlkv format`, and the format options and rendering shared with `cxlkv init`."""
from __future__ import annotations

import re

import click

from cxlkv.cli.app import (
    NO_ATTACH,
    Application,
    exit_codes_epilog,
    json_option,
    pass_app,
    pool_option,
)
from cxlkv.errors import UsageError


def parse_duration_ms(text: str) -> int:
    """'10s', '500ms', '2m', '10' (seconds) -> milliseconds."""
    m = re.fullmatch(r"\s*(\d+)\s*(ms|s|m|min)?\s*", str(text))
    if not m:
        raise UsageError(f"invalid duration {text!r}: use e.g. 10s, 500ms, 2m")
    n, unit = int(m.group(1)), m.group(2) or "s"
    return n * {"ms": 1, "s": 1000, "m": 60_000, "min": 60_000}[unit]


def format_options(f):
    """Options that describe a pool's format; all default to None = not given."""
    opts = [
        click.option("--size", metavar="BYTES",
                     help="Pool size, e.g. 1G, 512M (default: 1G for a new file, the whole "
                          "file or device otherwise)."),
        click.option("--sync", type=click.Choice(["cas", "manager"]),
                     help="Synchronisation mode: cas (coherent memory: one host, or CXL 3.x "
                          "coherent sharing) or manager (non-coherent multi-host CXL; needs "
                          "cxlkv lock-manager). Default: cas."),
        click.option("--chunk-size", metavar="BYTES",
                     help="Allocator chunk granularity, a power of two (default 2M)."),
        click.option("--max-nodes", type=int, metavar="N",
                     help="Node table slots: processes that can attach at once (default 128)."),
        click.option("--lease", metavar="DURATION",
                     help="Node lease: a node whose heartbeat stops for this long is dead "
                          "(default 10s)."),
        click.option("--grace", metavar="DURATION",
                     help="Quarantine grace: what a node fenced by heartbeat held is reused "
                          "only once it is proven gone, has acknowledged its fencing, or this "
                          "long has passed (default: 6 leases)."),
        click.option("--hash-slots", type=int, metavar="N",
                     help="KV hash table entries, a power of two (default: one per 16 KiB "
                          "of pool)."),
        click.option("--hash-max-load", type=int, metavar="PCT",
                     help="Highest KV hash table load before eviction (default 90)."),
        click.option("--name-tokens", type=int, metavar="N",
                     help="Token ids kept with each KV block's name, for KV events' token_ids "
                          "(blocks of more tokens are announced without them; 0: none; each "
                          "hash slot costs 64 bytes + 4 per token). Default 16 (vLLM's block "
                          "size); e.g. 64 for vLLM --block-size 64."),
        click.option("--label", metavar="NAME", help="A name for the pool (63 bytes at most)."),
        click.option("--group", metavar="GROUP",
                     help="Group that owns the pool file or device (mode 0660)."),
        click.option("--force", is_flag=True,
                     help="Overwrite an existing pool or other data, and accept a world-readable "
                          "or world-writable path. Never overrides live nodes or a running "
                          "lock manager."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def given_params(size, sync, chunk_size, max_nodes, lease, grace, hash_slots, hash_max_load,
                 label, name_tokens=None) -> dict:
    from cxlkv.util.sizes import parse_size

    given = {}
    if size is not None:
        given["size"] = parse_size(size, "size")
    if sync is not None:
        given["sync"] = sync
    if chunk_size is not None:
        given["chunk_size"] = parse_size(chunk_size, "chunk size")
    if max_nodes is not None:
        given["max_nodes"] = max_nodes
    if lease is not None:
        given["lease_ms"] = parse_duration_ms(lease)
    if grace is not None:
        given["grace_ms"] = parse_duration_ms(grace)
    if hash_slots is not None:
        given["hash_slots"] = hash_slots
    if hash_max_load is not None:
        given["hash_max_load_pct"] = hash_max_load
    if label is not None:
        given["label"] = label
    if name_tokens is not None:
        given["name_tokens"] = name_tokens
    return given


def run_format(app: Application, fn, path: str, given: dict, *, force: bool, group, **kw):
    """Call init_pool / format_pool with a progress bar; return the result."""
    from cxlkv.util.sizes import human_size

    state = {}

    def progress(done, total):
        if "cb" not in state:
            if total < (256 << 20):
                state["cb"] = lambda d, t: None
            else:
                cm = app.progress(f"zeroing {human_size(total)}", total)
                state["cm"] = cm
                state["cb"] = cm.__enter__()
        state["cb"](done, total)

    def notice(count, seconds):
        app.info(f"{app.command}: waiting up to {seconds:g}s for the heartbeats of {count} "
                 "node(s) on other hosts, to see whether they are alive")

    try:
        return fn(path, given, force=force, group=group, progress=progress, notice=notice,
                  **kw)
    finally:
        if "cm" in state:
            state["cm"].__exit__(None, None, None)


def render_result(app: Application, res, next_steps: bool) -> None:
    from cxlkv.util.sizes import human_size

    for w in res.warnings:
        app.warn(w)
    if app.json:
        app.emit_json(res.to_json())
        return
    sb = res.sb
    kind = "emulated pool file" if res.target.kind == "file" else f"device {res.target.device}"
    verb = {"created": "created", "formatted": "formatted", "reformatted": "reformatted",
            "unchanged": "already formatted with these parameters, nothing changed:"}[res.action]
    app.out.print(f"{verb} {kind} {res.path}")
    app.out.print(f"  size {human_size(sb.pool_size)}, sync {sb.sync}, "
                  f"{sb.nchunks} chunks of {human_size(sb.chunk_size)}, "
                  f"{sb.max_nodes} node slots, lease {sb.lease_ms / 1000:g}s "
                  f"(grace {sb.quarantine_grace_ms / 1000:g}s), "
                  f"{sb.hash_slots} hash slots")
    app.out.print(f"  uuid {sb.uuid}")
    if next_steps:
        app.out.print("next:")
        if sb.sync == "manager":
            app.out.print(f"  cxlkv lock-manager --pool {res.path} &   # sync mode manager: "
                          "nodes attach and lock only while a lock manager runs (on every "
                          "host: cxlkv-lock-manager@ units, see cxlkv-runbook(7))")
        app.out.print(f"  export CXLKV_POOL={res.path}")
        app.out.print("  cxlkv inspect")


@click.command("format", epilog=exit_codes_epilog(only=NO_ATTACH))
@pool_option(required=True)
@format_options
@json_option
@pass_app
def format_cmd(app: Application, pool, size, sync, chunk_size, max_nodes, lease, grace,
               hash_slots, hash_max_load, name_tokens, label, group, force, as_json):
    """Format a pool file or device-dax device.

    The lower-level verb behind `cxlkv init`: it formats what --pool names,
    creating a file when --size is given and the path is missing.  Without
    --force it formats only a missing path or a blank (all-zero) target:
    an existing pool or other data is refused.  Live nodes are refused even
    with --force, and so is a lock manager heartbeating for the pool (stop
    cxlkv-lock-manager@ on every host first).  Formatting zeroes the whole
    pool, so no previous contents survive.
    """
    from cxlkv.ops.init import format_pool

    given = given_params(size, sync, chunk_size, max_nodes, lease, grace, hash_slots,
                         hash_max_load, label, name_tokens)
    res = run_format(app, format_pool, pool, given, force=force, group=group)
    render_result(app, res, next_steps=False)
