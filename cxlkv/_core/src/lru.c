/*
 * Leaf LRU lists of the KV cache (INCOMPAT_KV_LRU): what eviction takes, in
 * O(victims) instead of a scan of the hash table.
 *
 * Invariant (lock: the pool lock guards every list word, link and dirty
 * word; only its holder writes them): an entry is on a list iff it is
 * PUBLISHED and has no live children (a leaf), on the list of its tenant,
 * which is ordered by the entries' lru stamps (head = least recently used).
 * The kv.c writers (insert, set_state, stamp, remove) call lru_sync() after
 * every change of an entry's state, children or stamp, so the lists follow
 * the table.  A parent whose last child goes becomes a leaf, with its stamp
 * raised to the child's (its subtree's newest use, as the old whole-table
 * order had it), and is put in place by a bounded walk from whichever end
 * of its list is nearer in time (so at most LRU_WALK steps: a slightly
 * early or late place, never a scan).
 *
 * Crash safety: lru_begin() sets kv_hdr.lru_dirty before a call's edits and
 * lru_end() clears it.  Whoever next holds the lock and finds it set (the
 * holder died or was fenced mid-edit) rebuilds the lists from the table;
 * so does any call that finds a link out of range or a list inconsistent
 * (m->lru_bad).  Every link is bounds-checked before it is followed; walks
 * are bounded by the table size, so a corrupt cycle ends.
 *
 * flush_meta (manager mode, non-coherence emulation): every line read is
 * invalidated first and every word written is flushed at once.
 */
#include "core.h"

#include <stdlib.h>
#include <string.h>

#define E_CTL       offsetof(struct cxlkv_hash_entry, ctl)
#define E_KEY_LO    offsetof(struct cxlkv_hash_entry, key_lo)
#define E_LEN       offsetof(struct cxlkv_hash_entry, length)   /* length | ns << 32 | tenant << 48 */
#define E_PARENT    offsetof(struct cxlkv_hash_entry, parent)   /* parent | children << 32 */
#define E_LRU       offsetof(struct cxlkv_hash_entry, lru)
#define H_TOMB      offsetof(struct cxlkv_kv_hdr, tombstones)
#define H_DIRTY     offsetof(struct cxlkv_kv_hdr, lru_dirty)
#define H_LEAVES    offsetof(struct cxlkv_kv_hdr, lru_leaves)
#define H_REBUILDS  offsetof(struct cxlkv_kv_hdr, lru_rebuilds)
#define H_LISTS     offsetof(struct cxlkv_kv_hdr, lru_lists)

#define ST(ctl)     ((ctl) & CXLKV_KV_STATE_MASK)
#define VER(ctl)    ((ctl) >> 8)
#define CTL(st, v)  ((uint64_t)(st) | (uint64_t)(v) << 8)
#define LO32        0xffffffffull
#define LRU_WALK    64

static inline void mflush(Mapping *m, uint64_t off, uint64_t len)
{
    if (m->flush_meta)
        pool_flush(m, off, len);
}

static inline void minval(Mapping *m, uint64_t off, uint64_t len)
{
    if (m->flush_meta)
        pool_invalidate(m, off, len);
}

static inline uint64_t eoff(const Mapping *m, uint64_t i)
{
    return m->lru_table + i * CXLKV_HASH_ENTRY_SIZE;
}

static inline uint64_t eload(Mapping *m, uint64_t i, uint64_t field)
{
    minval(m, eoff(m, i) + field, 8);
    return pool_load64(m, eoff(m, i) + field);
}

static inline uint64_t link_get(Mapping *m, uint64_t i)
{
    minval(m, m->lru_links + i * 8, 8);
    return pool_load64(m, m->lru_links + i * 8);
}

static inline void link_set(Mapping *m, uint64_t i, uint64_t prev1, uint64_t next1)
{
    pool_store64(m, m->lru_links + i * 8, prev1 | next1 << 32);
    mflush(m, m->lru_links + i * 8, 8);
}

static inline uint64_t list_off(const Mapping *m, uint64_t t)
{
    return m->lru_hdr + H_LISTS + (t % CXLKV_KV_LRU_LISTS) * 8;
}

static inline uint64_t list_get(Mapping *m, uint64_t t)
{
    minval(m, list_off(m, t), 8);
    return pool_load64(m, list_off(m, t));
}

static inline void list_set(Mapping *m, uint64_t t, uint64_t head1, uint64_t tail1)
{
    pool_store64(m, list_off(m, t), head1 | tail1 << 32);
    mflush(m, list_off(m, t), 8);
}

static inline void hdr_add(Mapping *m, uint64_t field, int64_t delta)
{
    minval(m, m->lru_hdr + field, 8);
    uint64_t v = pool_load64(m, m->lru_hdr + field);
    if (delta < 0 && v < (uint64_t)-delta)
        v = 0;
    else
        v += (uint64_t)delta;
    pool_store64(m, m->lru_hdr + field, v);
    mflush(m, m->lru_hdr + field, 8);
}

