"""The engine loop: speculative output equals plain output, for any drafter and tree."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch
from conftest import VOCAB, tiny_target
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dartspec.drafters import PromptLookupDrafter
from dartspec.drafters.base import DraftBudget, Drafter, DrafterBase, NoDrafter
from dartspec.engine import Generator, _path_rows
from dartspec.errors import ContextLengthError, DartspecError
from dartspec.target import Target
from dartspec.tree import Tree


class RandomDrafter(DrafterBase):
    """Random trees of random shape; with probability ``oracle_rate`` one branch follows ``reference`` (the
    true continuation, e.g. plain decoding's output) for a random length, so long acceptances happen too."""

    name = "random"

    def __init__(self, seed: int, reference: Sequence[int] = (), oracle_rate: float = 0.5) -> None:
        self.rng = np.random.default_rng(seed)
        self.reference = list(reference)
        self.oracle_rate = oracle_rate
        self.prompt_len = 0

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self.prompt_len = len(prompt_ids)

    def propose(self, tokens: Sequence[int], budget: DraftBudget) -> Tree:
        paths = []
        if self.reference and budget.max_depth > 0 and self.rng.random() < self.oracle_rate:
            done = len(tokens) - self.prompt_len
            good = self.reference[done : done + budget.max_depth]
            cut = int(self.rng.integers(0, len(good) + 1))
            paths.append([*good[:cut], int(self.rng.integers(0, VOCAB))])
        for _ in range(int(self.rng.integers(0, 4))):
            depth = int(self.rng.integers(1, budget.max_depth + 1)) if budget.max_depth else 0
            paths.append(self.rng.integers(0, VOCAB, size=depth).tolist())
        paths = [p[: budget.max_depth] for p in paths]
        return Tree.from_paths(tokens[-1], paths, max_nodes=budget.max_nodes)


@pytest.fixture(scope="module")
def target() -> Target:
    return tiny_target("llama", seed=1)


@pytest.fixture(scope="module")
def qwen() -> Target:
    return tiny_target("qwen2", seed=4)


def prompt_for(seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    motif = rng.integers(2, VOCAB, size=4).tolist()
    return rng.integers(2, VOCAB, size=5).tolist() + motif * 3  # repeats give prompt lookup matches


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 10_000),
    tree_size=st.integers(1, 24),
    max_depth=st.integers(0, 8),
    max_new=st.integers(1, 40),
)
def test_random_drafter_greedy_equals_plain(target: Target, seed: int, tree_size: int, max_depth: int, max_new: int):
    prompt = prompt_for(seed)
    plain = Generator(target).generate(prompt, max_new_tokens=max_new)
    drafter = RandomDrafter(seed, plain.token_ids)
    spec = Generator(target, drafter, tree_size=tree_size, max_depth=max_depth).generate(prompt, max_new_tokens=max_new)
    assert spec.token_ids == plain.token_ids
    assert spec.text == plain.text and spec.finish_reason == plain.finish_reason
    assert len(spec.token_ids) <= max_new


@pytest.mark.parametrize("arch_fixture", ["target", "qwen"])
def test_prompt_lookup_greedy_equals_plain(arch_fixture: str, request: pytest.FixtureRequest) -> None:
    t = request.getfixturevalue(arch_fixture)
    accepted = 0
    for seed in range(6):
        prompt = prompt_for(seed)
        plain = Generator(t).generate(prompt, max_new_tokens=30)
        spec = Generator(t, PromptLookupDrafter(min_ngram=1)).generate(prompt, max_new_tokens=30)
        assert spec.token_ids == plain.token_ids
        accepted += spec.stats.draft_tokens_accepted
    assert accepted > 0
    # A one-node budget (a full batch's share) leaves no room beside the root: no search of the context at all.
    lookup = PromptLookupDrafter(min_ngram=1)
    lookup.continuations = lambda tokens, length: pytest.fail("searched the context with no room to draft")
    assert lookup.propose([3, 4, 3, 4, 3], DraftBudget(max_nodes=1, max_depth=5)).size == 1


