/* DART's n-gram-guided beam search (dartspec/search.py BeamTree) in one call.
 *
 * The numpy search is a few dozen array operations and an n-gram call per level, ~1.4 ms for a 32-node tree on a
 * slow 2-core host, run while a GPU waits for the next verify (14% of a DART step on an H100 with CUDA graphs).
 * Here it is a few thousand multiply-adds and binary searches. Same doubles in the same order as the numpy code
 * (scores, the early stop, the n-gram term, the EOS rule, the prefix-closed top R-1), so the same tree wherever no
 * two scores tie; at a tie numpy's partition picks either, this code the earlier candidate (beam-major order).
 *
 * Inputs: per level the top-k candidates (target ids) and their renormalised log-probs, (depth, k) row-major; the
 * last order-1 committed tokens (-1 where missing); the n-gram tables as dartspec_ngram_prob takes them (keys NULL:
 * no n-gram); the end tokens. Outputs, for the `max_nodes - 1` kept nodes in creation order: their tokens and their
 * parents as kept-node indices (-1 = the root). Returns how many nodes were kept, or -1 if a scratch size is
 * exceeded (more than 64 candidates, a beam over 32, 32 levels or order 8: the caller then runs the numpy search). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "ngram.h"

/* numpy rounds a * b + c twice; a fused multiply-add (which -march=native would allow) once. */
#pragma GCC optimize("fp-contract=off")

#define MAX_K 64    /* candidates per level */
#define MAX_BEAM 32 /* beam width: a level keeps at most this many nodes */
#define MAX_LEVELS 32
#define MAX_ORDER 8
#define MAX_NODES (MAX_LEVELS * MAX_BEAM)
#define EOS_PENALTY 1e6

static int is_eos(int64_t t, const int64_t *eos, long n_eos) {
    for (long i = 0; i < n_eos; i++)
        if (eos[i] == t) return 1;
    return 0;
}

/* Whether entry a ranks below entry b: a lower score, or the same score and a later entry. */
static int worse(const double *score, long a, long b) {
    return score[a] < score[b] || (score[a] == score[b] && a > b);
}

/* The room-th largest of n values (room <= n), by partial selection on a copy. */
static double kth_largest(const double *v, long n, long room, double *scratch) {
    memcpy(scratch, v, n * sizeof(double));
    for (long i = 0; i < room; i++) {
        long best = i;
        for (long j = i + 1; j < n; j++)
            if (scratch[j] > scratch[best]) best = j;
        double t = scratch[i];
        scratch[i] = scratch[best];
        scratch[best] = t;
    }
    return scratch[room - 1];
}

