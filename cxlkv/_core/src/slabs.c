/*
 * Allocator slow paths whose cost must not grow with the pool: finding a
 * free run of chunks for a new slab, releasing a batch of empty slabs, and
 * changing the owner of a batch of slabs (recovery, adoption).  All of them
 * run under the pool lock (the caller's; Python orchestrates), after
 * set_geometry; every offset they form is inside the geometry checked there
 * or range-checked here.
 *
 * The emptied-slab record: slab_free notes each slab whose last allocated
 * slot it freed (slab_note_emptied), in this process's Mapping, so that
 * release_empty() looks at those slabs only instead of every descriptor.
 * The record is in process memory (no lock but its own mutex): it is a hint -
 * each slab in it is checked again by the release protocol - and when it
 * overflows the caller is told, and falls back to a sweep.
 */
#include "core.h"
#include <pthread.h>

#define EMPTIED_MAX  8192
#define MAX_SPAN     64        /* the longest slab (alloc.py MAX_SLAB_CHUNKS) */

struct slab_record {
    uint64_t n;
    int overflow;
    uint64_t heads[EMPTIED_MAX];
};

struct slab_emptied {
    pthread_mutex_t lock;      /* slab_free runs without the GIL */
    uint64_t last_freed;       /* head+1 of the last slab put in `freed` (relaxed) */
    struct slab_record emptied, freed;
};

static struct slab_emptied *
emptied_get(Mapping *m)
{
    struct slab_emptied *e = __atomic_load_n(&m->emptied, __ATOMIC_ACQUIRE);
    if (e)
        return e;
    e = calloc(1, sizeof *e);
    if (!e)
        return NULL;
    pthread_mutex_init(&e->lock, NULL);
    struct slab_emptied *none = NULL;
    if (!__atomic_compare_exchange_n(&m->emptied, &none, e, 0, __ATOMIC_ACQ_REL,
                                     __ATOMIC_ACQUIRE)) {
        pthread_mutex_destroy(&e->lock);
        free(e);
        return none;
    }
    return e;
}

void
slab_emptied_free(Mapping *m)
{
    if (m->emptied) {
        pthread_mutex_destroy(&m->emptied->lock);
        free(m->emptied);
        m->emptied = NULL;
    }
}

static void
record_add(struct slab_record *r, uint64_t head)
{
    if (r->n && r->heads[r->n - 1] == head)
        return;                 /* the same slab again */
    if (r->n < EMPTIED_MAX)
        r->heads[r->n++] = head;
    else
        r->overflow = 1;
}

/* Called by slab_free (GIL released) after it freed a slot of slab `head`;
 * word_empty: the slot's alloc word is now 0 (the slab may be empty). */
void
slab_note_free(Mapping *m, uint64_t head, int word_empty)
{
    int empty = 0;
    if (word_empty) {
        uint64_t d = m->desc_base + head * CXLKV_CHUNK_DESC_SIZE;
        empty = 1;
        for (uint64_t w = 0; w < 8 && empty; w++)
            empty = pool_load64(m, d + CD_ALLOC + w * 8) == 0;
    }
    struct slab_emptied *e = emptied_get(m);
    if (!e)
        return;                 /* no memory: the sweep finds the slab */
    if (!empty && __atomic_load_n(&e->last_freed, __ATOMIC_RELAXED) == head + 1)
        return;                 /* a batch freeing one slab's slots: noted already */
    pthread_mutex_lock(&e->lock);
    record_add(&e->freed, head);
    __atomic_store_n(&e->last_freed, head + 1, __ATOMIC_RELAXED);
    if (empty)
        record_add(&e->emptied, head);
    pthread_mutex_unlock(&e->lock);
}

/* slab_take_emptied(freed=False) -> (bytes of uint64 heads, overflowed): the
 * slabs this process's frees emptied (freed=True: freed a slot in) since the
 * last such call; duplicates possible, and overflowed when some were lost. */
