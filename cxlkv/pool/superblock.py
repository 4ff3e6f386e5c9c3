"""Superblock: encode, decode and validate one copy; choose between the two.

Decoding is a parser of untrusted bytes: whatever the input, it returns a
Superblock or raises a PoolInvalid / PoolIncompatible subclass, never
anything else (tests/test_superblock_fuzz.py throws random bytes at it).

Rules (ndctl label index, PMDK pool header):
* two copies, at 0 and 4096, each with a sequence number; the valid copy with
  the higher number wins, so a torn write of one copy is survivable;
* the checksum is xxh64 (seed 0) over the 4096 bytes with the checksum field
  zeroed; it is checked before any other field is believed;
* an unknown incompat feature refuses to open, an unknown ro_compat feature
  opens read-only, an unknown compat feature is ignored.
"""
from __future__ import annotations

import dataclasses
import re
import uuid as uuidlib
from dataclasses import dataclass, field

import xxhash

from cxlkv.errors import (
    CxlkvError,
    NotFormatted,
    PoolCorrupt,
    PoolIncompatible,
    PoolTruncated,
    WrongMagic,
)
from cxlkv.pool import layout
from cxlkv.version import __version__

_CSUM_OFF = layout.field_offset(layout.SuperblockStruct, "checksum")
#: default quarantine grace (grace_ms 0), in leases
GRACE_LEASES = 6
MAX_GRACE_MS = 7 * 24 * 3600 * 1000


def checksum(raw: bytes | bytearray | memoryview) -> int:
    """xxh64 of a superblock image with its checksum field taken as zero."""
    mv = memoryview(raw)[: layout.SB_SIZE]
    h = xxhash.xxh64(seed=0)
    h.update(mv[:_CSUM_OFF])
    h.update(b"\0" * 8)
    h.update(mv[_CSUM_OFF + 8:])
    return h.intdigest()


@dataclass(frozen=True)
class Superblock:
    """A decoded, validated superblock copy."""

    pool_size: int
    sync: str                     # "cas" | "manager"
    chunk_size: int
    max_nodes: int
    lease_ms: int
    hash_slots: int
    hash_max_load_pct: int
    nchunks: int
    regions: dict[str, tuple[int, int]]   # name -> (offset, size)
    uuid: uuidlib.UUID
    ctime_ns: int
    tenant_secret: bytes = field(repr=False)
    label: str = ""
    creator: str = ""
    seq: int = 1
    version: int = layout.FORMAT_VERSION
    compat: int = 0
    incompat: int = 0
    ro_compat: int = 0
    grace_ms: int = 0             # 0: the default, GRACE_LEASES leases
    name_tokens: int = 0          # compat NAMES: token ids kept per block name

    @property
    def quarantine_grace_ms(self) -> int:
        """How long what a fenced node held stays quarantined when the node
        neither acknowledges its fencing nor is proven gone."""
        return self.grace_ms or GRACE_LEASES * self.lease_ms

    @property
    def read_only_features(self) -> int:
        """ro_compat bits this software does not know (force read-only)."""
        return self.ro_compat & ~layout.RO_COMPAT_SUPPORTED

    def replace(self, **changes) -> "Superblock":
        return dataclasses.replace(self, **changes)

    def encode(self) -> bytes:
        s = layout.SuperblockStruct()
        s.magic = layout.MAGIC
        s.version = self.version
        s.sb_size = layout.SB_SIZE
        s.seq = self.seq
        s.compat, s.incompat, s.ro_compat = self.compat, self.incompat, self.ro_compat
        s.uuid[:] = self.uuid.bytes
        s.pool_size = self.pool_size
        s.ctime_ns = self.ctime_ns
        s.sync_mode = layout.SYNC_CODES[self.sync]
        s.max_nodes = self.max_nodes
        s.chunk_size = self.chunk_size
        s.lease_ms = self.lease_ms
        s.grace_ms = self.grace_ms
        s.name_tokens = self.name_tokens
        s.hash_slots = self.hash_slots
        s.hash_max_load_pct = self.hash_max_load_pct
        s.nchunks = self.nchunks
        for name, (off, size) in self.regions.items():
            r = s.regions[layout.REGION_INDEX[name]]
            r.off, r.size = off, size
        s.tenant_secret[:] = self.tenant_secret
        s.label = _cstr(self.label, 64, "label")
        s.creator = _cstr(self.creator, 32, "creator")
        raw = bytearray(bytes(s))
        raw[_CSUM_OFF:_CSUM_OFF + 8] = checksum(raw).to_bytes(8, "little")
        return bytes(raw)

    def to_json(self) -> dict:
        return {
            "uuid": str(self.uuid),
            "label": self.label,
            "format_version": self.version,
            "seq": self.seq,
            "pool_size": self.pool_size,
            "created_ns": self.ctime_ns,
            "sync": self.sync,
            "chunk_size": self.chunk_size,
            "nchunks": self.nchunks,
            "max_nodes": self.max_nodes,
            "lease_ms": self.lease_ms,
            "grace_ms": self.quarantine_grace_ms,
            "hash_slots": self.hash_slots,
            "hash_max_load_pct": self.hash_max_load_pct,
            "name_tokens": self.name_tokens if self.compat & layout.COMPAT_NAMES else None,
            "features": {"compat": self.compat, "incompat": self.incompat,
                         "ro_compat": self.ro_compat},
            "creator": self.creator,
            "regions": {name: {"offset": off, "size": size}
                        for name, (off, size) in self.regions.items()},
        }


