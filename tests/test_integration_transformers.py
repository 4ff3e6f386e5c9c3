"""cxlkv.integrations.transformers: a real model's DynamicCache through the pool.

Needs torch and transformers (`pip install -e '.[transformers]'`; scripts/test
installs them); skipped with that reason where they are missing."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install -e '.[transformers]')")
pytest.importorskip("transformers", reason="needs transformers (pip install -e '.[transformers]')")

import cxlkv  # noqa: E402
from cxlkv.errors import UsageError  # noqa: E402
from cxlkv.integrations import transformers as hf  # noqa: E402
from cxlkv.testing.models import tiny_llama  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T = 16


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    return tiny_llama(seed=0)


@pytest.fixture
def pool(tmp_path):
    path = str(tmp_path / "hf.pool")
    cxlkv.init_pool(path, {"size": 64 << 20})
    with cxlkv.open_pool(path) as p:
        yield p


def ids_of(n: int, seed: int = 1, vocab: int = 1024):
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def forward(model, ids, cache=None):
    with torch.no_grad():
        out = model(ids, **({hf.cache_kwarg(model): cache} if cache is not None else {}),
                    use_cache=True)
    return out.logits, hf.output_cache(out)


def prefill_and_store(model, kv, ids):
    logits, cache = forward(model, ids)
    return logits, cache, hf.store_prefix(kv, ids, cache)


def test_layout_and_block_bytes(model):
    lay = hf.block_layout(model, 16)
    assert (lay.layers, lay.kv_heads, lay.head_dim, lay.dtype) == (4, 2, 64, torch.float32)
    assert lay.shape == (4, 2, 2, 16, 64)
    assert lay.block_bytes == 4 * 2 * 2 * 16 * 64 * 4


def test_roundtrip_is_bit_exact(model, pool):
    kv = hf.kv_for_model(pool, model)
    ids = ids_of(133)
    full, cache, stored = prefill_and_store(model, kv, ids)
    assert stored == 133 // T
    loaded, n = hf.load_prefix(kv, ids)
    assert n == 128 and loaded.get_seq_length() == 128
    ref = hf.cache_prefix(cache, n)
    for (k, v), (rk, rv) in zip(hf.cache_tensors(loaded), hf.cache_tensors(ref)):
        assert torch.equal(k, rk) and torch.equal(v, rv)
    got, _ = forward(model, ids[:, n:], loaded)
    want, _ = forward(model, ids[:, n:], ref)
    assert torch.equal(got, want)
    assert (got - full[:, n:]).abs().max() <= 1e-5


def test_block_payload_layout(model, pool):
    """A block is [layers][K, V][kv_heads][block_tokens][head_dim] of the model's dtype."""
    kv = hf.kv_for_model(pool, model)
    ids = ids_of(2 * T)
    _, cache, _ = prefill_and_store(model, kv, ids)
    with kv.load(ids.numpy()[0]) as views:
        assert len(views) == 2
        blk = torch.frombuffer(bytearray(views[1]), dtype=torch.float32).view(4, 2, 2, T, 64)
    for i, (k, v) in enumerate(hf.cache_tensors(cache)):
        assert torch.equal(blk[i, 0], k[0, :, T:2 * T])
        assert torch.equal(blk[i, 1], v[0, :, T:2 * T])


def test_store_skips_what_is_present(model, pool):
    kv = hf.kv_for_model(pool, model)
    ids = ids_of(100)
    _, cache, stored = prefill_and_store(model, kv, ids)
    assert stored == 6
    assert hf.store_prefix(kv, ids, cache) == 0
    longer = torch.cat([ids, ids_of(60, seed=9)], dim=1)
    _, cache2 = forward(model, longer)
    assert hf.store_prefix(kv, longer, cache2) == 160 // T - 6
    # a cache shorter than the ids stores what it covers; under a block, nothing
    assert hf.store_prefix(kv, ids_of(40, seed=3), hf.cache_prefix(cache2, 10)) == 0


def test_whole_prompt_cached_leaves_one_token(model, pool):
    kv = hf.kv_for_model(pool, model)
    ids = ids_of(128)
    full, cache, _ = prefill_and_store(model, kv, ids)
    loaded, n = hf.load_prefix(kv, ids)
    assert n == 127                       # the last token is computed, for its logits
    got, _ = forward(model, ids[:, n:], loaded)
    want, _ = forward(model, ids[:, n:], hf.cache_prefix(cache, n))
    assert torch.equal(got, want)
    assert (got[0, -1] - full[0, -1]).abs().max() <= 1e-5
    loaded, n = hf.load_prefix(kv, ids, max_tokens=128)
    assert n == 128
    loaded, n = hf.load_prefix(kv, ids, max_tokens=40)
    assert n == 40 and loaded.get_seq_length() == 40


def test_generate_from_loaded_prefix(model, pool):
    kv = hf.kv_for_model(pool, model)
    ids = ids_of(90)
    prefill_and_store(model, kv, ids)
    loaded, n = hf.load_prefix(kv, ids)
    assert n == 80
    kw = hf.cache_kwarg(model)
    with torch.no_grad():
        got = model.generate(ids, **{kw: loaded}, max_new_tokens=6, do_sample=False)
        want = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)


def test_partial_prefix_reuse(model, pool):
    kv = hf.kv_for_model(pool, model)
    a = ids_of(128)
    _, cache, _ = prefill_and_store(model, kv, a)
    b = torch.cat([a[:, :3 * T], ids_of(50, seed=5)], dim=1)
    b[0, 3 * T] = (a[0, 3 * T] + 1) % 1024
    loaded, n = hf.load_prefix(kv, b)
    assert n == 3 * T
    got, _ = forward(model, b[:, n:], loaded)
    want, _ = forward(model, b[:, n:], hf.cache_prefix(cache, n))
    assert torch.equal(got, want)
    full, _ = forward(model, b)
    assert (got - full[:, n:]).abs().max() <= 1e-5


