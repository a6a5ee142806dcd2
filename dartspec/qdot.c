/* Integer-dot GEMM for the exact-a16 format (dartspec/exact.py): y = x W^T + b with W the same integer groups
 * as the exact format and x rounded to 16-bit integers per group of 32 inputs.
 *
 * The fp32 kernel (qgemm.c) widens every weight to fp32 and is bound by that widening and by fp32 FMA
 * throughput: it runs below memory speed for one row and scales poorly with rows. Here a group's products
 * are integer: for a row and a group, x_j = dx * xq_j with dx = max|x| / 32767 (xq in int16), so
 *
 *   sum_j x_j w_j = dx * d * sum_j xq_j q_j  +  m * sum_j x_j          (m = 0 for 8-bit groups)
 *
 * and sum_j xq_j q_j is an exact int32 dot product (|sum| < 2^28): one VPDPWSSD (AVX-512 VNNI) or
 * VPMADDWD + VPADDD (AVX2) per 16 or 8 products of a pair of inputs with PANEL outputs. The only change to
 * the model is the rounding of each activation to 1/32767 of its group's largest magnitude (fp16 weights
 * round each weight to 1/2048 of itself): the fidelity gate measures it. Every row is computed the same
 * way whatever the other rows are, so a tree verification computes what one-token decoding computes.
 *
 * Weights are stored in panels of PANEL outputs (16 with AVX-512, 8 with AVX2; dartspec_qdot_panel() says
 * which): for panel p and group g, chunk c holds 2 * PANEL bytes, byte 2 * o + e for output o and input
 * pair element e. 4-bit groups: 8 chunks, the low nibble is q[2c + e], the high nibble q[16 + 2c + e]
 * (q in 0..15); 8-bit groups: 16 chunks of int8 q[2c + e]; kind 5, the same chunks of uint8 q with an offset m
 * (a GGUF's Q5_K sub-blocks, d * q + m with q in 0..31); kind 6, 6-bit groups whose two halves of 16 inputs have a
 * scale each (Q6_K sub-blocks, q - 32 with q in 0..63; scales (P, G, 2, PANEL), fp32), in 6 bits as in the file: the
 * low 4 bits of q in 4-bit chunks, then 4 chunks of their high 2 bits, byte 2 * o + e of chunk j holding those of
 * inputs 4j + e, 16 + 4j + e, 4j + 2 + e and 18 + 4j + e at bits 0, 2, 4 and 6 (24 bytes an output's group instead
 * of 32: a decode step reads less); kind 7, 8-bit groups whose values fit 5 bits (-16..15: a GGUF's Q5_0 and Q4_0
 * blocks), in 5 bits: q + 16's low 4 bits as kind 4's nibbles, then 2 chunks of their fifth bits, byte 2 * o + e of
 * chunk j holding those of inputs 2c + e and 16 + 2c + e at bits 2k and 2k + 1 for c = 4j + k (20 bytes an output's
 * group instead of 32; the dot product runs on q + 16 and subtracts 16 times the input group's integer sum, so the
 * integer sums are kind 8's). Scales d and offsets m of the other kinds are (P, G, PANEL), fp32 or,
 * where every value is a half-precision number (a GGUF's Q4_1 / Q8_0 blocks store them so), fp16: a decode step is
 * bound by reading the weights, and fp16 scales make a 4-bit group 20 bytes instead of 24, the same numbers. A Q4_K
 * weight's 4-bit groups (`half` 2) keep the file's own codes: d holds (P, G, 2, PANEL) uint8, each group's 6-bit scale
 * code then its minimum code, m holds (P, G / 8, 2, PANEL) fp16, each super-block of 256 inputs' d and -dmin; the
 * kernel forms d * sc and -dmin * m, both exact in fp32, so the same numbers as fp32 scales in 18.5 bytes a group.
 * A Q6_K weight's kind-6 groups likewise (`half` 2): d holds (P, G, 2, PANEL) int8, each half group's scale code, m
 * (P, G / 8, PANEL) fp16, each super-block's d: 26.25 bytes a group instead of 32.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "qdot.h"
#include "vmath.h"

#define GROUP 32

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define PANEL 16
/* 8 rows a pass: with the input pairs as vpdpwssd's memory operands (DOT2 below) the integer accumulators of 8 rows
 * fit the 32 registers; a verify forward of 5-6 rows then takes 0.89-0.90x the time of 4 + 1 or 4 + 2 rows in two
 * passes, 8 rows 0.97x (Intel Xeon, Emerald Rapids) */
