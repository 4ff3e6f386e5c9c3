/* CPU feature detection and pool copies; see cpu.h. */
#include "cpu.h"

#include <stdlib.h>
#include <strings.h>
#include <time.h>

struct cxlkv_cpu cxlkv_cpu;

/* -- the write deadline's clock (see cpu.h) -------------------------------------------- */
__thread struct cxlkv_dl_cache cxlkv_dl_cache __attribute__((tls_model("initial-exec")));
static int tsc_invariant;           /* CPUID: the TSC ticks at one rate, also in sleep */
int cxlkv_tsc_on;                   /* and Python said the kernel keeps time with it */
static int64_t tsc_base_ns;         /* CLOCK_MONOTONIC and the TSC when the module loaded */
static uint64_t tsc_base __attribute__((unused));
#define TSC_CALIBRATE_NS 20000000ll  /* the rate is measured over at least this long */

static int64_t
mono_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

int
cxlkv_deadline_tsc(int on)
{
    __atomic_store_n(&cxlkv_tsc_on, on && tsc_invariant, __ATOMIC_RELAXED);
    return on && tsc_invariant;
}

int
cxlkv_deadline_slow(int64_t deadline_ns)
{
    int64_t now = mono_now_ns();
    if (now > deadline_ns)
        return 1;
#if defined(__x86_64__)
    if (__atomic_load_n(&cxlkv_tsc_on, __ATOMIC_RELAXED) && now - tsc_base_ns >= TSC_CALIBRATE_NS) {
        uint64_t t = __rdtsc();
        if (t <= tsc_base)
            return 0;                   /* the TSC went back (a suspend reset it): the clock */
        double rate = (double)(t - tsc_base) / (double)(now - tsc_base_ns);   /* ticks/ns */
        if (!(rate > 0.05 && rate < 100.0))
            return 0;                   /* not a TSC that ticks with time: the clock */
        uint64_t left = (uint64_t)((double)(deadline_ns - now) * rate * 0.99);
        cxlkv_dl_cache.deadline_ns = deadline_ns;
        cxlkv_dl_cache.tsc_from = t;
        cxlkv_dl_cache.tsc = t + left;
    }
#endif
    return 0;
}

const char *cxlkv_flush_name(enum cxlkv_flush_kind k)
{
    switch (k) {
    case CXLKV_FLUSH_CLFLUSH: return "clflush";
    case CXLKV_FLUSH_CLFLUSHOPT: return "clflushopt";
    case CXLKV_FLUSH_CLWB: return "clwb";
    case CXLKV_FLUSH_DC_CIVAC: return "dc civac";
    default: return "none";
    }
}

void cxlkv_cpu_init(void)
{
    memset(&cxlkv_cpu, 0, sizeof(cxlkv_cpu));
#if defined(__x86_64__)
    unsigned a, b, c, d;
    if (__get_cpuid(1, &a, &b, &c, &d)) {
        cxlkv_cpu.has_clflush = (d >> 19) & 1;
        cxlkv_cpu.has_sse2 = (d >> 26) & 1;
    }
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
        cxlkv_cpu.has_clflushopt = (b >> 23) & 1;
        cxlkv_cpu.has_clwb = (b >> 24) & 1;
    }
    if (__get_cpuid(0x80000000, &a, &b, &c, &d) && a >= 0x80000007 &&
        __get_cpuid(0x80000007, &a, &b, &c, &d))
        tsc_invariant = (d >> 8) & 1;
    tsc_base_ns = mono_now_ns();
    tsc_base = __rdtsc();
    __builtin_cpu_init();
    cxlkv_cpu.has_avx2 = __builtin_cpu_supports("avx2");
    cxlkv_cpu.has_avx512f = __builtin_cpu_supports("avx512f");

    cxlkv_cpu.flush = cxlkv_cpu.has_clwb ? CXLKV_FLUSH_CLWB
                    : cxlkv_cpu.has_clflushopt ? CXLKV_FLUSH_CLFLUSHOPT
                    : CXLKV_FLUSH_CLFLUSH;
    cxlkv_cpu.invalidate = cxlkv_cpu.has_clflushopt ? CXLKV_FLUSH_CLFLUSHOPT
                         : CXLKV_FLUSH_CLFLUSH;

    const char *force = getenv("CXLKV_FLUSH");
    if (force && *force) {
        if (!strcasecmp(force, "clflush"))
            cxlkv_cpu.flush = cxlkv_cpu.invalidate = CXLKV_FLUSH_CLFLUSH;
        else if (!strcasecmp(force, "clflushopt") && cxlkv_cpu.has_clflushopt)
            cxlkv_cpu.flush = cxlkv_cpu.invalidate = CXLKV_FLUSH_CLFLUSHOPT;
        else if (!strcasecmp(force, "clwb") && cxlkv_cpu.has_clwb)
            cxlkv_cpu.flush = CXLKV_FLUSH_CLWB;
        /* anything else (or an instruction this CPU lacks): keep the CPUID choice;
         * the Python side reports what is in use. */
    }
#elif defined(__aarch64__)
    cxlkv_cpu.flush = cxlkv_cpu.invalidate = CXLKV_FLUSH_DC_CIVAC;
#endif
}

/* Lines below NT_MIN bytes are not worth streaming. */
#define NT_MIN 256
/* Reads out of the pool stream their stores from this size on (below it the
 * copy fits in cache and the reader probably uses it at once). */
#define NT_READ_MIN (256 * 1024)

