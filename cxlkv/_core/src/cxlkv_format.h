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
#define CXLKV_LOCK_ENTRY_SIZE  64u
#define CXLKV_HEAP_SIZE        1024u   /* per-node heap header */
#define CXLKV_CHUNK_DESC_SIZE  128u    /* per data chunk */
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
 * time (one flush per heartbeat); the identity lines change only on attach. */
#define CXLKV_NODE_FREE        0u
#define CXLKV_NODE_ATTACHED    1u
#define CXLKV_NODE_FENCED      2u   /* reaped: must not write live state */

struct cxlkv_node {
    uint64_t state;             /*    0 CXLKV_NODE_* */
    uint64_t epoch;             /*    8 bumped on every attach of this slot */
    uint64_t heartbeat;         /*   16 counter; liveness = observed to advance */
    uint64_t fence_epoch;       /*   24 epochs <= this are dead */
    uint8_t  line0_pad[32];     /*   32 */
    uint64_t pid;               /*   64 */
    uint64_t start_time_ns;     /*   72 process start time (pid reuse guard) */
    uint64_t attach_time_ns;    /*   80 wall clock at attach (display only) */
    uint32_t format_version;    /*   88 */
    uint32_t flags;             /*   92 */
    uint8_t  boot_id[16];       /*   96 /proc/sys/kernel/random/boot_id */
    char     hostname[64];      /*  112 */
    char     sw_version[32];    /*  176 */
    uint8_t  reserved[304];     /*  208 */
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

#endif /* CXLKV_FORMAT_H */
