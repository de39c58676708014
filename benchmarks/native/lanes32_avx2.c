/* An independent C decoder of the kvz format 1.2 entropy stage `lanes32` (format_spec/kvz.md §7.3),
 * for measurement only (benchmarks/entropy_native.py builds it with the system gcc into a temporary
 * folder and calls it through ctypes; it is not part of the package build).
 *
 * Stream: 64 words of lane states, a lane table of 32 word counts (1 or 2 words each), then the
 * 32 lane streams one after another; symbol i is on lane i % 32.  Decode table entry per model m
 * and slot s: freq << 20 | (s - cum) << 8 | token (prec <= 12 bits).
 *
 * Entry points (same contract, same error codes as alignpred.entropy.lanes, ERR_* below):
 *   lanes32_decode_scalar  one lane after another in symbol order (portable C)
 *   lanes32_decode_avx2    32 lanes in lock-step as 4 x 8 x i32 (vpgatherdd ymm for the table and
 *                          for the two next 16-bit words of every lane's own stream)
 *   lanes32_decode_avx512  32 lanes as 2 x 16 x i32 (vpgatherdd zmm, mask registers)
 * `w` is the payload as uint16 words followed by two zero pad words (W real words): every read is
 * at an index <= W + 1 (positions are clamped to W before a read, as the library does), so a damaged
 * stream never reads outside the buffer; a lane that ran past its words is found at the end
 * (positions must equal the lane ends).  Model ids are checked against the table (ERR_MODEL).
 * lanes32_decode2_{avx2,avx512} decode two objects of one shape and model list together (64 lanes in
 * flight), lanes32_probe_gather measures gather throughput.
 * lanes32_isa() says which vector entry points this build has (bit 0 AVX2, bit 1 AVX-512).
 * Measurement only: -DLANES32_ABLATE_TABLE / -DLANES32_ABLATE_WORDS replace the AVX2 path's table /
 * word gather by register arithmetic (wrong symbols; the benchmark times them to see what bounds it).
 */
#include <stdint.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

enum { ERR_OK = 0, ERR_SHORT = 1, ERR_TILING = 2, ERR_BAD_STATE = 3, ERR_FINAL = 4, ERR_WORDS = 5,
       ERR_MODEL = 6, ERR_NO_ISA = 7 };
#define STATE_L 65536u

int lanes32_isa(void) {
    int f = 0;
#ifdef __AVX2__
    f |= 1;
#endif
#if defined(__AVX512F__) && defined(__AVX512VL__)
    f |= 2;
#endif
    return f;
}

static int lane_table(const uint16_t *w, int64_t W, int64_t hw, uint32_t *x, int64_t *pos, int64_t *end) {
    if (W < hw) return ERR_SHORT;
    int64_t o = hw;
    for (int l = 0; l < 32; l++) {
        uint32_t xl = (uint32_t)w[2 * l] | ((uint32_t)w[2 * l + 1] << 16);
        if (xl < STATE_L) return ERR_BAD_STATE;
        x[l] = xl;
        int64_t cnt = hw > 96 ? ((int64_t)w[64 + 2 * l] | ((int64_t)w[64 + 2 * l + 1] << 16)) : (int64_t)w[64 + l];
        pos[l] = o;
        o += cnt;
        end[l] = o;
    }
    return o == W ? ERR_OK : ERR_TILING;
}

static int lane_finish(const uint32_t *x, const int64_t *pos, const int64_t *end) {
    for (int l = 0; l < 32; l++)
        if (pos[l] != end[l]) return ERR_WORDS;
    for (int l = 0; l < 32; l++)
        if (x[l] != STATE_L) return ERR_FINAL;
    return ERR_OK;
}

static int check_models(const int64_t *ids, int64_t C, int64_t n_models) {
    for (int64_t c = 0; c < C; c++)
        if (ids[c] < 0 || ids[c] >= n_models) return ERR_MODEL;
    return ERR_OK;
}

#define RENORM(x, p)                                  \
    if ((x) < STATE_L) {                              \
        (x) = ((x) << 16) | w[(p) < W ? (p) : W];     \
        (p)++;                                        \
    }

