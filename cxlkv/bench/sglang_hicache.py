"""SGLang HiCache L3: batch_set / batch_get GB/s of the cxlkv backend vs SGLang's own file backend.

Both backends are SGLang's HiCacheStorage subclasses, driven the way SGLang's
cache controller drives them, same process, same run, same host pool (SGLang's
own MHATokenToKVPoolHost or, with --kind mla, MLATokenToKVPoolHost), the
order alternating run by run:

  cxlkv   CxlkvHiCacheStorage (zero-copy forms: batch_set_v1 / batch_get_v1
          with host-pool indices) on a scratch pool in /dev/shm
  file    SGLang's HiCacheFile (its generic path: get_data_page + batch_set;
          batch_get into flat pages + set_from_flat_data_page), its directory
          in /dev/shm too (the same medium: memory)

Each run sets --pages new pages (new keys: both skip present ones), then gets
them back into other host slots, checked bit for bit; medians over --runs.
A memcpy of the same bytes is the machine's baseline.

    cxlkv bench run sglang-hicache [--pages 64] [--runs 5] [--layout page_first]
                                   [--kind mha|mla] [--torch-threads 1] [--json]

Pages: MHA, 16 layers of 8 KV heads of 128, K and V, 16 tokens, bf16: 1 MiB;
MLA (DeepSeek-V3's latent: kv_lora_rank 512 + rope 64), 61 layers, 16 tokens,
bf16: 1.07 MiB, one tensor per layer.

Needs SGLang's storage classes and memory pools: run from the main venv it
runs itself under .venv-sglang (scripts/setup --engines; or --python PATH).
The host pool is SGLang's own, over SGLang's own device pool on device
"cpu", with pin_memory=False (pinning registers the buffer with CUDA, which
needs a GPU; see tests/test_integration_sglang.py).
"""
from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import time
import warnings

import cxlkv
from cxlkv.bench import harness
from cxlkv.errors import Unavailable
from cxlkv.testing.sglang_pools import cpu_host_pool

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENV_PYTHON = os.path.join(ROOT, ".venv-sglang", "bin", "python")
#: the MHA page: 16 layers, 8 KV heads of 128, 16 tokens, bf16, K and V: 1 MiB
LAYERS, HEADS, HEAD_DIM, PAGE = 16, 8, 128, 16
#: the MLA page: DeepSeek-V3's latent row (512 + 64) in 61 layers, 16 tokens, bf16
MLA_LAYERS, KV_LORA_RANK, ROPE_DIM = 61, 512, 64
#: the layouts SGLang's host pools give storage backends pages of, by kind
LAYOUTS = {"mha": ("page_first", "layer_first", "page_first_direct", "page_head"),
           "mla": ("page_first", "layer_first", "page_first_direct")}


def host_pool(kind: str, layout: str, pages: int):
    """SGLang's host pool of `pages` pages (MHATokenToKVPoolHost or
    MLATokenToKVPoolHost) over its device pool of one page on "cpu", with the
    arguments SGLang's build_kv_host_pool passes but pin_memory=False."""
    if layout not in LAYOUTS[kind]:
        raise Unavailable(f"SGLang's {kind} host pool gives backends no {layout} pages "
                          f"(layouts: {', '.join(LAYOUTS[kind])})")
    # SGLang 0.5.23's pools in the page-major layouts whose page axis comes first
    # (MHA page_head, MLA page_first_direct) build their per-layer views by
    # indexing that axis with layer ids: they need at least as many pages as layers
    pages = max(pages, LAYERS if kind == "mha" else MLA_LAYERS)
    if kind == "mha":
        return cpu_host_pool("mha", layout, pages=pages, page=PAGE, layers=LAYERS,
                             heads=HEADS, head_dim=HEAD_DIM, device_tokens=PAGE)
    return cpu_host_pool("mla", layout, pages=pages, page=PAGE, layers=MLA_LAYERS,
                         kv_lora_rank=KV_LORA_RANK, rope_dim=ROPE_DIM, device_tokens=PAGE)


