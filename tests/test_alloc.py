"""The allocator: slots, slabs, zeroing, ownership, recovery, utilisation."""
from __future__ import annotations

import numpy as np
import pytest

import cxlkv
from cxlkv.pool import layout
from cxlkv.ops.init import init_pool
from cxlkv.api import Pool
from cxlkv.state import alloc
from cxlkv.state import nodes as node_table

from cxlkv.testing.nodes import NodeProc

MiB = 1 << 20


@pytest.fixture
def apool(pool_path):
    init_pool(pool_path, {"size": 64 * MiB, "chunk_size": 2 * MiB, "max_nodes": 8,
                          "lease_ms": 300})
    return pool_path


def no_overlap(offsets, sizes):
    order = np.argsort(offsets)
    o, s = np.asarray(offsets)[order], np.asarray(sizes)[order]
    return bool(np.all(o[:-1] + s[:-1] <= o[1:]))


def test_alloc_free_basic(apool):
    with cxlkv.open_pool(apool) as pool:
        data_off, data_size = pool.region("data")
        offs = [pool.alloc(n) for n in (1, 64, 4096, 5000, 100_000, 4096)]
        sizes = [alloc.slot_size_for(pool, n) for n in (1, 64, 4096, 5000, 100_000, 4096)]
        assert all(o % 64 == 0 and data_off <= o < data_off + data_size for o in offs)
        assert len(set(offs)) == len(offs) and no_overlap(offs, sizes)
        for o in offs:
            pool.free(o)
        with pytest.raises(alloc.AllocError, match="double free"):
            pool.free(offs[0])


@pytest.mark.parametrize("bad,msg", [(0, "outside the data area"), (1 << 40, "outside"),
                                     ("mid", "not the start of a slot"),
                                     ("unused", "not in an allocated slab")])
def test_bad_frees_are_refused(apool, bad, msg):
    with cxlkv.open_pool(apool) as pool:
        o = pool.alloc(8192)
        data_off, data_size = pool.region("data")
        bad = {"mid": o + 64, "unused": data_off + data_size - 4096}.get(bad, bad)
        with pytest.raises(alloc.AllocError, match=msg):
            pool.free(bad)
        pool.free(o)                     # the good one is untouched and frees fine


@pytest.mark.parametrize("nbytes", [0, -4096])
def test_a_size_of_nothing_is_a_usage_error(apool, nbytes):
    from cxlkv.errors import UsageError

    with cxlkv.open_pool(apool) as pool:
        with pytest.raises(UsageError, match=f"cannot allocate {nbytes} bytes"):
            pool.alloc(nbytes)
        with pytest.raises(UsageError):
            pool.alloc_batch(nbytes, 3)


def test_freed_slots_are_zeroed(apool):
    with cxlkv.open_pool(apool) as pool:
        o = pool.alloc(4096)
        pool.mapping.write(o, b"\xab" * 4096)
        pool.free(o)                                     # zero=True: zeroed now
        assert pool.mapping.read(o, 4096) == bytes(4096)
        o2 = pool.alloc(4096)
        pool.mapping.write(o2, b"\xcd" * 4096)
        pool.free(o2, zero=False)                        # dirty: stale bytes stay for now
        o3 = pool.alloc(4096)                            # zero=True: dirty slot zeroed first
        assert o3 == o2
        assert pool.mapping.read(o3, 4096) == bytes(4096)
        pool.mapping.write(o3, b"\xee" * 4096)
        pool.free(o3, zero=False)
        o4 = pool.alloc(4096, zero=False)                # caller overwrites: no zeroing
        assert o4 == o3 and pool.mapping.read(o4, 1) == b"\xee"


