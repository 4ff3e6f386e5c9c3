"""Pool scenarios of `cxlkv bench`: copies through the C core, the pool lock,
the allocator (each against the harness's same-run baselines)."""
from __future__ import annotations

import time

import numpy as np

from cxlkv.bench import harness

MiB = harness.MiB

def pool_copy_gbps(pool, total: int = 64 * MiB, block: int = 256 * 1024) -> tuple[float, float]:
    """Writes (non-temporal, flushed) and reads of `block` pieces through the C core."""
    offs = pool.alloc_batch(block, total // block, zero=False)
    try:
        src = np.random.default_rng(1).integers(0, 256, block, dtype=np.uint8)
        dst = np.empty(block, dtype=np.uint8)
        m = pool.mapping
        for o in offs.tolist():          # prefault the pool pages once
            m.write(o, src)

        def w():
            t = time.perf_counter()
            for o in offs.tolist():
                m.write(o, src)
            return total / (time.perf_counter() - t) / 1e9

        def r():
            t = time.perf_counter()
            for o in offs.tolist():
                m.readinto(o, dst)
            return total / (time.perf_counter() - t) / 1e9

        return harness.median_of(w), harness.median_of(r)
    finally:
        pool.free_batch(offs, zero=False)


def lock_us(pool, n: int = 100_000) -> float:
    """Uncontended acquire + release of pool.lock(), through the public API."""
    lk = pool.lock()
    for _ in range(1000):
        with lk:
            pass

    def once():
        t = time.perf_counter()
        for _ in range(n):
            with lk:
                pass
        return (time.perf_counter() - t) / n * 1e6

    return harness.median_of(once)


def alloc_ops(pool, nbytes: int = 4096, batch: int = 256, rounds: int = 2000) -> float:
    """alloc + free pairs per second, batch forms, no zeroing (the caller overwrites)."""
    pool.free_batch(pool.alloc_batch(nbytes, batch, zero=False), zero=False)

    def once():
        t = time.perf_counter()
        for _ in range(rounds):
            pool.free_batch(pool.alloc_batch(nbytes, batch, zero=False), zero=False)
        return rounds * batch / (time.perf_counter() - t)

    return harness.median_of(once)
