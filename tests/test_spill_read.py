"""The spill tier's read path in C (cxlkv/_core/src/spill.c, through
`SlotFile.read_run`): a run of slots read and verified in one call - the
good leading blocks bit-exact, the first slot that fails stops the run
with its status (a torn or damaged header, a wrong key, namespace or
length, a cut or damaged payload), never a wrong block; every argument
bounds-checked before anything is read.  The run's checks hold the same
whether the calling thread reads every unit or helper threads do
(spill_pool.c; the `mode` fixture runs each test both ways), and whether
payloads are copied out of a mapping of the file with their checksum in
the same pass or preadv'd (the `path` fixture).  A file cut short under a
mapped copy (SIGBUS) is a miss, not a dead process; any other SIGBUS still
ends the process."""
from __future__ import annotations

import errno
import os
import signal
import struct
import subprocess
import sys

import numpy as np
import pytest
import xxhash

from cxlkv import _core
from cxlkv.kv.tiers.spill import files
from cxlkv.testing.checks import wait_for

NSD = b"n" * 16
ST = files.STATUS


@pytest.fixture(autouse=True, params=["caller", "helpers"])
def mode(request, monkeypatch):
    """caller: no helper threads, the calling thread reads every unit;
    helpers: two helper threads read every unit (the caller takes none),
    one slot per unit, so every slot of a run goes through a helper."""
    before = _core.spill_helper_stats()
    if request.param == "helpers":
        _core.spill_helpers(2, 50, False)
        monkeypatch.setattr(files, "READ_BYTES", 1)
    else:
        _core.spill_helpers(0)
    yield request.param
    _core.spill_helpers(before["helpers"], before["spin_us"], True)


@pytest.fixture(autouse=True, params=["mapped", "pread"])
def path(request, monkeypatch):
    """mapped: read_run copies payloads out of the slot file's mapping
    (the default); pread: preadv, then the checksum."""
    monkeypatch.setattr(files, "READ_MAPPED", request.param == "mapped")
    return request.param


def key(i: int) -> bytes:
    return struct.pack("<QQ", i * 0x9E3779B97F4A7C15 & (2**64 - 1), i)