#if defined(__x86_64__)
__attribute__((target("avx2")))
static void nt_body_avx2(char *dst, const char *src, size_t n)
{
    /* dst is 64-byte aligned, n a multiple of 64 */
    while (n >= 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)src);
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + 64));
        __m256i d = _mm256_loadu_si256((const __m256i *)(src + 96));
        _mm256_stream_si256((__m256i *)dst, a);
        _mm256_stream_si256((__m256i *)(dst + 32), b);
        _mm256_stream_si256((__m256i *)(dst + 64), c);
        _mm256_stream_si256((__m256i *)(dst + 96), d);
        src += 128; dst += 128; n -= 128;
    }
    if (n) {
        __m256i a = _mm256_loadu_si256((const __m256i *)src);
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + 32));
        _mm256_stream_si256((__m256i *)dst, a);
        _mm256_stream_si256((__m256i *)(dst + 32), b);
    }
}

__attribute__((target("avx2")))
static void nt_zero_avx2(char *dst, size_t n)
{
    __m256i z = _mm256_setzero_si256();
    for (; n; n -= 64, dst += 64) {
        _mm256_stream_si256((__m256i *)dst, z);
        _mm256_stream_si256((__m256i *)(dst + 32), z);
    }
}

static void nt_body_sse2(char *dst, const char *src, size_t n)
{
    for (; n; n -= 64, src += 64, dst += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
    }
}

static void nt_zero_sse2(char *dst, size_t n)
{
    __m128i z = _mm_setzero_si128();
    for (; n; n -= 64, dst += 64) {
        _mm_stream_si128((__m128i *)dst, z);
        _mm_stream_si128((__m128i *)(dst + 16), z);
        _mm_stream_si128((__m128i *)(dst + 32), z);
        _mm_stream_si128((__m128i *)(dst + 48), z);
    }
}
#endif

/* Split [dst, dst+n) into an unaligned head, a 64-byte aligned body that is a
 * multiple of 64 bytes, and a tail. */
static inline void split64(const char *dst, size_t n, size_t *head, size_t *body)
{
    size_t h = (size_t)((64 - ((uintptr_t)dst & 63)) & 63);
    if (h > n)
        h = n;
    *head = h;
    *body = (n - h) & ~(size_t)63;
}

void cxlkv_copy_to_pool(void *dstv, const void *srcv, size_t n, int nt)
{
    char *dst = dstv;
    const char *src = srcv;
    if (src < dst + n && dst < src + n) {       /* source overlaps the pool range */
        memmove(dst, src, n);
        cxlkv_flush_range(dst, n);
        return;
    }
#if defined(__x86_64__)
    if (nt && __atomic_load_n(&cxlkv_write_clwb, __ATOMIC_RELAXED))
        nt = 0;                                 /* the write copy mode (gather.c) */
    if (nt && n >= NT_MIN) {
        size_t head, body;
        split64(dst, n, &head, &body);
        size_t tail = n - head - body;
        if (head) {
            memcpy(dst, src, head);
            cxlkv_line_op(cxlkv_cpu.flush, dst);
        }
        if (cxlkv_cpu.has_avx2)
            nt_body_avx2(dst + head, src + head, body);
        else
            nt_body_sse2(dst + head, src + head, body);
        if (tail) {
            memcpy(dst + head + body, src + head + body, tail);
            cxlkv_line_op(cxlkv_cpu.flush, dst + head + body);
        }
        cxlkv_sfence();
        return;
    }
#endif
    (void)nt;
    memcpy(dst, src, n);
    cxlkv_flush_range(dst, n);
}

void cxlkv_zero_pool(void *dstv, size_t n, int nt)
{
    char *dst = dstv;
#if defined(__x86_64__)
    if (nt && n >= NT_MIN) {
        size_t head, body;
        split64(dst, n, &head, &body);
        size_t tail = n - head - body;
        if (head) {
            memset(dst, 0, head);
            cxlkv_line_op(cxlkv_cpu.flush, dst);
        }
        if (cxlkv_cpu.has_avx2)
            nt_zero_avx2(dst + head, body);
        else
            nt_zero_sse2(dst + head, body);
        if (tail) {
            memset(dst + head + body, 0, tail);
            cxlkv_line_op(cxlkv_cpu.flush, dst + head + body);
        }
        cxlkv_sfence();
        return;
    }
#endif
    (void)nt;
    memset(dst, 0, n);
    cxlkv_flush_range(dst, n);
}

/* Out of the pool into private memory.  Large copies use non-temporal
 * stores: the destination is not read first (no read-for-ownership), which
 * is a third of the memory traffic of a plain copy. */
void cxlkv_copy_from_pool(void *dstv, const void *srcv, size_t n)
{
#if defined(__x86_64__)
    if (n >= NT_READ_MIN && __atomic_load_n(&cxlkv_read_nt, __ATOMIC_RELAXED)) {
        char *dst = dstv;
        const char *src = srcv;
        size_t head, body;
        split64(dst, n, &head, &body);
        size_t tail = n - head - body;
        if (head)
            memcpy(dst, src, head);
        if (cxlkv_cpu.has_avx2)
            nt_body_avx2(dst + head, src + head, body);
        else
            nt_body_sse2(dst + head, src + head, body);
        if (tail)
            memcpy(dst + head + body, src + head + body, tail);
        cxlkv_sfence();
        return;
    }
#endif
    memcpy(dstv, srcv, n);
}