#define RMAX 8
typedef __m512i ivec;
typedef __m512 fvec;
#define IZERO() _mm512_setzero_si512()
#define IADD(a, b) _mm512_add_epi32(a, b)
#define FZERO() _mm512_setzero_ps()
#define WIDEN_U8(p) _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(p)))
#define WIDEN_I8(p) _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(p)))
#define LOW4(v) _mm512_and_si512(v, _mm512_set1_epi16(0x0F))
#define HIGH4(v) _mm512_srli_epi16(v, 4)
#define SHL16(v, n) _mm512_slli_epi16(v, n)
#define SHR16(v, n) _mm512_srli_epi16(v, n)
/* a kind-6 or kind-7 value: nibble | (t & high), the high bits moved into place in t; one ternary-logic instruction */
#define MERGE(nib, t, high) _mm512_ternarylogic_epi32(nib, t, _mm512_set1_epi16(high), 0xF8)
#define ISUB(a, b) _mm512_sub_epi32(a, b)
#define ISET(v) _mm512_set1_epi32(v)
#define BCAST(p) _mm512_set1_epi32(*(p))
#ifdef __AVX512VNNI__
/* The input pair as vpdpwssd's own broadcast memory operand ({1to16}): gcc emits a vpbroadcastd of its own for
 * _mm512_set1_epi32 of a load, a second instruction on the vector ports for every dot product (16 independent
 * vpdpwssd took 8.0 cycles alone, 11.8 with their broadcasts, 8.4 folded). XB passes the pair's address. */
#define XB(p) (p)
#define DPB(s, w, p) __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(s) : "v"(w), "m"(*(const int32_t *)(p)))
#define DOT2(s0, s1, w0, x0, w1, x1) do { DPB(s0, w0, x0); DPB(s1, w1, x1); } while (0)
#else
#define DOT2(s0, s1, w0, x0, w1, x1) \
    (s0 = _mm512_add_epi32(s0, _mm512_add_epi32(_mm512_madd_epi16(w0, x0), _mm512_madd_epi16(w1, x1))))
#endif
#ifndef XB
#define XB(p) BCAST(p)
#endif
#define FLOAD(p) _mm512_loadu_ps(p)
#define HLOAD(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define U8LOAD(p) _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define I8LOAD(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define FSET(v) _mm512_set1_ps(v)
#define FMADD(a, b, c) _mm512_fmadd_ps(a, b, c)
#define FMUL(a, b) _mm512_mul_ps(a, b)
#define FADD(a, b) _mm512_add_ps(a, b)
#define TOFLOAT(v) _mm512_cvtepi32_ps(v)
#define FSTORE(p, v) _mm512_storeu_ps(p, v)
#else
#define PANEL 8
/* 8 rows a pass: the 8 integer accumulators stay in registers, the fp32 sums (touched once a group) spill. A verify
 * forward of 5 rows then takes 0.91x the time of 4 + 1 rows in two passes, 8-64 rows 0.96x (Zen 3) */
#define RMAX 8
typedef __m256i ivec;
typedef __m256 fvec;
#define IZERO() _mm256_setzero_si256()
#define IADD(a, b) _mm256_add_epi32(a, b)
#define FZERO() _mm256_setzero_ps()
#define WIDEN_U8(p) _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(p)))
#define WIDEN_I8(p) _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p)))
#define LOW4(v) _mm256_and_si256(v, _mm256_set1_epi16(0x0F))
#define HIGH4(v) _mm256_srli_epi16(v, 4)
#define SHL16(v, n) _mm256_slli_epi16(v, n)
#define SHR16(v, n) _mm256_srli_epi16(v, n)
#define MERGE(nib, t, high) _mm256_or_si256(nib, _mm256_and_si256(t, _mm256_set1_epi16(high)))
#define ISUB(a, b) _mm256_sub_epi32(a, b)
#define ISET(v) _mm256_set1_epi32(v)
#define BCAST(p) _mm256_set1_epi32(*(p))
#ifdef __AVXVNNI__
#define DOT2(s0, s1, w0, x0, w1, x1) (s0 = _mm256_dpwssd_avx_epi32(s0, w0, x0), s1 = _mm256_dpwssd_avx_epi32(s1, w1, x1))
#else
#define DOT2(s0, s1, w0, x0, w1, x1) \
    (s0 = _mm256_add_epi32(s0, _mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1))))
