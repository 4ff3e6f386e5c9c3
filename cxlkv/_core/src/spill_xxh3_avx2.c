/*
 * xxh3-64 of spilled payloads with AVX2 (spill.c picks the widest variant
 * the CPU has, by cpu.c's probe; spill_xxh3_avx512.c is the AVX-512 one).
 * A translation unit of its own: xxhash is compiled inline here for AVX2
 * and nothing else of the core may be.  The system libxxhash is built for
 * baseline x86-64: 256 KiB payloads hashed at 11-13 GiB/s there, 22-25
 * here, 27-30 with AVX-512 (this VM's Xeon, data in L2).  Same function,
 * same result as XXH3_64bits (seed 0) on any vector unit.
 */
#include <stddef.h>
#include <stdint.h>

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2")
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "spill_copysum.h"

uint64_t cxlkv_spill_xxh3_avx2(const void *p, size_t n);
uint64_t cxlkv_spill_copysum_avx2(void *dst, const void *src, size_t n);

uint64_t
cxlkv_spill_xxh3_avx2(const void *p, size_t n)
{
    return XXH3_64bits(p, n);
}

uint64_t
cxlkv_spill_copysum_avx2(void *dst, const void *src, size_t n)
{
    return copysum(dst, src, n);
}
#pragma GCC pop_options
#endif
