"""The C calls of the store path's bookkeeping under the pool lock:
kv_usage (the room check), kv_account (usage of new blocks) and node_fresh
(the guard's fast path) - their results, bounds and errors, on a plain
mapping; and the same bookkeeping through a store on a real pool."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

import cxlkv
from cxlkv import _core
from cxlkv.errors import PoolRangeError, PoolReadOnly
from cxlkv.pool import layout

SIZE = 1 << 16
T_SIZE = layout.KV_TENANT_SIZE
NS_SIZE = layout.KV_NS_SIZE
T = {f: layout.field_offset(layout.KVTenantStruct, f) for f in ("state", "quota", "used",
                                                                "blocks", "rejected")}
NS_BLOCKS = layout.field_offset(layout.KVNsStruct, "blocks")


def _mapping(path, writable: bool):
    """A Mapping of a new zeroed file of SIZE bytes."""
    with open(path, "wb") as f:
        f.truncate(SIZE)
    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        return _core.Mapping(fd, SIZE, writable)
    finally:
        os.close(fd)


@pytest.fixture
def m(tmp_path):
    mp = _mapping(tmp_path / "records.bin", True)
    yield mp
    mp.close()


def put_tenant(m, off, i, state, quota=0, used=0, blocks=0):
    r = off + i * T_SIZE
    m.store64(r + T["state"], state)                 # state | reserved0 << 32
    m.store64(r + T["quota"], quota)
    m.store64(r + T["used"], used)
    m.store64(r + T["blocks"], blocks)


# -- kv_usage -----------------------------------------------------------------------------

def test_usage_sums_only_active_tenants(m):
    base = 4096
    put_tenant(m, base, 0, layout.KV_REC_ACTIVE, used=100)
    put_tenant(m, base, 1, layout.KV_REC_FREE, used=1 << 40)     # a free record's leftovers
    put_tenant(m, base, 2, layout.KV_REC_ACTIVE, quota=5000, used=700)
    put_tenant(m, base, 3, layout.KV_REC_ACTIVE | 7 << 32, used=9)   # reserved0 is not state
    assert m.kv_usage(base, 4, 2) == (100 + 700 + 9, 5000, 700)
    assert m.kv_usage(base, 4, 1) == (809, 0, 1 << 40)
    assert m.kv_usage(base, 2, 0) == (100, 0, 100)                 # only the first two


def test_usage_refuses_bad_geometry(m):
    with pytest.raises(ValueError, match="tenant 4 out of range"):
        m.kv_usage(4096, 4, 4)
    with pytest.raises(ValueError, match="geometry"):
        m.kv_usage(4096 + 8, 4, 0)                               # not a record boundary
    with pytest.raises(ValueError, match="geometry"):
        m.kv_usage(4096, 0, 0)
    with pytest.raises(PoolRangeError):
        m.kv_usage(SIZE - 2 * T_SIZE, 3, 0)                      # runs past the mapping
    with pytest.raises(PoolRangeError):
        m.kv_usage(1 << 62, 1, 0)
    with pytest.raises(PoolRangeError, match="must be 0"):
        m.kv_usage(-64, 1, 0)


# -- kv_account ------------------------------------------------------------------------------

def test_account_adds_to_both_records_and_nothing_else(m):
    ns, t = 8192, 4096 + 3 * T_SIZE
    put_tenant(m, 4096, 3, layout.KV_REC_ACTIVE, quota=77, used=1000, blocks=5)
    m.store64(ns + NS_BLOCKS, 11)
    before_ns, before_t = m.read(ns, NS_SIZE), m.read(t, T_SIZE)
    m.kv_account(ns, t, 8, 8 * 16448)
    assert m.load64(ns + NS_BLOCKS) == 19
    assert m.load64(t + T["blocks"]) == 13
    assert m.load64(t + T["used"]) == 1000 + 8 * 16448
    assert m.load64(t + T["quota"]) == 77
    after_ns, after_t = m.read(ns, NS_SIZE), m.read(t, T_SIZE)
    assert after_ns[:NS_BLOCKS] == before_ns[:NS_BLOCKS]
    assert after_ns[NS_BLOCKS + 8:] == before_ns[NS_BLOCKS + 8:]
    assert after_t[:T["used"]] == before_t[:T["used"]]
    assert after_t[T["blocks"] + 8:] == before_t[T["blocks"] + 8:]
    m.kv_account(ns, t, 0, 0)                                    # a no-op
    assert m.load64(ns + NS_BLOCKS) == 19


def test_account_refuses_bad_records(m, tmp_path):
    with pytest.raises(ValueError, match="aligned"):
        m.kv_account(8192 + 8, 4096, 1, 1)
    with pytest.raises(ValueError, match="aligned"):
        m.kv_account(8192, 4096 + 32, 1, 1)
    with pytest.raises(PoolRangeError):
        m.kv_account(SIZE - 64, 4096, 1, 1)                      # namespace record past the end
    with pytest.raises(PoolRangeError):
        m.kv_account(8192, SIZE, 1, 1)
    assert m.load64(8192 + NS_BLOCKS) == 0                       # nothing written
    ro = _mapping(tmp_path / "ro.bin", False)
    with ro, pytest.raises(PoolReadOnly):
        ro.kv_account(8192, 4096, 1, 1)


# -- node_fresh -------------------------------------------------------------------------------

def test_node_fresh_needs_the_deadline_ahead_and_the_word(m):
    m.store64(256, 0x1234)
    ahead = time.monotonic_ns() + 60 * 10**9
    assert m.node_fresh(256, 0x1234, ahead) is True
    assert m.node_fresh(256, 0x1235, ahead) is False             # the word changed
    assert m.node_fresh(256, 0x1234, 0) is False                 # fenced / never fresh
    assert m.node_fresh(256, 0x1234, time.monotonic_ns() - 1) is False   # passed


def test_node_fresh_refuses_bad_offsets(m):
    ahead = time.monotonic_ns() + 60 * 10**9
    with pytest.raises(PoolRangeError):
        m.node_fresh(260, 0, ahead)                              # misaligned
    with pytest.raises(PoolRangeError):
        m.node_fresh(SIZE, 0, ahead)
    with pytest.raises(TypeError):
        m.node_fresh(256, 0)


# -- through the store path -------------------------------------------------------------------

def test_store_accounts_new_blocks_and_guard_takes_the_fast_path(kvpool):
    with cxlkv.open_pool(kvpool) as pool:
        kv = pool.kv(model="records", block_tokens=4, block_bytes=4096)
        a = kv.area
        toks = np.arange(32, dtype=np.int64)
        assert kv.store(toks[:16], bytes(4 * 4096)) == 4
        assert kv.store(toks, bytes(8 * 4096)) == 4                  # 4 present, 4 new
        assert a.ns_record(kv.ns).blocks == 8
        t = a.tenant_record(kv.tenant)
        assert (t.blocks, t.used) == (8, 8 * kv.slot_size)
        used, quota, mine = pool.mapping.kv_usage(a.tenant_off(0), a.max_tenants, kv.tenant)
        assert (used, quota, mine) == (a.used_bytes(), 0, 8 * kv.slot_size)
        node = pool.node
        off, word = node._guard_word
        assert pool.mapping.node_fresh(off, word, node._deadline_ns)
    assert node._guard_word is None                              # detached
