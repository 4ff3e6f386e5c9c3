/* Non-coherence emulation: see nc.h. */
#include "nc.h"

#include <stdlib.h>
#include <string.h>

#include "cpu.h"

#define NC_SETS 4096u
#define NC_FILL_MAX 4096u    /* reads up to this size fill the cache */

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

struct nc_cache *
nc_create(char *base, uint64_t size)
{
    struct nc_cache *c = calloc(1, sizeof(*c));
    if (!c)
        return NULL;
    c->lines = calloc(NC_SETS, sizeof(struct nc_line));
    if (!c->lines) {
        free(c);
        return NULL;
    }
    pthread_mutex_init(&c->mu, NULL);
    c->base = base;
    c->size = size;
    c->nsets = NC_SETS;
    const char *seed = getenv("CXLKV_NONCOHERENT_SEED");
    c->rng = (seed && *seed) ? strtoull(seed, NULL, 0) : 1;
    if (c->rng == 0)
        c->rng = 1;
    const char *every = getenv("CXLKV_NC_EVICT_EVERY");
    c->evict_every = (every && *every) ? strtoull(every, NULL, 0) : 64;
    const char *drop = getenv("CXLKV_NC_DROP_FLUSH");
    c->drop_flush = (drop && *drop) ? strtoull(drop, NULL, 0) : 0;
    return c;
}

void
nc_destroy(struct nc_cache *c)
{
    if (!c)
        return;
    pthread_mutex_destroy(&c->mu);
    free(c->lines);
    free(c);
}

static void
writeback(struct nc_cache *c, struct nc_line *l)
{
    if (l->tag && l->dirty) {
        uint64_t off = (l->tag - 1) * 64;
        uint64_t n = off + 64 <= c->size ? 64 : c->size - off;
        memcpy(c->base + off, l->data, n);
        cxlkv_flush_range(c->base + off, n);
        l->dirty = 0;
        c->writebacks++;
    }
}

static void
random_eviction(struct nc_cache *c)
{
    if (c->evict_every == 0 || rng_next(c) % c->evict_every)
        return;
    struct nc_line *l = &c->lines[rng_next(c) % c->nsets];
    if (l->tag) {
        writeback(c, l);
        l->tag = 0;
        c->evictions++;
    }
}

/* The cached line holding pool line n, filled from memory on a miss. */
static struct nc_line *
line_for(struct nc_cache *c, uint64_t n)
{
    struct nc_line *l = &c->lines[n % c->nsets];
    if (l->tag == n + 1) {
        c->hits++;
        return l;
    }
    writeback(c, l);           /* conflict eviction */
    uint64_t off = n * 64;
    uint64_t len = off + 64 <= c->size ? 64 : c->size - off;
    memset(l->data, 0, 64);
    memcpy(l->data, c->base + off, len);
    l->tag = n + 1;
    l->dirty = 0;
    c->misses++;
    return l;
}

#define WORD_OP(name, body)                                                 \
    uint64_t name(struct nc_cache *c, uint64_t off, uint64_t a, uint64_t b) \
    {                                                                       \
        pthread_mutex_lock(&c->mu);                                         \
        random_eviction(c);                                                 \
        struct nc_line *l = line_for(c, off / 64);                          \
        uint64_t *w = (uint64_t *)(l->data + off % 64);                     \
        uint64_t old = *w;                                                  \
        body;                                                               \
        pthread_mutex_unlock(&c->mu);                                       \
        return old;                                                         \
    }

static WORD_OP(word_load, (void)a; (void)b)
static WORD_OP(word_store, *w = a; l->dirty = 1; (void)b)
static WORD_OP(word_cas, if (old == a) { *w = b; l->dirty = 1; })
static WORD_OP(word_add, *w = old + a; l->dirty = 1; (void)b)
static WORD_OP(word_or, *w = old | a; l->dirty = 1; (void)b)
static WORD_OP(word_and, *w = old & a; l->dirty = 1; (void)b)

