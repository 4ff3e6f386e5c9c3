/*
 * cxlkv._core._native: the only code that touches pool memory.
 *
 * A Mapping is a pool mapped MAP_SHARED (a file or a device-dax character
 * device) or, for pure formatting and tests, a borrowed writable buffer.
 * Every access takes a byte offset from the pool base and is bounds-checked
 * against the mapping before the pointer is formed: an offset read from the
 * pool is untrusted input.  Out of range raises RangeError (an IndexError);
 * nothing here can be made to touch memory outside the mapping.
 *
 * All pool accesses funnel through the pool_* helpers below, so that a
 * different memory model (the non-coherence emulation) switches in at one
 * place.
 */
#include "core.h"

#include <errno.h>
#include <string.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* Bump when the Python-visible interface changes; cxlkv/_core/__init__.py
 * refuses to import a build with a different number (a stale build must fail
 * loudly, not strangely). */
#define CXLKV_NATIVE_ABI 10

/* Copies at least this large release the GIL. */
#define GIL_RELEASE_MIN (64 * 1024)

PyObject *cxlkv_RangeError;   /* set by _native.set_error_types() */
PyObject *cxlkv_CorruptError; /* impossible pool metadata; set by set_error_types() */
#define RangeError cxlkv_RangeError

/* ------------------------------------------------------------------ */
/* Mapping object                                                      */

static PyTypeObject MappingType;
static PyTypeObject SpanType;

static int
range_error(const Mapping *m, uint64_t off, uint64_t len, const char *what)
{
    PyErr_Format(RangeError,
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
        PyErr_Format(RangeError, "%s: offset %llu is not 8-byte aligned", what,
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
        PyErr_Format(PyExc_PermissionError, "%s: pool is mapped read-only", what);
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

/* --- argument helpers ---------------------------------------------- */

int
as_u64(PyObject *o, uint64_t *out, const char *what)
{
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, not %.100s", what,
                     Py_TYPE(o)->tp_name);
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            PyErr_Format(RangeError, "%s out of range: %R (must be 0 .. 2**64-1)", what, o);
        }
        return -1;
    }
    *out = (uint64_t)v;
    return 0;
}

int
nargs_check(Py_ssize_t nargs, Py_ssize_t lo, Py_ssize_t hi, const char *name)
{
    if (nargs < lo || nargs > hi) {
        if (lo == hi)
            PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, lo, nargs);
        else
            PyErr_Format(PyExc_TypeError, "%s() takes %zd to %zd arguments (%zd given)", name,
                         lo, hi, nargs);
        return -1;
    }
    return 0;
}

/* tri-state nt argument: None -> mapping default by size */
int
parse_nt(Mapping *m, PyObject *o, uint64_t len, int *nt)
{
    if (o == NULL || o == Py_None) {
        *nt = m->nt_default && len >= m->nt_threshold;
        return 0;
    }
    int t = PyObject_IsTrue(o);
    if (t < 0)
        return -1;
    *nt = t;
    return 0;
}

/* ------------------------------------------------------------------ */

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
}

static void
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

static PyObject *
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
    return (PyObject *)m;
}

static PyObject *
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

static PyObject *
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

static PyObject *
Mapping_enter(Mapping *m, PyObject *Py_UNUSED(ignored))
{
    if (check_open(m) < 0)
        return NULL;
    Py_INCREF(m);
    return (PyObject *)m;
}

static PyObject *
Mapping_exit(Mapping *m, PyObject *args)
{
    (void)args;
    return Mapping_close(m, NULL);
}

/* load64(off) -> int */
static PyObject *
Mapping_load64(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t off;
    if (nargs_check(nargs, 1, 1, "load64") < 0 || as_u64(args[0], &off, "offset") < 0 ||
        check_word(m, off, "load64") < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(pool_load64(m, off));
}

/* store64(off, value) */
static PyObject *
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
static PyObject *
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
static PyObject *
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
static PyObject *
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
static PyObject *
Mapping_flush(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t off, len;
    if (range_args(m, args, nargs, "flush", &off, &len) < 0)
        return NULL;
    pool_flush(m, off, len);
    Py_RETURN_NONE;
}

/* invalidate(off, length): drop the lines so the next loads read memory */
static PyObject *
Mapping_invalidate(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t off, len;
    if (range_args(m, args, nargs, "invalidate", &off, &len) < 0)
        return NULL;
    pool_invalidate(m, off, len);
    Py_RETURN_NONE;
}

/* write(off, buffer, nt=None): copy a buffer into the pool; flushed on return */
static PyObject *
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
    int rc;
    if (b.len >= GIL_RELEASE_MIN) {
        m->busy++;
        Py_BEGIN_ALLOW_THREADS
        rc = pool_write(m, off, b.buf, (uint64_t)b.len, nt);
        Py_END_ALLOW_THREADS
        m->busy--;
    } else {
        rc = pool_write(m, off, b.buf, (uint64_t)b.len, nt);
    }
    if (rc < 0) {
        PyErr_NoMemory();
        goto out;
    }
    ret = Py_NewRef(Py_None);
out:
    PyBuffer_Release(&b);
    return ret;
}

/* zero(off, length, nt=None): zero a range; flushed on return */
static PyObject *
Mapping_zero(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t off, len;
    int nt;
    if (nargs_check(nargs, 2, 3, "zero") < 0 || as_u64(args[0], &off, "offset") < 0 ||
        as_u64(args[1], &len, "length") < 0 || check_range(m, off, len, "zero") < 0 ||
        check_writable(m, "zero") < 0 || parse_nt(m, nargs > 2 ? args[2] : NULL, len, &nt) < 0)
        return NULL;
    m->busy++;
    Py_BEGIN_ALLOW_THREADS
    pool_zero(m, off, len, nt);
    Py_END_ALLOW_THREADS
    m->busy--;
    Py_RETURN_NONE;
}

/* read(off, length) -> bytes */
static PyObject *
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
static PyObject *
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
/* cas-mode ticket lock (the hot path of pool.lock())                   */

