/*
 * Sync mode `manager`: the lock manager's hot loop and the client's wait for
 * a grant (cxlkv/daemons/lockmgr.py, cxlkv/state/locks.py ManagerLock).
 *
 * Memory without cross-host atomics: every word read here that another party
 * writes is invalidated first, every word written is flushed (plain store +
 * flush, one writer per line).  The offsets come from Python (the lock and
 * node regions of the superblock) and are bounds-checked once per call
 * against the mapping for the whole regions; slots come from a range checked
 * against max_nodes, so every derived offset lies inside.
 *
 * mgr_loop runs with the GIL released until something needs Python: the
 * heartbeat / superblock check is due, a node slot needs a look (a claim, an
 * attach or detach acknowledgement, a local process gone, a remote heartbeat
 * still for a lease, a fenced slot), a write is due but the lease guard must
 * beat first, another manager took the lease, or the lock is in a state the
 * Python reference handles (the holder's line shows another epoch; a fenced
 * node waits for recovery while the lock is free).  The common rounds -
 * a holder released, grant the next waiter round-robin - never leave C.
 * When nothing happened for the spin time it sleeps with backoff (to 1 ms, and
 * to a few ms once idle for a second; never past the next heartbeat), so an
 * idle manager costs nearly nothing: a request to an idle manager waits at
 * most one such sleep.
 */
#include "core.h"

#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <stddef.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define LH_MGR_TOKEN   offsetof(struct cxlkv_lock_hdr, mgr_token)
#define LH_MGR_HEARTBEAT offsetof(struct cxlkv_lock_hdr, mgr_heartbeat)
#define LE_EPOCH       offsetof(struct cxlkv_lock_entry, epoch)
#define LE_REQ         offsetof(struct cxlkv_lock_entry, req_seq)
#define LE_RELEASE     offsetof(struct cxlkv_lock_entry, release_seq)
#define LE_GRANT       offsetof(struct cxlkv_lock_entry, grant_seq)
#define LE_REVOKE      offsetof(struct cxlkv_lock_entry, revoke_seq)
#define LE_GRANT_EPOCH offsetof(struct cxlkv_lock_entry, grant_epoch)
#define ND_CONTROL     offsetof(struct cxlkv_node, control)
#define ND_HEARTBEAT   offsetof(struct cxlkv_node, heartbeat)
#define ND_CLAIM       offsetof(struct cxlkv_node, claim_token)
#define ND_PID         offsetof(struct cxlkv_node, pid)
#define ND_BOOT        offsetof(struct cxlkv_node, boot_id)
#define ND_PIDNS       offsetof(struct cxlkv_node, pidns)
#define ND_IDENT_EPOCH offsetof(struct cxlkv_node, ident_epoch)
#define ND_MGR_CONTROL offsetof(struct cxlkv_node, mgr_control)
#define ND_MGR_GRANT   offsetof(struct cxlkv_node, mgr_grant_token)

#define ST_FREE     0
#define ST_CLAIMED  1
#define ST_ATTACHED 2
#define ST_FENCED   3

