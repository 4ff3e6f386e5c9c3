"""`cxlkv doctor`: what is misconfigured on this host and its pool, and what to do."""
from __future__ import annotations

import click
from rich.table import Table

from cxlkv.cli.app import Application, exit_codes_epilog, json_option, pass_app
from cxlkv.errors import UsageError

DOCTOR_CODES = ((0, "every check passed (or does not apply here)"),
                (1, "warnings, no failures"),
                (2, "failures (or a usage error)"),
                (70, "internal error (a bug)"), (130, "interrupted"))
MARK = {"pass": "ok", "warn": "WARN", "fail": "FAIL", "skip": "skip", "unknown": "?"}


@click.command("doctor", epilog=exit_codes_epilog(DOCTOR_CODES))
@click.option("--pool", "pool", metavar="PATH", envvar="CXLKV_POOL",
              help="Pool to check [env: CXLKV_POOL; default: the one devdax device, else "
                   "/dev/shm/cxlkv-default.pool when it exists].")
@json_option
@pass_app
def doctor_cmd(app: Application, pool, as_json):
    """Check this host and its pool for the known CXL pitfalls.

    Kernel and CXL modules, tools, memdevs and their health (temperature over
    70 C, life used, alarms), regions, DAX devices in devdax mode (not
    auto-onlined as system RAM), alignment, device permissions, THP, NUMA
    balancing, demotion and memory tiers, the memory auto-online policy; and
    for the pool: formatted and readable, node heartbeats fresh, a lock
    manager running in sync mode manager.  Each check passes, warns or fails
    with a remedy; nothing is changed.
    """
    from cxlkv.ops import doctor

    if pool == "":
        raise UsageError("empty path given to --pool")
    rep = doctor.run(pool=pool)
    if app.json:
        app.emit_json(rep)
        return rep["exit_code"]
    t = Table(title="cxlkv doctor" + (f" (pool {rep['pool']})" if rep["pool"] else ""),
              title_justify="left")
    for col in ("", "check", "subject", "finding", "remedy"):
        t.add_column(col)
    for c in rep["checks"]:
        t.add_row(MARK[c["status"]], c["title"], c["subject"] or "", c["detail"],
                  c["remedy"] or "")
    app.out.print(t)
    s = rep["summary"]
    app.out.print(f"{s['pass']} passed, {s['warn']} warning(s), {s['fail']} failure(s), "
                  f"{s['skip']} not applicable, {s['unknown']} unknown")
    return rep["exit_code"]
