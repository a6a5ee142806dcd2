/* Exact-format GEMM for the lean runtime (dartspec/exact.py): y = x W^T + b, W stored as integer groups.
 *
 * A weight row is cut into groups of 32 along the input. A 4-bit group holds w = d * q + m (q in 0..15,
 * 16 bytes: byte j has q[j] in its low nibble and q[j+16] in its high nibble); an 8-bit group holds
 * w = d * q (q int8). GGUF's Q4_1 / Q4_K and Q8_0 blocks are such groups, so a model converted from a
 * GGUF file is represented bit for bit. The weights are widened to fp32 in registers and every product
 * and sum is fp32: only the summation order differs from a dense fp32 GEMM.
 *
 *   sum_k x[k] w[k] = sum_g d_g * (sum_j q_j x_j) + m_g * (sum_j x_j)
 *
 * Compiled once per machine with -march=native: 16-lane AVX-512 code where the CPU has it, 8-lane AVX2 else.
 * Threads: OpenMP, linked against the libgomp that torch itself loaded, so both share one pool.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define GROUP 32

static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

#ifdef __AVX512F__
/* 16 lanes: a group is two vectors of weights, each widened once, scaled by d (exact: a 4-bit or 8-bit q
 * times d needs at most 19 significant bits) and multiplied into every input row; two accumulators per row
 * keep the FMA chains independent. */
#define RMAX 8
typedef __m512 acc_t;
static inline acc_t acc_zero(void) { return _mm512_setzero_ps(); }
static inline float acc_sum(acc_t a, acc_t b) { return _mm512_reduce_add_ps(_mm512_add_ps(a, b)); }
#define GROUP_BODY(W0, W1)                                                           \
    for (long r = 0; r < R; r++) {                                                   \
        const float *xp = x + r * K + g * GROUP;                                     \
        a0[r] = _mm512_fmadd_ps(W0, _mm512_loadu_ps(xp), a0[r]);                     \
        a1[r] = _mm512_fmadd_ps(W1, _mm512_loadu_ps(xp + 16), a1[r]);                \
    }
static inline void widen4(const uint8_t *w, float d, __m512 *w0, __m512 *w1) {
    __m128i b = _mm_loadu_si128((const __m128i *)w), low = _mm_set1_epi8(0x0F);
    __m512 ds = _mm512_set1_ps(d);
    *w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, low))), ds);
    *w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), low))), ds);
}
static inline void widen8(const int8_t *w, float d, __m512 *w0, __m512 *w1) {
    __m512 ds = _mm512_set1_ps(d);
    *w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)w))), ds);
    *w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + 16)))), ds);
}
#else
/* 8 lanes (AVX2): the same with four vectors per group. */
#define RMAX 4
typedef __m256 acc_t;
static inline acc_t acc_zero(void) { return _mm256_setzero_ps(); }
static inline float acc_sum(acc_t a, acc_t b) { return hsum8(_mm256_add_ps(a, b)); }
static inline __m256 widen_u8(__m128i v, __m256 ds) {
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), ds);
}
static inline __m256 widen_i8(__m128i v, __m256 ds) {
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), ds);
}
#define GROUP_BODY4(W0, W1, W2, W3)                                                  \
    for (long r = 0; r < R; r++) {                                                   \
        const float *xp = x + r * K + g * GROUP;                                     \
        a0[r] = _mm256_fmadd_ps(W0, _mm256_loadu_ps(xp), a0[r]);                     \
        a1[r] = _mm256_fmadd_ps(W1, _mm256_loadu_ps(xp + 8), a1[r]);                 \
        a0[r] = _mm256_fmadd_ps(W2, _mm256_loadu_ps(xp + 16), a0[r]);                \
        a1[r] = _mm256_fmadd_ps(W3, _mm256_loadu_ps(xp + 24), a1[r]);                \
    }
#endif

