"""The C core: atomics, bounds checks, cache maintenance, copies, views."""
from __future__ import annotations

import multiprocessing as mp
import os
import resource
import subprocess
import sys
import tempfile
import threading

import numpy as np
import pytest

from cxlkv import _core
from cxlkv.errors import InternalError, PoolRangeError, PoolReadOnly
from cxlkv.testing.checks import mapped_bytes

SIZE = 1 << 20


@pytest.fixture
def mapfile(tmp_path):
    p = tmp_path / "core.bin"
    with open(p, "wb") as f:
        f.truncate(SIZE)
    return str(p)


def open_map(path, writable=True):
    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        return _core.Mapping(fd, os.path.getsize(path), writable)
    finally:
        os.close(fd)


# -- atomics -------------------------------------------------------------

def test_atomics_single_process(mapfile):
    with open_map(mapfile) as m:
        m.store64(64, 41)
        assert m.load64(64) == 41
        assert m.fetch_add64(64, 1) == 41
        assert m.load64(64) == 42
        assert m.cas64(64, 1, 7) == 42          # fails: returns current value
        assert m.load64(64) == 42
        assert m.cas64(64, 42, 7) == 42         # succeeds: returns old value
        assert m.load64(64) == 7
        assert m.fetch_add64(64, 2**64 - 1) == 7  # subtract one (mod 2**64)
        assert m.load64(64) == 6
        m.store64(72, 2**64 - 1)
        assert m.fetch_add64(72, 1) == 2**64 - 1
        assert m.load64(72) == 0


