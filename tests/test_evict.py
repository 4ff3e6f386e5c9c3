"""Eviction from the in-pool leaf LRU lists (INCOMPAT KV_LRU): the victims
are those of the whole-table order (leaf first, least recently used first),
pins, keeps and tenant quotas hold, a kill -9 mid-edit is rebuilt, fsck
checks and repairs the lists, in both sync modes and under the
non-coherence emulation."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

import numpy as np
import psutil
import pytest

import cxlkv
from cxlkv.errors import PoolIncompatible
from cxlkv.kv.area import Area
from cxlkv.pool import layout
from cxlkv.ops.init import init_pool
from cxlkv.api import Pool
from cxlkv.state import nodes
from cxlkv.ops.fsck import check
from cxlkv.ops.repair import repair

from cxlkv.testing.checks import fsck_clean, wait_for
from cxlkv.testing.nodes import lock_manager

MiB = 1 << 20
BB = 256                      # small blocks: many entries in a small pool


def make(path, slots=1 << 18, size=64 * MiB, sync="cas"):
    init_pool(path, {"size": size, "chunk_size": 64 * 1024, "max_nodes": 8,
                     "lease_ms": 1000, "hash_slots": slots, "sync": sync})


def store_forest(kv, groups: int, per_group: int, rng) -> list[list[int]]:
    """Sequences sharing a 2-block prefix per group, 2-4 blocks of their own."""
    seqs = []
    for g in range(groups):
        stem = [g * 1_000_000 + j for j in range(2 * kv.block_tokens)]
        for s in range(per_group):
            tail = [g * 1_000_000 + 1000 * (s + 1) + j
                    for j in range(int(rng.integers(2, 5)) * kv.block_tokens)]
            seqs.append(stem + tail)
            kv.store(seqs[-1], b"\1" * (len(seqs[-1]) // kv.block_tokens * BB))
    return seqs


def effective_stamps(t: np.ndarray) -> np.ndarray:
    """The oracle: each live entry's newest stamp over its subtree."""
    st = t["ctl"] & 0xFF
    live = (st == layout.KV_PENDING) | (st == layout.KV_PUBLISHED) | (st == layout.KV_EVICTING)
    eff = t["lru"].astype(np.int64).copy()
    par = t["parent"].astype(np.int64) - 1
    depth = Area._depths(np.where(live & (par >= 0), par, -1))
    for i in np.flatnonzero(live)[np.argsort(-depth[live], kind="stable")]:
        if par[i] >= 0:
            eff[par[i]] = max(eff[par[i]], eff[i])
    return eff


def lists_clean(pool):
    Area(pool)                                 # tells the mapping where the lists are
    problems, first, on, leaves = pool.mapping.kv_lru_check()
    assert problems == 0, first
    assert on == leaves
    return on


def test_pick_matches_the_whole_table_order_on_a_large_table(pool_path):
    make(pool_path)
    rng = np.random.default_rng(1)
    with cxlkv.open_pool(pool_path) as pool:
        kv = pool.kv(model="m", block_tokens=4, block_bytes=BB)
        seqs = store_forest(kv, 300, 6, rng)
        for i in rng.choice(len(seqs), 200, replace=False):     # touch some, in turns
            with kv.load(seqs[int(i)][:int(rng.integers(1, 5)) * 4]):
                pass
            if i % 7 == 0:
                with pool.lock():
                    Area(pool).drain_rings()
        a = Area(pool)
        with pool.lock():
            a.drain_rings()
            on = lists_clean(pool)
            t = a.entries()
            order = a._victims(t, None, None, None)
            eff = effective_stamps(t)
            k = len(order) // 2
            out = np.zeros(k, dtype=np.uint64)
            got = pool.mapping.kv_lru_pick(0xFFFF, k, 0, a.smallest, np.zeros(0, np.uint64),
                                           np.zeros(0, np.uint64), out)
        assert on > 300 and got == k
        picked = out[:got].astype(np.int64)
        # the same stamps as the oracle's first k (ties may come in another order)
        assert sorted(eff[picked]) == sorted(eff[order[:k]])
        # leaf first: every live child of a victim comes before it
        pos = {int(v): j for j, v in enumerate(picked)}
        st = t["ctl"] & 0xFF
        for i in np.flatnonzero((st == layout.KV_PUBLISHED) & (t["parent"] > 0)):
            p = int(t["parent"][i]) - 1
            if p in pos:
                assert int(i) in pos and pos[int(i)] < pos[p]


