"""kill -9 at deterministic points (CXLKV_CRASH_AT=site:N) inside the lock,
mid-allocation, mid-free and mid-slab-release; then recovery leaves a pool
that fsck calls clean, every published payload intact and nothing leaked."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import xxhash

import cxlkv
from cxlkv.pool import layout
from cxlkv.ops.init import init_pool
from cxlkv.api import Pool
from cxlkv.state import alloc
from cxlkv.ops.fsck import check

MiB = 1 << 20
MAGIC = b"CRASHTST"

WORKLOAD = r'''
import sys, numpy as np, xxhash, cxlkv
from cxlkv.state.alloc import PoolFullError
MAGIC = b"CRASHTST"
pool = cxlkv.open_pool(sys.argv[1])
m = pool.mapping
kept = []
def payload(o, n):
    body = np.full(n - 24, o % 251, dtype=np.uint8).tobytes()
    return MAGIC + n.to_bytes(8, "little") + xxhash.xxh64(body).digest() + body
for rnd in range(3):
    for size, count in ((4096, 1500), (300_000, 20), (3 << 20, 3)):
        offs = []
        try:
            for _ in range(count):
                offs.append(pool.alloc(size, zero=False))
        except PoolFullError:
            pass
        for o in offs:
            m.write(o, payload(o, size))
        pub = offs[::2]
        if pub:
            pool.publish(pub)
        keep = pub[:1]
        drop = [o for o in offs if o not in keep]
        for i, o in enumerate(drop):
            pool.free(o, zero=bool(i % 2))
        with pool.lock():
            v = m.load64(int(sys.argv[2]))
            m.store64(int(sys.argv[2]), v + 1)
pool.close()
'''

SITES = ["alloc.bit", "free.zeroed", "free.pub", "slab.head", "slab.tails",
         "release.releasing", "release.tails", "release.head", "lock.held"]


@pytest.fixture
def crash_pool(pool_path):
    init_pool(pool_path, {"size": 16 * MiB, "chunk_size": 1 * MiB, "max_nodes": 8,
                          "lease_ms": 300})
    with cxlkv.open_pool(pool_path) as pool:       # a counter word for the lock workload
        counter = pool.alloc(64)
        pool.mapping.write(counter, MAGIC + (64).to_bytes(8, "little")
                           + xxhash.xxh64(bytes(40)).digest() + bytes(40))
        pool.publish(counter)
    return pool_path, counter


def published_slots(pool):
    data_off, chunk, _, _ = alloc.geometry(pool)
    d = alloc.descriptors(pool)
    try:
        out, reserved = [], 0
        for head in np.flatnonzero((d["control"] & 0xFF) == layout.CHUNK_HEAD):
            ss, ns = int(d["slot_size"][head]), int(d["nslots"][head])
            a = [int(x) for x in d["alloc_bits"][head]]
            p = [int(x) for x in d["pub_bits"][head]]
            for i in range(ns):
                if (a[i // 64] >> (i % 64)) & 1:
                    if (p[i // 64] >> (i % 64)) & 1:
                        out.append((data_off + int(head) * chunk + i * ss, ss))
                    else:
                        reserved += 1
        return out, reserved
    finally:
        del d


def run_workload(path, counter, crash_at):
    env = {**os.environ, "CXLKV_CRASH_AT": crash_at} if crash_at else dict(os.environ)
    r = subprocess.run([sys.executable, "-c", WORKLOAD, path, str(counter + 56)], env=env,
                       capture_output=True, text=True, timeout=120)
    return r


def verify_and_drain(path, counter):
    with cxlkv.open_pool(path) as pool:               # attaching reaps the dead node
        rep = check(pool)
        # our own node is attached now: its token is live
        assert rep.clean, [f.to_json() for f in rep.errors]
        slots, reserved = published_slots(pool)
        assert reserved == 0, "unpublished slots survived recovery"
        for off, ss in slots:
            head = pool.mapping.read(off, 24)
            assert head[:8] == MAGIC, f"published slot {off} lost its payload"
            n = int.from_bytes(head[8:16], "little")
            if off != counter:           # the counter slot's body is the lock counter
                assert n <= ss
                assert xxhash.xxh64(pool.mapping.read(off + 24, n - 24)).digest() == head[16:]
        pool.free_batch([o for o, _ in slots])
    with Pool.open(path) as p:
        rep = check(p)
        assert rep.clean, [f.to_json() for f in rep.errors]
        assert rep.stats["allocator"]["chunks_used"] == 0        # zero leaked bytes
        assert rep.stats["nodes"] == {"free": 8}


def test_workload_runs_clean_without_crashes(crash_pool):
    path, counter = crash_pool
    r = run_workload(path, counter, None)
    assert r.returncode == 0, r.stderr
    with Pool.open(path) as p:
        assert p.mapping.load64(counter + 56) == 3 * 3
    verify_and_drain(path, counter)


@pytest.mark.parametrize("site", SITES)
@pytest.mark.parametrize("nth", [1, 4])
def test_kill_at_crash_point(crash_pool, site, nth):
    path, counter = crash_pool
    r = run_workload(path, counter, f"{site}:{nth}")
    assert r.returncode in (-9, 0), r.stderr
    if r.returncode == 0 and nth == 1:
        pytest.fail(f"the workload never passed {site}")
    verify_and_drain(path, counter)


def test_crash_points_are_off_by_default():
    from cxlkv import _core

    assert not _core.CRASH_ENABLED
    _core.crashpoint("lock.held")          # a no-op: we are still here


@pytest.mark.parametrize("site", ["free.pub", "free.zeroed"])
def test_killed_freeing_another_nodes_slot(pool_path, site):
    """The free a dead node began in a live node's slab is finished by recovery."""
    init_pool(pool_path, {"size": 16 * MiB, "chunk_size": 1 * MiB, "max_nodes": 8,
                          "lease_ms": 300})
    with cxlkv.open_pool(pool_path) as owner:
        off = owner.alloc(4096)
        owner.mapping.write(off, b"x" * 4096)
        owner.publish(off)
        r = subprocess.run([sys.executable, "-c", "import sys, cxlkv; "
                            "p = cxlkv.open_pool(sys.argv[1]); p.free(int(sys.argv[2]))",
                            pool_path, str(off)], timeout=60, capture_output=True, text=True,
                           env={**os.environ, "CXLKV_CRASH_AT": f"{site}:1"})
        assert r.returncode == -9, r.stderr
        owner.node._reap_dead()                   # what the heartbeat thread does
        rep = check(owner)
        assert rep.clean, [f.to_json() for f in rep.errors]
        assert published_slots(owner) == ([], 0)  # the slot is free, not leaked
        assert owner.mapping.read(off, 4096) == bytes(4096)


