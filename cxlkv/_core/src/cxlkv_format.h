/*
 * cxlkv on-media format, version 1.
 *
 * The one definition of every structure that lives in a pool.  The Python
 * mirror (cxlkv/pool/layout.py) declares the same fields; tests/test_layout.py
 * checks both against each other and pins every offset and size.  Changing a
 * field here means changing the mirror, the layout test and the golden image.
 *
 * Rules: fixed-width little-endian fields only; every reference is a 64-bit
 * byte offset from the pool base (0 = null), never a pointer; reserved bytes
 * are written as zero.
 */
#ifndef CXLKV_FORMAT_H
#define CXLKV_FORMAT_H

#include <stdint.h>
#include <stddef.h>

#define CXLKV_MAGIC            "CXLKVPOL"   /* 8 bytes, no NUL */
#define CXLKV_FORMAT_VERSION   1u
#define CXLKV_SB_SIZE          4096u       /* one superblock copy */
#define CXLKV_SB_COPIES        2u          /* copy A at 0, copy B at 4096 */
#define CXLKV_CACHELINE        64u
#define CXLKV_PAGE             4096u

/* sync modes (superblock.sync_mode) */
#define CXLKV_SYNC_CAS         1u
#define CXLKV_SYNC_MANAGER     2u

/* feature masks: none defined in v1.  Unknown incompat -> refuse to open;
 * unknown ro_compat -> open read-only; unknown compat -> ignore. */
#define CXLKV_FEATURE_COMPAT_SUPP     0ull
#define CXLKV_FEATURE_INCOMPAT_SUPP   0ull
#define CXLKV_FEATURE_RO_COMPAT_SUPP  0ull

/* regions, in the order they lie in the pool (superblock.regions[i]) */
enum cxlkv_region_id {
    CXLKV_REGION_NODES  = 0,   /* node table: max_nodes x struct cxlkv_node */
    CXLKV_REGION_LOCKS  = 1,   /* lock area: header + max_nodes lock entries */
    CXLKV_REGION_BITMAP = 2,   /* allocator: one bit per data chunk */
    CXLKV_REGION_HEAPS  = 3,   /* per-node heap headers + chunk descriptors */
    CXLKV_REGION_HASH   = 4,   /* KV hash table: hash_slots entries */
    CXLKV_REGION_DATA   = 5,   /* chunk-aligned data area */
    CXLKV_REGION_COUNT  = 8    /* slots in the superblock; 6 and 7 reserved */
};

/* Sizes of the per-item records that the region sizes are computed from. */
#define CXLKV_NODE_SIZE        512u
#define CXLKV_LOCK_HDR_SIZE    4096u
#define CXLKV_LOCK_ENTRY_SIZE  128u
#define CXLKV_HEAP_SIZE        1024u   /* per-node heap header */
#define CXLKV_CHUNK_DESC_SIZE  256u    /* per data chunk */
#define CXLKV_HASH_ENTRY_SIZE  64u

struct cxlkv_region {
    uint64_t off;               /* byte offset from the pool base */
    uint64_t size;              /* bytes */
};

struct cxlkv_superblock {
    char     magic[8];          /*    0 "CXLKVPOL" */
    uint32_t version;           /*    8 format version */
    uint32_t sb_size;           /*   12 bytes covered by the checksum (4096) */
    uint64_t seq;               /*   16 sequence number; the newer valid copy wins */
    uint64_t compat;            /*   24 feature masks */
    uint64_t incompat;          /*   32 */
    uint64_t ro_compat;         /*   40 */
    uint8_t  uuid[16];          /*   48 pool UUID */
    uint64_t pool_size;         /*   64 bytes the format covers */
    uint64_t ctime_ns;          /*   72 creation time, ns since the Unix epoch */
    uint32_t sync_mode;         /*   80 CXLKV_SYNC_* */
    uint32_t max_nodes;         /*   84 node table slots */
    uint64_t chunk_size;        /*   88 allocator chunk, power of two */
    uint64_t lease_ms;          /*   96 node lease */
    uint64_t hash_slots;        /*  104 hash table entries, power of two */
    uint32_t hash_max_load_pct; /*  112 store refuses / evicts above this load */
    uint32_t flags;             /*  116 reserved, 0 */
    uint64_t nchunks;           /*  120 chunks in the data area */
    struct cxlkv_region regions[CXLKV_REGION_COUNT]; /* 128 */
    uint8_t  tenant_secret[32]; /*  256 per-pool key for tenant salts */
    char     label[64];         /*  288 pool name, NUL padded */
    char     creator[32];       /*  352 software that formatted it, NUL padded */
    uint8_t  reserved[3704];    /*  384 zero */
    uint64_t checksum;          /* 4088 xxh64 (seed 0) of the 4096 bytes with this field 0 */
};

