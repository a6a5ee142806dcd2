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
 * (q in 0..15); 8-bit groups: 16 chunks of int8 q[2c + e]. Scales d and offsets m are (P, G, PANEL) fp32.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define GROUP 32

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define PANEL 16
#define RMAX 8
typedef __m512i ivec;
typedef __m512 fvec;
#define IZERO() _mm512_setzero_si512()
#define FZERO() _mm512_setzero_ps()
#define WIDEN_U8(p) _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(p)))
#define WIDEN_I8(p) _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(p)))
#define LOW4(v) _mm512_and_si512(v, _mm512_set1_epi16(0x0F))
#define HIGH4(v) _mm512_srli_epi16(v, 4)
#define BCAST(p) _mm512_set1_epi32(*(p))
#ifdef __AVX512VNNI__
#define DOT(acc, w, x) acc = _mm512_dpwssd_epi32(acc, w, x)
#else
#define DOT(acc, w, x) acc = _mm512_add_epi32(acc, _mm512_madd_epi16(w, x))
#endif
#define FLOAD(p) _mm512_loadu_ps(p)
#define FSET(v) _mm512_set1_ps(v)
#define FMADD(a, b, c) _mm512_fmadd_ps(a, b, c)
#define FMUL(a, b) _mm512_mul_ps(a, b)
#define TOFLOAT(v) _mm512_cvtepi32_ps(v)
#define FSTORE(p, v) _mm512_storeu_ps(p, v)
#else
#define PANEL 8
#define RMAX 4
typedef __m256i ivec;
typedef __m256 fvec;
#define IZERO() _mm256_setzero_si256()
#define FZERO() _mm256_setzero_ps()
#define WIDEN_U8(p) _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(p)))
#define WIDEN_I8(p) _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p)))
#define LOW4(v) _mm256_and_si256(v, _mm256_set1_epi16(0x0F))
#define HIGH4(v) _mm256_srli_epi16(v, 4)
#define BCAST(p) _mm256_set1_epi32(*(p))
#ifdef __AVXVNNI__
#define DOT(acc, w, x) acc = _mm256_dpwssd_avx_epi32(acc, w, x)
#else
#define DOT(acc, w, x) acc = _mm256_add_epi32(acc, _mm256_madd_epi16(w, x))
#endif
#define FLOAD(p) _mm256_loadu_ps(p)
#define FSET(v) _mm256_set1_ps(v)
#define FMADD(a, b, c) _mm256_fmadd_ps(a, b, c)
#define FMUL(a, b) _mm256_mul_ps(a, b)
#define TOFLOAT(v) _mm256_cvtepi32_ps(v)
#define FSTORE(p, v) _mm256_storeu_ps(p, v)
#endif

#define CHUNK (2 * PANEL)

int dartspec_qdot_panel(void) { return PANEL; }

/* Per row and group: xq (16 int16 pairs read as int32), dx, and the exact fp32 sum of the group. */
static void quantize_rows(const float *x, long M, long K, int32_t *xq, float *dx, float *sx) {
    long G = K / GROUP;
    for (long r = 0; r < M; r++)
        for (long g = 0; g < G; g++) {
            const float *p = x + r * K + g * GROUP;
            float amax = 0.0f, s = 0.0f;
            for (int j = 0; j < GROUP; j++) {
                amax = fmaxf(amax, fabsf(p[j]));
                s += p[j];
            }
            float d = amax / 32767.0f, inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
            int16_t *q = (int16_t *)(xq + (r * G + g) * (GROUP / 2));
            for (int j = 0; j < GROUP; j++) {
                float v = nearbyintf(p[j] * inv);
                q[j] = (int16_t)(v > 32767.0f ? 32767.0f : (v < -32767.0f ? -32767.0f : v));
            }
            dx[r * G + g] = d;
            sx[r * G + g] = s;
        }
}

