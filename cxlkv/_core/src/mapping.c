/*
 * The Mapping object: a pool mapped MAP_SHARED (a file or a device-dax
 * character device) or, for pure formatting and tests, a borrowed writable
 * buffer.  Here: its life (map, close), the checks every access goes through
 * (bounds, writability and the node's guard), the word atomics,
 * flush/invalidate, the copies (write, zero, read, readinto), zero-copy views
 * (Span) and its properties.
 *
 * Every access takes a byte offset from the pool base and is bounds-checked
 * against the mapping before the pointer is formed: an offset read from the
 * pool is untrusted input.  Out of range raises RangeError (an IndexError);
 * nothing here can be made to touch memory outside the mapping.
 *
 * All pool accesses funnel through the pool_* helpers (core.h), so that a
 * different memory model (the non-coherence emulation) switches in at one
 * place.
 */
#include "core.h"

#include <errno.h>
#include <pthread.h>
#include <string.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* Copies at least this large release the GIL. */
#define GIL_RELEASE_MIN (64 * 1024)

static int
range_error(const Mapping *m, uint64_t off, uint64_t len, const char *what)
{
    PyErr_Format(cxlkv_RangeError,
                 "%s: range [%llu, +%llu) is outside the pool mapping of %llu bytes",
                 what, (unsigned long long)off, (unsigned long long)len,
                 (unsigned long long)m->size);
    return -1;
}

int
check_open(const Mapping *m)
{
    if (m->closed || m->base == NULL) {
        PyErr_SetString(PyExc_ValueError, "pool mapping is closed");
        return -1;
    }
    return 0;
}

/* The one bounds check.  off and len come from Python or from the pool. */
int
check_range(const Mapping *m, uint64_t off, uint64_t len, const char *what)
{
    if (check_open(m) < 0)
        return -1;
    if (off > m->size || len > m->size - off)
        return range_error(m, off, len, what);
    return 0;
}

int
check_word(const Mapping *m, uint64_t off, const char *what)
{
    if (check_range(m, off, 8, what) < 0)
        return -1;
    if (off & 7) {
        PyErr_Format(cxlkv_RangeError, "%s: offset %llu is not 8-byte aligned", what,
                     (unsigned long long)off);
        return -1;
    }
    return 0;
}

/* set while this thread runs a guard: the guard's own writes must not
 * recurse into it; other threads still check (the guard is Python and may
 * let them run meanwhile) */
static _Thread_local int in_guard;

int
check_writable(Mapping *m, const char *what)
{
    if (!m->writable) {
        PyErr_Format(cxlkv_ReadOnlyError, "%s: pool is mapped read-only", what);
        return -1;
    }
    /* every write primitive passes here (GIL held): once the attached node's
     * freshness ran out - it was stalled, or fenced (deadline 1) - its guard
     * proves it fresh again or raises, before anything is written */
    if (m->guard && !in_guard && write_deadline_passed(m)) {
        in_guard = 1;
        PyObject *r = PyObject_CallNoArgs(m->guard);
        in_guard = 0;
        if (!r)
            return -1;
        Py_DECREF(r);
    }
    return 0;
}

/* bumped in a forked child: its granules are mapped again (core.h) */
uint64_t cxlkv_fork_gen;

static void
prefault_after_fork(void)
{
    __atomic_fetch_add(&cxlkv_fork_gen, 1, __ATOMIC_RELAXED);
}

void
cxlkv_prefault_atfork(void)
{
    pthread_atfork(NULL, NULL, prefault_after_fork);
}

/* Map the 2 MiB granules of [off, off + len) not yet mapped by this process
 * (pool_prefault in core.h).  Granules are marked done whatever madvise
 * answered, so a failing one is not asked again; a kernel without
 * MADV_POPULATE_READ (before 5.14) turns prefaulting off.  Threads may race
 * to map one granule: mapping it twice is harmless. */