/* Node table slot (CXLKV_NODE_SIZE bytes).  Line 0 holds what changes at run
 * time (one flush per heartbeat); the identity lines change only on attach.
 *
 * control packs the slot state (bits 0-7) with the slot's epoch (bits 8-63),
 * so every transition is one compare-and-swap (cas mode) or one store by the
 * single writer the protocol names (manager mode), and a stale holder is
 * recognised by its epoch.  Epoch 0 never belongs to a node. */
#define CXLKV_NODE_FREE        0u
#define CXLKV_NODE_CLAIMED     1u   /* being attached: identity being written */
#define CXLKV_NODE_ATTACHED    2u
#define CXLKV_NODE_FENCED      3u   /* reaped: must not write live state; recovery pending */
#define CXLKV_NODE_STATE_BITS  8u
#define CXLKV_NODE_STATE_MASK  0xffull

struct cxlkv_node {
    uint64_t control;           /*    0 state | epoch << 8 */
    uint64_t heartbeat;         /*    8 counter; liveness = observed to advance */
    uint64_t claim_token;       /*   16 manager mode: a claimant's request */
    uint64_t grant_token;       /*   24 manager mode: written by the lock manager only */
    uint8_t  line0_pad[32];     /*   32 */
    uint64_t pid;               /*   64 */
    uint64_t start_time_ns;     /*   72 process start time (pid reuse guard) */
    uint64_t attach_time_ns;    /*   80 wall clock at attach (display only) */
    uint32_t format_version;    /*   88 */
    uint32_t flags;             /*   92 */
    uint8_t  boot_id[16];       /*   96 /proc/sys/kernel/random/boot_id */
    char     hostname[64];      /*  112 */
    char     sw_version[32];    /*  176 */
    uint64_t pidns;             /*  208 pid namespace inode: pids compare only within one */
    uint64_t ident_epoch;       /*  216 epoch this identity was written for */
    uint8_t  reserved[224];     /*  224 */
    /* line 7: written only by the lock manager (manager mode), so that no
     * cache line has two writers on non-coherent memory */
    uint64_t mgr_control;       /*  448 manager mode: state | epoch << 8 */
    uint64_t mgr_grant_token;   /*  456 manager mode: claim granted to this token */
    uint8_t  line7_pad[48];     /*  464 */
};

/* Lock area: a header, then one entry per node slot.
 * cas mode: a ticket lock (next_ticket / now_serving on separate lines);
 * each waiter records its ticket in its entry so that a dead waiter's or
 * holder's ticket can be skipped once its node is fenced.
 * manager mode: entries carry IDLE / WAITING / LOCKED, granted by the lock
 * manager, whose lease lives in the header. */
#define CXLKV_LOCK_IDLE        0u
#define CXLKV_LOCK_WAITING     1u
#define CXLKV_LOCK_LOCKED      2u
#define CXLKV_LOCK_ABANDONED   3u   /* cas: ticket given up (timeout, dead node) */

struct cxlkv_lock_hdr {
    uint64_t next_ticket;       /*    0 cas: next ticket to hand out */
    uint8_t  line0_pad[56];
    uint64_t now_serving;       /*   64 cas: ticket that may enter */
    uint64_t owner;             /*   72 holder: (slot + 1) | epoch << 16; 0 = none */
    uint64_t acquisitions;      /*   80 count of grants (stats) */
    uint8_t  line1_pad[40];
    uint64_t mgr_token;         /*  128 manager lease: holder's random token, 0 = none */
    uint64_t mgr_epoch;         /*  136 bumped by every new active manager */
    uint64_t mgr_heartbeat;     /*  144 advanced by the active manager */
    uint64_t mgr_pid;           /*  152 */
    uint8_t  mgr_boot_id[16];   /*  160 */
    char     mgr_hostname[64];  /*  176 */
    uint8_t  reserved[3856];    /*  240 */
};