#define LH_NEXT      offsetof(struct cxlkv_lock_hdr, next_ticket)
#define LH_SERVING   offsetof(struct cxlkv_lock_hdr, now_serving)
#define LH_OWNER     offsetof(struct cxlkv_lock_hdr, owner)
#define LH_ACQ       offsetof(struct cxlkv_lock_hdr, acquisitions)
#define LE_STATE     offsetof(struct cxlkv_lock_entry, state)
#define LE_TICKET    offsetof(struct cxlkv_lock_entry, ticket)
#define LE_EPOCH     offsetof(struct cxlkv_lock_entry, epoch)

static inline void cpu_relax(void)
{
#if defined(__x86_64__)
    _mm_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield" ::: "memory");
#endif
}

static int
lock_args(Mapping *m, PyObject *const *args, uint64_t *hdr, uint64_t *entry, const char *name)
{
    if (as_u64(args[0], hdr, "lock header offset") < 0 ||
        as_u64(args[1], entry, "lock entry offset") < 0 ||
        check_range(m, *hdr, CXLKV_LOCK_HDR_SIZE, name) < 0 ||
        check_range(m, *entry, CXLKV_LOCK_ENTRY_SIZE, name) < 0 ||
        check_writable(m, name) < 0)
        return -1;
    if ((*hdr | *entry) & 63) {
        PyErr_Format(RangeError, "%s: lock header and entry must be 64-byte aligned", name);
        return -1;
    }
    return 0;
}

/* Spin until now_serving == ticket, at most `spins` times; 1 if it is ours. */
static int
ticket_spin(Mapping *m, uint64_t hdr, uint64_t ticket, uint64_t spins, uint64_t *serving)
{
    uint64_t s = pool_load64(m, hdr + LH_SERVING);
    for (uint64_t i = 0; s != ticket && i < spins; i++) {
        cpu_relax();
        s = pool_load64(m, hdr + LH_SERVING);
    }
    *serving = s;
    return s == ticket;
}

/* Our turn came: take it, unless the node was fenced while it waited (its
 * control word changed) - then nothing is written: the waiters skip a fenced
 * node's ticket, and a fenced node must not hold the lock.  1 = granted. */
static int
ticket_granted(Mapping *m, uint64_t hdr, uint64_t entry, uint64_t token, uint64_t ctl_off,
               uint64_t ctl)
{
    if (pool_load64(m, ctl_off) != ctl)
        return 0;
    pool_store64(m, hdr + LH_OWNER, token);
    pool_fadd64(m, hdr + LH_ACQ, 1);
    pool_store64(m, entry + LE_STATE, CXLKV_LOCK_LOCKED);
    return 1;
}

/* ticket_acquire(hdr, entry, token, epoch, spins, control_off, control)
 *   -> the ticket (an int) when acquired; (ticket, now_serving) when not yet
 *      (wait with ticket_wait); None when the word at control_off (the
 *      caller's node control word) is no longer `control`: the node was
 *      fenced and must not take the lock.  (An int on the fast path: no tuple
 *      to build, the uncontended lock is about one call.) */
static PyObject *
Mapping_ticket_acquire(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t hdr, entry, token, epoch, spins, serving, ctl_off, ctl;
    if (nargs_check(nargs, 7, 7, "ticket_acquire") < 0 ||
        lock_args(m, args, &hdr, &entry, "ticket_acquire") < 0 ||
        as_u64(args[2], &token, "token") < 0 || as_u64(args[3], &epoch, "epoch") < 0 ||
        as_u64(args[4], &spins, "spins") < 0 || as_u64(args[5], &ctl_off, "control offset") < 0 ||
        as_u64(args[6], &ctl, "control") < 0 || check_word(m, ctl_off, "ticket_acquire") < 0)
        return NULL;
    if (pool_load64(m, ctl_off) != ctl)
        Py_RETURN_NONE;
    /* record who waits for which ticket before taking it is impossible (the
     * number is unknown); the entry is written right after, and a ticket that
     * no entry claims for a whole lease is skipped by the waiters. */
    /* a stale ABANDONED state must not meet the new ticket: waiters skip
     * abandoned tickets at once */
    pool_store64(m, entry + LE_STATE, CXLKV_LOCK_IDLE);
    pool_store64(m, entry + LE_EPOCH, epoch);
    uint64_t t = pool_fadd64(m, hdr + LH_NEXT, 1);
    pool_store64(m, entry + LE_TICKET, t);
    pool_store64(m, entry + LE_STATE, CXLKV_LOCK_WAITING);
    int got = ticket_spin(m, hdr, t, 64, &serving);
    if (!got && spins > 64) {
        m->busy++;
        Py_BEGIN_ALLOW_THREADS
        got = ticket_spin(m, hdr, t, spins, &serving);
        Py_END_ALLOW_THREADS
        m->busy--;
    }
    if (got) {
        if (!ticket_granted(m, hdr, entry, token, ctl_off, ctl))
            Py_RETURN_NONE;
        return PyLong_FromUnsignedLongLong(t);
    }
    return Py_BuildValue("(KK)", (unsigned long long)t, (unsigned long long)serving);
}

/* ticket_wait(hdr, entry, ticket, token, spins, control_off, control)
 *   -> (acquired, now_serving), or None when our turn came but the word at
 *      control_off is no longer `control` (the node was fenced meanwhile) */
static PyObject *
Mapping_ticket_wait(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t hdr, entry, ticket, token, spins, serving, ctl_off, ctl;
    if (nargs_check(nargs, 7, 7, "ticket_wait") < 0 ||
        lock_args(m, args, &hdr, &entry, "ticket_wait") < 0 ||
        as_u64(args[2], &ticket, "ticket") < 0 || as_u64(args[3], &token, "token") < 0 ||
        as_u64(args[4], &spins, "spins") < 0 || as_u64(args[5], &ctl_off, "control offset") < 0 ||
        as_u64(args[6], &ctl, "control") < 0 || check_word(m, ctl_off, "ticket_wait") < 0)
        return NULL;
    int got;
    m->busy++;
    Py_BEGIN_ALLOW_THREADS
    got = ticket_spin(m, hdr, ticket, spins, &serving);
    Py_END_ALLOW_THREADS
    m->busy--;
    if (got && !ticket_granted(m, hdr, entry, token, ctl_off, ctl))
        Py_RETURN_NONE;
    return Py_BuildValue("(OK)", got ? Py_True : Py_False, (unsigned long long)serving);
}

