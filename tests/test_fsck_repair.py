"""cxlkv fsck --repair: each specific kind of damage (written byte by byte, or
left by kill -9) is found, repaired (exit 1), and the pool checks clean (exit 0)
with its published data intact."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import cxlkv
from cxlkv.api import Pool
from cxlkv.ops.init import init_pool
from cxlkv.pool import layout
from cxlkv.state import alloc, locks, nodes, protocol
from cxlkv.testing.checks import codes, fsck
from cxlkv.testing.damage import damage, desc_off, fake_node, patch_bytes
from cxlkv.testing.data import pattern
from cxlkv.testing.nodes import NodeProc

MiB = 1 << 20
BLOCK = 4096
NS = dict(model="m", block_tokens=4, block_bytes=BLOCK)


@pytest.fixture
def kv_pool(pool_path):
    """Published allocator slots and KV chains (two of 4 blocks sharing 2), nobody attached."""
    init_pool(pool_path, {"size": 16 * MiB, "chunk_size": 256 * 1024, "max_nodes": 8,
                          "lease_ms": 300, "hash_slots": 256})
    with cxlkv.open_pool(pool_path) as pool:
        offs = pool.alloc_batch(8192, 12)
        for o in offs.tolist():
            pool.mapping.write(o, b"P" * 8192)
        pool.publish(offs)
        kv = pool.kv(**NS)
        for toks in (list(range(16)), list(range(8)) + list(range(100, 108))):
            kv.store(toks, b"".join(pattern(kv, toks)))
    return pool_path


def repaired_codes(doc):
    return {a["code"] for a in doc["repairs"]}


def check_repairs(cli, path, expect):
    """fsck finds `expect`, --repair fixes it (1), fsck is clean (0)."""
    rc, doc = fsck(cli, path)
    assert rc == 4 and expect in codes(doc), doc
    rc, doc = fsck(cli, path, "--repair")
    assert rc == 1, doc
    assert doc["after"]["clean"], doc["after"]["findings"]
    assert expect in repaired_codes(doc) | codes(doc["before"]), doc
    rc, doc2 = fsck(cli, path)
    assert rc == 0, doc2
    rc, doc3 = fsck(cli, path, "--repair")            # nothing left to do
    assert rc == 0 and doc3["repairs"] == [], doc3
    return doc


def kv_intact(path, *chains):
    """The chains that survived read back exactly; returns how many blocks matched."""
    with cxlkv.open_pool(path) as pool:
        kv = pool.kv(**NS)
        total = 0
        for toks in chains:
            n = kv.match(toks) // 4
            if n:
                want = pattern(kv, toks)
                with kv.load(toks[:4 * n]) as views:
                    assert [bytes(v) for v in views] == want[:n]
            total += n
        return total


CHAINS = (list(range(16)), list(range(8)) + list(range(100, 108)))


def heads(p):
    d = alloc.descriptors(p)
    h = [int(i) for i in np.flatnonzero((d["control"] & 0xFF) == layout.CHUNK_HEAD)]
    del d
    return h


def plain_head(p):
    """The head of the slab of 8192-byte (non-KV) slots."""
    d = alloc.descriptors(p)
    h = [i for i in heads(p) if int(d["slot_size"][i]) == 8192][0]
    del d
    return h


def entries(p):
    from cxlkv.kv.area import Area

    a = Area(p)
    t = a.entries()
    live = np.flatnonzero((t["ctl"] & 0xFF) == layout.KV_PUBLISHED)
    return a, t, [int(i) for i in live]


def leaf(p):
    """A published entry with no children."""
    a, t, live = entries(p)
    return a, t, [i for i in live if int(t["children"][i]) == 0][0]


def set_entry_word(p, i, field, value):
    from cxlkv.kv.area import Area

    a = Area(p)
    off = a.entry_off(i) + layout.field_offset(layout.HashEntryStruct, field)
    p.mapping.store64(off, value)


ALLOC_DAMAGE = [
    ("chunk-leaked", lambda p: alloc.set_bits(p, p.sb.nchunks - 1, 1, True)),
    ("slab-dirty", lambda p: p.mapping.store64(desc_off(p, plain_head(p)) + 192, 1)),
    ("slab-pub", lambda p: p.mapping.store64(desc_off(p, plain_head(p)) + 128 + 56, 1)),
    ("slab-bits", lambda p: p.mapping.store64(desc_off(p, plain_head(p)) + 64 + 56, 1 << 63)),
    ("slab-bitmap", lambda p: alloc.set_bits(p, plain_head(p), 1, False)),
    ("slab-geometry", lambda p: p.mapping.store64(desc_off(p, plain_head(p)) + 16, 100)),
    ("slab-dead-owner", lambda p: p.mapping.store64(desc_off(p, plain_head(p)) + 8, 0x30005)),
    ("lock-owner", lambda p: p.mapping.store64(locks.lock_offsets(p)[0] + 72, 0x10002)),
    ("lock-tickets", lambda p: p.mapping.store64(locks.lock_offsets(p)[0] + 64, 10**6)),
    ("lock-entry-dead", lambda p: p.mapping.store64(locks.entry_offset(p, 3), layout.LOCK_LOCKED)),
    ("node-state", lambda p: p.mapping.store64(nodes.node_offset(p, 5), 0x3F7)),
    ("chunk-orphan-tail", lambda p: p.mapping.store64(desc_off(p, p.sb.nchunks - 2),
                                                      layout.CHUNK_TAIL | (p.sb.nchunks - 3) << 8)),
]


@pytest.mark.parametrize("code,fn", ALLOC_DAMAGE, ids=[c for c, _ in ALLOC_DAMAGE])
def test_state_damage_is_repaired(cli, kv_pool, code, fn):
    damage(kv_pool, fn)
    check_repairs(cli, kv_pool, code)
    assert kv_intact(kv_pool, *CHAINS) == 8            # both chains, whole


def test_bad_superblock_copy_is_rewritten_from_the_good_one(cli, kv_pool):
    patch_bytes(kv_pool, 4096 + 100, b"\xff")
    doc = check_repairs(cli, kv_pool, "superblock-copy")
    assert "superblock-copy" in repaired_codes(doc)
    with open(kv_pool, "rb") as f:
        a, b = f.read(4096), f.read(4096)
    assert a == b


def _free_slot(p):
    """An offset in the data area that is no allocated slot."""
    data_off, chunk, nchunks, _ = alloc.geometry(p)
    return data_off + (nchunks - 1) * chunk


def _share_payload(p):
    a, t, live = entries(p)
    i, other = [j for j in live if int(t["children"][j]) == 0]     # the two chains' leaves
    set_entry_word(p, i, "payload", int(t["payload"][other]))


def _entry_field(p, field, value_of):
    a, t, i = leaf(p)
    p.mapping.store64(a.entry_off(i) + layout.field_offset(layout.HashEntryStruct, field),
                      value_of(t, i))


KV_DAMAGE = [
    # an entry pointing at a free block
    ("kv-payload", lambda p: set_entry_word(p, leaf(p)[2], "payload", _free_slot(p))),
    # two entries sharing one payload
    ("kv-shared-payload", _share_payload),
    ("kv-entry-state", lambda p: _entry_field(p, "ctl", lambda t, i: (int(t["ctl"][i]) & ~0xFF)
                                              | 0x77)),
    # the length word holds length, namespace and tenant: namespace 9 is not in use
    ("kv-namespace", lambda p: _entry_field(p, "length", lambda t, i: BLOCK | 9 << 32)),
    ("kv-length", lambda p: _entry_field(p, "length", lambda t, i: 4032)),
    # the parent word holds parent and child count
    ("kv-children", lambda p: _entry_field(p, "parent", lambda t, i: int(t["parent"][i])
                                           | 7 << 32)),
    ("kv-counters", lambda p: p.mapping.store64(
        entries(p)[0].hdr + layout.field_offset(layout.KVHdrStruct, "live"), 99)),
    # refcounts of a node that is gone: a pin in a free slot's pin table
    ("kv-dead-pins", lambda p: p.mapping.store64(entries(p)[0].pins_off(6), leaf(p)[2] + 1)),
]


@pytest.mark.parametrize("code,fn", KV_DAMAGE, ids=[c for c, _ in KV_DAMAGE])
def test_kv_damage_is_repaired(cli, kv_pool, code, fn):
    damage(kv_pool, fn)
    doc = check_repairs(cli, kv_pool, code)
    whole = code in ("kv-counters", "kv-dead-pins", "kv-children")
    # what was dropped is exactly the damaged leaf (both leaves for a shared payload)
    want = 8 if whole else 6 if code == "kv-shared-payload" else 7
    assert kv_intact(kv_pool, *CHAINS) == want, doc["repairs"]


def test_live_block_whose_free_has_begun(cli, kv_pool):
    """A published block whose slot a free has marked (begun, not finished:
    its bytes may be zeroed already): fsck names the slab and the entry;
    the repair finishes the free and drops exactly that entry."""
    def mark(p):
        a, t, i = leaf(p)
        p.mapping.slab_mark_freeing(np.array([int(t["payload"][i])], dtype=np.uint64))
        return int(t["payload"][i])

    off = damage(kv_pool, mark)
    rc, doc = fsck(cli, kv_pool)
    assert rc == 4 and {"slab-dirty", "kv-payload"} <= codes(doc), doc
    assert any(f"{off:#x}" in f["message"] and "free has begun" in f["message"]
               for f in doc["findings"] if f["code"] == "kv-payload"), doc["findings"]
    doc = check_repairs(cli, kv_pool, "kv-payload")
    assert {"slab-dirty", "kv-payload"} <= repaired_codes(doc), doc["repairs"]
    with Pool.open(kv_pool, writable=False) as p:
        assert alloc.slot_bits(p, off) == (False, False, False)
    assert kv_intact(kv_pool, *CHAINS) == 7


def test_entry_pointing_at_a_foreign_block(cli, kv_pool):
    """An entry whose payload is a live node's reservation: the entry goes
    (with --live, under the pool lock), the reservation stays the node's."""
    q = NodeProc()
    try:
        q.attach(kv_pool)
        foreign = q.call(op="alloc_publish", nbytes=BLOCK, reserved=1,
                         published=0)["reserved"][0]
        damage(kv_pool, lambda p: set_entry_word(p, leaf(p)[2], "payload", foreign))
        rc, doc = fsck(cli, kv_pool)
        assert rc == 4 and "kv-payload" in codes(doc)
        rc, doc = fsck(cli, kv_pool, "--repair", "--live")
        assert rc == 1 and doc["after"]["clean"], doc
        with Pool.open(kv_pool, writable=False) as p:
            assert alloc.slot_bits(p, foreign) == (True, False, False)     # still reserved
        r = q.call(op="free_all", offsets=[foreign])
        assert r == {"freed": 1}, r
    finally:
        q.close()
    assert fsck(cli, kv_pool)[0] == 0
    assert kv_intact(kv_pool, *CHAINS) == 7


