"""`cxlkv fsck`: read-only consistency check of a pool (exit codes as e2fsck)."""
from __future__ import annotations

import click
from rich.table import Table

from cxlkv.cli.app import Application, exit_codes_epilog, json_option, pass_app, pool_option
from cxlkv.errors import CxlkvError

EXIT_CLEAN, EXIT_ERRORS, EXIT_OPERATIONAL = 0, 4, 8
FSCK_CODES = ((EXIT_CLEAN, "clean"), (EXIT_ERRORS, "errors found and left uncorrected"),
              (EXIT_OPERATIONAL, "operational error: the pool could not be checked"),
              (2, "usage error"))


@click.command("fsck", epilog=exit_codes_epilog(FSCK_CODES))
@pool_option(required=True)
@click.option("--force", is_flag=True, help="Check a world-readable or world-writable pool.")
@json_option
@pass_app
def fsck_cmd(app: Application, pool, force, as_json):
    """Check a pool's shared state without changing it.

    Checks both superblock copies, the node table, the lock area, the chunk
    bitmap against the slab descriptors, each slab's slot bitmaps, counts and
    owners (an owner that is not an attached node means a dead node that was
    not reaped).  The pool is mapped read-only.  Run it on a quiet pool: work
    in flight can look like damage.
    """
    from cxlkv.pool.pool import Pool
    from cxlkv.state.fsck import check

    try:
        with Pool.open(pool, writable=False, force=force) as p:
            rep = check(p)
    except CxlkvError as e:
        return app.fail(e, EXIT_OPERATIONAL)
    if app.json:
        app.emit_json({"pool": pool, **rep.to_json()})
    else:
        if rep.findings:
            t = Table(title=f"fsck {pool}", title_justify="left")
            for col in ("severity", "where", "code", "problem"):
                t.add_column(col)
            for f in rep.findings:
                t.add_row(f.severity, f.where, f.code, f.message)
            app.out.print(t)
        a = rep.stats.get("allocator", {})
        app.out.print(f"{pool}: {'clean' if rep.clean else f'{len(rep.errors)} error(s)'}; "
                      f"{a.get('slabs', 0)} slabs, {a.get('slots_allocated', 0)} slots allocated "
                      f"({a.get('slots_published', 0)} published), "
                      f"{a.get('chunks_used', 0)} of {a.get('chunks', 0)} chunks in use")
    return EXIT_CLEAN if rep.clean else EXIT_ERRORS