PyObject *
Mapping_slab_take_emptied(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    int which = 0;
    if (nargs_check(nargs, 0, 1, "slab_take_emptied") < 0 ||
        (nargs && (which = PyObject_IsTrue(args[0])) < 0))
        return NULL;
    struct slab_emptied *e = emptied_get(m);
    if (!e)
        return PyErr_NoMemory();
    pthread_mutex_lock(&e->lock);
    struct slab_record *r = which ? &e->freed : &e->emptied;
    PyObject *b = PyBytes_FromStringAndSize((const char *)r->heads, (Py_ssize_t)(r->n * 8));
    int over = r->overflow;
    if (b) {
        r->n = 0;
        r->overflow = 0;
        if (which)
            __atomic_store_n(&e->last_freed, 0, __ATOMIC_RELAXED);
    }
    pthread_mutex_unlock(&e->lock);
    if (!b)
        return NULL;
    return Py_BuildValue("(NO)", b, over ? Py_True : Py_False);
}

static inline uint64_t
desc_word(Mapping *m, uint64_t chunk, uint64_t field)
{
    uint64_t d = m->desc_base + chunk * CXLKV_CHUNK_DESC_SIZE;
    if (m->flush_meta)
        pool_invalidate(m, d, 64);
    return pool_load64(m, d + field);
}

/* The end of the span of a slab head (made, half made or being released)
 * that covers chunk s, or s when none does: a dead node's half-made slab has
 * its head but not yet its tails or bits. */
static uint64_t
covered_until(Mapping *m, uint64_t s)
{
    uint64_t end = s;
    for (uint64_t h = s > MAX_SPAN ? s - MAX_SPAN : 0; h < s; h++) {
        uint64_t kind = desc_word(m, h, CD_CONTROL) & 0xff;
        if (kind != CXLKV_CHUNK_HEAD && kind != CXLKV_CHUNK_RELEASING)
            continue;
        uint64_t k = desc_word(m, h, CD_NCHUNKS);
        if (k < 1)
            k = 1;
        if (k > m->nchunks - h)
            k = m->nchunks - h;
        if (h + k > end)
            end = h + k;
    }
    return end;
}

/* The first chunk >= from and < to where k bitmap bits in a row are clear,
 * or UINT64_MAX.  Words with every bit set are skipped a word at a time. */
static uint64_t
bitmap_run(Mapping *m, uint64_t bm, uint64_t from, uint64_t to, uint64_t k)
{
    uint64_t run = 0, i = from;
    uint64_t last_inval = UINT64_MAX;
    while (i < to) {
        uint64_t w = i / 64;
        if (m->flush_meta && w / 512 != last_inval) {      /* a 4 KiB block of words */
            last_inval = w / 512;
            uint64_t lo = last_inval * 512, hi = (m->nchunks + 63) / 64;
            if (hi > lo + 512)
                hi = lo + 512;
            pool_invalidate(m, bm + lo * 8, (hi - lo) * 8);
        }
        uint64_t word = pool_load64(m, bm + w * 8);
        uint64_t b = i % 64;
        if (b == 0 && to - i >= 64) {
            if (word == ~0ull) {
                run = 0;
                i += 64;
                continue;
            }
            if (word == 0) {
                if (run + 64 >= k)
                    return i - run;      /* the run began `run` chunks back */
                run += 64;
                i += 64;
                continue;
            }
        }
        if (word >> b & 1) {
            run = 0;
        } else if (++run == k) {
            return i + 1 - k;
        }
        i++;
    }
    return UINT64_MAX;
}

/* The first chunk of k free chunks from `hint` (next fit, wrapping once),
 * or UINT64_MAX.  Free: bitmap bit clear, descriptor FREE, and inside no
 * head's span.  Reads only (the GIL may be released). */
static uint64_t
find_run(Mapping *m, uint64_t bm, uint64_t k, uint64_t hint)
{
    if (hint >= m->nchunks)
        hint = 0;
    for (int pass = 0; pass < 2; pass++) {
        uint64_t pos = pass ? 0 : hint;
        uint64_t to = pass ? (hint + k < m->nchunks ? hint + k : m->nchunks) : m->nchunks;
        while (pos < to) {
            uint64_t s = bitmap_run(m, bm, pos, to, k);
            if (s == UINT64_MAX)
                break;
            uint64_t e = covered_until(m, s);
            if (e > s) {
                pos = e;
                continue;
            }
            uint64_t j;
            for (j = s; j < s + k; j++)
                if (desc_word(m, j, CD_CONTROL) & 0xff)
                    break;
            if (j < s + k) {
                pos = j + 1;
                continue;
            }
            return s;
        }
    }
    return UINT64_MAX;
}

