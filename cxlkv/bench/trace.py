"""The long-context allocation trace behind the utilisation figure.

Sequences with long-tailed lengths (log-normal, median 8K tokens, clipped to
1K-128K) from three small open models with different KV block sizes (16
tokens per block, all layers, K and V, bf16) are stored block by block until
the first allocation failure; utilisation = live payload bytes / data-area
bytes at that moment.  The same trace is replayed against a buddy
allocator model (every block rounded up to a power of two, perfect packing
otherwise), for comparison.
"""
from __future__ import annotations

import math

import numpy as np

from cxlkv.state.alloc import PoolFullError

#: (name, layers, kv heads, head dim, bytes per element, tokens per block)
MODELS = (
    ("qwen2-0.5b", 24, 2, 64, 2, 16),       # 192 KiB blocks
    ("smollm-135m", 30, 3, 64, 2, 16),      # 360 KiB blocks
    ("llama-3.2-1b", 16, 8, 64, 2, 16),     # 512 KiB blocks
)


def block_bytes(layers: int, heads: int, dim: int, elt: int, tokens: int) -> int:
    return 2 * layers * heads * dim * elt * tokens        # K and V


def sequences(seed: int, n: int = 100_000):
    """(model index, token count) pairs of the trace, deterministic per seed."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(math.log(8192), 1.0, n), 1024, 131072).astype(np.int64)
    models = rng.integers(0, len(MODELS), n)
    return zip(models.tolist(), lengths.tolist())


def run_trace(pool, seed: int = 1) -> dict:
    """Replay the trace into an attached pool; frees everything after."""
    data_size = pool.region("data")[1]
    sizes = [block_bytes(*m[1:]) for m in MODELS]
    live, payload, stored, blocks_per_model = [], 0, 0, [0] * len(MODELS)
    full = False
    try:
        for model, tokens in sequences(seed):
            nblocks = tokens // MODELS[model][5]
            try:
                offs = pool.alloc_batch(sizes[model], nblocks, zero=False)
            except PoolFullError:
                # store what still fits, block by block, up to the first failure
                offs = []
                try:
                    for _ in range(nblocks):
                        offs.append(pool.alloc(sizes[model], zero=False))
                except PoolFullError:
                    full = True
                offs = np.array(offs, dtype=np.uint64)
            live.append(offs)
            payload += len(offs) * sizes[model]
            blocks_per_model[model] += len(offs)
            stored += 1
            if full:
                break
    finally:
        for offs in live:
            pool.free_batch(offs, zero=False)
    return {"sequences": stored, "payload_bytes": payload, "data_bytes": data_size,
            "utilisation": payload / data_size,
            "buddy_utilisation": buddy_utilisation(data_size, seed),
            "block_bytes": dict(zip((m[0] for m in MODELS), sizes)),
            "blocks": dict(zip((m[0] for m in MODELS), blocks_per_model))}


def buddy_utilisation(capacity: int, seed: int = 1) -> float:
    """The same trace against a buddy allocator: blocks rounded up to 2^k."""
    sizes = [block_bytes(*m[1:]) for m in MODELS]
    used = payload = 0
    for model, tokens in sequences(seed):
        n = tokens // MODELS[model][5]
        cost = 1 << (sizes[model] - 1).bit_length()
        fit = min(n, (capacity - used) // cost)
        used += fit * cost
        payload += fit * sizes[model]
        if fit < n:
            break
    return payload / capacity
