/*
 * Non-coherence emulation (CXLKV_NONCOHERENT=1).
 *
 * The process sees the pool through its own software cache of 64-byte
 * lines, as a host sees non-coherent CXL memory through its CPU caches:
 * loads may hit stale lines, stores stay in dirty lines until flushed,
 * invalidate drops lines (writing dirty ones back first, as CLFLUSH does),
 * and dirty lines are also written back at random moments (real caches
 * evict on their own).  Atomics work on the cached line only: they are not
 * atomic across processes, as on memory without cross-host atomics.
 * A missing flush or invalidate then shows up as lost or stale data.
 *
 * CXLKV_NONCOHERENT_SEED seeds the eviction randomness (default 1);
 * CXLKV_NC_EVICT_EVERY=N evicts a random line once per N accesses on
 * average (default 64; 0 = never, for deterministic tests);
 * CXLKV_NC_DROP_FLUSH=N makes every Nth flush a no-op (a test hook that
 * proves the tests catch a missing flush).
 */
#ifndef CXLKV_NC_H
#define CXLKV_NC_H

#include <pthread.h>
#include <stdint.h>
#include <stddef.h>

struct nc_line {
    uint64_t tag;          /* line number + 1; 0 = empty */
    uint64_t dirty;
    uint8_t data[64];
};

struct nc_cache {
    pthread_mutex_t mu;
    char *base;            /* the real memory */
    uint64_t size;
    struct nc_line *lines;
    uint64_t nsets;        /* direct mapped: line n lives in set n % nsets */
    uint64_t rng;
    uint64_t evict_every;  /* one random eviction per this many accesses, on average */
    uint64_t drop_flush;   /* test hook: drop every Nth flush (0 = never) */
    uint64_t flushes;
    uint64_t hits, misses, writebacks, evictions, dropped;
};

struct nc_cache *nc_create(char *base, uint64_t size);
void nc_destroy(struct nc_cache *c);

uint64_t nc_load64(struct nc_cache *c, uint64_t off);
void nc_store64(struct nc_cache *c, uint64_t off, uint64_t v);
uint64_t nc_cas64(struct nc_cache *c, uint64_t off, uint64_t expect, uint64_t desired);
uint64_t nc_fadd64(struct nc_cache *c, uint64_t off, uint64_t delta);
uint64_t nc_or64(struct nc_cache *c, uint64_t off, uint64_t bits);
uint64_t nc_and64(struct nc_cache *c, uint64_t off, uint64_t bits);
void nc_flush(struct nc_cache *c, uint64_t off, uint64_t len);
void nc_invalidate(struct nc_cache *c, uint64_t off, uint64_t len);
void nc_read(struct nc_cache *c, uint64_t off, void *dst, uint64_t len);
/* Bulk write / zero straight to memory, dropping the cached lines of the range
 * first, all under the cache mutex (so no other thread of this process can
 * refill a line with old bytes in between). */
void nc_write(struct nc_cache *c, uint64_t off, const void *src, uint64_t len, int nt);
void nc_zero(struct nc_cache *c, uint64_t off, uint64_t len, int nt);

#endif
