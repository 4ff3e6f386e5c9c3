/*
 * KV cache hot paths: block-key hashing, hash-table lookup / insert /
 * publish / state changes, pins, the touch ring and batched block copies.
 *
 * Entry writes (insert, publish, set_state, remove) are only called with the
 * pool lock held; lookups and pins are lock-free.  A reader reads an entry
 * as a seqlock (ctl, fields, ctl again) so a concurrent change reads as a
 * miss, never as a mixed entry.  With flush_meta on (manager mode or the
 * non-coherence emulation) writers flush the lines they wrote and readers
 * invalidate lines before reading them.
 *
 * Every table and region offset is checked against the mapping once per
 * call; entry indices come from key & (nslots - 1) or from the caller and
 * are checked against nslots; pin and ring indices against their sizes.
 */
#include "core.h"

#include <string.h>
#include <xxhash.h>

#define E_CTL       offsetof(struct cxlkv_hash_entry, ctl)
#define E_KEY_LO    offsetof(struct cxlkv_hash_entry, key_lo)
#define E_KEY_HI    offsetof(struct cxlkv_hash_entry, key_hi)
#define E_PAYLOAD   offsetof(struct cxlkv_hash_entry, payload)
#define E_LEN       offsetof(struct cxlkv_hash_entry, length)   /* length | ns << 32 | tenant << 48 */
#define E_PARENT    offsetof(struct cxlkv_hash_entry, parent)   /* parent | children << 32 */
#define E_OWNER     offsetof(struct cxlkv_hash_entry, owner)
#define E_LRU       offsetof(struct cxlkv_hash_entry, lru)
#define H_LIVE      offsetof(struct cxlkv_kv_hdr, live)
#define H_TOMB      offsetof(struct cxlkv_kv_hdr, tombstones)

#define ST(ctl)     ((ctl) & CXLKV_KV_STATE_MASK)
#define VER(ctl)    ((ctl) >> 8)
#define CTL(st, v)  ((uint64_t)(st) | (uint64_t)(v) << 8)

#define SEQ_RETRIES 64

typedef struct {
    uint64_t base, nslots;   /* table offset, entries (power of two) */
} Table;

static inline uint64_t ent(const Table *t, uint64_t i) { return t->base + i * CXLKV_HASH_ENTRY_SIZE; }

static inline void meta_flush(Mapping *m, uint64_t off, uint64_t len)
{
    if (m->flush_meta)
        pool_flush(m, off, len);
}

static inline void meta_inval(Mapping *m, uint64_t off, uint64_t len)
{
    if (m->flush_meta)
        pool_invalidate(m, off, len);
}

static int
table_args(Mapping *m, PyObject *o_off, PyObject *o_n, Table *t)
{
    if (check_open(m) < 0 || as_u64(o_off, &t->base, "table offset") < 0 ||
        as_u64(o_n, &t->nslots, "table slots") < 0)
        return -1;
    if (t->nslots == 0 || (t->nslots & (t->nslots - 1)) || t->nslots > (UINT64_MAX >> 7) ||
        (t->base & 63)) {
        PyErr_SetString(PyExc_ValueError, "kv: invalid table geometry");
        return -1;
    }
    return check_range(m, t->base, t->nslots * CXLKV_HASH_ENTRY_SIZE, "kv table");
}

