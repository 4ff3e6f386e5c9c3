"""`cxlkv snapshot` and `cxlkv restore`: the KV cache of a pool to a directory
and back (warm restart)."""
from __future__ import annotations

import click

from cxlkv import errors
from cxlkv.cli.app import Application, exit_codes_epilog, json_option, pass_app, pool_option
from cxlkv.util.sizes import human_size

force_option = click.option("--force", is_flag=True,
                            help="Open a world-readable or world-writable pool.")

SNAPSHOT_EXIT = exit_codes_epilog(((0, "success (blocks that changed while copied are "
                                       "skipped and counted)"),) + errors.EXIT_CODES[1:])
RESTORE_EXIT = exit_codes_epilog((
    (0, "success (blocks left out for want of room are counted, not an error)"),
    (1, "corrupt blocks were skipped (and their descendants); or refused: the pool "
        "holds KV blocks, or its tenant secret cannot be carried"),
    (2, "usage error"),
    (3, "pool or snapshot directory missing or not accessible"),
    (4, "not a usable pool, or the snapshot is incomplete or corrupt (manifest, index)"),
    (5, "the pool or the snapshot needs a newer cxlkv (format version)"),
    (6, "unsafe permissions (world-readable or world-writable)"),
    (7, "device or mapping error"),
    (70, "internal error (a bug)"),
    (130, "interrupted"),
))


@click.command("snapshot", epilog=SNAPSHOT_EXIT)
@pool_option(required=True)
@click.option("--to", "to", metavar="DIR", required=True,
              help="New or empty directory to write the snapshot into.")
@force_option
@json_option
@pass_app
def snapshot_cmd(app: Application, pool, to, force, as_json):
    """Write the pool's published KV blocks and the metadata to rebuild its
    table into DIR, while nodes keep serving.

    Each block is pinned, copied and its version checked again: a block that
    changed meanwhile is skipped and counted, never written torn.  DIR holds
    every tenant's blocks and the pool's tenant secret: it is created 0700.
    """
    import cxlkv
    from cxlkv.kv.snapshot import snapshot

    with cxlkv.open_pool(pool, force=force) as p:
        with app.progress("snapshot", 0) as tick:
            r = snapshot(p, to, progress=tick)
    if app.json:
        app.emit_json(r)
        return 0
    app.out.print(f"{pool}: {r['blocks']} blocks ({human_size(r['bytes'])}) of "
                  f"{r['namespaces']} namespace(s) written to {to} in {r['seconds']:.2f} s")
    skipped = r["skipped_changed"] + r["skipped_orphans"]
    if skipped:
        app.out.print(f"{skipped} block(s) changed while being copied (evicted or replaced) "
                      f"and were skipped ({r['skipped_orphans']} of them because their parent "
                      "was)")
    return 0


@click.command("restore", epilog=RESTORE_EXIT)
@pool_option(required=True)
@click.option("--from", "src", metavar="DIR", required=True,
              help="Snapshot directory written by cxlkv snapshot.")
@force_option
@json_option
@pass_app
def restore_cmd(app: Application, pool, src, force, as_json):
    """Restore a KV snapshot into a pool without KV blocks (freshly formatted).

    Blocks go in most recently used first, each after its ancestors: a pool
    smaller than the snapshot keeps the most recent whole chains that fit and
    the rest is counted as left out.  Every block's checksum is verified; a
    corrupt one is skipped with its descendants, and the command exits 1.
    """
    import cxlkv
    from cxlkv.kv.snapshot import read_manifest, restore

    read_manifest(src)                      # a bad snapshot fails before the pool is touched
    with cxlkv.open_pool(pool, force=force) as p:
        with app.progress("restore", 0) as tick:
            r = restore(p, src, progress=tick)
    if app.json:
        app.emit_json(r)
    else:
        app.out.print(f"{pool}: restored {r['restored']} of {r['blocks']} blocks "
                      f"({human_size(r['restored_bytes'])}) from {src} in {r['seconds']:.2f} s")
        if r["left_out"]:
            app.out.print(f"{r['left_out']} block(s) ({human_size(r['left_out_bytes'])}) left "
                          f"out, the least recently used: {r['left_out_reason']}")
        if r["present"] or r["busy"]:
            app.out.print(f"{r['present'] + r['busy']} block(s) were stored meanwhile by "
                          "another node")
        if r["tenant_secret_carried"]:
            app.out.print("the snapshot's tenant secret was carried into the pool's superblock")
    if r["corrupt"]:
        app.warn(f"{r['corrupt']} corrupt block(s) skipped (checksum mismatch), and "
                 f"{r['corrupt_descendants']} block(s) chained under them")
        return 1
    return 0