/* the manager's state words (an int64 array shared with Python) */
enum {
    MS_HOLDER = 0,      /* slot holding the lock, -1 = none */
    MS_LAST,            /* last slot granted (round-robin) */
    MS_GRANTS,          /* grants made (count) */
    MS_RECOVER,         /* recover_pending: grant nothing until Python recovered */
    MS_BEAT_AT,         /* CLOCK_MONOTONIC ns of the last heartbeat (guard) */
    MS_RETURN_AT,       /* return to Python (heartbeat due) at this time */
    MS_BUSY_UNTIL,      /* spin, do not sleep, until this time */
    MS_SLEEP,           /* current backoff, ns */
    MS_TOKEN,           /* this manager's lease token */
    MS_LEASE,           /* lease, ns */
    MS_SCAN_EVERY,      /* node slots are looked at this often, ns */
    MS_SPIN,            /* spin this long after activity, ns */
    MS_SLEEP_MAX,       /* longest idle sleep, ns */
    MS_PIDNS,           /* this process's pid namespace inode */
    MS_LAST_SCAN,       /* time of the last look at the node slots */
    MS_REFRESH,         /* 1: Python just looked at the slots: refresh the table only */
    MS_SLOT,            /* out: the slot that needs Python (-1: several / none) */
    MS_ROUNDS,          /* lock rounds run (stats) */
    MS_IDLE_AFTER,      /* no activity for this long (ns): sleep up to MS_IDLE_SLEEP_MAX */
    MS_IDLE_SLEEP_MAX,  /* longest sleep of a manager idle that long, ns */
    MS_BEAT_DUE,        /* heartbeat due at this time */
    MS_BEAT_EVERY,      /* heartbeat period, ns */
    MS_BEATS,           /* heartbeats made in C (stats) */
    MS_COUNT
};

/* per-slot table (int64 x TB_WIDTH per slot) */
enum {
    TB_CTL = 0,         /* mgr_control this entry describes; -1 = none yet */
    TB_HB,              /* heartbeat last seen */
    TB_SINCE,           /* CLOCK_MONOTONIC ns when (ctl, heartbeat) last changed */
    TB_PIDFD,           /* pidfd of a local node's process, -1 = none */
    TB_LOCAL,           /* 0 not known yet / 3 remote: judged by heartbeat; 1 local (pidfd),
                           2 local without pidfd (Python checks the pid every scan) */
    TB_WIDTH = 8
};

enum { R_BEAT = 0, R_SLOTS = 1, R_GUARD = 2, R_STEPDOWN = 3, R_PYSTEP = 4 };

static inline int64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline void relax(void)
{
#if defined(__x86_64__)
    _mm_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield" ::: "memory");
#endif
}

static void sleep_ns(int64_t ns)
{
    if (ns <= 0)
        return;
    struct timespec ts = {(time_t)(ns / 1000000000), (long)(ns % 1000000000)};
    nanosleep(&ts, NULL);
}

/* A line another party writes: invalidate, then load. */
static inline uint64_t fresh64(Mapping *m, uint64_t off)
{
    pool_invalidate(m, off, 8);
    return pool_load64(m, off);
}

struct mgr {
    Mapping *m;
    uint64_t hdr, entries, nodes;
    int64_t n;
    int64_t *st;
    int64_t *tb;
    const unsigned char *boot;    /* 16 bytes */
    const unsigned char *sb;      /* the superblock copies last found good by Python */
    uint64_t sb_len;              /* 0: none (Python beats) */
};

static inline uint64_t ent(const struct mgr *g, int64_t s) { return g->entries + (uint64_t)s * CXLKV_LOCK_ENTRY_SIZE; }
static inline uint64_t nod(const struct mgr *g, int64_t s) { return g->nodes + (uint64_t)s * CXLKV_NODE_SIZE; }

static void tb_reset(int64_t *t, int64_t ctl, int64_t hb, int64_t now)
{
    if (t[TB_PIDFD] >= 0)
        close((int)t[TB_PIDFD]);
    t[TB_CTL] = ctl;
    t[TB_HB] = hb;
    t[TB_SINCE] = now;
    t[TB_PIDFD] = -1;
    t[TB_LOCAL] = 0;
}

/* Is the attached node's identity of this host and epoch (NodeInfo.
 * same_process_space)?  Then open a pidfd for its pid. 1 if it became local. */
