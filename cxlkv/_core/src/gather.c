/*
 * Gather / scatter between KV blocks and an engine's own layout, and the
 * copy modes of the pool's bulk copies.
 *
 * kv_copy(blocks, block_bytes, src_offset, buf, offsets, shape, src_strides,
 *         buf_strides, run, to_blocks=False) -> bytes copied
 *
 * Each block (a buffer of exactly block_bytes: a pinned pool view, a hot-tier
 * copy, a staging block) is walked as the same strided array: `shape` (up to
 * CXLKV_GATHER_MAXDIM dims) with byte strides `src_strides` inside the block
 * and `buf_strides` in `buf`, `run` contiguous bytes at each point, starting
 * src_offset bytes into every block (a layer of the block).  Block i's
 * origin lies at byte offsets[i] (int64) from buf's first element; that is
 * how a block table (vLLM's paged KV) or a token position (a transformers
 * layer tensor) is expressed.  to_blocks=False copies blocks -> buf (a load),
 * True buf -> blocks (a store into staging blocks).
 *
 * Bounds, both sides, before any pointer is formed: every block buffer is
 * exactly block_bytes and the strided walk stays inside [0, block_bytes);
 * every block's walk in buf stays inside the extent buf's exporter describes
 * (its shape, strides and itemsize: a numpy or torch view may be strided).
 * All products and sums are overflow-checked.  The copy runs with the GIL
 * released, holding every buffer.
 *
 * Copy modes (process-wide, set from Python: cxlkv._core.copymode):
 *   read   plain | nt     copies out of the pool (read, readinto, read_blocks,
 *                         gather, kv_copy loads): plain stores, or
 *                         non-temporal stores into the destination (no
 *                         read-for-ownership; the data is not left in cache)
 *   write  nt | clwb      copies into the pool: non-temporal stores, or
 *                         regular stores then a clwb/clflushopt write-back
 * Both leave written pool lines in memory, as the publish protocol needs.
 * Guarded by nothing: set once at import or calibration (GIL held), read with
 * relaxed loads by copies that may run without the GIL.
 */
#include "core.h"

#include <string.h>

#define CXLKV_GATHER_MAXDIM 8

int cxlkv_read_nt = 1;      /* read mode: 1 nt (the historical default), 0 plain */
int cxlkv_write_clwb = 0;   /* write mode: 0 nt, 1 regular stores + write-back */

#if defined(__x86_64__)
__attribute__((target("avx2")))
static void
stream_avx2(char *dst, const char *src, size_t n)
{
    /* dst 32-byte aligned, n a multiple of 32 */
    for (; n >= 128; n -= 128, src += 128, dst += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)src);
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + 64));
        __m256i d = _mm256_loadu_si256((const __m256i *)(src + 96));
        _mm256_stream_si256((__m256i *)dst, a);
        _mm256_stream_si256((__m256i *)(dst + 32), b);
        _mm256_stream_si256((__m256i *)(dst + 64), c);
        _mm256_stream_si256((__m256i *)(dst + 96), d);
    }
    for (; n; n -= 32, src += 32, dst += 32)
        _mm256_stream_si256((__m256i *)dst, _mm256_loadu_si256((const __m256i *)src));
}

static void
stream_sse2(char *dst, const char *src, size_t n)
{
    /* dst 16-byte aligned, n a multiple of 16 */
    for (; n; n -= 16, src += 16, dst += 16)
        _mm_stream_si128((__m128i *)dst, _mm_loadu_si128((const __m128i *)src));
}
#endif

/* One run: streaming stores for the aligned body when nt, else memcpy. */
static inline void
copy_run(char *dst, const char *src, size_t n, int nt)
{
#if defined(__x86_64__)
    if (nt && n >= 256) {
        size_t h = (size_t)((32 - ((uintptr_t)dst & 31)) & 31);
        if (h)
            memcpy(dst, src, h);
        size_t body = (n - h) & ~(size_t)31;
        if (cxlkv_cpu.has_avx2)
            stream_avx2(dst + h, src + h, body);
        else
            stream_sse2(dst + h, src + h, body);
        if (n - h - body)
            memcpy(dst + h + body, src + h + body, n - h - body);
        return;
    }
#endif
    (void)nt;
    memcpy(dst, src, n);
}

