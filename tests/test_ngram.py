"""N-gram counts and DART's longest-context probability against a brute-force counter."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dartspec.errors import DartspecError
from dartspec.ngram import MergedNgram, NgramModel, OnlineNgram


def brute_prob(seqs: list[list[int]], order: int, ctx: list[int], t: int, min_count: int = 1) -> float:
    """DART's rule by counting; n-grams (n >= 2) seen fewer than ``min_count`` times are unknown."""
    grams: Counter = Counter()
    for s in seqs:
        for n in range(1, order + 1):
            for i in range(len(s) - n + 1):
                grams[tuple(s[i : i + n])] += 1
    for k in range(min(order - 1, len(ctx)), -1, -1):
        c = tuple(ctx[len(ctx) - k :]) if k else ()
        if grams.get((*c, t), 0) >= (min_count if k else 1):
            total = sum(v for g, v in grams.items() if len(g) == k + 1 and g[:k] == c)
            return grams[(*c, t)] / total
    return 0.0


corpora = st.lists(st.lists(st.integers(0, 6), min_size=0, max_size=15), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(seqs=corpora, ctx=st.lists(st.integers(0, 6), min_size=2, max_size=2), order=st.integers(1, 3))
def test_static_and_online_match_brute_force(seqs: list[list[int]], ctx: list[int], order: int) -> None:
    model, _ = NgramModel.build(seqs, order=order, vocab=7)
    cands = np.arange(7)[None, :]
    contexts = np.array([ctx[len(ctx) - (order - 1) :] if order > 1 else []]).reshape(1, -1)
    expected = [brute_prob(seqs, order, ctx, t) for t in range(7)]
    np.testing.assert_allclose(model.prob(contexts, cands)[0], expected)
    online = OnlineNgram(order)
    for s in seqs:
        online.history = []  # each sequence counted on its own, like the static builder
        online.extend(s)
    np.testing.assert_allclose(online.prob(contexts, cands)[0], expected)


@settings(max_examples=60, deadline=None)
@given(
    seqs=corpora,
    rows=st.lists(
        st.tuples(st.lists(st.integers(0, 6), max_size=2), st.lists(st.integers(0, 6), min_size=3, max_size=3)),
        min_size=1,
        max_size=5,
    ),
    order=st.integers(1, 4),
)
def test_a_batch_of_rows_matches_brute_force_row_by_row(
    seqs: list[list[int]], rows: list[tuple[list[int], list[int]]], order: int
) -> None:
    """One query of many rows (as the beam search asks), each with its own context, shorter contexts padded with
    -1 on the left, and its own candidates: every entry is the brute-force rule for that row."""
    model, _ = NgramModel.build(seqs, order=order, vocab=7)
    contexts = np.array([[-1] * (2 - len(ctx)) + ctx for ctx, _ in rows]).reshape(len(rows), 2)
    cands = np.array([c for _, c in rows])
    got = model.prob(contexts, cands)
    expected = [[brute_prob(seqs, order, ctx, t) for t in c] for ctx, c in rows]
    np.testing.assert_allclose(got, expected)


@settings(max_examples=40, deadline=None)
@given(seqs=corpora, ctx=st.lists(st.integers(0, 6), min_size=2, max_size=2), min_count=st.integers(2, 3))
def test_min_count_prunes_without_changing_kept_probabilities(seqs: list[list[int]], ctx: list[int], min_count: int):
    model, _ = NgramModel.build(seqs, order=3, vocab=7, min_count=min_count)
    got = model.prob(np.array([ctx]), np.arange(7)[None, :])[0]
    expected = [brute_prob(seqs, 3, ctx, t, min_count) for t in range(7)]
    np.testing.assert_allclose(got, expected)


def test_min_count_must_be_positive() -> None:
    with pytest.raises(DartspecError, match="min_count"):
        NgramModel.build([[1, 2, 3]], order=2, vocab=5, min_count=0)


def test_longest_context_rule_by_hand() -> None:
    model, stats = NgramModel.build([[1, 2, 3, 1, 2, 4, 5, 2, 3]], order=3, vocab=8)
    # After (1, 2): 3 once, 4 once -> 1/2 each; 5 never follows (1,2) but follows 4; never after 2 -> backs
    # off to the unigram rate of 5 (1/9).
    p = model.prob(np.array([[1, 2]]), np.array([[3, 4, 5, 7]]))[0]
    np.testing.assert_allclose(p, [0.5, 0.5, 1 / 9, 0.0])
    # Context (9 unseen, 2): (2, 3) seen twice of three bigrams starting with 2.
    p = model.prob(np.array([[7, 2]]), np.array([[3, 4]]))[0]
    np.testing.assert_allclose(p, [2 / 3, 1 / 3])
    assert stats.tokens == 9 and stats.entries > 0


def test_save_load_memmap_round_trip(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 50, size=200) for _ in range(20)]
    model, _ = NgramModel.build(seqs, order=3, vocab=50, tokenizer="tok-A")
    size = model.save(tmp_path / "m.ngram")
    assert size > 0
    loaded = NgramModel.load(tmp_path / "m.ngram", tokenizer="tok-A")
    assert isinstance(loaded.arrays["keys3"], np.memmap)
    ctx = rng.integers(0, 50, size=(30, 2))
    cand = rng.integers(0, 50, size=(30, 10))
    np.testing.assert_array_equal(loaded.prob(ctx, cand), model.prob(ctx, cand))


