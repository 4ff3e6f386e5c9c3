"""`cxlkv health`: one Nagios/Icinga status line for cron and monitoring (read-only)."""
from __future__ import annotations

import sys
import threading
import time

import click

from cxlkv.cli.app import Application, exit_codes_epilog, json_option, pass_app, pool_option
from cxlkv.errors import CxlkvError

HEALTH_CODES = ((0, "OK"), (1, "WARNING"), (2, "CRITICAL"),
                (3, "UNKNOWN: could not check (unreadable pool, newer format, timed out, "
                    "usage error)"),
                (70, "internal error (a bug)"))


class HealthUsage(CxlkvError):
    """A usage error is UNKNOWN (3) for a monitoring plugin, not 2 (CRITICAL)."""

    exit_code = 3
    kind = "usage"


class NagiosCommand(click.Command):
    def parse_args(self, ctx, args):
        try:
            return super().parse_args(ctx, args)
        except click.ClickException as e:
            if "--json" not in args:
                sys.stdout.write(f"CXLKV UNKNOWN - usage error: {e.format_message()}\n")
            raise HealthUsage(f"{e.format_message()} (see cxlkv health --help)") from None


def _pct(ctx, param, value):
    if value is not None and not 0 <= value <= 100:
        raise click.BadParameter("must be a percentage between 0 and 100")
    return value


@click.command("health", cls=NagiosCommand, epilog=exit_codes_epilog(HEALTH_CODES))
@pool_option(required=True)
@click.option("--warn-used", type=float, default=80.0, show_default=True, metavar="PCT",
              callback=_pct, help="WARNING when unevictable bytes reach PCT % of the data area.")
@click.option("--crit-used", type=float, default=95.0, show_default=True, metavar="PCT",
              callback=_pct, help="CRITICAL when unevictable bytes reach PCT % of the data area.")
@click.option("--warn-temp", type=float, default=70.0, show_default=True, metavar="C",
              help="WARNING when a CXL device behind the pool reaches C degrees Celsius.")
@click.option("--crit-temp", type=float, default=85.0, show_default=True, metavar="C",
              help="CRITICAL when a CXL device behind the pool reaches C degrees Celsius.")
@click.option("--timeout", type=click.FloatRange(0.1, 3600), default=10.0, show_default=True,
              metavar="SECONDS", help="Answer within SECONDS whatever happens (UNKNOWN if the "
                                      "checks have not finished).")
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
    --timeout.
    """
    from cxlkv.daemons import health as H

    if warn_used > crit_used or warn_temp > crit_temp:
        raise HealthUsage("a warning threshold is above its critical one "
                          "(see cxlkv health --help)")
    th = H.Thresholds(warn_used, crit_used, warn_temp, crit_temp)
    h = run_checks(pool, th, timeout)
    if app.json:
        app.emit_json(h.to_json())
    else:
        sys.stdout.write(h.line().replace("\n", " ") + "\n")
        sys.stdout.flush()
    return h.status


def check_pool(path: str, th, deadline: float):
    """The checks themselves (run in a worker thread by run_checks)."""
    from cxlkv.daemons import health as H
    from cxlkv.pool.pool import Pool
    from cxlkv.state import nodes as N

    try:
        p = Pool.open(path, writable=False, force=True)
    except CxlkvError as e:
        return H.open_failure(path, e)
    with p:
        left = deadline - time.monotonic()
        dev = H.device_health(path, timeout=max(0.1, left / 2))
        mgr = H.ManagerWatch(p) if p.sb.sync == "manager" else None
        h = H.evaluate(p, th, observer=N.Observer(p), manager=mgr, device=dev,
                       deadline=deadline)
        for w in p.warnings:
            if "superblock copy" not in w:
                h.add("permissions", H.WARNING, w)
        return h


def run_checks(path: str, th, timeout: float):
    """check_pool in a daemon thread; UNKNOWN when it has not answered in time
    (whatever it is blocked on: a hung device, a tool that does not return)."""
    from cxlkv.daemons import health as H

    start = time.monotonic()
    box: dict = {}

    def work():
        try:
            box["h"] = check_pool(path, th, start + 0.8 * timeout)
        except BaseException as e:        # noqa: BLE001 - reported by the caller
            box["e"] = e

    t = threading.Thread(target=work, name="cxlkv-health", daemon=True)
    t.start()
    t.join(max(0.0, start + timeout - time.monotonic()))
    if "e" in box:
        raise box["e"]
    if "h" not in box:
        h = H.Health(path)
        h.add("timeout", H.UNKNOWN, f"no answer within --timeout {timeout:g} s")
        return h
    return box["h"]