def _hammer_fetch_add(path, off, n, ready):
    m = open_map(path)
    ready.wait()
    m.add64_many(off, 1, n)
    for _ in range(n // 10):
        m.fetch_add64(off + 8, 3)
    m.close()


def _hammer_cas_lock(path, n, ready):
    """Increment a plain word under a CAS spinlock at offset 0."""
    m = open_map(path)
    ready.wait()
    for _ in range(n):
        while m.cas64(0, 0, os.getpid()) != 0:
            pass
        v = m.load64(128)          # non-atomic read-modify-write inside the lock
        m.store64(128, v + 1)
        assert m.cas64(0, os.getpid(), 0) == os.getpid()
    # lock-free CAS increments on another word
    for _ in range(n):
        while True:
            old = m.load64(192)
            if m.cas64(192, old, old + 1) == old:
                break
    m.close()


@pytest.mark.parametrize("procs", [2, 4])
def test_atomics_hammered_from_processes(mapfile, procs):
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    n_add, n_cas = 200_000, 3_000
    ps = [ctx.Process(target=_hammer_fetch_add, args=(mapfile, 256, n_add, ready))
          for _ in range(procs)]
    ps += [ctx.Process(target=_hammer_cas_lock, args=(mapfile, n_cas, ready))
           for _ in range(procs)]
    for p in ps:
        p.start()
    ready.set()
    for p in ps:
        p.join(120)
        assert p.exitcode == 0
    with open_map(mapfile) as m:
        assert m.load64(256) == procs * n_add
        assert m.load64(264) == procs * (n_add // 10) * 3
        assert m.load64(128) == procs * n_cas
        assert m.load64(192) == procs * n_cas
        assert m.load64(0) == 0


# -- bounds -------------------------------------------------------------

BAD_WORD_OFFSETS = [SIZE, SIZE - 4, SIZE - 7, 2**63, 2**64 - 1, 2**64 - 8]


@pytest.mark.parametrize("off", BAD_WORD_OFFSETS)
def test_out_of_range_words_raise(mapfile, off):
    with open_map(mapfile) as m:
        for call in (lambda: m.load64(off), lambda: m.store64(off, 1),
                     lambda: m.cas64(off, 0, 1), lambda: m.fetch_add64(off, 1)):
            with pytest.raises(PoolRangeError):
                call()


def test_misaligned_and_negative_offsets_raise(mapfile):
    with open_map(mapfile) as m:
        with pytest.raises(PoolRangeError, match="aligned"):
            m.load64(4)
        with pytest.raises(PoolRangeError):
            m.load64(-8)
        with pytest.raises(PoolRangeError):
            m.store64(0, -1)
        with pytest.raises(PoolRangeError):
            m.store64(0, 2**64)
        with pytest.raises(TypeError):
            m.load64(8.0)


@pytest.mark.parametrize("off,length", [
    (0, SIZE + 1), (SIZE, 1), (SIZE + 1, 0), (8, 2**64 - 8), (2**64 - 1, 2),
    (SIZE - 10, 11), (2**63, 2**63),
])
def test_out_of_range_ranges_raise(mapfile, off, length):
    with open_map(mapfile) as m:
        for call in (lambda: m.read(off, length), lambda: m.flush(off, length),
                     lambda: m.invalidate(off, length), lambda: m.zero(off, length),
                     lambda: m.view(off, length)):
            with pytest.raises(PoolRangeError):
                call()
        if length < 1 << 24:
            with pytest.raises(PoolRangeError):
                m.write(off, b"x" * length)
            with pytest.raises(PoolRangeError):
                m.readinto(off, bytearray(length))


def test_edges_in_range(mapfile):
    with open_map(mapfile) as m:
        m.store64(SIZE - 8, 5)
        assert m.load64(SIZE - 8) == 5
        assert m.read(SIZE, 0) == b""
        m.write(SIZE - 3, b"abc")
        assert m.read(SIZE - 3, 3) == b"abc"


def test_read_only_mapping_refuses_writes(mapfile):
    with open_map(mapfile, writable=False) as m:
        assert m.load64(0) == 0
        for call in (lambda: m.store64(0, 1), lambda: m.cas64(0, 0, 1),
                     lambda: m.fetch_add64(0, 1), lambda: m.write(0, b"x"),
                     lambda: m.zero(0, 8), lambda: m.view(0, 8, True)):
            with pytest.raises(PoolReadOnly, match="read-only"):     # also a PermissionError
                call()


# -- cache maintenance ------------------------------------------------------

@pytest.mark.parametrize("insn", ["clflush", "clflushopt", "clwb"])
def test_flush_invalidate_each_instruction(mapfile, insn):
    info = _core.cpu_info()
    if not info[insn]:
        pytest.skip(f"this CPU has no {insn}")
    code = (
        "import os,sys; from cxlkv import _core\n"
        "p=sys.argv[1]; fd=os.open(p, os.O_RDWR); m=_core.Mapping(fd, os.path.getsize(p)); os.close(fd)\n"
        "info=_core.cpu_info(); print(info['flush'], info['invalidate'])\n"
        "m.write(100, b'hello'); m.flush(0, 4096); m.invalidate(0, 4096)\n"
        "assert m.read(100, 5) == b'hello'\n"
        "m.flush(3, 1); m.invalidate(4095, 2); m.flush(0, 0); _core.fence(); _core.sfence()\n")
    r = subprocess.run([sys.executable, "-c", code, mapfile], capture_output=True, text=True,
                       env={**os.environ, "CXLKV_FLUSH": insn}, timeout=60)
    assert r.returncode == 0, r.stderr
    flush, inval = r.stdout.split()
    assert flush == insn
    # CLWB cannot invalidate: invalidation falls back to a flushing instruction
    assert inval == ("clflushopt" if insn == "clwb" else insn)
    with open(mapfile, "rb") as f:
        f.seek(100)
        assert f.read(5) == b"hello"


def test_cpu_info_names_a_flush():
    info = _core.cpu_info()
    assert info["flush"] in ("clflush", "clflushopt", "clwb", "dc civac", "none")
    assert info["invalidate"] != "clwb"


# -- copies ---------------------------------------------------------------

@pytest.mark.parametrize("nt", [True, False, None])
@pytest.mark.parametrize("off,length", [(0, 1 << 19), (3, 300_001), (64, 255), (61, 4096),
                                        (4096 - 1, 65), (0, 1)])
def test_write_read_roundtrip(mapfile, nt, off, length):
    rng = np.random.default_rng(off + length)
    data = rng.integers(0, 256, length, dtype=np.uint8)
    with open_map(mapfile) as m:
        m.write(off, data, nt)
        assert m.read(off, length) == data.tobytes()
        out = np.empty(length, dtype=np.uint8)
        assert m.readinto(off, out) == length
        assert np.array_equal(out, data)
        # neighbours untouched
        if off:
            assert m.read(off - 1, 1) == b"\0"
        if off + length < SIZE:
            assert m.read(off + length, 1) == b"\0"
        m.zero(off, length, nt)
        assert not any(m.read(off, length))


def test_nt_threshold_setting(mapfile):
    with open_map(mapfile) as m:
        assert m.nt_threshold > 0
        m.nt_threshold = 0
        assert m.nt_threshold == 0
        m.write(0, b"x" * 200_000)
        assert m.read(0, 3) == b"xxx"


# -- prefault: a bulk copy maps its 2 MiB granule in one call ----------------

GRAN = 2 << 20


@pytest.fixture
def shm_pool():
    """An 8 MiB file on tmpfs with every page given its memory (as a pool
    file is once written): fault-around can then map 16 pages a fault."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("needs /dev/shm (tmpfs)")
    fd, p = tempfile.mkstemp(dir="/dev/shm", prefix="cxlkv-test-prefault-")
    try:
        os.write(fd, bytes(4 * GRAN))
        os.close(fd)
        yield p
    finally:
        os.unlink(p)


# under scripts/test-asan the C copy's first touch of a granule also faults
# in its AddressSanitizer shadow (an eighth of it): a page per 32 KiB
SHADOW = GRAN // 8 // 4096 if "libasan" in os.environ.get("LD_PRELOAD", "") else 0


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def _page_writes(m, granule: int) -> int:
    """Page faults taken by 4 KiB writes to every page of one granule, less
    those the same writes take again once every page is mapped (the
    interpreter's own, and a sanitizer's shadow memory)."""
    first = _raw_page_writes(m, granule)
    return first - _raw_page_writes(m, granule)


def _raw_page_writes(m, granule: int) -> int:
    page = b"\xa5" * 4096
    f0 = _faults()
    for off in range(granule * GRAN, (granule + 1) * GRAN, 4096):
        m.write(off, page)
    return _faults() - f0


def test_bulk_writes_map_their_granule_in_one_call(shm_pool):
    with open_map(shm_pool) as m:
        assert m.prefault
        on = _page_writes(m, 1)
        m.prefault = False
        off = _page_writes(m, 2)
        assert m.read(GRAN, 4096) == b"\xa5" * 4096
        assert m.read(3 * GRAN - 4096, 4096) == b"\xa5" * 4096
    assert off >= 400, off          # a fault per page: what the counter sees without it
    assert on <= 64 + SHADOW, on    # fault-around while populating, then none


def test_a_forked_child_maps_the_granules_again(shm_pool):
    """A child shares the mapping but none of its page-table entries: what
    the parent mapped is mapped again in the child, in one call."""
    with open_map(shm_pool) as m:
        _page_writes(m, 1)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:                                    # pragma: no cover - the child
            try:
                os.write(w, str(_page_writes(m, 1)).encode())
            finally:
                os._exit(0)
        os.close(w)
        child = int(os.read(r, 64))
        os.close(r)
        os.waitpid(pid, 0)
    assert child <= 64 + SHADOW, child


def test_prefault_range_maps_ahead_of_the_writes(shm_pool):
    with open_map(shm_pool) as m:
        assert m.prefault_range(GRAN, 2 * GRAN) is True
        assert _page_writes(m, 1) <= 8 + SHADOW and _page_writes(m, 2) <= 8 + SHADOW
        with pytest.raises(PoolRangeError):
            m.prefault_range(3 * GRAN, 2 * GRAN)
        m.prefault = False
        assert m.prefault_range(0, GRAN) is False
        assert _page_writes(m, 0) >= 400                # nothing was mapped ahead


def test_a_populated_mapping_needs_no_granule_mapped_again(shm_pool):
    """MAP_POPULATE mapped every page: the bulk copies skip their granule's
    populate call (a walk of 512 mapped pages, half a 2 MiB copy's time)."""
    fd = os.open(shm_pool, os.O_RDWR)
    try:
        m = _core.Mapping(fd, 4 * GRAN, True, populate=True)
    finally:
        os.close(fd)
    with m:
        assert m.mapped_granules == 4
        assert _page_writes(m, 2) <= 8 + SHADOW         # mapped: no fault either
    with open_map(shm_pool) as m:                       # not populated: as the copies go
        assert m.mapped_granules == 0
        m.write(GRAN, b"\x01" * 65536)                  # a bulk copy maps its granule
        assert m.mapped_granules == 1
        assert m.prefault_range(0, 4 * GRAN) and m.mapped_granules == 4


def test_a_read_maps_what_it_reads_not_its_granule(shm_pool):
    """A block read out of a granule this process never touched costs its
    own pages (read faults map 16 at a time), not the whole 2 MiB."""
    block = 256 << 10
    with open_map(shm_pool) as m:
        out = bytearray(block)
        m.readinto(GRAN + 3 * block, out)
        assert bytes(out) == bytes(block)               # the file's zeros
        assert m.mapped_granules == 0
        assert block <= mapped_bytes(shm_pool) <= 2 * block   # its pages and fault-around's
        m.write(2 * GRAN, b"\x01" * 65536)              # a write maps its granule
        assert m.mapped_granules == 1 and mapped_bytes(shm_pool) >= GRAN


def test_prefault_needs_a_mapping_of_its_own():
    m = _core.Mapping.from_buffer(bytearray(1 << 16))
    assert not m.prefault
    with pytest.raises(ValueError, match="prefault"):
        m.prefault = True
    m.write(0, b"x" * 4096)                              # copies work without it
    assert m.read(0, 2) == b"xx"


def test_copy_releases_the_gil(mapfile):
    """While add64_many runs in a thread, this thread keeps running and sees
    intermediate counts; with the GIL held it would only see the end."""
    n = 50_000_000
    with open_map(mapfile) as m:
        t = threading.Thread(target=m.add64_many, args=(0, 1, n))
        t.start()
        seen = set()
        while t.is_alive() and len(seen) < 3:
            v = m.load64(0)
            if 0 < v < n:
                seen.add(v)
        t.join()
        assert m.load64(0) == n
        assert len(seen) >= 1


# -- views --------------------------------------------------------------------

def test_views_are_zero_copy(mapfile):
    with open_map(mapfile) as m:
        v = m.view(4096, 64, True)
        a = np.frombuffer(v, dtype=np.uint64)
        a[0] = 0xDEADBEEF
        assert m.load64(4096) == 0xDEADBEEF
        m.store64(4104, 7)
        assert a[1] == 7
        ro = m.view(4096, 8)
        assert ro.readonly
        with pytest.raises(TypeError):
            ro[0] = 1
        assert m.exports >= 2
        with pytest.raises(BufferError):
            m.close()
        del a, v, ro
        assert m.exports == 0
    assert m.closed


def test_closed_mapping_raises(mapfile):
    m = open_map(mapfile)
    m.close()
    m.close()  # idempotent
    for call in (lambda: m.load64(0), lambda: m.read(0, 1), lambda: m.view(0, 1),
                 lambda: m.address):
        with pytest.raises(ValueError, match="closed"):
            call()


def test_the_allocator_before_its_geometry_is_an_internal_error():
    """A bug, not a bad argument: the C allocator used before set_geometry."""
    with _core.Mapping.from_buffer(bytearray(4096)) as m:
        with pytest.raises(InternalError, match="slab_free: allocator geometry not set"):
            m.slab_free(np.zeros(1, dtype=np.uint64), True, 0)
        with pytest.raises(InternalError, match="chunk_find_run: allocator geometry not set"):
            m.chunk_find_run(0, 1, 0)


def test_from_buffer(mapfile):
    b = bytearray(4096)
    with _core.Mapping.from_buffer(b) as m:
        m.store64(8, 9)
        assert b[8] == 9
    with _core.Mapping.from_buffer(b"\0" * 64) as m:
        assert not m.writable
        with pytest.raises(PoolReadOnly):
            m.store64(0, 1)
    with pytest.raises(ValueError):
        _core.Mapping.from_buffer(bytearray())


def test_mapping_of_bad_fd():
    with pytest.raises(OSError):
        _core.Mapping(999999, 4096)
    with pytest.raises(ValueError):
        _core.Mapping(0, 0)



@pytest.mark.parametrize("nt", [True, False])
@pytest.mark.parametrize("src_off,dst_off", [(64, 72), (72, 64), (0, 4096), (4096, 100)])
def test_overlapping_write_is_a_memmove(mapfile, nt, src_off, dst_off):
    n = 100_000
    with open_map(mapfile) as m:
        data = np.random.default_rng(1).integers(0, 256, SIZE, dtype=np.uint8).tobytes()
        m.write(0, data)
        expect = bytearray(data)
        expect[dst_off:dst_off + n] = expect[src_off:src_off + n]
        v = m.view(src_off, n)
        m.write(dst_off, v, nt)
        v.release()
        assert m.read(0, SIZE) == bytes(expect)


def test_mapping_past_the_end_of_a_file_is_refused(tmp_path):
    p = tmp_path / "small"
    p.write_bytes(b"\0" * 4096)
    fd = os.open(p, os.O_RDWR)
    try:
        with pytest.raises(ValueError, match="4096-byte file"):
            _core.Mapping(fd, 1 << 20)
        with pytest.raises(ValueError, match="alignment"):
            _core.Mapping(fd, 4096, align=2 << 20)
    finally:
        os.close(fd)


def test_misaligned_buffer_refused():
    with pytest.raises(ValueError, match="aligned"):
        _core.Mapping.from_buffer(memoryview(bytearray(64))[1:])


def test_gather_copies_each_buffer_to_its_block_and_skips_none():
    from cxlkv._core import gather

    bb = 4096
    srcs = [bytes([i + 1]) * bb for i in range(4)]
    dst = bytearray(b"\xee" * 4 * bb)
    assert gather([srcs[0], None, srcs[2], memoryview(srcs[3])], dst, bb) == 3
    assert dst[:bb] == srcs[0] and dst[bb:2 * bb] == b"\xee" * bb
    assert dst[2 * bb:] == srcs[2] + srcs[3]
    with pytest.raises(ValueError, match="destination too small"):
        gather(srcs, bytearray(3 * bb), bb)
    with pytest.raises(ValueError, match="block 1 is 10 bytes"):
        gather([srcs[0], b"x" * 10], dst, bb)
    with pytest.raises(BufferError):
        gather([srcs[0]], bytes(bb), bb)            # read-only destination
    with pytest.raises(TypeError):
        gather(5, dst, bb)
