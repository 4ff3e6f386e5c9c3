"""Formatting: parameters, the region layout, and writing a fresh pool.

`format_mapping` is a function of a Mapping (a mapped pool, or any buffer
wrapped by Mapping.from_buffer) and parameters, so tests format a bytearray
without files.  Order (famfs): the old superblocks are destroyed first, the
tables are zeroed and flushed, the superblocks are written last - a crash
half way leaves "not formatted", never a half-old pool.
"""
from __future__ import annotations

import os
import time
import uuid as uuidlib
from dataclasses import dataclass
from typing import Callable

from cxlkv.version import __version__
from cxlkv._core import Mapping
from cxlkv.errors import UsageError
from cxlkv.pool import layout
from cxlkv.pool.superblock import MAX_GRACE_MS, Superblock
from cxlkv.util.sizes import GiB, KiB, MiB, human_size

DEFAULT_SIZE = 1 * GiB
DEFAULT_CHUNK = 2 * MiB
DEFAULT_MAX_NODES = 128
DEFAULT_LEASE_MS = 10_000
DEFAULT_HASH_LOAD_PCT = 90
#: one hash slot per this many pool bytes unless --hash-slots says otherwise
HASH_BYTES_PER_SLOT = 16 * KiB
MIN_HASH_SLOTS = 1024

