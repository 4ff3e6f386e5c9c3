"""`cxlkv health`: one Nagios/Icinga status line for cron and monitoring (read-only)."""
from __future__ import annotations

import sys
import threading
import time

import click

from cxlkv.cli.app import Application, exit_codes_epilog, json_option, pass_app, pool_option
from cxlkv.errors import CxlkvError, HealthUsage

HEALTH_CODES = ((0, "OK"), (1, "WARNING"), (2, "CRITICAL"),
                (3, "UNKNOWN: could not check (unreadable pool, newer format, timed out, "
                    "usage error, internal error)"))
#: --timeout when none is given (longer when the pool's lease needs it)
DEFAULT_TIMEOUT = 10.0


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
    from cxlkv.ops import health as H

    if warn_used > crit_used or warn_temp > crit_temp:
        raise HealthUsage("a warning threshold is above its critical one "
                          "(see cxlkv health --help)")
    th = H.Thresholds(warn_used, crit_used, warn_temp, crit_temp)
    try:
        h = run_checks(pool, th, timeout)
    except (Exception, KeyboardInterrupt) as e:     # noqa: BLE001 - a plugin answers 0-3
        h = internal_failure(pool, e)
    if app.json:
        app.emit_json(h.to_json())
    else:
        sys.stdout.write(h.line().replace("\n", " ") + "\n")
        sys.stdout.flush()
    return h.status


def check_pool(path: str, th, start: float, limits: dict, derive: bool = False):
    """The checks themselves (run in a worker thread by run_checks): the pool
    first - heartbeats watched until 80 % of the time limit - while the
    device tools run alongside; the device gets what is left until 95 % of
    the limit, in all, and is reported unknown when it has not answered by
    then (the pool's verdict stands).  With `derive` the time limit grows to
    what judging a node of another host takes (H.judge_timeout of the lease)."""
    from cxlkv.ops import health as H
    from cxlkv.host import numa
    from cxlkv.api import Pool
    from cxlkv.state import nodes as N

    try:
        p = Pool.open(path, writable=False, force=True)
    except CxlkvError as e:
        return H.open_failure(path, e)
    with p:
        if derive:
            limits["timeout"] = max(limits["timeout"], H.judge_timeout(p.sb.lease_ms / 1000.0))
        limit = limits["timeout"]
        dev_end = start + 0.95 * limit
        box: dict = {}

        def device():
            try:
                box["d"] = H.device_health(path, timeout=max(0.1, dev_end - time.monotonic()))
            except Exception as e:             # noqa: BLE001 - the device is unknown then
                box["e"] = f"{type(e).__name__}: {e}"

        dev_t = threading.Thread(target=device, name="cxlkv-health-device", daemon=True)
        dev_t.start()
        mgr = H.ManagerWatch(p) if p.sb.sync == "manager" else None
        h = H.evaluate(p, th, observer=N.Observer(p), manager=mgr, device=None,
                       deadline=start + 0.8 * limit)
        dev_t.join(max(0.0, dev_end - time.monotonic()))
        if "d" in box:
            H.add_device(h, box["d"], th)
        else:
            why = box.get("e") or "the device tools did not answer within the time left"
            try:
                dax = numa.dax_of(path)
            except Exception:                 # noqa: BLE001 - no device figures then
                dax = None
            if dax is not None:
                H.add_device(h, {"device": dax, "memdevs": [], "temperature_c": None,
                                 "alarms": [], "error": why}, th)
        for w in p.warnings:
            if "superblock copy" not in w:
                h.add("permissions", H.WARNING, w)
        return h


def run_checks(path: str, th, timeout: float | None):
    """check_pool in a daemon thread; UNKNOWN when it has not answered in time
    (whatever it is blocked on: a hung device, a tool that does not return)
    or failed.  timeout None: DEFAULT_TIMEOUT, or longer when the pool's
    lease needs it (see check_pool)."""
    from cxlkv.ops import health as H

    start = time.monotonic()
    limits = {"timeout": DEFAULT_TIMEOUT if timeout is None else timeout}
    box: dict = {}

    def work():
        try:
            box["h"] = check_pool(path, th, start, limits, derive=timeout is None)
        except BaseException as e:        # noqa: BLE001 - reported by the caller
            box["e"] = e

    t = threading.Thread(target=work, name="cxlkv-health", daemon=True)
    t.start()
    while t.is_alive():
        left = start + limits["timeout"] - time.monotonic()
        if left <= 0:
            break
        t.join(min(left, 0.05))
    if "e" in box:
        return internal_failure(path, box["e"])
    if "h" not in box:
        h = H.Health(path)
        h.add("timeout", H.UNKNOWN, f"no answer within --timeout {limits['timeout']:g} s")
        return h
    return box["h"]


def internal_failure(path: str, e: BaseException):
    """A check that failed in an unforeseen way: UNKNOWN (3), never another code."""
    from cxlkv.ops import health as H

    h = H.Health(path)
    what = e.message if isinstance(e, CxlkvError) else f"internal error: {type(e).__name__}: {e}"
    h.add("internal", H.UNKNOWN, f"cannot check: {what}")
    return h