/* ticket_release(hdr, entry, ticket, token, control_off, control) -> True,
 * or False when the lock was no longer ours (our ticket was skipped: this
 * node was judged dead).  When the word at control_off (the caller's node
 * control word) is no longer `control` the node was fenced: nothing is
 * written (its entry may already be recovered) and False is returned. */
static PyObject *
Mapping_ticket_release(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t hdr, entry, ticket, token, ctl_off, ctl;
    if (nargs_check(nargs, 6, 6, "ticket_release") < 0 ||
        lock_args(m, args, &hdr, &entry, "ticket_release") < 0 ||
        as_u64(args[2], &ticket, "ticket") < 0 || as_u64(args[3], &token, "token") < 0 ||
        as_u64(args[4], &ctl_off, "control offset") < 0 ||
        as_u64(args[5], &ctl, "control") < 0 || check_word(m, ctl_off, "ticket_release") < 0)
        return NULL;
    if (pool_load64(m, ctl_off) != ctl)
        Py_RETURN_FALSE;
    pool_store64(m, entry + LE_STATE, CXLKV_LOCK_IDLE);
    pool_cas64(m, hdr + LH_OWNER, token, 0);
    int ok = pool_cas64(m, hdr + LH_SERVING, ticket, ticket + 1) == ticket;
    return PyBool_FromLong(ok);
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

static PyTypeObject SpanType = {
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
static PyObject *
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
static PyObject *
Mapping_set_guard(Mapping *m, PyObject *fn)
{
    if (fn != Py_None && !PyCallable_Check(fn)) {
        PyErr_SetString(PyExc_TypeError, "set_guard: a callable or None");
        return NULL;
    }
    Py_XSETREF(m->guard, fn == Py_None ? NULL : Py_NewRef(fn));
    Py_RETURN_NONE;
}

/* section_begin() -> True, or False when the write deadline is the fenced
 * sentinel (1): the node was fenced and no section may start.  Counting and
 * checking in one call (under the GIL) orders it against the thread that
 * sets the sentinel and then reads the counters to acknowledge the fencing. */
static PyObject *
Mapping_section_begin(Mapping *m, PyObject *Py_UNUSED(ignored))
{
    if (__atomic_load_n(&m->write_deadline_ns, __ATOMIC_SEQ_CST) == 1)
        Py_RETURN_FALSE;
    m->sections++;
    Py_RETURN_TRUE;
}

static PyObject *
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

static PyObject *
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

static PyGetSetDef Mapping_getset[] = {
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
    {NULL},
};

#define FAST(name, doc) {#name, (PyCFunction)(void (*)(void))Mapping_##name, METH_FASTCALL, doc}

static PyMethodDef Mapping_methods[] = {
    FAST(load64, "load64(off) -> int: atomic 64-bit load (acquire)"),
    FAST(store64, "store64(off, value): atomic 64-bit store (release)"),
    FAST(cas64, "cas64(off, expected, new) -> old: compare-and-swap; swapped iff old == expected"),
    FAST(fetch_add64, "fetch_add64(off, delta) -> old: atomic add modulo 2**64"),
    FAST(add64_many, "add64_many(off, delta, count) -> old: count atomic adds, GIL released"),
    FAST(ticket_acquire, "ticket_acquire(hdr, entry, token, epoch, spins, control_off, control) -> ticket if acquired | (ticket, serving) | None if fenced"),
    FAST(ticket_wait, "ticket_wait(hdr, entry, ticket, token, spins, control_off, control) -> (acquired, serving) | None if fenced; GIL released"),
    FAST(ticket_release, "ticket_release(hdr, entry, ticket, token, control_off, control) -> bool: False if it was not ours or the node was fenced (nothing written)"),
    FAST(mgr_loop, "mgr_loop(lock_hdr, nodes, max_nodes, state, table, boot_id, superblocks) -> reason: the lock manager's scan / grant / heartbeat loop until Python is needed (0 heartbeat or return time due, 1 slots, 2 guard, 3 step down, 4 Python step); GIL released"),
    FAST(mgr_wait, "mgr_wait(entry, req, spin_ns, sleep_max_ns, until_ns) -> 1 granted | 2 revoked | 0 until_ns passed; GIL released"),
    FAST(hostlock_acquire, "hostlock_acquire(off, mine, spins, wait_ns, since_ns) -> 0 when the host lock is ours, else the holder's word after up to wait_ns; GIL released while waiting (hostlock.c)"),
    FAST(hostlock_release, "hostlock_release(off, mine) -> bool: False if the word no longer names mine (taken over; nothing written)"),
    FAST(set_geometry, "set_geometry(data_off, chunk_size, nchunks, desc_base): allocator geometry"),
    FAST(slab_alloc, "slab_alloc(head, owner, out, count, zero, slot_size=0, heap=0) -> allocated | -1 (not our active slab of that size) | -2 (no hazard word free: call again holding the pool lock, heap=0)"),
    FAST(slab_free, "slab_free(offsets, zero, owner) -> freed (stops at a slab owner does not own; owner 0 = any); raises ValueError at the first bad offset (MetadataCorrupt, also a ValueError, for a corrupt descriptor)"),
    FAST(slab_mark_freeing, "slab_mark_freeing(offsets) -> marked: set the dirty bit of allocated slots (a free has begun)"),
    FAST(slab_publish, "slab_publish(offsets) -> published"),
    FAST(chunk_find_run, "chunk_find_run(bitmap_off, k, hint) -> first of k free chunks (bitmap clear, descriptor FREE, in no head's span) from hint, wrapping once; -1 if none"),
    FAST(slabs_release, "slabs_release(heads, bitmap_off, heaps_off, max_nodes) -> (released, looked_at): release_slab's protocol for each empty slab (released ones moved to the front of heads); stops early once the write deadline has passed"),
    FAST(slabs_set_owner, "slabs_set_owner(heads, expect, owner) -> changed (moved to the front of heads): CAS the owner of HEAD slabs"),
    FAST(slab_census, "slab_census(bitmap_off, token, live) -> (releasing, mine, interrupted, dangling, leaked, empty): bytes of uint64 chunk indices from one pass over the descriptors (recovery)"),
    FAST(slab_take_emptied, "slab_take_emptied(freed=False) -> (bytes of uint64 heads, overflowed): slabs this process's frees emptied (freed=True: freed a slot in) since the last such call"),
    FAST(kv_lookup, "kv_lookup(table, nslots, ns, keys, out_idx, out_ctl, out_payload, out_len, stop_at_miss) -> found"),
    FAST(kv_insert, "kv_insert(table, nslots, hdr, max_used, ns, tenant, length, owner, keys, parent, payloads, out_idx, out_status) -> (processed, used, full); pool lock held"),
    FAST(kv_set_state, "kv_set_state(table, nslots, idx, from, to, owner, stamp, new_owner=0) -> changed; pool lock held"),
    FAST(kv_stamp, "kv_stamp(table, nslots, idx, stamp) -> stamped; pool lock held"),
    FAST(kv_in_flight, "kv_in_flight(table, nslots, out) -> found: entries in WRITING, PENDING or EVICTING (first len(out) indices to out)"),
    FAST(kv_remove, "kv_remove(table, nslots, hdr, idx) -> parent + 1; pool lock held"),
    FAST(kv_pin, "kv_pin(table, nslots, pins, npins, hint, idx, ctl, out) -> (pinned, hint, full)"),
    FAST(kv_unpin, "kv_unpin(pins, npins, records) -> cleared"),
    FAST(kv_touch, "kv_touch(head_off, ring_off, nring, idx) -> head"),
    FAST(journal_append, "journal_append(hdr, ring, nrec, table, nslots, op, writer, now_us, idx, ns=0) -> head; pool lock held"),
    FAST(kv_lru_setup, "kv_lru_setup(table, nslots, kv_hdr, links): where the leaf LRU lists are; the kv_* writers keep them from then on"),
    FAST(kv_lru_rebuild, "kv_lru_rebuild() -> leaves: relink every leaf from the table; pool lock held"),
    FAST(kv_lru_pick, "kv_lru_pick(tenant, want_n, want_bytes, smallest, pinned, keep, out) -> n: victims, LRU leaf first; pool lock held"),
    FAST(kv_lru_path_victim, "kv_lru_path_victim(key_lo, pinned, keep) -> idx | -1: LRU leaf on a key's probe path; pool lock held"),
    FAST(kv_lru_check, "kv_lru_check() -> (problems, first_problem, on_lists, leaves)"),
    FAST(kv_purge, "kv_purge(start, budget) -> (next_start, freed): bounded tombstone purge; pool lock held"),
    FAST(kv_evict_free, "kv_evict_free(hdr, rec_off, one, idx) -> (freed, errors): remove EVICTING victims and free their (marked) slots, one by one, crash-safe; pool lock held"),
    FAST(write_blocks, "write_blocks(offsets, src, block_bytes, nt=None) -> blocks written: block i of src to offsets[i]; flushed; stops before a block once write_deadline_ns passed"),
    FAST(read_blocks, "read_blocks(offsets, dst, block_bytes): offsets[i] to block i of dst"),
    FAST(flush, "flush(off, length): write back the cache lines of a range, then fence"),
    FAST(invalidate, "invalidate(off, length): drop the cache lines of a range"),
    FAST(write, "write(off, buffer, nt=None): copy into the pool; flushed on return"),
    FAST(zero, "zero(off, length, nt=None): zero a range; flushed on return"),
    FAST(read, "read(off, length) -> bytes"),
    FAST(readinto, "readinto(off, buffer) -> int: copy out of the pool"),
    FAST(view, "view(off, length, writable=False) -> memoryview (zero-copy; under CXLKV_NONCOHERENT=1 it shows the emulated cache, read-only)"),
    {"from_buffer", (PyCFunction)Mapping_from_buffer, METH_O | METH_CLASS,
     "from_buffer(obj) -> Mapping over an existing buffer (formatting without files, tests)"},
    {"close", (PyCFunction)Mapping_close, METH_NOARGS, "unmap; refused while views are alive"},
    {"host_memory", (PyCFunction)Mapping_host_memory, METH_NOARGS,
     "this mapping is host memory (the host lock file): never under the non-coherence emulation"},
    {"set_guard", (PyCFunction)Mapping_set_guard, METH_O,
     "set_guard(fn or None): called (GIL held) before any write once write_deadline_ns has "
     "passed; it proves the writer fresh or raises"},
    {"section_begin", (PyCFunction)Mapping_section_begin, METH_NOARGS,
     "count a section of the attached node in flight; False (nothing counted) once the "
     "write deadline is the fenced sentinel 1"},
    {"section_end", (PyCFunction)Mapping_section_end, METH_NOARGS,
     "end a section begun with section_begin"},
    {"nc_stats", (PyCFunction)Mapping_nc_stats, METH_NOARGS,
     "non-coherence emulation counters, or None when coherent"},
    {"__enter__", (PyCFunction)Mapping_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)Mapping_exit, METH_VARARGS, NULL},
    {NULL},
};

static PyTypeObject MappingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cxlkv._core._native.Mapping",
    .tp_basicsize = sizeof(Mapping),
    .tp_dealloc = (destructor)Mapping_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Mapping(fd, size, writable=True, populate=False, align=0, offset=0): a pool mapped MAP_SHARED",
    .tp_methods = Mapping_methods,
    .tp_getset = Mapping_getset,
    .tp_new = Mapping_new,
};

