/*
 * Allocator hot paths: slot allocation, free and publish inside slabs.
 *
 * Slab creation and release (rare: they touch the global chunk bitmap) are
 * done by Python under the pool lock; these functions only flip bits in one
 * slab's descriptor with compare-and-swap, so nodes allocate without taking
 * the pool lock (cas mode).  Every offset - from the caller or read from a
 * descriptor - is validated against the geometry set by set_geometry(),
 * which itself was checked against the mapping.
 *
 * Lock-free allocation is fenced against release by the node's hazard words
 * (struct cxlkv_heap, see cxlkv_format.h): a slab an allocator has checked
 * cannot be released under it, so a slot bit, once set, is never taken back.
 * Descriptors that cannot be right (an unknown kind, a tail that names no
 * earlier head, impossible slab geometry) raise cxlkv_CorruptError, before
 * anything is written; a bad offset from the caller raises ValueError.
 */
#include "core.h"


static inline void
bit_set(Mapping *m, uint64_t word_off, uint64_t bit)
{
    pool_or64(m, word_off, bit);
}

static inline void
bit_clear(Mapping *m, uint64_t word_off, uint64_t bit)
{
    pool_and64(m, word_off, ~bit);
}

static int
need_geometry(Mapping *m, const char *what)
{
    if (check_open(m) < 0)
        return -1;
    if (!m->geo_set) {
        PyErr_Format(cxlkv_InternalError, "%s: allocator geometry not set", what);
        return -1;
    }
    return 0;
}

/* set_geometry(data_off, chunk_size, nchunks, desc_base) */
PyObject *
Mapping_set_geometry(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t d, c, n, b;
    if (nargs_check(nargs, 4, 4, "set_geometry") < 0 || as_u64(args[0], &d, "data_off") < 0 ||
        as_u64(args[1], &c, "chunk_size") < 0 || as_u64(args[2], &n, "nchunks") < 0 ||
        as_u64(args[3], &b, "desc_base") < 0)
        return NULL;
    if (c == 0 || n == 0 || (c & 63) || (b & 63) || n > UINT64_MAX / c ||
        n > UINT64_MAX / CXLKV_CHUNK_DESC_SIZE) {
        PyErr_SetString(PyExc_ValueError, "set_geometry: invalid geometry");
        return NULL;
    }
    if (check_range(m, d, c * n, "set_geometry data") < 0 ||
        check_range(m, b, n * CXLKV_CHUNK_DESC_SIZE, "set_geometry descriptors") < 0)
        return NULL;
    m->data_off = d;
    m->chunk_size = c;
    m->nchunks = n;
    m->desc_base = b;
    m->geo_set = 1;
    Py_RETURN_NONE;
}

/* Validate a slab head descriptor; fills slot size, slot count and base. */
const char *
slab_geometry(Mapping *m, uint64_t head, uint64_t *slot_size, uint64_t *nslots,
              uint64_t *base)
{
    uint64_t d = m->desc_base + head * CXLKV_CHUNK_DESC_SIZE;
    uint64_t ss = pool_load64(m, d + CD_SLOT), ns = pool_load64(m, d + CD_NSLOTS);
    uint64_t nc = pool_load64(m, d + CD_NCHUNKS);
    if (ss == 0 || (ss & 63) || ns == 0 || ns > CXLKV_SLAB_MAX_SLOTS || nc == 0 ||
        nc > m->nchunks - head || ss > (nc * m->chunk_size) / ns)
        return "slab descriptor is corrupt";
    *slot_size = ss;
    *nslots = ns;
    *base = m->data_off + head * m->chunk_size;
    return NULL;
}

/* Map a pool offset to (head chunk, slot).  NULL, or an error string with
 * *corrupt set when the descriptors are impossible rather than the offset
 * wrong.  A RELEASING head is still a slab: release_slab sets RELEASING, then
 * goes back to HEAD if any slot is allocated, so the holder of a slot may
 * publish or free it meanwhile (the caller checks the slot's alloc bit). */
