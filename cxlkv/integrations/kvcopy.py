"""One-pass copies between KV blocks and an engine's own tensors (C: kv_copy).

The engines' layouts differ from the pool's block payload; these functions
move the bytes in one strided pass each way, with the GIL released, straight
from the pinned pool views (Loaded.views()) into the engine's tensors, or
from the engine's tensors into a store's reserved pool slots
(KVCache.store_with: ReservedBlocks, C kv_scatter) or staging blocks.  Both sides are bounds-checked
in C: the walk inside every block against its length, every block's walk in
the tensor against the tensor's own extent (its shape and strides).

    copy_blocks       the general form: any strided walk, any CPU tensor
    hf_load           blocks [L][2][H][T][D] -> a [L, 2, H, tokens, D] tensor
    hf_store          a transformers cache's (k, v) per layer -> staging blocks,
                      or straight into a store's reserved pool slots
    paged_layer       one layer of vLLM-style blocks [L][H][bs][C] <-> a paged
                      cache [kernel blocks, H, n, C] by block table
    LayerLoad         per-layer steps on a thread: an engine waits for layer i
                      while later layers are still being copied

Tensors must be on the CPU (the C copy dereferences their memory); callers
stage through a CPU tensor for other devices.
"""
from __future__ import annotations

import threading
from typing import Callable, Sequence

import numpy as np
import torch

from cxlkv._core import copymode, kv_copy
from cxlkv.errors import UsageError
from cxlkv.kv.cache import ReservedBlocks

__all__ = ["LayerLoad", "byte_view", "copy_blocks", "hf_load", "hf_store", "paged_layer",
           "prepare"]

_SAME_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def prepare() -> dict:
    """The copy modes in use, calibrating them once per host if needed
    (cxlkv._core.copymode.ensure); a bad CXLKV_COPY is a UsageError."""
    return copymode.ensure()


