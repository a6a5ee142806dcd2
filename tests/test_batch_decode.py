"""Static-batch decoding (data generation) against transformers' own ``generate`` on each prompt alone."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, tiny_model, tiny_target, tiny_tokenizer

from dartspec.batch_decode import decode_batch
from dartspec.errors import DartspecError
from dartspec.lean import LeanTarget
from dartspec.target import Target


def runtime(kind: str, arch: str):
    """A tiny target whose LM head is its own random matrix: with the tied one, greedy decoding of these random
    models mostly repeats the last token, which would hide a wrong position or a leak from padding."""
    model = tiny_model(arch)
    torch.manual_seed(7)
    model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight))
    if kind == "hf":
        return Target(model, tiny_tokenizer(), name=f"tiny-{arch}")
    return LeanTarget(model, tiny_tokenizer(), name=f"lean-{arch}")


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 24, (n,), generator=g)
    return [torch.randint(2, VOCAB, (int(k),), generator=g).tolist() for k in lengths]


@pytest.mark.parametrize(
    ("kind", "arch"),
    [("hf", "llama"), ("hf", "qwen3"), ("hf", "gemma3")] + [("lean", a) for a in ("llama", "qwen2", "qwen3", "gemma3")],
)
def test_greedy_batch_equals_generate_on_each_prompt_alone(kind: str, arch: str) -> None:
    target = runtime(kind, arch)
    batch = prompts(9)
    # Stop tokens taken from the free-running answers at different depths end rows at different steps, so
    # finished rows are dropped from the batch (and its cache) mid-way.
    free = decode_batch(target, batch, 30, stop_ids=frozenset())
    stops = frozenset(a.tokens[(3 * i) % 30] for i, a in enumerate(free[:4]))
    got = decode_batch(target, batch, 30, stop_ids=stops)
    assert len({len(a.tokens) for a in got}) > 2
    for prompt, answer in zip(batch, got, strict=True):
        ref = target.model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=30,
            eos_token_id=sorted(stops),
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        assert answer.tokens == ref
        assert answer.finished == (ref[-1] in stops)


@pytest.mark.parametrize("kind", ["hf", "lean"])
def test_reads_every_few_steps_and_prefill_in_row_slices_change_nothing(kind: str) -> None:
    """A device reads the new tokens back every few steps and prefills large batches in slices of rows (stacked
    into one cache): rows that end between reads, and rows prefilled apart, still give each prompt's own answer."""
    target = runtime(kind, "llama")
    batch = prompts(11, seed=5)
    free = decode_batch(target, batch, 24, stop_ids=frozenset())
    stops = frozenset(a.tokens[(5 * i) % 24] for i, a in enumerate(free[:5]))
    want = decode_batch(target, batch, 24, stop_ids=stops)
    assert len({len(a.tokens) for a in want}) > 2
    width = max(len(p) for p in batch)
    for every, slots in [(3, 10**6), (8, 3 * width), (1, width), (50, 2 * width)]:
        got = decode_batch(target, batch, 24, stop_ids=stops, check_every=every, prefill_slots=slots)
        assert got == want, (every, slots)


def test_sampling_follows_the_tempered_distribution_and_the_seed() -> None:
    target = tiny_target("llama")
    prompt = [5, 9, 17]
    rows = 4000
    got = decode_batch(target, [prompt] * rows, 1, temperature=0.7, seed=3, stop_ids=frozenset())
    counts = torch.bincount(torch.tensor([a.tokens[0] for a in got]), minlength=VOCAB).double()
    target.reset()
    probs = torch.softmax(target.prefill(prompt).logits[-1].double() / 0.7, dim=-1)
    sigma = (rows * probs * (1 - probs)).sqrt()
    assert ((counts - rows * probs).abs() <= 5 * sigma + 1).all()
    again = decode_batch(target, [prompt] * 50, 6, temperature=0.7, seed=3)
    other = decode_batch(target, [prompt] * 50, 6, temperature=0.7, seed=4)
    assert again == decode_batch(target, [prompt] * 50, 6, temperature=0.7, seed=3)
    assert again != other


def test_bad_requests_are_clear_errors() -> None:
    target = tiny_target("llama")
    with pytest.raises(DartspecError, match="empty"):
        decode_batch(target, [[3, 4], []], 4)
    with pytest.raises(DartspecError, match="max_new_tokens"):
        decode_batch(target, [[3, 4]], 0)
    assert decode_batch(target, [], 4) == []