def test_evict_takes_old_leaves_and_spares_touched_ones(pool_path):
    make(pool_path, slots=1 << 16, size=32 * MiB)
    rng = np.random.default_rng(2)
    with cxlkv.open_pool(pool_path) as pool:
        kv = pool.kv(model="m", block_tokens=4, block_bytes=BB)
        seqs = store_forest(kv, 100, 4, rng)
        hot = seqs[:50]                                    # the oldest, then used again
        for s in hot:
            with kv.load(s):
                pass
        a = Area(pool)
        with pool.lock():
            a.drain_rings()
            total = a.header().live
            blocks, _ = a.evict(need_entries=total // 2)
        assert blocks >= total // 2
        assert all(kv.match(s) == len(s) for s in hot)
        # nothing left with a parent gone, chains contiguous, lists exact
        t = a.entries()
        st = t["ctl"] & 0xFF
        live = (st == layout.KV_PUBLISHED)
        par = t["parent"][live].astype(np.int64)
        assert (st[par[par > 0] - 1] == layout.KV_PUBLISHED).all()
        lists_clean(pool)
    fsck_clean(pool_path)


def test_pins_and_keeps_are_never_evicted(pool_path):
    make(pool_path, slots=1 << 12, size=16 * MiB)
    with cxlkv.open_pool(pool_path) as pool:
        kv = pool.kv(model="m", block_tokens=4, block_bytes=BB)
        seqs = store_forest(kv, 20, 3, np.random.default_rng(3))
        a = Area(pool)
        with kv.load(seqs[0]) as view:
            assert len(view) == len(seqs[0]) // 4
            keep_seq = seqs[5]
            found, idx, _ctl, _pay = kv._lookup(kv._keys(keep_seq))
            assert found == len(keep_seq) // 4
            with pool.lock():
                a.evict(need_entries=10 ** 6, keep=idx[-1:])     # the leaf: so its chain stays
            assert kv.match(seqs[0]) == len(seqs[0])       # pinned, and its ancestors
            assert kv.match(keep_seq) == len(keep_seq)
            assert a.header().live == len(set(map(tuple, (seqs[0][:8], seqs[5][:8])))) * 2 \
                + (len(seqs[0]) + len(keep_seq)) // 4 - 4
            lists_clean(pool)
        with pool.lock():
            a.evict(need_entries=10 ** 6)
        assert a.header().live == 0 and lists_clean(pool) == 0


def test_tenant_quota_evicts_only_that_tenants_blocks(pool_path):
    make(pool_path, slots=1 << 14, size=32 * MiB)
    with cxlkv.open_pool(pool_path) as pool:
        ka = pool.kv(model="m", block_tokens=4, block_bytes=BB, salt="a", quota=64 * BB)
        kb = pool.kv(model="m", block_tokens=4, block_bytes=BB, salt="b")
        b_seqs = [[7_000_000 + 100 * s + j for j in range(16)] for s in range(20)]
        for s in b_seqs:
            kb.store(s, b"\2" * 4 * BB)
        a_seqs = [[100 * s + j for j in range(16)] for s in range(40)]   # 160 blocks > 64
        for s in a_seqs:
            ka.store(s, b"\3" * 4 * BB)
        assert all(kb.match(s) == 16 for s in b_seqs)
        assert ka.match(a_seqs[-1]) == 16 and ka.match(a_seqs[0]) < 16
        a = Area(pool)
        assert a.tenant_record(ka.tenant).used <= 64 * BB
        lists_clean(pool)
    fsck_clean(pool_path)


def test_a_corrupt_link_is_found_by_fsck_and_repaired(pool_path):
    make(pool_path, slots=1 << 12, size=16 * MiB)
    with cxlkv.open_pool(pool_path) as pool:
        kv = pool.kv(model="m", block_tokens=4, block_bytes=BB)
        store_forest(kv, 20, 3, np.random.default_rng(4))
        a = Area(pool)
        leaves = lists_clean(pool)
    with Pool.open(pool_path) as p:                   # corrupt it after the detach
        a = Area(p)
        head = a.header().lru_lists[0] & 0xFFFFFFFF
        p.mapping.store64(a.links + (head - 1) * 8, (1 << 32) * (a.nslots + 5))
    with Pool.open(pool_path, writable=False) as p:
        rep = check(p)
    assert "kv-lru" in {f.code for f in rep.errors}
    rr = repair(pool_path)
    assert "kv-lru" in {d["code"] for d in rr.actions}
    fsck_clean(pool_path)
    with cxlkv.open_pool(pool_path) as pool:
        assert lists_clean(pool) == leaves


def test_a_corrupt_link_heals_on_the_next_eviction(pool_path):
    make(pool_path, slots=1 << 12, size=16 * MiB)
    with cxlkv.open_pool(pool_path) as pool:
        kv = pool.kv(model="m", block_tokens=4, block_bytes=BB)
        store_forest(kv, 20, 3, np.random.default_rng(5))
        a = Area(pool)
        head = a.header().lru_lists[0] & 0xFFFFFFFF
        rebuilds = a.header().lru_rebuilds
        pool.mapping.store64(a.links + (head - 1) * 8, 7 << 32)    # a wrong, in-range link
        with pool.lock():
            got = 0
            for _ in range(3):
                got += a.evict(need_entries=10)[0]
        assert got >= 10 and a.header().lru_rebuilds > rebuilds
        lists_clean(pool)
    fsck_clean(pool_path)


CRASHER = r'''
import sys, numpy as np, cxlkv
from cxlkv.kv.area import Area
pool = cxlkv.open_pool(sys.argv[1])
kv = pool.kv(model="m", block_tokens=4, block_bytes=256)
with pool.lock():
    Area(pool).evict(need_entries=int(sys.argv[2]))
print("survived")
'''


@pytest.mark.parametrize("site", ["kv.lru:5", "kv.evict:3", "kv.lru:12", "kv.evict:50"])
def test_kill9_mid_eviction_is_recovered(pool_path, site):
    make(pool_path, slots=1 << 12, size=16 * MiB)
    with cxlkv.open_pool(pool_path) as pool:
        kv = pool.kv(model="m", block_tokens=4, block_bytes=BB)
        seqs = store_forest(kv, 20, 3, np.random.default_rng(6))
    r = subprocess.run([sys.executable, "-c", CRASHER, pool_path, "60"], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "CXLKV_CRASH_AT": site})
    assert r.returncode == -9, r.stderr
    with cxlkv.open_pool(pool_path) as pool:          # attaching reaps the dead node
        kv = pool.kv(model="m", block_tokens=4, block_bytes=BB)
        lists_clean(pool)
        a = Area(pool)
        with pool.lock():
            a.evict(need_entries=20)
        lists_clean(pool)
        for s in seqs:                                 # chains stay contiguous
            assert kv.match(s) in range(0, len(s) + 1, 4)
    fsck_clean(pool_path)