/* One output row for R input rows starting at x (row stride K): out[r] = sum_k x[r][k] w[k]. */
static inline __attribute__((always_inline)) void row_q4(const float *x, long R, long K, const uint8_t *w, const float *d, const float *m,
                          const float *xs, long G, float *out) {
    acc_t a0[RMAX], a1[RMAX];
    for (long r = 0; r < R; r++) a0[r] = a1[r] = acc_zero();
    for (long g = 0; g < G; g++) {
#ifdef __AVX512F__
        __m512 w0, w1;
        widen4(w + g * 16, d[g], &w0, &w1);
        GROUP_BODY(w0, w1)
#else
        __m128i b = _mm_loadu_si128((const __m128i *)(w + g * 16)), low = _mm_set1_epi8(0x0F);
        __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
        __m256 ds = _mm256_set1_ps(d[g]);
        __m256 w0 = widen_u8(lo, ds), w1 = widen_u8(_mm_srli_si128(lo, 8), ds);
        __m256 w2 = widen_u8(hi, ds), w3 = widen_u8(_mm_srli_si128(hi, 8), ds);
        GROUP_BODY4(w0, w1, w2, w3)
#endif
    }
    for (long r = 0; r < R; r++) {
        float s = acc_sum(a0[r], a1[r]);
        const float *xr = xs + r * G;
        for (long g = 0; g < G; g++) s += m[g] * xr[g];
        out[r] = s;
    }
}

static inline __attribute__((always_inline)) void row_q8(const float *x, long R, long K, const int8_t *w, const float *d, long G, float *out) {
    acc_t a0[RMAX], a1[RMAX];
    for (long r = 0; r < R; r++) a0[r] = a1[r] = acc_zero();
    for (long g = 0; g < G; g++) {
#ifdef __AVX512F__
        __m512 w0, w1;
        widen8(w + g * GROUP, d[g], &w0, &w1);
        GROUP_BODY(w0, w1)
#else
        __m128i b0 = _mm_loadu_si128((const __m128i *)(w + g * GROUP));
        __m128i b1 = _mm_loadu_si128((const __m128i *)(w + g * GROUP + 16));
        __m256 ds = _mm256_set1_ps(d[g]);
        __m256 w0 = widen_i8(b0, ds), w1 = widen_i8(_mm_srli_si128(b0, 8), ds);
        __m256 w2 = widen_i8(b1, ds), w3 = widen_i8(_mm_srli_si128(b1, 8), ds);
        GROUP_BODY4(w0, w1, w2, w3)
#endif
    }
    for (long r = 0; r < R; r++) out[r] = acc_sum(a0[r], a1[r]);
}

#include "rows.h"

/* x (M, K) fp32 contiguous, y (M, O) fp32; kind 4: w (O, G, 16) uint8 with d, m (O, G); kind 8: w (O, G, 32)
 * int8 with d (O, G), m unused. bias (O) or NULL. */
void dartspec_qgemm(int kind, const float *x, long M, long K, const void *w, const float *d, const float *m,
                    const float *bias, float *y, long O) {
    long G = K / GROUP;
    float *xs = NULL;
    if (kind == 4) {
        xs = (float *)malloc(sizeof(float) * M * G);
        for (long r = 0; r < M; r++)
            for (long g = 0; g < G; g++) {
                float s = 0.0f;
                for (long j = 0; j < GROUP; j++) s += x[r * K + g * GROUP + j];
                xs[r * G + g] = s;
            }
    }
#pragma omp parallel for schedule(static)
    for (long o = 0; o < O; o++) {
        float out[RMAX];
        for (long r0 = 0; r0 < M; r0 += RMAX) {
            long R = M - r0 < RMAX ? M - r0 : RMAX;
            const float *xr = x + r0 * K;
            /* A constant row count per call site, so the accumulators live in registers. */
            if (kind == 4) {
                const uint8_t *wo = (const uint8_t *)w + o * G * 16;
                const float *xsr = xs + r0 * G;
                switch (R) {
                    ROWS(row_q4(xr, N, K, wo, d + o * G, m + o * G, xsr, G, out))
                }
            } else {
                const int8_t *wo = (const int8_t *)w + o * G * GROUP;
                switch (R) {
                    ROWS(row_q8(xr, N, K, wo, d + o * G, G, out))
                }
            }
            float b = bias ? bias[o] : 0.0f;
            for (long r = 0; r < R; r++) y[(r0 + r) * O + o] = out[r] + b;
        }
    }
    free(xs);
}