/* ------------------------------------------------------------------ */
/* module functions                                                     */

/* Test hooks at named sites: CXLKV_CRASH_AT=site:N SIGKILLs the process the
 * Nth time it passes `site` (a death); CXLKV_PAUSE_AT=site:N SIGSTOPs it
 * there instead (a stall: the test judges, reaps and SIGCONTs it). */
struct site_hook {
    int parsed;
    char site[64];
    long long left;       /* passes of `site` before the hook fires */
};
static struct site_hook crash, pause_at;

static int
site_hook_fires(struct site_hook *h, const char *env, const char *site)
{
    if (!h->parsed) {
        h->parsed = 1;
        const char *e = getenv(env);
        const char *colon = e ? strrchr(e, ':') : NULL;
        if (colon && (size_t)(colon - e) < sizeof(h->site)) {
            memcpy(h->site, e, (size_t)(colon - e));
            h->left = atoll(colon + 1);
        }
    }
    return h->left > 0 && !strcmp(site, h->site) &&
           __atomic_sub_fetch(&h->left, 1, __ATOMIC_SEQ_CST) == 0;
}

void
cxlkv_crashpoint(const char *site)
{
    if (site_hook_fires(&crash, "CXLKV_CRASH_AT", site))
        raise(SIGKILL);
    if (site_hook_fires(&pause_at, "CXLKV_PAUSE_AT", site))
        raise(SIGSTOP);
}

