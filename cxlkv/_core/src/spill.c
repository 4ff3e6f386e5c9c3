/*
 * The spill tier's read path: verify and copy a run of slots of a spill slot
 * file (cxlkv/kv/tiers/spill/files.py) into the caller's buffers, one call,
 * the GIL released.
 *
 * spill_read(fd, meta, hdr_off, nslots, data_off, slot_bytes, slots, keys,
 *            ns_digest, length, bufs, read_bytes, snap=None, data=None)
 *     -> (ok, status, errno)
 *
 *   fd          the slot file, open for reading
 *   meta        a buffer of the file's mapped metadata (its mmap); the slot
 *               headers lie at hdr_off, nslots x 72 bytes (spill_format.h)
 *   data_off    where slot 0's payload lies in the file; slot s's payload
 *               at data_off + s * slot_bytes
 *   slots       uint64 buffer: the slots to read, in order
 *   keys        len(slots) x 16 bytes: the key each slot must hold
 *   ns_digest   16 bytes: the namespace each block must be of
 *   length      the payload bytes of every block (<= slot_bytes)
 *   bufs        len(slots) writable contiguous buffers of >= length bytes:
 *               block i is read into the first length bytes of bufs[i]
 *   read_bytes  at most this many bytes per preadv (adjacent slots of
 *               full-slot payloads are read together up to it; the hash of
 *               each block then runs over bytes still in cache)
 *   snap        None, or a writable buffer of >= 64 bytes: the header of the
 *               slot the call stopped at, as it was checked (for the
 *               caller's compare-and-free of a damaged slot)
 *
 *   data        None (preadv only), or a buffer of a mapping of the file
 *               from offset 0 (read-only, shared; its length may be short
 *               of the file's): payloads inside it are copied out of it with
 *               their checksum in the same pass (below)
 *
 * For each slot in order: the header is copied out of the mapping (64
 * bytes: the checksummed header and its sum) and checked - magic, version,
 * state LIVE, header checksum, key, namespace, length; the payload is read
 * (preadv, short reads continued); the header is compared with the copy
 * again (a slot freed or rewritten meanwhile is a miss; checked first), then
 * the bytes read and the payload's xxh3-64 against the header's.  The call
 * stops at the first slot that fails and returns how many leading slots are
 * good blocks, the failing slot's status (SPILL_OK when all are) and an
 * errno for SPILL_IOERR.  A block is returned only when every check passed:
 * a torn or damaged slot is never a wrong block.  Nothing in the file is
 * written.
 *
 * The mapped path: each payload of a unit is copied out of `data` 64 KiB
 * at a time and hashed while the piece is in cache (spill_copysum.h).  A
 * raw pread copies as fast as this copy, but leaves the hash a second pass
 * over the bytes from memory.  Pages not mapped yet are faulted in by the
 * copy (the kernel maps a fault's neighbours with it, 64 KiB by default); a
 * MADV_POPULATE_READ of the unit first, as this path once did, made it
 * slower both for pages mapped already (a walk of 512 page-table entries
 * per 2 MiB: 11 against 17-21 GB/s, 2026-12-07) and for pages touched for
 * the first time (the bench's store read 0.35x against 0.58x a raw read).
 * A file cut short (or a disk failing) under the copy raises SIGBUS in it:
 * a handler (installed once, chaining to the one before it for any other
 * fault) jumps back out of it, and the rest of the unit is read with
 * preadv, which says what went wrong (cut short, an I/O error).
 *
 * Bounds, before anything is read: the header area lies inside meta; every
 * slot < nslots; every payload offset fits off_t (data_off + nslots x
 * slot_bytes, overflow-checked); every buffer holds length bytes; length <=
 * slot_bytes.  The header area is shared with writers of other processes
 * (under DIR/.usage's flock, which readers do not take): it is only copied
 * and compared, never trusted across the read.  The meta buffer is held
 * for the call, so the mapping outlives it.
 */
#include "core.h"
#include "spill_format.h"

#include <endian.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "spill_copysum.h"

/* per-slot statuses (spill_layout()["status"]) */
enum {
    SPILL_OK = 0,
    SPILL_GONE,       /* not LIVE, or LIVE with another key: freed or reused (a miss) */
    SPILL_TORN,       /* LIVE but magic, version or header checksum wrong (damaged) */
    SPILL_MISMATCH,   /* the key's header, another namespace or length (damaged) */
    SPILL_SHORT,      /* the payload is cut short (the file truncated) */
    SPILL_IOERR,      /* preadv failed (errno returned; a miss) */
    SPILL_CHANGED,    /* the header changed while the payload was read (a miss) */
    SPILL_BADSUM,     /* the payload's checksum is wrong (damaged) */
};

