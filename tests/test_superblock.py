"""Superblock encode/decode, the two-copy rule, feature masks."""
from __future__ import annotations

import pytest

from cxlkv.errors import (NotFormatted, PoolCorrupt, PoolIncompatible, PoolTruncated,
                          UsageError, WrongMagic)
from cxlkv.ops.init import init_pool
from cxlkv.pool import layout
from cxlkv.pool.format import build_superblock
from cxlkv.pool.superblock import checksum, decode, select

from cxlkv.testing.damage import reencode
from cxlkv.testing.pools import small_params


def sb_bytes(**changes) -> bytes:
    sb = build_superblock(small_params())
    return sb.replace(**changes).encode() if changes else sb.encode()


def test_roundtrip():
    sb = build_superblock(small_params(sync="manager", label="rack7"))
    back = decode(sb.encode())
    assert back == sb


def test_encode_is_one_page_with_checksum():
    raw = sb_bytes()
    assert len(raw) == layout.SB_SIZE
    assert int.from_bytes(raw[4088:], "little") == checksum(raw)


def test_newer_seq_wins_and_torn_copy_survives():
    a = sb_bytes(seq=5, label="old")
    b = sb_bytes(seq=6, label="new")
    sel = select(a, b)
    assert (sel.copy, sel.sb.label) == ("B", "new")
    torn = b[:2000] + bytes(layout.SB_SIZE - 2000)      # half-written copy B
    sel = select(a, torn)
    assert (sel.copy, sel.sb.label) == ("A", "old")
    assert "checksum" in sel.problems["B"]


def test_tie_prefers_copy_a():
    raw = sb_bytes()
    assert select(raw, raw).copy == "A"


def test_all_zero_is_not_formatted():
    with pytest.raises(NotFormatted):
        select(bytes(4096), bytes(4096))


def test_wrong_magic():
    junk = b"\x7fELF" + bytes(range(256)) * 15 + bytes(252)
    with pytest.raises(WrongMagic, match="not a cxlkv pool"):
        select(junk[:4096], bytes(4096))


def test_both_checksums_bad():
    raw = bytearray(sb_bytes())
    raw[200] ^= 0xFF
    with pytest.raises(PoolCorrupt, match="checksum"):
        select(bytes(raw), bytes(raw))


def test_newer_version_refused():
    raw = reencode(sb_bytes(), version=2)
    with pytest.raises(PoolIncompatible, match="version 2 is newer"):
        decode(raw)
    # the newest copy decides: an older v1 copy does not hide a newer pool
    with pytest.raises(PoolIncompatible):
        select(reencode(sb_bytes(seq=1), version=1), reencode(sb_bytes(seq=2), version=2))


def test_unknown_incompat_refused_and_ro_compat_read_only():
    with pytest.raises(PoolIncompatible, match="incompatible features 0x10000000000"):
        decode(reencode(sb_bytes(), incompat=1 << 40))
    sb = decode(reencode(sb_bytes(), ro_compat=8, compat=layout.COMPAT_KV | 16))
    assert sb.read_only_features == 8


def test_short_input_is_truncated():
    with pytest.raises(PoolTruncated):
        decode(sb_bytes()[:100])


@pytest.mark.parametrize("field,value", [
    ("sb_size", 512), ("sync_mode", 9), ("chunk_size", 3000), ("max_nodes", 0),
    ("lease_ms", 0), ("hash_slots", 1000), ("hash_max_load_pct", 0), ("nchunks", 0),
    ("pool_size", 4095), ("version", 0),
])
def test_invalid_fields_are_corrupt(field, value):
    with pytest.raises(PoolCorrupt):
        decode(reencode(sb_bytes(), **{field: value}))


def test_misplaced_region_is_corrupt():
    buf = bytearray(sb_bytes())
    s = layout.SuperblockStruct.from_buffer(buf)
    s.regions[layout.REGION_INDEX["hash"]].off = 1 << 40
    del s
    with pytest.raises(PoolCorrupt, match="hash"):
        decode(reencode(bytes(buf)))


def test_an_incompatible_pool_names_the_cxlkv_it_needs():
    with pytest.raises(PoolIncompatible, match=r"formatted by cxlkv 9\.9\.9: use cxlkv 9\.9\.9 "
                                               r"or later"):
        decode(reencode(sb_bytes(), incompat=1 << 40, creator=b"cxlkv 9.9.9"))
    with pytest.raises(PoolIncompatible, match="needs a newer cxlkv"):
        decode(reencode(sb_bytes(), incompat=1 << 40, creator=b"someone else"))


def test_bad_format_arguments_are_usage_errors(tmp_path):
    """Arguments a caller got wrong are UsageError (exit 2), with the message."""
    with pytest.raises(UsageError, match="tenant secret must be 32 bytes"):
        build_superblock(small_params(), secret=b"short")
    with pytest.raises(UsageError, match=r"unknown format parameters: \['sizes'\]"):
        init_pool(str(tmp_path / "p.pool"), {"sizes": 1 << 20})
