"""The hit path at memory speed: KV from the pool into an engine's layout vs memcpy.

Every figure is a ratio to a numpy memcpy of the same bytes measured in the
same run, under the same load:

  load_prefix   transformers: a 4K-token prefix of the tiny Llama's layout
                (4 layers, 2 KV heads, head_dim 64, float32: 16 MiB) from the
                pool into a fresh DynamicCache, end to end (pin, gather,
                release); beside it the former torch.stack gather
  paged load    the vLLM connector's load: the same blocks, vLLM's block
                layout, into per-layer paged caches [blocks, heads, 16, C]
                at a random block table, one strided pass per layer; beside
                it the former stack + index_copy_
  store_prefix  the other way: the cache's layer tensors into new blocks in
                one pass (KVCache.store_with); beside it the former gather
                into staging blocks + kv.store
  put / get     kv.store / kv.load_into of 64 MiB in 256 KiB blocks (as
                `cxlkv bench`), under each copy mode

idle, then with a CPU-bound process beside it (--no-load skips that).  The
copy modes in use (cxlkv._core.copymode) are printed; each candidate is
measured, so the calibrated choice can be checked against the table.

    cxlkv bench run hitpath [--tokens 4096] [--runs 9] [--no-load] [--json]

Needs torch and transformers (pip install -e '.[transformers]').
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings

import numpy as np

import cxlkv
from cxlkv._core import copymode
from cxlkv.bench import harness
from cxlkv.bench import kv as kvbench
from cxlkv.errors import UsageError

HINT = "pip install -e '.[transformers]'"
#: targets (ratio to memcpy of the same bytes, same run)
TARGETS = {"load_prefix": 0.5, "paged_load": 0.5, "put": 0.8, "get": 0.8}
LAYERS, KV_HEADS, HEAD_DIM, BLOCK_TOKENS = 4, 2, 64, 16


def _tensor(torch, view):
    """torch.frombuffer of a read-only pool view, as the former paths did."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(view, dtype=torch.float32)


def _hit_figures(torch, hf, kvcopy, pool, tokens: int, runs: int) -> dict:
    lay = hf.BlockLayout(LAYERS, KV_HEADS, HEAD_DIM, BLOCK_TOKENS, torch.float32)
    name = f"bench-hitpath-{os.getpid()}"
    kv = pool.kv(model=name, block_tokens=BLOCK_TOKENS, block_bytes=lay.block_bytes)
    try:
        mkv = hf.ModelKV(kv, lay)
        nb = tokens // BLOCK_TOKENS
        nbytes = nb * lay.block_bytes
        ids = torch.arange(tokens + 1, dtype=torch.int64)[None] % 30000
        toks = ids[0, :nb * BLOCK_TOKENS].numpy().astype(np.uint32)
        if kv.store(toks, harness.buffer(nbytes, seed=5)) != nb:
            raise RuntimeError("hitpath bench: the prefix was not stored whole")
        out = {"kv_bytes": nbytes}

        def load_prefix():
            cache, n = hf.load_prefix(mkv, ids)
            if n != tokens:
                raise RuntimeError(f"hitpath bench: load_prefix found {n} of {tokens} tokens")

        def stack_gather():                      # the former load_prefix gather
            with kv.load(toks) as views:
                srcs = [_tensor(torch, v).view(lay.shape) for v in views]
                buf = torch.stack(srcs, dim=3)
                del srcs, buf

        # the vLLM layout: [layers][heads][block_size][C = K and V of head_dim]
        c = 2 * HEAD_DIM
        rng = np.random.default_rng(7)
        nblocks = nb * 2
        caches = [torch.zeros((nblocks, KV_HEADS, BLOCK_TOKENS, c)) for _ in range(LAYERS)]
        table = [int(x) for x in rng.permutation(nblocks)[:nb]]

        def paged_load():                        # CxlkvConnector._load_step, every layer
            with kv.load(toks) as views:
                for li in range(LAYERS):
                    kvcopy.paged_layer(views, lay.block_bytes, li, caches[li], table,
                                       KV_HEADS, BLOCK_TOKENS)

        ids_t = torch.tensor(table, dtype=torch.long)

        def index_copy_load():                   # the former connector load
            with kv.load(toks) as views:
                srcs = [_tensor(torch, v).view(
                    LAYERS, KV_HEADS, BLOCK_TOKENS, c) for v in views]
                staged = torch.stack(srcs)
                del srcs
            for li in range(LAYERS):
                caches[li].index_copy_(0, ids_t, staged[:, li])

        # the store direction (store_prefix): a cache's layer tensors into new
        # blocks (fresh tokens each call; the pool has room for every call)
        g = torch.Generator().manual_seed(11)
        layers_kv = [(torch.randn((1, KV_HEADS, tokens, HEAD_DIM), generator=g),
                      torch.randn((1, KV_HEADS, tokens, HEAD_DIM), generator=g))
                     for _ in range(LAYERS)]
        fresh = iter(range(1, 1 << 30))

        def new_tokens():
            return toks.astype(np.int64) + next(fresh) * 100_000

        def store_one_pass():                    # store_prefix: store_with + kv_scatter
            kv.store_with(new_tokens(), lambda which, target: kvcopy.hf_store(
                layers_kv, target, BLOCK_TOKENS, which))

        def store_staged():                      # the former store_prefix: gather, then store
            stage = np.empty(nbytes, dtype=np.uint8)
            mv = memoryview(stage)
            bb = lay.block_bytes
            kvcopy.hf_store(layers_kv, [mv[i * bb:(i + 1) * bb] for i in range(nb)],
                            BLOCK_TOKENS)
            kv.store(new_tokens(), stage)

        src, dst = harness.buffer(nbytes, seed=4), harness.buffer(nbytes)

        def memcpy():
            dst[:] = src

        figs = {"memcpy": memcpy, "load_prefix": load_prefix, "stack": stack_gather,
                "paged_load": paged_load, "index_copy": index_copy_load,
                "store_prefix": store_one_pass, "store_staged": store_staged}
        for f in figs.values():                  # warm: pages touched, pools allocated
            f()
        times: dict = {k: [] for k in figs}
        for _ in range(runs):                    # interleaved: each run beside its memcpy
            for k, f in figs.items():
                t = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t)
        out["memcpy_gbps"] = nbytes / harness.median(times["memcpy"]) / 1e9
        for k in figs:
            if k == "memcpy":
                continue
            out[f"{k}_ms"] = harness.median(times[k]) * 1e3
            out[f"{k}_vs_memcpy"] = harness.median(
                m / x for m, x in zip(times["memcpy"], times[k]))
        return out
    finally:
        kv.drop()