static int
bitmap_args(Mapping *m, uint64_t bm, const char *name)
{
    if (!m->geo_set) {
        PyErr_Format(cxlkv_InternalError, "%s: allocator geometry not set", name);
        return -1;
    }
    if (check_word(m, bm, name) < 0 || check_range(m, bm, (m->nchunks + 63) / 64 * 8, name) < 0)
        return -1;
    return 0;
}

/* chunk_find_run(bitmap_off, k, hint) -> first chunk of k free chunks, or -1
 * (find_run). */
PyObject *
Mapping_chunk_find_run(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t bm, k, hint;
    if (nargs_check(nargs, 3, 3, "chunk_find_run") < 0 || check_open(m) < 0 ||
        as_u64(args[0], &bm, "bitmap_off") < 0 || as_u64(args[1], &k, "k") < 0 ||
        as_u64(args[2], &hint, "hint") < 0 || bitmap_args(m, bm, "chunk_find_run") < 0)
        return NULL;
    if (k == 0 || k > MAX_SPAN || k > m->nchunks)
        return PyLong_FromLong(-1);
    uint64_t found;
    m->busy++;
    Py_BEGIN_ALLOW_THREADS
    found = find_run(m, bm, k, hint);
    Py_END_ALLOW_THREADS
    m->busy--;
    return PyLong_FromLongLong(found == UINT64_MAX ? -1 : (long long)found);
}

/* slab_make(bitmap_off, k, hint, owner, slot_size, nslots) -> head, or -1
 * when no k free chunks are left (pool lock held), or -2 when the write
 * deadline passed during the search (nothing written: guard, then again).  In the order recovery
 * relies on: the head (it names the owner, so a half-made slab is found),
 * flushed; crash point slab.head; the tails, flushed; crash point
 * slab.tails; then the bitmap bits (only pool-lock holders change them). */
PyObject *
Mapping_slab_make(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t bm, k, hint, owner, ss, nslots;
    if (nargs_check(nargs, 6, 6, "slab_make") < 0 || check_open(m) < 0 ||
        check_writable(m, "slab_make") < 0 ||
        as_u64(args[0], &bm, "bitmap_off") < 0 || as_u64(args[1], &k, "k") < 0 ||
        as_u64(args[2], &hint, "hint") < 0 || as_u64(args[3], &owner, "owner") < 0 ||
        as_u64(args[4], &ss, "slot_size") < 0 || as_u64(args[5], &nslots, "nslots") < 0 ||
        bitmap_args(m, bm, "slab_make") < 0)
        return NULL;
    if (k == 0 || k > MAX_SPAN || k > m->nchunks)
        return PyLong_FromLong(-1);
    if (ss == 0 || nslots == 0 || nslots > 8 * sizeof(((struct cxlkv_chunk *)0)->alloc_bits)) {
        PyErr_Format(PyExc_ValueError, "slab_make: bad slab shape (%llu slots of %llu bytes)",
                     (unsigned long long)nslots, (unsigned long long)ss);
        return NULL;
    }
    uint64_t head = find_run(m, bm, k, hint);
    if (head == UINT64_MAX)
        return PyLong_FromLong(-1);
    /* stalled in the search past the lease: the pool lock may be another's
     * now, and the run taken - nothing is written; the caller guards */
    cxlkv_crashpoint("slab.search");
    if (write_deadline_passed(m))
        return PyLong_FromLong(-2);
    uint64_t h = m->desc_base + head * CXLKV_CHUNK_DESC_SIZE;
    pool_zero(m, h + 8, CXLKV_CHUNK_DESC_SIZE - 8, 0);
    pool_store64(m, h + CD_OWNER, owner);
    pool_store64(m, h + CD_SLOT, ss);
    pool_store64(m, h + CD_NSLOTS, nslots);
    pool_store64(m, h + CD_NCHUNKS, k);
    pool_store64(m, h + CD_CONTROL, CXLKV_CHUNK_HEAD);
    pool_flush(m, h, CXLKV_CHUNK_DESC_SIZE);
    cxlkv_crashpoint("slab.head");
    for (uint64_t i = head + 1; i < head + k; i++)
        pool_store64(m, m->desc_base + i * CXLKV_CHUNK_DESC_SIZE,
                     CXLKV_CHUNK_TAIL | head << 8);
    pool_flush(m, h, k * CXLKV_CHUNK_DESC_SIZE);
    cxlkv_crashpoint("slab.tails");
    for (uint64_t i = head; i < head + k;) {
        uint64_t w = i / 64, lo = i % 64, hi = head + k - w * 64;
        if (hi > 64)
            hi = 64;
        uint64_t mask = (hi - lo == 64 ? ~0ull : ((1ull << (hi - lo)) - 1)) << lo;
        uint64_t woff = bm + w * 8;
        pool_invalidate(m, woff, 8);
        pool_or64(m, woff, mask);
        i = w * 64 + hi;
    }
    pool_flush(m, bm + head / 64 * 8, ((head + k + 63) / 64 - head / 64) * 8);
    return PyLong_FromUnsignedLongLong(head);
}