#endif
#define XB(p) BCAST(p)
#define FLOAD(p) _mm256_loadu_ps(p)
#define HLOAD(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define U8LOAD(p) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define I8LOAD(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define FSET(v) _mm256_set1_ps(v)
#define FMADD(a, b, c) _mm256_fmadd_ps(a, b, c)
#define FMUL(a, b) _mm256_mul_ps(a, b)
#define FADD(a, b) _mm256_add_ps(a, b)
#define TOFLOAT(v) _mm256_cvtepi32_ps(v)
#define FSTORE(p, v) _mm256_storeu_ps(p, v)
#endif

#define CHUNK (2 * PANEL)
/* The locality hint of the weight prefetch (exact.py passes it per CPU vendor). On a 2-core Intel Xeon (Emerald
 * Rapids) a non-temporal prefetch (0) made a decode step's GEMMs slower than no prefetch at all (0.72x its time) and
 * one into L2 (2, PREFETCHT1) twice as fast (0.51x); on AMD Zen 5 the non-temporal one measured faster than none. */
#ifndef PREFETCH_HINT
#define PREFETCH_HINT 0
#endif

int dartspec_qdot_panel(void) { return PANEL; }

#if PANEL == 8
static inline int32_t hsum_i16(__m256i v) { /* the sum of 16 int16 lanes */
    __m256i w = _mm256_madd_epi16(v, _mm256_set1_epi16(1));
    __m128i x = _mm_add_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
    x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(x, _mm_shuffle_epi32(x, 0xB1)));
}
#endif

/* One row and its groups: xq (16 int16 pairs read as int32), dx, the fp32 sum of each group, and 32 times the sum of
 * each half group's int16 values (x32: kind 6's q - 32 is the dot with q, minus that). The int16 values are
 * round-to-nearest-even of x * 32767 / max|x| on every path; only the order of the fp32 group sum differs. */
static void quantize_row(const float *p, long K, int32_t *xq, float *dx, float *sx, int32_t *x32) {
    for (long g = 0; g < K / GROUP; g++, p += GROUP) {
#if PANEL == 16
        __m512 a = _mm512_loadu_ps(p), b = _mm512_loadu_ps(p + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        float s = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
        float d = amax / 32767.0f, inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
        __m512 vi = _mm512_set1_ps(inv);
        __m512i hi = _mm512_set1_epi32(32767), lo = _mm512_set1_epi32(-32767);
        /* cvtps rounds by MXCSR: to nearest even, as nearbyintf does. */
        __m512i qa = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(a, vi)), hi), lo);
        __m512i qb = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(b, vi)), hi), lo);
        int16_t *q = (int16_t *)(xq + g * (GROUP / 2));
        _mm256_storeu_si256((__m256i *)q, _mm512_cvtepi32_epi16(qa));
        _mm256_storeu_si256((__m256i *)(q + 16), _mm512_cvtepi32_epi16(qb));
        x32[2 * g] = 32 * _mm512_reduce_add_epi32(qa);
        x32[2 * g + 1] = 32 * _mm512_reduce_add_epi32(qb);
#else /* AVX2: the same rounding, 8 lanes at a time (gcc left the scalar loop of fmaxf / nearbyintf unvectorized) */
        __m256 a0 = _mm256_loadu_ps(p), a1 = _mm256_loadu_ps(p + 8), a2 = _mm256_loadu_ps(p + 16),
               a3 = _mm256_loadu_ps(p + 24);
        __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, a0), _mm256_andnot_ps(sign, a1)),
                                 _mm256_max_ps(_mm256_andnot_ps(sign, a2), _mm256_andnot_ps(sign, a3)));
        __m256 t = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        t4 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
        float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        float s = _mm_cvtss_f32(_mm_add_ss(t4, _mm_movehdup_ps(t4)));
        float d = amax / 32767.0f, inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
        __m256 vi = _mm256_set1_ps(inv);
        __m256i hi = _mm256_set1_epi32(32767), lo = _mm256_set1_epi32(-32767);
        /* cvtps rounds by MXCSR: to nearest even, as nearbyintf does. */
#define Q16(a) _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(a, vi)), hi), lo)
        /* packs interleaves the 128-bit lanes of its two inputs; the permute puts the 16 values back in order */
        __m256i q01 = _mm256_permute4x64_epi64(_mm256_packs_epi32(Q16(a0), Q16(a1)), 0xD8);
        __m256i q23 = _mm256_permute4x64_epi64(_mm256_packs_epi32(Q16(a2), Q16(a3)), 0xD8);