struct walk {
    int ndim;
    Py_ssize_t shape[CXLKV_GATHER_MAXDIM];
    int64_t sst[CXLKV_GATHER_MAXDIM], dst[CXLKV_GATHER_MAXDIM];
    size_t run;
};

/* The next point of a walk (odometer order, last dimension fastest): the
 * byte offsets in the block (*so) and in buf (*bo); 0 once the walk is done. */
static inline int
walk_next(const struct walk *w, Py_ssize_t *idx, int64_t *so, int64_t *bo)
{
    for (int d = w->ndim - 1; d >= 0; d--) {
        *so += w->sst[d];
        *bo += w->dst[d];
        if (++idx[d] < w->shape[d])
            return 1;
        *so -= w->sst[d] * w->shape[d];
        *bo -= w->dst[d] * w->shape[d];
        idx[d] = 0;
    }
    return 0;
}

/* Copy one block's strided walk; `to_blocks` swaps the direction. */
static void
walk_copy(const struct walk *w, char *blk, char *buf, int to_blocks, int nt)
{
    Py_ssize_t idx[CXLKV_GATHER_MAXDIM] = {0};
    if (w->ndim == 0) {
        if (to_blocks)
            memcpy(blk, buf, w->run);
        else
            copy_run(buf, blk, w->run, nt);
        return;
    }
    int64_t so = 0, bo = 0;
    for (;;) {
        if (to_blocks)
            memcpy(blk + so, buf + bo, w->run);
        else
            copy_run(buf + bo, blk + so, w->run, nt);
        if (!walk_next(w, idx, &so, &bo))
            return;
    }
}

/* Merge dims that are contiguous on both sides, innermost into the run. */
static void
walk_simplify(struct walk *w)
{
    /* drop dims of extent 1 */
    int k = 0;
    for (int i = 0; i < w->ndim; i++)
        if (w->shape[i] != 1) {
            w->shape[k] = w->shape[i];
            w->sst[k] = w->sst[i];
            w->dst[k] = w->dst[i];
            k++;
        }
    w->ndim = k;
    while (w->ndim > 0 && w->sst[w->ndim - 1] == (int64_t)w->run &&
           w->dst[w->ndim - 1] == (int64_t)w->run) {
        w->run *= (size_t)w->shape[w->ndim - 1];
        w->ndim--;
    }
    for (int i = w->ndim - 2; i >= 0; i--) {
        if (w->sst[i] == w->sst[i + 1] * w->shape[i + 1] &&
            w->dst[i] == w->dst[i + 1] * w->shape[i + 1]) {
            w->shape[i] *= w->shape[i + 1];
            w->sst[i] = w->sst[i + 1];
            w->dst[i] = w->dst[i + 1];
            for (int j = i + 1; j < w->ndim - 1; j++) {
                w->shape[j] = w->shape[j + 1];
                w->sst[j] = w->sst[j + 1];
                w->dst[j] = w->dst[j + 1];
            }
            w->ndim--;
        }
    }
}

static int
int_tuple(PyObject *o, int64_t *out, int *n, const char *what)
{
    PyObject *seq = PySequence_Fast(o, "kv_copy: shape and strides must be sequences of ints");
    if (!seq)
        return -1;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    if (len > CXLKV_GATHER_MAXDIM) {
        PyErr_Format(PyExc_ValueError, "kv_copy: %s has %zd dims (at most %d)", what, len,
                     CXLKV_GATHER_MAXDIM);
        Py_DECREF(seq);
        return -1;
    }
    for (Py_ssize_t i = 0; i < len; i++) {
        long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return -1;
        }
        out[i] = v;
    }
    *n = (int)len;
    Py_DECREF(seq);
    return 0;
}

/* [lo, hi) of the walk's byte offsets relative to the origin, run included;
 * -1 (ValueError) on overflow. */
