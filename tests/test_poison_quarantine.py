"""Quarantine of poisoned pool memory: the KV blocks on the bad range are
evicted and never served, the chunks are retired in the on-media list
(incompat BADCHUNKS) that the allocator never reuses, fsck checks it,
`inspect` / `kv stats` / `health` show it; a metadata hit is CRITICAL.
The bad ranges come from the lab capture where that matters
(tests/fixtures/lab/poison/), translated by cxlkv.host.poison."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import cxlkv
from cxlkv.api import Pool
from cxlkv.errors import PoolIncompatible, RetiredSlots
from cxlkv.kv.area import Area
from cxlkv.kv.cache import blocks_covering, quarantine
from cxlkv.ops import health
from cxlkv.ops.fsck import check
from cxlkv.pool import layout
from cxlkv.state import alloc, nodes
from cxlkv.testing.checks import fsck_clean

BB = 4096
LIVE = Path(__file__).parent / "fixtures" / "lab" / "poison" / "kernel6.12-qemu10.0"


def fill(pool, n=40, model="m"):
    kv = pool.kv(model=model, block_tokens=4, block_bytes=BB)
    toks = list(range(4 * n))
    data = [np.full(BB, i % 251, np.uint8) for i in range(n)]
    assert kv.store(toks, data) == n
    return kv, toks


def payloads(pool):
    t = Area(pool).entries()
    st = t["ctl"] & 0xFF
    return np.sort(t["payload"][st == layout.KV_PUBLISHED].astype(np.int64))


def test_blocks_on_a_bad_range_are_evicted_and_its_chunk_never_reused(kvpool):
    with cxlkv.open_pool(kvpool) as pool:
        kv, toks = fill(pool)
        pay = payloads(pool)
        bad = int(pay[len(pay) // 2]) + 100              # inside a block's payload
        data_off, chunk, nchunks, _ = alloc.geometry(pool)
        bad_chunk = (bad - data_off) // chunk
        r = quarantine(pool, bad, 64, "poison")
        assert r["region"] == "data" and not r["critical"]
        assert r["retired_chunks"] == [bad_chunk] and r["evicted_blocks"] >= 1
        assert not len(blocks_covering(Area(pool), bad, 64))
        # the prefix up to the poisoned block still matches; nothing beyond it is served
        assert kv.match(toks) < len(toks)
        with kv.load(toks) as views:
            assert len(views) == kv.match(toks) // 4
        # idempotent
        again = quarantine(pool, bad, 64, "poison")
        assert again["retired_chunks"] == [] and again["already_retired"] == [bad_chunk]
        # the allocator never hands out the chunk: fill the pool, free, fill again
        lo, hi = data_off + bad_chunk * chunk, data_off + (bad_chunk + 1) * chunk
        for _ in range(2):
            got = []
            try:
                while True:
                    got.append(pool.alloc(chunk // 2))
            except cxlkv.errors.PoolFullError:
                pass
            arr = np.array(got, dtype=np.int64)
            assert not ((arr + chunk // 2 > lo) & (arr < hi)).any()
            pool.free_batch(np.array(got, dtype=np.uint64))
            pool.allocator.release_empty()
        assert pool.sb.incompat & layout.INCOMPAT_BADCHUNKS
    rep = fsck_clean(kvpool)
    assert rep.stats["retired"] == {"chunks": 1, "bytes": chunk, "metadata_hits": 0}


def test_stats_inspect_and_health_show_retired_bytes(kvpool, cli):
    with cxlkv.open_pool(kvpool) as pool:
        fill(pool, 8)
        quarantine(pool, int(payloads(pool)[0]), 64, "media-error")
        chunk = pool.sb.chunk_size
    r = cli("kv", "stats", "--pool", kvpool, "--json")
    assert r.code == 0 and r.json()["kv"]["retired"] == {"chunks": 1, "bytes": chunk,
                                                          "metadata_hits": 0}
    assert "retired (poison): 1 chunk(s)" in cli("kv", "stats", "--pool", kvpool).out
    assert "retired" in cli("inspect", "--pool", kvpool).out
    with Pool.open(kvpool, writable=False) as p:
        h = health.evaluate(p, health.Thresholds(), observer=nodes.Observer(p), manager=None,
                            deadline=None)
    poison_checks = [c for c in h.checks if c.id == "poison"]
    assert [c.status for c in poison_checks] == [health.WARNING]
    assert h.data["poison"]["chunks"] == 1


def test_a_metadata_hit_is_critical_and_fsck_says_reformat(kvpool, cli):
    with cxlkv.open_pool(kvpool) as pool:
        hash_off, _ = pool.region("hash")
        r = quarantine(pool, hash_off + 128, 64, "poison")
        assert r["critical"] and r["region"] == "hash" and r["retired_chunks"] == []
    with Pool.open(kvpool, writable=False) as p:
        rep = check(p)
        h = health.evaluate(p, health.Thresholds(), observer=nodes.Observer(p), manager=None,
                            deadline=None)
    assert [f.code for f in rep.errors] == ["retired-metadata"]
    assert "re-format" in rep.errors[0].message
    assert h.status == health.CRITICAL
    r = cli("kv", "quarantine", "--pool", kvpool, "--offset", hex(hash_off + 128))
    assert r.code == 2 and "CRITICAL" in r.out


def test_retirement_survives_a_released_slab_and_recovery_of_leaks(kvpool):
    with cxlkv.open_pool(kvpool) as pool:
        kv, toks = fill(pool, 16)
        bad = int(payloads(pool)[3])
        r = quarantine(pool, bad, 64, "poison")
        (c,) = r["retired_chunks"]
        kv.drop()                                         # every block goes, slabs empty
        pool.allocator.release_empty()
        with pool.lock():
            pool.allocator._sweep(0)
            alloc._reclaim_leaked_chunks(pool)            # must not call it leaked
        assert alloc.bitmap(pool)[c]
        assert c in alloc.retired_chunks(pool).tolist()
    fsck_clean(kvpool)


def test_an_older_cxlkv_refuses_a_pool_with_retired_chunks(kvpool, monkeypatch):
    with cxlkv.open_pool(kvpool) as pool:
        fill(pool, 4)
        quarantine(pool, int(payloads(pool)[0]), 64)
    monkeypatch.setattr(layout, "INCOMPAT_SUPPORTED",
                        layout.INCOMPAT_SUPPORTED & ~layout.INCOMPAT_BADCHUNKS)
    with pytest.raises(PoolIncompatible):
        Pool.open(kvpool, writable=False)


@pytest.mark.skipif(not LIVE.exists(), reason=f"no capture in {LIVE}")
def test_captured_poison_quarantines_the_offsets_the_guest_wrote(kvpool, cli, monkeypatch,
                                                                 tmp_path):
    """The guest's trace, translated through its sysfs (a file-backed pool
    stands in for dax0.0: pool offset = dax offset), quarantines exactly the
    chunks under the markers the guest wrote."""
    monkeypatch.setenv("CXLKV_SYSFS_ROOT", str(LIVE / "sysfs" / "poison" / "sys"))
    trace = json.loads((LIVE / "commands" / "poison" / "trace-after-clear.json").read_text())
    f = tmp_path / "trace.txt"
    f.write_text(trace["stdout"])
    markers = [json.loads(x) for x in (LIVE / "markers.json").read_text().splitlines()]
    with Pool.open(kvpool, writable=False) as p:
        size, (data_off, _), chunk = p.sb.pool_size, p.region("data"), p.sb.chunk_size
    r = cli("kv", "quarantine", "--pool", kvpool, "--trace", str(f), "--json")
    doc = r.json()
    got = sorted(x["offset"] for x in doc["results"])
    inside = sorted(m["dax_offset"] for m in markers if m["dax_offset"] < size)
    # the markers inside this 32 MiB pool, plus 0x100040 (the QMP range after clear_poison)
    assert set(inside) <= set(got) and 0x100040 in got
    outside = {t["record"]["dpa"] for t in doc["outside_pool"]}
    assert 0x1000 in outside                      # namespace info block, not dax0.0
    with Pool.open(kvpool, writable=False) as p:
        for res in doc["results"]:
            assert res["region"] == alloc.region_of(p, res["offset"])
            assert res["critical"] == (res["offset"] < data_off)
        listed = {e["offset"] for e in alloc.retired(p)}
    assert listed == set(got)
    assert r.code == (2 if any(x["critical"] for x in doc["results"]) else 0)
    del chunk


# -- health figures from cxl list -H (ndctl's field names; QEMU reports none) -------------

def _device(**health_fields):
    from cxlkv.host import discovery
    h = discovery.health({"memdev": "mem0", "health": health_fields})
    return {"device": "dax0.0", "memdevs": [{"memdev": "mem0", **h}], "temperature_c": None,
            "alarms": [], "error": None}


@pytest.mark.parametrize("fields,want", [
    ({"life_used_percent": 10, "dirty_shutdowns": 0, "volatile_errors": 0}, health.OK),
    ({"life_used_percent": 85}, health.WARNING),
    ({"life_used_percent": 97}, health.CRITICAL),
    ({"dirty_shutdowns": 2}, health.WARNING),
    ({"volatile_errors": 5}, health.WARNING),
    ({"volatile_errors": 100}, health.CRITICAL),
])
def test_wear_figures_have_thresholds(fields, want):
    h = health.Health("/dev/dax0.0")
    health.add_wear(h, _device(**fields), health.Thresholds())
    assert max(c.status for c in h.checks) == want
    assert {p[0] for p in h.perf} == {k.replace("_percent", "") for k in fields}


def test_a_device_without_health_adds_nothing():
    h = health.Health("/dev/dax0.0")
    health.add_wear(h, {"device": "dax0.0", "memdevs": [{"memdev": "mem0"}]},
                    health.Thresholds())
    assert h.checks == [] and h.perf == []


# -- the serve path: follow the trace, quarantine what is new ----------------------------

@pytest.mark.skipif(not LIVE.exists(), reason=f"no capture in {LIVE}")
def test_follower_reports_each_record_once_and_the_agent_quarantines_it(kvpool, tmp_path,
                                                                       monkeypatch):
    import shutil
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, Counter

    from cxlkv.daemons.agent import Agent
    from cxlkv.host import poison

    root = tmp_path / "sys"
    shutil.copytree(LIVE / "sysfs" / "poison" / "sys", root, symlinks=True)
    tracing = root / "kernel" / "tracing"
    (tracing / "events" / "cxl" / "cxl_poison").mkdir(parents=True)
    (root / "bus" / "cxl" / "devices" / "mem0").mkdir(exist_ok=True)
    monkeypatch.setenv("CXLKV_SYSFS_ROOT", str(root))
    full = json.loads((LIVE / "commands" / "poison" / "trace-after-clear.json").read_text())
    lines = full["stdout"].splitlines(keepends=True)
    half = len(lines) // 2
    (tracing / "trace").write_text("".join(lines[:half]))
    f = poison.Follower(["mem0"])
    assert f.start() == []
    assert (tracing / "events" / "cxl" / "cxl_poison" / "enable").read_text() == "1\n"
    first = f.poll()
    (tracing / "trace").write_text("".join(lines))
    second = f.poll()
    assert f.poll() == []
    assert len(first) + len(second) == sum("cxl_poison:" in x for x in lines)
    tr = poison.Translator(pool_dax=None, pool_size=32 << 20)
    reg = CollectorRegistry()
    events = []
    with cxlkv.open_pool(kvpool) as pool:
        fake = SimpleNamespace(
            pool=pool, event=lambda lvl, msg, **kw: events.append((lvl, msg)),
            _poison_pending=set(),
            metrics=SimpleNamespace(poison_records=Counter("x", "x", ["outcome"],
                                                           registry=reg)))
        for rec in first + second:
            Agent._on_poison(fake, tr, rec)
        listed = {e["offset"] for e in alloc.retired(pool)}
    assert 0x100000 in listed                      # the QMP range (dpa 0x700000), first list
    outcome = {s.labels["outcome"]: s.value for m in reg.collect() for s in m.samples
               if s.name == "x_total"}
    assert outcome["cleared"] == 1 and outcome["outside-pool"] >= 1
    assert outcome.get("quarantined", 0) + outcome.get("critical", 0) >= 2


def test_fsck_repair_keeps_a_retired_slab_out_of_use(kvpool):
    from cxlkv.ops.repair import repair
    with cxlkv.open_pool(kvpool) as pool:
        fill(pool, 16)
        bad = int(payloads(pool)[5])
        (c,) = quarantine(pool, bad, 64)["retired_chunks"]
        data_off, chunk, _, base = alloc.geometry(pool)
        ctl = pool.mapping.load64(base + c * layout.CHUNK_DESC_SIZE)
        head = c if ctl & 0xFF == layout.CHUNK_HEAD else ctl >> 8
    repair(kvpool, force=True)
    with Pool.open(kvpool, writable=False) as p:
        _, _, _, base = alloc.geometry(p)
        owner = p.mapping.load64(base + head * layout.CHUNK_DESC_SIZE + 8)
        assert owner in (alloc.RETIRED_OWNER, 0) and alloc.bitmap(p)[c]
        if owner == 0:      # released (it was empty): the chunk stays retired
            assert p.mapping.load64(base + c * layout.CHUNK_DESC_SIZE) & 0xFF == 0
    fsck_clean(kvpool)


# -- a quarantine racing with a store: a slot handed out before its chunk was
# retired is never written (before the copy) nor published (under the lock)

def _in_chunk(pool, offs, chunk_index) -> np.ndarray:
    data_off, chunk, _, _ = alloc.geometry(pool)
    return (np.asarray(offs, dtype=np.int64) - data_off) // chunk == chunk_index


def _chunk_of(pool, off) -> int:
    data_off, chunk, _, _ = alloc.geometry(pool)
    return (int(off) - data_off) // chunk


def _check_store_dodged(pool, kv, toks, data, bad_chunk, before):
    assert kv.match(toks) == len(toks)
    with kv.load(toks) as views:
        assert [bytes(v) for v in views] == [bytes(d) for d in data]
    new = np.setdiff1d(payloads(pool), before)
    assert len(new) == len(data) and not _in_chunk(pool, new, bad_chunk).any()


@pytest.mark.parametrize("when", ["after-alloc", "after-copy"])
def test_a_store_whose_slots_are_retired_meanwhile_stores_elsewhere(kvpool, when):
    """The quarantine lands between the allocator handing out a free slot
    (its owner check passed) and the store's copy (after-alloc: the free slot
    had no block for the quarantine to evict), or between the copy and the
    publish (after-copy: the reserved entry is pending, its writer's publish
    refuses it).  The store stores every block elsewhere; no block is ever
    published on the retired chunk; the chunk's poisoned bytes are not written."""
    with cxlkv.open_pool(kvpool) as pool:
        kv, _ = fill(pool, n=8)
        before = payloads(pool)
        toks = list(range(10_000, 10_000 + 4 * 6))
        data = [np.full(BB, 200 + i, np.uint8) for i in range(6)]
        seen = {}

        def strike(pay):
            seen["first"] = first = int(pay[0])
            seen["chunk"] = _chunk_of(pool, first)
            # the poisoned line's bytes: nothing writes it from here on
            seen["before"] = bytes(pool.mapping.read(first, 64))
            seen["r"] = quarantine(pool, first, 64, "poison")

        if when == "after-alloc":
            real_alloc = kv._alloc

            def racing_alloc(count):
                pay = real_alloc(count)
                if "r" not in seen:
                    strike(pay)
                return pay
            kv._alloc = racing_alloc
        else:
            real_copy = kv._copy

            def racing_copy(new, pay, src, items):
                real_copy(new, pay, src, items)
                if "r" not in seen:
                    strike(pay)
            kv._copy = racing_copy
        assert kv.store(toks, data) == 6
        r = seen["r"]
        assert r["retired_chunks"] == [seen["chunk"]] and r["pinned"] == 0
        # after the copy the entry is reserved, not published: nothing to
        # evict, its writer's publish refuses it
        assert r["pending"] == (1 if when == "after-copy" else 0)
        _check_store_dodged(pool, kv, toks, data, seen["chunk"], before)
        assert bytes(pool.mapping.read(seen["first"], 64)) == seen["before"]
    fsck_clean(kvpool)


