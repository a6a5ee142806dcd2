"""Continuous batching: many sequences stepped together in one target forward give each what it gives alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import VOCAB, tiny_model, tiny_tokenizer
from test_engine import RandomDrafter
from test_lean import _gguf_like
from test_lossless import drafter, prompts, untied_target

from dartspec import exact
from dartspec.drafters import NoDrafter
from dartspec.engine import Generator, SequenceState
from dartspec.errors import DartspecError
from dartspec.lean import LeanTarget
from dartspec.tree import Tree

needs_kernels = pytest.mark.skipif(not exact.available(), reason="no C compiler for dartspec's kernels")


def lean_target(arch: str = "llama", seed: int = 0, kv_cache: str = "fp32", **config) -> LeanTarget:
    """A tiny exact-a16 target (its blocks run as C calls, so verify_many takes its batched path) with an untied
    random head (a tied one makes greedy decoding repeat the last token); ``kv_cache``: its KV caches' numbers;
    ``config``: the model's other settings (:func:`conftest.tiny_model`)."""
    model = tiny_model(arch, seed, **config).float()
    torch.manual_seed(11)
    model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight))
    name = f"tiny-{arch}"
    return LeanTarget(_gguf_like(model, seed), tiny_tokenizer(), quant="exact-a16", name=name, kv_cache=kv_cache)


def random_tree(rng: np.random.Generator, root: int, size: int) -> Tree:
    paths = [rng.integers(2, VOCAB, size=int(rng.integers(1, 4))).tolist() for _ in range(size)]
    return Tree.from_paths(root, paths, max_nodes=size)


@needs_kernels
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_one_forward_over_many_sequences_equals_each_alone_bit_for_bit(arch: str) -> None:
    target = lean_target(arch)
    rng = np.random.default_rng(0)
    lengths = [5, 23, 11, 40]
    prompts_ = [rng.integers(2, VOCAB, size=n).tolist() for n in lengths]
    for features in (False, True):
        history: list[list[Tree]] = [[] for _ in prompts_]
        alone = target.new_cache()
        together = [target.new_cache() for _ in prompts_]
        for p, c in zip(prompts_, together, strict=True):
            target.prefill(p, cache=c)
        for step in range(3):
            # Trees of mixed sizes and shapes (a chain, a root alone, branching trees) at different cache lengths.
            trees = [random_tree(rng, 3 + s, size) for s, size in enumerate([1, 6, 3, 9])]
            trees[0] = Tree.chain(4, [5, 6, 7]) if step == 1 else trees[0]
            outs = target.verify_many(list(zip(trees, together, strict=True)), features=features)
            for p, c, tree, out, kept_trees in zip(prompts_, together, trees, outs, history, strict=True):
                base = c.length - tree.size
                alone.truncate(0)
                target.prefill(p, cache=alone)
                # Replay the same committed history alone, then the same tree.
                for kept in kept_trees:
                    target.verify(kept, cache=alone)
                assert alone.length == base
                ref = target.verify(tree, features=features, cache=alone)
                assert torch.equal(out.logits, ref.logits)
                if features:
                    assert out.features is not None and torch.equal(out.features, ref.features)
                for layer_a, layer_b in zip(alone.layers, c.layers, strict=True):
                    assert torch.equal(layer_a.keys[:, :, : c.length], layer_b.keys[:, :, : c.length])
            for kept_trees, tree in zip(history, trees, strict=True):
                # Nothing is committed away: the whole tree stays in the cache and the next step attends to it.
                kept_trees.append(tree)


def run_batched(gen: Generator, jobs: list[dict], step_rows: int | None) -> dict[int, list[int]]:
    """Jobs join at their ``at`` step and leave when finished; returns each job's tokens."""
    active: dict[int, SequenceState] = {}
    done: dict[int, list[int]] = {}
    step = 0
    while len(done) < len(jobs):
        for i, job in enumerate(jobs):
            if job["at"] == step:
                active[i] = gen.start(job["prompt"], own_state=True, **job["params"])
        for i, seq in list(active.items()):
            if gen.emit(seq).result is not None:
                done[i] = seq.result.token_ids
                del active[i]
        if active:
            gen.advance_many(list(active.values()), step_rows=step_rows)
        step += 1
    return done


def jobs_for(prompt_list: list[list[int]], temperature: float = 0.0) -> list[dict]:
    return [
        {
            "prompt": p,
            "at": [0, 0, 2, 5][i % 4],
            "params": {"max_new_tokens": [24, 9, 30, 16][i % 4], "temperature": temperature, "seed": 100 + i},
        }
        for i, p in enumerate(prompt_list)
    ]


