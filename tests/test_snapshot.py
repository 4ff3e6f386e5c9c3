"""KV snapshot and restore: consistent copies while a writer keeps storing,
bit-exact restore, smaller targets (most recent whole chains), corrupt
blocks, newer formats, fsck after restore."""
from __future__ import annotations

import json
import select
import time

import numpy as np
import pytest

import cxlkv
from cxlkv.cli import COMMANDS
from cxlkv.kv import snapshot
from cxlkv.kv.area import Area
from cxlkv.pool import layout
from cxlkv.ops.init import init_pool
from cxlkv.api import Pool

from cxlkv.testing.checks import fsck_clean
from cxlkv.testing.data import pattern
from cxlkv.testing.nodes import NodeProc, lock_manager

MiB = 1 << 20
BB = 16 * 1024
ARGS = {"model": "m", "block_tokens": 16, "block_bytes": BB, "salt": "alice"}


@pytest.fixture(autouse=True)
def _commands(monkeypatch):
    """`cxlkv snapshot` and `cxlkv restore`, registered as cxlkv.cli will."""
    monkeypatch.setitem(COMMANDS, "snapshot", ("cxlkv.cli.snapshot", "snapshot_cmd",
                                               "Write a pool's KV blocks to a directory."))
    monkeypatch.setitem(COMMANDS, "restore", ("cxlkv.cli.snapshot", "restore_cmd",
                                              "Restore a KV snapshot into an empty pool."))


def make_pool(path, size=32 * MiB):
    init_pool(str(path), {"size": size, "chunk_size": 256 * 1024, "max_nodes": 8,
                          "lease_ms": 300})
    return str(path)


def churn_sequences(stem=32, variants=8):
    """Every full sequence kv_churn (cxlkv/testing/nodes.py) may store."""
    return [list(range(stem)) + [100000 + k * 1000 + j for j in range(5 * 16)]
            for k in range(variants)]


def verify_all(path, seqs, args=ARGS) -> int:
    """Load every sequence's matched prefix; every block bit-exact.  Returns
    the distinct blocks seen."""
    seen = set()
    with cxlkv.open_pool(path) as pool:
        kv = pool.kv(**args)
        for toks in seqs:
            want = pattern(kv, toks)
            with kv.load(toks) as views:
                for i, v in enumerate(views):
                    assert bytes(v) == want[i], f"block {i} of a sequence differs"
                    seen.add(kv.block_hashes(toks)[i])
    return len(seen)


def table_keys(path) -> set[bytes]:
    with Pool.open(path, writable=False) as p:
        t = Area(p).entries()
    live = (t["ctl"] & 0xFF) == layout.KV_PUBLISHED
    return {int(a).to_bytes(8, "little") + int(b).to_bytes(8, "little")
            for a, b in zip(t["key_lo"][live], t["key_hi"][live])}


def index_keys(snap) -> set[bytes]:
    idx = snapshot.read_index(snap, snapshot.read_manifest(snap))
    return {int(a).to_bytes(8, "little") + int(b).to_bytes(8, "little")
            for a, b in zip(idx["key_lo"], idx["key_hi"])}


def store_chains(path, n, args=ARGS, gap=0.0):
    """n chains of 1..4 blocks under a 2-block stem, one store each (so each
    has its own LRU stamp, the last the newest)."""
    seqs = []
    with cxlkv.open_pool(path) as pool:
        kv = pool.kv(**args)
        for i in range(n):
            toks = list(range(32)) + [50000 + i * 100 + j for j in range(16 * (1 + i % 4))]
            kv.store(toks, b"".join(pattern(kv, toks)))
            seqs.append(toks)
            if gap:
                time.sleep(gap)
    return seqs


# -- snapshot while serving -----------------------------------------------------------------
def _published(path) -> int:
    from cxlkv.kv.area import Area
    from cxlkv.api import Pool

    with Pool.open(path, writable=False) as p:
        return Area(p).header().live