def test_long_acceptances_happen_and_stats_add_up(target: Target) -> None:
    prompt = prompt_for(7)
    plain = Generator(target).generate(prompt, max_new_tokens=40)
    drafter = RandomDrafter(0, plain.token_ids, oracle_rate=1.0)
    res = Generator(target, drafter, tree_size=16, max_depth=6).generate(prompt, max_new_tokens=40)
    s = res.stats
    assert s.tau > 2
    assert s.tau == pytest.approx(s.new_tokens / s.target_forwards)
    assert s.new_tokens == len(res.token_ids)
    assert len(s.accept_per_depth) == 6 and all(0 <= a <= 1 for a in s.accept_per_depth)
    # Accepting depth d needs depth d-1 accepted, so the counts can only drop with depth.
    assert s.depth_accepted == sorted(s.depth_accepted, reverse=True)
    assert res.token_ids == plain.token_ids
    assert plain.stats.tau == 1.0 and plain.stats.target_forwards == 40


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 0.9, 20)])
def test_sampling_with_a_seed_is_identical_with_and_without_drafting(
    target: Target, temperature: float, top_p: float, top_k: int
) -> None:
    prompt = prompt_for(2)
    kw = dict(max_new_tokens=40, temperature=temperature, top_p=top_p, top_k=top_k)
    plain = Generator(target).generate(prompt, seed=5, **kw)
    for seed in range(3):
        drafter = RandomDrafter(seed, plain.token_ids)
        spec = Generator(target, drafter, tree_size=12, max_depth=5).generate(prompt, seed=5, **kw)
        assert spec.token_ids == plain.token_ids
    other = Generator(target).generate(prompt, seed=6, **kw)
    assert other.token_ids != plain.token_ids


def test_streaming_events_add_up_to_the_result(target: Target) -> None:
    ref = Generator(target).generate(prompt_for(3), max_new_tokens=33).token_ids
    gen = Generator(target, RandomDrafter(1, ref), tree_size=10, max_depth=4)
    events = list(gen.stream(prompt_for(3), max_new_tokens=33))
    result = events[-1].result
    assert result is not None and all(e.result is None for e in events[:-1])
    assert "".join(e.text for e in events) == result.text
    assert [t for e in events for t in e.token_ids] == result.token_ids
    assert all(0 <= e.drafted <= len(e.token_ids) for e in events)
    quiet = list(gen._events(prompt_for(3), False, max_new_tokens=33))  # generate's: no text until the end
    assert all(e.text == "" for e in quiet[:-1]) and quiet[-1].text == result.text == gen.generate(prompt_for(3),
        max_new_tokens=33).text  # fmt: skip


def test_the_drafter_reads_the_accepted_paths_feature_rows() -> None:
    features = torch.randn(7, 5)
    reads, skips = NoDrafter(), NoDrafter()
    reads.needs_features = True
    for path in ([0], [0, 1], [0, 1, 2, 3], [0, 2], [0, 1, 4, 6], [0, 3, 5]):
        assert torch.equal(_path_rows(features, path, reads), features[path])
        assert _path_rows(features, path, skips) is None
    assert _path_rows(None, [0, 1], reads) is None


def test_eos_ends_generation(target: Target) -> None:
    prompt = prompt_for(4)
    plain = Generator(target).generate(prompt, max_new_tokens=30).token_ids
    eos_at = 6
    t = tiny_target("llama", seed=1)
    t.eos_token_ids = frozenset({plain[eos_at]})
    first = plain.index(plain[eos_at])
    for drafter in (None, RandomDrafter(2, plain, oracle_rate=1.0)):
        res = Generator(t, drafter, tree_size=12, max_depth=6).generate(prompt, max_new_tokens=30)
        assert res.finish_reason == "stop"
        assert res.token_ids == plain[: first + 1]


