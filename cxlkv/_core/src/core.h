/* Internal interface of the C core: the Mapping object and the pool access
 * helpers every other source file goes through. */
#ifndef CXLKV_CORE_H
#define CXLKV_CORE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <time.h>

#include "cpu.h"
#include "cxlkv_format.h"

/* chunk descriptor and heap fields (alloc.c, slabs.c) */
#define CD_CONTROL   offsetof(struct cxlkv_chunk, control)
#define CD_OWNER     offsetof(struct cxlkv_chunk, owner)
#define CD_SLOT      offsetof(struct cxlkv_chunk, slot_size)
#define CD_NSLOTS    offsetof(struct cxlkv_chunk, nslots)
#define CD_NCHUNKS   offsetof(struct cxlkv_chunk, nchunks)
#define CD_ALLOC     offsetof(struct cxlkv_chunk, alloc_bits)
#define CD_PUB       offsetof(struct cxlkv_chunk, pub_bits)
#define CD_DIRTY     offsetof(struct cxlkv_chunk, dirty_bits)
#define HEAP_HAZARD  offsetof(struct cxlkv_heap, hazard)
#include "nc.h"

typedef struct {
    PyObject_HEAD
    char *base;
    uint64_t size;
    int writable;
    int owns_map;          /* 1: munmap on close; 0: borrowed buffer */
    int closed;
    Py_ssize_t exports;    /* live buffer exports (views) */
    Py_ssize_t busy;       /* calls running with the GIL released */
    Py_buffer borrowed;    /* when owns_map == 0 */
    int nt_default;        /* use NT stores for large writes */
    uint64_t nt_threshold;
    /* allocator geometry (set_geometry): validated once against the mapping */
    int geo_set;
    uint64_t data_off, chunk_size, nchunks, desc_base;
    /* non-coherence emulation (CXLKV_NONCOHERENT=1), NULL when coherent */
    struct nc_cache *nc;
    /* flush metadata the hot paths write (manager mode: other hosts read it
     * without coherence); off for cas mode on coherent memory */
    int flush_meta;
    /* write_deadline_ns (CLOCK_MONOTONIC): copies that honour it (write_blocks)
     * stop before a block once it has passed - the attached node's heartbeat
     * is no longer known fresh, so it may have been fenced.  0 = no deadline
     * (a pool no node of this process is attached to).  Written by any
     * thread of the process: accessed with relaxed atomics. */
    int64_t write_deadline_ns;
    /* sections of the attached node in flight (section_begin/end): writes or
     * views of this process that the node's fencing acknowledgement waits for */
    Py_ssize_t sections;
    /* the attached node's guard (set_guard): called before a write once the
     * write deadline has passed - it proves the node fresh (beats) or raises
     * NodeFenced (a thread-local flag in mapping.c keeps the guard's own
     * writes from recursing) */
    PyObject *guard;
    /* leaf LRU lists of the KV area (kv_lru_setup, lru.c): hash table, its
     * slots, the KV header and the link array; lru_bad: an inconsistency
     * seen during the current call (the lists are rebuilt at its end);
     * lru_fenced: the node's guard raised mid-call (nothing more is written) */
    int lru_set, lru_bad, lru_depth, lru_fenced;
    uint64_t lru_table, lru_nslots, lru_hdr, lru_links;
    /* slabs this process's frees emptied (slabs.c), NULL until the first */
    struct slab_emptied *emptied;
    /* prefault (mapping.c): 1 while bulk copies map their 2 MiB granule of
     * the pool into this process's page tables in one call first; `mapped`:
     * a bit per granule already done, NULL until the first */
    int prefault;
    uint64_t *mapped;
    uint64_t mapped_gen;   /* cxlkv_fork_gen when `mapped` was last true */
} Mapping;

/* Bulk writes into the pool go through 2 MiB granules mapped in one
 * madvise(MADV_POPULATE_READ) each (fault-around maps 16 pages a fault, and
 * tmpfs maps them writable) instead of a page fault per 4 KiB page: on an
 * emulated pool in a tmpfs file those faults were a third of a store's CPU.
 * Device-dax maps 2 MiB pages itself; there it is one fault less. */
#define PREFAULT_SHIFT 21
void pool_prefault_slow(Mapping *m, uint64_t off, uint64_t len);
/* bumped in a forked child (a child has none of the parent's page-table
 * entries of a shared mapping: its granules are mapped again) */
