"""Hugging Face transformers: a model's KV cache (DynamicCache) to and from the pool.

    import cxlkv
    from cxlkv.integrations.transformers import kv_for_model, load_prefix, store_prefix

    with cxlkv.open_pool(path) as pool:
        kv = kv_for_model(pool, model, salt=tenant)       # this model's namespace
        cache, n = load_prefix(kv, input_ids)              # longest prefix in the pool
        out = model(input_ids[:, n:], **{cache_kwarg(model): cache}, use_cache=True)
        store_prefix(kv, input_ids, cache)                 # publish the full blocks

(`cache_kwarg` is "cache" in recent transformers releases, "past_key_values" in older ones.)

Block payload
-------------
A block holds `block_tokens` consecutive tokens of every layer, as one
C-contiguous array in the model's dtype, native (little-endian) byte order:
    [layers][2: K then V][kv_heads][block_tokens][head_dim]

so block_bytes = layers x 2 x kv_heads x block_tokens x head_dim x itemsize
(after RoPE: exactly the tensors a DynamicCache layer holds, batch row 0).
Only full blocks are stored; a prefix's partial last block is recomputed.

Namespace
---------
`kv_for_model` names the namespace after the model (model_type, dtype,
layers x kv_heads x head_dim, block_tokens) and a 128-bit fingerprint of its
config (volatile keys such as `transformers_version` and `_name_or_path`
left out), its dtype and a sample of its weights (64 evenly spaced values of
every parameter), so two different models - another checkpoint, a
fine-tune, another dtype - never share blocks.  Pass namespace= to name it
yourself (e.g. after a checkpoint revision).

Copies
------
store_prefix gathers the cache into one host buffer of whole blocks (one
strided pass in C per layer tensor, cxlkv.integrations.kvcopy; device to
host first for a GPU model) and stores it; blocks already in the pool are
not written.  load_prefix pins the matched blocks and gathers them, in one
strided pass in C with the GIL released, straight from the pinned pool views
into the one layer-major tensor the DynamicCache layers view: the only copy
on the hit path (a GPU model: into a CPU tensor, then one transfer).  The
copy's store mode (plain or non-temporal) is the host's calibrated read mode
(cxlkv._core.copymode).  The pins are released before load_prefix returns.
The tensor has ROOM_BLOCKS blocks of spare tokens: the returned cache's
layers write the next forward's tokens into them in place rather than
concatenating the prefix.  A ModelKV keeps its last KEEP_BUFFERS such tensors
and reuses one once no tensor views it any more (fresh memory costs a page
fault every 4 KiB, more than the copy).

Models with sliding-window, linear-attention or other non-plain cache layers
are refused (UsageError); batches must be of one sequence.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import threading
import warnings

import numpy as np
import torch
import xxhash

from cxlkv.errors import UsageError
from cxlkv.integrations import kvcopy

__all__ = ["BlockLayout", "ModelKV", "block_layout", "cache_kwarg", "cache_prefix", "cache_tensors",
           "kv_for_model", "load_prefix", "model_namespace", "output_cache", "store_prefix"]

#: names that moved to the test helpers; they still import from here, deprecated
_MOVED = {"tiny_llama": "cxlkv.testing.models", "TINY_LLAMA": "cxlkv.testing.models"}


def __getattr__(name):
    # `from cxlkv.integrations.transformers import tiny_llama` (its home before the
    # test helpers moved to cxlkv.testing): loaded on first use, with a
    # DeprecationWarning.  By importlib: the import contract keeps the library off
    # cxlkv.testing, and this forward of deprecated names is the one way in.
    if name in _MOVED:
        warnings.warn(f"cxlkv.integrations.transformers.{name} moved to "
                      f"{_MOVED[name]}.{name}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module 'cxlkv.integrations.transformers' has no attribute {name!r}")

#: config keys that say nothing about the KV a model computes
_VOLATILE = {"transformers_version", "_name_or_path", "name_or_path", "torch_dtype", "dtype",
             "use_cache", "architectures", "_commit_hash", "output_attentions",
             "output_hidden_states", "return_dict", "id2label", "label2id", "tokenizer_class",
             "_attn_implementation", "attn_implementation", "_experts_implementation"}
#: weight values sampled per parameter for the namespace fingerprint
_SAMPLES = 64
#: spare capacity of a loaded cache, in blocks: the following forward's tokens
#: (the prompt's rest, then decode steps) are written into it in place
ROOM_BLOCKS = 2
#: destination buffers a ModelKV keeps for reuse by later load_prefix calls
#: (each the size of a loaded prefix's KV; 0 = none kept)
KEEP_BUFFERS = 2


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    """The shape of a block's payload: [layers][2][kv_heads][block_tokens][head_dim]."""

    layers: int
    kv_heads: int
    head_dim: int
    block_tokens: int
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.layers, 2, self.kv_heads, self.block_tokens, self.head_dim)

    @property
    def token_bytes(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * _itemsize(self.dtype)

    @property
    def block_bytes(self) -> int:
        return self.token_bytes * self.block_tokens


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    if get is None:
        return config
    try:
        return get(decoder=True)
    except TypeError:
        return get()


def _model_dtype(model) -> torch.dtype:
    dt = getattr(model, "dtype", None)
    if isinstance(dt, torch.dtype):
        return dt
    return next(model.parameters()).dtype


def _model_device(model) -> torch.device:
    dev = getattr(model, "device", None)
    if isinstance(dev, torch.device):
        return dev
    return next(model.parameters()).device


def block_layout(model, block_tokens: int = 16) -> BlockLayout:
    """The payload layout of `model`'s KV blocks (UsageError for caches it cannot hold)."""
    cfg = _text_config(model.config)
    kinds = set(getattr(cfg, "layer_types", None) or ())
    if kinds - {"full_attention"}:
        raise UsageError(f"{cfg.model_type}: cache layers {sorted(kinds - {'full_attention'})} "
                         "are not plain full-attention KV; only those can be stored in the pool")
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True) \
            and not kinds:
        raise UsageError(f"{cfg.model_type}: sliding-window attention keeps only the last "
                         f"{cfg.sliding_window} tokens; its cache cannot be stored in the pool")
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return BlockLayout(layers=cfg.num_hidden_layers, kv_heads=kv_heads, head_dim=head_dim,
                       block_tokens=block_tokens, dtype=_model_dtype(model))


