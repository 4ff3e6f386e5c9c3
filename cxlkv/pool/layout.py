"""Python mirror of the on-media structures in cxlkv/_core/src/cxlkv_format.h.

The C header is the definition; these ctypes structures declare the same
fields so Python can encode and decode them.  tests/test_layout.py checks the
two agree field by field (offsets and sizes from C's offsetof) and pins every
offset, so a change to either side fails the build until both and the golden
image are updated together.
"""
from __future__ import annotations

import ctypes
from ctypes import c_char, c_uint8, c_uint16, c_uint32, c_uint64

MAGIC = b"CXLKVPOL"
FORMAT_VERSION = 1
SB_SIZE = 4096
SB_COPIES = 2
SB_OFFSETS = (0, SB_SIZE)  # copy A, copy B
CACHELINE = 64
PAGE = 4096

SYNC_CAS = 1
SYNC_MANAGER = 2
SYNC_NAMES = {SYNC_CAS: "cas", SYNC_MANAGER: "manager"}
SYNC_CODES = {v: k for k, v in SYNC_NAMES.items()}

# Feature bits this version understands.
COMPAT_KV = 1               # the pool has a KV region
COMPAT_NAMES = 1 << 1       # the KV region ends with block names (BlockNameStruct)
COMPAT_SUPPORTED = COMPAT_KV | COMPAT_NAMES
COMPAT_FEATURE_NAMES = {COMPAT_KV: "kv", COMPAT_NAMES: "names"}
INCOMPAT_KV_LRU = 1 << 0     # the KV region holds the leaf LRU lists (cxlkv_format.h)
INCOMPAT_JOURNAL = 1 << 2    # the KV region ends with the change journal
INCOMPAT_BADCHUNKS = 1 << 3  # the lock header page holds the retired-chunk list (BadChunk*)
INCOMPAT_NAMES = {INCOMPAT_KV_LRU: "kv_lru", INCOMPAT_JOURNAL: "journal",
                  INCOMPAT_BADCHUNKS: "badchunks"}
INCOMPAT_SUPPORTED = INCOMPAT_KV_LRU | INCOMPAT_JOURNAL | INCOMPAT_BADCHUNKS
#: features the KV cache needs, with what each is (pools of cxlkv 0.1 lack them)
KV_REQUIRED = {INCOMPAT_KV_LRU: "KV_LRU (the in-pool eviction lists)",
               INCOMPAT_JOURNAL: "JOURNAL (the change journal)"}


def missing_kv_features(incompat: int) -> list[str]:
    """The KV_REQUIRED features a pool's incompat mask lacks, by name."""
    return [name for bit, name in KV_REQUIRED.items() if not incompat & bit]
RO_COMPAT_SUPPORTED = 0

# Regions; index = slot in superblock.regions.  POOL_ORDER is the order they
# lie in the pool (data always last; kv was added in slot 6).
REGION_NAMES = ("nodes", "locks", "bitmap", "heaps", "hash", "data", "kv")
POOL_ORDER = ("nodes", "locks", "bitmap", "heaps", "hash", "kv", "data")
REGION_COUNT = 8
REGION_INDEX = {name: i for i, name in enumerate(REGION_NAMES)}

# Per-item record sizes the region sizes are computed from.
NODE_SIZE = 512
LOCK_HDR_SIZE = 4096
LOCK_ENTRY_SIZE = 128
HEAP_SIZE = 1024
CHUNK_DESC_SIZE = 256
HASH_ENTRY_SIZE = 64

NODE_FREE = 0
NODE_CLAIMED = 1
NODE_ATTACHED = 2
NODE_FENCED = 3
#: node flags (NodeStruct.flags; identity, written by the node): the KV-events publisher
NODE_FLAG_KV_EVENTS = 1
NODE_STATE_BITS = 8
NODE_STATE_MASK = 0xFF
NODE_STATE_NAMES = {NODE_FREE: "free", NODE_CLAIMED: "claimed", NODE_ATTACHED: "attached",
                    NODE_FENCED: "fenced"}