#define HDR_BYTES  ((uint64_t)sizeof(struct cxlkv_spill_slot))
#define SNAP       CXLKV_SPILL_SNAP
#define HSUM_OFF   offsetof(struct cxlkv_spill_slot, hsum)
#define IOV_CAP    64

uint64_t cxlkv_spill_xxh3_avx2(const void *p, size_t n);     /* spill_xxh3_avx2.c */
uint64_t cxlkv_spill_xxh3_avx512(const void *p, size_t n);   /* spill_xxh3_avx512.c */
uint64_t cxlkv_spill_copysum_avx2(void *dst, const void *src, size_t n);
uint64_t cxlkv_spill_copysum_avx512(void *dst, const void *src, size_t n);

/* xxh3-64 of a payload with the widest vector unit the CPU has (inline
 * xxhash here: SSE2 on x86-64) */
static uint64_t
payload_sum(const void *p, size_t n)
{
#if defined(__x86_64__) && defined(__GNUC__)
    if (cxlkv_cpu.has_avx512f)
        return cxlkv_spill_xxh3_avx512(p, n);
    if (cxlkv_cpu.has_avx2)
        return cxlkv_spill_xxh3_avx2(p, n);
#endif
    return XXH3_64bits(p, n);
}

/* copy n bytes to dst and return their xxh3-64, in one pass */
static uint64_t
payload_copysum(void *dst, const void *src, size_t n)
{
#if defined(__x86_64__) && defined(__GNUC__)
    if (cxlkv_cpu.has_avx512f)
        return cxlkv_spill_copysum_avx512(dst, src, n);
    if (cxlkv_cpu.has_avx2)
        return cxlkv_spill_copysum_avx2(dst, src, n);
#endif
    return copysum(dst, src, n);
}

/* -- SIGBUS out of a mapped copy -------------------------------------------------------
 * The thread's armed jump and the mapping it covers (initial-exec TLS: read
 * in the handler without any allocation). */
static __thread sigjmp_buf *volatile bus_jump __attribute__((tls_model("initial-exec")));
static __thread const char *bus_lo __attribute__((tls_model("initial-exec")));
static __thread const char *bus_hi __attribute__((tls_model("initial-exec")));
static struct sigaction bus_prev;
static pthread_once_t bus_once = PTHREAD_ONCE_INIT;
static atomic_int bus_ready;                /* 1: installed; -1: not, pread only */

static void
bus_handler(int sig, siginfo_t *si, void *uc)
{
    sigjmp_buf *jb = bus_jump;
    const char *a = si ? (const char *)si->si_addr : NULL;
    if (jb && a >= bus_lo && a < bus_hi) {
        bus_jump = NULL;
        siglongjmp(*jb, 1);
    }
    /* not ours: whoever handled it before, else the default (death) */
    if (bus_prev.sa_flags & SA_SIGINFO) {
        if (bus_prev.sa_sigaction)
            bus_prev.sa_sigaction(sig, si, uc);
        return;
    }
    if (bus_prev.sa_handler != SIG_DFL && bus_prev.sa_handler != SIG_IGN) {
        bus_prev.sa_handler(sig);
        return;
    }
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(sig, &dfl, NULL);
    raise(sig);                             /* delivered when this returns */
}

static void
bus_install(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = bus_handler;
    sa.sa_flags = SA_SIGINFO | SA_RESTART | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    atomic_store(&bus_ready, sigaction(SIGBUS, &sa, &bus_prev) == 0 ? 1 : -1);
}

/* Copy payloads of slots [i, j) (adjacent, or one) at file offset `off`
 * out of the caller's mapping of the file (`data`, `data_len` bytes from
 * offset 0), each hashed in the same pass (into sums[]); how many leading
 * slots were copied - the caller preads the rest (0: none). */