static int
walk_extent(const struct walk *w, const int64_t *st, int64_t *lo, int64_t *hi)
{
    int64_t l = 0, h = 0;
    for (int i = 0; i < w->ndim; i++) {
        int64_t span;
        if (__builtin_mul_overflow((int64_t)(w->shape[i] - 1), st[i], &span))
            goto ovf;
        if (span < 0) {
            if (__builtin_add_overflow(l, span, &l))
                goto ovf;
        } else if (__builtin_add_overflow(h, span, &h)) {
            goto ovf;
        }
    }
    if (__builtin_add_overflow(h, (int64_t)w->run, &h))
        goto ovf;
    *lo = l;
    *hi = h;
    return 0;
ovf:
    PyErr_SetString(PyExc_ValueError, "kv_copy: shape x strides overflows 64 bits");
    return -1;
}

/* The byte extent [lo, hi) of an exporter's buffer relative to view.buf. */
static void
buffer_extent(const Py_buffer *v, int64_t *lo, int64_t *hi)
{
    int64_t l = 0, h = v->itemsize;
    if (v->len == 0) {
        *lo = *hi = 0;
        return;
    }
    if (v->strides) {
        for (int i = 0; i < v->ndim; i++) {
            int64_t span = (int64_t)(v->shape[i] - 1) * (int64_t)v->strides[i];
            if (span < 0)
                l += span;
            else
                h += span;
        }
    } else {
        h = v->len;
    }
    *lo = l;
    *hi = h;
}