static const char *
decode_slot(Mapping *m, uint64_t off, uint64_t *head, uint64_t *slot, uint64_t *slot_size,
            int *corrupt)
{
    *corrupt = 0;
    if (off < m->data_off || off - m->data_off >= m->chunk_size * m->nchunks)
        return "offset is outside the data area";
    uint64_t idx = (off - m->data_off) / m->chunk_size;
    if (m->flush_meta)     /* non-coherent: read what other hosts flushed */
        pool_invalidate(m, m->desc_base + idx * CXLKV_CHUNK_DESC_SIZE, CXLKV_CHUNK_DESC_SIZE);
    uint64_t ctl = pool_load64(m, m->desc_base + idx * CXLKV_CHUNK_DESC_SIZE + CD_CONTROL);
    uint64_t kind = ctl & 0xff, h = idx;
    if (kind == CXLKV_CHUNK_TAIL) {
        h = ctl >> 8;
        if (h >= idx) {
            *corrupt = 1;
            return "chunk descriptor is corrupt (a tail that names no earlier head)";
        }
        if (m->flush_meta)
            pool_invalidate(m, m->desc_base + h * CXLKV_CHUNK_DESC_SIZE, CXLKV_CHUNK_DESC_SIZE);
        kind = pool_load64(m, m->desc_base + h * CXLKV_CHUNK_DESC_SIZE + CD_CONTROL) & 0xff;
    }
    if (kind > CXLKV_CHUNK_RELEASING) {
        *corrupt = 1;
        return "chunk descriptor is corrupt (unknown kind)";
    }
    if (kind != CXLKV_CHUNK_HEAD && kind != CXLKV_CHUNK_RELEASING)
        return "offset is not in an allocated slab";
    uint64_t ns, base;
    const char *err = slab_geometry(m, h, slot_size, &ns, &base);
    if (err) {
        if (kind == CXLKV_CHUNK_RELEASING)  /* past its check: being cleared */
            return "offset is not in an allocated slab";
        *corrupt = 1;
        return err;
    }
    uint64_t rel = off - base;
    if (rel % *slot_size)
        return "offset is not the start of a slot";
    if (rel / *slot_size >= ns)
        return "offset is past the last slot of its slab";
    *head = h;
    *slot = rel / *slot_size;
    return NULL;
}

/* Claim one of the hazard words of the node heap header at `heap` for the
 * slab whose head chunk is `head`; -> the word's offset, or 0 when other
 * threads of this node hold all of them. */
static uint64_t
hazard_claim(Mapping *m, uint64_t heap, uint64_t head)
{
    for (uint64_t i = 0; i < CXLKV_HEAP_HAZARDS; i++) {
        uint64_t w = heap + HEAP_HAZARD + i * 8;
        if (pool_cas64(m, w, 0, head + 1) == 0) {
            if (m->flush_meta)
                pool_flush(m, w, 8);
            /* Dekker with release_slab(): the hazard is visible before this
             * thread reads the slab's descriptor */
            __atomic_thread_fence(__ATOMIC_SEQ_CST);
            return w;
        }
    }
    return 0;
}

static void
hazard_drop(Mapping *m, uint64_t w)
{
    pool_store64(m, w, 0);
    if (m->flush_meta)
        pool_flush(m, w, 8);
}

/* slab_alloc(head, owner, out, count, zero, slot_size=0, heap=0) -> allocated
 * Allocates up to `count` slots from the slab whose head chunk index is
 * `head`, writing their pool offsets to out[0..].  -1 when the slab is not an
 * active slab owned by `owner` (released, adopted by someone else) or, with
 * slot_size, not of that slot size (released and remade for another size).
 * heap: the pool offset of the calling node's heap header; a hazard word
 * there names the slab while it is in use, so that no release can take the
 * slab from under this call.  -2 when every hazard word is taken (other
 * threads of the node): call again holding the pool lock, with heap 0 (the
 * lock alone keeps releases out).  Raises cxlkv_CorruptError when the head's
 * descriptor is impossible. */
