"""`cxlkv bench`: what the pool gives, each figure beside a baseline measured
in the same run (these machines are shared and noisy; ratios are what count).

Scenarios run on scratch pools made for the run (in /dev/shm) and removed
after.  Each returns its figures; `run()` collects them into one dict with
stable keys.  A scenario that cannot run reports None and the reason.
"""
from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from typing import Callable

import numpy as np

MiB = 1 << 20

#: the targets the issues set (figure -> (comparison, value))
TARGETS = {
    "lock_cas_us": ("<=", 1.0),
    "lock_manager_us": ("<=", 50.0),
    "alloc_ops_per_s": (">=", 2_000_000),
    "alloc_utilisation": (">=", 0.92),
}


def _scratch_dir() -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return tempfile.mkdtemp(prefix="cxlkv-bench-", dir=base)


def _median(fn: Callable[[], float], repeat: int = 5) -> float:
    return statistics.median(fn() for _ in range(repeat))


def memcpy_gbps(total: int = 64 * MiB, block: int = 256 * 1024) -> float:
    """Baseline: numpy copies of `total` bytes in `block` pieces between touched buffers."""
    src = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)
    dst = np.empty_like(src)
    dst[:] = 0

    def once():
        t = time.perf_counter()
        for off in range(0, total, block):
            dst[off:off + block] = src[off:off + block]
        return total / (time.perf_counter() - t) / 1e9

    return _median(once)


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

        return _median(w), _median(r)
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

    return _median(once)


def alloc_ops(pool, nbytes: int = 4096, batch: int = 256, rounds: int = 2000) -> float:
    """alloc + free pairs per second, batch forms, no zeroing (the caller overwrites)."""
    pool.free_batch(pool.alloc_batch(nbytes, batch, zero=False), zero=False)

    def once():
        t = time.perf_counter()
        for _ in range(rounds):
            pool.free_batch(pool.alloc_batch(nbytes, batch, zero=False), zero=False)
        return rounds * batch / (time.perf_counter() - t)

    return _median(once)


def run(progress: Callable[[str], None] = lambda s: None, quick: bool = False) -> dict:
    """Every scenario; one dict of figures with stable keys.

    quick=True shrinks every scenario (for tests: the figures mean little)."""
    import cxlkv
    from cxlkv.pool.admin import init_pool
    from cxlkv.state.trace import run_trace

    out: dict = {"version": cxlkv.__version__, "notes": {}}
    d = _scratch_dir()
    try:
        progress("memcpy baseline")
        total = 8 * MiB if quick else 64 * MiB
        out["memcpy_gbps"] = memcpy_gbps(total)

        path = os.path.join(d, "cas.pool")
        init_pool(path, {"size": (64 if quick else 512) * MiB, "sync": "cas"})
        with cxlkv.open_pool(path) as pool:
            progress("pool writes and reads")
            out["pool_write_gbps"], out["pool_read_gbps"] = pool_copy_gbps(pool, total)
            progress("cas lock")
            out["lock_cas_us"] = lock_us(pool, 2000 if quick else 100_000)
            progress("alloc + free")
            out["alloc_ops_per_s"] = alloc_ops(pool, rounds=20 if quick else 2000)
        progress("manager lock")
        path = os.path.join(d, "manager.pool")
        init_pool(path, {"size": 64 * MiB, "sync": "manager", "chunk_size": MiB})
        from cxlkv.daemons.lockmgr import ensure_manager

        _, stop = ensure_manager(path)
        try:
            with cxlkv.open_pool(path) as pool:
                out["lock_manager_us"] = lock_us(pool, 200 if quick else 5000)
        finally:
            stop()

        progress("utilisation trace")
        path = os.path.join(d, "trace.pool")
        init_pool(path, {"size": (256 * MiB) if quick else (1 << 30)})
        with cxlkv.open_pool(path) as pool:
            tr = run_trace(pool, seed=1)
        out["alloc_utilisation"] = tr["utilisation"]
        out["buddy_utilisation"] = tr["buddy_utilisation"]
        out["trace"] = {k: tr[k] for k in ("sequences", "payload_bytes", "data_bytes",
                                           "block_bytes", "blocks")}
    finally:
        shutil.rmtree(d, ignore_errors=True)
    m = out["memcpy_gbps"]
    out["pool_write_vs_memcpy"] = out["pool_write_gbps"] / m
    out["pool_read_vs_memcpy"] = out["pool_read_gbps"] / m
    out["utilisation_vs_buddy"] = out["alloc_utilisation"] / out["buddy_utilisation"]
    out["targets"] = {k: _meets(out.get(k), *t) for k, t in TARGETS.items()}
    return out


def _meets(value, op: str, target: float):
    if value is None:
        return None
    return value <= target if op == "<=" else value >= target
