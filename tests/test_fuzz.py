"""Property tests: random bytes at the superblock parser and the C bounds checks.

Whatever the input, the parser returns a Superblock or raises a CxlkvError,
and the C core returns data or raises PoolRangeError / TypeError - never a
crash.  (The ASan/UBSan build runs these too; see README.)
"""
from __future__ import annotations

import os

from hypothesis import HealthCheck, given, settings, strategies as st

from cxlkv import _core
from cxlkv.errors import CxlkvError, PoolRangeError
from cxlkv.pool import layout
from cxlkv.pool.format import build_superblock
from cxlkv.pool.superblock import checksum, decode, select

from cxlkv.testing.pools import small_params

VALID = build_superblock(small_params()).encode()
FUZZ = settings(max_examples=int(os.environ.get("CXLKV_FUZZ_EXAMPLES", "400")),
                deadline=None, suppress_health_check=[HealthCheck.too_slow])


def parse(raw: bytes):
    try:
        return decode(raw)
    except CxlkvError:
        return None


@FUZZ
@given(st.binary(min_size=0, max_size=4200))
def test_random_bytes(raw):
    parse(raw)
    try:
        select(raw, raw[::-1])
    except CxlkvError:
        pass


@FUZZ
@given(st.lists(st.tuples(st.integers(0, layout.SB_SIZE - 1), st.integers(0, 255)), max_size=20),
       st.booleans())
def test_mutated_valid_superblock(edits, fix_checksum):
    """Flip bytes of a valid superblock, optionally re-checksumming, so the
    field validation (not just the checksum) sees garbage."""
    buf = bytearray(VALID)
    for off, val in edits:
        buf[off] = val
    if fix_checksum:
        buf[4088:] = bytes(8)
        buf[4088:] = checksum(buf).to_bytes(8, "little")
    sb = parse(bytes(buf))
    if sb is not None:
        # anything accepted has regions inside the pool, in order
        end = 2 * layout.SB_SIZE
        for name in layout.POOL_ORDER:
            off, size = sb.regions[name]
            if name == "kv" and not sb.compat & layout.COMPAT_KV:
                assert (off, size) == (0, 0)
                continue
            assert off >= end and off + size <= sb.pool_size
            end = off + size


SIZE = 64 * 1024
u64 = st.one_of(st.integers(0, 2 * SIZE), st.integers(0, 2**64 - 1), st.integers(-2**70, -1),
                st.integers(2**64, 2**70))


@FUZZ
@given(st.sampled_from(["load64", "store64", "cas64", "fetch_add64", "read", "flush",
                        "invalidate", "zero", "view", "write", "readinto"]),
       u64, u64, u64)
def test_c_bounds_checks(op, a, b, c):
    buf = bytearray(SIZE)
    m = _core.Mapping.from_buffer(buf)
    args = {"load64": (a,), "store64": (a, b), "cas64": (a, b, c), "fetch_add64": (a, b),
            "read": (a, b % (4 * SIZE)), "flush": (a, b), "invalidate": (a, b),
            "zero": (a, b), "view": (a, b), "write": (a, b"z" * (b % (2 * SIZE))),
            "readinto": (a, bytearray(b % (2 * SIZE)))}[op]
    try:
        r = getattr(m, op)(*args)
    except (PoolRangeError, TypeError):
        r = None
    if op == "view" and r is not None:
        assert len(r) == b and a + b <= SIZE
        r.release()
    m.close()