def storage_config(*, layout: str, kind: str, extra: dict | None, tp_rank: int = 0,
                   tp_size: int = 1):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=kind == "mla", enable_storage_metrics=False,
        is_page_first_layout=layout == "page_first", model_name="bench/model",
        extra_config=extra)


def _measure(pages: int, runs: int, layout: str, progress, kind: str = "mha",
             threads: int = 1) -> dict:
    import torch
    torch.set_num_threads(threads)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)     # SGLang's "needs a GPU" notes
        from sglang.srt.mem_cache.hicache_storage import HiCacheFile
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    d = harness.scratch_dir("cxlkv-sglang-")
    try:
        host = host_pool(kind, layout, 2 * pages)
        page_bytes = host.get_data_page(0).numel() * host.dtype.itemsize
        total = pages * page_bytes
        pool = os.path.join(d, "pool")
        cxlkv.init_pool(pool, {"size": max(256 << 20, (runs + 2) * total)})   # no eviction
        cx = StorageBackendFactory.create_backend("dynamic", storage_config(
            layout=layout, kind=kind, extra={"backend_name": "cxlkv", "interface_v1": 1, "pool": pool,
                                  "module_path": "cxlkv.integrations.sglang",
                                  "class_name": "CxlkvHiCacheStorage"}), host)
        cx.register_mem_pool_host(host)
        fb = HiCacheFile(storage_config(layout=layout, kind=kind, extra={
            "file_storage_path": os.path.join(d, "files")}))
        fb.register_mem_pool_host(host)
        src = torch.arange(0, pages * PAGE, dtype=torch.int64)
        dst = torch.arange(pages * PAGE, 2 * pages * PAGE, dtype=torch.int64)
        g = torch.Generator().manual_seed(1)
        host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape, generator=g).to(host.dtype))
        times = {"cxlkv_set": [], "cxlkv_get": [], "file_set": [], "file_get": []}
        exact = True

        def check():
            nonlocal exact
            for i in range(pages):
                a = host.get_data_page(int(src[i * PAGE]), flat=False)
                b = host.get_data_page(int(dst[i * PAGE]), flat=False)
                exact = exact and torch.equal(a, b)
                b.zero_()                      # the next backend's get must write it again

        def run_cxlkv(keys):
            t0 = time.perf_counter()
            ok = all(cx.batch_set_v1(keys, src))
            t1 = time.perf_counter()
            ok = ok and all(cx.batch_get_v1(keys, dst))
            t2 = time.perf_counter()
            times["cxlkv_set"].append(t1 - t0)
            times["cxlkv_get"].append(t2 - t1)
            return ok

        def run_file(keys):
            # what SGLang's controller does for a backend without the zero-copy forms
            t0 = time.perf_counter()
            ok = fb.batch_set(keys, [host.get_data_page(int(src[i * PAGE]))
                                     for i in range(pages)])
            t1 = time.perf_counter()
            got = fb.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys])
            for i, p in enumerate(got):
                ok = ok and p is not None
                if p is not None:
                    host.set_from_flat_data_page(int(dst[i * PAGE]), p)
            t2 = time.perf_counter()
            times["file_set"].append(t1 - t0)
            times["file_get"].append(t2 - t1)
            return ok

        okall = True
        for r in range(runs):
            progress(f"run {r + 1} of {runs}")
            keys = [os.urandom(32).hex() for _ in range(pages)]
            order = (run_cxlkv, run_file) if r % 2 == 0 else (run_file, run_cxlkv)
            for fn in order:
                okall = fn(keys) and okall
                check()
        cx.close()
        med = {k: harness.median(v) for k, v in times.items()}
        gbps = {k: total / v / 1e9 for k, v in med.items()}
        progress("memcpy baseline")
        mc = harness.memcpy_gbps(total=min(total, 64 << 20))
        return {"kind": kind, "torch_threads": torch.get_num_threads(), "host_pool": type(host).__name__, "layout": layout,
                "page_shape": list(host.get_data_page(0, flat=False).shape), "pages": pages, "page_bytes": page_bytes, "runs": runs,
                "set_gbps": {"cxlkv": gbps["cxlkv_set"], "file": gbps["file_set"]},
                "get_gbps": {"cxlkv": gbps["cxlkv_get"], "file": gbps["file_get"]},
                "set_vs_file": gbps["cxlkv_set"] / gbps["file_set"],
                "get_vs_file": gbps["cxlkv_get"] / gbps["file_get"],
                "memcpy_gbps": mc, "bit_exact": bool(exact), "all_ok": bool(okall)}
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _have_sglang() -> bool:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            for name in ("hicache_storage", "memory_pool", "pool_host.mha", "pool_host.mla"):
                importlib.import_module(f"sglang.srt.mem_cache.{name}")
        return True
    except Exception:
        return False


