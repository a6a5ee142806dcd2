"""The target runtime: tree verification equals plain decoding, commit keeps exactly the accepted path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import VOCAB, tiny_target
from hypothesis import given, settings
from hypothesis import strategies as st

from dartspec import exact
from dartspec.errors import ContextLengthError, DartspecError
from dartspec.kernels import rows_first_linear
from dartspec.kv_cache import TreeKVCache
from dartspec.target import Target
from dartspec.tree import Tree

# Models run in float64, but transformers' RMSNorm computes in float32, so batched and one-token forwards may
# differ by ~1e-8; any masking or cache bug shows up as O(1e-2) or more.
ATOL = 1e-6


def reference_logits(target: Target, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return target.model(torch.tensor([seq])).logits[0].double()


def random_tree(rng: np.random.Generator, root: int, size: int) -> Tree:
    tokens, parents = [root], [-1]
    used: set[tuple[int, int]] = set()
    while len(tokens) < size:
        p = int(rng.integers(0, len(tokens)))
        t = int(rng.integers(0, VOCAB))
        if (p, t) in used:
            continue
        used.add((p, t))
        tokens.append(t)
        parents.append(p)
    return Tree(np.array(tokens), np.array(parents))


@pytest.mark.parametrize("seed", range(4))
def test_tree_logits_equal_step_by_step_decoding(any_target: Target, seed: int) -> None:
    rng = np.random.default_rng(seed)
    t = any_target
    prompt = rng.integers(0, VOCAB, size=int(rng.integers(3, 20))).tolist()
    t.reset()
    out = t.prefill(prompt)
    torch.testing.assert_close(out.logits[0].double(), reference_logits(t, prompt)[-1], rtol=0, atol=ATOL)
    tree = random_tree(rng, int(rng.integers(0, VOCAB)), int(rng.integers(1, 20)))
    base = t.cached
    got = t.verify(tree).logits
    for node in range(tree.size):
        seq = prompt + [int(tree.tokens[i]) for i in tree.path_to(node)]
        torch.testing.assert_close(got[node].double(), reference_logits(t, seq)[-1], rtol=0, atol=ATOL)
    # Commit a random root-to-node path; the next forward must see exactly prompt + path.
    node = int(rng.integers(0, tree.size))
    path = tree.path_to(node)
    t.commit(base, path)
    assert t.cached == base + len(path)
    nxt = int(rng.integers(0, VOCAB))
    after = t.verify(Tree.chain(nxt, [3, 4])).logits
    seq = prompt + [int(tree.tokens[i]) for i in path] + [nxt]
    ref = reference_logits(t, [*seq, 3, 4])
    torch.testing.assert_close(after.double(), ref[-3:], rtol=0, atol=ATOL)


def test_long_context_beyond_sliding_window() -> None:
    """Gemma3's sliding layers must only see the window, in prefill chunks and in tree verification."""
    t = tiny_target("gemma3", seed=3)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, VOCAB, size=40).tolist()
    t.prefill(prompt)
    tree = random_tree(rng, 5, 12)
    got = t.verify(tree).logits
    for node in range(tree.size):
        seq = prompt + [int(tree.tokens[i]) for i in tree.path_to(node)]
        torch.testing.assert_close(got[node].double(), reference_logits(t, seq)[-1], rtol=0, atol=ATOL)


def test_features_are_hidden_states_entering_feature_layers(llama_target: Target) -> None:
    t = llama_target
    prompt = list(range(5, 17))
    t.reset()
    out = t.prefill(prompt, features=True)
    with torch.no_grad():
        hs = t.model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    expected = torch.cat([hs[i][0] for i in t.feature_layers], dim=-1)
    assert out.features.shape == (len(prompt), 3 * t.hidden_size)
    torch.testing.assert_close(out.features, expected, rtol=0, atol=ATOL)
    # Tree verification returns one feature row per node, equal to a plain forward along each path.
    tree = Tree(np.array([40, 41, 42, 43]), np.array([-1, 0, 0, 1]))
    feats = t.verify(tree, features=True).features
    with torch.no_grad():
        hs = t.model(torch.tensor([[*prompt, 40, 41, 43]]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(feats[3], torch.cat([hs[i][0, -1] for i in t.feature_layers]), rtol=0, atol=ATOL)


def test_chunked_prefill_equals_one_forward(monkeypatch: pytest.MonkeyPatch, llama_target: Target) -> None:
    t = llama_target
    prompt = list(np.random.default_rng(5).integers(0, VOCAB, size=45))
    t.reset()
    whole = t.prefill(prompt, features=True)
    monkeypatch.setattr(t, "prefill_chunk", 8)
    t.reset()
    chunked = t.prefill(prompt, features=True)
    torch.testing.assert_close(chunked.logits, whole.logits, rtol=0, atol=ATOL)
    torch.testing.assert_close(chunked.features, whole.features, rtol=0, atol=ATOL)
    assert t.cached == 45


def test_context_window_errors() -> None:
    t = tiny_target("llama", max_positions=32)
    with pytest.raises(ContextLengthError, match="context window of 32"):
        t.prefill(list(range(40)))
    t.prefill(list(range(30)))
    with pytest.raises(ContextLengthError):
        t.verify(Tree.chain(1, [2, 3, 4]))
    assert t.cached == 30  # a refused forward leaves the cache as it was


def test_kv_cache_grows_past_its_initial_capacity(llama_target: Target) -> None:
    t = llama_target
    t.reset()
    seq = list(np.random.default_rng(9).integers(0, VOCAB, size=300))
    t.prefill(seq[:10])
    for i in range(10, 300, 37):
        t.prefill(seq[i : i + 37])
    out = t.verify(Tree.root_only(7)).logits
    torch.testing.assert_close(out[0].double(), reference_logits(t, [*seq, 7])[-1], rtol=0, atol=ATOL)


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 40), bias=st.booleans(), out=st.sampled_from([3, 17, 64]))
def test_rows_first_linear_equals_f_linear(m: int, bias: bool, out: int) -> None:
    g = torch.Generator().manual_seed(m * 7 + out)
    x = torch.randn(2, m, 24, generator=g, dtype=torch.float64)
    w = torch.randn(out, 24, generator=g, dtype=torch.float64)
    b = torch.randn(out, generator=g, dtype=torch.float64) if bias else None
    torch.testing.assert_close(rows_first_linear(x, w, b), F.linear(x, w, b), rtol=1e-12, atol=1e-12)


