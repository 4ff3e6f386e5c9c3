/*
 * Helper threads for the spill tier's read path (spill.c): a run of slots
 * is cut into units (one preadv each, then the hash of its blocks), and the
 * calling thread and these helpers take units in order from a shared
 * counter, so the copy and hash of unit k+1 run on another core while unit
 * k's are done here.  The caller takes units too: a run is never slower
 * than the caller alone by more than the hand-off (the helpers may be
 * asleep, busy or descheduled; the caller then does the units they have
 * not taken).
 *
 * One job at a time, process-wide: a caller finding another job posted runs
 * its units alone.  A job lives on its caller's stack; it is posted and
 * withdrawn under `mu`, and a helper counts itself in (`users`) under `mu`
 * before touching it, so the caller returns only once no helper holds it.
 * Helpers never touch Python objects: the caller holds every buffer until
 * it returns.
 *
 * An idle helper polls for the next job for `spin_us`, then sleeps on `cv`.
 * A job is posted only while a helper is awake (`warm_only`): when every
 * helper sleeps, the run is the caller's alone and the helpers are woken to
 * poll for the next one - on this project's 2-vCPU VM a run that woke a
 * sleeping helper was slower than the caller alone (README, Spill at line
 * rate).  The caller waits for the units helpers hold by polling (each is
 * one unit's copy and hash: tens of microseconds), yielding the CPU after a
 * few microseconds.
 *
 * Fork: a child has no helpers (pthread_atfork resets the pool).
 */
#include "core.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

#define MAX_HELPERS 8

struct pool_job {
    spill_unit_fn fn;
    void *ctx;
    Py_ssize_t nunits;
    _Atomic Py_ssize_t *limit;   /* units >= *limit are not started */
    _Atomic Py_ssize_t next;     /* the next unit to take */
    _Atomic int users;           /* helpers holding this job */
};

static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct pool_job *job;        /* guarded by mu: the posted job, or NULL */
    _Atomic unsigned long seq;   /* bumped (under mu) when a job is posted */
    int want;                    /* guarded by mu: helpers 0..want-1 are to run */
    _Atomic int alive;           /* helpers started and not yet told to exit */
    int sleeping;                /* guarded by mu: helpers waiting on cv */
    pthread_t tids[MAX_HELPERS]; /* guarded by cfg (spill_helpers) */
    unsigned long start_seq[MAX_HELPERS];   /* guarded by mu: seq when helper i was started */
    _Atomic int spin_us;
    _Atomic int caller_works;    /* 0: the caller takes no unit (tests) */
    _Atomic int warm_only;       /* post a job only while a helper is awake (polling) */
    _Atomic unsigned long long helper_units, caller_units, jobs, solo, warmups;
    int atfork;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, .spin_us = 50,
          .caller_works = 1, .warm_only = 1};

/* serialises spill_helpers() (starting, stopping and joining helpers) */
static pthread_mutex_t cfg = PTHREAD_MUTEX_INITIALIZER;

static inline void
cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static inline uint64_t
now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Take and run units of `j` until none is left (or past its limit). */
static unsigned long long
take_units(struct pool_job *j)
{
    unsigned long long done = 0;
    for (;;) {
        Py_ssize_t u = atomic_fetch_add(&j->next, 1);
        if (u >= j->nunits || u >= atomic_load(j->limit))
            return done;
        j->fn(j->ctx, u);
        done++;
    }
}

static void *
helper_main(void *arg)
{
    int me = (int)(intptr_t)arg;
    /* the jobs posted since spill_helpers() started this thread are new to
     * it, however late it runs (seq read now could already count one) */
    pthread_mutex_lock(&pool.mu);
    unsigned long seen = pool.start_seq[me];
    pthread_mutex_unlock(&pool.mu);
    for (;;) {
        /* poll for a new job for spin_us, then sleep */
        uint64_t until = now_ns() + (uint64_t)atomic_load(&pool.spin_us) * 1000u;
        for (unsigned k = 0; atomic_load(&pool.seq) == seen; k++) {
            if ((k & 63) == 63 && now_ns() >= until)
                break;
            cpu_relax();
        }
        pthread_mutex_lock(&pool.mu);
        while (atomic_load(&pool.seq) == seen && me < pool.want) {
            pool.sleeping++;
            pthread_cond_wait(&pool.cv, &pool.mu);
            pool.sleeping--;
        }
        if (me >= pool.want) {
            pthread_mutex_unlock(&pool.mu);
            return NULL;
        }
        seen = atomic_load(&pool.seq);
        struct pool_job *j = pool.job;
        if (j)
            atomic_fetch_add(&j->users, 1);
        pthread_mutex_unlock(&pool.mu);
        if (j) {
            atomic_fetch_add(&pool.helper_units, take_units(j));
            atomic_fetch_sub(&j->users, 1);        /* the last touch of the job */
        }
    }
}

static void
after_fork_child(void)
{
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.cv, NULL);
    pthread_mutex_init(&cfg, NULL);
    pool.job = NULL;
    pool.want = pool.sleeping = 0;
    atomic_store(&pool.alive, 0);
}