PyObject *
Mapping_slab_alloc(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t head, owner, count, want_ss = 0, heap = 0;
    int zero;
    if (nargs_check(nargs, 5, 7, "slab_alloc") < 0 || need_geometry(m, "slab_alloc") < 0 ||
        (nargs > 5 && as_u64(args[5], &want_ss, "slot_size") < 0) ||
        (nargs > 6 && as_u64(args[6], &heap, "heap") < 0) ||
        as_u64(args[0], &head, "head") < 0 || as_u64(args[1], &owner, "owner") < 0 ||
        as_u64(args[3], &count, "count") < 0 || check_writable(m, "slab_alloc") < 0)
        return NULL;
    if (heap && (check_word(m, heap, "slab_alloc heap") < 0 ||
                 check_range(m, heap, CXLKV_HEAP_SIZE, "slab_alloc heap") < 0))
        return NULL;
    if ((zero = PyObject_IsTrue(args[4])) < 0)
        return NULL;
    if (head >= m->nchunks) {
        PyErr_Format(cxlkv_RangeError, "slab_alloc: chunk %llu out of range",
                     (unsigned long long)head);
        return NULL;
    }
    Py_buffer out;
    if (get_offsets(args[2], &out, 1) < 0)
        return NULL;
    if ((uint64_t)(out.len / 8) < count)
        count = (uint64_t)(out.len / 8);
    uint64_t d = m->desc_base + head * CXLKV_CHUNK_DESC_SIZE;
    uint64_t *dst = out.buf;
    long long got = 0;
    const char *err = NULL;
    uint64_t ss, ns, base, kind, hz = 0;
    if (heap && !(hz = hazard_claim(m, heap, head))) {
        got = -2;
        goto done;
    }
    if (m->flush_meta)
        pool_invalidate(m, d, CXLKV_CHUNK_DESC_SIZE);
    kind = pool_load64(m, d + CD_CONTROL) & 0xff;
    if (kind > CXLKV_CHUNK_RELEASING) {
        err = "chunk descriptor is corrupt (unknown kind)";
        goto done;
    }
    if (kind != CXLKV_CHUNK_HEAD || pool_load64(m, d + CD_OWNER) != owner) {
        got = -1;
        goto done;
    }
    if ((err = slab_geometry(m, head, &ss, &ns, &base)))
        goto done;
    if (want_ss && ss != want_ss) {   /* released and remade with another slot size */
        got = -1;
        goto done;
    }
    m->busy++;
    Py_BEGIN_ALLOW_THREADS
    while ((uint64_t)got < count) {
        uint64_t slot = UINT64_MAX;
        for (uint64_t w = 0; w * 64 < ns && slot == UINT64_MAX; w++) {
            uint64_t valid = (ns - w * 64) >= 64 ? ~0ull : ((1ull << (ns - w * 64)) - 1);
            uint64_t wo = d + CD_ALLOC + w * 8;
            uint64_t cur = pool_load64(m, wo);
            /* bounded retries (16), then the next word: contention
             * never spins a core */
            for (int tries = 0; (~cur & valid) && tries < 16; tries++) {
                uint64_t bit = __builtin_ctzll(~cur & valid);
                uint64_t old = pool_cas64(m, wo, cur, cur | (1ull << bit));
                if (old == cur) {
                    slot = w * 64 + bit;
                    break;
                }
                cur = old;
            }
        }
        if (slot == UINT64_MAX)
            break;
        uint64_t w = slot / 64, bit = 1ull << (slot % 64);
        cxlkv_crashpoint("alloc.bit");
        /* The hazard (or the pool lock) kept every release out since the check
         * above; a release may have set RELEASING meanwhile, and goes back to
         * HEAD on seeing the hazard.  A slab that is not ours all the same
         * means this node was declared dead and recovered (its hazards
         * cleared): the slot may be someone else's by now, so its bit stays
         * (recovery or fsck --repair reclaims it) and nothing is handed out. */
        kind = pool_load64(m, d + CD_CONTROL) & 0xff;
        if ((kind != CXLKV_CHUNK_HEAD && kind != CXLKV_CHUNK_RELEASING) ||
            pool_load64(m, d + CD_OWNER) != owner || pool_load64(m, d + CD_SLOT) != ss)
            break;
        if (pool_load64(m, d + CD_DIRTY + w * 8) & bit) {
            if (zero)
                pool_zero(m, base + slot * ss, ss, 1);
            bit_clear(m, d + CD_DIRTY + w * 8, bit);
        }
        if (m->flush_meta)
            pool_flush(m, d + CD_ALLOC, 192);
        dst[got++] = base + slot * ss;
    }
    Py_END_ALLOW_THREADS
    m->busy--;
done:
    if (hz)
        hazard_drop(m, hz);
    PyBuffer_Release(&out);
    if (err) {
        PyErr_Format(cxlkv_CorruptError, "slab_alloc: chunk %llu: %s", (unsigned long long)head,
                     err);
        return NULL;
    }
    return PyLong_FromLongLong(got);
}

/* Zero a slot being freed in pieces, checking the write deadline before
 * each: 0 when it stopped (the deadline passed) with the slot partly zeroed. */
