/* DART's longest-context n-gram probability (dartspec/ngram.py NgramModel.prob) in one call.
 *
 * The numpy version is ~25 array operations a call, ~150 us for the few dozen candidates of a beam-search level
 * whatever the batch: with 8-16 levels a step it was half of a 32-node tree search, which runs on the host while a
 * GPU waits. Here each probability is a couple of binary searches.
 *
 * Tables as NgramModel._joined builds them: every order's n-gram keys in one sorted uint64 array (order n shifted by
 * key_shift), their counts; every order's context keys in one sorted array (shifted by ctx_shift), their totals; the
 * shifts per order, longest first. For row b (its last order-1 tokens in ctx, -1 where missing) and candidate t, the
 * probability is count(c, t) / max(count(c), 1) at the longest context c (n-1 tokens, all present) that was seen and
 * under which (c, t) was counted; 0 where none was. Same doubles, same division: equal to numpy's, bit for bit.
 * A context's n-grams are one run of the sorted keys, found once per row and order; candidates are searched in it. */
#include <stdint.h>

#include "ngram.h"

static long lower_bound(const uint64_t *table, long lo, long hi, uint64_t key) {
    while (lo < hi) { /* first index in [lo, hi) with table[i] >= key */
        long mid = lo + (hi - lo) / 2;
        if (table[mid] < key)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static long find_in(const uint64_t *table, long lo, long hi, uint64_t key) {
    long i = lower_bound(table, lo, hi, key);
    return i < hi && table[i] == key ? i : -1;
}

void dartspec_ngram_prob(const uint64_t *keys, const double *counts, long nkeys, const uint64_t *ctx_keys,
                         const double *totals, long nctx, const uint64_t *key_shift, const uint64_t *ctx_shift,
                         long order, uint64_t vocab, const int64_t *ctx, const int64_t *cand, long B, long K,
                         double *out) {
    long width = order - 1;
    for (long b = 0; b < B; b++) {
        const int64_t *c = ctx + b * width;
        double *o = out + b * K;
        const int64_t *t = cand + b * K;
        long done = 0;
        for (long k = 0; k < K; k++) o[k] = -1.0; /* not yet decided */
        for (long i = 0; i < order && done < K; i++) { /* order n = order - i, longest first */
            long n = order - i;
            uint64_t packed = 0;
            int valid = 1;
            for (long j = n - 1; j >= 1; j--) { /* the last n-1 tokens, oldest first: base-vocab digits */
                int64_t tok = c[width - j];
                if (tok < 0) {
                    valid = 0;
                    break;
                }
                packed = packed * vocab + (uint64_t)tok;
            }
            if (!valid) continue;
            long ch = find_in(ctx_keys, 0, nctx, packed + ctx_shift[i]);
            if (ch < 0) continue;
            double total = totals[ch] > 1.0 ? totals[ch] : 1.0;
            uint64_t base = packed * vocab + key_shift[i];
            /* This context's n-grams are the keys in [base, base + vocab): search that run, not the whole table. */
            long lo = lower_bound(keys, 0, nkeys, base), hi = lower_bound(keys, lo, nkeys, base + vocab);
            for (long k = 0; k < K && lo < hi; k++) {
                if (o[k] >= 0.0) continue;
                long h = find_in(keys, lo, hi, base + (uint64_t)t[k]);
                if (h >= 0) {
                    o[k] = counts[h] / total;
                    done++;
                }
            }
        }
        for (long k = 0; k < K; k++)
            if (o[k] < 0.0) o[k] = 0.0;
    }
}

/* Prompt lookup's search (dartspec/drafters/pld.py PromptLookupDrafter.continuations) in one call: for the longest
 * suffix of seq (max_ngram down to min_ngram tokens) that occurred earlier with something after it, up to
 * max_matches distinct continuations of at most `length` tokens, newest occurrence first. Writes continuation c to
 * out[c * length ...] and its length to out_len[c]; returns how many were found (0: no suffix matched). The numpy
 * search was ~20 us warm and ~110 us a step in a decode (array temporaries on caches the weights just swept). */
long dartspec_lookup(const int64_t *seq, long n_tok, long max_ngram, long min_ngram, long length, long max_matches,
                     int64_t *out, long *out_len) {
    if (length < 1 || max_matches < 1) return 0;
    long top = max_ngram < n_tok - 1 ? max_ngram : n_tok - 1;
    for (long n = top; n >= min_ngram && n >= 1; n--) {
        const int64_t *suffix = seq + n_tok - n;
        long found = 0;
        for (long i = n_tok - n - 1; i >= 0 && found < max_matches; i--) {
            long m = 0;
            while (m < n && seq[i + m] == suffix[m]) m++;
            if (m < n) continue;
            const int64_t *cont = seq + i + n;
            long len = n_tok - (i + n) < length ? n_tok - (i + n) : length;
            long seen = 0;
            for (long c = 0; c < found && !seen; c++) {
                if (out_len[c] != len) continue;
                long e = 0;
                while (e < len && out[c * length + e] == cont[e]) e++;
                seen = e == len;
            }
            if (seen) continue;
            for (long e = 0; e < len; e++) out[found * length + e] = cont[e];
            out_len[found++] = len;
        }
        if (found) return found;
    }
    return 0;
}
