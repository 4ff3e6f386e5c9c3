"""`cxlkv health`: one Nagios/Icinga status line for cron and monitoring (read-only)."""
from __future__ import annotations

import sys

import click

from cxlkv.cli.app import Application, exit_codes_epilog, json_option, pass_app, pool_option
from cxlkv.errors import HealthUsage

HEALTH_CODES = ((0, "OK"), (1, "WARNING"), (2, "CRITICAL"),
                (3, "UNKNOWN: could not check (unreadable pool, newer format, timed out, "
                    "usage error, internal error)"))


class NagiosCommand(click.Command):
    def parse_args(self, ctx, args):
        # decided before parsing: click consumes `args` as it parses them
        as_json = "--json" in (args[:args.index("--")] if "--" in args else args)
        try:
            return super().parse_args(ctx, args)
        except click.ClickException as e:
            from cxlkv.cli import usage_message

            msg = usage_message(e)
            if not as_json:
                sys.stdout.write(f"CXLKV UNKNOWN - usage error: {msg}\n")
            raise HealthUsage(f"{msg} (see cxlkv health --help)") from None


def _pct(ctx, param, value):
    if value is not None and not 0 <= value <= 100:
        raise click.BadParameter("must be a percentage between 0 and 100")
    return value


@click.command("health", cls=NagiosCommand, epilog=exit_codes_epilog(HEALTH_CODES))
@pool_option(required=True)
@click.option("--warn-unevictable", "--warn-used", "warn_used", type=float, default=80.0,
              show_default=True, metavar="PCT", callback=_pct,
              help="WARNING when unevictable bytes reach PCT % of the data area "
                   "(--warn-used: the old name).")
@click.option("--crit-unevictable", "--crit-used", "crit_used", type=float, default=95.0,
              show_default=True, metavar="PCT", callback=_pct,
              help="CRITICAL when unevictable bytes reach PCT % of the data area "
                   "(--crit-used: the old name).")
@click.option("--warn-temp", type=float, default=70.0, show_default=True, metavar="C",
              help="WARNING when a CXL device behind the pool reaches C degrees Celsius.")
@click.option("--crit-temp", type=float, default=85.0, show_default=True, metavar="C",
              help="CRITICAL when a CXL device behind the pool reaches C degrees Celsius.")
@click.option("--timeout", type=click.FloatRange(0.1, 3600), default=None,
              metavar="SECONDS", help="Answer within SECONDS whatever happens (UNKNOWN if the "
                                      "checks have not finished).  Judging a node of another "
                                      "host takes 1.25 x the pool's lease + 1 s; the default "
                                      "is 10, or that when it is longer.")
@json_option
@pass_app
def health_cmd(app: Application, pool, warn_used, crit_used, warn_temp, crit_temp, timeout,
               as_json):
    """Check a pool's health for cron, Nagios or Icinga: one status line.

    Prints `CXLKV STATUS - text | perfdata` (the Nagios plugin format) and
    exits 0 OK, 1 WARNING, 2 CRITICAL or 3 UNKNOWN.  Checks: the superblock
    copies; usage - pinned and otherwise unevictable bytes against the data
    area (a warm cache sitting full is healthy: its blocks are evictable);
    dead nodes not reaped yet; in sync mode manager, a lock manager
    heartbeating; the CXL device's temperature and alarms when the pool is a
    DAX device that reports them.  Read-only: it never attaches as a node and
    never repairs (see cxlkv fsck --repair).  Remote nodes and the lock
    manager are judged by watching their heartbeats, for at most 80 % of
    --timeout; nodes still not judged then make a WARNING that says which
    --timeout would do.  The device tools run meanwhile and get what is
    left (to 95 %): when they have not answered the device is reported
    unknown and the pool's verdict stands.  Any failure is UNKNOWN (3):
    the exit status is always 0-3.
    """
    from cxlkv.ops import health

    if warn_used > crit_used or warn_temp > crit_temp:
        raise HealthUsage("a warning threshold is above its critical one "
                          "(see cxlkv health --help)")
    th = health.Thresholds(warn_used, crit_used, warn_temp, crit_temp)
    try:
        h = health.run_checks(pool, th, timeout)
    except (Exception, KeyboardInterrupt) as e:     # noqa: BLE001 - a plugin answers 0-3
        h = health.internal_failure(pool, e)
    if app.json:
        app.emit_json(h.to_json())
    else:
        sys.stdout.write(h.line().replace("\n", " ") + "\n")
        sys.stdout.flush()
    return h.status
