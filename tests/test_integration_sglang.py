"""cxlkv.integrations.sglang: the HiCache storage backend against SGLang's own
storage classes (HiCacheStorageConfig, StorageBackendFactory's dynamic
loading, HiCacheStorage, PoolTransfer / PoolTransferResult) and its own host
memory pools, on CPU.

SGLang's PyPI install pulls a CUDA torch and CUDA kernels, so these tests run
in a venv of their own, made by `scripts/setup --engines` (.venv-sglang:
torch 2.14.1 and torchvision 0.29.1 from this machine's disk - a CUDA build,
run on the CPU - sglang with --no-deps and what its storage and memory-pool
modules import).  From the main venv, test_sglang_venv runs this file under
.venv-sglang (or $CXLKV_SGLANG_PYTHON) with the checkout on PYTHONPATH, and
skips, with the reason, where that venv is missing or cannot import SGLang's
storage classes and host pools.

The host pools are SGLang's own: MHATokenToKVPoolHost (layouts layer_first,
page_first, page_first_direct, page_head; a page is K and V) and
MLATokenToKVPoolHost (one latent tensor per layer; layer_first, page_first,
page_first_direct), each built over SGLang's own device pool
(MHATokenToKVPool / MLATokenToKVPool on device "cpu") with the arguments
SGLang's build_kv_host_pool passes, and pin_memory=False: with its default
(True) the host pool registers its buffer with CUDA (cudaHostRegister), which
fails without a GPU ('Found no NVIDIA driver on your system');
pin_memory is the constructor's own parameter, nothing in SGLang is patched.
Those modules import torchvision (through sglang.srt.configs), hence the
venv's torch 2.14.1 + torchvision 0.29.1: PyPI's torchvision does not load
beside the CPU torch 2.13.0 ('operator torchvision::nms does not exist').

Not exercised: a running SGLang server (its scheduler and the cache
controller's threads calling the backend), GPU device pools and the
host<->device transfer kernels, pinned host memory, DCP and context-parallel
page shards, head-split pages (tp_lcm_size).
"""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
import warnings

import pytest

import cxlkv
from cxlkv.integrations import sglang as sg
from cxlkv.testing.checks import foreign_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SGLANG_PYTHON = os.environ.get("CXLKV_SGLANG_PYTHON") or os.path.join(
    ROOT, ".venv-sglang", "bin", "python")
#: what the tests under the SGLang venv import of SGLang
SGLANG_IMPORTS = ("sglang.srt.mem_cache.hicache_storage", "sglang.srt.mem_cache.memory_pool",
                  "sglang.srt.mem_cache.pool_host.mha", "sglang.srt.mem_cache.pool_host.mla")

try:
    with warnings.catch_warnings():
        # its quantization modules warn at import that they need a GPU
        warnings.simplefilter("ignore", UserWarning)
        for _name in SGLANG_IMPORTS:
            importlib.import_module(_name)
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
    ns = sg.namespace_for(model="org/Llama-3", dtype="bfloat16", kind="mha", layout="page_first",
                          page_shape=(2, 16, 4, 8, 64), page_size=16, tp_rank=1, tp_size=2)
    assert ns == "sglang/org-Llama-3/bfloat16/mha/page_first/2x16x4x8x64/p16/tp1of2"
    # MLA: one copy for every TP rank; pipeline and context-parallel shards apart
    assert sg.namespace_for(model="m", dtype="bf16", kind="mla", layout="layer_first",
                            page_shape=(4, 16, 1, 576), page_size=16, tp_rank=3, tp_size=4,
                            pp_rank=1, pp_size=2, cp_rank=0, cp_size=2, replicated=True) == \
        "sglang/m/bf16/mla/layer_first/4x16x1x576/p16/pp1of2/cp0of2"
    assert sg.namespace_for(model="m", dtype="bf16", kind="mha", layout="page_head",
                            page_shape=(2,), page_size=1, tp_rank=0, tp_size=1,
                            stem="team-a").startswith("team-a/bf16/mha/page_head/")
    with pytest.raises(cxlkv.CxlkvError, match="page kind"):
        sg.namespace_for(model="m", dtype="bf16", kind="", layout="page_first",
                         page_shape=(1,), page_size=1, tp_rank=0, tp_size=1)


