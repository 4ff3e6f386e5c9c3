"""`cxlkv bench`: the pool's figures, each beside a same-run baseline.

`cxlkv bench` (and `--scale`) runs the suites as always; `cxlkv bench run NAME
[ARGS]` runs one scenario of cxlkv.bench (the figure families that have
options of their own: spill, ttft, lock-scale, ...).  A group with the
suites as its own callback keeps every `cxlkv bench` command line working,
and gives the scenarios one place that lists them and passes their options
through untouched (each scenario parses its own, --help and --json included).
"""
from __future__ import annotations

from contextlib import contextmanager

import click
from rich.table import Table

from cxlkv.cli.app import Application, exit_codes_epilog, json_option, pass_app
from cxlkv.errors import UsageError

SCALE_SCENARIOS = ("full-pool", "procs", "manager", "attach", "recovery")


@click.group("bench", invoke_without_command=True, epilog=exit_codes_epilog(),
             subcommand_metavar="[run NAME [ARGS]...]")
@click.option("--pool", "pool", metavar="PATH", default=None,
              help="Run the KV scenarios (put/get, lookup, handoff) on this existing pool, "
                   "in a namespace of their own that is dropped after; refused when the pool "
                   "lacks room for them (the bench never evicts other blocks).  Without it "
                   "they run on a scratch pool.")
@click.option("--scale", is_flag=True,
              help="Measure the rack-scale costs instead (see --scale-only): full-pool "
                   "stores at a small and a large hash table, store and lock throughput "
                   "at 1-8 processes, the lock manager, attach of a 16 GiB pool, "
                   "recovery of a dead node; a few minutes.")
@click.option("--scale-only", metavar="LIST", default=",".join(SCALE_SCENARIOS),
              show_default=True, help="With --scale: the scenarios to run.")
@click.option("--scale-entries", metavar="N,N", default="65536,1048576", show_default=True,
              help="With --scale: hash-table slots of the full-pool scenario (the largest "
                   "is compared with the smallest).")
@click.option("--scale-procs", metavar="N,..", default="1,2,4,8", show_default=True,
              help="With --scale: process counts (4 and 8 are compared with the best of "
                   "1-2; the largest is the lock manager's client count).")
@click.option("--scale-stores", type=click.IntRange(2), default=40, show_default=True,
              help="With --scale: timed full-pool stores per table size.")
@click.option("--scale-seconds", type=click.FloatRange(0.01), default=0.5,
              show_default=True, help="With --scale: seconds of each throughput window.")
@click.option("--scale-rounds", type=click.IntRange(1), default=3, show_default=True,
              help="With --scale: rounds over the process counts (each count's median "
                   "is its figure; the order alternates between rounds).")
@click.option("--scale-attach-size", metavar="SIZE", default="16G", show_default=True,
              help="With --scale: size of the pool whose attach is timed.")
@click.option("--scale-slabs", type=click.IntRange(1), default=10_000, show_default=True,
              help="With --scale: slabs the killed node holds.")