def test_other_tenant_gets_no_reuse(model, pool):
    ids = ids_of(70)
    prefill_and_store(model, hf.kv_for_model(pool, model, salt="tenant-a"), ids)
    assert hf.load_prefix(hf.kv_for_model(pool, model, salt="tenant-a"), ids)[1] == 64
    assert hf.load_prefix(hf.kv_for_model(pool, model, salt="tenant-b"), ids) == (None, 0)
    assert hf.load_prefix(hf.kv_for_model(pool, model), ids) == (None, 0)


def test_namespace_names_the_model(model):
    ns = hf.model_namespace(model)
    assert ns.startswith("hf/llama/float32/4x2x64/t16/") and len(ns.encode()) < 128
    assert hf.model_namespace(tiny_llama(seed=0)) == ns          # same weights, same name
    assert hf.model_namespace(tiny_llama(seed=1)) != ns          # other weights
    assert hf.model_namespace(tiny_llama(seed=0, dtype=torch.bfloat16)) != ns
    assert hf.model_namespace(tiny_llama(seed=0, rope_theta=5e5)) != ns
    assert hf.model_namespace(model, block_tokens=32) != ns


def test_different_models_never_share_blocks(model, pool):
    ids = ids_of(64)
    prefill_and_store(model, hf.kv_for_model(pool, model), ids)
    other = tiny_llama(seed=1)
    assert hf.load_prefix(hf.kv_for_model(pool, other), ids) == (None, 0)


def test_bfloat16_roundtrip(pool):
    m = tiny_llama(seed=0, dtype=torch.bfloat16)
    kv = hf.kv_for_model(pool, m)
    assert kv.block_bytes == 4 * 2 * 2 * T * 64 * 2
    ids = ids_of(70)
    _, cache, _ = prefill_and_store(m, kv, ids)
    loaded, n = hf.load_prefix(kv, ids)
    assert n == 64
    for (k, v), (rk, rv) in zip(hf.cache_tensors(loaded),
                                hf.cache_tensors(hf.cache_prefix(cache, n))):
        assert k.dtype == torch.bfloat16 and torch.equal(k, rk) and torch.equal(v, rv)


def test_pins_are_released(model, pool):
    kv = hf.kv_for_model(pool, model)
    ids = ids_of(70)
    prefill_and_store(model, kv, ids)
    loaded, n = hf.load_prefix(kv, ids)
    assert n == 64
    res = kv.drop()                        # nothing pinned: every block goes
    assert res["evicted"] == 4 and res["pinned_left"] == 0
    # the loaded cache is a copy: still usable after the blocks are gone
    forward(model, ids[:, n:], loaded)


def test_refuses_what_it_cannot_hold(model, pool):
    kv = hf.kv_for_model(pool, model)
    with pytest.raises(UsageError, match="batch"):
        hf.load_prefix(kv, torch.zeros((2, 20), dtype=torch.long))
    with pytest.raises(UsageError, match="integer"):
        hf.load_prefix(kv, torch.zeros((1, 20)))
    _, cache = forward(tiny_llama(seed=0, num_key_value_heads=4), ids_of(32))
    with pytest.raises(UsageError, match="cache layer 0"):
        hf.store_prefix(kv, ids_of(32), cache)
    _, cache = forward(tiny_llama(seed=0, num_hidden_layers=2), ids_of(32))
    with pytest.raises(UsageError, match="2 layers"):
        hf.store_prefix(kv, ids_of(32), cache)
    with pytest.raises(UsageError, match="kv_for_model"):
        hf.load_prefix(kv.kv, ids_of(32))
    with pytest.raises(UsageError, match="DynamicCache"):
        hf.store_prefix(kv, ids_of(32), object())
    assert hf.load_prefix(kv, ids_of(1)) == (None, 0)


def test_refuses_sliding_window_models():
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, sliding_window=8)
    with pytest.raises(UsageError, match="sliding"):
        hf.block_layout(MistralForCausalLM(cfg))


@pytest.mark.slow
def test_disaggregated_prefill_and_decode_processes():
    """Two processes, two nodes: the prefill worker stores, the decode worker
    loads and generates (scripts/disagg_demo.py, which runs every check)."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "disagg_demo.py"), "--json"],
                       capture_output=True, text=True, timeout=280)
    assert r.returncode in (0, 1), r.stderr[-3000:]
    report = json.loads(r.stdout)
    failed = [c["check"] for c in report["checks"] if not c["ok"]]
    assert not failed and report["ok"], failed
    sc = report["decode"]["scenarios"]
    assert sc["full"]["loaded_tokens"] == 128 and sc["full"]["recomputed_tokens"] == 5
    assert sc["partial"]["loaded_tokens"] == 48 and sc["partial"]["published_blocks"] > 0
    assert sc["other_tenant"]["loaded_tokens"] == 0
    assert report["prefill"]["node"] != report["decode"]["node"]


def test_ttft_bench_runs():
    """`cxlkv bench run ttft` end to end on a short context (the figures are the bench's job)."""
    from cxlkv.bench import ttft

    r = ttft.measure(contexts=(128,), runs=2, threads=1)
    (c,) = r["contexts"]
    assert c["tokens"] == 128 and c["blocks_stored"] == 8 and c["same_first_token"]
    assert c["kv_bytes"] == 128 * 4096 and c["recompute_ms"] > 0 and c["hit_ms"] > 0
    assert r["target"]["met"] is None                    # no 4K context in this run
    assert "ratio" in ttft.render(r)