def add_arguments(ap) -> None:
    ap.add_argument("--pages", type=int, default=64, help="pages per batch (about 1 MiB each)")
    ap.add_argument("--runs", type=int, default=5, help="runs, alternating the order")
    ap.add_argument("--layout", default="page_first", choices=LAYOUTS["mha"],
                    help="SGLang's host pool layout (mla: not page_head)")
    ap.add_argument("--kind", default="mha", choices=tuple(LAYOUTS),
                    help="the host pool: SGLang's MHATokenToKVPoolHost or MLATokenToKVPoolHost")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="torch's intra-op threads for both backends (default 1: on a small "
                         "shared machine two-thread copies stall whenever the other CPU is busy)")
    ap.add_argument("--python", default=os.environ.get("CXLKV_SGLANG_PYTHON") or VENV_PYTHON,
                    help="an interpreter with SGLang, when this one has none")


def run(a, progress) -> dict:
    if a.layout not in LAYOUTS[a.kind]:
        raise Unavailable(f"SGLang's {a.kind} host pool gives backends no {a.layout} pages "
                          f"(layouts: {', '.join(LAYOUTS[a.kind])})")
    if _have_sglang():
        return _measure(a.pages, a.runs, a.layout, progress, a.kind, a.torch_threads)
    if not os.path.exists(a.python):
        raise Unavailable(f"SGLang is not importable here and there is no {a.python} "
                          "(scripts/setup --engines makes it)")
    progress(f"running under {a.python}")
    r = subprocess.run([a.python, "-m", "cxlkv.bench.sglang_hicache", "--pages", str(a.pages),
                        "--runs", str(a.runs), "--layout", a.layout, "--kind", a.kind,
                        "--torch-threads", str(a.torch_threads)],
                       env=harness.child_env(), capture_output=True, text=True, timeout=1800)
    if r.returncode:
        raise Unavailable(f"{a.python}: {(r.stderr.strip().splitlines() or ['failed'])[-1]}")
    return json.loads(r.stdout)


def render(r: dict) -> str:
    return "\n".join([
        f"SGLang HiCache L3, {r['pages']} pages of {r['page_bytes'] >> 10} KiB "
        f"({r['host_pool']}, {r['layout']}), medians of {r['runs']} runs, "
        f"{r['torch_threads']} torch thread(s)",
        f"{'':8} {'cxlkv':>10} {'file':>10} {'ratio':>8}",
        f"{'set':8} {r['set_gbps']['cxlkv']:>7.2f} GB/s {r['set_gbps']['file']:>5.2f} GB/s "
        f"{r['set_vs_file']:>7.1f}x",
        f"{'get':8} {r['get_gbps']['cxlkv']:>7.2f} GB/s {r['get_gbps']['file']:>5.2f} GB/s "
        f"{r['get_vs_file']:>7.1f}x",
        f"memcpy (same run): {r['memcpy_gbps']:.2f} GB/s; pages read back bit-exact: "
        f"{r['bit_exact']}"])


def ok(r: dict) -> bool:
    return bool(r["bit_exact"] and r["all_ok"])


if __name__ == "__main__":              # the run under the SGLang venv
    import argparse
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args()
    print(json.dumps(harness.jsonable(_measure(args.pages, args.runs, args.layout,
                                               lambda s: print(s, file=sys.stderr), args.kind,
                                               args.torch_threads))))
