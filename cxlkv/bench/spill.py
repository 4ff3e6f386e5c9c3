"""Spill tier figures: spill write and promote throughput vs raw
sequential file I/O on the same disk (same run; reads both from the page
cache and from the disk with the page cache dropped), and the hit rate of a trace
larger than the pool without the spill tier, with it (this process owns the
store) and as a reader of a store another process owns (as under
`cxlkv serve --spill-dir`).

The store alone and the raw baselines (buffered and O_DIRECT) run in
alternating 32 MiB chunks, `--rounds` times: a shared disk stalls for a
while now and then, and each stall then lands on all of them alike; the
median of the rounds' ratios is reported.

The store picks its read path by timing its own reads (`--read-path auto`,
cxlkv/kv/tiers/spill/readpath.py; each round says which it took and what
each path measured); `--read-path mapped` or `pread` fixes one, for an A/B
of the two in the same hour.

    cxlkv bench run spill [--dir DIR] [--mib N] [--rounds R]
                          [--read-path auto|mapped|pread] [--json]
"""
from __future__ import annotations

import mmap
import os
import shutil
import statistics
import subprocess
import time

import numpy as np
import xxhash

import cxlkv
from cxlkv import _core
from cxlkv.bench import harness
from cxlkv.kv.cache import KVCache
from cxlkv.errors import BenchRefused
from cxlkv.kv.tiers import spill
from cxlkv.kv.tiers.spill import readpath
from cxlkv.kv.tiers.spill import store as spill_store

MiB = harness.MiB
BB = 256 * 1024
RUN = 8                      # blocks per sequence (a promotion fetches such a run)
COLD_MAX = 128 * MiB         # bytes of each round of reads from the disk


def mkpool(path, size):
    harness.scratch_pool(path, size, chunk_size=1 * MiB, max_nodes=8, lease_ms=2000)


