"""The draft-model drafter: its chains are the draft model's own greedy continuation (against transformers' forward
of that model), a draft model that is the target is accepted in full with no catch-up forward, and bad pairings are
clear errors. Its losslessness with a random draft model is in test_lossless / test_batching (``draft-model``)."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, tiny_model, tiny_tokenizer
from test_lossless import prompts, untied_target

from dartspec.drafters import make_drafter
from dartspec.drafters.base import DraftBudget
from dartspec.drafters.draft_model import DraftModelDrafter
from dartspec.drafters.hybrid import HybridDrafter
from dartspec.drafters.pld import PromptLookupDrafter
from dartspec.engine import Generator
from dartspec.errors import DartspecError
from dartspec.target import Target


def draft_target(dtype: torch.dtype = torch.float64) -> Target:
    """A smaller random model with the tiny tokenizer (2 layers, its own head)."""
    model = tiny_model("qwen2", seed=7, layers=2)
    torch.manual_seed(12)
    model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight))
    return Target(model.to(dtype), tiny_tokenizer(), name="tiny-draft")


def next_probs(model: Target, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.softmax(model.model(torch.tensor([tokens])).logits[0, -1].double(), -1)


def test_the_chain_is_the_draft_models_greedy_continuation_and_runner_ups_fill_the_budget() -> None:
    target, small = untied_target("llama", torch.float64), draft_target()
    tokens = prompts(1)[0]
    drafter = DraftModelDrafter(small, target, p_min=0.0)
    drafter.begin(tokens)
    tree = drafter.propose(tokens, DraftBudget(max_nodes=6, max_depth=3))
    chain: list[int] = []
    for _ in range(3):  # the independent reference: transformers' forward of the draft model, no cache
        chain.append(int(next_probs(small, [*tokens, *chain]).argmax()))
    paths = tree.paths()
    assert [int(t) for t in tree.tokens[paths[0]]] == [tokens[-1], *chain]
    assert tree.size == 6 and tree.max_depth == 3
    # The two nodes left go to runner-ups along the chain, the most likely first (each: the chain's probability up to
    # it times its own).
    scores = []
    reach = 1.0
    for depth in range(3):
        p = next_probs(small, [*tokens, *chain[:depth]])
        second = torch.topk(p, 2)
        scores.append((reach * float(second.values[1]), [*chain[:depth], int(second.indices[1])]))
        reach *= float(second.values[0])
    want = [path for _, path in sorted(scores, key=lambda s: -s[0])[:2]]
    got = [[int(t) for t in tree.tokens[path[1:]]] for path in paths[1:]]
    assert sorted(got) == sorted(want)


def test_a_doubted_token_ends_the_chain_after_the_first_and_competes_for_the_nodes_left() -> None:
    target, small = untied_target("llama", torch.float64), draft_target()
    tokens = prompts(1)[0]
    first = next_probs(small, tokens)
    assert float(first.max()) < 0.9  # a random model doubts everything
    drafter = DraftModelDrafter(small, target, p_min=0.9)
    drafter.begin(tokens)
    tree = drafter.propose(tokens, DraftBudget(max_nodes=4, max_depth=4))
    assert drafter.forwards == 2  # the second forward scored the chain's next token, which was doubted
    t1 = int(first.argmax())
    assert tree.tokens[1] == t1  # the first token is drafted all the same
    top1, top2 = torch.topk(first, 2), torch.topk(next_probs(small, [*tokens, t1]), 2)
    p1 = float(top1.values[0])
    candidates = [
        (float(top1.values[1]), [int(top1.indices[1])]),
        (p1 * float(top2.values[0]), [t1, int(top2.indices[0])]),
        (p1 * float(top2.values[1]), [t1, int(top2.indices[1])]),
    ]
    want = sorted(path for _, path in sorted(candidates, key=lambda c: -c[0])[:2])
    leaves = sorted([int(t) for t in tree.tokens[path[1:]]] for path in tree.paths())
    assert tree.size == 4 and [leaf for leaf in leaves if leaf != [t1]] == want, (leaves, want)


def test_a_draft_model_that_is_the_target_is_accepted_in_full_without_catch_up_forwards() -> None:
    """Greedy chains of the target's own model are the target's answer: each step commits the chain and the target's
    next token, and the draft model runs one forward per drafted token (the catch-up rides in the first)."""
    target = untied_target("llama", torch.float64)
    twin = Target(target.model, tiny_tokenizer(), name="tiny-twin")
    prompt = prompts(1)[0]
    plain = Generator(target).generate(prompt, max_new_tokens=21, ignore_eos=True)
    drafter = DraftModelDrafter(twin, target, p_min=0.0)
    got = Generator(target, drafter, tree_size=4, max_depth=3).generate(prompt, max_new_tokens=21, ignore_eos=True)
    assert got.token_ids == plain.token_ids
    steps = got.stats.target_forwards - 1  # after the prefill: 5 steps of 4 tokens
    assert steps == 5 and got.stats.draft_tokens_accepted == 15
    assert got.stats.extra["draft_model_forwards"] == 3 * steps
    # The first step fed the prompt and the prefill's token, each later one the last chain's end and the target's
    # token; then each drafted two more.
    assert got.stats.extra["draft_model_positions"] == len(prompt) + 1 + 2 + 4 * (steps - 1)


def test_a_next_turn_reuses_the_draft_models_cache() -> None:
    target = untied_target("llama", torch.float64)
    small = draft_target()
    drafter = DraftModelDrafter(small, target)
    gen = Generator(target, drafter, tree_size=4, max_depth=3)
    prompt = prompts(1)[0]
    first = gen.generate(prompt, max_new_tokens=8, ignore_eos=True)
    longer = [*prompt, *first.token_ids, 5, 6]
    gen.generate(longer, max_new_tokens=4, ignore_eos=True)
    assert drafter.cached[: len(prompt) + 5] == longer[: len(prompt) + 5]
    assert drafter.cache.length == len(drafter.cached)


def test_bad_pairings_are_clear_errors() -> None:
    target = untied_target("llama", torch.float64)
    with pytest.raises(DartspecError, match="--drafter-path"):
        make_drafter("draft-model", target)
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    other = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0")),
        unk_token="w0",
    )
    stranger = Target(draft_target().model, other, name="stranger")
    with pytest.raises(DartspecError, match="tokenizer"):
        DraftModelDrafter(stranger, target)
    with pytest.raises(ValueError, match="p_min"):
        DraftModelDrafter(draft_target(), target, p_min=1.0)


@pytest.mark.parametrize("beside_spans", [True, False])
def test_with_lookup_spans_the_draft_model_drafts_only_in_the_nodes_they_leave(beside_spans: bool) -> None:
    target, small = untied_target("llama", torch.float64), draft_target()
    chain = DraftModelDrafter(small, target, p_min=0.0)
    hybrid = HybridDrafter(chain, PromptLookupDrafter(), beside_spans=beside_spans)
    assert hybrid.name == "draft-model+pld"
    repeats = [5, 6, 7, 8, 9, 10, 5, 6, 7]  # "6 7" was followed by "8 9 10": a span of three
    hybrid.begin(repeats)
    assert hybrid.propose(repeats, DraftBudget(max_nodes=4, max_depth=3)).tokens.tolist() == [7, 8, 9, 10]
    assert chain.forwards == 0  # the span filled the budget
    tree = hybrid.propose(repeats, DraftBudget(max_nodes=6, max_depth=3))
    # Two nodes left: the draft model fills them (one forward: the chain stops at the budget) or leaves them.
    assert tree.tokens[:4].tolist() == [7, 8, 9, 10]
    assert (tree.size, chain.forwards) == ((6, 2) if beside_spans else (4, 0))
    fresh = [*repeats, 11, 12]  # no match: the draft model has every node, and feeds what it missed in one forward
    before = chain.positions
    tree = hybrid.propose(fresh, DraftBudget(max_nodes=4, max_depth=3))
    assert tree.size == 4 and chain.positions - before == len(fresh) - (len(repeats) if beside_spans else 0) + 2
    prompt = prompts(1)[0]
    plain = Generator(target).generate(prompt, max_new_tokens=24)
    assert Generator(target, hybrid, tree_size=4).generate(prompt, max_new_tokens=24).token_ids == plain.token_ids
    with pytest.raises(DartspecError, match="--drafter-path"):
        make_drafter("draft-model+pld", target)


def test_a_sampled_request_draws_its_chain_from_the_draft_model_at_its_temperature() -> None:
    """With sampled drafts each chain token is drawn from the draft model's own distribution at the request's
    temperature (transformers' forward of the draft model, the same uniforms), which rides on the tree for the
    verifier's rejection test."""
    import numpy as np

    from dartspec.tree import DraftSampling
    from dartspec.verify import sample

    target, small = untied_target("llama", torch.float64), draft_target()
    tokens = prompts(1)[0]
    drafter = DraftModelDrafter(small, target, p_min=0.0)
    budget = DraftBudget(max_nodes=5, max_depth=3, sampling=DraftSampling(0.7, np.random.default_rng(4)))
    tree = drafter.propose(tokens, budget)
    uniforms = np.random.default_rng(4)
    chain: list[int] = []
    for depth in range(3):
        with torch.no_grad():
            logits = small.model(torch.tensor([[*tokens, *chain]])).logits[0, -1].double()
        q = torch.softmax(logits / 0.7, -1).numpy()
        drawn = sample(torch.from_numpy(q), uniforms.random())
        proposal = tree.proposals[depth]
        assert np.allclose(proposal.probs, q, atol=1e-9) and proposal.draws == (depth + 1,) and proposal.at == (drawn,)
        assert tree.tokens[depth + 1] == drawn
        chain.append(drawn)
    assert tree.size == 5 and sorted(tree.proposals) == [0, 1, 2]
