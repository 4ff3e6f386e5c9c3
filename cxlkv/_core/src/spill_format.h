/*
 * The spill tier's slot header: the one definition of the 72-byte header in
 * front of every slot of a spill slot file (DIR/slots-<bytes>.dat on local
 * disk, not in a pool; the file itself is described in
 * cxlkv/kv/tiers/spill/files.py).  files.py packs and parses it with a
 * struct that it checks against spill_layout() (spill.c, offsetof) at
 * import; tests/test_spill_slots.py pins every offset and a golden header.
 * A change here is a spill format version bump (CXLKV_SPILL_VERSION).
 *
 * Little-endian fields.  `hsum` is the xxh3-64 (seed 0) of the 56 bytes
 * before it; a slot's header verifies when magic, version and state LIVE
 * match and hsum is right.  `stamp` is outside the checksum (a LIVE slot's
 * last use, a WRITING slot's writer pid).
 */
#ifndef CXLKV_SPILL_FORMAT_H
#define CXLKV_SPILL_FORMAT_H

#include <stddef.h>
#include <stdint.h>

#define CXLKV_SPILL_MAGIC      "CXSB"      /* 4 bytes, no NUL */
#define CXLKV_SPILL_VERSION    3u          /* 1: one file per block; 2: payloads 4 KiB
                                              * aligned in the file (now 2 MiB: files.py) */
#define CXLKV_SPILL_FREE       0u
#define CXLKV_SPILL_WRITING    1u
#define CXLKV_SPILL_LIVE       2u

struct cxlkv_spill_slot {
    char     magic[4];          /*  0 CXLKV_SPILL_MAGIC */
    uint8_t  version;           /*  4 CXLKV_SPILL_VERSION */
    uint8_t  state;             /*  5 FREE / WRITING / LIVE */
    uint16_t reserved0;         /*  6 */
    uint32_t length;            /*  8 payload bytes (<= the file's slot bytes) */
    uint32_t reserved1;         /* 12 */
    uint8_t  key[16];           /* 16 the pool key */
    uint8_t  ns_digest[16];     /* 32 the namespace digest */
    uint64_t psum;              /* 48 xxh3-64 of the payload */
    uint64_t hsum;              /* 56 xxh3-64 of bytes 0..55 */
    uint64_t stamp;             /* 64 last use (ns) / the writer's pid; not checksummed */
};

/* the bytes a reader compares before and after reading a payload: the
 * checksummed header and its sum (a slot freed or rewritten meanwhile
 * differs; the stamp may change with every use) */
#define CXLKV_SPILL_SNAP       offsetof(struct cxlkv_spill_slot, stamp)

_Static_assert(sizeof(struct cxlkv_spill_slot) == 72, "spill slot header size");
_Static_assert(offsetof(struct cxlkv_spill_slot, length) == 8, "spill length offset");
_Static_assert(offsetof(struct cxlkv_spill_slot, key) == 16, "spill key offset");
_Static_assert(offsetof(struct cxlkv_spill_slot, psum) == 48, "spill psum offset");
_Static_assert(offsetof(struct cxlkv_spill_slot, hsum) == 56, "spill hsum offset");
_Static_assert(CXLKV_SPILL_SNAP == 64, "spill snapshot bytes");

#endif /* CXLKV_SPILL_FORMAT_H */