void
pool_prefault_slow(Mapping *m, uint64_t off, uint64_t len)
{
#ifdef MADV_POPULATE_READ
    uint64_t ngran = (m->size + (1ull << PREFAULT_SHIFT) - 1) >> PREFAULT_SHIFT;
    uint64_t *bits = __atomic_load_n(&m->mapped, __ATOMIC_ACQUIRE);
    uint64_t gen = __atomic_load_n(&cxlkv_fork_gen, __ATOMIC_RELAXED);
    if (bits && m->mapped_gen != gen) {
        /* a forked child: only the forking thread runs here yet */
        memset(bits, 0, (size_t)((ngran + 63) / 64) * sizeof *bits);
        m->mapped_gen = gen;
    }
    if (!bits) {
        uint64_t *fresh = calloc((size_t)((ngran + 63) / 64), sizeof *fresh);
        if (!fresh) {
            m->prefault = 0;
            return;
        }
        uint64_t *none = NULL;
        m->mapped_gen = gen;
        if (__atomic_compare_exchange_n(&m->mapped, &none, fresh, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE)) {
            bits = fresh;
        } else {
            free(fresh);
            bits = none;
        }
    }
    if (off >= m->size)
        return;
    if (len > m->size - off)
        len = m->size - off;
    for (uint64_t g = off >> PREFAULT_SHIFT; g <= (off + len - 1) >> PREFAULT_SHIFT; g++) {
        uint64_t bit = 1ull << (g & 63);
        if (__atomic_load_n(&bits[g >> 6], __ATOMIC_RELAXED) & bit)
            continue;
        uint64_t a = g << PREFAULT_SHIFT, n = 1ull << PREFAULT_SHIFT;
        if (n > m->size - a)
            n = m->size - a;
        if (madvise(m->base + a, (size_t)n, MADV_POPULATE_READ) < 0 &&
            (errno == EINVAL || errno == ENOSYS)) {
            m->prefault = 0;
            return;
        }
        __atomic_fetch_or(&bits[g >> 6], bit, __ATOMIC_RELAXED);
    }
#else
    (void)off;
    (void)len;
    m->prefault = 0;
#endif
}

static void
mapping_release(Mapping *m)
{
    if (m->nc) {
        /* what this process wrote but never flushed is lost, as on a host
         * that dies with dirty lines: nothing is written back here */
        nc_destroy(m->nc);
        m->nc = NULL;
    }
    if (m->base) {
        if (m->owns_map)
            munmap(m->base, (size_t)m->size);
        else
            PyBuffer_Release(&m->borrowed);
    }
    m->base = NULL;
    m->closed = 1;
    m->prefault = 0;
    free(__atomic_exchange_n(&m->mapped, NULL, __ATOMIC_ACQ_REL));
}