LOCK_IDLE = 0
LOCK_WAITING = 1
LOCK_LOCKED = 2
LOCK_ABANDONED = 3


def node_control(state: int, epoch: int) -> int:
    """Pack a node slot's control word."""
    return state | epoch << NODE_STATE_BITS


def node_state(control: int) -> tuple[int, int]:
    """Unpack a control word into (state, epoch)."""
    return control & NODE_STATE_MASK, control >> NODE_STATE_BITS


class Region(ctypes.LittleEndianStructure):
    _pack_ = 1
    _fields_ = [("off", c_uint64), ("size", c_uint64)]


class SuperblockStruct(ctypes.LittleEndianStructure):
    _pack_ = 1
    _fields_ = [
        ("magic", c_char * 8),
        ("version", c_uint32),
        ("sb_size", c_uint32),
        ("seq", c_uint64),
        ("compat", c_uint64),
        ("incompat", c_uint64),
        ("ro_compat", c_uint64),
        ("uuid", c_uint8 * 16),
        ("pool_size", c_uint64),
        ("ctime_ns", c_uint64),
        ("sync_mode", c_uint32),
        ("max_nodes", c_uint32),
        ("chunk_size", c_uint64),
        ("lease_ms", c_uint64),
        ("hash_slots", c_uint64),
        ("hash_max_load_pct", c_uint32),
        ("flags", c_uint32),
        ("nchunks", c_uint64),
        ("regions", Region * REGION_COUNT),
        ("tenant_secret", c_uint8 * 32),
        ("label", c_char * 64),
        ("creator", c_char * 32),
        ("grace_ms", c_uint64),
        ("name_tokens", c_uint32),
        ("reserved", c_uint8 * 3692),
        ("checksum", c_uint64),
    ]


class NodeStruct(ctypes.LittleEndianStructure):
    _pack_ = 1
    _fields_ = [
        ("control", c_uint64),
        ("heartbeat", c_uint64),
        ("claim_token", c_uint64),
        ("grant_token", c_uint64),
        ("ack_epoch", c_uint64),
        ("line0_pad", c_uint8 * 24),
        ("pid", c_uint64),
        ("start_time_ns", c_uint64),
        ("attach_time_ns", c_uint64),
        ("format_version", c_uint32),
        ("flags", c_uint32),
        ("boot_id", c_uint8 * 16),
        ("hostname", c_char * 64),
        ("sw_version", c_char * 32),
        ("pidns", c_uint64),
        ("ident_epoch", c_uint64),
        ("reserved", c_uint8 * 32),
        # line 4: written only by probers (the visibility challenge, state.visibility)
        ("challenge", c_uint64),
        ("challenge_epoch", c_uint64),
        ("line4_pad", c_uint8 * 48),
        # line 5: written only by the node, with its heartbeat: the challenge echoed
        ("answer", c_uint64),
        ("answer_epoch", c_uint64),
        ("answer_heartbeat", c_uint64),
        ("line5_pad", c_uint8 * 40),
        ("reserved6", c_uint8 * 64),
        ("mgr_control", c_uint64),
        ("mgr_grant_token", c_uint64),
        ("line7_pad", c_uint8 * 48),
    ]


class LockHdrStruct(ctypes.LittleEndianStructure):
    _pack_ = 1
    _fields_ = [
        ("next_ticket", c_uint64),
        ("line0_pad", c_uint8 * 56),
        ("now_serving", c_uint64),
        ("owner", c_uint64),
        ("acquisitions", c_uint64),
        ("line1_pad", c_uint8 * 40),
        ("mgr_token", c_uint64),
        ("mgr_epoch", c_uint64),
        ("mgr_heartbeat", c_uint64),
        ("mgr_pid", c_uint64),
        ("mgr_boot_id", c_uint8 * 16),
        ("mgr_hostname", c_char * 64),
        ("mgr_recovering", c_uint64),
        ("mgr_pidns", c_uint64),
        ("reserved", c_uint8 * 3840),
    ]


