"""`cxlkv lock-manager`: run the lock manager of a pool in sync mode `manager`."""
from __future__ import annotations

import click

from cxlkv.cli.app import NO_ATTACH, Application, exit_codes_epilog, pass_app, pool_option


@click.command("lock-manager", epilog=exit_codes_epilog(only=NO_ATTACH))
@pool_option(required=True)
@click.option("--standby", is_flag=True,
              help="If a manager is active, wait and take over when its heartbeat stops "
                   "for a lease (run one on every host for failover).")
@pass_app
def lockmgr_cmd(app: Application, pool, standby):
    """Grant the pool lock and node slots of a pool in sync mode `manager`.

    Exactly one manager is active per pool; a second one refuses (exit 1)
    unless --standby.  Runs in the foreground until SIGTERM or SIGINT, then
    hands the lease back at once.  Logs to stderr.
    """
    from cxlkv.daemons.lockmgr import LockManager, serve

    serve(LockManager(pool, standby=standby, log=lambda msg: app.info(f"{app.command}: {msg}")))
