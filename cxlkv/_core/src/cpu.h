/*
 * Cache maintenance, fences and copies for pool memory.
 *
 * flush      : write dirty lines back to memory (before another host reads).
 * invalidate : drop lines so the next load reads memory (before reading what
 *              another host wrote).  CLWB keeps the line cached, so it can
 *              flush but never invalidate; invalidation uses CLFLUSHOPT or
 *              CLFLUSH.
 * The instruction is chosen once, at module load, from CPUID; CXLKV_FLUSH
 * (clflush | clflushopt | clwb) overrides it for experiments.
 */
#ifndef CXLKV_CPU_H
#define CXLKV_CPU_H

#include <stdint.h>
#include <stddef.h>
#include <string.h>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

enum cxlkv_flush_kind {
    CXLKV_FLUSH_NONE = 0,      /* architecture without a user-space flush */
    CXLKV_FLUSH_CLFLUSH,
    CXLKV_FLUSH_CLFLUSHOPT,
    CXLKV_FLUSH_CLWB,
    CXLKV_FLUSH_DC_CIVAC,      /* aarch64 clean+invalidate to PoC */
};

struct cxlkv_cpu {
    int has_clflush, has_clflushopt, has_clwb, has_avx2, has_avx512f, has_sse2;
    enum cxlkv_flush_kind flush;       /* used by flush() */
    enum cxlkv_flush_kind invalidate;  /* used by invalidate() */
};

extern struct cxlkv_cpu cxlkv_cpu;

static inline void cxlkv_sfence(void)
{
#if defined(__x86_64__)
    _mm_sfence();
#elif defined(__aarch64__)
    __asm__ volatile("dmb ishst" ::: "memory");
#else
    __atomic_thread_fence(__ATOMIC_RELEASE);
#endif
}

static inline void cxlkv_mfence(void)
{
#if defined(__x86_64__)
    _mm_mfence();
#elif defined(__aarch64__)
    __asm__ volatile("dmb ish" ::: "memory");
#else
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}

static inline void cxlkv_line_op(enum cxlkv_flush_kind k, const void *p)
{
#if defined(__x86_64__)
    switch (k) {
    case CXLKV_FLUSH_CLWB:
        __asm__ volatile(".byte 0x66; xsaveopt %0" : "+m"(*(volatile char *)p));
        break;
    case CXLKV_FLUSH_CLFLUSHOPT:
        __asm__ volatile(".byte 0x66; clflush %0" : "+m"(*(volatile char *)p));
        break;
    case CXLKV_FLUSH_CLFLUSH:
        __asm__ volatile("clflush %0" : "+m"(*(volatile char *)p));
        break;
    default:
        break;
    }
#elif defined(__aarch64__)
    if (k == CXLKV_FLUSH_DC_CIVAC)
        __asm__ volatile("dc civac, %0" ::"r"(p) : "memory");
#else
    (void)k; (void)p;
#endif
}

/* Flush [p, p+n): every line that overlaps the range, then a store fence so
 * the write-backs complete before anything stored after this call. */
static inline void cxlkv_flush_range(const void *p, size_t n)
{
    if (n == 0)
        return;
    uintptr_t a = (uintptr_t)p & ~(uintptr_t)63, end = (uintptr_t)p + n;
    enum cxlkv_flush_kind k = cxlkv_cpu.flush;
    for (; a < end; a += 64)
        cxlkv_line_op(k, (const void *)a);
    cxlkv_sfence();
}

/* Invalidate [p, p+n) so that the following loads come from memory. */
static inline void cxlkv_invalidate_range(const void *p, size_t n)
{
    if (n == 0)
        return;
    uintptr_t a = (uintptr_t)p & ~(uintptr_t)63, end = (uintptr_t)p + n;
    enum cxlkv_flush_kind k = cxlkv_cpu.invalidate;
    cxlkv_mfence();
    for (; a < end; a += 64)
        cxlkv_line_op(k, (const void *)a);
    cxlkv_mfence();
}

/* Copy modes (gather.c, set from Python): reads out of the pool stream their
 * stores (1) or not (0); writes into the pool use regular stores + write-back
 * instead of non-temporal stores (1). */
extern int cxlkv_read_nt;
extern int cxlkv_write_clwb;

void cxlkv_cpu_init(void);
const char *cxlkv_flush_name(enum cxlkv_flush_kind k);

/* The write deadline's clock (cpu.c).  Checking a deadline before every
 * slot or block with clock_gettime costs ~20 ns a time; where the TSC is
 * invariant and the kernel keeps time with it (cxlkv_deadline_tsc(1), from
 * Python once it has read the clocksource), a deadline is turned into a TSC
 * value once (on its first check: one clock_gettime and one rdtsc, the rate
 * measured against CLOCK_MONOTONIC since the module loaded, the remaining
 * time cut by 1% so that an error in the rate ends it early, never late)
 * and each later check of the same deadline is one rdtsc (~9 ns).  The TSC
 * goes on counting while a process is stopped, so a stall ends it as it
 * ends the clock.  Before 20 ms have passed since load, or elsewhere: the
 * clock.  -> 1 once `deadline_ns` (CLOCK_MONOTONIC) has passed. */
struct cxlkv_dl_cache {
    int64_t deadline_ns;       /* the deadline this thread turned into ... */
    uint64_t tsc;              /* ... this TSC value (0: none), ... */
    uint64_t tsc_from;         /* ... when the TSC read this (a TSC below it - reset
                                * by a suspend, say - sends the check to the clock) */
};
extern __thread struct cxlkv_dl_cache cxlkv_dl_cache __attribute__((tls_model("initial-exec")));
extern int cxlkv_tsc_on;
int cxlkv_deadline_slow(int64_t deadline_ns);
/* on: use the TSC where this CPU's is invariant; -> whether it is used */
int cxlkv_deadline_tsc(int on);

static inline int cxlkv_deadline_passed(int64_t deadline_ns)
{
#if defined(__x86_64__)
    if (cxlkv_dl_cache.deadline_ns == deadline_ns && cxlkv_dl_cache.tsc &&
        __atomic_load_n(&cxlkv_tsc_on, __ATOMIC_RELAXED)) {
        uint64_t t = __rdtsc();
        if (t >= cxlkv_dl_cache.tsc_from)
            return t > cxlkv_dl_cache.tsc;
    }
#endif
    return cxlkv_deadline_slow(deadline_ns);
}

/* Copy into pool memory.  Large copies use non-temporal stores (which bypass
 * the cache, so they also serve as the flush); the unaligned head and tail
 * are copied normally and flushed.  Ends with a store fence. */
void cxlkv_copy_to_pool(void *dst, const void *src, size_t n, int nt);
/* Zero pool memory the same way. */
void cxlkv_zero_pool(void *dst, size_t n, int nt);
/* Copy out of pool memory (plain loads). */
void cxlkv_copy_from_pool(void *dst, const void *src, size_t n);

#endif
