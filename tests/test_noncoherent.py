"""The non-coherence emulation: each Mapping made with CXLKV_NONCOHERENT=1 is
a host with its own cache; two of them on one file are two hosts."""
from __future__ import annotations

import os

import pytest

import cxlkv
from cxlkv import _core
from cxlkv.pool.admin import init_pool

SIZE = 1 << 20


@pytest.fixture
def hosts(tmp_path, monkeypatch):
    """Make 'host' mappings of one file, each with its own emulated cache."""
    path = tmp_path / "shared.bin"
    with open(path, "wb") as f:
        f.truncate(SIZE)
    monkeypatch.setenv("CXLKV_NONCOHERENT", "1")
    monkeypatch.setenv("CXLKV_NC_EVICT_EVERY", "0")     # no random write-backs: deterministic
    made = []

    def host(**env):
        for k, v in env.items():
            monkeypatch.setenv(k, str(v))
        fd = os.open(path, os.O_RDWR)
        try:
            m = _core.Mapping(fd, SIZE)
        finally:
            os.close(fd)
        for k in env:
            monkeypatch.delenv(k)
        made.append(m)
        assert m.noncoherent
        return m

    yield host
    for m in made:
        m.close()


def test_store_is_invisible_until_flushed(hosts):
    a, b = hosts(), hosts()
    a.store64(0, 42)
    b.invalidate(0, 8)
    assert b.load64(0) == 0              # still in a's cache
    a.flush(0, 8)
    assert b.load64(0) == 0              # b reads its own (stale) line
    b.invalidate(0, 8)
    assert b.load64(0) == 42             # invalidate, then read memory


def test_stale_reads_without_invalidate(hosts):
    a, b = hosts(), hosts()
    assert b.read(64, 8) == bytes(8)     # b caches the line
    a.write(64, b"newvalue")             # write() reaches memory
    assert b.read(64, 8) == bytes(8)     # stale
    b.invalidate(64, 8)
    assert b.read(64, 8) == b"newvalue"


def test_atomics_are_not_atomic_across_hosts(hosts):
    a, b = hosts(), hosts()
    b.load64(128)                        # b has the line cached at 0
    for _ in range(1000):
        a.fetch_add64(128, 1)
    a.flush(128, 8)
    for _ in range(1000):
        b.fetch_add64(128, 1)            # on b's stale copy
    b.flush(128, 8)
    c = hosts()
    assert c.load64(128) == 1000         # one host's updates are lost: no cross-host atomics


def test_invalidate_writes_dirty_lines_back(hosts):
    a, b = hosts(), hosts()
    a.store64(256, 7)
    a.invalidate(256, 8)                 # like CLFLUSH: write back, then drop
    assert b.load64(256) == 7


def test_views_show_memory_after_write_back(hosts):
    a = hosts()
    a.store64(512, 9)                    # dirty in a's cache
    v = a.view(512, 8)
    assert int.from_bytes(bytes(v), "little") == 9
    v.release()


def test_random_evictions_write_dirty_lines_back(hosts):
    a = hosts(CXLKV_NC_EVICT_EVERY=1, CXLKV_NONCOHERENT_SEED=7)
    b = hosts()
    a.store64(1024, 5)
    for i in range(20_000):              # other traffic evicts the dirty line sooner or later
        a.load64((i % 4096) * 64 + 8192)
    b.invalidate(1024, 8)
    assert b.load64(1024) == 5
    assert a.nc_stats()["evictions"] > 0


def test_drop_flush_hook_loses_a_flush(hosts):
    a = hosts(CXLKV_NC_DROP_FLUSH=1)     # every flush is "forgotten"
    b = hosts()
    a.store64(2048, 3)
    a.flush(2048, 8)
    b.invalidate(2048, 8)
    assert b.load64(2048) == 0
    assert a.nc_stats()["dropped_flushes"] == 1


def test_coherent_mapping_has_no_stats(tmp_path):
    p = tmp_path / "c.bin"
    p.write_bytes(bytes(4096))
    fd = os.open(p, os.O_RDWR)
    try:
        with _core.Mapping(fd, 4096) as m:
            assert not m.noncoherent and m.nc_stats() is None
    finally:
        os.close(fd)


def test_cas_mode_refuses_noncoherent_hosts(pool_path, monkeypatch):
    init_pool(pool_path, {"size": 8 << 20, "chunk_size": 64 << 10})
    monkeypatch.setenv("CXLKV_NONCOHERENT", "1")
    with pytest.raises(cxlkv.errors.RefusedError, match="coherent memory"):
        cxlkv.open_pool(pool_path)


def test_inspect_reports_the_memory_model(cli, small_pool):
    assert cli("inspect", "--pool", small_pool, "--json").json()["pool"]["memory_model"] == \
        "coherent"
    r = cli("inspect", "--pool", small_pool, "--json", env={"CXLKV_NONCOHERENT": "1"})
    assert r.json()["pool"]["memory_model"] == "noncoherent-emulated"