def _cstr(text: str, size: int, what: str) -> bytes:
    b = text.encode("utf-8")
    if len(b) >= size:
        raise ValueError(f"{what} is longer than {size - 1} bytes")
    return b


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def decode(raw: bytes | bytearray | memoryview, *, copy: str = "A") -> Superblock:
    """Decode and validate one superblock copy.

    Raises NotFormatted (all zero), WrongMagic, PoolCorrupt (checksum or a
    field out of range), PoolTruncated (short input) or PoolIncompatible
    (a newer format version or an unknown incompat feature).
    """
    raw = bytes(memoryview(raw)[: layout.SB_SIZE])
    where = f"superblock copy {copy}"
    if len(raw) < layout.SB_SIZE:
        raise PoolTruncated(f"{where}: only {len(raw)} of {layout.SB_SIZE} bytes present")
    if not any(raw):
        raise NotFormatted(f"{where} is all zeros: not formatted")
    if raw[:8] != layout.MAGIC:
        raise WrongMagic(f"{where}: wrong magic {_show(raw[:8])} (a cxlkv pool starts with "
                         f"{layout.MAGIC.decode()})")
    s = layout.SuperblockStruct.from_buffer_copy(raw)
    stored = s.checksum
    if stored != checksum(raw):
        raise PoolCorrupt(f"{where}: checksum mismatch (stored {stored:#018x}, "
                          f"computed {checksum(raw):#018x})")
    if s.version != layout.FORMAT_VERSION:
        if s.version > layout.FORMAT_VERSION:
            raise PoolIncompatible(
                f"{where}: format version {s.version} is newer than this cxlkv supports "
                f"({layout.FORMAT_VERSION}); {_needs(s)}")
        raise PoolCorrupt(f"{where}: invalid format version {s.version}")
    unknown = s.incompat & ~layout.INCOMPAT_SUPPORTED
    if unknown:
        raise PoolIncompatible(
            f"{where}: unknown incompatible features {unknown:#x}; {_needs(s)}")
    return _validate(s, where)


def _needs(s: layout.SuperblockStruct) -> str:
    """Which cxlkv a pool needs: the one that formatted it (its `creator`,
    trusted once the checksum holds) when that is newer than this one, else
    (an older or unparsable creator: it cannot be what is missing) at least a
    newer one."""

    creator = s.creator.split(b"\0", 1)[0].decode("utf-8", "replace")
    made_by = creator.split()[1] if creator.startswith("cxlkv ") and len(creator.split()) > 1 \
        else None
    if made_by and _version_key(made_by) is not None and _version_key(__version__) is not None \
            and _version_key(made_by) > _version_key(__version__):
        return (f"it was formatted by {creator}: use cxlkv {made_by} or later "
                f"(this is cxlkv {__version__})")
    return f"it needs a newer cxlkv than this one ({__version__}): upgrade cxlkv to use it"