def payload(k: bytes, n: int) -> bytes:
    return (k * (n // 16 + 1))[:n]


def make(tmp_path, length: int, n: int = 6, nslots: int = 8) -> files.SlotFile:
    """A slot file with blocks key(0..n-1) of `length` bytes in slots 0..n-1."""
    sb = files.slot_bytes(length)
    sf = files.SlotFile.create(tmp_path / files.file_name(sb), sb, nslots)
    for i in range(n):
        s = sf.claim(key(i), os.getpid())
        assert s == i
        p = payload(key(i), length)
        files.write_all(sf.fd, [p], sf.payload_off(s))
        sf.publish(s, files.header(key(i), NSD, length, xxhash.xxh3_64_intdigest(p), 1))
    return sf


def read(sf, slots, length, keys=None, ns=NSD, snap=None, size=None):
    keys = [key(s) for s in slots] if keys is None else keys
    bufs = [bytearray(size or length) for _ in slots]
    r = sf.read_run(np.array(slots, np.uint64), b"".join(keys), ns, length, bufs, snap)
    return r, bufs


def poke(sf, off, data: bytes) -> None:
    os.pwrite(sf.fd, data, off)


def test_the_header_layout_is_the_c_definition():
    c = _core.spill_layout()
    assert c["size"] == files.HDR_SIZE == 72 and c["snap"] == files.SNAP == 64
    assert c["fields"]["hsum"] == (56, 8) and c["fields"]["stamp"] == (64, 8)
    assert c["magic"] == files.MAGIC and c["version"] == files.VERSION
    assert set(ST) == {"ok", "gone", "torn", "mismatch", "short", "ioerr", "changed", "badsum"}


@pytest.mark.parametrize("length", [1, 17, 128, 129, 240, 241, 1000, 4096, 65536, 256 * 1024,
                                    256 * 1024 + 1])
def test_a_run_is_read_bit_exact_and_hashed_as_python_does(tmp_path, length):
    """Every xxh3 size class (short, mid, long inputs): the payload sums the
    writer made with the Python xxhash verify in C; full slots are read
    together, partial ones one by one."""
    sf = make(tmp_path, length)
    try:
        (ok, status, err), bufs = read(sf, [0, 1, 2, 4, 5], length, size=length + 100)
        assert (ok, status, err) == (5, ST["ok"], 0)
        for s, b in zip([0, 1, 2, 4, 5], bufs):
            assert bytes(b[:length]) == payload(key(s), length) and b[length:] == bytes(100)
    finally:
        sf.close()


def test_an_empty_run_reads_nothing(tmp_path):
    sf = make(tmp_path, 4096)
    try:
        assert read(sf, [], 4096)[0] == (0, ST["ok"], 0)
    finally:
        sf.close()


# -- the run stops at the first slot that fails ------------------------------------------------

L = 4096 * 4


def damage(sf, how: str) -> dict:
    """Damage slot 3 `how`; the read_run keyword arguments that ask for it."""
    o, p = sf.hdr_off(3), sf.payload_off(3)
    if how == "header-bit":                   # the length: the header checksum fails
        poke(sf, o + 9, b"\x7f")
    elif how == "header-sum":
        poke(sf, o + 56, bytes(8))
    elif how == "magic":
        poke(sf, o, b"XXXX")
    elif how == "version":
        poke(sf, o + 4, b"\x09")
    elif how == "writing":                    # a crash between payload and header
        poke(sf, o + 5, bytes([files.WRITING]))
    elif how == "free":
        poke(sf, o + 5, bytes([files.FREE]))
    elif how == "payload-bit":
        poke(sf, p + L - 1, bytes([payload(key(3), L)[-1] ^ 0x80]))
    elif how == "other-payload":              # slot 4's bytes under 3's header
        poke(sf, p, payload(key(4), L))
    elif how == "truncated":                  # cut inside slot 3's payload
        os.ftruncate(sf.fd, p + L // 3)
    elif how == "wrong-key":
        return {"keys": [key(s) for s in (0, 1, 2)] + [key(77), key(4)]}
    elif how == "wrong-ns":
        return {"ns": b"x" * 16}
    return {}


EXPECT = {"header-bit": "torn", "header-sum": "torn", "magic": "torn", "version": "torn",
          "writing": "gone", "free": "gone", "payload-bit": "badsum",
          "other-payload": "badsum", "truncated": "short", "wrong-key": "gone",
          "wrong-ns": "mismatch"}


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "read-before"])
@pytest.mark.parametrize("how", sorted(EXPECT))
def test_the_run_stops_at_a_damaged_slot_with_its_status(tmp_path, how, warm):
    """cold: damaged before the first read (a mapping made then covers the
    cut file only); read-before: the run was read once before, so its pages
    are mapped and cached when the damage comes."""
    sf = make(tmp_path, L)
    try:
        if warm:
            assert read(sf, [0, 1, 2, 3, 4], L)[0] == (5, ST["ok"], 0)
        kw = damage(sf, how)
        before = sf.raw_header(3)
        snap = bytearray(64)
        (ok, status, err), bufs = read(sf, [0, 1, 2, 3, 4], L, snap=snap, **kw)
        if how == "wrong-ns":                 # every block is of another namespace
            assert (ok, status) == (0, ST["mismatch"]) and snap == sf.raw_header(0)
            return
        assert (ok, status, err) == (3, ST[EXPECT[how]], 0)
        assert [bytes(b) for b in bufs[:3]] == [payload(key(s), L) for s in range(3)]
        assert snap == before                 # the header as checked
    finally:
        sf.close()


def test_another_length_is_a_mismatch(tmp_path):
    sf = make(tmp_path, L)
    try:
        assert read(sf, [0, 1], L - 1)[0] == (0, ST["mismatch"], 0)
    finally:
        sf.close()


def test_a_read_error_is_reported_with_its_errno(tmp_path):
    sf = make(tmp_path, L)
    wfd = os.open(sf.path, os.O_WRONLY)
    try:
        bufs = [bytearray(L)]
        r = _core.spill_read(wfd, sf.mm, sf.geo["hdr_off"], sf.nslots, sf.data_off, sf.sbytes,
                             np.array([0], np.uint64), key(0), NSD, L, bufs, 1 << 20)
        assert r == (0, ST["ioerr"], errno.EBADF)
    finally:
        os.close(wfd)
        sf.close()


# -- bounds ----------------------------------------------------------------------------------

def call(sf, **over):
    a = {"fd": sf.fd, "meta": sf.mm, "hdr_off": sf.geo["hdr_off"], "nslots": sf.nslots,
         "data_off": sf.data_off, "slot_bytes": sf.sbytes, "slots": np.array([0, 1], np.uint64),
         "keys": key(0) + key(1), "ns": NSD, "length": L,
         "bufs": [bytearray(L), bytearray(L)], "read_bytes": 1 << 20, "snap": None}
    a.update(over)
    return _core.spill_read(*a.values())


BAD = {
    "slot out of range": ({"slots": np.array([0, 8], np.uint64)}, ValueError),
    "length over the slot": ({"length": L + 1, "bufs": [bytearray(L + 1)] * 2}, ValueError),
    "slot bytes 0": ({"slot_bytes": 0}, ValueError),
    "headers outside the mapping": ({"nslots": 10**6, }, ValueError),
    "header offset outside": ({"hdr_off": 2**63}, ValueError),
    "header area overflows": ({"nslots": 2**62}, ValueError),
    "payload offsets overflow": ({"data_off": 2**63}, ValueError),
    "payload area overflows": ({"slot_bytes": 2**60, "length": 1}, ValueError),
    "keys short": ({"keys": key(0)}, ValueError),
    "namespace short": ({"ns": b"n"}, ValueError),
    "a buffer short": ({"bufs": [bytearray(L), bytearray(L - 1)]}, ValueError),
    "buffers missing": ({"bufs": [bytearray(L)]}, ValueError),
    "read-only buffer": ({"bufs": [bytearray(L), bytes(L)]}, (TypeError, BufferError)),
    "not buffers": ({"bufs": 5}, TypeError),
    "slots not uint64": ({"slots": np.array([0, 1], np.int32)}, TypeError),
    "negative fd": ({"fd": -1}, ValueError),
    "snap short": ({"snap": bytearray(63)}, ValueError),
    "negative offset": ({"data_off": -1}, IndexError),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_every_argument_is_bounds_checked_before_anything_is_read(tmp_path, case):
    sf = make(tmp_path, L)
    try:
        over, exc = BAD[case]
        with pytest.raises(exc):
            call(sf, **over)
        assert call(sf) == (2, ST["ok"], 0)   # the file is untouched
    finally:
        sf.close()


def test_a_closed_slot_file_is_refused(tmp_path):
    sf = make(tmp_path, L)
    mm = sf.mm
    sf.close()
    with pytest.raises(ValueError):
        _core.spill_read(0, mm, 0, 1, 0, L, np.array([0], np.uint64), key(0), NSD, L,
                         [bytearray(L)], 1 << 20)


# -- helper threads ----------------------------------------------------------------------------

def test_helpers_read_the_units_they_take(tmp_path, mode):
    """With helpers and the caller taking no unit, every unit of a run is
    read and verified by a helper thread: the blocks bit-exact, counted."""
    sf = make(tmp_path, L, n=8, nslots=8)
    try:
        before = _core.spill_helper_stats()
        (ok, status, _), bufs = read(sf, list(range(8)), L)
        after = _core.spill_helper_stats()
        assert (ok, status) == (8, ST["ok"])
        assert [bytes(b) for b in bufs] == [payload(key(s), L) for s in range(8)]
        if mode == "helpers":
            assert after["helper_units"] - before["helper_units"] == 8
            assert after["caller_units"] == before["caller_units"]
            assert after["jobs"] - before["jobs"] == 1
        else:
            assert after["helpers"] == 0 and after["helper_units"] == before["helper_units"]
            assert after["solo"] - before["solo"] == 1
    finally:
        sf.close()


def test_a_failing_unit_stops_the_run_before_later_units(tmp_path, mode):
    """Slot 2 damaged in a run of 8 one-slot units: the run is the two
    before it, whichever thread read which unit; later units, when read at
    all, are not returned as good."""
    sf = make(tmp_path, L, n=8, nslots=8)
    try:
        poke(sf, sf.payload_off(2) + 5, b"\xee")
        poke(sf, sf.hdr_off(6), b"XXXX")
        (ok, status, _), bufs = read(sf, list(range(8)), L)
        assert (ok, status) == (2, ST["badsum"])
        assert [bytes(b) for b in bufs[:2]] == [payload(key(s), L) for s in range(2)]
    finally:
        sf.close()


def test_a_run_does_not_wait_for_a_sleeping_helper(tmp_path, mode, monkeypatch):
    """With the caller taking units and every helper asleep, the run is the
    caller's alone (no hand-off to wait for) and the helpers are woken to
    poll for the next run."""
    monkeypatch.setattr(files, "READ_BYTES", 1)            # 8 units
    sf = make(tmp_path, L, n=8, nslots=8)
    try:
        _core.spill_helpers(1, 0, True)                    # no polling: straight to sleep
        wait_for(lambda: _core.spill_helper_stats()["sleeping"] == 1, what="the helper asleep")
        before = _core.spill_helper_stats()
        (ok, _, _), bufs = read(sf, list(range(8)), L)
        after = _core.spill_helper_stats()
        assert ok == 8 and bytes(bufs[7]) == payload(key(7), L)
        assert after["solo"] - before["solo"] == 1 and after["warmups"] - before["warmups"] == 1
        assert after["helper_units"] == before["helper_units"] and after["jobs"] == before["jobs"]
    finally:
        sf.close()


def test_the_helpers_are_started_and_stopped(mode):
    _core.spill_helpers(3, 10)
    st = _core.spill_helper_stats()
    assert (st["helpers"], st["spin_us"]) == (3, 10)
    assert _core.spill_helpers(1) == 1 and _core.spill_helper_stats()["helpers"] == 1
    assert _core.spill_helper_stats()["spin_us"] == 10         # unchanged when not given
    for bad in ((-1,), (9,), (1, -5), (1, 10**6)):
        with pytest.raises(ValueError, match="spill_helpers"):
            _core.spill_helpers(*bad)
    assert _core.spill_helper_stats()["helpers"] == 1


def test_a_forked_child_reads_without_the_parents_helpers(tmp_path, mode):
    """A child forked while helpers run has none (they are not forked):
    its reads run on its own thread, and do not wait for helpers."""
    sf = make(tmp_path, L, n=8, nslots=8)
    try:
        _core.spill_helpers(2, 50, False)
        pid = os.fork()
        if pid == 0:                                        # the child: exit 0 when right
            try:
                (ok, _, _), bufs = read(sf, list(range(8)), L)
                good = ok == 8 and bytes(bufs[7]) == payload(key(7), L)
                os._exit(0 if good and _core.spill_helper_stats()["helpers"] == 0 else 1)
            finally:
                os._exit(2)
        status = []

        def reaped() -> bool:
            p, st = os.waitpid(pid, os.WNOHANG)
            if p == pid:
                status.append(os.waitstatus_to_exitcode(st))
            return bool(status)

        try:
            wait_for(reaped, what="the forked child's read", timeout=60)
        except BaseException:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise
        assert status == [0]
    finally:
        sf.close()


# -- a file cut short under a mapped copy --------------------------------------------------

_CUT_UNDER_COPY = """
import os, sys
import numpy as np
sys.path[:0] = [{tests!r}]
from cxlkv import _core
from cxlkv.kv.tiers.spill import files
import test_spill_read as t
if {helpers!r}:                                 # a unit per slot, every one a helper's
    _core.spill_helpers(2, 50, False)
    files.READ_BYTES = 1
sf = files.SlotFile.open(files.Path({path!r}))
before = _core.spill_helper_stats()["helper_units"]
(ok, status, err), bufs = t.read(sf, [0, 1, 2, 3, 4], t.L)
good = all(bytes(bufs[s]) == t.payload(t.key(s), t.L) for s in range(ok))
print(ok, status, err, good, _core.spill_helper_stats()["helper_units"] - before, flush=True)
"""


@pytest.mark.parametrize("mode", ["caller"], indirect=True)
@pytest.mark.parametrize("path", ["mapped"], indirect=True)
@pytest.mark.parametrize("copier", ["caller", "helper"])
def test_a_file_cut_short_before_the_copy_is_a_miss_not_a_sigbus(tmp_path, copier):
    """The reader stops just before its copy (CXLKV_PAUSE_AT=spill.map), the
    file is cut inside slot 3's payload, the reader goes on: the copy of
    slot 3 faults (SIGBUS), the handler takes it back out of the copy, and
    preadv finds the cut - the run is slots 0-2, status short, the process
    alive.  caller: the run is one unit, copied by the calling thread;
    helper: a unit per slot, every one taken by a read helper thread
    (spill_pool.c; the jump is the copying thread's own), and the file is
    cut inside slot 0, so whichever unit a helper was about to copy when the
    process stopped faults in its copy; the run is then empty."""
    sf = make(tmp_path, L)
    sf.close()
    sf_path = str(tmp_path / files.file_name(files.slot_bytes(L)))
    code = _CUT_UNDER_COPY.format(tests=os.path.dirname(__file__), path=sf_path,
                                  helpers=copier == "helper")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "CXLKV_PAUSE_AT": "spill.map:1"})
    try:
        def stopped() -> bool:
            with open(f"/proc/{p.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] == "T"
        wait_for(stopped, what="the reader to stop before its copy", timeout=60)
        geo_sf = files.SlotFile.open(files.Path(sf_path))
        try:
            cut = 0 if copier == "helper" else 3
            os.ftruncate(geo_sf.fd, geo_sf.payload_off(cut) + L // 3)
        finally:
            geo_sf.close()
        os.kill(p.pid, signal.SIGCONT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, err
    ok, status, errno_, good, helper_units = out.split()
    assert (int(ok), int(status), errno_, good) == (cut, ST["short"], "0", "True")
    assert (int(helper_units) > 0) == (copier == "helper")


_FOREIGN_SIGBUS = """
import mmap, os, sys
import numpy as np
sys.path[:0] = [{tests!r}]
from cxlkv.kv.tiers.spill import files
import test_spill_read as t
sf = files.SlotFile.open(files.Path({path!r}))
assert t.read(sf, [0, 1], t.L)[0] == (2, 0, 0)          # the handler is installed
fd = os.open({other!r}, os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, 8192)
m = mmap.mmap(fd, 8192)
os.ftruncate(fd, 0)
print("touching", flush=True)
m[4096]                                                   # past the end: SIGBUS
print("survived", flush=True)
"""


@pytest.mark.parametrize("mode", ["caller"], indirect=True)
@pytest.mark.parametrize("path", ["mapped"], indirect=True)
@pytest.mark.parametrize("faulthandler", [False, True], ids=["plain", "faulthandler"])
def test_a_sigbus_outside_a_mapped_copy_still_ends_the_process(tmp_path, faulthandler):
    """The read path's SIGBUS handler takes only faults of its own copies:
    any other bus error ends the process as before (by the signal; under
    Python's faulthandler, with its report)."""
    sf = make(tmp_path, L)
    sf.close()
    code = _FOREIGN_SIGBUS.format(tests=os.path.dirname(__file__),
                                  path=str(tmp_path / files.file_name(files.slot_bytes(L))),
                                  other=str(tmp_path / "other"))
    argv = [sys.executable] + (["-X", "faulthandler"] if faulthandler else []) + ["-c", code]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                       stdin=subprocess.DEVNULL)
    assert p.stdout.split() == ["touching"], (p.stdout, p.stderr)
    # under scripts/test-asan the sanitizer's handler came first: it reports
    # and aborts - or, where faulthandler's report runs inside its handler,
    # exits with its exitcode (1) as it dies a second time (gcc 12's libasan
    # on the 6.18 kernel of 2026-12-06: every run)
    asan = "libasan" in os.environ.get("LD_PRELOAD", "")
    if asan:
        assert p.returncode in ((-signal.SIGABRT, 1) if faulthandler else (-signal.SIGABRT,)), \
            p.stderr
        assert "AddressSanitizer: BUS" in p.stderr, p.stderr
    else:
        assert p.returncode == -signal.SIGBUS, p.stderr
    if faulthandler:
        assert "Bus error" in p.stderr