def test_stop_token_ids_end_the_answer_as_eos_does(target: Target) -> None:
    """vLLM's stop_token_ids: the answer is the one without them cut after the first of them (kept), with EOS ignored
    too, with drafts whose accepted paths run past it, not before min_tokens; ids outside the vocabulary refused."""
    prompt = prompt_for(4)
    full = Generator(target).generate(prompt, max_new_tokens=30, ignore_eos=True).token_ids
    stop = full[6]
    first = full.index(stop)
    for drafter in (None, RandomDrafter(2, full, oracle_rate=1.0)):
        gen = Generator(target, drafter, tree_size=12, max_depth=6)
        res = gen.generate(prompt, max_new_tokens=30, ignore_eos=True, stop_token_ids=[stop, VOCAB - 1])
        assert (res.token_ids, res.finish_reason) == (full[: first + 1], "stop")
        # vLLM's text: without the stop token's, unless include_stop_str_in_output (streamed the same)
        assert res.text == target.decode(full[:first]) != target.decode(full[: first + 1])
        kept = dict(max_new_tokens=30, ignore_eos=True, stop_token_ids=[stop], include_stop_str_in_output=True)
        assert gen.generate(prompt, **kept).text == target.decode(full[: first + 1])
        streamed = gen.stream(prompt, max_new_tokens=30, ignore_eos=True, stop_token_ids=[stop])
        assert "".join(ev.text for ev in streamed) == res.text
    late = Generator(target).generate(prompt, max_new_tokens=30, ignore_eos=True, stop_token_ids=[stop], min_tokens=9)
    assert late.token_ids[:first] == full[:first] and stop not in late.token_ids[first:8]
    assert len(late.token_ids) >= 9 and (late.finish_reason == "length" or late.token_ids[-1] == stop)
    for bad, why in (([VOCAB], "no token id of"), ([True], "True is no token id"), ([3] * 65, "at most 64")):
        with pytest.raises(DartspecError, match=why):
            Generator(target).generate(prompt, max_new_tokens=5, stop_token_ids=bad)


def test_skip_special_tokens_false_shows_them_but_not_the_token_that_ended_the_answer(target: Target) -> None:
    """vLLM's skip_special_tokens=False: special tokens' text in the answer's (the tokenizer's own decoding of its
    tokens), whole and streamed; the EOS that ended it only with include_stop_str_in_output."""
    prompt = prompt_for(4)
    gen = Generator(target, PromptLookupDrafter(), tree_size=4)

    def decode(ids: list[int], skip: bool) -> str:
        return target.tokenizer.decode(ids, skip_special_tokens=skip)

    kw = dict(max_new_tokens=20, ignore_eos=True, logit_bias={1: 4.0})  # EOS (t1, special) often, not the end
    shown = gen.generate(prompt, skip_special_tokens=False, **kw)
    hidden = gen.generate(prompt, **kw)
    assert shown.token_ids == hidden.token_ids and 1 in shown.token_ids
    assert shown.text == decode(shown.token_ids, False) != hidden.text == decode(hidden.token_ids, True)
    assert "".join(ev.text for ev in gen.stream(prompt, skip_special_tokens=False, **kw)) == shown.text
    ended = gen.generate(prompt, max_new_tokens=20, logit_bias={1: 2.0}, skip_special_tokens=False)
    assert ended.token_ids[-1] == 1 and ended.finish_reason == "stop"
    assert ended.text == decode(ended.token_ids[:-1], False)
    kept = gen.generate(
        prompt, max_new_tokens=20, logit_bias={1: 2.0}, skip_special_tokens=False, include_stop_str_in_output=True
    )
    assert kept.text == decode(kept.token_ids, False) != ended.text


def test_stop_strings_truncate_text(target: Target) -> None:
    prompt = prompt_for(5)
    full = Generator(target).generate(prompt, max_new_tokens=30)
    words = full.text.split(" ")
    stop = " ".join(words[4:6])
    for drafter in (None, PromptLookupDrafter(min_ngram=1)):
        gen = Generator(target, drafter)
        res = gen.generate(prompt, max_new_tokens=30, stop=[stop])
        assert res.finish_reason == "stop"
        assert res.text == full.text[: full.text.index(stop)]
        streamed = "".join(e.text for e in gen.stream(prompt, max_new_tokens=30, stop=[stop]))
        assert streamed == res.text
        # vLLM's include_stop_str_in_output: the same tokens, the text through the stop string (streamed too)
        kept = gen.generate(prompt, max_new_tokens=30, stop=["t0 t0 t0", stop], include_stop_str_in_output=True)
        assert kept.token_ids == res.token_ids and kept.text == res.text + stop
        options = {"stop": [stop], "include_stop_str_in_output": True}
        assert "".join(e.text for e in gen.stream(prompt, max_new_tokens=30, **options)) == kept.text