int
lru_on(const Mapping *m, uint64_t table, uint64_t nslots)
{
    return m->lru_set && table == m->lru_table && nslots == m->lru_nslots;
}

static inline int is_leaf(Mapping *m, uint64_t i)
{
    return ST(eload(m, i, E_CTL)) == CXLKV_KV_PUBLISHED && (eload(m, i, E_PARENT) >> 32) == 0;
}

static inline uint64_t tenant_of(Mapping *m, uint64_t i)
{
    return (eload(m, i, E_LEN) >> 48) % CXLKV_KV_LRU_LISTS;
}

/* a link value (index + 1, 0 = none) in range, else the lists are corrupt */
static inline int ok1(Mapping *m, uint64_t v)
{
    if (v > m->lru_nslots) {
        m->lru_bad = 1;
        return 0;
    }
    return 1;
}

static void
unlink_entry(Mapping *m, uint64_t i, uint64_t t)
{
    uint64_t w = link_get(m, i), p = w & LO32, n = w >> 32, l = list_get(m, t);
    uint64_t head = l & LO32, tail = l >> 32;
    if (!ok1(m, p) || !ok1(m, n))
        return;
    if (p) {
        uint64_t pw = link_get(m, p - 1);
        if ((pw >> 32) != i + 1)
            m->lru_bad = 1;
        link_set(m, p - 1, pw & LO32, n);
    } else {
        if (head != i + 1)
            m->lru_bad = 1;
        head = n;
    }
    cxlkv_crashpoint("kv.lru");                 /* tests: a holder dies mid-edit */
    if (n) {
        uint64_t nw = link_get(m, n - 1);
        if ((nw & LO32) != i + 1)
            m->lru_bad = 1;
        link_set(m, n - 1, p, nw >> 32);
    } else {
        if (tail != i + 1)
            m->lru_bad = 1;
        tail = p;
    }
    list_set(m, t, head, tail);
    link_set(m, i, 0, 0);
    hdr_add(m, H_LEAVES, -1);
}

/* put i after a1 (index + 1; 0 = at the head) on list t */
static void
insert_after(Mapping *m, uint64_t i, uint64_t t, uint64_t a1)
{
    uint64_t l = list_get(m, t), head = l & LO32, tail = l >> 32;
    uint64_t n1 = a1 ? link_get(m, a1 - 1) >> 32 : head;
    if (!ok1(m, n1) || !ok1(m, head) || !ok1(m, tail))
        return;
    link_set(m, i, a1, n1);
    if (a1)
        link_set(m, a1 - 1, link_get(m, a1 - 1) & LO32, i + 1);
    else
        head = i + 1;
    if (n1)
        link_set(m, n1 - 1, i + 1, link_get(m, n1 - 1) >> 32);
    else
        tail = i + 1;
    list_set(m, t, head, tail);
    hdr_add(m, H_LEAVES, 1);
}

/* place i on list t by its stamp (tail: newest) */
static void
insert_sorted(Mapping *m, uint64_t i, uint64_t t, int at_tail)
{
    uint64_t l = list_get(m, t), head = l & LO32, tail = l >> 32;
    if (!ok1(m, head) || !ok1(m, tail))
        return;
    if (!head || !tail) {
        insert_after(m, i, t, 0);
        return;
    }
    uint64_t key = eload(m, i, E_LRU), kt = eload(m, tail - 1, E_LRU);
    if (at_tail || key >= kt) {
        insert_after(m, i, t, tail);
        return;
    }
    uint64_t kh = eload(m, head - 1, E_LRU);
    if (key <= kh) {
        insert_after(m, i, t, 0);
        return;
    }
    if (key - kh <= kt - key) {
        uint64_t cur = head;                         /* forward: last one not newer */
        for (int k = 0; k < LRU_WALK; k++) {
            uint64_t nx = link_get(m, cur - 1) >> 32;
            if (!ok1(m, nx))
                return;
            if (!nx || eload(m, nx - 1, E_LRU) > key)
                break;
            cur = nx;
        }
        insert_after(m, i, t, cur);
    } else {
        uint64_t cur = tail;                         /* backward: first one not newer */
        for (int k = 0; k < LRU_WALK; k++) {
            if (eload(m, cur - 1, E_LRU) <= key)
                break;
            uint64_t pv = link_get(m, cur - 1) & LO32;
            if (!ok1(m, pv))
                return;
            cur = pv;
            if (!cur)
                break;
        }
        insert_after(m, i, t, cur);
    }
}

int
lru_sync(Mapping *m, uint64_t i, int where)
{
    if (!m->lru_set || i >= m->lru_nslots)
        return 0;
    cxlkv_crashpoint("kv.lru.sync");
    /* a node stalled past its write deadline proves itself fresh before each
     * edit (its guard beats, or raises NodeFenced: it writes nothing more,
     * the dirty word stays set and the next holder rebuilds) */
    if (m->lru_fenced || (write_deadline_passed(m) && check_writable(m, "kv lru") < 0)) {
        m->lru_fenced = 1;
        return -1;
    }
    uint64_t t = tenant_of(m, i), l = list_get(m, t);
    int linked = link_get(m, i) != 0 || (l & LO32) == i + 1;
    int want = is_leaf(m, i);
    if (linked && (!want || where == LRU_RESTAMP))
        unlink_entry(m, i, t);
    else if (linked)
        return 0;
    if (want)
        insert_sorted(m, i, t, where == LRU_TAIL);
    return 0;
}

