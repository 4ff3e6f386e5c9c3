"""The host DRAM hot tier (cxlkv.kv.tiers.hot): loads served from local copies,
and a copy never outlives the pool entry it was read from."""
from __future__ import annotations

import numpy as np
import pytest

import cxlkv
from cxlkv.errors import UsageError
from cxlkv.kv.tiers import hot
from cxlkv.kv.tiers.base import Tier

from cxlkv.testing.nodes import NodeProc

MiB = 1 << 20
BB = 4096


def blocks(tag: int, n: int) -> bytes:
    rng = np.random.default_rng(tag)
    return rng.integers(0, 256, n * BB, dtype=np.uint8).tobytes()


def test_second_load_is_served_from_dram_bit_exact(kvpool):
    toks = list(range(16 * 6))
    data = blocks(1, 6)
    with cxlkv.open_pool(kvpool) as pool:
        kv = pool.kv(model="m", block_bytes=BB, hot_bytes=1 * MiB)
        tier = hot.tier_of(pool)
        assert kv.store(toks, data) == 6
        out = bytearray(6 * BB)
        assert kv.load_into(toks, out) == 6 and bytes(out) == data
        s = tier.stats()
        assert (s["hits"], s["misses"], s["inserted"], s["blocks"]) == (0, 6, 6, 6)
        out2 = bytearray(6 * BB)
        assert kv.load_into(toks, out2) == 6 and bytes(out2) == data
        assert tier.stats()["hits"] == 6
        # start= skips blocks in the hot tier as in the pool
        out3 = bytearray(2 * BB)
        assert kv.load_into(toks, out3, start=4) == 2 and bytes(out3) == data[4 * BB:]
        # load(): hot blocks come back as read-only DRAM views
        with kv.load(toks) as views:
            assert b"".join(bytes(v) for v in views) == data
            assert all(v.readonly for v in views)
        assert tier.stats()["hits"] == 6 + 2 + 6


def test_mixed_hot_and_cold_blocks_copy_in_order(kvpool):
    toks = list(range(16 * 8))
    data = blocks(2, 8)
    with cxlkv.open_pool(kvpool) as pool:
        kv = pool.kv(model="m", block_bytes=BB, hot_bytes=1 * MiB)
        kv.store(toks, data)
        # make blocks 2, 3 and 6 hot only
        for j in (2, 3, 6):
            out = bytearray(BB)
            assert kv.load_into(toks[:16 * (j + 1)], out, start=j) == 1
        assert hot.tier_of(pool).stats()["blocks"] == 3
        out = bytearray(8 * BB)
        assert kv.load_into(toks, out) == 8
        assert bytes(out) == data
        assert hot.tier_of(pool).stats()["hits"] == 3


def test_load_views_fill_the_tier_when_released(kvpool):
    toks = list(range(16 * 3))
    data = blocks(3, 3)
    with cxlkv.open_pool(kvpool) as pool:
        kv = pool.kv(model="m", block_bytes=BB, hot_bytes=1 * MiB)
        kv.store(toks, data)
        with kv.load(toks) as views:
            assert b"".join(bytes(v) for v in views) == data
        assert hot.tier_of(pool).stats()["inserted"] == 3
        out = bytearray(3 * BB)
        assert kv.load_into(toks, out) == 3 and bytes(out) == data
        assert hot.tier_of(pool).stats()["hits"] == 3


def test_a_block_stored_again_by_another_node_is_read_fresh(kvpool):
    """Another node drops the namespace and stores other bytes under the
    same tokens: the entry's version changed, so the DRAM copy is stale."""
    toks = list(range(16 * 4))
    old, new = blocks(4, 4), blocks(5, 4)
    with cxlkv.open_pool(kvpool) as a, cxlkv.open_pool(kvpool) as b:
        assert a.node.slot != b.node.slot
        kva = a.kv(model="m", block_bytes=BB, hot_bytes=1 * MiB)
        kvb = b.kv(model="m", block_bytes=BB)
        kvb.store(toks, old)
        out = bytearray(4 * BB)
        assert kva.load_into(toks, out) == 4 and bytes(out) == old
        assert hot.tier_of(a).stats()["blocks"] == 4
        kvb.drop()
        # dropped: the pool is the authority, the DRAM copies are not served
        assert kva.load_into(toks, bytearray(4 * BB)) == 0
        kvb = b.kv(model="m", block_bytes=BB)
        kva = a.kv(model="m", block_bytes=BB)
        assert kvb.store(toks, new) == 4
        out = bytearray(4 * BB)
        assert kva.load_into(toks, out) == 4
        assert bytes(out) == new
        s = hot.tier_of(a).stats()
        assert s["stale"] == 4 and s["hits"] == 0
        with kva.load(toks) as views:               # the fresh copies are now hot
            assert b"".join(bytes(v) for v in views) == new
        assert hot.tier_of(a).stats()["hits"] == 4