static Py_ssize_t
map_read(const char *data, uint64_t data_len, uint64_t off, char **dst, uint64_t *sums,
         Py_ssize_t n, uint64_t length)
{
    uint64_t len = (uint64_t)n * length, end;
    if (!data || n <= 0 || length == 0 || __builtin_add_overflow(off, len, &end) ||
        end > data_len)
        return 0;                           /* past the mapping (a shorter file): preadv */
    pthread_once(&bus_once, bus_install);
    if (atomic_load(&bus_ready) != 1)
        return 0;
    uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE), base = off & ~(page - 1);
    cxlkv_crashpoint("spill.map");          /* tests: cut the file short here */
    const char *src = data + off;
    volatile Py_ssize_t done = 0;
    sigjmp_buf jb;
    if (sigsetjmp(jb, 1) == 0) {
        bus_lo = data + base;
        bus_hi = data + end;
        bus_jump = &jb;
        for (Py_ssize_t m = 0; m < n; m++) {
            sums[m] = payload_copysum(dst[m], src + (size_t)m * length, (size_t)length);
            done = m + 1;
        }
    }
    bus_jump = NULL;
    return done;
}

/* Copy slot's header out of the mapping into snap and check it against what
 * the caller asks for; *psum: the payload checksum it records. */
static int
check_header(const uint8_t *live, uint8_t *snap, const uint8_t *key, const uint8_t *ns,
             uint64_t length, uint64_t *psum)
{
    struct cxlkv_spill_slot h;
    memcpy(snap, live, SNAP);
    memcpy(&h, snap, SNAP);
    uint64_t hsum = le64toh(h.hsum);
    if (memcmp(h.magic, CXLKV_SPILL_MAGIC, 4) != 0 || h.version != CXLKV_SPILL_VERSION ||
        h.state != CXLKV_SPILL_LIVE || hsum != XXH3_64bits(snap, HSUM_OFF))
        return h.state == CXLKV_SPILL_LIVE ? SPILL_TORN : SPILL_GONE;
    if (memcmp(h.key, key, 16) != 0)
        return SPILL_GONE;
    if (memcmp(h.ns_digest, ns, 16) != 0 || le32toh(h.length) != length)
        return SPILL_MISMATCH;
    *psum = le64toh(h.psum);
    return SPILL_OK;
}

/* preadv all of iov[0..cnt) at off, short reads continued (iov is
 * consumed); the bytes read, and *err set when a read failed. */
static uint64_t
read_all(int fd, struct iovec *iov, int cnt, off_t off, int *err)
{
    uint64_t total = 0;
    while (cnt > 0) {
        ssize_t r = preadv(fd, iov, cnt, off);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            *err = errno;
            return total;
        }
        if (r == 0)
            return total;                     /* end of file: cut short */
        total += (uint64_t)r;
        off += r;
        while (cnt > 0 && (size_t)r >= iov->iov_len) {
            r -= (ssize_t)iov->iov_len;
            iov++;
            cnt--;
        }
        if (cnt > 0 && r > 0) {
            iov->iov_base = (char *)iov->iov_base + r;
            iov->iov_len -= (size_t)r;
        }
    }
    return total;
}

struct spill_req {
    int fd;
    const uint8_t *hdrs;        /* the slot headers in the mapping */
    uint64_t data_off, slot_bytes, length;
    const uint64_t *slots;      /* validated: < nslots */
    const uint8_t *keys, *ns;
    char **dst;
    uint8_t *snaps;             /* n x SNAP */
    uint64_t *psums;            /* n: the sums the headers record */
    uint64_t *sums;             /* n: the sums of the payloads copied from a mapping */
    const char *data;           /* the caller's mapping of the file, or NULL */
    uint64_t data_len;
    struct spill_unit *units;
    _Atomic Py_ssize_t limit;   /* the first unit known to fail: later ones are not started */
};

/* a unit: slots [first, first + n), adjacent full slots (one preadv); its
 * result: the good leading slots, the status of the one it stopped at */
struct spill_unit {
    Py_ssize_t first, n, good;
    int status, err;
};

/* Cut slots[0..n) into units: adjacent slots of full-slot payloads, up to
 * IOV_CAP of them and read_bytes bytes each (one slot at least). */
static Py_ssize_t
cut_units(const uint64_t *slots, Py_ssize_t n, uint64_t length, uint64_t slot_bytes,
          uint64_t read_bytes, struct spill_unit *units)
{
    Py_ssize_t nu = 0, i = 0;
    while (i < n) {
        Py_ssize_t j = i + 1;
        uint64_t bytes = length;
        while (j < n && j - i < IOV_CAP && length == slot_bytes && slots[j] == slots[j - 1] + 1 &&
               bytes + length <= read_bytes) {
            bytes += length;
            j++;
        }
        units[nu++] = (struct spill_unit){.first = i, .n = j - i};
        i = j;
    }
    return nu;
}

