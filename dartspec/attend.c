/* One decode-time attention block of the lean runtime in one call (dartspec/lean.py, fp32 on CPU).
 *
 * For a handful of new tokens (one, or a draft tree) the arithmetic of attention is tiny; what costs is the
 * dozen small torch operations around it per layer (slices, per-head norms, the rotary multiply, two cache
 * writes, transposes, the attention call): ~100 us a layer on these CPUs, a third of a decode step. This
 * function does them in one pass over the fused QKV output:
 *
 *   1. per new row: optional per-head RMSNorm of q and k (Qwen3), rotary rotation of adjacent pairs
 *      (the lean runtime's q/k row order), keys and values written to the cache at base + row;
 *   2. per new row and query head: scores against every allowed cached position (mask (q, base + q) bytes,
 *      or NULL: causal), a max-subtracted softmax, the weighted sum of values.
 *
 * Each row is computed the same way whatever the other rows are, so a tree verification computes what
 * one-token decoding computes.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "qdot.h"
#include "vmath.h"

#define KEYS 16  /* keys per score block: one 512-bit vector of fp32 scores */
#define QUERIES 4 /* queries scored together against a block of keys */
#define LANES 16 /* partial sums of the softmax and value sums: one 512-bit vector */

/* A cache of fp16 numbers (dartspec_kv.half): each is widened to fp32 as it is read, and every new key and value
 * rounded to the nearest fp16 (ties to even, as torch's .half()) as it is written; the arithmetic is the same fp32
 * arithmetic as over an fp32 cache holding those numbers. Without F16C (never on the CPUs with AVX2) the compiler's
 * _Float16 converts. */
static inline float h2f(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    _Float16 f;
    memcpy(&f, &h, 2);
    return (float)f;
#endif
}

static inline uint16_t f2h(float x) {
#if defined(__F16C__)
    return _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT);
#else
    _Float16 f = (_Float16)x;
    uint16_t h;
    memcpy(&h, &f, 2);
    return h;
#endif
}

/* Number i of a cache buffer (fp32, or fp16 where half). */
static inline float ld1(const void *p, long i, int half) {
    return half ? h2f(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void st1(void *p, long i, float x, int half) {
    if (half)
        ((uint16_t *)p)[i] = f2h(x);
    else
        ((float *)p)[i] = x;
}

#if defined(__AVX512F__)
/* Numbers i .. i + 16 of a cache buffer as fp32. */
static inline __m512 ld16(const void *p, long i, int half) {
    if (half) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)));
    return _mm512_loadu_ps((const float *)p + i);
}

static inline void st16(void *p, long i, __m512 x, int half) {
    if (half)
        _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
    else
        _mm512_storeu_ps((float *)p + i, x);
}
#endif

#if !defined(__AVX512F__)
/* Numbers i .. i + 8 of a cache buffer as fp32 (value_acc's AVX2 path). */
static inline __m256 ld8(const void *p, long i, int half) {
#if defined(__F16C__)
    if (half) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
#endif
    if (half) {
        float t[8];
        for (int l = 0; l < 8; l++) t[l] = ld1(p, i + l, 1);
        return _mm256_loadu_ps(t);
    }
    return _mm256_loadu_ps((const float *)p + i);
}
#endif

/* Numbers i .. i + LANES of a cache buffer as fp32: where they are (fp32), else widened into buf. */
static inline const float *lanes(const void *p, long i, int half, float *buf) {
    if (!half) return (const float *)p + i;
#if defined(__AVX512F__) && LANES == 16
    _mm512_storeu_ps(buf, ld16(p, i, 1));
#else
    for (long l = 0; l < LANES; l++) buf[l] = ld1(p, i + l, 1);
#endif
    return buf;
}

/* Row ``slot`` of kv head g of one of the own buffers (k, v or kt: (KV, cap, D) numbers). */
static inline void *own_row(void *own, const dartspec_kv *kv, long g, long slot, long D) {
    return (char *)own + (g * kv->cap + slot) * D * (kv->half ? 2 : 4);
}

/* Key or value row of position j of kv head g: a shared page below npre, else the sequence's own buffer. (Pages
 * hold a power of two of positions: a shift and a mask, not a division per row.) */
static inline const void *kv_row(const void *own, const void *const *pages, const dartspec_kv *kv, long g, long j,
                                 long D) {
    if (j < kv->npre) {
        long shift = __builtin_ctzl((unsigned long)kv->page);
        return (const char *)pages[j >> shift] + ((g << shift) + (j & (kv->page - 1))) * D * (kv->half ? 2 : 4);
    }
    return own_row((void *)own, kv, g, j - kv->npre, D);
}

static void rms_norm_head(float *x, const float *w, long D, float eps) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (long d = 0; d < D; d++) s += x[d] * x[d];
    float r = 1.0f / sqrtf(s / (float)D + eps);
    for (long d = 0; d < D; d++) x[d] = x[d] * r * w[d];
}

static void rotate(float *x, const float *rot, long D) {
    for (long j = 0; j < D / 2; j++) {
        float a = x[2 * j], b = x[2 * j + 1], c = rot[2 * j], s = rot[2 * j + 1];
        x[2 * j] = a * c - b * s;
        x[2 * j + 1] = a * s + b * c;
    }
}

/* acc[u][j] = sum over d, in order, of x[u][d] * kt[d][j] for QUERIES queries and a block of KEYS transposed keys:
 * QUERIES independent FMA chains sharing each load of a key row. */