def _put_get(pool, runs: int) -> dict:
    """put/get under every copy mode, each timed rep beside a memcpy of the
    same bytes: a mode's ratio is the median of its reps' ratios (the best of
    its two turns), and the current modes' are the figures judged."""
    total = 64 * harness.MiB
    cur = copymode.modes()
    mc = harness.Memcpy(total)
    res: dict = {}
    base: list = []
    try:
        for read, write in (("plain", "nt"), ("nt", "clwb"), ("plain", "clwb"), ("nt", "nt")):
            copymode.use(read, write)
            r = kvbench.kv_put_get_paired(pool, f"bench-hitpath-pg-{os.getpid()}", total,
                                          reps=max(3, runs // 2), memcpy=mc)
            base += r["reps"]["memcpy"]
            for k, mode, fig in (("put", write, "put_gbps"), ("get", read, "get_gbps"),
                                 ("put_vs", write, "put_vs_memcpy"),
                                 ("get_vs", read, "get_vs_memcpy")):
                res.setdefault(k, {}).setdefault(mode, []).append(r[fig])
    finally:
        copymode.use(cur["read"], cur["write"])
    res = {k: {mode: max(v) for mode, v in d.items()} for k, d in res.items()}
    return {"memcpy_gbps": harness.median(base), "put_gbps": res["put"], "get_gbps": res["get"],
            "put_vs_memcpy_by_mode": res["put_vs"], "get_vs_memcpy_by_mode": res["get_vs"],
            "put_vs_memcpy": res["put_vs"][cur["write"]],
            "get_vs_memcpy": res["get_vs"][cur["read"]],
            "best_put_vs_memcpy": max(res["put_vs"].values()),
            "best_get_vs_memcpy": max(res["get_vs"].values())}


def _round(d):
    if isinstance(d, dict):
        return {k: _round(v) for k, v in d.items()}
    return round(d, 3) if isinstance(d, float) else d


def measure(tokens: int = 4096, runs: int = 9, load: bool = True, progress=None) -> dict:
    torch = harness.require_module("torch", HINT)
    harness.require_module("transformers", HINT)
    from cxlkv.integrations import kvcopy
    from cxlkv.integrations import transformers as hf

    progress = progress or (lambda s: None)
    modes = kvcopy.prepare()
    out = {"copy_modes": modes, "tokens": tokens, "runs": runs, "conditions": {}}
    with harness.scratch("cxlkv-bench-hitpath-") as d:
        need = tokens * LAYERS * 2 * KV_HEADS * HEAD_DIM * 4
        # the prefix, the two stores of every run and warm-up (nothing evicted
        # inside a timed store), put/get
        path = harness.scratch_pool(os.path.join(d, "hit.pool"),
                                    max(256 * harness.MiB, 2 * need + 160 * harness.MiB)
                                    + 2 * (runs + 1) * need)
        harness.materialize(path)
        with cxlkv.open_pool(path) as pool:
            harness.map_in(pool)        # timed stores write pages this process mapped
            for cond in (("idle", "loaded") if load else ("idle",)):
                busy = None
                if cond == "loaded":
                    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                            cwd=harness.CHILD_CWD)
                try:
                    progress(f"{cond}: load_prefix and paged load")
                    r = _hit_figures(torch, hf, kvcopy, pool, tokens, runs)
                    progress(f"{cond}: put and get")
                    r["put_get"] = _put_get(pool, runs)
                finally:
                    if busy is not None:
                        busy.kill()
                        busy.wait()
                out["conditions"][cond] = _round(r)
    out["targets"] = {c: {"load_prefix": r["load_prefix_vs_memcpy"] >= TARGETS["load_prefix"],
                          "paged_load": r["paged_load_vs_memcpy"] >= TARGETS["paged_load"],
                          "put": r["put_get"]["put_vs_memcpy"] >= TARGETS["put"],
                          "get": r["put_get"]["get_vs_memcpy"] >= TARGETS["get"]}
                      for c, r in out["conditions"].items()}
    return out


def render(r: dict) -> str:
    m = r["copy_modes"]
    lines = [f"copy modes: read={m['read']} write={m['write']} ({m['source']})",
             f"{r['tokens']}-token prefix, tiny Llama layout; ratios to numpy memcpy of the "
             f"same bytes, same run; medians of {r['runs']}"]
    for cond, c in r["conditions"].items():
        pg = c["put_get"]
        t = r["targets"][cond]

        def mark(ok):
            return "met" if ok else "MISSED"
        lines += [
            f"[{cond}] memcpy {c['memcpy_gbps']:.2f} GB/s ({c['kv_bytes'] >> 20} MiB)",
            f"  load_prefix      {c['load_prefix_ms']:7.2f} ms  {c['load_prefix_vs_memcpy']:.2f}x"
            f"  (target >= {TARGETS['load_prefix']}: {mark(t['load_prefix'])}; former "
            f"torch.stack gather {c['stack_vs_memcpy']:.2f}x)",
            f"  paged load       {c['paged_load_ms']:7.2f} ms  {c['paged_load_vs_memcpy']:.2f}x"
            f"  (target >= {TARGETS['paged_load']}: {mark(t['paged_load'])}; former "
            f"stack + index_copy_ {c['index_copy_vs_memcpy']:.2f}x)",
            f"  store_prefix     {c['store_prefix_ms']:7.2f} ms  "
            f"{c['store_prefix_vs_memcpy']:.2f}x  (one pass into the reserved slots; former "
            f"gather + store {c['store_staged_vs_memcpy']:.2f}x)",
            f"  put  {pg['put_vs_memcpy']:.2f}x memcpy ({pg['memcpy_gbps']:.2f} GB/s) with "
            f"write={m['write']}; " + ", ".join(f"{k} {v:.2f} GB/s"
                                               for k, v in pg["put_gbps"].items())
            + f"  (target >= {TARGETS['put']}: {mark(t['put'])})",
            f"  get  {pg['get_vs_memcpy']:.2f}x memcpy with read={m['read']}; "
            + ", ".join(f"{k} {v:.2f} GB/s" for k, v in pg["get_gbps"].items())
            + f"  (target >= {TARGETS['get']}: {mark(t['get'])})"]
    return "\n".join(lines)


def add_arguments(ap) -> None:
    ap.add_argument("--tokens", type=int, default=4096, help="prefix length in tokens")
    ap.add_argument("--runs", type=int, default=9, help="timed runs per figure")
    ap.add_argument("--no-load", action="store_true",
                    help="skip the run with a CPU-bound process beside it")


def run(a, progress) -> dict:
    if a.tokens < BLOCK_TOKENS or a.runs < 1:
        raise UsageError(f"--tokens must be >= {BLOCK_TOKENS} and --runs >= 1")
    return measure(a.tokens // BLOCK_TOKENS * BLOCK_TOKENS, a.runs, not a.no_load, progress)


def ok(r: dict) -> bool:
    """The scenario ran (figures are reported whether or not targets are met)."""
    return bool(r["conditions"])