/* One unit (any thread; no Python): check the headers, read the payloads of
 * the leading slots whose headers check (one preadv), then for each compare
 * the header with its copy, the bytes read and the payload's checksum. */
static void
run_unit(void *ctx, Py_ssize_t u)
{
    struct spill_req *r = ctx;
    struct spill_unit *un = &r->units[u];
    struct iovec iov[IOV_CAP];
    Py_ssize_t i = un->first, end = un->first + un->n, j = i;
    int st = SPILL_OK;
    un->err = 0;
    for (; j < end; j++) {
        st = check_header(r->hdrs + r->slots[j] * HDR_BYTES, r->snaps + j * SNAP,
                          r->keys + j * 16, r->ns, r->length, &r->psums[j]);
        if (st != SPILL_OK)
            break;
        iov[j - i].iov_base = r->dst[j];
        iov[j - i].iov_len = (size_t)r->length;
    }
    if (j > i) {
        int e = 0;
        off_t off = (off_t)(r->data_off + r->slots[i] * r->slot_bytes);
        Py_ssize_t k = map_read(r->data, r->data_len, (uint64_t)off, r->dst + i, r->sums + i,
                                j - i, r->length);
        uint64_t got = (uint64_t)k * r->length;
        if (i + k < j)
            got += read_all(r->fd, iov + k, (int)(j - i - k), off + (off_t)got, &e);
        cxlkv_crashpoint("spill.read");       /* tests: a stall between read and checks */
        for (Py_ssize_t m = i; m < j; m++) {
            int bad = SPILL_OK;
            if (memcmp(r->hdrs + r->slots[m] * HDR_BYTES, r->snaps + m * SNAP, SNAP) != 0)
                bad = SPILL_CHANGED;
            else if (got < (uint64_t)(m - i + 1) * r->length) {
                bad = e ? SPILL_IOERR : SPILL_SHORT;
                un->err = e;
            } else if ((m < i + k ? r->sums[m] : payload_sum(r->dst[m], (size_t)r->length))
                       != r->psums[m])
                bad = SPILL_BADSUM;
            if (bad != SPILL_OK) {
                j = m;
                st = bad;
                break;
            }
        }
    }
    un->good = j - i;
    un->status = st;
    if (st != SPILL_OK) {                     /* later units need not be read */
        Py_ssize_t lim = atomic_load(&r->limit);
        while (u + 1 < lim && !atomic_compare_exchange_weak(&r->limit, &lim, u + 1))
            ;
    }
}

/* The verify-and-copy of a run (GIL released): its units on this thread and
 * the helpers (spill_pool.c); the good leading slots. */
static Py_ssize_t
spill_run(struct spill_req *r, Py_ssize_t nunits, int *status, int *err)
{
    atomic_init(&r->limit, nunits);
    cxlkv_spill_pool_run(run_unit, r, nunits, &r->limit);
    Py_ssize_t ok = 0, lim = atomic_load(&r->limit);
    for (Py_ssize_t u = 0; u < lim; u++) {
        ok += r->units[u].good;
        if (r->units[u].good < r->units[u].n) {
            *status = r->units[u].status;
            *err = r->units[u].err;
            return ok;
        }
    }
    *status = SPILL_OK;
    return ok;
}

