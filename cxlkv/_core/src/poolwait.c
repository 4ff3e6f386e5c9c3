/*
 * Sleeping until a pool word changes, for processes of one host
 * (cxlkv/kv/stream.py: a consumer following a producer's stores).
 *
 * word_wait(off, seen, timeout_ns) sleeps in the kernel - a shared futex
 * (not FUTEX_PRIVATE: the word is in a file every process maps) on the low
 * 32 bits of the 8-byte-aligned 64-bit word at `off` - while the word still
 * equals `seen`, for at most timeout_ns, with the GIL released.  It costs the
 * writer nothing while nobody waits and takes no CPU from it while someone
 * does; word_wake(off) wakes every sleeper after the writer changed the
 * word.  A wake-up that comes before the sleep is not lost: the kernel
 * compares the word under its own lock before sleeping.
 *
 * Who writes the word: whoever owns it (the change journal's next_seq,
 * written under the pool lock); these calls only read it.  Both work on one
 * host only (a futex is a kernel object): hosts of a rack poll instead.
 * The word is read from memory itself, never through the non-coherence
 * emulation's cache, as the kernel reads it: its writer must have flushed
 * it (the journal's writer does).
 */
#include "core.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "word_wait's futex is the low half of its word: little-endian only"
#endif

static int64_t
now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* The word at a checked offset: in range, 8-byte aligned. */
static uint64_t *
checked_word(Mapping *m, PyObject *arg, const char *name)
{
    uint64_t off;
    if (as_u64(arg, &off, "offset") < 0 || check_open(m) < 0 || check_word(m, off, name) < 0)
        return NULL;
    return (uint64_t *)(m->base + off);
}

/* word_wait(off, seen, timeout_ns) -> the word's value when the wait ended:
 * != seen once it changed, == seen when timeout_ns passed first. */
PyObject *
Mapping_word_wait(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t seen, timeout_ns;
    if (nargs_check(nargs, 3, 3, "word_wait") < 0)
        return NULL;
    uint64_t *w = checked_word(m, args[0], "word_wait");
    if (w == NULL || as_u64(args[1], &seen, "seen") < 0 ||
        as_u64(args[2], &timeout_ns, "timeout_ns") < 0)
        return NULL;
    if (timeout_ns > (uint64_t)LLONG_MAX / 2)
        timeout_ns = (uint64_t)LLONG_MAX / 2;
    uint64_t cur = __atomic_load_n(w, __ATOMIC_ACQUIRE);
    if (cur != seen || timeout_ns == 0)
        return PyLong_FromUnsignedLongLong(cur);
    int64_t until = now_ns() + (int64_t)timeout_ns;
    m->busy++;
    Py_BEGIN_ALLOW_THREADS
    for (;;) {
        int64_t left = until - now_ns();
        if (left <= 0)
            break;
        struct timespec ts = {(time_t)(left / 1000000000), (long)(left % 1000000000)};
        /* EAGAIN: the low half differs already; EINTR / spurious: look again */
        syscall(SYS_futex, (uint32_t *)w, FUTEX_WAIT, (uint32_t)seen, &ts, NULL, 0);
        cur = __atomic_load_n(w, __ATOMIC_ACQUIRE);
        if (cur != seen)
            break;
    }
    Py_END_ALLOW_THREADS
    m->busy--;
    return PyLong_FromUnsignedLongLong(cur);
}

/* word_wake(off) -> how many sleepers of word_wait on `off` were woken. */
PyObject *
Mapping_word_wake(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs_check(nargs, 1, 1, "word_wake") < 0)
        return NULL;
    uint64_t *w = checked_word(m, args[0], "word_wake");
    if (w == NULL)
        return NULL;
    long n = syscall(SYS_futex, (uint32_t *)w, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
    if (n < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    return PyLong_FromLong(n);
}