static void score_block(const float *const *x, const void *kt, int half, long D, float acc[QUERIES][KEYS]) {
#if defined(__AVX512F__) && KEYS == 16 && QUERIES == 4
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (long d = 0; d < D; d++) {
        __m512 k = ld16(kt, d * KEYS, half);
        a0 = _mm512_fmadd_ps(_mm512_set1_ps(x[0][d]), k, a0);
        a1 = _mm512_fmadd_ps(_mm512_set1_ps(x[1][d]), k, a1);
        a2 = _mm512_fmadd_ps(_mm512_set1_ps(x[2][d]), k, a2);
        a3 = _mm512_fmadd_ps(_mm512_set1_ps(x[3][d]), k, a3);
    }
    _mm512_storeu_ps(acc[0], a0);
    _mm512_storeu_ps(acc[1], a1);
    _mm512_storeu_ps(acc[2], a2);
    _mm512_storeu_ps(acc[3], a3);
#else
    /* fp32 keys only (score_queries widens fp16 ones first): a conversion inside the loop below kept gcc from
     * vectorizing it (an AVX2 build's verify forward took 1.11-1.18x the time after 1,500 positions) */
    const float *k = (const float *)kt;
    (void)half;
    for (long u = 0; u < QUERIES; u++)
        for (long jj = 0; jj < KEYS; jj++) acc[u][jj] = 0.0f;
    for (long d = 0; d < D; d++)
        for (long u = 0; u < QUERIES; u++) {
            float xd = x[u][d];
#pragma omp simd
            for (long jj = 0; jj < KEYS; jj++) acc[u][jj] += xd * k[d * KEYS + jj];
        }
#endif
}

#if defined(__AVX512F__) && KEYS == 16
/* score_block for 8 queries: 8 independent FMA chains, enough to keep both FMA units busy through their 4-cycle
 * latency (4 chains left half of them idle in a prefill chunk's 64 rows x 3 queries a kv head). Each score is the
 * same sum over d in the same order as score_block's, so which block a query falls in changes no bit. */
static void score_block8(const float *const *x, const void *kt, int half, long D, float acc[8][KEYS]) {
    __m512 a[8];
    for (int u = 0; u < 8; u++) a[u] = _mm512_setzero_ps();
    for (long d = 0; d < D; d++) {
        __m512 k = ld16(kt, d * KEYS, half);
        for (int u = 0; u < 8; u++) a[u] = _mm512_fmadd_ps(_mm512_set1_ps(x[u][d]), k, a[u]);
    }
    for (int u = 0; u < 8; u++) _mm512_storeu_ps(acc[u], a[u]);
}
#endif

/* Weighted sums of value rows, resumable: ``acc`` ((4, D) floats, zeroed first) takes list entries k0 .. k1 of a row's
 * list, in order, and value_out turns it into the output. A list may be taken in pieces whose every cut is a multiple
 * of 4: the arithmetic is that of one pass over the whole list, bit for bit, so the shared prefix of many sequences
 * can be summed for all of them at once (each value row read once) and each sequence's own part after it. */