/* One symbol of one lane (the library's lane_step); tab: the model's table. */
static inline int32_t step1(uint32_t *px, int64_t *pp, const uint16_t *w, int64_t W, const uint32_t *tab, int prec) {
    uint32_t x = *px;
    int64_t p = *pp;
    uint32_t e = tab[x & ((1u << prec) - 1)];
    uint32_t tok = e & 0xFF, r = 0, nb = 0;
    x = (e >> 20) * (x >> prec) + ((e >> 8) & 0xFFF);
    RENORM(x, p);
    if (tok >= 16) {
        nb = (tok >> 2) - 2;
        uint32_t k = nb < 16 ? nb : 16;
        r = x & ((1u << k) - 1);
        x >>= k;
        RENORM(x, p);
        if (nb > 16) {
            uint32_t k2 = nb - 16;
            r |= (x & ((1u << k2) - 1)) << 16;
            x >>= k2;
            RENORM(x, p);
        }
    }
    uint32_t t1 = tok >> 1;
    uint32_t hi = tok >= 16 ? ((t1 & 1) | 2) : t1;
    uint32_t a = (hi << nb) | r;
    *px = x;
    *pp = p;
    return (int32_t)(a ^ (0u - (tok & 1)));
}

/* Symbols [i0, n) one at a time (the tail of the vector decoders, and the scalar decoder). */
static void scalar_range(const uint16_t *w, int64_t W, const int64_t *ids, int64_t N, const uint32_t *dtab, int prec,
                         int32_t *out, uint32_t *x, int64_t *pos, int64_t i0, int64_t n) {
    if (i0 >= n) return;
    int64_t c = i0 / N, t = i0 % N;
    const uint32_t *tab = dtab + ((int64_t)ids[c] << prec);
    for (int64_t i = i0; i < n; i++) {
        int l = (int)(i & 31);
        out[i] = step1(&x[l], &pos[l], w, W, tab, prec);
        if (++t == N) {
            t = 0;
            if (++c * N < n) tab = dtab + ((int64_t)ids[c] << prec);
        }
    }
}

int lanes32_decode_scalar(const uint16_t *w, int64_t W, int64_t hw, const int64_t *ids, int64_t C, int64_t N,
                          const uint32_t *dtab, int64_t n_models, int32_t prec, int32_t *out) {
    uint32_t x[32];
    int64_t pos[32], end[32];
    int err = check_models(ids, C, n_models);
    if (err) return err;
    if ((err = lane_table(w, W, hw, x, pos, end))) return err;
    scalar_range(w, W, ids, N, dtab, prec, out, x, pos, 0, C * N);
    return lane_finish(x, pos, end);
}

/* Per-lane table offsets of the group starting at symbol i0 (a group across channel boundaries). */
static void group_bases(const int64_t *ids, int64_t N, int prec, int64_t i0, int32_t *mb) {
    for (int l = 0; l < 32; l++) mb[l] = (int32_t)(ids[(i0 + l) / N] << prec);
}

/* The vector decoders need 32-bit positions: payloads of 2**30 words or more (or more than 2**32
 * symbols) take the scalar steps. */
#define VECTOR_OK(W, n) ((W) < ((int64_t)1 << 30) && (n) <= ((int64_t)1 << 32))

#ifdef __AVX2__
/* Rare second raw chunk (nb > 16, values |v| >= 2**17), lane by lane. */
static void chunk2_fix(__m256i *px, __m256i *pp, __m256i *pr, __m256i nbv, const uint16_t *w, int64_t W) {
    uint32_t xs[8], ps[8], rs[8], nbs[8];
    _mm256_storeu_si256((__m256i *)xs, *px);
    _mm256_storeu_si256((__m256i *)ps, *pp);
    _mm256_storeu_si256((__m256i *)rs, *pr);
    _mm256_storeu_si256((__m256i *)nbs, nbv);
    for (int l = 0; l < 8; l++) {
        if (nbs[l] > 16) {
            uint32_t k2 = nbs[l] - 16, x = xs[l];
            int64_t p = ps[l];
            rs[l] |= (x & ((1u << k2) - 1)) << 16;
            x >>= k2;
            RENORM(x, p);
            xs[l] = x;
            ps[l] = (uint32_t)p;
        }
    }
    *px = _mm256_loadu_si256((const __m256i *)xs);
    *pp = _mm256_loadu_si256((const __m256i *)ps);
    *pr = _mm256_loadu_si256((const __m256i *)rs);
}

