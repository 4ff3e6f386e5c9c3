"""Layout pins: the C header and the Python mirror agree, and every offset is fixed.

Changing the on-media format means editing this file on purpose (PMDK's
obj_layout.c discipline), together with the C header, the mirror and the
golden image.
"""
from __future__ import annotations

import pytest

from cxlkv import _core
from cxlkv.pool import layout

# (offset, size) of every field, written out by hand.
PINNED = {
    "superblock": (4096, {
        "magic": (0, 8), "version": (8, 4), "sb_size": (12, 4), "seq": (16, 8),
        "compat": (24, 8), "incompat": (32, 8), "ro_compat": (40, 8), "uuid": (48, 16),
        "pool_size": (64, 8), "ctime_ns": (72, 8), "sync_mode": (80, 4), "max_nodes": (84, 4),
        "chunk_size": (88, 8), "lease_ms": (96, 8), "hash_slots": (104, 8),
        "hash_max_load_pct": (112, 4), "flags": (116, 4), "nchunks": (120, 8),
        "regions": (128, 128), "tenant_secret": (256, 32), "label": (288, 64),
        "creator": (352, 32), "grace_ms": (384, 8), "name_tokens": (392, 4),
        "reserved": (396, 3692), "checksum": (4088, 8),
    }),
    "region": (16, {"off": (0, 8), "size": (8, 8)}),
    "node": (512, {
        "control": (0, 8), "heartbeat": (8, 8), "claim_token": (16, 8), "grant_token": (24, 8),
        "ack_epoch": (32, 8), "line0_pad": (40, 24), "pid": (64, 8), "start_time_ns": (72, 8),
        "attach_time_ns": (80, 8), "format_version": (88, 4), "flags": (92, 4),
        "boot_id": (96, 16), "hostname": (112, 64), "sw_version": (176, 32),
        "pidns": (208, 8), "ident_epoch": (216, 8), "reserved": (224, 32),
        "challenge": (256, 8), "challenge_epoch": (264, 8), "line4_pad": (272, 48),
        "answer": (320, 8), "answer_epoch": (328, 8), "answer_heartbeat": (336, 8),
        "line5_pad": (344, 40), "reserved6": (384, 64),
        "mgr_control": (448, 8), "mgr_grant_token": (456, 8),
        "line7_pad": (464, 48),
    }),
    "lock_hdr": (4096, {
        "next_ticket": (0, 8), "line0_pad": (8, 56), "now_serving": (64, 8), "owner": (72, 8),
        "acquisitions": (80, 8), "line1_pad": (88, 40), "mgr_token": (128, 8),
        "mgr_epoch": (136, 8), "mgr_heartbeat": (144, 8), "mgr_pid": (152, 8),
        "mgr_boot_id": (160, 16), "mgr_hostname": (176, 64), "mgr_recovering": (240, 8),
        "mgr_pidns": (248, 8), "reserved": (256, 3840),
    }),
    "chunk": (256, {
        "control": (0, 8), "owner": (8, 8), "slot_size": (16, 8), "nslots": (24, 8),
        "nchunks": (32, 8), "pad": (40, 24), "alloc_bits": (64, 64),
        "pub_bits": (128, 64), "dirty_bits": (192, 64),
    }),
    "heap": (1024, {"hazard": (0, 64), "reserved": (64, 960)}),
    "lock_entry": (128, {
        "state": (0, 8), "ticket": (8, 8), "epoch": (16, 8), "req_seq": (24, 8),
        "release_seq": (32, 8), "freeing": (40, 8), "held_when_fenced": (48, 8),
        "recovering": (56, 8),
        "grant_seq": (64, 8),
        "revoke_seq": (72, 8), "grant_epoch": (80, 8), "line1_pad": (88, 40),
    }),
    "hash_entry": (64, {
        "ctl": (0, 8), "key_lo": (8, 8), "key_hi": (16, 8), "payload": (24, 8),
        "length": (32, 4), "ns": (36, 2), "tenant": (38, 2), "parent": (40, 4),
        "children": (44, 4), "owner": (48, 8), "lru": (56, 8),
    }),
    "kv_hdr": (4096, {
        "magic": (0, 8), "max_namespaces": (8, 4), "max_tenants": (12, 4),
        "pins_per_node": (16, 4), "ring_per_node": (20, 4), "ns_off": (24, 8),
        "tenant_off": (32, 8), "node_off": (40, 8), "node_stride": (48, 8),
        "line0_pad": (56, 8), "live": (64, 8), "tombstones": (72, 8), "evictions": (80, 8),
        "evicted_bytes": (88, 8), "line1_pad": (96, 32), "lru_off": (128, 8),
        "lru_dirty": (136, 8), "lru_leaves": (144, 8), "lru_rebuilds": (152, 8),
        "purge_cursor": (160, 8), "line2_pad": (168, 24), "lru_lists": (192, 2048),
        "reserved": (2240, 1856),
    }),
    "kv_stats": (64, {
        "lookups": (0, 8), "hit_blocks": (8, 8), "miss_blocks": (16, 8),
        "stored_blocks": (24, 8), "present_blocks": (32, 8), "stored_bytes": (40, 8),
        "loaded_blocks": (48, 8), "loaded_bytes": (56, 8),
    }),
    "kv_ns": (256, {
        "name": (0, 128), "state": (128, 4), "hash_kind": (132, 4), "block_tokens": (136, 4),
        "reserved0": (140, 4), "block_bytes": (144, 8), "digest": (152, 16),
        "blocks": (168, 8), "evictions": (176, 8), "evicted_bytes": (184, 8),
        "stats": (192, 64),
    }),
    "kv_tenant": (64, {
        "salt": (0, 16), "state": (16, 4), "reserved0": (20, 4), "quota": (24, 8),
        "used": (32, 8), "blocks": (40, 8), "rejected": (48, 8), "reserved1": (56, 8),
    }),
    "kv_node": (128, {
        "ring_head": (0, 8), "line0_pad": (8, 56), "ring_drained": (64, 8),
        "line1_pad": (72, 56),
    }),
    "journal_hdr": (128, {
        "magic": (0, 8), "records_per_node": (8, 4), "rec_size": (12, 4), "ring_off": (16, 8),
        "ring_stride": (24, 8), "max_nodes": (32, 4), "line0_pad": (36, 28),
        "next_seq": (64, 8), "line1_pad": (72, 56),
    }),
    "journal_ring": (64, {"head": (0, 8), "writer": (8, 8), "pad": (16, 48)}),
    "journal_rec": (64, {
        "seq": (0, 8), "key_lo": (8, 8), "key_hi": (16, 8), "parent_lo": (24, 8),
        "parent_hi": (32, 8), "length": (40, 4), "ns": (44, 2), "tenant": (46, 2),
        "time_us": (48, 8), "entry": (56, 4), "op": (60, 1), "reserved": (61, 3),
    }),
    "block_name": (64, {
        "key_lo": (0, 8), "key_hi": (8, 8), "len": (16, 4), "ntokens": (20, 4),
        "name": (24, 40),
    }),
    "badchunk_hdr": (32, {
        "magic": (0, 8), "count": (8, 4), "capacity": (12, 4), "retired_bytes": (16, 8),
        "metadata_hits": (24, 8),
    }),
    "badchunk": (32, {
        "chunk": (0, 8), "offset": (8, 8), "length": (16, 4), "reason": (20, 2),
        "region": (22, 2), "time_ns": (24, 8),
    }),
}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_python_mirror_matches_pins(name):
    size, fields = PINNED[name]
    struct = layout.STRUCTS[name]
    assert layout.field_layout(struct) == fields
    import ctypes
    assert ctypes.sizeof(struct) == size


