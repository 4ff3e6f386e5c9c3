"""The change journal: every node appends what it published and
evicted to a ring of its own; a reader sees every record once, in the rack's
order, and falls back to one pass over the table (a resync) when a ring
overran, a record is torn or a slot changed hands.  Node processes stand in
for hosts; sync mode cas, and manager under the non-coherence emulation."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import psutil
import pytest

import cxlkv
from cxlkv.errors import PoolIncompatible
from cxlkv.kv import journal
from cxlkv.kv import keys as block_keys
from cxlkv.kv.area import Area
from cxlkv.pool import layout
from cxlkv.ops.init import init_pool
from cxlkv.api import Pool
from cxlkv.ops import fsck
from cxlkv.state import nodes as node_table

from cxlkv.testing.checks import wait_for
from cxlkv.testing.nodes import NodeProc, lock_manager
from cxlkv.testing.pools import MiB

BB = 16 * 1024
KV_ARGS = {"model": "journal-test", "block_bytes": BB, "block_tokens": 16}
MODES = ["cas", "manager-nc"]


@pytest.fixture(params=MODES)
def rack(request, pool_path, monkeypatch):
    """A pool (8 MiB: stores evict) in one mode; yields (path, env for nodes)."""
    nc = request.param == "manager-nc"
    env = {"CXLKV_NONCOHERENT": "1"} if nc else {}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    init_pool(pool_path, {"size": 8 * MiB, "chunk_size": 256 * 1024, "max_nodes": 8,
                          "sync": "manager" if nc else "cas", "lease_ms": 300,
                          "grace_ms": 900})
    mgr = lock_manager(pool_path) if nc else None
    yield pool_path, env
    if mgr is not None:
        mgr.terminate()
        mgr.wait(10)


def toks(tag: int, blocks: int) -> list[int]:
    return (np.arange(blocks * 16) + tag * 1_000_000).tolist()


def key(rec) -> bytes:
    return int(rec["key_lo"]).to_bytes(8, "little") + int(rec["key_hi"]).to_bytes(8, "little")


def name_of(rec, prefix: str = "") -> bytes:
    return bytes(rec[prefix + "name"][:int(rec[prefix + "name_len"])])


def names_hash_to_keys(recs, model: str = KV_ARGS["model"]) -> None:
    """Every STORED / EVICTED record is named, and its names are the chain
    hashes its keys were made of (unsalted tenant): the block's and, for a
    STORED record with a parent, its parent's - resolved at the poll, so
    unnamed only where the parent was evicted meanwhile."""
    recs = recs[np.isin(recs["op"], [journal.STORED, journal.EVICTED])]
    if not len(recs):
        return
    assert (recs["name_len"] > 0).all(), "an unnamed record"
    digest = block_keys.namespace_digest(model)
    rows = np.stack([np.frombuffer(name_of(r), dtype=np.uint8) for r in recs])
    keys = block_keys.pool_keys(rows, digest, bytes(16))
    assert [bytes(k) for k in keys] == [key(r) for r in recs]
    child = ((recs["parent_lo"] != 0) | (recs["parent_hi"] != 0)) & (recs["op"] == journal.STORED)
    assert (recs["parent_name_len"][recs["op"] == journal.EVICTED] == 0).all()
    child &= recs["parent_name_len"] > 0
    for r in recs[child]:
        k = block_keys.pool_keys(np.frombuffer(name_of(r, "parent_"), dtype=np.uint8)[None],
                                 digest, bytes(16))
        assert bytes(k[0]) == key({"key_lo": r["parent_lo"], "key_hi": r["parent_hi"]})


def published(pool) -> set[bytes]:
    t = Area(pool).entries()
    t = t[(t["ctl"] & 0xFF) == layout.KV_PUBLISHED]
    return {int(a).to_bytes(8, "little") + int(b).to_bytes(8, "little")
            for a, b in zip(t["key_lo"].tolist(), t["key_hi"].tolist())}


class Follower:
    """Applies a reader's records to a set of present keys, checking that
    each change is consistent with what came before (exactly once, in order)."""

    def __init__(self, pool, **kw):
        self.reader = journal.JournalReader(pool, **kw)
        self.present: set[bytes] = set()
        self.seqs: list[int] = []
        self.ops = {journal.STORED: 0, journal.EVICTED: 0, journal.NS_CLEARED: 0}
        self.resyncs: list[tuple[str, ...]] = []

    def poll(self) -> journal.Changes:
        ch = self.reader.poll()
        names_hash_to_keys(ch.records)
        if ch.resync:
            self.resyncs.append(ch.reasons)
            self.present = {key(r) for r in ch.records}
            return ch
        for r in ch.records:
            k, op = key(r), int(r["op"])
            self.ops[op] += 1
            self.seqs.append(int(r["seq"]))
            if op == journal.STORED:
                assert k not in self.present, "stored twice"
                self.present.add(k)
            elif op == journal.EVICTED:
                assert k in self.present, "evicted before stored"
                self.present.discard(k)
        return ch


# -- every change of two nodes, once ------------------------------------------------------
def test_two_nodes_stores_and_evictions_are_seen_exactly_once(rack):
    path, env = rack
    with Pool.open(path) as pool:
        f = Follower(pool)
        assert f.poll().resync and f.resyncs == [("start",)]
        nodes = [NodeProc(env=env) for _ in range(2)]
        for n in nodes:
            n.attach(path)
            assert "ns" in n.call(op="kv_open", args=KV_ARGS)
        stored = 0
        for i in range(60):
            for j, n in enumerate(nodes):
                stored += n.call(op="kv_store", tokens=toks(i * 2 + j, 4))["stored"]
            f.poll()
        f.poll()
        for n in nodes:
            n.close()
        f.poll()
        ev = Area(pool).header().evictions
        assert ev > 0, "the test must evict"
        assert f.resyncs == [("start",)]
        assert f.ops[journal.STORED] == stored and f.ops[journal.EVICTED] == ev
        assert f.seqs == sorted(set(f.seqs))            # one order across both rings
        assert f.present == published(pool)
        rep = journal.report(pool)
        assert rep["appended"] == stored + ev and len(rep["rings"]) == 2


def test_records_carry_the_parent_key_and_the_namespace(pool_path):
    init_pool(pool_path, {"size": 8 * MiB, "chunk_size": 256 * 1024, "max_nodes": 8})
    with cxlkv.open_pool(pool_path) as pool:
        r = journal.JournalReader(pool, start="now")
        kv = pool.kv(**KV_ARGS)
        t = toks(1, 3)
        assert kv.store(t, bytes(3 * BB)) == 3
        recs = r.poll().records
        keys = kv._keys(np.array(t))
        assert [key(x) for x in recs] == [bytes(k) for k in keys]
        assert key({"key_lo": recs["parent_lo"][0], "key_hi": recs["parent_hi"][0]}) == bytes(16)
        assert key({"key_lo": recs["parent_lo"][2],
                    "key_hi": recs["parent_hi"][2]}) == bytes(keys[1])
        assert set(recs["ns"].tolist()) == {kv.ns} and set(recs["length"].tolist()) == {BB}
        assert set(recs["node"].tolist()) == {pool.node.slot}
        from cxlkv.kv.cache import drop_namespace

        drop_namespace(pool, KV_ARGS["model"])
        recs = r.poll().records
        assert recs["op"].tolist() == [journal.EVICTED] * 3 + [journal.NS_CLEARED]
        assert int(recs["ns"][-1]) == kv.ns


# -- overrun, torn records ----------------------------------------------------------------
def test_an_overrun_is_detected_and_resynced(pool_path):
    init_pool(pool_path, {"size": 32 * MiB, "chunk_size": 256 * 1024, "max_nodes": 8})
    with cxlkv.open_pool(pool_path) as pool:
        f = Follower(pool, start="now")
        kv = pool.kv(**KV_ARGS)
        nrec = f.reader.geo.nrec
        for i in range(nrec // 4 + 2):                      # more than a ring, unread
            kv.store(toks(i, 4), bytes(4 * BB))
        ch = f.poll()
        assert ch.resync and ch.reasons == ("overrun",)
        assert f.present == published(pool) and len(f.present) == 4 * (nrec // 4 + 2)
        assert f.reader.stats["resync_overrun"] == 1
        kv.store(toks(4000, 2), bytes(2 * BB))
        ch = f.poll()                                       # and on from there
        assert not ch.resync and len(ch.records) == 2


@pytest.mark.parametrize("how", ["stale", "being-written"])
def test_a_torn_record_is_detected(pool_path, how):
    init_pool(pool_path, {"size": 8 * MiB, "chunk_size": 256 * 1024, "max_nodes": 8})
    with cxlkv.open_pool(pool_path) as pool:
        f = Follower(pool, start="now")
        kv = pool.kv(**KV_ARGS)
        kv.store(toks(1, 2), bytes(2 * BB))
        assert len(f.poll().records) == 2
        # half a record by hand: the head advanced over a record whose fields
        # are half there and whose sequence number is not the next one
        g, m, slot = f.reader.geo, pool.mapping, pool.node.slot
        ring = g.ring_off(slot)
        head = m.load64(ring)
        rec = ring + 64 + (head % g.nrec) * layout.JOURNAL_REC_SIZE
        with pool.lock():
            m.store64(rec + 8, 0x1234)                      # key_lo only
            m.store64(rec, 1 if how == "stale" else 0)      # a sequence number already used / none
            m.store64(ring, head + 1)
        ch = f.poll()
        assert ch.resync and ch.reasons == ("torn",)
        assert f.present == published(pool) and f.reader.stats["resync_torn"] == 1


# -- a node slot used again ---------------------------------------------------------------
def test_a_reused_node_slot_resyncs_once_and_keeps_counting(rack):
    path, env = rack
    with Pool.open(path) as pool:
        f = Follower(pool)
        f.poll()
        a = NodeProc(env=env)
        a.attach(path)
        a.call(op="kv_open", args=KV_ARGS)
        a.call(op="kv_store", tokens=toks(1, 3))
        f.poll()
        head = f.reader.cursors[a.slot]
        assert head == 3 and not f.resyncs[1:]
        a.kill()                                            # dies; its slot is reaped ...
        with cxlkv.open_pool(path) as p2:
            wait_for(lambda: node_table.read_slot(p2, a.slot).state == "free", what="the reap")
        others = []                                         # ... and taken by another node
        while True:                                         # (nodes claim a random free slot)
            b = NodeProc(env=env)
            b.attach(path)
            if b.slot == a.slot:
                break
            others.append(b)
        assert b.epoch != a.epoch
        b.call(op="kv_open", args=KV_ARGS)
        b.call(op="kv_store", tokens=toks(2, 2))
        ch = f.poll()
        assert ch.resync and ch.reasons == ("writer",)
        assert f.reader.cursors[b.slot] == head + 2         # the head went on, not back to 0
        b.call(op="kv_store", tokens=toks(3, 2))
        ch = f.poll()
        assert not ch.resync and len(ch.records) == 2
        assert f.present == published(pool)
        for n in others + [b]:
            n.close()


# -- crashes and stalls -------------------------------------------------------------------
def test_a_node_killed_mid_append_leaves_nothing_torn(pool_path):
    init_pool(pool_path, {"size": 8 * MiB, "chunk_size": 256 * 1024, "max_nodes": 8,
                          "lease_ms": 300})
    with Pool.open(pool_path) as pool:
        f = Follower(pool)
        f.poll()
        w = NodeProc(env={"CXLKV_CRASH_AT": "journal.append:3"})
        w.attach(pool_path)
        w.call(op="kv_open", args=KV_ARGS)
        for i in range(2):
            assert w.call(op="kv_store", tokens=toks(i, 2))["stored"] == 2
        w.send(op="kv_store", tokens=toks(2, 2))            # killed after writing its records
        assert w.p.wait(30) == -9
        ch = f.poll()
        assert not ch.resync and len(ch.records) == 4       # its half append is beyond the head
        assert f.ops[journal.STORED] == 4 and len(published(pool)) == 6
        with cxlkv.open_pool(pool_path) as p2:              # reaps it; the slot is free again
            wait_for(lambda: node_table.read_slot(p2, w.slot).state == "free", what="the reap")
        others = []
        while True:                                         # the slot's next node appends ...
            b = NodeProc()
            b.attach(pool_path)
            if b.slot == w.slot:
                break
            others.append(b)
        b.call(op="kv_open", args=KV_ARGS)
        assert b.call(op="kv_store", tokens=toks(3, 1))["stored"] == 1
        for n in others + [b]:
            n.close()
        ch = f.poll()                                       # ... and the reader resyncs
        assert ch.resync and ch.reasons == ("writer",)
        assert f.present == published(pool) and len(f.present) == 7
    with Pool.open(pool_path) as p:
        rep = fsck.check(p)
    assert rep.clean, [x.to_json() for x in rep.errors]


def test_a_fenced_node_cannot_append_after_it_resumes(pool_path, remote_env):
    init_pool(pool_path, {"size": 8 * MiB, "chunk_size": 256 * 1024, "max_nodes": 8,
                          "lease_ms": 300, "grace_ms": 900})
    with cxlkv.open_pool(pool_path) as pool:
        f = Follower(pool)
        f.poll()
        w = NodeProc(env=remote_env(CXLKV_PAUSE_AT="journal.append:2"))
        w.attach(pool_path)
        w.call(op="kv_open", args=KV_ARGS)
        assert w.call(op="kv_store", tokens=toks(1, 2))["stored"] == 2
        assert len(f.poll().records) == 2
        w.send(op="kv_store", tokens=toks(2, 2))            # stops mid-append, lock held
        wait_for(lambda: psutil.Process(w.p.pid).status() == psutil.STATUS_STOPPED,
                 what="the node to stop in its append")
        wait_for(lambda: node_table.read_slot(pool, w.slot).state == "fenced", what="the fence")
        kv = pool.kv(**KV_ARGS)
        kv.store(toks(3, 2), bytes(2 * BB))                 # the lock was passed on
        os.kill(w.p.pid, signal.SIGCONT)
        r = w.reply()
        assert r.get("error") in ("NodeFenced", "LockLost"), r     # told, and appended nothing
        ring = f.reader.geo.ring_off(w.slot)
        assert pool.mapping.load64(ring) == 2               # its head did not move
        ch = f.poll()
        assert not ch.resync and set(ch.records["node"].tolist()) == {pool.node.slot}
        assert f.ops[journal.STORED] == 4
        w.close()


def test_a_node_stalled_taking_sequence_numbers_never_rolls_them_back(pool_path, remote_env):
    """Stopped between reading next_seq and writing it back, fenced, resumed
    after another node appended: the shared counter keeps the other node's
    value (cas mode: the write is a compare-and-swap), the stalled node is
    told and its ring does not move."""
    init_pool(pool_path, {"size": 8 * MiB, "chunk_size": 256 * 1024, "max_nodes": 8,
                          "lease_ms": 300, "grace_ms": 900})
    with cxlkv.open_pool(pool_path) as pool:
        f = Follower(pool)
        f.poll()
        w = NodeProc(env=remote_env(CXLKV_PAUSE_AT="journal.seq:2"))
        w.attach(pool_path)
        w.call(op="kv_open", args=KV_ARGS)
        assert w.call(op="kv_store", tokens=toks(1, 2))["stored"] == 2
        w.send(op="kv_store", tokens=toks(2, 2))            # stops in its append, lock held
        wait_for(lambda: psutil.Process(w.p.pid).status() == psutil.STATUS_STOPPED,
                 what="the node to stop taking sequence numbers")
        wait_for(lambda: node_table.read_slot(pool, w.slot).state == "fenced", what="the fence")
        kv = pool.kv(**KV_ARGS)
        kv.store(toks(3, 3), bytes(3 * BB))                 # the lock was passed on
        nxt = f.reader.geo.next_seq()
        os.kill(w.p.pid, signal.SIGCONT)
        r = w.reply()
        assert r.get("error") in ("NodeFenced", "LockLost"), r
        assert f.reader.geo.next_seq() == nxt               # not rolled back
        assert pool.mapping.load64(f.reader.geo.ring_off(w.slot)) == 2
        ch = f.poll()
        assert not ch.resync and f.ops[journal.STORED] == 5
        w.close()


# -- old pools ----------------------------------------------------------------------------
def test_a_pool_formatted_without_the_journal_is_refused_by_name(golden_pool):
    path = golden_pool("pool-v1-4m-0.1")
    with Pool.open(str(path)) as p:
        assert not p.sb.incompat & layout.INCOMPAT_JOURNAL
        with pytest.raises(PoolIncompatible, match="without the feature JOURNAL"):
            journal.JournalReader(p)
        assert journal.report(p) is None
    mgr = lock_manager(str(path))                           # the golden pool is in manager mode
    try:
        r = subprocess.run([sys.executable, "-c", f"""