long dartspec_beam_search(const int64_t *cand, const double *lp, long depth, long k, const int64_t *history,
                          const uint64_t *keys, const double *counts, long nkeys, const uint64_t *ctx_keys,
                          const double *totals, long nctx, const uint64_t *key_shift, const uint64_t *ctx_shift,
                          long order, uint64_t vocab, const int64_t *eos, long n_eos, long max_nodes,
                          long beam_width, double level_decay, double logit_decay, double ngram_weight, double eps,
                          int cap_width, int64_t *out_tokens, int64_t *out_parents) {
    long width = keys ? order - 1 : 0;
    if (k > MAX_K || beam_width > MAX_BEAM || depth > MAX_LEVELS || order > MAX_ORDER || max_nodes < 2) return -1;
    /* Everything on the stack (~100 KB): no state between calls, safe from several threads. */
    int64_t tokens[MAX_NODES], parents[MAX_NODES];
    double node_score[MAX_NODES], scratch[MAX_NODES];
    int64_t beam_nodes[MAX_BEAM], new_beam_nodes[MAX_BEAM];
    double beam_scores[MAX_BEAM], new_beam_scores[MAX_BEAM];
    int64_t beam_ctx[MAX_BEAM * MAX_ORDER], new_ctx[MAX_BEAM * MAX_ORDER];
    int64_t ngram_cand[MAX_BEAM * MAX_K];
    double score[MAX_BEAM * MAX_K], pn[MAX_BEAM * MAX_K];
    long chosen[MAX_BEAM];
    long nb = 1, count = 0, room = max_nodes - 1;
    beam_nodes[0] = -1;
    beam_scores[0] = 0.0;
    for (long j = 0; j < width; j++) beam_ctx[j] = history[j];
    for (long level = 0; level < depth; level++) {
        const int64_t *c = cand + level * k;
        const double *l = lp + level * k;
        double w = pow((double)(level + 1), -level_decay);
        double decay = pow(logit_decay, (double)level);
        if (cap_width && count >= room) {
            /* Scores never rise along a path: once no node of this level can beat the R-1 best so far, stop. */
            double top_beam = beam_scores[0], top_lp = l[0];
            for (long b = 1; b < nb; b++)
                if (beam_scores[b] > top_beam) top_beam = beam_scores[b];
            for (long j = 1; j < k; j++)
                if (l[j] > top_lp) top_lp = l[j];
            double best = top_beam + w * (decay * top_lp + ngram_weight * log1p(eps));
            if (best < kth_largest(node_score, count, room, scratch)) break;
        }
        double wd = w * decay;
        long n = nb * k;
        for (long b = 0; b < nb; b++)
            for (long j = 0; j < k; j++) score[b * k + j] = beam_scores[b] + wd * l[j];
        if (keys && level > 0) {
            for (long b = 0; b < nb; b++) memcpy(ngram_cand + b * k, c, k * sizeof(int64_t));
            dartspec_ngram_prob(keys, counts, nkeys, ctx_keys, totals, nctx, key_shift, ctx_shift, order, vocab,
                                beam_ctx, ngram_cand, nb, k, pn);
            double wn = w * ngram_weight;
            for (long i = 0; i < n; i++) score[i] = score[i] + wn * log(pn[i] + eps);
        }
        long n_keep = beam_width < n ? beam_width : n;
        long eos_here = 0;
        for (long j = 0; j < k; j++) eos_here += is_eos(c[j], eos, n_eos);
        if (cap_width && room + nb * eos_here < n_keep) n_keep = room + nb * eos_here;
        /* The n_keep best, best first (ties: the earlier entry): a heap of the best so far, its worst on top. */
        long hn = 0;
        for (long j = 0; j < n; j++) {
            if (hn < n_keep) {
                long i = hn++;
                while (i > 0 && worse(score, j, chosen[(i - 1) / 2])) {
                    chosen[i] = chosen[(i - 1) / 2];
                    i = (i - 1) / 2;
                }
                chosen[i] = j;
            } else if (worse(score, chosen[0], j)) {
                long i = 0;
                for (;;) {
                    long a = 2 * i + 1, b = a + 1, m = i;
                    long top = j;
                    if (a < hn && worse(score, chosen[a], top)) m = a, top = chosen[a];
                    if (b < hn && worse(score, chosen[b], top)) m = b;
                    if (m == i) break;
                    chosen[i] = chosen[m];
                    i = m;
                }
                chosen[i] = j;
            }
        }
        for (long i = 1; i < n_keep; i++) { /* best first */
            long v = chosen[i], t = i - 1;
            while (t >= 0 && worse(score, chosen[t], v)) {
                chosen[t + 1] = chosen[t];
                t--;
            }
            chosen[t + 1] = v;
        }
        long alive_count = 0;
        for (long i = 0; i < n_keep; i++) {
            long b = chosen[i] / k, j = chosen[i] % k;
            int64_t tok = c[j];
            int alive = !is_eos(tok, eos, n_eos);
            double s = score[chosen[i]];
            tokens[count + i] = tok;
            parents[count + i] = beam_nodes[b];
            node_score[count + i] = alive ? s : s - EOS_PENALTY;
            if (alive) {
                new_beam_nodes[alive_count] = count + i;
                new_beam_scores[alive_count] = s;
                /* context: the beam's last order-1 tokens, then this one */
                for (long t = 0; t + 1 < width; t++) new_ctx[alive_count * width + t] = beam_ctx[b * width + t + 1];
                if (width) new_ctx[alive_count * width + width - 1] = tok;
                alive_count++;
            }
        }
        count += n_keep;
        if (!alive_count) break;
        nb = alive_count;
        memcpy(beam_nodes, new_beam_nodes, nb * sizeof(int64_t));
        memcpy(beam_scores, new_beam_scores, nb * sizeof(double));
        memcpy(beam_ctx, new_ctx, nb * width * sizeof(int64_t));
    }
    /* The best R-1 nodes by (score desc, index asc) whose parents are kept; a second pass picks up ties. */
    long order_idx[MAX_NODES], index_of[MAX_NODES];
    int8_t kept[MAX_NODES];
    for (long i = 0; i < count; i++) {
        order_idx[i] = i;
        kept[i] = 0;
    }
    for (long i = 1; i < count; i++) { /* insertion sort: stable, so equal scores stay in index order */
        long v = order_idx[i], j = i - 1;
        while (j >= 0 && node_score[order_idx[j]] < node_score[v]) {
            order_idx[j + 1] = order_idx[j];
            j--;
        }
        order_idx[j + 1] = v;
    }
    long n_kept = 0;
    for (int pass = 0; pass < 2 && n_kept < room; pass++)
        for (long i = 0; i < count && n_kept < room; i++) {
            long v = order_idx[i];
            if (!kept[v] && (parents[v] == -1 || kept[parents[v]])) {
                kept[v] = 1;
                n_kept++;
            }
        }
    long out = 0;
    for (long i = 0; i < count; i++) {
        if (!kept[i]) continue;
        index_of[i] = out;
        out_tokens[out] = tokens[i];
        out_parents[out] = parents[i] == -1 ? -1 : index_of[parents[i]];
        out++;
    }
    return out;
}

