"""The NVMe spill tier (cxlkv.kv.tiers.spill): evicted blocks go to a bounded
directory and come back bit-exact; corrupt and truncated files are misses
and are removed; a full or failing disk or a full queue drops, never an
error; the store's own size limit and LRU."""
from __future__ import annotations

import errno
import os
import struct
import threading
from pathlib import Path

import numpy as np
import pytest

import cxlkv
from cxlkv.errors import UsageError
from cxlkv.kv.cache import KVCache
from cxlkv.kv.tiers import spill
from cxlkv.ops.init import init_pool
from cxlkv.testing.checks import fsck_clean
from cxlkv.testing.data import pattern

MiB = 1 << 20
BB = 64 * 1024
ARGS = {"model": "m", "block_tokens": 16, "block_bytes": BB}


@pytest.fixture
def spill_pool(pool_path):
    """An 8 MiB pool: the KV tests here overflow it into the spill tier; returns its path."""
    init_pool(pool_path, {"size": 8 * MiB, "chunk_size": 256 * 1024, "max_nodes": 8,
                          "lease_ms": 300})
    return pool_path


def seqs(n, blocks=4):
    return [list(range(s * 1000, s * 1000 + 16 * blocks)) for s in range(n)]


def in_pool(kv, toks) -> np.ndarray:
    _, _, ctl, _ = kv._lookup(kv._keys(toks), stop=False)
    return ctl != 0


def on_disk(d) -> tuple[int, int]:
    """(blocks, bytes) of the LIVE slots whose headers verify in the slot
    files of directory `d`."""
    n = b = 0
    for f in Path(d).glob("slots-*.dat"):
        sf = spill.SlotFile.open(f, writable=False)
        live = sf.live()
        n += len(live)
        b += len(live) * (spill.HDR_SIZE + sf.sbytes)
        sf.close()
    return n, b


def poke(path, off, data: bytes) -> None:
    """Write `data` at `off` in the file at `path` (damage from outside)."""
    with open(path, "r+b") as f:
        f.seek(off)
        f.write(data)


def peek(path, off, n) -> bytes:
    with open(path, "rb") as f:
        f.seek(off)
        return f.read(n)


def stamp(store, key) -> int:
    """The stamp in the header of the slot holding `key`."""
    path, _, hoff = store.locate(key)
    return struct.unpack("<Q", peek(path, hoff + 64, 8))[0]


def fill(kv, n=60):
    """Store n sequences of 4 blocks (15 MiB through an 8 MiB pool)."""
    ss = seqs(n)
    for t in ss:
        kv.store(t, pattern(kv, t))
    return ss


def test_spill_and_promote_round_trip_is_bit_exact(spill_pool, tmp_path):
    d = tmp_path / "spill"
    with cxlkv.open_pool(spill_pool) as pool:
        kv = KVCache(pool, **ARGS, spill_dir=d, spill_bytes=64 * MiB)
        sp = spill.store_of(pool)
        ss = fill(kv)
        sp.flush()
        st = sp.stats()
        assert st["written"] > 0 and st["dropped"] == 0, st
        evicted = [t for t in ss if not in_pool(kv, t).all()]
        assert len(evicted) > len(ss) // 3           # the pool really overflowed
        # match sees both tiers: every sequence is whole again
        assert all(kv.match(t) == len(t) for t in ss)
        for t in evicted[:10]:
            out = bytearray(4 * BB)
            assert kv.load_into(t, out) == 4
            assert bytes(out) == b"".join(pattern(kv, t))
            assert in_pool(kv, t).all()              # promoted back into the pool
        for t in evicted[10:20]:
            with kv.load(t) as views:
                assert [bytes(v) for v in views] == pattern(kv, t)
        assert sp.stats()["promoted"] > 0 and sp.stats()["corrupt"] == 0
        # a second KVCache of the pool object shares the store
        kv2 = pool.kv(**ARGS)
        assert kv2.match(evicted[-1]) == 64
        spill.disable(pool)                     # writes what is queued
        assert spill.store_of(pool) is None
        blocks = on_disk(d)[0]
    fsck_clean(spill_pool)
    # the directory survives the process: a new store indexes it again
    with cxlkv.open_pool(spill_pool) as pool:
        kv = KVCache(pool, **ARGS, spill_dir=d, spill_bytes=64 * MiB)
        assert spill.store_of(pool).stats()["blocks"] == blocks > 0