/* N rows (a constant at every call site, so the accumulators stay in registers) against one panel. */
static inline __attribute__((always_inline)) void panel_rows(int kind, long N, const int32_t *xq, const float *dx,
                                                             const float *sx, long G, const uint8_t *w,
                                                             const float *d, const float *m, fvec *out) {
    fvec acc[RMAX];
    for (long r = 0; r < N; r++) acc[r] = FZERO();
    for (long g = 0; g < G; g++) {
        ivec s[RMAX];
        for (long r = 0; r < N; r++) s[r] = IZERO();
        if (kind == 4) {
            const uint8_t *wg = w + g * 8 * CHUNK;
            for (int c = 0; c < 8; c++) {
                ivec v = WIDEN_U8(wg + c * CHUNK), lo = LOW4(v), hi = HIGH4(v);
                for (long r = 0; r < N; r++) {
                    const int32_t *xr = xq + (r * G + g) * (GROUP / 2);
                    DOT(s[r], lo, BCAST(xr + c));
                    DOT(s[r], hi, BCAST(xr + c + 8));
                }
            }
        } else {
            const uint8_t *wg = w + g * 16 * CHUNK;
            for (int c = 0; c < 16; c++) {
                ivec v = WIDEN_I8(wg + c * CHUNK);
                for (long r = 0; r < N; r++) DOT(s[r], v, BCAST(xq + (r * G + g) * (GROUP / 2) + c));
            }
        }
        fvec dv = FLOAD(d + g * PANEL);
        for (long r = 0; r < N; r++) acc[r] = FMADD(TOFLOAT(s[r]), FMUL(dv, FSET(dx[r * G + g])), acc[r]);
        if (kind == 4) {
            fvec mv = FLOAD(m + g * PANEL);
            for (long r = 0; r < N; r++) acc[r] = FMADD(mv, FSET(sx[r * G + g]), acc[r]);
        }
    }
    for (long r = 0; r < N; r++) out[r] = acc[r];
}

#include "rows.h"

/* x (M, K) fp32 contiguous, y (M, O) fp32, w in panels as above (P = ceil(O / PANEL)), bias (O) or NULL. */
void dartspec_qdot(int kind, const float *x, long M, long K, const void *w, const float *d, const float *m,
                   const float *bias, float *y, long O) {
    long G = K / GROUP, P = (O + PANEL - 1) / PANEL;
    int32_t *xq = (int32_t *)malloc(sizeof(int32_t) * M * G * (GROUP / 2));
    float *dx = (float *)malloc(sizeof(float) * M * G), *sx = (float *)malloc(sizeof(float) * M * G);
    quantize_rows(x, M, K, xq, dx, sx);
    long panel_bytes = G * GROUP * PANEL / (kind == 4 ? 2 : 1);
#pragma omp parallel for schedule(static)
    for (long p = 0; p < P; p++) {
        const uint8_t *wp = (const uint8_t *)w + p * panel_bytes;
        const float *dp = d + p * G * PANEL, *mp = m ? m + p * G * PANEL : NULL;
        long width = O - p * PANEL < PANEL ? O - p * PANEL : PANEL;
        for (long r0 = 0; r0 < M; r0 += RMAX) {
            long R = M - r0 < RMAX ? M - r0 : RMAX;
            fvec out[RMAX];
            const int32_t *xr = xq + r0 * G * (GROUP / 2);
            if (kind == 4) {
                switch (R) { ROWS(panel_rows(4, N, xr, dx + r0 * G, sx + r0 * G, G, wp, dp, mp, out)) }
            } else {
                switch (R) { ROWS(panel_rows(8, N, xr, dx + r0 * G, sx + r0 * G, G, wp, dp, mp, out)) }
            }
            for (long r = 0; r < R; r++) {
                float lanes[PANEL];
                FSTORE(lanes, out[r]);
                float *yr = y + (r0 + r) * O + p * PANEL;
                for (long o = 0; o < width; o++) yr[o] = lanes[o] + (bias ? bias[p * PANEL + o] : 0.0f);
            }
        }
    }
    free(xq);
    free(dx);
    free(sx);
}
