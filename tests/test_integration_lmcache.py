"""cxlkv.integrations.lmcache: the storage plugin against LMCache's own engine
(LMCacheEngineBuilder, LMCacheEngine.store / retrieve, the storage manager and
its plugin loader, LocalCPUBackend as the allocator), on CPU.

LMCache's PyPI install pulls CUDA packages (cupy, cufile, a CUDA torch), so
these tests run in a venv of their own, made by `scripts/setup --engines`
(.venv-lmcache: torch 2.13.0 CPU from this machine's wheel, lmcache with
--no-deps and what its engine imports).  From the main venv, test_lmcache_venv
runs this file under .venv-lmcache (or $CXLKV_LMCACHE_PYTHON) with the
checkout on PYTHONPATH, and skips, with the reason, where that venv is
missing or cannot import LMCache.  The header tests run everywhere.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import cxlkv
from cxlkv.integrations import lmcache as lmc
from cxlkv.testing.checks import foreign_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LMCACHE_PYTHON = os.environ.get("CXLKV_LMCACHE_PYTHON") or os.path.join(
    ROOT, ".venv-lmcache", "bin", "python")

try:
    import lmcache.v1.cache_engine  # noqa: F401
    HAVE_LMCACHE = True
except Exception:                    # ImportError, or a broken CUDA import
    HAVE_LMCACHE = False

in_lmcache = pytest.mark.skipif(not HAVE_LMCACHE, reason="runs under the LMCache venv "
                                "(test_lmcache_venv runs this file there)")


# -- everywhere: the block header and the keys, without LMCache ------------------------------
def test_chunk_header_layout_is_pinned():
    assert lmc.CHUNK_HEADER.size == 72 and lmc.HEADER_BYTES == 128
    raw = lmc.pack_header(1, (2, 4, 16, 32), 8192)
    assert len(raw) == lmc.HEADER_BYTES and raw[72:] == bytes(56)
    assert raw[:8] == b"CXLKVLMC"
    assert raw[8:16] == (1).to_bytes(4, "little") + (4).to_bytes(4, "little")
    assert raw[16:24] == (2).to_bytes(8, "little") and raw[64:72] == (8192).to_bytes(8, "little")
    assert lmc.unpack_header(raw) == (1, (2, 4, 16, 32), 8192)


def test_chunk_header_refuses_what_is_not_one():
    with pytest.raises(cxlkv.CxlkvError, match="bad header"):
        lmc.unpack_header(bytes(128))
    with pytest.raises(cxlkv.CxlkvError, match="at most 6"):
        lmc.pack_header(1, (1,) * 7, 0)


def test_keys_and_namespace():
    class Key:                                   # LMCache's CacheEngineKey.to_string() shape
        def __init__(self, s):
            self.s = s

        def to_string(self):
            return self.s

    a = lmc.chunk_hash_bytes(Key("m@1@0@ab12@bfloat16"))
    b = lmc.chunk_hash_bytes(Key("m@1@0@ab13@bfloat16"))
    assert len(a) == 32 and a != b
    assert lmc.chunk_hash_bytes(Key("m@1@0@ab12@bfloat16")) == a
    assert lmc.namespace_for(model="org/m", dtype="bfloat16", worker=1, world=2,
                             chunk_size=256) == "lmcache/org-m/bfloat16/tp1of2/c256"
    assert lmc.namespace_for(model="x", dtype="f", worker=0, world=1, chunk_size=16,
                             name="mine") == "mine/tp0of1/c16"


def test_the_class_needs_lmcache():
    if HAVE_LMCACHE:
        pytest.skip("LMCache is installed here")
    with pytest.raises(ImportError, match="needs LMCache"):
        lmc.CxlkvLMCacheBackend


@pytest.mark.lmcache
@pytest.mark.skipif(HAVE_LMCACHE, reason="already running under LMCache")
def test_lmcache_venv():
    """Run this file's tests under the LMCache venv."""
    if not os.path.exists(LMCACHE_PYTHON):
        pytest.skip(f"no LMCache venv at {LMCACHE_PYTHON} (scripts/setup --engines makes it)")
    r = subprocess.run([LMCACHE_PYTHON, "-c", "import lmcache.v1.cache_engine"],
                       capture_output=True, text=True, timeout=300)
    if r.returncode:
        pytest.skip(f"{LMCACHE_PYTHON} cannot import lmcache: "
                    f"{r.stderr.strip().splitlines()[-1:]}")
    env = foreign_env(PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([LMCACHE_PYTHON, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                        "-m", "lmcache", os.path.abspath(__file__)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    tail = (r.stdout + r.stderr)[-6000:]
    assert r.returncode == 0, tail
    assert " passed" in r.stdout and " failed" not in r.stdout, tail


# -- under the LMCache venv -------------------------------------------------------------------
L, H, D, C = 2, 2, 8, 16                # layers, KV heads, head size, chunk tokens


def make_engine(instance: str, pool: str, *, plugin: bool = True, cpu_gb: float = 0.05):
    """An LMCacheEngine on CPU with the cxlkv plugin configured as a deployment
    would (storage_plugins + extra_config), built by LMCache's own builder."""
    import torch
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.gpu_connector import GPUConnectorInterface
    from lmcache.v1.metadata import LMCacheMetadata

    class CPUConnector(GPUConnectorInterface):
        """The serving engine's KV: one CPU tensor [layers, K/V, tokens, heads,
        head size] passed as kvcaches= (LMCache's GPU connectors need CUDA)."""

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

    extra = {"storage_plugin.cxlkv.module_path": "cxlkv.integrations.lmcache",
             "storage_plugin.cxlkv.class_name": "CxlkvLMCacheBackend", "cxlkv.pool": pool}
    cfg = LMCacheEngineConfig.from_defaults(
        chunk_size=C, local_cpu=True, max_local_cpu_size=cpu_gb,
        storage_plugins=["cxlkv"] if plugin else None, extra_config=extra if plugin else None)
    md = LMCacheMetadata(model_name="tiny-llama", world_size=1, local_world_size=1, worker_id=0,
                         local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=(L, 2, C, H, D),
                         chunk_size=C)
    eng = LMCacheEngineBuilder.get_or_create(instance, cfg, md, CPUConnector(),
                                             lambda t, r: None, lambda o, r: o)
    eng.post_init()
    return eng


def kv_for(tokens, seed: int):
    import torch
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, 2, len(tokens), H, D, generator=g).to(torch.bfloat16)


def child_main(argv):
    """python -c: one LMCache instance (another process, another node) -
    `store` stores the prompt's KV, `retrieve` retrieves it and checks it."""
    import torch
    role, pool, n = argv[0], argv[1], int(argv[2])
    tokens = list(range(1000, 1000 + n))
    eng = make_engine(f"child-{role}", pool)
    be = eng.storage_manager.storage_backends["cxlkv"]
    if role == "store":
        eng.store(tokens, kvcaches=kv_for(tokens, 7))
        print("stored", be.stats["stored"])
    else:
        out = torch.zeros(L, 2, n, H, D, dtype=torch.bfloat16)
        got = int(eng.retrieve(tokens, kvcaches=out).sum())
        full = n // C * C
        assert got == full, (got, full)
        assert torch.equal(out[:, :, :full], kv_for(tokens, 7)[:, :, :full])
        print("retrieved", got, be.stats["retrieved"])
    eng.close()


def _child(role: str, pool: str, n: int) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.path.dirname(__file__))
    r = subprocess.run([sys.executable, "-c", "import sys, test_integration_lmcache as t; "
                        "t.child_main(sys.argv[1:])", role, pool, str(n)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return r.stdout


@in_lmcache
@pytest.mark.lmcache
def test_store_in_one_process_retrieve_bit_exact_in_another(engine_pool):
    assert "stored 2" in _child("store", engine_pool, 40)           # 2 full chunks of 16
    assert "retrieved 32 2" in _child("retrieve", engine_pool, 40)  # from the pool, bit for bit


@in_lmcache
@pytest.mark.lmcache
def test_plugin_contains_remove_and_keys(engine_pool):
    from lmcache.utils import CacheEngineKey

    eng = make_engine("here", engine_pool)
    try:
        be = eng.storage_manager.storage_backends["cxlkv"]
        assert type(be).__name__ == "CxlkvLMCacheBackend"
        assert be.namespace == "lmcache/tiny-llama/bfloat16/tp0of1/c16"
        tokens = list(range(5000, 5048))
        eng.store(tokens, kvcaches=kv_for(tokens, 3))
        ckeys = [k for _, _, k in eng.token_database.process_tokens(tokens)]
        assert all(isinstance(k, CacheEngineKey) for k in ckeys) and len(ckeys) == 3
        # LMCache's chunk keys map into the cxlkv namespace: the pool finds them
        # by the SHA-256 of the key string
        with cxlkv.open_pool(engine_pool) as pool:
            kv = pool.kv(model=be.namespace, block_tokens=C,
                         block_bytes=lmc.HEADER_BYTES + be.chunk_bytes)
            assert kv.match_hashes([lmc.chunk_hash_bytes(k) for k in ckeys]) == 3
            with kv.load_hashes([lmc.chunk_hash_bytes(ckeys[0])]) as views:
                fmt, shape, nbytes = lmc.unpack_header(views[0])
            assert shape == (2, L, C, H * D) and nbytes == 2 * L * C * H * D * 2
        assert be.contains(ckeys[1]) and be.batched_contains(ckeys) == 3
        assert be.remove(ckeys[2]) and not be.contains(ckeys[2])
        assert not be.remove(ckeys[2])                       # absent: nothing removed
        assert be.batched_contains(ckeys) == 2
        obj = be.get_blocking(ckeys[0])
        ref = kv_for(tokens, 3)[:, :, :C].transpose(0, 1).reshape(2, L, C, H * D)
        assert obj is not None and (obj.tensor == ref).all()
        obj.ref_count_down()
        assert be.get_blocking(ckeys[2]) is None
    finally:
        eng.close()
