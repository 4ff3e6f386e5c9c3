"""The spill store's files: ``DIR/<2 hex>/<32 hex key>.blk``, a 72-byte
header then the payload, written to a temporary ``KEY.PID.THREAD.N.tmp``
beside it and renamed into place.

The header: magic, format version, reserved, the pool key, the namespace
digest, the payload length, the xxh3-64 of the payload; then the xxh3-64 of
those 64 bytes.
"""
from __future__ import annotations

import os
import struct
from pathlib import Path

import xxhash

MAGIC = b"CXLKVSP\0"
VERSION = 1
# magic, version, reserved, key, ns digest, length, xxh3-64 of the payload; then
# an xxh3-64 of those 64 bytes: a 72-byte header
HDR = struct.Struct("<8sII16s16sQQ")
HDR_SIZE = HDR.size + 8


def block_path(root: Path, key: bytes) -> Path:
    """Where the file of `key` lives under the store's directory."""
    h = key.hex()
    return root / h[:2] / (h + ".blk")


def block_key(name: str) -> bytes | None:
    """The key of a block file's name, or None for another name."""
    if not name.endswith(".blk") or len(name) != 36:
        return None
    return bytes.fromhex(name[:32])          # ValueError: not hex


def header(key: bytes, ns_digest: bytes, payload) -> bytes:
    """The 72-byte header of a block file."""
    hdr = HDR.pack(MAGIC, VERSION, 0, key, ns_digest, len(payload),
                   xxhash.xxh3_64_intdigest(payload))
    return hdr + struct.pack("<Q", xxhash.xxh3_64_intdigest(hdr))


def verify(raw: bytes, key: bytes, ns_digest: bytes, length: int) -> bool:
    """Whether `raw` (a whole file) is the block `key` of namespace
    `ns_digest`, `length` payload bytes, intact."""
    if len(raw) != HDR_SIZE + length:
        return False
    magic, ver, _, k, nsd, ln, xs = HDR.unpack_from(raw)
    hsum = struct.unpack_from("<Q", raw, HDR.size)[0]
    return (magic == MAGIC and ver == VERSION and k == key and nsd == ns_digest
            and ln == length and hsum == xxhash.xxh3_64_intdigest(raw[:HDR.size])
            and xs == xxhash.xxh3_64_intdigest(memoryview(raw)[HDR_SIZE:]))


def tmp_path(path: Path, thread: int, n: int) -> Path:
    """The temporary a writer thread writes `path` to first."""
    return path.with_name(f"{path.name[:-4]}.{os.getpid()}.{thread}.{n}.tmp")


def tmp_pid(name: str) -> int | None:
    """The writer's pid in a temporary's name (KEY.PID.THREAD.N.tmp)."""
    parts = name.split(".")
    if len(parts) == 5 and parts[1].isdigit():
        return int(parts[1])
    return None


def write_all(fd: int, data) -> None:
    mv = memoryview(data)
    while mv:
        n = os.write(fd, mv)
        mv = mv[n:]