/* Whether the allocator of the node that owner token `owner` names has slab
 * `head` in a hazard word (alloc.py _hazard_on: only the owner allocates
 * without the pool lock, so only its hazards matter). */
static int
hazard_on(Mapping *m, uint64_t heaps, uint64_t max_nodes, uint64_t head, uint64_t owner)
{
    uint64_t slot = (owner & 0xffff);
    if (slot == 0 || slot > max_nodes)
        return 0;
    uint64_t off = heaps + (slot - 1) * CXLKV_HEAP_SIZE + HEAP_HAZARD;
    if (m->flush_meta)
        pool_invalidate(m, off, 8 * CXLKV_HEAP_HAZARDS);
    for (uint64_t i = 0; i < CXLKV_HEAP_HAZARDS; i++)
        if (pool_load64(m, off + 8 * i) == head + 1)
            return 1;
    return 0;
}

static void
bitmap_clear(Mapping *m, uint64_t bm, uint64_t i)
{
    /* non-coherent: the atomic works on this process's copy of the line, and
     * the flush writes the whole line back - it must be fresh */
    if (m->flush_meta)
        pool_invalidate(m, bm + i / 64 * 8, 8);
    pool_and64(m, bm + i / 64 * 8, ~(1ull << (i % 64)));
    pool_flush(m, bm + i / 64 * 8, 8);
}

/* Release one empty slab (alloc.py release_slab, same protocol and crash
 * points): 1 released, 0 refused (not a HEAD, a slot allocated, or the
 * owner's hazard on it), -1 impossible geometry (nothing written), 2
 * stopped at the write deadline with the slab RELEASING (a stall: the pool
 * lock may have gone to another node, which finishes it as it finishes a
 * dead holder's; or this caller guards and calls again, and it goes on).
 * A RELEASING head - under the pool lock only a holder that died or was
 * stalled leaves one - is finished (the resume of alloc.release_slab). */