def _version_key(text: str):
    """A comparable version (packaging's when it is installed, else a tuple of
    the leading dot-separated integers); None when it cannot be read."""
    try:
        from packaging.version import InvalidVersion, Version
    except ImportError:                         # pragma: no cover - packaging is common
        Version = None
    if Version is not None:
        try:
            return Version(text)
        except InvalidVersion:
            return None

    m = re.match(r"(\d+(?:\.\d+)*)", text)
    return tuple(int(x) for x in m.group(1).split(".")) if m else None


def _validate(s: layout.SuperblockStruct, where: str) -> Superblock:
    def bad(msg: str) -> PoolCorrupt:
        return PoolCorrupt(f"{where}: {msg}")

    if s.sb_size != layout.SB_SIZE:
        raise bad(f"sb_size {s.sb_size} != {layout.SB_SIZE}")
    if s.sync_mode not in layout.SYNC_NAMES:
        raise bad(f"unknown sync mode {s.sync_mode}")
    if not _is_pow2(s.chunk_size) or not (4096 <= s.chunk_size <= 1 << 40):
        raise bad(f"chunk size {s.chunk_size} is not a power of two >= 4096")
    if not 1 <= s.max_nodes <= 65536:
        raise bad(f"max_nodes {s.max_nodes} out of range")
    if not 1 <= s.lease_ms <= 3_600_000:
        raise bad(f"lease {s.lease_ms} ms out of range (1 ms .. 1 hour)")
    if s.grace_ms and not s.lease_ms <= s.grace_ms <= MAX_GRACE_MS:
        raise bad(f"quarantine grace {s.grace_ms} ms out of range (the lease .. 7 days)")
    if s.name_tokens > layout.NAME_TOKENS_MAX:
        raise bad(f"name_tokens {s.name_tokens} out of range (0 .. {layout.NAME_TOKENS_MAX})")
    if not _is_pow2(s.hash_slots):
        raise bad(f"hash_slots {s.hash_slots} is not a power of two")
    if not 1 <= s.hash_max_load_pct <= 100:
        raise bad(f"hash_max_load_pct {s.hash_max_load_pct} out of range")
    if s.pool_size < 2 * layout.SB_SIZE or s.pool_size % layout.PAGE:
        raise bad(f"pool size {s.pool_size} invalid")
    regions: dict[str, tuple[int, int]] = {}
    has_kv = bool(s.compat & layout.COMPAT_KV)
    prev_end = layout.SB_COPIES * layout.SB_SIZE
    for name in layout.POOL_ORDER:
        i = layout.REGION_INDEX[name]
        off, size = s.regions[i].off, s.regions[i].size
        if name == "kv" and not has_kv:        # formatted before the KV region existed
            if off or size:
                raise bad("region slot 6 is set but the pool has no KV feature bit")
            regions[name] = (0, 0)
            continue
        if off % layout.PAGE or off < prev_end or size > s.pool_size or off > s.pool_size - size:
            raise bad(f"region {name} [{off}, +{size}) is misplaced")
        regions[name] = (off, size)
        prev_end = off + size
    for i in range(len(layout.REGION_NAMES), layout.REGION_COUNT):
        if s.regions[i].off or s.regions[i].size:
            raise bad(f"reserved region slot {i} is not empty")
    need = {
        "nodes": s.max_nodes * layout.NODE_SIZE,
        "locks": layout.LOCK_HDR_SIZE + s.max_nodes * layout.LOCK_ENTRY_SIZE,
        "bitmap": (s.nchunks + 7) // 8,
        "heaps": s.max_nodes * layout.HEAP_SIZE + s.nchunks * layout.CHUNK_DESC_SIZE,
        "hash": s.hash_slots * layout.HASH_ENTRY_SIZE,
    }
    if has_kv:
        need["kv"] = layout.kv_region_size(s.max_nodes, s.hash_slots, s.incompat, s.compat,
                                           s.name_tokens)
    for name, n in need.items():
        if regions[name][1] < n:
            raise bad(f"region {name} is {regions[name][1]} bytes, needs {n}")
    data_off, data_size = regions["data"]
    if s.nchunks == 0 or data_off % s.chunk_size or data_size != s.nchunks * s.chunk_size:
        raise bad(f"data region [{data_off}, +{data_size}) does not hold {s.nchunks} "
                  f"chunks of {s.chunk_size}")
    try:
        label = s.label.decode("utf-8")
        creator = s.creator.decode("utf-8")
    except UnicodeDecodeError:
        raise bad("label or creator is not UTF-8") from None
    return Superblock(
        pool_size=s.pool_size, sync=layout.SYNC_NAMES[s.sync_mode], chunk_size=s.chunk_size,
        max_nodes=s.max_nodes, lease_ms=s.lease_ms, hash_slots=s.hash_slots,
        hash_max_load_pct=s.hash_max_load_pct, nchunks=s.nchunks, regions=regions,
        uuid=uuidlib.UUID(bytes=bytes(s.uuid)), ctime_ns=s.ctime_ns,
        tenant_secret=bytes(s.tenant_secret), label=label, creator=creator, seq=s.seq,
        version=s.version, compat=s.compat, incompat=s.incompat, ro_compat=s.ro_compat,
        grace_ms=s.grace_ms, name_tokens=s.name_tokens)