static void value_acc(const dartspec_kv *kv, long g, const long *pos, const float *w, long k0, long k1, long D,
                      float *acc) {
    int half = (int)kv->half;
#if defined(__AVX512F__)
    if (D == 64) { /* each position's whole row at once (4 vectors); even and odd positions in 8 FMA chains */
        __m512 e0 = _mm512_loadu_ps(acc), e1 = _mm512_loadu_ps(acc + 16), e2 = _mm512_loadu_ps(acc + 32),
               e3 = _mm512_loadu_ps(acc + 48), o0 = _mm512_loadu_ps(acc + 64), o1 = _mm512_loadu_ps(acc + 80),
               o2 = _mm512_loadu_ps(acc + 96), o3 = _mm512_loadu_ps(acc + 112);
        long k = k0;
        for (; k + 2 <= k1; k += 2) {
            const void *a = kv_row(kv->v, kv->vpages, kv, g, pos[k], D);
            const void *b = kv_row(kv->v, kv->vpages, kv, g, pos[k + 1], D);
            __m512 wa = _mm512_set1_ps(w[k]), wb = _mm512_set1_ps(w[k + 1]);
            e0 = _mm512_fmadd_ps(wa, ld16(a, 0, half), e0);
            e1 = _mm512_fmadd_ps(wa, ld16(a, 16, half), e1);
            e2 = _mm512_fmadd_ps(wa, ld16(a, 32, half), e2);
            e3 = _mm512_fmadd_ps(wa, ld16(a, 48, half), e3);
            o0 = _mm512_fmadd_ps(wb, ld16(b, 0, half), o0);
            o1 = _mm512_fmadd_ps(wb, ld16(b, 16, half), o1);
            o2 = _mm512_fmadd_ps(wb, ld16(b, 32, half), o2);
            o3 = _mm512_fmadd_ps(wb, ld16(b, 48, half), o3);
        }
        if (k < k1) {
            const void *a = kv_row(kv->v, kv->vpages, kv, g, pos[k], D);
            __m512 wa = _mm512_set1_ps(w[k]);
            e0 = _mm512_fmadd_ps(wa, ld16(a, 0, half), e0);
            e1 = _mm512_fmadd_ps(wa, ld16(a, 16, half), e1);
            e2 = _mm512_fmadd_ps(wa, ld16(a, 32, half), e2);
            e3 = _mm512_fmadd_ps(wa, ld16(a, 48, half), e3);
        }
        _mm512_storeu_ps(acc, e0);
        _mm512_storeu_ps(acc + 16, e1);
        _mm512_storeu_ps(acc + 32, e2);
        _mm512_storeu_ps(acc + 48, e3);
        _mm512_storeu_ps(acc + 64, o0);
        _mm512_storeu_ps(acc + 80, o1);
        _mm512_storeu_ps(acc + 96, o2);
        _mm512_storeu_ps(acc + 112, o3);
        return;
    }
#endif
    long d0 = 0; /* LANES dimensions at a time, four partial sums over the list (independent FMA chains) */
#if !defined(__AVX512F__) && LANES == 16
    /* AVX2: the same sums with the 8 partial-sum vectors of a block held in registers (the loop below keeps them in
     * memory: a load and a store per FMA; perf put it at the top of a 4-row verify step's attention on a Zen 3) */
    for (; d0 + LANES <= D; d0 += LANES) {
        __m256 s[4][2];
        for (int u = 0; u < 4; u++)
            for (int h = 0; h < 2; h++) s[u][h] = _mm256_loadu_ps(acc + u * D + d0 + 8 * h);
        long kk = k0;
        for (; kk + 4 <= k1; kk += 4)
            for (int u = 0; u < 4; u++) {
                const void *v = kv_row(kv->v, kv->vpages, kv, g, pos[kk + u], D);
                __m256 wk = _mm256_set1_ps(w[kk + u]);
                s[u][0] = _mm256_fmadd_ps(wk, ld8(v, d0, half), s[u][0]);
                s[u][1] = _mm256_fmadd_ps(wk, ld8(v, d0 + 8, half), s[u][1]);
            }
        for (; kk < k1; kk++) {
            const void *v = kv_row(kv->v, kv->vpages, kv, g, pos[kk], D);
            __m256 wk = _mm256_set1_ps(w[kk]);
            s[0][0] = _mm256_fmadd_ps(wk, ld8(v, d0, half), s[0][0]);
            s[0][1] = _mm256_fmadd_ps(wk, ld8(v, d0 + 8, half), s[0][1]);
        }
        for (int u = 0; u < 4; u++)
            for (int h = 0; h < 2; h++) _mm256_storeu_ps(acc + u * D + d0 + 8 * h, s[u][h]);
    }
#endif
    float buf[LANES];
    for (; d0 + LANES <= D; d0 += LANES) {
        long kk = k0;
        for (; kk + 4 <= k1; kk += 4)
            for (int u = 0; u < 4; u++) {
                const float *v = lanes(kv_row(kv->v, kv->vpages, kv, g, pos[kk + u], D), d0, half, buf);
                float wk = w[kk + u], *a = acc + u * D + d0;
#pragma omp simd
                for (long l = 0; l < LANES; l++) a[l] += wk * v[l];
            }
        for (; kk < k1; kk++) {
            const float *v = lanes(kv_row(kv->v, kv->vpages, kv, g, pos[kk], D), d0, half, buf);
            float wk = w[kk], *a = acc + d0;
#pragma omp simd
            for (long l = 0; l < LANES; l++) a[l] += wk * v[l];
        }
    }
    for (long d = d0; d < D; d++) /* a head size that is no multiple of LANES: the rest in order */
        for (long kk = k0; kk < k1; kk++) acc[d] += w[kk] * ld1(kv_row(kv->v, kv->vpages, kv, g, pos[kk], D), d, half);
}

/* value_acc for nq (1-3) queries that share one list (the heads of a kv group in one row): each value row is read,
 * widened and addressed once for all of them, and each query's sums are the same chains in the same order as
 * value_acc's (even and odd entries apart), so the result is the same bit for bit. In a 2,048-token prefill the value
 * sums were the largest part of attention (perf: 20% of the prefill), each row read once per head. */