# Retired (poisoned) chunks: incompat BADCHUNKS.  The list lives in the lock
# header page's reserved bytes (LockHdrStruct.reserved, from offset 240), at
# BADCHUNK_LIST_OFF: a header, then BADCHUNK_MAX entries.  Written only under
# the pool lock: an entry first, then `count` (an append a crash cannot tear).
# A data chunk named here keeps its bitmap bit set for ever, so the allocator
# never hands it out again; an entry with chunk == BADCHUNK_NO_CHUNK records a
# hit outside the data region (metadata: CRITICAL, see cxlkv-runbook(7)).
BADCHUNK_MAGIC = 0x314442564B4C5843      # b"CXLKVBD1" little-endian
BADCHUNK_LIST_OFF = 256                  # from the start of the lock header page
BADCHUNK_NO_CHUNK = (1 << 64) - 1
BADCHUNK_POISON = 1                      # reasons
BADCHUNK_MEDIA_ERROR = 2
BADCHUNK_MANUAL = 3
BADCHUNK_REASONS = {BADCHUNK_POISON: "poison", BADCHUNK_MEDIA_ERROR: "media-error",
                    BADCHUNK_MANUAL: "manual"}


class BadChunkHdrStruct(ctypes.LittleEndianStructure):
    _pack_ = 1
    _fields_ = [
        ("magic", c_uint64),
        ("count", c_uint32),
        ("capacity", c_uint32),
        ("retired_bytes", c_uint64),     # sum over data entries of the chunk size
        ("metadata_hits", c_uint64),
    ]


class BadChunkStruct(ctypes.LittleEndianStructure):
    _pack_ = 1
    _fields_ = [
        ("chunk", c_uint64),             # data chunk index, or BADCHUNK_NO_CHUNK
        ("offset", c_uint64),            # pool offset of the bad range
        ("length", c_uint32),            # bytes of the bad range
        ("reason", c_uint16),            # BADCHUNK_* reason
        ("region", c_uint16),            # REGION_INDEX of the region hit
        ("time_ns", c_uint64),           # CLOCK_REALTIME when retired
    ]


BADCHUNK_MAX = (LOCK_HDR_SIZE - BADCHUNK_LIST_OFF - ctypes.sizeof(BadChunkHdrStruct)) \
    // ctypes.sizeof(BadChunkStruct)


class LockEntryStruct(ctypes.LittleEndianStructure):
    _pack_ = 1
    _fields_ = [
        ("state", c_uint64),
        ("ticket", c_uint64),
        ("epoch", c_uint64),
        ("req_seq", c_uint64),
        ("release_seq", c_uint64),
        ("freeing", c_uint64),
        ("held_when_fenced", c_uint64),
        ("recovering", c_uint64),
        ("grant_seq", c_uint64),
        ("revoke_seq", c_uint64),
        ("grant_epoch", c_uint64),
        ("line1_pad", c_uint8 * 40),
    ]


CHUNK_FREE = 0
CHUNK_HEAD = 1
CHUNK_TAIL = 2
CHUNK_RELEASING = 3
SLAB_MAX_SLOTS = 512


class ChunkStruct(ctypes.LittleEndianStructure):
    _pack_ = 1
    _fields_ = [
        ("control", c_uint64),
        ("owner", c_uint64),
        ("slot_size", c_uint64),
        ("nslots", c_uint64),
        ("nchunks", c_uint64),
        ("pad", c_uint8 * 24),
        ("alloc_bits", c_uint64 * 8),
        ("pub_bits", c_uint64 * 8),
        ("dirty_bits", c_uint64 * 8),
    ]


HEAP_HAZARDS = 8


class HeapStruct(ctypes.LittleEndianStructure):
    """Per-node heap header: the allocator's hazard words (cxlkv_format.h)."""

    _pack_ = 1
    _fields_ = [
        ("hazard", c_uint64 * HEAP_HAZARDS),
        ("reserved", c_uint8 * 960),
    ]