static int
try_local(struct mgr *g, int64_t s, int64_t *t, uint64_t epoch)
{
    Mapping *m = g->m;
    uint64_t off = nod(g, s);
    pool_invalidate(m, off + ND_PID, 64);
    pool_invalidate(m, off + ND_PIDNS, 16);
    uint64_t pid = pool_load64(m, off + ND_PID);
    if (pool_load64(m, off + ND_IDENT_EPOCH) != epoch)
        return 0;                   /* identity not written yet: look again next scan */
    unsigned char boot[16];
    pool_read(m, off + ND_BOOT, boot, 16);
    if (pid == 0 || pid > 0x7fffffff || pool_load64(m, off + ND_PIDNS) != (uint64_t)g->st[MS_PIDNS] ||
        memcmp(boot, g->boot, 16) != 0) {
        t[TB_LOCAL] = 3;            /* another host or pid namespace: judged by heartbeat */
        return 0;
    }
#ifdef SYS_pidfd_open
    long fd = syscall(SYS_pidfd_open, (pid_t)pid, 0);
    if (fd >= 0) {
        t[TB_PIDFD] = fd;
        t[TB_LOCAL] = 1;
        return 1;
    }
#endif
    t[TB_LOCAL] = 2;
    return 1;
}

/* Invalidate line 0 (the node's own line) of every slot: one fence pair for
 * all of them (what pool_invalidate does per range), so that the loads that
 * follow miss in parallel. */
static void
invalidate_node_lines(struct mgr *g, int own_too)
{
    Mapping *m = g->m;
    if (m->nc) {
        for (int64_t s = 0; s < g->n; s++) {
            nc_invalidate(m->nc, nod(g, s), 64);
            if (own_too)
                nc_invalidate(m->nc, nod(g, s) + ND_MGR_CONTROL, 16);
        }
        return;
    }
    enum cxlkv_flush_kind k = cxlkv_cpu.invalidate;
    cxlkv_mfence();
    for (int64_t s = 0; s < g->n; s++) {
        cxlkv_line_op(k, m->base + nod(g, s));
        if (own_too)
            cxlkv_line_op(k, m->base + nod(g, s) + ND_MGR_CONTROL);
    }
    cxlkv_mfence();
}

/* One look at every node slot (what LockManager._slot would act on).
 * Line 7 (mgr_control, mgr_grant_token) has one writer, this manager (its
 * Python side writes it through the same mapping), so it is read from this
 * host's cache, and invalidated only on a refresh (after Python acted, or
 * when taking office: what an earlier manager wrote).  Returns the number of
 * slots that need Python; *which = the last of them. */
static int
scan_slots(struct mgr *g, int64_t now, int64_t *which, int refresh)
{
    Mapping *m = g->m;
    int need = 0;
    invalidate_node_lines(g, refresh);
    for (int64_t s = 0; s < g->n; s++) {
        uint64_t off = nod(g, s);
        int64_t *t = g->tb + s * TB_WIDTH;
        uint64_t mctl = pool_load64(m, off + ND_MGR_CONTROL);
        uint64_t granted = pool_load64(m, off + ND_MGR_GRANT);
        uint64_t ctl = pool_load64(m, off + ND_CONTROL);
        uint64_t hb = pool_load64(m, off + ND_HEARTBEAT);
        uint64_t claim = pool_load64(m, off + ND_CLAIM);
        unsigned state = (unsigned)(mctl & 0xFF);
        uint64_t epoch = mctl >> 8;
        unsigned ack_state = (unsigned)(ctl & 0xFF);
        uint64_t ack_epoch = ctl >> 8;
        int flag = 0;
        int fresh = t[TB_CTL] != (int64_t)mctl;
        if (fresh)
            tb_reset(t, (int64_t)mctl, (int64_t)hb, now);
        if (state == ST_FREE) {
            flag = claim && claim != granted;
        } else if (state == ST_CLAIMED && ack_state == ST_ATTACHED && ack_epoch == epoch) {
            flag = 1;
        } else if (state == ST_ATTACHED && ack_state == ST_FREE && ack_epoch == epoch) {
            flag = 1;
        } else if (state == ST_CLAIMED || state == ST_ATTACHED) {
            if (t[TB_LOCAL] == 0 && state == ST_ATTACHED && try_local(g, s, t, epoch))
                flag = 1;           /* first sight of a local process: Python checks it */
            else if (t[TB_LOCAL] == 1) {
                struct pollfd p = {(int)t[TB_PIDFD], POLLIN, 0};
                flag = poll(&p, 1, 0) != 0;     /* exited (or an error): Python looks */
            } else if (t[TB_LOCAL] == 2) {
                flag = 1;           /* no pidfd: Python checks the pid every scan */
            } else if ((int64_t)hb != t[TB_HB]) {
                t[TB_HB] = (int64_t)hb;
                t[TB_SINCE] = now;
            } else {
                flag = now - t[TB_SINCE] >= g->st[MS_LEASE];
            }
        } else if (state == ST_FENCED) {
            flag = 1;
        }
        if (flag) {
            need++;
            *which = s;
        }
    }
    return need;
}