static int
release_one(Mapping *m, uint64_t bm, uint64_t heaps, uint64_t max_nodes, uint64_t head)
{
    uint64_t h = m->desc_base + head * CXLKV_CHUNK_DESC_SIZE, ss, ns, base;
    pool_invalidate(m, h, CXLKV_CHUNK_DESC_SIZE);
    uint64_t kind = pool_load64(m, h + CD_CONTROL) & 0xff;
    if (kind != CXLKV_CHUNK_HEAD && kind != CXLKV_CHUNK_RELEASING)
        return 0;
    if (slab_geometry(m, head, &ss, &ns, &base) != NULL)
        return -1;
    for (uint64_t w = 0; w < 8; w++)        /* cheap refusal before any write */
        if (pool_load64(m, h + CD_ALLOC + w * 8))
            return 0;
    if (kind == CXLKV_CHUNK_HEAD &&
        pool_cas64(m, h + CD_CONTROL, CXLKV_CHUNK_HEAD, CXLKV_CHUNK_RELEASING) !=
        CXLKV_CHUNK_HEAD)
        return 0;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);  /* RELEASING visible before hazards are read */
    pool_flush(m, h, 8);
    cxlkv_crashpoint("release.releasing");
    pool_invalidate(m, h, CXLKV_CHUNK_DESC_SIZE);
    int busy = hazard_on(m, heaps, max_nodes, head, pool_load64(m, h + CD_OWNER));
    for (uint64_t w = 0; w < 8 && !busy; w++)
        busy = pool_load64(m, h + CD_ALLOC + w * 8) != 0;
    if (busy) {
        pool_store64(m, h + CD_CONTROL, CXLKV_CHUNK_HEAD);
        pool_flush(m, h, 8);
        return 0;
    }
    uint64_t k = pool_load64(m, h + CD_NCHUNKS), ours[MAX_SPAN], n = 0;
    if (k < 1)
        k = 1;
    if (k > m->nchunks - head)
        k = m->nchunks - head;
    if (k > MAX_SPAN)
        k = MAX_SPAN;
    ours[n++] = head;
    for (uint64_t i = head + 1; i < head + k; i++)   /* only this slab's own tails */
        if (desc_word(m, i, CD_CONTROL) == (CXLKV_CHUNK_TAIL | head << 8))
            ours[n++] = i;
    int dirty = 0;
    for (uint64_t w = 0; w < 8; w++)
        dirty |= pool_load64(m, h + CD_DIRTY + w * 8) != 0;
    if (dirty)                                   /* stale bytes never outlive a slab */
        for (uint64_t j = 0; j < n; j++) {
            cxlkv_crashpoint("release.zero");
            if (write_deadline_passed(m))
                return 2;
            cxlkv_crashpoint("release.zeroing");    /* tests: a stall past the check */
            pool_zero(m, m->data_off + ours[j] * m->chunk_size, m->chunk_size, 1);
        }
    if (write_deadline_passed(m))
        return 2;
    for (uint64_t j = n; j-- > 1;)
        pool_store64(m, m->desc_base + ours[j] * CXLKV_CHUNK_DESC_SIZE, CXLKV_CHUNK_FREE);
    pool_flush(m, h, k * CXLKV_CHUNK_DESC_SIZE);
    cxlkv_crashpoint("release.tails");
    pool_zero(m, h + 8, CXLKV_CHUNK_DESC_SIZE - 8, 0);
    pool_store64(m, h + CD_CONTROL, CXLKV_CHUNK_FREE);
    pool_flush(m, h, CXLKV_CHUNK_DESC_SIZE);
    cxlkv_crashpoint("release.head");
    for (uint64_t j = 0; j < n; j++)
        bitmap_clear(m, bm, ours[j]);
    return 1;
}

/* slabs_release(heads, bitmap_off, heaps_off, max_nodes) -> (released, looked_at)
 * Releases the empty slabs among `heads` (a writable uint64 buffer; the
 * released ones are moved to its front, in order).  Stops before a slab once
 * the write deadline has passed, or inside one - before zeroing a chunk of
 * it, or before its descriptors - leaving it RELEASING (looked_at <
 * len(heads)): the caller proves its node fresh (guard) and calls again
 * with the rest, which finishes that one first.  Raises
 * cxlkv_CorruptError at a slab of impossible geometry (the ones before it
 * are done and moved to the front; nothing of the bad one is written). */