def byte_view(t: torch.Tensor) -> np.ndarray:
    """A numpy array over `t`'s memory with its shape and strides (no copy;
    any dtype: reinterpreted as an integer of the same size)."""
    if not isinstance(t, torch.Tensor):
        raise UsageError(f"expected a torch tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise UsageError(f"kv copies need a CPU tensor (got one on {t.device})")
    it = t.element_size()
    if it not in _SAME_SIZE:
        raise UsageError(f"unsupported element size {it} ({t.dtype})")
    return t.detach().view(_SAME_SIZE[it]).numpy()


def copy_blocks(blocks: Sequence, block_bytes: int, tensor: torch.Tensor, offsets,
                shape: Sequence[int], src_strides: Sequence[int], buf_strides: Sequence[int],
                *, src_offset: int = 0, to_blocks: bool = False) -> int:
    """Copy the strided walk `shape` of every block (element strides
    `src_strides` inside the block, starting src_offset bytes in) to/from
    `tensor` (element strides `buf_strides`, block i's origin offsets[i]
    elements from the tensor's first element).  Returns bytes copied."""
    it = tensor.element_size()
    shape, ss, bs = list(shape), list(src_strides), list(buf_strides)
    if not (len(shape) == len(ss) == len(bs)):
        raise UsageError(f"shape {shape}, src_strides {ss} and buf_strides {bs} differ in length")
    run = it
    if shape and ss[-1] == 1 and bs[-1] == 1:
        run = it * shape.pop()
        ss.pop()
        bs.pop()
    offs = np.ascontiguousarray(np.asarray(offsets, dtype=np.int64) * it)
    if isinstance(blocks, ReservedBlocks):
        # a store's reserved pool slots: written in place, one pass
        if not to_blocks:
            raise UsageError("reserved blocks are only written (to_blocks=True)")
        return blocks.scatter(src_offset, byte_view(tensor), offs, shape,
                              [s * it for s in ss], [s * it for s in bs], run)
    return kv_copy(blocks, block_bytes, src_offset, byte_view(tensor), offs, shape,
                   [s * it for s in ss], [s * it for s in bs], run, to_blocks)


def _check_dims(t: torch.Tensor, want: tuple, what: str) -> None:
    if t.dim() != len(want) or any(w is not None and s != w for s, w in zip(t.shape, want)):
        shown = tuple("*" if w is None else w for w in want)
        raise UsageError(f"{what} is {tuple(t.shape)}; expected {shown}")


def hf_load(blocks: Sequence, out: torch.Tensor, layers: int, kv_heads: int,
            block_tokens: int, head_dim: int) -> int:
    """Blocks [layers][2][kv_heads][block_tokens][head_dim] (block b = tokens
    b*block_tokens...) into `out` [layers, 2, kv_heads, >= nb*block_tokens,
    head_dim] (any strides, same dtype as the blocks)."""
    nb = len(blocks)
    _check_dims(out, (layers, 2, kv_heads, None, head_dim), "the destination")
    if out.shape[3] < nb * block_tokens:
        raise UsageError(f"the destination holds {out.shape[3]} tokens; {nb} blocks need "
                         f"{nb * block_tokens}")
    t, d, h = block_tokens, head_dim, kv_heads
    st = out.stride()
    return copy_blocks(blocks, layers * 2 * h * t * d * out.element_size(), out,
                       np.arange(nb, dtype=np.int64) * (t * st[3]),
                       (layers, 2, h, t, d), (2 * h * t * d, h * t * d, t * d, d, 1),
                       st)


def hf_store(layers_kv: Sequence[tuple[torch.Tensor, torch.Tensor]], blocks: Sequence,
             block_tokens: int, which=None) -> int:
    """Each layer's (keys, values), each [1, kv_heads, >= nb*block_tokens,
    head_dim] (any strides), into blocks [layers][2][kv_heads][block_tokens]
    [head_dim]: staging blocks (writable buffers of one block each) or a
    store's ReservedBlocks (the pool slots, written in place).  Block i holds
    the tokens of chain position which[i] (default i)."""
    nb = len(blocks)
    if not layers_kv or not nb:
        return 0
    pos = np.arange(nb, dtype=np.int64) if which is None else np.asarray(which, dtype=np.int64)
    if len(pos) != nb:
        raise UsageError(f"{len(pos)} chain positions for {nb} blocks")
    k0 = layers_kv[0][0]
    h, d, t, it = k0.shape[1], k0.shape[3], block_tokens, k0.element_size()
    n_l = len(layers_kv)
    bb = n_l * 2 * h * t * d * it
    done = 0
    for li, pair in enumerate(layers_kv):
        for j, src in enumerate(pair):
            _check_dims(src, (1, h, None, d), f"layer {li} {'values' if j else 'keys'}")
            need = (int(pos.max()) + 1) * t if nb else 0
            if src.shape[2] < need:
                raise UsageError(f"layer {li} holds {src.shape[2]} tokens; its blocks need "
                                 f"{need}")
            st = src.stride()
            done += copy_blocks(blocks, bb, src, pos * (t * st[2]),
                                (h, t, d), (t * d, d, 1), (st[1], st[2], st[3]),
                                src_offset=(li * 2 + j) * h * t * d * it, to_blocks=True)
    return done


def paged_layer(blocks: Sequence, block_bytes: int, layer: int, cache: torch.Tensor,
                block_ids: Sequence[int], heads: int, block_size: int, *,
                to_blocks: bool = False) -> int:
    """Layer `layer` of blocks [layers][heads][block_size][C] to/from the paged
    cache `cache` [kernel blocks, heads, n, C] (n divides block_size: a vLLM
    block is block_size/n kernel blocks, in token order) at vLLM block ids
    `block_ids` (one per block)."""
    if len(block_ids) != len(blocks):
        raise UsageError(f"{len(block_ids)} block ids for {len(blocks)} blocks")
    if cache.dim() != 4 or cache.shape[1] != heads or block_size % cache.shape[2]:
        raise UsageError(f"paged cache {tuple(cache.shape)}: expected [blocks, {heads}, n, C] "
                         f"with n dividing {block_size}")
    kb, _, n, c = cache.shape
    r = block_size // n
    ids = np.asarray(block_ids, dtype=np.int64)
    if len(ids) and (ids.min() < 0 or (ids.max() + 1) * r > kb):
        bad = int(ids[(ids < 0) | ((ids + 1) * r > kb)][0])
        raise UsageError(f"block id {bad} is outside the paged cache's {kb // r} blocks")
    layer_bytes = heads * block_size * c * cache.element_size()
    st = cache.stride()
    return copy_blocks(blocks, block_bytes, cache, ids * (r * st[0]),
                       (r, heads, n, c), (n * c, block_size * c, c, 1), st,
                       src_offset=layer * layer_bytes, to_blocks=to_blocks)


class LayerLoad:
    """Runs `steps` (one per layer, in order) on a thread; wait(i) returns once
    step i is done, so an engine computes layer i while layers > i are still
    being copied.  finish() waits for all, then runs `done` (e.g. releasing
    the pool pins) in the caller's thread and raises the first step error.

    The copies release the GIL (kv_copy), so the steps overlap the engine's
    own work on another core."""

    def __init__(self, steps: Sequence[Callable[[], object]],
                 done: Callable[[], object] | None = None):
        self._steps = list(steps)
        self._events = [threading.Event() for _ in self._steps]
        self._error: BaseException | None = None
        self._done = done
        self._finished = False
        self._thread = threading.Thread(target=self._run, name="cxlkv-layer-load", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for i, step in enumerate(self._steps):
                step()
                self._events[i].set()
        except BaseException as e:            # handed to the waiting thread
            self._error = e
        finally:
            for ev in self._events:
                ev.set()

    @property
    def layers(self) -> int:
        return len(self._steps)

    def ready(self, i: int) -> bool:
        return self._events[i].is_set() and self._error is None

    def wait(self, i: int) -> None:
        """Block until layer i is in place (raises the copy's error if any)."""
        self._events[i].wait()
        if self._error is not None:
            raise self._error

    def finish(self) -> None:
        """Wait for every layer, run `done` once, raise the first error."""
        if self._finished:
            return
        self._thread.join()
        self._finished = True
        try:
            if self._done is not None:
                self._done()
        finally:
            if self._error is not None:
                raise self._error