static inline __attribute__((always_inline)) void value_acc_heads(const dartspec_kv *kv, long g, const long *pos,
                                                                  const float *const *w, int nq, long k0, long k1,
                                                                  long D, float *const *acc) {
#if defined(__AVX512F__)
    if (D == 64) {
        int half = (int)kv->half;
        __m512 e[3][4], o[3][4];
        for (int u = 0; u < nq; u++)
            for (int c = 0; c < 4; c++) {
                e[u][c] = _mm512_loadu_ps(acc[u] + 16 * c);
                o[u][c] = _mm512_loadu_ps(acc[u] + 64 + 16 * c);
            }
        long k = k0;
        for (; k + 2 <= k1; k += 2) {
            const void *a = kv_row(kv->v, kv->vpages, kv, g, pos[k], D);
            const void *b = kv_row(kv->v, kv->vpages, kv, g, pos[k + 1], D);
            __m512 va[4], vb[4];
            for (int c = 0; c < 4; c++) va[c] = ld16(a, 16 * c, half), vb[c] = ld16(b, 16 * c, half);
            for (int u = 0; u < nq; u++) {
                __m512 wa = _mm512_set1_ps(w[u][k]), wb = _mm512_set1_ps(w[u][k + 1]);
                for (int c = 0; c < 4; c++) {
                    e[u][c] = _mm512_fmadd_ps(wa, va[c], e[u][c]);
                    o[u][c] = _mm512_fmadd_ps(wb, vb[c], o[u][c]);
                }
            }
        }
        if (k < k1) {
            const void *a = kv_row(kv->v, kv->vpages, kv, g, pos[k], D);
            __m512 va[4];
            for (int c = 0; c < 4; c++) va[c] = ld16(a, 16 * c, half);
            for (int u = 0; u < nq; u++) {
                __m512 wa = _mm512_set1_ps(w[u][k]);
                for (int c = 0; c < 4; c++) e[u][c] = _mm512_fmadd_ps(wa, va[c], e[u][c]);
            }
        }
        for (int u = 0; u < nq; u++)
            for (int c = 0; c < 4; c++) {
                _mm512_storeu_ps(acc[u] + 16 * c, e[u][c]);
                _mm512_storeu_ps(acc[u] + 64 + 16 * c, o[u][c]);
            }
        return;
    }
#endif
#if !defined(__AVX512F__) && LANES == 16
    if (nq > 1 && D % LANES == 0) {
        /* AVX2: value_acc's chains (4 per dimension, the list's tail in the first) for all nq heads at once, 8
         * dimensions at a time so that 4 chains of 3 heads stay in 12 of the 16 registers: each value row is read
         * and widened (vcvtph2ps, one a cycle on a Zen 3: over an fp16 cache three heads' conversions outweighed their
         * FMAs) once for the group. Lanes are independent, so the sums are value_acc's bit for bit. */
        int half = (int)kv->half;
        for (long d0 = 0; d0 < D; d0 += 8) {
            __m256 s[3][4];
            for (int u = 0; u < nq; u++)
                for (int c = 0; c < 4; c++) s[u][c] = _mm256_loadu_ps(acc[u] + c * D + d0);
            long k = k0;
            for (; k + 4 <= k1; k += 4)
                for (int c = 0; c < 4; c++) {
                    __m256 v = ld8(kv_row(kv->v, kv->vpages, kv, g, pos[k + c], D), d0, half);
                    for (int u = 0; u < nq; u++) s[u][c] = _mm256_fmadd_ps(_mm256_set1_ps(w[u][k + c]), v, s[u][c]);
                }
            for (; k < k1; k++) {
                __m256 v = ld8(kv_row(kv->v, kv->vpages, kv, g, pos[k], D), d0, half);
                for (int u = 0; u < nq; u++) s[u][0] = _mm256_fmadd_ps(_mm256_set1_ps(w[u][k]), v, s[u][0]);
            }
            for (int u = 0; u < nq; u++)
                for (int c = 0; c < 4; c++) _mm256_storeu_ps(acc[u] + c * D + d0, s[u][c]);
        }
        return;
    }
#endif
    for (int u = 0; u < nq; u++) value_acc(kv, g, pos, w[u], k0, k1, D, acc[u]);
}

static void value_out(const float *acc, long D, float *o) {
#if defined(__AVX512F__)
    if (D == 64) {
        for (long d = 0; d < 64; d += 16)
            _mm512_storeu_ps(o + d, _mm512_add_ps(_mm512_loadu_ps(acc + d), _mm512_loadu_ps(acc + 64 + d)));
        return;
    }
#endif
    long d0 = 0;
    for (; d0 + LANES <= D; d0 += LANES)
#pragma omp simd
        for (long l = 0; l < LANES; l++)
            o[d0 + l] = (acc[d0 + l] + acc[D + d0 + l]) + (acc[2 * D + d0 + l] + acc[3 * D + d0 + l]);
    for (long d = d0; d < D; d++) o[d] = acc[d];
}

/* One sequence's attention in phases (so that many sequences can share the phases' reads of a common prefix). */
typedef struct {
    long q, H, KV, D, total;
    const dartspec_kv *kv;
    float scale;
    float *qs;      /* (q, H, D) rotated (and normed) queries */
    float *scores;  /* (q H, total) by position; then the softmax weights, by list index */
    long *seen;     /* (q, total) each row's visible positions, in order */
    long *count;    /* (q) */
    long *run;      /* (q) each list's leading entries 0, 1, 2, ... (before its first hidden position) */
    float *acc;     /* (q H, 4, D) value sums */
} attention;

/* Rotate the queries, write the new keys and values to the cache, list each row's visible positions. */
static void att_prepare(attention *a, const float *qkv, long q, long H, long KV, long D, const float *rot,
                        const dartspec_kv *kv, long base, const uint8_t *mask, const float *q_norm,
                        const float *k_norm, float eps, float scale) {
    long width = (H + 2 * KV) * D, total = base + q, slot0 = base - kv->npre; /* new rows' own slots */
    a->q = q, a->H = H, a->KV = KV, a->D = D, a->total = total, a->kv = kv, a->scale = scale;
    a->qs = (float *)malloc(sizeof(float) * q * H * D);
    a->scores = (float *)malloc(sizeof(float) * q * H * total);
    a->seen = (long *)malloc(sizeof(long) * q * total);
    a->count = (long *)malloc(sizeof(long) * 2 * q);
    a->run = a->count + q;
    a->acc = (float *)calloc((size_t)q * H * 4 * D, sizeof(float));
    for (long i = 0; i < q; i++) {
        const float *row = qkv + i * width;
        const float *r = rot + i * D;
        for (long h = 0; h < H; h++) {
            float *x = a->qs + (i * H + h) * D;
            memcpy(x, row + h * D, sizeof(float) * D);
            if (q_norm) rms_norm_head(x, q_norm, D, eps);
            rotate(x, r, D);
        }
        for (long h = 0; h < KV; h++) {
            float k[D];
            memcpy(k, row + (H + h) * D, sizeof(float) * D);
            if (k_norm) rms_norm_head(k, k_norm, D, eps);
            rotate(k, r, D);
            void *kr = own_row(kv->k, kv, h, slot0 + i, D), *vr = own_row(kv->v, kv, h, slot0 + i, D);
            const float *v = row + (H + KV + h) * D;
            if (kv->half) {
                for (long d = 0; d < D; d++) st1(kr, d, k[d], 1), st1(vr, d, v[d], 1);
            } else {
                memcpy(kr, k, sizeof(float) * D);
                memcpy(vr, v, sizeof(float) * D);
            }
        }
    }
    for (long i = 0; i < q; i++) { /* row i's visible positions, in order */
        long n = 0, run = -1;
        for (long j = 0; j < (mask ? total : base + i + 1); j++)
            if (!mask || mask[i * total + j])
                a->seen[i * total + n++] = j;
            else if (run < 0)
                run = n;
        a->count[i] = n;
        a->run[i] = run < 0 ? n : run;
    }
}