static inline __m256i step8(__m256i *px, __m256i *pp, __m256i mb, const int *tab, const int *wd, __m256i wmax,
                            __m256i smask, __m128i pcnt, const uint16_t *w, int64_t W) {
    const __m256i zero = _mm256_setzero_si256(), ones = _mm256_set1_epi32(-1), m16 = _mm256_set1_epi32(0xFFFF);
    __m256i x = *px, p = *pp;
#ifdef LANES32_ABLATE_TABLE   /* measurement only (wrong symbols): entries made in registers, tokens 0..31 */
    __m256i e = _mm256_or_si256(_mm256_set1_epi32(0x50000000),
                                _mm256_and_si256(_mm256_xor_si256(x, mb), _mm256_set1_epi32(0x1F)));
    (void)tab; (void)smask;
#else
    __m256i e = _mm256_i32gather_epi32(tab, _mm256_add_epi32(mb, _mm256_and_si256(x, smask)), 4);
#endif
#ifdef LANES32_ABLATE_WORDS   /* measurement only (wrong symbols): words made in registers */
    __m256i g = _mm256_xor_si256(p, _mm256_set1_epi32(0x5A5A3C3C));
    (void)wd; (void)wmax;
#else
    __m256i g = _mm256_i32gather_epi32(wd, _mm256_min_epu32(p, wmax), 2);
#endif
    __m256i tok = _mm256_and_si256(e, _mm256_set1_epi32(0xFF));
    x = _mm256_add_epi32(_mm256_mullo_epi32(_mm256_srli_epi32(e, 20), _mm256_srl_epi32(x, pcnt)),
                         _mm256_and_si256(_mm256_srli_epi32(e, 8), _mm256_set1_epi32(0xFFF)));
    __m256i w0 = _mm256_and_si256(g, m16), w1 = _mm256_srli_epi32(g, 16);
    __m256i n1 = _mm256_cmpeq_epi32(_mm256_srli_epi32(x, 16), zero);
    x = _mm256_blendv_epi8(x, _mm256_or_si256(_mm256_slli_epi32(x, 16), w0), n1);
    p = _mm256_sub_epi32(p, n1);
    __m256i big = _mm256_cmpgt_epi32(tok, _mm256_set1_epi32(15));
    __m256i nb = _mm256_and_si256(big, _mm256_sub_epi32(_mm256_srli_epi32(tok, 2), _mm256_set1_epi32(2)));
    __m256i k1 = _mm256_min_epu32(nb, _mm256_set1_epi32(16));
    __m256i r = _mm256_andnot_si256(_mm256_sllv_epi32(ones, k1), x);
    x = _mm256_srlv_epi32(x, k1);
    __m256i n2 = _mm256_cmpeq_epi32(_mm256_srli_epi32(x, 16), zero);
    x = _mm256_blendv_epi8(x, _mm256_or_si256(_mm256_slli_epi32(x, 16), _mm256_blendv_epi8(w0, w1, n1)), n2);
    p = _mm256_sub_epi32(p, n2);
    if (__builtin_expect(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(nb, _mm256_set1_epi32(16)))), 0))
        chunk2_fix(&x, &p, &r, nb, w, W);
    __m256i t1 = _mm256_srli_epi32(tok, 1);
    __m256i hi = _mm256_blendv_epi8(t1, _mm256_or_si256(_mm256_and_si256(t1, _mm256_set1_epi32(1)), _mm256_set1_epi32(2)), big);
    __m256i a = _mm256_or_si256(_mm256_sllv_epi32(hi, nb), r);
    *px = x;
    *pp = p;
    return _mm256_xor_si256(a, _mm256_sub_epi32(zero, _mm256_and_si256(tok, _mm256_set1_epi32(1))));
}
#endif

