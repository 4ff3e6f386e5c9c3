"""The one-pass gathers and scatters between pool blocks and engine layouts
(gather.c kv_copy, cxlkv.integrations.kvcopy), the copy modes and their
calibration (cxlkv._core.copymode), checked bit for bit against the torch
paths they replace.

Needs torch (pip install -e '.[transformers]'); skipped with that reason
where it is missing."""
from __future__ import annotations

import gc
import json
import os
import logging
import sys
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install -e '.[transformers]')")

import cxlkv  # noqa: E402
from cxlkv._core import _native, copymode, kv_copy  # noqa: E402
from cxlkv.errors import PoolRangeError, UsageError  # noqa: E402
from cxlkv.integrations import kvcopy  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def _own_cache(monkeypatch, tmp_path):
    """Calibrations cache into this test's directory, never the user's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("CXLKV_COPY", raising=False)
    before = _native.copy_modes()
    yield
    _native.set_copy_modes(before["read"], before["write"])
    copymode.apply()


@pytest.fixture(params=["plain", "nt"])
def read_mode(request):
    """Every gather is checked under both read modes."""
    _native.set_copy_modes(request.param, "nt")
    return request.param


def rand(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)


def as_blocks(t: torch.Tensor):
    """[nb, ...] contiguous -> nb read-only byte buffers (as pool views are)."""
    flat = t.contiguous().view(torch.uint8).numpy().reshape(t.shape[0], -1)
    return [memoryview(row).toreadonly() for row in flat]


def writable_blocks(nb, bb):
    buf = np.zeros(nb * bb, dtype=np.uint8)
    mv = memoryview(buf)
    return buf, [mv[i * bb:(i + 1) * bb] for i in range(nb)]


# -- transformers: blocks [L][2][H][T][D] <-> per-layer tensors ----------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(4))
def test_hf_load_matches_torch_stack(dtype, seed, read_mode):
    rng = np.random.default_rng(seed)
    L, H, T, D = (int(rng.integers(1, 5)), int(rng.choice([1, 3, 5])),
                  int(rng.choice([1, 3, 16])), int(rng.choice([8, 24, 64])))
    nb = int(rng.integers(1, 9))
    src = rand((nb, L, 2, H, T, D), dtype, seed)
    blocks = as_blocks(src)
    # the path load_prefix used: frombuffer + stack(dim=3)
    want = torch.stack([torch.frombuffer(bytearray(b), dtype=dtype).view(L, 2, H, T, D)
                        for b in blocks], dim=3).reshape(L, 2, H, nb * T, D)
    out = torch.full((L, 2, H, nb * T, D), 7, dtype=dtype)
    n = kvcopy.hf_load(blocks, out, L, H, T, D)
    assert n == src.numel() * src.element_size()
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))


def test_hf_load_into_strided_destination(read_mode):
    """Spare capacity on the token axis (a cache with room to grow) and a
    transposed destination: every other byte is left alone."""
    L, H, T, D, nb = 2, 3, 4, 8, 5
    src = rand((nb, L, 2, H, T, D), torch.float16, 1)
    big = torch.zeros((L, 2, H, nb * T + 7, D), dtype=torch.float16)
    kvcopy.hf_load(as_blocks(src), big, L, H, T, D)
    want = src.permute(1, 2, 3, 0, 4, 5).reshape(L, 2, H, nb * T, D)
    assert torch.equal(big[:, :, :, :nb * T], want)
    assert not big[:, :, :, nb * T:].any()
    base = torch.zeros((L, 2, D, H, nb * T), dtype=torch.float16)
    kvcopy.hf_load(as_blocks(src), base.permute(0, 1, 3, 4, 2), L, H, T, D)
    assert torch.equal(base.permute(0, 1, 3, 4, 2), want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_hf_store_matches_torch_copy(dtype):
    L, H, T, D, nb, extra = 3, 5, 16, 24, 4, 9
    layers = [(rand((1, H, nb * T + extra, D), dtype, 2 * i),
               rand((1, H, nb * T + extra, D), dtype, 2 * i + 1)) for i in range(L)]
    # a non-contiguous keys tensor, as a model's cache may hold
    layers[1] = (rand((1, nb * T + extra, H, D), dtype, 50).transpose(1, 2), layers[1][1])
    want = torch.empty((nb, L, 2, H, T, D), dtype=dtype)   # the path store_prefix used
    for i, (k, v) in enumerate(layers):
        for j, src in enumerate((k, v)):
            want[:, i, j].copy_(src[0, :, :nb * T].unflatten(1, (nb, T)).transpose(0, 1))
    bb = L * 2 * H * T * D * want.element_size()
    buf, blocks = writable_blocks(nb, bb)
    assert kvcopy.hf_store(layers, blocks, T) == nb * bb
    assert bytes(buf) == want.view(torch.uint8).numpy().tobytes()


# -- vLLM: blocks [L][H][bs][C] <-> paged caches [kernel blocks, H, n, C] ------------------
def ref_scatter(cache, block_ids, pages, block_size):
    """The connector's former _scatter (index_copy_ by kernel block)."""
    nb, (_, h, n, c) = len(block_ids), cache.shape
    r = block_size // n
    if r > 1:
        pages = pages.view(nb, h, r, n, c).permute(0, 2, 1, 3, 4).reshape(nb * r, h, n, c)
    ids = torch.tensor(block_ids, dtype=torch.long)
    if r > 1:
        ids = (ids[:, None] * r + torch.arange(r)).reshape(-1)
    cache.index_copy_(0, ids, pages)


