"""The one definition of a KV block's value in the remote tier.

A value is a fixed 72-byte little-endian header followed by the payload (the
block's bytes, block_bytes long):

    offset size field
    0      8    magic            b"CXLKVRB\\0"
    8      2    version          VERSION (a newer one: not ours to read, kept)
    10     2    flags            0 (no flag defined yet; an unknown one: not ours)
    12     4    reserved         0
    16     8    payload length   = block_bytes
    24     16   key              the block's 16-byte pool key, echoed
    40     16   namespace digest the namespace's 16-byte digest
    56     8    payload xxh3-64
    64     8    header xxh3-64   of bytes 0..63
    72     ...  payload

decode() checks everything against what the reader expects and raises
CorruptValue with a reason.  `CorruptValue.damaged` says what a reader
should do with the value: True - it is damaged (bad magic or checksum,
truncated, another key's or namespace's header): delete it; False - it is
intact but not readable by this reader (a newer version or unknown flags, a
block of another size): leave it for whoever wrote it.
"""
from __future__ import annotations

import struct

import xxhash

from cxlkv.errors import CorruptValue

MAGIC = b"CXLKVRB\0"
VERSION = 1
#: flags this version understands (none yet)
KNOWN_FLAGS = 0

HEAD = struct.Struct("<8sHHIQ16s16sQ")        # everything the header checksum covers
HEADER_SIZE = HEAD.size + 8                   # + xxh3-64 of HEAD
_SUM = struct.Struct("<Q")

#: field -> (offset, size), pinned by tests/test_remote.py
OFFSETS = {"magic": (0, 8), "version": (8, 2), "flags": (10, 2), "reserved": (12, 4),
           "length": (16, 8), "key": (24, 16), "ns_digest": (40, 16),
           "payload_xxh3": (56, 8), "header_xxh3": (64, 8)}


def _check16(name: str, b) -> bytes:
    b = bytes(b)
    if len(b) != 16:
        raise ValueError(f"{name} must be 16 bytes, not {len(b)}")
    return b


def header(key, ns_digest, payload) -> bytes:
    """The 72-byte header of `payload` stored under `key` in namespace `ns_digest`."""
    head = HEAD.pack(MAGIC, VERSION, 0, 0, len(payload), _check16("key", key),
                     _check16("ns_digest", ns_digest), xxhash.xxh3_64_intdigest(payload))
    return head + _SUM.pack(xxhash.xxh3_64_intdigest(head))


def encode(key, ns_digest, payload) -> bytes:
    """Header + payload, one bytes object (the payload is copied once)."""
    return header(key, ns_digest, payload) + payload


def payload_bytes(payload) -> bytes:
    """`payload` itself when it is bytes (immutable: no copy), else one copy
    of its bytes."""
    return payload if type(payload) is bytes else bytes(memoryview(payload).cast("B"))


def encode_parts(key, ns_digest, payload) -> tuple[bytes, bytes]:
    """(header, payload) of the value, the payload as bytes (payload_bytes)."""
    data = payload_bytes(payload)
    return header(key, ns_digest, data), data


def decode(key, ns_digest, block_bytes: int, value) -> memoryview:
    """The payload of `value` (a zero-copy view into it), after checking it is
    block `key` of namespace `ns_digest`, block_bytes long, intact.  Raises
    CorruptValue."""
    mv = memoryview(value).cast("B")
    n = len(mv)
    if n < HEADER_SIZE:
        if n < 10:
            raise CorruptValue("truncated", f"{n} bytes")
        if bytes(mv[:8]) != MAGIC:
            raise CorruptValue("magic")
        version = int.from_bytes(mv[8:10], "little")
        if version > VERSION:
            raise CorruptValue("version", f"version {version}, this cxlkv reads {VERSION}",
                               damaged=False)
        raise CorruptValue("truncated", f"{n} bytes, header is {HEADER_SIZE}")
    magic, version, flags, reserved, length, k, nsd, psum = HEAD.unpack_from(mv)
    if magic != MAGIC:
        raise CorruptValue("magic")
    if version > VERSION:
        # checked before the header checksum: a newer header may be laid out otherwise
        raise CorruptValue("version", f"version {version}, this cxlkv reads {VERSION}",
                           damaged=False)
    if xxhash.xxh3_64_intdigest(mv[:HEAD.size]) != _SUM.unpack_from(mv, HEAD.size)[0]:
        raise CorruptValue("header-checksum")
    if version < 1:
        raise CorruptValue("version", f"version {version}")
    if flags & ~KNOWN_FLAGS or reserved:
        raise CorruptValue("flags", f"flags {flags:#x}, reserved {reserved:#x}", damaged=False)
    if k != bytes(key):
        raise CorruptValue("key", "the header names another block")
    if nsd != bytes(ns_digest):
        raise CorruptValue("namespace", "the header names another namespace")
    if n < HEADER_SIZE + length:
        raise CorruptValue("truncated", f"{n - HEADER_SIZE} of {length} payload bytes")
    if n > HEADER_SIZE + length:
        raise CorruptValue("length", f"{n - HEADER_SIZE - length} bytes after the payload")
    payload = mv[HEADER_SIZE:]
    if xxhash.xxh3_64_intdigest(payload) != psum:
        raise CorruptValue("payload-checksum")
    if length != block_bytes:
        # intact, but a block of another size: another reader's, not damaged
        raise CorruptValue("length", f"{length} bytes, expected {block_bytes}", damaged=False)
    return payload
