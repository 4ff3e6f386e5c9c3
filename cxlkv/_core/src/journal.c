/*
 * The change journal's append (cxlkv_format.h, "Change journal"): a node
 * records what it published or evicted in the ring of its own slot.
 *
 * Called with the pool lock held (so one appender per ring at a time, and
 * the entries read here are stable); the write path's freshness check
 * (check_writable) runs first, so a fenced node appends nothing.  The batch
 * takes its sequence numbers from the header's next_seq first (a crash
 * after that leaves a gap, never a reuse); every record is written as a
 * seqlock - seq 0, release, the fields, release, its sequence number - and
 * the head is advanced after the whole batch, once the node is proven fresh
 * again if the write deadline passed meanwhile: a crash or a fencing before
 * that leaves the head where it was (the records are beyond it, overwritten
 * by the slot's next appender).  With flush_meta
 * (manager mode, the non-coherence emulation) the records and the head line
 * are flushed and the lines read are invalidated first.
 *
 * Block names (compat NAMES, cxlkv_format.h): with the names' offsets
 * given, each STORED or EVICTED record gets, inside its seqlock, a copy of
 * the block's name record (not its token ids) in the ring names at its ring
 * position - only when its key is the block's, else an empty name with the
 * key - so that a reader has the name a block had when the record was
 * written, after its entry was evicted and reused.
 *
 * Bounds: the ring (header line and records) is checked against the
 * mapping once per call, and so are the table names and this ring's names;
 * entry indices against nslots, a parent index read from an entry against
 * nslots before it is followed.
 */
#include "core.h"

#define E_KEY_LO    offsetof(struct cxlkv_hash_entry, key_lo)
#define E_KEY_HI    offsetof(struct cxlkv_hash_entry, key_hi)
#define E_LEN       offsetof(struct cxlkv_hash_entry, length)   /* length | ns << 32 | tenant << 48 */
#define E_PARENT    offsetof(struct cxlkv_hash_entry, parent)   /* parent | children << 32 */
#define H_NEXT_SEQ  offsetof(struct cxlkv_journal_hdr, next_seq)
#define R_HEAD      offsetof(struct cxlkv_journal_ring, head)
#define R_WRITER    offsetof(struct cxlkv_journal_ring, writer)
#define J_SEQ       offsetof(struct cxlkv_journal_rec, seq)
#define J_KEY_LO    offsetof(struct cxlkv_journal_rec, key_lo)
#define J_KEY_HI    offsetof(struct cxlkv_journal_rec, key_hi)
#define J_PAR_LO    offsetof(struct cxlkv_journal_rec, parent_lo)
#define J_PAR_HI    offsetof(struct cxlkv_journal_rec, parent_hi)
#define J_LEN       offsetof(struct cxlkv_journal_rec, length)  /* length | ns << 32 | tenant << 48 */
#define J_TIME      offsetof(struct cxlkv_journal_rec, time_us)
#define J_ENTRY     offsetof(struct cxlkv_journal_rec, entry)   /* entry | op << 32 */

_Static_assert(offsetof(struct cxlkv_journal_rec, length) + 4 ==
               offsetof(struct cxlkv_journal_rec, ns), "journal record length/ns word");
_Static_assert(offsetof(struct cxlkv_hash_entry, length) + 4 ==
               offsetof(struct cxlkv_hash_entry, ns), "hash entry length/ns word");
_Static_assert(offsetof(struct cxlkv_journal_rec, entry) + 4 ==
               offsetof(struct cxlkv_journal_rec, op), "journal record entry/op word");

static inline void
inval(Mapping *m, uint64_t off, uint64_t len)
{
    if (m->flush_meta)
        pool_invalidate(m, off, len);
}

#define N_KEY_LO    offsetof(struct cxlkv_block_name, key_lo)
#define N_KEY_HI    offsetof(struct cxlkv_block_name, key_hi)
#define N_LEN       offsetof(struct cxlkv_block_name, len)

/* The table name of entry ix (entries of esize bytes) into ring name record
 * dst, when its key is (klo, khi); else an empty name record for that key. */
static void
copy_name(Mapping *m, uint64_t names, uint64_t esize, uint64_t ix, uint64_t klo, uint64_t khi,
          uint64_t dst)
{
    uint8_t rec[CXLKV_NAME_SIZE];
    uint64_t src = names + ix * esize;
    inval(m, src, CXLKV_NAME_SIZE);
    pool_read(m, src, rec, CXLKV_NAME_SIZE);
    struct cxlkv_block_name *n = (struct cxlkv_block_name *)rec;
    if (n->key_lo != klo || n->key_hi != khi || n->len > CXLKV_NAME_MAX) {
        memset(rec, 0, sizeof rec);
        n->key_lo = klo;
        n->key_hi = khi;
    }
    n->ntokens = 0;                         /* the token ids stay in the table */
    /* word stores, as the record's own: no write-back here (put_record
     * flushes the line when flush_meta is on; coherent readers need none) */
    uint64_t w[CXLKV_NAME_SIZE / 8];
    memcpy(w, rec, sizeof w);
    for (unsigned i = 0; i < CXLKV_NAME_SIZE / 8; i++)
        pool_store64(m, dst + 8 * i, w[i]);
}

