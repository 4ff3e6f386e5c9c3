"""cxlkv fsck: clean pools pass; each kind of damage is found (exit 4); no writes."""
from __future__ import annotations


import pytest

import cxlkv
from cxlkv.pool import layout
from cxlkv.ops.init import init_pool
from cxlkv.api import Pool
from cxlkv.state import alloc
from cxlkv.state import locks
from cxlkv.state import nodes

from cxlkv.testing.checks import codes, digest, fsck
from cxlkv.testing.damage import damage, desc_off, patch_bytes
from cxlkv.testing.nodes import NodeProc

MiB = 1 << 20


@pytest.fixture
def used_pool(pool_path):
    """A pool with published blocks of two sizes, nobody attached."""
    init_pool(pool_path, {"size": 32 * MiB, "chunk_size": 1 * MiB, "max_nodes": 8,
                          "lease_ms": 300})
    with cxlkv.open_pool(pool_path) as pool:
        offs = list(pool.alloc_batch(8192, 40)) + list(pool.alloc_batch(3 * MiB, 2))
        pool.publish(offs)
        pool.free_batch(offs[:10])
    return pool_path


def test_clean_pool(cli, used_pool):
    before = digest(used_pool)
    code, doc = fsck(cli, used_pool)
    assert code == 0 and doc["clean"], doc
    assert doc["stats"]["allocator"]["slots_published"] == 32
    assert digest(used_pool) == before              # read-only
    r = cli("fsck", "--pool", used_pool)
    assert r.code == 0 and "clean" in r.out


def first_head(pool):
    d = alloc.descriptors(pool)
    h = int(((d["control"] & 0xFF) == layout.CHUNK_HEAD).nonzero()[0][0])
    del d
    return h


@pytest.mark.parametrize("name,fn,code", [
    ("leaked chunk", lambda p: alloc.set_bits(p, p.sb.nchunks - 1, 1, True), "chunk-leaked"),
    ("dirty and allocated", lambda p: p.mapping.store64(desc_off(p, first_head(p)) + 192,
                                                        1 << 20), "slab-dirty"),
    ("pub without alloc", lambda p: p.mapping.store64(desc_off(p, first_head(p)) + 128 + 56,
                                                      1), "slab-pub"),
    ("bits past the end", lambda p: p.mapping.store64(desc_off(p, first_head(p)) + 64 + 56,
                                                      1 << 63), "slab-bits"),
    ("slab free in bitmap", lambda p: alloc.set_bits(p, first_head(p), 1, False), "slab-bitmap"),
    ("bad geometry", lambda p: p.mapping.store64(desc_off(p, first_head(p)) + 16, 100),
     "slab-geometry"),
    ("dead owner", lambda p: p.mapping.store64(desc_off(p, first_head(p)) + 8, 0x30005),
     "slab-dead-owner"),
    ("lock held by nobody", lambda p: p.mapping.store64(locks.lock_offsets(p)[0] + 72, 0x10002),
     "lock-owner"),
    ("tickets", lambda p: p.mapping.store64(locks.lock_offsets(p)[0] + 64, 10**6),
     "lock-tickets"),
    ("lock entry of a dead node",
     lambda p: p.mapping.store64(locks.entry_offset(p, 3), layout.LOCK_LOCKED),
     "lock-entry-dead"),
])
def test_damage_is_found(cli, used_pool, name, fn, code):
    damage(used_pool, fn)
    rc, doc = fsck(cli, used_pool)
    assert rc == 4, (name, doc)
    assert code in codes(doc), (name, doc)


def test_bad_superblock_copy(cli, used_pool):
    patch_bytes(used_pool, 4096 + 100, b"\xff")
    rc, doc = fsck(cli, used_pool)
    assert rc == 4 and "superblock-copy" in codes(doc)


def test_killed_node_without_reaping(cli, used_pool):
    k = NodeProc()
    k.attach(used_pool)
    k.call(op="alloc_publish", nbytes=8192, reserved=3, published=2)
    k.kill()
    rc, doc = fsck(cli, used_pool)
    assert rc == 4
    assert {"node-dead", "slab-dead-owner"} <= codes(doc)
    with cxlkv.open_pool(used_pool):      # attaching reaps it
        pass
    rc, doc = fsck(cli, used_pool)
    assert rc == 0, doc


def test_operational_error_is_8(cli, tmp_path):
    r = cli("fsck", "--pool", str(tmp_path / "missing"), "--json")
    assert r.code == 8 and r.json()["error"]["exit_code"] == 8


def test_tickets_of_gone_nodes_are_reported(small_pool):
    """cas mode: tickets taken by nodes that are gone stall the next lock a
    lease each; fsck says so (and fsck --repair resets them)."""
    from cxlkv.ops.fsck import check

    with Pool.open(small_pool) as p:
        hdr, _ = locks.lock_offsets(p)
        serving = p.mapping.load64(hdr + layout.field_offset(layout.LockHdrStruct, "now_serving"))
        p.mapping.store64(hdr + layout.field_offset(layout.LockHdrStruct, "next_ticket"),
                          serving + 2)
    with Pool.open(small_pool, writable=False) as p:
        codes = {f.code for f in check(p).errors}
    assert "lock-tickets" in codes


def test_a_fenced_node_is_quarantined_not_damage(cli, used_pool):
    """A fenced node's quarantine is a state, not damage: fsck says so (a
    warning, exit 0) and counts what it holds as its own."""
    damage(used_pool, lambda p: p.mapping.store64(nodes.node_offset(p, 2),
                                                  layout.node_control(layout.NODE_FENCED, 4)))
    rc, doc = fsck(cli, used_pool)
    assert rc == 0, doc
    warned = [f for f in doc["findings"] if f["code"] == "node-quarantined"]
    assert warned and warned[0]["severity"] == "warning" and "grace" in warned[0]["message"]