@json_option
@click.pass_context
def bench_cmd(ctx: click.Context, pool, scale, scale_only, scale_entries, scale_procs,
              scale_stores, scale_seconds, scale_rounds, scale_attach_size, scale_slabs,
              as_json):
    """Measure the pool against baselines measured in the same run.

    Runs on scratch pools it makes in /dev/shm and removes after: pool writes
    and reads vs a numpy memcpy of the same blocks; uncontended pool.lock()
    acquire+release in cas mode and in manager mode (a lock manager is started
    for the run); allocator alloc+free pairs per second (batch calls);
    allocator utilisation on a long-context trace vs a buddy allocator
    replaying the same trace.  Then the KV cache: kv.store and kv.load_into
    of 64 MiB in 256 KiB blocks vs memcpy; kv.match of 32K tokens; and a
    64 MiB prefix handed from a producer process to a consumer process
    through the pool, against the same bytes through a /dev/shm mapping, a
    loopback TCP stream and a redis-server started for the run (127.0.0.1).
    Takes under a minute.

    --scale measures the rack-scale costs instead (pool-size and process
    count independence), each beside its same-run baseline and target.

    `cxlkv bench run` lists the other scenarios; `cxlkv bench run NAME
    [ARGS]` runs one (`cxlkv bench run NAME --help` for its options).
    """
    app = ctx.find_object(Application)
    if ctx.invoked_subcommand is not None:
        given = [p.opts[0] for p in ctx.command.params
                 if p.name != "as_json"
                 and ctx.get_parameter_source(p.name) != click.core.ParameterSource.DEFAULT]
        if given:
            raise UsageError(f"{', '.join(given)} {'does' if len(given) == 1 else 'do'} not "
                             f"apply to `cxlkv bench {ctx.invoked_subcommand}`")
        return
    if scale:
        from cxlkv.cli.bench_scale import scale_cmd

        if pool is not None:
            raise UsageError("--pool does not apply to --scale (it runs on scratch pools)")

        scale_cmd(app, _progress, only=scale_only, entries=scale_entries, procs=scale_procs,
                  stores=scale_stores, seconds=scale_seconds, rounds=scale_rounds,
                  attach_size=scale_attach_size, slabs=scale_slabs)
        return
    from cxlkv.bench import suite

    with _progress(app, suite.STEPS) as progress:
        res = suite.run(progress, pool_path=pool)
    if app.json:
        app.emit_json(res)
        return
    t = Table(title="cxlkv bench", title_justify="left")
    for col in ("figure", "value", "baseline", "ratio", "target"):
        t.add_column(col, justify="left" if col in ("figure", "target") else "right")

    def target(key):
        if key not in suite.TARGETS:
            return ""
        op, v = suite.TARGETS[key]
        ok = res["targets"][key]
        return f"{op} {v:g} " + ("met" if ok else "MISSED" if ok is False else "n/a")

    def num(key, fmt=".2f"):
        v = res.get(key)
        return "n/a" if v is None else format(v, fmt)

    rows = [
        ("memcpy GB/s", num("memcpy_gbps"), "", "", ""),
        ("pool write GB/s (NT)", num("pool_write_gbps"), "memcpy",
         num("pool_write_vs_memcpy"), ""),
        ("pool read GB/s", num("pool_read_gbps"), "memcpy", num("pool_read_vs_memcpy"), ""),
        ("lock cas us", num("lock_cas_us", ".3f"), "", "", target("lock_cas_us")),
        ("lock manager us", num("lock_manager_us", ".1f"), "", "", target("lock_manager_us")),
        ("alloc+free ops/s", f"{res['alloc_ops_per_s'] / 1e6:.2f} M", "", "",
         target("alloc_ops_per_s")),
        ("alloc utilisation", num("alloc_utilisation", ".3f"),
         f"buddy {res['buddy_utilisation']:.3f}", num("utilisation_vs_buddy"),
         target("alloc_utilisation")),
        ("kv put GB/s", num("put_gbps"), "memcpy", num("put_vs_memcpy"),
         target("put_vs_memcpy")),
        ("kv get GB/s", num("get_gbps"), "memcpy", num("get_vs_memcpy"),
         target("get_vs_memcpy")),
        (f"kv match {res.get('lookup_tokens', 32768)} tokens ms", num("lookup_32k_ms", ".3f"),
         f"list {num('lookup_32k_list_ms', '.3f')}", "", target("lookup_32k_ms")),
        ("handoff GB/s (pool)", num("handoff_gbps"), "", "", ""),
        ("handoff GB/s (pool, streamed)", num("handoff_stream_gbps"), "tcp",
         num("handoff_stream_vs_tcp"), target("handoff_stream_vs_tcp")),
        ("  vs /dev/shm", num("shm_handoff_gbps"), "shm", num("handoff_vs_shm"),
         target("handoff_vs_shm")),
        ("  vs TCP", num("tcp_gbps"), "tcp", num("handoff_vs_tcp"), target("handoff_vs_tcp")),
        ("  vs redis", num("redis_gbps"), "redis", num("handoff_vs_redis"),
         target("handoff_vs_redis")),
    ]
    for r in rows:
        t.add_row(*r)
    app.out.print(t)
    cm = res.get("copy_modes")
    if cm:
        app.out.print(f"copy modes: read {cm['read']}, write {cm['write']} ({cm['source']})")
    if res.get("kv_pool"):
        app.out.print(f"KV scenarios ran on {res['kv_pool']} (namespace "
                      f"{res['kv_namespace']}, dropped)")
    for key, note in res["notes"].items():
        app.out.print(f"{key}: {note}")


@bench_cmd.command("run", add_help_option=False,
                   context_settings={"ignore_unknown_options": True,
                                     "allow_interspersed_args": False})
@click.argument("name", required=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@pass_app
def run_cmd(app: Application, name, args):
    """Run one bench scenario: NAME [ARGS] (NAME --help: its options).

    Without NAME, list the scenarios.  Each runs on scratch pools it removes
    after and reports its figures beside the baselines it measures in the
    same run; --json prints them as one JSON document.
    """
    from cxlkv.bench import harness

    if name in ("-h", "--help"):
        app.out.print(click.get_current_context().get_help())
        return
    if name == "--json" and not args:           # `cxlkv bench run --json`: the list
        name = None
    elif name is not None and name.startswith("-"):
        raise UsageError(f"`cxlkv bench run` takes a scenario name before its options, not "
                         f"{name} (`cxlkv bench run` lists them)")
    if name is None:
        if app.json:
            app.emit_json({n: harness.describe(n) for n in harness.SCENARIOS})
            return
        for n in harness.SCENARIOS:
            app.out.print(f"{n:12s} {harness.describe(n)}")
        return
    if "-h" in args or "--help" in args:
        app.out.print(harness.parser(name).format_help().rstrip())
        return
    opts = harness.parse(name, list(args))
    app.json = app.json or opts.json
    progress = (lambda step: None) if app.json else \
        (lambda step: app.info(f"bench {name}: {step}"))
    res = harness.run(name, opts, progress)
    if app.json:
        app.emit_json(harness.jsonable(res))
    else:
        app.out.print(harness.render(name, res))
    if not harness.ok(name, res):
        raise click.exceptions.Exit(1)


@contextmanager
def _progress(app: Application, steps):
    """A progress bar over the bench's steps on stderr; plain step lines when
    stderr is not a terminal; nothing with --json.  Yields progress(step)."""
    if app.json:
        yield lambda step: None
        return
    if not app.err.is_terminal:
        yield lambda step: app.info(f"bench: {step}")
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, \
        TimeElapsedColumn

    with Progress(TextColumn("bench"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.description}"), TimeElapsedColumn(), console=app.err,
                  transient=True) as p:
        task = p.add_task("", total=len(steps))
        seen = []

        def progress(step):
            if seen:
                p.advance(task)
            seen.append(step)
            p.update(task, description=step)

        yield progress
