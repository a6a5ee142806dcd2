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

/* Key or value row of position j of kv head g: a shared page below npre, else the sequence's own buffer. */
static inline const float *kv_row(const float *own, const float *const *pages, const dartspec_kv *kv, long g, long j,
                                  long D) {
    if (j < kv->npre) return pages[j / kv->page] + (g * kv->page + j % kv->page) * D;
    return own + (g * kv->cap + j - kv->npre) * D;
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
static void score_block(const float *const *x, const float *kt, long D, float acc[QUERIES][KEYS]) {
#if defined(__AVX512F__) && KEYS == 16 && QUERIES == 4
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (long d = 0; d < D; d++) {
        __m512 k = _mm512_loadu_ps(kt + d * KEYS);
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
    for (long u = 0; u < QUERIES; u++)
        for (long jj = 0; jj < KEYS; jj++) acc[u][jj] = 0.0f;
    for (long d = 0; d < D; d++)
        for (long u = 0; u < QUERIES; u++) {
            float xd = x[u][d];
#pragma omp simd
            for (long jj = 0; jj < KEYS; jj++) acc[u][jj] += xd * kt[d * KEYS + jj];
        }
#endif
}

#if defined(__AVX512F__)
/* o (64) = sum over the list of w[k] * values[pos[k]] (kv head g): for each position its whole row at once (4
 * vectors), even and odd positions in separate accumulators (8 independent FMA chains), added at the end. */
static void value_sum_64(const dartspec_kv *kv, long g, const long *pos, const float *w, long n, long D, float *o) {
    __m512 e0 = _mm512_setzero_ps(), e1 = e0, e2 = e0, e3 = e0, o0 = e0, o1 = e0, o2 = e0, o3 = e0;
    long k = 0;
    for (; k + 2 <= n; k += 2) {
        const float *a = kv_row(kv->v, kv->vpages, kv, g, pos[k], D);
        const float *b = kv_row(kv->v, kv->vpages, kv, g, pos[k + 1], D);
        __m512 wa = _mm512_set1_ps(w[k]), wb = _mm512_set1_ps(w[k + 1]);
        e0 = _mm512_fmadd_ps(wa, _mm512_loadu_ps(a), e0);
        e1 = _mm512_fmadd_ps(wa, _mm512_loadu_ps(a + 16), e1);
        e2 = _mm512_fmadd_ps(wa, _mm512_loadu_ps(a + 32), e2);
        e3 = _mm512_fmadd_ps(wa, _mm512_loadu_ps(a + 48), e3);
        o0 = _mm512_fmadd_ps(wb, _mm512_loadu_ps(b), o0);
        o1 = _mm512_fmadd_ps(wb, _mm512_loadu_ps(b + 16), o1);
        o2 = _mm512_fmadd_ps(wb, _mm512_loadu_ps(b + 32), o2);
        o3 = _mm512_fmadd_ps(wb, _mm512_loadu_ps(b + 48), o3);
    }
    if (k < n) {
        const float *a = kv_row(kv->v, kv->vpages, kv, g, pos[k], D);
        __m512 wa = _mm512_set1_ps(w[k]);
        e0 = _mm512_fmadd_ps(wa, _mm512_loadu_ps(a), e0);
        e1 = _mm512_fmadd_ps(wa, _mm512_loadu_ps(a + 16), e1);
        e2 = _mm512_fmadd_ps(wa, _mm512_loadu_ps(a + 32), e2);
        e3 = _mm512_fmadd_ps(wa, _mm512_loadu_ps(a + 48), e3);
    }
    _mm512_storeu_ps(o, _mm512_add_ps(e0, o0));
    _mm512_storeu_ps(o + 16, _mm512_add_ps(e1, o1));
    _mm512_storeu_ps(o + 32, _mm512_add_ps(e2, o2));
    _mm512_storeu_ps(o + 48, _mm512_add_ps(e3, o3));
}
#endif

/* qkv (q, (H + 2 KV) D); rot (q, D/2, 2) cos/sin of each row's position; kc, vc (KV, cap, D) cache buffers
 * holding base positions; mask (q, base + q) or NULL; q_norm / k_norm (D) or NULL; out (q, H D). */
void dartspec_attend(const float *qkv, long q, long H, long KV, long D, const float *rot, float *kc, float *vc,
                     long cap, long base, const uint8_t *mask, const float *q_norm, const float *k_norm, float eps,
                     float scale, float *out) {
    dartspec_kv kv = {kc, vc, cap, NULL, NULL, 0, 1};
    dartspec_attend_team(qkv, q, H, KV, D, rot, &kv, base, mask, q_norm, k_norm, eps, scale, out, 1);
}

/* As dartspec_attend on a cache that may start with shared pages (``kv``); ``threaded`` 0 runs it on the calling
 * thread alone (a caller that spreads many sequences' attention over the threads). The arithmetic is the same
 * either way, and the same whether a position's row is in a shared page or the sequence's own buffer. */
void dartspec_attend_team(const float *qkv, long q, long H, long KV, long D, const float *rot, const dartspec_kv *kv,
                          long base, const uint8_t *mask, const float *q_norm, const float *k_norm, float eps,
                          float scale, float *out, int threaded) {
    float *kc = kv->k, *vc = kv->v;
    long cap = kv->cap, slot0 = base - kv->npre; /* the new rows' slots in the own buffers */
    long width = (H + 2 * KV) * D, total = base + q;
    float *qs = (float *)malloc(sizeof(float) * q * H * D);
    for (long i = 0; i < q; i++) {
        const float *row = qkv + i * width;
        const float *r = rot + i * D;
        for (long h = 0; h < H; h++) {
            float *x = qs + (i * H + h) * D;
            memcpy(x, row + h * D, sizeof(float) * D);
            if (q_norm) rms_norm_head(x, q_norm, D, eps);
            rotate(x, r, D);
        }
        for (long h = 0; h < KV; h++) {
            float *k = kc + (h * cap + slot0 + i) * D;
            memcpy(k, row + (H + h) * D, sizeof(float) * D);
            if (k_norm) rms_norm_head(k, k_norm, D, eps);
            rotate(k, r, D);
            memcpy(vc + (h * cap + slot0 + i) * D, row + (H + KV + h) * D, sizeof(float) * D);
        }
    }
    long group = H / KV, blocks = (total + KEYS - 1) / KEYS;
    float *scores = (float *)malloc(sizeof(float) * q * H * total);
    long *seen = (long *)malloc(sizeof(long) * q * total), *count = (long *)malloc(sizeof(long) * q);
    for (long i = 0; i < q; i++) { /* row i's visible positions, in order */
        long n = 0;
        for (long j = 0; j < (mask ? total : base + i + 1); j++)
            if (!mask || mask[i * total + j]) seen[i * total + n++] = j;
        count[i] = n;
    }
#pragma omp parallel if (threaded)
    {
        /* Scores: each block of KEYS keys is transposed once and every query of its kv head is multiplied
         * against it (one broadcast and one KEYS-wide FMA per dimension, no horizontal sums). */
        float *kt = (float *)malloc(sizeof(float) * D * KEYS);
#pragma omp for schedule(static)
        for (long gb = 0; gb < KV * blocks; gb++) {
            long g = gb / blocks, j0 = (gb % blocks) * KEYS, n = total - j0 < KEYS ? total - j0 : KEYS;
            for (long jj = 0; jj < KEYS; jj++) {
                const float *key = jj < n ? kv_row(kc, kv->kpages, kv, g, j0 + jj, D) : NULL;
                for (long d = 0; d < D; d++) kt[d * KEYS + jj] = key ? key[d] : 0.0f;
            }
            /* The queries of this kv head QUERIES at a time: one load of each key row serves all of them, and
             * their sums are independent FMA chains (one query alone waits on its own chain over D). Each score is
             * still its own sum over d in order, whatever the grouping. */
            long nq = q * group;
            for (long u0 = 0; u0 < nq; u0 += QUERIES) {
                const float *x[QUERIES];
                float *srow[QUERIES];
                for (long u = 0; u < QUERIES; u++) { /* past the last query, repeat it (computed, not stored) */
                    long at = u0 + u < nq ? u0 + u : nq - 1, i = at / group, h = g * group + at % group;
                    x[u] = qs + (i * H + h) * D;
                    srow[u] = u0 + u < nq ? scores + (i * H + h) * total + j0 : NULL;
                }
                float acc[QUERIES][KEYS];
                score_block(x, kt, D, acc);
                for (long u = 0; u < QUERIES; u++)
                    if (srow[u])
                        for (long jj = 0; jj < n; jj++) srow[u][jj] = acc[u][jj] * scale;
            }
        }
        free(kt);
        /* Softmax over the visible positions and the weighted sum of values, per query row and head, over the
         * row's visible positions listed in order. A tree row's list equals the list of the same token decoded
         * alone (the cached prefix, then its ancestors in depth order), and so do its scores: any fixed
         * arithmetic over the list, such as sums in LANES interleaved partial sums, computes what decoding
         * computes, bit for bit. (Summing by cache slot would not: tree slots differ from sequential ones.) */
        float *e = (float *)malloc(sizeof(float) * total);
#pragma omp for schedule(static)
        for (long t = 0; t < q * H; t++) {
            long i = t / H, h = t % H, g = h / group, n = count[i];
            const long *pos = seen + i * total;
            const float *p = scores + t * total;
            float best = -INFINITY;
            for (long k = 0; k < n; k++) best = p[pos[k]] > best ? p[pos[k]] : best;
#pragma omp simd
            for (long k = 0; k < n; k++) e[k] = exp_nonpositive(p[pos[k]] - best);
            float part[LANES] = {0};
            long k = 0;
            for (; k + LANES <= n; k += LANES)
#pragma omp simd
                for (long l = 0; l < LANES; l++) part[l] += e[k + l];
            for (; k < n; k++) part[k % LANES] += e[k];
            for (long w = LANES / 2; w > 0; w /= 2)
                for (long l = 0; l < w; l++) part[l] += part[l + w];
            float inv = 1.0f / part[0], *o = out + i * H * D + h * D;
#pragma omp simd
            for (long k = 0; k < n; k++) e[k] *= inv; /* the weights, once (not per dimension block) */
            /* Values: a weighted sum over the list; a fixed-order scheme per head size, so deterministic per list. */
#if defined(__AVX512F__)
            if (D == 64) {
                value_sum_64(kv, g, pos, e, n, D, o);
                continue;
            }
#endif
            long d0 = 0; /* LANES dimensions at a time, four partial sums over the list (independent FMA chains) */
            for (; d0 + LANES <= D; d0 += LANES) {
                float a[4][LANES] = {{0}};
                long kk = 0;
                for (; kk + 4 <= n; kk += 4)
                    for (int u = 0; u < 4; u++) {
                        const float *v = kv_row(vc, kv->vpages, kv, g, pos[kk + u], D) + d0;
                        float w = e[kk + u];
#pragma omp simd
                        for (long l = 0; l < LANES; l++) a[u][l] += w * v[l];
                    }
                for (; kk < n; kk++) {
                    const float *v = kv_row(vc, kv->vpages, kv, g, pos[kk], D) + d0;
                    float w = e[kk];
#pragma omp simd
                    for (long l = 0; l < LANES; l++) a[0][l] += w * v[l];
                }
#pragma omp simd
                for (long l = 0; l < LANES; l++) o[d0 + l] = (a[0][l] + a[1][l]) + (a[2][l] + a[3][l]);
            }
            for (long d = d0; d < D; d++) { /* a head size that is no multiple of LANES: the rest in order */
                float acc = 0.0f;
                for (long kk = 0; kk < n; kk++) acc += e[kk] * kv_row(vc, kv->vpages, kv, g, pos[kk], D)[d];
                o[d] = acc;
            }
        }
        free(e);
    }
    free(seen);
    free(count);
    free(scores);
    free(qs);
}