def test_publish_refuses_a_slot_retired_after_it_was_handed_out(kvpool):
    with cxlkv.open_pool(kvpool) as pool:
        off = pool.alloc(256)
        r = quarantine(pool, off, 64, "poison")
        bad = _chunk_of(pool, off)
        assert r["retired_chunks"] == [bad]
        _, chunk, _, _ = alloc.geometry(pool)
        other = pool.alloc(chunk // 2)               # a slab of its own, elsewhere
        assert _chunk_of(pool, other) != bad
        with pytest.raises(RetiredSlots) as ei:
            pool.publish(np.array([other, off], dtype=np.uint64))
        assert ei.value.offsets.tolist() == [off] and ei.value.kind == "retired"
        pool.publish(other)                          # nothing was published by the refusal
        pool.free(off, zero=False)
        pool.free(other)
    fsck_clean(kvpool)


def test_the_agent_quarantines_again_until_readers_unpin(kvpool):
    """A block on the bad range pinned by a reader is not evicted under it;
    the agent keeps the range and quarantines it again each poll until the
    reader lets go."""
    from types import SimpleNamespace

    from cxlkv.daemons.agent import Agent

    with cxlkv.open_pool(kvpool) as pool:
        kv, toks = fill(pool, n=8)
        with kv.load(toks) as views:
            assert len(views) == 8
            bad = int(payloads(pool)[-1]) + 128
            r = quarantine(pool, bad, 64, "poison")
            assert r["pinned"] >= 1
            events = []
            fake = SimpleNamespace(pool=pool, _poison_pending={(bad, 64)},
                                   event=lambda lvl, msg, **kw: events.append(msg))
            Agent._poison_retry(fake)
            assert fake._poison_pending == {(bad, 64)} and not events
        Agent._poison_retry(fake)
        assert fake._poison_pending == set() and "pinned block(s) evicted" in events[0]
        assert not len(blocks_covering(Area(pool), bad, 64))
        assert kv.match(toks) < len(toks)
    fsck_clean(kvpool)


def test_the_command_says_when_pinned_blocks_stay_and_exits_1(kvpool, cli):
    with cxlkv.open_pool(kvpool) as pool:
        kv, toks = fill(pool, n=4)
        with kv.load(toks) as views:
            assert len(views) == 4
            bad = int(payloads(pool)[0]) + 64
            r = cli("kv", "quarantine", "--pool", kvpool, "--offset", hex(bad))
            assert r.code == 1 and "not finished: 1 block(s)" in r.out
        r = cli("kv", "quarantine", "--pool", kvpool, "--offset", hex(bad))
        assert r.code == 0 and "block(s) evicted" in r.out and "not finished" not in r.out