def test_page_kind_from_the_host_pool_class():
    """By SGLang's class names (and their subclasses), without importing SGLang."""
    MLATokenToKVPoolHost = type("MLATokenToKVPoolHost", (), {})
    MHATokenToKVPoolHost = type("MHATokenToKVPoolHost", (), {})
    HiSparse = type("HiSparseMHATokenToKVPoolHost", (MHATokenToKVPoolHost,), {})
    assert sg.page_kind(MLATokenToKVPoolHost()) == "mla"
    assert sg.page_kind(MHATokenToKVPoolHost()) == sg.page_kind(HiSparse()) == "mha"
    assert sg.page_kind(type("DeepSeekV4PagedHostPool", (), {})()) == "DeepSeekV4PagedHostPool"


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
    r = subprocess.run([SGLANG_PYTHON, "-W", "ignore::UserWarning", "-c",
                        "import " + ", ".join(SGLANG_IMPORTS)],
                       capture_output=True, text=True, timeout=300)
    if r.returncode:
        pytest.skip(f"{SGLANG_PYTHON} cannot import SGLang's storage classes and host pools "
                    f"(scripts/setup --engines brings the venv up to date): "
                    f"{r.stderr.strip().splitlines()[-1:]}")
    env = foreign_env(PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    this = os.path.abspath(__file__)
    r = subprocess.run([SGLANG_PYTHON, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                        "-m", "sglang", "--deselect", f"{os.path.relpath(this, ROOT)}::test_sglang_venv", this],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    tail = (r.stdout + r.stderr)[-6000:]
    assert r.returncode == 0, tail
    assert " passed" in r.stdout and " failed" not in r.stdout, tail
    assert " skipped" not in r.stdout, tail


# -- under the SGLang venv --------------------------------------------------------------------
LAYERS, HEADS, HEAD_DIM, PAGE = 4, 2, 16, 16
KV_LORA_RANK, ROPE_DIM = 32, 16          # MLA: one 48-wide latent row per token and layer
#: the layouts whose pages SGLang's host pools hand to storage backends (get_data_page)
MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
COMBOS = [("mha", lay) for lay in MHA_LAYOUTS] + [("mla", lay) for lay in MLA_LAYOUTS]


def host_pool(kind: str, layout: str, pages: int):
    """SGLang's own host pool (MHATokenToKVPoolHost or MLATokenToKVPoolHost) of
    `pages` pages over SGLang's own device pool on "cpu", built with the
    arguments SGLang's build_kv_host_pool passes, and pin_memory=False (see the
    module doc)."""
    from cxlkv.testing.sglang_pools import cpu_host_pool

    # (SGLang's MHA page_head and MLA page_first_direct pools need pages >= layers:
    # they build per-layer views by indexing the page axis with layer ids)
    assert pages >= LAYERS
    return cpu_host_pool(kind, layout, pages=pages, page=PAGE, layers=LAYERS, heads=HEADS,
                         head_dim=HEAD_DIM, kv_lora_rank=KV_LORA_RANK, rope_dim=ROPE_DIM)


def make_backend(pool: str, host, *, tp_rank: int = 0, tp_size: int = 1, extra=None):
    """The backend as SGLang makes it: StorageBackendFactory's "dynamic"
    backend from the extra config, then register_mem_pool_host and
    on_host_pools_registered; is_mla_model as SGLang's cache controller sets
    it (true for an MLA pool)."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    cfg = HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=isinstance(host, MLATokenToKVPoolHost), enable_storage_metrics=False,
        is_page_first_layout=host.layout == "page_first", model_name="meta-llama/Tiny",
        extra_config={"backend_name": "cxlkv", "module_path": "cxlkv.integrations.sglang",
                      "class_name": "CxlkvHiCacheStorage", "interface_v1": 1, "pool": pool,
                      **(extra or {})})
    be = StorageBackendFactory.create_backend("dynamic", cfg, host)
    assert isinstance(be, HiCacheStorage)
    be.register_mem_pool_host(host)
    be.on_host_pools_registered()
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
    """Random KV in the whole host buffer; the host indices of its first pages."""
    import torch
    g = torch.Generator().manual_seed(seed)
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape, generator=g).to(host.dtype))
    return torch.arange(pages * PAGE, dtype=torch.int64)


def page(host, i: int):
    """Page i of a host pool, as SGLang's host pool hands it to backends."""
    return host.get_data_page(i * PAGE, flat=False)


def child_main(argv):
    """python -c: one SGLang instance (another process, another node), every
    page kind and layout in turn, all under the same page keys."""
    import torch
    role, pool, n = argv[0], argv[1], int(argv[2])
    keys = chain(n, 5)
    for seed, (kind, layout) in enumerate(COMBOS):
        host = host_pool(kind, layout, n + 2)
        be = make_backend(pool, host)
        ref_path = os.path.join(os.path.dirname(pool), f"ref-{kind}-{layout}")
        if role == "set":
            idx = fill(host, n, 11 + seed)
            assert all(be.batch_set_v1(keys, idx))
            torch.save(host.kv_buffer.clone(), ref_path)
            print("set", kind, layout, be.get_stats()["set_pages"])
        else:
            ref = host_pool(kind, layout, n + 2)        # the writer's host buffer
            ref.kv_buffer.copy_(torch.load(ref_path))
            assert be.batch_exists(keys) == n
            # into other host slots than the writer's: pages 2.. of this host pool
            idx = torch.arange(2 * PAGE, (n + 2) * PAGE, dtype=torch.int64)
            assert be.batch_get_v1(keys, idx) == [True] * n
            for i in range(n):
                assert torch.equal(page(host, i + 2), page(ref, i)), (kind, layout, i)
            assert not page(host, 0).any() and not page(host, 1).any()   # nothing else
            print("got", kind, layout, n)
        be.close()


def _child(*args) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.path.dirname(__file__))
    r = subprocess.run([sys.executable, "-W", "ignore::UserWarning", "-c",
                        "import sys, test_integration_sglang as t; t.child_main(sys.argv[1:])",
                        *map(str, args)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return r.stdout


@in_sglang
@pytest.mark.sglang
def test_pages_set_by_one_instance_are_read_bit_exact_by_another(engine_pool):
    """Every MHA and MLA layout under the same keys: each reads back its own pages."""
    out = _child("set", engine_pool, 6)
    for kind, layout in COMBOS:
        assert f"set {kind} {layout} 6\n" in out, out
    out = _child("get", engine_pool, 6)
    for kind, layout in COMBOS:
        assert f"got {kind} {layout} 6\n" in out, out


@in_sglang
@pytest.mark.sglang
def test_partial_prefix_legacy_forms_and_namespaces(engine_pool):
    import torch
    from sglang.srt.mem_cache.hicache_storage import PoolTransfer, PoolTransferResult

    host = host_pool("mha", "page_first", 8)
    be = make_backend(engine_pool, host)
    keys = chain(6, 9)
    idx = fill(host, 6, 4)
    ref = host_pool("mha", "page_first", 8)
    ref.kv_buffer.copy_(host.kv_buffer)
    assert be.batch_set_v1(keys[:3], idx[:3 * PAGE]) == [True] * 3
    assert be.batch_exists(keys) == 3 and be.exists(keys[2]) and not be.exists(keys[3])
    # the legacy forms as SGLang's cache controller calls them: _generic_page_set
    # (flat pages, taken at tensor indices), _generic_page_get (into dummy flat
    # pages, then set_from_flat_data_page); the same bytes
    assert be.batch_set(keys[3:5], [host.get_data_page(idx[i * PAGE]) for i in (3, 4)])
    assert be.batch_get_v1(keys, torch.arange(2 * PAGE, 8 * PAGE)) == [True] * 5 + [False]
    for i in range(5):
        assert torch.equal(page(host, i + 2), page(ref, i))
    got = be.batch_get(keys[:6], [host.get_dummy_flat_data_page() for _ in range(6)])
    assert got[5] is None and all(g is not None for g in got[:5])
    host.kv_buffer.zero_()
    for i in range(5):
        host.set_from_flat_data_page(i * PAGE, got[i])
        assert torch.equal(page(host, i), page(ref, i))
    # the v2 interface, KV pool only
    r = be.batch_exists_v2(keys)
    assert isinstance(r, PoolTransferResult) and r.kv_hit_pages == 5
    res = be.batch_get_v2([PoolTransfer(name="kv", host_indices=idx[:2 * PAGE], keys=keys[:2])])
    assert res == {"kv": [True, True]}
    assert be.batch_exists_v2(keys, [PoolTransfer(name="mamba", keys=keys[:1])]).kv_hit_pages == 0
    # another TP rank, another layout, MLA: other namespaces, nothing shared
    other = make_backend(engine_pool, host_pool("mha", "page_first", 8), tp_rank=1, tp_size=2)
    assert other.batch_exists(keys) == 0
    assert make_backend(engine_pool, host_pool("mha", "layer_first", 8)).batch_exists(keys) == 0
    assert make_backend(engine_pool, host_pool("mla", "page_first", 8)).batch_exists(keys) == 0
    assert be.namespace() == "sglang/meta-llama-Tiny/bfloat16/mha/page_first/2x16x4x2x16/p16/tp0of1"
    # the extra config's namespace replaces the stem only: the page format follows it
    named = make_backend(engine_pool, host_pool("mha", "page_first", 8),
                         extra={"namespace": "team-a"})
    assert named.namespace() == "team-a/bfloat16/mha/page_first/2x16x4x2x16/p16/tp0of1"
    assert be.clear() and be.batch_exists(keys) == 0


@in_sglang
@pytest.mark.sglang
@pytest.mark.parametrize("layout", MLA_LAYOUTS)
def test_mla_pages_are_one_copy_for_every_tp_rank(engine_pool, layout):
    """MLA KV is the same on every TP rank: rank 0 (SGLang's storage writer)
    stores; rank 1 finds the pages and reads them bit for bit, and stores nothing."""
    import torch

    h0, h1 = host_pool("mla", layout, 8), host_pool("mla", layout, 8)
    r0 = make_backend(engine_pool, h0, tp_rank=0, tp_size=2)
    r1 = make_backend(engine_pool, h1, tp_rank=1, tp_size=2)
    shape = tuple(page(h0, 0).shape)
    assert r0.namespace() == r1.namespace() == (
        f"sglang/meta-llama-Tiny/bfloat16/mla/{layout}/{'x'.join(map(str, shape))}/p16")
    # one latent tensor per layer, no K/V halves
    assert page(h0, 0).numel() == LAYERS * PAGE * (KV_LORA_RANK + ROPE_DIM)
    keys = chain(4, 7)
    idx = fill(h0, 4, 21)
    assert r0.batch_set_v1(keys, idx) == [True] * 4
    assert r1.batch_exists(keys) == 4
    assert r1.batch_get_v1(keys, torch.arange(4 * PAGE, 8 * PAGE)) == [True] * 4
    for i in range(4):
        assert torch.equal(page(h1, i + 4), page(h0, i))
    # the legacy get, flat MLA pages
    got = r1.batch_get(keys[:2], [h1.get_dummy_flat_data_page() for _ in range(2)])
    assert torch.equal(got[1], page(h0, 1).flatten())
    # a non-writer rank's set is accepted (SGLang skips its backups) but stores nothing
    more = chain(2, 8)
    fill(h1, 2, 22)
    assert r1.batch_set_v1(more, torch.arange(0, 2 * PAGE)) == [True, True]
    assert r0.batch_exists(more) == 0 and r1.get_stats()["set_pages"] == 0
    # MHA pages under the same keys, model, dtype and layout never meet these
    assert make_backend(engine_pool, host_pool("mha", layout, 8)).batch_exists(keys) == 0
