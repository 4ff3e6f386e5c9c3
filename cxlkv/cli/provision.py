"""`cxlkv provision plan|apply|teardown`: raw CXL capacity -> a devdax pool, step by step."""
from __future__ import annotations

import sys

import click

from cxlkv import errors
from cxlkv.cli.app import Application, exit_codes_epilog, json_option, pass_app

PROVISION_CODES = (
    (0, "success; nothing left to do (apply/teardown: also when there was nothing to do)"),
    (1, "refused: not confirmed, or memory in use (a mapped device, live pool nodes, "
        "system RAM with pages in use)"),
    (2, "usage error"),
    (3, "a tool (cxl, ndctl, daxctl) is not installed"),
    (7, "cannot be provisioned as asked, or a step failed (the tool's stderr, the state "
        "left and how to undo it are shown)"),
    (70, "internal error (a bug)"), (130, "interrupted"))


def target_options(f):
    for opt in reversed([
        click.option("--mode", type=click.Choice(["devdax", "system-ram"]), default="devdax",
                     show_default=True,
                     help="devdax: a device a pool maps; system-ram: online the memory as a "
                          "CPU-less NUMA node instead (never done unless asked)."),
        click.option("--memdev", "memdevs", multiple=True, metavar="memN",
                     help="Memdev to provision (repeat for an interleaved region; default: "
                          "every enabled memdev)."),
        click.option("--decoder", metavar="decoderN.M",
                     help="Root decoder (CXL window) for a new region (default: the first "
                          "that fits)."),
        click.option("--align", default="2M", show_default=True, metavar="SIZE",
                     help="Page size of a new devdax namespace (4K, 2M or 1G)."),
        click.option("--group", metavar="GROUP",
                     help="Group that may map the device and pool (mode 0660)."),
        click.option("--sync", type=click.Choice(["manager", "cas"]), default="manager",
                     show_default=True,
                     help="Sync mode of the pool: manager for multi-host CXL without "
                          "cross-host atomics, cas for coherent memory."),
        click.option("--no-format", "no_format", is_flag=True,
                     help="Stop at the device: do not format a pool on it."),
    ]):
        f = opt(f)
    return f


def make_options(mode, memdevs, decoder, align, group, sync, no_format, region=None):
    from cxlkv.ops.provision import Options

    o = Options(mode=mode, memdevs=list(memdevs), decoder=decoder, region=region, align=align,
                group=group, sync=sync, format=not no_format)
    o.check()
    return o


@click.group("provision", epilog=exit_codes_epilog(PROVISION_CODES))
def provision_group():
    """Turn raw CXL capacity into a devdax pool: plan, apply, teardown.

    `plan` prints the exact ordered steps - create a region, a devdax namespace
    (or take a DAX device back from system RAM), the device's group and mode,
    format the pool - marking those already in place, without changing
    anything.  `apply` runs them (asking first, unless --yes), verifies each
    by listing, and is idempotent.  `teardown` undoes them.
    """


@provision_group.command("plan", epilog=exit_codes_epilog(PROVISION_CODES))
@target_options
@click.option("--teardown", is_flag=True, help="Show the teardown plan instead.")
@click.option("--region", metavar="regionN", help="With --teardown: the region to tear down.")
@json_option
@pass_app
def plan_cmd(app: Application, mode, memdevs, decoder, align, group, sync, no_format, teardown,
             region, as_json):
    """Print the steps apply (or teardown) would run; change nothing."""
    from cxlkv.host import discovery
    from cxlkv.ops import provision

    opts = make_options(mode, memdevs, decoder, align, group, sync, no_format, region)
    plan = (provision.plan_teardown if teardown else provision.plan_apply)(discovery.discover(),
                                                                           opts)
    if app.json:
        app.emit_json(plan.to_json())
        return 0
    render_plan(app, plan)
    n = len(plan.todo)
    verb = "teardown" if teardown else "apply"
    if n:
        app.out.print(f"Nothing has been changed. `cxlkv provision {verb} --yes` (with the same "
                      f"options) runs the {n} step(s) marked 'will run', in this order, and "
                      "stops at the first failure.")
    else:
        app.out.print(f"Everything is in place: `cxlkv provision {verb}` would change nothing.")
    return 0


@provision_group.command("apply", epilog=exit_codes_epilog(PROVISION_CODES))
@target_options
@click.option("--yes", "-y", "yes", is_flag=True, help="Do not ask before changing anything.")
@json_option
@pass_app
def apply_cmd(app: Application, mode, memdevs, decoder, align, group, sync, no_format, yes,
              as_json):
    """Run the plan: region, devdax namespace, device mode and group, pool format.

    Idempotent: steps already in place are skipped, and a second run changes
    nothing.  Each step is verified by listing what it made; the first
    failure stops the run with the tool's message, the state left behind and
    the commands that undo the steps already done.
    """
    from cxlkv.ops import provision

    opts = make_options(mode, memdevs, decoder, align, group, sync, no_format)
    return run(app, provision.plan_apply, opts, yes)