def test_large_slots_and_slab_shapes(apool):
    assert alloc.slab_shape(2 * MiB, 3 * MiB, 1000) == (3, 2)
    assert alloc.slab_shape(2 * MiB, 16 * MiB, 1000) == (8, 1)
    assert alloc.slab_shape(2 * MiB, 192 * 1024, 1000) == (3, 32)
    with cxlkv.open_pool(apool) as pool:
        a, b = pool.alloc(3 * MiB), pool.alloc(3 * MiB)
        assert abs(a - b) == 3 * MiB
        c = pool.alloc(16 * MiB)
        assert no_overlap([a, b, c], [3 * MiB, 3 * MiB, 16 * MiB])
        for o in (a, b, c):
            pool.free(o)


def test_pool_full_then_space_returns(apool):
    with cxlkv.open_pool(apool) as pool:
        n = pool.sb.nchunks
        offs = pool.alloc_batch(2 * MiB, n, zero=False)
        assert len(set(offs.tolist())) == n
        with pytest.raises(alloc.PoolFullError, match="pool full"):
            pool.alloc(2 * MiB)
        with pytest.raises(alloc.PoolFullError):
            pool.alloc_batch(4096, 10)
        pool.free(int(offs[0]))
        # the freed chunk's slab is empty: released and reused for another size
        small = pool.alloc_batch(4096, 512, zero=False)
        assert len(small) == 512
        pool.free_batch(small)
        pool.free_batch(offs[1:])


def test_all_or_nothing_batch(apool):
    with cxlkv.open_pool(apool) as pool:
        n = pool.sb.nchunks
        with pytest.raises(alloc.PoolFullError):
            pool.alloc_batch(2 * MiB, n + 1)
        d = alloc.descriptors(pool)
        assert int(alloc.used_slots(d).sum()) == 0
        del d


def test_empty_slabs_switch_sizes(apool):
    with cxlkv.open_pool(apool) as pool:
        n = pool.sb.nchunks
        small = pool.alloc_batch(4096, n * 512, zero=False)        # every chunk, 4 KiB slots
        pool.free_batch(small, zero=False)
        big = pool.alloc_batch(2 * MiB, n, zero=True)              # all chunks again
        assert len(big) == n
        pool.free_batch(big)


def test_publish(apool):
    with cxlkv.open_pool(apool) as pool:
        o = pool.alloc(4096)
        assert pool.publish(o) == 1
        pool.free(o)
        with pytest.raises(alloc.AllocError, match="not allocated"):
            pool.publish(o)


def test_four_processes_allocate_without_overlap(apool):
    procs = [NodeProc() for _ in range(4)]
    try:
        for p in procs:
            p.attach(apool)
        for i, p in enumerate(procs):
            p.send(op="churn", nbytes=4096 * (i + 1), rounds=30, keep=20, seed=i)
        results = [p.reply() for p in procs]
        for r in results:
            assert r.get("bad", 0) == 0, r
        live = [(o, 4096 * (i + 1)) for i, r in enumerate(results) for o in r["kept"]]
        assert no_overlap([o for o, _ in live], [s for _, s in live])
        with Pool.open(apool) as p:
            d = alloc.descriptors(p)
            assert int(alloc.used_slots(d).sum()) == len(live)
            del d
    finally:
        for p in procs:
            p.close()


def test_dead_node_unpublished_reclaimed_published_kept(apool):
    victim = NodeProc()
    victim.attach(apool)
    r = victim.call(op="alloc_publish", nbytes=8192, reserved=5, published=3)
    victim.kill()
    with cxlkv.open_pool(apool) as pool:               # attach reaps the dead local node
        assert node_table.read_slot(pool, victim.slot).state == "free"
        d = alloc.descriptors(pool)
        assert int(alloc.used_slots(d).sum()) == 3                # the published ones survive
        assert int(np.count_nonzero(d["owner"][(d["control"] & 0xFF) == layout.CHUNK_HEAD])) == 0
        del d
        for o in r["reserved"]:                         # reserved bytes were zeroed
            assert pool.mapping.read(o, 8192) == bytes(8192)
        for o in r["published"]:
            assert pool.mapping.read(o, 4) == b"PUBL"
        # the orphaned slab is adopted for the same size; published slots stay put
        mine = pool.alloc_batch(8192, 10)
        assert not set(mine.tolist()) & set(r["published"])
        pool.free_batch(mine)
        pool.free_batch(r["published"])


