"""cxlkv.integrations.sglang: the HiCache storage backend against SGLang's own
storage classes (HiCacheStorageConfig, StorageBackendFactory's dynamic
loading, HiCacheStorage, PoolTransfer / PoolTransferResult), on CPU.

SGLang's PyPI install pulls a CUDA torch and CUDA kernels, so these tests run
in a venv of their own, made by `scripts/setup --engines` (.venv-sglang:
torch 2.13.0 CPU from this machine's wheel, sglang with --no-deps and what its
storage modules import).  From the main venv, test_sglang_venv runs this file
under .venv-sglang (or $CXLKV_SGLANG_PYTHON) with the checkout on PYTHONPATH,
and skips, with the reason, where that venv is missing or cannot import
SGLang's storage classes.

SGLang's host memory pool (sglang.srt.mem_cache.pool_host) does not import on
this CPU-only machine: its package imports sglang.srt.configs, which imports
torchvision, and no torchvision build loads beside the CPU torch here
('operator torchvision::nms does not exist').  So the host pool here is
HostPool below: the geometry and the four methods the storage backends use of
SGLang's MHATokenToKVPoolHost (kv_buffer dims per layout, get_data_page,
set_from_flat_data_page, get_dummy_flat_data_page), written from that class.
Not exercised: MHATokenToKVPoolHost itself, MLA host pools, a running
SGLang server.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import cxlkv
from cxlkv.integrations import sglang as sg
from cxlkv.testing.checks import foreign_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SGLANG_PYTHON = os.environ.get("CXLKV_SGLANG_PYTHON") or os.path.join(
    ROOT, ".venv-sglang", "bin", "python")

try:
    import sglang.srt.mem_cache.hicache_storage  # noqa: F401
    HAVE_SGLANG = True
except Exception:                    # ImportError, or a broken CUDA import
    HAVE_SGLANG = False

in_sglang = pytest.mark.skipif(not HAVE_SGLANG, reason="runs under the SGLang venv "
                               "(test_sglang_venv runs this file there)")


# -- everywhere: keys and namespaces, without SGLang ------------------------------------------
def test_page_keys_and_namespace():
    h = "ab" * 32
    assert sg.page_hash_bytes(h) == bytes.fromhex(h)
    other = sg.page_hash_bytes("not-hex.mamba")
    assert len(other) == 32 and other != sg.page_hash_bytes("not-hex.swa")
    with pytest.raises(cxlkv.CxlkvError, match="str"):
        sg.page_hash_bytes(b"x")
    ns = sg.namespace_for(model="org/Llama-3", dtype="bfloat16", layout="page_first",
                          page_shape=(2, 16, 4, 8, 64), page_size=16, tp_rank=1, tp_size=2)
    assert ns == "sglang/org-Llama-3/bfloat16/page_first/2x16x4x8x64/p16/tp1of2"
    assert "/tp" not in sg.namespace_for(model="m", dtype="bf16", layout="layer_first",
                                         page_shape=(1,), page_size=1, tp_rank=3, tp_size=4,
                                         mla=True)


def test_the_class_needs_sglang():
    if HAVE_SGLANG:
        pytest.skip("SGLang is installed here")
    with pytest.raises(ImportError, match="needs SGLang"):
        sg.CxlkvHiCacheStorage


@pytest.mark.sglang
@pytest.mark.skipif(HAVE_SGLANG, reason="already running under SGLang")
def test_sglang_venv():
    """Run this file's tests under the SGLang venv."""
    if not os.path.exists(SGLANG_PYTHON):
        pytest.skip(f"no SGLang venv at {SGLANG_PYTHON} (scripts/setup --engines makes it)")
    r = subprocess.run([SGLANG_PYTHON, "-c", "import sglang.srt.mem_cache.hicache_storage"],
                       capture_output=True, text=True, timeout=300)
    if r.returncode:
        pytest.skip(f"{SGLANG_PYTHON} cannot import SGLang's storage classes: "
                    f"{r.stderr.strip().splitlines()[-1:]}")
    env = foreign_env(PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([SGLANG_PYTHON, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                        "-m", "sglang", os.path.abspath(__file__)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    tail = (r.stdout + r.stderr)[-6000:]
    assert r.returncode == 0, tail
    assert " passed" in r.stdout and " failed" not in r.stdout, tail


# -- under the SGLang venv --------------------------------------------------------------------
LAYERS, HEADS, HEAD_DIM, PAGE = 4, 2, 16, 16


class HostPool:
    """SGLang's MHATokenToKVPoolHost as the storage backends see it (see the
    module doc): a [K/V, ...] buffer in "layer_first" or "page_first" layout."""

    def __init__(self, layout: str, pages: int, dtype=None):
        import torch
        self.layout, self.page_size = layout, PAGE
        self.dtype = dtype or torch.bfloat16
        self.layer_num, self.head_num, self.head_dim = LAYERS, HEADS, HEAD_DIM
        self.size = pages * PAGE
        self.device = "cpu"
        dims = ((2, LAYERS, self.size, HEADS, HEAD_DIM) if layout == "layer_first" else
                (2, self.size, LAYERS, HEADS, HEAD_DIM))
        self.kv_buffer = torch.zeros(dims, dtype=self.dtype)

    def get_data_page(self, index, flat: bool = True):
        if self.layout == "layer_first":
            page = self.kv_buffer[:, :, index:index + self.page_size]
        else:
            page = self.kv_buffer[:, index:index + self.page_size]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self):
        import torch
        return torch.zeros((2, LAYERS, PAGE, HEADS, HEAD_DIM), dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page) -> None:
        page = self.get_data_page(index, flat=False)
        page.copy_(data_page.reshape(page.shape))


def make_backend(pool: str, host, *, tp_rank: int = 0, tp_size: int = 1, extra=None):
    """The backend as SGLang makes it: StorageBackendFactory's "dynamic"
    backend from the extra config, then register_mem_pool_host."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    cfg = HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False,
        is_page_first_layout=host.layout == "page_first", model_name="meta-llama/Tiny",
        extra_config={"backend_name": "cxlkv", "module_path": "cxlkv.integrations.sglang",
                      "class_name": "CxlkvHiCacheStorage", "interface_v1": 1, "pool": pool,
                      **(extra or {})})
    be = StorageBackendFactory.create_backend("dynamic", cfg, host)
    assert isinstance(be, HiCacheStorage)
    be.register_mem_pool_host(host)
    return be


def chain(n: int, seed: int) -> list[str]:
    """SGLang's page hashes for n pages of a prompt (its own get_hash_str chain)."""
    from sglang.srt.mem_cache.utils import get_hash_str
    keys, prior = [], None
    for i in range(n):
        prior = get_hash_str([seed * 1000 + i * PAGE + t for t in range(PAGE)], prior)
        keys.append(prior)
    return keys


def fill(host, pages: int, seed: int):
    import torch
    g = torch.Generator().manual_seed(seed)
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape, generator=g).to(host.dtype))
    return torch.arange(pages * PAGE, dtype=torch.int64)