static void att_free(attention *a) {
    free(a->qs);
    free(a->scores);
    free(a->seen);
    free(a->count);
    free(a->acc);
}

#if defined(__AVX512F__) && KEYS == 16
/* A 16 x 16 block of floats transposed in registers (unpacks within 128-bit lanes, then lane shuffles). */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
        __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    }
}
#endif

/* kt (D, KEYS) = keys j0 .. j0 + n of kv head g, transposed (zeros past n). Only data moves: the scores computed from
 * it are the same whichever way it is built. */
static void transpose_keys(const dartspec_kv *kv, long g, long j0, long n, long D, void *kt) {
    int half = (int)kv->half; /* kt holds the cache's kind of numbers */
#if defined(__AVX512F__) && KEYS == 16
    if (D % 16 == 0) { /* 16 x 16 blocks in registers: a quarter of the scalar moves' time on a 64-wide head */
        const void *rows[16];
        for (long jj = 0; jj < 16; jj++) rows[jj] = jj < n ? kv_row(kv->k, kv->kpages, kv, g, j0 + jj, D) : NULL;
        for (long d0 = 0; d0 < D; d0 += 16) {
            __m512 r[16];
            for (long jj = 0; jj < 16; jj++) r[jj] = rows[jj] ? ld16(rows[jj], d0, half) : _mm512_setzero_ps();
            transpose16(r);
            for (long d = 0; d < 16; d++) st16(kt, (d0 + d) * KEYS, r[d], half);
        }
        return;
    }
#endif
    for (long jj = 0; jj < KEYS; jj++) {
        const void *key = jj < n ? kv_row(kv->k, kv->kpages, kv, g, j0 + jj, D) : NULL;
        if (!half) { /* (plain moves: no conversion's branch in the loop) */
            float *t = (float *)kt;
            for (long d = 0; d < D; d++) t[d * KEYS + jj] = key ? ((const float *)key)[d] : 0.0f;
        } else {
            for (long d = 0; d < D; d++) st1(kt, d * KEYS + jj, key ? ld1(key, d, 1) : 0.0f, 1);
        }
    }
}

/* Scores of nq queries (x[u], each D floats) against one transposed block of n keys, into srow[u][0 .. n):
 * QUERIES at a time, one load of each key row serving all of them. Each score is its own sum over d in order,
 * whatever the grouping, so a query's scores do not depend on which other queries share the block. */
static void score_queries(const float *const *x, float *const *srow, long nq, const void *kt, int half, long n,
                          long D, float scale) {
#if !(defined(__AVX512F__) && KEYS == 16 && QUERIES == 4)
    float wide[half ? D * KEYS : 1]; /* score_block's loop reads fp32: an fp16 block is widened once for all */
    if (half) {
        long i = 0;
#if defined(__F16C__)
        for (; i + 8 <= D * KEYS; i += 8)
            _mm256_storeu_ps(wide + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)kt + i))));
#endif
        for (; i < D * KEYS; i++) wide[i] = ld1(kt, i, 1);
        kt = wide, half = 0;
    }
#endif
    long u0 = 0;
#if defined(__AVX512F__) && KEYS == 16
    for (; u0 + 8 <= nq; u0 += 8) {
        float acc[8][KEYS];
        score_block8(x + u0, kt, half, D, acc);
        for (long u = 0; u < 8; u++)
            for (long jj = 0; jj < n; jj++) srow[u0 + u][jj] = acc[u][jj] * scale;
    }
#endif
    for (; u0 < nq; u0 += QUERIES) {
        const float *xs[QUERIES];
        for (long u = 0; u < QUERIES; u++) xs[u] = x[u0 + u < nq ? u0 + u : nq - 1]; /* past the end: repeat */
        float acc[QUERIES][KEYS];
        score_block(xs, kt, half, D, acc);
        for (long u = 0; u < QUERIES && u0 + u < nq; u++)
            for (long jj = 0; jj < n; jj++) srow[u0 + u][jj] = acc[u][jj] * scale;
    }
}

/* The queries of kv head g of sequences a[0 .. m) (rows x heads of the group): pointers to them and to their score
 * rows at key j0. Returns their number. */
static long group_queries(attention *const *a, long m, long g, long j0, const float **x, float **srow) {
    long nq = 0;
    for (long s = 0; s < m; s++) {
        long group = a[s]->H / a[s]->KV;
        for (long i = 0; i < a[s]->q; i++)
            for (long h = g * group; h < (g + 1) * group; h++) {
                long t = i * a[s]->H + h;
                x[nq] = a[s]->qs + t * a[s]->D;
                srow[nq++] = a[s]->scores + t * a[s]->total + j0;
            }
    }
    return nq;
}

/* Scores of key block b of kv head g for the queries of sequences a[0 .. m), which all see the same keys there
 * (one sequence, or sequences sharing the pages of a prefix): the block is read and transposed once for all. */
