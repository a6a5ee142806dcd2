"""JSON-constrained decoding (any object, and a JSON Schema): token masks equal a brute-force check of every token
against the text so far, the lazy greedy and sampling choices are the masked argmax and the masked law, and with any
drafter the engine commits what a naive constrained loop over transformers' forward commits (greedy and seeded
sampling)."""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from conftest import VOCAB, tiny_target
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine import RandomDrafter

from dartspec import json_grammar as jg
from dartspec.constraint import SAMPLE_TRIES, JsonConstraint, TokenTexts
from dartspec.drafters import PromptLookupDrafter
from dartspec.engine import Generator
from dartspec.errors import DartspecError
from dartspec.json_schema import compile_schema
from dartspec.sampling import SamplingParams
from dartspec.target import Target
from dartspec.verify import Verifier, sample, warp

EOS = 1
# A vocabulary of JSON pieces (ids 2..): single characters, multi-closers, keys with their colon, quote-carrying and
# escape-carrying pieces, whitespace runs and words; id 0 a special token (decodes to nothing), 1 EOS.
_PIECES = [
    *'{}[]",: \n-+.0123456789eEabfilnrstuxyz\\/\t',
    '"}',
    "}}",
    "]}",
    "}]",
    "},",
    '",',
    '":',
    '{"',
    '["',
    '"a":',
    ' "b": ',
    ", ",
    ": ",
    "\n  ",
    "  ",
    "true",
    "false",
    "null",
    "12",
    "3.5",
    "1e3",
    "-0",
    '\\"',
    "\\n",
    "\\u00e9",
    "\\u",
    "00",
    "ab",
    "cat",
    " and",
    "é",
    "\x01",
    '"]}',
    *"cdghjkmopqvw",  # the rest of the alphabet, and keys of a tool call (tests/test_serve.py)
    '"name": ',
    '"arguments": ',
]
PIECES = ["", "", *_PIECES] + [f"w{i}" for i in range(VOCAB - 2 - len(_PIECES))]
assert len(PIECES) == VOCAB


def fake_decode(ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """The fake pieces' text (they hold no special tokens: ``skip_special_tokens`` changes nothing)."""
    return "".join(PIECES[i] for i in ids)


# A schema the fake vocabulary can write: keys in order, a required bounded integer, an enum array, a bounded nullable
# string, a string a pattern checks (its tokens split and join its characters).
SCHEMA = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": -5, "maximum": 500},
        "b": {"type": "array", "items": {"enum": ["cat", "ab", 3.5]}, "maxItems": 3},
        "n": {"type": ["string", "null"], "maxLength": 4},
        "p": {"type": "string", "pattern": "^(ab|c|\u00e9)+[0-9]?$", "maxLength": 5},
        "q": {"type": "string", "pattern": "^(ab|c|\u00e9)+[0-9]?$|^b"},
        "r": {"type": "string", "pattern": "^[a-z]*$", "maxLength": 3},
    },
    "required": ["a"],
}
OBJECT = jg.Grammar.any_object()
# Plain text a regular expression matches (vLLM's guided_regex): quotes, escapes and whitespace are plain characters.
REGEX = jg.Grammar.regex('(ab|cat|c){8,}( [a-z0-9]+)*( and "x\\\\")?\\n?')
# An object of two or three keys, other keys among them (read whole until two differ: a repeat counts once); in it
# objects whose keys a pattern checks, or a list of names
BOUNDED = {
    "type": "object",
    "properties": {
        "a": {"type": "integer"},
        "m": {"patternProperties": {"^(ab|c)+$": {"enum": ["cat"]}}},
        "k": {"propertyNames": {"enum": ["ab", "cat"]}, "additionalProperties": {"const": 3.5}},
    },
    "additionalProperties": {"enum": ["cat", 3.5]},
    "minProperties": 2,
    "maxProperties": 3,
}
GRAMMARS = {"json_object": OBJECT, "schema": compile_schema(SCHEMA), "regex": REGEX, "bounded": compile_schema(BOUNDED)}


def texts() -> TokenTexts:
    return TokenTexts.of(fake_decode, VOCAB, frozenset({EOS}), anchor=PIECES.index("ab"))


def brute_allowed(prefix: str, grammar: jg.Grammar = OBJECT) -> np.ndarray:
    """Every token checked against the whole text so far, from the start (no incremental state, no shortcuts)."""
    out = np.zeros(VOCAB, dtype=bool)
    whole = grammar.advance(grammar.start(), prefix.encode())
    for token in range(VOCAB):
        if token == EOS:
            out[token] = whole is not None and grammar.complete(whole)
        elif PIECES[token]:
            out[token] = grammar.advance(grammar.start(), (prefix + PIECES[token]).encode()) is not None
    return out


def random_prefix(rng: np.random.Generator, steps: int, grammar: jg.Grammar = OBJECT) -> list[int]:
    """A valid answer prefix: tokens drawn among the allowed ones (brute force)."""
    ids: list[int] = []
    for _ in range(steps):
        allowed = np.flatnonzero(brute_allowed(fake_decode(ids), grammar))
        allowed = allowed[allowed != EOS]
        if not len(allowed):
            break
        ids.append(int(rng.choice(allowed)))
    return ids