static int
get_bytes(PyObject *obj, Py_buffer *b, Py_ssize_t unit, const char *what)
{
    if (PyObject_GetBuffer(obj, b, PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (b->len % unit) {
        PyErr_Format(PyExc_ValueError, "%s: length %zd is not a multiple of %zd", what, b->len,
                     unit);
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

static inline void
key_words(const unsigned char *k, uint64_t *lo, uint64_t *hi)
{
    memcpy(lo, k, 8);
    memcpy(hi, k + 8, 8);
}

/* ------------------------------------------------------------------ hashing */

/* kv_chain(tokens, block_tokens, out) -> blocks
 * tokens: buffer of uint32 (little-endian); h_i = XXH3_128(h_{i-1} || tokens
 * of block i) with h_{-1} = 16 zero bytes, canonical (big-endian) bytes, as
 * the xxhash package's xxh3_128_digest.  Full blocks only. */
PyObject *
mod_kv_chain(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    uint64_t bt;
    if (nargs_check(nargs, 3, 3, "kv_chain") < 0 || as_u64(args[1], &bt, "block_tokens") < 0)
        return NULL;
    if (bt == 0 || bt > (1u << 20)) {
        PyErr_SetString(PyExc_ValueError, "kv_chain: block_tokens out of range");
        return NULL;
    }
    Py_buffer tk, out;
    if (get_bytes(args[0], &tk, 4, "kv_chain tokens") < 0)
        return NULL;
    if (PyObject_GetBuffer(args[2], &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&tk);
        return NULL;
    }
    uint64_t n = (uint64_t)tk.len / 4 / bt;
    PyObject *ret = NULL;
    unsigned char *buf = NULL;
    if ((uint64_t)out.len < n * 16) {
        PyErr_SetString(PyExc_ValueError, "kv_chain: output buffer too small");
        goto done;
    }
    size_t blen = 16 + bt * 4;
    buf = PyMem_Malloc(blen);
    if (!buf) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    memset(buf, 0, 16);
    const unsigned char *src = tk.buf;
    unsigned char *dst = out.buf;
    for (uint64_t i = 0; i < n; i++) {
        memcpy(buf + 16, src + i * bt * 4, bt * 4);
        XXH128_canonical_t c;
        XXH128_canonicalFromHash(&c, XXH3_128bits(buf, blen));
        memcpy(dst + i * 16, c.digest, 16);
        memcpy(buf, c.digest, 16);
    }
    Py_END_ALLOW_THREADS
    ret = PyLong_FromUnsignedLongLong(n);
done:
    PyMem_Free(buf);
    PyBuffer_Release(&tk);
    PyBuffer_Release(&out);
    return ret;
}

/* kv_keys(hashes, hash_len, prefix, out) -> n
 * key_i = XXH3_128(prefix || hash_i) (canonical bytes): prefix is the
 * namespace digest and the tenant's derived salt. */
PyObject *
mod_kv_keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    uint64_t hl;
    if (nargs_check(nargs, 4, 4, "kv_keys") < 0 || as_u64(args[1], &hl, "hash_len") < 0)
        return NULL;
    if (hl == 0 || hl > 64) {
        PyErr_SetString(PyExc_ValueError, "kv_keys: hash_len must be 1..64");
        return NULL;
    }
    Py_buffer h, p, out;
    if (get_bytes(args[0], &h, (Py_ssize_t)hl, "kv_keys hashes") < 0)
        return NULL;
    if (PyObject_GetBuffer(args[2], &p, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&h);
        return NULL;
    }
    if (PyObject_GetBuffer(args[3], &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&h);
        PyBuffer_Release(&p);
        return NULL;
    }
    uint64_t n = (uint64_t)h.len / hl;
    PyObject *ret = NULL;
    unsigned char buf[64 + 64];
    if (p.len > 64 || (uint64_t)out.len < n * 16) {
        PyErr_SetString(PyExc_ValueError, "kv_keys: prefix longer than 64 bytes or output too small");
        goto done;
    }
    memcpy(buf, p.buf, (size_t)p.len);
    for (uint64_t i = 0; i < n; i++) {
        memcpy(buf + p.len, (const unsigned char *)h.buf + i * hl, hl);
        XXH128_canonical_t c;
        XXH128_canonicalFromHash(&c, XXH3_128bits(buf, (size_t)p.len + hl));
        memcpy((unsigned char *)out.buf + i * 16, c.digest, 16);
    }
    ret = PyLong_FromUnsignedLongLong(n);
done:
    PyBuffer_Release(&h);
    PyBuffer_Release(&p);
    PyBuffer_Release(&out);
    return ret;
}

/* ------------------------------------------------------------------ lookups */

typedef struct {
    uint64_t idx, ctl, payload, lenword;
} Found;

/* Find `key` (published, of namespace ns) lock-free.  1 found, 0 not. */
static int
find_published(Mapping *m, const Table *t, uint64_t lo, uint64_t hi, uint64_t ns, Found *f)
{
    uint64_t mask = t->nslots - 1, i = lo & mask;
    for (uint64_t probes = 0; probes < t->nslots; probes++, i = (i + 1) & mask) {
        uint64_t e = ent(t, i);
        for (int tries = 0; tries < SEQ_RETRIES; tries++) {
            meta_inval(m, e, CXLKV_HASH_ENTRY_SIZE);
            uint64_t c1 = pool_load64(m, e + E_CTL);
            if (ST(c1) == CXLKV_KV_EMPTY)
                return 0;
            uint64_t klo = pool_load64(m, e + E_KEY_LO), khi = pool_load64(m, e + E_KEY_HI);
            uint64_t pay = pool_load64(m, e + E_PAYLOAD), lw = pool_load64(m, e + E_LEN);
            __atomic_thread_fence(__ATOMIC_ACQUIRE);
            uint64_t c2 = pool_load64(m, e + E_CTL);
            if (c1 != c2)
                continue;                   /* changed under us: read it again */
            if (klo == lo && khi == hi && ST(c1) == CXLKV_KV_PUBLISHED &&
                ((lw >> 32) & 0xffff) == ns) {
                f->idx = i;
                f->ctl = c1;
                f->payload = pay;
                f->lenword = lw;
                return 1;
            }
            break;                          /* not this one: next slot */
        }
    }
    return 0;
}

/* kv_lookup(table_off, nslots, ns, keys, out_idx, out_ctl, out_payload, out_len, stop_at_miss)
 * -> found.  With stop_at_miss, stops at the first key not found (prefix
 * match: the count is the number of leading blocks present); otherwise
 * missing keys get out_ctl 0.  Outputs are uint64 buffers of >= n items. */
PyObject *
Mapping_kv_lookup(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    Table t;
    uint64_t ns;
    if (nargs_check(nargs, 9, 9, "kv_lookup") < 0 || table_args(m, args[0], args[1], &t) < 0 ||
        as_u64(args[2], &ns, "ns") < 0)
        return NULL;
    int stop = PyObject_IsTrue(args[8]);
    if (stop < 0)
        return NULL;
    Py_buffer k, o[4];
    int got = 0;
    PyObject *ret = NULL;
    if (get_bytes(args[3], &k, 16, "kv_lookup keys") < 0)
        return NULL;
    for (; got < 4; got++)
        if (get_offsets(args[4 + got], &o[got], 1) < 0)
            goto done;
    uint64_t n = (uint64_t)k.len / 16;
    for (int j = 0; j < 4; j++)
        if ((uint64_t)o[j].len / 8 < n) {
            PyErr_SetString(PyExc_ValueError, "kv_lookup: output buffer too small");
            goto done;
        }
    uint64_t *oi = o[0].buf, *oc = o[1].buf, *op = o[2].buf, *ol = o[3].buf, hits = 0;
    const unsigned char *kb = k.buf;
    m->busy++;
    Py_BEGIN_ALLOW_THREADS
    for (uint64_t i = 0; i < n; i++) {
        uint64_t lo, hi;
        Found f;
        key_words(kb + i * 16, &lo, &hi);
        if (find_published(m, &t, lo, hi, ns, &f)) {
            oi[i] = f.idx;
            oc[i] = f.ctl;
            op[i] = f.payload;
            ol[i] = f.lenword & 0xffffffffu;
            hits++;
        } else {
            oc[i] = 0;
            if (stop)
                break;
        }
    }
    Py_END_ALLOW_THREADS
    m->busy--;
    ret = PyLong_FromUnsignedLongLong(hits);
done:
    PyBuffer_Release(&k);
    for (int j = 0; j < got; j++)
        PyBuffer_Release(&o[j]);
    return ret;
}

/* ------------------------------------------------------------------ writes (pool lock held) */

static void
set_children(Mapping *m, const Table *t, uint64_t idx, int64_t delta)
{
    uint64_t e = ent(t, idx);
    meta_inval(m, e, CXLKV_HASH_ENTRY_SIZE);
    uint64_t w = pool_load64(m, e + E_PARENT);
    uint64_t ch = w >> 32;
    if (delta < 0 && ch == 0)
        return;                      /* never below zero (recovery recounts) */
    ch = (uint64_t)((int64_t)ch + delta) & 0xffffffffu;
    pool_store64(m, e + E_PARENT, (w & 0xffffffffu) | ch << 32);
    meta_flush(m, e, CXLKV_HASH_ENTRY_SIZE);
}

/* kv_insert(table_off, nslots, hdr_off, max_used, ns, tenant, length, owner, keys,
 *           parent, payloads, out_idx, out_status) -> (processed, used_payloads, full)
 * For each key in order: if an entry with the key exists (any state but
 * EMPTY/TOMBSTONE) its status is 1 (present); otherwise a PENDING entry is
 * written with the next unused payload (status 0).  `parent` is the entry
 * index + 1 of the block before the first key (0: the first key is block 0);
 * each block's parent is the one before it.  Stops early when the payloads run
 * out (more absent blocks than expected), when the table holds max_used live
 * entries (full = 1), at a block another node is still storing (full = 2:
 * nothing may be chained under it), when the key's probe path has no
 * tombstone and taking its EMPTY slot would leave none (full = 3), or before
 * writing an entry once the mapping's write deadline has passed (full = 4:
 * this node was stalled and may have been fenced; it proves itself fresh -
 * Attachment.guard - and resumes). */
PyObject *
Mapping_kv_insert(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    Table t;
    uint64_t hdr, max_used, ns, tenant, length, owner, parent;
    if (nargs_check(nargs, 13, 13, "kv_insert") < 0 || table_args(m, args[0], args[1], &t) < 0 ||
        as_u64(args[2], &hdr, "hdr") < 0 || as_u64(args[3], &max_used, "max_used") < 0 ||
        as_u64(args[4], &ns, "ns") < 0 || as_u64(args[5], &tenant, "tenant") < 0 ||
        as_u64(args[6], &length, "length") < 0 || as_u64(args[7], &owner, "owner") < 0 ||
        as_u64(args[9], &parent, "parent") < 0 || check_writable(m, "kv_insert") < 0 ||
        check_range(m, hdr, CXLKV_KV_HDR_SIZE, "kv header") < 0)
        return NULL;
    if (ns > 0xffff || tenant > 0xffff || length > 0xffffffffu || parent > t.nslots) {
        PyErr_SetString(PyExc_ValueError, "kv_insert: ns, tenant, length or parent out of range");
        return NULL;
    }
    Py_buffer k, pay, oi, os;
    if (get_bytes(args[8], &k, 16, "kv_insert keys") < 0)
        return NULL;
    PyObject *ret = NULL;
    int g = 0, lr = 0;
    if (get_offsets(args[10], &pay, 0) < 0)
        goto done;
    g = 1;
    if (get_offsets(args[11], &oi, 1) < 0)
        goto done;
    g = 2;
    if (get_offsets(args[12], &os, 1) < 0)
        goto done;
    g = 3;
    uint64_t n = (uint64_t)k.len / 16, npay = (uint64_t)pay.len / 8;
    if ((uint64_t)oi.len / 8 < n || (uint64_t)os.len / 8 < n) {
        PyErr_SetString(PyExc_ValueError, "kv_insert: output buffer too small");
        goto done;
    }
    const uint64_t *pv = pay.buf;
    uint64_t *idx_out = oi.buf, *st_out = os.buf, used = 0, i = 0, full = 0;
    lr = lru_on(m, t.base, t.nslots);
    if (lr && lru_begin(m) < 0) {
        lr = 0;
        goto done;
    }
    uint64_t mask = t.nslots - 1;
    meta_inval(m, hdr + H_LIVE, 16);
    uint64_t live = pool_load64(m, hdr + H_LIVE), tomb = pool_load64(m, hdr + H_TOMB);
    for (; i < n; i++) {
        uint64_t lo, hi, j = 0, found = UINT64_MAX, first_tomb = UINT64_MAX, empty = UINT64_MAX;
        key_words((const unsigned char *)k.buf + i * 16, &lo, &hi);
        uint64_t s = lo & mask;
        for (uint64_t probes = 0; probes < t.nslots; probes++, s = (s + 1) & mask) {
            uint64_t e = ent(&t, s);
            meta_inval(m, e, CXLKV_HASH_ENTRY_SIZE);
            uint64_t c = pool_load64(m, e + E_CTL);
            if (ST(c) == CXLKV_KV_EMPTY) {
                empty = s;
                break;
            }
            if (ST(c) == CXLKV_KV_TOMBSTONE) {
                if (first_tomb == UINT64_MAX)
                    first_tomb = s;
                continue;
            }
            if (pool_load64(m, e + E_KEY_LO) == lo && pool_load64(m, e + E_KEY_HI) == hi) {
                found = s;
                break;
            }
        }
        if (found != UINT64_MAX) {
            uint64_t e = ent(&t, found), c = pool_load64(m, e + E_CTL);
            if (ST(c) != CXLKV_KV_PUBLISHED && pool_load64(m, e + E_OWNER) != owner) {
                /* another node's block in flight: what follows it cannot be
                 * chained under it (it may yet be abandoned) */
                full = 2;
                break;
            }
            idx_out[i] = found;
            st_out[i] = 1;
            parent = found + 1;
            continue;
        }
        if (used >= npay)
            break;                               /* caller allocates more and resumes */
        if (live + 1 > max_used) {
            full = 1;
            break;
        }
        if (first_tomb != UINT64_MAX) {
            j = first_tomb;
        } else if (empty != UINT64_MAX && live + tomb + 2 <= t.nslots) {
            j = empty;                           /* one EMPTY slot always stays */
        } else {
            full = 3;                            /* tombstones fill the rest */
            break;
        }
        if (write_deadline_passed(m)) {
            full = 4;                            /* stalled: the caller proves freshness */
            break;
        }
        uint64_t p = pv[used];
        if (p == 0 || check_range(m, p, length, "kv_insert payload") < 0)
            goto done;
        uint64_t e = ent(&t, j), c = pool_load64(m, e + E_CTL);
        int was_tomb = ST(c) == CXLKV_KV_TOMBSTONE;
        uint64_t v = VER(c) + 1;
        /* the owner first, with the WRITING state in the same line write-back:
         * a recovery then removes only its own node's half-written entries,
         * never a fenced (stalled) writer's still in flight */
        pool_store64(m, e + E_OWNER, owner);
        pool_store64(m, e + E_CTL, CTL(CXLKV_KV_WRITING, v));
        meta_flush(m, e, CXLKV_HASH_ENTRY_SIZE);
        __atomic_thread_fence(__ATOMIC_RELEASE);
        pool_store64(m, e + E_KEY_LO, lo);
        pool_store64(m, e + E_KEY_HI, hi);
        pool_store64(m, e + E_PAYLOAD, p);
        pool_store64(m, e + E_LEN, length | ns << 32 | tenant << 48);
        pool_store64(m, e + E_PARENT, parent);          /* children 0 */
        pool_store64(m, e + E_OWNER, owner);
        pool_store64(m, e + E_LRU, 0);
        __atomic_thread_fence(__ATOMIC_RELEASE);
        pool_store64(m, e + E_CTL, CTL(CXLKV_KV_PENDING, v + 1));
        meta_flush(m, e, CXLKV_HASH_ENTRY_SIZE);
        if (parent) {
            set_children(m, &t, parent - 1, 1);
            if (lr && lru_sync(m, parent - 1, LRU_SORTED) < 0)   /* no longer a leaf */
                goto done;                                /* fenced meanwhile */
        }
        live++;
        if (was_tomb)
            tomb--;
        pool_store64(m, hdr + H_LIVE, live);
        pool_store64(m, hdr + H_TOMB, tomb);
        meta_flush(m, hdr + H_LIVE, 16);
        cxlkv_crashpoint("kv.insert");
        idx_out[i] = j;
        st_out[i] = 0;
        used++;
        parent = j + 1;
    }
    ret = Py_BuildValue("(KKK)", (unsigned long long)i, (unsigned long long)used,
                        (unsigned long long)full);
done:
    if (lr && lru_end(m) < 0)
        Py_CLEAR(ret);
    PyBuffer_Release(&k);
    if (g > 0)
        PyBuffer_Release(&pay);
    if (g > 1)
        PyBuffer_Release(&oi);
    if (g > 2)
        PyBuffer_Release(&os);
    return ret;
}

/* ------------------------------------------------------------------ usage records (pool lock held) */

#define NS_BLOCKS   offsetof(struct cxlkv_kv_ns, blocks)
#define T_STATE     offsetof(struct cxlkv_kv_tenant, state)     /* state | reserved0 << 32 */
#define T_QUOTA     offsetof(struct cxlkv_kv_tenant, quota)
#define T_USED      offsetof(struct cxlkv_kv_tenant, used)
#define T_BLOCKS    offsetof(struct cxlkv_kv_tenant, blocks)

/* The tenant records: `max` records of CXLKV_KV_TENANT_SIZE at `off`. */
static int
tenant_args(Mapping *m, uint64_t off, uint64_t max, const char *name)
{
    if (max == 0 || max > 0x10000 || (off & 63)) {
        PyErr_Format(PyExc_ValueError, "%s: invalid tenant records geometry", name);
        return -1;
    }
    return check_range(m, off, max * CXLKV_KV_TENANT_SIZE, name);
}

/* kv_usage(tenants_off, max_tenants, tenant) -> (used, quota, tenant_used)
 * One pass over the tenant records (the store path's room check, pool lock
 * held): the payload bytes held by every ACTIVE tenant, and the quota and
 * bytes used of record `tenant`.  Invalidates the records first when
 * flush_meta is on. */
PyObject *
Mapping_kv_usage(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t off, max, t;
    if (nargs_check(nargs, 3, 3, "kv_usage") < 0 || check_open(m) < 0 ||
        as_u64(args[0], &off, "tenant records offset") < 0 ||
        as_u64(args[1], &max, "max_tenants") < 0 || as_u64(args[2], &t, "tenant") < 0 ||
        tenant_args(m, off, max, "kv_usage") < 0)
        return NULL;
    if (t >= max) {
        PyErr_Format(PyExc_ValueError, "kv_usage: tenant %llu out of range (%llu records)",
                     (unsigned long long)t, (unsigned long long)max);
        return NULL;
    }
    meta_inval(m, off, max * CXLKV_KV_TENANT_SIZE);
    uint64_t used = 0;
    for (uint64_t i = 0; i < max; i++) {
        uint64_t r = off + i * CXLKV_KV_TENANT_SIZE;
        if ((pool_load64(m, r + T_STATE) & 0xffffffffu) == CXLKV_KV_REC_ACTIVE)
            used += pool_load64(m, r + T_USED);
    }
    uint64_t r = off + t * CXLKV_KV_TENANT_SIZE;
    return Py_BuildValue("(KKK)", (unsigned long long)used,
                         (unsigned long long)pool_load64(m, r + T_QUOTA),
                         (unsigned long long)pool_load64(m, r + T_USED));
}

/* kv_account(ns_off, tenant_off, blocks, nbytes): add `blocks` to the
 * namespace record's and the tenant record's block counts and `nbytes` to
 * the tenant's bytes used (newly reserved entries; pool lock held).  Each
 * record must be a whole, aligned record of the mapping; the lines are
 * invalidated before and flushed after when flush_meta is on. */
PyObject *
Mapping_kv_account(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t ns_off, t_off, blocks, nbytes;
    if (nargs_check(nargs, 4, 4, "kv_account") < 0 || check_open(m) < 0 ||
        as_u64(args[0], &ns_off, "namespace record offset") < 0 ||
        as_u64(args[1], &t_off, "tenant record offset") < 0 ||
        as_u64(args[2], &blocks, "blocks") < 0 || as_u64(args[3], &nbytes, "nbytes") < 0)
        return NULL;
    if ((ns_off & 63) || (t_off & 63)) {
        PyErr_SetString(PyExc_ValueError, "kv_account: record offsets must be 64-byte aligned");
        return NULL;
    }
    if (check_range(m, ns_off, CXLKV_KV_NS_SIZE, "kv_account namespace record") < 0 ||
        check_range(m, t_off, CXLKV_KV_TENANT_SIZE, "kv_account tenant record") < 0 ||
        check_writable(m, "kv_account") < 0)
        return NULL;
    meta_inval(m, ns_off + NS_BLOCKS, 8);
    meta_inval(m, t_off, CXLKV_KV_TENANT_SIZE);
    pool_store64(m, ns_off + NS_BLOCKS, pool_load64(m, ns_off + NS_BLOCKS) + blocks);
    pool_store64(m, t_off + T_BLOCKS, pool_load64(m, t_off + T_BLOCKS) + blocks);
    pool_store64(m, t_off + T_USED, pool_load64(m, t_off + T_USED) + nbytes);
    meta_flush(m, ns_off + NS_BLOCKS, 8);
    meta_flush(m, t_off, CXLKV_KV_TENANT_SIZE);
    Py_RETURN_NONE;
}

/* kv_set_state(table_off, nslots, idx, from_state, to_state, owner, stamp, new_owner=0)
 *   -> changed
 * For each entry index: if its state is from_state (and, when owner != 0,
 * its owner is `owner`), move it to to_state with a new version; with
 * stamp != 0 also set its LRU stamp; with new_owner != 0 also its owner (an
 * evictor records itself, so that only its own recovery finishes its
 * eviction).  Used to publish (PENDING -> PUBLISHED), to start evicting
 * (PUBLISHED -> EVICTING) and to undo that. */
PyObject *
Mapping_kv_set_state(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    Table t;
    uint64_t from, to, owner, stamp, new_owner = 0;
    if (nargs_check(nargs, 7, 8, "kv_set_state") < 0 || table_args(m, args[0], args[1], &t) < 0 ||
        as_u64(args[3], &from, "from_state") < 0 || as_u64(args[4], &to, "to_state") < 0 ||
        as_u64(args[5], &owner, "owner") < 0 || as_u64(args[6], &stamp, "stamp") < 0 ||
        (nargs > 7 && as_u64(args[7], &new_owner, "new_owner") < 0) ||
        check_writable(m, "kv_set_state") < 0)
        return NULL;
    if (from > CXLKV_KV_TOMBSTONE || to > CXLKV_KV_TOMBSTONE) {
        PyErr_SetString(PyExc_ValueError, "kv_set_state: unknown state");
        return NULL;
    }
    Py_buffer b;
    if (get_offsets(args[2], &b, 0) < 0)
        return NULL;
    const uint64_t *ix = b.buf;
    uint64_t n = (uint64_t)b.len / 8, changed = 0;
    int lr = lru_on(m, t.base, t.nslots);
    if (lr && lru_begin(m) < 0) {
        PyBuffer_Release(&b);
        return NULL;
    }
    for (uint64_t i = 0; i < n; i++) {
        if (ix[i] >= t.nslots) {
            PyErr_Format(PyExc_ValueError, "kv_set_state: entry %llu out of range",
                         (unsigned long long)ix[i]);
            if (lr)
                lru_end(m);
            PyBuffer_Release(&b);
            return NULL;
        }
        /* a node stalled past its write deadline proves itself fresh before
         * each entry (its guard beats, or raises NodeFenced): resumed after
         * it was fenced, it must not go on marking entries that another
         * node's recovery and stores have dealt with meanwhile */
        cxlkv_crashpoint("kv.state.next");
        if (write_deadline_passed(m) && check_writable(m, "kv_set_state") < 0) {
            if (lr)
                lru_end(m);                               /* exception set: no write */
            PyBuffer_Release(&b);
            return NULL;
        }
        uint64_t e = ent(&t, ix[i]);
        meta_inval(m, e, CXLKV_HASH_ENTRY_SIZE);
        uint64_t c = pool_load64(m, e + E_CTL);
        if (ST(c) != from || (owner && pool_load64(m, e + E_OWNER) != owner))
            continue;
        if (stamp)
            pool_store64(m, e + E_LRU, stamp);
        if (new_owner)
            pool_store64(m, e + E_OWNER, new_owner);
        __atomic_thread_fence(__ATOMIC_RELEASE);
        pool_store64(m, e + E_CTL, CTL(to, VER(c) + 1));
        meta_flush(m, e, CXLKV_HASH_ENTRY_SIZE);
        if (lr && lru_sync(m, ix[i], stamp ? LRU_TAIL : LRU_SORTED) < 0) {
            lru_end(m);                                   /* fenced meanwhile */
            PyBuffer_Release(&b);
            return NULL;
        }
        changed++;
    }
    __atomic_thread_fence(__ATOMIC_SEQ_CST);   /* evict: the state change before the pin scan */
    PyBuffer_Release(&b);
    if (lr && lru_end(m) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(changed);
}

/* kv_stamp(table_off, nslots, idx, stamp) -> stamped
 * Set the LRU stamp of published entries (the evictor applying the nodes'
 * touch rings; pool lock held).  The line is invalidated first, so a stale
 * copy of it is never written back. */
PyObject *
Mapping_kv_stamp(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    Table t;
    uint64_t stamp;
    if (nargs_check(nargs, 4, 4, "kv_stamp") < 0 || table_args(m, args[0], args[1], &t) < 0 ||
        as_u64(args[3], &stamp, "stamp") < 0 || check_writable(m, "kv_stamp") < 0)
        return NULL;
    Py_buffer b;
    if (get_offsets(args[2], &b, 0) < 0)
        return NULL;
    const uint64_t *ix = b.buf;
    uint64_t n = (uint64_t)b.len / 8, done = 0;
    int lr = lru_on(m, t.base, t.nslots);
    if (lr && lru_begin(m) < 0) {
        PyBuffer_Release(&b);
        return NULL;
    }
    for (uint64_t i = 0; i < n; i++) {
        if (ix[i] >= t.nslots)
            continue;
        if (write_deadline_passed(m) && check_writable(m, "kv_stamp") < 0) {
            if (lr)                                       /* as in kv_set_state */
                lru_end(m);
            PyBuffer_Release(&b);
            return NULL;
        }
        uint64_t e = ent(&t, ix[i]);
        meta_inval(m, e, CXLKV_HASH_ENTRY_SIZE);
        if (ST(pool_load64(m, e + E_CTL)) != CXLKV_KV_PUBLISHED)
            continue;
        pool_store64(m, e + E_LRU, stamp);
        meta_flush(m, e, CXLKV_HASH_ENTRY_SIZE);
        if (lr && lru_sync(m, ix[i], LRU_RESTAMP) < 0) {   /* a leaf moves to its place */
            lru_end(m);
            PyBuffer_Release(&b);
            return NULL;
        }
        done++;
    }
    PyBuffer_Release(&b);
    if (lr && lru_end(m) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(done);
}

/* kv_in_flight(table_off, nslots, out) -> found
 * Indices of the entries a writer or evictor left part way (WRITING,
 * PENDING, EVICTING): what recovery of a node must look at.  One pass over
 * the ctl words, no copy of the table; the first len(out) indices go to out
 * (a uint64 buffer), the return value counts all of them (call again with a
 * larger out when it is bigger). */
PyObject *
Mapping_kv_in_flight(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    Table t;
    if (nargs_check(nargs, 3, 3, "kv_in_flight") < 0 || table_args(m, args[0], args[1], &t) < 0)
        return NULL;
    Py_buffer b;
    if (get_offsets(args[2], &b, 1) < 0)
        return NULL;
    uint64_t *out = b.buf, cap = (uint64_t)b.len / 8, found = 0;
    for (uint64_t i = 0; i < t.nslots; i++) {
        uint64_t e = ent(&t, i);
        meta_inval(m, e, 8);
        uint64_t st = ST(pool_load64(m, e + E_CTL));
        if (st == CXLKV_KV_WRITING || st == CXLKV_KV_PENDING || st == CXLKV_KV_EVICTING) {
            if (found < cap)
                out[found] = i;
            found++;
        }
    }
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLongLong(found);
}

/* kv_remove(table_off, nslots, hdr_off, idx) -> parent index + 1 (0 = none)
 * Delete an entry (any live state): it becomes a TOMBSTONE, or EMPTY when the
 * slot after it is EMPTY (then the tombstones just before it become EMPTY
 * too: no chain runs through them).  The parent's child count drops. */
PyObject *
Mapping_kv_remove(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    Table t;
    uint64_t hdr, idx, parent;
    if (nargs_check(nargs, 4, 4, "kv_remove") < 0 || table_args(m, args[0], args[1], &t) < 0 ||
        as_u64(args[2], &hdr, "hdr") < 0 || as_u64(args[3], &idx, "idx") < 0 ||
        check_writable(m, "kv_remove") < 0 ||
        check_range(m, hdr, CXLKV_KV_HDR_SIZE, "kv header") < 0)
        return NULL;
    if (idx >= t.nslots) {
        PyErr_SetString(PyExc_ValueError, "kv_remove: entry out of range");
        return NULL;
    }
    if (kv_remove_at(m, t.base, t.nslots, hdr, idx, &parent) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(parent);
}

/* kv_remove's work, for callers that checked the table (table_args), the
 * header range and idx < nslots.  *parent_out: parent index + 1 (0 = none).
 * 0, or -1 with an exception set. */
int
kv_remove_at(Mapping *m, uint64_t table, uint64_t nslots, uint64_t hdr, uint64_t idx,
             uint64_t *parent_out)
{
    Table t = {table, nslots};
    uint64_t mask = t.nslots - 1, e = ent(&t, idx);
    *parent_out = 0;
    meta_inval(m, e, CXLKV_HASH_ENTRY_SIZE);
    uint64_t c = pool_load64(m, e + E_CTL);
    if (ST(c) == CXLKV_KV_EMPTY || ST(c) == CXLKV_KV_TOMBSTONE)
        return 0;
    uint64_t parent = pool_load64(m, e + E_PARENT) & 0xffffffffu;
    uint64_t used = pool_load64(m, e + E_LRU);
    int lr = lru_on(m, t.base, t.nslots);
    if (lr && lru_begin(m) < 0)
        return -1;
    meta_inval(m, hdr + H_LIVE, 16);
    uint64_t live = pool_load64(m, hdr + H_LIVE), tomb = pool_load64(m, hdr + H_TOMB);
    uint64_t next = ent(&t, (idx + 1) & mask);
    meta_inval(m, next, 8);
    if (ST(pool_load64(m, next + E_CTL)) == CXLKV_KV_EMPTY) {
        pool_store64(m, e + E_CTL, CTL(CXLKV_KV_EMPTY, VER(c) + 1));
        meta_flush(m, e, 8);
        uint64_t j = (idx - 1) & mask;
        for (uint64_t k = 0; k + 1 < t.nslots; k++, j = (j - 1) & mask) {
            uint64_t ej = ent(&t, j);
            meta_inval(m, ej, 8);
            uint64_t cj = pool_load64(m, ej + E_CTL);
            if (ST(cj) != CXLKV_KV_TOMBSTONE)
                break;
            pool_store64(m, ej + E_CTL, CTL(CXLKV_KV_EMPTY, VER(cj) + 1));
            meta_flush(m, ej, 8);
            if (tomb)
                tomb--;
        }
    } else {
        pool_store64(m, e + E_CTL, CTL(CXLKV_KV_TOMBSTONE, VER(c) + 1));
        meta_flush(m, e, 8);
        tomb++;
    }
    if (live)
        live--;
    pool_store64(m, hdr + H_LIVE, live);
    pool_store64(m, hdr + H_TOMB, tomb);
    meta_flush(m, hdr + H_LIVE, 16);
    if (lr && lru_sync(m, idx, LRU_SORTED) < 0) {       /* off its list */
        lru_end(m);
        return -1;
    }
    if (parent && parent <= t.nslots) {
        set_children(m, &t, parent - 1, -1);
        if (lr) {
            /* the parent's stamp is its subtree's newest use: if it became a
             * leaf it is placed by that */
            uint64_t pe = ent(&t, parent - 1);
            meta_inval(m, pe, CXLKV_HASH_ENTRY_SIZE);
            if (pool_load64(m, pe + E_LRU) < used) {
                pool_store64(m, pe + E_LRU, used);
                meta_flush(m, pe, CXLKV_HASH_ENTRY_SIZE);
            }
            if (lru_sync(m, parent - 1, LRU_SORTED) < 0) {
                lru_end(m);
                return -1;
            }
        }
    }
    if (lr && lru_end(m) < 0)
        return -1;
    *parent_out = parent <= t.nslots ? parent : 0;
    return 0;
}

/* ------------------------------------------------------------------ pins and touches (node-owned) */

/* kv_pin(table_off, nslots, pins_off, npins, hint, idx, ctl, out_pin) -> (pinned, hint, table_full)
 * Pin entries in order: write idx + 1 into a free pin record of this node,
 * fence, then re-read the entry: if its ctl is no longer the one the lookup
 * saw (being evicted, or replaced) the pin is dropped and pinning stops.
 * The evictor does the mirror image (state change, fence, pin scan), so
 * either the reader sees the change or the evictor sees the pin. */
PyObject *
Mapping_kv_pin(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    Table t;
    uint64_t pins, npins, hint;
    if (nargs_check(nargs, 8, 8, "kv_pin") < 0 || table_args(m, args[0], args[1], &t) < 0 ||
        as_u64(args[2], &pins, "pins_off") < 0 || as_u64(args[3], &npins, "npins") < 0 ||
        as_u64(args[4], &hint, "hint") < 0 || check_writable(m, "kv_pin") < 0)
        return NULL;
    if (npins == 0 || npins > (1u << 24) || check_range(m, pins, npins * 8, "kv pins") < 0)
        return NULL;
    Py_buffer bi, bc, bo;
    if (get_offsets(args[5], &bi, 0) < 0)
        return NULL;
    if (get_offsets(args[6], &bc, 0) < 0) {
        PyBuffer_Release(&bi);
        return NULL;
    }
    if (get_offsets(args[7], &bo, 1) < 0) {
        PyBuffer_Release(&bi);
        PyBuffer_Release(&bc);
        return NULL;
    }
    PyObject *ret = NULL;
    uint64_t n = (uint64_t)bi.len / 8, i = 0, full = 0;
    if ((uint64_t)bc.len / 8 < n || (uint64_t)bo.len / 8 < n) {
        PyErr_SetString(PyExc_ValueError, "kv_pin: buffers differ in length");
        goto done;
    }
    const uint64_t *ix = bi.buf, *cv = bc.buf;
    uint64_t *po = bo.buf;
    hint %= npins;
    for (; i < n; i++) {
        /* a node stalled past its write deadline proves itself fresh before
         * each pin: resumed after its quarantine ended, these records may
         * be the pins of the node that took its slot over */
        cxlkv_crashpoint("kv.pin.next");
        if (write_deadline_passed(m) && check_writable(m, "kv_pin") < 0)
            goto done;
        if (ix[i] >= t.nslots) {
            PyErr_SetString(PyExc_ValueError, "kv_pin: entry out of range");
            goto done;
        }
        uint64_t r = UINT64_MAX;
        for (uint64_t k = 0; k < npins; k++) {
            uint64_t cand = (hint + k) % npins;
            if (pool_load64(m, pins + cand * 8) == 0) {
                r = cand;
                break;
            }
        }
        if (r == UINT64_MAX) {
            full = 1;
            break;
        }
        pool_store64(m, pins + r * 8, ix[i] + 1);
        meta_flush(m, pins + r * 8, 8);
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        uint64_t e = ent(&t, ix[i]);
        meta_inval(m, e, 8);
        if (pool_load64(m, e + E_CTL) != cv[i]) {
            pool_store64(m, pins + r * 8, 0);
            meta_flush(m, pins + r * 8, 8);
            break;
        }
        po[i] = r;
        hint = (r + 1) % npins;
    }
    ret = Py_BuildValue("(KKK)", (unsigned long long)i, (unsigned long long)hint,
                        (unsigned long long)full);
done:
    PyBuffer_Release(&bi);
    PyBuffer_Release(&bc);
    PyBuffer_Release(&bo);
    return ret;
}

/* kv_unpin(pins_off, npins, records) -> cleared */
PyObject *
Mapping_kv_unpin(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t pins, npins;
    if (nargs_check(nargs, 3, 3, "kv_unpin") < 0 || check_open(m) < 0 ||
        as_u64(args[0], &pins, "pins_off") < 0 || as_u64(args[1], &npins, "npins") < 0 ||
        check_writable(m, "kv_unpin") < 0)
        return NULL;
    if (npins == 0 || npins > (1u << 24) || check_range(m, pins, npins * 8, "kv pins") < 0)
        return NULL;
    Py_buffer b;
    if (get_offsets(args[2], &b, 0) < 0)
        return NULL;
    const uint64_t *r = b.buf;
    uint64_t n = (uint64_t)b.len / 8, done = 0;
    for (uint64_t i = 0; i < n; i++) {
        if (write_deadline_passed(m) && check_writable(m, "kv_unpin") < 0) {   /* as kv_pin */
            PyBuffer_Release(&b);
            return NULL;
        }
        if (r[i] >= npins)
            continue;
        pool_store64(m, pins + r[i] * 8, 0);
        meta_flush(m, pins + r[i] * 8, 8);
        done++;
    }
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLongLong(done);
}

/* kv_touch(head_off, ring_off, nring, idx) -> new head
 * Append entry indices to this node's touch ring (an evictor applies them to
 * the entries' LRU stamps), so that readers never write shared lines. */
PyObject *
Mapping_kv_touch(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t head_off, ring, nring;
    if (nargs_check(nargs, 4, 4, "kv_touch") < 0 || check_open(m) < 0 ||
        as_u64(args[0], &head_off, "head_off") < 0 || as_u64(args[1], &ring, "ring_off") < 0 ||
        as_u64(args[2], &nring, "nring") < 0 || check_writable(m, "kv_touch") < 0 ||
        check_word(m, head_off, "kv ring head") < 0)
        return NULL;
    if (nring == 0 || nring > (1u << 24) || check_range(m, ring, nring * 8, "kv ring") < 0)
        return NULL;
    Py_buffer b;
    if (get_offsets(args[3], &b, 0) < 0)
        return NULL;
    const uint64_t *ix = b.buf;
    uint64_t n = (uint64_t)b.len / 8, head = pool_load64(m, head_off);
    uint64_t first = n > nring ? n - nring : 0;
    for (uint64_t i = first; i < n; i++) {
        /* as kv_pin: the ring may be the next holder's of this slot (every
         * 64 entries and before the head: a stale touch only moves a stamp) */
        if (!((i - first) % 64) && write_deadline_passed(m) &&
            check_writable(m, "kv_touch") < 0) {
            PyBuffer_Release(&b);
            return NULL;
        }
        uint64_t r = ring + ((head + i - first) % nring) * 8;
        pool_store64(m, r, ix[i] + 1);
    }
    if (write_deadline_passed(m) && check_writable(m, "kv_touch") < 0) {
        PyBuffer_Release(&b);
        return NULL;
    }
    if (m->flush_meta && n > first) {
        uint64_t a = (head % nring), cnt = n - first;
        if (a + cnt <= nring) {
            pool_flush(m, ring + a * 8, cnt * 8);
        } else {
            pool_flush(m, ring + a * 8, (nring - a) * 8);
            pool_flush(m, ring, (a + cnt - nring) * 8);
        }
    }
    __atomic_thread_fence(__ATOMIC_RELEASE);
    head += n - first;
    pool_store64(m, head_off, head);
    meta_flush(m, head_off, 8);
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLongLong(head);
}

/* ------------------------------------------------------------------ block copies */

/* write_blocks(offsets, src, block_bytes, nt=None) -> blocks written
 * Block i of the contiguous source goes to offsets[i]; flushed on return
 * (non-temporal stores for large blocks).  Stops before a block once the
 * mapping's write deadline has passed (the caller's node may have been
 * fenced while this thread was stalled), so fewer than len(offsets) may be
 * written: the caller proves its node fresh again and goes on from there. */
PyObject *
Mapping_write_blocks(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t bb;
    if (nargs_check(nargs, 3, 4, "write_blocks") < 0 || check_open(m) < 0 ||
        as_u64(args[2], &bb, "block_bytes") < 0 || check_writable(m, "write_blocks") < 0)
        return NULL;
    Py_buffer o, s;
    if (get_offsets(args[0], &o, 0) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[1], &s, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&o);
        return NULL;
    }
    PyObject *ret = NULL;
    uint64_t n = (uint64_t)o.len / 8;
    const uint64_t *off = o.buf;
    int nt;
    if (bb == 0 || (uint64_t)s.len != n * bb) {
        PyErr_Format(PyExc_ValueError, "write_blocks: source is %zd bytes, expected %llu x %llu",
                     s.len, (unsigned long long)n, (unsigned long long)bb);
        goto done;
    }
    if (parse_nt(m, nargs > 3 ? args[3] : NULL, bb, &nt) < 0)
        goto done;
    for (uint64_t i = 0; i < n; i++)
        if (check_range(m, off[i], bb, "write_blocks") < 0)
            goto done;
    uint64_t done = 0;
    int rc = 0;
    m->busy++;
    Py_BEGIN_ALLOW_THREADS
    for (; done < n && rc == 0 && !write_deadline_passed(m); done++)
        rc = pool_write(m, off[done], (const char *)s.buf + done * bb, bb, nt);
    Py_END_ALLOW_THREADS
    m->busy--;
    if (rc < 0) {
        PyErr_NoMemory();
        goto done;
    }
    ret = PyLong_FromUnsignedLongLong(done);
done:
    PyBuffer_Release(&o);
    PyBuffer_Release(&s);
    return ret;
}

/* read_blocks(offsets, dst, block_bytes): offsets[i] -> block i of dst.
 * With flush_meta the source lines are invalidated first (another host
 * wrote them). */
PyObject *
Mapping_read_blocks(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t bb;
    if (nargs_check(nargs, 3, 3, "read_blocks") < 0 || check_open(m) < 0 ||
        as_u64(args[2], &bb, "block_bytes") < 0)
        return NULL;
    Py_buffer o, d;
    if (get_offsets(args[0], &o, 0) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[1], &d, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&o);
        return NULL;
    }
    PyObject *ret = NULL;
    uint64_t n = (uint64_t)o.len / 8;
    const uint64_t *off = o.buf;
    if (bb == 0 || (uint64_t)d.len < n * bb) {
        PyErr_SetString(PyExc_ValueError, "read_blocks: destination too small");
        goto done;
    }
    for (uint64_t i = 0; i < n; i++)
        if (check_range(m, off[i], bb, "read_blocks") < 0)
            goto done;
    m->busy++;
    Py_BEGIN_ALLOW_THREADS
    for (uint64_t i = 0; i < n; i++) {
        meta_inval(m, off[i], bb);
        pool_read(m, off[i], (char *)d.buf + i * bb, bb);
    }
    Py_END_ALLOW_THREADS
    m->busy--;
    ret = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&o);
    PyBuffer_Release(&d);
    return ret;
}

/* gather(blocks, dst, block_bytes) -> n: item i of the sequence `blocks`, a
 * buffer of block_bytes or None, to block i of dst, with the streaming copy
 * reads out of the pool use (the DRAM hot tier's hits). */
PyObject *
mod_gather(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    uint64_t bb;
    if (nargs_check(nargs, 3, 3, "gather") < 0 || as_u64(args[2], &bb, "block_bytes") < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(args[0], "gather: blocks must be a sequence");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Py_buffer d;
    if (PyObject_GetBuffer(args[1], &d, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        Py_DECREF(seq);
        return NULL;
    }
    PyObject *ret = NULL;
    Py_buffer *b = PyMem_Calloc(n ? (size_t)n : 1, sizeof *b);
    Py_ssize_t got = 0, copied = 0;
    if (!b) {
        PyErr_NoMemory();
        goto done;
    }
    if (bb == 0 || (unsigned long long)d.len < (unsigned long long)n * bb) {
        PyErr_SetString(PyExc_ValueError, "gather: destination too small");
        goto done;
    }
    for (; got < n; got++) {
        PyObject *it = PySequence_Fast_GET_ITEM(seq, got);
        if (it == Py_None)
            continue;
        if (PyObject_GetBuffer(it, &b[got], PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        if ((unsigned long long)b[got].len != bb) {
            PyErr_Format(PyExc_ValueError, "gather: block %zd is %zd bytes, not %llu", got,
                         b[got].len, (unsigned long long)bb);
            PyBuffer_Release(&b[got]);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        if (b[i].buf) {
            cxlkv_copy_from_pool((char *)d.buf + (size_t)i * bb, b[i].buf, (size_t)bb);
            copied++;
        }
    Py_END_ALLOW_THREADS
    ret = PyLong_FromSsize_t(copied);
done:
    if (b) {
        for (Py_ssize_t i = 0; i < got; i++)
            if (b[i].buf)
                PyBuffer_Release(&b[i]);
        PyMem_Free(b);
    }
    PyBuffer_Release(&d);
    Py_DECREF(seq);
    return ret;
}
