/* Small vectorizable math shared by the C kernels (attend.c, qdot.c). */
#ifndef DARTSPEC_VMATH_H
#define DARTSPEC_VMATH_H
#include <math.h>
#include <stdint.h>
#include <string.h>

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

/* x * sigmoid(x) through exp(-|x|) (never overflows), vectorizable like exp_nonpositive. */
static inline float silu(float x) {
    float e = exp_nonpositive(x < 0.0f ? x : -x);
    return x >= 0.0f ? x / (1.0f + e) : x * e / (1.0f + e);
}

/* 1 / sqrt(mean(x^2) + eps) of n values, the sum of squares in double (SmolLM2's outlier channels reach the
 * thousands): RMSNorm's factor, before the GEMM that quantizes a normed row (qdot.c) and after a branch whose output
 * is normed (block.c). */
static inline float rms_inverse(const float *x, long n, float eps) {
    double ss = 0.0;
#pragma omp simd reduction(+ : ss)
    for (long k = 0; k < n; k++) ss += (double)x[k] * x[k];
    return (float)(1.0 / sqrt(ss / (double)n + eps));
}

/* GELU, tanh form (Gemma's gelu_pytorch_tanh): 0.5 x (1 + tanh(u)), u = sqrt(2 / pi) (x + 0.044715 x^3), tanh(|u|)
 * = (1 - e) / (1 + e) with e = exp(-2 |u|) (never overflows), vectorizable like exp_nonpositive. */
static inline float gelu_tanh(float x) {
    float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    float e = exp_nonpositive(-2.0f * fabsf(u));
    float t = (1.0f - e) / (1.0f + e);
    return 0.5f * x * (1.0f + (u >= 0.0f ? t : -t));
}
#endif