def test_utilisation_on_the_long_context_trace(tmp_path):
    from cxlkv.bench.trace import run_trace

    path = str(tmp_path / "trace.pool")
    init_pool(path, {"size": 1 << 30})
    with cxlkv.open_pool(path) as pool:
        res = run_trace(pool, seed=1)
    assert res["sequences"] >= 3 and sum(res["blocks"].values()) > 1000
    assert res["utilisation"] >= 0.92, res
    assert res["utilisation"] > res["buddy_utilisation"]


def test_nodes_free_each_others_slots(apool):
    """Same slot size in four nodes; each frees what another allocated
    (foreign frees go under the pool lock); nothing overlaps or leaks."""
    procs = [NodeProc() for _ in range(4)]
    try:
        for p in procs:
            p.attach(apool)
        held = [p.call(op="alloc_publish", nbytes=8192, reserved=0, published=30)["published"]
                for p in procs]
        for i, p in enumerate(procs):            # node i frees node i+1's slots
            p.send(op="free_all", offsets=held[(i + 1) % 4])
        assert [p.reply() for p in procs] == [{"freed": 30}] * 4
        with Pool.open(apool) as pool:
            d = alloc.descriptors(pool)
            assert int(alloc.used_slots(d).sum()) == 0
            del d
    finally:
        for p in procs:
            p.close()
    with Pool.open(apool) as pool:
        from cxlkv.ops.fsck import check

        rep = check(pool)
        assert rep.clean and rep.stats["allocator"]["chunks_used"] == 0


# -- releases racing lock-free allocation ---------------------------

def _head(pool, off: int) -> int:
    data_off, chunk, _, _ = alloc.geometry(pool)
    return (off - data_off) // chunk


def _desc(pool, head: int) -> int:
    return alloc.geometry(pool)[3] + head * layout.CHUNK_DESC_SIZE


def _kind(pool, head: int) -> int:
    return pool.mapping.load64(_desc(pool, head)) & 0xFF


def test_slot_holder_publishes_and_frees_while_a_release_looks_at_its_slab(apool, monkeypatch):
    """The interleaving `cxlkv stress` hit about one run in three: node B, out of
    room, tries to release node A's slab, which was empty when B listed the
    empty slabs; A has just taken slots in it.  B's release marks the slab
    RELEASING, and A publishes and frees in that window (no pool lock); then
    B sees A's slots and puts the slab back."""
    with cxlkv.open_pool(apool) as a, cxlkv.open_pool(apool) as b:
        one, two = a.alloc(4096), a.alloc(4096)
        head = _head(a, one)
        assert _head(a, two) == head
        seen = []

        def b_releasing(site):               # B's release, just past RELEASING
            if site == "release.releasing" and not seen:
                seen.append(_kind(a, head))
                a.publish(two)
                a.free(one)

        monkeypatch.setattr(alloc, "crashpoint", b_releasing)
        with b.lock():
            assert alloc.release_slab(b, head) is False
        assert seen == [layout.CHUNK_RELEASING]
        assert _kind(a, head) == layout.CHUNK_HEAD
        assert alloc.slot_bits(a, one) == (False, False, False)
        assert alloc.slot_bits(a, two) == (True, True, False)
        a.free(two)