struct cxlkv_lock_entry {
    /* line 0: written only by the node */
    uint64_t state;             /*    0 cas: CXLKV_LOCK_* */
    uint64_t ticket;            /*    8 cas: ticket taken */
    uint64_t epoch;             /*   16 the node epoch that took it / requests */
    uint64_t req_seq;           /*   24 manager: requests made */
    uint64_t release_seq;       /*   32 manager: requests released */
    uint64_t freeing;           /*   40 slot being freed in another node's slab (under
                                          the lock), 0 = none: recovery finishes it */
    uint8_t  line0_pad[16];     /*   48 */
    /* line 1: written only by the lock manager */
    uint64_t grant_seq;         /*   64 manager: request granted */
    uint64_t revoke_seq;        /*   72 manager: request revoked (dead holder) */
    uint64_t grant_epoch;       /*   80 manager: node epoch of the grant */
    uint8_t  line1_pad[40];     /*   88 */
};

/* Allocator.  The data area is nchunks chunks; the global bitmap has one bit
 * per chunk (1 = part of a slab).  A slab is a run of `nchunks` contiguous
 * chunks carved into `nslots` slots of exactly `slot_size` bytes (64-byte
 * multiples; at most 512 slots); its head chunk's descriptor holds the slot
 * bitmaps, the other chunks' descriptors point back to the head.
 *
 * Per slot: alloc bit (reserved or published), pub bit (published: survives
 * its allocator's death), dirty bit (freed without zeroing: zeroed before the
 * slot is handed out again unless the new owner overwrites all of it).
 * owner is the token ((slot + 1) | epoch << 16) of the node whose heap the
 * slab belongs to; 0 = orphaned (its node died), adoptable by anyone. */
#define CXLKV_CHUNK_FREE       0u
#define CXLKV_CHUNK_HEAD       1u
#define CXLKV_CHUNK_TAIL       2u   /* control = TAIL | head index << 8 */
#define CXLKV_CHUNK_RELEASING  3u   /* head being returned to the bitmap */
#define CXLKV_SLAB_MAX_SLOTS   512u

struct cxlkv_chunk {
    uint64_t control;           /*    0 kind | (tail: head index) << 8 */
    uint64_t owner;             /*    8 owner token, 0 = orphan */
    uint64_t slot_size;         /*   16 bytes per slot */
    uint64_t nslots;            /*   24 slots in the slab */
    uint64_t nchunks;           /*   32 chunks in the slab */
    uint8_t  pad[24];           /*   40 (no slot count: derived from alloc_bits) */
    uint64_t alloc_bits[8];     /*   64 */
    uint64_t pub_bits[8];       /*  128 */
    uint64_t dirty_bits[8];     /*  192 */
};

#ifdef __cplusplus
#define CXLKV_STATIC_ASSERT static_assert
#else
#define CXLKV_STATIC_ASSERT _Static_assert
#endif

CXLKV_STATIC_ASSERT(sizeof(struct cxlkv_region) == 16, "region size");
CXLKV_STATIC_ASSERT(sizeof(struct cxlkv_superblock) == CXLKV_SB_SIZE, "superblock size");
CXLKV_STATIC_ASSERT(offsetof(struct cxlkv_superblock, regions) == 128, "regions offset");
CXLKV_STATIC_ASSERT(offsetof(struct cxlkv_superblock, checksum) == 4088, "checksum offset");
CXLKV_STATIC_ASSERT(sizeof(struct cxlkv_node) == CXLKV_NODE_SIZE, "node size");
CXLKV_STATIC_ASSERT(sizeof(struct cxlkv_lock_hdr) == CXLKV_LOCK_HDR_SIZE, "lock header size");
CXLKV_STATIC_ASSERT(sizeof(struct cxlkv_lock_entry) == CXLKV_LOCK_ENTRY_SIZE, "lock entry size");
CXLKV_STATIC_ASSERT(sizeof(struct cxlkv_chunk) == CXLKV_CHUNK_DESC_SIZE, "chunk descriptor size");

#endif /* CXLKV_FORMAT_H */
