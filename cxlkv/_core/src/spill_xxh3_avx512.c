/* xxh3-64 of spilled payloads with AVX-512F (see spill_xxh3_avx2.c). */
#include <stddef.h>
#include <stdint.h>

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f")
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "spill_copysum.h"

uint64_t cxlkv_spill_xxh3_avx512(const void *p, size_t n);
uint64_t cxlkv_spill_copysum_avx512(void *dst, const void *src, size_t n);

uint64_t
cxlkv_spill_xxh3_avx512(const void *p, size_t n)
{
    return XXH3_64bits(p, n);
}

uint64_t
cxlkv_spill_copysum_avx512(void *dst, const void *src, size_t n)
{
    return copysum(dst, src, n);
}
#pragma GCC pop_options
#endif