PyObject *
Mapping_slabs_release(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t bm, heaps, max_nodes;
    if (nargs_check(nargs, 4, 4, "slabs_release") < 0 ||
        as_u64(args[1], &bm, "bitmap_off") < 0 || as_u64(args[2], &heaps, "heaps_off") < 0 ||
        as_u64(args[3], &max_nodes, "max_nodes") < 0 || check_writable(m, "slabs_release") < 0)
        return NULL;
    if (!m->geo_set) {
        PyErr_SetString(cxlkv_InternalError, "slabs_release: allocator geometry not set");
        return NULL;
    }
    if (check_word(m, bm, "slabs_release bitmap") < 0 ||
        check_range(m, bm, (m->nchunks + 63) / 64 * 8, "slabs_release bitmap") < 0 ||
        max_nodes > 65535 ||
        check_range(m, heaps, max_nodes * CXLKV_HEAP_SIZE, "slabs_release heaps") < 0)
        return NULL;
    Py_buffer in;
    if (get_offsets(args[0], &in, 1) < 0)
        return NULL;
    uint64_t *heads = in.buf, n = (uint64_t)in.len / 8, done = 0, bad = UINT64_MAX, i;
    m->busy++;
    Py_BEGIN_ALLOW_THREADS
    for (i = 0; i < n; i++) {
        if (write_deadline_passed(m))
            break;
        uint64_t head = heads[i];
        if (head >= m->nchunks)
            continue;
        int r = release_one(m, bm, heaps, max_nodes, head);
        if (r < 0) {
            bad = head;
            break;
        }
        if (r == 2)
            break;                      /* stopped at the deadline: this one again */
        if (r)
            heads[done++] = head;
    }
    Py_END_ALLOW_THREADS
    m->busy--;
    PyBuffer_Release(&in);
    if (bad != UINT64_MAX) {
        PyErr_Format(cxlkv_CorruptError, "chunk %llu: slab descriptor is corrupt "
                     "(%llu slabs released before it)", (unsigned long long)bad,
                     (unsigned long long)done);
        return NULL;
    }
    return Py_BuildValue("(KK)", (unsigned long long)done, (unsigned long long)i);
}

/* slabs_set_owner(heads, expect, owner) -> changed
 * For each head that is a HEAD owned by `expect`: owner := `owner` (CAS),
 * flushed.  Recovery orphans a dead node's slabs (expect = its token,
 * owner 0); an allocator adopts an orphan (expect 0).  The changed ones are
 * moved to the front of `heads` (a writable uint64 buffer). */
PyObject *
Mapping_slabs_set_owner(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t expect, owner;
    if (nargs_check(nargs, 3, 3, "slabs_set_owner") < 0 ||
        as_u64(args[1], &expect, "expect") < 0 || as_u64(args[2], &owner, "owner") < 0 ||
        check_writable(m, "slabs_set_owner") < 0)
        return NULL;
    if (!m->geo_set) {
        PyErr_SetString(cxlkv_InternalError, "slabs_set_owner: allocator geometry not set");
        return NULL;
    }
    Py_buffer in;
    if (get_offsets(args[0], &in, 1) < 0)
        return NULL;
    uint64_t *heads = in.buf, n = (uint64_t)in.len / 8, done = 0;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t head = heads[i];
        if (head >= m->nchunks)
            continue;
        uint64_t h = m->desc_base + head * CXLKV_CHUNK_DESC_SIZE;
        if (m->flush_meta)
            pool_invalidate(m, h, 64);
        if ((pool_load64(m, h + CD_CONTROL) & 0xff) != CXLKV_CHUNK_HEAD)
            continue;
        if (pool_cas64(m, h + CD_OWNER, expect, owner) != expect)
            continue;
        pool_flush(m, h, 64);
        heads[done++] = head;
    }
    PyBuffer_Release(&in);
    return PyLong_FromUnsignedLongLong(done);
}

struct grow {
    uint64_t *v;
    size_t n, cap;
};

static int
grow_push(struct grow *g, uint64_t x)
{
    if (g->n == g->cap) {
        size_t cap = g->cap ? g->cap * 2 : 256;
        uint64_t *v = realloc(g->v, cap * sizeof *v);
        if (!v)
            return -1;
        g->v = v;
        g->cap = cap;
    }
    g->v[g->n++] = x;
    return 0;
}

/* slab_census(bitmap_off, token, live) -> (releasing, mine, interrupted,
 * dangling, leaked, empty), each bytes of uint64 chunk indices, from one
 * pass over the descriptor table (recovery's view of it; pool lock held):
 *   releasing    heads left RELEASING (a release a dead lock holder began)
 *   mine         HEADs owned by `token`
 *   interrupted  HEADs owned by no token in `live` (a uint64 buffer) with a
 *                slot both allocated and dirty (a free someone began)
 *   dangling     TAILs in no HEAD's or RELEASING head's span
 *   leaked       chunks with their bitmap bit set and a FREE descriptor
 *   empty        HEADs owned by no token in `live` with no slot allocated
 *                (orphans, or a dead node's, that nobody will free into) */