def test_release_refuses_a_slab_its_owner_is_allocating_from(apool):
    """An allocator names its slab in a hazard word before checking it; while
    the word is up no other node's release takes the slab (so it cannot be
    remade, and the allocator's slot bit can never land in someone else's slab)."""
    with cxlkv.open_pool(apool) as a, cxlkv.open_pool(apool) as b:
        off = a.alloc(4096)
        a.free(off)                                 # A's slab is empty, still A's
        head = _head(a, off)
        hazard = alloc.heap_offset(a, a.node.slot) + 8 * 3
        a.mapping.store64(hazard, head + 1)          # A between its check and its CAS
        with b.lock():
            assert alloc.release_slab(b, head) is False
        assert _kind(a, head) == layout.CHUNK_HEAD
        b.mapping.store64(alloc.heap_offset(b, b.node.slot), head + 1)  # B's hazards don't count
        a.mapping.store64(hazard, 0)
        with b.lock():
            assert alloc.release_slab(b, head) is True
        assert _kind(a, head) == layout.CHUNK_FREE
        b.mapping.store64(alloc.heap_offset(b, b.node.slot), 0)


def test_allocation_falls_back_to_the_pool_lock_when_every_hazard_word_is_taken(apool):
    with cxlkv.open_pool(apool) as pool:
        off = pool.alloc(4096)
        head = _head(pool, off)
        heap = alloc.heap_offset(pool, pool.node.slot)
        m, al = pool.mapping, pool.allocator
        assert [m.load64(heap + 8 * i) for i in range(layout.HEAP_HAZARDS)] == [0] * 8   # dropped
        for i in range(layout.HEAP_HAZARDS):                 # other threads of this node
            m.store64(heap + 8 * i, 1000 + i)
        out = np.empty(1, dtype=np.uint64)
        assert m.slab_alloc(head, al.token, out, 1, True, 4096, heap) == -2
        more = pool.alloc(4096)                         # under the pool lock instead
        assert _head(pool, more) == head and more != off
        assert [m.load64(heap + 8 * i) for i in range(layout.HEAP_HAZARDS)] == \
            [1000 + i for i in range(8)]
        for i in range(layout.HEAP_HAZARDS):
            m.store64(heap + 8 * i, 0)
        pool.free_batch([off, more])


HAZARD_CRASH = r'''
import sys, cxlkv
pool = cxlkv.open_pool(sys.argv[1])
pool.alloc(4096)
'''