static void score_key_block(attention *const *a, long m, long g, long b, void *kt, const float **x, float **srow) {
    const attention *first = a[0];
    const dartspec_kv *kv = first->kv;
    long j0 = b * KEYS, n = first->total - j0 < KEYS ? first->total - j0 : KEYS, slot = j0 - kv->npre;
    if (kv->kt && slot >= 0 && j0 + KEYS <= first->total - first->q) {
        /* A block of committed positions in the own buffers: its keys never change again, so they are transposed
         * once into the cache's transposed copy and read from there at every later step (transposing them at every
         * step made a verify forward of 1-2 rows ~4% slower, after 256 positions and after 1,500). Only data moves:
         * the same scores. */
        void *block = own_row(kv->kt, kv, g, slot, first->D);
        /* The next block's (most often this thread's next task): past a few hundred positions the copy comes from
         * DRAM, and a verify forward of 1-4 rows after 800-1,500 positions took 0.93-0.97x the time with this. */
        if (j0 + 2 * KEYS <= first->total - first->q)
            for (long c = 0, bytes = KEYS * first->D * (kv->half ? 2 : 4); c < bytes; c += 64)
                __builtin_prefetch((const char *)block + bytes + c);
        if (slot + KEYS > kv->kt_valid) transpose_keys(kv, g, j0, KEYS, first->D, block);
        kt = block;
    } else {
        transpose_keys(kv, g, j0, n, first->D, kt);
    }
    long nq = group_queries(a, m, g, j0, x, srow);
    score_queries(x, srow, nq, kt, (int)kv->half, n, first->D, first->scale);
}

/* Softmax weights of query t (row t / H, head t % H) over its row's visible positions, into its score row by list
 * index: e = exp(score - max) summed in LANES interleaved partial sums, then scaled by the sum's inverse. A tree row's
 * list equals the list of the same token decoded alone (the cached prefix, then its ancestors in depth order), and so
 * do its scores: any fixed arithmetic over the list computes what decoding computes, bit for bit. (Summing by cache
 * slot would not: tree slots differ from sequential ones.) ``e`` is scratch of ``total`` floats. */
static void softmax_weights(attention *a, long t, float *e) {
    long i = t / a->H, n = a->count[i];
    const long *pos = a->seen + i * a->total;
    float *p = a->scores + t * a->total;
    /* The row's scores in list order first (its list starts with a run of positions 0, 1, ...: one copy), so that the
     * maximum and exp vectorize: read through the list, gcc left both scalar (a gather by 64-bit indices). */
    long run = a->run[i];
    memcpy(e, p, sizeof(float) * run);
    for (long k = run; k < n; k++) e[k] = p[pos[k]];
    float best = -INFINITY;
#pragma omp simd reduction(max : best)
    for (long k = 0; k < n; k++) best = e[k] > best ? e[k] : best;
#pragma omp simd
    for (long k = 0; k < n; k++) e[k] = exp_nonpositive(e[k] - best);
    float part[LANES] = {0};
    long k = 0;
    for (; k + LANES <= n; k += LANES)
#pragma omp simd
        for (long l = 0; l < LANES; l++) part[l] += e[k + l];
    for (; k < n; k++) part[k % LANES] += e[k];
    for (long w = LANES / 2; w > 0; w /= 2)
        for (long l = 0; l < w; l++) part[l] += part[l + w];
    float inv = 1.0f / part[0];
#pragma omp simd
    for (long k2 = 0; k2 < n; k2++) p[k2] = e[k2] * inv; /* the weights, once (not per dimension block) */
}

/* Heads h0 .. h1 of row i (all in kv group g): their value sums over their list entries k0 .. (the rest of the list),
 * written to out. Up to 3 heads share each read of a value row (value_acc_heads). */
static void finish_heads(attention *a, long i, long g, long h0, long h1, long k0, float *out) {
    long D = a->D;
    const long *pos = a->seen + i * a->total;
    int nq = (int)(h1 - h0);
    const float *w[3];
    float *acc[3];
    for (int u = 0; u < nq; u++) {
        long t = i * a->H + h0 + u;
        w[u] = a->scores + t * a->total;
        acc[u] = a->acc + t * 4 * D;
    }
    if (nq == 3)
        value_acc_heads(a->kv, g, pos, w, 3, k0, a->count[i], D, acc);
    else if (nq == 2)
        value_acc_heads(a->kv, g, pos, w, 2, k0, a->count[i], D, acc);
    else
        value_acc_heads(a->kv, g, pos, w, 1, k0, a->count[i], D, acc);
    for (int u = 0; u < nq; u++) value_out(acc[u], D, out + (i * a->H + h0 + u) * D);
}

/* Head c of a kv group of ``group`` heads cut into chunks of at most 3, as even as can be (4 heads: 2 and 2). */
static long chunk_start(long group, long c) {
    long chunks = (group + 2) / 3;
    return c * (group / chunks) + (c < group % chunks ? c : group % chunks);
}

/* Value sums over the shared positions 0 .. common of the queries of kv head g of sequences a[0 .. m), in tiles of
 * a page: each value row is read from memory once for all of them (and from cache for each query of the tile). */
static void shared_values(attention *const *a, long m, long g, long common) {
    long D = a[0]->D;
    for (long k0 = 0; k0 < common; k0 += KEYS)
        for (long s = 0; s < m; s++) {
            long group = a[s]->H / a[s]->KV;
            for (long i = 0; i < a[s]->q; i++)
                for (long h = g * group; h < (g + 1) * group; h++) {
                    long t = i * a[s]->H + h;
                    value_acc(a[s]->kv, g, a[s]->seen + i * a[s]->total, a[s]->scores + t * a[s]->total, k0,
                              k0 + KEYS, D, a[s]->acc + t * 4 * D);
                }
        }
}