/* ---------------------------------------------------------------- rebuild */

typedef struct {
    uint64_t lru, idx;
} Leaf;

static int
leaf_cmp(const void *a, const void *b)
{
    const Leaf *x = a, *y = b;
    if (x->lru != y->lru)
        return x->lru < y->lru ? -1 : 1;
    return x->idx < y->idx ? -1 : x->idx > y->idx;
}

/* A rebuilder stalled past its write deadline proves itself fresh before it
 * writes on (its guard beats, or raises NodeFenced): resumed after it was
 * fenced, its leaves are a stale view of a table others have edited and
 * relinked meanwhile.  Checked once the leaves are sorted, then every
 * REBUILD_CHECK link writes.  -1 with the exception set. */
#define REBUILD_CHECK 256

static int
rebuild_fresh(Mapping *m)
{
    return write_deadline_passed(m) && check_writable(m, "kv lru rebuild") < 0 ? -1 : 0;
}

/* Relink every leaf from the table, in stamp order (dirty set by the caller).
 * -1 with MemoryError set when the scratch arrays cannot be had, or with
 * NodeFenced from the guard (rebuild_fresh). */
static int
rebuild(Mapping *m)
{
    uint64_t n = m->lru_nslots, nl = 0;
    Leaf *lv = malloc(n * sizeof(Leaf));
    if (!lv) {
        PyErr_NoMemory();
        return -1;
    }
    minval(m, m->lru_table, n * CXLKV_HASH_ENTRY_SIZE);
    for (uint64_t i = 0; i < n; i++) {
        uint64_t e = eoff(m, i);
        if (ST(pool_load64(m, e + E_CTL)) == CXLKV_KV_PUBLISHED &&
            (pool_load64(m, e + E_PARENT) >> 32) == 0) {
            lv[nl].lru = pool_load64(m, e + E_LRU);
            lv[nl++].idx = i;
        }
    }
    qsort(lv, nl, sizeof(Leaf), leaf_cmp);
    cxlkv_crashpoint("kv.lru.rebuild");
    uint64_t head[CXLKV_KV_LRU_LISTS] = {0}, tail[CXLKV_KV_LRU_LISTS] = {0};
    for (uint64_t i = 0; i < n; i++) {
        if (!(i % REBUILD_CHECK) && rebuild_fresh(m) < 0) {
            free(lv);
            return -1;
        }
        pool_store64(m, m->lru_links + i * 8, 0);
    }
    for (uint64_t k = 0; k < nl; k++) {
        if (!(k % REBUILD_CHECK) && rebuild_fresh(m) < 0) {
            free(lv);
            return -1;
        }
        uint64_t i = lv[k].idx, t = (pool_load64(m, eoff(m, i) + E_LEN) >> 48) % CXLKV_KV_LRU_LISTS;
        pool_store64(m, m->lru_links + i * 8, tail[t]);
        if (tail[t]) {
            uint64_t p = tail[t] - 1;
            uint64_t w = pool_load64(m, m->lru_links + p * 8);
            pool_store64(m, m->lru_links + p * 8, (w & LO32) | (i + 1) << 32);
        } else {
            head[t] = i + 1;
        }
        tail[t] = i + 1;
    }
    mflush(m, m->lru_links, n * 8);
    if (rebuild_fresh(m) < 0) {
        free(lv);
        return -1;
    }
    for (uint64_t t = 0; t < CXLKV_KV_LRU_LISTS; t++)
        pool_store64(m, list_off(m, t), head[t] | tail[t] << 32);
    mflush(m, list_off(m, 0), CXLKV_KV_LRU_LISTS * 8);
    pool_store64(m, m->lru_hdr + H_LEAVES, nl);
    mflush(m, m->lru_hdr + H_LEAVES, 8);
    hdr_add(m, H_REBUILDS, 1);
    free(lv);
    m->lru_bad = 0;
    return 0;
}

int
lru_begin(Mapping *m)
{
    if (!m->lru_set || m->lru_depth++ > 0)         /* nested: the outer call's edit */
        return 0;
    m->lru_bad = 0;
    minval(m, m->lru_hdr + H_DIRTY, 8);
    uint64_t d = pool_load64(m, m->lru_hdr + H_DIRTY);
    pool_store64(m, m->lru_hdr + H_DIRTY, 1);
    mflush(m, m->lru_hdr + H_DIRTY, 8);
    if (d && rebuild(m) < 0) {              /* a holder died mid-edit */
        m->lru_depth--;
        return -1;
    }
    return 0;
}