PyObject *
Mapping_slab_census(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t bm, token;
    if (nargs_check(nargs, 3, 3, "slab_census") < 0 || check_open(m) < 0 ||
        as_u64(args[0], &bm, "bitmap_off") < 0 || as_u64(args[1], &token, "token") < 0)
        return NULL;
    if (!m->geo_set) {
        PyErr_SetString(cxlkv_InternalError, "slab_census: allocator geometry not set");
        return NULL;
    }
    if (check_word(m, bm, "slab_census bitmap") < 0 ||
        check_range(m, bm, (m->nchunks + 63) / 64 * 8, "slab_census bitmap") < 0)
        return NULL;
    Py_buffer lb;
    if (get_offsets(args[2], &lb, 0) < 0)
        return NULL;
    const uint64_t *live = lb.buf;
    size_t nlive = (size_t)lb.len / 8;
    struct grow g[6] = {{0}};
    int oom = 0;
    m->busy++;
    Py_BEGIN_ALLOW_THREADS
    uint64_t cover = 0, word = 0;
    for (uint64_t i = 0; i < m->nchunks && !oom; i++) {
        uint64_t d = m->desc_base + i * CXLKV_CHUNK_DESC_SIZE;
        if (i % 64 == 0) {
            if (m->flush_meta)
                pool_invalidate(m, bm + i / 64 * 8, 8);
            word = pool_load64(m, bm + i / 64 * 8);
        }
        if (m->flush_meta)
            pool_invalidate(m, d, 64);
        uint64_t ctl = pool_load64(m, d + CD_CONTROL), kind = ctl & 0xff;
        if (kind == CXLKV_CHUNK_HEAD || kind == CXLKV_CHUNK_RELEASING) {
            uint64_t k = pool_load64(m, d + CD_NCHUNKS);
            if (k < 1)
                k = 1;
            if (k > m->nchunks - i)
                k = m->nchunks - i;
            if (i + k > cover)
                cover = i + k;
        }
        if (kind == CXLKV_CHUNK_RELEASING) {
            oom |= grow_push(&g[0], i);
        } else if (kind == CXLKV_CHUNK_HEAD) {
            uint64_t owner = pool_load64(m, d + CD_OWNER);
            if (owner == token)
                oom |= grow_push(&g[1], i);
            int is_live = 0;
            for (size_t j = 0; j < nlive && !is_live; j++)
                is_live = live[j] == owner;
            if (!is_live) {
                if (m->flush_meta)
                    pool_invalidate(m, d + CD_ALLOC, 192);
                uint64_t hit = 0, used = 0;
                for (uint64_t w = 0; w < 8; w++) {
                    uint64_t a = pool_load64(m, d + CD_ALLOC + w * 8);
                    used |= a;
                    hit |= a & pool_load64(m, d + CD_DIRTY + w * 8);
                }
                if (hit)
                    oom |= grow_push(&g[2], i);
                if (!used)
                    oom |= grow_push(&g[5], i);
            }
        } else if (kind == CXLKV_CHUNK_TAIL) {
            if (i >= cover)
                oom |= grow_push(&g[3], i);
        } else if (kind == CXLKV_CHUNK_FREE && (word >> (i % 64) & 1)) {
            oom |= grow_push(&g[4], i);
        }
    }
    Py_END_ALLOW_THREADS
    m->busy--;
    PyBuffer_Release(&lb);
    PyObject *out = NULL;
    if (oom) {
        PyErr_NoMemory();
    } else {
        out = PyTuple_New(6);
        for (int j = 0; out && j < 6; j++) {
            PyObject *b = PyBytes_FromStringAndSize((const char *)g[j].v,
                                                    (Py_ssize_t)(g[j].n * 8));
            if (!b)
                Py_CLEAR(out);
            else
                PyTuple_SET_ITEM(out, j, b);
        }
    }
    for (int j = 0; j < 6; j++)
        free(g[j].v);
    return out;
}
