/*
 * What a verified read of page-cache-resident blocks can reach on this CPU,
 * with nothing else in the way (no index, no headers, no Python):
 *
 *   cc -O2 -march=native -o /tmp/verified_read scripts/verified_read.c
 *   /tmp/verified_read [DIR] [PASSES]            # DIR: /var/tmp by default
 *
 * Writes a 256 MiB file of 256 KiB blocks to DIR (page cache), maps it and
 * maps every page, then per pass times, against `pread` of each block into
 * one reused buffer (the spill bench's raw read): `pread` into 8 reused
 * buffers (a promotion's run of blocks), `pread` then XXH3-64 of each block
 * (the spill store's preadv path), a plain copy out of the mapping, and the
 * copy out of the mapping with the hash fused in 64 KiB pieces (the store's
 * mapped path, spill_copysum.h).  On 2026-12-07/08 (AMD EPYC, 2 vCPUs):
 * pread then the hash 0.69-0.75x, the fused copy 0.80-0.90x, six passes.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
#define XXH_INLINE_ALL                   /* the streaming state on the stack, as spill.c */
#include <xxhash.h>

#define BB (256 * 1024)
#define N 1024
#define RUN 8
#define PIECE 65536

static double
now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static uint64_t
copysum(char *dst, const char *src, size_t n)
{
    XXH3_state_t st;
    XXH3_64bits_reset(&st);
    for (size_t o = 0; o < n; o += PIECE) {
        size_t k = n - o < PIECE ? n - o : PIECE;
        memcpy(dst + o, src + o, k);
        XXH3_64bits_update(&st, dst + o, k);
    }
    return XXH3_64bits_digest(&st);
}

static void
read_block(int fd, char *dst, int i)
{
    if (pread(fd, dst, BB, (off_t)i * BB) != BB) {
        perror("pread");
        exit(1);
    }
}

int
main(int argc, char **argv)
{
    const char *dir = argc > 1 ? argv[1] : "/var/tmp";
    int passes = argc > 2 ? atoi(argv[2]) : 3;
    char path[4096];
    snprintf(path, sizeof path, "%s/verified-read-XXXXXX", dir);
    int fd = mkstemp(path);
    if (fd < 0) {
        perror("mkstemp");
        return 1;
    }
    unlink(path);
    char *blk = malloc(BB), *one = aligned_alloc(4096, BB), *bufs[RUN];
    for (int i = 0; i < BB; i++)
        blk[i] = (char)rand();
    for (int i = 0; i < N; i++)
        if (write(fd, blk, BB) != BB) {
            perror("write");
            return 1;
        }
    for (int i = 0; i < RUN; i++) {
        bufs[i] = aligned_alloc(4096, BB);
        memset(bufs[i], 1, BB);
    }
    memset(one, 1, BB);
    const size_t total = (size_t)N * BB;
    const char *m = mmap(NULL, total, PROT_READ, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) {
        perror("mmap");
        return 1;
    }
    const uint64_t want = XXH3_64bits(blk, BB);
    volatile char sink = 0;
    for (size_t o = 0; o < total; o += 4096)
        sink += m[o];                               /* every page mapped */
    for (int p = 0; p < passes; p++) {
        double t0 = now();
        for (int i = 0; i < N; i++)
            read_block(fd, one, i);
        double raw = now() - t0;
        t0 = now();
        for (int i = 0; i < N; i++)
            read_block(fd, bufs[i % RUN], i);
        double run = now() - t0;
        t0 = now();
        for (int i = 0; i < N; i++) {
            read_block(fd, bufs[i % RUN], i);
            if (XXH3_64bits(bufs[i % RUN], BB) != want)
                return fprintf(stderr, "block %d read back other bytes\n", i), 1;
        }
        double hashed = now() - t0;
        t0 = now();
        for (int i = 0; i < N; i++)
            memcpy(bufs[i % RUN], m + (size_t)i * BB, BB);
        double mapped = now() - t0;
        t0 = now();
        for (int i = 0; i < N; i++)
            if (copysum(bufs[i % RUN], m + (size_t)i * BB, BB) != want)
                return fprintf(stderr, "block %d copied other bytes\n", i), 1;
        double fused = now() - t0;
        printf("pass %d: pread into one buffer %.1f GB/s; against it: into a run's %d buffers "
               "%.2fx, pread then xxh3 %.2fx, copy out of the mapping %.2fx, that with the hash "
               "fused %.2fx\n", p + 1, (double)total / raw / 1e9, RUN, raw / run, raw / hashed,
               raw / mapped, raw / fused);
    }
    close(fd);
    return sink & 0;
}