int
lru_end(Mapping *m)
{
    if (!m->lru_set || (m->lru_depth > 0 && --m->lru_depth > 0))
        return 0;
    if (m->lru_fenced) {                    /* stopped by its guard: no more writes */
        m->lru_fenced = 0;
        return 0;
    }
    /* an error path (exception set): leave dirty set, the next holder
     * rebuilds.  Otherwise the rebuild and the clearing are writes like any
     * other: a node stopped inside an edit and fenced meanwhile must not make
     * them when it resumes (the lock is someone else's by then) */
    if (PyErr_Occurred() || check_writable(m, "kv lru lists") < 0)
        return PyErr_Occurred() ? -1 : 0;
    int rc = 0;
    if (m->lru_bad)
        rc = rebuild(m);
    if (rc == 0) {
        pool_store64(m, m->lru_hdr + H_DIRTY, 0);
        mflush(m, m->lru_hdr + H_DIRTY, 8);
    }
    return rc;
}

/* ---------------------------------------------------------------- Python API */

/* kv_lru_setup(table_off, nslots, kv_hdr_off, links_off): where the lists of
 * this mapping's KV area are; from then on the kv_* writers keep them. */
PyObject *
Mapping_kv_lru_setup(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t t, n, h, l;
    if (nargs_check(nargs, 4, 4, "kv_lru_setup") < 0 || check_open(m) < 0 ||
        as_u64(args[0], &t, "table") < 0 || as_u64(args[1], &n, "nslots") < 0 ||
        as_u64(args[2], &h, "kv_hdr") < 0 || as_u64(args[3], &l, "links") < 0)
        return NULL;
    if (n == 0 || (n & (n - 1)) || n > LO32 || (t & 63) || (h & 63) || (l & 7)) {
        PyErr_SetString(PyExc_ValueError, "kv_lru_setup: invalid geometry");
        return NULL;
    }
    if (check_range(m, t, n * CXLKV_HASH_ENTRY_SIZE, "kv table") < 0 ||
        check_range(m, h, CXLKV_KV_HDR_SIZE, "kv header") < 0 ||
        check_range(m, l, n * 8, "kv lru links") < 0)
        return NULL;
    m->lru_table = t;
    m->lru_nslots = n;
    m->lru_hdr = h;
    m->lru_links = l;
    m->lru_set = 1;
    Py_RETURN_NONE;
}

static int
need_lru(Mapping *m, const char *what)
{
    if (!m->lru_set) {
        PyErr_Format(PyExc_ValueError, "%s: kv_lru_setup first", what);
        return -1;
    }
    return 0;
}

/* kv_lru_rebuild() -> leaves: relink every leaf from the table (pool lock held) */
PyObject *
Mapping_kv_lru_rebuild(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    (void)args;
    if (nargs_check(nargs, 0, 0, "kv_lru_rebuild") < 0 || need_lru(m, "kv_lru_rebuild") < 0 ||
        check_writable(m, "kv_lru_rebuild") < 0)
        return NULL;
    pool_store64(m, m->lru_hdr + H_DIRTY, 1);
    mflush(m, m->lru_hdr + H_DIRTY, 8);
    if (rebuild(m) < 0 || lru_end(m) < 0)
        return NULL;
    minval(m, m->lru_hdr + H_LEAVES, 8);
    return PyLong_FromUnsignedLongLong(pool_load64(m, m->lru_hdr + H_LEAVES));
}

static int
in_sorted(const uint64_t *a, uint64_t n, uint64_t v)
{
    uint64_t lo = 0, hi = n;
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        if (a[mid] < v)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < n && a[lo] == v;
}

/* Parents a pick makes leaves (all their live children picked): a min-heap
 * by stamp, and the count of children still unpicked per parent (a small
 * open-addressing table).  Both hold at most `cap` items. */
typedef struct {
    uint64_t *hk, *hv, nh;         /* heap: stamp, entry */
    uint64_t *tk, *tv, mask;       /* table: entry + 1, unpicked children */
} Virt;

static void
heap_push(Virt *v, uint64_t k, uint64_t i)
{
    uint64_t j = v->nh++;
    while (j && v->hk[(j - 1) / 2] > k) {
        v->hk[j] = v->hk[(j - 1) / 2];
        v->hv[j] = v->hv[(j - 1) / 2];
        j = (j - 1) / 2;
    }
    v->hk[j] = k;
    v->hv[j] = i;
}

static uint64_t
heap_pop(Virt *v)
{
    uint64_t top = v->hv[0], k = v->hk[--v->nh], i = v->hv[v->nh], j = 0;
    for (;;) {
        uint64_t c = 2 * j + 1;
        if (c >= v->nh)
            break;
        if (c + 1 < v->nh && v->hk[c + 1] < v->hk[c])
            c++;
        if (v->hk[c] >= k)
            break;
        v->hk[j] = v->hk[c];
        v->hv[j] = v->hv[c];
        j = c;
    }
    v->hk[j] = k;
    v->hv[j] = i;
    return top;
}