/* The search's input (dartspec/search.py top_candidates) in one call: per row of a (depth, vocab) float32
 * log-probability matrix (rows `stride` floats apart), the k largest entries in descending order (equal values: the
 * lower index first) as ids (mapped through d2t where given) and their log-probabilities renormalised over those k,
 * in doubles. torch's topk and float32 logsumexp took ~80 us a step on a warm cache and ~270 us right after a
 * target forward's weight stream; this is one pass over each row with a k-entry sorted buffer. Returns 0, or -1 if
 * k is out of range (1..MAX_K, at most vocab). */
long dartspec_top_candidates(const float *logp, long depth, long vocab, long stride, long k, const int64_t *d2t,
                             int64_t *out_ids, double *out_lp) {
    if (k < 1 || k > MAX_K || k > vocab) return -1;
    for (long r = 0; r < depth; r++) {
        const float *row = logp + r * stride;
        float val[MAX_K];
        long idx[MAX_K], n = 0;
        for (long j = 0; j < vocab; j++) {
            float v = row[j];
            if (n == k && !(v > val[k - 1])) continue; /* not above the k-th so far (or NaN) */
            long at = n < k ? n++ : k - 1;
            while (at > 0 && v > val[at - 1]) {
                val[at] = val[at - 1];
                idx[at] = idx[at - 1];
                at--;
            }
            val[at] = v;
            idx[at] = j;
        }
        double top = val[0], sum = 0.0;
        for (long i = 0; i < k; i++) sum += exp((double)val[i] - top);
        double lse = top + log(sum);
        for (long i = 0; i < k; i++) {
            out_ids[r * k + i] = d2t ? d2t[idx[i]] : idx[i];
            out_lp[r * k + i] = (double)val[i] - lse;
        }
    }
    return 0;
}
