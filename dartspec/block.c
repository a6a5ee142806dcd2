/* One decoder block of the lean runtime on exact-a16 weights in one call (dartspec/lean.py), in place:
 *
 *   x += o(attend(qkv(rms_norm(x, ln1))))          (or qkv(attn_in): a drafter's layer reads a wider input)
 *   x += down(silu(gate(h)) * up(h)),  h = rms_norm(x, ln2)
 *
 * Gemma 3's blocks norm each branch's output too (post_attn, post_ffn: x += rms_norm(o(...), post_attn)) and use GELU
 * (tanh form) for SiLU; their norm weights come as (1 + w), Gemma's convention, from exact.py.
 *
 * For a handful of new rows (decoding, a draft tree) each block otherwise costs a dozen small torch
 * operations and their Python (norms, slices, SiLU, products, residual adds, five kernel calls): about a
 * fifth of a SmolLM2 decode step. Here the norms and the SiLU product are the prologue of the GEMM that
 * quantizes its input anyway (qdot_prepare), and the residual adds are its epilogue (qdot_run accumulate).
 * Every row is computed on its own, so a tree verification computes what one-token decoding computes.
 */
#include <stdlib.h>
#include <string.h>

#include "qdot.h"
#include "vmath.h"

/* Field order is the ctypes Structure in exact.py. */
typedef struct {
    qdot_linear qkv, o, gate_up, down;
    const float *ln1, *ln2, *q_norm, *k_norm; /* q_norm / k_norm NULL unless per-head norms (Qwen3, Gemma 3) */
    const float *post_attn, *post_ffn;        /* NULL unless the branches' outputs are normed (Gemma 3) */
    long heads, kv_heads, head_dim;
    float eps, scale;
    int gelu;    /* the MLP's activation: GELU (tanh form) where 1, SiLU where 0 */
    int sliding; /* a sliding-window layer: dartspec_blocks gives it the local rotary table and window masks */
} dartspec_block_weights;

/* x (q, n) += rms_norm(y, w) row by row (a Gemma 3 branch's output, normed before the residual add). */
static void add_normed(float *x, const float *y, long q, long n, const float *w, float eps) {
    for (long r = 0; r < q; r++) {
        const float *yr = y + r * n;
        float inv = rms_inverse(yr, n, eps);
#pragma omp simd
        for (long k = 0; k < n; k++) x[r * n + k] += yr[k] * inv * w[k];
    }
}

/* The branch's projection (o or down) added into x: directly (the GEMM's epilogue), or through its output norm. */
static void add_branch(const qdot_linear *L, const qdot_rows *rows, long q, float *x, float *tmp, const float *norm,
                       float eps) {
    if (!norm) {
        qdot_run(L, rows, q, x, 1);
        return;
    }
    qdot_run(L, rows, q, tmp, 0);
    add_normed(x, tmp, q, L->O, norm, eps);
}

/* Many sequences' new rows in one call: the projections run over all ``q`` rows of x together (the weights are
 * read once), attention per sequence against its own cache. Sequence s owns rows starts[s] .. starts[s + 1]; its
 * cache is kv[s] (shared prefix pages, then its own buffers) with base[s] positions filled, its mask (rows, base +
 * rows) or NULL (causal). x (q, hidden) fp32; attn_in (q, qkv.K) or NULL (rms_norm(x, ln1)); rot (q, D/2, 2). Every
 * row is computed on its own, so a sequence's rows are what a call with that sequence alone computes; ``share``
 * lets sequences on the same prefix pages attend to them together (same results, fewer reads). */
void dartspec_block_many(const dartspec_block_weights *b, float *x, const float *attn_in, long q, const float *rot,
                         long nseq, const long *starts, const dartspec_kv *kv, const long *base,
                         const uint8_t *const *mask, int share) {
    long hidden = b->o.O, inner = b->down.K, width = qdot_width(&b->qkv), attn_width = b->heads * b->head_dim;
    long widest = hidden > inner ? hidden : inner;
    widest = widest > attn_width ? widest : attn_width;
    widest = widest > b->qkv.K ? widest : b->qkv.K;
    float *qkv = (float *)malloc(sizeof(float) * q * width);
    float *attn = (float *)malloc(sizeof(float) * q * attn_width);
    float *gu = (float *)malloc(sizeof(float) * q * qdot_width(&b->gate_up));
    float *branch = b->post_attn || b->post_ffn ? (float *)malloc(sizeof(float) * q * hidden) : NULL;
    qdot_rows rows;
    int fp16 = qdot_takes_float(&b->qkv) || qdot_takes_float(&b->o) || qdot_takes_float(&b->gate_up) ||
               qdot_takes_float(&b->down);
    qdot_rows_alloc(&rows, q, widest, fp16);

    if (attn_in)
        qdot_prepare(QDOT_PLAIN, attn_in, q, b->qkv.K, b->qkv.K, NULL, 0.0f, &rows);
    else
        qdot_prepare(QDOT_RMSNORM, x, q, hidden, hidden, b->ln1, b->eps, &rows);
    qdot_run(&b->qkv, &rows, q, qkv, 0);
    /* Attention per sequence (spread over the threads; with ``share``, sequences on the same prefix pages read them
     * once for all: dartspec_attend_seqs). */
    dartspec_attend_seqs(qkv, b->heads, b->kv_heads, b->head_dim, rot, nseq, starts, kv, base, mask, b->q_norm,
                         b->k_norm, b->eps, b->scale, attn, share);
    qdot_prepare(QDOT_PLAIN, attn, q, attn_width, attn_width, NULL, 0.0f, &rows);
    add_branch(&b->o, &rows, q, x, branch, b->post_attn, b->eps);
    qdot_prepare(QDOT_RMSNORM, x, q, hidden, hidden, b->ln2, b->eps, &rows);
    qdot_run(&b->gate_up, &rows, q, gu, 0);
    qdot_prepare(b->gelu ? QDOT_GELU_MUL : QDOT_SILU_MUL, gu, q, inner, 2 * inner, NULL, 0.0f, &rows);
    add_branch(&b->down, &rows, q, x, branch, b->post_ffn, b->eps);

    qdot_rows_free(&rows);
    free(branch);
    free(gu);
    free(attn);
    free(qkv);
}