/* LockManager.guard's fast path, on the clock of this moment (not the
 * round's: the process may have been paused since): beaten within half a
 * lease.  Otherwise Python proves the lease (or steps down) first. */
static inline int
guard_ok(struct mgr *g)
{
    return mono_ns() - g->st[MS_BEAT_AT] < g->st[MS_LEASE] / 2;
}

/* One round of the lock (LockManager.step after the slots): 1 = something
 * changed, 0 = nothing, or -(R_*) for Python. */
static int
lock_round(struct mgr *g)
{
    Mapping *m = g->m;
    int64_t holder = g->st[MS_HOLDER];
    int changed = 0;
    g->st[MS_ROUNDS]++;
    if (holder >= 0) {
        uint64_t e = ent(g, holder);
        pool_invalidate(m, e, CXLKV_LOCK_ENTRY_SIZE);
        uint64_t grant = pool_load64(m, e + LE_GRANT);
        /* the release before the epoch: a line rewritten epoch first, then
         * release, is judged by the epoch its release came with (epoch read
         * first, the release after, took a stale release for the holder's) */
        uint64_t rel = pool_load64(m, e + LE_RELEASE), rev = pool_load64(m, e + LE_REVOKE);
        cxlkv_crashpoint("mgr.held");
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        uint64_t epoch = pool_load64(m, e + LE_EPOCH);
        if (epoch != pool_load64(m, e + LE_GRANT_EPOCH))
            return -R_PYSTEP;       /* a stale incarnation wrote the line: Python revokes */
        if (rel >= grant || rev >= grant) {
            g->st[MS_HOLDER] = holder = -1;
            changed = 1;
        }
    }
    if (holder >= 0)
        return changed;
    if (g->st[MS_RECOVER])
        return -R_PYSTEP;           /* recover the fenced node before the next grant */
    /* round-robin: the first waiter after the last one served */
    int64_t n = g->n, last = g->st[MS_LAST];
    for (int64_t i = 1; i <= n; i++) {
        int64_t s = ((last + i) % n + n) % n;
        const int64_t *t = g->tb + s * TB_WIDTH;
        /* not an attached node (as of the last look at the slots): it could
         * not be granted anyway - its request is not even read */
        if (t[TB_CTL] < 0 || (t[TB_CTL] & 0xFF) != ST_ATTACHED)
            continue;
        uint64_t e = ent(g, s);
        pool_invalidate(m, e, CXLKV_LOCK_ENTRY_SIZE);
        uint64_t req = pool_load64(m, e + LE_REQ);
        uint64_t grant = pool_load64(m, e + LE_GRANT), revoke = pool_load64(m, e + LE_REVOKE);
        uint64_t release = pool_load64(m, e + LE_RELEASE);
        uint64_t top = grant > revoke ? grant : revoke;
        if (release > top)
            top = release;
        if (req <= top)
            continue;
        uint64_t epoch = pool_load64(m, e + LE_EPOCH);
        uint64_t mctl = fresh64(m, nod(g, s) + ND_MGR_CONTROL);
        if (mctl != (((epoch << 8) | ST_ATTACHED)))
            continue;               /* not (yet) an attached node of that epoch */
        if (fresh64(m, g->hdr + LH_MGR_TOKEN) != (uint64_t)g->st[MS_TOKEN])
            return -R_STEPDOWN;
        if (!guard_ok(g))
            return -R_GUARD;
        pool_store64(m, e + LE_GRANT_EPOCH, epoch);
        pool_store64(m, e + LE_GRANT, req);
        pool_flush(m, e + LE_GRANT, 24);
        g->st[MS_HOLDER] = s;
        g->st[MS_LAST] = s;
        g->st[MS_GRANTS]++;
        return 1;
    }
    return changed;
}

