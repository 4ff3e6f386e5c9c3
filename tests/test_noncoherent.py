"""The non-coherence emulation: each Mapping made with CXLKV_NONCOHERENT=1 is
a host with its own cache; two of them on one file are two hosts."""
from __future__ import annotations

import os

import pytest
from hypothesis import given, settings, strategies as st

import cxlkv
from cxlkv import _core
from cxlkv.ops.init import init_pool

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


def test_views_show_this_hosts_own_stores(hosts):
    a = hosts()
    before = a.view(512, 16)
    a.store64(512, 9)                    # dirty in a's cache, not in memory
    v = a.view(512, 8)
    assert int.from_bytes(bytes(v), "little") == 9
    assert int.from_bytes(bytes(before[:8]), "little") == 9    # made before the store
    assert hosts().load64(512) == 0      # still not in memory: a view flushes nothing
    a.write(520, b"written!")            # the rest of the line ...
    assert bytes(before[8:]) == b"written!"
    assert hosts().load64(512) == 9      # ... went back whole, the dirty word with it
    v.release()
    before.release()


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


# -- every read path sees this host's cached copy -----------------------------------------
@pytest.mark.parametrize("n", [8 << 10, 256 << 10])
def test_large_reads_see_stale_lines_until_invalidated(hosts, n):
    """Reads of any size go through the cache: a missing invalidate before a
    large read returns the stale copy, not memory."""
    a, b = hosts(), hosts()
    off, new = 4096, bytes(range(256)) * (n // 256)
    assert b.read(off, n) == bytes(n)    # b caches the range
    a.write(off, new)
    assert b.read(off, n) == bytes(n)    # no invalidate: stale, every byte of it
    out = bytearray(n)
    b.readinto(off, out)
    assert out == bytes(n)
    b.invalidate(off, n)
    assert b.read(off, n) == new
    b.readinto(off, out)
    assert out == new


def test_a_read_fetches_lines_not_cached(hosts):
    a, b = hosts(), hosts()
    a.write(8192, b"x" * 20_000)
    assert b.read(8192, 20_000) == b"x" * 20_000     # first touch reads memory


def test_views_show_the_stale_copy_until_invalidated(hosts):
    """A view reads through the cache: a view of lines another host wrote
    since this one last invalidated them shows the stale copy (zero-copy:
    numpy sees it too); after the invalidate every view, old or new, shows
    memory."""
    import numpy as np

    a, b = hosts(), hosts()
    off, n = 64 << 10, 64 << 10
    old = b.view(off, n)                 # b caches the range, all zero
    a.write(off, b"\x01" * n)
    stale = b.view(off, n)
    assert not np.frombuffer(stale, dtype=np.uint8).any()
    assert not np.frombuffer(old, dtype=np.uint8).any()
    b.invalidate(off, n)
    fresh = b.view(off, n)
    assert bytes(fresh) == b"\x01" * n
    assert bytes(old) == b"\x01" * n     # made before the invalidate: shows memory after it
    assert np.frombuffer(stale, dtype=np.uint8).all()
    for v in (old, stale, fresh):
        v.release()


def test_a_view_of_lines_not_cached_shows_memory(hosts):
    a, b = hosts(), hosts()
    a.write(200_000, b"fresh" * 100)
    with b.view(200_000, 500) as v:
        assert bytes(v) == b"fresh" * 100


def test_a_view_does_not_invalidate_for_the_caller(hosts):
    """Regression: view() used to drop the range's cached lines itself, so a
    missing invalidate before a view went unnoticed."""
    a, b = hosts(), hosts()
    b.load64(300 * 64)
    a.store64(300 * 64, 77)
    a.flush(300 * 64, 8)
    with b.view(300 * 64, 8) as v:
        assert bytes(v) == bytes(8)
    assert b.load64(300 * 64) == 0


def test_writable_views_are_refused_under_the_emulation(hosts):
    a = hosts()
    with pytest.raises(BufferError, match="not emulated"):
        a.view(0, 64, True)
    with a.view(0, 64) as v:
        assert v.readonly


def test_read_blocks_invalidates_only_with_flush_meta(hosts):
    import numpy as np

    a, b = hosts(), hosts()
    offs = np.array([16384, 32768], dtype=np.uint64)
    dst = bytearray(2 * 8192)
    b.read_blocks(offs, dst, 8192)       # b caches both blocks
    a.write(16384, b"p" * 8192)
    a.write(32768, b"q" * 8192)
    b.read_blocks(offs, dst, 8192)
    assert dst == bytes(2 * 8192)        # nobody invalidated: stale
    b.flush_meta = True                  # manager mode: read_blocks invalidates first
    b.read_blocks(offs, dst, 8192)
    assert dst == b"p" * 8192 + b"q" * 8192


# -- whole-line write-back --------------------------------------------------------------------
LINE = 64 * 40


def _partial_write(b, kind):
    if kind == "write":
        b.write(LINE, b"B" * 8)
    elif kind == "zero":
        b.zero(LINE, 8)
    else:
        b.store64(LINE, int.from_bytes(b"B" * 8, "little"))
        b.flush(LINE, 8)


@pytest.mark.parametrize("kind", ["write", "zero", "store64"])
def test_a_partial_line_write_writes_back_its_stale_line(hosts, kind):
    """b writes 8 bytes of a line it holds a stale copy of: the whole line
    goes back, and a's bytes in the rest of the line are lost."""
    a, b = hosts(), hosts()
    b.read(LINE, 64)                     # b caches the line
    a.write(LINE + 32, b"A" * 8)         # a writes another part of it
    _partial_write(b, kind)
    line = hosts().read(LINE, 64)
    assert line[32:40] == bytes(8)       # clobbered by b's stale copy


@pytest.mark.parametrize("kind", ["write", "zero", "store64"])
def test_a_partial_line_write_after_an_invalidate_keeps_the_rest(hosts, kind):
    a, b = hosts(), hosts()
    b.read(LINE, 64)
    a.write(LINE + 32, b"A" * 8)
    b.invalidate(LINE, 64)               # the right pattern: drop the stale copy first
    _partial_write(b, kind)
    line = hosts().read(LINE, 64)
    assert line[32:40] == b"A" * 8
    assert line[:8] == (bytes(8) if kind == "zero" else b"B" * 8)


def test_a_partial_line_write_fetches_a_line_not_cached(hosts):
    a, b = hosts(), hosts()
    a.write(LINE + 32, b"A" * 8)
    b.write(LINE, b"B" * 8)              # b never had the line: fetched fresh
    assert hosts().read(LINE, 64)[32:40] == b"A" * 8


@pytest.mark.parametrize("nt", [False, True])
def test_a_long_write_writes_back_its_partial_head_and_tail_lines(hosts, nt):
    """[base+32, base+32+n): the first and last lines are partial and go
    back whole from b's cache; the whole lines between go to memory as
    written and clobber nothing of a's beyond the range."""
    a, b = hosts(), hosts()
    base, n = 64 * 100, 64 * 8
    b.read(base, n + 64)                 # b caches all nine lines
    a.write(base, b"h" * 8)              # the head line's rest
    a.write(base + 32 + n + 8, b"t" * 8)   # the tail line's rest
    a.write(base + 64 * 9, b"n" * 8)     # the line after the range
    b.write(base + 32, b"W" * n, nt)
    got = hosts().read(base, 64 * 10)
    assert got[32:32 + n] == b"W" * n
    assert got[:8] == bytes(8)           # head: b's stale copy went back
    assert got[32 + n + 8:32 + n + 16] == bytes(8)   # tail: likewise
    assert got[64 * 9:64 * 9 + 8] == b"n" * 8        # untouched line: a's bytes stay


def test_whole_line_writes_do_not_depend_on_the_cached_copy(hosts):
    a, b = hosts(), hosts()
    b.read(LINE, 128)                    # stale copies of both lines
    a.write(LINE + 64, b"A" * 64)
    b.write(LINE, b"B" * 64)             # exactly one whole line
    assert hosts().read(LINE, 128) == b"B" * 64 + b"A" * 64


# -- the drop-invalidate hook -------------------------------------------------------------
def test_drop_invalidate_hook_loses_an_invalidate(hosts):
    a = hosts()
    b = hosts(CXLKV_NC_DROP_INVALIDATE=2)     # every second invalidate is "forgotten"
    b.load64(4096)                       # cached
    a.store64(4096, 1)
    a.flush(4096, 8)
    b.invalidate(4096, 8)                # 1st: done
    assert b.load64(4096) == 1
    a.store64(4096, 2)
    a.flush(4096, 8)
    b.invalidate(4096, 8)                # 2nd: dropped
    assert b.load64(4096) == 1
    b.invalidate(4096, 8)                # 3rd: done
    assert b.load64(4096) == 2
    st = b.nc_stats()
    assert st["invalidates"] == 3 and st["dropped_invalidates"] == 1


def test_a_dropped_invalidate_writes_nothing_back(hosts):
    a = hosts(CXLKV_NC_DROP_INVALIDATE=1)
    a.store64(8192, 5)
    a.invalidate(8192, 8)                # dropped: no write-back either
    assert hosts().load64(8192) == 0
    assert a.load64(8192) == 5           # still a's dirty line


def test_a_dropped_invalidate_before_a_view_shows_the_stale_copy(hosts):
    a = hosts()
    b = hosts(CXLKV_NC_DROP_INVALIDATE=1)
    b.read(12288, 4096)
    a.write(12288, b"v" * 4096)
    b.invalidate(12288, 4096)            # dropped
    with b.view(12288, 4096) as v:
        assert bytes(v) == bytes(4096)


# -- the emulation against a model of it ------------------------------------------------------
class _ModelHost:
    """What one host holds, per the contract in nc.h (no random evictions):
    line -> [its 64 cached bytes, dirty]; and the lines a view has shown."""

    def __init__(self):
        self.lines: dict[int, list] = {}
        self.exposed: set[int] = set()


class _Model:
    def __init__(self, size: int):
        self.mem, self.size = bytearray(size), size

    def _len(self, n):
        return min(64, self.size - 64 * n)

    def fill(self, h, n):
        if n not in h.lines:
            h.lines[n] = [bytearray(self.mem[64 * n:64 * n + self._len(n)].ljust(64, b"\0")), False]
        return h.lines[n]

    def writeback(self, h, n):
        c = h.lines.get(n)
        if c and c[1]:
            self.mem[64 * n:64 * n + self._len(n)] = c[0][:self._len(n)]
            c[1] = False

    def cached(self, h, off, n):
        """What h reads at [off, off + n), filling the lines it lacks."""
        out = bytearray()
        for ln in range(off // 64, (off + n - 1) // 64 + 1):
            out += self.fill(h, ln)[0]
        return bytes(out[off % 64:off % 64 + n])

    def store(self, h, off, data):
        """A partial-line store: into the cached line, then written back whole."""
        c = self.fill(h, off // 64)
        c[0][off % 64:off % 64 + len(data)] = data
        c[1] = True

    def write(self, h, off, data):
        end, p = off + len(data), off
        a, b = -(-off // 64) * 64, end // 64 * 64
        if a >= b:
            a = b = end
        while p < end:
            n = p // 64
            if a <= p < b:                   # whole line: straight to memory
                self.mem[p:p + 64] = data[p - off:p - off + 64]
                if n in h.lines:
                    h.lines[n] = [bytearray(data[p - off:p - off + 64]), False]
                p += 64
                continue
            take = min(64 - p % 64, end - p)
            self.store(h, p, data[p - off:p - off + take])
            self.writeback(h, n)
            p += take

    def flush(self, h, off, n):
        for ln in range(off // 64, (off + n - 1) // 64 + 1):
            self.writeback(h, ln)

    def invalidate(self, h, off, n):
        for ln in range(off // 64, (off + n - 1) // 64 + 1):
            self.writeback(h, ln)
            h.lines.pop(ln, None)
            if ln in h.exposed:
                self.fill(h, ln)             # re-fetched at once


_SMALL = 1000                                # 15 lines and a short one of 40 bytes


def _ops():
    rng = st.tuples(st.integers(0, _SMALL - 1), st.integers(1, 300)).map(
        lambda t: (t[0], min(t[1], _SMALL - t[0])))
    word = st.integers(0, _SMALL // 8 - 1).map(lambda i: 8 * i)
    host = st.integers(0, 1)
    return st.lists(st.one_of(
        st.tuples(st.just("read"), host, rng),
        st.tuples(st.just("view"), host, rng),
        st.tuples(st.just("write"), host, rng, st.integers(1, 255)),
        st.tuples(st.just("zero"), host, rng),
        st.tuples(st.just("load64"), host, word),
        st.tuples(st.just("store64"), host, word, st.integers(0, 2**64 - 1)),
        st.tuples(st.just("flush"), host, rng),
        st.tuples(st.just("invalidate"), host, rng),
    ), max_size=40)


def _run_against_model(ops, preload):
    import numpy as np

    mem = np.zeros(_SMALL // 8, dtype=np.uint64)
    env = {"CXLKV_NONCOHERENT": "1", "CXLKV_NC_EVICT_EVERY": "0",
           "CXLKV_NC_PRELOAD": "1" if preload else "0"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        hosts = [_core.Mapping.from_buffer(mem), _core.Mapping.from_buffer(mem)]
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    model, mh, views = _Model(_SMALL), [_ModelHost(), _ModelHost()], []
    if preload:
        for h in mh:
            model.cached(h, 0, _SMALL)
    try:
        for op in ops:
            kind, i = op[0], op[1]
            m, h = hosts[i], mh[i]
            if kind == "read":
                (off, n), = op[2:]
                assert m.read(off, n) == model.cached(h, off, n), op
            elif kind == "view":
                (off, n), = op[2:]
                v = m.view(off, n)
                h.exposed.update(range(off // 64, (off + n - 1) // 64 + 1))
                assert bytes(v) == model.cached(h, off, n), op
                views.append((i, off, n, v))
            elif kind in ("write", "zero"):
                (off, n) = op[2]
                data = bytes([op[3]]) * n if kind == "write" else bytes(n)
                m.write(off, data) if kind == "write" else m.zero(off, n)
                model.write(h, off, data)
            elif kind == "load64":
                assert m.load64(op[2]) == int.from_bytes(model.cached(h, op[2], 8), "little")
            elif kind == "store64":
                m.store64(op[2], op[3])
                model.store(h, op[2], op[3].to_bytes(8, "little"))
            else:
                (off, n), = op[2:]
                getattr(m, kind)(off, n)
                getattr(model, kind)(h, off, n)
            assert mem.tobytes() == bytes(model.mem), op        # memory, byte for byte
            for j, off, n, v in views:       # every live view shows its host's cache
                assert bytes(v) == model.cached(mh[j], off, n), (op, j, off, n)
    finally:
        for *_, v in views:
            v.release()
        for m in hosts:
            m.close()


@settings(max_examples=int(os.environ.get("CXLKV_FUZZ_EXAMPLES", "300")), deadline=None)
@given(_ops(), st.booleans())
def test_the_emulation_follows_its_model(ops, preload):
    """Random reads, views, writes, zeroes, word loads and stores, flushes and
    invalidates by two hosts (no random evictions; with and without
    CXLKV_NC_PRELOAD): every value read, every view and memory after every
    step are what the contract in nc.h says."""
    _run_against_model(ops, preload)


def test_preload_caches_every_line_from_the_start(hosts):
    """CXLKV_NC_PRELOAD=1: a line b never touched is cached as it was when b
    mapped the pool, so even a first read without an invalidate is stale."""
    b = hosts(CXLKV_NC_PRELOAD=1)
    a = hosts()
    a.write(100 * 64, b"p" * 8192)
    assert b.read(100 * 64, 8192) == bytes(8192)
    with b.view(100 * 64, 64) as v:
        assert bytes(v) == bytes(64)
    b.invalidate(100 * 64, 8192)
    assert b.read(100 * 64, 8192) == b"p" * 8192
    assert b.nc_stats()["cached_lines"] == SIZE // 64


def test_kv_scatter_reaches_memory_for_another_host(hosts):
    """kv_scatter (store_with's one-pass write) goes through this host's
    emulated cache like every write, and is in memory on return: another
    host reads it after invalidating."""
    import numpy as np
    a, b = hosts(), hosts()
    src = np.arange(256, dtype=np.uint8)
    offs = np.array([4096, 8192], dtype=np.uint64)
    # two blocks of 128 bytes: 4 runs of 32 each, interleaved from src
    assert a.kv_scatter(offs, 128, 0, src, np.array([0, 32], dtype=np.int64), [4], [32], [64],
                        32) == 2
    b.invalidate(4096, 128)
    b.invalidate(8192, 128)
    want = src.reshape(4, 2, 32)
    assert b.read(4096, 128) == want[:, 0].tobytes()
    assert b.read(8192, 128) == want[:, 1].tobytes()
