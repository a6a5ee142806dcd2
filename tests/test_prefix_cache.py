"""The prefix cache: shared prompt prefixes give every request what it computes alone, bit for bit; blocks are
reference-counted and evicted least recently used, never while in use."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from conftest import VOCAB
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_batching import lean_target, needs_kernels, random_tree, run_batched
from test_lossless import drafter

from dartspec.drafters import NoDrafter
from dartspec.engine import Generator
from dartspec.errors import DartspecError
from dartspec.prefix_cache import PrefixCache

pytestmark = needs_kernels


def _prompts(rng: np.random.Generator, shared: int, tails: list[int]) -> list[list[int]]:
    head = rng.integers(2, VOCAB, size=shared).tolist()
    return [head + rng.integers(2, VOCAB, size=n).tolist() for n in tails]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "qwen3+kv16", "qwen3-d64g3", "qwen3-d64g3+kv16"])
def test_shared_prefix_gives_the_same_logits_features_and_trees_bit_for_bit(arch: str) -> None:
    """(``+kv16``: fp16 caches, whose pages hold fp16 numbers too. ``-d64g3``: heads of 64 dimensions, 3 a kv head,
    as SmolLM2's: the C attention's value sums for 3 heads at once, which continue the shared pages' sums.)"""
    arch, _, kv = arch.partition("+")
    kv_cache = "fp16" if kv else "fp32"
    config = {}
    if arch.endswith("-d64g3"):
        arch, config = "qwen3", {"head_dim": 64, "num_attention_heads": 6, "num_key_value_heads": 2}
    plain, cached = lean_target(arch, kv_cache=kv_cache, **config), lean_target(arch, kv_cache=kv_cache, **config)
    pc = cached.enable_prefix_cache(1 << 30)
    rng = np.random.default_rng(1)
    prompts = _prompts(rng, 70, [9, 1, 30, 0])  # 70 shared tokens: 4 blocks of 16 shared, then each its own
    prompts.append(prompts[0][:40])  # a prompt inside another's blocks
    for features in (False, True):
        pc.clear()
        for i, p in enumerate(prompts):
            a, b = plain.new_cache(), cached.new_cache()
            ref, out = plain.prefill(p, features=features, cache=a), cached.prefill(p, features=features, cache=b)
            assert torch.equal(ref.logits, out.logits)
            if features:
                assert torch.equal(ref.features, out.features)
            if i:  # the first computed everything; the rest found the shared head
                assert b.layers[0].npre >= 32
            assert b.layers[0].npre <= len(p) - 1  # the last token is always computed
            tree = random_tree(rng, p[-1], 7)
            assert torch.equal(plain.verify(tree, cache=a).logits, cached.verify(tree, cache=b).logits)
            plain.commit(len(p), [0, 2], cache=a), cached.commit(len(p), [0, 2], cache=b)
            tree = random_tree(rng, 5, 4)
            assert torch.equal(plain.verify(tree, cache=a).logits, cached.verify(tree, cache=b).logits)
    assert pc.stats.hit_tokens > 0
    want = torch.float16 if kv else torch.float32  # the pages hold the caches' numbers
    assert len(pc._blocks) and all(block.kv.dtype == want for block in pc._blocks.values())


@pytest.mark.parametrize("name", ["none", "random", "dart", "random+kv16"])
def test_batched_generation_with_shared_prefixes_equals_lone_runs(name: str) -> None:
    """Requests joining one after another find the earlier ones' prefix (a feature drafter's feature rows
    included); every request's tokens equal those of a runtime without the cache (``+kv16``: fp16 caches)."""
    name, _, kv = name.partition("+")
    kv_cache = "fp16" if kv else "fp32"
    plain, cached = lean_target(kv_cache=kv_cache), lean_target(kv_cache=kv_cache)
    cached.enable_prefix_cache(1 << 30)
    rng = np.random.default_rng(2)
    prompts = _prompts(rng, 48, [3, 12, 20, 7])
    ref = Generator(plain, NoDrafter()).generate(prompts[0], max_new_tokens=16).token_ids
    jobs = [{"prompt": p, "at": i, "params": {"max_new_tokens": 16}} for i, p in enumerate(prompts)]
    want = run_batched(Generator(plain, drafter(name, plain, ref), tree_size=6, max_depth=4), jobs, None)
    got = run_batched(Generator(cached, drafter(name, cached, ref), tree_size=6, max_depth=4), jobs, None)
    assert got == want
    # verify_many's batched path ran with shared pages (a joining request found the others' prefix)
    assert cached.prefix_cache is not None and cached.prefix_cache.stats.hit_tokens >= 3 * 48


def test_prompts_one_after_another_on_the_runtimes_own_cache_equal_a_runtime_without_it() -> None:
    """Without ``own_state`` (the CLI's generate and chat) each prompt starts on the runtime's own cache, which the
    prefix cache may have started with shared pages: the next prompt lets them go (it once raised instead)."""
    plain, cached = lean_target(), lean_target()
    cached.enable_prefix_cache(1 << 30)
    rng = np.random.default_rng(3)
    first = _prompts(rng, 40, [5])[0]
    later = first + rng.integers(2, VOCAB, size=20).tolist()  # a conversation's next turn: the last one extended
    for prompt in (first, later, first, later):
        want = Generator(plain, NoDrafter()).generate(prompt, max_new_tokens=12).token_ids
        assert Generator(cached, NoDrafter()).generate(prompt, max_new_tokens=12).token_ids == want
    assert cached.prefix_cache is not None and cached.prefix_cache.stats.hit_tokens >= 3 * 32


def test_references_and_eviction() -> None:
    target = lean_target()
    pc = target.enable_prefix_cache(1 << 30)
    rng = np.random.default_rng(3)
    a, b = _prompts(rng, 40, [8, 8])  # 2 shared blocks, then a third block each (40 + 8 = 48 tokens)
    ca = target.new_cache()
    target.prefill(a, cache=ca)
    assert len(pc) == 3 and pc.nbytes == 3 * pc.block_bytes
    cb = target.new_cache()
    target.prefill(b, cache=cb)
    assert cb.layers[0].npre == 32 and len(pc) == 4  # b's third block differs from a's
    # (a lookup leaves a prompt's last token to compute: one more token finds all three blocks)
    assert [blk.refs for blk in pc.match([*b, 1])] == [1, 1, 0]  # cb holds the shared two; its third is free
    # Over budget: only free leaves go, least recently used first: a's third block (b's is newer).
    pc.max_bytes = 3 * pc.block_bytes
    pc._evict()
    assert len(pc) == 3 and len(pc.match([*a, 1])) == 2 and len(pc.match([*b, 1])) == 3
    pc.max_bytes = 0
    pc._evict()
    assert len(pc) == 2  # the two blocks cb uses stay, whatever the budget
    cb.reset()  # letting the pages go releases them ...
    assert [blk.refs for blk in pc.match(b)] == [0, 0]
    pc._evict()
    assert len(pc) == 0 and pc.nbytes == 0
    # ... and so does dropping the cache
    pc.max_bytes = 1 << 30
    target.prefill(a, cache=target.new_cache())
    cc = target.new_cache()
    target.prefill(a, cache=cc)
    assert pc.match(a)[0].refs == 1
    del cc  # CPython frees it here; collect() in case a cycle holds it
    gc.collect()
    assert pc.match(a)[0].refs == 0


def test_shared_pages_are_never_written_or_cut() -> None:
    target = lean_target()
    target.enable_prefix_cache(1 << 30)
    p = list(range(2, 40))
    target.prefill(p, cache=target.new_cache())
    c = target.new_cache()
    target.prefill(p, cache=c)
    assert c.layers[0].npre == 32
    with pytest.raises(ValueError, match="shared pages"):
        c.truncate(10)
    with pytest.raises(ValueError, match="shared pages"):
        c.keep(20, torch.tensor([0]))


def test_prefix_cache_needs_the_exact_kernels() -> None:
    from conftest import tiny_target

    with pytest.raises(DartspecError, match="prefix cache"):
        tiny_target().enable_prefix_cache(1 << 20)
    for block in (10, 48):
        with pytest.raises(ValueError, match="power of two"):
            PrefixCache(layers=1, kv_heads=1, head_dim=8, max_bytes=1, block=block)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shared=st.integers(0, 70),
    tails=st.lists(st.integers(1, 30), min_size=2, max_size=5),
    sizes=st.lists(st.integers(1, 9), min_size=5, max_size=5),
    seed=st.integers(0, 2**16),
)
def test_shared_prefix_attention_equals_each_sequence_alone(
    shared: int, tails: list[int], sizes: list[int], seed: int
) -> None:
    """Sequences on common prefix pages (random prefix and own lengths, one sharing only part of the prefix or none,
    random trees) attend to them together, pages read once, and get what they get when each reads them itself,
    and what each gets verified alone on a runtime without a prefix cache: bit for bit."""
    cached, plain = _targets()
    cached.prefix_cache.clear()
    rng = np.random.default_rng(seed)
    prompts = _prompts(rng, shared, tails)
    prompts[-1] = prompts[-1][: max(2, shared // 2)]
    trees = [random_tree(np.random.default_rng(seed + i), p[-1], sizes[i]) for i, p in enumerate(prompts)]
    results = {}
    for share in (True, False):
        cached.share_prefix_attention = share
        caches = [cached.new_cache() for _ in prompts]
        for p, c in zip(prompts, caches, strict=True):
            cached.prefill(p, cache=c)
        results[share] = [o.logits for o in cached.verify_many(list(zip(trees, caches, strict=True)))]
    for p, tree, together, apart in zip(prompts, trees, results[True], results[False], strict=True):
        alone = plain.new_cache()
        plain.prefill(p, cache=alone)
        assert torch.equal(together, apart) and torch.equal(together, plain.verify(tree, cache=alone).logits)


_TARGETS: list = []


def _targets():
    """(a runtime with a prefix cache, one without), built once for the hypothesis examples: heads of 64 dimensions,
    3 a kv head, as SmolLM2's (the C attention's own paths for them: the shared pages' value sums of each head, then
    each sequence's own rows' for its 3 heads at once, must continue the same sums)."""
    if not _TARGETS:
        config = {"head_dim": 64, "num_attention_heads": 6, "num_key_value_heads": 2}
        cached = lean_target("qwen3", **config)
        cached.enable_prefix_cache(1 << 30)
        _TARGETS.extend([cached, lean_target("qwen3", **config)])
    return _TARGETS[0], _TARGETS[1]
