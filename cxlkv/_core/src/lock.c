/*
 * The cas-mode ticket lock, the hot path of pool.lock() (cxlkv_format.h,
 * "Lock area"): a node takes a ticket from the header's next_ticket, records
 * it in its own lock entry, and spins until now_serving reaches it (the GIL
 * released past the first 64 polls).  Every call is given the caller's node
 * control word and writes nothing once that word changed (the node was
 * fenced).  The manager mode's grant loop is lockmgr.c, the host-local tier
 * hostlock.c.
 */
#include "core.h"

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
        PyErr_Format(cxlkv_RangeError, "%s: lock header and entry must be 64-byte aligned", name);
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
PyObject *
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
PyObject *
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
PyObject *
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