/* One record at ring position pos with sequence number seq (seqlock
 * write).  words[0..6]: key_lo, key_hi, parent_lo, parent_hi, length word,
 * time, entry word.  With names (table names offset and entry size, this
 * ring's names offset: all or none), the block's name is copied within the
 * seqlock. */
static void
put_record(Mapping *m, uint64_t recs, uint64_t nrec, uint64_t pos, uint64_t seq,
           const uint64_t *w, uint64_t names, uint64_t esize, uint64_t rnames)
{
    uint64_t r = recs + (pos % nrec) * CXLKV_JOURNAL_REC_SIZE;
    pool_store64(m, r + J_SEQ, 0);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    if (rnames) {
        uint64_t dst = rnames + (pos % nrec) * CXLKV_NAME_SIZE;
        uint64_t entry = w[6] & 0xffffffffull;
        if (entry)
            copy_name(m, names, esize, entry - 1, w[0], w[1], dst);
        else
            pool_zero(m, dst, CXLKV_NAME_SIZE, 0);
        if (m->flush_meta)
            pool_flush(m, dst, CXLKV_NAME_SIZE);
    }
    pool_store64(m, r + J_KEY_LO, w[0]);
    pool_store64(m, r + J_KEY_HI, w[1]);
    pool_store64(m, r + J_PAR_LO, w[2]);
    pool_store64(m, r + J_PAR_HI, w[3]);
    pool_store64(m, r + J_LEN, w[4]);
    pool_store64(m, r + J_TIME, w[5]);
    pool_store64(m, r + J_ENTRY, w[6]);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    pool_store64(m, r + J_SEQ, seq);
    if (m->flush_meta)
        pool_flush(m, r, CXLKV_JOURNAL_REC_SIZE);
}

/* journal_append(hdr_off, ring_off, nrec, table_off, nslots, op, writer, now_us, idx, ns=0,
 *                names_off=0, ring_names_off=0, name_entry_size=0) -> head
 * Append one record per entry index in `idx` (uint64; STORED or EVICTED:
 * the key, parent key, length, namespace and tenant are read from the
 * entry, which must still hold them), or, for NS_CLEARED, one record for
 * namespace `ns` (idx ignored).  With the table names at names_off (entries
 * of name_entry_size bytes) and this ring's names at ring_names_off (all
 * three or none), the blocks' names are copied too.  Returns the ring's new
 * head. */