def test_without_spill_evicted_blocks_are_gone(spill_pool):
    with cxlkv.open_pool(spill_pool) as pool:
        kv = pool.kv(**ARGS)
        ss = fill(kv)
        assert spill.store_of(pool) is None
        assert any(kv.match(t) < len(t) for t in ss)


def _spilled_only(kv, sp, ss):
    """(sequence, block index) of blocks on disk and not in the pool."""
    out = []
    for t in ss:
        keys = kv._keys(t)
        inp = in_pool(kv, t)
        for j in range(len(keys)):
            if not inp[j] and sp.run(keys[j:j + 1]) and (j == 0 or inp[:j].all()):
                out.append((t, j))
    return out


def test_corrupt_and_truncated_spill_files_are_misses_and_removed(spill_pool, tmp_path):
    with cxlkv.open_pool(spill_pool) as pool:
        kv = KVCache(pool, **ARGS, spill_dir=tmp_path / "spill", spill_bytes=64 * MiB)
        sp = spill.store_of(pool)
        ss = fill(kv)
        sp.flush()
        cand = _spilled_only(kv, sp, ss)
        assert len(cand) >= 3
        (t1, j1), (t2, j2), (t3, j3) = cand[:3]
        k1, k2, k3 = (bytes(kv._keys(t)[j]) for t, j in cand[:3])
        (p1, o1, _), (p2, o2, _), (p3, _, h3) = (sp.locate(k, BB) for k in (k1, k2, k3))
        poke(p1, o1 + 1000, bytes([peek(p1, o1 + 1000, 1)[0] ^ 0x40]))   # one payload bit
        poke(p3, h3 + 20, bytes([peek(p3, h3 + 20, 1)[0] ^ 1]))          # the header (its key)
        with open(p2, "r+b") as f:                    # the slot file cut in a payload
            f.truncate(o2 + BB // 2)
        for t, j, k in ((t1, j1, k1), (t2, j2, k2), (t3, j3, k3)):
            out = bytearray(len(t) // 16 * BB)
            got = kv.load_into(t, out)
            assert got == j                              # the bad block is a miss
            assert bytes(out[:got * BB]) == b"".join(pattern(kv, t)[:got])
            assert sp.locate(k, BB) is None             # its slot freed
            assert kv.match(t) == j * 16                 # and stays one
        assert sp.stats()["corrupt"] == 3
    fsck_clean(spill_pool)


def test_store_full_degrades_to_drop(spill_pool, tmp_path, caplog):
    with cxlkv.open_pool(spill_pool) as pool:
        kv = KVCache(pool, **ARGS, spill_dir=tmp_path / "spill", spill_bytes=0)
        sp = spill.store_of(pool)
        ss = fill(kv)
        sp.flush()
        st = sp.stats()
        assert st["written"] == 0 and st["dropped_store-full"] > 0 and st["blocks"] == 0
        assert any(kv.match(t) < len(t) for t in ss)
    # one warning, through logging (an engine routes or silences it)
    assert sum("store-full" in r.getMessage() for r in caplog.records
               if r.name.startswith("cxlkv.kv.tiers.spill")) == 1


def test_failing_disk_degrades_to_drop(spill_pool, tmp_path, monkeypatch, caplog):
    def enospc(fd, bufs, off):
        raise OSError(errno.ENOSPC, "No space left on device")

    with cxlkv.open_pool(spill_pool) as pool:
        kv = KVCache(pool, **ARGS, spill_dir=tmp_path / "spill", spill_bytes=64 * MiB)
        sp = spill.store_of(pool)
        monkeypatch.setattr(os, "pwritev", enospc)
        ss = fill(kv)
        sp.flush()
        monkeypatch.undo()
        st = sp.stats()
        assert st["written"] == 0 and st["dropped_disk"] > 0
        assert st["blocks"] == 0 and st["used_bytes"] == 0
        assert on_disk(tmp_path / "spill") == (0, 0)     # claimed slots freed again
        assert any(kv.match(t) < len(t) for t in ss)
        for t in ss[:5]:
            kv.load_into(t, bytearray(4 * BB))
    assert sum("No space left" in r.getMessage() for r in caplog.records) == 1
    fsck_clean(spill_pool)


def test_unusable_directory_and_full_queue_drop(spill_pool, tmp_path):
    bad = tmp_path / "file"
    bad.write_text("not a directory")
    with cxlkv.open_pool(spill_pool) as pool:
        kv = KVCache(pool, **ARGS, spill_dir=bad / "spill", spill_bytes=64 * MiB)
        fill(kv)
        st = spill.store_of(pool).stats()
        assert st["dropped_disk"] > 0 and st["written"] == 0
    with cxlkv.open_pool(spill_pool) as pool:
        spill.enable(pool, tmp_path / "q", 64 * MiB, queue_bytes=BB - 1)
        kv = pool.kv(**ARGS)
        fill(kv, 80)
        st = spill.store_of(pool).stats()
        assert st["dropped_queue-full"] > 0 and st["written"] == 0


def test_one_directory_one_owner_and_one_store_per_pool(spill_pool, tmp_path):
    with cxlkv.open_pool(spill_pool) as pool:
        sp = spill.enable(pool, tmp_path / "a", MiB)
        assert sp.mode == "owner" and sp.stats()["mode"] == "owner"
        assert spill.enable(pool, tmp_path / "a", MiB) is spill.store_of(pool)
        with pytest.raises(UsageError):
            spill.enable(pool, tmp_path / "b", MiB)
        with pytest.raises(spill.SpillDirBusy, match=f"pid {os.getpid()}"):
            spill.SpillStore(tmp_path / "a", MiB, mode="owner")     # owned by the first
        with pytest.raises(UsageError):
            spill.SpillStore(tmp_path / "a", MiB, mode="boss")
        r = spill.SpillStore(tmp_path / "a", 5, writers=1)           # auto: a reader
        assert r.mode == "reader" and r.stats()["max_bytes"] == MiB   # the owner's limit
        r.close()
        with pytest.raises(UsageError):
            KVCache(pool, **ARGS, spill_dir=tmp_path / "a")
        spill.disable(pool)
        assert spill.store_of(pool) is None


def test_own_size_limit_and_lru(tmp_path):
    n = 1000
    size = spill.footprint(n)
    # one writer: blocks reach the index in the order they were offered (with
    # two, concurrent writes finish in either order - an LRU tie)
    st = spill.SpillStore(tmp_path / "s", 3 * size, writers=1)
    nsd = b"n" * 16
    keys = [bytes([i]) * 16 for i in range(6)]
    for k in keys[:3]:
        assert st.offer(k, nsd, k[:1] * n)
    st.flush()
    assert st.stats()["blocks"] == 3 and st.stats()["used_bytes"] == 3 * size
    assert st.get(keys[0], nsd, n) == keys[0][:1] * n     # touch: 1 is now oldest
    assert st.get(keys[0], b"x" * 16, n) is None          # another namespace: corrupt
    assert st.offer(keys[0], nsd, keys[0][:1] * n)
    st.flush()
    assert st.offer(keys[3], nsd, keys[3][:1] * n)
    st.flush()
    assert st.run([keys[3]]) == 1 and st.run([keys[1]]) == 0
    assert st.run([keys[2]]) == 1 and st.run([keys[0]]) == 1
    assert st.locate(keys[1]) is None
    st.get(keys[2], nsd, n)
    st.offer(keys[4], nsd, keys[4][:1] * n)
    st.offer(keys[5], nsd, keys[5][:1] * n)
    st.flush()
    s = st.stats()
    assert s["used_bytes"] <= 3 * size and s["blocks"] == 3 and s["evicted"] == 3
    assert [st.run([k]) for k in keys] == [0, 0, 1, 0, 1, 1]
    assert on_disk(tmp_path / "s") == (3, s["used_bytes"])
    assert st.offer(keys[0], nsd, b"z" * (4 * size)) and (st.flush() or True)
    assert st.stats()["dropped_store-full"] == 1           # bigger than the whole store
    st.close()
    # reopened: the index is rebuilt from the files, oldest first
    st2 = spill.SpillStore(tmp_path / "s", 3 * size, writers=1)
    assert st2.stats()["blocks"] == 3 and st2.get(keys[5], nsd, n) == keys[5][:1] * n
    st2.close()


def test_directory_of_a_closed_pool_is_taken_over(spill_pool, tmp_path):
    with cxlkv.open_pool(spill_pool) as pool:
        kv = KVCache(pool, **ARGS, spill_dir=tmp_path / "s", spill_bytes=64 * MiB)
        ss = fill(kv)                       # closed without disable(): the queue stays
    with cxlkv.open_pool(spill_pool) as pool:
        kv = KVCache(pool, **ARGS, spill_dir=tmp_path / "s", spill_bytes=64 * MiB)
        sp = spill.store_of(pool)
        assert sp.stats()["blocks"] > 0     # the old store's queue was written first
        assert all(kv.match(t) == len(t) for t in ss)
        spill.disable(pool)


def test_manager_mode_spills_another_nodes_blocks_fresh(pool_path, tmp_path, monkeypatch):
    """Non-coherent memory: the evictor's copy for the spill store reads the
    payload another node wrote, not a stale line of its own."""
    import subprocess
    import sys

    monkeypatch.setenv("CXLKV_NONCOHERENT", "1")
    monkeypatch.setenv("CXLKV_NC_EVICT_EVERY", "0")
    init_pool(pool_path, {"size": 16 * MiB, "chunk_size": 256 * 1024, "max_nodes": 8,
                          "sync": "manager", "lease_ms": 2000})
    env = {k: v for k, v in os.environ.items() if not k.startswith("CXLKV_N")}
    mgr = subprocess.Popen([sys.executable, "-m", "cxlkv", "lock-manager", "--pool", pool_path],
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        pa, pb = cxlkv.open_pool(pool_path), cxlkv.open_pool(pool_path)
        a = dict(ARGS, block_bytes=4096)
        ka = KVCache(pa, **a, spill_dir=tmp_path / "s", spill_bytes=64 * MiB)
        kb = pb.kv(**a)
        t = list(range(64))
        kb.store(t, b"0" * 4096 * 4)
        _, _, _, pay = ka._lookup(ka._keys(t))
        for off in pay:                              # A caches the old payload lines
            assert pa.mapping.read(int(off), 4096)[:1] == b"0"
        kb.drop()
        pb.close()                                   # a new node searches for room from
        pb = cxlkv.open_pool(pool_path)              # the start: it reuses the freed slots
        kb = pb.kv(**a)
        kb.store(t, pattern(kb, t))                  # new content in the same slots
        reused = set(int(x) for x in kb._lookup(kb._keys(t))[3]) & set(int(x) for x in pay)
        with pa.lock():
            from cxlkv.kv.area import Area

            Area(pa).evict(need_bytes=1 << 40)       # A evicts and spills B's blocks
        assert not in_pool(ka, t).any()
        spill.store_of(pa).flush()
        out = bytearray(4 * 4096)
        assert ka.load_into(t, out) == 4
        assert bytes(out) == b"".join(pattern(kb, t))
        assert reused                                # the case this test is about
        spill.disable(pa)
        pa.close()
        pb.close()
    finally:
        mgr.terminate()
        mgr.wait(30)
    fsck_clean(pool_path)


def test_pool_kv_passes_the_spill_options(tmp_path):
    import cxlkv
    from cxlkv.kv.tiers import spill

    path = str(tmp_path / "p.pool")
    cxlkv.init_pool(path, {"size": 8 << 20, "chunk_size": 256 * 1024, "max_nodes": 4})
    with cxlkv.open_pool(path) as pool:
        pool.kv(model="m", block_tokens=4, block_bytes=4096, spill_dir=str(tmp_path / "spill"),
                spill_bytes=1 << 20)
        assert spill.store_of(pool) is not None


# -- one store per host: an owner and readers ------------------------------------------------

NSD = b"n" * 16
N = 1000
SIZE = spill.footprint(N)


def blk(i: int) -> tuple[bytes, bytes]:
    """(key, payload) of test block i."""
    k = i.to_bytes(4, "little") * 4
    return k, k[:1] * N


def blk_bytes(d) -> int:
    return on_disk(d)[1]


def test_reader_sees_the_owners_blocks_and_removes_a_corrupt_one(tmp_path):
    d = tmp_path / "s"
    own = spill.SpillStore(d, 64 * SIZE, writers=1)
    rd = spill.SpillStore(d, 1, writers=1)                    # auto: the directory is owned
    try:
        assert (own.mode, rd.mode) == ("owner", "reader")
        assert rd.stats()["max_bytes"] == 64 * SIZE           # the owner's limit, not its own
        for i in range(4):
            assert own.offer(*blk(i)[:1], NSD, blk(i)[1])
        own.flush()
        keys = [blk(i)[0] for i in range(5)]
        assert rd.run(keys) == 4 and rd.run(keys[4:] + keys[:4]) == 0   # stops at a miss
        before = stamp(own, keys[0])
        assert rd.get(keys[0], NSD, N) == blk(0)[1]
        assert stamp(own, keys[0]) > before                    # the owner can see the use
        # a corrupt block seen by the reader: a miss, freed, its bytes off the count
        path, off, _ = own.locate(keys[1])
        poke(path, off + 7, bytes([peek(path, off + 7, 1)[0] ^ 1]))
        assert rd.get(keys[1], NSD, N) is None and own.locate(keys[1]) is None
        assert rd.stats()["corrupt"] == 1
        assert rd.stats()["used_bytes"] == own.stats()["used_bytes"] == 3 * SIZE == blk_bytes(d)
        assert rd.run(keys[1:2]) == 0
        # the owner's index still has it: removed there without counting it twice
        assert own.get(keys[1], NSD, N) is None and own.stats()["used_bytes"] == 3 * SIZE
        # a reader's own evictions are written by its own writers, and found by the owner
        assert rd.offer(*blk(9)[:1], NSD, blk(9)[1])
        rd.flush()
        assert rd.stats()["written"] == 1
        own.maintain()                  # folds the readers' journal in (else within MAINTAIN_S)
        assert own.run([blk(9)[0]]) == 1 and own.stats()["discovered"] == 1
        assert own.get(blk(9)[0], NSD, N) == blk(9)[1]
        assert own.stats()["used_bytes"] == 4 * SIZE == blk_bytes(d)
        # an evicted block the reader has seen on disk is not copied nor written
        # again, only touched; one the owner removed meanwhile is dropped ("gone")
        path, _, hoff = own.locate(keys[2])
        poke(path, hoff + 64, struct.pack("<Q", 1))
        assert not rd.offer(*blk(2)[:1], NSD, blk(2)[1])
        rd.flush()
        assert rd.stats()["already"] == 1 and rd.stats()["written"] == 1
        assert stamp(own, keys[2]) > 1
        path, _, hoff = own.locate(keys[3])
        poke(path, hoff + 5, b"\0")                  # its slot freed behind the reader's back
        assert not rd.offer(*blk(3)[:1], NSD, blk(3)[1])
        rd.flush()
        assert rd.stats()["dropped_gone"] == 1 and rd.stats()["already"] == 1
        assert rd.offer(*blk(3)[:1], NSD, blk(3)[1])       # forgotten: written next time
        rd.flush()
        assert rd.stats()["written"] == 2
    finally:
        rd.close()
        own.close()


def test_second_chance_for_a_file_a_reader_used(tmp_path):
    """The owner's least recently used file was read by a reader since: it
    stays (moved to the recent end) and the next one goes."""
    d = tmp_path / "s"
    # 8 blocks; with a reader attached the owner keeps 1/8 free for readers: 7
    own = spill.SpillStore(d, 8 * SIZE, writers=1)
    rd = spill.SpillStore(d, 0, mode="reader", writers=1)
    try:
        own.maintain()                    # sees the reader now (else within MAINTAIN_S)
        for i in range(7):                                 # A (0) is the oldest
            own.offer(*blk(i)[:1], NSD, blk(i)[1])
        own.flush()
        assert own.stats()["blocks"] == 7 and own.stats()["evicted"] == 0
        assert rd.get(blk(0)[0], NSD, N) == blk(0)[1]      # a reader uses A
        own.offer(*blk(7)[:1], NSD, blk(7)[1])
        own.flush()
        s = own.stats()
        assert s["second_chance"] == 1 and s["evicted"] == 1, s
        assert own.locate(blk(0)[0]) is not None           # A survived
        assert own.locate(blk(1)[0]) is None               # B, untouched and older, went
        assert s["used_bytes"] == 7 * SIZE == blk_bytes(d)
        # A is now the most recent: the next two writes take C and D
        own.offer(*blk(8)[:1], NSD, blk(8)[1])
        own.offer(*blk(10)[:1], NSD, blk(10)[1])
        own.flush()
        assert [own.run([blk(i)[0]]) for i in range(4)] == [1, 0, 0, 0]
        # no reader left: the owner may fill the whole limit again
        rd.close()
        own.maintain()
        own.offer(*blk(11)[:1], NSD, blk(11)[1])
        own.flush()
        assert own.stats()["used_bytes"] == 8 * SIZE
    finally:
        rd.close()
        own.close()


def test_size_limit_holds_with_owner_and_reader_writing(tmp_path):
    import threading

    d = tmp_path / "s"
    limit = 20 * SIZE
    own = spill.SpillStore(d, limit)
    rd = spill.SpillStore(d, limit, mode="reader")
    own.maintain()                      # sees the reader now: keeps room for its writes
    seen = []
    done = threading.Event()

    def watch():
        while not done.is_set():
            seen.append(own._header()[0])

    def offer(store, base):
        for i in range(base, base + 150):
            while not store.offer(*blk(i)[:1], NSD, blk(i)[1]):
                store.flush()                            # queue full: wait for the writers

    w = threading.Thread(target=watch)
    w.start()
    ts = [threading.Thread(target=offer, args=(s, b)) for s, b in ((own, 0), (rd, 1000))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    own.flush()
    rd.flush()
    done.set()
    w.join()
    try:
        assert max(seen) <= limit                       # the shared count, all along
        assert own.stats()["used_bytes"] == blk_bytes(d) <= limit
        assert own.stats()["written"] > 0 and rd.stats()["written"] > 0
        own.maintain()                                  # readers' files found; their room freed
        s = own.stats()
        assert s["discovered"] > 0 and s["evicted"] > 0
        assert s["used_bytes"] == blk_bytes(d) <= limit - limit // 8
        # every block is known to the owner: it can empty the store entirely
        assert on_disk(d)[0] == s["blocks"]
    finally:
        rd.close()
        own.close()


def test_owner_gone_reader_stays_reader_next_enable_owns(spill_pool, tmp_path):
    d = tmp_path / "s"
    own = spill.SpillStore(d, 8 * SIZE, writers=1)
    for i in range(3):
        own.offer(*blk(i)[:1], NSD, blk(i)[1])
    own.flush()
    with cxlkv.open_pool(spill_pool) as pool:
        rd = spill.enable(pool, d, 1)
        assert rd.mode == "reader"
        own.close()                                      # the owner goes away
        assert rd.mode == "reader"                       # ... its readers stay readers
        assert rd.offer(*blk(5)[:1], NSD, blk(5)[1]) and (rd.flush() or True)
        assert rd.stats()["written"] == 1 and rd.stats()["used_bytes"] == 4 * SIZE
        for i in range(6, 12):                           # nobody trims: writes stop at the limit
            rd.offer(*blk(i)[:1], NSD, blk(i)[1])
        rd.flush()
        assert rd.stats()["used_bytes"] == 8 * SIZE == blk_bytes(d)
        assert rd.stats()["dropped_store-full"] == 2
        assert rd.get(blk(0)[0], NSD, N) == blk(0)[1]    # reads go on
        spill.disable(pool)
        # the lock is free: the next enable in auto mode owns it and recounts
        pool2 = pool
        nxt = spill.enable(pool2, d, 8 * SIZE)
        assert nxt.mode == "owner" and nxt.stats()["blocks"] == 8
        assert nxt.stats()["used_bytes"] == 8 * SIZE
        spill.disable(pool2)


def test_collector_for_a_serving_process(spill_pool, tmp_path):
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    with cxlkv.open_pool(spill_pool) as pool:
        reg = CollectorRegistry()
        reg.register(spill.collector(pool))
        assert b"cxlkv_spill" not in generate_latest(reg)        # no store yet: no samples
        kv = KVCache(pool, **ARGS, spill_dir=tmp_path / "spill", spill_bytes=64 * MiB)
        sp = spill.store_of(pool)
        ss = fill(kv)
        sp.flush()
        cold = [t for t in ss if not in_pool(kv, t)[0]][:3]
        for t in cold:
            assert kv.load_into(t, bytearray(4 * BB)) == 4
        sp.flush()          # promotions evict, and what they evict is being written
        st = sp.stats()
        got = {}
        for fam in text_string_to_metric_families(generate_latest(reg).decode()):
            for s in fam.samples:
                got[(s.name, tuple(sorted(s.labels.items())))] = s.value
        one = lambda n, **lb: got[(n, tuple(sorted(lb.items())))]   # noqa: E731
        assert one("cxlkv_spill_written_blocks_total") == st["written"] > 0
        assert one("cxlkv_spill_written_bytes_total") == st["written"] * BB
        assert one("cxlkv_spill_hits_total") == st["hits"] >= 12
        assert one("cxlkv_spill_promoted_blocks_total") == st["promoted"] >= 12
        assert one("cxlkv_spill_corrupt_total") == 0
        assert one("cxlkv_spill_dropped_blocks_total", reason="disk") == 0
        assert one("cxlkv_spill_dropped_blocks_total", reason="queue-full") == \
            st["dropped_queue-full"]
        assert one("cxlkv_spill_store_bytes") == st["used_bytes"] > 0
        assert one("cxlkv_spill_limit_bytes") == 64 * MiB
        assert one("cxlkv_spill_queue_limit_bytes") == spill.QUEUE_BYTES
        assert one("cxlkv_spill_owner") == 1
        spill.disable(pool)


def test_drops_go_to_a_given_logger_once_per_kind(tmp_path):
    import logging

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    log = logging.getLogger("test.spill.drops")
    log.addHandler(Keep())
    log.propagate = False
    st = spill.SpillStore(tmp_path / "s", SIZE // 2, logger=log)
    for i in range(3):
        st.offer(*blk(i)[:1], NSD, blk(i)[1])
    st.flush()
    st.close()
    assert st.stats()["dropped_store-full"] == 3
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    assert records[0].fields == {"spill_dir": str(tmp_path / "s"), "reason": "store-full"}
    assert "store-full" in records[0].getMessage()


def test_owner_start_frees_the_slots_of_dead_writers_only(tmp_path):
    """A slot claimed (WRITING) by a writer that is gone is freed by the next
    owner's recount; one of a live writer stays claimed and counted."""
    import subprocess
    import sys

    d = tmp_path / "s"
    st = spill.SpillStore(d, 16 * SIZE, writers=1)
    st.offer(*blk(0)[:1], NSD, blk(0)[1])
    st.flush()
    st.close()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    sf = spill.SlotFile.open(d / spill.file_name(spill.slot_bytes(N)))
    dead = sf.claim(blk(1)[0], int(gone.stdout))
    live = sf.claim(blk(2)[0], 1)                              # pid 1 is alive
    assert isinstance(dead, int) and isinstance(live, int)
    sf.close()
    st = spill.SpillStore(d, 16 * SIZE)
    try:
        sf = st._files[spill.slot_bytes(N)]
        assert sf.states[dead] == 0 and sf.states[live] == 1  # FREE, WRITING
        assert st.stats()["blocks"] == 1                        # only the published block
        assert st.stats()["used_bytes"] == 2 * SIZE             # ... and the live claim
        assert st.get(blk(0)[0], NSD, N) == blk(0)[1]
        assert st.get(blk(1)[0], NSD, N) is None
    finally:
        st.close()


def test_a_readers_stale_index_entry_is_a_miss_then_forgotten(tmp_path):
    d = tmp_path / "s"
    own = spill.SpillStore(d, 2 * SIZE, writers=1)
    rd = spill.SpillStore(d, 0, mode="reader", writers=1)
    try:
        own.offer(*blk(0)[:1], NSD, blk(0)[1])
        own.flush()
        assert rd.run([blk(0)[0]]) == 1                     # found by stat, remembered
        own.maintain()                                       # readers attached: room kept
        own.offer(*blk(1)[:1], NSD, blk(1)[1])
        own.flush()                                          # 0 went to make room
        assert own.locate(blk(0)[0]) is None
        assert rd.run([blk(0)[0]]) == 1                     # stale: the reader's index
        assert rd.get(blk(0)[0], NSD, N) is None            # a miss...
        assert rd.run([blk(0)[0]]) == 0                     # ... and forgotten
        assert rd.stats()["misses"] == 1 and rd.stats()["corrupt"] == 0
    finally:
        rd.close()
        own.close()


def _hold_writers(store):
    """Make `store`'s writer threads wait before writing anything until the
    returned event is set."""
    go = threading.Event()
    write = store._write_batch

    def held(items):
        assert go.wait(60), "the test never let the writers go"
        write(items)

    store._write_batch = held
    return go


def test_a_block_waiting_for_the_writers_is_a_hit_from_the_queue(spill_pool, tmp_path):
    """Evicted blocks the writers have not written yet are matched and
    promoted from the queue (bit-exact, counted as queued hits), not missed;
    once written they come from the disk."""
    with cxlkv.open_pool(spill_pool) as pool:
        kv = KVCache(pool, **ARGS, spill_dir=tmp_path / "spill", spill_bytes=64 * MiB)
        sp = spill.store_of(pool)
        go = _hold_writers(sp)
        try:
            ss = fill(kv)
            evicted = [t for t in ss if not in_pool(kv, t).any()]
            assert evicted, "the pool did not overflow"
            assert sp.stats()["written"] == 0 and sp.stats()["queued_bytes"] > 0
            t = evicted[0]
            assert kv.match(t) == len(t)
            out = bytearray(4 * BB)
            assert kv.load_into(t, out) == 4
            assert bytes(out) == b"".join(pattern(kv, t))
            st = sp.stats()
            assert st["queued_hits"] == st["hits"] == 4 and st["written"] == 0, st
        finally:
            go.set()
        sp.flush()
        t = evicted[-1]
        assert not in_pool(kv, t).any() and sp.stats()["written"] > 0
        assert kv.load_into(t, out) == 4
        assert bytes(out) == b"".join(pattern(kv, t))
        st = sp.stats()
        assert st["queued_hits"] == 4 and st["hits"] == 8, st
        spill.disable(pool)
    fsck_clean(spill_pool)


def test_a_block_read_from_the_queue_keeps_its_bytes_when_the_buffer_is_reused(tmp_path):
    """take() copies evicted blocks into buffers the writers give back; a
    block fetched from the queue is a copy of its own: the buffer going to
    the next evicted block does not change it.  Another namespace's block of
    the same key is not served from the queue."""
    st = spill.SpillStore(tmp_path / "s", 64 * MiB, queue_bytes=8 * MiB)
    try:
        go = _hold_writers(st)
        ns = b"n" * 16

        def copier(payload):
            def copy(dst):
                memoryview(dst).cast("B")[:] = payload
                return ns
            return copy

        (ka, a), (kb, b) = blk(1), blk(2)
        assert st.take(ka, len(a), copier(a))
        got = st.fetch([ka], ns, len(a))
        assert [bytes(v) for v in got] == [a]
        assert st.fetch([ka], b"m" * 16, len(a)) == []          # not its namespace
        go.set()
        st.flush()
        assert st.take(kb, len(b), copier(b))                    # reuses a's buffer
        st.flush()
        assert bytes(got[0]) == a
        assert [bytes(v) for v in st.fetch([ka, kb], ns, len(a))] == [a, b]
        s = st.stats()
        assert s["queued_hits"] == 1 and s["written"] == 2 and s["dropped"] == 0, s
    finally:
        st.close()