def test_bad_inputs(target: Target) -> None:
    gen = Generator(target)
    for prompt, why in (
        ([], "non-empty"),
        ([3, VOCAB + 5], f"token id {VOCAB + 5} is outside .* vocabulary \\(0-{VOCAB - 1}\\)"),
        ([-1], "token id -1 is outside"),
        ([{"role": "x", "content": "a"}], "'role'"),
        ([3, "a"], "non-empty string, a list of chat messages, or token ids"),
    ):
        with pytest.raises(DartspecError, match=why):
            gen.generate(prompt, max_new_tokens=5)
    with pytest.raises(DartspecError, match="max_new_tokens"):
        gen.generate([3, 4], max_new_tokens=0)
    with pytest.raises(DartspecError, match="temperature"):
        gen.generate([3, 4], temperature=-1)
    short = tiny_target("llama", max_positions=16)
    with pytest.raises(ContextLengthError, match="context window"):
        Generator(short).generate(list(range(2, 30)), max_new_tokens=5)
    # Near the end of the window generation stops at the limit instead of overflowing.
    res = Generator(short, PromptLookupDrafter(min_ngram=1)).generate([5, 6, 5, 6, 5, 6, 5, 6, 5, 6], max_new_tokens=50)
    assert res.finish_reason in ("length", "stop") and len(res.token_ids) <= 6


def test_a_drafter_with_the_wrong_root_is_an_error(target: Target) -> None:
    class Bad(RandomDrafter):
        def propose(self, tokens: Sequence[int], budget: DraftBudget) -> Tree:
            return Tree.chain(tokens[-1] + 1, [])

    with pytest.raises(RuntimeError, match="root"):
        Generator(target, Bad(0)).generate([3, 4, 5], max_new_tokens=5)


def test_default_tree_size_follows_device_and_drafter(target: Target) -> None:
    """CPU: 4 nodes for free drafts (lookup), 2 for drafters that run a network each step; GPU: 16 and 32."""
    from dartspec.drafters.base import NoDrafter
    from dartspec.engine import default_tree_size

    class NetworkDrafter(NoDrafter):
        needs_features = True

    assert Generator(target, PromptLookupDrafter()).tree_size == 4
    assert Generator(target, NetworkDrafter()).tree_size == 2
    # The base class fills in the contract's optional parts, so these are whole drafters.
    assert isinstance(NetworkDrafter(), Drafter) and isinstance(RandomDrafter(0), Drafter)
    assert Generator(target).tree_size == 4
    assert default_tree_size(torch.device("cuda"), True) == 32 and default_tree_size("cuda") == 16


def test_auto_drafter_on_a_cpu_is_dart_with_lookup_where_a_drafter_ships_and_plain_decoding_on_a_gpu(
    target: Target,
) -> None:
    from dartspec.drafters import default_drafter, make_drafter
    from dartspec.engine import default_budget
    from dartspec.methods import GeneratorSpec, build_generator

    # No DART drafter ships for the tiny target: prompt lookup at its CPU size.
    gen = build_generator(target, GeneratorSpec(drafter="auto"))
    assert gen.drafter.name == "pld" and gen.tree_size == 4
    assert make_drafter("auto", target).name == "pld"
    assert default_drafter("cpu") == "pld" and default_drafter("cpu", "no-such-model") == "pld"
    assert default_drafter("cpu", "smollm2-135m") == "dart+pld"  # its drafter ships in the package
    # On a GPU plain decoding (on CUDA graphs), also where a DART drafter ships for the model: measured faster there.
    assert default_drafter(torch.device("cuda"), "smollm2-135m") == "none"
    assert default_drafter("cuda", target.name) == default_drafter("cuda") == "none"
    # dart+pld's default budget: lookup's size with DART's tree at its own on a CPU; the network's size on a GPU.
    assert default_budget("cpu", True, lookup=True) == (4, 3) and default_budget("cpu", True) == (2, None)
    assert default_budget("cpu") == (4, None) and default_budget("cpu", False, lookup=True) == (4, None)
    assert default_budget(torch.device("cuda"), True, lookup=True) == (32, None)