def test_lists_stay_exact_in_manager_mode_under_noncoherence(pool_path, monkeypatch):
    """Two emulated hosts take turns storing and evicting; each reads the
    other's list edits (flushed, and invalidated before reading)."""
    monkeypatch.setenv("CXLKV_NONCOHERENT", "1")
    monkeypatch.setenv("CXLKV_NC_EVICT_EVERY", "0")
    make(pool_path, slots=1 << 12, size=16 * MiB, sync="manager")
    mgr = lock_manager(pool_path)
    try:
        pa, pb = cxlkv.open_pool(pool_path), cxlkv.open_pool(pool_path)
        ka = pa.kv(model="m", block_tokens=4, block_bytes=BB)
        kb = pb.kv(model="m", block_tokens=4, block_bytes=BB)
        rng = np.random.default_rng(7)
        for r in range(6):
            for kv, p in ((ka, pa), (kb, pb)):
                store_forest(kv, 4, 3, rng) if r % 2 else None
                seq = [r * 10_000 + j + (p is pb) * 500_000 for j in range(16)]
                kv.store(seq, b"\4" * 4 * BB)
                with kv.load(seq):
                    pass
                with p.lock():
                    Area(p).evict(need_entries=5)
                    lists_clean(p)
        pa.close()
        pb.close()
        fsck_clean(pool_path)
    finally:
        mgr.terminate()
        mgr.wait(30)