int lanes32_decode_avx2(const uint16_t *w, int64_t W, int64_t hw, const int64_t *ids, int64_t C, int64_t N,
                        const uint32_t *dtab, int64_t n_models, int32_t prec, int32_t *out) {
#ifndef __AVX2__
    (void)w; (void)W; (void)hw; (void)ids; (void)C; (void)N; (void)dtab; (void)n_models; (void)prec; (void)out;
    return ERR_NO_ISA;
#else
    uint32_t x[32];
    int64_t pos[32], end[32];
    int err = check_models(ids, C, n_models);
    if (err) return err;
    if ((err = lane_table(w, W, hw, x, pos, end))) return err;
    int64_t n = C * N, groups = VECTOR_OK(W, n) ? n / 32 : 0;
    if (groups) {
        const int *tab = (const int *)dtab, *wd = (const int *)w;
        const __m256i wmax = _mm256_set1_epi32((int32_t)W), smask = _mm256_set1_epi32((1 << prec) - 1);
        const __m128i pcnt = _mm_cvtsi32_si128(prec);
        __m256i x0 = _mm256_loadu_si256((const __m256i *)x), x1 = _mm256_loadu_si256((const __m256i *)(x + 8));
        __m256i x2 = _mm256_loadu_si256((const __m256i *)(x + 16)), x3 = _mm256_loadu_si256((const __m256i *)(x + 24));
        int32_t p32[32], mbl[32];
        for (int l = 0; l < 32; l++) p32[l] = (int32_t)pos[l];
        __m256i p0 = _mm256_loadu_si256((const __m256i *)p32), p1 = _mm256_loadu_si256((const __m256i *)(p32 + 8));
        __m256i p2 = _mm256_loadu_si256((const __m256i *)(p32 + 16)), p3 = _mm256_loadu_si256((const __m256i *)(p32 + 24));
        int64_t c = 0, t = 0;
        for (int64_t gi = 0; gi < groups; gi++) {
            int64_t i0 = 32 * gi;
            __m256i m0, m1, m2, m3;
            if (t + 32 <= N) {
                m0 = m1 = m2 = m3 = _mm256_set1_epi32((int32_t)(ids[c] << prec));
            } else {
                group_bases(ids, N, prec, i0, mbl);
                m0 = _mm256_loadu_si256((const __m256i *)mbl);
                m1 = _mm256_loadu_si256((const __m256i *)(mbl + 8));
                m2 = _mm256_loadu_si256((const __m256i *)(mbl + 16));
                m3 = _mm256_loadu_si256((const __m256i *)(mbl + 24));
            }
            __m256i v0 = step8(&x0, &p0, m0, tab, wd, wmax, smask, pcnt, w, W);
            __m256i v1 = step8(&x1, &p1, m1, tab, wd, wmax, smask, pcnt, w, W);
            __m256i v2 = step8(&x2, &p2, m2, tab, wd, wmax, smask, pcnt, w, W);
            __m256i v3 = step8(&x3, &p3, m3, tab, wd, wmax, smask, pcnt, w, W);
            _mm256_storeu_si256((__m256i *)(out + i0), v0);
            _mm256_storeu_si256((__m256i *)(out + i0 + 8), v1);
            _mm256_storeu_si256((__m256i *)(out + i0 + 16), v2);
            _mm256_storeu_si256((__m256i *)(out + i0 + 24), v3);
            t += 32;
            if (t >= N) {
                if (N >= 32) { t -= N; c++; }
                else { c = (i0 + 32) / N; t = (i0 + 32) % N; }
            }
        }
        _mm256_storeu_si256((__m256i *)x, x0);
        _mm256_storeu_si256((__m256i *)(x + 8), x1);
        _mm256_storeu_si256((__m256i *)(x + 16), x2);
        _mm256_storeu_si256((__m256i *)(x + 24), x3);
        _mm256_storeu_si256((__m256i *)p32, p0);
        _mm256_storeu_si256((__m256i *)(p32 + 8), p1);
        _mm256_storeu_si256((__m256i *)(p32 + 16), p2);
        _mm256_storeu_si256((__m256i *)(p32 + 24), p3);
        for (int l = 0; l < 32; l++) pos[l] = (int64_t)(uint32_t)p32[l];
    }
    scalar_range(w, W, ids, N, dtab, prec, out, x, pos, 32 * groups, n);
    return lane_finish(x, pos, end);
#endif
}