/* qkv (q, (H + 2 KV) D); rot (q, D/2, 2) cos/sin of each row's position; kc, vc (KV, cap, D) cache buffers
 * holding base positions (fp16 numbers where half, else fp32); mask (q, base + q) or NULL; q_norm / k_norm (D) or NULL; out (q, H D). */
void dartspec_attend(const float *qkv, long q, long H, long KV, long D, const float *rot, void *kc, void *vc,
                     long cap, long half, long base, const uint8_t *mask, const float *q_norm, const float *k_norm,
                     float eps, float scale, float *out) {
    dartspec_kv kv = {kc, vc, cap, NULL, NULL, 0, 1, NULL, 0, half};
    long starts[2] = {0, q};
    dartspec_attend_seqs(qkv, H, KV, D, rot, 1, starts, &kv, &base, &mask, q_norm, k_norm, eps, scale, out, 0);
}

/* Many sequences' attention blocks in one call: sequence s owns rows starts[s] .. starts[s + 1] of qkv, rot and out,
 * its cache is kv[s] with base[s] positions filled, its mask (rows, base + rows) or NULL (causal). One sequence
 * spreads over the threads; several spread over the threads by sequence. With ``share``, sequences whose caches
 * start with the same shared pages (the prefix cache) attend to those pages together (FlashForge's shared-prefix
 * attention): each key block of the common prefix is read and transposed once for all their queries, and each value
 * row summed once for all of them. Every score, weight and sum is computed as for the sequence alone (same order),
 * so the result is the same bit for bit; only the memory reads are shared. */