/* one child of p picked: 1 when that was its last live child */
static int
virt_child_gone(Mapping *m, Virt *v, uint64_t p)
{
    uint64_t h = (p * 0x9E3779B97F4A7C15ull) & v->mask;
    while (v->tk[h] && v->tk[h] != p + 1)
        h = (h + 1) & v->mask;
    if (!v->tk[h]) {
        v->tk[h] = p + 1;
        v->tv[h] = eload(m, p, E_PARENT) >> 32;
    }
    if (v->tv[h])
        v->tv[h]--;
    return v->tv[h] == 0;
}

/* kv_lru_pick(tenant, want_n, want_bytes, smallest_slot, pinned, keep, out) -> n
 * Victims in eviction order, least recently used leaf first, from the
 * tenant's list (tenant >= 256: all lists, oldest head first), skipping
 * entries in the sorted uint64 arrays pinned and keep, until want_n victims
 * and want_bytes slot bytes (length rounded up to 64, at least
 * smallest_slot) or out is full.  A parent whose live children were all
 * picked becomes a candidate at once, by its subtree's newest stamp, so the
 * order is leaf first over whole chains (children before their parent in
 * `out`).  Reads only (pool lock held); a corrupt list found on the way is
 * rebuilt and the pick ends early. */
PyObject *
Mapping_kv_lru_pick(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t tenant, want_n, want_b, smallest;
    if (nargs_check(nargs, 7, 7, "kv_lru_pick") < 0 || need_lru(m, "kv_lru_pick") < 0 ||
        as_u64(args[0], &tenant, "tenant") < 0 || as_u64(args[1], &want_n, "want_n") < 0 ||
        as_u64(args[2], &want_b, "want_bytes") < 0 || as_u64(args[3], &smallest, "smallest") < 0 ||
        check_writable(m, "kv_lru_pick") < 0)
        return NULL;
    Py_buffer bp, bk, bo;
    if (get_offsets(args[4], &bp, 0) < 0)
        return NULL;
    if (get_offsets(args[5], &bk, 0) < 0) {
        PyBuffer_Release(&bp);
        return NULL;
    }
    if (get_offsets(args[6], &bo, 1) < 0) {
        PyBuffer_Release(&bp);
        PyBuffer_Release(&bk);
        return NULL;
    }
    PyObject *ret = NULL;
    const uint64_t *pin = bp.buf, *keep = bk.buf;
    uint64_t npin = (uint64_t)bp.len / 8, nkeep = (uint64_t)bk.len / 8;
    uint64_t *out = bo.buf, cap = (uint64_t)bo.len / 8, n = 0, bytes = 0, steps = 0;
    uint64_t tsize = 16;
    while (tsize < 4 * cap)
        tsize <<= 1;
    Virt v = {.hk = PyMem_Malloc((cap + 1) * 8), .hv = PyMem_Malloc((cap + 1) * 8),
              .tk = PyMem_Calloc(tsize, 8), .tv = PyMem_Calloc(tsize, 8), .mask = tsize - 1};
    if (!v.hk || !v.hv || !v.tk || !v.tv) {
        PyErr_NoMemory();
        goto done;
    }
    if (lru_begin(m) < 0)
        goto done;
    uint64_t cur[CXLKV_KV_LRU_LISTS];
    int nl = 0;
    for (uint64_t t = 0; t < CXLKV_KV_LRU_LISTS; t++) {
        if (tenant < CXLKV_KV_LRU_LISTS && t != tenant)
            continue;
        uint64_t h = list_get(m, t) & LO32;
        if (h && ok1(m, h))
            cur[nl++] = h;
    }
    while (n < cap && !(n >= want_n && bytes >= want_b) && !m->lru_bad) {
        int best = -1;
        uint64_t bl = 0;
        for (int k = 0; k < nl; k++) {
            if (!cur[k])
                continue;
            uint64_t s = eload(m, cur[k] - 1, E_LRU);
            if (best < 0 || s < bl) {
                best = k;
                bl = s;
            }
        }
        uint64_t i, ki = bl;                        /* ki: its subtree's newest stamp */
        if (v.nh && (best < 0 || v.hk[0] < bl)) {
            ki = v.hk[0];
            i = heap_pop(&v);                       /* a parent made a leaf by this pick */
        } else if (best < 0) {
            break;
        } else {
            i = cur[best] - 1;
            uint64_t nx = link_get(m, i) >> 32;
            if (!ok1(m, nx) || !is_leaf(m, i) || ++steps > m->lru_nslots) {
                m->lru_bad = 1;
                break;
            }
            cur[best] = nx;
        }
        if (in_sorted(pin, npin, i) || in_sorted(keep, nkeep, i))
            continue;
        uint64_t len = eload(m, i, E_LEN) & LO32, ss = 0;
        if (len) {
            ss = (len + 63) / 64 * 64;
            if (ss < smallest)
                ss = smallest;
        }
        out[n++] = i;
        bytes += ss;
        uint64_t p1 = eload(m, i, E_PARENT) & LO32;
        if (p1 && p1 <= m->lru_nslots && ST(eload(m, p1 - 1, E_CTL)) == CXLKV_KV_PUBLISHED &&
            virt_child_gone(m, &v, p1 - 1)) {
            uint64_t s = eload(m, p1 - 1, E_LRU);
            heap_push(&v, s > ki ? s : ki, p1 - 1);
        }
    }
    if (lru_end(m) < 0)
        goto done;
    ret = PyLong_FromUnsignedLongLong(n);
done:
    PyMem_Free(v.hk);
    PyMem_Free(v.hv);
    PyMem_Free(v.tk);
    PyMem_Free(v.tv);
    PyBuffer_Release(&bp);
    PyBuffer_Release(&bk);
    PyBuffer_Release(&bo);
    return ret;
}