def test_fast_linear_does_not_change_outputs() -> None:
    fast, slow = tiny_target("qwen2", seed=2), tiny_target("qwen2", seed=2, fast_linear=False)
    prompt = list(range(3, 20))
    for t in (fast, slow):
        t.prefill(prompt)
    tree = Tree.chain(4, [5, 6, 7])
    torch.testing.assert_close(fast.verify(tree).logits, slow.verify(tree).logits, rtol=0, atol=ATOL)


def test_feature_layers_can_be_switched() -> None:
    t = tiny_target("llama")
    prompt = list(range(5, 15))
    with torch.no_grad():
        hs = t.model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    t.set_feature_layers([1, 4, 5])
    t.reset()
    feats = t.prefill(prompt, features=True).features
    torch.testing.assert_close(feats, torch.cat([hs[i][0] for i in (1, 4, 5)], dim=-1), rtol=0, atol=ATOL)
    t.set_feature_layers(None)  # back to the default 2, N//2, N-3
    t.reset()
    feats = t.prefill(prompt, features=True).features
    torch.testing.assert_close(feats, torch.cat([hs[i][0] for i in (2, 3, 3)], dim=-1), rtol=0, atol=ATOL)
    with pytest.raises(DartspecError, match="feature layer 6 is out of range for a 6-layer target"):
        t.set_feature_layers([1, 6])


@pytest.mark.skipif(not exact.available(), reason="needs gcc and an AVX2 CPU")
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), cached=st.integers(0, 40), tree=st.integers(1, 12), dtype=st.sampled_from([0, 1]))
def test_kv_keep_in_c_equals_the_layer_by_layer_keep(seed: int, cached: int, tree: int, dtype: int) -> None:
    """attend.c's keep of an accepted path over every layer against each layer's torch keep (the reference, and the
    path elsewhere): the same entries and lengths, past a buffer's first capacity too."""
    from dartspec import kv_cache

    assert kv_cache._c_kv_keep() is not None
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    kind = (torch.float32, torch.bfloat16)[dtype]
    caches = [TreeKVCache(3, capacity=8), TreeKVCache(3, capacity=8)]
    for n in (cached, tree):
        if n:
            for layer in range(3):
                k, v = (torch.randn(1, 2, n, 16, generator=g).to(kind) for _ in range(2))
                for cache in caches:
                    cache.layers[layer].update(k.clone(), v.clone())
    base = cached
    nodes = np.sort(rng.choice(tree, size=int(rng.integers(1, tree + 1)), replace=False))
    nodes[0] = 0  # a path starts at the root
    path = torch.as_tensor(np.unique(nodes))
    assert caches[0]._keep_in_c(base, path)
    for layer in caches[1].layers:
        layer.keep(base, path)
    n = base + len(path)
    for a, b in zip(caches[0].layers, caches[1].layers, strict=True):
        assert a.length == b.length == n
        assert torch.equal(a.keys[:, :, :n], b.keys[:, :, :n]) and torch.equal(a.values[:, :, :n], b.values[:, :, :n])


def test_extend_all_gives_every_layers_current_buffers() -> None:
    """The cache's table of buffer addresses (the lean runtime's per-step slots) follows every replacement of a
    buffer: growth, and one made behind its back (select_rows, as static batching does)."""
    cache = TreeKVCache(3, capacity=4)
    like = torch.empty(1, 2, 0, 8)

    def check(table: tuple[np.ndarray, ...], length: int) -> None:
        assert table[0].tolist() == [layer.keys.data_ptr() for layer in cache.layers]
        assert table[1].tolist() == [layer.values.data_ptr() for layer in cache.layers]
        assert table[2].tolist() == [layer.keys.shape[2] for layer in cache.layers]
        # the transposed keys (fp32 CPU buffers of one row: made for the C attention) are as large as the keys
        assert table[3].tolist() == [layer.kt.data_ptr() for layer in cache.layers]
        assert all(layer.kt.shape == layer.keys.shape for layer in cache.layers)
        # a position's keys, values and transposed keys in 3 layers of 2 heads of 8 fp32 numbers
        assert cache.own_bytes() == length * 3 * (3 * 2 * 8 * 4)
        assert [layer.length for layer in cache.layers] == [length] * 3
        assert all(layer.keys.shape[2] >= length for layer in cache.layers)

    check(cache.extend_all(3, like, like), 3)
    check(cache.extend_all(1, like, like), 4)  # the kept table
    check(cache.extend_all(3, like, like), 7)  # every layer grew
    cache.select_rows(torch.tensor([0]))  # new buffers
    check(cache.extend_all(1, like, like), 8)
    cache.truncate(2)
    check(cache.extend_all(2, like, like), 4)