#define FREE_ZERO_PIECE (256u << 10)
static int
zero_until_deadline(Mapping *m, uint64_t off, uint64_t len)
{
    for (uint64_t done = 0; done < len; done += FREE_ZERO_PIECE) {
        if (done) {
            cxlkv_crashpoint("free.piece");
            if (write_deadline_passed(m))
                return 0;
        }
        uint64_t n = len - done < FREE_ZERO_PIECE ? len - done : FREE_ZERO_PIECE;
        pool_zero(m, off + done, n, 1);
    }
    return 1;
}

/* slab_free(offsets, zero, owner) -> freed.
 * Frees slots in order.  owner != 0: stops (returning how many it freed) at
 * the first slot whose slab another node owns - the caller takes the pool
 * lock and calls again with owner 0 for the rest, so that frees in slabs
 * that are not the caller's are serialised with recovery and with releases.
 * Stops as well (returning how many it freed) once the write deadline has
 * passed - before a slot, or between pieces of zeroing one, which leaves
 * that slot allocated and dirty: a begun free, which the caller finishes by
 * calling again (after guard()) or recovery finishes.  A caller stalled in
 * here past its lease (a reaper recovering a dead node, say) may have been
 * fenced, and the slots that follow freed by another reaper and handed out
 * again meanwhile: nothing is written once its freshness has run out.
 * Raises ValueError at the first offset that is not an allocated slot,
 * cxlkv_CorruptError at the first whose descriptors are impossible (the ones
 * before it are freed).
 * Order, so that a crash at any point is recognisable and finishable:
 *   dirty bit set ("contents going away") -> pub bit cleared -> contents
 *   zeroed (zero=True) -> alloc bit cleared -> dirty bit cleared (zeroed).
 * An allocated slot with its dirty bit set is a free that was interrupted.
 * owner != 0 (no pool lock): clearing the last alloc bit lets another node
 * release the slab and remake it at once, so nothing may be written to the
 * descriptor after it - the dirty bit is cleared first.  A crash between the
 * two leaves an unpublished slot in the caller's own slab, which the
 * recovery of the caller frees like any reserved slot. */
PyObject *
Mapping_slab_free(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    int zero;
    uint64_t owner;
    if (nargs_check(nargs, 3, 3, "slab_free") < 0 || need_geometry(m, "slab_free") < 0 ||
        check_writable(m, "slab_free") < 0 || as_u64(args[2], &owner, "owner") < 0)
        return NULL;
    if ((zero = PyObject_IsTrue(args[1])) < 0)
        return NULL;
    Py_buffer in;
    if (get_offsets(args[0], &in, 0) < 0)
        return NULL;
    const uint64_t *offs = in.buf;
    Py_ssize_t n = in.len / 8, i;
    const char *err = NULL;
    int corrupt = 0;
    m->busy++;
    Py_BEGIN_ALLOW_THREADS
    for (i = 0; i < n; i++) {
        uint64_t head, slot, ss;
        cxlkv_crashpoint("free.next");
        if (write_deadline_passed(m))
            break;                                  /* stale, or fenced: the caller guards */
        if ((err = decode_slot(m, offs[i], &head, &slot, &ss, &corrupt)))
            break;
        uint64_t d = m->desc_base + head * CXLKV_CHUNK_DESC_SIZE;
        if (owner && pool_load64(m, d + CD_OWNER) != owner)
            break;                                  /* not ours: the caller locks */
        uint64_t w = slot / 64, bit = 1ull << (slot % 64);
        if (!(pool_load64(m, d + CD_ALLOC + w * 8) & bit)) {
            err = "slot is not allocated (double free?)";
            break;
        }
        /* (each skipped where the bit is as wanted already - a slot freed
         * unzeroed before stays dirty, one never published has no pub bit:
         * nobody else writes this slot's bits while it is being freed) */
        if (!(pool_load64(m, d + CD_DIRTY + w * 8) & bit))
            bit_set(m, d + CD_DIRTY + w * 8, bit);
        if (pool_load64(m, d + CD_PUB + w * 8) & bit)
            bit_clear(m, d + CD_PUB + w * 8, bit);
        if (m->flush_meta && zero)      /* the begun free is visible before the zeroing */
            pool_flush(m, d + CD_ALLOC, 192);
        cxlkv_crashpoint("free.pub");   /* tests: a stall past the check, before zeroing */
        if (zero && !zero_until_deadline(m, offs[i], ss))
            break;                                  /* a begun free, left dirty */
        cxlkv_crashpoint("free.zeroed");
        if (zero && owner)
            bit_clear(m, d + CD_DIRTY + w * 8, bit);
        if (m->flush_meta && owner)     /* all but the alloc bit, while the slab is held */
            pool_flush(m, d + CD_ALLOC, 192);
        uint64_t old = pool_and64(m, d + CD_ALLOC + w * 8, ~bit);
        if (!(old & bit)) {
            err = "slot is not allocated (double free?)";
            break;
        }
        if (zero && !owner)
            bit_clear(m, d + CD_DIRTY + w * 8, bit);
        if (m->flush_meta)
            pool_flush(m, d + CD_ALLOC + (owner ? w * 8 : 0), owner ? 8 : 192);
        slab_note_free(m, head, !(old & ~bit));   /* for release_empty and reuse */
    }
    Py_END_ALLOW_THREADS
    m->busy--;
    uint64_t bad = i < n ? offs[i] : 0;
    PyBuffer_Release(&in);
    if (err) {
        PyErr_Format(corrupt ? cxlkv_CorruptError : PyExc_ValueError,
                     "free of offset %llu (item %zd): %s; %zd freed before it",
                     (unsigned long long)bad, i, err, i);
        return NULL;
    }
    return PyLong_FromSsize_t(i);
}

