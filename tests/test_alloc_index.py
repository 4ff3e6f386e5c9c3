"""The allocator's metadata work that does not grow with the pool: the free-run
search over the chunk bitmap (checked against the old full-scan computation),
releases of what this process's frees emptied, and batch recovery."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import cxlkv
from cxlkv.pool import layout
from cxlkv.ops.init import init_pool
from cxlkv.api import Pool
from cxlkv.state import alloc
from cxlkv.ops import fsck
from cxlkv.state import nodes

from cxlkv.testing.checks import wait_for
from cxlkv.testing.pools import MiB


def oracle_free(pool) -> np.ndarray:
    """Free chunks as _new_slab computed them before the index: not in the
    bitmap, descriptor FREE, inside no head's span."""
    d = alloc.descriptors(pool)
    try:
        return (~alloc.bitmap(pool) & ((d["control"] & 0xFF) == layout.CHUNK_FREE)
                & ~alloc.head_spans(d))
    finally:
        del d


def find_run(pool, k: int, hint: int = 0) -> int:
    return pool.allocator.m.chunk_find_run(pool.allocator.bitmap_off, k, hint)


def assert_run_ok(pool, free: np.ndarray, k: int, hint: int) -> None:
    got = find_run(pool, k, hint)
    first = alloc._find_run(free, k)
    if hint == 0:
        assert got == first, (k, got, first)
    elif first < 0:
        assert got == -1
    else:
        assert got >= 0 and free[got:got + k].all() and got + k <= len(free), (k, hint, got)
        after = alloc._find_run(free[hint:], k)        # next fit: the first run from the hint
        assert got == (hint + after if after >= 0 else first), (k, hint, got)