#if defined(__AVX512F__) && defined(__AVX512VL__)
static void chunk2_fix16(__m512i *px, __m512i *pp, __m512i *pr, __m512i nbv, const uint16_t *w, int64_t W) {
    uint32_t xs[16], ps[16], rs[16], nbs[16];
    _mm512_storeu_si512(xs, *px);
    _mm512_storeu_si512(ps, *pp);
    _mm512_storeu_si512(rs, *pr);
    _mm512_storeu_si512(nbs, nbv);
    for (int l = 0; l < 16; l++) {
        if (nbs[l] > 16) {
            uint32_t k2 = nbs[l] - 16, x = xs[l];
            int64_t p = ps[l];
            rs[l] |= (x & ((1u << k2) - 1)) << 16;
            x >>= k2;
            RENORM(x, p);
            xs[l] = x;
            ps[l] = (uint32_t)p;
        }
    }
    *px = _mm512_loadu_si512(xs);
    *pp = _mm512_loadu_si512(ps);
    *pr = _mm512_loadu_si512(rs);
}

static inline __m512i step16(__m512i *px, __m512i *pp, __m512i mb, const int *tab, const int *wd, __m512i wmax,
                             __m512i smask, __m128i pcnt, const uint16_t *w, int64_t W) {
    const __m512i m16 = _mm512_set1_epi32(0xFFFF), one = _mm512_set1_epi32(1);
    __m512i x = *px, p = *pp;
    __m512i e = _mm512_i32gather_epi32(_mm512_add_epi32(mb, _mm512_and_si512(x, smask)), tab, 4);
    __m512i g = _mm512_i32gather_epi32(_mm512_min_epu32(p, wmax), wd, 2);
    __m512i tok = _mm512_and_si512(e, _mm512_set1_epi32(0xFF));
    x = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_srli_epi32(e, 20), _mm512_srl_epi32(x, pcnt)),
                         _mm512_and_si512(_mm512_srli_epi32(e, 8), _mm512_set1_epi32(0xFFF)));
    __m512i w0 = _mm512_and_si512(g, m16), w1 = _mm512_srli_epi32(g, 16);
    __mmask16 n1 = _mm512_cmplt_epu32_mask(x, _mm512_set1_epi32((int)STATE_L));
    x = _mm512_mask_or_epi32(x, n1, _mm512_slli_epi32(x, 16), w0);
    p = _mm512_mask_add_epi32(p, n1, p, one);
    __mmask16 big = _mm512_cmpgt_epi32_mask(tok, _mm512_set1_epi32(15));
    __m512i nb = _mm512_maskz_sub_epi32(big, _mm512_srli_epi32(tok, 2), _mm512_set1_epi32(2));
    __m512i k1 = _mm512_min_epu32(nb, _mm512_set1_epi32(16));
    __m512i r = _mm512_andnot_si512(_mm512_sllv_epi32(_mm512_set1_epi32(-1), k1), x);
    x = _mm512_srlv_epi32(x, k1);
    __mmask16 n2 = _mm512_cmplt_epu32_mask(x, _mm512_set1_epi32((int)STATE_L));
    x = _mm512_mask_or_epi32(x, n2, _mm512_slli_epi32(x, 16), _mm512_mask_blend_epi32(n1, w0, w1));
    p = _mm512_mask_add_epi32(p, n2, p, one);
    if (__builtin_expect(_mm512_cmpgt_epu32_mask(nb, _mm512_set1_epi32(16)) != 0, 0))
        chunk2_fix16(&x, &p, &r, nb, w, W);
    __m512i t1 = _mm512_srli_epi32(tok, 1);
    __m512i hi = _mm512_mask_or_epi32(t1, big, _mm512_and_si512(t1, one), _mm512_set1_epi32(2));
    __m512i a = _mm512_or_si512(_mm512_sllv_epi32(hi, nb), r);
    *px = x;
    *pp = p;
    return _mm512_mask_xor_epi32(a, _mm512_test_epi32_mask(tok, one), a, _mm512_set1_epi32(-1));
}
#endif