/* Set one per-slot bit (`field`: CD_PUB or CD_DIRTY) of allocated slots,
 * flushed in manager mode; -> slots done.  ValueError at the first offset
 * that is not an allocated slot, cxlkv_CorruptError at the first whose
 * descriptors are impossible (the ones before it are done). */
static PyObject *
set_slot_bits(Mapping *m, PyObject *const *args, Py_ssize_t nargs, uint64_t field,
              const char *what)
{
    if (nargs_check(nargs, 1, 1, what) < 0 || need_geometry(m, what) < 0 ||
        check_writable(m, what) < 0)
        return NULL;
    Py_buffer in;
    if (get_offsets(args[0], &in, 0) < 0)
        return NULL;
    const uint64_t *offs = in.buf;
    Py_ssize_t n = in.len / 8, i;
    const char *err = NULL;
    int corrupt = 0;
    for (i = 0; i < n; i++) {
        /* a node stalled past its write deadline proves itself fresh before
         * each slot: resumed after its quarantine was recovered, the slots
         * on its list may be published blocks of other nodes by then (a
         * begun-free mark on one would have its owner's recovery free it) */
        cxlkv_crashpoint("slot.bits.next");
        if (write_deadline_passed(m) && check_writable(m, what) < 0) {
            PyBuffer_Release(&in);
            return NULL;
        }
        uint64_t head, slot, ss;
        if ((err = decode_slot(m, offs[i], &head, &slot, &ss, &corrupt)))
            break;
        uint64_t d = m->desc_base + head * CXLKV_CHUNK_DESC_SIZE;
        uint64_t w = slot / 64, bit = 1ull << (slot % 64);
        if (!(pool_load64(m, d + CD_ALLOC + w * 8) & bit)) {
            err = "slot is not allocated";
            break;
        }
        bit_set(m, d + field + w * 8, bit);
        if (m->flush_meta)
            pool_flush(m, d + field + w * 8, 8);
    }
    uint64_t bad = i < n ? offs[i] : 0;
    PyBuffer_Release(&in);
    if (err) {
        PyErr_Format(corrupt ? cxlkv_CorruptError : PyExc_ValueError,
                     "%s of offset %llu (item %zd): %s", what, (unsigned long long)bad, i, err);
        return NULL;
    }
    return PyLong_FromSsize_t(i);
}

/* slab_mark_freeing(offsets) -> marked
 * Set the dirty bit of allocated slots: "this free has begun".  A free that
 * is recorded before it starts (a foreign free, an eviction) marks the slot
 * first, so recovery finishes exactly the slots still allocated and marked;
 * a slot freed and handed out again has its dirty bit clear. */
PyObject *
Mapping_slab_mark_freeing(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    return set_slot_bits(m, args, nargs, CD_DIRTY, "slab_mark_freeing");
}

/* slab_publish(offsets) -> published: mark allocated slots published */
PyObject *
Mapping_slab_publish(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    return set_slot_bits(m, args, nargs, CD_PUB, "slab_publish");
}