def test_snapshot_while_a_writer_stores_then_restore_is_bit_exact(tmp_path, cli):
    # a pool small enough that the writer keeps evicting while we copy
    src = make_pool(tmp_path / "src.pool", size=8 * MiB)
    w = NodeProc()
    snaps = []
    try:
        w.attach(src)
        assert "ns" in w.call(op="kv_open", args=ARGS)
        # the writer stores until told to stop: the snapshots below are taken
        # while it stores, however fast it is
        stop = tmp_path / "stop-churn"
        w.send(op="kv_churn", seed=1, rounds=10**9, stem=32, variants=300, until=str(stop))
        # the first snapshot starts once the writer has published something
        deadline = time.monotonic() + 60
        while not _published(src):
            assert time.monotonic() < deadline, "the writer stored nothing in 60 s"
            select.select([w.p.stdout], [], [], 0.01)
        busy = 0
        while len(snaps) < 3 or not select.select([w.p.stdout], [], [], 0)[0]:
            d = tmp_path / f"snap{len(snaps)}"
            r = cli("snapshot", "--pool", src, "--to", d, "--json")
            assert r.code == 0, r.err
            doc = r.json()
            assert doc["blocks"] > 0
            # the writer was still storing when this snapshot ended
            busy += not select.select([w.p.stdout], [], [], 0)[0]
            snaps.append((d, doc))
            if len(snaps) >= 6:
                break
        stop.touch()
        res = w.reply()
        assert res.get("bad") == 0, res
        assert res["stored"] > 0 and busy >= 3, (res, busy)
    finally:
        w.close()
    fsck_clean(src)
    seqs = churn_sequences(variants=300)
    for k, (d, doc) in enumerate(snaps):       # those with skipped blocks too
        dst = make_pool(tmp_path / f"dst{k}.pool", size=16 * MiB)
        r = cli("restore", "--pool", dst, "--from", d, "--json")
        assert r.code == 0, r.err
        rep = r.json()
        assert rep["restored"] == rep["blocks"] == doc["blocks"], rep
        assert rep["left_out"] == rep["corrupt"] == 0
        assert rep["tenant_secret_carried"] is True       # the tenant re-derives its salt
        fsck_clean(dst)
        # every restored block is reachable by its tokens and bit-exact
        assert table_keys(dst) == index_keys(d)
        assert verify_all(dst, seqs) == doc["blocks"]


def test_snapshot_skips_blocks_that_change_while_copied(tmp_path, monkeypatch):
    src = make_pool(tmp_path / "src.pool")
    seqs = store_chains(src, 6)
    real = snapshot.entry_controls
    calls = []

    def evicted_meanwhile(area, idx):
        out = real(area, idx)
        if not calls:                       # the first batch: its 3rd block "changed"
            out = out.copy()
            out[2] += 1 << 8
        calls.append(1)
        return out

    monkeypatch.setattr(snapshot, "entry_controls", evicted_meanwhile)
    with cxlkv.open_pool(src) as pool:
        r = snapshot.snapshot(pool, tmp_path / "snap")
        total = Area(pool).header().live
    assert r["skipped_changed"] == 1
    assert r["blocks"] + r["skipped_changed"] + r["skipped_orphans"] == total
    dst = make_pool(tmp_path / "dst.pool")
    with cxlkv.open_pool(dst) as pool:
        rep = snapshot.restore(pool, tmp_path / "snap")
    assert rep["restored"] == r["blocks"]
    fsck_clean(dst)
    verify_all(dst, seqs)                 # no chain under a missing block, all bit-exact


# -- smaller pools -------------------------------------------------------------------------
def test_restore_into_a_smaller_pool_keeps_the_most_recent_whole_chains(tmp_path, cli):
    src = make_pool(tmp_path / "src.pool")
    seqs = store_chains(src, 120, gap=0.0005)       # about 2 MiB... 7.5 MiB of blocks
    with cxlkv.open_pool(src) as pool:              # an old chain used again: recent now
        kv = pool.kv(**ARGS)
        with kv.load(seqs[0]) as v:
            assert len(v) == 3
        with pool.lock():                    # touches reach the stamps (as eviction does)
            Area(pool).drain_rings()
    snap = tmp_path / "snap"
    assert cli("snapshot", "--pool", src, "--to", snap).code == 0
    dst = make_pool(tmp_path / "small.pool", size=4 * MiB)
    r = cli("restore", "--pool", dst, "--from", snap, "--json")
    assert r.code == 0, r.err
    rep = r.json()
    assert rep["restored"] > 0 and rep["left_out"] > 0
    assert rep["restored"] + rep["left_out"] == rep["blocks"]
    assert rep["left_out_reason"] in ("pool full", "hash table full")
    fsck_clean(dst)
    # chains intact: every published entry's parent is published
    with Pool.open(dst, writable=False) as p:
        t = Area(p).entries()
    live = (t["ctl"] & 0xFF) == layout.KV_PUBLISHED
    par = t["parent"][live].astype(np.int64)
    assert all(live[par[par > 0] - 1])
    # most recent first: every sequence fully present is newer than every
    # sequence that is missing blocks (seqs[0] was loaded last: newest)
    with cxlkv.open_pool(dst) as pool:
        kv = pool.kv(**ARGS)
        full = [kv.match(s) == len(s) for s in seqs]
    order = [0] + list(range(len(seqs) - 1, 0, -1))    # newest first
    ranks = [full[i] for i in order]
    assert ranks[0] and not ranks[-1]
    first_missing = ranks.index(False)
    assert not any(ranks[first_missing + 1:]), ranks
    verify_all(dst, seqs)
    # the text report says what was left out
    dst2 = make_pool(tmp_path / "small2.pool", size=4 * MiB)
    r = cli("restore", "--pool", dst2, "--from", snap)
    assert r.code == 0 and "left out" in r.out