uint64_t nc_load64(struct nc_cache *c, uint64_t off) { return word_load(c, off, 0, 0); }
void nc_store64(struct nc_cache *c, uint64_t off, uint64_t v) { word_store(c, off, v, 0); }
uint64_t nc_cas64(struct nc_cache *c, uint64_t off, uint64_t e, uint64_t d) { return word_cas(c, off, e, d); }
uint64_t nc_fadd64(struct nc_cache *c, uint64_t off, uint64_t d) { return word_add(c, off, d, 0); }
uint64_t nc_or64(struct nc_cache *c, uint64_t off, uint64_t bits) { return word_or(c, off, bits, 0); }
uint64_t nc_and64(struct nc_cache *c, uint64_t off, uint64_t bits) { return word_and(c, off, bits, 0); }

void
nc_flush(struct nc_cache *c, uint64_t off, uint64_t len)
{
    if (!len)
        return;
    pthread_mutex_lock(&c->mu);
    c->flushes++;
    if (c->drop_flush && c->flushes % c->drop_flush == 0) {
        c->dropped++;                      /* test hook: this flush "was forgotten" */
        pthread_mutex_unlock(&c->mu);
        return;
    }
    for (uint64_t n = off / 64; n <= (off + len - 1) / 64; n++) {
        struct nc_line *l = &c->lines[n % c->nsets];
        if (l->tag == n + 1)
            writeback(c, l);
    }
    pthread_mutex_unlock(&c->mu);
}

static void invalidate_locked(struct nc_cache *c, uint64_t off, uint64_t len);

void
nc_invalidate(struct nc_cache *c, uint64_t off, uint64_t len)
{
    if (!len)
        return;
    pthread_mutex_lock(&c->mu);
    invalidate_locked(c, off, len);
    pthread_mutex_unlock(&c->mu);
}

void
nc_write(struct nc_cache *c, uint64_t off, const void *src, uint64_t len, int nt)
{
    pthread_mutex_lock(&c->mu);
    if (len)
        invalidate_locked(c, off, len);
    cxlkv_copy_to_pool(c->base + off, src, (size_t)len, nt);
    pthread_mutex_unlock(&c->mu);
}

void
nc_zero(struct nc_cache *c, uint64_t off, uint64_t len, int nt)
{
    pthread_mutex_lock(&c->mu);
    if (len)
        invalidate_locked(c, off, len);
    cxlkv_zero_pool(c->base + off, (size_t)len, nt);
    pthread_mutex_unlock(&c->mu);
}

static void
invalidate_locked(struct nc_cache *c, uint64_t off, uint64_t len)
{
    uint64_t first = off / 64, last = (off + len - 1) / 64;
    if (last - first + 1 >= c->nsets) {    /* larger than the cache: drop everything */
        for (uint64_t i = 0; i < c->nsets; i++) {
            uint64_t n = c->lines[i].tag - 1;
            if (c->lines[i].tag && n >= first && n <= last) {
                writeback(c, &c->lines[i]);
                c->lines[i].tag = 0;
            }
        }
    } else {
        for (uint64_t n = first; n <= last; n++) {
            struct nc_line *l = &c->lines[n % c->nsets];
            if (l->tag == n + 1) {
                writeback(c, l);
                l->tag = 0;
            }
        }
    }
}

void
nc_read(struct nc_cache *c, uint64_t off, void *dstv, uint64_t len)
{
    uint8_t *dst = dstv;
    pthread_mutex_lock(&c->mu);
    random_eviction(c);
    int fill = len <= NC_FILL_MAX;
    while (len) {
        uint64_t n = off / 64, in = off % 64;
        uint64_t take = 64 - in < len ? 64 - in : len;
        struct nc_line *l = &c->lines[n % c->nsets];
        if (l->tag != n + 1 && fill)
            l = line_for(c, n);
        if (l->tag == n + 1)
            memcpy(dst, l->data + in, take);
        else
            memcpy(dst, c->base + off, take);
        dst += take;
        off += take;
        len -= take;
    }
    pthread_mutex_unlock(&c->mu);
}