static PyObject *
mod_crashpoint(PyObject *self, PyObject *arg)
{
    (void)self;
    const char *site = PyUnicode_AsUTF8(arg);
    if (!site)
        return NULL;
    cxlkv_crashpoint(site);
    Py_RETURN_NONE;
}

static PyObject *
mod_fence(PyObject *self, PyObject *Py_UNUSED(ignored))
{
    (void)self;
    cxlkv_mfence();
    Py_RETURN_NONE;
}

static PyObject *
mod_sfence(PyObject *self, PyObject *Py_UNUSED(ignored))
{
    (void)self;
    cxlkv_sfence();
    Py_RETURN_NONE;
}

static PyObject *
mod_cpu_info(PyObject *self, PyObject *Py_UNUSED(ignored))
{
    (void)self;
    return Py_BuildValue("{s:O,s:O,s:O,s:O,s:O,s:s,s:s}",
                         "clflush", cxlkv_cpu.has_clflush ? Py_True : Py_False,
                         "clflushopt", cxlkv_cpu.has_clflushopt ? Py_True : Py_False,
                         "clwb", cxlkv_cpu.has_clwb ? Py_True : Py_False,
                         "avx2", cxlkv_cpu.has_avx2 ? Py_True : Py_False,
                         "avx512f", cxlkv_cpu.has_avx512f ? Py_True : Py_False,
                         "flush", cxlkv_flush_name(cxlkv_cpu.flush),
                         "invalidate", cxlkv_flush_name(cxlkv_cpu.invalidate));
}

static PyObject *
mod_set_error_types(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *range, *corrupt;
    if (!PyArg_ParseTuple(args, "O!O!:set_error_types", &PyType_Type, &range, &PyType_Type,
                          &corrupt))
        return NULL;
    if (!PyType_IsSubtype((PyTypeObject *)range, (PyTypeObject *)PyExc_IndexError) ||
        !PyType_IsSubtype((PyTypeObject *)corrupt, (PyTypeObject *)PyExc_ValueError)) {
        PyErr_SetString(PyExc_TypeError, "range error type must subclass IndexError, "
                                         "corrupt error type ValueError");
        return NULL;
    }
    Py_INCREF(range);
    Py_XSETREF(RangeError, range);
    Py_INCREF(corrupt);
    Py_XSETREF(cxlkv_CorruptError, corrupt);
    Py_RETURN_NONE;
}