def test_token_texts_keep_each_tokens_bytes() -> None:
    t = texts()
    assert t.pieces[2] == b"{" and t.pieces[0] == b"" and t.pieces[PIECES.index("é")] == "é".encode()
    assert not t.string_safe[PIECES.index('"}')] and not t.string_safe[PIECES.index("\n")]
    assert t.string_safe[PIECES.index("cat")] and not t.string_safe[EOS] and not t.string_safe[0]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), steps=st.integers(0, 25), kind=st.sampled_from(sorted(GRAMMARS)))
def test_masks_equal_a_brute_force_check_of_every_token(seed: int, steps: int, kind: str) -> None:
    grammar = GRAMMARS[kind]
    constraint = JsonConstraint(texts(), grammar)
    ids = random_prefix(np.random.default_rng(seed), steps, grammar)
    constraint.commit(ids)
    got = constraint.mask(constraint.state, VOCAB + 4, torch.device("cpu"))
    want = brute_allowed(fake_decode(ids), grammar)
    assert got[:VOCAB].numpy().tolist() == want.tolist() and not got[VOCAB:].any()
    for token in range(VOCAB):
        assert (constraint.after(constraint.state, token) is not None) == want[token]


@pytest.mark.parametrize(
    "prefix",
    [
        *('{"a":1,"n":"', '{"a":1,"n":"a', '{"a":1,"n":"ab', '{"a":1,"n":"abc', '{"a": 1', "{", '{"a":1,"p":"a'),
        *(
            '{"a":1,"p":"c',
            '{"a":1,"q":"',
            '{"a":1,"q":"c',
            '{"a":1,"q":"a',
            '{"a":1,"q":"b',
            '{"a":1,"q":"bc',
            '{"a":1,"q":"\\u00',
            '{"a":1,"r":"ab',
        ),
    ],
)
def test_masks_near_a_strings_bound_and_between_tokens_equal_a_brute_force_check(prefix: str) -> None:
    """The masks' shortcuts at the states they serve: a bounded string with 4, 3, 2 and 1 characters of room (a
    token fits by its length), places where whitespace changes nothing (a token led by it goes by what follows), and
    inside a string a pattern checks."""
    grammar = GRAMMARS["schema"]
    constraint = JsonConstraint(texts(), grammar)
    constraint.commit(_tokenize(prefix))
    got = constraint.mask(constraint.state, VOCAB, torch.device("cpu"))
    assert got.numpy().tolist() == brute_allowed(prefix, grammar).tolist()


@pytest.mark.parametrize(
    "prefix",
    [
        *('{"m":{"', '{"m":{"ab', '{"m":{"abc', '{"m":{"ab":"cat","'),
        *('{"k":{"', '{"k":{"ab":3.5,"', '{"a":1,"', '{"a":1,"c'),
    ],
)
def test_masks_at_keys_a_pattern_or_a_list_checks_equal_a_brute_force_check(prefix: str) -> None:
    grammar = GRAMMARS["bounded"]
    constraint = JsonConstraint(texts(), grammar)
    constraint.commit(_tokenize(prefix))
    got = constraint.mask(constraint.state, VOCAB, torch.device("cpu"))
    want = brute_allowed(prefix, grammar)
    assert got.numpy().tolist() == want.tolist() and want.any()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), steps=st.integers(0, 20), bury=st.booleans(), kind=st.sampled_from(sorted(GRAMMARS)))
def test_greedy_takes_the_most_likely_allowed_token(seed: int, steps: int, bury: bool, kind: str) -> None:
    rng = np.random.default_rng(seed)
    grammar = GRAMMARS[kind]
    constraint = JsonConstraint(texts(), grammar)
    ids = random_prefix(rng, steps, grammar)
    constraint.commit(ids)
    allowed = torch.from_numpy(brute_allowed(fake_decode(ids), grammar))
    row = torch.tensor(rng.normal(size=VOCAB))
    if bury:  # every refused token more likely than any allowed one (past the first GREEDY_TRIES: the whole mask)
        row[~allowed] += 100.0
    want = int(row.masked_fill(~allowed, -torch.inf).argmax())
    assert constraint.greedy(row, constraint.state) == want


def test_sampling_draws_from_the_restricted_distribution() -> None:
    """A chi-square test of the lazy redraws (and of the whole-mask path a truncated distribution takes) against the
    target's warped distribution restricted to the allowed tokens."""
    from scipy.stats import chi2 as chi2_dist

    rng = np.random.default_rng(5)
    logits = torch.tensor(rng.normal(size=VOCAB) * 2)
    for prefix, params in (
        ('{"a": ', SamplingParams(temperature=1.0, seed=0)),
        ('{"a": [1, ', SamplingParams(temperature=0.7, seed=0, top_k=12)),
        ("{", SamplingParams(temperature=1.3, seed=0, top_p=0.9)),
    ):
        ids = _tokenize(prefix)
        allowed = torch.from_numpy(brute_allowed(prefix))
        if params.truncates:
            want = warp(logits.masked_fill(~allowed, -torch.inf), params).numpy()
        else:
            want = warp(logits, params).masked_fill(~allowed, 0.0).numpy()
            want = want / want.sum()
        n = 4000
        counts = Counter()
        for i in range(n):
            constraint = JsonConstraint(texts(), OBJECT)
            constraint.commit(ids)
            verifier = Verifier(SamplingParams(**{**params.__dict__, "seed": i}), constraint=constraint)
            counts[verifier.next_token(logits)] += 1
        assert all(want[t] > 0 for t in counts), prefix
        keep = want > 0
        expected = want[keep] * n
        observed = np.array([counts[t] for t in np.flatnonzero(keep)])
        chi2 = float(((observed - expected) ** 2 / expected).sum())
        assert chi2_dist.sf(chi2, df=keep.sum() - 1) > 1e-3, (prefix, chi2)


