"""The KV cache engine: keys, store/match/load, pins and eviction, tenants,
quotas, several processes, crashes, manager mode under the non-coherence
emulation."""
from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
import threading

import numpy as np
import pytest

import cxlkv
from cxlkv.errors import UsageError
from cxlkv.kv.area import Area, KVPoolFull, QuotaExceeded
from cxlkv.pool import layout
from cxlkv.ops.init import init_pool
from cxlkv.api import Pool
from cxlkv.ops.fsck import check
from cxlkv.state import alloc

from cxlkv.testing.checks import fsck_clean, mapped_bytes
from cxlkv.testing.data import pattern
from cxlkv.testing.nodes import NodeProc, lock_manager

MiB = 1 << 20
BB = 4096


def present(kv, toks) -> np.ndarray:
    """Which full blocks of toks are published (not only the leading run)."""
    keys = kv._keys(toks)
    _, _, ctl, _ = kv._lookup(keys, stop=False)
    return ctl != 0


# -- keys ------------------------------------------------------------------------------
def test_block_hashes_are_chained_full_blocks_and_numpy_friendly(kvpool):
    with cxlkv.open_pool(kvpool) as pool:
        kv = pool.kv(model="m", block_tokens=16, block_bytes=BB)
        toks = list(range(50))
        hs = kv.block_hashes(toks)
        assert len(hs) == 3 and all(len(h) == 16 for h in hs)
        assert kv.block_hashes(np.array(toks, dtype=np.int32)) == hs
        assert kv.block_hashes(toks[:48]) == hs
        # chained: changing block 0 changes every later hash, block 2 only its own
        assert kv.block_hashes([1] + toks[1:])[2] != hs[2]
        assert kv.block_hashes(toks[:32] + [7] + toks[33:])[:2] == hs[:2]
        import xxhash
        h0 = xxhash.xxh3_128_digest(bytes(16) + np.arange(16, dtype="<u4").tobytes())
        assert hs[0] == h0


@pytest.mark.parametrize("bad", [[1.5, 2.0], ["a"], [-1], [2**32], "abc", np.array([True]),
                                 np.array([1.0]), [[1, 2], 3]])
def test_non_integer_or_out_of_range_tokens_are_refused(kvpool, bad):
    with cxlkv.open_pool(kvpool) as pool:
        kv = pool.kv(model="m", block_tokens=2, block_bytes=BB)
        with pytest.raises(UsageError):
            kv.match(bad)


def test_keys_equal_across_processes_and_restarts(kvpool):
    toks = list(range(1000, 1064))
    procs = [NodeProc(), NodeProc()]
    try:
        for p in procs:
            p.attach(kvpool)
            p.call(op="kv_open", args={"model": "m", "block_tokens": 16, "block_bytes": BB})
        assert procs[0].call(op="kv_store", tokens=toks)["stored"] == 4
        assert procs[1].call(op="kv_match", tokens=toks)["matched"] == 64
    finally:
        for p in procs:
            p.close()
    with cxlkv.open_pool(kvpool) as pool:       # a new process after everyone left
        kv = pool.kv(model="m", block_tokens=16, block_bytes=BB)
        assert kv.match(toks) == 64
        n, bad = len(pattern(kv, toks)), 0
        with kv.load(toks) as views:
            bad = sum(bytes(v) != w for v, w in zip(views, pattern(kv, toks)))
        assert (len(views), bad) == (n, 0)


def _cbor_uint(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    for info, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if n < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | info]) + struct.pack(fmt, n)
    raise ValueError(n)


def _vllm_hash(parent: bytes, toks: list[int]) -> bytes:
    """vLLM's sha256_cbor block hash, CBOR written out by hand:
    array(3) [bytes parent, array(n) [uints], null]."""
    body = bytes([0x83]) + _cbor_uint(2, len(parent)) + parent + _cbor_uint(4, len(toks))
    body += b"".join(_cbor_uint(0, t) for t in toks) + bytes([0xF6])
    return hashlib.sha256(body).digest()


