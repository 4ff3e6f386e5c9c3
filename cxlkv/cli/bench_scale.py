"""`cxlkv bench --scale`: parse the scale options, run, render."""
from __future__ import annotations

from rich.table import Table

from cxlkv.bench import scale
from cxlkv.cli.app import Application
from cxlkv.errors import UsageError
from cxlkv.util.sizes import parse_size


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UsageError(f"{what} must be comma-separated whole numbers, not {text!r}") from None
    if not vals or min(vals) < 1:
        raise UsageError(f"{what} must name at least one number >= 1")
    return vals


def scale_cmd(app: Application, progress_cm, *, only: str, entries: str, procs: str,
              stores: int, seconds: float, rounds: int, attach_size: str, slabs: int) -> None:
    chosen = tuple(s.strip() for s in only.split(",") if s.strip())
    bad = [s for s in chosen if s not in scale.SCENARIOS]
    if bad or not chosen:
        raise UsageError(f"unknown --scale-only scenario {', '.join(bad) or '(none)'}: choose "
                         f"from {', '.join(scale.SCENARIOS)}")
    ent = _ints(entries, "--scale-entries")
    if any(e & (e - 1) or e < 1024 for e in ent):
        raise UsageError("--scale-entries must be powers of two >= 1024")
    kw = dict(only=chosen, entries=ent, procs=_ints(procs, "--scale-procs"), stores=stores,
              seconds=seconds, rounds=rounds,
              attach_size=parse_size(attach_size, "--scale-attach-size"), slabs=slabs)
    with progress_cm(app, scale.steps(chosen, ent, kw["procs"], rounds)) as progress:
        res = scale.run(progress, **kw)
    if app.json:
        app.emit_json(res)
        return
    render(app, res)


def _f(v, fmt=".2f") -> str:
    return "n/a" if v is None else format(v, fmt)


def _c(*vals) -> str:
    """Compact figures, slash-separated: about three significant digits."""
    return "/".join("n/a" if v is None else f"{v:.0f}" if v >= 100 else
                    f"{v:.1f}" if v >= 10 else f"{v:.2f}" if v >= 0.1 else f"{v:.3f}"
                    for v in vals)


def render(app: Application, res: dict) -> None:
    t = Table(title="cxlkv bench --scale", title_justify="left")
    for col in ("figure", "value", "baseline", "ratio", "target"):
        t.add_column(col, justify="left" if col in ("figure", "target") else "right",
                     no_wrap=col in ("figure", "value"))

    def target(key):
        op, v = scale.TARGETS[key]
        ok = res["targets"].get(key)
        return f"{op} {v:g} " + ("met" if ok else "MISSED" if ok is False else "n/a")

    fp = res.get("full_pool") or {}
    sizes = sorted(fp, key=int)
    for s in sizes:
        r = fp[s]
        small = s == sizes[0] and len(sizes) > 1
        t.add_row(f"store ms, {int(s)} slots",
                  _c(r["store_p50_ms"], r["store_p90_ms"], r["store_p99_ms"]),
                  "" if small or len(sizes) < 2 else f"p90 {_c(fp[sizes[0]]['store_p90_ms'])}",
                  "" if small or len(sizes) < 2 else _c(res["store_p90_big_vs_small"]),
                  "" if small or len(sizes) < 2 else target("store_p90_big_vs_small"))
        t.add_row("  lock wait ms",
                  _c(r["lock_wait_p50_ms"], r["lock_wait_p99_ms"]), "", "",
                  "" if small or len(sizes) < 2 else target("lock_wait_p99_big_ms"))
    pr = res.get("procs") or {}
    for what, label in (("store", "kv.store ops/s"), ("lock", "lock ops/s cas"),
                        ("manager_lock", "lock ops/s mgr")):
        for k in sorted(pr, key=int):
            v = pr[k].get(f"{what}_ops_per_s")
            if v is None:
                continue
            key = f"{what}_ops_{k}_vs_best12"
            n = len((pr[k].get("rounds") or {}).get(f"{what}_ops_per_s", ()))
            t.add_row(f"{label}, {k} proc" + (f" (median of {n})" if n > 1 else ""),
                      f"{v:,.0f}",
                      "best 1-2" if res.get(key) is not None else "",
                      _c(res[key]) if res.get(key) is not None else "",
                      target(key) if key in scale.TARGETS else "")
    if res.get("manager_rtt_p50_us") is not None:
        t.add_row(f"manager rtt us, {res.get('manager_clients')} clients",
                  _c(res["manager_rtt_p50_us"], res.get("manager_rtt_p99_us")),
                  "", "", target("manager_rtt_p50_us"))
        t.add_row("manager CPU %, first 1.5 s after a grant",
                  _f(res.get("manager_cooldown_cpu_pct")), "", "", "")
        t.add_row("idle manager CPU %", _f(res.get("manager_idle_cpu_pct")), "", "",
                  target("manager_idle_cpu_pct"))
    if "attach_size" in res:
        gib = res["attach_size"] / (1 << 30)
        t.add_row(f"attach {gib:g} GiB ms", _c(res["attach_ms"]),
                  f"later {_c(res['attach_warm_ms'])}", "", target("attach_ms"))
        t.add_row("  no bytecode cache", _c(res["attach_uncached_ms"]), "", "", "")
        t.add_row("  import of cxlkv.api ms", _c(res["attach_imports_ms"]),
                  f"no cache {_c(res['attach_uncached_imports_ms'])}", "", "")
        t.add_row("  detach ms", _c(res["detach_ms"]), "", "", "")
    if "recovery_slabs" in res:
        t.add_row(f"recovery {res['recovery_slabs']} slabs ms",
                  _c(res["recovery_ms"]), f"attach {_c(res['recovery_attach_ms'])}", "",
                  target("recovery_ms"))
    app.out.print(t)
    app.out.print("store: p50/p90/p99 of 64-block stores into a full pool (each evicts); lock "
                  "wait: p50/p99 of another node's pool.lock() meanwhile; ops/s: all processes "
                  "together; rtt: manager-mode acquire + release, p50/p99; attach: the first "
                  "open_pool in a fresh process, after cxlkv.api was imported (later: the next "
                  "ones); recovery: the "
                  "open_pool that reaps the killed node (baseline: the next one)")
    for key, note in res["notes"].items():
        if "not measured in this run" not in note:
            app.out.print(f"{key}: {note}")