int lanes32_decode_avx512(const uint16_t *w, int64_t W, int64_t hw, const int64_t *ids, int64_t C, int64_t N,
                          const uint32_t *dtab, int64_t n_models, int32_t prec, int32_t *out) {
#if !(defined(__AVX512F__) && defined(__AVX512VL__))
    (void)w; (void)W; (void)hw; (void)ids; (void)C; (void)N; (void)dtab; (void)n_models; (void)prec; (void)out;
    return ERR_NO_ISA;
#else
    uint32_t x[32];
    int64_t pos[32], end[32];
    int err = check_models(ids, C, n_models);
    if (err) return err;
    if ((err = lane_table(w, W, hw, x, pos, end))) return err;
    int64_t n = C * N, groups = VECTOR_OK(W, n) ? n / 32 : 0;
    if (groups) {
        const int *tab = (const int *)dtab, *wd = (const int *)w;
        const __m512i wmax = _mm512_set1_epi32((int32_t)W), smask = _mm512_set1_epi32((1 << prec) - 1);
        const __m128i pcnt = _mm_cvtsi32_si128(prec);
        int32_t p32[32], mbl[32];
        for (int l = 0; l < 32; l++) p32[l] = (int32_t)pos[l];
        __m512i x0 = _mm512_loadu_si512(x), x1 = _mm512_loadu_si512(x + 16);
        __m512i p0 = _mm512_loadu_si512(p32), p1 = _mm512_loadu_si512(p32 + 16);
        int64_t c = 0, t = 0;
        for (int64_t gi = 0; gi < groups; gi++) {
            int64_t i0 = 32 * gi;
            __m512i m0, m1;
            if (t + 32 <= N) {
                m0 = m1 = _mm512_set1_epi32((int32_t)(ids[c] << prec));
            } else {
                group_bases(ids, N, prec, i0, mbl);
                m0 = _mm512_loadu_si512(mbl);
                m1 = _mm512_loadu_si512(mbl + 16);
            }
            __m512i v0 = step16(&x0, &p0, m0, tab, wd, wmax, smask, pcnt, w, W);
            __m512i v1 = step16(&x1, &p1, m1, tab, wd, wmax, smask, pcnt, w, W);
            _mm512_storeu_si512(out + i0, v0);
            _mm512_storeu_si512(out + i0 + 16, v1);
            t += 32;
            if (t >= N) {
                if (N >= 32) { t -= N; c++; }
                else { c = (i0 + 32) / N; t = (i0 + 32) % N; }
            }
        }
        _mm512_storeu_si512(x, x0);
        _mm512_storeu_si512(x + 16, x1);
        _mm512_storeu_si512(p32, p0);
        _mm512_storeu_si512(p32 + 16, p1);
        for (int l = 0; l < 32; l++) pos[l] = (int64_t)(uint32_t)p32[l];
    }
    scalar_range(w, W, ids, N, dtab, prec, out, x, pos, 32 * groups, n);
    return lane_finish(x, pos, end);
#endif
}

/* Two objects of the same shape and models (e.g. neighbours in one tensor) decoded together: 64
 * independent lanes in flight, twice the instruction-level parallelism of one object.  Needs
 * N % 32 == 0 (every group inside one channel; the tail objects go one at a time); returns the
 * first object's error, else the second's, else ERR_OK.  ERR_NO_ISA when not built. */
