"""`bench replay` against the engine: a replayed decode takes the steps the engine's own greedy decode takes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import VOCAB, tiny_target
from test_dart import model_for

from dartspec.bench.replay import LookupReplay, Replay, anchor_rows, replay_answer
from dartspec.drafters.dart import DartDrafter
from dartspec.drafters.hybrid import HybridDrafter
from dartspec.engine import Generator


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.mark.parametrize(
    ("tree", "size", "online", "lookup", "draft_nodes"),
    [
        ("beam", 8, False, False, None),
        ("beam", 3, False, False, None),
        ("chain", 6, False, False, None),
        ("ddtree", 8, False, False, None),
        ("beam", 8, True, False, None),
        ("beam", 8, False, True, None),
        ("beam", 3, False, True, None),
        ("beam", 8, False, True, 3),  # the CPU default's kind of split: DART's tree capped inside the budget
    ],
)
def test_replay_takes_the_engines_steps(
    target, tree: str, size: int, online: bool, lookup: bool, draft_nodes: int | None
) -> None:
    """Forwards, new tokens, accepted drafts and tree nodes of the replay equal the engine's greedy decode of the same
    prompts with the same drafter, tree builder and budget (up to the answer's end and the token limit); with
    ``lookup``, of ``dart+pld``'s (prompt-lookup spans first, the DART tree in the nodes they leave, at most
    ``draft_nodes`` of them)."""
    model = model_for(target, depth=4, vocab=VOCAB)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    drafter = DartDrafter(model, target, tree, online_ngram=online)  # online: n-grams of the prompt and output
    hybrid = HybridDrafter(drafter, draft_nodes=draft_nodes)
    gen = Generator(target, hybrid if lookup else drafter, tree_size=size, max_depth=8)
    replayed = LookupReplay(hybrid) if lookup else drafter
    spans: list[bool] = []  # per lookup (engine and replay): whether the context had a match
    if lookup:
        find = hybrid.lookup.continuations

        def counted(tokens: list[int], length: int) -> list[list[int]]:
            found = find(tokens, length)
            spans.append(bool(found))
            return found

        hybrid.lookup.continuations = counted  # type: ignore[method-assign]
    rng = np.random.default_rng(4)
    accepted = 0
    for limit in (1, 5, 30, 40):
        # Prompts that repeat themselves give the lookup matches from the first step.
        prompt = rng.integers(2, VOCAB, size=int(rng.integers(3, 12))).tolist() * (2 if lookup else 1)
        res = gen.generate(prompt, max_new_tokens=limit, temperature=0.0)
        tokens = prompt + res.token_ids
        got = Replay("x")
        replay_answer(
            anchor_rows(model, target, tokens, len(prompt)), tokens, len(prompt), replayed, size, 8, limit, got
        )
        s = res.stats
        assert (got.forwards, got.tokens) == (s.target_forwards, s.new_tokens), limit
        assert (sum(got.accepted), sum(got.nodes)) == (s.draft_tokens_accepted, s.tree_nodes), limit
        accepted += s.draft_tokens_accepted
    assert accepted > 0  # the drafter's guesses were accepted somewhere, so the walk was exercised
    assert not lookup or sum(spans) > 10  # and the lookup's spans went into the trees