def test_restore_order_puts_parents_first_and_newest_first():
    idx = np.zeros(5, dtype=snapshot.INDEX_DTYPE)
    # chain 0 <- 1 <- 2 (old), 3 <- 4 (new); block 1 touched recently
    idx["parent"] = [-1, 0, 1, -1, 3]
    idx["lru"] = [10, 50, 20, 40, 40]
    order = snapshot.restore_order(idx).tolist()
    assert order == [0, 1, 3, 4, 2]


# -- integrity ------------------------------------------------------------------------------
def test_a_corrupt_block_is_skipped_with_its_descendants(tmp_path, cli):
    src = make_pool(tmp_path / "src.pool")
    seqs = store_chains(src, 8)
    snap = tmp_path / "snap"
    assert cli("snapshot", "--pool", src, "--to", snap).code == 0
    idx = snapshot.read_index(snap, snapshot.read_manifest(snap))
    # corrupt the first block of a 4-block chain (depth 2: under the stem)
    kids = np.bincount(idx["parent"][idx["parent"] >= 0], minlength=len(idx))
    # a block under the stem with a chain of two or more below it
    depth = np.zeros(len(idx), dtype=int)
    for i in range(len(idx)):
        depth[i] = depth[idx["parent"][i]] + 1 if idx["parent"][i] >= 0 else 0
    victim = next(i for i in range(len(idx)) if depth[i] == 2 and kids[i] == 1
                  and kids[np.flatnonzero(idx["parent"] == i)[0]] == 1)
    with open(snap / snapshot.DATA, "r+b") as f:
        f.seek(int(idx["offset"][victim]) + 100)
        b = f.read(1)
        f.seek(int(idx["offset"][victim]) + 100)
        f.write(bytes([b[0] ^ 0xFF]))
    dst = make_pool(tmp_path / "dst.pool")
    r = cli("restore", "--pool", dst, "--from", snap, "--json")
    assert r.code == 1, r.err
    rep = r.json()
    assert rep["corrupt"] == 1 and rep["corrupt_descendants"] >= 2
    assert rep["restored"] == rep["blocks"] - 1 - rep["corrupt_descendants"]
    assert "corrupt" in r.err
    fsck_clean(dst)
    verify_all(dst, seqs)                  # the rest bit-exact, the chain cut cleanly


def test_a_snapshot_from_a_newer_format_is_refused(tmp_path, cli):
    src = make_pool(tmp_path / "src.pool")
    store_chains(src, 2)
    snap = tmp_path / "snap"
    assert cli("snapshot", "--pool", src, "--to", snap).code == 0
    doc = json.loads((snap / snapshot.MANIFEST).read_text())
    doc["version"] = snapshot.VERSION + 1
    doc["checksum"] = snapshot._manifest_sum(doc)
    (snap / snapshot.MANIFEST).write_text(json.dumps(doc))
    dst = make_pool(tmp_path / "dst.pool")
    r = cli("restore", "--pool", dst, "--from", snap, "--json")
    assert r.code == 5
    assert "newer" in r.json()["error"]["message"]
    assert f"version {snapshot.VERSION + 1}" in r.err
    with Pool.open(dst, writable=False) as p:      # the pool was not touched
        assert Area(p).header().live == 0


def test_a_damaged_manifest_or_index_is_refused(tmp_path, cli):
    src = make_pool(tmp_path / "src.pool")
    store_chains(src, 2)
    snap = tmp_path / "snap"
    assert cli("snapshot", "--pool", src, "--to", snap).code == 0
    dst = make_pool(tmp_path / "dst.pool")
    raw = (snap / snapshot.INDEX).read_bytes()
    (snap / snapshot.INDEX).write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))
    r = cli("restore", "--pool", dst, "--from", snap)
    assert r.code == 4 and "index" in r.err
    (snap / snapshot.INDEX).write_bytes(raw)
    text = (snap / snapshot.MANIFEST).read_text()
    (snap / snapshot.MANIFEST).write_text(text.replace('"blocks": ', '"blocks": 1'))
    r = cli("restore", "--pool", dst, "--from", snap)
    assert r.code == 4 and "checksum" in r.err
    (snap / snapshot.MANIFEST).unlink()
    r = cli("restore", "--pool", dst, "--from", snap)
    assert r.code == 4 and "incomplete" in r.err
    r = cli("restore", "--pool", dst, "--from", tmp_path / "nowhere")
    assert r.code == 3


