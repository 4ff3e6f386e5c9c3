"""Allocator metadata costs against pool size: the same figures at
16K and 1M chunks in one run, and their ratio.

- slab: making a slab (pool.alloc of a chunk-size slot: one new 1-slot slab
  per call) with the first 90 % of the chunk bitmap in use;
- release: allocator.release_empty() after an eviction batch (64 slots freed
  as the evictor frees them, then the call it makes);
- recovery: _recover_allocations of a node killed holding 10,000 one-slot
  slabs, one in ten reserved (zeroed and released), the rest published
  (orphaned); the time to zero the reserved slots again is shown beside it;
- alloc: the `cxlkv bench` allocator figure (alloc+free pairs per second).

Pools are sparse files of 64 KiB chunks under --dir (1 GiB and 64 GiB), formatted
without zeroing their data area (never written here).

    cxlkv bench run alloc-scale [--slabs N] [--recovery-slabs N] [--json]
"""
from __future__ import annotations

import os
import subprocess
import tempfile
import time

import numpy as np

import cxlkv
from cxlkv._core import Mapping
from cxlkv.bench import harness, poolops
from cxlkv.pool.format import FormatParams, format_mapping
from cxlkv.api import Pool
from cxlkv.state import alloc

KiB, MiB, GiB = harness.KiB, harness.MiB, harness.GiB
CHUNK = 64 * KiB

CHILD = r"""
import sys, numpy as np, cxlkv
p = cxlkv.open_pool(sys.argv[1])
offs = p.alloc_batch(p.sb.chunk_size, int(sys.argv[2]), zero=False)
res, pub = offs[::10], np.setdiff1d(offs, offs[::10])
for o in res.tolist():                       # reserved slots hold data (pages touched)
    p.mapping.write(o, b"R" * p.sb.chunk_size)
p.publish(pub)
print(p.node.slot, p.node.epoch, flush=True)
sys.stdin.readline()
"""


def fill_bitmap(pool, frac: float) -> None:
    """Mark the first `frac` of the chunks in use in the bitmap (scratch pool:
    chunks with bits and no slab, which the next recovery reclaims)."""
    off, _ = pool.region("bitmap")
    n = int(pool.sb.nchunks * frac) // 64
    pool.mapping.write(off, b"\xff" * (8 * n))


def slab_ms(pool, count: int) -> list[float]:
    out = []
    for _ in range(count):
        t = time.perf_counter()
        pool.alloc(CHUNK, zero=False)
        out.append((time.perf_counter() - t) * 1e3)
    return out


def release_ms(pool, rounds: int) -> list[float]:
    m, out = pool.mapping, []
    for _ in range(rounds):
        offs = pool.alloc_batch(4 * KiB, 64, zero=False)
        pool.publish(offs)
        with pool.lock():
            for o in offs.tolist():               # as kv/area.py _evict_batch frees
                one = np.array([o], dtype=np.uint64)
                m.slab_mark_freeing(one)
                m.slab_free(one, True, 0)
            t = time.perf_counter()
            pool.allocator.release_empty()
            out.append((time.perf_counter() - t) * 1e3)
    return out


def recovery_ms(path: str, slabs: int) -> tuple[float, float, int]:
    """(recovery ms, of which zeroing the reserved slots, reserved bytes) of a
    node killed holding `slabs` one-slot slabs, one in ten reserved."""
    child = harness.python(CHILD, path, slabs, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           text=True)
    slot, epoch = map(int, child.stdout.readline().split())
    with Pool.open(path) as p:
        d = alloc.descriptors(p)
        heads = np.flatnonzero(((d["control"] & 0xFF) == 1) & (d["pub_bits"][:, 0] == 0)
                               & (d["alloc_bits"][:, 0] == 1))
        del d
    child.kill()
    child.wait()
    with Pool.open(path) as p:                     # no node of ours: nobody reaps meanwhile
        data_off, chunk, _, _ = alloc.geometry(p)
        for h in heads.tolist():    # as a long-running reaper's mapping: pages mapped writable
            p.mapping.write(data_off + h * chunk, b"R" * chunk)
        t = time.perf_counter()
        alloc._recover_allocations(p, slot, epoch)
        took = (time.perf_counter() - t) * 1e3
        t = time.perf_counter()
        for h in heads.tolist():                   # the same bytes zeroed again
            p.mapping.zero(data_off + h * chunk, chunk)
        zero = (time.perf_counter() - t) * 1e3
    return took, zero, len(heads) * CHUNK


