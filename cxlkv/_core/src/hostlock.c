/*
 * The host-local tier of the pool lock (cxlkv/state/hostlock.py): a futex
 * lock word in a small per-host file (host memory, never the pool), so that
 * at most one process per host competes for the pool lock.
 *
 * Word (64 bits, little-endian, 8-byte aligned; the futex is its low half;
 * the next word is the spinner's: see SPIN_LONG_NS):
 *   bits  0-15  holder's node slot + 1 (0: no holder)
 *   bit   30    HANDOFF: a waiter starves - the next release hands the lock
 *               to a sleeping waiter instead of letting anyone barge in
 *   bit   31    WAITERS: someone may sleep in FUTEX_WAIT - release wakes one
 *   bits 32-63  the holder node's epoch (low 32 bits)
 * Free: holder bits 0.  Reserved (handed off, not yet taken): holder bits 0
 * and HANDOFF set - only a waiter that has already waited may take it.
 *
 * Barging (a free word goes to whoever CASes first) keeps the lock with a
 * running process: a preempted or sleeping waiter never stalls the others.
 * A waiter that has waited STARVE_NS sets HANDOFF, so nobody starves; the
 * mode stays on while the takers keep having waited that long and ends by
 * itself when the hand-offs get quick (or nobody sleeps any more).
 *
 * This memory is the host's own and coherent: plain atomics, no pool_*
 * helpers (a mapping under the non-coherence emulation is refused).  The
 * holder's identity beyond the word (pid, start time) and every judgement of
 * a holder's death live in Python, which calls in again after each timed
 * wait (a dead or fenced holder is taken over with cas64).
 */
#include "core.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the host lock's futex is the low half of its word: little-endian only"
#endif

#define HL_SLOT     0xFFFFull
#define HL_HANDOFF  (1ull << 30)
#define HL_WAITERS  (1ull << 31)
#define HL_HOLDER   0xFFFFFFFF0000FFFFull
/* a waiter that has waited this long asks for a hand-off */
#define STARVE_NS   4000000ll
/* the one waiter allowed to keep spinning (the spinner word, right after the
 * lock word: the deadline of its spin, 0 = none) spins this long before it
 * sleeps too: when the holder releases, the lock goes to a running process
 * at once instead of waiting for a woken sleeper to be scheduled, while the
 * others sleep (so a host with more processes than cores does not burn them) */
#define SPIN_LONG_NS 150000ll

static inline int64_t
mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline void
relax(void)
{
#if defined(__x86_64__)
    _mm_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield" ::: "memory");
#endif
}

static inline int
cas(uint64_t *w, uint64_t *expect, uint64_t desired)
{
    return __atomic_compare_exchange_n(w, expect, desired, 0, __ATOMIC_SEQ_CST,
                                       __ATOMIC_SEQ_CST);
}

/* Shared (not FUTEX_PRIVATE): the word is in a file mapped by several processes. */
static void
futex_wait(uint64_t *w, uint32_t val, int64_t ns)
{
    struct timespec ts = {(time_t)(ns / 1000000000), (long)(ns % 1000000000)};
    syscall(SYS_futex, (uint32_t *)w, FUTEX_WAIT, val, &ts, NULL, 0);
}

static long
futex_wake(uint64_t *w, int n)
{
    return syscall(SYS_futex, (uint32_t *)w, FUTEX_WAKE, n, NULL, NULL, 0);
}

static int
hl_args(Mapping *m, PyObject *const *args, uint64_t *off, uint64_t *mine, const char *name)
{
    if (as_u64(args[0], off, "offset") < 0 || as_u64(args[1], mine, "holder word") < 0 ||
        check_word(m, *off, name) < 0 || check_word(m, *off + 8, name) < 0 ||
        check_writable(m, name) < 0)
        return -1;
    if (m->nc) {
        PyErr_Format(PyExc_ValueError, "%s: the host lock lives in host memory; call "
                     "host_memory() on its mapping first", name);
        return -1;
    }
    if ((*mine & ~HL_HOLDER) || !(*mine & HL_SLOT)) {
        PyErr_Format(PyExc_ValueError, "%s: bad holder word %#llx", name,
                     (unsigned long long)*mine);
        return -1;
    }
    return 0;
}

/* The slow path, GIL released: spin, then sleep in the kernel, until the
 * lock is ours (returns 0) or `until` passes (returns the word seen last,
 * never 0).  `waited`: this acquisition already waited in an earlier call
 * (it may take a reserved word); `since`: when it began (monotonic ns). */