def test_sha256_cbor_chain_equals_vllms(kvpool, monkeypatch):
    seed = "1234"
    # NONE_HASH = sha256(CBOR text string "1234")
    none_hash = hashlib.sha256(bytes([0x60 | len(seed)]) + seed.encode()).digest()
    toks = [1, 30000, 70000, 5_000_000_000 % 2**32] * 8
    want, parent = [], none_hash
    for i in range(0, 32, 16):
        parent = _vllm_hash(parent, toks[i:i + 16])
        want.append(parent)
    with cxlkv.open_pool(kvpool) as pool:
        kv = pool.kv(model="v", block_tokens=16, block_bytes=BB, hash="sha256_cbor",
                     hash_seed=seed)
        assert kv.block_hashes(toks) == want
        monkeypatch.setenv("PYTHONHASHSEED", seed)
        kv2 = pool.kv(model="v2", block_tokens=16, block_bytes=BB, hash="sha256_cbor")
        assert kv2.block_hashes(toks) == want
        # a connector can key by vLLM's own hashes
        blocks = [bytes([i]) * BB for i in range(2)]
        assert kv.store_hashes(want, blocks) == 2
        assert kv.match(toks) == 32 and kv.match_hashes(want) == 2
        monkeypatch.delenv("PYTHONHASHSEED")
        with pytest.raises(UsageError, match="PYTHONHASHSEED"):
            pool.kv(model="v3", block_tokens=16, block_bytes=BB, hash="sha256_cbor")


# -- store / match / load ---------------------------------------------------------------------
def test_store_match_load_round_trip(kvpool):
    with cxlkv.open_pool(kvpool) as pool:
        kv = pool.kv(model="m", block_tokens=16, block_bytes=BB)
        toks = np.arange(100)                           # 6 full blocks, 4 tokens left over
        assert kv.match(toks) == 0
        data = np.frombuffer(b"".join(pattern(kv, toks)), dtype=np.uint8)
        assert kv.store(toks, data) == 6
        assert kv.match(toks) == 96
        assert kv.store(toks, data) == 0                # all present: skipped
        longer = np.arange(160)
        assert kv.store(longer, b"".join(pattern(kv, longer))) == 4   # only the new tail
        with kv.load(longer) as views:
            assert [bytes(v) for v in views] == pattern(kv, longer)
            assert all(v.readonly for v in views)
        out = np.zeros(10 * BB, dtype=np.uint8)
        assert kv.load_into(longer, out) == 10
        assert out.tobytes() == b"".join(pattern(kv, longer))
        assert kv.match(np.arange(1, 100)) == 0          # another prefix
        s = kv.stats()
        assert (s["blocks"], s["stores"], s["bytes"]) == (10, 10, 10 * BB)
    fsck_clean(kvpool)


def test_blocks_as_a_list_of_buffers_and_bad_buffers(kvpool):
    with cxlkv.open_pool(kvpool) as pool:
        kv = pool.kv(model="m", block_tokens=4, block_bytes=BB)
        toks = list(range(8))
        assert kv.store(toks, [np.full(BB, 1, np.uint8), bytearray(BB)]) == 2
        with pytest.raises(UsageError, match="block 1 is 10 bytes"):
            kv.store(list(range(10, 18)), [bytes(BB), bytes(10)])
        with pytest.raises(UsageError, match="got 1 block buffers for 2"):
            kv.store(list(range(10, 18)), [bytes(BB)])
        with pytest.raises(UsageError, match="need 2 x 4096"):
            kv.store(list(range(10, 18)), bytes(BB))
        with pytest.raises(UsageError, match="not a buffer"):
            kv.store(list(range(10, 18)), [bytes(BB), 5])
        assert kv.match(list(range(10, 18))) == 0     # nothing half stored
    fsck_clean(kvpool)


def test_namespace_reopened_with_other_parameters_is_refused(kvpool):
    with cxlkv.open_pool(kvpool) as pool:
        pool.kv(model="m", block_tokens=16, block_bytes=BB)
        with pytest.raises(UsageError, match="block_bytes=4096"):
            pool.kv(model="m", block_tokens=16, block_bytes=2 * BB)
        with pytest.raises(UsageError):
            pool.kv(model="m", block_tokens=8, block_bytes=BB)
        with pytest.raises(UsageError):
            pool.kv(model="", block_tokens=8, block_bytes=BB)
        with pytest.raises(UsageError):
            pool.kv(model="m", block_tokens=16, block_bytes=BB, hash="md5")
        # two models never share blocks
        a = pool.kv(model="a", block_tokens=4, block_bytes=BB)
        b = pool.kv(model="b", block_tokens=4, block_bytes=BB)
        a.store([1, 2, 3, 4], bytes(BB))
        assert (a.match([1, 2, 3, 4]), b.match([1, 2, 3, 4])) == (4, 0)