def _tokenize(text: str) -> list[int]:
    """Single-character pieces for ``text`` (each character is a piece of its own)."""
    return [PIECES.index(c) for c in text]


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def target(request: pytest.FixtureRequest) -> Target:
    target = tiny_target(request.param, seed=3)
    target.__dict__["token_texts"] = texts()  # the fake pieces, so that the tiny vocabulary can write JSON
    return target


PROMPT = [5, 9, 3, 17, 5, 9, 3, 17, 5, 9, 40, 2, 33, 5, 9]


def naive_decode(target: Target, n: int, temperature: float, seed: int, grammar: jg.Grammar) -> list[int]:
    """Plain constrained decoding written out: transformers' forward over the whole sequence, the allowed tokens by
    brute force over the text so far, the masked argmax or a draw from the masked distribution (the verifier's
    generator seeded as it seeds it, and redrawing as the module docstring says: up to SAMPLE_TRIES lazy redraws, then
    one draw among all allowed tokens; the law of this is checked above)."""
    rng = torch.Generator().manual_seed(seed)
    answer: list[int] = []
    while len(answer) < n and (not answer or answer[-1] != EOS):
        with torch.no_grad():
            logits = target.model(torch.tensor([PROMPT + answer])).logits[0, -1].double()
        allowed = torch.from_numpy(brute_allowed(fake_decode(answer), grammar))
        if temperature == 0:
            answer.append(int(logits.masked_fill(~allowed, -torch.inf).argmax()))
            continue
        probs = warp(logits, SamplingParams(temperature=temperature, seed=seed))
        for _ in range(SAMPLE_TRIES):  # draw; a refused token is dropped and the draw repeated, so many times
            token = sample(probs, float(torch.rand((), generator=rng, dtype=torch.float64)))
            if allowed[token]:
                break
            probs = probs.clone()
            probs[token] = 0.0
        else:  # then one draw among the allowed tokens
            token = sample(probs.masked_fill(~allowed, 0.0), float(torch.rand((), generator=rng, dtype=torch.float64)))
        answer.append(token)
    return answer


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("kind", sorted(GRAMMARS))
def test_any_drafter_commits_what_a_naive_constrained_loop_does(target: Target, temperature: float, kind: str) -> None:
    grammar = GRAMMARS[kind]
    fmt = {"schema": SCHEMA, "regex": REGEX, "bounded": BOUNDED}.get(kind, kind)
    ref = naive_decode(target, 40, temperature, 4, grammar)
    assert grammar.advance(grammar.start(), fake_decode(ref[:-1] if ref[-1] == EOS else ref).encode()) is not None
    for drafter in [None, PromptLookupDrafter(min_ngram=1), RandomDrafter(seed=2, reference=ref, oracle_rate=0.8)]:
        gen = Generator(target, drafter, tree_size=6, max_depth=4)
        out = gen.generate(PROMPT, max_new_tokens=40, temperature=temperature, seed=4, response_format=fmt)
        assert out.token_ids == ref, drafter
        if isinstance(drafter, RandomDrafter):
            assert out.stats.draft_tokens_accepted > 5
    if ref[-1] == EOS and kind != "regex":  # a whole object, then the end
        value = json.loads(fake_decode(ref[:-1]))
        if kind == "bounded":
            assert 2 <= len(value) <= 3, value
    if ref[-1] == EOS and kind == "regex":
        assert re.fullmatch('(ab|cat|c){8,}( [a-z0-9]+)*( and "x\\\\")?\n?', fake_decode(ref[:-1]))


def test_a_vocabulary_that_cannot_write_json_is_a_clear_error() -> None:
    target = tiny_target("llama", seed=3, layers=2)  # its tokens are words "t0".."t95": no "{"
    with pytest.raises(DartspecError, match="no token of the vocabulary continues the constrained answer"):
        Generator(target).generate(PROMPT, max_new_tokens=4, response_format="json_object")
    with pytest.raises(DartspecError, match="response_format must be one of text, json_object or a JSON schema"):
        Generator(target).generate(PROMPT, max_new_tokens=4, response_format="json_schema")
    with pytest.raises(DartspecError, match="backreferences are not supported"):
        Generator(target).generate(PROMPT, max_new_tokens=4, response_format={"type": "string", "pattern": "(a)\\1"})