@dataclass
class Selection:
    """Which copy won and what was wrong with the other."""

    sb: Superblock
    copy: str                         # "A" or "B"
    problems: dict[str, str]          # copy -> what is wrong with it (empty if both good)


def _seq_if_checksummed(raw: bytes) -> int | None:
    if len(raw) >= layout.SB_SIZE and raw[:8] == layout.MAGIC:
        s = layout.SuperblockStruct.from_buffer_copy(raw[: layout.SB_SIZE])
        if s.checksum == checksum(raw):
            return s.seq
    return None


# When both copies are bad, report the most telling reason.
_SEVERITY = (PoolIncompatible, PoolCorrupt, PoolTruncated, WrongMagic, NotFormatted)


def _show(b: bytes) -> str:
    """Bytes for a message: as text when printable, else hex - never a b'\\x..' repr."""
    text = b.decode("ascii", "replace")
    return f'"{text}"' if text.isprintable() and "\ufffd" not in text else f"0x{b.hex()}"


def select(raw_a: bytes, raw_b: bytes) -> Selection:
    """Choose the valid copy with the highest sequence number.

    A copy whose checksum holds but whose format is newer still takes part in
    the choice: if it is the newest, the pool is refused as incompatible
    rather than silently read at an older state.
    """
    good: list[tuple[int, str, Superblock | CxlkvError]] = []
    errors: dict[str, CxlkvError] = {}
    for name, raw in (("A", raw_a), ("B", raw_b)):
        try:
            sb = decode(raw, copy=name)
            good.append((sb.seq, name, sb))
        except CxlkvError as e:
            errors[name] = e
            seq = _seq_if_checksummed(raw)
            if seq is not None and isinstance(e, PoolIncompatible):
                good.append((seq, name, e))
    if good:
        # highest seq wins; on a tie copy A (written last by format) wins
        good.sort(key=lambda t: (t[0], t[1] == "A"), reverse=True)
        _, name, winner = good[0]
        if isinstance(winner, CxlkvError):
            raise winner
        return Selection(winner, name, {k: str(v) for k, v in errors.items()})
    for cls in _SEVERITY:
        hits = [e for e in errors.values() if isinstance(e, cls)]
        if hits:
            if cls is NotFormatted and len(hits) == 2:
                raise NotFormatted("both superblock copies are all zeros: not a formatted pool")
            if cls is WrongMagic and all(isinstance(e, (WrongMagic, NotFormatted))
                                         for e in errors.values()):
                raise WrongMagic(f"not a cxlkv pool: {hits[0]}")
            detail = "; ".join(f"{e}" for e in errors.values())
            raise cls(f"no valid superblock: {detail}")
    raise PoolCorrupt("no valid superblock")  # pragma: no cover - errors is never empty