void
cxlkv_spill_pool_run(spill_unit_fn fn, void *ctx, Py_ssize_t nunits, _Atomic Py_ssize_t *limit)
{
    struct pool_job j = {.fn = fn, .ctx = ctx, .nunits = nunits, .limit = limit};
    atomic_init(&j.next, 0);
    atomic_init(&j.users, 0);
    int posted = 0, caller_works = 1;
    if (nunits > 1) {
        pthread_mutex_lock(&pool.mu);
        caller_works = atomic_load(&pool.caller_works);
        if (pool.want > 0 && pool.job == NULL &&
            (pool.sleeping < pool.want || !caller_works || !atomic_load(&pool.warm_only))) {
            pool.job = &j;
            atomic_fetch_add(&pool.seq, 1);
            posted = 1;
            if (pool.sleeping)
                pthread_cond_broadcast(&pool.cv);
        } else if (pool.want > 0 && pool.job == NULL) {
            /* every helper asleep: waking one costs about what it would
             * take over (measured: a run after an idle spell was slower
             * with helpers than alone).  This run is the caller's; the
             * helpers are woken to poll for the next one. */
            atomic_fetch_add(&pool.seq, 1);
            pthread_cond_broadcast(&pool.cv);
            atomic_fetch_add(&pool.warmups, 1);
        }
        pthread_mutex_unlock(&pool.mu);
    }
    if (!posted)
        caller_works = 1;
    atomic_fetch_add(posted ? &pool.jobs : &pool.solo, 1);
    if (caller_works)
        atomic_fetch_add(&pool.caller_units, take_units(&j));
    if (!posted)
        return;
    /* every unit taken (or, with caller_works off, all of them done by the
     * helpers); then withdraw the job and wait for the helpers holding it */
    for (unsigned k = 0;; k++) {
        Py_ssize_t nx = atomic_load(&j.next);
        if ((nx >= nunits || nx >= atomic_load(limit)) &&
            (caller_works || atomic_load(&j.users) == 0))
            break;
        if (k < 256) {
            cpu_relax();
        } else {
            if (atomic_load(&pool.alive) == 0)   /* helpers stopped meanwhile */
                atomic_fetch_add(&pool.caller_units, take_units(&j));
            sched_yield();
        }
    }
    pthread_mutex_lock(&pool.mu);
    pool.job = NULL;
    pthread_mutex_unlock(&pool.mu);
    for (unsigned k = 0; atomic_load(&j.users) != 0; k++) {
        if (k < 256)
            cpu_relax();
        else
            sched_yield();
    }
}

/* spill_helpers(n, spin_us=None, caller_works=None) -> helpers running
 * (spin_us and caller_works: unchanged when not given; 50 and True at first) */
PyObject *
mod_spill_helpers(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs_check(nargs, 1, 3, "spill_helpers") < 0)
        return NULL;
    long n = PyLong_AsLong(args[0]);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    long spin = -1;
    if (nargs > 1 && args[1] != Py_None) {
        spin = PyLong_AsLong(args[1]);
        if (spin == -1 && PyErr_Occurred())
            return NULL;
    }
    int works = -1;
    if (nargs > 2 && args[2] != Py_None && (works = PyObject_IsTrue(args[2])) < 0)
        return NULL;
    if (n < 0 || n > MAX_HELPERS || spin < -1 || spin > 100000) {
        PyErr_Format(PyExc_ValueError, "spill_helpers: n must be 0..%d and spin_us 0..100000",
                     MAX_HELPERS);
        return NULL;
    }
    int err = 0, running;
    pthread_t gone[MAX_HELPERS];
    int ngone = 0;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&cfg);
    pthread_mutex_lock(&pool.mu);
    if (!pool.atfork) {
        pool.atfork = 1;
        pthread_atfork(NULL, NULL, after_fork_child);
    }
    if (spin >= 0)
        atomic_store(&pool.spin_us, (int)spin);
    if (works >= 0)
        atomic_store(&pool.caller_works, works);
    /* helpers >= n exit when idle (joined below); then start the missing */
    for (int i = (int)n; i < pool.want; i++)
        gone[ngone++] = pool.tids[i];
    if (n < pool.want) {
        pool.want = (int)n;
        atomic_store(&pool.alive, (int)n);
        pthread_cond_broadcast(&pool.cv);
    }
    pthread_mutex_unlock(&pool.mu);
    for (int i = 0; i < ngone; i++)
        pthread_join(gone[i], NULL);
    pthread_mutex_lock(&pool.mu);
    while (pool.want < n) {
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setstacksize(&at, 64 * 1024);
        pool.start_seq[pool.want] = atomic_load(&pool.seq);
        err = pthread_create(&pool.tids[pool.want], &at, helper_main,
                             (void *)(intptr_t)pool.want);
        pthread_attr_destroy(&at);
        if (err)
            break;
        pool.want++;
        atomic_store(&pool.alive, pool.want);
    }
    running = pool.want;
    pthread_mutex_unlock(&pool.mu);
    pthread_mutex_unlock(&cfg);
    Py_END_ALLOW_THREADS
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromLong(running);
}

/* spill_helper_stats() -> {helpers, spin_us, jobs, solo, helper_units, caller_units} */
PyObject *
mod_spill_helper_stats(PyObject *self, PyObject *Py_UNUSED(ignored))
{
    (void)self;
    pthread_mutex_lock(&pool.mu);
    int running = pool.want, sleeping = pool.sleeping;
    pthread_mutex_unlock(&pool.mu);
    return Py_BuildValue("{s:i,s:i,s:i,s:K,s:K,s:K,s:K,s:K}", "helpers", running,
                         "sleeping", sleeping,
                         "spin_us", atomic_load(&pool.spin_us), "jobs", atomic_load(&pool.jobs),
                         "solo", atomic_load(&pool.solo), "warmups", atomic_load(&pool.warmups),
                         "helper_units", atomic_load(&pool.helper_units),
                         "caller_units", atomic_load(&pool.caller_units));
}