#undef Q16
        int16_t *q = (int16_t *)(xq + g * (GROUP / 2));
        _mm256_storeu_si256((__m256i *)q, q01);
        _mm256_storeu_si256((__m256i *)(q + 16), q23);
        x32[2 * g] = 32 * hsum_i16(q01);
        x32[2 * g + 1] = 32 * hsum_i16(q23);
#endif
        dx[g] = d;
        sx[g] = s;
    }
}

/* The M input rows of a GEMM (row r at x + r * stride), after the prologue `in` (qdot.h), quantized. Each row
 * is transformed and rounded on its own, so a row's result never depends on the other rows. */
void qdot_prepare(int in, const float *x, long M, long K, long stride, const float *norm, float eps, qdot_rows *out) {
    long G = K / GROUP;
    float *tmp = (float *)malloc(sizeof(float) * K);
    for (long r = 0; r < M; r++) {
        const float *row = x + r * stride;
        if (in == QDOT_RMSNORM) {
            float inv = rms_inverse(row, K, eps);
#pragma omp simd
            for (long k = 0; k < K; k++) tmp[k] = row[k] * inv * norm[k];
            row = tmp;
        } else if (in == QDOT_SILU_MUL) { /* row = [gate | up], each K wide: silu(gate) * up */
#pragma omp simd
            for (long k = 0; k < K; k++) tmp[k] = silu(row[k]) * row[K + k];
            row = tmp;
        } else if (in == QDOT_GELU_MUL) { /* the same with GELU (Gemma) */
#pragma omp simd
            for (long k = 0; k < K; k++) tmp[k] = gelu_tanh(row[k]) * row[K + k];
            row = tmp;
        }
        quantize_row(row, K, out->xq + r * G * (GROUP / 2), out->dx + r * G, out->sx + r * G, out->x32 + r * G * 2);
        if (out->xf) memcpy(out->xf + r * K, row, sizeof(float) * K);
    }
    free(tmp);
}

void qdot_rows_alloc(qdot_rows *rows, long M, long K, int keep_float) {
    long G = K / GROUP;
    rows->xq = (int32_t *)malloc(sizeof(int32_t) * M * G * (GROUP / 2));
    rows->dx = (float *)malloc(sizeof(float) * M * G);
    rows->sx = (float *)malloc(sizeof(float) * M * G);
    rows->x32 = (int32_t *)malloc(sizeof(int32_t) * M * G * 2);
    rows->xf = keep_float ? (float *)malloc(sizeof(float) * M * K) : NULL;
}

void qdot_rows_free(qdot_rows *rows) {
    free(rows->xq);
    free(rows->dx);
    free(rows->sx);
    free(rows->x32);
    free(rows->xf);
}

/* N rows (a constant at every call site, so the accumulators stay in registers) against one panel. With VNNI
 * each row has two integer accumulators (the low and high nibbles' products, or even and odd chunks): two
 * independent chains of the 5-cycle VPDPWSSD keep the units busy at few rows. Without it (DOT2) each pair of
 * products is summed first and a row has one accumulator (s1 stays zero): a VPADDD chain is short anyway, and
 * AVX2's 16 registers then hold the integer sums of 8 rows (two per row spilled already at 4 rows: this is 1.2x
 * faster at 4-16 rows on a Zen 3). The
 * integer sums are exact either way, so the result does not depend on the path. */