@pytest.mark.parametrize("name", sorted(PINNED))
def test_c_header_matches_pins(name):
    size, fields = PINNED[name]
    c = _core.layout()[name]
    assert c["size"] == size
    assert {k: tuple(v) for k, v in c["fields"].items()} == fields


def test_c_describes_every_struct_the_mirror_has():
    assert set(_core.layout()) == set(layout.STRUCTS) == set(PINNED)


def test_constants_agree():
    c = _core.constants()
    assert c["MAGIC"] == layout.MAGIC
    pairs = {
        "FORMAT_VERSION": layout.FORMAT_VERSION, "SB_SIZE": layout.SB_SIZE,
        "SB_COPIES": layout.SB_COPIES,
        "SYNC_CAS": layout.SYNC_CAS, "SYNC_MANAGER": layout.SYNC_MANAGER,
        "REGION_COUNT": layout.REGION_COUNT, "NODE_SIZE": layout.NODE_SIZE,
        "LOCK_HDR_SIZE": layout.LOCK_HDR_SIZE, "LOCK_ENTRY_SIZE": layout.LOCK_ENTRY_SIZE,
        "HEAP_SIZE": layout.HEAP_SIZE, "CHUNK_DESC_SIZE": layout.CHUNK_DESC_SIZE,
        "HASH_ENTRY_SIZE": layout.HASH_ENTRY_SIZE, "NODE_FREE": layout.NODE_FREE,
        "NODE_CLAIMED": layout.NODE_CLAIMED, "NODE_ATTACHED": layout.NODE_ATTACHED,
        "NODE_FENCED": layout.NODE_FENCED,
        "NODE_FLAG_KV_EVENTS": layout.NODE_FLAG_KV_EVENTS, "LOCK_IDLE": layout.LOCK_IDLE,
        "LOCK_WAITING": layout.LOCK_WAITING, "LOCK_LOCKED": layout.LOCK_LOCKED,
        "LOCK_ABANDONED": layout.LOCK_ABANDONED, "CHUNK_FREE": layout.CHUNK_FREE,
        "CHUNK_HEAD": layout.CHUNK_HEAD, "CHUNK_TAIL": layout.CHUNK_TAIL,
        "CHUNK_RELEASING": layout.CHUNK_RELEASING, "SLAB_MAX_SLOTS": layout.SLAB_MAX_SLOTS,
        "HEAP_HAZARDS": layout.HEAP_HAZARDS,
        "FEATURE_COMPAT_KV": layout.COMPAT_KV, "FEATURE_COMPAT_SUPP": layout.COMPAT_SUPPORTED,
        "FEATURE_COMPAT_NAMES": layout.COMPAT_NAMES, "NAME_SIZE": layout.NAME_SIZE,
        "NAME_MAX": layout.NAME_MAX, "NAME_TOKENS_MAX": layout.NAME_TOKENS_MAX,
        "FEATURE_INCOMPAT_SUPP": layout.INCOMPAT_SUPPORTED,
        "FEATURE_INCOMPAT_KV_LRU": layout.INCOMPAT_KV_LRU, "KV_LRU_LISTS": layout.KV_LRU_LISTS,
        "FEATURE_RO_COMPAT_SUPP": layout.RO_COMPAT_SUPPORTED,
        "KV_EMPTY": layout.KV_EMPTY, "KV_WRITING": layout.KV_WRITING,
        "KV_PENDING": layout.KV_PENDING,
        "KV_PUBLISHED": layout.KV_PUBLISHED, "KV_EVICTING": layout.KV_EVICTING,
        "KV_TOMBSTONE": layout.KV_TOMBSTONE, "KV_MAGIC": layout.KV_MAGIC,
        "KV_HDR_SIZE": layout.KV_HDR_SIZE,
        "KV_NS_SIZE": layout.KV_NS_SIZE, "KV_TENANT_SIZE": layout.KV_TENANT_SIZE,
        "KV_NS_NAME": layout.KV_NS_NAME, "KV_NSTATS": layout.KV_NSTATS,
        "KV_REC_FREE": layout.KV_REC_FREE,
        "KV_REC_ACTIVE": layout.KV_REC_ACTIVE, "KV_HASH_XXH3_128": layout.KV_HASH_XXH3_128,
        "KV_HASH_SHA256_CBOR": layout.KV_HASH_SHA256_CBOR,
        "FEATURE_INCOMPAT_JOURNAL": layout.INCOMPAT_JOURNAL, "JOURNAL_MAGIC": layout.JOURNAL_MAGIC,
        "JOURNAL_REC_SIZE": layout.JOURNAL_REC_SIZE, "JOURNAL_STORED": layout.JOURNAL_STORED,
        "JOURNAL_EVICTED": layout.JOURNAL_EVICTED, "JOURNAL_NS_CLEARED": layout.JOURNAL_NS_CLEARED,
        "FEATURE_INCOMPAT_BADCHUNKS": layout.INCOMPAT_BADCHUNKS,
        "BADCHUNK_MAGIC": layout.BADCHUNK_MAGIC, "BADCHUNK_LIST_OFF": layout.BADCHUNK_LIST_OFF,
        "BADCHUNK_NO_CHUNK": layout.BADCHUNK_NO_CHUNK, "BADCHUNK_POISON": layout.BADCHUNK_POISON,
        "BADCHUNK_MEDIA_ERROR": layout.BADCHUNK_MEDIA_ERROR,
        "BADCHUNK_MANUAL": layout.BADCHUNK_MANUAL,
    }
    for k, v in pairs.items():
        assert c[k] == v, k
    for i, name in enumerate(layout.REGION_NAMES):
        assert c[f"REGION_{name.upper()}"] == i