def test_repair_refuses_live_nodes_unless_forced(cli, kv_pool):
    damage(kv_pool, lambda p: alloc.set_bits(p, p.sb.nchunks - 1, 1, True))
    q = NodeProc()
    try:
        q.attach(kv_pool)
        r = cli("fsck", "--pool", kv_pool, "--repair")
        assert r.code == 8
        assert f"node {q.slot}" in r.err and "live node" in r.err and "--live" in r.err
        r = cli("fsck", "--pool", kv_pool, "--repair", "--json")
        assert r.code == 8 and r.json()["error"]["kind"] == "live-nodes"
        assert [n["slot"] for n in r.json()["error"]["nodes"]] == [q.slot]
        rc, doc = fsck(cli, kv_pool, "--repair", "--live")
        assert rc == 1 and doc["attached"], doc
        assert doc["after"]["clean"], doc["after"]
        # the live node was left alone and still works
        assert q.call(op="alloc_publish", nbytes=4096, reserved=0, published=1)["published"]
    finally:
        q.close()
    assert fsck(cli, kv_pool)[0] == 0


KV_WORK = r'''
import sys, numpy as np, cxlkv
pool = cxlkv.open_pool(sys.argv[1])
kv = pool.kv(model="w", block_tokens=4, block_bytes=4096)
res = pool.alloc_batch(4096, 5)              # reservations that die with us
def blocks(toks):
    return b"".join(h * (4096 // len(h)) for h in kv.block_hashes(toks))
for i in range(30):
    toks = list(range(i % 5 * 4)) + [1000 + i] * 8
    kv.store(toks, blocks(toks))
    with kv.load(toks[:8]) as views:
        pass
held = kv.load(list(range(16)))              # pins that die with us
held.views()
print("stored", held.blocks, flush=True)
sys.stdin.read()                             # until killed
'''


