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

/* AMX (tdpbssd, signed int8 tiles: 16 x 16 x 64 = 16384 multiply-adds per instruction) on 6
 * accumulator tiles with the multiplicands in tiles 6 and 7 (register-only, as above). The exact
 * map kernel's AMX path forms each int16 product from four int8 tile products (high and low
 * bytes), so its int16 peak is a quarter of this. The process asks Linux for the tile state
 * first (arch_prctl ARCH_REQ_XCOMP_PERM); INT64_MIN when the CPU, compiler or OS cannot. */
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#include <string.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

struct tile_config { uint8_t palette, start; uint8_t pad[14]; uint16_t colsb[16]; uint8_t rows[16]; };
#endif

int64_t dot_peak_amx_int8(int64_t iters, int32_t seed)
{
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) return INT64_MIN;
    struct tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
    _tile_loadconfig(&cfg);
    int8_t a[16 * 64], b[16 * 64];
    int32_t c[16 * 16];
    for (int i = 0; i < 16 * 64; i++) { a[i] = (int8_t)(seed + i); b[i] = (int8_t)(seed * 3 - i); }
    memset(c, 0, sizeof c);
    _tile_loadd(6, a, 64);
    _tile_loadd(7, b, 64);
    _tile_loadd(0, c, 64); _tile_loadd(1, c, 64); _tile_loadd(2, c, 64);
    _tile_loadd(3, c, 64); _tile_loadd(4, c, 64); _tile_loadd(5, c, 64);
    for (int64_t i = 0; i < iters; i++) {
        _tile_dpbssd(0, 6, 7); _tile_dpbssd(1, 6, 7); _tile_dpbssd(2, 6, 7);
        _tile_dpbssd(3, 6, 7); _tile_dpbssd(4, 6, 7); _tile_dpbssd(5, 6, 7);
    }
    int64_t s = 0;
    int32_t out[16 * 16];
    _tile_stored(0, out, 64); for (int i = 0; i < 256; i++) s += out[i];
    _tile_stored(5, out, 64); for (int i = 0; i < 256; i++) s += out[i];
    _tile_release();
    return s;
#else
    (void)iters; (void)seed;
    return INT64_MIN;
#endif
}