@pytest.fixture
def small_chunks(pool_path):
    """32 MiB in 64 KiB chunks: about 500 chunks, 8 bitmap words."""
    init_pool(pool_path, {"size": 32 * MiB, "chunk_size": 64 * 1024, "max_nodes": 8,
                          "lease_ms": 300})
    return pool_path


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_run_search_matches_the_full_scan_after_random_alloc_free_release(small_chunks,
                                                                               seed):
    rng = random.Random(seed)
    sizes = [4096, 60 * 1024, 64 * 1024, 100 * 1024, 200 * 1024, 1 * MiB]
    with cxlkv.open_pool(small_chunks) as a, cxlkv.open_pool(small_chunks) as b:
        held: list[tuple[object, int]] = []
        for step in range(300):
            node = a if rng.random() < 0.5 else b
            r = rng.random()
            if r < 0.55:
                try:
                    offs = node.alloc_batch(rng.choice(sizes), rng.randint(1, 6))
                    held += [(node, int(o)) for o in offs]
                except alloc.PoolFullError:
                    pass
            elif r < 0.9 and held:
                rng.shuffle(held)
                n = rng.randint(1, max(1, len(held) // 3))
                for who, off in held[:n]:
                    (who if rng.random() < 0.7 else node).free(off)   # some foreign frees
                held = held[n:]
            else:
                with node.lock():
                    node.allocator.release_empty()
            if step % 10 == 0:
                with a.lock():
                    free = oracle_free(a)
                    for k in (1, 2, 3, 5, 17, 64):
                        assert_run_ok(a, free, k, 0)
                        assert_run_ok(a, free, k, rng.randrange(a.sb.nchunks))
        for who, off in held:
            who.free(off)


def test_the_search_skips_a_dead_nodes_half_made_slab(small_chunks):
    """A head written (a crash at slab.head) with no tails and no bits: the
    chunks of its span are not free though the bitmap says so."""
    with cxlkv.open_pool(small_chunks) as p:
        _, _, n, base = alloc.geometry(p)
        h = base + 10 * layout.CHUNK_DESC_SIZE
        with p.lock():
            p.mapping.store64(h + 8 * 4, 5)              # nchunks
            p.mapping.store64(h + 8 * 2, 64 * 1024)     # slot size
            p.mapping.store64(h + 8 * 3, 5)              # nslots
            p.mapping.store64(h, layout.CHUNK_HEAD)
            free = oracle_free(p)
            assert not free[10:15].any()
            for k in (1, 3, 8):
                for hint in (0, 8, 11, 14):
                    assert_run_ok(p, free, k, hint)
            assert find_run(p, 3, 11) == 15
            p.mapping.store64(h, 0)
            p.mapping.zero(h, layout.CHUNK_DESC_SIZE)


def fill_with_chunk_slabs(pool) -> list[int]:
    """One slot per chunk (a 1-chunk slab each) until the pool is full."""
    offs = []
    while True:
        try:
            offs.append(pool.alloc(pool.sb.chunk_size))
        except alloc.PoolFullError:
            return offs


def test_a_slab_is_made_exactly_when_a_run_of_its_length_exists(pool_path):
    init_pool(pool_path, {"size": 64 * MiB, "chunk_size": 2 * MiB, "max_nodes": 8})
    with cxlkv.open_pool(pool_path) as p:
        offs = fill_with_chunk_slabs(p)
        data_off, chunk, nchunks, _ = alloc.geometry(p)
        assert len(offs) == nchunks
        by_chunk = {(o - data_off) // chunk: o for o in offs}
        # holes of one and two chunks: a 4 MiB slot (a 2-chunk slab) fits, 5 MiB
        # (a 5-chunk slab with two slots) does not
        holes = [1, 4, 5, 9, 13, 14]
        p.free_batch([by_chunk[i] for i in holes])
        assert alloc.slab_shape(chunk, alloc.slot_size_for(p, 5 * MiB), nchunks)[0] == 5
        with pytest.raises(alloc.PoolFullError):
            p.alloc(5 * MiB)
        two = p.alloc(4 * MiB)
        assert (two - data_off) // chunk in (4, 13)
        p.free_batch([by_chunk[i] for i in (20, 21, 22, 23, 24)])
        five = p.alloc(5 * MiB)
        assert (five - data_off) // chunk == 20
        p.free_batch([five, two] + [o for i, o in by_chunk.items()
                                    if i not in holes + [20, 21, 22, 23, 24]])
        rep = fsck.check(p)
        assert rep.clean


def test_slab_make_writes_head_tails_and_bits_or_finds_no_run(pool_path):
    """The C slab maker (one call under the pool lock): a 3-chunk slab's
    descriptors and bitmap bits as recovery and fsck read them; -1 (nothing
    written) when no run of its length is free; a bad shape is refused."""
    init_pool(pool_path, {"size": 64 * MiB, "chunk_size": 2 * MiB, "max_nodes": 8})
    with cxlkv.open_pool(pool_path) as p:
        m, a = p.mapping, p.allocator
        data_off, chunk, nchunks, base = alloc.geometry(p)
        with p.lock():
            bits_before = alloc.bitmap(p).copy()
            head = m.slab_make(a.bitmap_off, 3, 62, 77, 6 * MiB, 1)   # from 62: wraps to 0
            assert head == 0
            d = alloc.descriptors(p)
            assert (d["control"][0] & 0xFF) == layout.CHUNK_HEAD
            assert (d["owner"][0], d["slot_size"][0], d["nslots"][0], d["nchunks"][0]) == (
                77, 6 * MiB, 1, 3)
            assert list(d["control"][1:3]) == [layout.CHUNK_TAIL | 0 << 8] * 2
            del d
            bits = alloc.bitmap(p)
            assert bits[:3].all() and (bits[3:] == bits_before[3:]).all()
            assert m.slab_make(a.bitmap_off, nchunks, 0, 77, MiB, 1) == -1
            assert (alloc.bitmap(p)[3:] == bits_before[3:]).all()
            with pytest.raises(ValueError, match="bad slab shape"):
                m.slab_make(a.bitmap_off, 1, 0, 77, MiB, 0)
            # undo: the slab was never handed to the allocator
            alloc.release_slab(p, head)
        assert fsck.check(p).clean


def test_release_empty_releases_what_our_frees_emptied_and_nothing_else(pool_path):
    init_pool(pool_path, {"size": 64 * MiB, "chunk_size": 2 * MiB, "max_nodes": 8})
    with cxlkv.open_pool(pool_path) as a, cxlkv.open_pool(pool_path) as b:
        mine = a.alloc_batch(2 * MiB, 4)
        theirs = b.alloc_batch(2 * MiB, 4)
        other = b.alloc(2 * MiB)
        b.free(other)                                # b's own frees: b's record
        a.free_batch(theirs[:2])                     # a frees b's slots (foreign)
        a.free_batch(mine[:1])
        with a.lock():
            assert a.allocator.release_empty() == 3
            assert a.allocator.release_empty() == 0  # the record is drained
        kinds = [(p.mapping.load64(alloc.geometry(p)[3] + ((int(o) - alloc.geometry(p)[0])
                                                          // (2 * MiB)) * 256) & 0xFF)
                 for p, o in [(a, theirs[0]), (a, theirs[1]), (a, mine[0]), (b, other),
                              (a, theirs[2])]]
        assert kinds == [layout.CHUNK_FREE] * 3 + [layout.CHUNK_HEAD, layout.CHUNK_HEAD]
        with b.lock():
            assert b.allocator.release_empty() == 1  # b's own
        a.free_batch(mine[1:])
        b.free_batch(theirs[2:])
        assert fsck.check(a).clean


SLABS_THEN_WAIT = r"""
import sys, numpy as np, cxlkv
p = cxlkv.open_pool(sys.argv[1])
n = int(sys.argv[2])
offs = p.alloc_batch(p.sb.chunk_size, n)
pub = offs[::2]
for o in offs[:64].tolist():
    p.mapping.write(o, b"R" * 64)
p.publish(pub)
for o in pub.tolist():
    p.mapping.write(o, b"P" * 64)
print(len(offs), flush=True)
sys.stdin.readline()
"""


def dead_node_with_slabs(path: str, n: int, env=None) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-c", SLABS_THEN_WAIT, path, str(n)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    assert int(proc.stdout.readline()) == n
    return proc


def slab_census(pool) -> dict:
    d = alloc.descriptors(pool)
    try:
        kind = d["control"] & 0xFF
        heads = np.flatnonzero(kind == layout.CHUNK_HEAD)
        return {"heads": len(heads), "orphans": int((d["owner"][heads] == 0).sum()),
                "used": int(alloc.used_slots(d,
                                             heads).sum()), "bits": int(alloc.bitmap(pool).sum())}
    finally:
        del d


@pytest.fixture(params=["cas", "manager", "manager-nc"])
def mode_pool(request, pool_path, monkeypatch):
    """160 MiB in 64 KiB chunks, in one sync mode (with its lock manager), the
    environment set for this process and its children."""
    env = {"CXLKV_NONCOHERENT": "1"} if request.param == "manager-nc" else {}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    sync = "cas" if request.param == "cas" else "manager"
    init_pool(pool_path, {"size": 160 * MiB, "chunk_size": 64 * 1024, "max_nodes": 8,
                          "lease_ms": 300, "sync": sync})
    mgr = None
    if sync == "manager":
        mgr = subprocess.Popen([sys.executable, "-m", "cxlkv", "lock-manager", "--pool",
                                pool_path], stderr=subprocess.PIPE, text=True)
        assert "active" in mgr.stderr.readline()
    yield pool_path
    if mgr is not None:
        mgr.terminate()
        mgr.wait(10)


def test_recovery_of_a_killed_node_with_many_slabs(mode_pool):
    """kill -9 of a node holding 2,000 one-slot slabs, half published: the
    reserved ones are freed (zeroed) and their slabs released, the published
    ones kept in orphaned slabs, all in one recovery."""
    pool_path = mode_pool
    n = 2000
    proc = dead_node_with_slabs(pool_path, n)
    proc.kill()
    proc.wait()
    with cxlkv.open_pool(pool_path) as p:                # reaps the dead node (cas mode)
        want = {"heads": n // 2, "orphans": n // 2, "used": n // 2, "bits": n // 2}
        wait_for(lambda: slab_census(p) == want, what="the dead node's recovery")
        rep = fsck.check(p)
        assert rep.clean, [f.to_json() for f in rep.errors]
        data_off, chunk, _, _ = alloc.geometry(p)
        first = data_off                                    # slot 0: published
        assert p.mapping.read(first, 64) == b"P" * 64
        assert alloc.slot_bits(p, first) == (True, True, False)
        assert p.mapping.read(first + chunk, 64) == bytes(64)   # reserved: zeroed
        # orphans are adopted under pressure, and the pool fills to the brim
        offs = fill_with_chunk_slabs(p)
        assert len(offs) == p.sb.nchunks - n // 2
        p.free_batch(offs)


@pytest.mark.parametrize("site", ["slab.head", "slab.tails", "release.releasing",
                                  "release.tails", "release.head"])
def test_a_node_killed_making_or_releasing_a_slab_leaves_nothing_behind(pool_path, site):
    init_pool(pool_path, {"size": 32 * MiB, "chunk_size": 2 * MiB, "max_nodes": 8,
                          "lease_ms": 300})
    script = ("import sys, cxlkv\n"
              "p = cxlkv.open_pool(sys.argv[1])\n"
              "a = p.alloc_batch(6 << 20, 2)\n"          # 3-chunk slabs
              "p.free_batch(a)\n"
              "with p.lock():\n"
              "    p.allocator.release_empty()\n")
    r = subprocess.run([sys.executable, "-c", script, pool_path], capture_output=True,
                       text=True, timeout=60, env={**os.environ, "CXLKV_CRASH_AT": f"{site}:1"})
    assert r.returncode == -9, r.stderr
    with cxlkv.open_pool(pool_path) as p:
        rep = fsck.check(p)
        assert rep.clean, [f.to_json() for f in rep.errors]
        assert slab_census(p)["bits"] == 0
        offs = fill_with_chunk_slabs(p)
        assert len(offs) == p.sb.nchunks                 # nothing leaked
        p.free_batch(offs)


@pytest.mark.parametrize("mode", ["cas", "manager", "manager-nc"])
def test_a_stalled_node_fenced_and_reaped_has_its_slabs_recovered(pool_path, mode, monkeypatch,
                                                                  remote_env):
    from test_stall import Rack, fenced, freed

    rack = Rack(pool_path, mode, monkeypatch, grace_ms=600)
    try:
        with cxlkv.open_pool(rack.path) as pool:             # the reaper
            pool.node.interval = 0.02
            a = rack.node(remote_env)
            got = a.call(op="alloc_publish", nbytes=256 * 1024, reserved=12, published=8)
            os.kill(a.p.pid, signal.SIGSTOP)
            wait_for(lambda: fenced(rack.path, a), what="the stalled node to be fenced")
            wait_for(lambda: freed(rack.path, a), what="the quarantine to end")
            for o in got["reserved"]:
                assert alloc.slot_bits(pool, o) in (None, (False, False, False))
            for o in got["published"]:
                assert alloc.slot_bits(pool, o) == (True, True, False)
                assert pool.mapping.read(o, 8) == b"PUBLPUBL"
            os.kill(a.p.pid, signal.SIGCONT)
            a.send(op="alloc_publish", nbytes=256 * 1024, reserved=1, published=0)
            assert "error" in a.reply()                     # fenced: it allocates nothing
            a.p.kill()
            a.p.wait(30)
            pool.free_batch(got["published"])
        with Pool.open(rack.path) as p:
            rep = fsck.check(p)
        assert rep.clean, [f.to_json() for f in rep.errors]
    finally:
        rack.close()


def test_recovery_of_10k_slabs_is_batched(pool_path):
    """Recovery's cost: 10,000 slabs in well under a second here (the figure,
    <= 50 ms, is `cxlkv bench run alloc-scale`'s; this machine is shared)."""
    init_pool(pool_path, {"size": 800 * MiB, "chunk_size": 64 * 1024, "max_nodes": 8,
                          "lease_ms": 60_000})
    n = 10_000
    proc = dead_node_with_slabs(pool_path, n)
    with Pool.open(pool_path) as probe:
        slot = next(i.slot for i in nodes.read_nodes(probe) if i.state == "attached")
        epoch = nodes.read_slot(probe, slot).epoch
    proc.kill()
    proc.wait()
    with Pool.open(pool_path) as p:
        t = time.perf_counter()
        alloc._recover_allocations(p, slot, epoch)
        took = time.perf_counter() - t
        c = slab_census(p)
    assert c == {"heads": n // 2, "orphans": n // 2, "used": n // 2, "bits": n // 2}
    assert took < 1.0, took


def test_a_release_keeps_bits_another_node_set_in_the_same_bitmap_line(mode_pool, monkeypatch):
    """Node A's copy of a bitmap line goes stale when B makes a slab next to
    A's; A's release of its own slab must not write that stale line back
    (non-coherent memory: found by `cxlkv stress`)."""
    monkeypatch.setenv("CXLKV_NC_EVICT_EVERY", "0")        # no lucky evictions
    with cxlkv.open_pool(mode_pool) as a, cxlkv.open_pool(mode_pool) as b:
        x = a.alloc(64 * 1024)
        a.free(x)                                           # emptied: A's to release
        y = b.alloc(64 * 1024)                              # the next chunk, same line
        data_off, chunk, _, _ = alloc.geometry(a)
        assert (y - data_off) // chunk == (x - data_off) // chunk + 1
        with a.lock():
            assert a.allocator.release_empty() == 1
        with Pool.open(mode_pool, writable=False) as p:
            assert alloc.bitmap(p)[(y - data_off) // chunk]
            assert not alloc.bitmap(p)[(x - data_off) // chunk]
        b.free(y)


def test_the_census_matches_the_numpy_computation(small_chunks):
    """slab_census (one C pass) against the full-table numpy reading of the
    same states: a RELEASING head, a dangling tail, a leaked bit, a slab with
    an interrupted free, slabs of a given owner."""
    with cxlkv.open_pool(small_chunks) as p:
        offs = p.alloc_batch(100 * 1024, 6)
        p.publish(offs[:4])
        m = p.mapping
        data_off, chunk, n, base = alloc.geometry(p)
        with p.lock():
            m.slab_mark_freeing(offs[:1])                   # a free begun: dirty + allocated
            m.store64(base + 300 * layout.CHUNK_DESC_SIZE,
                      layout.CHUNK_TAIL | 299 << 8)   # dangling
            alloc.set_bits(p, 310, 1, True)                     # leaked
            h = (int(offs[5]) - data_off) // chunk
            m.store64(base + h * layout.CHUNK_DESC_SIZE, layout.CHUNK_RELEASING)
            got = alloc.census(p, p.node.owner_token, [0])      # 0 live: our slabs are candidates
            d = alloc.descriptors(p)
            try:
                kind = d["control"] & 0xFF
                heads = np.flatnonzero(kind == layout.CHUNK_HEAD)
                hit = (d["alloc_bits"][heads] & d["dirty_bits"][heads]).any(axis=1)
                want = (np.flatnonzero(kind == layout.CHUNK_RELEASING),
                        heads[d["owner"][heads] == p.node.owner_token],
                        heads[hit & (d["owner"][heads] != 0)],
                        np.flatnonzero((kind == layout.CHUNK_TAIL) & ~alloc.head_spans(d)),
                        np.flatnonzero(alloc.bitmap(p) & (kind == layout.CHUNK_FREE)))
            finally:
                del d
            for g, w in zip(got, want):
                assert g.tolist() == w.tolist()
            assert [len(x) for x in got[:5]] == [1, 1, 1, 1, 1]   # 100 KiB slots: 2 slabs
            m.store64(base + h * layout.CHUNK_DESC_SIZE, layout.CHUNK_HEAD)
            alloc.repair_dangling(p)
            assert [len(x) for x in alloc.census(p)[3:5]] == [0, 0]
        p.free_batch(offs)


def test_orphans_emptied_by_a_node_that_died_are_released_by_the_next_recovery(small_chunks):
    """B frees the last slots of an orphaned slab (a foreign free: B's record
    of it lives in B's process) and is killed before releasing it; the
    recovery of B releases every empty slab no live node owns."""
    with cxlkv.open_pool(small_chunks) as a:
        offs = a.alloc_batch(4096, 20)
        a.publish(offs)
    script = ("import sys, json, numpy as np, cxlkv, os, signal\n"
              "p = cxlkv.open_pool(sys.argv[1])\n"
              "p.free_batch(np.array(json.loads(sys.argv[2]), dtype=np.uint64))\n"
              "os.kill(os.getpid(), signal.SIGKILL)\n")
    r = subprocess.run([sys.executable, "-c", script, small_chunks,
                        json.dumps([int(o) for o in offs])], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == -9, r.stderr
    with Pool.open(small_chunks) as p:
        c = slab_census(p)
        assert c["heads"] == c["orphans"] > 0 and c["used"] == 0      # empty, unreleased
    with cxlkv.open_pool(small_chunks) as p:                          # reaps B
        assert slab_census(p) == {"heads": 0, "orphans": 0, "used": 0, "bits": 0}
        assert fsck.check(p).clean


def test_the_sweep_finds_slabs_others_emptied_a_window_at_a_time(small_chunks, monkeypatch):
    """A full pool whose slabs another process emptied (its record, not
    ours): each slab-making attempt that finds no free run sweeps one window
    of descriptors, releasing the empty slabs there and no more."""
    monkeypatch.setattr(alloc, "SWEEP_CHUNKS", 64)
    with cxlkv.open_pool(small_chunks) as a, cxlkv.open_pool(small_chunks) as b:
        offs = fill_with_chunk_slabs(a)
        b.free_batch(offs)                                  # foreign frees: b's record
        before = slab_census(a)["heads"]
        got = [a.alloc(128 * 1024) for _ in range(3)]       # 2-chunk slabs
        released = before - slab_census(a)["heads"] + 3
        assert 4 <= released <= 64 * 2                      # one or two windows, not all
        a.free_batch(got)
        with b.lock():
            b.allocator.release_empty()                     # b releases the rest it emptied
        assert slab_census(a)["heads"] <= 3