def test_a_pool_formatted_without_kv_lru_is_refused_by_name(golden_pool):
    path = golden_pool("pool-v1-4m-0.1")
    with Pool.open(str(path), writable=False) as p:
        assert not p.sb.incompat & layout.INCOMPAT_KV_LRU
        with pytest.raises(PoolIncompatible, match="KV_LRU"):
            Area(p)


def uncrossed_tombstones(t: np.ndarray) -> np.ndarray:
    """The oracle (the whole-table scan it replaces): tombstones that no live
    entry's probe path (home .. its slot) crosses."""
    st = t["ctl"] & 0xFF
    n = len(t)
    live = np.flatnonzero((st != layout.KV_EMPTY) & (st != layout.KV_TOMBSTONE))
    home = (t["key_lo"][live] & np.uint64(n - 1)).astype(np.int64)
    end = np.where(live >= home, live, live + n)
    cover = np.zeros(2 * n + 1, dtype=np.int64)
    np.add.at(cover, home, 1)
    np.add.at(cover, end, -1)
    crossed = np.cumsum(cover)[:2 * n]
    crossed = (crossed[:n] + crossed[n:]) > 0
    return np.flatnonzero((st == layout.KV_TOMBSTONE) & ~crossed)


def test_bounded_purge_frees_uncrossed_tombstones_like_the_scan(pool_path):
    make(pool_path, slots=1 << 11, size=16 * MiB)
    with cxlkv.open_pool(pool_path) as pool:
        kv = pool.kv(model="m", block_tokens=4, block_bytes=BB)
        seqs = [[s * 100 + j for j in range(8)] for s in range(300)]
        for s in seqs:
            kv.store(s, b"\5" * 2 * BB)
        a = Area(pool)
        with pool.lock():
            a.evict(need_entries=400)
        for s in seqs[::3]:
            kv.store(s, b"\5" * 2 * BB)
        with pool.lock():
            a.evict(need_entries=40)               # tombstones among live entries, unpurged
            t = a.entries()
            st = t["ctl"] & 0xFF
            before = int((st == layout.KV_TOMBSTONE).sum())
            want = uncrossed_tombstones(t)
            freed = a.purge_tombstones(force=True, budget=a.nslots)
            t2 = a.entries()
        assert before > 0 and len(want) > 0 and freed == len(want)
        assert ((t2["ctl"][want] & 0xFF) == layout.KV_EMPTY).all()
        assert a.header().tombstones == int(((t2["ctl"] & 0xFF) == layout.KV_TOMBSTONE).sum())
        for s in seqs:                             # every stored block still found
            assert kv.match(s) in (0, 4, 8)
        with pool.lock():
            assert a.purge_tombstones(force=True, budget=a.nslots) == 0   # nothing left to free
    fsck_clean(pool_path)