import cxlkv
with cxlkv.open_pool({str(path)!r}) as pool:
    pool.kv(model="m", block_bytes=4096)
"""], capture_output=True, text=True, timeout=60)
    finally:
        mgr.terminate()
        mgr.wait(10)
    assert r.returncode != 0 and "JOURNAL (the change journal)" in r.stderr, r.stderr


# -- fsck ---------------------------------------------------------------------------------
def test_fsck_reports_and_repairs_a_damaged_journal_header(pool_path):
    from cxlkv.ops import repair

    init_pool(pool_path, {"size": 8 * MiB, "chunk_size": 256 * 1024, "max_nodes": 8})
    with cxlkv.open_pool(pool_path) as pool:
        pool.kv(**KV_ARGS).store(toks(1, 3), bytes(3 * BB))
        g = journal.JournalReader(pool, start="now").geo
        hdr = g.hdr
        seq = g.next_seq()
    with Pool.open(pool_path) as p:
        p.mapping.store64(hdr + layout.field_offset(layout.JournalHdrStruct, "next_seq"),
                          2)  # behind
        rep = fsck.check(p)
        assert [f.code for f in rep.errors] == ["kv-journal-seq"]
        p.mapping.store64(hdr, 0)                                                 # magic
        assert [f.code for f in fsck.check(p).errors] == ["kv-journal-header"]
        with pytest.raises(Exception, match="header is corrupt"):
            journal.JournalReader(p)
    rep = repair.repair(pool_path)
    assert "kv-journal-header" in [a["code"] for a in rep.actions]
    with Pool.open(pool_path) as p:
        assert fsck.check(p).clean
        r = journal.JournalReader(p, start="now")
        assert r.geo.next_seq() == seq                     # above every record again


def test_a_restore_records_what_it_publishes(tmp_path):
    from cxlkv.kv import snapshot

    a, b = str(tmp_path / "a.pool"), str(tmp_path / "b.pool")
    for p in (a, b):
        init_pool(p, {"size": 8 * MiB, "chunk_size": 256 * 1024, "max_nodes": 8})
    with cxlkv.open_pool(a) as pool:
        pool.kv(**KV_ARGS).store(toks(1, 5), bytes(5 * BB))
        snapshot.snapshot(pool, tmp_path / "snap")
    with cxlkv.open_pool(b) as pool:
        f = Follower(pool, start="now")
        assert snapshot.restore(pool, tmp_path / "snap")["blocks"] == 5
        ch = f.poll()
        assert not ch.resync and f.ops[journal.STORED] == 5 and f.present == published(pool)


def test_inspect_and_kv_stats_show_the_rings(cli, pool_path):
    init_pool(pool_path, {"size": 8 * MiB, "chunk_size": 256 * 1024, "max_nodes": 8})
    with cxlkv.open_pool(pool_path) as pool:
        pool.kv(**KV_ARGS).store(toks(1, 3), bytes(3 * BB))
        slot = pool.node.slot
    for args in (("inspect", "--pool", pool_path, "--json"),
                 ("kv", "stats", "--pool", pool_path, "--json")):
        r = cli(*args)
        assert r.code == 0, r.err
        doc = r.json()
        j = (doc["pool"] if "pool" in doc and isinstance(doc["pool"],
                                                         dict) else doc)["kv"]["journal"]
        assert j["appended"] == 3 and j["next_seq"] == 4
        assert j["rings"] == [{"slot": slot, "head": 3, "writer_slot": slot, "writer_epoch": 1}]


# -- block names ----------------------------------------------------------------------------
def test_an_eviction_record_keeps_the_name_after_the_entry_is_reused(pool_path):
    """The record of an eviction carries the block's name (copied from the
    entry's name when the record was appended), so a reader that comes later,
    when the entry already names another block, still learns which block went."""
    from cxlkv.kv import names

    init_pool(pool_path, {"size": 8 * MiB, "chunk_size": 256 * 1024, "max_nodes": 8})
    with cxlkv.open_pool(pool_path) as pool:
        r = journal.JournalReader(pool, start="now")
        kv = pool.kv(**KV_ARGS)
        t = toks(3, 4)
        assert kv.store(t, bytes(4 * BB)) == 4
        hashes = kv.block_hashes(t)
        stored = r.poll().records
        assert [name_of(x) for x in stored] == hashes
        assert [name_of(x, "parent_") for x in stored] == [b""] + hashes[:-1]
        # a store chained under blocks of an earlier poll: the parent's name
        # comes from its entry
        t6 = toks(3, 6)
        assert kv.store(t6, bytes(6 * BB)) == 2
        h6 = kv.block_hashes(t6)
        more = r.poll().records
        assert [name_of(x) for x in more] == h6[4:]
        assert [name_of(x, "parent_") for x in more] == h6[3:5]
        with pool.lock():
            assert kv.area.evict(everything=True)[0] == 6
        nm = names.Names.of(pool)
        entries = stored["entry"].astype(np.uint64) - 1
        # the entries now name other blocks (as a store after the eviction
        # would make them): what the table holds no longer names these keys
        other = np.zeros(4, dtype=nm.entry)
        other["key_lo"], other["key_hi"], other["len"] = 7, 7, 16
        nm.write_records(pool.node, entries, other)
        gone = r.poll().records
        assert gone["op"].tolist() == [journal.EVICTED] * 6
        assert sorted(name_of(x) for x in gone) == sorted(h6)
        names_hash_to_keys(gone)


def test_names_of_hashes_the_caller_gives_and_names_too_long_to_keep(pool_path):
    from cxlkv.errors import UsageError
    from cxlkv.kv import names

    init_pool(pool_path, {"size": 8 * MiB, "chunk_size": 256 * 1024, "max_nodes": 8})
    with cxlkv.open_pool(pool_path) as pool:
        r = journal.JournalReader(pool, start="now")
        kv = pool.kv(**KV_ARGS)
        vllm = [bytes([i]) * 32 for i in range(1, 4)]        # vLLM's 32-byte block hashes
        assert kv.store_hashes(vllm, bytes(3 * BB)) == 3
        recs = r.poll().records
        assert [name_of(x) for x in recs] == vllm
        assert [name_of(x, "parent_") for x in recs] == [b""] + vllm[:-1]
        long = [bytes([i]) * 48 for i in range(1, 3)]        # more than a name record holds
        assert kv.store_hashes(long, bytes(2 * BB)) == 2
        recs = r.poll().records
        assert recs["name_len"].tolist() == [0, 0]           # unnamed: published by pool key
        assert [key(x) for x in recs] == [bytes(k) for k in kv.keys_for_hashes(long)]
        nm = names.Names.of(pool)
        given = np.arange(3 * 16, dtype=np.uint32) + 7
        more = [bytes([9]) * 32, bytes([10]) * 32]
        with pytest.raises(UsageError, match="20 token ids for 2 blocks"):
            kv.store_hashes(more, bytes(2 * BB), tokens=given[:20])
        assert kv.store_hashes(more, bytes(2 * BB), tokens=given[:32 + 16][16:]) == 2
        recs = r.poll().records
        got = nm.tokens(recs["entry"].astype(np.int64) - 1, recs["key_lo"], recs["key_hi"])
        assert got == [given[16:32].tolist(), given[32:48].tolist()]
        assert nm.tokens(recs["entry"].astype(np.int64) - 1, recs["key_lo"] + 1,
                         recs["key_hi"]) == [None, None]          # not these blocks' entries
        res = journal.JournalReader(pool).poll()             # a resync names them the same
        assert res.resync
        by_key = {key(x): name_of(x) for x in res.records}
        assert [by_key[bytes(k)] for k in kv.keys_for_hashes(vllm)] == vllm
        assert [by_key[bytes(k)] for k in kv.keys_for_hashes(long)] == [b"", b""]
        assert [by_key[bytes(k)] for k in kv.keys_for_hashes(more)] == more


def test_a_pool_formatted_before_block_names_stores_unnamed_blocks(golden_pool):
    """The golden image of the format before NAMES (manager mode): the KV
    cache works as before and its journal records name nothing."""
    path = golden_pool("pool-v1-4m-before-names")
    with Pool.open(str(path), writable=False) as p:
        assert not p.sb.compat & layout.COMPAT_NAMES and p.sb.incompat & layout.INCOMPAT_JOURNAL
    mgr = lock_manager(str(path))
    try:
        with cxlkv.open_pool(str(path)) as pool:
            r = journal.JournalReader(pool, start="now")
            kv = pool.kv(model="old", block_tokens=16, block_bytes=4096)
            assert kv.store(toks(1, 2), bytes(2 * 4096)) == 2
            recs = r.poll().records
            assert recs["name_len"].tolist() == [0, 0]
            assert recs["parent_name_len"].tolist() == [0, 0]
            with kv.load(toks(1, 2)) as views:
                assert len(views) == 2
    finally:
        mgr.terminate()
        mgr.wait(10)


@pytest.mark.parametrize("name_tokens", [0, 8, 16, 40])
def test_token_ids_kept_as_the_format_says(pool_path, name_tokens):
    """A block keeps its token ids when it has at most the pool's name_tokens
    (cxlkv format --name-tokens); its name in any case."""
    from cxlkv.kv import names

    init_pool(pool_path, {"size": 8 * MiB, "chunk_size": 256 * 1024, "max_nodes": 8,
                          "name_tokens": name_tokens})
    with cxlkv.open_pool(pool_path) as pool:
        assert pool.sb.name_tokens == name_tokens
        nm = names.Names.of(pool)
        assert nm.entry_size == 64 + (4 * name_tokens + 63) // 64 * 64
        r = journal.JournalReader(pool, start="now")
        kv = pool.kv(**KV_ARGS)                          # 16 tokens a block
        t = toks(5, 2)
        assert kv.store(t, bytes(2 * BB)) == 2
        recs = r.poll().records
        assert [name_of(x) for x in recs] == kv.block_hashes(t)
        got = nm.tokens(recs["entry"].astype(np.int64) - 1, recs["key_lo"], recs["key_hi"])
        want = [t[:16], t[16:]] if name_tokens >= 16 else [None, None]
        assert got == want


def test_name_tokens_out_of_range_is_a_usage_error(cli, tmp_path):
    r = cli("format", "--pool", str(tmp_path / "p.pool"), "--size", "64M",
            "--name-tokens", "2000")
    assert r.code == 2 and "name tokens 2000" in r.err
    assert not (tmp_path / "p.pool").exists()