def raw_io(d, nbytes):
    """Sequential write (no fsync, as the spill writer) and read back of one file."""
    buf = os.urandom(BB)
    f = os.path.join(d, "raw.dat")
    t0 = time.perf_counter()
    fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    for _ in range(nbytes // BB):
        os.write(fd, buf)
    os.close(fd)
    w = time.perf_counter() - t0
    t0 = time.perf_counter()
    with open(f, "rb") as fh:
        while fh.read(BB):
            pass
    r = time.perf_counter() - t0
    os.unlink(f)
    return nbytes / w, nbytes / r


def interleaved(d, nbytes, chunk=32 * MiB):
    """The spill store alone against raw sequential I/O and raw O_DIRECT I/O
    of the same bytes, in alternating chunks (a shared disk stalls for a
    while now and then: each stall lands on all of them alike).  Writes: raw
    sequential writes of one file (no fsync, as the spill writers), the store's offer
    of the chunk's 256 KiB blocks and its writers drained, O_DIRECT appends;
    reads: the raw file read back (a new bytes object per 256 KiB pread, as
    the issue's baseline), the store's fetch (read + verify) of runs of 8
    blocks as promotion asks for them, the O_DIRECT file read back, and the
    raw file read back into 8 reused buffers, one per block of a run (the
    destination the store's fetch has: a run's blocks are alive together),
    and that again with an xxh3-64 of each block after its read (the least
    a verified read does: the store's check is that hash).
    Returns bytes/s for each, and bytes per CPU second of the process (all
    its threads: the store's writers and read helpers count) for the raw
    and store phases ("*_cpu"), and the units the read helpers took."""
    buf = os.urandom(BB)
    al = mmap.mmap(-1, BB)                             # page aligned, for O_DIRECT
    al.write(buf)
    raw_f, dir_f = os.path.join(d, "raw.dat"), os.path.join(d, "direct.dat")
    st = spill.SpillStore(os.path.join(d, "direct"), 4 * nbytes, queue_bytes=2 * chunk)
    keys = [os.urandom(16) for _ in range(nbytes // BB)]
    per = chunk // BB
    runbufs = [np.empty(BB, dtype=np.uint8) for _ in range(RUN)]
    want = xxhash.xxh3_64_intdigest(buf)               # every block's checksum
    t = dict.fromkeys(("raw_w", "store_w", "dir_w", "raw_r", "store_r", "dir_r", "bufs_r", "sum_r",
                       "raw_w_cpu", "store_w_cpu", "raw_r_cpu", "store_r_cpu"), 0.0)
    h0 = _core.spill_helper_stats()
    rfd = os.open(raw_f, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        dfd = os.open(dir_f, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    except OSError:                                    # no O_DIRECT on this file system
        dfd = None
    try:
        for c in range(0, len(keys), per):
            # the raw and the store's writes, the order turning each chunk:
            # neither always writes into the page cache the other left
            # dirty (the kernel's dirty throttling: scripts/write_sizes.py)
            for what in (("raw", "store") if (c // per) % 2 == 0 else ("store", "raw")):
                c0, t0 = time.process_time(), time.perf_counter()
                if what == "raw":
                    for i in range(c, c + per):
                        os.pwrite(rfd, buf, i * BB)
                else:
                    for k in keys[c:c + per]:
                        st.offer(k, b"n" * 16, buf)
                    st.flush()
                t[what + "_w"] += time.perf_counter() - t0
                t[what + "_w_cpu"] += time.process_time() - c0
            t2 = time.perf_counter()
            if dfd is not None:
                for i in range(c, c + per):
                    os.pwritev(dfd, [al], i * BB)
            t["dir_w"] += time.perf_counter() - t2
        for c in range(0, len(keys), per):
            c0, t0 = time.process_time(), time.perf_counter()
            for i in range(c, c + per):
                if len(os.pread(rfd, BB, i * BB)) != BB:
                    raise RuntimeError("spill bench: short raw read")
            c1, t1 = time.process_time(), time.perf_counter()
            for r in range(c, c + per, RUN):           # runs of blocks, as promotion asks
                if len(st.fetch(keys[r:r + RUN], b"n" * 16, BB)) != len(keys[r:r + RUN]):
                    raise RuntimeError("spill bench: a block offered to the store is not there")
            c2, t2 = time.process_time(), time.perf_counter()
            if dfd is not None:
                for i in range(c, c + per):
                    os.preadv(dfd, [al], i * BB)
            t3 = time.perf_counter()
            # the two reads into a run's buffers, the order turning each
            # chunk (the second finds what the first left in the CPU's caches)
            for what in (("bufs_r", "sum_r") if (c // per) % 2 == 0 else ("sum_r", "bufs_r")):
                t4 = time.perf_counter()
                for i in range(c, c + per):
                    b = runbufs[i % RUN]
                    if os.preadv(rfd, [b], i * BB) != BB:
                        raise RuntimeError("spill bench: short raw read")
                    if what == "sum_r" and xxhash.xxh3_64_intdigest(b) != want:
                        raise RuntimeError("spill bench: the raw file read back other bytes")
                t[what] += time.perf_counter() - t4
            t["raw_r"] += t1 - t0
            t["store_r"] += t2 - t1
            t["dir_r"] += t3 - t2
            t["raw_r_cpu"] += c1 - c0
            t["store_r_cpu"] += c2 - c1
    finally:
        os.close(rfd)
        os.unlink(raw_f)
        if dfd is not None:
            os.close(dfd)
        os.unlink(dir_f)
        st.close()
        shutil.rmtree(os.path.join(d, "direct"))
    n = len(keys) * BB
    paths = {k: v for k, v in st.stats().items() if k.startswith("read_")}
    h1 = _core.spill_helper_stats()
    hu, cu = (h1[k] - h0[k] for k in ("helper_units", "caller_units"))
    return {**{k: (n / v if v else 0.0) for k, v in t.items()},
            "helper_share": hu / (hu + cu) if hu + cu else 0.0, "helpers": h1["helpers"],
            "paths": paths}


def _drop_cached(root) -> None:
    """Write the files under `root` to disk and drop their pages from the
    page cache (pages mapped into a process stay: the store's data mapping
    is made on its first mapped read, after this).  Everything else dirty
    is written first too (os.sync), so that no write-back runs under the
    reads."""
    os.sync()
    for dirpath, _, names in os.walk(root):
        for nm in names:
            fd = os.open(os.path.join(dirpath, nm), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def cold_reads(d, nbytes, rounds):
    """Reads from the disk rather than the page cache: per round a fresh
    store and a raw file of the same blocks, both written, synced and
    dropped from the page cache; then the raw file read back (a pread per
    256 KiB block) and the store's fetch + verify of runs of 8 blocks, the
    order turning each round, the cache dropped again between the two.
    Bytes/s of each, per round."""
    buf = os.urandom(BB)
    out = []
    for r in range(rounds):
        root = os.path.join(d, "cold")
        os.makedirs(root)
        st = spill.SpillStore(os.path.join(root, "store"), 4 * nbytes, queue_bytes=2 * nbytes)
        try:
            keys = [os.urandom(16) for _ in range(nbytes // BB)]
            for k in keys:
                if not st.offer(k, b"c" * 16, buf):
                    raise RuntimeError("spill bench: the store refused a block (cold reads)")
            st.flush()
            raw_f = os.path.join(root, "raw.dat")
            fd = os.open(raw_f, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                # laid out in one go, as the store's preallocated slot files
                # are (appends after the earlier phases' deleted files got
                # scattered extents: 0.6-1.6 GiB/s read back rather than 3)
                os.posix_fallocate(fd, 0, len(keys) * BB)
                for _ in keys:
                    os.write(fd, buf)
                t = {}
                for what in (("raw", "store") if r % 2 == 0 else ("store", "raw")):
                    _drop_cached(root)
                    t0 = time.perf_counter()
                    if what == "raw":
                        for i in range(len(keys)):
                            if len(os.pread(fd, BB, i * BB)) != BB:
                                raise RuntimeError("spill bench: short raw read")
                    else:
                        for i in range(0, len(keys), RUN):
                            if len(st.fetch(keys[i:i + RUN], b"c" * 16, BB)) != \
                                    len(keys[i:i + RUN]):
                                raise RuntimeError("spill bench: a block offered to the store "
                                                   "is not there (cold reads)")
                    t[what] = len(keys) * BB / (time.perf_counter() - t0)
            finally:
                os.close(fd)
            out.append({"raw_read_Bps": t["raw"], "store_read_Bps": t["store"],
                        "store_vs_raw_read": t["store"] / t["raw"],
                        "read_path": st.stats()["read_path"]})
        finally:
            st.close()
            shutil.rmtree(root)
    return out


def raw_files(d, nbytes):
    """One file per 256 KiB block (the spill store's layout, without its header,
    checksum and rename), then read back."""
    buf = os.urandom(BB)
    root = os.path.join(d, "rawfiles")
    for i in range(256):
        os.makedirs(os.path.join(root, f"{i:02x}"))
    n = nbytes // BB
    t0 = time.perf_counter()
    for i in range(n):
        fd = os.open(os.path.join(root, f"{i % 256:02x}", str(i)), os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, buf)
        os.close(fd)
    w = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(n):
        with open(os.path.join(root, f"{i % 256:02x}", str(i)), "rb") as fh:
            fh.read()
    r = time.perf_counter() - t0
    shutil.rmtree(root)
    return nbytes / w, nbytes / r


def spill_throughput(d, pool_path, nbytes):
    """Spill: fill a pool 4x over with spill on; bytes written by the writer
    over the time from the first store to the queue drained.  Promote:
    load_into of sequences wholly on disk; bytes over time."""
    mkpool(pool_path, 64 * MiB)
    sdir = os.path.join(d, "spill")
    with cxlkv.open_pool(pool_path) as pool:
        kv = KVCache(pool, model="bench", block_tokens=16, block_bytes=BB,
                     spill_dir=sdir, spill_bytes=4 * nbytes)
        sp = spill.store_of(pool)
        nseq = nbytes // (8 * BB)
        seqs = [list(range(s * 10000, s * 10000 + 16 * 8)) for s in range(nseq)]
        data = np.random.default_rng(1).integers(0, 255, 8 * BB, dtype=np.uint8)
        t0 = time.perf_counter()
        for i, t in enumerate(seqs):
            data[:8] = i
            kv.store(t, data)
        store_t = time.perf_counter() - t0
        sp.flush()
        spill_t = time.perf_counter() - t0
        st = sp.stats()
        written = st["written_bytes"]
        # promote: sequences whose first block is not in the pool
        cold = [t for t in seqs if kv._lookup(kv._keys(t))[0] == 0 and kv.match(t) == len(t)]
        cold = cold[: max(1, (48 * MiB) // (8 * BB))]       # under the pool's free room
        out = bytearray(8 * BB)
        t0 = time.perf_counter()
        got = 0
        for t in cold:
            got += kv.load_into(t, out)
        prom_t = time.perf_counter() - t0
        st2 = sp.stats()
        spill.disable(pool)
    shutil.rmtree(sdir, ignore_errors=True)
    fetched = (st2["hits"] - st["hits"]) * BB
    fetch_s = st2["read_s"] - st["read_s"]
    return {"stored_bytes": nseq * 8 * BB, "store_s": store_t, "drain_s": spill_t - store_t,
            "spilled_bytes": written, "spill_write_Bps": written / spill_t,
            "writers_busy_s": st["write_s"], "dropped": st["dropped"],
            "promoted_bytes": got * BB, "promote_Bps": got * BB / prom_t, "promote_s": prom_t,
            "promote_fetch_s": fetch_s, "promote_fetch_Bps": fetched / fetch_s if fetch_s else 0.0,
            "promoted": st2["promoted"], "corrupt": st2["corrupt"]}


OWNER = """
import sys
from cxlkv.errors import BenchRefused
from cxlkv.kv.tiers import spill
from cxlkv.kv.tiers.spill import store as spill_store
st = spill.SpillStore(sys.argv[1], int(sys.argv[2]), mode="owner")
print("owner", flush=True)
sys.stdin.read()
st.close()
"""


def hit_rate(d, pool_path, with_spill, reader=False):
    """A trace of 4000 requests over 600 prefixes of 8 blocks (1.2 GiB of
    distinct blocks; Zipf-like popularity) through a 256 MiB pool; each request
    loads what is cached and stores the rest.  reader=True: another process
    owns the store (this one's lookups stat, its writes go through the shared
    count)."""
    mkpool(pool_path, 256 * MiB)
    nprefix, nreq = 600, 4000
    w = np.array([1 / (i + 1) ** 0.6 for i in range(nprefix)])
    w /= w.sum()
    trace = np.random.default_rng(7).choice(nprefix, size=nreq, p=w)
    sdir = os.path.join(d, "spill-hr")
    hits = total = 0
    owner = None
    if reader:
        owner = harness.python(OWNER, sdir, 2048 * MiB, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
        if owner.stdout.readline().strip() != "owner":
            raise RuntimeError("spill bench: the owner process did not start")
    with cxlkv.open_pool(pool_path) as pool:
        kw = {"spill_dir": sdir, "spill_bytes": 2048 * MiB} if with_spill else {}
        kv = KVCache(pool, model="trace", block_tokens=16, block_bytes=BB, **kw)
        data = np.zeros(8 * BB, dtype=np.uint8)
        out = bytearray(8 * BB)
        t0 = time.perf_counter()
        for p in trace:
            t = list(range(int(p) * 10000, int(p) * 10000 + 16 * 8))
            n = kv.load_into(t, out)
            hits += n
            total += 8
            if n < 8:
                data[:8] = p
                kv.store(t, data)
        el = time.perf_counter() - t0
        st = spill.store_of(pool).stats() if with_spill else None
        if with_spill:
            if st["mode"] != ("reader" if reader else "owner"):
                raise RuntimeError(f"spill bench: the store is {st['mode']}")
            spill.disable(pool)
    if owner is not None:
        owner.stdin.close()
        owner.wait(60)
    shutil.rmtree(sdir, ignore_errors=True)
    return {"hit_rate": hits / total, "seconds": el, "spill": st}


def add_arguments(ap) -> None:
    ap.add_argument("--dir", default=None,
                    help="directory on the disk to measure (default /var/tmp)")
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5,
                    help="interleaved rounds of the raw baselines and the store alone")
    ap.add_argument("--read-helpers", type=int, default=None,
                    help="helper threads of the spill read path (this process's; default: "
                         f"the store's, {spill_store.READ_HELPERS} on this machine)")
    ap.add_argument("--read-path", choices=readpath.CHOICES, default="auto",
                    help="how the store reads payloads: copied out of a mapping of the slot "
                         "file and hashed in the same pass (mapped), preadv and then hashed "
                         "(pread), or whichever its own reads time faster (auto, the store's "
                         "default)")


def run(a, progress) -> dict:
    # the disk measured in --dir (the spill store's place); the pool in /dev/shm
    with harness.scratch("cxlkv-spill-bench-", a.dir or "/var/tmp") as d, \
            harness.scratch("cxlkv-spill-bench-pool-") as pd:
        pool_path = os.path.join(pd, "bench.pool")
        nbytes = a.mib * MiB
        helpers = spill_store.READ_HELPERS if a.read_helpers is None else a.read_helpers
        if not 0 <= helpers <= spill_store.MAX_READ_HELPERS:
            raise BenchRefused(f"--read-helpers must be 0..{spill_store.MAX_READ_HELPERS}")
        _core.spill_helpers(helpers)            # process-wide; a store only ever adds some
        spill_store.READ_HELPERS = helpers      # the default of the stores made below
        readpath.DEFAULT = a.read_path          # likewise
        rounds = []
        for i in range(max(1, a.rounds)):
            progress(f"round {i + 1}: raw I/O, the spill store alone, raw O_DIRECT, interleaved")
            f = interleaved(d, nbytes)
            rounds.append({"raw_write_Bps": f["raw_w"], "raw_read_Bps": f["raw_r"],
                           "store_write_Bps": f["store_w"], "store_read_Bps": f["store_r"],
                           "direct_write_Bps": f["dir_w"], "direct_read_Bps": f["dir_r"],
                           "raw_read_run_bufs_Bps": f["bufs_r"],
                           "raw_read_verify_Bps": f["sum_r"],
                           "raw_write_cpu_Bps": f["raw_w_cpu"],
                           "store_write_cpu_Bps": f["store_w_cpu"],
                           "raw_read_cpu_Bps": f["raw_r_cpu"],
                           "store_read_cpu_Bps": f["store_r_cpu"],
                           "read_helpers": f["helpers"], "helper_unit_share": f["helper_share"],
                           "read_path": f["paths"]["read_path"],
                           "read_mapped_Bps": f["paths"]["read_mapped_Bps"],
                           "read_pread_Bps": f["paths"]["read_pread_Bps"],
                           "store_vs_raw_write": f["store_w"] / f["raw_w"],
                           "store_vs_raw_read": f["store_r"] / f["raw_r"],
                           "store_vs_raw_read_run_bufs": f["store_r"] / f["bufs_r"],
                           "store_vs_raw_read_verify": f["store_r"] / f["sum_r"],
                           "raw_read_verify_vs_raw_read": f["sum_r"] / f["raw_r"],
                           "direct_vs_raw_write": f["dir_w"] / f["raw_w"],
                           "direct_vs_raw_read": f["dir_r"] / f["raw_r"]})
        progress("reads from the disk (page cache dropped)")
        cold = cold_reads(d, min(nbytes, COLD_MAX), max(1, a.rounds))
        progress("raw I/O")
        rw, rr = raw_io(d, nbytes)
        progress("spill and promote")
        sp = spill_throughput(d, pool_path, nbytes)
        progress("raw I/O again")
        rw2, rr2 = raw_io(d, nbytes)
        progress("raw I/O, one file per block")
        fw, fr = raw_files(d, nbytes)
        progress("hit rate without spill")
        h0 = hit_rate(d, pool_path, False)
        progress("hit rate with spill")
        h1 = hit_rate(d, pool_path, True)
        progress("hit rate, spill as a reader")
        h2 = hit_rate(d, pool_path, True, reader=True)
        med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]
               if k != "read_path"}
        return {"dir": d, "rounds": rounds,
                "store_vs_raw_write": med["store_vs_raw_write"],
                "store_vs_raw_read": med["store_vs_raw_read"],
                "store_vs_raw_read_run_bufs": med["store_vs_raw_read_run_bufs"],
                "store_vs_raw_read_verify": med["store_vs_raw_read_verify"],
                "raw_read_verify_vs_raw_read": med["raw_read_verify_vs_raw_read"],
                "direct_vs_raw_write": med["direct_vs_raw_write"],
                "direct_vs_raw_read": med["direct_vs_raw_read"],
                "store_vs_raw_read_cpu": med["store_read_cpu_Bps"] / med["raw_read_cpu_Bps"],
                "store_vs_raw_write_cpu": med["store_write_cpu_Bps"] / med["raw_write_cpu_Bps"],
                "read_helpers": rounds[0]["read_helpers"], "read_path": a.read_path,
                "read_paths_taken": [r["read_path"] for r in rounds],
                "helper_unit_share": med["helper_unit_share"],
                "store_write_Bps": med["store_write_Bps"], "store_read_Bps": med["store_read_Bps"],
                "cold_rounds": cold,
                "store_vs_raw_read_cold": statistics.median(c["store_vs_raw_read"] for c in cold),
                "cold_raw_read_Bps": statistics.median(c["raw_read_Bps"] for c in cold),
                "cold_store_read_Bps": statistics.median(c["store_read_Bps"] for c in cold),
                "raw_write_Bps": (rw, rw2), "raw_read_Bps": (rr, rr2), **sp,
                "spill_vs_raw_write": sp["spill_write_Bps"] / ((rw + rw2) / 2),
                "promote_vs_raw_read": sp["promote_Bps"] / ((rr + rr2) / 2),
                "promote_fetch_vs_raw_read": sp["promote_fetch_Bps"] / ((rr + rr2) / 2),
                "raw_files_write_Bps": fw, "raw_files_read_Bps": fr,
                "hit_rate_no_spill": h0["hit_rate"], "hit_rate_spill": h1["hit_rate"],
                "trace_s_no_spill": h0["seconds"], "trace_s_spill": h1["seconds"],
                "trace_spill_stats": h1["spill"], "hit_rate_spill_reader": h2["hit_rate"],
                "trace_s_spill_reader": h2["seconds"], "trace_spill_reader_stats": h2["spill"]}


def render(rep: dict) -> str:
    G = 1 << 30
    (rw, rw2), (rr, rr2) = rep["raw_write_Bps"], rep["raw_read_Bps"]
    fw, fr = rep["raw_files_write_Bps"], rep["raw_files_read_Bps"]
    cold = ", ".join(f"{c['store_vs_raw_read']:.2f}" for c in rep["cold_rounds"])
    lines = [f"disk dir {rep['dir']}"]
    for i, r in enumerate(rep["rounds"]):
        lines.append(
            f"round {i + 1}: raw write {r['raw_write_Bps'] / G:.2f} GiB/s, store write "
            f"{r['store_write_Bps'] / G:.2f} ({r['store_vs_raw_write']:.2f}x), O_DIRECT write "
            f"{r['direct_write_Bps'] / G:.2f} ({r['direct_vs_raw_write']:.2f}x); raw read "
            f"{r['raw_read_Bps'] / G:.2f}, store fetch+verify {r['store_read_Bps'] / G:.2f} "
            f"({r['store_vs_raw_read']:.2f}x; {r['store_vs_raw_read_run_bufs']:.2f}x raw into a "
            f"run's buffers, {r['raw_read_run_bufs_Bps'] / G:.2f}; "
            f"{r['store_vs_raw_read_verify']:.2f}x those with an xxh3 of each, "
            f"{r['raw_read_verify_Bps'] / G:.2f}), O_DIRECT read "
            f"{r['direct_read_Bps'] / G:.2f} ({r['direct_vs_raw_read']:.2f}x); per CPU second of "
            f"the process: raw write {r['raw_write_cpu_Bps'] / G:.2f}, store write "
            f"{r['store_write_cpu_Bps'] / G:.2f}, raw read {r['raw_read_cpu_Bps'] / G:.2f}, store "
            f"read {r['store_read_cpu_Bps'] / G:.2f} GiB (helpers read "
            f"{r['helper_unit_share']:.0%} of the units); read path {r['read_path']}"
            + (f" (its runs: mapped {r['read_mapped_Bps'] / G:.2f}, pread "
               f"{r['read_pread_Bps'] / G:.2f} GiB/s, medians)" if rep["read_path"] == "auto"
               else ""))
    lines += [
        f"SpillStore alone (median of {len(rep['rounds'])} rounds): write "
        f"{rep['store_vs_raw_write']:.2f}x a raw sequential write of the same bytes, "
        f"fetch+verify {rep['store_vs_raw_read']:.2f}x a raw read "
        f"({rep['store_vs_raw_read_run_bufs']:.2f}x one into a run's 8 reused buffers, "
        f"{rep['store_vs_raw_read_verify']:.2f}x that with an xxh3 of each block, itself "
        f"{rep['raw_read_verify_vs_raw_read']:.2f}x the raw read); O_DIRECT "
        f"{rep['direct_vs_raw_write']:.2f}x / {rep['direct_vs_raw_read']:.2f}x buffered",
        f"from the disk (page cache dropped, {len(rep['cold_rounds'])} rounds): store "
        f"fetch+verify {rep['cold_store_read_Bps'] / G:.2f} GiB/s, raw read "
        f"{rep['cold_raw_read_Bps'] / G:.2f} GiB/s: {rep['store_vs_raw_read_cold']:.2f}x "
        f"(rounds {cold})",
        f"CPU per byte (the process's, medians): store write {rep['store_vs_raw_write_cpu']:.2f}x, "
        f"store read {rep['store_vs_raw_read_cpu']:.2f}x the raw I/O's bytes per CPU second "
        f"({rep['read_helpers']} read helper threads took {rep['helper_unit_share']:.0%} of the "
        "units)",
        f"raw sequential write {rw / G:.2f} / {rw2 / G:.2f} GiB/s (before/after the end to end "
        f"run), read {rr / G:.2f} / {rr2 / G:.2f} GiB/s",
        f"raw one file per block (the old layout): write {fw / G:.2f} GiB/s, "
        f"read {fr / G:.2f} GiB/s",
        f"end to end, pool store -> evict -> disk: spill write "
        f"{rep['spill_write_Bps'] / G:.2f} GiB/s ({rep['spilled_bytes'] / MiB:.0f} MiB, "
        f"dropped {rep['dropped']}) = {rep['spill_vs_raw_write']:.2f}x raw write; the stores "
        f"took {rep['store_s']:.2f} s, the queue drained {rep['drain_s']:.2f} s after (writers "
        f"busy {rep['writers_busy_s']:.2f} s)",
        f"end to end promote (disk -> verify -> pool store, evicting): "
        f"{rep['promote_Bps'] / G:.2f} GiB/s ({rep['promoted_bytes'] / MiB:.0f} MiB) = "
        f"{rep['promote_vs_raw_read']:.2f}x raw read; of its {rep['promote_s']:.2f} s the spill "
        f"tier's read + verify took {rep['promote_fetch_s']:.3f} s "
        f"({rep['promote_fetch_vs_raw_read']:.2f}x raw read), the pool's store the rest",
        f"hit rate, trace of 1.2 GiB distinct blocks through a 256 MiB pool: "
        f"{rep['hit_rate_no_spill']:.3f} without spill, {rep['hit_rate_spill']:.3f} with, "
        f"{rep['hit_rate_spill_reader']:.3f} as a reader of another process's store "
        f"({rep['trace_s_no_spill']:.1f} s / {rep['trace_s_spill']:.1f} s / "
        f"{rep['trace_s_spill_reader']:.1f} s)"]
    return "\n".join(lines)
