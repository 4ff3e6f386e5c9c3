/* Non-coherence emulation: see nc.h. */
#include "nc.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "cpu.h"

static uint64_t
rng_next(struct nc_cache *c)
{
    /* xorshift64* */
    uint64_t x = c->rng;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    c->rng = x;
    return x * 0x2545F4914F6CDD1Dull;
}

static uint64_t
env_u64(const char *name, uint64_t dflt)
{
    const char *e = getenv(name);
    return (e && *e) ? strtoull(e, NULL, 0) : dflt;
}

/* Private zero-filled memory that costs nothing until touched. */
static void *
reserve(uint64_t bytes)
{
    if (bytes == 0 || bytes > (uint64_t)SIZE_MAX)
        return NULL;
    void *p = mmap(NULL, (size_t)bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
        return NULL;
#ifdef MADV_NOHUGEPAGE
    /* touched sparsely: 4 KiB pages keep the resident size near what is used */
    (void)madvise(p, (size_t)bytes, MADV_NOHUGEPAGE);
#endif
    return p;
}

static void
unreserve(void *p, uint64_t bytes)
{
    if (p)
        munmap(p, (size_t)bytes);
}

static void res_add(struct nc_cache *c, uint64_t n);

struct nc_cache *
nc_create(char *base, uint64_t size)
{
    if (size == 0 || size > UINT64_MAX / 16) {
        errno = EINVAL;
        return NULL;
    }
    struct nc_cache *c = calloc(1, sizeof(*c));
    if (!c)
        return NULL;
    c->base = base;
    c->size = size;
    c->nlines = (size + 63) / 64;
    c->shadow = reserve(c->nlines * 64);
    c->state = reserve(c->nlines);
    c->slot = reserve(c->nlines * 8);
    c->res = reserve(c->nlines * 8);
    if (!c->shadow || !c->state || !c->slot || !c->res) {
        nc_destroy(c);
        errno = ENOMEM;
        return NULL;
    }
    pthread_mutex_init(&c->mu, NULL);
    c->rng = env_u64("CXLKV_NONCOHERENT_SEED", 1);
    if (c->rng == 0)
        c->rng = 1;
    c->evict_every = env_u64("CXLKV_NC_EVICT_EVERY", 64);
    c->drop_flush = env_u64("CXLKV_NC_DROP_FLUSH", 0);
    c->drop_invalidate = env_u64("CXLKV_NC_DROP_INVALIDATE", 0);
    if (env_u64("CXLKV_NC_PRELOAD", 0)) {    /* every line cached from the start */
        memcpy(c->shadow, c->base, (size_t)size);
        memset(c->state, NC_VALID, (size_t)c->nlines);
        for (uint64_t n = 0; n < c->nlines; n++)
            res_add(c, n);
    }
    return c;
}

void
nc_destroy(struct nc_cache *c)
{
    if (!c)
        return;
    if (c->shadow && c->state && c->slot && c->res)
        pthread_mutex_destroy(&c->mu);
    unreserve(c->shadow, c->nlines * 64);
    unreserve(c->state, c->nlines);
    unreserve(c->slot, c->nlines * 8);
    unreserve(c->res, c->nlines * 8);
    free(c);
}

/* [off, off + len) lies inside the pool. */
static inline int
in_pool(const struct nc_cache *c, uint64_t off, uint64_t len)
{
    return off <= c->size && len <= c->size - off;
}

/* Bytes of line n inside the pool (64 but for a short last line). */
static inline uint64_t
line_len(const struct nc_cache *c, uint64_t n)
{
    uint64_t off = n * 64;
    return off + 64 <= c->size ? 64 : c->size - off;
}

/* --- all below: c->mu held -------------------------------------------- */

static void
fetch(struct nc_cache *c, uint64_t n)
{
    memcpy(c->shadow + n * 64, c->base + n * 64, line_len(c, n));
}

static void
writeback(struct nc_cache *c, uint64_t n)
{
    if ((c->state[n] & (NC_VALID | NC_DIRTY)) != (NC_VALID | NC_DIRTY))
        return;
    uint64_t len = line_len(c, n);
    /* the whole line, stale bytes and all */
    memcpy(c->base + n * 64, c->shadow + n * 64, len);
    cxlkv_flush_range(c->base + n * 64, len);
    c->state[n] &= (uint8_t)~NC_DIRTY;
    c->writebacks++;
}

static void
res_add(struct nc_cache *c, uint64_t n)
{
    c->slot[n] = c->nres;
    c->res[c->nres++] = n;
}

static void
res_del(struct nc_cache *c, uint64_t n)
{
    uint64_t i = c->slot[n], last = c->res[--c->nres];
    c->res[i] = last;
    c->slot[last] = i;
}

/* Write back (if dirty) and drop line n; the shadow keeps its bytes (a view
 * that still shows them shows what was cached before the drop). */
static void
drop(struct nc_cache *c, uint64_t n)
{
    if (!(c->state[n] & NC_VALID))
        return;
    writeback(c, n);
    c->state[n] &= (uint8_t)~(NC_VALID | NC_DIRTY);
    res_del(c, n);
}

/* Make line n cached: fetched from memory if it is not, kept (however stale)
 * if it is. */
static void
fill(struct nc_cache *c, uint64_t n)
{
    if (c->state[n] & NC_VALID) {
        c->hits++;
        return;
    }
    fetch(c, n);
    c->state[n] = (uint8_t)((c->state[n] & NC_EXPOSED) | NC_VALID);
    res_add(c, n);
    c->misses++;
}

static void
random_eviction(struct nc_cache *c)
{
    if (c->evict_every == 0 || c->nres == 0 || rng_next(c) % c->evict_every)
        return;
    drop(c, c->res[rng_next(c) % c->nres]);
    c->evictions++;
}

static void
fill_range(struct nc_cache *c, uint64_t off, uint64_t len, uint8_t mark)
{
    if (!len)
        return;
    for (uint64_t n = off / 64, last = (off + len - 1) / 64; n <= last; n++) {
        fill(c, n);
        c->state[n] |= mark;
    }
}

static void
invalidate_locked(struct nc_cache *c, uint64_t off, uint64_t len)
{
    if (!len)
        return;
    uint64_t n = off / 64, last = (off + len - 1) / 64;
    while (n <= last) {
        /* skip uncached, never-exposed lines eight at a time: invalidating a
         * large range this process never touched costs a scan of its state */
        if (n % 8 == 0 && last - n >= 7) {
            uint64_t w;
            memcpy(&w, c->state + n, 8);
            if (w == 0) {
                n += 8;
                continue;
            }
        }
        uint8_t s = c->state[n];
        if (s & NC_EXPOSED) {
            /* a view may be reading this line: fetch it again now, so what
             * the view shows is memory as of this invalidate */
            writeback(c, n);
            fetch(c, n);
            if (!(s & NC_VALID)) {
                c->state[n] |= NC_VALID;
                res_add(c, n);
            }
        } else {
            drop(c, n);
        }
        n++;
    }
}

/* --- the interface ------------------------------------------------------ */

#define WORD_OP(name, body)                                                 \
    uint64_t name(struct nc_cache *c, uint64_t off, uint64_t a, uint64_t b) \
    {                                                                       \
        if (!in_pool(c, off, 8) || (off & 7))                               \
            return 0;                                                       \
        pthread_mutex_lock(&c->mu);                                         \
        random_eviction(c);                                                 \
        uint64_t n = off / 64;                                              \
        fill(c, n);                                                         \
        uint64_t *w = (uint64_t *)(void *)(c->shadow + off);                \
        uint64_t old = *w;                                                  \
        body;                                                               \
        pthread_mutex_unlock(&c->mu);                                       \
        return old;                                                         \
    }
#define DIRTY() c->state[n] |= NC_DIRTY

static WORD_OP(word_load, (void)a; (void)b)
static WORD_OP(word_store, *w = a; DIRTY(); (void)b)
static WORD_OP(word_cas, if (old == a) { *w = b; DIRTY(); })
static WORD_OP(word_add, *w = old + a; DIRTY(); (void)b)
static WORD_OP(word_or, *w = old | a; DIRTY(); (void)b)
static WORD_OP(word_and, *w = old & a; DIRTY(); (void)b)

uint64_t nc_load64(struct nc_cache *c, uint64_t off) { return word_load(c, off, 0, 0); }
void nc_store64(struct nc_cache *c, uint64_t off, uint64_t v) { word_store(c, off, v, 0); }
uint64_t nc_cas64(struct nc_cache *c, uint64_t off, uint64_t e, uint64_t d) { return word_cas(c, off, e, d); }
uint64_t nc_fadd64(struct nc_cache *c, uint64_t off, uint64_t d) { return word_add(c, off, d, 0); }
uint64_t nc_or64(struct nc_cache *c, uint64_t off, uint64_t bits) { return word_or(c, off, bits, 0); }
uint64_t nc_and64(struct nc_cache *c, uint64_t off, uint64_t bits) { return word_and(c, off, bits, 0); }

void
nc_flush(struct nc_cache *c, uint64_t off, uint64_t len)
{
    if (!len || !in_pool(c, off, len))
        return;
    pthread_mutex_lock(&c->mu);
    c->flushes++;
    if (c->drop_flush && c->flushes % c->drop_flush == 0) {
        c->dropped++;                      /* test hook: this flush "was forgotten" */
        pthread_mutex_unlock(&c->mu);
        return;
    }
    for (uint64_t n = off / 64, last = (off + len - 1) / 64; n <= last; n++)
        writeback(c, n);
    pthread_mutex_unlock(&c->mu);
}

void
nc_invalidate(struct nc_cache *c, uint64_t off, uint64_t len)
{
    if (!len || !in_pool(c, off, len))
        return;
    pthread_mutex_lock(&c->mu);
    c->invalidates++;
    if (c->drop_invalidate && c->invalidates % c->drop_invalidate == 0)
        c->dropped_inval++;                /* test hook: this invalidate "was forgotten" */
    else
        invalidate_locked(c, off, len);
    pthread_mutex_unlock(&c->mu);
}

void
nc_read(struct nc_cache *c, uint64_t off, void *dst, uint64_t len)
{
    if (!len || !in_pool(c, off, len))
        return;
    pthread_mutex_lock(&c->mu);
    random_eviction(c);
    fill_range(c, off, len, 0);
    memcpy(dst, c->shadow + off, (size_t)len);
    pthread_mutex_unlock(&c->mu);
}

const char *
nc_view(struct nc_cache *c, uint64_t off, uint64_t len)
{
    if (!in_pool(c, off, len))
        return NULL;
    pthread_mutex_lock(&c->mu);
    random_eviction(c);
    fill_range(c, off, len, NC_EXPOSED);
    pthread_mutex_unlock(&c->mu);
    return c->shadow + off;
}

/* A partial line: store into the cached line (fetched if not cached; a stale
 * cached copy stays stale), then write the whole line back. */
static void
store_partial(struct nc_cache *c, uint64_t off, const void *src, uint64_t len)
{
    uint64_t n = off / 64;
    fill(c, n);
    if (src)
        memcpy(c->shadow + off, src, (size_t)len);
    else
        memset(c->shadow + off, 0, (size_t)len);
    c->state[n] |= NC_DIRTY;
    writeback(c, n);
}

/* Whole lines [off, off + len) were stored to memory directly: the cached
 * copies (and what views show) now hold the same bytes, clean. */
static void
stored_whole(struct nc_cache *c, uint64_t off, const void *src, uint64_t len)
{
    for (uint64_t n = off / 64; n < (off + len) / 64; n++) {
        if (!c->state[n])
            continue;
        const char *s = src ? (const char *)src + (n * 64 - off) : NULL;
        if (s)
            memcpy(c->shadow + n * 64, s, 64);
        else
            memset(c->shadow + n * 64, 0, 64);
        c->state[n] &= (uint8_t)~NC_DIRTY;
    }
}

static void
write_locked(struct nc_cache *c, uint64_t off, const char *src, uint64_t len, int nt)
{
    /* [a, b): the whole lines of the range.  A short last line of the pool
     * is never whole here (b <= end <= size rounds down below it). */
    uint64_t end = off + len, a = (off + 63) & ~(uint64_t)63, b = end & ~(uint64_t)63;
    if (a >= b)
        a = b = end;                       /* no whole line: all of it is partial */
    for (uint64_t p = off; p < a;) {       /* partial head (one or two lines) */
        uint64_t take = 64 - p % 64 < a - p ? 64 - p % 64 : a - p;
        store_partial(c, p, src ? src + (p - off) : NULL, take);
        p += take;
    }
    if (a < b) {
        if (src)
            cxlkv_copy_to_pool(c->base + a, src + (a - off), (size_t)(b - a), nt);
        else
            cxlkv_zero_pool(c->base + a, (size_t)(b - a), nt);
        stored_whole(c, a, src ? src + (a - off) : NULL, b - a);
    }
    if (b < end)                           /* partial tail */
        store_partial(c, b, src ? src + (b - off) : NULL, end - b);
}

int
nc_write(struct nc_cache *c, uint64_t off, const void *srcv, uint64_t len, int nt)
{
    if (!len || !in_pool(c, off, len))
        return 0;
    const char *src = srcv;
    char *bounce = NULL;
    /* a source inside the pool or the shadow (a view of this pool) may be
     * changed by the fills below: copy it first */
    uintptr_t s = (uintptr_t)src, e = s + (uintptr_t)len;
    uintptr_t pb = (uintptr_t)c->base, sb = (uintptr_t)c->shadow;
    if ((s < pb + c->size && pb < e) || (s < sb + c->nlines * 64 && sb < e)) {
        bounce = malloc((size_t)len);
        if (!bounce) {
            errno = ENOMEM;
            return -1;
        }
        memcpy(bounce, src, (size_t)len);
        src = bounce;
    }
    pthread_mutex_lock(&c->mu);
    random_eviction(c);
    write_locked(c, off, src, len, nt);
    pthread_mutex_unlock(&c->mu);
    free(bounce);
    return 0;
}

void
nc_zero(struct nc_cache *c, uint64_t off, uint64_t len, int nt)
{
    if (!len || !in_pool(c, off, len))
        return;
    pthread_mutex_lock(&c->mu);
    random_eviction(c);
    write_locked(c, off, NULL, len, nt);
    pthread_mutex_unlock(&c->mu);
}