static inline __attribute__((always_inline)) void panel_rows(int kind, int half, long N, const int32_t *xq,
                                                             const float *dx, const float *sx, const int32_t *x32, long G,
                                                             const uint8_t *w, const void *d, const void *m,
                                                             const uint8_t *next, fvec *out) {
    fvec acc[RMAX];
    long group_bytes = (kind == 4 ? 8 : kind == 6 ? 12 : kind == 7 ? 10 : 16) * CHUNK;
    for (long r = 0; r < N; r++) acc[r] = FZERO();
    for (long g = 0; g < G; g++) {
        if (next) /* the next panel's weights, one group a step: DRAM latency hides behind this panel's work */
            for (long b = 0; b < group_bytes; b += 64) __builtin_prefetch(next + g * group_bytes + b, 0, PREFETCH_HINT);
        ivec s0[RMAX], s1[RMAX];
        if (kind == 6) { /* the group's halves (inputs 0-15: low nibbles, 16-31: high) summed apart, scaled apart */
            const uint8_t *wg = w + g * 12 * CHUNK, *bits = wg + 8 * CHUNK;
            ivec t0[RMAX], t1[RMAX];
            for (long r = 0; r < N; r++) s0[r] = s1[r] = t0[r] = t1[r] = IZERO();
            for (int c = 0; c < 8; c += 2) {
                /* chunk c's values q: a nibble and 2 high bits of the pair's byte b (c even: bits 0 and 2 for the
                 * halves, c + 1: bits 4 and 6), moved to bits 4-5 (the file's q - 32: x32 after the loop) */
                ivec b = WIDEN_U8(bits + c / 2 * CHUNK), v0 = WIDEN_U8(wg + c * CHUNK);
                ivec v1 = WIDEN_U8(wg + (c + 1) * CHUNK);
                ivec a0 = MERGE(LOW4(v0), SHL16(b, 4), 0x30), a1 = MERGE(LOW4(v1), b, 0x30);
                ivec h0 = MERGE(HIGH4(v0), SHL16(b, 2), 0x30), h1 = MERGE(HIGH4(v1), SHR16(b, 2), 0x30);
                for (long r = 0; r < N; r++) {
                    const int32_t *xr = xq + (r * G + g) * (GROUP / 2);
                    DOT2(s0[r], s1[r], a0, XB(xr + c), a1, XB(xr + c + 1));
                    DOT2(t0[r], t1[r], h0, XB(xr + 8 + c), h1, XB(xr + 9 + c));
                }
            }
            for (int h = 0; h < 2; h++) {
                fvec dv = half == 2 ? FMUL(HLOAD((const uint16_t *)m + g / 8 * PANEL),
                                           I8LOAD((const int8_t *)d + (g * 2 + h) * PANEL))
                                    : FLOAD((const float *)d + (g * 2 + h) * PANEL);
                for (long r = 0; r < N; r++) {
                    ivec sum = ISUB(h ? IADD(t0[r], t1[r]) : IADD(s0[r], s1[r]), BCAST(x32 + (r * G + g) * 2 + h));
                    acc[r] = FMADD(TOFLOAT(sum), FMUL(dv, FSET(dx[r * G + g])), acc[r]);
                }
            }
            continue;
        }
        for (long r = 0; r < N; r++) s0[r] = s1[r] = IZERO();
        if (kind == 7) { /* 5-bit groups: q + 16 in nibbles (as kind 4) and high bits; 16 * the group's sum after */
            const uint8_t *wg = w + g * 10 * CHUNK, *bits = wg + 8 * CHUNK;
            for (int j = 0; j < 2; j++) { /* chunks 4j .. 4j + 3 share a chunk of high bits */
                ivec b = WIDEN_U8(bits + j * CHUNK);
                /* chunk 4j + k: its low-half value's high bit at bit 2k, its high-half value's at 2k + 1: to bit 4 */
                ivec t[8] = {SHL16(b, 4), SHL16(b, 3), SHL16(b, 2), SHL16(b, 1), b, SHR16(b, 1), SHR16(b, 2), SHR16(b, 3)};
                for (int k = 0; k < 4; k++) {
                    int c = 4 * j + k;
                    ivec v = WIDEN_U8(wg + c * CHUNK);
                    ivec lo = MERGE(LOW4(v), t[2 * k], 0x10), hi = MERGE(HIGH4(v), t[2 * k + 1], 0x10);
                    for (long r = 0; r < N; r++) {
                        const int32_t *xr = xq + (r * G + g) * (GROUP / 2);
                        DOT2(s0[r], s1[r], lo, XB(xr + c), hi, XB(xr + c + 8));
                    }
                }
            }
            for (long r = 0; r < N; r++) { /* x32 holds 32 times each half's sum: 16 times the group's is their mean */
                const int32_t *h = x32 + (r * G + g) * 2;
                s0[r] = ISUB(s0[r], ISET((h[0] + h[1]) / 2));
            }
        } else if (kind == 4) {
            const uint8_t *wg = w + g * 8 * CHUNK;
            for (int c = 0; c < 8; c++) {
                ivec v = WIDEN_U8(wg + c * CHUNK), lo = LOW4(v), hi = HIGH4(v);
                for (long r = 0; r < N; r++) {
                    const int32_t *xr = xq + (r * G + g) * (GROUP / 2);
                    DOT2(s0[r], s1[r], lo, XB(xr + c), hi, XB(xr + c + 8));
                }
            }
        } else {
            const uint8_t *wg = w + g * 16 * CHUNK;
            for (int c = 0; c < 16; c += 2) {
                ivec v0 = kind == 5 ? WIDEN_U8(wg + c * CHUNK) : WIDEN_I8(wg + c * CHUNK);
                ivec v1 = kind == 5 ? WIDEN_U8(wg + (c + 1) * CHUNK) : WIDEN_I8(wg + (c + 1) * CHUNK);
                for (long r = 0; r < N; r++) {
                    const int32_t *xr = xq + (r * G + g) * (GROUP / 2);
                    DOT2(s0[r], s1[r], v0, XB(xr + c), v1, XB(xr + c + 1));
                }
            }
        }
        /* the group's scales: fp16 widened in one instruction (F16C), or fp32, or a Q4_K super-block's product */
#define SCALES(p) (half ? HLOAD((const uint16_t *)(p) + g * PANEL) : FLOAD((const float *)(p) + g * PANEL))
#define CODED(c) \
    FMUL(HLOAD((const uint16_t *)m + (g / 8 * 2 + (c)) * PANEL), U8LOAD((const uint8_t *)d + (g * 2 + (c)) * PANEL))
        fvec dv = half == 2 ? CODED(0) : SCALES(d);
        for (long r = 0; r < N; r++)
            acc[r] = FMADD(TOFLOAT(IADD(s0[r], s1[r])), FMUL(dv, FSET(dx[r * G + g])), acc[r]);
        if (kind == 4 || kind == 5) {
            fvec mv = half == 2 ? CODED(1) : SCALES(m);
            for (long r = 0; r < N; r++) acc[r] = FMADD(mv, FSET(sx[r * G + g]), acc[r]);
        }
    }
#undef SCALES
#undef CODED
    for (long r = 0; r < N; r++) out[r] = acc[r];
}