/* The heartbeat, when Python's checks would pass: the superblock copies are
 * byte for byte the ones Python last validated (LockManager.check_superblock
 * returns at once on them), the lease still carries our token (still_active);
 * then beat (LockManager.beat).  0: Python must look (and beat). */
static int
beat(struct mgr *g, int64_t now)
{
    Mapping *m = g->m;
    if (g->sb_len == 0)
        return 0;
    unsigned char buf[256];
    pool_invalidate(m, 0, g->sb_len);
    for (uint64_t o = 0; o < g->sb_len; o += sizeof buf) {
        uint64_t k = g->sb_len - o < sizeof buf ? g->sb_len - o : sizeof buf;
        pool_read(m, o, buf, k);
        if (memcmp(buf, g->sb + o, k) != 0)
            return 0;
    }
    if (fresh64(m, g->hdr + LH_MGR_TOKEN) != (uint64_t)g->st[MS_TOKEN])
        return 0;
    uint64_t off = g->hdr + LH_MGR_HEARTBEAT;
    pool_store64(m, off, pool_load64(m, off) + 1);
    pool_flush(m, off, 8);
    g->st[MS_BEAT_AT] = now;
    g->st[MS_BEATS]++;
    return 1;
}

static int
mgr_run(struct mgr *g)
{
    int64_t *st = g->st;
    int64_t which = -1;
    int64_t now = mono_ns();
    st[MS_SLOT] = -1;
    if (st[MS_REFRESH]) {
        scan_slots(g, now, &which, 1);  /* Python just acted on the slots */
        st[MS_REFRESH] = 0;
        st[MS_LAST_SCAN] = now;
    }
    for (;;) {
        now = mono_ns();
        if (now >= st[MS_BEAT_DUE]) {
            if (!beat(g, now))
                return R_BEAT;
            st[MS_BEAT_DUE] = now + st[MS_BEAT_EVERY];
        }
        if (now >= st[MS_RETURN_AT])
            return R_BEAT;
        if (now - st[MS_LAST_SCAN] >= st[MS_SCAN_EVERY]) {
            st[MS_LAST_SCAN] = now;
            which = -1;
            int need = scan_slots(g, now, &which, 0);
            if (need) {
                st[MS_SLOT] = need == 1 ? which : -1;
                return R_SLOTS;
            }
        }
        int r = lock_round(g);
        if (r < 0)
            return -r;
        if (r > 0) {
            st[MS_SLEEP] = 0;
            st[MS_BUSY_UNTIL] = now + st[MS_SPIN];
            continue;
        }
        if (now < st[MS_BUSY_UNTIL]) {
            /* spin after activity: grants stay fast; yielding, so that a
             * client runnable on this CPU gets it (more processes than CPUs) */
            sched_yield();
            continue;
        }
        /* backoff from 50 us to MS_SLEEP_MAX; once idle for MS_IDLE_AFTER, to
         * MS_IDLE_SLEEP_MAX: each wake-up is what an idle manager costs */
        int64_t cap = now - (st[MS_BUSY_UNTIL] - st[MS_SPIN]) >= st[MS_IDLE_AFTER]
                      ? st[MS_IDLE_SLEEP_MAX] : st[MS_SLEEP_MAX];
        int64_t s = st[MS_SLEEP] * 2;
        if (s < 50000)
            s = 50000;
        if (s > cap)
            s = cap;
        st[MS_SLEEP] = s;
        int64_t left = (st[MS_RETURN_AT] < st[MS_BEAT_DUE] ? st[MS_RETURN_AT] : st[MS_BEAT_DUE]) - now;
        sleep_ns(s < left ? s : left);  /* idle: sleep, a request waits at most this */
    }
}