PyObject *
mod_spill_read(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs_check(nargs, 12, 14, "spill_read") < 0)
        return NULL;
    long fdl = PyLong_AsLong(args[0]);
    if (fdl == -1 && PyErr_Occurred())
        return NULL;
    uint64_t hdr_off, nslots, data_off, slot_bytes, length, read_bytes;
    if (as_u64(args[2], &hdr_off, "hdr_off") < 0 || as_u64(args[3], &nslots, "nslots") < 0 ||
        as_u64(args[4], &data_off, "data_off") < 0 ||
        as_u64(args[5], &slot_bytes, "slot_bytes") < 0 ||
        as_u64(args[9], &length, "length") < 0 ||
        as_u64(args[11], &read_bytes, "read_bytes") < 0)
        return NULL;
    PyObject *snap_obj = nargs > 12 ? args[12] : Py_None;
    PyObject *data_obj = nargs > 13 ? args[13] : Py_None;

    Py_buffer meta = {0}, sl = {0}, keys = {0}, ns = {0}, snap = {0}, data = {0};
    Py_buffer *bufs = NULL;
    char **dst = NULL;
    uint8_t *snaps = NULL;
    uint64_t *psums = NULL, *sums = NULL;
    struct spill_unit *units = NULL;
    PyObject *seq = NULL, *res = NULL;
    Py_ssize_t n = 0, held = 0;

    if (fdl < 0 || fdl > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "spill_read: fd must be a file descriptor (>= 0)");
        return NULL;
    }
    int fd = (int)fdl;
    if (PyObject_GetBuffer(args[1], &meta, PyBUF_SIMPLE) < 0)
        return NULL;
    if (get_offsets(args[6], &sl, 0) < 0)
        goto done;
    n = sl.len / 8;
    if (PyObject_GetBuffer(args[7], &keys, PyBUF_C_CONTIGUOUS) < 0 ||
        PyObject_GetBuffer(args[8], &ns, PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    if (snap_obj != Py_None && PyObject_GetBuffer(snap_obj, &snap, PyBUF_WRITABLE |
                                                  PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    if (data_obj != Py_None && PyObject_GetBuffer(data_obj, &data, PyBUF_SIMPLE) < 0)
        goto done;

    /* bounds: the geometry, then every argument against it */
    uint64_t hdr_end, data_end;
    if (slot_bytes == 0 || length > slot_bytes) {
        PyErr_Format(PyExc_ValueError, "spill_read: length %llu must be <= slot_bytes %llu (> 0)",
                     (unsigned long long)length, (unsigned long long)slot_bytes);
        goto done;
    }
    if (__builtin_mul_overflow(nslots, HDR_BYTES, &hdr_end) ||
        __builtin_add_overflow(hdr_end, hdr_off, &hdr_end) || hdr_end > (uint64_t)meta.len) {
        PyErr_Format(PyExc_ValueError, "spill_read: %llu slot headers at %llu lie outside the "
                     "%zd mapped bytes", (unsigned long long)nslots,
                     (unsigned long long)hdr_off, meta.len);
        goto done;
    }
    if (__builtin_mul_overflow(nslots, slot_bytes, &data_end) ||
        __builtin_add_overflow(data_end, data_off, &data_end) || data_end > (uint64_t)INT64_MAX) {
        PyErr_SetString(PyExc_ValueError, "spill_read: the payload area overflows a file offset");
        goto done;
    }
    if (keys.len != n * 16 || ns.len != 16) {
        PyErr_Format(PyExc_ValueError, "spill_read: keys must be %zd x 16 bytes (got %zd) and "
                     "ns_digest 16 (got %zd)", n, keys.len, ns.len);
        goto done;
    }
    if (snap.obj && snap.len < (Py_ssize_t)SNAP) {
        PyErr_Format(PyExc_ValueError, "spill_read: snap must hold %d bytes", (int)SNAP);
        goto done;
    }
    const uint64_t *slots = (const uint64_t *)sl.buf;
    for (Py_ssize_t i = 0; i < n; i++)
        if (slots[i] >= nslots) {
            PyErr_Format(PyExc_ValueError, "spill_read: slot %llu out of range (%llu slots)",
                         (unsigned long long)slots[i], (unsigned long long)nslots);
            goto done;
        }
    seq = PySequence_Fast(args[10], "spill_read: bufs must be a sequence of buffers");
    if (!seq)
        goto done;
    if (PySequence_Fast_GET_SIZE(seq) != n) {
        PyErr_Format(PyExc_ValueError, "spill_read: %zd buffers for %zd slots",
                     PySequence_Fast_GET_SIZE(seq), n);
        goto done;
    }
    if (n > 0) {
        bufs = PyMem_Calloc((size_t)n, sizeof *bufs);
        dst = PyMem_Malloc((size_t)n * sizeof *dst);
        snaps = PyMem_Malloc((size_t)n * SNAP);
        psums = PyMem_Malloc((size_t)n * sizeof *psums);
        sums = PyMem_Malloc((size_t)n * sizeof *sums);
        units = PyMem_Malloc((size_t)n * sizeof *units);
        if (!bufs || !dst || !snaps || !psums || !sums || !units) {
            PyErr_NoMemory();
            goto done;
        }
    }
    for (; held < n; held++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, held), &bufs[held],
                               PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        if ((uint64_t)bufs[held].len < length) {
            PyErr_Format(PyExc_ValueError, "spill_read: buffer %zd holds %zd bytes, not %llu",
                         held, bufs[held].len, (unsigned long long)length);
            held++;
            goto done;
        }
        dst[held] = bufs[held].buf;
    }

    struct spill_req r = {
        .fd = fd, .hdrs = (const uint8_t *)meta.buf + hdr_off, .data_off = data_off,
        .slot_bytes = slot_bytes, .length = length, .slots = slots, .keys = keys.buf,
        .ns = ns.buf, .dst = dst, .snaps = snaps, .psums = psums, .sums = sums, .units = units,
        .data = data.obj ? data.buf : NULL, .data_len = data.obj ? (uint64_t)data.len : 0,
    };
    int status = SPILL_OK, err = 0;
    Py_ssize_t ok = 0;
    Py_BEGIN_ALLOW_THREADS
    if (n > 0)
        ok = spill_run(&r, cut_units(slots, n, length, slot_bytes, read_bytes, units),
                       &status, &err);
    Py_END_ALLOW_THREADS
    if (snap.obj && ok < n)
        memcpy(snap.buf, snaps + ok * SNAP, SNAP);
    res = Py_BuildValue("(nii)", ok, status, err);
done:
    for (Py_ssize_t i = 0; i < held; i++)
        PyBuffer_Release(&bufs[i]);
    PyMem_Free(bufs);
    PyMem_Free(dst);
    PyMem_Free(snaps);
    PyMem_Free(psums);
    PyMem_Free(sums);
    PyMem_Free(units);
    Py_XDECREF(seq);
    if (snap.obj)
        PyBuffer_Release(&snap);
    if (data.obj)
        PyBuffer_Release(&data);
    if (ns.obj)
        PyBuffer_Release(&ns);
    if (keys.obj)
        PyBuffer_Release(&keys);
    if (sl.obj)
        PyBuffer_Release(&sl);
    PyBuffer_Release(&meta);
    return res;
}

/* spill_layout() -> the slot header as spill_format.h defines it: size,
 * snapshot bytes, fields {name: (offset, size)}, magic, version, states and
 * spill_read's statuses */
#define SFIELD(d, f)                                                                       \
    do {                                                                                   \
        PyObject *t_ = Py_BuildValue("(nn)",                                               \
                                     (Py_ssize_t)offsetof(struct cxlkv_spill_slot, f),     \
                                     (Py_ssize_t)sizeof(((struct cxlkv_spill_slot *)0)->f)); \
        if (!t_ || PyDict_SetItemString(d, #f, t_) < 0) {                                  \
            Py_XDECREF(t_);                                                                \
            goto fail;                                                                     \
        }                                                                                  \
        Py_DECREF(t_);                                                                     \
    } while (0)

PyObject *
mod_spill_layout(PyObject *self, PyObject *Py_UNUSED(ignored))
{
    (void)self;
    PyObject *f = PyDict_New(), *out = NULL;
    if (!f)
        return NULL;
    SFIELD(f, magic);
    SFIELD(f, version);
    SFIELD(f, state);
    SFIELD(f, reserved0);
    SFIELD(f, length);
    SFIELD(f, reserved1);
    SFIELD(f, key);
    SFIELD(f, ns_digest);
    SFIELD(f, psum);
    SFIELD(f, hsum);
    SFIELD(f, stamp);
    out = Py_BuildValue(
        "{s:n,s:n,s:O,s:y#,s:I,s:{s:I,s:I,s:I},s:{s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i}}",
        "size", (Py_ssize_t)sizeof(struct cxlkv_spill_slot), "snap", (Py_ssize_t)SNAP,
        "fields", f, "magic", CXLKV_SPILL_MAGIC, (Py_ssize_t)4,
        "version", CXLKV_SPILL_VERSION, "states", "free", CXLKV_SPILL_FREE, "writing",
        CXLKV_SPILL_WRITING, "live", CXLKV_SPILL_LIVE, "status", "ok", SPILL_OK, "gone",
        SPILL_GONE, "torn", SPILL_TORN, "mismatch", SPILL_MISMATCH, "short", SPILL_SHORT,
        "ioerr", SPILL_IOERR, "changed", SPILL_CHANGED, "badsum", SPILL_BADSUM);
fail:
    Py_DECREF(f);
    return out;
}