def ref_gather(cache, block_ids, block_size):
    nb, (_, h, n, c) = len(block_ids), cache.shape
    r = block_size // n
    ids = torch.tensor(block_ids, dtype=torch.long)
    if r > 1:
        ids = (ids[:, None] * r + torch.arange(r)).reshape(-1)
    got = cache.index_select(0, ids)
    if r > 1:
        got = got.view(nb, r, h, n, c).permute(0, 2, 1, 3, 4)
    return got.reshape(nb, h, r * n, c)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(3))
def test_paged_load_and_save_match_index_copy(dtype, seed, read_mode):
    rng = np.random.default_rng(100 + seed)
    L, H = int(rng.integers(1, 4)), int(rng.choice([1, 3, 7]))
    bs = int(rng.choice([4, 16]))
    n = int(rng.choice([d for d in (1, 2, 4, 16) if bs % d == 0]))
    C = int(rng.choice([6, 32, 128]))
    vblocks = int(rng.integers(6, 20))
    nb = int(rng.integers(1, vblocks))
    ids = [int(x) for x in rng.permutation(vblocks)[:nb]]
    src = rand((nb, L, H, bs, C), dtype, seed)
    blocks = as_blocks(src)
    bb = L * H * bs * C * src.element_size()
    caches = [rand((vblocks * bs // n, H, n, C), dtype, 1000 + li) for li in range(L)]
    want = [c.clone() for c in caches]
    for li in range(L):
        ref_scatter(want[li], ids, src[:, li], bs)
        kvcopy.paged_layer(blocks, bb, li, caches[li], ids, H, bs)
        assert torch.equal(caches[li].view(torch.uint8), want[li].view(torch.uint8))
    # and back: every layer's pages into staging blocks (save_kv_layer)
    buf, out = writable_blocks(nb, bb)
    for li in range(L):
        kvcopy.paged_layer(out, bb, li, caches[li], ids, H, bs, to_blocks=True)
    staged = torch.stack([ref_gather(c, ids, bs) for c in caches], dim=1)
    assert bytes(buf) == staged.contiguous().view(torch.uint8).numpy().tobytes()
    assert bytes(buf) == src.view(torch.uint8).numpy().tobytes()


def test_paged_into_a_strided_cache_view():
    """vLLM backends hand out per-layer views of one larger tensor ([2, ...] K/V
    or an interleaved layout): the copy follows the view's strides."""
    H, bs, C, vb = 2, 8, 16, 5
    whole = torch.zeros((vb, 2, H, bs, C), dtype=torch.float16)
    view = whole[:, 1]                                      # every other slab
    src = rand((2, 1, H, bs, C), torch.float16, 3)
    kvcopy.paged_layer(as_blocks(src), src[0].numel() * 2, 0, view, [4, 1], H, bs)
    assert torch.equal(whole[4, 1], src[0, 0]) and torch.equal(whole[1, 1], src[1, 0])
    assert not whole[:, 0].any() and not whole[[0, 2, 3], 1].any()


# -- bad input: clear errors, nothing written ----------------------------------------------
def test_bad_shapes_and_ids_are_refused():
    src = rand((2, 1, 2, 4, 8), torch.float32, 0)
    blocks = as_blocks(src)
    cache = torch.zeros((6, 2, 4, 8))
    with pytest.raises(UsageError, match="outside the paged cache's 6 blocks"):
        kvcopy.paged_layer(blocks, 256, 0, cache, [1, 6], 2, 4)
    with pytest.raises(UsageError, match="2 block ids for 1 blocks"):
        kvcopy.paged_layer(blocks[:1], 256, 0, cache, [1, 2], 2, 4)
    with pytest.raises(UsageError, match=r"expected \[blocks, 3, n, C\]"):
        kvcopy.paged_layer(blocks, 256, 0, cache, [1, 2], 3, 4)
    with pytest.raises(UsageError, match="holds 7 tokens; 2 blocks need 8"):
        kvcopy.hf_load(blocks, torch.zeros((1, 2, 2, 7, 8)), 1, 2, 4, 8)
    with pytest.raises(UsageError, match="expected"):
        kvcopy.hf_load(blocks, torch.zeros((1, 2, 3, 8, 8)), 1, 2, 4, 8)
    with pytest.raises(UsageError, match="CPU tensor"):
        kvcopy.byte_view(torch.zeros(2, device="meta"))
    assert not cache.any()


def test_kv_copy_bounds_both_sides():
    blocks = [memoryview(bytes(64)), memoryview(bytes(64))]
    dst = np.zeros(128, dtype=np.uint8)
    offs = np.array([0, 64], dtype=np.int64)
    assert kv_copy(blocks, 64, 0, dst, offs, [4], [16], [16], 16) == 128
    # the walk leaves the block: [8, 72) of 64 bytes
    with pytest.raises(PoolRangeError, match="block of 64 bytes"):
        kv_copy(blocks, 64, 8, dst, offs, [4], [16], [16], 16)
    # block 1 lands past the destination's end
    with pytest.raises(PoolRangeError, match="block 1 at buffer offset 65"):
        kv_copy(blocks, 64, 0, dst, np.array([0, 65], dtype=np.int64), [4], [16], [16], 16)
    with pytest.raises(PoolRangeError, match="outside the buffer"):
        kv_copy(blocks, 64, 0, dst, np.array([-1, 0], dtype=np.int64), [4], [16], [16], 16)
    # a block of the wrong length, a short offsets array, mismatched dims, overflow
    with pytest.raises(ValueError, match="block 1 is 32 bytes, not 64"):
        kv_copy([blocks[0], memoryview(bytes(32))], 64, 0, dst, offs, [4], [16], [16], 16)
    with pytest.raises(ValueError, match="1 offsets for 2 blocks"):
        kv_copy(blocks, 64, 0, dst, offs[:1], [4], [16], [16], 16)
    with pytest.raises(ValueError, match="shape has 1 dims, src_strides 2"):
        kv_copy(blocks, 64, 0, dst, offs, [4], [16, 1], [16], 16)
    with pytest.raises(ValueError, match="overflows"):
        kv_copy(blocks, 64, 0, dst, offs, [4, 2**40], [16, 2**40], [16, 2**40], 16)
    with pytest.raises(ValueError, match="negative"):
        kv_copy(blocks, 64, 0, dst, offs, [4], [-16], [16], 16)
    with pytest.raises(TypeError, match="int64"):
        kv_copy(blocks, 64, 0, dst, offs.astype(np.int32), [4], [16], [16], 16)
    with pytest.raises(BufferError):
        kv_copy(blocks, 64, 0, bytes(128), offs, [4], [16], [16], 16)   # read-only dst
    with pytest.raises(BufferError):                # scatter into read-only blocks
        kv_copy([memoryview(bytes(64)).toreadonly()], 64, 0, dst, offs[:1], [4], [16], [16],
                16, True)
    assert not dst.any()


def test_kv_copy_respects_a_strided_exporter_extent():
    """A strided numpy view vouches only for its own span, not its base's."""
    base = np.zeros(256, dtype=np.uint8)
    view = base[64:128]
    blocks = [memoryview(bytes(range(64)))]
    kv_copy(blocks, 64, 0, view, np.zeros(1, dtype=np.int64), [], [], [], 64)
    assert bytes(base[64:128]) == bytes(range(64)) and not base[:64].any()
    with pytest.raises(PoolRangeError):
        kv_copy(blocks, 64, 0, view, np.array([1], dtype=np.int64), [], [], [], 64)


# -- through a real pool: load_prefix's path from pinned views ------------------------------
def test_gather_from_pinned_pool_views(tmp_path, read_mode):
    path = str(tmp_path / "g.pool")
    cxlkv.init_pool(path, {"size": 32 << 20})
    L, H, T, D, nb = 2, 3, 16, 8, 6
    src = rand((nb, L, 2, H, T, D), torch.bfloat16, 9)
    bb = src[0].numel() * 2
    toks = np.arange(nb * T, dtype=np.uint32)
    with cxlkv.open_pool(path) as p:
        kv = p.kv(model="gather-test", block_tokens=T, block_bytes=bb)
        kv.store(toks, src.view(torch.uint8).numpy().reshape(-1))
        with kv.load(toks) as views:
            out = torch.empty((L, 2, H, nb * T, D), dtype=torch.bfloat16)
            kvcopy.hf_load(views, out, L, H, T, D)
        assert torch.equal(out, src.permute(1, 2, 3, 0, 4, 5).reshape(L, 2, H, nb * T, D))


# -- layer-wise loads -----------------------------------------------------------------------
# -- the store direction straight into the pool: KVCache.store_with + kv_scatter --------------
def _hf_layers(L, H, T, D, nb, dtype, seed):
    layers = [(rand((1, H, nb * T, D), dtype, seed + 2 * i),
               rand((1, H, nb * T, D), dtype, seed + 2 * i + 1)) for i in range(L)]
    # a non-contiguous keys tensor, as a model's cache may hold
    layers[0] = (rand((1, nb * T, H, D), dtype, seed + 99).transpose(1, 2), layers[0][1])
    return layers


@pytest.mark.parametrize("write_mode", ["nt", "clwb"])
def test_store_with_writes_the_pool_slots_in_place(tmp_path, write_mode):
    """store_prefix's one pass: the layers' tensors scattered straight into
    the reserved slots hold exactly what the staging path writes; present
    blocks are skipped and the new ones are found at their chain positions."""
    _native.set_copy_modes("nt", write_mode)
    path = str(tmp_path / "s.pool")
    cxlkv.init_pool(path, {"size": 32 << 20})
    L, H, T, D, nb = 3, 4, 16, 32, 6
    layers = _hf_layers(L, H, T, D, nb, torch.bfloat16, 5)
    bb = L * 2 * H * T * D * 2
    want, blocks = writable_blocks(nb, bb)
    kvcopy.hf_store(layers, blocks, T)
    toks = np.arange(nb * T, dtype=np.uint32)
    seen = []
    with cxlkv.open_pool(path) as p:
        kv = p.kv(model="scatter", block_tokens=T, block_bytes=bb)
        assert kv.store(toks[:2 * T], want[:2 * bb]) == 2          # two present already

        def fill(which, target):
            seen.append(which.tolist())
            return kvcopy.hf_store(layers, target, T, which)
        assert kv.store_with(toks, fill) == nb - 2
        assert seen == [[2, 3, 4, 5]]
        with kv.load(toks) as views:
            assert b"".join(bytes(v) for v in views) == want.tobytes()
        assert kv.store_with(toks, fill) == 0 and len(seen) == 1   # nothing new: no call


def test_a_failing_fill_publishes_nothing(tmp_path):
    path = str(tmp_path / "f.pool")
    cxlkv.init_pool(path, {"size": 32 << 20})
    with cxlkv.open_pool(path) as p:
        kv = p.kv(model="fail", block_tokens=4, block_bytes=4096)

        def fill(which, target):
            raise RuntimeError("the engine's copy failed")
        with pytest.raises(RuntimeError, match="copy failed"):
            kv.store_with(list(range(8)), fill)
        assert kv.match(list(range(8))) == 0
    from cxlkv.testing.checks import fsck_clean
    fsck_clean(path)


def test_kv_scatter_bounds_and_the_write_deadline(tmp_path):
    path = str(tmp_path / "b.pool")
    cxlkv.init_pool(path, {"size": 32 << 20})
    with cxlkv.open_pool(path, heartbeat=False) as p:
        m = p.mapping
        offs = p.alloc_batch(64, 2)
        src = np.arange(128, dtype=np.uint8)
        boffs = np.array([0, 64], dtype=np.int64)
        # a pool offset outside the pool, a walk outside the block, a block past buf
        with pytest.raises(PoolRangeError):
            m.kv_scatter(np.array([offs[0], p.sb.pool_size - 32], dtype=np.uint64), 64, 0, src,
                         boffs, [4], [16], [16], 16)
        with pytest.raises(PoolRangeError, match="block of 64 bytes"):
            m.kv_scatter(offs, 64, 8, src, boffs, [4], [16], [16], 16)
        with pytest.raises(PoolRangeError, match="outside the buffer"):
            m.kv_scatter(offs, 64, 0, src, np.array([0, 65], dtype=np.int64), [4], [16], [16],
                         16)
        with pytest.raises(ValueError, match="1 buffer offsets for 2 blocks"):
            m.kv_scatter(offs, 64, 0, src, boffs[:1], [4], [16], [16], 16)
        assert all(m.read(int(o), 64) == bytes(64) for o in offs)   # nothing written
        # a stall: past the write deadline no block is written; then all are
        m.write_deadline_ns = 2                                    # long past
        assert m.kv_scatter(offs, 64, 0, src, boffs, [4], [16], [16], 16) == 0
        assert all(m.read(int(o), 64) == bytes(64) for o in offs)
        m.write_deadline_ns = 0
        assert m.kv_scatter(offs, 64, 0, src, boffs, [4], [16], [16], 16) == 2
        assert m.read(int(offs[0]), 64) + m.read(int(offs[1]), 64) == src.tobytes()
        p.free_batch(offs)


def test_layer_load_orders_layers_and_hands_errors_back():
    import threading
    gate = threading.Event()
    seen, released = [], []

    def step(i):
        def run():
            if i == 2:
                gate.wait(5)
            seen.append(i)
        return run

    ll = kvcopy.LayerLoad([step(i) for i in range(4)], done=lambda: released.append(1))
    ll.wait(1)                               # layers 0 and 1 done while 2 is held back
    assert seen == [0, 1] and not ll.ready(2)
    gate.set()
    ll.wait(3)
    ll.finish()
    ll.finish()
    assert seen == [0, 1, 2, 3] and released == [1]

    def boom():
        raise PoolRangeError("copy failed")

    ll = kvcopy.LayerLoad([lambda: None, boom, lambda: seen.append("never")],
                          done=lambda: released.append(2))
    with pytest.raises(PoolRangeError, match="copy failed"):
        ll.wait(2)
    with pytest.raises(PoolRangeError):
        ll.finish()
    assert released == [1, 2] and "never" not in seen


# -- copy modes -----------------------------------------------------------------------------
def test_copy_modes_env_override_and_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("CXLKV_COPY", "read=plain,write=clwb")
    m = copymode.apply()
    assert (m["read"], m["write"], m["source"]) == ("plain", "clwb", "env")
    monkeypatch.setenv("CXLKV_COPY", "read=fast")
    with pytest.raises(UsageError, match="read=plain"):
        copymode.apply()
    with pytest.raises(UsageError, match="CXLKV_COPY"):
        kvcopy.prepare()
    monkeypatch.delenv("CXLKV_COPY")
    monkeypatch.setattr(copymode, "SPAN", 2 << 20)       # a quick calibration
    m = copymode.calibrate()
    assert m["source"] == "calibrated"
    cached = json.load(open(copymode.cache_path()))[copymode.host_key()]
    assert (m["read"], m["write"]) == (cached["read"], cached["write"])
    assert set(cached["read_gbps"]) == {"plain", "nt"}
    assert set(cached["write_gbps"]) == {"nt", "clwb"}
    # the choice is the faster measured one, the default unless beaten by the margin
    for d, alt in (("read", "plain"), ("write", "clwb")):
        g = cached[f"{d}_gbps"]
        assert m[d] == (alt if g[alt] >= copymode.MARGIN * g[copymode.DEFAULTS[d]]
                        else copymode.DEFAULTS[d])
    # env wins over the cache, part by part
    monkeypatch.setenv("CXLKV_COPY", "write=" + ("nt" if m["write"] == "clwb" else "clwb"))
    m2 = copymode.apply()
    assert m2["read"] == m["read"] and m2["write"] != m["write"]
    assert m2["source"] == "env+calibrated"


def test_calibration_span_is_out_of_cache_and_old_choices_are_measured_again(
        monkeypatch, tmp_path):
    caches = tmp_path / "cache"
    for i, (level, size) in enumerate([(1, "48K"), (2, "1024K"), (3, "32768K")]):
        (caches / f"index{i}").mkdir(parents=True)
        (caches / f"index{i}" / "size").write_text(size + "\n")
    assert copymode.llc_bytes(str(caches)) == 32 << 20
    assert copymode.llc_bytes(str(tmp_path / "none")) is None
    monkeypatch.setattr(copymode, "llc_bytes", lambda: 32 << 20)
    assert copymode.span() == 128 << 20                          # 4 x LLC
    monkeypatch.setattr(copymode, "llc_bytes", lambda: 1 << 20)
    assert copymode.span() == 32 << 20                           # at least 32 MiB
    monkeypatch.setattr(copymode, "llc_bytes", lambda: None)
    assert copymode.span() == 128 << 20
    # a choice cached by the earlier method (32 MiB, in cache) is not used
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("CXLKV_COPY", raising=False)
    monkeypatch.setattr(copymode, "SPAN", 2 << 20)
    os.makedirs(os.path.dirname(copymode.cache_path()))
    old = {"read": "plain", "write": "clwb", "read_gbps": {}, "write_gbps": {}, "at": "x"}
    with open(copymode.cache_path(), "w") as f:
        json.dump({copymode.host_key(): old}, f)
    assert copymode.apply()["source"] == "default"
    calls = []
    real = copymode.measure
    monkeypatch.setattr(copymode, "measure", lambda: calls.append(1) or real())
    m = copymode.ensure()
    assert calls and m["source"] == "calibrated"
    cached = json.load(open(copymode.cache_path()))[copymode.host_key()]
    assert cached["method"] == copymode.METHOD and cached["span"] == 2 << 20
    copymode.ensure()
    assert len(calls) == 1                                       # cached now


@pytest.mark.parametrize("modes", [("plain", "clwb"), ("nt", "nt"), ("plain", "nt")])
def test_put_get_identical_under_every_mode(tmp_path, modes):
    """kv.store / kv.load_into (the put and get paths) under each copy mode."""
    _native.set_copy_modes(*modes)
    path = str(tmp_path / "m.pool")
    cxlkv.init_pool(path, {"size": 32 << 20})
    bb = 256 << 10
    data = np.random.default_rng(5).integers(0, 256, 3 * bb, dtype=np.uint8)
    toks = np.arange(48, dtype=np.uint32)
    with cxlkv.open_pool(path) as p:
        kv = p.kv(model="modes", block_tokens=16, block_bytes=bb)
        assert kv.store(toks, data) == 3
        out = np.zeros_like(data)
        assert kv.load_into(toks, out) == 3
        assert np.array_equal(out, data)


# -- transformers: the loaded cache's buffers ---------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    pytest.importorskip("transformers", reason="needs transformers (pip install -e "
                                               "'.[transformers]')")
    from cxlkv.testing.models import tiny_llama
    return tiny_llama(seed=0)


@pytest.fixture
def hf_kv(tiny, tmp_path):
    from cxlkv.integrations import transformers as hf
    path = str(tmp_path / "hf.pool")
    cxlkv.init_pool(path, {"size": 64 << 20})
    with cxlkv.open_pool(path) as p:
        yield hf, hf.kv_for_model(p, tiny)


def _forward(model, hf, ids, cache=None):
    with torch.no_grad():
        out = model(ids, **({hf.cache_kwarg(model): cache} if cache is not None else {}),
                    use_cache=True)
    return out.logits, hf.output_cache(out)


def test_loaded_cache_grows_in_place_and_matches_a_plain_cache(tiny, hf_kv, monkeypatch):
    """The first forward after a hit writes its tokens into the buffer's room
    (no concatenation of the prefix); logits and cache equal those of the same
    forward on a plain contiguous copy of the loaded cache, through the room
    and past it (decode steps that concatenate), and after a crop."""
    hf, kv = hf_kv
    monkeypatch.setattr(hf, "ROOM_BLOCKS", 1)                     # 16 tokens of room
    ids = torch.randint(0, 1024, (1, 70), generator=torch.Generator().manual_seed(3))
    _, cache = _forward(tiny, hf, ids)
    hf.store_prefix(kv, ids, cache)
    loaded, n = hf.load_prefix(kv, ids)
    assert n == 64
    plain = hf._new_cache([(k.clone(), v.clone()) for k, v in hf.cache_tensors(loaded)])
    k0 = hf.cache_tensors(loaded)[0][0]
    ptr = k0.data_ptr()
    got, _ = _forward(tiny, hf, ids[:, n:], loaded)
    want, _ = _forward(tiny, hf, ids[:, n:], plain)
    assert torch.equal(got, want)
    k1 = hf.cache_tensors(loaded)[0][0]
    assert k1.shape[2] == 70 and k1.data_ptr() == ptr            # appended in place
    step = torch.tensor([[5]])
    for i in range(12):                                          # through the room and past it
        a, _ = _forward(tiny, hf, step, loaded)
        b, _ = _forward(tiny, hf, step, plain)
        assert torch.equal(a, b), i
    assert hf.cache_tensors(loaded)[0][0].data_ptr() != ptr       # concatenated once full
    for (k, v), (pk, pv) in zip(hf.cache_tensors(loaded), hf.cache_tensors(plain)):
        assert torch.equal(k, pk) and torch.equal(v, pv)


def test_crop_then_update_never_writes_under_an_earlier_view(tiny, hf_kv):
    hf, kv = hf_kv
    ids = torch.randint(0, 1024, (1, 49), generator=torch.Generator().manual_seed(4))
    _, cache = _forward(tiny, hf, ids)
    hf.store_prefix(kv, ids, cache)
    loaded, n = hf.load_prefix(kv, ids)
    _forward(tiny, hf, ids[:, n:], loaded)                        # 48 + 1 tokens, in place
    before = [k.clone() for k, _ in hf.cache_tensors(loaded)]
    held = [k for k, _ in hf.cache_tensors(loaded)]               # views someone kept
    loaded.crop(-9)                                              # 49 -> 40 tokens
    _forward(tiny, hf, torch.tensor([[7]]), loaded)
    for h, b in zip(held, before):
        assert torch.equal(h, b)
    assert hf.cache_tensors(loaded)[0][0].shape[2] == 41


def test_load_prefix_reuses_a_buffer_only_once_nothing_views_it(tiny, hf_kv):
    hf, kv = hf_kv
    ids = torch.randint(0, 1024, (1, 81), generator=torch.Generator().manual_seed(5))
    hf.store_prefix(kv, ids, _forward(tiny, hf, ids)[1])

    def keys(cache):
        return [layer[0] for layer in hf.cache_tensors(cache)]

    first, n = hf.load_prefix(kv, ids)
    snap = [k.clone() for k in keys(first)]
    ptr = keys(first)[0].data_ptr()
    second = hf.load_prefix(kv, ids)[0]                          # first still alive
    assert keys(second)[0].data_ptr() != ptr
    _forward(tiny, hf, ids[:, n:], second)                        # writes into second's room
    assert all(torch.equal(k, s) for k, s in zip(keys(first), snap))
    del first
    gc.collect()
    third = hf.load_prefix(kv, ids)[0]                            # first's buffer is free
    assert keys(third)[0].data_ptr() == ptr
    assert all(torch.equal(k, s) for k, s in zip(keys(third), snap))


def test_a_buffer_first_made_under_inference_mode_serves_calls_outside_it(tiny, hf_kv):
    """An engine may run its forward under torch.inference_mode and another
    caller of the same namespace under no_grad: the kept buffer is handed to
    both, and the forward outside inference mode updates it in place."""
    hf, kv = hf_kv
    ids = torch.randint(0, 1024, (1, 81), generator=torch.Generator().manual_seed(6))
    hf.store_prefix(kv, ids, _forward(tiny, hf, ids)[1])
    plain, n = hf.load_prefix(kv, ids)
    want, _ = _forward(tiny, hf, ids[:, n:], plain)
    del plain
    gc.collect()
    with torch.inference_mode():
        first, n = hf.load_prefix(kv, ids)
        ptr = hf.cache_tensors(first)[0][0].data_ptr()
        out = tiny(ids[:, n:], **{hf.cache_kwarg(tiny): first}, use_cache=True)
        assert torch.equal(out.logits, want)
    del first, out
    gc.collect()
    second, n = hf.load_prefix(kv, ids)                          # outside: the same buffer
    assert hf.cache_tensors(second)[0][0].data_ptr() == ptr
    got, _ = _forward(tiny, hf, ids[:, n:], second)              # grows it in place
    assert torch.equal(got, want)


# -- the vLLM connector's worker side, vLLM's base class stubbed ----------------------------
@pytest.fixture
def connector_module(monkeypatch):
    """cxlkv.integrations.vllm imported over a stub of the three vLLM names it
    needs at import (the base class, its metadata type and role, the logger),
    removed again after the test.  test_integration_vllm.py runs the connector
    under real vLLM (a venv of its own); this keeps its worker-side copies
    (loads, layer-wise loads, saves) tested where vLLM is not installed."""
    if "vllm" in sys.modules or HAVE_VLLM:
        pytest.skip("vLLM is installed: test_integration_vllm.py runs the real connector")

    class Base:
        def __init__(self, vllm_config, role, kv_cache_config=None):
            self._vllm_config = vllm_config
            self._kv_transfer_config = vllm_config.kv_transfer_config
            self._connector_metadata = None

        def bind_connector_metadata(self, meta):
            self._connector_metadata = meta

    names = {"vllm": {}, "vllm.distributed": {}, "vllm.distributed.kv_transfer": {},
             "vllm.distributed.kv_transfer.kv_connector": {},
             "vllm.distributed.kv_transfer.kv_connector.v1": {},
             "vllm.distributed.kv_transfer.kv_connector.v1.base": {
                 "KVConnectorBase_V1": Base, "KVConnectorMetadata": type("Meta", (), {}),
                 "KVConnectorRole": types.SimpleNamespace(WORKER=1)},
             "vllm.logger": {"init_logger": logging.getLogger}}
    for name, attrs in names.items():
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, m)
    monkeypatch.delitem(sys.modules, "cxlkv.integrations.vllm", raising=False)
    import cxlkv.integrations.vllm as cv
    yield cv
    sys.modules.pop("cxlkv.integrations.vllm", None)


try:
    import vllm  # noqa: F401
    HAVE_VLLM = True
except Exception:
    HAVE_VLLM = False


@pytest.mark.parametrize("layerwise", ["false", "true"])
def test_connector_saves_and_loads_paged_blocks(connector_module, tmp_path, layerwise):
    """One connector saves 6 blocks from its paged caches (kernel blocks of half
    a vLLM block; one layer through save_kv_layer, the rest in wait_for_save);
    another loads them into other block ids, bit for bit, nothing else
    written, synchronously or layer by layer."""
    NS = types.SimpleNamespace
    cv = connector_module
    L, H, bs, n, C, NB = 3, 2, 16, 8, 64, 40
    names = [f"layer.{i}" for i in range(L)]
    spec = NS(num_kv_heads=H, head_size=C // 2, dtype=torch.float16, block_size=bs)
    kcc = NS(kv_cache_groups=[NS(kv_cache_spec=spec, layer_names=names)])
    path = str(tmp_path / "v.pool")
    cxlkv.init_pool(path, {"size": 64 << 20})

    def connector(extra):
        cfg = NS(kv_transfer_config=NS(kv_connector_extra_config=extra, is_kv_consumer=True,
                                       is_kv_producer=True),
                 parallel_config=NS(tensor_parallel_size=1),
                 cache_config=NS(block_size=bs, prefix_caching_hash_algo="sha256_cbor"),
                 model_config=NS(model="stub", revision=None, dtype="float16",
                                 quantization=None, hf_config=None))
        return cv.CxlkvConnector(cfg, 1, kcc)

    src = [rand((NB * bs // n, H, n, C), torch.float16, 60 + i) for i in range(L)]
    hashes = [bytes([i]) * 32 for i in range(6)]
    prod = connector({"pool": path})
    prod.register_kv_caches(dict(zip(names, src)))
    ids_p = [3, 7, 1, 30, 12, 5]
    prod.bind_connector_metadata(cv.CxlkvConnectorMetadata(
        stores=[cv.CxlkvTransfer("r", None, hashes, ids_p)]))
    prod.save_kv_layer(names[1], src[1], None)
    prod.wait_for_save()
    assert prod.stats["stored_blocks"] == 6
    dst = [torch.zeros_like(t) for t in src]
    cons = connector({"pool": path, "layerwise": layerwise})
    cons.register_kv_caches(dict(zip(names, dst)))
    ids_c = [9, 2, 22, 0, 17, 11]
    cons.bind_connector_metadata(cv.CxlkvConnectorMetadata(
        loads=[cv.CxlkvTransfer("q", None, hashes + [b"\xff" * 32], ids_c + [33])]))
    cons.start_load_kv(None)
    for name in names:
        cons.wait_for_layer_load(name)
    r = bs // n
    for li in range(L):
        for p, c in zip(ids_p, ids_c):
            assert torch.equal(dst[li][c * r:(c + 1) * r], src[li][p * r:(p + 1) * r])
        others = [k for k in range(dst[li].shape[0]) if k // r not in ids_c]
        assert not dst[li][others].any()
    assert cons.stats["loaded_blocks"] == 6 and cons.stats["missed_blocks"] == 1
    assert cons.get_block_ids_with_load_errors() == {33}
    cons.wait_for_save()
    cons.shutdown()
    prod.shutdown()