def child_main(argv):
    """python -c: one SGLang instance (another process, another node)."""
    import torch
    role, pool, layout, n = argv[0], argv[1], argv[2], int(argv[3])
    keys = chain(n, 5)
    host = HostPool(layout, n + 2)
    be = make_backend(pool, host)
    if role == "set":
        idx = fill(host, n, 11)
        assert all(be.batch_set_v1(keys, idx))
        torch.save(host.kv_buffer.clone(), os.path.join(os.path.dirname(pool), f"ref-{layout}"))
        print("set", be.get_stats()["set_pages"])
    else:
        ref = torch.load(os.path.join(os.path.dirname(pool), f"ref-{layout}"))
        assert be.batch_exists(keys) == n
        # into other host slots than the writer's: pages 2.. of this host pool
        idx = torch.arange(2 * PAGE, (n + 2) * PAGE, dtype=torch.int64)
        assert be.batch_get_v1(keys, idx) == [True] * n
        for i in range(n):
            assert torch.equal(host.get_data_page(idx[i * PAGE].item(), flat=False),
                               ref_page(ref, layout, i)), i
        print("got", n)
    be.close()


def ref_page(buf, layout: str, i: int):
    s = slice(i * PAGE, (i + 1) * PAGE)
    return buf[:, :, s] if layout == "layer_first" else buf[:, s]


def _child(*args) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.path.dirname(__file__))
    r = subprocess.run([sys.executable, "-c", "import sys, test_integration_sglang as t; "
                        "t.child_main(sys.argv[1:])", *map(str, args)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return r.stdout


@in_sglang
@pytest.mark.sglang
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_pages_set_by_one_instance_are_read_bit_exact_by_another(engine_pool, layout):
    assert "set 6" in _child("set", engine_pool, layout, 6)
    assert "got 6" in _child("get", engine_pool, layout, 6)


@in_sglang
@pytest.mark.sglang
def test_partial_prefix_legacy_forms_and_namespaces(engine_pool):
    import torch
    from sglang.srt.mem_cache.hicache_storage import PoolTransfer, PoolTransferResult

    host = HostPool("page_first", 8)
    be = make_backend(engine_pool, host)
    keys = chain(6, 9)
    idx = fill(host, 6, 4)
    ref = host.kv_buffer.clone()
    assert be.batch_set_v1(keys[:3], idx[:3 * PAGE]) == [True] * 3
    assert be.batch_exists(keys) == 3 and be.exists(keys[2]) and not be.exists(keys[3])
    # legacy forms: flat pages in, flat pages out, same bytes
    assert be.batch_set(keys[3:5], [host.get_data_page(i * PAGE) for i in (3, 4)])
    assert be.batch_get_v1(keys, torch.arange(2 * PAGE, 8 * PAGE)) == [True] * 5 + [False]
    for i in range(5):
        assert torch.equal(host.get_data_page((i + 2) * PAGE, flat=False),
                           ref_page(ref, "page_first", i))
    got = be.batch_get(keys[:6], [host.get_dummy_flat_data_page() for _ in range(6)])
    assert got[5] is None and all(g is not None for g in got[:5])
    for i in range(5):
        assert torch.equal(got[i], ref_page(ref, "page_first", i).flatten())
    # the v2 interface, KV pool only
    r = be.batch_exists_v2(keys)
    assert isinstance(r, PoolTransferResult) and r.kv_hit_pages == 5
    res = be.batch_get_v2([PoolTransfer(name="kv", host_indices=idx[:2 * PAGE], keys=keys[:2])])
    assert res == {"kv": [True, True]}
    assert be.batch_exists_v2(keys, [PoolTransfer(name="mamba", keys=keys[:1])]).kv_hit_pages == 0
    # another TP rank, another layout: other namespaces, nothing shared
    other = make_backend(engine_pool, HostPool("page_first", 8), tp_rank=1, tp_size=2)
    assert other.batch_exists(keys) == 0
    assert make_backend(engine_pool, HostPool("layer_first", 8)).batch_exists(keys) == 0
    assert be.namespace().endswith("/page_first/2x16x4x2x16/p16/tp0of1")
    assert be.clear() and be.batch_exists(keys) == 0