# KV cache (see cxlkv_format.h): hash entry states, records, per-node areas.
KV_EMPTY = 0
KV_WRITING = 1
KV_PENDING = 2
KV_PUBLISHED = 3
KV_EVICTING = 4
KV_TOMBSTONE = 5
KV_STATE_NAMES = {KV_EMPTY: "empty", KV_WRITING: "writing", KV_PENDING: "pending",
                  KV_PUBLISHED: "published", KV_EVICTING: "evicting", KV_TOMBSTONE: "tombstone"}
KV_MAGIC = 0x31564B564B4C5843
KV_HDR_SIZE = 4096
KV_NS_SIZE = 256
KV_TENANT_SIZE = 64
KV_NS_NAME = 128
KV_NSTATS = 8
KV_REC_FREE = 0
KV_REC_ACTIVE = 1
KV_HASH_XXH3_128 = 1
KV_HASH_SHA256_CBOR = 2
KV_HASH_NAMES = {KV_HASH_XXH3_128: "xxh3_128", KV_HASH_SHA256_CBOR: "sha256_cbor"}
KV_HASH_CODES = {v: k for k, v in KV_HASH_NAMES.items()}
KV_NODE_HDR_SIZE = 128
KV_LRU_LISTS = 256


class HashEntryStruct(ctypes.LittleEndianStructure):
    _pack_ = 1
    _fields_ = [
        ("ctl", c_uint64),
        ("key_lo", c_uint64),
        ("key_hi", c_uint64),
        ("payload", c_uint64),
        ("length", c_uint32),
        ("ns", c_uint16),
        ("tenant", c_uint16),
        ("parent", c_uint32),
        ("children", c_uint32),
        ("owner", c_uint64),
        ("lru", c_uint64),
    ]


class KVHdrStruct(ctypes.LittleEndianStructure):
    _pack_ = 1
    _fields_ = [
        ("magic", c_uint64),
        ("max_namespaces", c_uint32),
        ("max_tenants", c_uint32),
        ("pins_per_node", c_uint32),
        ("ring_per_node", c_uint32),
        ("ns_off", c_uint64),
        ("tenant_off", c_uint64),
        ("node_off", c_uint64),
        ("node_stride", c_uint64),
        ("line0_pad", c_uint8 * 8),
        ("live", c_uint64),
        ("tombstones", c_uint64),
        ("evictions", c_uint64),
        ("evicted_bytes", c_uint64),
        ("line1_pad", c_uint8 * 32),
        ("lru_off", c_uint64),
        ("lru_dirty", c_uint64),
        ("lru_leaves", c_uint64),
        ("lru_rebuilds", c_uint64),
        ("purge_cursor", c_uint64),
        ("line2_pad", c_uint8 * 24),
        ("lru_lists", c_uint64 * KV_LRU_LISTS),
        ("reserved", c_uint8 * 1856),
    ]


KV_STAT_NAMES = ("lookups", "hit_blocks", "miss_blocks", "stored_blocks", "present_blocks",
                 "stored_bytes", "loaded_blocks", "loaded_bytes")


class KVStatsStruct(ctypes.LittleEndianStructure):
    _pack_ = 1
    _fields_ = [(name, c_uint64) for name in KV_STAT_NAMES]


class KVNsStruct(ctypes.LittleEndianStructure):
    _pack_ = 1
    _fields_ = [
        ("name", c_char * 128),
        ("state", c_uint32),
        ("hash_kind", c_uint32),
        ("block_tokens", c_uint32),
        ("reserved0", c_uint32),
        ("block_bytes", c_uint64),
        ("digest", c_uint8 * 16),
        ("blocks", c_uint64),
        ("evictions", c_uint64),
        ("evicted_bytes", c_uint64),
        ("stats", KVStatsStruct),
    ]


class KVTenantStruct(ctypes.LittleEndianStructure):
    _pack_ = 1
    _fields_ = [
        ("salt", c_uint8 * 16),
        ("state", c_uint32),
        ("reserved0", c_uint32),
        ("quota", c_uint64),
        ("used", c_uint64),
        ("blocks", c_uint64),
        ("rejected", c_uint64),
        ("reserved1", c_uint64),
    ]