/* kv_lru_path_victim(key_lo, pinned, keep) -> entry index | -1
 * The least recently used leaf (not pinned, not kept) on the probe path of
 * a key: from its home slot to the first EMPTY (pool lock held, reads only). */
PyObject *
Mapping_kv_lru_path_victim(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t key;
    if (nargs_check(nargs, 3, 3, "kv_lru_path_victim") < 0 || need_lru(m, "kv_lru_path_victim") < 0 ||
        as_u64(args[0], &key, "key_lo") < 0)
        return NULL;
    Py_buffer bp, bk;
    if (get_offsets(args[1], &bp, 0) < 0)
        return NULL;
    if (get_offsets(args[2], &bk, 0) < 0) {
        PyBuffer_Release(&bp);
        return NULL;
    }
    uint64_t mask = m->lru_nslots - 1, i = key & mask, best = UINT64_MAX, bl = 0;
    for (uint64_t k = 0; k < m->lru_nslots; k++, i = (i + 1) & mask) {
        minval(m, eoff(m, i), CXLKV_HASH_ENTRY_SIZE);
        uint64_t c = pool_load64(m, eoff(m, i) + E_CTL);
        if (ST(c) == CXLKV_KV_EMPTY)
            break;
        if (ST(c) != CXLKV_KV_PUBLISHED || (pool_load64(m, eoff(m, i) + E_PARENT) >> 32))
            continue;
        if (in_sorted(bp.buf, (uint64_t)bp.len / 8, i) || in_sorted(bk.buf, (uint64_t)bk.len / 8, i))
            continue;
        uint64_t s = pool_load64(m, eoff(m, i) + E_LRU);
        if (best == UINT64_MAX || s < bl) {
            best = i;
            bl = s;
        }
    }
    PyBuffer_Release(&bp);
    PyBuffer_Release(&bk);
    return best == UINT64_MAX ? PyLong_FromLong(-1) : PyLong_FromUnsignedLongLong(best);
}

/* kv_purge(start, budget) -> (next_start, freed)
 * Turn tombstones that no live entry's probe path crosses back into EMPTY,
 * over whole clusters (runs between EMPTY slots) from the one holding slot
 * `start` on, until at least `budget` slots were looked at (pool lock held).
 * In a cluster walked from its end, a tombstone at r is crossed iff a live
 * entry after it has its home at or before r.  Safe for lock-free readers:
 * one looking for a present key never passes such a tombstone. */
PyObject *
Mapping_kv_purge(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t start, budget;
    if (nargs_check(nargs, 2, 2, "kv_purge") < 0 || need_lru(m, "kv_purge") < 0 ||
        as_u64(args[0], &start, "start") < 0 || as_u64(args[1], &budget, "budget") < 0 ||
        check_writable(m, "kv_purge") < 0)
        return NULL;
    uint64_t n = m->lru_nslots, mask = n - 1, j = start & mask, k = 0, freed = 0, seen = 0;
    for (; k < n; k++, j = (j - 1) & mask) {
        minval(m, eoff(m, j), 8);
        if (ST(pool_load64(m, eoff(m, j) + E_CTL)) == CXLKV_KV_EMPTY)
            break;
    }
    if (k == n)                                     /* no EMPTY slot: nothing is safe */
        return Py_BuildValue("(KK)", (unsigned long long)start, 0ull);
    uint64_t pos = (j + 1) & mask;
    while (seen < budget && seen < n) {
        uint64_t len = 0;
        for (; len < n; len++) {
            uint64_t s = (pos + len) & mask;
            minval(m, eoff(m, s), CXLKV_HASH_ENTRY_SIZE);
            if (ST(pool_load64(m, eoff(m, s) + E_CTL)) == CXLKV_KV_EMPTY)
                break;
        }
        uint64_t minhome = len;
        for (uint64_t r = len; r-- > 0;) {
            uint64_t s = (pos + r) & mask, e = eoff(m, s), c = pool_load64(m, e + E_CTL);
            if (ST(c) == CXLKV_KV_TOMBSTONE) {
                if (minhome > r) {
                    /* a node stalled past its write deadline proves itself
                     * fresh first: resumed after it was fenced, its view of
                     * the cluster is stale (the tombstone may hold another
                     * node's entry by now).  Stopped here, the header's
                     * count is left high: a fenced node's recovery recounts */
                    cxlkv_crashpoint("kv.purge.next");
                    if (write_deadline_passed(m) && check_writable(m, "kv_purge") < 0)
                        return NULL;
                    pool_store64(m, e + E_CTL, CTL(CXLKV_KV_EMPTY, VER(c) + 1));
                    mflush(m, e, 8);
                    freed++;
                }
            } else {
                uint64_t rel = ((pool_load64(m, e + E_KEY_LO) & mask) - pos) & mask;
                if (rel > r)
                    rel = 0;                        /* home outside its cluster: keep all */
                if (rel < minhome)
                    minhome = rel;
            }
        }
        seen += len + 1;
        pos = (pos + len + 1) & mask;
    }
    if (freed)
        hdr_add(m, H_TOMB, -(int64_t)freed);
    return Py_BuildValue("(KK)", (unsigned long long)pos, (unsigned long long)freed);
}

