/* The core's integer dot-product peak, for the speed benchmark's map-product bound.
 *
 * Each probe runs 12 independent accumulator chains of one instruction over register operands
 * (no memory traffic), so it measures the instruction's throughput: vpdpwssd zmm (AVX512-VNNI,
 * 32 int16 multiply-adds per instruction) and vpmaddwd + vpaddd ymm (AVX2, 16 per pair) -- the
 * instructions the exact map kernel lowers to. The empty asm statement makes the multiplicands
 * look modified every iteration, so the compiler cannot hoist the products out of the loop.
 * Returns a checksum (never printed; it keeps the loop alive), or INT64_MIN without the ISA.
 *
 * Not part of the package build: kvz.benchmarks.speed compiles it with gcc -O3 -march=native.
 */
#include <immintrin.h>
#include <stdint.h>

#define CHAINS 12

int64_t dot_peak_vnni512(int64_t iters, int32_t seed)
{
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
    __m512i a = _mm512_set1_epi32(seed), b = _mm512_set1_epi32(seed ^ 0x00030001);
    __m512i acc[CHAINS];
    for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_set1_epi32(c);
    for (int64_t i = 0; i < iters; i++) {
        __asm__ volatile("" : "+v"(a), "+v"(b));
        for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_dpwssd_epi32(acc[c], a, b);
    }
    __m512i s = acc[0];
    for (int c = 1; c < CHAINS; c++) s = _mm512_add_epi32(s, acc[c]);
    return (int64_t)_mm512_reduce_add_epi32(s);
#else
    (void)iters; (void)seed;
    return INT64_MIN;
#endif
}

int64_t dot_peak_madd256(int64_t iters, int32_t seed)
{
#if defined(__AVX2__)
    __m256i a = _mm256_set1_epi32(seed), b = _mm256_set1_epi32(seed ^ 0x00030001);
    __m256i acc[CHAINS];
    for (int c = 0; c < CHAINS; c++) acc[c] = _mm256_set1_epi32(c);
    for (int64_t i = 0; i < iters; i++) {
        __asm__ volatile("" : "+v"(a), "+v"(b));
        for (int c = 0; c < CHAINS; c++) acc[c] = _mm256_add_epi32(acc[c], _mm256_madd_epi16(a, b));
    }
    __m256i s = acc[0];
    for (int c = 1; c < CHAINS; c++) s = _mm256_add_epi32(s, acc[c]);
    int32_t v[8];
    _mm256_storeu_si256((__m256i *)v, s);
    return (int64_t)v[0] + v[1] + v[2] + v[3] + v[4] + v[5] + v[6] + v[7];
#else
    (void)iters; (void)seed;
    return INT64_MIN;
#endif
}