/* A buffer of int64 (numpy int64), C-contiguous. */
static int
get_i64(PyObject *obj, Py_buffer *b)
{
    if (PyObject_GetBuffer(obj, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (b->itemsize != 8 || (b->format && strcmp(b->format, "q") && strcmp(b->format, "l") &&
                             strcmp(b->format, "<q") && strcmp(b->format, "=q") &&
                             strcmp(b->format, "<l") && strcmp(b->format, "=l"))) {
        PyErr_SetString(PyExc_TypeError, "kv_copy: offsets must be a buffer of int64");
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

/* The arguments kv_copy and kv_scatter share, at the same positions:
 * block_bytes (1), src_offset (2), shape / src_strides / buf_strides (5-7)
 * and run (8).  Fills the walk, checks every dimension and that the walk
 * stays inside each block ([src_offset, block_bytes)); dlo/dhi: the walk's
 * byte extent on the buffer side.  -1 with an exception set. */
static int
parse_walk(PyObject *const *args, const char *fn, struct walk *w, uint64_t *bb,
           uint64_t *soff, int *empty, int64_t *dlo, int64_t *dhi)
{
    uint64_t run;
    if (as_u64(args[1], bb, "block_bytes") < 0 || as_u64(args[2], soff, "src_offset") < 0 ||
        as_u64(args[8], &run, "run") < 0)
        return -1;
    int64_t shp[CXLKV_GATHER_MAXDIM];
    int n1, n2, n3;
    if (int_tuple(args[5], shp, &n1, "shape") < 0 ||
        int_tuple(args[6], w->sst, &n2, "src_strides") < 0 ||
        int_tuple(args[7], w->dst, &n3, "buf_strides") < 0)
        return -1;
    if (n1 != n2 || n1 != n3) {
        PyErr_Format(PyExc_ValueError, "%s: shape has %d dims, src_strides %d, "
                     "buf_strides %d", fn, n1, n2, n3);
        return -1;
    }
    if (run == 0 || *bb == 0 || run > (uint64_t)INT64_MAX || *bb > (uint64_t)INT64_MAX) {
        PyErr_Format(PyExc_ValueError, "%s: run and block_bytes must be >= 1", fn);
        return -1;
    }
    w->ndim = n1;
    w->run = (size_t)run;
    *empty = 0;
    for (int i = 0; i < n1; i++) {
        if (shp[i] < 0) {
            PyErr_Format(PyExc_ValueError, "%s: shape[%d] = %lld is negative", fn, i,
                         (long long)shp[i]);
            return -1;
        }
        if (w->sst[i] < 0) {
            PyErr_Format(PyExc_ValueError, "%s: src_strides[%d] = %lld is negative", fn, i,
                         (long long)w->sst[i]);
            return -1;
        }
        *empty |= shp[i] == 0;
        w->shape[i] = (Py_ssize_t)shp[i];
    }
    int64_t slo = 0, shi = 0;
    *dlo = *dhi = 0;
    if (!*empty && (walk_extent(w, w->sst, &slo, &shi) < 0 ||
                    walk_extent(w, w->dst, dlo, dhi) < 0))
        return -1;
    if (!*empty && (*soff > *bb || (uint64_t)shi > *bb - *soff)) {
        PyErr_Format(cxlkv_RangeError, "%s: the walk spans bytes [%llu, %llu) of a block "
                     "of %llu bytes", fn, (unsigned long long)*soff,
                     (unsigned long long)*soff + (unsigned long long)shi,
                     (unsigned long long)*bb);
        return -1;
    }
    return 0;
}

/* Every block's walk in buf (origins buf_offsets, n of them) inside the
 * extent buf's exporter describes; -1 (RangeError) otherwise. */
static int
check_buf_walks(const char *fn, const Py_buffer *buf, const int64_t *off, Py_ssize_t n,
                int64_t dlo, int64_t dhi)
{
    int64_t blo, bhi;
    buffer_extent(buf, &blo, &bhi);
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t a, z;
        if (__builtin_add_overflow(off[i], dlo, &a) || __builtin_add_overflow(off[i], dhi, &z) ||
            a < blo || z > bhi) {
            PyErr_Format(cxlkv_RangeError, "%s: block %zd at buffer offset %lld spans "
                         "[%lld, %lld), outside the buffer's [%lld, %lld)", fn, i,
                         (long long)off[i], (long long)(off[i] + dlo),
                         (long long)(off[i] + dhi), (long long)blo, (long long)bhi);
            return -1;
        }
    }
    return 0;
}

PyObject *
mod_kv_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    uint64_t bb, soff;
    int to_blocks = 0, empty;
    struct walk w;
    int64_t dlo, dhi;
    if (nargs_check(nargs, 9, 10, "kv_copy") < 0 ||
        parse_walk(args, "kv_copy", &w, &bb, &soff, &empty, &dlo, &dhi) < 0)
        return NULL;
    if (nargs > 9 && (to_blocks = PyObject_IsTrue(args[9])) < 0)
        return NULL;

    PyObject *seq = PySequence_Fast(args[0], "kv_copy: blocks must be a sequence of buffers");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Py_buffer buf, offs;
    int have_buf = 0, have_offs = 0;
    Py_buffer *b = PyMem_Calloc(n ? (size_t)n : 1, sizeof *b);
    Py_ssize_t got = 0;
    PyObject *ret = NULL;
    if (!b) {
        PyErr_NoMemory();
        goto done;
    }
    if (PyObject_GetBuffer(args[3], &buf, (to_blocks ? 0 : PyBUF_WRITABLE) | PyBUF_STRIDES) < 0)
        goto done;
    have_buf = 1;
    if (get_i64(args[4], &offs) < 0)
        goto done;
    have_offs = 1;
    if (offs.len / 8 != n) {
        PyErr_Format(PyExc_ValueError, "kv_copy: %zd offsets for %zd blocks", offs.len / 8, n);
        goto done;
    }
    const int64_t *off = offs.buf;
    if (!empty && check_buf_walks("kv_copy", &buf, off, n, dlo, dhi) < 0)
        goto done;
    for (; got < n; got++) {
        PyObject *it = PySequence_Fast_GET_ITEM(seq, got);
        if (PyObject_GetBuffer(it, &b[got], PyBUF_C_CONTIGUOUS |
                               (to_blocks ? PyBUF_WRITABLE : 0)) < 0)
            goto done;
        if ((uint64_t)b[got].len != bb) {
            PyErr_Format(PyExc_ValueError, "kv_copy: block %zd is %zd bytes, not %llu", got,
                         b[got].len, (unsigned long long)bb);
            PyBuffer_Release(&b[got]);
            goto done;
        }
    }
    walk_simplify(&w);
    int nt = !to_blocks && __atomic_load_n(&cxlkv_read_nt, __ATOMIC_RELAXED);
    uint64_t total = 0;
    if (!empty) {
        uint64_t per = w.run;
        for (int i = 0; i < w.ndim; i++)
            per *= (uint64_t)w.shape[i];
        total = per * (uint64_t)n;
        int big = total >= 64 * 1024;
        PyThreadState *ts = big ? PyEval_SaveThread() : NULL;
        for (Py_ssize_t i = 0; i < n; i++)
            walk_copy(&w, (char *)b[i].buf + soff, (char *)buf.buf + off[i], to_blocks, nt);
#if defined(__x86_64__)
        if (nt)
            _mm_sfence();
#endif
        if (big)
            PyEval_RestoreThread(ts);
    }
    ret = PyLong_FromUnsignedLongLong(total);
done:
    if (b) {
        for (Py_ssize_t i = 0; i < got; i++)
            PyBuffer_Release(&b[i]);
        PyMem_Free(b);
    }
    if (have_offs)
        PyBuffer_Release(&offs);
    if (have_buf)
        PyBuffer_Release(&buf);
    Py_DECREF(seq);
    return ret;
}

/* copy_modes() -> {"read": "plain"|"nt", "write": "nt"|"clwb"} */
PyObject *
mod_copy_modes(PyObject *self, PyObject *Py_UNUSED(ignored))
{
    (void)self;
    return Py_BuildValue("{s:s,s:s}", "read", cxlkv_read_nt ? "nt" : "plain",
                         "write", cxlkv_write_clwb ? "clwb" : "nt");
}

/* set_copy_modes(read, write): "plain"|"nt", "nt"|"clwb" */
PyObject *
mod_set_copy_modes(PyObject *self, PyObject *args)
{
    (void)self;
    const char *r, *wr;
    if (!PyArg_ParseTuple(args, "ss:set_copy_modes", &r, &wr))
        return NULL;
    int rn, wc;
    if (!strcmp(r, "nt"))
        rn = 1;
    else if (!strcmp(r, "plain"))
        rn = 0;
    else {
        PyErr_Format(PyExc_ValueError, "read copy mode %R: plain or nt", PyTuple_GET_ITEM(args, 0));
        return NULL;
    }
    if (!strcmp(wr, "nt"))
        wc = 0;
    else if (!strcmp(wr, "clwb"))
        wc = 1;
    else {
        PyErr_Format(PyExc_ValueError, "write copy mode %R: nt or clwb", PyTuple_GET_ITEM(args, 1));
        return NULL;
    }
    __atomic_store_n(&cxlkv_read_nt, rn, __ATOMIC_RELAXED);
    __atomic_store_n(&cxlkv_write_clwb, wc, __ATOMIC_RELAXED);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------ scatter into the pool */

/* One run into pool memory.  Not under the emulation: non-temporal stores
 * when the write mode is nt and the run is whole 16-byte units at a 16-byte
 * aligned address (the common KV layouts: head_dim x itemsize runs), which
 * reach memory without a flush; otherwise regular stores and a write-back of
 * the run's lines (no fence here: the caller fences once per block). */
static int
run_to_pool(Mapping *m, uint64_t off, const char *src, size_t n, int nt)
{
    if (m->nc)
        return nc_write(m->nc, off, src, n, nt);
    char *dst = m->base + off;
#if defined(__x86_64__)
    if (nt && !(((uintptr_t)dst | n) & 15)) {
        if (cxlkv_cpu.has_avx2 && !(((uintptr_t)dst | n) & 31))
            stream_avx2(dst, src, n);
        else
            stream_sse2(dst, src, n);
        return 0;
    }
#endif
    memcpy(dst, src, n);
    uintptr_t a = (uintptr_t)dst & ~(uintptr_t)63, end = (uintptr_t)dst + n;
    for (; a < end; a += 64)
        cxlkv_line_op(cxlkv_cpu.flush, (const void *)a);
    return 0;
}

/* One block's walk from buf into the pool at block offset `blk`. */
static int
walk_to_pool(Mapping *m, const struct walk *w, uint64_t blk, const char *buf, int nt)
{
    Py_ssize_t idx[CXLKV_GATHER_MAXDIM] = {0};
    if (w->ndim == 0)
        return run_to_pool(m, blk, buf, w->run, nt);
    int64_t so = 0, bo = 0;
    for (;;) {
        if (run_to_pool(m, blk + (uint64_t)so, buf + bo, w->run, nt) < 0)
            return -1;
        if (!walk_next(w, idx, &so, &bo))
            return 0;
    }
}

/* kv_scatter(offsets, block_bytes, src_offset, buf, buf_offsets, shape,
 *            src_strides, buf_strides, run) -> blocks written
 *
 * The store direction of kv_copy with the blocks in the pool: block i is the
 * pool slot at offsets[i] (uint64, each checked to lie in the pool with its
 * block_bytes), written in place from the engine's tensor `buf` - one pass,
 * no staging block.  The walk's bounds are kv_copy's (inside every block,
 * inside buf's extent).  Stores follow the write copy mode (nt, or regular
 * stores + write-back), so the blocks' lines are in memory on return, as
 * publish needs.  Stops before a block once the mapping's write deadline has
 * passed (write_blocks' rule: the caller proves its node fresh again, or is
 * fenced, and goes on from the returned count). */
PyObject *
Mapping_kv_scatter(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t bb, soff;
    int empty;
    struct walk w;
    int64_t dlo, dhi;
    if (nargs_check(nargs, 9, 9, "kv_scatter") < 0 || check_open(m) < 0 ||
        check_writable(m, "kv_scatter") < 0 ||
        parse_walk(args, "kv_scatter", &w, &bb, &soff, &empty, &dlo, &dhi) < 0)
        return NULL;
    Py_buffer po, buf, bo;
    if (get_offsets(args[0], &po, 0) < 0)
        return NULL;
    PyObject *ret = NULL;
    int have_buf = 0, have_bo = 0;
    Py_ssize_t n = po.len / 8;
    const uint64_t *off = po.buf;
    for (Py_ssize_t i = 0; i < n; i++)
        if (check_range(m, off[i], bb, "kv_scatter") < 0)
            goto done;
    if (PyObject_GetBuffer(args[3], &buf, PyBUF_STRIDES) < 0)
        goto done;
    have_buf = 1;
    if (get_i64(args[4], &bo) < 0)
        goto done;
    have_bo = 1;
    if (bo.len / 8 != n) {
        PyErr_Format(PyExc_ValueError, "kv_scatter: %zd buffer offsets for %zd blocks",
                     bo.len / 8, n);
        goto done;
    }
    const int64_t *boff = bo.buf;
    if (!empty && check_buf_walks("kv_scatter", &buf, boff, n, dlo, dhi) < 0)
        goto done;
    walk_simplify(&w);
    int nt = m->nt_default && !__atomic_load_n(&cxlkv_write_clwb, __ATOMIC_RELAXED);
    Py_ssize_t done_n = 0;
    int rc = 0;
    if (empty) {
        done_n = n;
    } else {
        m->busy++;
        Py_BEGIN_ALLOW_THREADS
        for (; done_n < n && rc == 0 && !write_deadline_passed(m); done_n++) {
            rc = walk_to_pool(m, &w, off[done_n] + soff, (const char *)buf.buf + boff[done_n], nt);
            cxlkv_sfence();          /* this block's stores and write-backs are done */
        }
        Py_END_ALLOW_THREADS
        m->busy--;
    }
    if (rc < 0) {
        PyErr_NoMemory();
        goto done;
    }
    ret = PyLong_FromSsize_t(done_n);
done:
    if (have_bo)
        PyBuffer_Release(&bo);
    if (have_buf)
        PyBuffer_Release(&buf);
    PyBuffer_Release(&po);
    return ret;
}