class KVNodeStruct(ctypes.LittleEndianStructure):
    _pack_ = 1
    _fields_ = [
        ("ring_head", c_uint64),
        ("line0_pad", c_uint8 * 56),
        ("ring_drained", c_uint64),
        ("line1_pad", c_uint8 * 56),
    ]


# Change journal (incompat JOURNAL; see cxlkv_format.h): records' ops.
JOURNAL_MAGIC = 0x314E4A564B4C5843
JOURNAL_REC_SIZE = 64
JOURNAL_STORED = 1
JOURNAL_EVICTED = 2
JOURNAL_NS_CLEARED = 3
JOURNAL_OP_NAMES = {JOURNAL_STORED: "stored", JOURNAL_EVICTED: "evicted",
                    JOURNAL_NS_CLEARED: "namespace-cleared"}


class JournalHdrStruct(ctypes.LittleEndianStructure):
    _pack_ = 1
    _fields_ = [
        ("magic", c_uint64),
        ("records_per_node", c_uint32),
        ("rec_size", c_uint32),
        ("ring_off", c_uint64),
        ("ring_stride", c_uint64),
        ("max_nodes", c_uint32),
        ("line0_pad", c_uint8 * 28),
        ("next_seq", c_uint64),
        ("line1_pad", c_uint8 * 56),
    ]


class JournalRingStruct(ctypes.LittleEndianStructure):
    _pack_ = 1
    _fields_ = [("head", c_uint64), ("writer", c_uint64), ("pad", c_uint8 * 48)]


class JournalRecStruct(ctypes.LittleEndianStructure):
    _pack_ = 1
    _fields_ = [
        ("seq", c_uint64),
        ("key_lo", c_uint64),
        ("key_hi", c_uint64),
        ("parent_lo", c_uint64),
        ("parent_hi", c_uint64),
        ("length", c_uint32),
        ("ns", c_uint16),
        ("tenant", c_uint16),
        ("time_us", c_uint64),
        ("entry", c_uint32),
        ("op", c_uint8),
        ("reserved", c_uint8 * 3),
    ]


# Block names (compat NAMES; see cxlkv_format.h): the chain hash each block
# was keyed by, per hash entry and per journal record (the block's and its
# parent's), so that KV events can name blocks as the engines do.
NAME_SIZE = 64
NAME_MAX = 40
NAME_TOKENS_MAX = 1024
#: token ids a block name keeps unless `cxlkv format --name-tokens` says otherwise
#: (vLLM's default block size)
DEFAULT_NAME_TOKENS = 16


class BlockNameStruct(ctypes.LittleEndianStructure):
    _pack_ = 1
    _fields_ = [
        ("key_lo", c_uint64),
        ("key_hi", c_uint64),
        ("len", c_uint32),
        ("ntokens", c_uint32),
        ("name", c_uint8 * NAME_MAX),
    ]


def name_entry_size(name_tokens: int) -> int:
    """Bytes of a table name entry: the name record, then name_tokens token
    ids (uint32), to a cache-line multiple (cxlkv_name_entry_size)."""
    return NAME_SIZE + _align(4 * name_tokens, CACHELINE)


STRUCTS = {"superblock": SuperblockStruct, "region": Region, "node": NodeStruct,
           "lock_hdr": LockHdrStruct, "lock_entry": LockEntryStruct, "chunk": ChunkStruct,
           "heap": HeapStruct, "hash_entry": HashEntryStruct, "kv_hdr": KVHdrStruct, "kv_stats": KVStatsStruct,
           "kv_ns": KVNsStruct, "kv_tenant": KVTenantStruct, "kv_node": KVNodeStruct,
           "journal_hdr": JournalHdrStruct, "journal_ring": JournalRingStruct,
           "journal_rec": JournalRecStruct, "block_name": BlockNameStruct, "badchunk_hdr": BadChunkHdrStruct,
           "badchunk": BadChunkStruct}


def field_layout(struct: type[ctypes.Structure]) -> dict[str, tuple[int, int]]:
    """{field: (offset, size)} of a mirror structure."""
    return {name: (getattr(struct, name).offset, getattr(struct, name).size)
            for name, *_ in struct._fields_}