/* kv_lru_check() -> (problems, first_problem, on_lists, leaves)
 * Verify the lists against the table (fsck; reads only): every leaf on
 * exactly the list of its tenant, nothing else on a list, links in range
 * and mutual, no cycles, stamps ordered is not required (bounded walks). */
PyObject *
Mapping_kv_lru_check(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    (void)args;
    if (nargs_check(nargs, 0, 0, "kv_lru_check") < 0 || need_lru(m, "kv_lru_check") < 0)
        return NULL;
    uint64_t n = m->lru_nslots, problems = 0, on = 0, leaves = 0;
    char first[200] = "";
#define PROBLEM(...) do { if (!problems++) snprintf(first, sizeof first, __VA_ARGS__); } while (0)
    unsigned char *seen = calloc(n, 1);
    if (!seen)
        return PyErr_NoMemory();
    minval(m, m->lru_hdr, CXLKV_KV_HDR_SIZE);
    minval(m, m->lru_links, n * 8);
    minval(m, m->lru_table, n * CXLKV_HASH_ENTRY_SIZE);
    if (pool_load64(m, m->lru_hdr + H_DIRTY))
        PROBLEM("the lists are marked mid-edit (lru_dirty set)");
    for (uint64_t t = 0; t < CXLKV_KV_LRU_LISTS; t++) {
        uint64_t l = pool_load64(m, list_off(m, t)), head = l & LO32, tail = l >> 32;
        if (head > n || tail > n) {
            PROBLEM("list %llu: head or tail out of range", (unsigned long long)t);
            continue;
        }
        uint64_t prev = 0, cur = head, steps = 0;
        while (cur) {
            uint64_t i = cur - 1, w = pool_load64(m, m->lru_links + i * 8);
            if (seen[i]) {
                PROBLEM("entry %llu: on a list twice (a cycle)", (unsigned long long)i);
                break;
            }
            seen[i] = 1;
            on++;
            if ((w & LO32) != prev)
                PROBLEM("entry %llu: prev link %llu, expected %llu", (unsigned long long)i,
                        (unsigned long long)(w & LO32), (unsigned long long)prev);
            if (!is_leaf(m, i))
                PROBLEM("entry %llu: on a list but not a published leaf", (unsigned long long)i);
            else if (tenant_of(m, i) != t)
                PROBLEM("entry %llu: on the list of tenant %llu, not its own",
                        (unsigned long long)i, (unsigned long long)t);
            if ((w >> 32) > n) {
                PROBLEM("entry %llu: next link out of range", (unsigned long long)i);
                break;
            }
            prev = cur;
            cur = w >> 32;
            if (++steps > n)
                break;
        }
        if (prev != tail && !(head > n))
            PROBLEM("list %llu: tail %llu, the walk ends at %llu", (unsigned long long)t,
                    (unsigned long long)tail, (unsigned long long)prev);
    }
    for (uint64_t i = 0; i < n; i++) {
        if (is_leaf(m, i)) {
            leaves++;
            if (!seen[i])
                PROBLEM("entry %llu: a published leaf on no list", (unsigned long long)i);
        } else if (!seen[i] && pool_load64(m, m->lru_links + i * 8)) {
            PROBLEM("entry %llu: links set but on no list", (unsigned long long)i);
        }
    }
    if (pool_load64(m, m->lru_hdr + H_LEAVES) != on)
        PROBLEM("lru_leaves is %llu, the lists hold %llu",
                (unsigned long long)pool_load64(m, m->lru_hdr + H_LEAVES), (unsigned long long)on);
#undef PROBLEM
    free(seen);
    return Py_BuildValue("(KsKK)", (unsigned long long)problems, first, (unsigned long long)on,
                         (unsigned long long)leaves);
}