/* layout() -> {struct: {"size": n, "fields": {name: (offset, size)}}} from offsetof() */
#define FIELD(d, S, f)                                                                   \
    do {                                                                                 \
        PyObject *t_ = Py_BuildValue("(nn)", (Py_ssize_t)offsetof(struct S, f),         \
                                     (Py_ssize_t)sizeof(((struct S *)0)->f));            \
        if (!t_ || PyDict_SetItemString(d, #f, t_) < 0) {                                \
            Py_XDECREF(t_);                                                              \
            goto fail;                                                                   \
        }                                                                                \
        Py_DECREF(t_);                                                                   \
    } while (0)

static int
add_struct(PyObject *out, const char *name, Py_ssize_t size, PyObject *fields)
{
    PyObject *d = Py_BuildValue("{s:n,s:O}", "size", size, "fields", fields);
    if (!d)
        return -1;
    int r = PyDict_SetItemString(out, name, d);
    Py_DECREF(d);
    return r;
}

static PyObject *
mod_layout(PyObject *self, PyObject *Py_UNUSED(ignored))
{
    (void)self;
    PyObject *out = PyDict_New(), *f = NULL;
    if (!out)
        return NULL;

    if (!(f = PyDict_New()))
        goto fail;
    FIELD(f, cxlkv_superblock, magic);
    FIELD(f, cxlkv_superblock, version);
    FIELD(f, cxlkv_superblock, sb_size);
    FIELD(f, cxlkv_superblock, seq);
    FIELD(f, cxlkv_superblock, compat);
    FIELD(f, cxlkv_superblock, incompat);
    FIELD(f, cxlkv_superblock, ro_compat);
    FIELD(f, cxlkv_superblock, uuid);
    FIELD(f, cxlkv_superblock, pool_size);
    FIELD(f, cxlkv_superblock, ctime_ns);
    FIELD(f, cxlkv_superblock, sync_mode);
    FIELD(f, cxlkv_superblock, max_nodes);
    FIELD(f, cxlkv_superblock, chunk_size);
    FIELD(f, cxlkv_superblock, lease_ms);
    FIELD(f, cxlkv_superblock, hash_slots);
    FIELD(f, cxlkv_superblock, hash_max_load_pct);
    FIELD(f, cxlkv_superblock, flags);
    FIELD(f, cxlkv_superblock, nchunks);
    FIELD(f, cxlkv_superblock, regions);
    FIELD(f, cxlkv_superblock, tenant_secret);
    FIELD(f, cxlkv_superblock, label);
    FIELD(f, cxlkv_superblock, creator);
    FIELD(f, cxlkv_superblock, grace_ms);
    FIELD(f, cxlkv_superblock, reserved);
    FIELD(f, cxlkv_superblock, checksum);
    if (add_struct(out, "superblock", sizeof(struct cxlkv_superblock), f) < 0)
        goto fail;
    Py_CLEAR(f);

    if (!(f = PyDict_New()))
        goto fail;
    FIELD(f, cxlkv_region, off);
    FIELD(f, cxlkv_region, size);
    if (add_struct(out, "region", sizeof(struct cxlkv_region), f) < 0)
        goto fail;
    Py_CLEAR(f);

    if (!(f = PyDict_New()))
        goto fail;
    FIELD(f, cxlkv_node, control);
    FIELD(f, cxlkv_node, heartbeat);
    FIELD(f, cxlkv_node, claim_token);
    FIELD(f, cxlkv_node, grant_token);
    FIELD(f, cxlkv_node, ack_epoch);
    FIELD(f, cxlkv_node, line0_pad);
    FIELD(f, cxlkv_node, pid);
    FIELD(f, cxlkv_node, start_time_ns);
    FIELD(f, cxlkv_node, attach_time_ns);
    FIELD(f, cxlkv_node, format_version);
    FIELD(f, cxlkv_node, flags);
    FIELD(f, cxlkv_node, boot_id);
    FIELD(f, cxlkv_node, hostname);
    FIELD(f, cxlkv_node, sw_version);
    FIELD(f, cxlkv_node, pidns);
    FIELD(f, cxlkv_node, ident_epoch);
    FIELD(f, cxlkv_node, reserved);
    FIELD(f, cxlkv_node, mgr_control);
    FIELD(f, cxlkv_node, mgr_grant_token);
    FIELD(f, cxlkv_node, line7_pad);
    if (add_struct(out, "node", sizeof(struct cxlkv_node), f) < 0)
        goto fail;
    Py_CLEAR(f);

    if (!(f = PyDict_New()))
        goto fail;
    FIELD(f, cxlkv_lock_hdr, next_ticket);
    FIELD(f, cxlkv_lock_hdr, line0_pad);
    FIELD(f, cxlkv_lock_hdr, now_serving);
    FIELD(f, cxlkv_lock_hdr, owner);
    FIELD(f, cxlkv_lock_hdr, acquisitions);
    FIELD(f, cxlkv_lock_hdr, line1_pad);
    FIELD(f, cxlkv_lock_hdr, mgr_token);
    FIELD(f, cxlkv_lock_hdr, mgr_epoch);
    FIELD(f, cxlkv_lock_hdr, mgr_heartbeat);
    FIELD(f, cxlkv_lock_hdr, mgr_pid);
    FIELD(f, cxlkv_lock_hdr, mgr_boot_id);
    FIELD(f, cxlkv_lock_hdr, mgr_hostname);
    FIELD(f, cxlkv_lock_hdr, reserved);
    if (add_struct(out, "lock_hdr", sizeof(struct cxlkv_lock_hdr), f) < 0)
        goto fail;
    Py_CLEAR(f);

    if (!(f = PyDict_New()))
        goto fail;
    FIELD(f, cxlkv_lock_entry, state);
    FIELD(f, cxlkv_lock_entry, ticket);
    FIELD(f, cxlkv_lock_entry, epoch);
    FIELD(f, cxlkv_lock_entry, req_seq);
    FIELD(f, cxlkv_lock_entry, release_seq);
    FIELD(f, cxlkv_lock_entry, freeing);
    FIELD(f, cxlkv_lock_entry, line0_pad);
    FIELD(f, cxlkv_lock_entry, grant_seq);
    FIELD(f, cxlkv_lock_entry, revoke_seq);
    FIELD(f, cxlkv_lock_entry, grant_epoch);
    FIELD(f, cxlkv_lock_entry, line1_pad);
    if (add_struct(out, "lock_entry", sizeof(struct cxlkv_lock_entry), f) < 0)
        goto fail;
    Py_CLEAR(f);

    if (!(f = PyDict_New()))
        goto fail;
    FIELD(f, cxlkv_chunk, control);
    FIELD(f, cxlkv_chunk, owner);
    FIELD(f, cxlkv_chunk, slot_size);
    FIELD(f, cxlkv_chunk, nslots);
    FIELD(f, cxlkv_chunk, nchunks);
    FIELD(f, cxlkv_chunk, pad);
    FIELD(f, cxlkv_chunk, alloc_bits);
    FIELD(f, cxlkv_chunk, pub_bits);
    FIELD(f, cxlkv_chunk, dirty_bits);
    if (add_struct(out, "chunk", sizeof(struct cxlkv_chunk), f) < 0)
        goto fail;
    Py_CLEAR(f);

    if (!(f = PyDict_New()))
        goto fail;
    FIELD(f, cxlkv_heap, hazard);
    FIELD(f, cxlkv_heap, reserved);
    if (add_struct(out, "heap", sizeof(struct cxlkv_heap), f) < 0)
        goto fail;
    Py_CLEAR(f);

    if (!(f = PyDict_New()))
        goto fail;
    FIELD(f, cxlkv_hash_entry, ctl);
    FIELD(f, cxlkv_hash_entry, key_lo);
    FIELD(f, cxlkv_hash_entry, key_hi);
    FIELD(f, cxlkv_hash_entry, payload);
    FIELD(f, cxlkv_hash_entry, length);
    FIELD(f, cxlkv_hash_entry, ns);
    FIELD(f, cxlkv_hash_entry, tenant);
    FIELD(f, cxlkv_hash_entry, parent);
    FIELD(f, cxlkv_hash_entry, children);
    FIELD(f, cxlkv_hash_entry, owner);
    FIELD(f, cxlkv_hash_entry, lru);
    if (add_struct(out, "hash_entry", sizeof(struct cxlkv_hash_entry), f) < 0)
        goto fail;
    Py_CLEAR(f);

    if (!(f = PyDict_New()))
        goto fail;
    FIELD(f, cxlkv_kv_hdr, magic);
    FIELD(f, cxlkv_kv_hdr, max_namespaces);
    FIELD(f, cxlkv_kv_hdr, max_tenants);
    FIELD(f, cxlkv_kv_hdr, pins_per_node);
    FIELD(f, cxlkv_kv_hdr, ring_per_node);
    FIELD(f, cxlkv_kv_hdr, ns_off);
    FIELD(f, cxlkv_kv_hdr, tenant_off);
    FIELD(f, cxlkv_kv_hdr, node_off);
    FIELD(f, cxlkv_kv_hdr, node_stride);
    FIELD(f, cxlkv_kv_hdr, line0_pad);
    FIELD(f, cxlkv_kv_hdr, live);
    FIELD(f, cxlkv_kv_hdr, tombstones);
    FIELD(f, cxlkv_kv_hdr, evictions);
    FIELD(f, cxlkv_kv_hdr, evicted_bytes);
    FIELD(f, cxlkv_kv_hdr, line1_pad);
    FIELD(f, cxlkv_kv_hdr, lru_off);
    FIELD(f, cxlkv_kv_hdr, lru_dirty);
    FIELD(f, cxlkv_kv_hdr, lru_leaves);
    FIELD(f, cxlkv_kv_hdr, lru_rebuilds);
    FIELD(f, cxlkv_kv_hdr, purge_cursor);
    FIELD(f, cxlkv_kv_hdr, line2_pad);
    FIELD(f, cxlkv_kv_hdr, lru_lists);
    FIELD(f, cxlkv_kv_hdr, reserved);
    if (add_struct(out, "kv_hdr", sizeof(struct cxlkv_kv_hdr), f) < 0)
        goto fail;
    Py_CLEAR(f);

    if (!(f = PyDict_New()))
        goto fail;
    FIELD(f, cxlkv_kv_stats, lookups);
    FIELD(f, cxlkv_kv_stats, hit_blocks);
    FIELD(f, cxlkv_kv_stats, miss_blocks);
    FIELD(f, cxlkv_kv_stats, stored_blocks);
    FIELD(f, cxlkv_kv_stats, present_blocks);
    FIELD(f, cxlkv_kv_stats, stored_bytes);
    FIELD(f, cxlkv_kv_stats, loaded_blocks);
    FIELD(f, cxlkv_kv_stats, loaded_bytes);
    if (add_struct(out, "kv_stats", sizeof(struct cxlkv_kv_stats), f) < 0)
        goto fail;
    Py_CLEAR(f);

    if (!(f = PyDict_New()))
        goto fail;
    FIELD(f, cxlkv_kv_ns, name);
    FIELD(f, cxlkv_kv_ns, state);
    FIELD(f, cxlkv_kv_ns, hash_kind);
    FIELD(f, cxlkv_kv_ns, block_tokens);
    FIELD(f, cxlkv_kv_ns, reserved0);
    FIELD(f, cxlkv_kv_ns, block_bytes);
    FIELD(f, cxlkv_kv_ns, digest);
    FIELD(f, cxlkv_kv_ns, blocks);
    FIELD(f, cxlkv_kv_ns, evictions);
    FIELD(f, cxlkv_kv_ns, evicted_bytes);
    FIELD(f, cxlkv_kv_ns, stats);
    if (add_struct(out, "kv_ns", sizeof(struct cxlkv_kv_ns), f) < 0)
        goto fail;
    Py_CLEAR(f);

    if (!(f = PyDict_New()))
        goto fail;
    FIELD(f, cxlkv_kv_tenant, salt);
    FIELD(f, cxlkv_kv_tenant, state);
    FIELD(f, cxlkv_kv_tenant, reserved0);
    FIELD(f, cxlkv_kv_tenant, quota);
    FIELD(f, cxlkv_kv_tenant, used);
    FIELD(f, cxlkv_kv_tenant, blocks);
    FIELD(f, cxlkv_kv_tenant, rejected);
    FIELD(f, cxlkv_kv_tenant, reserved1);
    if (add_struct(out, "kv_tenant", sizeof(struct cxlkv_kv_tenant), f) < 0)
        goto fail;
    Py_CLEAR(f);

    if (!(f = PyDict_New()))
        goto fail;
    FIELD(f, cxlkv_kv_node, ring_head);
    FIELD(f, cxlkv_kv_node, line0_pad);
    FIELD(f, cxlkv_kv_node, ring_drained);
    FIELD(f, cxlkv_kv_node, line1_pad);
    if (add_struct(out, "kv_node", sizeof(struct cxlkv_kv_node), f) < 0)
        goto fail;
    Py_CLEAR(f);

    if (!(f = PyDict_New()))
        goto fail;
    FIELD(f, cxlkv_journal_hdr, magic);
    FIELD(f, cxlkv_journal_hdr, records_per_node);
    FIELD(f, cxlkv_journal_hdr, rec_size);
    FIELD(f, cxlkv_journal_hdr, ring_off);
    FIELD(f, cxlkv_journal_hdr, ring_stride);
    FIELD(f, cxlkv_journal_hdr, max_nodes);
    FIELD(f, cxlkv_journal_hdr, line0_pad);
    FIELD(f, cxlkv_journal_hdr, next_seq);
    FIELD(f, cxlkv_journal_hdr, line1_pad);
    if (add_struct(out, "journal_hdr", sizeof(struct cxlkv_journal_hdr), f) < 0)
        goto fail;
    Py_CLEAR(f);

    if (!(f = PyDict_New()))
        goto fail;
    FIELD(f, cxlkv_journal_ring, head);
    FIELD(f, cxlkv_journal_ring, writer);
    FIELD(f, cxlkv_journal_ring, pad);
    if (add_struct(out, "journal_ring", sizeof(struct cxlkv_journal_ring), f) < 0)
        goto fail;
    Py_CLEAR(f);

    if (!(f = PyDict_New()))
        goto fail;
    FIELD(f, cxlkv_journal_rec, seq);
    FIELD(f, cxlkv_journal_rec, key_lo);
    FIELD(f, cxlkv_journal_rec, key_hi);
    FIELD(f, cxlkv_journal_rec, parent_lo);
    FIELD(f, cxlkv_journal_rec, parent_hi);
    FIELD(f, cxlkv_journal_rec, length);
    FIELD(f, cxlkv_journal_rec, ns);
    FIELD(f, cxlkv_journal_rec, tenant);
    FIELD(f, cxlkv_journal_rec, time_us);
    FIELD(f, cxlkv_journal_rec, entry);
    FIELD(f, cxlkv_journal_rec, op);
    FIELD(f, cxlkv_journal_rec, reserved);
    if (add_struct(out, "journal_rec", sizeof(struct cxlkv_journal_rec), f) < 0)
        goto fail;
    Py_CLEAR(f);
    return out;
fail:
    Py_XDECREF(f);
    Py_DECREF(out);
    return NULL;
}

static PyObject *
mod_constants(PyObject *self, PyObject *Py_UNUSED(ignored))
{
    (void)self;
#define C(name) {#name, (unsigned long long)CXLKV_##name}
    static const struct { const char *name; unsigned long long v; } tab[] = {
        C(FORMAT_VERSION), C(SB_SIZE), C(SB_COPIES), C(SYNC_CAS), C(SYNC_MANAGER),
        C(REGION_NODES), C(REGION_LOCKS), C(REGION_BITMAP), C(REGION_HEAPS), C(REGION_HASH),
        C(REGION_DATA), C(REGION_KV), C(REGION_COUNT), C(NODE_SIZE), C(LOCK_HDR_SIZE),
        C(LOCK_ENTRY_SIZE), C(HEAP_SIZE), C(CHUNK_DESC_SIZE), C(HASH_ENTRY_SIZE),
        C(NODE_FREE), C(NODE_CLAIMED), C(NODE_ATTACHED), C(NODE_FENCED),
        C(LOCK_IDLE), C(LOCK_WAITING), C(LOCK_LOCKED), C(LOCK_ABANDONED),
        C(CHUNK_FREE), C(CHUNK_HEAD), C(CHUNK_TAIL), C(CHUNK_RELEASING), C(SLAB_MAX_SLOTS),
        C(HEAP_HAZARDS),
        C(FEATURE_COMPAT_KV), C(FEATURE_COMPAT_SUPP), C(FEATURE_INCOMPAT_SUPP),
        C(FEATURE_INCOMPAT_KV_LRU), C(KV_LRU_LISTS),
        C(FEATURE_RO_COMPAT_SUPP),
        C(KV_EMPTY), C(KV_WRITING), C(KV_PENDING), C(KV_PUBLISHED), C(KV_EVICTING),
        C(KV_TOMBSTONE), C(KV_MAGIC), C(KV_HDR_SIZE), C(KV_NS_SIZE), C(KV_TENANT_SIZE),
        C(KV_NS_NAME), C(KV_NSTATS), C(KV_REC_FREE), C(KV_REC_ACTIVE),
        C(KV_HASH_XXH3_128), C(KV_HASH_SHA256_CBOR),
        C(FEATURE_INCOMPAT_JOURNAL), C(JOURNAL_MAGIC), C(JOURNAL_REC_SIZE), C(JOURNAL_STORED),
        C(JOURNAL_EVICTED), C(JOURNAL_NS_CLEARED),
    };
#undef C
    PyObject *d = PyDict_New(), *v;
    if (!d)
        return NULL;
    v = PyBytes_FromStringAndSize(CXLKV_MAGIC, 8);
    if (!v || PyDict_SetItemString(d, "MAGIC", v) < 0)
        goto fail;
    Py_DECREF(v);
    for (size_t i = 0; i < sizeof tab / sizeof tab[0]; i++) {
        v = PyLong_FromUnsignedLongLong(tab[i].v);
        if (!v || PyDict_SetItemString(d, tab[i].name, v) < 0)
            goto fail;
        Py_DECREF(v);
    }
    return d;
fail:
    Py_XDECREF(v);
    Py_DECREF(d);
    return NULL;
}

/* gather(blocks, dst, block_bytes) -> n: item i of the sequence `blocks`, a
 * buffer of block_bytes or None, to block i of dst, with the streaming copy
 * reads out of the pool use (the DRAM hot tier's hits). */
static PyObject *
mod_gather(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    unsigned long long bb;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "gather(blocks, dst, block_bytes)");
        return NULL;
    }
    bb = PyLong_AsUnsignedLongLong(args[2]);
    if (bb == (unsigned long long)-1 && PyErr_Occurred())
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
                         b[got].len, bb);
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