/* One sequence: x (q, hidden) fp32; attn_in (q, qkv.K) or NULL (rms_norm(x, ln1)); rot (q, D/2, 2); the cache:
 * npre positions in shared pages of ``page`` positions (kpages, vpages; npre 0: none), then kc, vc (KV, cap, D);
 * base positions filled in all, fp16 numbers where half (else fp32); mask (q, base + q) or NULL (causal). */
void dartspec_block(const dartspec_block_weights *b, float *x, const float *attn_in, long q, const float *rot,
                    void *kc, void *vc, long cap, long half, const void *const *kpages, const void *const *vpages,
                    long npre, long page, long base, const uint8_t *mask) {
    long starts[2] = {0, q};
    dartspec_kv kv = {kc, vc, cap, kpages, vpages, npre, page > 0 ? page : 1, NULL, 0, half};
    dartspec_block_many(b, x, attn_in, q, rot, 1, starts, &kv, &base, &mask, 0);
}

/* x (q, n; rows `stride` apart) = rms_norm(x, w) row by row, in place: the lean runtime's final norm wherever its C
 * kernels run (inside dartspec_blocks, or after layers run one by one), so every path computes the same hidden
 * states bit for bit; a drafter's input norms (halves of wider rows). */
void dartspec_rms_norm(float *x, long q, long n, long stride, const float *w, float eps) {
    for (long r = 0; r < q; r++) {
        float *xr = x + r * stride, inv = rms_inverse(xr, n, eps);
#pragma omp simd
        for (long k = 0; k < n; k++) xr[k] = xr[k] * inv * w[k];
    }
}

/* Every layer of a forward in one call (the lean runtime's decode and verify steps): dartspec_block_many for layers
 * 0 .. L-1 in turn, layer l reading caches kv[l * nseq .. (l + 1) * nseq). Before layer l, x is copied into feats
 * (q, nfeat * hidden) at column block f for each f with feat_layers[f] == l (the drafters' fused features). One call
 * instead of one per layer: the Python around the calls cost ~7% of a one-token step on two cores (measured 0.93x
 * the time at 1 row, 0.96x at 4). Sliding-window layers (Gemma 3) take rot_local and window_mask where those are
 * given (their own rotary base; the window's masks, NULL where every key is within the window). With final_norm
 * (else NULL), x leaves as rms_norm(x, final_norm) (eps): the model's final-norm hidden states. */
void dartspec_blocks(const dartspec_block_weights *const *b, long L, float *x, long q, const float *rot,
                     const float *rot_local, long nseq, const long *starts, const dartspec_kv *kv, const long *base,
                     const uint8_t *const *mask, const uint8_t *const *window_mask, int share, long nfeat,
                     const long *feat_layers, float *feats, const float *final_norm, float eps) {
    long hidden = b[0]->o.O;
    for (long l = 0; l < L; l++) {
        for (long f = 0; f < nfeat; f++)
            if (feat_layers[f] == l)
                for (long r = 0; r < q; r++)
                    memcpy(feats + (r * nfeat + f) * hidden, x + r * hidden, sizeof(float) * hidden);
        int local = b[l]->sliding;
        dartspec_block_many(b[l], x, NULL, q, local && rot_local ? rot_local : rot, nseq, starts, kv + l * nseq, base,
                            local && window_mask ? window_mask : mask, share);
    }
    /* The model's final norm here, not as torch operations after the call: right after a forward's weight stream
     * every small torch operation runs from cold caches (~50-100 us each on a 2-core VM, a composite norm several). */
    if (final_norm) dartspec_rms_norm(x, q, hidden, hidden, final_norm, eps);
}