extern uint64_t cxlkv_fork_gen;
void cxlkv_prefault_atfork(void);

static inline void pool_prefault(Mapping *m, uint64_t off, uint64_t len)
{
    if (!m->prefault || len == 0)
        return;
    uint64_t g0 = off >> PREFAULT_SHIFT, g1 = (off + len - 1) >> PREFAULT_SHIFT;
    const uint64_t *bits = __atomic_load_n(&m->mapped, __ATOMIC_ACQUIRE);
    if (bits && m->mapped_gen == __atomic_load_n(&cxlkv_fork_gen, __ATOMIC_RELAXED)) {
        uint64_t g = g0;
        while (g <= g1 && (__atomic_load_n(&bits[g >> 6], __ATOMIC_RELAXED) >> (g & 63) & 1))
            g++;
        if (g > g1)
            return;
    }
    pool_prefault_slow(m, off, len);
}

/* Has the write deadline passed (a copy must stop before the next block)? */
static inline int
write_deadline_passed(const Mapping *m)
{
    int64_t d = __atomic_load_n(&m->write_deadline_ns, __ATOMIC_RELAXED);
    if (d == 0)
        return 0;
    return cxlkv_deadline_passed(d);
}

/* module.c: the exception types (set_error_types) */
extern PyObject *cxlkv_RangeError;
extern PyObject *cxlkv_CorruptError;
extern PyObject *cxlkv_ReadOnlyError;
extern PyObject *cxlkv_InternalError;
extern PyObject *cxlkv_LockLostError;

/* mapping.c: the checks every access goes through, before a pointer is formed
 * (check_writable also runs the node's guard once its write deadline passed) */
int check_open(const Mapping *m);
int check_range(const Mapping *m, uint64_t off, uint64_t len, const char *what);
int check_word(const Mapping *m, uint64_t off, const char *what);
int check_writable(Mapping *m, const char *what);

/* args.c: argument parsing */
int as_u64(PyObject *o, uint64_t *out, const char *what);
int nargs_check(Py_ssize_t nargs, Py_ssize_t lo, Py_ssize_t hi, const char *name);
/* nt argument (None = by size: the mapping's nt_threshold) */
int parse_nt(Mapping *m, PyObject *o, uint64_t len, int *nt);
/* A C-contiguous buffer of uint64 (numpy uint64); TypeError otherwise. */
int get_offsets(PyObject *obj, Py_buffer *b, int writable);

/* --- the pool access helpers (single switch point) -----------------
 * Every access to pool memory goes through these: with the non-coherence
 * emulation on, they go through the process's software cache instead. */

static inline uint64_t pool_load64(Mapping *m, uint64_t off)
{
    if (m->nc)
        return nc_load64(m->nc, off);
    return __atomic_load_n((uint64_t *)(m->base + off), __ATOMIC_ACQUIRE);
}

static inline void pool_store64(Mapping *m, uint64_t off, uint64_t v)
{
    if (m->nc) {
        nc_store64(m->nc, off, v);
        return;
    }
    __atomic_store_n((uint64_t *)(m->base + off), v, __ATOMIC_RELEASE);
}