@pytest.mark.parametrize("runtime", ["hf", pytest.param("lean", marks=needs_kernels)])
@pytest.mark.parametrize("name", ["none", "pld", "random", "dart", "dart+pld", "eagle3", "dflash", "draft-model"])
def test_sequences_stepped_together_equal_lone_runs(runtime: str, name: str) -> None:
    """Greedy and seeded sampling, requests joining and leaving mid-generation, rows budgets that give some
    sequences their root alone: every sequence's tokens equal its lone run's."""
    target = untied_target("llama", torch.float32) if runtime == "hf" else lean_target()
    ps = prompts(4)
    ref_tokens = Generator(target, NoDrafter()).generate(ps[0], max_new_tokens=24).token_ids
    for temperature in (0.0, 0.9):
        jobs = jobs_for(ps, temperature)
        gen = Generator(target, drafter(name, target, ref_tokens), tree_size=6, max_depth=4)
        lone = [gen.generate(j["prompt"], **j["params"]).token_ids for j in jobs]
        if temperature == 0:
            plain = [Generator(target).generate(j["prompt"], **j["params"]).token_ids for j in jobs]
            assert lone == plain
        for step_rows in (None, 8, 2):
            got = run_batched(gen, jobs, step_rows)
            assert [got[i] for i in range(len(jobs))] == lone, (name, temperature, step_rows)


@pytest.mark.parametrize("runtime", ["hf", pytest.param("lean", marks=needs_kernels)])
@pytest.mark.parametrize("name", ["dart+pld", "draft-model"])
def test_sampled_drafts_stepped_together_equal_lone_runs(runtime: str, name: str) -> None:
    """With sampled drafts a sequence's tokens depend on its trees (the draw and the rejection tests take its seeded
    generators' numbers), so each sequence must keep its own generators in a batch: at full trees (no rows budget,
    which would cut them) every sequence's tokens equal its lone run's, and differ from plain sampling's."""
    target = untied_target("llama", torch.float32) if runtime == "hf" else lean_target()
    ps = prompts(4)
    ref_tokens = Generator(target, NoDrafter()).generate(ps[0], max_new_tokens=24).token_ids
    jobs = jobs_for(ps, 0.9)
    gen = Generator(target, drafter(name, target, ref_tokens), tree_size=6, max_depth=4, sampled_drafts=True)
    lone = [gen.generate(j["prompt"], **j["params"]).token_ids for j in jobs]
    got = run_batched(gen, jobs, None)
    assert [got[i] for i in range(len(jobs))] == lone
    plain = [Generator(target).generate(j["prompt"], **j["params"]).token_ids for j in jobs]
    assert plain != lone  # the draws took numbers: a seed no longer gives plain sampling's tokens


def test_sequences_stepped_together_need_their_own_caches() -> None:
    target = untied_target("llama", torch.float32)
    gen = Generator(target, RandomDrafter(seed=0))
    a = gen.start([3, 4, 5], max_new_tokens=4)
    b = gen.start([3, 4, 5], max_new_tokens=4, own_state=True)
    with pytest.raises(DartspecError, match="own"):
        gen.advance_many([a, a])
    gen.advance_many([a, b])  # the runtime's own cache for one of them is fine
    assert len(a.new) >= 2 and len(b.new) >= 2


def test_forked_drafters_keep_their_own_state() -> None:
    target = untied_target("llama", torch.float32)
    ref = Generator(target, NoDrafter()).generate(prompts(1)[0], max_new_tokens=8).token_ids
    dart = drafter("dart+pld", target, ref)
    twin = dart.fork()
    assert twin.drafter.model is dart.drafter.model  # the network is shared
    assert twin.drafter._queue is not dart.drafter._queue and twin.drafter._cache is not dart.drafter._cache


@needs_kernels
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_one_sequence_takes_the_batched_path_and_gets_what_verify_gives(arch: str) -> None:
    """The engine's step (``verify_many`` of one sequence) runs the batched C path and returns what :meth:`verify`
    does, bit for bit: logits, argmax, features, and the cache it leaves."""
    target = lean_target(arch)
    rng = np.random.default_rng(3)
    prompt = rng.integers(2, VOCAB, size=37).tolist()
    many, one = target.new_cache(), target.new_cache()
    for cache in (many, one):
        target.prefill(prompt, cache=cache)
    forward = target._forward
    for step in range(4):
        tree = Tree.root_only(9) if step == 0 else random_tree(rng, 3 + step, 2 + 3 * step)
        target._forward = lambda *a, **k: pytest.fail("one sequence left the batched path")
        (got,) = target.verify_many([(tree, many)], features=True)
        target._forward = forward
        want = target.verify(tree, features=True, cache=one)
        assert torch.equal(got.logits, want.logits) and torch.equal(got.argmax, want.argmax)
        assert torch.equal(got.features, want.features)
        keep = tree.path_to(tree.size - 1)
        for cache in (many, one):
            target.commit(cache.length - tree.size, keep, cache)
        assert many.length == one.length
