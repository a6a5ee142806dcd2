/* The n-gram probability kernel (ngram.c), which the beam search (search.c) calls per level. */
#ifndef DARTSPEC_NGRAM_H
#define DARTSPEC_NGRAM_H
#include <stdint.h>

void dartspec_ngram_prob(const uint64_t *keys, const double *counts, long nkeys, const uint64_t *ctx_keys,
                         const double *totals, long nctx, const uint64_t *key_shift, const uint64_t *ctx_shift,
                         long order, uint64_t vocab, const int64_t *ctx, const int64_t *cand, long B, long K,
                         double *out);

#endif