/* kv_evict_free(hdr, rec_off, one, idx[, zero=True]) -> (freed, errors, failed)
 * Free the victims `idx` (entries marked EVICTING by this evictor whose
 * payload slots the caller marked as being freed - slab_mark_freeing - pool
 * lock held), in order, each crash-safe as recovery expects: the payload
 * offset recorded in this node's lock entry (`rec_off`, its `freeing`
 * word), the entry removed, the slot freed (zeroed unless zero is false:
 * quarantine never writes a poisoned chunk), the record cleared.  `one` is
 * a scratch uint64 array of one item.  A slot the allocator refuses (a
 * corrupt or double free: ValueError) is counted in errors and returned in
 * `failed`, a list of (entry, message) for the caller to log; its entry
 * still goes (fsck reports the slot).  Any other exception (a stalled
 * node's guard raising NodeFenced before a victim's writes) stops the loop
 * and propagates. */
PyObject *
Mapping_kv_evict_free(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t hdr, rec;
    int zr = 1;
    if (nargs_check(nargs, 4, 5, "kv_evict_free") < 0 || need_lru(m, "kv_evict_free") < 0 ||
        (nargs > 4 && (zr = PyObject_IsTrue(args[4])) < 0) ||
        as_u64(args[0], &hdr, "hdr") < 0 || as_u64(args[1], &rec, "rec_off") < 0 ||
        check_writable(m, "kv_evict_free") < 0 ||
        check_range(m, hdr, CXLKV_KV_HDR_SIZE, "kv header") < 0 ||
        check_word(m, rec, "freeing record") < 0)
        return NULL;
    Py_buffer bo, bi;
    if (get_offsets(args[2], &bo, 1) < 0)
        return NULL;
    if (get_offsets(args[3], &bi, 0) < 0) {
        PyBuffer_Release(&bo);
        return NULL;
    }
    PyObject *ret = NULL, *zero = PyLong_FromLong(0), *failed = PyList_New(0);
    uint64_t n = (uint64_t)bi.len / 8, freed = 0, errors = 0, parent;
    const uint64_t *ix = bi.buf;
    uint64_t *one = bo.buf;
    if (!zero || !failed)
        goto done;
    if (bo.len < 8) {
        PyErr_SetString(PyExc_ValueError, "kv_evict_free: scratch array too small");
        goto done;
    }
    if (lru_begin(m) < 0)
        goto done;
    for (uint64_t k = 0; k < n; k++) {
        uint64_t i = ix[k];
        if (i >= m->lru_nslots) {
            PyErr_Format(PyExc_ValueError, "kv_evict_free: entry %llu out of range",
                         (unsigned long long)i);
            lru_end(m);
            goto done;
        }
        /* a stalled node proves itself fresh (or raises NodeFenced) before
         * each victim, as the per-victim writes from Python did */
        if (check_writable(m, "kv_evict_free") < 0) {
            lru_end(m);
            goto done;
        }
        uint64_t p = eload(m, i, offsetof(struct cxlkv_hash_entry, payload));
        pool_store64(m, rec, p);
        pool_flush(m, rec, 8);
        one[0] = p;
        if (kv_remove_at(m, m->lru_table, m->lru_nslots, hdr, i, &parent) < 0) {
            lru_end(m);
            goto done;
        }
        cxlkv_crashpoint("kv.evict");
        PyObject *a3[3] = {args[2], zr ? Py_True : Py_False, zero}, *r;
        /* 0 freed: it stopped at the write deadline (a stall), the slot a
         * begun free; again - its entry's guard beats, or raises NodeFenced
         * with the record still set for recovery to finish */
        for (int tries = 0;
             (r = Mapping_slab_free(m, a3, 3)) && PyLong_Check(r) && PyLong_AsLong(r) == 0;
             tries++) {
            Py_DECREF(r);
            if (tries == 3) {           /* no guard renews the deadline: never spin */
                r = NULL;
                PyErr_SetString(cxlkv_InternalError, "kv_evict_free: the free kept stopping "
                                "at the write deadline");
                break;
            }
        }
        if (!r && !PyErr_ExceptionMatches(PyExc_ValueError)) {
            lru_end(m);
            goto done;
        }
        if (!r) {
            PyObject *et, *ev, *etb, *why, *item;
            PyErr_Fetch(&et, &ev, &etb);
            why = ev ? PyObject_Str(ev) : PyUnicode_FromString("free refused");
            Py_XDECREF(et);
            Py_XDECREF(ev);
            Py_XDECREF(etb);
            item = why ? Py_BuildValue("(KN)", (unsigned long long)i, why) : NULL;
            if (!item || PyList_Append(failed, item) < 0) {
                Py_XDECREF(item);
                lru_end(m);
                goto done;
            }
            Py_DECREF(item);
            errors++;
        } else {
            freed++;
        }
        Py_XDECREF(r);
        pool_store64(m, rec, 0);
        pool_flush(m, rec, 8);
    }
    if (lru_end(m) < 0)
        goto done;
    ret = Py_BuildValue("(KKO)", (unsigned long long)freed, (unsigned long long)errors, failed);
done:
    Py_XDECREF(failed);
    Py_XDECREF(zero);
    PyBuffer_Release(&bo);
    PyBuffer_Release(&bi);
    return ret;
}
