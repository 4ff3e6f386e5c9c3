"""`cxlkv install-units`: install the systemd units and the cron example."""
from __future__ import annotations

import click

from cxlkv.cli.app import NO_POOL, Application, exit_codes_epilog, json_option, pass_app
from cxlkv.daemons.units import DEFAULT_CONFDIR, DEFAULT_DEST, DEFAULT_GROUP


@click.command("install-units", epilog=exit_codes_epilog(only=NO_POOL))
@click.option("--dest", metavar="DIR", default=DEFAULT_DEST, show_default=True,
              help="Directory for the unit files.")
@click.option("--confdir", metavar="DIR", default=DEFAULT_CONFDIR, show_default=True,
              help="Where the units read NAME.env and NAME.toml; the examples go here.")
@click.option("--group", metavar="GROUP", default=DEFAULT_GROUP, show_default=True,
              help="The pool's group: the units run as a dynamic user in it.")
@click.option("--exe", metavar="PATH",
              help="Absolute path of cxlkv for ExecStart= (default: this one).")
@click.option("--cron", metavar="FILE",
              help="Also write the cron example here (e.g. /etc/cron.d/cxlkv-health).")
@click.option("--dry-run", is_flag=True, help="Say what would be written; write nothing.")
@json_option
@pass_app
def install_units_cmd(app: Application, dest, confdir, group, exe, cron, dry_run, as_json):
    """Install the systemd units of cxlkv, ready for this installation.

    Writes cxlkv-serve@.service (the node agent), cxlkv-lock-manager@.service
    (a standby lock manager, for pools in sync mode manager: run it on every
    host), cxlkv-health@.service and cxlkv-health@.timer (cxlkv health every
    minute) into --dest, with ExecStart= pointing at this cxlkv.  The
    instance name is the pool's name: cxlkv-serve@kv0 reads
    CONFDIR/kv0.env (CXLKV_POOL=...) and CONFDIR/kv0.toml (cxlkv serve's
    settings); examples of both are written to --confdir unless present.
    Then: systemctl daemon-reload; systemctl enable --now
    cxlkv-serve@kv0 cxlkv-health@kv0.timer.
    """
    from cxlkv.daemons.units import install

    rep = install(dest=dest, confdir=confdir, group=group, exe=exe, cron=cron,
                  dry_run=dry_run)
    if app.json:
        app.emit_json(rep)
        return 0
    for w in rep["warnings"]:
        app.warn(w)
    verb = "would write" if dry_run else "wrote"
    for p in rep["written"]:
        app.out.print(f"{verb} {p}")
    for p in rep["kept"]:
        app.out.print(f"kept {p} (exists)")
    app.out.print("next:")
    for line in rep["next"]:
        app.out.print(f"  {line}")
    return 0