#include "rows.h"

/* fp16 weights (kind 16): a panel is K steps of PANEL halfs (step k: the weights of the panel's outputs at input k),
 * widened in registers; fp32 FMAs against the unrounded rows. Two chains per row (even and odd inputs), added at
 * the end: the same order whatever the row count, so every row is computed on its own (a tree verification computes
 * what one-token decoding does; fbgemm's fp16 GEMM rounds by row count). Two chains keep one row memory-bound; up to
 * HROWS rows share each widened step (a prefill's 64-row chunks). */
#define HROWS 4
static inline __attribute__((always_inline)) void half_rows(long N, const float *x, long K, const uint16_t *w,
                                                            fvec *out) {
    fvec even[HROWS], odd[HROWS];
    for (long r = 0; r < N; r++) even[r] = odd[r] = FZERO();
    long k = 0;
    for (; k + 2 <= K; k += 2) {
        fvec w0 = HLOAD(w + k * PANEL), w1 = HLOAD(w + (k + 1) * PANEL);
        for (long r = 0; r < N; r++) {
            even[r] = FMADD(w0, FSET(x[r * K + k]), even[r]);
            odd[r] = FMADD(w1, FSET(x[r * K + k + 1]), odd[r]);
        }
    }
    if (k < K) {
        fvec w0 = HLOAD(w + k * PANEL);
        for (long r = 0; r < N; r++) even[r] = FMADD(w0, FSET(x[r * K + k]), even[r]);
    }
    for (long r = 0; r < N; r++) out[r] = FADD(even[r], odd[r]);
}

/* Rows r0 .. r0 + R of panel p's outputs (``out``: one vector of PANEL lanes a row) into y (rows ldy apart), + bias,
 * or added to y when `accumulate` (a residual connection). */
static void store_rows(const fvec *out, long R, long r0, long p, long O, long ldy, const float *bias, float *y,
                       int accumulate) {
    long width = O - p * PANEL < PANEL ? O - p * PANEL : PANEL;
    for (long r = 0; r < R; r++) {
        float lanes[PANEL];
        FSTORE(lanes, out[r]);
        float *yr = y + (r0 + r) * ldy + p * PANEL;
        for (long o = 0; o < width; o++) {
            float v = lanes[o] + (bias ? bias[p * PANEL + o] : 0.0f);
            yr[o] = accumulate ? yr[o] + v : v;
        }
    }
}