@provision_group.command("teardown", epilog=exit_codes_epilog(PROVISION_CODES))
@click.option("--region", metavar="regionN", help="Region to tear down (default: the only one).")
@click.option("--memdev", "memdevs", multiple=True, metavar="memN",
              help="Tear down the region over this memdev.")
@click.option("--yes", "-y", "yes", is_flag=True, help="Do not ask before changing anything.")
@json_option
@pass_app
def teardown_cmd(app: Application, region, memdevs, yes, as_json):
    """Undo apply: system RAM back offline, destroy the namespace, destroy the region.

    Refuses while anything uses the memory.  The data stays on the media.
    """
    from cxlkv.ops import provision

    opts = provision.Options(memdevs=list(memdevs), region=region)
    return run(app, provision.plan_teardown, opts, yes)


def run(app: Application, planner, opts, yes: bool) -> int:
    from cxlkv.host import discovery
    from cxlkv.ops import provision

    plan = planner(discovery.discover(), opts)
    if not plan.todo:
        if app.json:
            app.emit_json({"action": plan.action, "changed": False, "ran": [],
                           "plan": plan.to_json()})
        elif plan.action == "teardown":
            why = "; ".join(s.why for s in plan.steps if s.why) or "nothing was provisioned"
            app.out.print(f"nothing to tear down: {why} (cxlkv inspect shows this host's CXL "
                          "memory)")
        else:
            app.out.print(f"nothing to do: everything is in place ({len(plan.steps)} step(s) "
                          "checked)")
        return 0
    if not yes:
        if not sys.stdin.isatty():
            raise errors.RefusedError(f"not confirmed: {len(plan.todo)} step(s) would change this "
                                 "host; pass --yes (stdin is not a terminal, so nobody can "
                                 "be asked)", hint="cxlkv provision plan shows them")
        if not app.json:
            render_plan(app, plan)
        if not click.confirm(f"Run the {len(plan.todo)} step(s) marked 'will run'?",
                             default=False, err=True):
            raise errors.RefusedError("not confirmed: nothing was changed")

    def on_step(event, step, i, n, seconds=0.0):
        if app.json:
            return
        if event == "start":
            app.err.print(f"[{i}/{n}] {step.title}\n      $ {step.command}")
        else:
            app.err.print(f"      ok ({seconds:.1f} s)")

    try:
        res = provision.execute(planner, opts, on_step=on_step)
    except provision.ProvisionFailed as e:
        if not app.json:
            render_failure(app, e)
        return app.fail(e)
    if app.json:
        app.emit_json({"action": plan.action, **res})
    else:
        dev = res["plan"]["device"]
        what = (f"{dev} ready" if dev and plan.action == "apply" else
                f"{plan.region} torn down" if plan.action == "teardown" else "done")
        app.out.print(f"{what}: {len(res['ran'])} step(s) run; running it again changes nothing")
    return 0


def render_plan(app: Application, plan) -> None:
    o = plan.options
    if plan.action == "apply":
        head = (f"provision plan: mode {o['mode']}, memdevs {', '.join(o['memdevs']) or 'all'}"
                + (f", pool sync {o['sync']}" if o["format"] and o["mode"] == "devdax" else ""))
    else:
        head = f"teardown plan: region {plan.region or '-'}"
    app.out.print(head)
    for i, s in enumerate(plan.steps, 1):
        mark = "will run" if s.status == "todo" else "done    "
        app.out.print(f" {i}. [{mark}] {s.title}")
        app.out.print(f"      $ {s.command}")
        app.out.print(f"      {'why' if s.status == 'todo' else 'now'}: {s.why}")
        if s.undo and s.status == "todo":
            app.out.print(f"      undo: {s.undo}")
    for n in plan.notes:
        app.out.print(f" note: {n}")


def render_failure(app: Application, e) -> None:
    err = app.err.print
    err(f"{app.command}: step failed: {e.step['title']}")
    err(f"  $ {e.step['command']}")
    if e.result is not None:
        err(f"  exit status {e.result.rc}; its stderr:")
        for line in (e.result.stderr.strip() or "(empty)").splitlines():
            err(f"    {line}")
    err("  state left behind:")
    st = e.state
    err("    regions: " + (", ".join(f"{r['region']} ({r['type']}, {r['decode_state']}, DAX "
                                     f"{','.join(r['dax_devices']) or '-'})"
                                     for r in st["regions"]) or "none"))
    err("    namespaces: " + (", ".join(f"{n['dev']} ({n['mode']})" for n in st["namespaces"])
                              or "none"))
    err("    DAX devices: " + (", ".join(f"{d['chardev']} ({d['mode']})"
                                         for d in st["dax_devices"]) or "none"))
    if e.completed:
        err("  done before it: " + "; ".join(s["title"] for s in e.completed))
        err("  to undo them, in this order:")
        for u in e.undo:
            err(f"    {u}")
    else:
        err("  nothing was changed before it")
