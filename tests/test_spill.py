"""The NVMe spill tier (cxlkv.kv.spill): evicted blocks go to a bounded
directory and come back bit-exact; corrupt and truncated files are misses
and are removed; a full or failing disk or a full queue drops, never an
error; the store's own size limit and LRU."""
from __future__ import annotations

import errno
import os

import numpy as np
import pytest

import cxlkv
from cxlkv.errors import UsageError
from cxlkv.kv import spill as SP
from cxlkv.kv.cache import KVCache
from cxlkv.pool.admin import init_pool
from cxlkv.pool.pool import Pool
from cxlkv.state.fsck import check

MiB = 1 << 20
BB = 64 * 1024
ARGS = {"model": "m", "block_tokens": 16, "block_bytes": BB}


@pytest.fixture
def kvpool(pool_path):
    init_pool(pool_path, {"size": 8 * MiB, "chunk_size": 256 * 1024, "max_nodes": 8,
                          "lease_ms": 300})
    return pool_path


def pattern(kv, toks) -> list[bytes]:
    """Distinct, checkable content per block (its chain hash repeated)."""
    return [h * (kv.block_bytes // len(h)) for h in kv.block_hashes(toks)]


def seqs(n, blocks=4):
    return [list(range(s * 1000, s * 1000 + 16 * blocks)) for s in range(n)]


def in_pool(kv, toks) -> np.ndarray:
    _, _, ctl, _ = kv._lookup(kv._keys(toks), stop=False)
    return ctl != 0


def fill(kv, n=60):
    """Store n sequences of 4 blocks (15 MiB through an 8 MiB pool)."""
    ss = seqs(n)
    for t in ss:
        kv.store(t, pattern(kv, t))
    return ss


def fsck_clean(path):
    with Pool.open(path, writable=False) as p:
        rep = check(p)
    assert rep.clean, [f.to_json() for f in rep.errors]


def test_spill_and_promote_round_trip_is_bit_exact(kvpool, tmp_path):
    d = tmp_path / "spill"
    with cxlkv.open_pool(kvpool) as pool:
        kv = KVCache(pool, **ARGS, spill_dir=d, spill_bytes=64 * MiB)
        sp = SP.store_of(pool)
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
        SP.disable(pool)                     # writes what is queued
        assert SP.store_of(pool) is None
        blocks = len(list(d.rglob("*.blk")))
    fsck_clean(kvpool)
    # the directory survives the process: a new store indexes it again
    with cxlkv.open_pool(kvpool) as pool:
        kv = KVCache(pool, **ARGS, spill_dir=d, spill_bytes=64 * MiB)
        assert SP.store_of(pool).stats()["blocks"] == blocks > 0


def test_without_spill_evicted_blocks_are_gone(kvpool):
    with cxlkv.open_pool(kvpool) as pool:
        kv = pool.kv(**ARGS)
        ss = fill(kv)
        assert SP.store_of(pool) is None
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


def test_corrupt_and_truncated_spill_files_are_misses_and_removed(kvpool, tmp_path):
    with cxlkv.open_pool(kvpool) as pool:
        kv = KVCache(pool, **ARGS, spill_dir=tmp_path / "spill", spill_bytes=64 * MiB)
        sp = SP.store_of(pool)
        ss = fill(kv)
        sp.flush()
        cand = _spilled_only(kv, sp, ss)
        assert len(cand) >= 3
        (t1, j1), (t2, j2), (t3, j3) = cand[:3]
        f1 = sp._file(bytes(kv._keys(t1)[j1]))
        f2 = sp._file(bytes(kv._keys(t2)[j2]))
        f3 = sp._file(bytes(kv._keys(t3)[j3]))
        raw = bytearray(f1.read_bytes())
        raw[SP.HDR_SIZE + 1000] ^= 0x40                  # one bit of the payload
        f1.write_bytes(bytes(raw))
        with open(f2, "r+b") as f:
            f.truncate(SP.HDR_SIZE + BB // 2)
        raw = bytearray(f3.read_bytes())
        raw[20] ^= 1                                      # the header (its key)
        f3.write_bytes(bytes(raw))
        for t, j, f in ((t1, j1, f1), (t2, j2, f2), (t3, j3, f3)):
            out = bytearray(len(t) // 16 * BB)
            got = kv.load_into(t, out)
            assert got == j                              # the bad block is a miss
            assert bytes(out[:got * BB]) == b"".join(pattern(kv, t)[:got])
            assert not f.exists()
            assert kv.match(t) == j * 16                 # and stays one
        assert sp.stats()["corrupt"] == 3
    fsck_clean(kvpool)


def test_store_full_degrades_to_drop(kvpool, tmp_path, capsys):
    with cxlkv.open_pool(kvpool) as pool:
        kv = KVCache(pool, **ARGS, spill_dir=tmp_path / "spill", spill_bytes=0)
        sp = SP.store_of(pool)
        ss = fill(kv)
        sp.flush()
        st = sp.stats()
        assert st["written"] == 0 and st["dropped_store-full"] > 0 and st["blocks"] == 0
        assert any(kv.match(t) < len(t) for t in ss)
    err = capsys.readouterr().err
    assert err.count("store-full") == 1                  # one log line


def test_failing_disk_degrades_to_drop(kvpool, tmp_path, monkeypatch, capsys):
    def enospc(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    with cxlkv.open_pool(kvpool) as pool:
        kv = KVCache(pool, **ARGS, spill_dir=tmp_path / "spill", spill_bytes=64 * MiB)
        sp = SP.store_of(pool)
        monkeypatch.setattr(SP.os, "write", enospc)
        ss = fill(kv)
        sp.flush()
        monkeypatch.undo()
        st = sp.stats()
        assert st["written"] == 0 and st["dropped_disk"] > 0
        assert st["blocks"] == 0 and st["used_bytes"] == 0
        assert not list((tmp_path / "spill").rglob("*.tmp"))
        assert not list((tmp_path / "spill").rglob("*.blk"))
        assert any(kv.match(t) < len(t) for t in ss)
        for t in ss[:5]:
            kv.load_into(t, bytearray(4 * BB))
    assert capsys.readouterr().err.count("No space left") == 1
    fsck_clean(kvpool)


def test_unusable_directory_and_full_queue_drop(kvpool, tmp_path):
    bad = tmp_path / "file"
    bad.write_text("not a directory")
    with cxlkv.open_pool(kvpool) as pool:
        kv = KVCache(pool, **ARGS, spill_dir=bad / "spill", spill_bytes=64 * MiB)
        fill(kv)
        st = SP.store_of(pool).stats()
        assert st["dropped_disk"] > 0 and st["written"] == 0
    with cxlkv.open_pool(kvpool) as pool:
        SP.enable(pool, tmp_path / "q", 64 * MiB, queue_bytes=BB - 1)
        kv = pool.kv(**ARGS)
        fill(kv, 80)
        st = SP.store_of(pool).stats()
        assert st["dropped_queue-full"] > 0 and st["written"] == 0


def test_one_directory_one_process_one_store(kvpool, tmp_path):
    with cxlkv.open_pool(kvpool) as pool:
        SP.enable(pool, tmp_path / "a", MiB)
        assert SP.enable(pool, tmp_path / "a", MiB) is SP.store_of(pool)
        with pytest.raises(UsageError):
            SP.enable(pool, tmp_path / "b", MiB)
        with pytest.raises(UsageError):
            SP.SpillStore(tmp_path / "a", MiB)          # locked by the first
        with pytest.raises(UsageError):
            KVCache(pool, **ARGS, spill_dir=tmp_path / "a")
        SP.disable(pool)
        assert SP.store_of(pool) is None


def test_own_size_limit_and_lru(tmp_path):
    n = 1000
    size = SP.HDR_SIZE + n
    # one writer: blocks reach the index in the order they were offered (with
    # two, concurrent writes finish in either order - an LRU tie)
    st = SP.SpillStore(tmp_path / "s", 3 * size, writers=1)
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
    assert not st._file(keys[1]).exists()
    st.get(keys[2], nsd, n)
    st.offer(keys[4], nsd, keys[4][:1] * n)
    st.offer(keys[5], nsd, keys[5][:1] * n)
    st.flush()
    s = st.stats()
    assert s["used_bytes"] <= 3 * size and s["blocks"] == 3 and s["evicted"] == 3
    assert [st.run([k]) for k in keys] == [0, 0, 1, 0, 1, 1]
    assert sum(f.stat().st_size for f in (tmp_path / "s").rglob("*.blk")) == s["used_bytes"]
    assert st.offer(keys[0], nsd, b"z" * (4 * size)) and (st.flush() or True)
    assert st.stats()["dropped_store-full"] == 1           # bigger than the whole store
    st.close()
    # reopened: the index is rebuilt from the files, oldest first
    st2 = SP.SpillStore(tmp_path / "s", 3 * size, writers=1)
    assert st2.stats()["blocks"] == 3 and st2.get(keys[5], nsd, n) == keys[5][:1] * n
    st2.close()


def test_directory_of_a_closed_pool_is_taken_over(kvpool, tmp_path):
    with cxlkv.open_pool(kvpool) as pool:
        kv = KVCache(pool, **ARGS, spill_dir=tmp_path / "s", spill_bytes=64 * MiB)
        ss = fill(kv)                       # closed without disable(): the queue stays
    with cxlkv.open_pool(kvpool) as pool:
        kv = KVCache(pool, **ARGS, spill_dir=tmp_path / "s", spill_bytes=64 * MiB)
        sp = SP.store_of(pool)
        assert sp.stats()["blocks"] > 0     # the old store's queue was written first
        assert all(kv.match(t) == len(t) for t in ss)
        SP.disable(pool)


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
        kb = pb.kv(**a)
        kb.store(t, pattern(kb, t))                  # new content, maybe the same slots
        reused = set(int(x) for x in kb._lookup(kb._keys(t))[3]) & set(int(x) for x in pay)
        with pa.lock():
            from cxlkv.kv.area import Area

            Area(pa).evict(need_bytes=1 << 40)       # A evicts and spills B's blocks
        assert not in_pool(ka, t).any()
        SP.store_of(pa).flush()
        out = bytearray(4 * 4096)
        assert ka.load_into(t, out) == 4
        assert bytes(out) == b"".join(pattern(kb, t))
        assert reused                                # the case this test is about
        SP.disable(pa)
        pa.close()
        pb.close()
    finally:
        mgr.terminate()
        mgr.wait(30)
    fsck_clean(pool_path)


def test_pool_kv_passes_the_spill_options(tmp_path):
    import cxlkv
    from cxlkv.kv import spill as S

    path = str(tmp_path / "p.pool")
    cxlkv.init_pool(path, {"size": 8 << 20, "chunk_size": 256 * 1024, "max_nodes": 4})
    with cxlkv.open_pool(path) as pool:
        pool.kv(model="m", block_tokens=4, block_bytes=4096, spill_dir=str(tmp_path / "spill"),
                spill_bytes=1 << 20)
        assert S.store_of(pool) is not None
