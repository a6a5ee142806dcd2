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
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define KEYS 16 /* keys per score block: one 512-bit vector of fp32 scores */

/* exp(x) for x <= 0 (softmax after subtracting the maximum), vectorizable: x = n ln2 + r with |r| <= ln2 / 2,
 * exp(r) by its degree-6 minimax polynomial (Cephes' expf coefficients, ~1 ulp), 2^n through the exponent
 * bits. libm's expf is a scalar call per score: a third of the attention time of a 16-node tree. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = nearbyintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
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

/* qkv (q, (H + 2 KV) D); rot (q, D/2, 2) cos/sin of each row's position; kc, vc (KV, cap, D) cache buffers
 * holding base positions; mask (q, base + q) or NULL; q_norm / k_norm (D) or NULL; out (q, H D). */
void dartspec_attend(const float *qkv, long q, long H, long KV, long D, const float *rot, float *kc, float *vc,
                     long cap, long base, const uint8_t *mask, const float *q_norm, const float *k_norm, float eps,
                     float scale, float *out) {
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
            float *k = kc + (h * cap + base + i) * D;
            memcpy(k, row + (H + h) * D, sizeof(float) * D);
            if (k_norm) rms_norm_head(k, k_norm, D, eps);
            rotate(k, r, D);
            memcpy(vc + (h * cap + base + i) * D, row + (H + KV + h) * D, sizeof(float) * D);
        }
    }
    long group = H / KV, blocks = (total + KEYS - 1) / KEYS;
    float *scores = (float *)malloc(sizeof(float) * q * H * total);
#pragma omp parallel
    {
        /* Scores: each block of KEYS keys is transposed once and every query of its kv head is multiplied
         * against it (one broadcast and one KEYS-wide FMA per dimension, no horizontal sums). */
        float *kt = (float *)malloc(sizeof(float) * D * KEYS);
#pragma omp for schedule(static)
        for (long gb = 0; gb < KV * blocks; gb++) {
            long g = gb / blocks, j0 = (gb % blocks) * KEYS, n = total - j0 < KEYS ? total - j0 : KEYS;
            const float *keys = kc + (g * cap + j0) * D;
            for (long jj = 0; jj < KEYS; jj++)
                for (long d = 0; d < D; d++) kt[d * KEYS + jj] = jj < n ? keys[jj * D + d] : 0.0f;
            for (long i = 0; i < q; i++)
                for (long h = g * group; h < (g + 1) * group; h++) {
                    const float *x = qs + (i * H + h) * D;
                    float acc[KEYS] = {0};
                    for (long d = 0; d < D; d++) {
                        float xd = x[d];
#pragma omp simd
                        for (long jj = 0; jj < KEYS; jj++) acc[jj] += xd * kt[d * KEYS + jj];
                    }
                    float *srow = scores + (i * H + h) * total + j0;
                    for (long jj = 0; jj < n; jj++) srow[jj] = acc[jj] * scale;
                }
        }
        free(kt);
        /* Softmax over the visible positions and the weighted sum of values, per query row and head. */
#pragma omp for schedule(static)
        for (long t = 0; t < q * H; t++) {
            long i = t / H, h = t % H, g = h / group;
            float *p = scores + t * total;
            const float *values = vc + g * cap * D;
            const uint8_t *allowed = mask ? mask + i * total : NULL;
            long visible = mask ? total : base + i + 1;
            float best = -INFINITY;
            for (long j = 0; j < visible; j++) {
                if (allowed && !allowed[j]) p[j] = -INFINITY;
                if (p[j] > best) best = p[j];
            }
#pragma omp simd
            for (long j = 0; j < visible; j++) p[j] = p[j] == -INFINITY ? 0.0f : exp_nonpositive(p[j] - best);
            /* In order, one position at a time: a tree row's masked slots add exact zeros between its ancestors,
             * so it sums what the same row decoded alone sums, bit for bit (a vectorized sum would give each
             * position the lane of its cache slot, and tree slots differ from sequential ones). */
            float sum = 0.0f;
            for (long j = 0; j < visible; j++) sum += p[j];
            float *o = out + i * H * D + h * D, inv = 1.0f / sum;
            for (long d = 0; d < D; d++) o[d] = 0.0f;
            for (long j = 0; j < visible; j++) {
                if (p[j] == 0.0f) continue;
                const float *v = values + j * D;
                float w = p[j] * inv;
#pragma omp simd
                for (long d = 0; d < D; d++) o[d] += w * v[d];
            }
        }
    }
    free(scores);
    free(qs);
}
