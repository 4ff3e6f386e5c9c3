"""Helpers that damage pool files on purpose, for the tests of fsck, repair,
health and the superblock rules: raw byte patches, superblocks re-encoded
with a valid checksum, node-table slots written as some other node would,
chunk descriptors located."""
from __future__ import annotations

import uuid

from cxlkv.pool import layout
from cxlkv.api import Pool
from cxlkv.pool.superblock import checksum
from cxlkv.state import alloc
from cxlkv.state.nodes import local_pidns


def patch_bytes(path: str, offset: int, data: bytes) -> None:
    """Overwrite bytes of a pool file in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def reencode(raw: bytes, **fields) -> bytes:
    """A superblock image with fields changed and a valid checksum."""
    buf = bytearray(raw)
    s = layout.SuperblockStruct.from_buffer(buf)
    for k, v in fields.items():
        setattr(s, k, v)
    s.checksum = 0
    s.checksum = checksum(buf)
    del s
    return bytes(buf)


def rewrite_superblock(path: str, copy: str, **fields) -> None:
    """Re-encode one superblock copy ("A" or "B") of a pool file with changed fields."""
    off = layout.SB_OFFSETS["AB".index(copy)]
    with open(path, "r+b") as f:
        f.seek(off)
        raw = reencode(f.read(layout.SB_SIZE), **fields)
        f.seek(off)
        f.write(raw)


def fake_node(path: str, slot: int, *, pid: int, start_time_ns: int, boot_id: str,
              hostname: str = "testhost", heartbeat: int = 1,
              state: int = layout.NODE_ATTACHED) -> None:
    """Write a node-table slot as an attached node would."""
    with Pool.open(path, force=True) as pool:
        off, _ = pool.region("nodes")
        s = layout.NodeStruct()
        s.control, s.heartbeat = layout.node_control(state, 1), heartbeat
        s.pid, s.start_time_ns = pid, start_time_ns
        s.pidns, s.ident_epoch = local_pidns(), 1
        s.format_version = 1
        s.boot_id[:] = uuid.UUID(boot_id).bytes
        s.hostname = hostname.encode()
        s.sw_version = b"test"
        pool.mapping.write(off + slot * layout.NODE_SIZE, bytes(s))


def desc_off(pool, chunk: int) -> int:
    """Offset of chunk `chunk`'s descriptor in an open pool."""
    return alloc.geometry(pool)[3] + chunk * layout.CHUNK_DESC_SIZE


def damage(path: str, fn):
    """Open the pool at path (its allocator geometry set on the mapping, so
    the C allocator calls work) and call fn(pool) to damage it; returns what
    fn returned."""
    with Pool.open(path) as p:
        p.mapping.set_geometry(*alloc.geometry(p))
        return fn(p)