def _fingerprint(model, layout: BlockLayout) -> str:
    h = xxhash.xxh3_128()
    cfg = model.config.to_dict() if hasattr(model.config, "to_dict") else dict(vars(model.config))

    def clean(d):
        if isinstance(d, dict):
            return {k: clean(v) for k, v in d.items()
                    if k not in _VOLATILE and not str(k).startswith("_")}
        return d

    h.update(json.dumps(clean(cfg), sort_keys=True, default=str).encode())
    h.update(f"\0{layout.dtype}\0{layout.shape}\0".encode())
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            flat = p.detach().reshape(-1)
            n = flat.numel()
            h.update(f"{name}\0{tuple(p.shape)}\0{p.dtype}\0".encode())
            if n:
                idx = torch.linspace(0, n - 1, steps=min(_SAMPLES, n), device=flat.device).long()
                h.update(flat[idx].to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def model_namespace(model, block_tokens: int = 16) -> str:
    """The namespace name kv_for_model uses for `model` (under 128 bytes)."""
    lay = block_layout(model, block_tokens)
    cfg = _text_config(model.config)
    dt = str(lay.dtype).replace("torch.", "")
    mt = str(getattr(cfg, "model_type", "") or "model")[:24]
    return (f"hf/{mt}/{dt}/{lay.layers}x{lay.kv_heads}x{lay.head_dim}/t{block_tokens}/"
            f"{_fingerprint(model, lay)}")


class ModelKV:
    """A model's namespace of the pool's KV cache: the cxlkv.KVCache (`.kv`),
    the block layout (`.layout`) and the device loaded caches go to.

    Other attributes (match, store, load, stats, ...) are the KVCache's."""

    def __init__(self, kv, layout: BlockLayout, device=None):
        if kv.block_tokens != layout.block_tokens or kv.block_bytes != layout.block_bytes:
            raise UsageError(f"namespace {kv.name!r} has block_tokens={kv.block_tokens}, "
                             f"block_bytes={kv.block_bytes}; the layout needs "
                             f"{layout.block_tokens} and {layout.block_bytes}")
        self.kv = kv
        self.layout = layout
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        # load_prefix's destination buffers, kept for reuse once no cache views them
        self._buffers: list[torch.Tensor] = []
        self._buffers_lock = threading.Lock()

    def _buffer(self, tokens: int) -> torch.Tensor:
        """A [layers, 2, kv_heads, >= tokens, head_dim] CPU tensor for load_prefix:
        one of the last KEEP_BUFFERS made that no tensor views any more (its
        pages already touched: a fresh allocation pays a page fault every 4
        KiB, slower than the copy itself), else a new one."""
        lay = self.layout
        use_count = getattr(torch._C, "_storage_Use_Count", None)
        with self._buffers_lock:
            if use_count is not None:
                for buf in self._buffers:
                    # 2: `buf` here and the storage object asked; more: a view lives
                    if buf.shape[3] >= tokens and use_count(buf.untyped_storage()._cdata) == 2:
                        return buf[:, :, :, :tokens]
            # never an inference tensor, though the caller may be in
            # torch.inference_mode: a kept buffer is handed out again to calls
            # outside it, where the cache's in-place updates of an inference
            # tensor would raise
            with torch.inference_mode(False):
                buf = torch.empty((lay.layers, 2, lay.kv_heads, tokens, lay.head_dim),
                                  dtype=lay.dtype)
            if KEEP_BUFFERS:
                self._buffers = ([buf] + self._buffers)[:KEEP_BUFFERS]
            return buf[:, :, :, :tokens]

    def __getstate__(self):
        d = dict(self.__dict__)
        d.pop("_buffers", None)               # buffers and their lock stay in this process
        d.pop("_buffers_lock", None)
        return d

    def __setstate__(self, d):
        self.__dict__.update(d)
        self._buffers, self._buffers_lock = [], threading.Lock()

    @property
    def namespace(self) -> str:
        return self.kv.name

    def __getattr__(self, name):
        if name == "kv":                       # not set yet (e.g. while unpickling)
            raise AttributeError(name)
        return getattr(self.kv, name)

    def __repr__(self) -> str:
        return f"<cxlkv ModelKV {self.kv.name!r} {self.layout}>"


def kv_for_model(pool, model, salt=None, *, block_tokens: int = 16, namespace: str | None = None,
                 quota: int | None = None, **kv_options) -> ModelKV:
    """Open `model`'s namespace in `pool` (an attached cxlkv pool) as tenant `salt`.

    block_tokens: tokens per block (16, vLLM's default); the block size
    follows from the model (see the module doc).  namespace: your own name
    instead of the derived one (it must still be the same model and dtype).
    kv_options go to pool.kv (e.g. hot_bytes, remote_read, remote_budget_s)."""
    lay = block_layout(model, block_tokens)
    kvcopy.prepare()                            # the host's copy modes (calibrated once)
    name = namespace if namespace is not None else model_namespace(model, block_tokens)
    kv = pool.kv(model=name, block_tokens=block_tokens, block_bytes=lay.block_bytes, salt=salt,
                 quota=quota, **kv_options)
    return ModelKV(kv, lay, _model_device(model))


def _as_model_kv(kv, layout) -> ModelKV:
    if isinstance(kv, ModelKV):
        return kv
    if layout is None:
        raise UsageError("pass what kv_for_model returned, or a KVCache with "
                         "layout=BlockLayout(...)")
    return ModelKV(kv, layout)


def _tokens(input_ids) -> np.ndarray:
    """Token ids of one sequence as a uint32 numpy array."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 2:
            if input_ids.shape[0] != 1:
                raise UsageError(f"input_ids holds a batch of {input_ids.shape[0]} sequences; "
                                 "pass one sequence at a time")
            input_ids = input_ids[0]
        elif input_ids.dim() != 1:
            raise UsageError("input_ids must be 1-D or of shape (1, tokens)")
        if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise UsageError(f"input_ids must be integers (got {input_ids.dtype})")
        arr = input_ids.detach().to("cpu").numpy()
    else:
        arr = np.asarray(input_ids)
        if arr.ndim == 2 and arr.shape[0] == 1:
            arr = arr[0]
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise UsageError("input_ids must be one sequence of integer token ids")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF):
        raise UsageError("token ids must lie in [0, 2**32)")
    return np.ascontiguousarray(arr, dtype=np.uint32)


def cache_tensors(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) per layer of a transformers cache (DynamicCache, or the
    legacy tuple of (k, v) pairs)."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        out = []
        for i, layer in enumerate(layers):
            k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
            if getattr(layer, "is_sliding", False) or not isinstance(k, torch.Tensor) \
                    or not isinstance(v, torch.Tensor):
                raise UsageError(f"cache layer {i} ({type(layer).__name__}) holds no plain "
                                 "keys/values tensors; only full-attention caches can be stored")
            out.append((k, v))
        return out
    if isinstance(cache, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) >= 2
                                                for p in cache):
        return [(p[0], p[1]) for p in cache]
    raise UsageError(f"cannot read a {type(cache).__name__}: pass a DynamicCache")


def _check_layers(layers, lay: BlockLayout) -> int:
    """The tokens the cache holds (UsageError if it does not fit the layout)."""
    if len(layers) != lay.layers:
        raise UsageError(f"the cache has {len(layers)} layers; the namespace's layout has "
                         f"{lay.layers}")
    seq = None
    for i, (k, v) in enumerate(layers):
        for t in (k, v):
            if t.dim() != 4 or t.shape[0] != 1 or t.shape[1] != lay.kv_heads \
                    or t.shape[3] != lay.head_dim or t.dtype != lay.dtype:
                raise UsageError(f"cache layer {i} is {tuple(t.shape)} {t.dtype}; the namespace "
                                 f"holds (1, {lay.kv_heads}, tokens, {lay.head_dim}) {lay.dtype}")
        if k.shape[2] != v.shape[2] or (seq is not None and k.shape[2] != seq):
            raise UsageError(f"cache layer {i} holds {k.shape[2]} keys and {v.shape[2]} values; "
                             f"layer 0 holds {seq}")
        seq = k.shape[2]
    return seq or 0


def store_prefix(kv, input_ids, cache, *, layout: BlockLayout | None = None) -> int:
    """Store the full blocks of `cache` (the KV of `input_ids`' leading tokens)
    in the pool; returns how many blocks were new (present ones are skipped).

    The cache may hold fewer tokens than input_ids (only what it covers is
    stored) or more (the extra positions are ignored)."""
    mkv = _as_model_kv(kv, layout)
    lay = mkv.layout
    toks = _tokens(input_ids)
    layers = cache_tensors(cache)
    seq = _check_layers(layers, lay)
    t = lay.block_tokens
    nb = min(seq, len(toks)) // t
    if nb == 0:
        return 0
    toks = toks[:nb * t]
    if mkv.kv.match(toks) == nb * t:
        return 0
    if all(x.device.type == "cpu" for pair in layers for x in pair):
        # one pass: the layers' tensors straight into the reserved pool slots
        # ([layers][K/V][kv_heads][block_tokens][head_dim] each), new blocks only
        with torch.no_grad():
            return mkv.kv.store_with(
                toks, lambda which, target: kvcopy.hf_store(layers, target, t, which))
    # another device: one copy to the host in the block layout, then the store
    out = torch.empty((nb, lay.layers, 2, lay.kv_heads, t, lay.head_dim), dtype=lay.dtype)
    with torch.no_grad():
        for i, (k, v) in enumerate(layers):
            for j, src in enumerate((k, v)):
                out[:, i, j].copy_(src[0, :, :nb * t].unflatten(1, (nb, t)).transpose(0, 1))
    return mkv.kv.store(toks, out.view(torch.uint8).numpy().reshape(-1))


def _new_cache(layers, room=None):
    """A DynamicCache whose layers hold `layers` [(keys, values)] as they are (no
    copy).  room: [(keys buffer, values buffer)] the layers' tensors are the
    leading tokens of: their updates append in place while the buffers have
    room (_growable), instead of concatenating the whole cache."""
    from transformers import DynamicCache

    cache = DynamicCache()
    base = getattr(cache, "layer_class_to_replicate", None)
    if base is None or not hasattr(cache, "layers"):         # transformers < 4.56
        return DynamicCache.from_legacy_cache(tuple(layers))
    made = []
    for i, (k, v) in enumerate(layers):
        layer = (_growable(base) if room is not None else base)()
        layer.update(k[:, :, :0], v[:, :, :0])     # initialises device/dtype; copies nothing
        layer.keys, layer.values = k, v
        if room is not None:
            layer._room = room[i]
            layer._high = k.shape[-2]
        made.append(layer)
    cache.layers = made
    return cache


_GROWABLE: dict = {}


def _growable(base):
    """`base` (DynamicLayer) whose update() writes new tokens into spare room
    of the buffers its keys/values lead (set by _new_cache) rather than
    concatenating: the first forward after a pooled hit then copies only
    its own tokens, not the whole prefix.  Only positions past every token
    this layer ever held are written (after a crop it concatenates, so no
    view handed out earlier sees its bytes change); anything unexpected
    (batch, dtype, device, no room left) falls back to base.update."""
    cls = _GROWABLE.get(base)
    if cls is not None:
        return cls

    class PooledLayer(base):
        _room = None
        _high = 0

        def update(self, key_states, value_states, *args, **kwargs):
            room = self._room
            if room is not None and self.is_initialized:
                kb, vb = room
                n = self.keys.shape[-2]
                m = n + key_states.shape[-2]
                if (n == self._high and m <= kb.shape[-2]
                        and self.keys.data_ptr() == kb.data_ptr()
                        and self.values.data_ptr() == vb.data_ptr()
                        and key_states.shape[:2] == kb.shape[:2]
                        and value_states.shape[:2] == vb.shape[:2]
                        and key_states.shape[-1] == kb.shape[-1]
                        and value_states.shape[-1] == vb.shape[-1]
                        and key_states.dtype == kb.dtype and value_states.dtype == vb.dtype
                        and key_states.device == kb.device):
                    kb[..., n:m, :].copy_(key_states)
                    vb[..., n:m, :].copy_(value_states)
                    self.keys, self.values = kb[..., :m, :], vb[..., :m, :]
                    self._high = m
                    return self.keys, self.values
                self._room = None                     # from here on, as the base does
            return super().update(key_states, value_states, *args, **kwargs)

    PooledLayer.__name__ = PooledLayer.__qualname__ = f"Pooled{base.__name__}"
    _GROWABLE[base] = PooledLayer
    return PooledLayer


def load_prefix(kv, input_ids, *, max_tokens: int | None = None, device=None,
                layout: BlockLayout | None = None):
    """Load the longest prefix of `input_ids` whose KV is in the pool.

    Returns (DynamicCache, n_tokens), or (None, 0) when nothing matches.  The
    cache holds the KV of input_ids[:n_tokens]: run the model on
    input_ids[n_tokens:] with it.  By default n_tokens < len(input_ids)
    (max_tokens = len - 1), so there is always a token left to compute the
    next-token logits from; when every block matched, the last block's last
    token is dropped from the cache (a view, no copy).  device: where the
    cache goes (default: the model's device when kv_for_model opened it)."""
    mkv = _as_model_kv(kv, layout)
    lay = mkv.layout
    toks = _tokens(input_ids)
    limit = len(toks) - 1 if max_tokens is None else min(int(max_tokens), len(toks))
    if limit <= 0:
        return None, 0
    t = lay.block_tokens
    want = -(-limit // t)                                       # blocks covering `limit`
    loaded = mkv.kv.load(toks[:want * t])
    try:
        nb = loaded.blocks
        if nb == 0:
            return None, 0
        # [layers][K/V][kv_heads][blocks x block_tokens + room][head_dim]: one copy out
        # of the pool; the room takes the tokens the next forward adds
        cap = nb * t + ROOM_BLOCKS * t
        dev = torch.device(device) if device is not None else mkv.device
        buf = mkv._buffer(cap) if dev.type == "cpu" else torch.empty(
            (lay.layers, 2, lay.kv_heads, cap, lay.head_dim), dtype=lay.dtype)
        kvcopy.hf_load(loaded.views(), buf, lay.layers, lay.kv_heads, t, lay.head_dim)
    finally:
        loaded.release()
    if buf.device != dev:
        buf = buf.to(dev)
    n = min(nb * t, limit)
    room = [(buf[i, 0].unsqueeze(0), buf[i, 1].unsqueeze(0)) for i in range(lay.layers)]
    return _new_cache([(k[..., :n, :], v[..., :n, :]) for k, v in room], room), n


def cache_prefix(cache, n_tokens: int):
    """A DynamicCache of the first n_tokens of `cache` (views of its tensors, no
    copy; the same on every transformers version, unlike Cache.crop)."""
    layers = cache_tensors(cache)
    if n_tokens < 0 or any(k.shape[2] < n_tokens for k, _ in layers):
        raise UsageError(f"the cache holds fewer than {n_tokens} tokens")
    return _new_cache([(k[:, :, :n_tokens], v[:, :, :n_tokens]) for k, v in layers])


def cache_kwarg(model) -> str:
    """The name of the forward/generate argument that takes a cache in this
    transformers version: "cache" (recent releases) or "past_key_values"."""

    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def output_cache(outputs):
    """The cache a forward pass returned (`outputs.cache`, or
    `outputs.past_key_values` in older transformers releases)."""
    for name in ("cache", "past_key_values"):
        c = outputs.get(name) if hasattr(outputs, "get") else getattr(outputs, name, None)
        if c is not None:
            return c
    return None

