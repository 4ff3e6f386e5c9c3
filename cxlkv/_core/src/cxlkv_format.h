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

/* feature masks.  Unknown incompat -> refuse to open; unknown ro_compat ->
 * open read-only; unknown compat -> ignore. */
#define CXLKV_FEATURE_COMPAT_KV       1ull  /* the pool has a KV region (regions[6]) */
#define CXLKV_FEATURE_COMPAT_NAMES    (1ull << 1) /* the KV region ends with block names */
#define CXLKV_FEATURE_COMPAT_SUPP     (CXLKV_FEATURE_COMPAT_KV | CXLKV_FEATURE_COMPAT_NAMES)
#define CXLKV_FEATURE_INCOMPAT_KV_LRU 1ull  /* the KV region holds the leaf LRU lists
                                               (kv_hdr line 2, lru_lists, link array) */
#define CXLKV_FEATURE_INCOMPAT_JOURNAL (1ull << 2) /* the KV region ends with the change journal */
#define CXLKV_FEATURE_INCOMPAT_BADCHUNKS (1ull << 3) /* retired-chunk list in the lock
                                                      header page (layout.py BadChunk*) */
#define CXLKV_FEATURE_INCOMPAT_SUPP   (CXLKV_FEATURE_INCOMPAT_KV_LRU | CXLKV_FEATURE_INCOMPAT_JOURNAL | \
                                       CXLKV_FEATURE_INCOMPAT_BADCHUNKS)
#define CXLKV_FEATURE_RO_COMPAT_SUPP  0ull

/* regions (superblock.regions[i]); in the pool they lie in the order
 * nodes, locks, bitmap, heaps, hash, kv, data (data is always last) */
