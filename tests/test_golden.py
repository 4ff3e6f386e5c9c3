"""The committed golden image: still readable, and reproduced byte for byte."""
from __future__ import annotations

import gzip
import os
import uuid
from pathlib import Path

import pytest

from cxlkv.pool import layout
from cxlkv.pool.format import FormatParams, format_buffer
from cxlkv.pool.superblock import select

GOLDEN = Path(__file__).parent / "golden" / "pool-v1-4m.img.gz"
#: the same parameters formatted before the block names (compat NAMES) existed
BEFORE_NAMES = Path(__file__).parent / "golden" / "pool-v1-4m-before-names.img.gz"
PARAMS = FormatParams(size=4 << 20, sync="manager", chunk_size=64 << 10, max_nodes=4,
                      lease_ms=5000, hash_slots=64, hash_max_load_pct=80, label="golden")
INJECT = dict(pool_uuid=uuid.UUID("6f0c1b5e-2d4a-4e59-9a59-0c8c1f1e2d3a"),
              ctime_ns=1_790_000_000_123_456_789, secret=bytes(range(32)), creator="cxlkv golden")


def make_image() -> bytes:
    buf = bytearray(PARAMS.size)
    format_buffer(buf, PARAMS, **INJECT)
    return bytes(buf)


@pytest.mark.parametrize("image", [GOLDEN, BEFORE_NAMES], ids=["current", "before-names"])
def test_golden_image_still_reads(image):
    raw = gzip.decompress(image.read_bytes())
    sel = select(raw[:4096], raw[4096:8192])
    sb = sel.sb
    assert sb.sync == "manager" and sb.max_nodes == 4 and sb.chunk_size == 64 << 10
    assert sb.pool_size == 4 << 20 and sb.lease_ms == 5000 and sb.hash_slots == 64
    assert sb.label == "golden" and sb.uuid == INJECT["pool_uuid"]
    assert sb.tenant_secret == INJECT["secret"] and sb.ctime_ns == INJECT["ctime_ns"]
    assert sel.problems == {}
    assert bool(sb.compat & layout.COMPAT_NAMES) == (image == GOLDEN)


def test_format_reproduces_golden_image():
    assert make_image() == gzip.decompress(GOLDEN.read_bytes())


if __name__ == "__main__":  # regenerate: python tests/test_golden.py (after a deliberate change)
    GOLDEN.write_bytes(gzip.compress(make_image(), mtime=0))
    print(f"wrote {GOLDEN} ({os.path.getsize(GOLDEN)} bytes)")