def test_a_node_killed_mid_allocation_has_its_hazard_dropped_by_recovery(apool):
    import os
    import subprocess
    import sys

    env = {**os.environ, "CXLKV_CRASH_AT": "alloc.bit:1"}
    r = subprocess.run([sys.executable, "-c", HAZARD_CRASH, apool], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == -9, r.stderr
    with Pool.open(apool) as p:                          # not attached: nothing reaped yet
        d = alloc.descriptors(p)
        heads = np.flatnonzero((d["control"] & 0xFF) == layout.CHUNK_HEAD)
        del d
        assert len(heads) == 1
        heaps = [[p.mapping.load64(alloc.heap_offset(p, s) + 8 * i) for i in range(8)]
                 for s in range(p.sb.max_nodes)]
        assert sorted(w for ws in heaps for w in ws if w) == [int(heads[0]) + 1]
    with cxlkv.open_pool(apool) as pool:                 # reaps the dead node
        assert all(pool.mapping.load64(alloc.heap_offset(pool, s) + 8 * i) == 0
                   for s in range(pool.sb.max_nodes) for i in range(8))
        from cxlkv.ops.fsck import check

        rep = check(pool)
        assert rep.clean, [f.to_json() for f in rep.errors]
        assert rep.stats["allocator"]["slots_allocated"] == 0


@pytest.fixture
def crowded_pool(pool_path):
    """64 MiB in 2 MiB chunks: 30 chunks, so slabs are released and remade all the time."""
    init_pool(pool_path, {"size": 64 * MiB, "chunk_size": 2 * MiB, "max_nodes": 16})
    return pool_path


@pytest.mark.parametrize("nodes,seed", [(3, 1), (4, 2), (6, 3), (8, 4)])
def test_stress_on_a_crowded_pool_finds_nothing(crowded_pool, nodes, seed):
    """Workers allocate, publish, verify and free in a pool that is full most
    of the time (releases racing lock-free allocation in other nodes' slabs)."""
    from cxlkv.api import Pool
    from cxlkv.ops import stress
    from cxlkv.ops.fsck import check

    res = stress.run(stress.Options(pool=crowded_pool, nodes=nodes, ops=5000, seed=seed,
                                    mix={"alloc": 40, "free": 30, "verify": 20, "lock": 10}))
    assert res.violations == []
    assert res.ops["total"] >= 5000 and res.ops["alloc"] > 1000
    with Pool.open(crowded_pool, writable=False) as p:
        rep = check(p)
    assert rep.clean, rep.to_json()
    assert rep.stats["allocator"]["slots_allocated"] == rep.stats["allocator"]["chunks_used"] == 0


# -- corrupt descriptors ---------------------------------------------

CORRUPT = {
    "kind": lambda m, h: m.store64(h, 0x7F),                          # no such kind
    "geometry": lambda m, h: m.store64(h + alloc._F["nslots"], 100_000),  # > 512 slots
    "tail": None,                                   # a tail naming no earlier head
}


@pytest.mark.parametrize("op,how", [(op, how) for op in ("alloc", "free", "publish")
                                    for how in CORRUPT
                                    if (op, how) != ("alloc", "tail")])  # reads its head only
def test_a_corrupt_descriptor_fails_fast_naming_fsck_repair(apool, op, how):
    from cxlkv.errors import CxlkvError, MetadataCorrupt
    from cxlkv.ops.fsck import check
    from cxlkv.ops.repair import repair

    size = 3 * MiB if how == "tail" else 4096
    with cxlkv.open_pool(apool) as pool:
        m = pool.mapping
        target = pool.alloc(size)
        head = _head(pool, target)
        if how == "tail":           # 3 MiB slots: a 3-chunk slab, slot 1 starts in chunk 1
            target = pool.alloc(size)
            assert _head(pool, target) == head + 1
            m.store64(_desc(pool, head + 1), layout.CHUNK_TAIL | (head + 1) << 8)
        else:
            CORRUPT[how](m, _desc(pool, head))
        before = m.read(_desc(pool, head), 2 * layout.CHUNK_DESC_SIZE)
        call = {"alloc": lambda: pool.alloc(size), "free": lambda: pool.free(target),
                "publish": lambda: pool.publish(target)}[op]
        with pytest.raises(MetadataCorrupt, match=r"cxlkv fsck --repair") as err:
            call()
        assert isinstance(err.value, CxlkvError) and err.value.exit_code == 4
        assert apool in str(err.value)
        assert m.read(_desc(pool, head), 2 * layout.CHUNK_DESC_SIZE) == before   # nothing written
    rep = repair(apool)                                  # what the message says to do
    assert rep.after.clean, rep.after.to_json()
    with Pool.open(apool, writable=False) as p:
        assert check(p).clean


def test_kv_store_on_a_corrupt_descriptor_raises_metadata_corrupt(kvpool):
    from cxlkv.errors import MetadataCorrupt

    bb = 4096
    with cxlkv.open_pool(kvpool) as pool:
        kv = pool.kv(model="m", block_tokens=16, block_bytes=bb)
        assert kv.store(np.arange(32), bytes(2 * bb)) == 2
        d = alloc.descriptors(pool)
        heads = np.flatnonzero(((d["control"] & 0xFF) == layout.CHUNK_HEAD)
                               & (d["slot_size"] == alloc.slot_size_for(pool, bb)))
        del d
        assert len(heads) == 1
        pool.mapping.store64(_desc(pool, int(heads[0])) + alloc._F["nslots"], 100_000)
        with pytest.raises(MetadataCorrupt, match=r"cxlkv fsck --repair"):
            kv.store(np.arange(1000, 1032), bytes(2 * bb))
