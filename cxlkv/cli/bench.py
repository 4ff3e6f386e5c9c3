"""`cxlkv bench`: the pool's figures, each beside a same-run baseline."""
from __future__ import annotations

import click
from rich.table import Table

from cxlkv.cli.app import Application, exit_codes_epilog, json_option, pass_app


@click.command("bench", epilog=exit_codes_epilog())
@json_option
@pass_app
def bench_cmd(app: Application, as_json):
    """Measure the pool against baselines measured in the same run.

    Runs on scratch pools it makes in /dev/shm and removes after: pool writes
    and reads vs a numpy memcpy of the same blocks; uncontended pool.lock()
    acquire+release in cas mode and in manager mode (a lock manager is started
    for the run); allocator alloc+free pairs per second (batch
    calls); allocator utilisation on a long-context trace vs a buddy
    allocator replaying the same trace.  Takes about a minute.
    """
    from cxlkv.benchmarks import TARGETS, run

    def progress(step):
        if not app.json:
            app.info(f"bench: {step}")

    res = run(progress)
    if app.json:
        app.emit_json(res)
        return
    t = Table(title="cxlkv bench", title_justify="left")
    for col in ("figure", "value", "baseline", "ratio", "target"):
        t.add_column(col, justify="left" if col in ("figure", "target") else "right")

    def target(key):
        if key not in TARGETS:
            return ""
        op, v = TARGETS[key]
        ok = res["targets"][key]
        return f"{op} {v:g} " + ("met" if ok else "MISSED" if ok is False else "n/a")

    rows = [
        ("memcpy GB/s", f"{res['memcpy_gbps']:.2f}", "", "", ""),
        ("pool write GB/s (NT)", f"{res['pool_write_gbps']:.2f}", "memcpy",
         f"{res['pool_write_vs_memcpy']:.2f}", ""),
        ("pool read GB/s", f"{res['pool_read_gbps']:.2f}", "memcpy",
         f"{res['pool_read_vs_memcpy']:.2f}", ""),
        ("lock cas us", f"{res['lock_cas_us']:.3f}", "", "", target("lock_cas_us")),
        ("lock manager us", "n/a" if res["lock_manager_us"] is None
         else f"{res['lock_manager_us']:.1f}", "", "", target("lock_manager_us")),
        ("alloc+free ops/s", f"{res['alloc_ops_per_s'] / 1e6:.2f} M", "", "",
         target("alloc_ops_per_s")),
        ("alloc utilisation", f"{res['alloc_utilisation']:.3f}",
         f"buddy {res['buddy_utilisation']:.3f}", f"{res['utilisation_vs_buddy']:.2f}",
         target("alloc_utilisation")),
    ]
    for r in rows:
        t.add_row(*r)
    app.out.print(t)
    for key, note in res["notes"].items():
        app.out.print(f"{key}: {note}")