static PyMethodDef module_methods[] = {
    {"fence", mod_fence, METH_NOARGS, "full memory fence (mfence)"},
    {"gather", (PyCFunction)(void (*)(void))mod_gather, METH_FASTCALL,
     "gather(blocks, dst, block_bytes) -> n: each buffer (or None) to its block of dst"},
    {"kv_chain", (PyCFunction)(void (*)(void))mod_kv_chain, METH_FASTCALL,
     "kv_chain(tokens_u32, block_tokens, out) -> blocks: xxh3-128 chain of block hashes"},
    {"kv_keys", (PyCFunction)(void (*)(void))mod_kv_keys, METH_FASTCALL,
     "kv_keys(hashes, hash_len, prefix, out) -> n: pool keys xxh3-128(prefix || hash)"},
    {"crashpoint", mod_crashpoint, METH_O,
     "crashpoint(site): SIGKILL this process at the Nth pass when CXLKV_CRASH_AT=site:N, "
     "SIGSTOP it when CXLKV_PAUSE_AT=site:N"},
    {"sfence", mod_sfence, METH_NOARGS, "store fence"},
    {"cpu_info", mod_cpu_info, METH_NOARGS, "CPU features and the flush/invalidate instructions in use"},
    {"layout", mod_layout, METH_NOARGS, "on-media structure offsets and sizes, from the C header"},
    {"constants", mod_constants, METH_NOARGS, "on-media constants, from the C header"},
    {"set_error_types", mod_set_error_types, METH_VARARGS,
     "set_error_types(range_error, corrupt_error): the exception classes raised for "
     "out-of-range offsets and for impossible pool metadata"},
    {NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "cxlkv._core._native",
    "cxlkv C core: pool mapping, atomics, cache maintenance, copies.", -1, module_methods,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    cxlkv_cpu_init();
    if (PyType_Ready(&MappingType) < 0 || PyType_Ready(&SpanType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&native_module);
    if (!m)
        return NULL;
    RangeError = PyErr_NewException("cxlkv._core._native.RangeError", PyExc_IndexError, NULL);
    if (!RangeError)
        goto fail;
    Py_INCREF(RangeError);
    if (PyModule_AddObject(m, "RangeError", RangeError) < 0)
        goto fail;
    cxlkv_CorruptError = Py_NewRef(PyExc_ValueError);
    Py_INCREF(&MappingType);
    if (PyModule_AddObject(m, "Mapping", (PyObject *)&MappingType) < 0)
        goto fail;
    if (PyModule_AddIntConstant(m, "ABI_VERSION", CXLKV_NATIVE_ABI) < 0)
        goto fail;
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