PyObject *
Mapping_journal_append(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t hdr, ring, nrec, tbase, nslots, op, writer, now, ns = 0, names = 0, rnames = 0,
             esize = 0;
    if (nargs_check(nargs, 9, 13, "journal_append") < 0 || check_open(m) < 0 ||
        as_u64(args[0], &hdr, "header offset") < 0 ||
        as_u64(args[1], &ring, "ring offset") < 0 || as_u64(args[2], &nrec, "records") < 0 ||
        as_u64(args[3], &tbase, "table offset") < 0 || as_u64(args[4], &nslots, "table slots") < 0 ||
        as_u64(args[5], &op, "op") < 0 || as_u64(args[6], &writer, "writer") < 0 ||
        as_u64(args[7], &now, "now") < 0 || (nargs > 9 && as_u64(args[9], &ns, "ns") < 0) ||
        (nargs > 10 && as_u64(args[10], &names, "names offset") < 0) ||
        (nargs > 11 && as_u64(args[11], &rnames, "ring names offset") < 0) ||
        (nargs > 12 && as_u64(args[12], &esize, "name entry size") < 0))
        return NULL;
    if (!names != !rnames || !names != !esize || (names & 63) || (rnames & 63) ||
        (esize && (esize < CXLKV_NAME_SIZE ||
                   esize > cxlkv_name_entry_size(CXLKV_NAME_TOKENS_MAX) || (esize & 63)))) {
        PyErr_SetString(PyExc_ValueError,
                        "journal_append: names need both offsets and the entry size, aligned");
        return NULL;
    }
    if (op < CXLKV_JOURNAL_STORED || op > CXLKV_JOURNAL_NS_CLEARED || ns > 0xffff) {
        PyErr_SetString(PyExc_ValueError, "journal_append: unknown op or namespace out of range");
        return NULL;
    }
    if (nrec == 0 || nrec > (1ull << 32) || (ring & 63) || (hdr & 63) || nslots == 0 ||
        nslots > (1ull << 32) || (tbase & 63)) {
        PyErr_SetString(PyExc_ValueError, "journal_append: invalid ring or table geometry");
        return NULL;
    }
    if (check_range(m, hdr, sizeof(struct cxlkv_journal_hdr), "journal header") < 0 ||
        check_range(m, ring, 64 + nrec * CXLKV_JOURNAL_REC_SIZE, "journal ring") < 0 ||
        check_range(m, tbase, nslots * CXLKV_HASH_ENTRY_SIZE, "kv table") < 0 ||
        (names && (check_range(m, names, nslots * esize, "table names") < 0 ||
                   check_range(m, rnames, nrec * CXLKV_NAME_SIZE, "ring names") < 0)) ||
        check_writable(m, "journal_append") < 0)
        return NULL;
    Py_buffer b;
    if (get_offsets(args[8], &b, 0) < 0)
        return NULL;
    const uint64_t *ix = b.buf;
    uint64_t n = op == CXLKV_JOURNAL_NS_CLEARED ? 1 : (uint64_t)b.len / 8;
    if (op != CXLKV_JOURNAL_NS_CLEARED) {
        for (uint64_t i = 0; i < n; i++)
            if (ix[i] >= nslots) {
                PyErr_Format(PyExc_ValueError, "journal_append: entry %llu out of range",
                             (unsigned long long)ix[i]);
                PyBuffer_Release(&b);
                return NULL;
            }
    }
    if (n == 0) {
        PyBuffer_Release(&b);
        inval(m, ring, 64);
        return PyLong_FromUnsignedLongLong(pool_load64(m, ring + R_HEAD));
    }
    /* the sequence numbers first: a crash from here on leaves a gap */
    inval(m, hdr + H_NEXT_SEQ, 8);
    uint64_t seen = pool_load64(m, hdr + H_NEXT_SEQ), seq = seen ? seen : 1;
    cxlkv_crashpoint("journal.seq");        /* tests: a stall between load and store */
    if (m->flush_meta) {                    /* no cross-host atomics: a plain store */
        pool_store64(m, hdr + H_NEXT_SEQ, seq + n);
        pool_flush(m, hdr + H_NEXT_SEQ, 8);
    } else if (pool_cas64(m, hdr + H_NEXT_SEQ, seen, seq + n) != seen) {
        /* moved since the load: another node holds the lock now (this one
         * stalled in between and was fenced) - never roll it back */
        PyBuffer_Release(&b);
        if (check_writable(m, "journal_append") < 0)
            return NULL;
        PyErr_SetString(cxlkv_LockLostError,
                        "journal_append: next_seq moved while this node held the pool lock");
        return NULL;
    }
    inval(m, ring, 64);
    uint64_t head = pool_load64(m, ring + R_HEAD);
    uint64_t recs = ring + 64;
    uint64_t w[7];
    for (uint64_t i = 0; i < n; i++) {
        /* a writer stalled past its write deadline proves itself fresh
         * before each record: resumed after its quarantine ended, the ring
         * may be the next holder's of its slot, records past our head its
         * published ones */
        if (write_deadline_passed(m) && check_writable(m, "journal_append") < 0) {
            PyBuffer_Release(&b);
            return NULL;
        }
        if (op == CXLKV_JOURNAL_NS_CLEARED) {
            w[0] = w[1] = w[2] = w[3] = 0;
            w[4] = ns << 32;
            w[6] = op << 32;
        } else {
            uint64_t e = tbase + ix[i] * CXLKV_HASH_ENTRY_SIZE;
            inval(m, e, CXLKV_HASH_ENTRY_SIZE);
            w[0] = pool_load64(m, e + E_KEY_LO);
            w[1] = pool_load64(m, e + E_KEY_HI);
            w[4] = pool_load64(m, e + E_LEN);
            uint64_t par = pool_load64(m, e + E_PARENT) & 0xffffffffull;
            w[2] = w[3] = 0;
            if (par > 0 && par <= nslots) {
                uint64_t pe = tbase + (par - 1) * CXLKV_HASH_ENTRY_SIZE;
                inval(m, pe, CXLKV_HASH_ENTRY_SIZE);
                w[2] = pool_load64(m, pe + E_KEY_LO);
                w[3] = pool_load64(m, pe + E_KEY_HI);
            }
            w[6] = (ix[i] + 1) | op << 32;
        }
        w[5] = now;
        put_record(m, recs, nrec, head + i, seq + i, w, names, esize, rnames);
    }
    PyBuffer_Release(&b);
    /* a crash here: the records are beyond the head, never read */
    cxlkv_crashpoint("journal.append");
    /* a stall since the check above (past the write deadline): prove this
     * node fresh again, or leave the head alone (NodeFenced) */
    if (check_writable(m, "journal_append") < 0)
        return NULL;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (pool_load64(m, ring + R_WRITER) != writer)
        pool_store64(m, ring + R_WRITER, writer);
    pool_store64(m, ring + R_HEAD, head + n);
    if (m->flush_meta)
        pool_flush(m, ring, 64);
    return PyLong_FromUnsignedLongLong(head + n);
}