/* y (M, O; rows ldy apart) = rows W^T + bias, or y += that when `accumulate`, for fp16 weights (kind 16, half_rows). */
static void half_run(const qdot_linear *L, const qdot_rows *rows, long M, float *y, long ldy, int accumulate) {
    long K = L->K, O = L->O, P = (O + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static)
    for (long p = 0; p < P; p++) {
        const uint16_t *wp = (const uint16_t *)L->w + p * K * PANEL;
        for (long r0 = 0; r0 < M; r0 += HROWS) {
            long R = M - r0 < HROWS ? M - r0 : HROWS;
            fvec out[HROWS];
            const float *x = rows->xf + r0 * K;
            switch (R) { /* a constant row count: the accumulators stay in registers */
            case 1: half_rows(1, x, K, wp, out); break;
            case 2: half_rows(2, x, K, wp, out); break;
            case 3: half_rows(3, x, K, wp, out); break;
            default: half_rows(HROWS, x, K, wp, out); break;
            }
            store_rows(out, R, r0, p, O, ldy, L->bias, y, accumulate);
        }
    }
}

/* One part of a linear layer (its own O outputs) into y's columns 0 .. O (rows ldy apart). */
static void part_run(const qdot_linear *L, const qdot_rows *rows, long M, float *y, long ldy, int accumulate) {
    if (L->kind == 16) {
        half_run(L, rows, M, y, ldy, accumulate);
        return;
    }
    int kind = L->kind, half = L->half;
    long G = L->K / GROUP, O = L->O, P = (O + PANEL - 1) / PANEL;
    long scale_bytes = half ? 2 : 4;
    long panel_bytes = G * GROUP * PANEL * (kind == 4 ? 4 : kind == 6 ? 6 : kind == 7 ? 5 : 8) / 8; /* bits a weight */
    /* bytes of a panel's scales and offsets: a scale per half group (kind 6); two codes a group and two fp16 numbers
     * a super-block (half 2) */
    long d_bytes = half == 2 ? G * 2 * PANEL : G * PANEL * scale_bytes * (kind == 6 ? 2 : 1);
    long m_bytes = half == 2 ? G / 8 * (kind == 6 ? 1 : 2) * PANEL * 2 : G * PANEL * scale_bytes;
#pragma omp parallel for schedule(static)
    for (long p = 0; p < P; p++) {
        const uint8_t *wp = (const uint8_t *)L->w + p * panel_bytes;
        const char *dp = (const char *)L->d + p * d_bytes;
        const char *mp = L->m ? (const char *)L->m + p * m_bytes : NULL;
        for (long r0 = 0; r0 < M; r0 += RMAX) {
            long R = M - r0 < RMAX ? M - r0 : RMAX;
            fvec out[RMAX];
            const int32_t *xr = rows->xq + r0 * G * (GROUP / 2);
            const float *dx = rows->dx + r0 * G, *sx = rows->sx + r0 * G;
            const int32_t *x32 = rows->x32 + r0 * G * 2;
            /* Prefetch during the first pass over the panel only (later passes read it from L1/L2). */
            const uint8_t *next = r0 == 0 && p + 2 < P ? wp + 2 * panel_bytes : NULL;
            if (kind == 4 && half == 2) {
                switch (R) { ROWS(panel_rows(4, 2, N, xr, dx, sx, x32, G, wp, dp, mp, next, out)) }
            } else if (kind == 4 && half) {
                switch (R) { ROWS(panel_rows(4, 1, N, xr, dx, sx, x32, G, wp, dp, mp, next, out)) }
            } else if (kind == 4) {
                switch (R) { ROWS(panel_rows(4, 0, N, xr, dx, sx, x32, G, wp, dp, mp, next, out)) }
            } else if (kind == 6 && half == 2) {
                switch (R) { ROWS(panel_rows(6, 2, N, xr, dx, sx, x32, G, wp, dp, mp, next, out)) }
            } else if (kind == 6) {
                switch (R) { ROWS(panel_rows(6, 0, N, xr, dx, sx, x32, G, wp, dp, mp, next, out)) }
            } else if (kind == 7 && half) {
                switch (R) { ROWS(panel_rows(7, 1, N, xr, dx, sx, x32, G, wp, dp, mp, next, out)) }
            } else if (kind == 7) {
                switch (R) { ROWS(panel_rows(7, 0, N, xr, dx, sx, x32, G, wp, dp, mp, next, out)) }
            } else if (kind == 5) { /* fp32 scales and offsets (Q5_K's d * sc, dmin * m) */
                switch (R) { ROWS(panel_rows(5, 0, N, xr, dx, sx, x32, G, wp, dp, mp, next, out)) }
            } else if (half) {
                switch (R) { ROWS(panel_rows(8, 1, N, xr, dx, sx, x32, G, wp, dp, mp, next, out)) }
            } else {
                switch (R) { ROWS(panel_rows(8, 0, N, xr, dx, sx, x32, G, wp, dp, mp, next, out)) }
            }
            store_rows(out, R, r0, p, O, ldy, L->bias, y, accumulate);
        }
    }
}

