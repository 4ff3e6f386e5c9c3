"""LMCache: store / retrieve through the cxlkv plugin vs LMCache's local CPU backend.

Two LMCache engines (LMCacheEngineBuilder, CPU), same process, same run, the
order alternating run by run:

  local   LMCache with its local CPU backend only (max_local_cpu_size 1 GB)
  cxlkv   LMCache with the cxlkv storage plugin on a scratch pool in
          /dev/shm; before each retrieve its local CPU copies are cleared,
          so the chunks come from the pool

Each run stores a prompt of --tokens tokens (new tokens each run) through
LMCacheEngine.store and retrieves it through LMCacheEngine.retrieve into a
zeroed KV buffer, checked bit for bit; medians over --runs.  The KV: 16
layers, 8 KV heads of 128, bf16 (64 KiB a token), chunks of 256 tokens.

    cxlkv bench run lmcache [--tokens 1024] [--runs 5] [--json]

Needs LMCache: run from the main venv it runs itself under .venv-lmcache
(scripts/setup --engines; or --python PATH).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import cxlkv
from cxlkv.bench import harness
from cxlkv.errors import Unavailable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENV_PYTHON = os.path.join(ROOT, ".venv-lmcache", "bin", "python")
L, H, D, CHUNK = 16, 8, 128, 256


def engine(instance: str, pool: str | None):
    """An LMCacheEngine on CPU, with the cxlkv plugin when `pool` is given."""
    import torch
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.gpu_connector import GPUConnectorInterface
    from lmcache.v1.metadata import LMCacheMetadata

    class CPUConnector(GPUConnectorInterface):
        """The serving engine's KV as one CPU tensor [layers, K/V, tokens, heads, dim]."""

        def get_shape(self, num_tokens):
            return torch.Size([2, L, num_tokens, H * D])

        def from_gpu(self, memory_obj, start, end, **kw):
            memory_obj.tensor.copy_(kw["kvcaches"][:, :, start:end].transpose(0, 1)
                                    .reshape(memory_obj.tensor.shape))

        def to_gpu(self, memory_obj, start, end, **kw):
            kw["kvcaches"][:, :, start:end].copy_(
                memory_obj.tensor.reshape(2, L, end - start, H, D).transpose(0, 1))

        def batched_from_gpu(self, memory_objs, starts, ends, **kw):
            for o, s, e in zip(memory_objs, starts, ends):
                self.from_gpu(o, s, e, **kw)

        def batched_to_gpu(self, memory_objs, starts, ends, **kw):
            for o, s, e in zip(memory_objs, starts, ends):
                self.to_gpu(o, s, e, **kw)

    extra = None
    if pool:
        extra = {"storage_plugin.cxlkv.module_path": "cxlkv.integrations.lmcache",
                 "storage_plugin.cxlkv.class_name": "CxlkvLMCacheBackend", "cxlkv.pool": pool}
    cfg = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, local_cpu=True,
                                            max_local_cpu_size=1.0,
                                            storage_plugins=["cxlkv"] if pool else None,
                                            extra_config=extra)
    md = LMCacheMetadata(model_name="bench/model", world_size=1, local_world_size=1,
                         worker_id=0, local_worker_id=0, kv_dtype=torch.bfloat16,
                         kv_shape=(L, 2, CHUNK, H, D), chunk_size=CHUNK)
    eng = LMCacheEngineBuilder.get_or_create(instance, cfg, md, CPUConnector(),
                                             lambda t, r: None, lambda o, r: o)
    eng.post_init()
    return eng