def test_dead_holder_half_made_slab_does_not_hurt_the_next_holder(pool_path):
    """D dies holding the lock with a 3-chunk slab half made (head, no tails);
    the next holder W must not make its slab inside D's span, and D's recovery
    must not release anything of W's (found in review)."""
    init_pool(pool_path, {"size": 16 * MiB, "chunk_size": MiB, "max_nodes": 8,
                          "lease_ms": 300})
    with cxlkv.open_pool(pool_path) as w:
        w.node.interval = 0.02
        d = subprocess.run([sys.executable, "-c", "import sys, cxlkv\n"
                            "from cxlkv.state import alloc\n"
                            "p = cxlkv.open_pool(sys.argv[1])\n"
                            "with p.lock():\n"
                            "    p.allocator._new_slab(alloc.descriptors(p),\n"
                            "                          alloc.slot_size_for(p, 3 << 20))\n",
                            pool_path], env={**os.environ, "CXLKV_CRASH_AT": "slab.head:1"},
                           capture_output=True, text=True, timeout=60)
        assert d.returncode == -9, d.stderr
        off = w.alloc(2 * MiB)                       # the next holder makes its slab
        w.mapping.write(off, b"W" * (2 * MiB))
        w.publish(off)
        w.node._reap_dead()                          # D's recovery
        assert check(w).clean
        others = [w.alloc(MiB) for _ in range(3)]
        for o in others:
            w.mapping.write(o, b"x" * MiB)
        assert w.mapping.read(off, 2 * MiB) == b"W" * (2 * MiB)
        w.free_batch(others + [off])