static int
get_i64(PyObject *o, Py_buffer *b, Py_ssize_t min_items, const char *what)
{
    if (PyObject_GetBuffer(o, b, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (b->itemsize != 8 || !b->format || (strcmp(b->format, "q") && strcmp(b->format, "l") &&
                                           strcmp(b->format, "<q") && strcmp(b->format, "=q") &&
                                           strcmp(b->format, "<l") && strcmp(b->format, "=l")) ||
        b->len < min_items * 8) {
        PyErr_Format(PyExc_TypeError, "%s must be a writable int64 array of at least %zd items",
                     what, min_items);
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

/* mgr_loop(lock_hdr, nodes, max_nodes, state, table, boot_id, superblocks)
 *   -> reason
 *   state: int64[MS_COUNT] (see enum), table: int64[max_nodes * 8],
 *   boot_id: 16 bytes, superblocks: the bytes at offset 0 that Python last
 *   validated (b"": Python makes every heartbeat).  It beats itself while
 *   they are unchanged and the lease is ours, and returns at state[RETURN_AT]
 *   (signals are handled then).  Reasons: 0 heartbeat (Python's) or return
 *   time due, 1 a slot needs Python,
 *   2 guard (beat before writing), 3 another manager holds the lease,
 *   4 the lock needs the Python step.  GIL released. */
PyObject *
Mapping_mgr_loop(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t hdr, nodes, n;
    if (nargs_check(nargs, 7, 7, "mgr_loop") < 0 ||
        as_u64(args[0], &hdr, "lock header offset") < 0 ||
        as_u64(args[1], &nodes, "node table offset") < 0 ||
        as_u64(args[2], &n, "max_nodes") < 0)
        return NULL;
    if (n < 1 || n > 4096) {
        PyErr_Format(PyExc_ValueError, "mgr_loop: max_nodes %llu out of range",
                     (unsigned long long)n);
        return NULL;
    }
    if (check_range(m, hdr, CXLKV_LOCK_HDR_SIZE + n * CXLKV_LOCK_ENTRY_SIZE, "mgr_loop") < 0 ||
        check_range(m, nodes, n * CXLKV_NODE_SIZE, "mgr_loop") < 0 ||
        check_writable(m, "mgr_loop") < 0)
        return NULL;
    if ((hdr | nodes) & 63) {
        PyErr_SetString(cxlkv_RangeError, "mgr_loop: lock and node regions must be 64-byte aligned");
        return NULL;
    }
    Py_buffer sb, tb, bb;
    if (get_i64(args[3], &sb, MS_COUNT, "state") < 0)
        return NULL;
    if (get_i64(args[4], &tb, (Py_ssize_t)n * TB_WIDTH, "table") < 0) {
        PyBuffer_Release(&sb);
        return NULL;
    }
    if (PyObject_GetBuffer(args[5], &bb, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&sb);
        PyBuffer_Release(&tb);
        return NULL;
    }
    Py_buffer sbb;
    if (PyObject_GetBuffer(args[6], &sbb, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&sb);
        PyBuffer_Release(&tb);
        PyBuffer_Release(&bb);
        return NULL;
    }
    PyObject *ret = NULL;
    struct mgr g = {m, hdr, hdr + CXLKV_LOCK_HDR_SIZE, nodes, (int64_t)n, sb.buf, tb.buf, bb.buf,
                    sbb.buf, (uint64_t)sbb.len};
    if (bb.len != 16) {
        PyErr_SetString(PyExc_ValueError, "mgr_loop: boot_id must be 16 bytes");
        goto out;
    }
    if (check_range(m, 0, g.sb_len, "mgr_loop superblocks") < 0)
        goto out;
    if (g.st[MS_HOLDER] < -1 || g.st[MS_HOLDER] >= (int64_t)n || g.st[MS_LAST] < -1 ||
        g.st[MS_LAST] >= (int64_t)n || g.st[MS_LEASE] <= 0 || g.st[MS_SLEEP_MAX] <= 0 ||
        g.st[MS_IDLE_SLEEP_MAX] <= 0 || g.st[MS_BEAT_EVERY] <= 0) {
        PyErr_SetString(PyExc_ValueError, "mgr_loop: state words out of range");
        goto out;
    }
    int r;
    m->busy++;
    Py_BEGIN_ALLOW_THREADS
    r = mgr_run(&g);
    Py_END_ALLOW_THREADS
    m->busy--;
    ret = PyLong_FromLong(r);
out:
    PyBuffer_Release(&sb);
    PyBuffer_Release(&tb);
    PyBuffer_Release(&bb);
    PyBuffer_Release(&sbb);
    return ret;
}

/* mgr_wait(entry, req, spin_ns, sleep_max_ns, until_ns) -> 1 granted,
 *   2 revoked (revoke_seq >= req), 0 until_ns (CLOCK_MONOTONIC) passed.
 * The client's poll of its lock entry's manager line (ManagerLock.acquire):
 * spin for spin_ns, then sleep with backoff up to sleep_max_ns.  GIL released. */
PyObject *
Mapping_mgr_wait(Mapping *m, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t e, req, spin, smax, until;
    if (nargs_check(nargs, 5, 5, "mgr_wait") < 0 || as_u64(args[0], &e, "lock entry offset") < 0 ||
        as_u64(args[1], &req, "request") < 0 || as_u64(args[2], &spin, "spin_ns") < 0 ||
        as_u64(args[3], &smax, "sleep_max_ns") < 0 || as_u64(args[4], &until, "until_ns") < 0 ||
        check_range(m, e, CXLKV_LOCK_ENTRY_SIZE, "mgr_wait") < 0)
        return NULL;
    if (e & 63) {
        PyErr_SetString(cxlkv_RangeError, "mgr_wait: lock entry must be 64-byte aligned");
        return NULL;
    }
    int r = -1;
    /* a few polls with the GIL held: a grant often is already there */
    for (int i = 0; i < 8 && r < 0; i++) {
        pool_invalidate(m, e + LE_GRANT, 16);
        if (pool_load64(m, e + LE_GRANT) == req)
            r = 1;
        else if (pool_load64(m, e + LE_REVOKE) >= req)
            r = 2;
        else
            relax();
    }
    if (r < 0) {
        m->busy++;
        Py_BEGIN_ALLOW_THREADS
        int64_t start = mono_ns(), sl = 0;
        for (;;) {
            pool_invalidate(m, e + LE_GRANT, 16);
            if (pool_load64(m, e + LE_GRANT) == req) {
                r = 1;
                break;
            }
            if (pool_load64(m, e + LE_REVOKE) >= req) {
                r = 2;
                break;
            }
            int64_t now = mono_ns();
            if (now >= (int64_t)until) {
                r = 0;
                break;
            }
            if (now - start < (int64_t)spin) {
                sched_yield();      /* the manager may be waiting for this CPU */
                continue;
            }
            sl = sl ? sl * 2 : 2000;
            if (sl > (int64_t)smax)
                sl = (int64_t)smax;
            int64_t left = (int64_t)until - now;
            sleep_ns(sl < left ? sl : left);
        }
        Py_END_ALLOW_THREADS
        m->busy--;
    }
    return PyLong_FromLong(r);
}