void
Mapping_dealloc(Mapping *m)
{
    Py_CLEAR(m->guard);
    slab_emptied_free(m);
    mapping_release(m);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

/* CXLKV_NONCOHERENT=1: this process sees the pool through an emulated
 * non-coherent cache (nc.h). */
static int
maybe_noncoherent(Mapping *m)
{
    const char *e = getenv("CXLKV_NONCOHERENT");
    if (!e || strcmp(e, "1"))
        return 0;
    m->nc = nc_create(m->base, m->size);
    if (!m->nc) {
        PyErr_Format(PyExc_MemoryError,
                     "CXLKV_NONCOHERENT=1: cannot reserve the emulated cache for a pool of "
                     "%llu bytes (it needs address space the size of the pool)",
                     (unsigned long long)m->size);
        return -1;
    }
    return 0;
}

PyObject *
Mapping_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"fd", "size", "writable", "populate", "align", "offset", NULL};
    int fd, writable = 1, populate = 0;
    unsigned long long size, align = 0, offset = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iK|ppKK:Mapping", kwlist, &fd, &size,
                                     &writable, &populate, &align, &offset))
        return NULL;
    if (size == 0 || size > (unsigned long long)PY_SSIZE_T_MAX) {
        PyErr_Format(PyExc_ValueError, "cannot map %llu bytes", size);
        return NULL;
    }
    /* device-dax maps only whole alignment units */
    if (align && ((align & (align - 1)) || size % align || offset % align)) {
        PyErr_Format(PyExc_ValueError,
                     "mapping offset %llu and length %llu must be multiples of the device "
                     "alignment %llu", offset, size, align);
        return NULL;
    }
    if (offset % (unsigned long long)sysconf(_SC_PAGESIZE)) {
        PyErr_Format(PyExc_ValueError, "mapping offset %llu is not page aligned", offset);
        return NULL;
    }
    /* a regular file must hold the whole mapping: touching a page past its end
     * would kill the process with SIGBUS instead of raising */
    struct stat st;
    if (fstat(fd, &st) < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    if (S_ISREG(st.st_mode) && (offset > (unsigned long long)st.st_size ||
                                size > (unsigned long long)st.st_size - offset)) {
        PyErr_Format(PyExc_ValueError,
                     "cannot map %llu bytes at offset %llu of a %lld-byte file", size, offset,
                     (long long)st.st_size);
        return NULL;
    }
    int prot = PROT_READ | (writable ? PROT_WRITE : 0);
    int flags = MAP_SHARED | (populate ? MAP_POPULATE : 0);
    void *p;
    Py_BEGIN_ALLOW_THREADS
    p = mmap(NULL, (size_t)size, prot, flags, fd, (off_t)offset);
    Py_END_ALLOW_THREADS
    if (p == MAP_FAILED)
        return PyErr_SetFromErrno(PyExc_OSError);
#ifdef MADV_HUGEPAGE
    /* 2 MiB pages where the kernel allows them for this mapping (tmpfs with
     * shmem_enabled=advise|within_size|always; device-dax maps 2 MiB pages
     * by itself): 4 KiB pages halve copy bandwidth through TLB misses.
     * Advisory: a refusal changes nothing. */
    (void)madvise(p, (size_t)size, MADV_HUGEPAGE);
#endif
    Mapping *m = (Mapping *)type->tp_alloc(type, 0);
    if (!m) {
        munmap(p, (size_t)size);
        return NULL;
    }
    m->base = p;
    m->size = size;
    m->writable = writable;
    m->owns_map = 1;
    m->nt_default = 1;
    m->nt_threshold = 64 * 1024;
    if (maybe_noncoherent(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    m->prefault = !m->nc;
    if (populate && m->prefault) {
        /* MAP_POPULATE mapped every page: no granule needs its populate call
         * (one walks its 512 pages even when they are all mapped, ~100 us:
         * half the time of a 2 MiB copy into them) */
        size_t words = (size_t)(((size + (1ull << PREFAULT_SHIFT) - 1) >> PREFAULT_SHIFT) + 63) / 64;
        uint64_t *bits = malloc(words * sizeof *bits);
        if (bits) {
            memset(bits, 0xff, words * sizeof *bits);
            m->mapped_gen = __atomic_load_n(&cxlkv_fork_gen, __ATOMIC_RELAXED);
            m->mapped = bits;
        }
    }
    return (PyObject *)m;
}

PyObject *
Mapping_from_buffer(PyTypeObject *type, PyObject *obj)
{
    Mapping *m = (Mapping *)type->tp_alloc(type, 0);
    if (!m)
        return NULL;
    if (PyObject_GetBuffer(obj, &m->borrowed, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        if (PyObject_GetBuffer(obj, &m->borrowed, PyBUF_C_CONTIGUOUS) < 0) {
            m->closed = 1;
            Py_DECREF(m);
            return NULL;
        }
        m->writable = 0;
    } else {
        m->writable = 1;
    }
    if (m->borrowed.len == 0 || ((uintptr_t)m->borrowed.buf & 7)) {
        PyErr_SetString(PyExc_ValueError, m->borrowed.len == 0
                            ? "cannot use an empty buffer as a pool"
                            : "a pool buffer must start 8-byte aligned (atomics need it)");
        PyBuffer_Release(&m->borrowed);
        m->closed = 1;
        Py_DECREF(m);
        return NULL;
    }
    m->base = m->borrowed.buf;
    m->size = (uint64_t)m->borrowed.len;
    m->owns_map = 0;
    m->nt_default = 1;
    m->nt_threshold = 64 * 1024;
    if (maybe_noncoherent(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return (PyObject *)m;
}

PyObject *
Mapping_close(Mapping *m, PyObject *Py_UNUSED(ignored))
{
    if (m->closed)
        Py_RETURN_NONE;
    if (m->exports > 0) {
        PyErr_Format(PyExc_BufferError,
                     "cannot close the pool mapping: %zd view(s) of it are still alive",
                     m->exports);
        return NULL;
    }
    if (m->busy > 0) {
        PyErr_SetString(PyExc_BufferError,
                        "cannot close the pool mapping: a copy is running in another thread");
        return NULL;
    }
    mapping_release(m);
    Py_RETURN_NONE;
}

PyObject *
Mapping_enter(Mapping *m, PyObject *Py_UNUSED(ignored))
{
    if (check_open(m) < 0)
        return NULL;
    Py_INCREF(m);
    return (PyObject *)m;
}

PyObject *
Mapping_exit(Mapping *m, PyObject *args)
{
    (void)args;
    return Mapping_close(m, NULL);
}

/* load64(off) -> int */
PyObject *
Mapping_load64(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t off;
    if (nargs_check(nargs, 1, 1, "load64") < 0 || as_u64(args[0], &off, "offset") < 0 ||
        check_word(m, off, "load64") < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(pool_load64(m, off));
}

/* store64(off, value) */
PyObject *
Mapping_store64(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t off, v;
    if (nargs_check(nargs, 2, 2, "store64") < 0 || as_u64(args[0], &off, "offset") < 0 ||
        as_u64(args[1], &v, "value") < 0 || check_word(m, off, "store64") < 0 ||
        check_writable(m, "store64") < 0)
        return NULL;
    pool_store64(m, off, v);
    Py_RETURN_NONE;
}

/* cas64(off, expected, new) -> old value (the swap happened iff old == expected) */
PyObject *
Mapping_cas64(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t off, e, d;
    if (nargs_check(nargs, 3, 3, "cas64") < 0 || as_u64(args[0], &off, "offset") < 0 ||
        as_u64(args[1], &e, "expected") < 0 || as_u64(args[2], &d, "new") < 0 ||
        check_word(m, off, "cas64") < 0 || check_writable(m, "cas64") < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(pool_cas64(m, off, e, d));
}

/* fetch_add64(off, delta) -> old value (wraps modulo 2**64; pass 2**64-1 to subtract 1) */
PyObject *
Mapping_fetch_add64(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t off, d;
    if (nargs_check(nargs, 2, 2, "fetch_add64") < 0 || as_u64(args[0], &off, "offset") < 0 ||
        as_u64(args[1], &d, "delta") < 0 || check_word(m, off, "fetch_add64") < 0 ||
        check_writable(m, "fetch_add64") < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(pool_fadd64(m, off, d));
}

/* add64_many(off, delta, count): count fetch-adds on one word (for tests and
 * benchmarks of the atomics without per-call Python overhead) -> last old value */
PyObject *
Mapping_add64_many(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t off, d, n, old = 0;
    if (nargs_check(nargs, 3, 3, "add64_many") < 0 || as_u64(args[0], &off, "offset") < 0 ||
        as_u64(args[1], &d, "delta") < 0 || as_u64(args[2], &n, "count") < 0 ||
        check_word(m, off, "add64_many") < 0 || check_writable(m, "add64_many") < 0)
        return NULL;
    m->busy++;
    Py_BEGIN_ALLOW_THREADS
    for (uint64_t i = 0; i < n; i++)
        old = pool_fadd64(m, off, d);
    Py_END_ALLOW_THREADS
    m->busy--;
    return PyLong_FromUnsignedLongLong(old);
}

static int
range_args(Mapping *m, PyObject *const *args, Py_ssize_t nargs, const char *name,
           uint64_t *off, uint64_t *len)
{
    if (nargs_check(nargs, 2, 2, name) < 0 || as_u64(args[0], off, "offset") < 0 ||
        as_u64(args[1], len, "length") < 0 || check_range(m, *off, *len, name) < 0)
        return -1;
    return 0;
}

/* flush(off, length): write back the lines of the range, then sfence */
PyObject *
Mapping_flush(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t off, len;
    if (range_args(m, args, nargs, "flush", &off, &len) < 0)
        return NULL;
    pool_flush(m, off, len);
    Py_RETURN_NONE;
}

/* invalidate(off, length): drop the lines so the next loads read memory */
PyObject *
Mapping_invalidate(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t off, len;
    if (range_args(m, args, nargs, "invalidate", &off, &len) < 0)
        return NULL;
    pool_invalidate(m, off, len);
    Py_RETURN_NONE;
}

/* Write `src` (NULL: zeros) to [off, off+len) with the GIL released, in
 * pieces of WRITE_PIECE bytes: once the write deadline has passed between
 * two pieces, the GIL is taken back and check_writable runs the node's
 * guard, which proves the node fresh (it beats) or raises NodeFenced - so a
 * writer stalled in a long write past its lease, its memory recovered and
 * handed out meanwhile, writes at most the piece it was in.  -1 with an
 * exception set (the range then partly written). */
#define WRITE_PIECE (1u << 20)
static int
write_pieces(Mapping *m, uint64_t off, const char *src, uint64_t len, int nt, const char *what)
{
    uint64_t done = 0;
    int rc = 0;
    while (done < len) {
        if (done && check_writable(m, what) < 0)
            return -1;
        m->busy++;
        Py_BEGIN_ALLOW_THREADS
        do {
            uint64_t n = len - done < WRITE_PIECE ? len - done : WRITE_PIECE;
            if (src)
                rc = pool_write(m, off + done, src + done, n, nt);
            else
                pool_zero(m, off + done, n, nt);
            done += n;
            if (done < len)
                cxlkv_crashpoint("write.piece");
        } while (rc == 0 && done < len && !write_deadline_passed(m));
        Py_END_ALLOW_THREADS
        m->busy--;
        if (rc < 0) {
            PyErr_NoMemory();
            return -1;
        }
    }
    return 0;
}

/* write(off, buffer, nt=None): copy a buffer into the pool; flushed on return */
PyObject *
Mapping_write(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t off;
    if (nargs_check(nargs, 2, 3, "write") < 0 || as_u64(args[0], &off, "offset") < 0)
        return NULL;
    Py_buffer b;
    if (PyObject_GetBuffer(args[1], &b, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    int nt;
    PyObject *ret = NULL;
    if (check_range(m, off, (uint64_t)b.len, "write") < 0 || check_writable(m, "write") < 0 ||
        parse_nt(m, nargs > 2 ? args[2] : NULL, (uint64_t)b.len, &nt) < 0)
        goto out;
    if (b.len >= GIL_RELEASE_MIN) {
        if (write_pieces(m, off, b.buf, (uint64_t)b.len, nt, "write") < 0)
            goto out;
    } else if (pool_write(m, off, b.buf, (uint64_t)b.len, nt) < 0) {
        PyErr_NoMemory();
        goto out;
    }
    ret = Py_NewRef(Py_None);
out:
    PyBuffer_Release(&b);
    return ret;
}

/* zero(off, length, nt=None): zero a range; flushed on return */
PyObject *
Mapping_zero(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t off, len;
    int nt;
    if (nargs_check(nargs, 2, 3, "zero") < 0 || as_u64(args[0], &off, "offset") < 0 ||
        as_u64(args[1], &len, "length") < 0 || check_range(m, off, len, "zero") < 0 ||
        check_writable(m, "zero") < 0 || parse_nt(m, nargs > 2 ? args[2] : NULL, len, &nt) < 0)
        return NULL;
    if (write_pieces(m, off, NULL, len, nt, "zero") < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* read(off, length) -> bytes */
PyObject *
Mapping_read(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t off, len;
    if (range_args(m, args, nargs, "read", &off, &len) < 0)
        return NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)len);
    if (!out)
        return NULL;
    if (len >= GIL_RELEASE_MIN) {
        m->busy++;
        Py_BEGIN_ALLOW_THREADS
        pool_read(m, off, PyBytes_AS_STRING(out), len);
        Py_END_ALLOW_THREADS
        m->busy--;
    } else {
        pool_read(m, off, PyBytes_AS_STRING(out), len);
    }
    return out;
}

/* readinto(off, buffer) -> bytes copied (len(buffer)) */
PyObject *
Mapping_readinto(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t off;
    if (nargs_check(nargs, 2, 2, "readinto") < 0 || as_u64(args[0], &off, "offset") < 0)
        return NULL;
    Py_buffer b;
    if (PyObject_GetBuffer(args[1], &b, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    PyObject *ret = NULL;
    if (check_range(m, off, (uint64_t)b.len, "readinto") < 0)
        goto out;
    if (b.len >= GIL_RELEASE_MIN) {
        m->busy++;
        Py_BEGIN_ALLOW_THREADS
        pool_read(m, off, b.buf, (uint64_t)b.len);
        Py_END_ALLOW_THREADS
        m->busy--;
    } else {
        pool_read(m, off, b.buf, (uint64_t)b.len);
    }
    ret = PyLong_FromSsize_t(b.len);
out:
    PyBuffer_Release(&b);
    return ret;
}

/* ------------------------------------------------------------------ */
/* Span: a sub-range exporter backing zero-copy views                   */

typedef struct {
    PyObject_HEAD
    Mapping *map;
    uint64_t off, len;
    int writable;
} Span;

static void
Span_dealloc(Span *s)
{
    Py_XDECREF(s->map);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

/* The memory a view shows.  Coherent: the pool itself.  Under the
 * non-coherence emulation: this process's emulated cache of the range (the
 * shadow, nc.h): reading through the view is then a read through the cache,
 * stale lines and all, like a pointer into real non-coherent memory; the
 * uncached lines are fetched now and re-fetched by every invalidate. */
static int
Span_getbuffer(Span *s, Py_buffer *view, int flags)
{
    Mapping *m = s->map;
    if (check_range(m, s->off, s->len, "view") < 0) {
        view->obj = NULL;
        return -1;
    }
    if ((flags & PyBUF_WRITABLE) && !s->writable) {
        PyErr_SetString(PyExc_BufferError, "pool view is read-only");
        view->obj = NULL;
        return -1;
    }
    char *p = m->base + s->off;
    if (m->nc)
        p = (char *)nc_view(m->nc, s->off, s->len);   /* in range: checked above */
    if (PyBuffer_FillInfo(view, (PyObject *)s, p, (Py_ssize_t)s->len,
                          !s->writable, flags) < 0)
        return -1;
    m->exports++;
    return 0;
}

static void
Span_releasebuffer(Span *s, Py_buffer *view)
{
    (void)view;
    s->map->exports--;
}

static PyBufferProcs Span_as_buffer = {
    (getbufferproc)Span_getbuffer,
    (releasebufferproc)Span_releasebuffer,
};

PyTypeObject SpanType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cxlkv._core._native.Span",
    .tp_basicsize = sizeof(Span),
    .tp_dealloc = (destructor)Span_dealloc,
    .tp_as_buffer = &Span_as_buffer,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Exporter of one pool range; use Mapping.view().",
};

/* view(off, length, writable=False) -> memoryview over the pool range.
 * Under the non-coherence emulation the view shows this process's emulated
 * cache (see Span_getbuffer): no invalidate is done for the caller, so a view
 * of lines another host wrote since this process last invalidated them shows
 * the stale copies, as it would on the hardware.  Writable views are refused
 * there: stores through a pointer would bypass the emulated cache. */
PyObject *
Mapping_view(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t off, len;
    int writable = 0;
    if (nargs_check(nargs, 2, 3, "view") < 0 || as_u64(args[0], &off, "offset") < 0 ||
        as_u64(args[1], &len, "length") < 0 || check_range(m, off, len, "view") < 0)
        return NULL;
    if (nargs > 2 && (writable = PyObject_IsTrue(args[2])) < 0)
        return NULL;
    if (writable && check_writable(m, "view") < 0)
        return NULL;
    if (writable && m->nc) {
        PyErr_SetString(PyExc_BufferError,
                        "view: writable views are not emulated under CXLKV_NONCOHERENT=1 "
                        "(stores through a pointer would bypass the emulated cache); "
                        "use write() or store64()");
        return NULL;
    }
    Span *s = PyObject_New(Span, &SpanType);
    if (!s)
        return NULL;
    Py_INCREF(m);
    s->map = m;
    s->off = off;
    s->len = len;
    s->writable = writable;
    PyObject *mv = PyMemoryView_FromObject((PyObject *)s);
    Py_DECREF(s);
    return mv;
}

static PyObject *
Mapping_get_size(Mapping *m, void *c)
{
    (void)c;
    return PyLong_FromUnsignedLongLong(m->closed ? 0 : m->size);
}

static PyObject *
Mapping_get_writable(Mapping *m, void *c)
{
    (void)c;
    return PyBool_FromLong(m->writable);
}

static PyObject *
Mapping_get_closed(Mapping *m, void *c)
{
    (void)c;
    return PyBool_FromLong(m->closed);
}

/* set_guard(callable or None): what check_writable calls once the write
 * deadline has passed (see Mapping.guard in core.h) */
PyObject *
Mapping_set_guard(Mapping *m, PyObject *fn)
{
    if (fn != Py_None && !PyCallable_Check(fn)) {
        PyErr_SetString(PyExc_TypeError, "set_guard: a callable or None");
        return NULL;
    }
    Py_XSETREF(m->guard, fn == Py_None ? NULL : Py_NewRef(fn));
    Py_RETURN_NONE;
}

/* node_fresh(off, word, deadline_ns) -> True when deadline_ns (CLOCK_MONOTONIC;
 * the attached node's freshness, which the caller keeps) has not passed by
 * the copies' own check (write_deadline_passed)
 * and the word at off, invalidated first, is `word` (its state word: not
 * fenced meanwhile).  False means nothing: the caller runs the full check
 * (Attachment.guard beats or raises). */
PyObject *
Mapping_node_fresh(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t off, want, deadline;
    if (nargs_check(nargs, 3, 3, "node_fresh") < 0 || check_open(m) < 0 ||
        as_u64(args[0], &off, "offset") < 0 || as_u64(args[1], &want, "word") < 0 ||
        as_u64(args[2], &deadline, "deadline_ns") < 0 || check_word(m, off, "node_fresh") < 0)
        return NULL;
    /* the copies' own check (the TSC's may end a deadline up to 1 % early:
     * then this says stale too, and the guard beats rather than letting a
     * copy that stops at once be called again and again) */
    if (deadline == 0 || deadline > (uint64_t)INT64_MAX ||
        cxlkv_deadline_passed((int64_t)deadline))
        Py_RETURN_FALSE;
    pool_invalidate(m, off, 8);
    if (pool_load64(m, off) != want)
        Py_RETURN_FALSE;
    Py_RETURN_TRUE;
}

/* section_begin() -> True, or False when the write deadline is the fenced
 * sentinel (1): the node was fenced and no section may start.  Counting and
 * checking in one call (under the GIL) orders it against the thread that
 * sets the sentinel and then reads the counters to acknowledge the fencing. */
PyObject *
Mapping_section_begin(Mapping *m, PyObject *Py_UNUSED(ignored))
{
    if (__atomic_load_n(&m->write_deadline_ns, __ATOMIC_SEQ_CST) == 1)
        Py_RETURN_FALSE;
    m->sections++;
    Py_RETURN_TRUE;
}

PyObject *
Mapping_section_end(Mapping *m, PyObject *Py_UNUSED(ignored))
{
    if (m->sections > 0)
        m->sections--;
    Py_RETURN_NONE;
}

/* in_flight -> sections begun and not ended, plus calls running with the GIL
 * released (a copy in another thread) */
static PyObject *
Mapping_get_in_flight(Mapping *m, void *c)
{
    (void)c;
    return PyLong_FromSsize_t(m->sections + m->busy);
}

static PyObject *
Mapping_get_exports(Mapping *m, void *c)
{
    (void)c;
    return PyLong_FromSsize_t(m->exports);
}

static PyObject *
Mapping_get_flush_meta(Mapping *m, void *c)
{
    (void)c;
    return PyBool_FromLong(m->flush_meta);
}

static int
Mapping_set_flush_meta(Mapping *m, PyObject *v, void *c)
{
    (void)c;
    int t = v ? PyObject_IsTrue(v) : -1;
    if (t < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_AttributeError, "cannot delete flush_meta");
        return -1;
    }
    m->flush_meta = t;
    return 0;
}

static PyObject *
Mapping_get_write_deadline_ns(Mapping *m, void *c)
{
    (void)c;
    return PyLong_FromLongLong(__atomic_load_n(&m->write_deadline_ns, __ATOMIC_RELAXED));
}

static int
Mapping_set_write_deadline_ns(Mapping *m, PyObject *v, void *c)
{
    (void)c;
    if (!v) {
        PyErr_SetString(PyExc_AttributeError, "cannot delete write_deadline_ns");
        return -1;
    }
    long long d = PyLong_AsLongLong(v);
    if (d == -1 && PyErr_Occurred())
        return -1;
    if (d < 0) {
        PyErr_SetString(PyExc_ValueError, "write_deadline_ns must be >= 0");
        return -1;
    }
    __atomic_store_n(&m->write_deadline_ns, (int64_t)d, __ATOMIC_SEQ_CST);
    return 0;
}

static PyObject *
Mapping_get_noncoherent(Mapping *m, void *c)
{
    (void)c;
    return PyBool_FromLong(m->nc != NULL);
}

PyObject *
Mapping_nc_stats(Mapping *m, PyObject *Py_UNUSED(ignored))
{
    if (!m->nc)
        Py_RETURN_NONE;
    struct nc_cache *c = m->nc;
    pthread_mutex_lock(&c->mu);
    PyObject *d = Py_BuildValue("{s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K}",
                                "hits", (unsigned long long)c->hits,
                                "misses", (unsigned long long)c->misses,
                                "writebacks", (unsigned long long)c->writebacks,
                                "evictions", (unsigned long long)c->evictions,
                                "flushes", (unsigned long long)c->flushes,
                                "dropped_flushes", (unsigned long long)c->dropped,
                                "invalidates", (unsigned long long)c->invalidates,
                                "dropped_invalidates", (unsigned long long)c->dropped_inval,
                                "cached_lines", (unsigned long long)c->nres);
    pthread_mutex_unlock(&c->mu);
    return d;
}

static PyObject *
Mapping_get_address(Mapping *m, void *c)
{
    (void)c;
    if (check_open(m) < 0)
        return NULL;
    return PyLong_FromVoidPtr(m->base);
}

static PyObject *
Mapping_get_nt_threshold(Mapping *m, void *c)
{
    (void)c;
    return PyLong_FromUnsignedLongLong(m->nt_default ? m->nt_threshold : 0);
}

static int
Mapping_set_nt_threshold(Mapping *m, PyObject *v, void *c)
{
    (void)c;
    uint64_t t;
    if (!v) {
        PyErr_SetString(PyExc_AttributeError, "cannot delete nt_threshold");
        return -1;
    }
    if (as_u64(v, &t, "nt_threshold") < 0)
        return -1;
    m->nt_default = t != 0;
    m->nt_threshold = t;
    return 0;
}

/* prefault_range(off, len) -> bool: map the 2 MiB granules of [off, off+len)
 * into this process now, as the first bulk copy into each would (False:
 * prefaulting is off for this mapping, nothing done) */
PyObject *
Mapping_prefault_range(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t off, len;
    if (nargs_check(nargs, 2, 2, "prefault_range") < 0 || check_open(m) < 0 ||
        as_u64(args[0], &off, "offset") < 0 || as_u64(args[1], &len, "length") < 0 ||
        check_range(m, off, len, "prefault_range") < 0)
        return NULL;
    if (!m->prefault)
        Py_RETURN_FALSE;
    m->busy++;
    Py_BEGIN_ALLOW_THREADS
    pool_prefault(m, off, len);
    Py_END_ALLOW_THREADS
    m->busy--;
    return PyBool_FromLong(m->prefault);
}

/* mapped_granules: how many 2 MiB granules this process has mapped in one
 * call (a first bulk copy, prefault_range) or at mmap (populate) */
static PyObject *
Mapping_get_mapped_granules(Mapping *m, void *c)
{
    (void)c;
    const uint64_t *bits = __atomic_load_n(&m->mapped, __ATOMIC_ACQUIRE);
    if (!bits || m->mapped_gen != __atomic_load_n(&cxlkv_fork_gen, __ATOMIC_RELAXED))
        return PyLong_FromLong(0);
    uint64_t ngran = (m->size + (1ull << PREFAULT_SHIFT) - 1) >> PREFAULT_SHIFT, n = 0;
    for (uint64_t g = 0; g < ngran; g++)
        n += __atomic_load_n(&bits[g >> 6], __ATOMIC_RELAXED) >> (g & 63) & 1;
    return PyLong_FromUnsignedLongLong(n);
}

static PyObject *
Mapping_get_prefault(Mapping *m, void *c)
{
    (void)c;
    return PyBool_FromLong(m->prefault);
}

static int
Mapping_set_prefault(Mapping *m, PyObject *v, void *c)
{
    (void)c;
    if (!v) {
        PyErr_SetString(PyExc_AttributeError, "cannot delete prefault");
        return -1;
    }
    int on = PyObject_IsTrue(v);
    if (on < 0)
        return -1;
    if (on && (m->nc || !m->owns_map || m->closed)) {
        PyErr_SetString(PyExc_ValueError,
                        "prefaulting needs an open mapping of its own, seen without the "
                        "non-coherence emulation");
        return -1;
    }
    m->prefault = on;
    return 0;
}

PyGetSetDef Mapping_getset[] = {
    {"size", (getter)Mapping_get_size, NULL, "bytes mapped", NULL},
    {"writable", (getter)Mapping_get_writable, NULL, "mapped read-write", NULL},
    {"closed", (getter)Mapping_get_closed, NULL, "unmapped", NULL},
    {"exports", (getter)Mapping_get_exports, NULL, "live views", NULL},
    {"in_flight", (getter)Mapping_get_in_flight, NULL,
     "node sections begun and not ended, plus calls running with the GIL released", NULL},
    {"flush_meta", (getter)Mapping_get_flush_meta, (setter)Mapping_set_flush_meta,
     "hot paths flush the metadata they write (for non-coherent memory)", NULL},
    {"noncoherent", (getter)Mapping_get_noncoherent, NULL,
     "this process sees the pool through the non-coherence emulation", NULL},
    {"address", (getter)Mapping_get_address, NULL,
     "virtual address of the pool base in this process (for DMA registration); under "
     "CXLKV_NONCOHERENT=1 still the real memory, which the emulated cache does not cover", NULL},
    {"write_deadline_ns", (getter)Mapping_get_write_deadline_ns,
     (setter)Mapping_set_write_deadline_ns,
     "CLOCK_MONOTONIC ns after which write_blocks stops before its next block (the "
     "attached node's heartbeat is no longer known fresh); 0 = none", NULL},
    {"nt_threshold", (getter)Mapping_get_nt_threshold, (setter)Mapping_set_nt_threshold,
     "writes at least this large use non-temporal stores by default; 0 = never", NULL},
    {"mapped_granules", (getter)Mapping_get_mapped_granules, NULL,
     "2 MiB granules this process mapped in one call (bulk copies, prefault_range) "
     "or at mmap (populate)", NULL},
    {"prefault", (getter)Mapping_get_prefault, (setter)Mapping_set_prefault,
     "bulk copies map their 2 MiB granule of the pool into this process in one call "
     "(MADV_POPULATE_READ) the first time, not a page fault per 4 KiB page", NULL},
    {NULL},
};