def test_damaged_files_and_tokenizer_mismatch(tmp_path: Path) -> None:
    model, _ = NgramModel.build([[1, 2, 3, 4]], order=3, vocab=10, tokenizer="tok-A")
    path = tmp_path / "m.ngram"
    model.save(path)
    with pytest.raises(DartspecError, match="another tokenizer"):
        NgramModel.load(path, tokenizer="tok-B")
    data = path.read_bytes()
    path.write_bytes(data[:-40])
    with pytest.raises(DartspecError, match="truncated"):
        NgramModel.load(path)
    path.write_bytes(b"XXXX" + data[4:])
    with pytest.raises(DartspecError, match="not a dartspec n-gram"):
        NgramModel.load(path)
    path.write_bytes(data[:20])
    with pytest.raises(DartspecError):
        NgramModel.load(path)
    with pytest.raises(DartspecError, match="token ids"):
        NgramModel.build([[1, 99]], order=2, vocab=10)


def test_online_updates_and_merge() -> None:
    online = OnlineNgram(3)
    online.extend([5, 6, 7])
    assert online.prob(np.array([[5, 6]]), np.array([[7, 8]]))[0].tolist() == [1.0, 0.0]
    online.extend([5, 6, 8])
    assert online.prob(np.array([[5, 6]]), np.array([[7, 8]]))[0].tolist() == [0.5, 0.5]
    static, _ = NgramModel.build([[5, 6, 9]], order=3, vocab=10)
    merged = MergedNgram(static, online)
    np.testing.assert_allclose(merged.prob(np.array([[5, 6]]), np.array([[7, 9, 3]]))[0], [0.5, 1.0, 0.0])


def brute_interpolated(seqs: list[list[int]], order: int, ctx: list[int], t: int, vocab: int, s: float) -> float:
    grams: Counter = Counter()
    for q in seqs:
        for n in range(1, order + 1):
            for i in range(len(q) - n + 1):
                grams[tuple(q[i : i + n])] += 1
    p = 1.0 / vocab
    for k in range(0, min(order - 1, len(ctx)) + 1):
        c = tuple(ctx[len(ctx) - k :]) if k else ()
        total = sum(v for g, v in grams.items() if len(g) == k + 1 and g[:k] == c)
        if total:
            p = (1 - s) * grams.get((*c, t), 0) / total + s * p
    return p


@settings(max_examples=40, deadline=None)
@given(seqs=corpora, ctx=st.lists(st.integers(0, 6), min_size=2, max_size=2), s=st.sampled_from([0.2, 0.5, 0.9]))
def test_interpolated_variant_matches_brute_force(seqs: list[list[int]], ctx: list[int], s: float) -> None:
    from dartspec.ngram import SmoothedNgram

    model, _ = NgramModel.build(seqs, order=3, vocab=7)
    got = SmoothedNgram(model, s).prob(np.array([ctx]), np.arange(7)[None, :])[0]
    np.testing.assert_allclose(got, [brute_interpolated(seqs, 3, ctx, t, 7, s) for t in range(7)])
    assert (got > 0).all()  # unseen tokens keep some probability
    with pytest.raises(DartspecError, match="smoothing"):
        SmoothedNgram(model, 1.0)


def _padded(model: NgramModel, contexts: np.ndarray) -> np.ndarray:
    """Contexts as prob passes them on: ``(B, order-1)``, -1 on the left where missing."""
    width = model.order - 1
    out = np.full((len(contexts), width), -1, dtype=np.int64)
    take = min(width, contexts.shape[1])
    if take:
        out[:, width - take :] = contexts[:, contexts.shape[1] - take :]
    return out


@pytest.mark.skipif(not __import__("dartspec.exact").exact.available(), reason="needs the C kernels (gcc, AVX2)")
def test_the_c_kernel_equals_numpy_bit_for_bit() -> None:
    """``prob`` runs in C where the kernels build (ngram.c); its numpy version is the reference: equal doubles on
    random corpora of every order (contexts with missing tokens, unseen candidates) and on the shipped SmolLM2
    n-gram (49,152-token vocabulary: packed keys near 2^63)."""
    rng = np.random.default_rng(0)
    for order in (1, 2, 3, 4):
        for trial in range(6):
            seqs = [rng.integers(0, 9, size=rng.integers(0, 40)).tolist() for _ in range(5)]
            model, _ = NgramModel.build(seqs, order=order, vocab=12, min_count=1 + trial % 2)
            contexts = rng.integers(-1, 12, size=(7, rng.integers(0, 5)))
            cand = rng.integers(0, 12, size=(7, 9))
            got = model.prob(contexts, cand)
            assert np.array_equal(got, model._prob_numpy(_padded(model, contexts), cand)), (order, trial)
    shipped = NgramModel.load(Path(__file__).parents[1] / "dartspec/checkpoints/smollm2-135m-dart/ngram.bin")
    text = rng.integers(0, 2000, size=(40, shipped.order - 1))
    cand = np.concatenate([rng.integers(0, 2000, size=(40, 20)), rng.integers(0, 49152, size=(40, 5))], axis=1)
    got = shipped.prob(text, cand)
    assert (got > 0).any() and np.array_equal(got, shipped._prob_numpy(_padded(shipped, text), cand))
