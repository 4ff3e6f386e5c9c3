"""`cxlkv fsck`: consistency check of a pool, and its repair (exit codes as e2fsck)."""
from __future__ import annotations

import click
from rich.table import Table

from cxlkv.cli.app import Application, exit_codes_epilog, json_option, pass_app, pool_option
from cxlkv.errors import CxlkvError, FsckUsage

#: e2fsck's codes; a usage error is 16 as in e2fsck (its 2 means "corrected, reboot")
EXIT_CLEAN, EXIT_CORRECTED, EXIT_ERRORS, EXIT_OPERATIONAL, EXIT_USAGE = 0, 1, 4, 8, 16
FSCK_CODES = ((EXIT_CLEAN, "clean"),
              (EXIT_CORRECTED, "errors found and corrected (--repair); the pool is clean now"),
              (EXIT_ERRORS, "errors found and left uncorrected, or a repair that could not be "
                            "made (named under 'not repaired')"),
              (EXIT_OPERATIONAL, "operational error: the pool could not be checked or "
                                 "repaired (or --repair refused: live nodes attached, or a "
                                 "node attached while it ran)"),
              (EXIT_USAGE, "usage error"))


class FsckCommand(click.Command):
    def parse_args(self, ctx, args):
        try:
            return super().parse_args(ctx, args)
        except click.ClickException as e:
            raise FsckUsage(f"{e.format_message()} (see cxlkv fsck --help)") from None


@click.command("fsck", cls=FsckCommand, epilog=exit_codes_epilog(FSCK_CODES))
@pool_option(required=True)
@click.option("--repair", is_flag=True,
              help="Repair what is found (refused while live nodes are attached, "
                   "unless --live).")
@click.option("--live", is_flag=True,
              help="With --repair: repair while live nodes are attached (attached as a node, "
                   "under the pool lock; nodes of other hosts not judged yet count as live).")
@click.option("--force", is_flag=True,
              help="Open a world-readable or world-writable pool (only that).")
@json_option
@pass_app
def fsck_cmd(app: Application, pool, repair, live, force, as_json):
    """Check a pool's shared state; with --repair, put it right.

    Checks both superblock copies, the node table, the lock area, the chunk
    bitmap against the slab descriptors, each slab's slot bitmaps, counts and
    owners (an owner that is not an attached node means a dead node that was
    not reaped), and the KV cache: hash entries (states, probe chains,
    payloads pointing at free or foreign slots, parents and children,
    counters) and pins of nodes that are gone.  Without --repair the pool is
    mapped read-only.  Run it on a quiet pool: work in flight can look like
    damage.

    --repair rewrites a bad superblock copy from the good one, reaps nodes
    that are not alive (their locks, pins and reservations reclaimed),
    restores or frees what allocator structures say inconsistently, drops
    inconsistent KV entries and recomputes counters; then checks again.
    Liveness is judged once (nodes of other hosts watched for up to a
    lease); only nodes judged dead are reaped, and a node that attaches
    meanwhile stops an offline repair (exit 8) - in sync mode cas it cannot
    attach at all while the repair runs.  --live repairs with live nodes
    attached (attaching is not counted as a repair); --force only opens a
    pool of an unsafe mode.
    """
    if live and not repair:
        raise FsckUsage("--live goes with --repair (see cxlkv fsck --help)")
    if repair:
        return _repair(app, pool, force, live)
    from cxlkv.api import Pool
    from cxlkv.ops.fsck import check

    try:
        with Pool.open(pool, writable=False, force=force) as p:
            rep = check(p)
    except CxlkvError as e:
        return app.fail(_with_next_step(pool, e), EXIT_OPERATIONAL)
    if app.json:
        app.emit_json({"pool": pool, **rep.to_json()})
    else:
        _findings(app, f"fsck {pool}", rep.findings)
        _summary(app, pool, rep)
    return EXIT_CLEAN if rep.clean else EXIT_ERRORS


def _with_next_step(pool: str, e: CxlkvError) -> CxlkvError:
    """A pool whose superblock copies are both bad cannot be checked or
    repaired: say which path, and what is left to do."""
    from cxlkv.errors import NotFormatted, PoolInvalid, WrongMagic

    if not isinstance(e, PoolInvalid):
        return e
    if isinstance(e, WrongMagic):
        return e if e.hint else type(e)(e.message, path=pool, hint="check the path: it holds "
                                        "data that is not a cxlkv pool")
    msg = e.message if pool in e.message else f"{pool}: {e.message}"
    if isinstance(e, NotFormatted):
        return type(e)(msg, path=pool, hint=e.hint or f"make a pool of it: cxlkv format "
                                                       f"--pool {pool}")
    if "superblock" not in msg:
        return type(e)(msg, path=pool, hint=e.hint)
    return type(e)(
        f"{msg}; fsck cannot check or repair a pool with no good superblock copy",
        path=pool, hint=f"re-format it (`cxlkv format --pool {pool} --force`: the KV cache "
                        "starts empty) after stopping every node, or restore a snapshot into "
                        "the new pool (cxlkv-restore(1))")


def _findings(app: Application, title: str, findings) -> None:
    if not findings:
        return
    t = Table(title=title, title_justify="left")
    for col in ("severity", "where", "code", "problem"):
        t.add_column(col)
    for f in findings:
        t.add_row(f.severity, f.where, f.code, f.message)
    app.out.print(t)


def _summary(app: Application, pool: str, rep) -> None:
    a = rep.stats.get("allocator", {})
    app.out.print(f"{pool}: {'clean' if rep.clean else f'{len(rep.errors)} error(s)'}; "
                  f"{a.get('slabs', 0)} slabs, {a.get('slots_allocated', 0)} slots allocated "
                  f"({a.get('slots_published', 0)} published), "
                  f"{a.get('chunks_used', 0)} of {a.get('chunks', 0)} chunks in use")


def _repair(app: Application, pool: str, force: bool, live: bool) -> int:
    from cxlkv.ops.repair import repair

    def notice(count, seconds):
        app.info(f"{app.command}: watching {count} node(s) of other hosts for up to "
                 f"{seconds:g} s to tell whether they are alive")

    try:
        rep = repair(pool, force=force, live=live, notice=notice)
    except CxlkvError as e:
        return app.fail(_with_next_step(pool, e), EXIT_OPERATIONAL)
    if app.json:
        app.emit_json({"pool": pool, **rep.to_json()})
        return rep.exit_code
    _findings(app, f"fsck {pool}: found", rep.before.findings)
    if rep.actions:
        t = Table(title=f"fsck {pool}: repaired", title_justify="left")
        for col in ("where", "code", "repair"):
            t.add_column(col)
        for a in rep.actions:
            t.add_row(a["where"], a["code"], a["message"])
        app.out.print(t)
    if rep.after.errors:
        _findings(app, f"fsck {pool}: left", rep.after.findings)
    for a in rep.left:
        app.out.print(f"fsck {pool}: not repaired: {a['where']}: {a['message']}")
    _summary(app, pool, rep.after)
    if rep.attached:
        app.out.print(f"{pool}: repaired under the pool lock, attached as a node (--live)")
    if rep.exit_code == EXIT_CORRECTED:
        app.out.print(f"{pool}: {len(rep.actions)} repair(s) made; the pool is clean now")
    return rep.exit_code
