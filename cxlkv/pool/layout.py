"""Python mirror of the on-media structures in cxlkv/_core/src/cxlkv_format.h.

The C header is the definition; these ctypes structures declare the same
fields so Python can encode and decode them.  tests/test_layout.py checks the
two agree field by field (offsets and sizes from C's offsetof) and pins every
offset, so a change to either side fails the build until both and the golden
image are updated together.
"""
from __future__ import annotations

import ctypes
from ctypes import c_char, c_uint8, c_uint32, c_uint64

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

# Feature bits this version understands (none yet).
COMPAT_SUPPORTED = 0
INCOMPAT_SUPPORTED = 0
RO_COMPAT_SUPPORTED = 0

# Regions, in pool order; index = slot in superblock.regions.
REGION_NAMES = ("nodes", "locks", "bitmap", "heaps", "hash", "data")
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
        ("reserved", c_uint8 * 3704),
        ("checksum", c_uint64),
    ]


class NodeStruct(ctypes.LittleEndianStructure):
    _pack_ = 1
    _fields_ = [
        ("control", c_uint64),
        ("heartbeat", c_uint64),
        ("claim_token", c_uint64),
        ("grant_token", c_uint64),
        ("line0_pad", c_uint8 * 32),
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
        ("reserved", c_uint8 * 224),
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
        ("reserved", c_uint8 * 3856),
    ]


class LockEntryStruct(ctypes.LittleEndianStructure):
    _pack_ = 1
    _fields_ = [
        ("state", c_uint64),
        ("ticket", c_uint64),
        ("epoch", c_uint64),
        ("req_seq", c_uint64),
        ("release_seq", c_uint64),
        ("freeing", c_uint64),
        ("line0_pad", c_uint8 * 16),
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


STRUCTS = {"superblock": SuperblockStruct, "region": Region, "node": NodeStruct,
           "lock_hdr": LockHdrStruct, "lock_entry": LockEntryStruct, "chunk": ChunkStruct}


def field_layout(struct: type[ctypes.Structure]) -> dict[str, tuple[int, int]]:
    """{field: (offset, size)} of a mirror structure."""
    return {name: (getattr(struct, name).offset, getattr(struct, name).size)
            for name, *_ in struct._fields_}


def field_offset(struct: type[ctypes.Structure], name: str) -> int:
    return getattr(struct, name).offset