def test_sampling_above_the_max_draft_temperature_decodes_plainly(target: Target) -> None:
    """A hot sequence runs without its drafter (one node a step, no drafts offered), a cool one drafts; both give
    plain sampling's tokens for their seed, alone and stepped together in one forward."""
    from dartspec.methods import GeneratorSpec, build_generator

    prompt = [3, 4, 5, 3, 4, 5, 3, 4, 5, 3, 4]
    gen = Generator(target, PromptLookupDrafter(min_ngram=1), tree_size=4, max_draft_temperature=0.5)
    plain = Generator(target)
    for temperature, drafts in ((1.0, False), (0.3, True), (0.0, True)):
        out = gen.generate(prompt, max_new_tokens=24, temperature=temperature, seed=7)
        ref = plain.generate(prompt, max_new_tokens=24, temperature=temperature, seed=7)
        assert out.token_ids == ref.token_ids
        assert out.stats.drafter == ("pld" if drafts else "none") == out.stats.as_dict()["drafter"]
        assert (out.stats.tree_nodes > out.stats.target_forwards - 1) == drafts  # drafted nodes beyond the roots
        assert out.stats.as_dict().get("plain_above_temperature") == (None if drafts else 0.5)  # and why not
    hot = gen.start(prompt, max_new_tokens=16, temperature=1.0, seed=1, own_state=True)
    cool = gen.start(prompt, max_new_tokens=16, temperature=0.2, seed=2, own_state=True)
    assert (hot.tree_size, hot.drafter.name, cool.tree_size, cool.drafter.name) == (1, "none", 4, "pld")
    live = [hot, cool]
    while live:
        live = [s for s in live if gen.emit(s).result is None]
        if live:
            gen.advance_many(live)
    for seq, temperature, seed in ((hot, 1.0, 1), (cool, 0.2, 2)):
        ref = plain.generate(prompt, max_new_tokens=16, temperature=temperature, seed=seed)
        assert seq.result is not None and seq.result.token_ids == ref.token_ids
    # The command line's default drafter steps aside above 0.5 on a CPU; a drafter named on purpose never does.
    assert build_generator(target, GeneratorSpec(drafter="auto")).max_draft_temperature == 0.5
    assert build_generator(target, GeneratorSpec(drafter="pld")).max_draft_temperature is None
    with pytest.raises(DartspecError, match="max_draft_temperature"):
        Generator(target, max_draft_temperature=-1.0)


def test_a_batched_step_tells_each_drafter_what_its_share_cut(target: Target) -> None:
    budgets: list[DraftBudget] = []

    class Recording(DrafterBase):
        name = "recording"

        def propose(self, tokens: Sequence[int], budget: DraftBudget) -> Tree:
            budgets.append(budget)
            return Tree.root_only(tokens[-1])

    gen = Generator(target, Recording(), tree_size=4)
    a, b = (gen.start([3, 4, 5], max_new_tokens=8, own_state=True) for _ in range(2))
    gen.advance_many([a, b], step_rows=4)
    assert [(x.max_nodes, x.batch_cut) for x in budgets] == [(2, 2), (2, 2)]
    gen.advance(a)  # alone: its whole tree size
    assert (budgets[-1].max_nodes, budgets[-1].batch_cut) == (4, 0)


def test_a_sequence_stepped_by_hand_equals_the_stream(target: Target) -> None:
    """start / emit / advance (the per-sequence steps the stream is made of) give the same tokens and events."""
    gen = Generator(target, PromptLookupDrafter(min_ngram=1))
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    ref = list(gen.stream(prompt, max_new_tokens=24))
    seq = gen.start(prompt, max_new_tokens=24)
    events = []
    while seq.result is None:
        events.append(gen.emit(seq))
        if seq.result is None:
            gen.advance(seq)
    assert seq.result.token_ids == ref[-1].result.token_ids and seq.committed[: len(prompt)] == prompt
    assert [(e.token_ids, e.drafted, e.text) for e in events] == [(e.token_ids, e.drafted, e.text) for e in ref]