def test_pinned_values():
    # literal values, so a change to both sides still fails here
    assert layout.MAGIC == b"CXLKVPOL"
    assert (layout.FORMAT_VERSION, layout.SB_SIZE, layout.NODE_SIZE,
            layout.HASH_ENTRY_SIZE) == (1, 4096, 512, 64)
    assert layout.CHUNK_DESC_SIZE == 256
    assert (layout.HEAP_SIZE, layout.HEAP_HAZARDS) == (1024, 8)
    assert layout.REGION_NAMES == ("nodes", "locks", "bitmap", "heaps", "hash", "data", "kv")
    assert layout.POOL_ORDER == ("nodes", "locks", "bitmap", "heaps", "hash", "kv", "data")
    assert (layout.KV_MAGIC.to_bytes(8, "little"), layout.COMPAT_KV) == (b"CXLKVKV1", 1)
    assert (layout.KV_EMPTY, layout.KV_WRITING, layout.KV_PENDING, layout.KV_PUBLISHED,
            layout.KV_EVICTING,
            layout.KV_TOMBSTONE) == (0, 1, 2, 3, 4, 5)
    assert (layout.JOURNAL_MAGIC.to_bytes(8, "little"), layout.INCOMPAT_JOURNAL) == (b"CXLKVJN1", 4)
    assert (layout.JOURNAL_STORED, layout.JOURNAL_EVICTED, layout.JOURNAL_NS_CLEARED) == (1, 2, 3)
    assert layout.NODE_FLAG_KV_EVENTS == 1
    assert (layout.BADCHUNK_MAGIC.to_bytes(8, "little"), layout.INCOMPAT_BADCHUNKS,
            layout.BADCHUNK_LIST_OFF) == (b"CXLKVBD1", 8, 256)
    assert layout.BADCHUNK_REASONS == {1: "poison", 2: "media-error", 3: "manual"}
    # the list fits in the lock header page's reserved bytes, after its used fields
    assert layout.field_offset(layout.LockHdrStruct, "reserved") <= layout.BADCHUNK_LIST_OFF
    assert layout.BADCHUNK_MAX == (4096 - 256 - 32) // 32 == 119


def test_journal_geometry():
    # after the per-node KV areas, page aligned; records scale with the table
    g = layout.journal_geometry(8, 256)
    assert g["records_per_node"] == 256 and g["hdr_off"] % layout.PAGE == 0
    assert g["hdr_off"] >= layout.kv_geometry(8, 256)["size"]
    assert g["ring_off"] == g["hdr_off"] + layout.PAGE
    assert g["ring_stride"] == layout.PAGE * 5 and g["end"] == g["ring_off"] + 8 * g["ring_stride"]
    assert layout.journal_geometry(4, 1 << 20)["records_per_node"] == 16384
    # a pool of neither feature needs only the old areas; one with the LRU lists their links
    assert layout.kv_region_size(8, 256, 0) == layout.kv_geometry(8, 256)["lru_off"]
    assert layout.kv_region_size(8, 256, layout.INCOMPAT_KV_LRU) == layout.kv_geometry(8,
                                                                                       256)["size"]
    assert layout.kv_region_size(8, 256, layout.INCOMPAT_JOURNAL) == g["end"]