def test_an_evicted_block_is_not_served_from_dram(kvpool):
    toks = list(range(16 * 2))
    with cxlkv.open_pool(kvpool) as pool:
        kv = pool.kv(model="m", block_bytes=BB, hot_bytes=1 * MiB)
        kv.store(toks, blocks(6, 2))
        assert kv.load_into(toks, bytearray(2 * BB)) == 2
        with pool.lock():
            kv.area.evict(need_bytes=1 << 40)
        assert kv.match(toks) == 0
        assert kv.load_into(toks, bytearray(2 * BB)) == 0
        assert hot.tier_of(pool).stats()["hits"] == 0


def test_the_tier_keeps_to_its_size_least_recently_used_out(kvpool):
    toks = list(range(16 * 8))
    data = blocks(7, 8)
    with cxlkv.open_pool(kvpool) as pool:
        kv = pool.kv(model="m", block_bytes=BB, hot_bytes=3 * BB)
        kv.store(toks, data)
        for j in range(8):
            kv.load_into(toks[:16 * (j + 1)], bytearray(BB), start=j)
        s = hot.tier_of(pool).stats()
        assert s["blocks"] == 3 and s["bytes"] == 3 * BB and s["evicted"] == 5
        # the three most recent are the ones kept
        out = bytearray(BB)
        kv.load_into(toks, out, start=7)
        assert hot.tier_of(pool).stats()["hits"] == 1 and bytes(out) == data[7 * BB:]
        kv.load_into(toks[:16], bytearray(BB))
        assert hot.tier_of(pool).stats()["hits"] == 1
        # a smaller size drops down to it
        hot.enable(pool, BB)
        assert hot.tier_of(pool).stats()["blocks"] == 1


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "1G"])
def test_bad_sizes_are_refused(kvpool, bad):
    with cxlkv.open_pool(kvpool) as pool:
        with pytest.raises(UsageError):
            pool.kv(model="m", block_bytes=BB, hot_bytes=bad)


def test_processes_with_hot_tiers_churning_read_what_keys_say(kvpool):
    """Several nodes store, evict (a small pool) and load with hot tiers:
    every block read, from DRAM or the pool, holds what its key says."""
    procs = [NodeProc() for _ in range(3)]
    try:
        for p in procs:
            p.attach(kvpool)
            r = p.call(op="kv_open",
                       args={"model": "m", "block_tokens": 16, "block_bytes": 64 * 1024,
                                            "hot_bytes": 2 * MiB})
            assert "ns" in r, r
        for i, p in enumerate(procs):
            p.send(op="kv_churn", seed=i, rounds=150, stem=64, variants=12)
        res = [p.reply() for p in procs]
        assert all("bad" in r for r in res), res
        assert sum(r["bad"] for r in res) == 0 and sum(r["loaded"] for r in res) > 0
    finally:
        for p in procs:
            p.close()


def test_the_pool_object_owns_its_tiers(kvpool):
    """pool.tiers: empty until a tier is enabled, one tier per kind, each a
    Tier; disabling closes it (the hot tier drops its copies)."""
    with cxlkv.open_pool(kvpool) as pool:
        assert [t for t in pool.tiers] == [] and pool.tiers.get("hot") is None
        tier = hot.enable(pool, 1 * MiB)
        assert isinstance(tier, Tier) and pool.tiers.get("hot") is tier
        assert hot.enable(pool, 1 * MiB) is tier                 # idempotent
        assert hot.enable(pool, 2 * MiB) is tier and tier.max_bytes == 2 * MiB
        with pytest.raises(UsageError, match="already has a hot tier"):
            pool.tiers.enable(hot.HotTier(MiB))
        with pytest.raises(UsageError):
            pool.tiers.enable(object())
        kv = pool.kv(model="m", block_bytes=BB)
        toks = list(range(16 * 2))
        kv.store(toks, blocks(3, 2))
        kv.load_into(toks, bytearray(2 * BB))
        assert tier.stats()["blocks"] == 2
        hot.disable(pool)
        assert pool.tiers.get("hot") is None and tier.stats()["blocks"] == 0
        with pytest.raises(UsageError, match="remote_read needs the pool's remote tier"):
            pool.kv(model="m", block_bytes=BB, remote_read=True)