static int pair_setup(const uint16_t *wa, int64_t Wa, const uint16_t *wb, int64_t Wb, int64_t hw, const int64_t *ids,
                      int64_t C, int64_t N, int64_t n_models, uint32_t *x, int64_t *pos, int64_t *end, int32_t *p32) {
    int err = check_models(ids, C, n_models), eb;
    if (err) return err;
    if (N % 32 || !VECTOR_OK(Wa, C * N) || !VECTOR_OK(Wb, C * N)) return ERR_NO_ISA;
    err = lane_table(wa, Wa, hw, x, pos, end);
    eb = lane_table(wb, Wb, hw, x + 32, pos + 32, end + 32);
    if (err || eb) return err ? err : eb;
    for (int l = 0; l < 64; l++) p32[l] = (int32_t)pos[l];
    return ERR_OK;
}

static int pair_finish(const uint32_t *x, int64_t *pos, const int64_t *end, const int32_t *p32) {
    for (int l = 0; l < 64; l++) pos[l] = (int64_t)(uint32_t)p32[l];
    int err = lane_finish(x, pos, end);
    return err ? err : lane_finish(x + 32, pos + 32, end + 32);
}

int lanes32_decode2_avx2(const uint16_t *wa, int64_t Wa, const uint16_t *wb, int64_t Wb, int64_t hw, const int64_t *ids,
                         int64_t C, int64_t N, const uint32_t *dtab, int64_t n_models, int32_t prec, int32_t *oa,
                         int32_t *ob) {
#ifndef __AVX2__
    (void)wa; (void)Wa; (void)wb; (void)Wb; (void)hw; (void)ids; (void)C; (void)N; (void)dtab; (void)n_models;
    (void)prec; (void)oa; (void)ob;
    return ERR_NO_ISA;
#else
    uint32_t x[64];
    int64_t pos[64], end[64];
    int32_t p32[64];
    int err = pair_setup(wa, Wa, wb, Wb, hw, ids, C, N, n_models, x, pos, end, p32);
    if (err) return err;
    const int *tab = (const int *)dtab;
    const __m256i wma = _mm256_set1_epi32((int32_t)Wa), wmb = _mm256_set1_epi32((int32_t)Wb);
    const __m256i smask = _mm256_set1_epi32((1 << prec) - 1);
    const __m128i pcnt = _mm_cvtsi32_si128(prec);
    __m256i X[8], P[8];
    for (int j = 0; j < 8; j++) {
        X[j] = _mm256_loadu_si256((const __m256i *)(x + 8 * j));
        P[j] = _mm256_loadu_si256((const __m256i *)(p32 + 8 * j));
    }
    for (int64_t c = 0; c < C; c++) {
        const __m256i m = _mm256_set1_epi32((int32_t)(ids[c] << prec));
        for (int64_t i0 = c * N; i0 < (c + 1) * N; i0 += 32) {
            __m256i v[8];
            for (int j = 0; j < 4; j++) v[j] = step8(&X[j], &P[j], m, tab, (const int *)wa, wma, smask, pcnt, wa, Wa);
            for (int j = 4; j < 8; j++) v[j] = step8(&X[j], &P[j], m, tab, (const int *)wb, wmb, smask, pcnt, wb, Wb);
            for (int j = 0; j < 4; j++) {
                _mm256_storeu_si256((__m256i *)(oa + i0 + 8 * j), v[j]);
                _mm256_storeu_si256((__m256i *)(ob + i0 + 8 * j), v[4 + j]);
            }
        }
    }
    for (int j = 0; j < 8; j++) {
        _mm256_storeu_si256((__m256i *)(x + 8 * j), X[j]);
        _mm256_storeu_si256((__m256i *)(p32 + 8 * j), P[j]);
    }
    return pair_finish(x, pos, end, p32);
#endif
}