def scratch_pool(path: str, size: int) -> None:
    """A sparse pool file formatted without zeroing its (never written) data
    area, so that a 64 GiB pool costs only its metadata on disk."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        m = Mapping(fd, size, True)
        try:
            format_mapping(m, FormatParams(size=size, chunk_size=CHUNK, max_nodes=8,
                                           lease_ms=60_000), zero_data=False)
        finally:
            m.close()
    finally:
        os.close(fd)


def one_size(d: str, size: int, args) -> dict:
    path = os.path.join(d, f"scale-{size >> 30}g.pool")
    scratch_pool(path, size)
    res = {}
    try:
        with cxlkv.open_pool(path) as pool:
            res["nchunks"] = pool.sb.nchunks
            fill_bitmap(pool, 0.9)
            s = slab_ms(pool, args.slabs)
            res["slab_ms_p50"], res["slab_ms_max"] = harness.median(s), max(s)
            r = release_ms(pool, args.rounds)
            res["release_ms_p50"], res["release_ms_max"] = harness.median(r), max(r)
        res["recovery_ms"], res["recovery_zeroing_ms"], res["recovery_zeroed_bytes"] = \
            recovery_ms(path, args.recovery_slabs)
        res["recovery_slabs"] = args.recovery_slabs
    finally:
        os.unlink(path)
    return res


def add_arguments(ap) -> None:
    ap.add_argument("--slabs", type=int, default=50, help="slabs made per size")
    ap.add_argument("--rounds", type=int, default=20, help="eviction batches per size")
    ap.add_argument("--recovery-slabs", type=int, default=10_000)
    ap.add_argument("--dir", default=tempfile.gettempdir(),
                    help="where the sparse pool files go (default: the temporary directory)")


def run(args, progress) -> dict:
    with harness.scratch("cxlkv-bench-alloc-", args.dir) as d:
        progress("16K chunks")
        small = one_size(d, 1 * GiB, args)
        progress("1M chunks")
        big = one_size(d, 64 * GiB, args)
        progress("alloc + free")
        apath = harness.scratch_pool(os.path.join(d, "alloc.pool"), 256 * MiB)
        with cxlkv.open_pool(apath) as pool:
            ops = poolops.alloc_ops(pool)
    return {"small": small, "big": big,
            "ratio_slab_p50": big["slab_ms_p50"] / small["slab_ms_p50"],
            "ratio_release_p50": big["release_ms_p50"] / small["release_ms_p50"],
            "alloc_free_pairs_per_s": ops}


def render(out: dict) -> str:
    lines = []
    for name, r in (("16K", out["small"]), ("1M", out["big"])):
        lines.append(
            f"{name:>4} chunks ({r['nchunks']}): slab {r['slab_ms_p50']:.3f} ms p50 "
            f"(max {r['slab_ms_max']:.3f}), release_empty {r['release_ms_p50']:.3f} ms p50 "
            f"(max {r['release_ms_max']:.3f}), recovery of {r['recovery_slabs']} slabs "
            f"{r['recovery_ms']:.1f} ms (zeroing {r['recovery_zeroed_bytes'] >> 20} MiB of "
            f"reserved slots: {r['recovery_zeroing_ms']:.1f} ms of it)")
    lines.append(f"ratio 1M/16K: slab {out['ratio_slab_p50']:.2f}x, release_empty "
                 f"{out['ratio_release_p50']:.2f}x; allocator "
                 f"{out['alloc_free_pairs_per_s'] / 1e6:.2f} M alloc+free pairs/s")
    return "\n".join(lines)
