"""`cxlkv stress`: torture the pool's shared state with many nodes; kill -9 some, pause some."""
from __future__ import annotations

import math
from contextlib import contextmanager

import click
from rich.table import Table

from cxlkv import errors
from cxlkv.cli.app import Application, exit_codes_epilog, json_option, pass_app, pool_option

DEFAULT_MIX = "alloc=20,free=10,verify=10,lock=10,kv=40"
STRESS_CODES = ((0, "all checks passed"),
                (1, "a violation was found (each is named), or the pool is in use (refused)"),
                *(row for row in errors.EXIT_CODES if row[0] >= errors.EXIT_USAGE))


def parse_mix(text: str) -> dict[str, int]:
    """'alloc=40,free=30' -> weights of every op (the ones left out weigh 0)."""
    from cxlkv.ops.stress import OPS

    mix = dict.fromkeys(OPS, 0)
    for part in text.split(","):
        kind, _, weight = (s.strip() for s in part.partition("="))
        if kind not in mix or not weight.isdigit():
            raise errors.UsageError(f"invalid --mix {text!r}: use KIND=WEIGHT,... with kinds "
                               f"{', '.join(OPS)} (e.g. {DEFAULT_MIX})")
        mix[kind] = int(weight)
    if not any(mix.values()):
        raise errors.UsageError(f"invalid --mix {text!r}: every weight is zero")
    return mix


def parse_pause(text: str | None) -> tuple[float, float] | None:
    """'MIN:MAX' (seconds) -> (MIN, MAX); None stays None."""
    if text is None:
        return None
    lo, sep, hi = text.partition(":")
    try:
        pair = (float(lo), float(hi if sep else lo))
    except ValueError:
        pair = (0.0, -1.0)
    if not 0 < pair[0] <= pair[1] or not all(math.isfinite(x) for x in pair):
        raise errors.UsageError(f"invalid --pause-seconds {text!r}: use MIN:MAX, seconds with "
                           "0 < MIN <= MAX (e.g. 1.5:3)")
    return pair


@click.command("stress", epilog=exit_codes_epilog(STRESS_CODES))
@pool_option(required=True)
@click.option("--nodes", type=click.IntRange(min=1), default=4, show_default=True, metavar="N",
              help="Worker processes, each attached as its own node.")
@click.option("--seconds", type=click.FloatRange(min=0, min_open=True), metavar="S",
              help="Run for S seconds.")
@click.option("--ops", type=click.IntRange(min=1), metavar="N",
              help="Run until the workers have done N operations.")
@click.option("--kill-rate", type=click.FloatRange(min=0), default=0, metavar="R",
              help="kill -9 R random workers per second (at random moments) and start a "
                   "replacement for each.")
@click.option("--pause-rate", type=click.FloatRange(min=0), default=0, metavar="R",
              help="SIGSTOP R random workers per second (at random moments) for longer than "
                   "the lease, then SIGCONT them; every worker then looks like a host of its "
                   "own, judged by its heartbeat.")
@click.option("--pause-seconds", metavar="MIN:MAX",
              help="How long a pause lasts, drawn uniformly (default: 1.5 to 3 leases).")
@click.option("--mix", default=DEFAULT_MIX, show_default=True, metavar="KIND=WEIGHT,...",
              help="Weights of the operations alloc, free, verify, lock and kv (left out: 0; "
                   "free and verify allocate while a worker owns nothing).")
@click.option("--seed", type=int, metavar="N",
              help="Seed of payload sizes, operation choices, kill and pause times (default: "
                   "random; reported).")
