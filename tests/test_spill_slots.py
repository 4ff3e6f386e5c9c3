"""The spill store's slot files (cxlkv.kv.tiers.spill.files): the on-disk
layout pinned; torn and damaged slots are misses, never wrong bytes; a
writer killed mid-spill leaves a store whose index the next owner rebuilds
from the slot headers, every surviving block intact; several processes of
one host share one store; a full store evicts its least recently used
blocks; the old one-file-per-block format is migrated."""
from __future__ import annotations

import logging
import os
import signal
import struct
import subprocess
import sys
import threading

import numpy as np
import psutil
import pytest
import xxhash

from cxlkv.errors import SpillOldFormat
from cxlkv.kv.tiers import spill
from cxlkv.kv.tiers.spill import files
from cxlkv.kv.tiers.spill import store as spill_store
from cxlkv.kv.tiers.spill.lru import Index
from cxlkv.testing.checks import wait_for

NSD = b"n" * 16
BB = 64 * 1024
FP = spill.footprint(BB)


def key(i: int) -> bytes:
    return struct.pack("<QQ", i * 0x9E3779B97F4A7C15 & (2**64 - 1), i)


def payload(k: bytes, n: int = BB) -> bytes:
    """Test block bytes: derived from the key alone (a wrong block shows)."""
    return (k * (n // 16 + 1))[:n]


def live(d) -> dict[bytes, int]:
    """key -> slot size of every LIVE slot whose header verifies under `d`."""
    out = {}
    for f in d.glob("slots-*.dat"):
        sf = spill.SlotFile.open(f, writable=False)
        for k, _, _, _ in sf.live():
            assert k not in out, "one key in two slots"
            out[k] = sf.sbytes
        sf.close()
    return out


def poke(path, off, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(off)
        f.write(data)


# -- layout --------------------------------------------------------------------------------

def test_slot_header_layout_is_pinned():
    """The 72-byte slot header, the file header and the file geometry, as
    written by this version (a change is a format version bump)."""
    assert files.HDR.format == "<4sBBHII16s16sQ" and files.HDR.size == 56
    assert files.HDR_SIZE == 72 and files.MAGIC == b"CXSB" and files.VERSION == 3
    assert (files.FREE, files.WRITING, files.LIVE) == (0, 1, 2)
    h = files.header(bytes(range(16)), b"N" * 16, 1000, 0x1122334455667788, 7)
    assert h.hex() == (
        "43585342" "03" "02" "0000" "e8030000" "00000000"            # magic ver state - len -
        "000102030405060708090a0b0c0d0e0f" + "4e" * 16 +             # key, namespace digest
        "8877665544332211" "7be074afd9e55b0a" "0700000000000000")    # payload sum, hdr sum, stamp
    assert struct.unpack_from("<Q", h, 56)[0] == xxhash.xxh3_64_intdigest(h[:56])
    assert files.parse(h) == (bytes(range(16)), b"N" * 16, 1000, 0x1122334455667788)
    assert files.FILE_HDR.format == "<8sIIQQQQ" and files.FILE_MAGIC == b"CXLKVSF\0"
    assert files.geometry(4096, 3) == {                  # the payloads from 2 MiB on
        "slot_bytes": 4096, "slots": 3, "entries": 16, "window": 16, "index_off": 4096,
        "hdr_off": 8192, "data_off": 2 << 20, "size": (2 << 20) + 3 * 4096}
    g = files.geometry(BB, 1000)
    assert (g["entries"], g["window"]) == (4096, 64)
    assert g["data_off"] == 2 << 20 and g["size"] == g["data_off"] + 1000 * BB
    g = files.geometry(BB, 100_000)              # 4 MiB of index, 6.9 MiB of headers
    assert g["data_off"] == 12 << 20 and g["data_off"] >= g["hdr_off"] + 100_000 * 72
    assert files.geometry(4096, 3, files.OLD_VERSION)["data_off"] == 12288   # version 2
    assert files.slot_bytes(1) == files.slot_bytes(4096) == 4096 and files.slot_bytes(4097) == 8192
    assert spill.footprint(BB) == BB + 72 and spill.file_name(BB) == "slots-65536.dat"
    assert spill.USAGE.format == "<8sIIQQQ" and spill.USAGE_VERSION == 2 and spill.REC.size == 24


def test_mapped_views_match_the_header_layout(tmp_path):
    """The numpy views of a slot file (states, stamps, index) read the
    fields the header layout says."""
    sf = files.SlotFile.create(tmp_path / files.file_name(4096), 4096, 5)
    try:
        s = sf.claim(key(1), 4242)
        assert sf.states[s] == files.WRITING and sf.stamps[s] == 4242
        sf.publish(s, files.header(key(1), NSD, 10, 99, 1234))
        assert sf.states[s] == files.LIVE and sf.stamps[s] == 1234 and sf.find(key(1)) == s
        raw = open(sf.path, "rb").read()
        o = sf.hdr_off(s)
        assert raw[o + 5] == files.LIVE and raw[o + 16:o + 32] == key(1)
        assert struct.unpack_from("<Q", raw, o + 64)[0] == 1234
        words = np.frombuffer(raw, "<u8", count=sf.geo["entries"], offset=4096)
        assert (s + 1) in (words & 0xFFFFFFFF).tolist()
        assert sf.claim(key(1), 1) == "already"
    finally:
        sf.close()


# -- torn and damaged slots ------------------------------------------------------------------

DAMAGE = ["payload-bit", "header-bit", "header-sum", "writing", "truncated", "other-payload"]


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_torn_or_damaged_slot_is_a_miss_never_wrong_bytes(tmp_path, damage):
    d = tmp_path / "s"
    st = spill.SpillStore(d, 64 * FP, writers=1)
    for i in range(4):
        st.offer(key(i), NSD, payload(key(i)))
    st.flush()
    offs = [st.locate(key(i), BB)[1] for i in range(4)]
    assert offs == sorted(offs)                          # one batch: slots in order
    path, off, hoff = st.locate(key(1), BB)
    if damage == "payload-bit":
        poke(path, off + BB - 1, bytes([payload(key(1))[-1] ^ 0x80]))
    elif damage == "header-bit":                       # the length: the header sum fails
        poke(path, hoff + 9, b"\x7f")
    elif damage == "header-sum":
        poke(path, hoff + 56, bytes(8))
    elif damage == "writing":                          # a crash between payload and header
        poke(path, hoff + 5, bytes([files.WRITING]))
    elif damage == "truncated":                        # cut inside block 1's payload
        with open(path, "r+b") as f:
            f.truncate(off + BB // 3)
    elif damage == "other-payload":                    # block 2's bytes under 1's header
        poke(path, off, payload(key(2)))
    expect_ok = [0] if damage == "truncated" else [0, 2, 3]     # cut: 2 and 3 are gone too
    assert st.get(key(1), NSD, BB) is None             # a miss ...
    assert st.get(key(1), NSD, BB) is None             # ... that stays one
    for i in (0, 2, 3):                                # the others are intact (or cut)
        assert st.get(key(i), NSD, BB) == (payload(key(i)) if i in expect_ok else None)
    s = st.stats()
    assert s["corrupt"] == (0 if damage == "writing" else 1) + (
        0 if damage != "truncated" else 3 - len(expect_ok))
    if damage != "writing":
        assert st.locate(key(1), BB) is None           # its slot freed, its bytes off the count
    st.close()
    st = spill.SpillStore(d, 64 * FP, writers=1)     # the next owner frees a WRITING slot
    try:                                               # whose writer is gone
        assert st.locate(key(1), BB) is None and st.get(key(1), NSD, BB) is None
        assert st.stats()["used_bytes"] == len(live(d)) * FP == st.stats()["blocks"] * FP
    finally:
        st.close()


RACER = r"""
import struct, sys
from cxlkv.kv.tiers import spill
BB = 64 * 1024
def key(i):
    return struct.pack("<QQ", i * 0x9E3779B97F4A7C15 & (2**64 - 1), i)
st = spill.SpillStore(sys.argv[1], 0, mode="reader", writers=1)
keys = [key(i) for i in range(4)]
got = [st.get(keys[1], b"n" * 16, BB)] if sys.argv[2] == "get" else st.fetch(keys, b"n" * 16, BB)
s = st.stats()
# each block returned, by the key its payload was made of (see payload())
print(*["-" if g is None else bytes(g)[:16].hex() for g in got], s["corrupt"], s["misses"])
st.close()
"""


@pytest.mark.parametrize("call", ["get", "fetch"])
def test_a_slot_rewritten_while_read_is_a_miss(tmp_path, call):
    """The header is checked before the payload is read and compared after
    it: a slot freed and given to another block in between (the reader
    stopped there, CXLKV_PAUSE_AT=spill.read) is a miss, not that block;
    fetch returns the run before it."""
    d = tmp_path / "s"
    st = spill.SpillStore(d, 64 * FP, writers=1)
    try:
        for i in range(4):
            st.offer(key(i), NSD, payload(key(i)))
        st.flush()
        sf = st._files[BB]
        slot = sf.find(key(1))
        p = subprocess.Popen([sys.executable, "-c", RACER, str(d), call], stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "CXLKV_PAUSE_AT": "spill.read:1"})
        try:
            wait_for(lambda: psutil.Process(p.pid).status() == psutil.STATUS_STOPPED,
                     what="the reader to stop between its read and its checks")
            with st._usage.locked():                 # the owner reuses the slot meanwhile
                sf.release(slot, key(1))
                sf.cursor = slot                     # the freed slot is the next one
                assert sf.claim(key(9), os.getpid()) == slot
            files.write_all(sf.fd, [payload(key(9))], sf.payload_off(slot))
            with st._usage.locked():
                sf.publish(slot, files.header(key(9), NSD, BB,
                                              xxhash.xxh3_64_intdigest(payload(key(9))), 5))
            os.kill(p.pid, signal.SIGCONT)
            out, _ = p.communicate(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait(30)
        assert p.returncode == 0
        want = ["-"] if call == "get" else [key(0).hex()]
        assert out.split() == want + ["0", "1"]          # no corrupt block, one miss
        assert sf.find(key(9)) == slot                    # the other block is untouched
        buf = bytearray(BB)
        assert sf.read_run(np.array([slot], np.uint64), key(9), NSD, BB, [buf])[0] == 1
        assert buf == payload(key(9))
    finally:
        st.close()


# -- a writer killed mid-spill -----------------------------------------------------------------

WRITER = r"""
import struct, sys, threading
from cxlkv.kv.tiers import spill
from cxlkv.kv.tiers.spill import files
from cxlkv.kv.tiers.spill.lru import Index
d, limit = sys.argv[1], int(sys.argv[2])
armed = threading.Event()
if sys.argv[4] == "in-write":      # once armed: stop a writer between payload and header
    real = files.write_all
    told = threading.Lock()
    def write_all(fd, bufs, off):
        real(fd, bufs, off)
        if armed.is_set():
            if told.acquire(blocking=False):   # one line, from the first writer held
                sys.stdout.write("in-write\n")     # one write: lines do not interleave
                sys.stdout.flush()
            threading.Event().wait()          # held there until killed
    files.write_all = write_all
st = spill.SpillStore(d, limit, mode=sys.argv[3], writers=2, queue_bytes=4 << 20)
BB = 64 * 1024
def key(i):
    return struct.pack("<QQ", i * 0x9E3779B97F4A7C15 & (2**64 - 1), i)
i = 0
while True:                        # spill until killed
    for _ in range(32):
        k = key(i)
        st.offer(k, b"n" * 16, (k * (BB // 16 + 1))[:BB])
        i += 1
    if i % 256 == 0:
        st.flush()
        sys.stdout.write(f"{st.stats()['written']}\n")
        sys.stdout.flush()
        if i == 3 * 256:
            armed.set()
"""


@pytest.mark.parametrize("mode,when", [("owner", "in-write"), ("reader", "in-write"),
                                       ("owner", "any")])
def test_a_writer_killed_mid_spill_leaves_a_store_the_next_owner_rebuilds(tmp_path, mode, when):
    """SIGKILL a process spilling: while a writer has payloads written and
    their headers not yet (WRITING slots: deterministic), or at whatever
    instant it is at."""
    d = tmp_path / "s"
    limit = 96 * FP                          # smaller than what is written: slots are reused
    holder = spill.SpillStore(d, limit, writers=1) if mode == "reader" else None
    p = subprocess.Popen([sys.executable, "-c", WRITER, str(d), str(limit), mode, when],
                         stdout=subprocess.PIPE, text=True)
    try:
        for n in range(200):                 # it has spilled (and evicted) a few rounds
            line = p.stdout.readline().strip()
            if line == "in-write" or (when == "any" and n == 3):
                break
            assert line.isdigit()
            if holder is not None:           # the owner frees room for the reader's writes
                holder.maintain()
        assert line == "in-write" or when == "any"
        os.kill(p.pid, signal.SIGKILL)       # ... and is writing the next batch
        p.wait(30)
        if when == "in-write":               # torn: claimed slots with payloads, no headers
            sf = spill.SlotFile.open(d / spill.file_name(BB), writable=False)
            assert (sf.states == files.WRITING).any()
            sf.close()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(30)
    if holder is not None:
        holder.close()
    st = spill.SpillStore(d, limit, writers=1)             # the next owner
    try:
        assert st.mode == "owner"
        for sf in st._files.values():                      # no slot left claimed by the dead
            assert not (sf.states == files.WRITING).any()
        on_disk = live(d)
        s = st.stats()
        assert 0 < s["blocks"] == len(on_disk) and s["used_bytes"] == len(on_disk) * FP <= limit
        for k in on_disk:                                  # every surviving block verifies
            assert st.get(k, NSD, BB) == payload(k)
        assert st.stats()["corrupt"] == 0 and st.stats()["hits"] == len(on_disk)
        st.offer(key(10**6), NSD, payload(key(10**6)))    # and the store goes on
        st.flush()
        assert st.get(key(10**6), NSD, BB) == payload(key(10**6))
    finally:
        st.close()


# -- several processes of one host ---------------------------------------------------------

READER = r"""
import struct, sys
from cxlkv.kv.tiers import spill
BB = 64 * 1024
def key(i):
    return struct.pack("<QQ", i * 0x9E3779B97F4A7C15 & (2**64 - 1), i)
def payload(k):
    return (k * (BB // 16 + 1))[:BB]
st = spill.SpillStore(sys.argv[1], 0, mode="reader", writers=2)
lo, hi = int(sys.argv[2]), int(sys.argv[3])
for i in range(lo, hi):
    while not st.offer(key(i), b"n" * 16, payload(key(i))):
        if st.run([key(i)]):
            break                 # the other reader stored it first
        st.flush()
st.flush()
print("written", st.stats()["written"], st.stats()["already"], flush=True)
a, b = map(int, sys.stdin.readline().split())
good = wrong = missing = 0
for i in range(a, b):
    got = st.get(key(i), b"n" * 16, BB)
    if got is None:
        missing += 1
    elif bytes(got) == payload(key(i)):
        good += 1
    else:
        wrong += 1
print("read", good, wrong, missing, flush=True)
st.close()
"""


def test_several_processes_share_one_store(tmp_path):
    """An owner and two reader processes writing overlapping blocks at the
    same time: every key in one slot, each process reads all the others
    wrote bit-exact, the owner finds the readers' blocks and the count
    matches the slots."""
    d = tmp_path / "s"
    own = spill.SpillStore(d, 256 * FP)
    procs = [subprocess.Popen([sys.executable, "-c", READER, str(d), str(lo), str(hi)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for lo, hi in ((0, 60), (30, 90))]
    try:
        for i in range(90, 130):                         # the owner writes meanwhile
            own.offer(key(i), NSD, payload(key(i)))
        own.flush()
        wrote = [p.stdout.readline().split() for p in procs]
        assert all(w[0] == "written" for w in wrote)
        assert sum(int(w[1]) for w in wrote) == 90       # each overlapping key written once
        for p in procs:
            p.stdin.write("0 130\n")
            p.stdin.flush()
        for p in procs:
            _, good, wrong, missing = p.stdout.readline().split()
            assert (int(good), int(wrong), int(missing)) == (130, 0, 0)
            assert p.wait(60) == 0
        own.maintain()                                   # folds the readers' journal in
        s = own.stats()
        assert s["discovered"] == 90 and s["blocks"] == 130
        on_disk = live(d)
        assert len(on_disk) == 130 and s["used_bytes"] == 130 * FP
        for i in range(130):
            assert own.get(key(i), NSD, BB) == payload(key(i))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)
        own.close()


# -- a full store ------------------------------------------------------------------------------

def test_a_full_store_evicts_its_least_recently_used_blocks(tmp_path):
    d = tmp_path / "s"
    k = 16
    st = spill.SpillStore(d, k * FP, queue_bytes=64 * BB, writers=1)   # in offer order
    try:
        for i in range(k):
            st.offer(key(i), NSD, payload(key(i)))
        st.flush()
        for i in range(k // 2):                          # the first half used again
            assert st.get(key(i), NSD, BB) == payload(key(i))
        for i in range(k, k + k // 2):                   # one batch: half a store more
            st.offer(key(i), NSD, payload(key(i)))
        st.flush()
        held = [i for i in range(k + k // 2) if st.run([key(i)])]
        assert held == list(range(k // 2)) + list(range(k, k + k // 2))
        for i in range(3 * k, 6 * k):                    # three stores more, queued at once
            st.offer(key(i), NSD, payload(key(i)))
        st.flush()
        s = st.stats()
        held = [i for i in range(6 * k) if st.run([key(i)])]
        assert held == list(range(5 * k, 6 * k))         # the most recent store-full
        assert s["used_bytes"] == k * FP and s["blocks"] == k == len(live(d))
        assert s["evicted"] == k // 2 + 3 * k and s["dropped"] == 0
        for i in held:
            assert st.get(key(i), NSD, BB) == payload(key(i))
        # a block of another size gets its own slot file, under the same limit
        st.offer(key(7777), NSD, payload(key(7777), 3000))
        st.flush()
        assert st.get(key(7777), NSD, 3000) == payload(key(7777), 3000)
        assert st.stats()["used_bytes"] <= k * FP and len(list(d.glob("slots-*.dat"))) == 2
    finally:
        st.close()


@pytest.mark.parametrize("first", [1, 2, 3])
def test_the_lru_order_is_the_offer_order_whichever_slots_a_batch_gets(tmp_path, first):
    """A writer batch's blocks get freed slots in whatever order the LRU
    freed them; they are written in slot order but must be stamped and
    indexed in the order they were offered, in this process and after a
    reopen.  Offering `first` blocks alone first puts the later chunk
    boundaries across freed slots out of order (CI once saw 78, 79 kept
    and 80, 81 evicted when its writer happened to start early)."""
    d = tmp_path / "s"
    k = 16
    st = spill.SpillStore(d, k * FP, queue_bytes=64 * BB, writers=1)
    try:
        for i in range(k):
            st.offer(key(i), NSD, payload(key(i)))
        st.flush()
        for i in range(k // 2):                          # slots freed out of their order
            assert st.get(key(i), NSD, BB) == payload(key(i))
        for i in range(k, 3 * k + first):
            st.offer(key(i), NSD, payload(key(i)))
        st.flush()
        for i in range(3 * k + first, 6 * k):
            st.offer(key(i), NSD, payload(key(i)))
        st.flush()
        assert [i for i in range(6 * k) if st.run([key(i)])] == list(range(5 * k, 6 * k))
    finally:
        st.close()
    st = spill.SpillStore(d, k * FP, queue_bytes=64 * BB, writers=1)
    try:                                                 # the stamps keep the order
        for i in range(6 * k, 6 * k + k // 2):
            st.offer(key(i), NSD, payload(key(i)))
        st.flush()
        held = [i for i in range(7 * k) if st.run([key(i)])]
        assert held == list(range(5 * k + k // 2, 6 * k + k // 2))
    finally:
        st.close()


def test_writers_batch_adjacent_slots_up_to_write_bytes_a_call(tmp_path, monkeypatch):
    """Adjacent slots of a writer batch go out in one pwritev, never more
    than WRITE_BYTES a call (larger writes met the kernel's dirty-page
    throttling), and every block comes back bit-exact."""
    calls, go = [], threading.Event()
    real = files.write_all

    def write_all(fd, bufs, off):
        go.wait(30)                        # the first batch held until all are queued
        calls.append(sum(len(b) for b in bufs))
        real(fd, bufs, off)

    monkeypatch.setattr(files, "write_all", write_all)
    n = 3 * spill_store.WRITE_BYTES // BB
    st = spill.SpillStore(tmp_path / "s", 2 * n * FP, queue_bytes=2 * n * BB, writers=1)
    try:
        for i in range(n):
            assert st.offer(key(i), NSD, payload(key(i)))
        go.set()
        st.flush()
        assert sum(calls) == n * BB
        assert max(calls) == spill_store.WRITE_BYTES, calls       # batched, up to the cap
        assert all(c % BB == 0 for c in calls)
        for i in range(n):
            assert st.get(key(i), NSD, BB) == payload(key(i))
    finally:
        st.close()


# -- the old format ----------------------------------------------------------------------------

def _legacy_file(d, k: bytes, data: bytes, nsd: bytes = NSD) -> None:
    hdr = files.LEGACY_HDR.pack(files.LEGACY_MAGIC, 1, 0, k, nsd, len(data),
                                xxhash.xxh3_64_intdigest(data))
    f = d / k.hex()[:2] / (k.hex() + ".blk")
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_bytes(hdr + struct.pack("<Q", xxhash.xxh3_64_intdigest(hdr)) + data)


def test_a_directory_of_the_old_format_is_migrated(tmp_path, caplog):
    """A store left by the one-file-per-block version: its owner moves the
    blocks that verify into slot files, drops the rest, removes the old files."""
    d = tmp_path / "s"
    for i in range(5):
        _legacy_file(d, key(i), payload(key(i)))
    _legacy_file(d, key(5), payload(key(5)))
    bad = d / key(5).hex()[:2] / (key(5).hex() + ".blk")
    raw = bytearray(bad.read_bytes())
    raw[100] ^= 1
    bad.write_bytes(bytes(raw))                          # does not verify: dropped
    (d / "ab").mkdir(exist_ok=True)
    (d / "ab" / ("ab" * 16 + ".1.1.1.tmp")).write_bytes(b"x")
    with caplog.at_level(logging.WARNING, logger="cxlkv.kv.tiers.spill"):
        st = spill.SpillStore(d, 64 * FP)
    try:
        assert [r.getMessage() for r in caplog.records if "migrated" in r.getMessage()] == [
            f"spill: {d}: migrated 5 spilled blocks from the one-file-per-block format into "
            "slot files (1 dropped: not verifying or not fitting)"]
        assert not list(d.rglob("*.blk")) and not list(d.rglob("*.tmp"))
        assert not [p for p in d.iterdir() if p.is_dir()]
        for i in range(5):
            assert st.get(key(i), NSD, BB) == payload(key(i))
        assert st.get(key(5), NSD, BB) is None
        assert st.stats()["used_bytes"] == 5 * FP and sorted(live(d)) == sorted(
            key(i) for i in range(5))
    finally:
        st.close()


def _v2_file(d, sb: int, nslots: int, blocks: dict) -> "os.PathLike":
    """A slot file of format version 2 (the payloads 4 KiB aligned right
    after the headers), written byte by byte: blocks = {slot: (key, data)}."""
    geo = files.geometry(sb, nslots, files.OLD_VERSION)
    img = bytearray(geo["size"])
    img[:files.FILE_HDR.size] = files.FILE_HDR.pack(files.FILE_MAGIC, 2, 0, sb, nslots,
                                                    geo["entries"], geo["window"])
    for slot, (k, data) in blocks.items():
        h = files.HDR.pack(b"CXSB", 2, files.LIVE, 0, len(data), 0, k, NSD,
                           xxhash.xxh3_64_intdigest(data))
        o = geo["hdr_off"] + slot * files.HDR_SIZE
        img[o:o + files.HDR_SIZE] = h + struct.pack("<QQ", xxhash.xxh3_64_intdigest(h), 5)
        o = geo["data_off"] + slot * sb
        img[o:o + len(data)] = data
    d.mkdir(parents=True, exist_ok=True)
    f = d / files.file_name(sb)
    f.write_bytes(bytes(img))
    return f


def test_a_slot_file_of_version_2_is_migrated(tmp_path, caplog):
    """Slot files of format version 2: a reader refuses them with a clear
    reason; the owner moves the blocks that verify into version 3 files
    (payloads from 2 MiB on), drops the rest, and removes the old file; an
    owner stopped mid-migration leaves it aside, and the next one finishes."""
    d = tmp_path / "s"
    blocks = {s: (key(s), payload(key(s))) for s in range(6)}
    f = _v2_file(d, BB, 16, blocks)
    raw = bytearray(f.read_bytes())
    raw[files.geometry(BB, 16, 2)["data_off"] + 3 * BB + 7] ^= 1      # slot 3: a bad payload
    f.write_bytes(bytes(raw))
    with pytest.raises(SpillOldFormat, match="version 2"):
        files.SlotFile.open(f)
    with caplog.at_level(logging.WARNING, logger="cxlkv.kv.tiers.spill"):
        st = spill.SpillStore(d, 64 * FP)
    try:
        assert [r.getMessage() for r in caplog.records if "migrated" in r.getMessage()] == [
            f"spill: {f}: migrated 5 of its 5 verified spilled blocks from slot file format "
            "version 2 (the rest did not fit or were there already)"]
        assert sorted(p.name for p in d.glob("*slots-*")) == [files.file_name(BB)]
        new = files.SlotFile.open(f, writable=False)
        assert new.data_off == 2 << 20
        new.close()
        for s in (0, 1, 2, 4, 5):
            assert st.get(key(s), NSD, BB) == payload(key(s))
        assert st.get(key(3), NSD, BB) is None
        assert st.stats()["used_bytes"] == 5 * FP
    finally:
        st.close()
    # an owner that stopped after moving a file aside: the next one finishes it
    aside = _v2_file(tmp_path / "old", BB, 16, {0: (key(0), payload(key(0))),
                                                 9: (key(9), payload(key(9)))})
    aside = aside.rename(d / (files.OLD_PREFIX + files.file_name(BB)))
    _v2_file(d, 2 * BB, 4, {1: (key(20), payload(key(20), 2 * BB))})
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cxlkv.kv.tiers.spill"):
        st = spill.SpillStore(d, 64 * FP)
    try:
        assert sorted(r.getMessage() for r in caplog.records if "migrated" in r.getMessage()) == [
            f"spill: {aside}: migrated 1 of its 2 verified spilled blocks from slot file format "
            "version 2 (the rest did not fit or were there already)",
            f"spill: {d / files.file_name(2 * BB)}: migrated 1 of its 1 verified spilled blocks "
            "from slot file format version 2 (the rest did not fit or were there already)"]
        assert not aside.exists() and not files.old_slot_files(d)
        assert st.get(key(9), NSD, BB) == payload(key(9))
        assert st.get(key(0), NSD, BB) == payload(key(0))
        assert st.get(key(20), NSD, 2 * BB) == payload(key(20), 2 * BB)
        assert st.stats()["blocks"] == 7
    finally:
        st.close()


def test_a_slot_file_of_another_version_is_refused(tmp_path):
    """A slot file of a version this one does not know: a clear error, the
    file left as it is."""
    sf = files.SlotFile.create(tmp_path / files.file_name(4096), 4096, 2)
    sf.close()
    raw = bytearray(sf.path.read_bytes())
    raw[8:12] = struct.pack("<I", 9)
    sf.path.write_bytes(bytes(raw))
    with pytest.raises(OSError, match=r"not a spill slot file of version 3 \(version 9\)"):
        files.SlotFile.open(sf.path)
    assert sf.path.read_bytes() == bytes(raw) and files.old_slot_files(tmp_path) == []


# -- promotion reads runs --------------------------------------------------------------------

def test_fetch_reads_a_run_and_stops_at_a_block_that_does_not_verify(tmp_path):
    """fetch (what promotion calls) reads adjacent slots in one go and
    verifies each block: it returns the run up to the first block that is
    missing or damaged (freed, counted), bit-exact."""
    st = spill.SpillStore(tmp_path / "s", 64 * FP, writers=1)
    try:
        ks = [key(i) for i in range(8)]
        for k in ks:
            st.offer(k, NSD, payload(k))
        st.flush()
        got = st.fetch(ks, NSD, BB)
        assert [bytes(b) for b in got] == [payload(k) for k in ks]
        # the buffers start on a page; the file's payloads on a 2 MiB boundary
        assert all(np.frombuffer(b, np.uint8).ctypes.data % 4096 == 0 for b in got)
        assert st._files[BB].data_off % (2 << 20) == 0
        path, off, _ = st.locate(ks[5], BB)
        poke(path, off + 4096, b"\xff" * 8)                 # block 5 damaged
        got = st.fetch(ks, NSD, BB)
        assert [bytes(b) for b in got] == [payload(k) for k in ks[:5]]
        s = st.stats()
        assert s["corrupt"] == 1 and s["hits"] == 13 and st.locate(ks[5], BB) is None
        assert len(st.fetch(ks[:3] + [key(99)] + ks[3:], NSD, BB)) == 3   # a missing block
        assert st.fetch(ks, b"x" * 16, BB) == []            # another namespace: nothing
    finally:
        st.close()


def test_the_index_touches_a_run_in_one_call():
    """Index.touch_run: the locations of the leading keys indexed in one
    slot file, each moved to the most recent end; it stops at a key not
    indexed, one without a location or one of another slot size (that one
    touched, as a key-by-key walk would)."""
    ix = Index()
    for i, loc in enumerate([(BB, 3), (BB, 4), (BB, 5), (2 * BB, 0), (BB, 9)]):
        ix.remember(key(i), FP, 0, loc)
    ix.remember(key(7), FP, 0, None)
    assert ix.touch_run([key(0), key(1), key(2), key(3), key(4)]) == [(BB, 3), (BB, 4), (BB, 5)]
    assert [k for k, _ in ix.items()][-4:] == [key(0), key(1), key(2), key(3)]
    assert ix.touch_run([key(9), key(4)]) == [] and ix.touch_run([key(4)], 0) == [(BB, 9)]
    assert ix.touch_run([key(4), key(7), key(0)]) == [(BB, 9)]
    assert ix.touch_run([key(1), key(4)], 1) == [(BB, 9)]