def _measure(tokens: int, runs: int, progress) -> dict:
    import torch
    d = harness.scratch_dir("cxlkv-lmcache-")
    try:
        nbytes = tokens * L * 2 * H * D * 2
        pool = os.path.join(d, "pool")
        cxlkv.init_pool(pool, {"size": max(256 << 20, (runs + 2) * nbytes)})   # no eviction
        engines = {"local": engine("bench-local", None), "cxlkv": engine("bench-cxlkv", pool)}
        times = {f"{n}_{op}": [] for n in engines for op in ("store", "retrieve")}
        exact = True
        for r in range(runs):
            progress(f"run {r + 1} of {runs}")
            toks = [1 + (r * tokens + i) % 50000 for i in range(tokens)]
            toks[0] = 100000 + r                         # new chunk hashes each run
            g = torch.Generator().manual_seed(r)
            kv = torch.randn(L, 2, tokens, H, D, generator=g).to(torch.bfloat16)
            order = ("local", "cxlkv") if r % 2 == 0 else ("cxlkv", "local")
            for name in order:
                eng = engines[name]
                t0 = time.perf_counter()
                eng.store(toks, kvcaches=kv)
                t1 = time.perf_counter()
                if name == "cxlkv":           # the chunks must come from the pool
                    eng.storage_manager.storage_backends["LocalCPUBackend"].clear()
                out = torch.zeros_like(kv)
                t2 = time.perf_counter()
                got = int(eng.retrieve(toks, kvcaches=out).sum())
                t3 = time.perf_counter()
                full = tokens // CHUNK * CHUNK
                exact = exact and got == full and torch.equal(out[:, :, :full], kv[:, :, :full])
                if name == "local":
                    eng.storage_manager.storage_backends["LocalCPUBackend"].clear()
                times[f"{name}_store"].append(t1 - t0)
                times[f"{name}_retrieve"].append(t3 - t2)
        for eng in engines.values():
            eng.close()
        med = {k: harness.median(v) for k, v in times.items()}
        gbps = {k: nbytes / v / 1e9 for k, v in med.items()}
        progress("memcpy baseline")
        return {"tokens": tokens, "bytes": nbytes, "runs": runs,
                "store_gbps": {"local": gbps["local_store"], "cxlkv": gbps["cxlkv_store"]},
                "retrieve_gbps": {"local": gbps["local_retrieve"],
                                  "cxlkv": gbps["cxlkv_retrieve"]},
                "store_vs_local": gbps["cxlkv_store"] / gbps["local_store"],
                "retrieve_vs_local": gbps["cxlkv_retrieve"] / gbps["local_retrieve"],
                "memcpy_gbps": harness.memcpy_gbps(total=min(nbytes, 64 << 20)),
                "bit_exact": bool(exact)}
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _have_lmcache() -> bool:
    try:
        import lmcache.v1.cache_engine  # noqa: F401
        return True
    except Exception:
        return False


def add_arguments(ap) -> None:
    ap.add_argument("--tokens", type=int, default=1024, help="prompt tokens (64 KiB of KV each)")
    ap.add_argument("--runs", type=int, default=5, help="runs, alternating the order")
    ap.add_argument("--python", default=os.environ.get("CXLKV_LMCACHE_PYTHON") or VENV_PYTHON,
                    help="an interpreter with LMCache, when this one has none")


def run(a, progress) -> dict:
    if _have_lmcache():
        return _measure(a.tokens, a.runs, progress)
    if not os.path.exists(a.python):
        raise Unavailable(f"LMCache is not importable here and there is no {a.python} "
                          "(scripts/setup --engines makes it)")
    progress(f"running under {a.python}")
    r = subprocess.run([a.python, "-m", "cxlkv.bench.lmcache_plugin", "--tokens",
                        str(a.tokens), "--runs", str(a.runs)],
                       env=harness.child_env(), capture_output=True, text=True, timeout=1800)
    if r.returncode:
        raise Unavailable(f"{a.python}: {(r.stderr.strip().splitlines() or ['failed'])[-1]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def render(r: dict) -> str:
    return "\n".join([
        f"LMCache, {r['tokens']} tokens ({r['bytes'] >> 20} MiB of KV), medians of {r['runs']} "
        "runs",
        f"{'':9} {'local CPU':>10} {'cxlkv':>10} {'ratio':>7}",
        f"{'store':9} {r['store_gbps']['local']:>5.2f} GB/s {r['store_gbps']['cxlkv']:>5.2f} GB/s "
        f"{r['store_vs_local']:>6.2f}x",
        f"{'retrieve':9} {r['retrieve_gbps']['local']:>5.2f} GB/s "
        f"{r['retrieve_gbps']['cxlkv']:>5.2f} GB/s {r['retrieve_vs_local']:>6.2f}x",
        f"memcpy (same run): {r['memcpy_gbps']:.2f} GB/s; retrieved bit-exact: {r['bit_exact']}"])


def ok(r: dict) -> bool:
    return bool(r["bit_exact"])


if __name__ == "__main__":              # the run under the LMCache venv
    import argparse
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args()
    print(json.dumps(harness.jsonable(_measure(args.tokens, args.runs,
                                               lambda s: print(s, file=sys.stderr)))))