def test_restore_refuses_a_pool_that_holds_blocks(tmp_path, cli):
    src = make_pool(tmp_path / "src.pool")
    store_chains(src, 2)
    snap = tmp_path / "snap"
    assert cli("snapshot", "--pool", src, "--to", snap).code == 0
    r = cli("restore", "--pool", src, "--from", snap, "--json")
    assert r.code == 1 and r.json()["error"]["kind"] == "refused"
    # a non-empty destination is refused too
    r = cli("snapshot", "--pool", src, "--to", snap)
    assert r.code == 1 and "not empty" in r.err
    fsck_clean(src)


def test_unsalted_snapshot_keeps_the_target_secret(tmp_path):
    args = {**ARGS, "salt": None}
    src = make_pool(tmp_path / "src.pool")
    seqs = store_chains(src, 3, args=args)
    with cxlkv.open_pool(src) as pool:
        snapshot.snapshot(pool, tmp_path / "snap")
    dst = make_pool(tmp_path / "dst.pool")
    with Pool.open(dst, writable=False) as p:
        secret = bytes(p.sb.tenant_secret)
    with cxlkv.open_pool(dst) as pool:
        rep = snapshot.restore(pool, tmp_path / "snap")
    assert rep["tenant_secret_carried"] is False
    with Pool.open(dst, writable=False) as p:
        assert bytes(p.sb.tenant_secret) == secret
    assert verify_all(dst, seqs, args) == rep["restored"]
    fsck_clean(dst)


def test_the_tenant_secret_is_not_replaced_under_attached_nodes(tmp_path, cli):
    src = make_pool(tmp_path / "src.pool")
    store_chains(src, 2)                       # salted: the secret matters
    snap = tmp_path / "snap"
    assert cli("snapshot", "--pool", src, "--to", snap).code == 0
    dst = make_pool(tmp_path / "dst.pool")
    other = NodeProc()
    try:
        other.attach(dst)                      # a serving node that derived salts already
        r = cli("restore", "--pool", dst, "--from", snap)
        assert r.code == 1 and "secret" in r.err
    finally:
        other.close()
    r = cli("restore", "--pool", dst, "--from", snap, "--json")   # alone now: carried
    assert r.code == 0 and r.json()["tenant_secret_carried"] is True
    fsck_clean(dst)


def test_snapshot_and_restore_in_manager_mode_under_the_noncoherence_emulation(tmp_path, cli,
                                                                              monkeypatch):
    """Non-coherent multi-host memory: the snapshot reads entries and blocks
    another node keeps writing (invalidating first), restore writes them back
    (flushing); every restored block is bit-exact."""
    src, dst = str(tmp_path / "src.pool"), str(tmp_path / "dst.pool")
    for p, size in ((src, 8 * MiB), (dst, 16 * MiB)):
        init_pool(p, {"size": size, "chunk_size": 256 * 1024, "max_nodes": 8,
                      "lease_ms": 2000, "sync": "manager"})
    nc = {"CXLKV_NONCOHERENT": "1", "CXLKV_NC_EVICT_EVERY": "64", "CXLKV_NC_PRELOAD": "1"}
    mgrs = [lock_manager(src), lock_manager(dst)]
    w = NodeProc(nc)
    try:
        w.attach(src)
        assert "ns" in w.call(op="kv_open", args=ARGS)
        w.send(op="kv_churn", seed=2, rounds=1500, stem=32, variants=100)
        deadline = time.monotonic() + 60
        while not _published(src):
            assert time.monotonic() < deadline, "the writer stored nothing in 60 s"
            select.select([w.p.stdout], [], [], 0.01)
        snap = tmp_path / "snap"
        r = cli("snapshot", "--pool", src, "--to", snap, "--json", env=nc)
        assert r.code == 0, r.err
        doc = r.json()
        assert doc["blocks"] > 0
        res = w.reply()
        assert res.get("bad") == 0, res
        r = cli("restore", "--pool", dst, "--from", snap, "--json", env=nc)
        assert r.code == 0, r.err
        rep = r.json()
        assert rep["restored"] == rep["blocks"] == doc["blocks"] and rep["corrupt"] == 0, rep
        assert table_keys(dst) == index_keys(snap)
        for k, v in nc.items():
            monkeypatch.setenv(k, v)
        assert verify_all(dst, churn_sequences(variants=100)) == doc["blocks"]
    finally:
        w.close()
        for m in mgrs:
            m.terminate()
            m.wait(30)
    fsck_clean(src)
    fsck_clean(dst)