enum cxlkv_region_id {
    CXLKV_REGION_NODES  = 0,   /* node table: max_nodes x struct cxlkv_node */
    CXLKV_REGION_LOCKS  = 1,   /* lock area: header + max_nodes lock entries */
    CXLKV_REGION_BITMAP = 2,   /* allocator: one bit per data chunk */
    CXLKV_REGION_HEAPS  = 3,   /* per-node heap headers + chunk descriptors */
    CXLKV_REGION_HASH   = 4,   /* KV hash table: hash_slots entries */
    CXLKV_REGION_DATA   = 5,   /* chunk-aligned data area */
    CXLKV_REGION_KV     = 6,   /* KV header, namespaces, tenants, per-node KV areas */
    CXLKV_REGION_COUNT  = 8    /* slots in the superblock; 7 reserved */
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
    uint64_t grace_ms;          /*  384 quarantine grace of a fenced node; 0 = 6 leases */
    uint32_t name_tokens;       /*  392 compat NAMES: token ids kept per block name */
    uint8_t  reserved[3692];    /*  396 zero */
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
#define CXLKV_NODE_FENCED      3u   /* fenced: must not write; what it held is quarantined
                                        until it is gone, acknowledged or the grace passed */
/* node flags (struct cxlkv_node.flags, written by the node itself, valid for ident_epoch) */
#define CXLKV_NODE_FLAG_KV_EVENTS 1u /* the pool's KV-events publisher (cxlkv serve --kv-events) */
#define CXLKV_NODE_STATE_BITS  8u
#define CXLKV_NODE_STATE_MASK  0xffull

struct cxlkv_node {
    uint64_t control;           /*    0 state | epoch << 8 */
    uint64_t heartbeat;         /*    8 counter; liveness = observed to advance */
    uint64_t claim_token;       /*   16 manager mode: a claimant's request */
    uint64_t grant_token;       /*   24 manager mode: written by the lock manager only */
    uint64_t ack_epoch;         /*   32 the node's acknowledgement of its fencing: the
                                          fenced epoch, written once it stopped writing */
    uint8_t  line0_pad[24];     /*   40 */
    uint64_t pid;               /*   64 */
    uint64_t start_time_ns;     /*   72 process start time (pid reuse guard) */
    uint64_t attach_time_ns;    /*   80 wall clock at attach (display only) */
    uint32_t format_version;    /*   88 */
    uint32_t flags;             /*   92 CXLKV_NODE_FLAG_*, identity: set by the node */
    uint8_t  boot_id[16];       /*   96 /proc/sys/kernel/random/boot_id */
    char     hostname[64];      /*  112 */
    char     sw_version[32];    /*  176 */
    uint64_t pidns;             /*  208 pid namespace inode: pids compare only within one */
    uint64_t ident_epoch;       /*  216 epoch this identity was written for */
    uint8_t  reserved[32];      /*  224 */
    /* line 4: written only by probers (cxlkv doctor's visibility challenge):
     * a nonce for this node's incarnation ident_epoch to echo */
    uint64_t challenge;         /*  256 nonce, 0 = none */
    uint64_t challenge_epoch;   /*  264 the epoch it is meant for */
    uint8_t  line4_pad[48];     /*  272 */
    /* line 5: written only by the node, with its heartbeat: the last
     * challenge it saw, echoed */
    uint64_t answer;            /*  320 the challenge's nonce */
    uint64_t answer_epoch;      /*  328 the answering node's epoch */
    uint64_t answer_heartbeat;  /*  336 its heartbeat counter when it answered */
    uint8_t  line5_pad[40];     /*  344 */
    uint8_t  reserved6[64];     /*  384 */
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
    uint64_t mgr_recovering;    /*  240 the active manager's token while it recovers a
                                          node, else 0: one that takes over from a manager
                                          stopped there recovers nothing for a grace */
    uint64_t mgr_pidns;         /*  248 the active manager's pid namespace (inode) */
    uint8_t  reserved[3840];    /*  256 */
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
    uint64_t held_when_fenced;  /*   48 the node's owner token, written by whoever fenced
                                          it while it held the pool lock (0 = it did not):
                                          no recovery finishes other nodes' half-done work
                                          until its own */
    uint64_t recovering;        /*   56 while it recovers a node (under the pool lock):
                                          that node's token, else 0 - fenced meanwhile, it
                                          may still write into that node's memory */
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
#define CXLKV_CHUNK_RELEASING  3u   /* head being released: back to HEAD if a slot is
                                       allocated or its owner has it in a hazard word */
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

/* Per-node heap header (region heaps, one per node slot, before the chunk
 * descriptors).  hazard[i] = head chunk + 1 of the slab one allocator thread
 * of the node is taking slots from without the pool lock, 0 = none.  An
 * allocator claims a hazard word (CAS 0 -> head + 1), then checks that the
 * slab is its own HEAD, then sets slot bits; release_slab sets RELEASING, then
 * refuses while the owner's hazard words name the slab or any slot bit is
 * set.  So a slab is never released or remade under an allocator that has
 * checked it, and no allocator sets a bit it may have to take back.
 * Recovery of a node clears its hazard words. */
#define CXLKV_HEAP_HAZARDS     8u

struct cxlkv_heap {
    uint64_t hazard[CXLKV_HEAP_HAZARDS]; /*    0 */
    uint8_t  reserved[960];              /*   64 */
};

/* KV cache.
 *
 * Hash table (region hash): hash_slots entries, open addressing with linear
 * probing.  Every entry write happens under the pool lock; readers are
 * lock-free and read an entry as a seqlock: ctl, then the fields, then ctl
 * again (state | version << 8; every transition bumps the version).
 * Deleting leaves a TOMBSTONE (probe chains stay valid), turned back to
 * EMPTY when the slot after it is EMPTY. */
#define CXLKV_KV_EMPTY         0u
#define CXLKV_KV_WRITING       1u   /* lock holder filling the fields */
#define CXLKV_KV_PENDING       2u   /* reserved by `owner`, payload being written */
#define CXLKV_KV_PUBLISHED     3u   /* visible to readers */
#define CXLKV_KV_EVICTING      4u   /* being evicted (pins being checked) */
#define CXLKV_KV_TOMBSTONE     5u
#define CXLKV_KV_STATE_MASK    0xffull

struct cxlkv_hash_entry {
    uint64_t ctl;               /*    0 state | version << 8 */
    uint64_t key_lo;            /*    8 128-bit pool key of the block */
    uint64_t key_hi;            /*   16 */
    uint64_t payload;           /*   24 pool offset of the block's bytes */
    uint32_t length;            /*   32 payload bytes */
    uint16_t ns;                /*   36 namespace record index */
    uint16_t tenant;            /*   38 tenant record index (0 = no salt) */
    uint32_t parent;            /*   40 entry index of the previous block + 1; 0 = first */
    uint32_t children;          /*   44 live entries whose parent this is */
    uint64_t owner;             /*   48 token of the node that stored it */
    uint64_t lru;               /*   56 last use, microseconds since the Unix epoch */
};

/* KV region: header, namespace records, tenant records, then one area per
 * node slot.  Offsets in the header are relative to the region start. */
#define CXLKV_KV_MAGIC         0x31564b564b4c5843ull  /* "CXLKVKV1" */
#define CXLKV_KV_HDR_SIZE      4096u
#define CXLKV_KV_NS_SIZE       256u
#define CXLKV_KV_TENANT_SIZE   64u
#define CXLKV_KV_NS_NAME       128u
#define CXLKV_KV_NSTATS        8u
#define CXLKV_KV_LRU_LISTS     256u   /* one leaf LRU list per tenant record */

/* namespace and tenant record states */
#define CXLKV_KV_REC_FREE      0u
#define CXLKV_KV_REC_ACTIVE    1u

/* hash algorithms (namespace.hash_kind) */
#define CXLKV_KV_HASH_XXH3_128    1u
#define CXLKV_KV_HASH_SHA256_CBOR 2u

struct cxlkv_kv_hdr {
    uint64_t magic;             /*    0 CXLKV_KV_MAGIC */
    uint32_t max_namespaces;    /*    8 */
    uint32_t max_tenants;       /*   12 */
    uint32_t pins_per_node;     /*   16 pin records (u64) per node */
    uint32_t ring_per_node;     /*   20 touch-ring records per node */
    uint64_t ns_off;            /*   24 namespace records */
    uint64_t tenant_off;        /*   32 tenant records */
    uint64_t node_off;          /*   40 first per-node area */
    uint64_t node_stride;       /*   48 bytes per node area */
    uint8_t  line0_pad[8];      /*   56 */
    /* line 1: written under the pool lock */
    uint64_t live;              /*   64 entries PENDING, PUBLISHED or EVICTING */
    uint64_t tombstones;        /*   72 */
    uint64_t evictions;         /*   80 blocks evicted (all namespaces, ever) */
    uint64_t evicted_bytes;     /*   88 */
    uint8_t  line1_pad[32];     /*   96 */
    /* line 2: the leaf LRU lists (INCOMPAT_KV_LRU), written under the pool lock */
    uint64_t lru_off;           /*  128 link array (u64 per hash slot), from the region start */
    uint64_t lru_dirty;         /*  136 owner token of a lock holder editing the lists, 0 =
                                          consistent; found set -> the lists are rebuilt */
    uint64_t lru_leaves;        /*  144 entries on the lists */
    uint64_t lru_rebuilds;      /*  152 rebuilds from the table (recovery, fsck, corruption) */
    uint64_t purge_cursor;      /*  160 next slot the bounded tombstone purge looks at */
    uint8_t  line2_pad[24];     /*  168 */
    uint64_t lru_lists[CXLKV_KV_LRU_LISTS]; /* 192 per tenant: head + 1 | (tail + 1) << 32 */
    uint8_t  reserved[1856];    /* 2240 */
};

/* Leaf LRU lists (INCOMPAT_KV_LRU).  Every PUBLISHED entry without live
 * children (a leaf: the only kind eviction may take) is on exactly one
 * doubly-linked list, that of its tenant, ordered by its lru stamp (head =
 * least recently used); nothing else is on a list.  Links live in a separate
 * array of the KV region (the hash entry is full): u64 per hash slot,
 * prev + 1 | (next + 1) << 32, 0 = none.  Written only by the pool-lock
 * holder, with lru_dirty set around each edit so that a holder's death
 * mid-edit is seen and the lists rebuilt from the table. */

/* Counters a node keeps per namespace (its own line; folded into the
 * namespace record, under the lock, when the node detaches or is reaped). */
struct cxlkv_kv_stats {
    uint64_t lookups;           /*    0 match/load calls */
    uint64_t hit_blocks;        /*    8 blocks found */
    uint64_t miss_blocks;       /*   16 full blocks asked for and not found */
    uint64_t stored_blocks;     /*   24 blocks this node stored */
    uint64_t present_blocks;    /*   32 blocks it was asked to store that were present */
    uint64_t stored_bytes;      /*   40 */
    uint64_t loaded_blocks;     /*   48 blocks pinned by load */
    uint64_t loaded_bytes;      /*   56 */
};

struct cxlkv_kv_ns {
    char     name[128];         /*    0 namespace (model, dtype, layout), NUL padded */
    uint32_t state;             /*  128 CXLKV_KV_REC_* */
    uint32_t hash_kind;         /*  132 CXLKV_KV_HASH_* */
    uint32_t block_tokens;      /*  136 */
    uint32_t reserved0;         /*  140 */
    uint64_t block_bytes;       /*  144 */
    uint8_t  digest[16];        /*  152 xxh3-128 of the name: first part of every key */
    uint64_t blocks;            /*  168 live entries of this namespace */
    uint64_t evictions;         /*  176 blocks evicted */
    uint64_t evicted_bytes;     /*  184 */
    struct cxlkv_kv_stats stats;/*  192 folded counters of detached/reaped nodes */
};

struct cxlkv_kv_tenant {
    uint8_t  salt[16];          /*    0 derived salt (HMAC of the caller's under the pool secret) */
    uint32_t state;             /*   16 CXLKV_KV_REC_*; record 0 is the unsalted tenant */
    uint32_t reserved0;         /*   20 */
    uint64_t quota;             /*   24 bytes; 0 = none */
    uint64_t used;              /*   32 payload bytes of live entries */
    uint64_t blocks;            /*   40 live entries */
    uint64_t rejected;          /*   48 stores refused by the quota */
    uint64_t reserved1;         /*   56 */
};

/* Per-node KV area (node_stride bytes): line 0 written by the node, line 1
 * by the pool-lock holder, then the node's stats (max_namespaces lines), its
 * pin records (pins_per_node u64: entry index + 1, 0 = free) and its touch
 * ring (ring_per_node u64: entry index + 1), all written by the node only. */
struct cxlkv_kv_node {
    uint64_t ring_head;         /*    0 touches written so far */
    uint8_t  line0_pad[56];     /*    8 */
    uint64_t ring_drained;      /*   64 touches applied to entries by an evictor */
    uint8_t  line1_pad[56];     /*   72 */
    /* 128: struct cxlkv_kv_stats stats[max_namespaces], then pins, then ring */
};

/* Change journal (incompat JOURNAL): at the end of the KV region, on the
 * first page boundary after the per-node areas, a header page and then one
 * ring per node slot (ring_stride bytes each): a ring header line and
 * records_per_node records.  A node appends what it published and evicted
 * to the ring of its slot, under the pool lock: it takes sequence numbers
 * from next_seq, writes each record as a seqlock (seq 0, the fields, then
 * its seq), then advances the head.  The head counts records ever appended to the ring and goes on
 * across the nodes that use the slot in turn (never reset but by format),
 * so a reader's cursor stays meaningful after a slot is reused; `writer`
 * names the node that appended last.  Every record carries a sequence
 * number taken from the journal header's next_seq under the pool lock, so
 * records of all rings have one order (gaps where an appender died).
 * Readers detect an overrun (head - cursor > records_per_node) and a torn
 * record (its sequence number is not above the ring's previous one). */
#define CXLKV_JOURNAL_MAGIC     0x314e4a564b4c5843ull  /* "CXLKVJN1" */
#define CXLKV_JOURNAL_REC_SIZE  64u
#define CXLKV_JOURNAL_STORED    1u   /* a block was published */
#define CXLKV_JOURNAL_EVICTED   2u   /* a block was evicted (its free has begun) */
#define CXLKV_JOURNAL_NS_CLEARED 3u  /* a namespace record was freed (`kv drop`) */

struct cxlkv_journal_hdr {
    uint64_t magic;             /*    0 CXLKV_JOURNAL_MAGIC */
    uint32_t records_per_node;  /*    8 */
    uint32_t rec_size;          /*   12 CXLKV_JOURNAL_REC_SIZE */
    uint64_t ring_off;          /*   16 first ring, relative to the KV region */
    uint64_t ring_stride;       /*   24 bytes per ring */
    uint32_t max_nodes;         /*   32 rings */
    uint8_t  line0_pad[28];     /*   36 */
    /* line 1: written by the pool-lock holder */
    uint64_t next_seq;          /*   64 sequence number of the next record (rack-wide) */
    uint8_t  line1_pad[56];     /*   72 */
};

/* Ring header line: written by the node on the slot (pool lock held). */
struct cxlkv_journal_ring {
    uint64_t head;              /*    0 records appended so far (monotonic) */
    uint64_t writer;            /*    8 token (slot + 1 | epoch << 16) of the last appender */
    uint8_t  pad[48];           /*   16 */
};

struct cxlkv_journal_rec {
    uint64_t seq;               /*    0 sequence number (header next_seq); written last (0: being written) */
    uint64_t key_lo;            /*    8 pool key of the block (0 for NS_CLEARED) */
    uint64_t key_hi;            /*   16 */
    uint64_t parent_lo;         /*   24 pool key of its parent block; 0 = a chain root */
    uint64_t parent_hi;         /*   32 */
    uint32_t length;            /*   40 payload bytes */
    uint16_t ns;                /*   44 namespace record index */
    uint16_t tenant;            /*   46 tenant record index */
    uint64_t time_us;           /*   48 microseconds since the Unix epoch */
    uint32_t entry;             /*   56 hash entry index + 1 at the time (0 = none) */
    uint8_t  op;                /*   60 CXLKV_JOURNAL_* */
    uint8_t  reserved[3];       /*   61 */
};

/* Block names (compat NAMES): on the first page boundary after the
 * change journal, one name entry per hash-table entry (the *table names*: a
 * name record, then room for superblock.name_tokens token ids - the
 * block's, when it has at most that many; entry size
 * cxlkv_name_entry_size()), then, per journal ring, one name record per
 * journal record (the *ring names*: the block's, at the record's ring
 * position).
 * A block's name is the chain hash its writer keyed it by (for a vLLM
 * namespace, vLLM's own block hash); its pool key is a hash of the
 * namespace, the tenant salt and the name, so a name record whose key is
 * the block's key holds that block's name.  Who writes: the node that
 * reserved the entry writes its table name before publishing it (with the
 * write path's freshness checks); journal_append copies the table names of
 * the block and of its parent into the ring names of the record it
 * appends, inside the record's seqlock, so a reader that copies a record
 * consistently has its names too, even after the entry was evicted and
 * reused.  A record whose key is not the block's (written by a cxlkv
 * without NAMES, or a name longer than CXLKV_NAME_MAX) names nothing: the
 * block is published under its pool key.  Compat: a cxlkv that does not
 * know the feature ignores the area and stores unnamed blocks. */
#define CXLKV_NAME_SIZE         64u
#define CXLKV_NAME_MAX          40u
#define CXLKV_NAME_TOKENS_MAX   1024u   /* superblock.name_tokens at most */

struct cxlkv_block_name {
    uint64_t key_lo;            /*    0 pool key of the block named */
    uint64_t key_hi;            /*    8 */
    uint32_t len;               /*   16 bytes of name (0: none) */
    uint32_t ntokens;           /*   20 token ids after the record (table names; 0: none) */
    uint8_t  name[CXLKV_NAME_MAX]; /* 24 the chain hash */
};

/* Bytes of a table name entry: the record, then name_tokens token ids
 * (little-endian uint32), to a cache-line multiple. */
static inline uint64_t cxlkv_name_entry_size(uint32_t name_tokens)
{
    return CXLKV_NAME_SIZE + ((4ull * name_tokens + 63u) & ~63ull);
}

/* Retired (poisoned) chunks, incompat BADCHUNKS: a header at
 * CXLKV_BADCHUNK_LIST_OFF in the lock header page (its reserved bytes), then
 * entries up to the end of the page.  Written only under the pool lock, an
 * entry first, then `count`.  The C core does not read it (Python's
 * cxlkv.state.alloc does); it is described here so that the layout test pins
 * it like every other on-media structure. */
#define CXLKV_BADCHUNK_MAGIC    0x314442564b4c5843ull  /* "CXLKVBD1" */
#define CXLKV_BADCHUNK_LIST_OFF 256u                   /* from the lock header page */
#define CXLKV_BADCHUNK_NO_CHUNK UINT64_MAX             /* a hit outside the data region */
#define CXLKV_BADCHUNK_POISON   1u                     /* reasons */
#define CXLKV_BADCHUNK_MEDIA_ERROR 2u
#define CXLKV_BADCHUNK_MANUAL   3u

struct cxlkv_badchunk_hdr {
    uint64_t magic;             /*    0 CXLKV_BADCHUNK_MAGIC */
    uint32_t count;             /*    8 entries written */
    uint32_t capacity;          /*   12 entries that fit in the page */
    uint64_t retired_bytes;     /*   16 sum of the retired data chunks' sizes */
    uint64_t metadata_hits;     /*   24 entries without a chunk */
};

struct cxlkv_badchunk {
    uint64_t chunk;             /*    0 data chunk index, or CXLKV_BADCHUNK_NO_CHUNK */
    uint64_t offset;            /*    8 pool offset of the bad range */
    uint32_t length;            /*   16 bytes of the bad range */
    uint16_t reason;            /*   20 CXLKV_BADCHUNK_* */
    uint16_t region;            /*   22 index of the region hit (0xffff: none) */
    uint64_t time_ns;           /*   24 CLOCK_REALTIME when retired */
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
CXLKV_STATIC_ASSERT(sizeof(struct cxlkv_heap) == CXLKV_HEAP_SIZE, "heap header size");
CXLKV_STATIC_ASSERT(sizeof(struct cxlkv_chunk) == CXLKV_CHUNK_DESC_SIZE, "chunk descriptor size");
CXLKV_STATIC_ASSERT(sizeof(struct cxlkv_hash_entry) == CXLKV_HASH_ENTRY_SIZE, "hash entry size");
CXLKV_STATIC_ASSERT(sizeof(struct cxlkv_kv_hdr) == CXLKV_KV_HDR_SIZE, "kv header size");
CXLKV_STATIC_ASSERT(sizeof(struct cxlkv_kv_ns) == CXLKV_KV_NS_SIZE, "kv namespace size");
CXLKV_STATIC_ASSERT(sizeof(struct cxlkv_kv_tenant) == CXLKV_KV_TENANT_SIZE, "kv tenant size");
CXLKV_STATIC_ASSERT(sizeof(struct cxlkv_kv_node) == 128, "kv node header size");
CXLKV_STATIC_ASSERT(sizeof(struct cxlkv_journal_hdr) == 128, "journal header size");
CXLKV_STATIC_ASSERT(sizeof(struct cxlkv_journal_ring) == 64, "journal ring header size");
CXLKV_STATIC_ASSERT(sizeof(struct cxlkv_journal_rec) == CXLKV_JOURNAL_REC_SIZE, "journal record size");
CXLKV_STATIC_ASSERT(sizeof(struct cxlkv_block_name) == CXLKV_NAME_SIZE, "block name size");
CXLKV_STATIC_ASSERT(sizeof(struct cxlkv_badchunk_hdr) == 32, "retired-chunk list header size");
CXLKV_STATIC_ASSERT(sizeof(struct cxlkv_badchunk) == 32, "retired-chunk entry size");

#endif /* CXLKV_FORMAT_H */