def test_block_sizes_from_4k_to_16m_and_aligned_slots(pool_path):
    init_pool(pool_path, {"size": 256 * MiB})
    with cxlkv.open_pool(pool_path) as pool:
        for bb in (4096, 256 * 1024, 16 * MiB):
            kv = pool.kv(model=f"m{bb}", block_tokens=16, block_bytes=bb)
            toks = list(range(32))
            data = np.random.default_rng(bb).integers(0, 256, 2 * bb, dtype=np.uint8)
            assert kv.store(toks, data) == 2
            with kv.load(toks) as views:
                assert np.frombuffer(views[1], np.uint8).tobytes() == data[bb:].tobytes()
                addrs = [np.frombuffer(v, np.uint8).ctypes.data for v in views]
            assert all(a % 64 == 0 for a in addrs)


def test_tenants_never_match_each_others_prefixes(kvpool):
    toks = list(range(64))
    with cxlkv.open_pool(kvpool) as pool:
        a = pool.kv(model="m", block_tokens=16, block_bytes=BB, salt="tenant-a")
        b = pool.kv(model="m", block_tokens=16, block_bytes=BB, salt="tenant-b")
        pub = pool.kv(model="m", block_tokens=16, block_bytes=BB)
        a.store(toks, b"".join(pattern(a, toks)))
        assert (a.match(toks), b.match(toks), pub.match(toks)) == (64, 0, 0)
        a2 = pool.kv(model="m", block_tokens=16, block_bytes=BB, salt=b"tenant-a")
        assert a2.match(toks) == 64 and a2.tenant == a.tenant
        # the salt is derived inside: the raw salt is not the key material
        assert a._salt != b"tenant-a".ljust(16, b"\0")[:16]
        with pytest.raises(UsageError):
            pool.kv(model="m", block_tokens=16, block_bytes=BB, salt="")


# -- eviction -------------------------------------------------------------------------------
def fill(kv, first: int, seqs: int, blocks: int) -> list[list[int]]:
    out = []
    for s in range(seqs):
        toks = [first + s * 10_000 + j for j in range(blocks * kv.block_tokens)]
        kv.store(toks, b"".join(pattern(kv, toks)))
        out.append(toks)
    return out