def test_the_purge_after_an_eviction_is_in_proportion_to_its_victims(pool_path):
    """The tombstone sweep an eviction runs looks at PURGE_PER_VICTIM slots
    per victim (at least PURGE_MIN), not PURGE_BUDGET: a small eviction of a
    large table holds the lock for a small sweep; sweeps keep going round."""
    from cxlkv.kv.area import PURGE_BUDGET, PURGE_MIN, PURGE_PER_VICTIM

    make(pool_path, slots=1 << 13, size=64 * MiB)
    with cxlkv.open_pool(pool_path) as pool:
        kv = pool.kv(model="m", block_tokens=4, block_bytes=BB)
        a = Area(pool)
        s = 0
        while a.header().live < a.max_used:
            kv.store([s, s + 1, s + 2, s + 3], b"\7" * BB)
            s += 1
        with pool.lock():
            a.evict(need_entries=a.max_used // 2)   # tombstones past the sweep's threshold
            assert a.header().tombstones >= a.nslots // 16
            steps = []
            for victims in (1, 10, 100):
                c0 = a.header().purge_cursor
                assert a.evict(need_entries=victims)[0] == victims
                steps.append((a.header().purge_cursor - c0) % a.nslots)
            t = a.entries()
        # the sweep stops at the end of the cluster its budget ends in
        used = np.concatenate([(t["ctl"] & 0xFF) != layout.KV_EMPTY] * 2).astype(np.int8)
        edges = np.flatnonzero(np.diff(np.concatenate([[0], used, [0]])))
        longest = int((edges[1::2] - edges[::2]).max())
        want = [max(PURGE_MIN, PURGE_PER_VICTIM * v) for v in (1, 10, 100)]
        for got, budget in zip(steps, want):
            assert budget <= got <= budget + longest
        assert max(steps) < PURGE_BUDGET
    fsck_clean(pool_path)


PAUSER = r'''
import sys, cxlkv
from cxlkv.kv.area import Area
pool = cxlkv.open_pool(sys.argv[1])
kv = pool.kv(model="m", block_tokens=4, block_bytes=256)
try:
    with pool.lock():
        Area(pool).evict(need_entries=int(sys.argv[2]))
    print("evicted")
except Exception as e:
    print(type(e).__name__)
'''


@pytest.mark.parametrize("sync", ["cas", "manager"])
def test_an_evictor_paused_mid_eviction_writes_no_list_after_it_was_fenced(pool_path, sync,
                                                                          remote_env):
    """The lock holder stops inside an eviction (before a list edit); another
    node is granted the lock once it is fenced, evicts (rebuilding the lists
    it left mid-edit); the paused one resumes, is stopped by its guard before
    its next list write, and the lists stay exact."""
    init_pool(pool_path, {"size": 16 * MiB, "chunk_size": 64 * 1024, "max_nodes": 8,
                          "lease_ms": 300, "hash_slots": 1 << 12, "sync": sync})
    mgr = lock_manager(pool_path) if sync == "manager" else None
    try:
        with cxlkv.open_pool(pool_path) as pool:
            kv = pool.kv(model="m", block_tokens=4, block_bytes=BB)
            store_forest(kv, 20, 3, np.random.default_rng(8))
            p = subprocess.Popen([sys.executable, "-c", PAUSER, pool_path, "60"],
                                 stdout=subprocess.PIPE, text=True,
                                 env={**os.environ,
                                      **remote_env(CXLKV_PAUSE_AT="kv.lru.sync:20")})
            wait_for(lambda: psutil.Process(p.pid).status() == psutil.STATUS_STOPPED,
                     what="the evictor to stop mid-eviction")
            a = Area(pool)
            with pool.lock(timeout=30):               # granted once the evictor is fenced
                assert a.header().lru_dirty          # it stopped mid-edit
                a.evict(need_entries=10)
                lists_clean(pool)
            os.kill(p.pid, signal.SIGCONT)
            out, _ = p.communicate(timeout=60)
            assert out.strip() in ("NodeFenced", "LockLost"), out
            with pool.lock(timeout=30):
                lists_clean(pool)
                a.evict(need_entries=10)
                lists_clean(pool)
            wait_for(lambda: not [n for n in nodes.read_nodes(pool) if n.state == "fenced"],
                     timeout=30, what="the evictor's quarantine to end")
            with pool.lock(timeout=30):
                lists_clean(pool)
        fsck_clean(pool_path)
    finally:
        if mgr is not None:
            mgr.terminate()
            mgr.wait(30)


@pytest.mark.parametrize("sync", ["cas", "manager"])
def test_frees_a_paused_evictor_began_are_left_to_its_own_recovery(pool_path, sync, remote_env):
    """An evictor stops (SIGSTOP) after marking its victims' slots; it is
    fenced, and meanwhile the node that owns those slabs detaches cleanly -
    its recovery finishes interrupted frees in its slabs, but not those
    whose entries still say EVICTING.  When the evictor's quarantine ends its
    own recovery removes them: no block is ever served from a freed slot."""
    init_pool(pool_path, {"size": 16 * MiB, "chunk_size": 64 * 1024, "max_nodes": 8,
                          "lease_ms": 300, "hash_slots": 1 << 12, "sync": sync})
    mgr = lock_manager(pool_path) if sync == "manager" else None
    seqs = [[s * 1000 + j for j in range(4)] for s in range(20)]
    try:
        with cxlkv.open_pool(pool_path) as watcher:     # attached throughout: it reaps
            owner = cxlkv.open_pool(pool_path)
            kv = owner.kv(model="m", block_tokens=4, block_bytes=BB)
            for s in seqs:
                kv.store(s, bytes([s[0] // 1000 + 1]) * BB)
            p = subprocess.Popen([sys.executable, "-c", PAUSER, pool_path, "5"],
                                 stdout=subprocess.PIPE, text=True,
                                 env={**os.environ, **remote_env(CXLKV_PAUSE_AT="kv.evict:1")})
            wait_for(lambda: psutil.Process(p.pid).status() == psutil.STATUS_STOPPED,
                     what="the evictor to stop inside its frees")
            owner.close()                          # takes the lock once the evictor is fenced
            os.kill(p.pid, signal.SIGCONT)
            out, _ = p.communicate(timeout=60)
            assert out.strip() in ("NodeFenced", "LockLost"), out
            wait_for(lambda: not [n for n in nodes.read_nodes(watcher) if n.state == "fenced"],
                     timeout=30, what="the evictor's quarantine to end")
            kv = watcher.kv(model="m", block_tokens=4, block_bytes=BB)
            kept = 0
            for s in seqs:
                if kv.match(s):
                    kept += 1
                    with kv.load(s) as views:
                        assert bytes(views[0]) == bytes([s[0] // 1000 + 1]) * BB, s
            assert kept <= len(seqs) - 1                # at least the first victim went
        fsck_clean(pool_path)
    finally:
        if mgr is not None:
            mgr.terminate()
            mgr.wait(30)


RESUMER = r'''
import sys, cxlkv
from cxlkv.kv.area import Area
pool = cxlkv.open_pool(sys.argv[1])
pool.kv(model="m", block_tokens=4, block_bytes=256)
try:
    with pool.lock():
        Area(pool).evict(need_entries=5)
    print("evicted")
except Exception as e:
    print(type(e).__name__)
'''


def test_an_evictor_resumed_inside_a_list_edit_neither_rebuilds_nor_clears_the_lists(
        pool_path, remote_env):
    """Stopped after an edit's freshness check (the fifth unlink) and fenced:
    when it resumes while another node holds the lock with the lists marked
    dirty, the end of its call writes nothing - no rebuild, no clearing of
    the holder's dirty word."""
    init_pool(pool_path, {"size": 16 * MiB, "chunk_size": 64 * 1024, "max_nodes": 8,
                          "lease_ms": 300, "hash_slots": 1 << 12, "sync": "cas"})
    with cxlkv.open_pool(pool_path) as pool:
        kv = pool.kv(model="m", block_tokens=4, block_bytes=BB)
        for s in range(60):                                   # 60 independent leaves
            kv.store([s * 1000 + j for j in range(4)], b"\1" * BB)
        a = Area(pool)
        with pool.lock():
            a.drain_rings()                  # so the evictor's own drain edits nothing
        p = subprocess.Popen([sys.executable, "-c", RESUMER, pool_path], stdout=subprocess.PIPE,
                             text=True, env={**os.environ, **remote_env(CXLKV_PAUSE_AT="kv.lru:5")})
        wait_for(lambda: psutil.Process(p.pid).status() == psutil.STATUS_STOPPED,
                 what="the evictor to stop inside a list edit")
        with pool.lock(timeout=30):                           # granted once it is fenced
            a.evict(need_entries=10)
            lists_clean(pool)
        with pool.lock(timeout=30):
            a.set_hdr(lru_dirty=1)                            # as if mid-edit
            rebuilds = a.header().lru_rebuilds
            os.kill(p.pid, signal.SIGCONT)
            out, _ = p.communicate(timeout=60)
            h = a.header()
            assert (h.lru_dirty, h.lru_rebuilds) == (1, rebuilds)
            assert out.strip() in ("NodeFenced", "LockLost"), out
            a.m.kv_lru_rebuild()             # what a holder finding the word set does
            lists_clean(pool)
        wait_for(lambda: not [n for n in nodes.read_nodes(pool) if n.state == "fenced"],
                 timeout=30, what="the evictor's quarantine to end")
    fsck_clean(pool_path)


def test_evict_hashes_takes_one_unpinned_leaf(pool_path):
    """KVCache.evict_hashes: the chain's last block, only when it is a leaf no
    reader pins; absent, a parent or pinned: 0, nothing evicted."""
    make(pool_path, slots=1 << 12, size=16 * MiB)
    with cxlkv.open_pool(pool_path) as pool:
        kv = pool.kv(model="m", block_tokens=4, block_bytes=BB)
        chain = [bytes([i]) * 16 for i in range(1, 4)]
        assert kv.store_hashes(chain, b"\1" * (3 * BB)) == 3
        a = Area(pool)
        assert kv.evict_hashes([b"\x09" * 16]) == 0               # absent
        assert kv.evict_hashes(chain[:2]) == 0                     # a parent
        with kv.load_hashes(chain):                                # pinned
            assert kv.evict_hashes(chain) == 0
        assert a.header().live == 3
        assert kv.evict_hashes(chain) == 1
        assert a.header().live == 2 and kv.match_hashes(chain) == 2
        assert len(a.victims()) == 2                               # the rest, leaf first
        lists_clean(pool)
    fsck_clean(pool_path)


def test_a_refused_free_is_logged_not_written_to_stderr(pool_path, caplog, capfd,
                                                         monkeypatch):
    """A victim whose slot the allocator refuses (freed behind the cache's
    back) still leaves the table; the C core hands the failure back and the
    library logs it (no write to stderr of its own)."""
    # the handler the CLI installs on "cxlkv" (once a process: an earlier
    # test's cxlkv command) would print the log lines: only caplog's here
    monkeypatch.setattr(logging.getLogger("cxlkv"), "handlers", [])
    make(pool_path, slots=1 << 12, size=16 * MiB)
    with cxlkv.open_pool(pool_path) as pool:
        kv = pool.kv(model="m", block_tokens=4, block_bytes=BB)
        kv.store([1, 2, 3, 4], b"\1" * BB)
        found, _idx, _ctl, pay = kv._lookup(kv._keys([1, 2, 3, 4]))
        assert found == 1
        pool.free(int(pay[0]))                           # the damage: a double free to come
        capfd.readouterr()
        with caplog.at_level("WARNING", logger="cxlkv.kv.area"):
            assert kv.evict_hashes(kv.block_hashes([1, 2, 3, 4])) == 1
        assert kv.match([1, 2, 3, 4]) == 0
        assert any("free failed" in r.getMessage() for r in caplog.records), caplog.text
        assert capfd.readouterr().err == ""