static uint64_t
hl_wait(uint64_t *w, uint64_t mine, uint64_t spins, int64_t until, int64_t since, int waited)
{
    uint64_t cur = __atomic_load_n(w, __ATOMIC_RELAXED);
    for (uint64_t i = 0; i < spins && !(cur & HL_HANDOFF); i++) {
        if (!(cur & HL_HOLDER) && cas(w, &cur, mine | (cur & HL_WAITERS)))
            return 0;
        relax();
        cur = __atomic_load_n(w, __ATOMIC_RELAXED);
    }
    /* become the spinner if there is none (or its spin is long over: a
     * spinner that died leaves a deadline that passes by itself) */
    uint64_t *spinner = w + 1;
    int64_t t0 = mono_ns();
    uint64_t seen = __atomic_load_n(spinner, __ATOMIC_RELAXED);
    uint64_t end = (uint64_t)(t0 + SPIN_LONG_NS);
    if (!(cur & HL_HANDOFF) && (seen == 0 || (int64_t)seen < t0) &&
        __atomic_compare_exchange_n(spinner, &seen, end, 0, __ATOMIC_ACQ_REL,
                                    __ATOMIC_RELAXED)) {
        int got = 0;
        for (uint64_t i = 1;; i++) {
            cur = __atomic_load_n(w, __ATOMIC_RELAXED);
            if (cur & HL_HANDOFF)
                break;
            if (!(cur & HL_HOLDER) && cas(w, &cur, mine | (cur & HL_WAITERS))) {
                got = 1;
                break;
            }
            relax();
            if (!(i & 63) && mono_ns() >= (int64_t)end)
                break;
        }
        uint64_t e = end;                       /* unless a successor took it over */
        __atomic_compare_exchange_n(spinner, &e, 0, 0, __ATOMIC_RELEASE, __ATOMIC_RELAXED);
        if (got)
            return 0;
    }
    for (;;) {
        cur = __atomic_load_n(w, __ATOMIC_ACQUIRE);
        int64_t now = mono_ns();
        if (!(cur & HL_HOLDER)) {
            if (!(cur & HL_HANDOFF) || waited) {
                /* a taker that starved keeps the hand-off mode on for the next */
                uint64_t keep = (cur & HL_HANDOFF) && now - since >= STARVE_NS ? HL_HANDOFF : 0;
                if (cas(w, &cur, mine | HL_WAITERS | keep))
                    return 0;
                continue;
            }
        }
        uint64_t want = cur | HL_WAITERS;
        if ((cur & HL_HOLDER) && now - since >= STARVE_NS)
            want |= HL_HANDOFF;
        if (want != cur && !cas(w, &cur, want))
            continue;
        if (now >= until)
            return want;
        /* wake up when this wait turns into starving, to ask for the hand-off
         * then, not at the end of the caller's slice */
        int64_t nap = until - now, starve_in = STARVE_NS - (now - since);
        if (!(want & HL_HANDOFF) && starve_in > 0 && starve_in < nap)
            nap = starve_in;
        futex_wait(w, (uint32_t)want, nap);
        waited = 1;
    }
}

/* host_memory(): this mapping is host memory (a host lock file), coherent
 * whatever CXLKV_NONCOHERENT says: drop its emulated cache.  Call it right
 * after mapping, before any access. */
PyObject *
Mapping_host_memory(Mapping *m, PyObject *Py_UNUSED(ignored))
{
    if (check_open(m) < 0)
        return NULL;
    if (m->nc) {
        nc_destroy(m->nc);
        m->nc = NULL;
    }
    Py_RETURN_NONE;
}

/* hostlock_acquire(off, mine, spins, wait_ns, since_ns) -> 0 when the lock
 * is ours, else the holder's word after waiting up to wait_ns (judge the
 * holder, then call again with since_ns = when the first call began; 0 on
 * the first call).  The uncontended path is one CAS with the GIL held. */
PyObject *
Mapping_hostlock_acquire(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t off, mine, spins, wait_ns, since;
    if (nargs_check(nargs, 5, 5, "hostlock_acquire") < 0 ||
        hl_args(m, args, &off, &mine, "hostlock_acquire") < 0 ||
        as_u64(args[2], &spins, "spins") < 0 || as_u64(args[3], &wait_ns, "wait_ns") < 0 ||
        as_u64(args[4], &since, "since_ns") < 0)
        return NULL;
    uint64_t *w = (uint64_t *)(m->base + off);
    uint64_t cur = 0;
    if (since == 0 && cas(w, &cur, mine))
        return PyLong_FromLong(0);
    if (wait_ns > (uint64_t)LLONG_MAX / 2)
        wait_ns = (uint64_t)LLONG_MAX / 2;
    int64_t now = mono_ns();
    int64_t start = since ? (int64_t)since : now;
    uint64_t r;
    m->busy++;
    Py_BEGIN_ALLOW_THREADS
    r = hl_wait(w, mine, since ? 0 : spins, now + (int64_t)wait_ns, start, since != 0);
    Py_END_ALLOW_THREADS
    m->busy--;
    return PyLong_FromUnsignedLongLong(r);
}

/* hostlock_release(off, mine) -> True, or False when the word no longer
 * names `mine` (the lock was taken over: nothing is written). */
PyObject *
Mapping_hostlock_release(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t off, mine;
    if (nargs_check(nargs, 2, 2, "hostlock_release") < 0 ||
        hl_args(m, args, &off, &mine, "hostlock_release") < 0)
        return NULL;
    uint64_t *w = (uint64_t *)(m->base + off);
    uint64_t cur = mine;
    if (cas(w, &cur, 0))                        /* nobody waits: one CAS */
        Py_RETURN_TRUE;
    for (;;) {
        if ((cur & HL_HOLDER) != mine)
            Py_RETURN_FALSE;
        uint64_t next = cur & HL_HANDOFF;       /* reserved for a sleeper, or free */
        if (!cas(w, &cur, next))
            continue;
        if (cur & (HL_WAITERS | HL_HANDOFF)) {
            long woken = futex_wake(w, 1);
            uint64_t r = HL_HANDOFF;
            if (next && woken <= 0)             /* nobody slept: no hand-off to make */
                cas(w, &r, 0);
        }
        Py_RETURN_TRUE;
    }
}