int lanes32_decode2_avx512(const uint16_t *wa, int64_t Wa, const uint16_t *wb, int64_t Wb, int64_t hw,
                           const int64_t *ids, int64_t C, int64_t N, const uint32_t *dtab, int64_t n_models,
                           int32_t prec, int32_t *oa, int32_t *ob) {
#if !(defined(__AVX512F__) && defined(__AVX512VL__))
    (void)wa; (void)Wa; (void)wb; (void)Wb; (void)hw; (void)ids; (void)C; (void)N; (void)dtab; (void)n_models;
    (void)prec; (void)oa; (void)ob;
    return ERR_NO_ISA;
#else
    uint32_t x[64];
    int64_t pos[64], end[64];
    int32_t p32[64];
    int err = pair_setup(wa, Wa, wb, Wb, hw, ids, C, N, n_models, x, pos, end, p32);
    if (err) return err;
    const int *tab = (const int *)dtab;
    const __m512i wma = _mm512_set1_epi32((int32_t)Wa), wmb = _mm512_set1_epi32((int32_t)Wb);
    const __m512i smask = _mm512_set1_epi32((1 << prec) - 1);
    const __m128i pcnt = _mm_cvtsi32_si128(prec);
    __m512i X[4], P[4];
    for (int j = 0; j < 4; j++) {
        X[j] = _mm512_loadu_si512(x + 16 * j);
        P[j] = _mm512_loadu_si512(p32 + 16 * j);
    }
    for (int64_t c = 0; c < C; c++) {
        const __m512i m = _mm512_set1_epi32((int32_t)(ids[c] << prec));
        for (int64_t i0 = c * N; i0 < (c + 1) * N; i0 += 32) {
            __m512i v0 = step16(&X[0], &P[0], m, tab, (const int *)wa, wma, smask, pcnt, wa, Wa);
            __m512i v1 = step16(&X[1], &P[1], m, tab, (const int *)wa, wma, smask, pcnt, wa, Wa);
            __m512i v2 = step16(&X[2], &P[2], m, tab, (const int *)wb, wmb, smask, pcnt, wb, Wb);
            __m512i v3 = step16(&X[3], &P[3], m, tab, (const int *)wb, wmb, smask, pcnt, wb, Wb);
            _mm512_storeu_si512(oa + i0, v0);
            _mm512_storeu_si512(oa + i0 + 16, v1);
            _mm512_storeu_si512(ob + i0, v2);
            _mm512_storeu_si512(ob + i0 + 16, v3);
        }
    }
    for (int j = 0; j < 4; j++) {
        _mm512_storeu_si512(x + 16 * j, X[j]);
        _mm512_storeu_si512(p32 + 16 * j, P[j]);
    }
    return pair_finish(x, pos, end, p32);
#endif
}

/* Throughput probe: seconds per vpgatherdd (ymm: which = 0, zmm: which = 1) from an L1-resident
 * 16 KiB table, 8 independent chains (enough to cover the gather latency); -1 if not built. */
#include <time.h>
static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}
static int32_t probe_tab[4096];

double lanes32_probe_gather(int which, int64_t n) {
    for (int i = 0; i < 4096; i++) probe_tab[i] = (int32_t)((uint32_t)i * 2654435761u & 4095u);
    double t = now_s();
    int64_t sink = 0;
    if (which == 0) {
#ifdef __AVX2__
        const __m256i m = _mm256_set1_epi32(4095);
        __m256i a[8];
        for (int j = 0; j < 8; j++) a[j] = _mm256_set1_epi32(j + 1);
        for (int64_t i = 0; i < n; i++) {
#define G8(j) a[j] = _mm256_i32gather_epi32(probe_tab, _mm256_and_si256(a[j], m), 4)
            G8(0); G8(1); G8(2); G8(3); G8(4); G8(5); G8(6); G8(7);
        }
        for (int j = 0; j < 8; j++) sink += _mm256_extract_epi32(a[j], 0);
#else
        return -1.0;
#endif
    } else {
#if defined(__AVX512F__)
        const __m512i m = _mm512_set1_epi32(4095);
        __m512i a[8];
        for (int j = 0; j < 8; j++) a[j] = _mm512_set1_epi32(j + 1);
        for (int64_t i = 0; i < n; i++) {
#define G16(j) a[j] = _mm512_i32gather_epi32(_mm512_and_si512(a[j], m), probe_tab, 4)
            G16(0); G16(1); G16(2); G16(3); G16(4); G16(5); G16(6); G16(7);
        }
        for (int j = 0; j < 8; j++) sink += _mm512_reduce_add_epi32(a[j]);
#else
        return -1.0;
#endif
    }
    t = now_s() - t;
    return sink == -12345 ? 0.0 : t / (8.0 * (double)n);
}