@json_option
@pass_app
def stress_cmd(app: Application, pool, nodes, seconds, ops, kill_rate, pause_rate,
               pause_seconds, mix, seed, as_json):
    """Torture-test a pool's shared state before putting it in service.

    Starts --nodes worker processes, each attached as its own node: they
    allocate slots, write checksummed payloads and publish them, verify and
    free them, take the pool lock for a read-modify-write of a shared counter,
    and store and load KV blocks whose bytes are derived from their keys.
    With --kill-rate, random workers are killed with SIGKILL at random moments
    and replaced.  With --pause-rate, random workers are stopped (SIGSTOP) for
    longer than the lease - judged dead by their heartbeat, fenced and reaped
    meanwhile - and resumed; a resumed worker that finds itself fenced attaches
    again.  At the end, with every worker resumed and stopped and the node
    table drained (dead nodes reaped, fenced ones out of quarantine), it
    checks: no operation hung; fsck finds nothing; no two slots overlap; every
    allocated slot is a published payload whose checksum matches and that a
    worker owns; every published KV block holds its key's bytes; the lock
    counter matches the lock operations; and after freeing everything the
    pool is empty.  The pool must be empty and have no other node attached.
    Workers inherit the environment: with CXLKV_NONCOHERENT=1 they see the
    pool as non-coherent memory.
    """
    from cxlkv.ops import stress

    if (seconds is None) == (ops is None):
        raise errors.UsageError("give either --seconds or --ops")
    opts = stress.Options(pool, nodes, parse_mix(mix), seconds, ops, kill_rate, seed,
                          pause_rate=pause_rate, pause_seconds=parse_pause(pause_seconds))
    with _progress(app, opts) as progress:
        res = stress.run(opts, progress=progress,
                         notice=lambda text: app.info(f"{app.command}: {text}"))
    for v in res.violations:
        app.err.print(f"{app.command}: violation: {v['kind']} ({v['check']}): {v['detail']}")
    if app.json:
        app.emit_json(res.to_json())
    else:
        render(app, res)
    return 0 if res.passed else 1


@contextmanager
def _progress(app: Application, opts):
    """A progress bar on stderr (none with --json or when stderr is not a terminal);
    yields the engine's progress(seconds, ops, kills) callback."""
    if app.json or not app.err.is_terminal:
        yield None
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    by_time = opts.seconds is not None
    with Progress(TextColumn("stress"), BarColumn(), TextColumn("{task.fields[status]}"),
                  TimeElapsedColumn(), console=app.err, transient=True) as p:
        task = p.add_task("stress", total=opts.seconds if by_time else opts.ops, status="")
        yield lambda seconds, ops, kills: p.update(
            task, completed=seconds if by_time else ops,
            status=f"{ops} ops, {kills} kills")


def render(app: Application, res) -> None:
    ops = res.ops
    app.out.print(f"stress {res.pool}: {'passed' if res.passed else 'FAILED'}")
    app.out.print(f"  {res.nodes} nodes for {res.seconds:.1f} s, seed {res.seed}, memory "
                  f"{res.memory_model}, sync {res.sync}")
    app.out.print(f"  {ops['total']} ops ({res.ops_per_s:g}/s): "
                  + ", ".join(f"{k} {n}" for k, n in ops.items() if k != "total")
                  + f"; pool full {res.pool_full} times")
    app.out.print(f"  kills {res.kills}, restarts {res.restarts}; pauses {res.pauses} "
                  f"({res.pauses_reaped} reaped meanwhile, {res.resumes} resumed, "
                  f"{res.paused_kills} killed), reaps {res.reaps}, fenced {res.fenced}, "
                  f"hung {res.hangs}")
    kv = res.kv
    app.out.print(f"  kv: {kv.get('stored_blocks', 0)} blocks stored, "
                  f"{kv.get('loaded_blocks', 0)} loaded, {kv.get('evictions', 0)} evicted; "
                  f"lease {res.lease_s:g} s, quarantine grace {res.grace_s:g} s")
    lat = Table(title="latency (µs)", title_justify="left", box=None)
    for col in ("", "p50", "p99"):
        lat.add_column(col, justify="right" if col else "left")
    for kind, q in res.latency.items():
        lat.add_row(kind, *("-" if q[p] is None else f"{q[p]:.1f}" for p in ("p50", "p99")))
    app.out.print(lat)
    checks = Table(title="checks", title_justify="left", box=None)
    for col in ("check", "result", "detail"):
        checks.add_column(col)
    for name, c in res.checks.items():
        checks.add_row(name, "ok" if c["passed"] else "FAILED", c["detail"])
    app.out.print(checks)