def test_store_evicts_lru_leaves_first_and_keeps_chains_contiguous(kvpool):
    with cxlkv.open_pool(kvpool) as pool:
        kv = pool.kv(model="m", block_tokens=4, block_bytes=64 * 1024)
        cap = pool.sb.regions["data"][1] // kv.slot_size
        seqs = fill(kv, 0, 2 * cap // 8 + 4, 8)          # about twice what fits
        assert Area(pool).header().evictions > 0
        for toks in seqs:
            p = present(kv, toks)
            k = int(p.sum())
            assert p[:k].all() and not p[k:].any(), "a chain has a gap"
        # the most recent sequence survived in full; the oldest went first
        assert kv.match(seqs[-1]) == len(seqs[-1])
        assert kv.match(seqs[0]) < len(seqs[0])
        st = kv.stats()
        assert st["evictions"] > 0 and st["blocks"] * kv.slot_size <= pool.sb.regions["data"][1]
    fsck_clean(kvpool)


def test_recently_loaded_blocks_outlive_older_ones(kvpool):
    with cxlkv.open_pool(kvpool) as pool:
        kv = pool.kv(model="m", block_tokens=4, block_bytes=64 * 1024)
        cap = pool.sb.regions["data"][1] // kv.slot_size
        first = fill(kv, 0, cap // 8 // 2, 8)
        with kv.load(first[0]):
            pass                                         # touch the oldest sequence
        fill(kv, 5_000_000, cap // 8 // 2, 8)            # fills the pool past full
        assert kv.match(first[0]) == len(first[0])
        assert kv.match(first[1]) < len(first[1])


def test_eviction_never_frees_a_pinned_block(kvpool):
    with cxlkv.open_pool(kvpool) as pool:
        kv = pool.kv(model="m", block_tokens=4, block_bytes=64 * 1024)
        cap = pool.sb.regions["data"][1] // kv.slot_size
        toks = fill(kv, 0, 1, 8)[0]
        want = pattern(kv, toks)
        with kv.load(toks) as views:
            fill(kv, 1_000_000, 3 * cap // 8, 8)         # three pools' worth through it
            assert [bytes(v) for v in views] == want
            assert kv.match(toks) == len(toks)
        fill(kv, 2_000_000, 2 * cap // 8, 8)
        assert kv.match(toks) < len(toks)                # unpinned: evictable again


def test_pool_full_with_everything_pinned_is_a_clear_error(kvpool):
    with cxlkv.open_pool(kvpool) as pool:
        kv = pool.kv(model="m", block_tokens=4, block_bytes=1 * MiB)
        cap = pool.sb.regions["data"][1] // kv.slot_size
        held = []
        toks = []
        with pytest.raises(KVPoolFull, match="pool full"):
            for s in range(cap + 2):
                t = [s * 100 + j for j in range(4)]
                kv.store(t, bytes(kv.block_bytes))
                held.append(kv.load(t))
                toks.append(t)
        for h in held:
            h.release()
        t = [999_999, 1, 2, 3]
        assert kv.store(t, bytes(kv.block_bytes)) == 1   # evicts now
    fsck_clean(kvpool)


def test_tenant_quota_evicts_the_tenants_own_blocks_then_refuses(kvpool):
    with cxlkv.open_pool(kvpool) as pool:
        other = pool.kv(model="m", block_tokens=4, block_bytes=BB, salt="other")
        ot = fill(other, 0, 1, 4)[0]
        kv = pool.kv(model="m", block_tokens=4, block_bytes=BB, salt="small",
                     quota=8 * BB)
        seqs = fill(kv, 100_000, 4, 4)                   # 16 blocks through an 8-block quota
        used = [t for t in Area(pool).tenant_records() if t.state][kv.tenant]
        assert used.used <= 8 * BB
        assert other.match(ot) == len(ot)                # quota evicts only its own
        assert kv.match(seqs[-1]) == len(seqs[-1])
        with kv.load(seqs[-1]), kv.load(seqs[-2]):
            with pytest.raises(QuotaExceeded, match="quota"):
                fill(kv, 200_000, 1, 4)
    fsck_clean(kvpool)


def test_drop_namespace_and_report(kvpool, cli):
    with cxlkv.open_pool(kvpool) as pool:
        a = pool.kv(model="a", block_tokens=4, block_bytes=BB)
        b = pool.kv(model="b", block_tokens=4, block_bytes=BB)
        fill(a, 0, 2, 4)
        bt = fill(b, 0, 1, 4)[0]
        r = a.drop()
        assert (r["evicted"], r["pinned_left"], r["dropped"]) == (8, 0, True)
        assert b.match(bt) == len(bt)
        names = [n["namespace"] for n in __import__("cxlkv.kv.cache", fromlist=["x"])
                 .kv_report(pool)["namespaces"]]
        assert names == ["b"]
    fsck_clean(kvpool)


# -- several processes ---------------------------------------------------------------------------
def _procs(path, n, env=None, args=None):
    procs = [NodeProc(env) for _ in range(n)]
    for p in procs:
        p.attach(path)
        r = p.call(op="kv_open", args=args or {"model": "m", "block_tokens": 16,
                                                "block_bytes": BB})
        assert "ns" in r, r
    return procs


def test_four_processes_store_match_load_concurrently(kvpool):
    procs = _procs(kvpool, 4)
    try:
        for i, p in enumerate(procs):
            p.send(op="kv_churn", seed=i, rounds=150, stem=64, variants=6)
        res = [p.reply() for p in procs]
        assert all("bad" in r for r in res), res
        assert sum(r["bad"] for r in res) == 0
        assert sum(r["loaded"] for r in res) > 0
    finally:
        for p in procs:
            p.close()
    fsck_clean(kvpool)


def test_same_blocks_stored_at_once_are_stored_exactly_once(kvpool):
    toks = list(range(5000, 5000 + 16 * 40))
    procs = _procs(kvpool, 4)
    try:
        for p in procs:
            p.send(op="kv_store", tokens=toks)
        res = [p.reply() for p in procs]
        assert sum(r["stored"] for r in res) == 40, res
        assert all(p.call(op="kv_verify", tokens=toks) == {"blocks": 40, "bad": 0}
                   for p in procs)
    finally:
        for p in procs:
            p.close()
    rep = fsck_clean(kvpool)
    assert rep.stats["kv"]["entries"] == 40


def test_killed_reader_drops_its_pins(kvpool):
    with cxlkv.open_pool(kvpool) as pool:
        kv = pool.kv(model="m", block_tokens=16, block_bytes=BB)
        toks = fill(kv, 0, 1, 4)[0]
        reader = _procs(kvpool, 1)[0]
        assert reader.call(op="kv_hold", tokens=toks) == {"blocks": 4}
        assert len(Area(pool).pinned()) == 4
        reader.kill()
        with cxlkv.open_pool(kvpool) as other:      # attaching reaps the dead node
            assert len(Area(other).pinned()) == 0
        assert kv.drop()["evicted"] == 4
    fsck_clean(kvpool)


CRASH = r'''
import sys, numpy as np, cxlkv
pool = cxlkv.open_pool(sys.argv[1])
kv = pool.kv(model="m", block_tokens=16, block_bytes=65536)
for s in range(int(sys.argv[2])):
    toks = np.arange(s * 1000, s * 1000 + 64)
    kv.store(toks, b"".join(h * 4096 for h in kv.block_hashes(toks)))
    kv.match(toks)
pool.close()
'''


@pytest.mark.parametrize("site", ["kv.insert:3", "kv.copied:1", "kv.copied:2", "kv.evict:2",
                                  "alloc.bit:5"])
def test_writer_killed_mid_publish_leaves_nothing_visible(pool_path, site):
    init_pool(pool_path, {"size": 8 * MiB, "chunk_size": 256 * 1024, "max_nodes": 8,
                          "lease_ms": 300})
    env = {**os.environ, "CXLKV_CRASH_AT": site}
    r = subprocess.run([sys.executable, "-c", CRASH, pool_path, "60"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == -9, r.stderr
    with cxlkv.open_pool(pool_path) as pool:        # reaps and recovers the writer
        kv = pool.kv(model="m", block_tokens=16, block_bytes=65536)
        for s in range(60):
            toks = np.arange(s * 1000, s * 1000 + 64)
            want = [h * 4096 for h in kv.block_hashes(toks)]
            with kv.load(toks) as views:             # whatever is visible is whole
                assert [bytes(v) for v in views] == want[:len(views)]
        rep = check(pool)
        assert rep.clean, [f.to_json() for f in rep.errors]
        a = Area(pool)
        t = a.entries()
        st = t["ctl"] & 0xFF
        assert not np.isin(st, (layout.KV_PENDING, layout.KV_WRITING, layout.KV_EVICTING)).any()
        assert kv.drop()["dropped"]
    with Pool.open(pool_path) as p:                  # nothing leaked
        rep = check(p)
        assert rep.clean, [f.to_json() for f in rep.errors]
        assert rep.stats["allocator"]["slots_allocated"] == 0


# -- manager mode under the non-coherence emulation ------------------------------------------
def test_manager_mode_under_noncoherence_emulation(pool_path):
    from cxlkv.daemons.lockmgr import LockManager  # noqa: F401
    init_pool(pool_path, {"size": 16 * MiB, "chunk_size": 256 * 1024, "max_nodes": 8,
                          "sync": "manager", "lease_ms": 1000})
    mgr = subprocess.Popen([sys.executable, "-m", "cxlkv", "lock-manager", "--pool", pool_path],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        env = {"CXLKV_NONCOHERENT": "1", "CXLKV_NC_EVICT_EVERY": "64", "CXLKV_NC_PRELOAD": "1"}
        procs = _procs(pool_path, 4, env=env)
        try:
            for i, p in enumerate(procs):
                p.send(op="kv_churn", seed=i, rounds=60, stem=32, variants=4)
            res = [p.reply() for p in procs]
            assert all("bad" in r for r in res), res
            assert sum(r["bad"] for r in res) == 0 and sum(r["loaded"] for r in res) > 0
        finally:
            for p in procs:
                p.close()
        with Pool.open(pool_path, writable=False) as p:
            rep = check(p)
        assert rep.clean, [f.to_json() for f in rep.errors]
    finally:
        mgr.terminate()
        mgr.wait(30)


def test_vectorised_slot_sizes_match_the_allocator(kvpool):
    from cxlkv.state import alloc

    with cxlkv.open_pool(kvpool) as pool:
        a = Area(pool)
        lengths = np.array([1, 63, 64, 65, 4096, 100_000, 16 * MiB])
        assert list(a.slot_sizes(lengths)) == [alloc.slot_size_for(pool, int(x)) for x in lengths]


# -- regressions found in review --------------------------------------------------------------
def _check_clean(path):
    with Pool.open(path, writable=False) as p:
        rep = check(p)
    assert rep.clean, [f.to_json() for f in rep.errors]


def test_a_failed_copy_leaves_no_reservation_behind(kvpool):
    """An exception between reserving and publishing undoes the reservation:
    other nodes can store the blocks at once."""
    with cxlkv.open_pool(kvpool) as pa, cxlkv.open_pool(kvpool) as pb:
        ka = pa.kv(model="m", block_tokens=4, block_bytes=BB)
        kb = pb.kv(model="m", block_tokens=4, block_bytes=BB)

        def boom(*a, **k):
            raise MemoryError("simulated failure while copying")

        ka._copy = boom
        with pytest.raises(MemoryError):
            ka.store(list(range(8)), bytes(2 * BB))
        assert kb.store(list(range(8)), bytes(2 * BB)) == 2
        assert kb.match(list(range(8))) == 8
    _check_clean(kvpool)


def test_nothing_is_chained_under_another_nodes_pending_block(pool_path):
    """A writer killed after reserving [X, Y]; before it is reaped another
    node stores [X, Y, Z]: Z must not hang under the dead node's Y."""
    init_pool(pool_path, {"size": 32 * MiB, "chunk_size": 256 * 1024, "max_nodes": 8,
                          "lease_ms": 5000})
    a = r'''
import sys, cxlkv
pool = cxlkv.open_pool(sys.argv[1])
kv = pool.kv(model="m", block_tokens=4, block_bytes=4096)
kv.store(list(range(8)), bytes(8192))
'''
    with cxlkv.open_pool(pool_path) as pb:
        kb = pb.kv(model="m", block_tokens=4, block_bytes=BB)
        r = subprocess.run([sys.executable, "-c", a, pool_path],
                           env={**os.environ, "CXLKV_CRASH_AT": "kv.copied:1"})
        assert r.returncode == -9
        assert kb.store(list(range(12)), bytes(3 * BB)) == 0     # X is another node's, in flight
        with cxlkv.open_pool(pool_path):                          # reaps the writer
            pass
        assert kb.store(list(range(12)), bytes(3 * BB)) == 3
        assert kb.match(list(range(12))) == 12
    _check_clean(pool_path)


def test_a_full_table_never_evicts_the_parent_being_chained(pool_path):
    init_pool(pool_path, {"size": 64 * MiB, "chunk_size": 256 * 1024, "max_nodes": 8,
                          "hash_slots": 64, "hash_max_load_pct": 50})
    ab = list(range(1, 9))
    with cxlkv.open_pool(pool_path) as pool:
        kv = pool.kv(model="m", block_tokens=4, block_bytes=BB)
        a = Area(pool)
        kv.store(ab, bytes(2 * BB))
        s = 1000
        while a.header().live < a.max_used:
            kv.store([s] * 4, bytes(BB))
            s += 1
        assert kv.store(ab + [9, 10, 11, 12], bytes(3 * BB)) == 1
        assert kv.match(ab + [9, 10, 11, 12]) == 12
    _check_clean(pool_path)


def test_tombstones_do_not_eat_the_table(pool_path):
    """Evictions leave tombstones; the table keeps holding max_used live
    entries and a store evicts at most a sixteenth of the table at once."""
    init_pool(pool_path, {"size": 64 * MiB, "chunk_size": 256 * 1024, "max_nodes": 8,
                          "hash_slots": 1024, "hash_max_load_pct": 60})
    with cxlkv.open_pool(pool_path) as pool:
        kv = pool.kv(model="m", block_tokens=4, block_bytes=BB)
        a = Area(pool)
        worst = 0
        for s in range(3000):
            before = a.header().evictions
            kv.store([s, s + 1, s + 2, s + 3], bytes(BB))
            worst = max(worst, a.header().evictions - before)
        h = a.header()
        assert h.live >= a.max_used - a.nslots // 16
        assert worst <= a.nslots // 16 + 1
    _check_clean(pool_path)


def test_a_store_into_a_full_table_evicts_a_batch_for_the_stores_after_it(pool_path):
    """Inline eviction for room in the table frees more entries than the
    store needs, so that the next stores insert without evicting (the pool
    lock is not taken for an eviction by every store of a full cache)."""
    init_pool(pool_path, {"size": 64 * MiB, "chunk_size": 256 * 1024, "max_nodes": 8,
                          "hash_slots": 1024, "hash_max_load_pct": 60})
    with cxlkv.open_pool(pool_path) as pool:
        kv = pool.kv(model="m", block_tokens=4, block_bytes=BB)
        a = Area(pool)
        s = 0
        while a.header().live < a.max_used:
            kv.store([s] * 4, bytes(BB))
            s += 1
        before = a.header().evictions
        kv.store([s] * 4, bytes(BB))                 # the table is full: evicts
        batch = a.header().evictions - before
        assert batch > 1
        quiet = 0
        while a.header().evictions == before + batch:
            s += 1
            kv.store([s] * 4, bytes(BB))
            quiet += a.header().evictions == before + batch
        assert quiet == batch - 1                   # the batch made room for exactly these
    _check_clean(pool_path)


def test_counters_of_two_handles_on_one_namespace_add_up(kvpool):
    with cxlkv.open_pool(kvpool) as pool:
        k1 = pool.kv(model="m", block_tokens=4, block_bytes=BB)
        k2 = pool.kv(model="m", block_tokens=4, block_bytes=BB)
        for k in (k1, k2, k1, k2):
            k.match([1, 2, 3, 4])
        assert k1.stats()["lookups"] == 4


def test_a_store_larger_than_the_quota_is_refused_without_evicting(kvpool):
    with cxlkv.open_pool(kvpool) as pool:
        kv = pool.kv(model="m", block_tokens=4, block_bytes=BB, salt="t", quota=16 * BB)
        kept = fill(kv, 0, 4, 4)
        with pytest.raises(QuotaExceeded, match="whole quota"):
            kv.store(list(range(500_000, 500_000 + 4 * 20)), bytes(20 * BB))
        assert all(kv.match(t) == len(t) for t in kept)


def test_tenant_records_of_idle_tenants_are_reused(kvpool):
    with cxlkv.open_pool(kvpool) as pool:
        for i in range(400):
            kv = pool.kv(model="m", block_tokens=4, block_bytes=BB, salt=f"user-{i}")
            if i % 100 == 0:
                kv.store([i, 1, 2, 3], bytes(BB))       # a few keep blocks
        busy = pool.kv(model="m", block_tokens=4, block_bytes=BB, salt="user-0")
        assert busy.match([0, 1, 2, 3]) == 4


def test_caller_hashes_must_be_bytes(kvpool):
    with cxlkv.open_pool(kvpool) as pool:
        kv = pool.kv(model="m", block_tokens=4, block_bytes=BB)
        with pytest.raises(UsageError, match="must be bytes"):
            kv.match_hashes([12345, 67890])
        with pytest.raises(UsageError, match="same length"):
            kv.match_hashes([b"a" * 16, b"b" * 8])


def test_slot_bits_of_a_corrupt_tail_is_none(kvpool):
    from cxlkv.state import alloc

    with Pool.open(kvpool) as p:
        data_off, chunk, nchunks, base = alloc.geometry(p)
        p.mapping.store64(base + 3 * layout.CHUNK_DESC_SIZE, layout.CHUNK_TAIL | (1 << 40) << 8)
        assert alloc.slot_bits(p, data_off + 3 * chunk) is None


def test_manager_mode_evictor_never_writes_a_stale_line_back(pool_path, monkeypatch):
    """Non-coherent memory: applying touch rings and recounting must not
    write back this process's stale copies of entry or header lines."""
    monkeypatch.setenv("CXLKV_NONCOHERENT", "1")
    monkeypatch.setenv("CXLKV_NC_EVICT_EVERY", "0")
    monkeypatch.setenv("CXLKV_NC_PRELOAD", "1")
    init_pool(pool_path, {"size": 16 * MiB, "chunk_size": 256 * 1024, "max_nodes": 8,
                          "sync": "manager", "lease_ms": 2000})
    mgr = lock_manager(pool_path)
    try:
        pa, pb = cxlkv.open_pool(pool_path), cxlkv.open_pool(pool_path)
        ka = pa.kv(model="m", block_tokens=4, block_bytes=BB)
        kb = pb.kv(model="m", block_tokens=4, block_bytes=BB)
        k, x = [1, 2, 3, 4], [9, 9, 9, 9]
        kb.store(k, b"K" * BB)
        assert ka.match(k) == 4                    # A caches K's entry line
        kb.drop()
        kb = pb.kv(model="m", block_tokens=4, block_bytes=BB)
        kb.store(x, b"X" * BB)                     # X reuses K's payload slot
        kb.store(k, b"K" * BB)                     # K again, in the same entry slot
        with kb.load(k):
            pass                                   # a touch for A's evictor to apply
        ev = Area(pb).header().evictions
        with pa.lock():
            Area(pa).evict()                       # drains rings
            Area(pa).recount()
        with kb.load(k) as v:
            assert bytes(v[0][:4]) == b"KKKK"
        assert Area(pb).header().evictions == ev
        pa.close()
        pb.close()
        _check_clean(pool_path)
    finally:
        mgr.terminate()
        mgr.wait(30)


def test_load_into_from_a_start_block_follows_a_producer(kvpool):
    with cxlkv.open_pool(kvpool) as pool:
        kv = pool.kv(model="m", block_tokens=4, block_bytes=BB)
        toks = list(range(40))                       # 10 blocks, stored in two goes
        want = pattern(kv, toks)
        out = np.zeros(10 * BB, dtype=np.uint8)
        kv.store(toks[:16], b"".join(want[:4]))
        done = kv.load_into(toks, out)
        assert done == 4
        kv.store(toks, b"".join(want))
        assert kv.load_into(toks, out[done * BB:], start=done) == 6
        assert out.tobytes() == b"".join(want)
        assert kv.load_into(toks, out, start=10) == 0
        with pytest.raises(UsageError):
            kv.load_into(toks, out, start=-1)


def test_in_flight_finds_exactly_the_entries_left_part_way(kvpool):
    # what recovery looks at: one pass over the ctl words, whatever the table holds
    with cxlkv.open_pool(kvpool) as pool:
        kv = pool.kv(model="m", block_tokens=16, block_bytes=BB)
        toks = np.arange(16 * 8)
        kv.store(toks, b"".join(pattern(kv, toks)))
        a = kv.area
        assert len(a.in_flight()) == 0
        t = a.entries()
        pub = np.flatnonzero((t["ctl"] & 0xFF) == layout.KV_PUBLISHED).astype(np.uint64)
        assert len(pub) == 8
        picked = pub[[1, 4, 6]]
        with pool.lock():
            assert a.m.kv_set_state(a.table, a.nslots, picked, layout.KV_PUBLISHED,
                                    layout.KV_EVICTING, 0, 0) == 3
        got = a.in_flight()
        assert sorted(got.tolist()) == sorted(picked.tolist())
        out = np.zeros(1, dtype=np.uint64)              # a short buffer: all are counted
        assert a.m.kv_in_flight(a.table, a.nslots, out) == 3 and out[0] in picked
        with pool.lock():
            a.m.kv_set_state(a.table, a.nslots, picked, layout.KV_EVICTING, layout.KV_PUBLISHED, 0,
                             0)
        assert len(a.in_flight()) == 0
    fsck_clean(kvpool)


def test_an_eviction_interrupted_before_its_counters_is_recounted_at_detach(kvpool,
                                                                             monkeypatch):
    # the frees are done in C, the counters after them in Python: an exception
    # in between (SIGINT, say) leaves them to the node's own detach
    with cxlkv.open_pool(kvpool) as pool:
        kv = pool.kv(model="m", block_tokens=4, block_bytes=BB)
        for s in range(20):
            kv.store([s * 1000 + j for j in range(4)], b"\1" * BB)
        a = Area(pool)

        def interrupted(*args, **kw):
            raise KeyboardInterrupt

        monkeypatch.setattr(a, "slot_sizes", interrupted)
        with pytest.raises(KeyboardInterrupt):
            with pool.lock():
                a.evict(need_entries=5)
    with cxlkv.open_pool(kvpool) as pool:
        a = Area(pool)
        live = int(((a.entries()["ctl"] & 0xFF) == layout.KV_PUBLISHED).sum())
        assert live == 15
        assert [r.blocks for r in a.tenant_records() if r.blocks] == [live]
        assert [r.blocks for r in a.ns_records() if r.blocks] == [live]
    fsck_clean(kvpool)


# -- the metadata warm-up (Pool.warm_metadata) ------------------------------------------
def _warmers() -> list:
    return [t for t in threading.enumerate() if t.name == "cxlkv-warm"]


@pytest.fixture
def gib_pool(pool_path):
    """A 1 GiB pool (a sparse file): 16.5 MiB of metadata before its data."""
    init_pool(pool_path, {"size": 1024 * MiB, "chunk_size": 256 * 1024, "max_nodes": 8,
                          "lease_ms": 300})
    return pool_path


def test_a_kv_cache_maps_the_pool_metadata_in_the_background(gib_pool, monkeypatch):
    with cxlkv.open_pool(gib_pool) as pool:
        meta = alloc.geometry(pool)[0]
        assert mapped_bytes(gib_pool) < meta // 4         # attaching maps little of it
        kv = pool.kv(model="warm", block_bytes=4096)
        for t in _warmers():                                # (it may be done already)
            t.join()
        assert mapped_bytes(gib_pool) >= meta
        assert pool.warm_metadata() is True                 # once per process: not again
        assert not _warmers()
        toks = list(range(64))
        assert kv.store(toks, pattern(kv, toks)) == 4
        assert kv.match(toks) == 64
    assert not _warmers()
    # turned off: no thread, nothing mapped ahead
    monkeypatch.setenv("CXLKV_WARM_METADATA", "0")
    with cxlkv.open_pool(gib_pool) as pool:
        pool.kv(model="warm", block_bytes=4096)
        assert pool.warm_metadata() is False and not _warmers()
        assert mapped_bytes(gib_pool) < meta // 4
    fsck_clean(gib_pool)