def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class FormatParams:
    """What `cxlkv format` / `cxlkv init` are asked for."""

    size: int = DEFAULT_SIZE
    sync: str = "cas"
    chunk_size: int = DEFAULT_CHUNK
    max_nodes: int = DEFAULT_MAX_NODES
    lease_ms: int = DEFAULT_LEASE_MS
    grace_ms: int = 0                      # 0: the default (GRACE_LEASES leases)
    hash_slots: int | None = None          # None: derived from size
    hash_max_load_pct: int = DEFAULT_HASH_LOAD_PCT
    label: str = ""
    name_tokens: int = layout.DEFAULT_NAME_TOKENS   # token ids kept per block name

    def validate(self) -> None:
        if self.sync not in layout.SYNC_CODES:
            raise UsageError(f"sync mode must be one of {', '.join(layout.SYNC_CODES)}, "
                             f"not {self.sync!r}")
        if not _is_pow2(self.chunk_size) or not 64 * KiB <= self.chunk_size <= 1 * GiB:
            raise UsageError(f"chunk size {self.chunk_size} must be a power of two "
                             "between 64K and 1G")
        if not 1 <= self.max_nodes <= 4096:
            raise UsageError(f"max nodes {self.max_nodes} must be between 1 and 4096")
        if not 100 <= self.lease_ms <= 3_600_000:
            raise UsageError(f"lease {self.lease_ms} ms must be between 100 ms and 1 hour")
        if self.grace_ms and not self.lease_ms <= self.grace_ms <= MAX_GRACE_MS:
            raise UsageError(f"quarantine grace {self.grace_ms} ms must be between the lease "
                             f"({self.lease_ms} ms) and 7 days")
        if self.hash_slots is not None and (not _is_pow2(self.hash_slots)
                                            or self.hash_slots < 64):
            raise UsageError(f"hash slots {self.hash_slots} must be a power of two >= 64")
        if (isinstance(self.name_tokens, bool) or not isinstance(self.name_tokens, int)
                or not 0 <= self.name_tokens <= layout.NAME_TOKENS_MAX):
            raise UsageError(f"name tokens {self.name_tokens} must be between 0 and "
                             f"{layout.NAME_TOKENS_MAX} (token ids kept per KV block name)")
        if not 10 <= self.hash_max_load_pct <= 99:
            raise UsageError("hash max load must be between 10 and 99 percent")
        try:
            label = self.label.encode("utf-8")
        except UnicodeEncodeError:
            raise UsageError("label must be valid UTF-8 text") from None
        if len(label) > 63 or "\0" in self.label:
            raise UsageError("label must be at most 63 bytes, without NUL")
        if self.size % layout.PAGE:
            raise UsageError(f"size {self.size} is not a multiple of 4 KiB")

    def effective_hash_slots(self) -> int:
        if self.hash_slots is not None:
            return self.hash_slots
        want = max(MIN_HASH_SLOTS, self.size // HASH_BYTES_PER_SLOT)
        return 1 << (want - 1).bit_length()


@dataclass(frozen=True)
class Layout:
    regions: dict[str, tuple[int, int]]
    nchunks: int
    hash_slots: int


def compute_layout(p: FormatParams) -> Layout:
    """Where each region lies for these parameters (pure arithmetic)."""
    p.validate()
    hash_slots = p.effective_hash_slots()
    # Metadata sized for every chunk the pool could hold; the data area then
    # starts at the first chunk boundary after it.
    max_chunks = p.size // p.chunk_size
    sizes = {
        "nodes": p.max_nodes * layout.NODE_SIZE,
        "locks": layout.LOCK_HDR_SIZE + p.max_nodes * layout.LOCK_ENTRY_SIZE,
        "bitmap": _align((max_chunks + 63) // 64 * 8, 8),
        "heaps": p.max_nodes * layout.HEAP_SIZE + max_chunks * layout.CHUNK_DESC_SIZE,
        "hash": hash_slots * layout.HASH_ENTRY_SIZE,
        "kv": layout.kv_region_size(p.max_nodes, hash_slots,
                                    layout.INCOMPAT_KV_LRU | layout.INCOMPAT_JOURNAL,
                                    layout.COMPAT_KV | layout.COMPAT_NAMES, p.name_tokens),
    }
    off = layout.SB_COPIES * layout.SB_SIZE
    regions: dict[str, tuple[int, int]] = {}
    for name in layout.POOL_ORDER[:-1]:
        size = _align(max(sizes[name], 1), layout.PAGE)
        regions[name] = (off, size)
        off += size
    data_off = _align(off, p.chunk_size)
    nchunks = (p.size - data_off) // p.chunk_size if p.size > data_off else 0
    if nchunks < 1:
        need = data_off + p.chunk_size
        raise UsageError(
            f"a pool of {human_size(p.size)} is too small for these parameters: "
            f"metadata needs {human_size(data_off)} and at least one {human_size(p.chunk_size)} "
            f"chunk, so at least {human_size(need)} (or lower --max-nodes / --hash-slots / "
            f"--chunk-size)")
    regions["data"] = (data_off, nchunks * p.chunk_size)
    return Layout(regions, nchunks, hash_slots)


def build_superblock(p: FormatParams, *, pool_uuid: uuidlib.UUID | None = None,
                     ctime_ns: int | None = None, secret: bytes | None = None,
                     creator: str | None = None) -> Superblock:
    lay = compute_layout(p)
    if secret is not None and len(secret) != 32:
        raise UsageError("tenant secret must be 32 bytes")
    return Superblock(
        pool_size=p.size, sync=p.sync, chunk_size=p.chunk_size, max_nodes=p.max_nodes,
        lease_ms=p.lease_ms, grace_ms=p.grace_ms, hash_slots=lay.hash_slots, hash_max_load_pct=p.hash_max_load_pct,
        nchunks=lay.nchunks, regions=lay.regions,
        uuid=pool_uuid or uuidlib.uuid4(),
        ctime_ns=time.time_ns() if ctime_ns is None else ctime_ns,
        tenant_secret=os.urandom(32) if secret is None else secret,
        label=p.label, creator=creator or f"cxlkv {__version__}", seq=1,
        compat=layout.COMPAT_KV | layout.COMPAT_NAMES, name_tokens=p.name_tokens,
        incompat=layout.INCOMPAT_KV_LRU | layout.INCOMPAT_JOURNAL)


Progress = Callable[[int, int], None]   # (bytes done, bytes total)


def destroy_superblocks(m) -> None:
    """Zero and flush both superblock copies: the pool stops being a pool."""
    m.zero(0, layout.SB_COPIES * layout.SB_SIZE)


def format_mapping(m, p: FormatParams, *, zero_data: bool = True,
                   pool_uuid: uuidlib.UUID | None = None, ctime_ns: int | None = None,
                   secret: bytes | None = None, creator: str | None = None,
                   progress: Progress | None = None) -> Superblock:
    """Format the pool behind Mapping `m` with parameters `p`.

    zero_data=False skips zeroing the data area (only for memory known to be
    zero, e.g. a freshly allocated file); old tenant data must never survive
    a format.
    """
    if p.size > m.size:
        raise UsageError(f"size {p.size} is larger than the mapping ({m.size} bytes)")
    sb = build_superblock(p, pool_uuid=pool_uuid, ctime_ns=ctime_ns, secret=secret,
                          creator=creator)
    destroy_superblocks(m)
    data_off, data_size = sb.regions["data"]
    meta_end = data_off
    total = meta_end + (data_size if zero_data else 0)
    done = layout.SB_COPIES * layout.SB_SIZE
    step = 64 * MiB
    for off in range(done, total, step):
        n = min(step, total - off)
        m.zero(off, n)
        done = off + n
        if progress:
            progress(done, total)
    kv_off, _ = sb.regions["kv"]
    for off, rec in kv_initial_records(sb.max_nodes, sb.hash_slots):
        m.write(kv_off + off, rec)
    raw = sb.encode()
    # copy B first, then A: the same image with seq 1 in both
    m.write(layout.SB_OFFSETS[1], raw)
    m.write(layout.SB_OFFSETS[0], raw)
    if progress:
        progress(total, total)
    return sb


def kv_initial_records(max_nodes: int, hash_slots: int) -> list[tuple[int, bytes]]:
    """(offset in the KV region, bytes) a fresh KV region holds besides zeros:
    its header (with the leaf LRU lists empty and the place of their link
    array), tenant record 0 (the unsalted tenant) active, and the change
    journal's header (its rings start empty: heads 0)."""
    g = layout.kv_geometry(max_nodes, hash_slots)
    h = layout.KVHdrStruct()
    h.magic = layout.KV_MAGIC
    for f in ("max_namespaces", "max_tenants", "pins_per_node", "ring_per_node", "ns_off",
              "tenant_off", "node_off", "node_stride"):
        setattr(h, f, g[f])
    h.lru_off = g["lru_off"]
    t = layout.KVTenantStruct()
    t.state = layout.KV_REC_ACTIVE
    j = layout.journal_geometry(max_nodes, hash_slots)
    jh = layout.JournalHdrStruct(magic=layout.JOURNAL_MAGIC, records_per_node=j["records_per_node"],
                            rec_size=layout.JOURNAL_REC_SIZE, ring_off=j["ring_off"],
                            ring_stride=j["ring_stride"], max_nodes=max_nodes, next_seq=1)
    return [(0, bytes(h)), (g["tenant_off"], bytes(t)), (j["hdr_off"], bytes(jh))]


def format_buffer(buf, p: FormatParams, **kw) -> Superblock:
    """Format a writable buffer (bytearray, numpy array, mmap) in place."""

    with Mapping.from_buffer(buf) as m:
        return format_mapping(m, p, **kw)