void dartspec_attend_seqs(const float *qkv, long H, long KV, long D, const float *rot, long nseq, const long *starts,
                          const dartspec_kv *kv, const long *base, const uint8_t *const *mask, const float *q_norm,
                          const float *k_norm, float eps, float scale, float *out, int share) {
    long width = (H + 2 * KV) * D, half = D / 2;
    attention *att = (attention *)malloc(sizeof(attention) * nseq);
    attention **ptrs = (attention **)malloc(sizeof(attention *) * nseq);
    long *leader = (long *)malloc(sizeof(long) * nseq), *common = (long *)calloc(nseq, sizeof(long));
    long most_q = 0, most_total = 0;
    for (long s = 0; s < nseq; s++) {
        long n = starts[s + 1] - starts[s];
        most_q = n > most_q ? n : most_q;
        most_total = base[s] + n > most_total ? base[s] + n : most_total;
        ptrs[s] = &att[s];
    }
    /* Groups: sequences whose first shared page is the same; a group shares the pages all its members have in common
     * (whole pages, so a multiple of KEYS). A sequence alone in its group shares nothing. */
    for (long s = 0; s < nseq; s++) {
        leader[s] = s;
        if (!share || kv[s].npre == 0) continue;
        for (long r = 0; r < s; r++)
            if (kv[r].npre && kv[r].page == kv[s].page && kv[r].kpages[0] == kv[s].kpages[0]) {
                leader[s] = leader[r];
                break;
            }
    }
    for (long s = 0; s < nseq; s++) {
        long l = leader[s];
        if (l == s) continue;
        long run = common[l] ? common[l] : kv[l].npre, p = 0; /* whole pages equal in both */
        run = run < kv[s].npre ? run : kv[s].npre;
        while (p * kv[s].page < run && kv[s].kpages[p] == kv[l].kpages[p] && kv[s].vpages[p] == kv[l].vpages[p]) p++;
        common[l] = p * kv[s].page < run ? p * kv[s].page : run;
    }
    /* Members of each group, in order (the leader first). */
    long *order = (long *)malloc(sizeof(long) * nseq), *first = (long *)malloc(sizeof(long) * (nseq + 1));
    long ngroups = 0, placed = 0;
    for (long s = 0; s < nseq; s++) {
        if (leader[s] != s || common[s] == 0) continue;
        first[ngroups++] = placed;
        for (long r = s; r < nseq; r++)
            if (leader[r] == s) order[placed++] = r;
    }
    first[ngroups] = placed;
    long *shared = (long *)calloc(nseq, sizeof(long)); /* positions each sequence attends to with its group */
    for (long gi = 0; gi < ngroups; gi++)
        for (long u = first[gi]; u < first[gi + 1]; u++) shared[order[u]] = common[order[first[gi]]];
    attention **members = (attention **)malloc(sizeof(attention *) * (placed > 0 ? placed : 1));
    for (long u = 0; u < placed; u++) members[u] = &att[order[u]];
    /* Work lists, so that one sequence spreads over the threads as well as many: (group, kv head, block) of the shared
     * key blocks; (sequence, kv head, block) of the own ones; (sequence, query) of the weights and sums. */
    long blocks = most_total / KEYS + 1, joint = 0, own = 0, queries = 0;
    long *joint_task = (long *)malloc(sizeof(long) * 3 * (ngroups * KV * blocks + 1));
    long *own_task = (long *)malloc(sizeof(long) * 3 * (nseq * KV * blocks + 1));
    long *query_task = (long *)malloc(sizeof(long) * 2 * (nseq * most_q * H + 1));
    long group = H / KV, chunks = (group + 2) / 3, heads = 0;
    long *head_task = (long *)malloc(sizeof(long) * 4 * (nseq * most_q * KV * chunks + 1)); /* (s, i, h0, h1) */
    for (long gi = 0; gi < ngroups; gi++)
        for (long g = 0; g < KV; g++)
            for (long b = 0; b < common[order[first[gi]]] / KEYS; b++, joint++)
                joint_task[3 * joint] = gi, joint_task[3 * joint + 1] = g, joint_task[3 * joint + 2] = b;
    for (long s = 0; s < nseq; s++) {
        long total = base[s] + starts[s + 1] - starts[s];
        for (long g = 0; g < KV; g++)
            for (long b = shared[s] / KEYS; b * KEYS < total; b++, own++)
                own_task[3 * own] = s, own_task[3 * own + 1] = g, own_task[3 * own + 2] = b;
        for (long t = 0; t < (starts[s + 1] - starts[s]) * H; t++, queries++)
            query_task[2 * queries] = s, query_task[2 * queries + 1] = t;
        for (long i = 0; i < starts[s + 1] - starts[s]; i++)
            for (long g = 0; g < KV; g++)
                for (long c = 0; c < chunks; c++, heads++) {
                    long *task = head_task + 4 * heads;
                    task[0] = s, task[1] = i, task[2] = g * group + chunk_start(group, c);
                    task[3] = g * group + chunk_start(group, c + 1);
                }
    }

    /* One sequence: its preparation is short and serial, its work lists spread over the threads. (Loops left empty
     * are skipped, not run: every worksharing loop ends in a barrier, a few microseconds each on a decode step.) */
    if (nseq == 1)
        att_prepare(&att[0], qkv, starts[1], H, KV, D, rot, &kv[0], base[0], mask[0], q_norm, k_norm, eps, scale);
#pragma omp parallel
    {
        float *kt = (float *)malloc(sizeof(float) * D * KEYS);
        float *e = (float *)malloc(sizeof(float) * most_total);
        long most_queries = nseq * most_q * (H / KV);
        const float **x = (const float **)malloc(sizeof(float *) * most_queries);
        float **srow = (float **)malloc(sizeof(float *) * most_queries);
        if (nseq > 1) {
#pragma omp for schedule(dynamic, 1)
            for (long s = 0; s < nseq; s++)
                att_prepare(&att[s], qkv + starts[s] * width, starts[s + 1] - starts[s], H, KV, D,
                            rot + starts[s] * half * 2, &kv[s], base[s], mask[s], q_norm, k_norm, eps, scale);
        }
        if (joint) {
#pragma omp for schedule(dynamic, 1)
            for (long k = 0; k < joint; k++) {
                long gi = joint_task[3 * k];
                score_key_block(members + first[gi], first[gi + 1] - first[gi], joint_task[3 * k + 1],
                                joint_task[3 * k + 2], kt, x, srow);
            }
        }
#pragma omp for schedule(static)
        for (long k = 0; k < own; k++)
            score_key_block(&ptrs[own_task[3 * k]], 1, own_task[3 * k + 1], own_task[3 * k + 2], kt, x, srow);
        if (ngroups) {
#pragma omp for schedule(static)
            for (long k = 0; k < queries; k++) softmax_weights(&att[query_task[2 * k]], query_task[2 * k + 1], e);
#pragma omp for schedule(dynamic, 1) collapse(2)
            for (long gi = 0; gi < ngroups; gi++)
                for (long g = 0; g < KV; g++)
                    shared_values(members + first[gi], first[gi + 1] - first[gi], g, common[order[first[gi]]]);
#pragma omp for schedule(static)
            for (long k = 0; k < heads; k++) {
                const long *task = head_task + 4 * k;
                long s = task[0];
                finish_heads(&att[s], task[1], task[2] / group, task[2], task[3], shared[s], out + starts[s] * H * D);
            }
        } else {
#pragma omp for schedule(static)
            for (long k = 0; k < heads; k++) {
                const long *task = head_task + 4 * k;
                long s = task[0];
                for (long h = task[2]; h < task[3]; h++) softmax_weights(&att[s], task[1] * H + h, e);
                finish_heads(&att[s], task[1], task[2] / group, task[2], task[3], 0, out + starts[s] * H * D);
            }
        }
        free(kt);
        free(e);
        free(x);
        free(srow);
    }
    for (long s = 0; s < nseq; s++) att_free(&att[s]);
    free(att), free(ptrs), free(leader), free(common), free(order), free(first), free(shared), free(members);
    free(joint_task), free(own_task), free(query_task), free(head_task);
}

/* Rows own + nodes[i] of each head of one (1, heads, cap, row_bytes) buffer moved to own + i. nodes ascend and
 * nodes[i] >= i, so a row is read before any write reaches it. */
static void keep_rows(char *buf, long heads, long cap, long row_bytes, long own, const int64_t *nodes, long n) {
    for (long h = 0; h < heads; h++) {
        char *rows = buf + (h * cap + own) * row_bytes;
        for (long i = 0; i < n; i++)
            if (nodes[i] != i) memmove(rows + i * row_bytes, rows + nodes[i] * row_bytes, (size_t)row_bytes);
    }
}

/* A verify's accepted path kept in every layer's own cache buffers in one call (dartspec/kv_cache.py
 * TreeKVCache.keep): keys[l] and values[l] address layer l's (1, heads, caps[l], d) buffers, rows of key_bytes and
 * value_bytes. In torch this was four operations a layer, ~0.1 ms a step for SmolLM2's 30 layers on a CPU. */
void dartspec_kv_keep(const int64_t *keys, const int64_t *values, const int64_t *caps, long layers, long heads,
                      long key_bytes, long value_bytes, long own, const int64_t *nodes, long n) {
    for (long l = 0; l < layers; l++) {
        keep_rows((char *)(intptr_t)keys[l], heads, caps[l], key_bytes, own, nodes, n);
        keep_rows((char *)(intptr_t)values[l], heads, caps[l], value_bytes, own, nodes, n);
    }
}