long qdot_width(const qdot_linear *L) { return L->O + (L->rest ? qdot_width(L->rest) : 0); }

int qdot_takes_float(const qdot_linear *L) { return L->kind == 16 || (L->rest && qdot_takes_float(L->rest)); }

/* y (M, qdot_width(L)) = rows W^T + bias, or y += that when `accumulate` (a residual connection): each part into its
 * own columns. */
void qdot_run(const qdot_linear *L, const qdot_rows *rows, long M, float *y, int accumulate) {
    long width = qdot_width(L);
    for (long col = 0; L; col += L->O, L = L->rest) part_run(L, rows, M, y + col, width, accumulate);
}

/* x (M, K) fp32 contiguous, y (M, O) fp32, w in panels as above (P = ceil(O / PANEL)), d and m fp16 when `half`
 * (else fp32), bias (O) or NULL. */
void dartspec_qdot(int kind, int half, const float *x, long M, long K, const void *w, const void *d, const void *m,
                   const float *bias, float *y, long O) {
    qdot_linear L = {kind, half, K, O, w, d, m, bias, NULL};
    qdot_rows rows;
    qdot_rows_alloc(&rows, M, K, kind == 16);
    qdot_prepare(QDOT_PLAIN, x, M, K, K, NULL, 0.0f, &rows);
    qdot_run(&L, &rows, M, y, 0);
    qdot_rows_free(&rows);
}

/* torch.argmax's choice in one row of n values: the first largest, a NaN counting as the largest (its first). One
 * vectorized pass for the maximum, then blocks of 16 compared at once until the first that holds it. */
static long row_argmax(const float *v, long n) {
    float best = -INFINITY;
    int nan = 0;
#pragma omp simd reduction(max : best) reduction(| : nan)
    for (long i = 0; i < n; i++) {
        best = v[i] > best ? v[i] : best;
        nan |= v[i] != v[i];
    }
    for (long i = 0; i < n; i += 16) {
        long end = i + 16 < n ? i + 16 : n;
        int hit = 0;
#pragma omp simd reduction(| : hit)
        for (long j = i; j < end; j++) hit |= nan ? v[j] != v[j] : v[j] == best;
        if (hit)
            for (long j = i; j < end; j++)
                if (nan ? v[j] != v[j] : v[j] == best) return j;
    }
    return 0;
}

/* A model's LM head on M rows x (M, L's K): y (M, qdot_width(L)) = norm(x) W^T (+ bias), norm the RMSNorm of weight
 * `norm` (eps) or none (NULL); with `log_softmax`, each row of y then its log-softmax (a drafter's log-probabilities);
 * where argmax is not NULL, each row's argmax (torch.argmax's choice) from y while it is still in cache. One call
 * instead of torch operations after the GEMM: right after a forward's weight stream each small torch operation runs
 * on cold caches (~65 us for an argmax of SmolLM2's 49,152 logits on a 2-core VM, a composite norm more). */
void dartspec_logits(const qdot_linear *L, const float *x, long M, const float *norm, float eps, float *y,
                     int64_t *argmax, int log_softmax) {
    qdot_rows rows;
    long width = qdot_width(L);
    qdot_rows_alloc(&rows, M, L->K, qdot_takes_float(L));
    qdot_prepare(norm ? QDOT_RMSNORM : QDOT_PLAIN, x, M, L->K, L->K, norm, eps, &rows);
    qdot_run(L, &rows, M, y, 0);
    qdot_rows_free(&rows);
    for (long r = 0; r < M && log_softmax; r++) {
        float *yr = y + r * width, top = -INFINITY;
#pragma omp simd reduction(max : top)
        for (long i = 0; i < width; i++) top = yr[i] > top ? yr[i] : top;
        double sum = 0.0;
#pragma omp simd reduction(+ : sum)
        for (long i = 0; i < width; i++) sum += exp_nonpositive(yr[i] - top);
        float lse = top + (float)log(sum);
#pragma omp simd
        for (long i = 0; i < width; i++) yr[i] -= lse;
    }
    for (long r = 0; r < M && argmax; r++) argmax[r] = row_argmax(y + r * width, width);
}
