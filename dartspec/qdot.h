/* The integer-dot GEMM of the exact-a16 format (qdot.c) as building blocks for fused code (block.c). */
#ifndef DARTSPEC_QDOT_H
#define DARTSPEC_QDOT_H
#include <stdint.h>

/* One linear layer in panels (dartspec/exact.py ExactWeight with panel > 0). Field order is the ctypes
 * Structure in exact.py. A fused projection whose parts are groups of different kinds (a Q4_K_M file's q and k beside
 * a Q6_K v) is a chain: this part's O outputs, then `rest`'s, each in its own panels. */
typedef struct qdot_linear {
    int kind; /* 4: d*q+m nibbles, 8: d*q int8, 5: d*q+m uint8, 6: int8 with a d per 16, 16: fp16 (no d, m) */
    int half; /* d and m in fp16 (1), fp32 (0), or a K-quant weight's codes and super-block numbers (2, qdot.c) */
    long K, O;
    const void *w;
    const void *d, *m;  /* m NULL for kinds 8 and 6 (but 6 with half 2: its super-block numbers) */
    const float *bias;  /* NULL when none */
    const struct qdot_linear *rest; /* the outputs after these O, or NULL */
} qdot_linear;

/* Input rows quantized per group of 32: int16 pairs, the group's step dx and its exact fp32 sum sx, 32 times the sum
 * of each half group's int16 values (x32, two a group); and, where a GEMM of fp16 weights (kind 16) will take them
 * unrounded, the rows themselves in fp32 after the prologue (xf; NULL otherwise, so integer-only steps copy nothing). */
typedef struct {
    int32_t *xq;
    float *dx, *sx, *xf;
    int32_t *x32;
} qdot_rows;

/* What is applied to each input row before it is quantized. */
enum { QDOT_PLAIN = 0, QDOT_RMSNORM = 1, QDOT_SILU_MUL = 2, QDOT_GELU_MUL = 3 };

void qdot_rows_alloc(qdot_rows *rows, long M, long K, int keep_float);
void qdot_rows_free(qdot_rows *rows);
void qdot_prepare(int in, const float *x, long M, long K, long stride, const float *norm, float eps, qdot_rows *out);
void qdot_run(const qdot_linear *L, const qdot_rows *rows, long M, float *y, int accumulate);
long qdot_width(const qdot_linear *L);      /* outputs of all parts */
int qdot_takes_float(const qdot_linear *L); /* whether some part is fp16 weights (it reads rows->xf) */

/* One layer of one sequence's KV cache as attention sees it: positions [0, npre) in shared pages of ``page``
 * positions each (the prefix cache; page i holds (KV, page, D) keys at kpages[i], values at vpages[i]), the rest in
 * the sequence's own buffers k, v (KV, cap, D), position npre at slot 0. npre 0: no shared pages. ``kt`` (or NULL):
 * the own keys again, transposed in blocks of 16 slots (kv head g's block i, (D, 16), at kt + (g cap + 16 i) D), valid
 * for the first ``kt_valid`` slots (a multiple of 16); attention fills in the blocks its committed positions complete,
 * and the caller then counts them valid (kv_cache.py). ``half``: every one of these holds fp16 numbers (IEEE binary16)
 * instead of fp32 (half the bytes that attention reads a step); the arithmetic stays fp32. Every field is 8 bytes, in
 * the order of exact.py's KV_SLOT. */
typedef struct {
    void *k, *v;
    long cap;
    const void *const *kpages;
    const void *const *vpages;
    long npre, page;
    void *kt;
    long kt_valid;
    long half;
} dartspec_kv;

void dartspec_attend(const float *qkv, long q, long H, long KV, long D, const float *rot, void *kc, void *vc,
                     long cap, long half, long base, const uint8_t *mask, const float *q_norm, const float *k_norm,
                     float eps, float scale, float *out);
void dartspec_attend_seqs(const float *qkv, long H, long KV, long D, const float *rot, long nseq, const long *starts,
                          const dartspec_kv *kv, const long *base, const uint8_t *const *mask, const float *q_norm,
                          const float *k_norm, float eps, float scale, float *out, int share);
#endif
