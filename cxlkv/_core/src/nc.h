/*
 * Non-coherence emulation (CXLKV_NONCOHERENT=1).
 *
 * The process sees the pool through its own software cache of 64-byte
 * lines, as a host sees non-coherent CXL 2.0 memory through its CPU caches:
 *
 *  - loads hit the cached copy of a line, however stale: a line is fetched
 *    from memory only when it is not cached (first touch, or after an
 *    invalidate or an eviction).  Every read path goes through the cache:
 *    word loads, read()/readinto()/read_blocks() of any size, and views.
 *  - stores stay in the cached (dirty) line until it is written back: by a
 *    flush, by an invalidate (CLFLUSH writes back first), or by an eviction.
 *    A write-back writes the WHOLE line, so a store to part of a line whose
 *    cached rest is stale clobbers what another host wrote there since, as
 *    on real hardware.
 *  - bulk writes (write(), zero(), write_blocks()) do what the real copy
 *    does: whole lines of the range reach memory directly (non-temporal or
 *    plain stores of a full line do not depend on the line's old bytes); a
 *    partial first or last line is stored into the cached line (fetched
 *    first if not cached, kept if cached however stale) and written back
 *    whole.
 *  - atomics work on the cached line only: they are not atomic across
 *    processes, as on memory without cross-host atomics.
 *  - dirty lines are also written back, and clean ones dropped, at random
 *    moments (real caches evict on their own).
 *
 * The cache has no capacity limit of its own: a line stays cached until
 * invalidated or randomly evicted, so a read of a line this process has not
 * invalidated since another host wrote it returns the stale copy, whatever
 * the size of the read (a real cache may have evicted it; a protocol must not
 * count on that).  A line this process never touched is fetched on first
 * use, unless CXLKV_NC_PRELOAD=1: then every line starts cached, a copy of
 * the pool as mapped (a prefetcher may have fetched any line at any time), so
 * even a first read not preceded by an invalidate returns stale data.  Its storage is a private shadow of the pool: line n's
 * cached bytes live at shadow + 64 n.  That is what makes views sound
 * without copying: a view of the pool (Mapping.view) points into the shadow,
 * so reading through it (numpy, torch.frombuffer, hashing) reads this
 * process's cached copy, exactly as a pointer into real non-coherent memory
 * reads through the CPU cache.  Creating a view fills the range's uncached
 * lines and marks them exposed; an invalidate re-fetches exposed lines at
 * once (a legal hardware behaviour: a prefetch right after the CLFLUSH), so
 * a view created before an invalidate still shows memory after it.
 * Writable views are not emulated (stores through a raw pointer cannot mark
 * lines dirty): Mapping.view refuses them under the emulation.
 *
 * Cost: the shadow and the per-line state reserve address space the size of
 * the pool (MAP_NORESERVE; only touched pages use memory: about 1.3x the
 * bytes of the pool this process has touched), a read copies twice (memory
 * to the shadow on a miss, the shadow to the caller), a view or a write once
 * more than on coherent memory (filling the shadow; keeping the cached copy
 * of a written line).
 *
 * Environment, read when the cache is made:
 * CXLKV_NONCOHERENT_SEED seeds the eviction randomness (default 1);
 * CXLKV_NC_EVICT_EVERY=N evicts a random cached line once per N accesses on
 * average (default 64; 0 = never, for deterministic tests);
 * CXLKV_NC_PRELOAD=1 caches the whole pool when it is mapped (costs a copy
 * of the pool per process);
 * CXLKV_NC_DROP_FLUSH=N makes every Nth flush a no-op and
 * CXLKV_NC_DROP_INVALIDATE=N every Nth invalidate (test hooks that prove the
 * tests catch a missing flush or invalidate).
 *
 * Every nc_* function takes ranges the caller has bounds-checked against the
 * mapping; each checks again and does nothing on a range outside the pool.
 * All are thread-safe (one mutex per cache).
 */
#ifndef CXLKV_NC_H
#define CXLKV_NC_H

#include <pthread.h>
#include <stdint.h>
#include <stddef.h>

/* per-line state bits */
#define NC_VALID   1u    /* cached: the shadow holds this process's copy */
#define NC_DIRTY   2u    /* cached and stored to since the last write-back */
#define NC_EXPOSED 4u    /* a view has shown this line (sticky) */

struct nc_cache {
    pthread_mutex_t mu;
    char *base;            /* the real memory */
    uint64_t size;
    uint64_t nlines;       /* ceil(size / 64) */
    char *shadow;          /* nlines * 64 bytes: cached copies, line n at 64 n */
    uint8_t *state;        /* nlines: NC_* bits */
    uint64_t *slot;        /* nlines: index in res of a cached line */
    uint64_t *res;         /* the cached lines (for random eviction) */
    uint64_t nres;
    uint64_t rng;
    uint64_t evict_every;  /* one random eviction per this many accesses, on average */
    uint64_t drop_flush;   /* test hook: drop every Nth flush (0 = never) */
    uint64_t drop_invalidate;   /* test hook: drop every Nth invalidate (0 = never) */
    uint64_t flushes, invalidates;
    uint64_t hits, misses, writebacks, evictions, dropped, dropped_inval;
};

/* NULL (errno set) when memory for the shadow cannot be reserved. */
struct nc_cache *nc_create(char *base, uint64_t size);
void nc_destroy(struct nc_cache *c);

/* Word operations on the cached line of an 8-byte aligned word. */
uint64_t nc_load64(struct nc_cache *c, uint64_t off);
void nc_store64(struct nc_cache *c, uint64_t off, uint64_t v);
uint64_t nc_cas64(struct nc_cache *c, uint64_t off, uint64_t expect, uint64_t desired);
uint64_t nc_fadd64(struct nc_cache *c, uint64_t off, uint64_t delta);
uint64_t nc_or64(struct nc_cache *c, uint64_t off, uint64_t bits);
uint64_t nc_and64(struct nc_cache *c, uint64_t off, uint64_t bits);
/* Write back the dirty lines of the range (they stay cached, clean). */
void nc_flush(struct nc_cache *c, uint64_t off, uint64_t len);
/* Write back the dirty lines of the range and drop them (exposed lines are
 * fetched again at once, see above). */
void nc_invalidate(struct nc_cache *c, uint64_t off, uint64_t len);
/* Copy the range out of the cache (filling the lines not cached). */
void nc_read(struct nc_cache *c, uint64_t off, void *dst, uint64_t len);
/* Bulk write / zero, flushed on return: whole lines straight to memory (and
 * into this process's cached copy), a partial first or last line through the
 * cache and written back whole.  0, or -1 (errno ENOMEM) when src overlaps the
 * pool or the shadow and no bounce buffer could be had (nothing written). */
int nc_write(struct nc_cache *c, uint64_t off, const void *src, uint64_t len, int nt);
void nc_zero(struct nc_cache *c, uint64_t off, uint64_t len, int nt);
/* Fill the range's uncached lines and mark them exposed; the address of the
 * range in the shadow, for a read-only view (NULL for a range outside the
 * pool).  Reads through it see this process's cached copy. */
const char *nc_view(struct nc_cache *c, uint64_t off, uint64_t len);

#endif
