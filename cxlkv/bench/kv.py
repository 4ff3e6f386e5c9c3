"""KV cache scenarios of `cxlkv bench`: kv.store / kv.load_into throughput
and kv.match latency, on a namespace of their own that they drop."""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from cxlkv.bench import harness
from cxlkv.errors import UsageError
from cxlkv.kv.cache import drop_namespace

MiB, KiB = harness.MiB, harness.KiB

#: the KV scenarios' shape: one prefix of 64 MiB in 256 KiB blocks of 16 tokens
KV_TOTAL = 64 * MiB
KV_BLOCK = 256 * KiB
KV_BLOCK_TOKENS = 16
#: lookup: 32768 tokens = 2048 blocks of 16, small blocks
LOOKUP_TOKENS = 32768
LOOKUP_BLOCK = 4096


def tokens(rep: int, ntokens: int, base: int = 0) -> np.ndarray:
    """Token ids distinct for every `rep` (so every store really writes)."""
    start = base + rep * ntokens
    return np.arange(start, start + ntokens, dtype=np.uint32)


def drop(pool, name: str) -> None:
    """Drop namespace `name` if it exists (its blocks only; never others')."""
    try:
        drop_namespace(pool, name)
    except UsageError:
        pass                                            # not there: nothing to drop


def kv_put_get(pool, ns: str, total: int = KV_TOTAL, block: int = KV_BLOCK, reps: int = 5,
               guard: Callable[[int, int], None] | None = None) -> tuple[float, float]:
    """kv.store of `total` bytes in `block` blocks (fresh tokens every rep) and
    kv.load_into of them into a touched 4 KiB-aligned buffer: (put, get) GB/s,
    medians.  The namespace is dropped between reps (outside the timing); the
    first rep warms the pool pages and checks the bytes."""
    r = _put_get_reps(pool, ns, total, block, reps, guard)
    return harness.median(r["put"]), harness.median(r["get"])


def kv_put_get_paired(pool, ns: str, total: int = KV_TOTAL, block: int = KV_BLOCK,
                      reps: int = 5, guard: Callable[[int, int], None] | None = None,
                      memcpy: "harness.Memcpy | None" = None) -> dict:
    """kv_put_get with a memcpy of the same bytes timed just before every
    timed rep: put_gbps, get_gbps and memcpy_gbps (medians), and put_vs_memcpy
    and get_vs_memcpy as the medians of each rep's ratio to the memcpy beside
    it (on a machine whose memory speed drifts, a ratio of two figures timed
    minutes apart measures the drift as much as the copy)."""
    memcpy = memcpy or harness.Memcpy(total)
    r = _put_get_reps(pool, ns, total, block, reps, guard, memcpy)
    med = harness.median
    return {"put_gbps": med(r["put"]), "get_gbps": med(r["get"]),
            "memcpy_gbps": med(r["memcpy"]),
            "put_vs_memcpy": med([p / m for p, m in zip(r["put"], r["memcpy"])]),
            "get_vs_memcpy": med([g / m for g, m in zip(r["get"], r["memcpy"])]),
            "reps": r}


def _put_get_reps(pool, ns: str, total: int, block: int, reps: int, guard,
                  memcpy: "harness.Memcpy | None" = None) -> dict:
    """Every timed rep's put and get GB/s (and memcpy GB/s, timed before it)."""
    n = total // block
    src = harness.buffer(total, seed=2)
    out = harness.buffer(total)
    res: dict = {"put": [], "get": [], "memcpy": []}
    try:
        for rep in range(reps + 1):
            drop(pool, ns)
            if guard:
                guard(block, n)
            kv = pool.kv(model=ns, block_tokens=KV_BLOCK_TOKENS, block_bytes=block)
            toks = tokens(rep, n * KV_BLOCK_TOKENS)
            base = memcpy.gbps() if memcpy is not None and rep else None
            t0 = time.perf_counter()
            stored = kv.store(toks, src)
            t1 = time.perf_counter()
            got = kv.load_into(toks, out)
            t2 = time.perf_counter()
            if stored != n or got != n:
                raise RuntimeError(f"kv bench: stored {stored} and loaded {got} of {n} blocks")
            if rep == 0:
                if not np.array_equal(out, src):
                    raise RuntimeError("kv bench: load_into gave other bytes than stored")
                continue
            res["put"].append(total / (t1 - t0) / 1e9)
            res["get"].append(total / (t2 - t1) / 1e9)
            if base is not None:
                res["memcpy"].append(base)
    finally:
        drop(pool, ns)
    return res


def kv_lookup_ms(pool, ns: str, ntokens: int = LOOKUP_TOKENS, block: int = LOOKUP_BLOCK,
                 repeat: int = 50, guard: Callable[[int, int], None] | None = None
                 ) -> tuple[float, float]:
    """kv.match of `ntokens` tokens, every block present, hashing included:
    median milliseconds with the tokens as a uint32 array, and as a Python
    list of ints (what most callers hold)."""
    n = ntokens // KV_BLOCK_TOKENS
    drop(pool, ns)
    if guard:
        guard(block, n)
    try:
        kv = pool.kv(model=ns, block_tokens=KV_BLOCK_TOKENS, block_bytes=block)
        toks = tokens(0, ntokens)
        if kv.store(toks, harness.buffer(n * block, seed=3)) != n:
            raise RuntimeError("kv bench: the lookup prefix was not stored whole")
        lst = toks.tolist()
        res = []
        for arg in (toks, lst):
            for _ in range(3):
                kv.match(arg)
            ts = []
            for _ in range(repeat):
                t = time.perf_counter()
                m = kv.match(arg)
                ts.append(time.perf_counter() - t)
                if m != ntokens:
                    raise RuntimeError(f"kv bench: match found {m} of {ntokens} tokens")
            res.append(harness.median(ts) * 1e3)
        return res[0], res[1]
    finally:
        drop(pool, ns)