@pytest.mark.parametrize("site", [None, "kv.copied:3", "kv.insert:5", "lock.held:7"])
def test_kill_9_during_kv_work_is_repaired(cli, kv_pool, site):
    """A writer killed (after storing, with pins and reservations held; or at
    a crash point inside a store or the lock) leaves a dead node; fsck finds
    it, --repair reclaims everything it held, the published data survives."""
    env = {**os.environ}
    if site:
        env["CXLKV_CRASH_AT"] = site
    p = subprocess.Popen([sys.executable, "-c", KV_WORK, kv_pool], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    if site is None:
        line = p.stdout.readline()
        assert line.startswith("stored"), p.stderr.read()
        p.kill()
    assert p.wait(60) == -9, p.stderr.read()
    rc, doc = fsck(cli, kv_pool)
    assert rc == 4 and "node-dead" in codes(doc), doc
    if site is None:
        assert "slab-dead-owner" in codes(doc)
    rc, doc = fsck(cli, kv_pool, "--repair")
    assert rc == 1 and doc["after"]["clean"], doc
    assert "node-reaped" in repaired_codes(doc)
    assert fsck(cli, kv_pool)[0] == 0
    assert kv_intact(kv_pool, *CHAINS) == 8
    with Pool.open(kv_pool, writable=False) as pool:     # nothing of the dead node is left
        assert nodes.read_nodes(pool) == []
        d = alloc.descriptors(pool)
        owners = set(int(o) for o in d["owner"][(d["control"] & 0xFF) == layout.CHUNK_HEAD])
        del d
        assert owners <= {0}


# -- review findings: attaching is not a repair; liveness judged once, acted on safely ---------

OTHER_BOOT = "12345678-1234-5678-1234-567812345678"


def test_forced_repair_of_a_clean_pool_exits_0(cli, kv_pool):
    """Attaching to repair under the pool lock is not an error corrected."""
    q = NodeProc()
    try:
        q.attach(kv_pool)
        assert fsck(cli, kv_pool)[0] == 0
        rc, doc = fsck(cli, kv_pool, "--repair", "--live")
        assert rc == 0, doc
        assert doc["repairs"] == [] and doc["attached"] is True, doc
        r = cli("fsck", "--pool", kv_pool, "--repair", "--live")
        assert r.code == 0 and "repair(s) made" not in r.out, r.out
    finally:
        q.close()


def _remote_node(path, slot=3):
    fake_node(path, slot, pid=1, start_time_ns=1, boot_id=OTHER_BOOT, hostname="elsewhere")


def test_node_attaching_while_liveness_is_watched_is_never_fenced(kv_pool):
    """A node attaching while repair watches another host's node (up to a
    lease) is not in the judged set: the offline repair stops (operational
    error naming it) before touching anything, and the node keeps working."""
    from cxlkv.ops import repair

    _remote_node(kv_pool)
    q = NodeProc()
    try:
        def notice(count, seconds):
            q.attach(kv_pool)                 # while the repair watches node 3

        with pytest.raises(repair.PoolChanged) as ei:
            repair.repair(kv_pool, notice=notice)
        assert f"node {q.slot}" in str(ei.value) and "attached" in str(ei.value)
        assert ei.value.exit_code == 8
        r = q.call(op="alloc_publish", nbytes=4096, reserved=0, published=1)
        assert r.get("published"), r
        with Pool.open(kv_pool, writable=False) as p:         # no placeholders left
            slots = {n.slot for n in nodes.read_nodes(p)}         # (q's reaper may reap 3)
            assert q.slot in slots and slots <= {3, q.slot}, slots
        # with --live the newcomer is left alone and the dead node is reaped
        # (by the repair, or by q's own reaper, which watches it too)
        with Pool.open(kv_pool, writable=False) as p:
            free = [n.slot for n in nodes.read_nodes(p, include_free=True) if n.state == "free"]
        _remote_node(kv_pool, slot=[f for f in free if f != 3][0])
        q2 = NodeProc()
        try:
            rep = repair.repair(kv_pool, force=True, notice=lambda c, s: q2.attach(kv_pool))
            assert rep.exit_code in (0, 1) and rep.after.clean, rep.to_json()
            reaped = {a["where"] for a in rep.actions if a["code"] == "node-reaped"}
            assert f"node {q.slot}" not in reaped and f"node {q2.slot}" not in reaped
            with Pool.open(kv_pool, writable=False) as p:
                assert sorted(n.slot for n in nodes.read_nodes(p)) == sorted([q.slot, q2.slot])
            for node in (q, q2):
                r = node.call(op="alloc_publish", nbytes=4096, reserved=0, published=1)
                assert r.get("published"), r
        finally:
            q2.close()
    finally:
        q.close()


def test_offline_repair_blocks_attaches_while_it_runs(cli, kv_pool, monkeypatch):
    """While an offline repair works, a process that tries to attach finds the
    node table full; afterwards it attaches normally and nothing is left."""
    from cxlkv.ops import repair

    damage(kv_pool, lambda p: alloc.set_bits(p, p.sb.nchunks - 1, 1, True))
    q = NodeProc()
    seen = {}
    real = repair.Repair.did

    def during(rep, *args):                 # the first fix: attaches are blocked by then
        if "attach" not in seen:
            seen["attach"] = q.call(op="attach", path=kv_pool)
        real(rep, *args)

    monkeypatch.setattr(repair.Repair, "did", during)
    try:
        rc, doc = fsck(cli, kv_pool, "--repair")
        assert rc == 1 and doc["after"]["clean"], doc
        assert seen["attach"].get("error") == "NodeTableFull", seen
        with Pool.open(kv_pool, writable=False) as p:
            assert nodes.read_nodes(p) == []
        q.attach(kv_pool)
    finally:
        q.close()
    assert fsck(cli, kv_pool)[0] == 0


def test_undecided_nodes_count_as_alive(kv_pool):
    """A node still not judged when the watch ends is never treated as dead."""
    from cxlkv.ops import repair

    _remote_node(kv_pool)
    ticks = iter([0.0, 0.0, 0.1, 0.1] + [100.0] * 10)
    with Pool.open(kv_pool, writable=False) as p:
        judged = repair.judge_nodes(p, clock=lambda: next(ticks), sleep=lambda s: None)
    assert judged[3][1] == "undecided"


def _duplicate_with_payload(p, payload):
    """Copy a published leaf entry into the empty slot after it, with its own payload."""
    a, t, live = entries(p)
    st = t["ctl"] & 0xFF
    n = a.nslots
    i = next(i for i in live if st[(i + 1) % n] == layout.KV_EMPTY and int(t["children"][i]) == 0)
    raw = bytearray(p.mapping.read(a.entry_off(i), layout.HASH_ENTRY_SIZE))
    off = layout.field_offset(layout.HashEntryStruct, "payload")
    raw[off:off + 8] = payload.to_bytes(8, "little")
    p.mapping.write(a.entry_off((i + 1) % n), bytes(raw))
    return i


def test_duplicate_key_entry_payload_is_freed_not_leaked(cli, kv_pool):
    """A key stored twice with two payloads: the farther entry is dropped and
    its payload - a published KV-sized block only it referred to - freed."""
    with cxlkv.open_pool(kv_pool) as pool:
        extra = int(pool.alloc(BLOCK))
        pool.publish([extra])
    damage(kv_pool, lambda p: _duplicate_with_payload(p, extra))
    doc = check_repairs(cli, kv_pool, "kv-duplicate-key")
    dup = [r for r in doc["repairs"] if r["code"] == "kv-duplicate-key"]
    assert dup and "payload slot freed" in dup[0]["message"], doc["repairs"]
    with Pool.open(kv_pool, writable=False) as p:
        assert alloc.slot_bits(p, extra) == (False, False, False)
    assert kv_intact(kv_pool, *CHAINS) == 8


def test_duplicate_key_sharing_a_payload_keeps_nothing_dangling(cli, kv_pool):
    """A duplicate pointing at another entry's payload is not freed on its own
    account (the shared-payload rule drops both and frees it once)."""
    def dup_shared(p):
        a, t, live = entries(p)
        i = _duplicate_with_payload(p, 0)
        set_entry_word(p, (i + 1) % a.nslots, "payload", int(t["payload"][i]))

    damage(kv_pool, dup_shared)
    rc, doc = fsck(cli, kv_pool, "--repair")
    assert rc == 1 and doc["after"]["clean"], doc
    assert fsck(cli, kv_pool)[0] == 0


def test_fsck_usage_error_is_16_as_e2fsck(cli, kv_pool):
    """e2fsck's 2 means "corrected, reboot": a usage error is 16."""
    r = cli("fsck", "--pool", kv_pool, "--no-such-flag")
    assert r.code == 16 and "no such option" in r.err.lower(), r.err
    r = cli("fsck", "--pool", kv_pool, "--bogus", "--json")
    assert r.code == 16 and r.json()["error"]["kind"] == "usage"
    r = cli("fsck", "--help")
    assert r.code == 0 and "16" in r.out


def test_repair_ends_a_quarantine_the_reaper_never_ended(cli, kv_pool):
    """No reaper ran since a node was fenced: --repair recovers and frees it."""
    damage(kv_pool, lambda p: p.mapping.store64(nodes.node_offset(p, 2),
                                                layout.node_control(layout.NODE_FENCED, 4)))
    rc, doc = fsck(cli, kv_pool)
    assert rc == 0 and any(f["code"] == "node-quarantined" for f in doc["findings"]), doc
    rc, doc = fsck(cli, kv_pool, "--repair")
    assert rc == 1 and "node-reaped" in repaired_codes(doc), doc
    rc, doc = fsck(cli, kv_pool)
    assert rc == 0 and not doc["findings"], doc
    assert kv_intact(kv_pool, *CHAINS) == 8


def test_repair_reaps_a_node_fenced_recovering_another_before_that_one(cli, kv_pool):
    """Two fenced nodes, slot 3 fenced while it was recovering slot 1 (its
    lock entry says so): slot 1's recovery waits for slot 3's, so the repair
    takes slot 3 first and then reaps slot 1 as well, in one run."""
    def fence_two(p):
        for slot in (1, 3):
            p.mapping.store64(nodes.node_offset(p, slot), layout.node_control(layout.NODE_FENCED, 4))
        protocol.mark_held_when_fenced(p, 3, 4 | 4 << 16)
        protocol.mark_recovering(p, 3, 2 | 4 << 16)
        assert [n.slot for n in nodes.recovered_by_fenced(p, 1, 4)] == [3]
        assert nodes.recovered_by_fenced(p, 3, 4) == []
    damage(kv_pool, fence_two)
    rc, doc = fsck(cli, kv_pool, "--repair")
    assert rc == 1 and [a["where"] for a in doc["repairs"] if a["code"] == "node-reaped"] == \
        ["node 3", "node 1"], doc
    rc, doc = fsck(cli, kv_pool)
    assert rc == 0 and not doc["findings"], doc
    assert kv_intact(kv_pool, *CHAINS) == 8


def test_a_node_the_running_lock_manager_does_not_reap_is_left_and_said(cli, pool_path,
                                                                         monkeypatch):
    """Sync mode manager: a running lock manager owns its nodes' lines, and one
    that does not reap a dead node (a quarantine it ends only after its grace)
    leaves it - --repair says so and exits 4, never "clean"."""
    from cxlkv.state import protocol

    init_pool(pool_path, {"size": 32 << 20, "sync": "manager", "lease_ms": 300})
    # node 2 fenced by the lock manager (its line in the manager's words)
    damage(pool_path, lambda p: protocol.set_mgr(p, 2, layout.node_control(layout.NODE_FENCED, 4),
                                                 0))
    monkeypatch.setattr(protocol, "manager_alive", lambda pool: True)   # one runs, idle
    rc, doc = fsck(cli, pool_path, "--repair")
    assert rc == 4, doc
    assert [x["code"] for x in doc["left"]] == ["node-not-reaped"], doc
    assert "stop the lock managers" in doc["left"][0]["message"]
    r = cli("fsck", "--pool", pool_path, "--repair")
    assert r.code == 4 and "not repaired: node 2" in r.out, r.out
    assert "node 2 (identity not written)" in r.out
    monkeypatch.undo()                                 # no lock manager: fsck reaps itself
    rc, doc = fsck(cli, pool_path, "--repair")
    assert rc == 1 and "node-reaped" in repaired_codes(doc) and not doc["left"], doc