static inline uint64_t pool_cas64(Mapping *m, uint64_t off, uint64_t expect, uint64_t desired)
{
    if (m->nc)
        return nc_cas64(m->nc, off, expect, desired);
    uint64_t e = expect;
    __atomic_compare_exchange_n((uint64_t *)(m->base + off), &e, desired, 0,
                                __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return e;   /* old value; success iff == expect */
}

static inline uint64_t pool_fadd64(Mapping *m, uint64_t off, uint64_t delta)
{
    if (m->nc)
        return nc_fadd64(m->nc, off, delta);
    return __atomic_fetch_add((uint64_t *)(m->base + off), delta, __ATOMIC_SEQ_CST);
}

static inline uint64_t pool_or64(Mapping *m, uint64_t off, uint64_t bits)
{
    if (m->nc)
        return nc_or64(m->nc, off, bits);
    return __atomic_fetch_or((uint64_t *)(m->base + off), bits, __ATOMIC_SEQ_CST);
}

static inline uint64_t pool_and64(Mapping *m, uint64_t off, uint64_t bits)
{
    if (m->nc)
        return nc_and64(m->nc, off, bits);
    return __atomic_fetch_and((uint64_t *)(m->base + off), bits, __ATOMIC_SEQ_CST);
}

static inline void pool_flush(Mapping *m, uint64_t off, uint64_t len)
{
    if (m->nc) {
        nc_flush(m->nc, off, len);
        return;
    }
    cxlkv_flush_range(m->base + off, (size_t)len);
}

static inline void pool_invalidate(Mapping *m, uint64_t off, uint64_t len)
{
    if (m->nc) {
        nc_invalidate(m->nc, off, len);
        return;
    }
    cxlkv_invalidate_range(m->base + off, (size_t)len);
}

/* Bulk writes reach memory (non-temporal stores bypass the cache, and
 * write() flushes on return).  0, or -1 with errno ENOMEM: under the
 * emulation, a source overlapping the pool needed a bounce buffer that could
 * not be had (nothing was written). */
static inline int pool_write(Mapping *m, uint64_t off, const void *src, uint64_t len, int nt)
{
    if (m->nc)
        return nc_write(m->nc, off, src, len, nt);
    pool_prefault(m, off, len);
    cxlkv_copy_to_pool(m->base + off, src, (size_t)len, nt);
    return 0;
}

static inline void pool_zero(Mapping *m, uint64_t off, uint64_t len, int nt)
{
    if (m->nc) {
        nc_zero(m->nc, off, len, nt);
        return;
    }
    pool_prefault(m, off, len);
    cxlkv_zero_pool(m->base + off, (size_t)len, nt);
}

/* Under the emulation every read, whatever its size, goes through this
 * process's emulated cache (nc.h).  Reads map no granule ahead: a read
 * fault maps 16 pages (fault-around), so a block read out of a granule this
 * process never touched costs its own pages only (a 256 KiB block: 35-48 us
 * on a 2-vCPU VM, against 230-330 us to map its whole 2 MiB granule); a
 * granule read whole costs the same either way.  Writes take no
 * fault-around: they keep the granule call (a process fills its own slabs). */
static inline void pool_read(Mapping *m, uint64_t off, void *dst, uint64_t len)
{
    if (m->nc) {
        nc_read(m->nc, off, dst, len);
        return;
    }
    cxlkv_copy_from_pool(dst, m->base + off, (size_t)len);
}

/* crashpoint.c: deterministic crash points for crash-consistency tests:
 * with CXLKV_CRASH_AT=SITE:N the process kills itself (SIGKILL) the Nth time
 * it passes SITE (CXLKV_PAUSE_AT: SIGSTOP).  A no-op otherwise. */
void cxlkv_crashpoint(const char *site);
PyObject *mod_crashpoint(PyObject *self, PyObject *arg);

/* mapping.c: the Mapping type's life, atomics, copies, views, properties */
extern PyTypeObject SpanType;
extern PyGetSetDef Mapping_getset[];
PyObject *Mapping_new(PyTypeObject *type, PyObject *args, PyObject *kwds);
void Mapping_dealloc(Mapping *m);
PyObject *Mapping_from_buffer(PyTypeObject *type, PyObject *obj);
PyObject *Mapping_close(Mapping *m, PyObject *ignored);
PyObject *Mapping_enter(Mapping *m, PyObject *ignored);
PyObject *Mapping_exit(Mapping *m, PyObject *args);
PyObject *Mapping_load64(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *Mapping_store64(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *Mapping_cas64(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *Mapping_fetch_add64(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *Mapping_add64_many(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *Mapping_flush(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *Mapping_invalidate(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *Mapping_write(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *Mapping_zero(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *Mapping_read(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *Mapping_readinto(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *Mapping_view(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *Mapping_set_guard(Mapping *m, PyObject *fn);
PyObject *Mapping_section_begin(Mapping *m, PyObject *ignored);
PyObject *Mapping_node_fresh(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *Mapping_section_end(Mapping *m, PyObject *ignored);
PyObject *Mapping_nc_stats(Mapping *m, PyObject *ignored);

/* lock.c: the cas-mode ticket lock */
PyObject *Mapping_ticket_acquire(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *Mapping_ticket_wait(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *Mapping_ticket_release(Mapping *m, PyObject *const *args, Py_ssize_t nargs);

/* layout.c: the on-media layout and constants, from cxlkv_format.h */
PyObject *mod_layout(PyObject *self, PyObject *ignored);
PyObject *mod_constants(PyObject *self, PyObject *ignored);

/* alloc.c */
PyObject *Mapping_slab_alloc(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *Mapping_slab_free(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *Mapping_slab_mark_freeing(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *Mapping_slab_publish(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *Mapping_set_geometry(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
/* Validate a slab head descriptor: NULL, or what is impossible about it. */
const char *slab_geometry(Mapping *m, uint64_t head, uint64_t *slot_size, uint64_t *nslots,
                          uint64_t *base);

/* slabs.c */
void slab_note_free(Mapping *m, uint64_t head, int word_empty);
void slab_emptied_free(Mapping *m);
PyObject *Mapping_slab_take_emptied(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *Mapping_chunk_find_run(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *Mapping_slab_make(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *Mapping_prefault_range(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *Mapping_slabs_release(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *Mapping_slabs_set_owner(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *Mapping_slab_census(Mapping *m, PyObject *const *args, Py_ssize_t nargs);

/* kv.c */
PyObject *Mapping_kv_lookup(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *Mapping_kv_insert(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *Mapping_kv_publish(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *Mapping_kv_set_state(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *Mapping_kv_usage(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *Mapping_kv_account(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *Mapping_kv_stamp(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *Mapping_kv_in_flight(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *Mapping_kv_remove(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *Mapping_kv_pin(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *Mapping_kv_unpin(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *Mapping_kv_touch(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
/* kv.c: block-key hashing and block copies */
PyObject *Mapping_write_blocks(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *Mapping_read_blocks(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *mod_kv_chain(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *mod_kv_keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *mod_gather(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
/* gather.c: strided gather/scatter between blocks and an engine layout; copy modes */
PyObject *mod_kv_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *Mapping_kv_scatter(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *mod_copy_modes(PyObject *self, PyObject *ignored);
PyObject *mod_set_copy_modes(PyObject *self, PyObject *args);
/* spill.c: the spill tier's verify-and-copy read of slot runs */
PyObject *mod_spill_read(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *mod_spill_layout(PyObject *self, PyObject *ignored);
/* spill_pool.c: helper threads sharing a spill read's units with its caller */
typedef void (*spill_unit_fn)(void *ctx, Py_ssize_t unit);
void cxlkv_spill_pool_run(spill_unit_fn fn, void *ctx, Py_ssize_t nunits,
                          _Atomic Py_ssize_t *limit);
PyObject *mod_spill_helpers(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *mod_spill_helper_stats(PyObject *self, PyObject *ignored);
/* journal.c */
PyObject *Mapping_journal_append(Mapping *m, PyObject *const *args, Py_ssize_t nargs);

/* lockmgr.c: sync mode manager */
PyObject *Mapping_mgr_loop(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *Mapping_mgr_wait(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
/* lru.c: the leaf LRU lists, kept by the kv.c writers (pool lock held).
 * lru_begin / lru_end bracket a call's edits (the dirty word; a rebuild
 * when a dead holder left it set or the call found the lists corrupt):
 * -1 with an exception set when a rebuild could not get memory.  lru_sync
 * puts an entry on or off its list after its state, children or stamp
 * changed: LRU_TAIL (just published), LRU_SORTED (by its stamp),
 * LRU_RESTAMP (its stamp changed: moved). */
#define LRU_TAIL     0
#define LRU_SORTED   1
#define LRU_RESTAMP  2
int lru_on(const Mapping *m, uint64_t table, uint64_t nslots);
int lru_begin(Mapping *m);
int lru_end(Mapping *m);
int lru_sync(Mapping *m, uint64_t idx, int where);    /* -1: fenced (exception set) */
PyObject *Mapping_kv_lru_setup(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *Mapping_kv_lru_rebuild(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *Mapping_kv_lru_pick(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *Mapping_kv_lru_path_victim(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *Mapping_kv_lru_check(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *Mapping_kv_purge(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *Mapping_kv_evict_free(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
/* kv.c: kv_remove's work on a checked table, header and index */
int kv_remove_at(Mapping *m, uint64_t table, uint64_t nslots, uint64_t hdr, uint64_t idx,
                 uint64_t *parent_out);
/* hostlock.c */
PyObject *Mapping_host_memory(Mapping *m, PyObject *ignored);
PyObject *Mapping_hostlock_acquire(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *Mapping_hostlock_release(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
/* poolwait.c */
PyObject *Mapping_word_wait(Mapping *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *Mapping_word_wake(Mapping *m, PyObject *const *args, Py_ssize_t nargs);

#endif