def field_offset(struct: type[ctypes.Structure], name: str) -> int:
    return getattr(struct, name).offset


KV_MAX_NAMESPACES = 64
KV_MAX_TENANTS = 256


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def kv_geometry(max_nodes: int, hash_slots: int) -> dict[str, int]:
    """Where the parts of the KV region lie (offsets relative to its start).

    Pins per node and touch-ring records per node scale with the hash table
    (a node can pin a quarter of it, up to 8192 blocks)."""
    pins = min(8192, max(256, hash_slots // 4))
    ring = min(4096, max(64, hash_slots // 16))
    ns_off = KV_HDR_SIZE
    tenant_off = ns_off + KV_MAX_NAMESPACES * KV_NS_SIZE
    node_off = _align(tenant_off + KV_MAX_TENANTS * KV_TENANT_SIZE, PAGE)
    stats_off = KV_NODE_HDR_SIZE
    pins_off = stats_off + KV_MAX_NAMESPACES * ctypes.sizeof(KVStatsStruct)
    ring_off = _align(pins_off + pins * 8, CACHELINE)
    stride = _align(ring_off + ring * 8, PAGE)
    lru_off = _align(node_off + max_nodes * stride, PAGE)
    return {"max_namespaces": KV_MAX_NAMESPACES, "max_tenants": KV_MAX_TENANTS,
            "pins_per_node": pins, "ring_per_node": ring, "ns_off": ns_off,
            "tenant_off": tenant_off, "node_off": node_off, "node_stride": stride,
            "stats_off": stats_off, "pins_off": pins_off, "ring_off": ring_off,
            "lru_off": lru_off, "size": lru_off + hash_slots * 8}


def journal_geometry(max_nodes: int, hash_slots: int) -> dict[str, int]:
    """Where the change journal lies in the KV region (offsets relative to
    its start): a header page on the first page boundary after the per-node
    areas (kv_geometry), then one ring per node slot.  Records per node scale
    with the hash table (a thirty-second of it, 256 to 16384)."""
    recs = min(16384, max(256, hash_slots // 32))
    hdr_off = _align(kv_geometry(max_nodes, hash_slots)["size"], PAGE)
    ring_off = hdr_off + PAGE
    stride = _align(ctypes.sizeof(JournalRingStruct) + recs * JOURNAL_REC_SIZE, PAGE)
    return {"records_per_node": recs, "hdr_off": hdr_off, "ring_off": ring_off,
            "ring_stride": stride, "end": ring_off + max_nodes * stride}


def names_geometry(max_nodes: int, hash_slots: int, name_tokens: int) -> dict[str, int]:
    """Where the block names lie in the KV region (offsets relative to its
    start): on the first page boundary after the journal, one name entry per
    hash entry (entry_size bytes), then per ring one name record per journal
    record (ring_stride bytes a ring)."""
    j = journal_geometry(max_nodes, hash_slots)
    esize = name_entry_size(name_tokens)
    table_off = _align(j["end"], PAGE)
    ring_off = _align(table_off + hash_slots * esize, PAGE)
    stride = _align(j["records_per_node"] * NAME_SIZE, PAGE)
    return {"table_off": table_off, "entry_size": esize, "ring_off": ring_off,
            "ring_stride": stride, "end": ring_off + max_nodes * stride}


def kv_region_size(max_nodes: int, hash_slots: int, incompat: int, compat: int = 0,
                   name_tokens: int = 0) -> int:
    """Bytes the KV region needs: the KV areas (with the LRU link array when
    the pool has KV_LRU), the journal when it has JOURNAL, and the block
    names after it when it has NAMES too."""
    if incompat & INCOMPAT_JOURNAL and compat & COMPAT_NAMES:
        return names_geometry(max_nodes, hash_slots, name_tokens)["end"]
    if incompat & INCOMPAT_JOURNAL:
        return journal_geometry(max_nodes, hash_slots)["end"]
    g = kv_geometry(max_nodes, hash_slots)
    # a pool without the LRU lists is refused by name where the KV area opens
    return g["size"] if incompat & INCOMPAT_KV_LRU else g["lru_off"]
