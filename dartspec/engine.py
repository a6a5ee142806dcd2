"""The generation loop: prefill, then draft -> verify -> commit until EOS, a stop string or the limit.

The engine owns no model code: a :class:`~dartspec.runtime.TargetRuntime` runs forwards and keeps the KV
cache, a :class:`~dartspec.drafters.base.Drafter` proposes a :class:`~dartspec.tree.Tree`, and the
:class:`~dartspec.verify.Verifier` decides what is accepted. Plain decoding is the same loop with a
drafter that proposes the root alone.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dartspec.constraint import JsonConstraint, ResponseFormat, response_grammar
from dartspec.drafters.base import DraftBudget, Drafter, NoDrafter
from dartspec.errors import ContextLengthError, DartspecError
from dartspec.kv_cache import TreeKVCache
from dartspec.runtime import TargetOutput, TargetRuntime, on_cpu, sync
from dartspec.sampling import MAX_TOP_LOGPROBS, Penalties, bad_word_tokens, check_logprobs
from dartspec.tree import Tree
from dartspec.verify import SamplingParams, Verifier

__all__ = [
    "MAX_TOP_LOGPROBS",
    "GenerationResult",
    "GenerationStats",
    "Generator",
    "SequenceState",
    "StepEvent",
    "TokenLogprob",
    "sync",
]

Prompt = str | Sequence[dict[str, str]] | Sequence[int]


@dataclass
class GenerationStats:
    """What one generation cost and how well drafting worked.

    ``accept_per_depth[d]`` is the fraction of verification steps whose tree reached depth ``d + 1``
    in which a draft token at that depth was accepted.
    """

    drafter: str = ""  # the drafter this generation ran ("none" where it decoded plainly)
    prompt_tokens: int = 0
    new_tokens: int = 0
    target_forwards: int = 0
    draft_tokens_accepted: int = 0
    tree_nodes: int = 0
    seconds: float = 0.0
    times: dict[str, float] = field(
        default_factory=lambda: {"prefill": 0.0, "draft": 0.0, "tree": 0.0, "verify": 0.0, "other": 0.0}
    )
    depth_offered: list[int] = field(default_factory=list)
    depth_accepted: list[int] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # drafter-specific figures (e.g. tree_size_auto)

    @property
    def tau(self) -> float:
        """Mean tokens committed per target forward (the prefill counts as one forward, one token)."""
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def accept_per_depth(self) -> list[float]:
        return [a / o if o else 0.0 for a, o in zip(self.depth_accepted, self.depth_offered, strict=True)]

    def record_step(self, tree_depth: int, accepted: int, nodes: int) -> None:
        while len(self.depth_offered) < tree_depth:
            self.depth_offered.append(0)
            self.depth_accepted.append(0)
        for d in range(tree_depth):
            self.depth_offered[d] += 1
            self.depth_accepted[d] += int(d < accepted)
        self.target_forwards += 1
        self.draft_tokens_accepted += accepted
        self.tree_nodes += nodes

    def as_dict(self) -> dict[str, Any]:
        return {
            "drafter": self.drafter,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "tau": round(self.tau, 4),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "target_forwards": self.target_forwards,
            "draft_tokens_accepted": self.draft_tokens_accepted,
            "mean_tree_nodes": round(self.tree_nodes / max(self.target_forwards - 1, 1), 3),
            "accept_per_depth": [round(a, 4) for a in self.accept_per_depth],
            "seconds": round(self.seconds, 4),
            "times": {k: round(v, 4) for k, v in self.times.items()},
            **self.extra,
        }


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the target's own distribution at its position (before penalties,
    temperature, top-p and top-k: the logits the verifier read), the ``top`` most likely tokens there, ``(token_id,
    logprob)`` in descending order (as many as asked for), and for a prompt's tokens their ``rank`` there (1: the
    most likely; ties share the better rank; None for an answer's, where nothing shows it)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None

    def as_dict(self) -> dict[str, Any]:
        out = {"token_id": self.token_id, "logprob": self.logprob, "top": [list(t) for t in self.top]}
        if self.rank is not None:
            out["rank"] = self.rank
        return out


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int, ranks: bool = False) -> list[TokenLogprob]:
    """Each token's log-probability in the matching row of ``logits`` ``(rows, vocab)``, with the ``top`` most likely
    tokens of that row, and with ``ranks`` its rank (a pass over the vocabulary a row: a scored prompt's, not the
    decode loop's, where no answer shows it)."""
    logp = torch.log_softmax(logits.to(torch.float64), dim=-1)
    index = torch.tensor(list(tokens), device=logp.device)
    chosen = logp.gather(1, index[:, None])
    ranked = ((logp > chosen).sum(dim=-1) + 1).tolist() if ranks else [None] * len(tokens)
    values = chosen[:, 0].tolist()
    if top == 0:
        return [TokenLogprob(t, lp, rank=r) for t, lp, r in zip(tokens, values, ranked, strict=True)]
    best, ids = logp.topk(top, dim=-1)
    return [
        TokenLogprob(t, lp, tuple(zip(i, v, strict=True)), r)
        for t, lp, r, i, v in zip(tokens, values, ranked, ids.tolist(), best.tolist(), strict=True)
    ]


@dataclass(frozen=True)
class GenerationResult:
    """The finished generation: text, token ids (EOS included if produced), why it stopped, stats, and where asked
    for (``logprobs``), each token's log-probabilities."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None
    #: Where asked for (``prompt_logprobs``), those of the prompt's tokens after its first (which has none).
    prompt_logprobs: list[TokenLogprob] | None = None

    def as_dict(self) -> dict[str, Any]:
        out = {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            **self.stats.as_dict(),
        }
        if self.logprobs is not None:
            out["logprobs"] = [lp.as_dict() for lp in self.logprobs]
        if self.prompt_logprobs is not None:
            out["prompt_logprobs"] = [lp.as_dict() for lp in self.prompt_logprobs]
        return out


@dataclass(frozen=True)
class StepEvent:
    """What one engine step committed, for streaming.

    Attributes:
        token_ids: tokens committed in this step (after truncation at EOS / stop / limit).
        drafted: how many of the leading ``token_ids`` came from accepted drafts (the rest were
            produced by the target itself).
        text: new text that is safe to show (held back while it may still become a stop string or
            an incomplete UTF-8 character).
        result: set on the last event only.
        logprobs: the log-probabilities of ``token_ids``, where the generation was asked for them.
        prompt_logprobs: the first event's, those of the prompt's tokens after its first, where asked for.
    """

    token_ids: list[int]
    drafted: int
    text: str
    result: GenerationResult | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None


class _Clock:
    """Adds the wall time of each phase of a step to ``GenerationStats.times``."""

    def __init__(self, times: dict[str, float]) -> None:
        self.times = times
        self.mark = time.perf_counter()

    def restart(self) -> None:
        self.mark = time.perf_counter()

    def add(self, phase: str, seconds: float) -> None:
        """Time measured elsewhere (a batched step's shared forward) goes to ``phase``."""
        self.times[phase] += seconds

    def lap(self, phase: str, tree_seconds: float = 0.0) -> None:
        """Time since the last lap goes to ``phase``; ``tree_seconds`` of it (a drafter's tree building) to
        ``tree`` instead."""
        now = time.perf_counter()
        self.times[phase] += now - self.mark - tree_seconds
        self.times["tree"] += tree_seconds
        self.mark = now


def _path_rows(features: torch.Tensor | None, path: Sequence[int], drafter: Drafter) -> torch.Tensor | None:
    """The accepted path's rows of a verify's ``features`` for ``drafter`` (None if it reads none): a view where the
    path is nodes 0..n-1 (a chain's or a first span's; it ascends from 0, so it is when it ends at n-1), else a
    gather (indexing by a list cost ~0.15 ms a step on a CPU right after the target's forward)."""
    if features is None or not drafter.needs_features:
        return None
    n = len(path)
    if path[-1] == n - 1:
        return features[:n]
    return features.index_select(0, torch.tensor(path, device=features.device))


#: The most stop token ids one request may give (vLLM sets none; a list this long is a mistake, not a need).
MAX_STOP_TOKEN_IDS = 64


def check_token_ids(ids: Sequence[int], vocab_size: int, name: str, what: str) -> None:
    """A :class:`DartspecError` naming ``what`` (a request field) where one of ``ids`` is no token id of ``name``."""
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise DartspecError(f"{what}: {t!r} is no token id of {name} (0-{vocab_size - 1})")


def check_stop_token_ids(ids: Sequence[int], vocab_size: int, name: str) -> frozenset[int]:
    """``ids`` as a set, or a :class:`DartspecError` saying what is wrong with them."""
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise DartspecError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} token ids, got {len(ids)}")
    check_token_ids(ids, vocab_size, name, "stop_token_ids")
    return frozenset(ids)


class _TextStream:
    """Incremental detokenization that never shows text it may have to take back."""

    #: Tokens before the newest ones that are decoded again with them (the window's context: a SentencePiece
    #: token's leading space, or the bytes of a character split over tokens).
    WINDOW = 6

    def __init__(
        self, target: TargetRuntime, stop: Sequence[str], include_stop: bool = False, skip_special: bool = True
    ) -> None:
        self.target = target
        self.skip_special = skip_special  # special tokens' text left out (vLLM's skip_special_tokens)
        self.stop = [s for s in stop if s]
        self.include_stop = include_stop  # the text ends after the stop string, not before it (vLLM's option)
        self.hold = max((len(s) - 1 for s in self.stop), default=0)
        self.shown = 0
        # Decoding every committed token again at each step costs O(n^2) over an answer. Where decoding
        # concatenates (no clean-up of spaces around punctuation, which rewrites text already decoded), the text is
        # extended from a short window instead; elsewhere (or unknown tokenizers) it is decoded whole.
        tokenizer = getattr(target, "tokenizer", None)
        self.incremental = getattr(tokenizer, "clean_up_tokenization_spaces", True) is False
        self._text = ""
        self._prefix = self._read = 0  # the window: tokens [prefix:read] made the end of _text

    def full(self, token_ids: Sequence[int]) -> str:
        return self.target.decode(token_ids, self.skip_special)

    def current(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids``, one sequence that only grows between calls (the engine's answer), but for
        an incomplete last character; always a prefix of :meth:`full`. Work per call is a window, not the answer."""
        if not self.incremental or len(token_ids) < self._read:
            return self.full(token_ids)
        if len(token_ids) == self._read:
            return self._text  # nothing new since the last call (the stop check and the event share a step)
        # Incremental detokenization (as vLLM's): decode the window [prefix:] and keep what it adds to [prefix:read],
        # once it does not end in an incomplete character; the window keeps WINDOW tokens of context.
        before = self.full(token_ids[self._prefix : self._read])
        after = self.full(token_ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._text += after[len(before) :]
            self._prefix, self._read = max(0, len(token_ids) - self.WINDOW), len(token_ids)
        return self._text

    def find_stop(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def cut(self, text: str, at: int) -> str:
        """``text`` ended at its stop string found at ``at``: before it, or with ``include_stop`` after it (the first
        listed of those found there)."""
        if not self.include_stop:
            return text[:at]
        return text[: at + next(len(s) for s in self.stop if text.find(s) == at)]

    def delta(self, text: str, final: bool) -> str:
        end = len(text)
        if not final:
            end -= self.hold
            while end > self.shown and text[end - 1] == "\ufffd":
                end -= 1
        if end <= self.shown:
            return ""
        out = text[self.shown : end]
        self.shown = end
        return out


@dataclass
class SequenceState:
    """One generation's state in the engine: what was asked (prompt, limit, sampling with its RNG, stop strings,
    tree size), its target KV cache and its drafter (with the drafter's state), what is committed, what has been
    shown, and its timings. :meth:`Generator.start` makes one, :meth:`Generator.advance` steps it (or
    :meth:`Generator.advance_many` steps many in one target forward), :meth:`Generator.emit` reports it."""

    prompt_ids: list[int]
    limit: int
    verifier: Verifier
    drafter: Drafter
    cache: TreeKVCache
    tree_size: int
    max_depth: int
    text: _TextStream
    stats: GenerationStats
    started: float
    committed: list[int]
    new: list[int]
    clock: _Clock
    shown: int = 0
    drafted: int = 0
    result: GenerationResult | None = None
    #: Alternatives per token's log-probabilities (0: the token's alone), or None: none taken.
    top_logprobs: int | None = None
    #: The tokens that end this answer (none with ``ignore_eos``).
    eos: frozenset[int] = frozenset()
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of ``new``, where taken
    prompt_logprobs: list[TokenLogprob] | None = None  # of the prompt's tokens after its first, where asked for


#: Prompt tokens scored per forward where their log-probabilities are asked for: each chunk's logits become
#: log-probabilities and are dropped (all of a long prompt's at once would be prompt x vocabulary floats, 5 GB for 8K
#: tokens of Qwen). A multiple of the runtimes' own prefill chunks (64, 512), so that the forwards, and the first
#: token, are those of a plain prefill.
SCORE_CHUNK = 512


def _score_prompt(
    target: TargetRuntime, prompt_ids: list[int], top: int, features: bool, cache: TreeKVCache
) -> tuple[TargetOutput, list[TokenLogprob]]:
    """Prefill ``prompt_ids`` into ``cache`` as :meth:`TargetRuntime.prefill` does (its output: the last position's
    logits), taking the log-probabilities of the prompt's tokens after its first on the way."""
    scored: list[TokenLogprob] = []
    feats = []
    for start in range(0, len(prompt_ids), SCORE_CHUNK):
        end = min(start + SCORE_CHUNK, len(prompt_ids))
        out = target.prefill(prompt_ids[start:end], features=features, cache=cache, all_logits=True)
        following = prompt_ids[start + 1 : end + 1]  # row i predicts the token after prompt_ids[start + i]
        scored += token_logprobs(out.logits[: len(following)], following, top, ranks=True)
        feats.append(out.features)
    argmax = None if out.argmax is None else out.argmax[-1:]
    return TargetOutput(out.logits[-1:], torch.cat(feats) if features else None, argmax=argmax), scored


def default_tree_size(device: Any, feature_drafter: bool = False) -> int:
    """The fastest fixed tree size measured for the shipped drafters (BENCHMARKS.md). On a GPU, where the verify
    cost is flat: 32 for drafters that run a network per step (DART on one H200, float32: 1.50x / 1.71x plain
    decoding at 32 nodes, 1.48x / 1.66x at 16, MT-Bench / HumanEval), 16 for the others. On a CPU 2 for those
    drafters (DART, EAGLE-3: at today's acceptance deeper drafts do not pay for their verification; DART on the
    exact-a16 runtime, MT-Bench: 1.04x plain at 2 nodes, 1.03x at 3, 1.00x at 4) and 4 for prompt lookup
    (drafting is free)."""
    if not on_cpu(device):
        return 32 if feature_drafter else 16
    return 2 if feature_drafter else 4


#: On a CPU, the nodes (root included) of a ``dart+pld`` tree that DART's own tree may take: the rest of the budget is
#: the spans'. 80 development prompts (ShareGPT 14000+), 128 new tokens, interleaved: on a 2-core AVX-512 EPYC, where
#: a third row costs 8% of a two-row step, 1.31x plain decoding at 3 against 1.22x at 2 (tau 2.08 / 1.87); on a
#: 2-core AVX2 Zen 3, where rows cost more, 1.19x against 1.21x (BENCHMARKS.md).
CPU_LOOKUP_DRAFT_NODES = 3


#: On a CPU, the longest context (prompt and answer so far, in tokens) in which ``dart+pld``'s network drafts by
#: default; past it the lookup's spans alone (:class:`dartspec.drafters.hybrid.HybridDrafter`). SmolLM2 on a 2-core
#: EPYC, summaries of joined development prompts (ShareGPT 14000+, 96 new tokens, 8 prompts a length, interleaved),
#: decoding speed over plain decoding's: the default 1.21x / 1.27x / 0.94x / 0.72x at 430 / 630 / 800 / 1,370 tokens,
#: prompt lookup alone 1.24x / 1.34x / 1.13x / 0.98x (BENCHMARKS.md).
CPU_LOOKUP_DRAFT_CONTEXT = 512


def default_draft_context(device: Any, feature_drafter: bool = False, lookup: bool = False) -> int | None:
    """The context past which a hybrid's network stops drafting by default (None: never): on a CPU
    :data:`CPU_LOOKUP_DRAFT_CONTEXT` for a drafter that merges lookup spans with a network's tree."""
    return CPU_LOOKUP_DRAFT_CONTEXT if on_cpu(device) and lookup and feature_drafter else None


def default_budget(device: Any, feature_drafter: bool = False, lookup: bool = False) -> tuple[int, int | None]:
    """The default tree size and the network drafter's share of it (None: no cap). A drafter that merges prompt lookup's
    spans with a network's tree (``lookup``, e.g. ``dart+pld``) gets the larger of the two defaults: on a CPU prompt
    lookup's 4 nodes, DART's tree at most :data:`CPU_LOOKUP_DRAFT_NODES` of them (spans are often right for several
    tokens, DART's guesses past the second rarely pay there; on 80 development prompts a share of 2 ran at 1.29x plain
    decoding against 1.21x for one shared budget of 2 and 1.20x for prompt lookup alone, a share of 3 faster still
    where rows are cheaper). On a GPU the network's default (32) is the larger: no cap."""
    size = default_tree_size(device, feature_drafter)
    if not (lookup and feature_drafter):
        return size, None
    spans = default_tree_size(device, False)
    return (size, None) if size >= spans else (spans, min(CPU_LOOKUP_DRAFT_NODES, spans))


class Generator:
    """Speculative generation with a target and a drafter; lossless by construction.

    Example::

        target = load_target("smollm2-135m")  # dartspec.targets
        gen = Generator(target, PromptLookupDrafter())
        result = gen.generate([{"role": "user", "content": "Hi!"}], max_new_tokens=64)
        print(result.text, result.stats.tau)
    """

    def __init__(
        self,
        target: TargetRuntime,
        drafter: Drafter | None = None,
        *,
        tree_size: int | None = None,
        max_depth: int = 8,
        max_draft_temperature: float | None = None,
        sampled_drafts: bool = False,
    ):
        """``tree_size`` None: :func:`default_tree_size` for the target's device and the drafter.
        ``max_draft_temperature``: a sequence sampled at a higher temperature decodes plainly (no drafter, one node
        a step), since a flatter distribution accepts fewer drafts than their verification costs where rows are
        not free (a CPU: :func:`dartspec.drafters.default_max_draft_temperature`); None: every sequence drafts.
        ``sampled_drafts``: a sampled sequence's drafter draws its tree from its own distribution where it can
        (DART's), and the verifier tests the draws by rejection (:mod:`dartspec.verify`): more drafts accepted, and
        a seed no longer gives plain sampling's tokens (the distribution stays the target's)."""
        drafter = drafter if drafter is not None else NoDrafter()
        tree_size = default_tree_size(target.device, drafter.needs_features) if tree_size is None else tree_size
        if tree_size < 1 or max_depth < 0:
            raise DartspecError(f"tree size must be >= 1 and depth >= 0 (got {tree_size}, {max_depth})")
        if max_draft_temperature is not None and not max_draft_temperature >= 0:
            raise DartspecError(f"max_draft_temperature must be >= 0 or None (got {max_draft_temperature})")
        self.target = target
        self.drafter: Drafter = drafter
        self.tree_size = tree_size
        self.max_depth = max_depth
        self.max_draft_temperature = max_draft_temperature
        self.sampled_drafts = sampled_drafts

    def encode(self, prompt: Prompt, chat: bool | None = None) -> list[int]:
        """Token ids for a prompt: a string (chat template applied if ``chat``), messages, or ids."""
        if isinstance(prompt, str):
            if chat:
                return self.target.encode_chat([{"role": "user", "content": prompt}])
            return self.target.encode(prompt)
        items = list(prompt)
        if items and all(isinstance(m, dict) for m in items):
            if chat is False:
                raise DartspecError("a list of chat messages needs the chat template (chat=True)")
            for m in items:
                if not isinstance(m.get("content"), str) or m.get("role") not in (
                    "system",
                    "user",
                    "assistant",
                ):
                    raise DartspecError(
                        "each chat message needs a 'role' (system/user/assistant) and a 'content' string"
                    )
            return self.target.encode_chat(items)
        if items and all(isinstance(t, int) for t in items):
            bad = next((t for t in items if not 0 <= t < self.target.vocab_size), None)
            if bad is None:
                return items
            last = self.target.vocab_size - 1
            raise DartspecError(f"token id {bad} is outside {self.target.name}'s vocabulary (0-{last})")
        raise DartspecError("the prompt must be a non-empty string, a list of chat messages, or token ids")

    def generate(self, prompt: Prompt, **kwargs: Any) -> GenerationResult:
        """Generate to completion; keyword arguments as for :meth:`stream`."""
        for event in self._events(prompt, False, **kwargs):
            if event.result is not None:
                return event.result
        raise AssertionError("the stream ended without a result")

    def stream(self, prompt: Prompt, **params: Any) -> Iterator[StepEvent]:
        """Yield a :class:`StepEvent` per target forward; the last one carries the result. Keyword arguments as
        for :meth:`start` (``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``, ``stop``,
        ``chat``, the penalties).

        Closing the iterator early (e.g. a client disconnect) simply ends the generation.
        """
        return self._events(prompt, True, **params)

    def _events(self, prompt: Prompt, text: bool, **params: Any) -> Iterator[StepEvent]:
        """:meth:`stream`'s events; ``text`` False: only the last one carries text (see :meth:`emit`)."""
        seq = self.start(prompt, **params)
        while True:
            event = self.emit(seq, text)
            yield event
            if event.result is not None:
                return
            self.advance(seq)  # its clock restarts there: the consumer's time between events is not ours

    def start(
        self,
        prompt: Prompt,
        *,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        chat: bool | None = None,
        own_state: bool = False,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        logit_bias: Mapping[int, float] | None = None,
        response_format: ResponseFormat = "text",
        min_tokens: int = 0,
        ignore_eos: bool = False,
        stop_token_ids: Sequence[int] = (),
        include_stop_str_in_output: bool = False,
        allowed_token_ids: Sequence[int] | None = None,
        bad_words: Sequence[str | Sequence[int]] | None = (),
        skip_special_tokens: bool = True,
    ) -> SequenceState:
        """Check the request, prefill the prompt and take the first token: a sequence for :meth:`emit` and
        :meth:`advance`. ``prompt``: text (``chat`` applies the chat template), chat messages or token ids;
        ``stop``: strings that end the text (not included). ``own_state``: the sequence gets a KV cache and a
        drafter (:meth:`~dartspec.drafters.base.Drafter.fork`) of its own, so that it can be stepped beside others
        (:meth:`advance_many`); otherwise it uses the runtime's cache and the generator's drafter (one sequence at
        a time, their buffers and learned settings reused). ``logprobs``: take each committed token's
        log-probability with that many alternatives (0 to :data:`MAX_TOP_LOGPROBS`; None: none): the target's own,
        before penalties and temperature. ``prompt_logprobs``: the same for the prompt's tokens after its first
        (:attr:`GenerationResult.prompt_logprobs`, scoring a text: OpenAI's ``echo``, vLLM's ``prompt_logprobs``);
        ``max_new_tokens`` may then be 0 (the prompt scored, nothing generated). ``repetition_penalty``,
        ``presence_penalty``, ``frequency_penalty``, ``logit_bias`` (token id -> bias):
        :class:`~dartspec.sampling.Penalties`; greedy decoding takes the argmax of the penalised logits.
        ``response_format="json_object"``: the answer is a JSON object; a mapping: a JSON
        Schema (:mod:`dartspec.json_schema`) the answer follows; either decoded under the constraint of
        :mod:`dartspec.constraint` (greedy: the most likely allowed token; sampling: the target's distribution
        restricted to the allowed tokens), and ending where the document does. ``min_tokens``: EOS cannot
        come before that many tokens (vLLM's; not with a JSON answer, which must end where its object does);
        ``ignore_eos``: EOS does not end the answer (vLLM's, for load tests), only a stop string or the limit.
        ``stop_token_ids``: more tokens that end the answer as EOS does (vLLM's; kept in the token ids, not in the
        text; with ``ignore_eos`` too; not before ``min_tokens``). ``include_stop_str_in_output``: the text ends after
        the stop string or stop token that ended it, not before (vLLM's).
        ``allowed_token_ids``: only these tokens can be chosen (vLLM's; EOS only if listed; not with a structured
        answer). ``bad_words``: words the answer never contains (vLLM's: each word's last token is impossible where the
        answer ends with the rest of it, the word tokenized as at the start of a text and after a space; a list of token
        ids is a bad word already tokenized). ``skip_special_tokens=False``: special tokens' text is in the answer's
        text (vLLM's; the EOS or stop token that ended it only with ``include_stop_str_in_output``)."""
        penalties = Penalties(
            repetition_penalty,
            presence_penalty,
            frequency_penalty,
            logit_bias or (),
            allowed_token_ids,  # type: ignore[arg-type]
            bad_word_tokens(bad_words or (), lambda word: self.target.encode(word, add_special_tokens=False)),
        )
        params = SamplingParams(
            temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, penalties=penalties, min_p=min_p
        )
        check_logprobs(logprobs)
        check_logprobs(prompt_logprobs, "prompt_logprobs")
        scoring = prompt_logprobs is not None
        if type(max_new_tokens) is not int or max_new_tokens < (0 if scoring else 1):
            raise DartspecError(
                f"max_new_tokens must be a positive integer (0 only to score the prompt, with prompt_logprobs), got "
                f"{max_new_tokens!r}"
            )
        grammar = response_grammar(response_format, min_tokens)
        target, drafter = self.target, self.drafter
        penalties.check_vocabulary(target.vocab_size, target.name)
        stops = check_stop_token_ids(stop_token_ids, target.vocab_size, target.name)
        if penalties.allowed is not None and grammar is not None:  # the grammar could leave no allowed token
            raise DartspecError(
                "allowed_token_ids cannot be combined with a structured answer (JSON, a regex or a choice)"
            )
        if penalties.bad_words and grammar is not None:  # the same: every token the grammar allows could be banned
            raise DartspecError("bad_words cannot be combined with a structured answer (JSON, a regex or a choice)")
        if penalties.allowed is not None and min_tokens and set(penalties.allowed) <= target.eos_token_ids | stops:
            raise DartspecError("with min_tokens, allowed_token_ids must allow a token that does not end the answer")
        prompt_ids = self.encode(prompt, chat)
        room = target.max_context - len(prompt_ids)
        if room < min(max_new_tokens, 1):
            raise ContextLengthError(
                f"the prompt is {len(prompt_ids)} tokens but {target.name} has a context window of "
                f"{target.max_context} tokens"
            )
        constraint = None if grammar is None else JsonConstraint(target.token_texts, grammar)
        verifier = Verifier(
            params,
            sampled_drafts=self.sampled_drafts,
            prompt_ids=prompt_ids,
            constraint=constraint,
            min_tokens=min_tokens,
            eos=target.eos_token_ids | stops,
        )
        stats = GenerationStats(prompt_tokens=len(prompt_ids))
        plain = self.max_draft_temperature is not None and params.temperature > self.max_draft_temperature
        if plain:  # say why a generator with a drafter did not draft (--json, the CLI's stats line)
            drafter = NoDrafter()
            stats.extra["plain_above_temperature"] = self.max_draft_temperature
        stats.drafter = drafter.name
        started = time.perf_counter()
        if own_state:
            cache, drafter = target.new_cache(), drafter.fork()
        else:
            cache = target.cache
            target.reset()
        drafter.begin(prompt_ids)
        scored = None
        if prompt_logprobs is None:
            out = target.prefill(prompt_ids, features=drafter.needs_features, cache=cache)
        else:
            out, scored = _score_prompt(target, prompt_ids, prompt_logprobs, drafter.needs_features, cache)
        drafter.observe(prompt_ids, out.features)
        stats.target_forwards = 1
        new = []
        if max_new_tokens:
            new.append(verifier.next_token(out.logits[0], None if out.argmax is None else out.argmax[0]))
        stats.times["prefill"] = time.perf_counter() - started
        taken = [] if logprobs is None else token_logprobs(out.logits[: len(new)], new, logprobs)
        return SequenceState(
            prompt_ids=list(prompt_ids),
            limit=min(max_new_tokens, room),
            verifier=verifier,
            drafter=drafter,
            cache=cache,
            tree_size=1 if plain else self.tree_size,
            max_depth=self.max_depth,
            text=_TextStream(target, stop, include_stop_str_in_output, skip_special_tokens),
            stats=stats,
            started=started,
            committed=[*prompt_ids, *new],
            new=new,
            clock=_Clock(stats.times),
            top_logprobs=logprobs,
            logprobs=taken,
            prompt_logprobs=scored,
            eos=stops if ignore_eos else target.eos_token_ids | stops,
        )

    def emit(self, seq: SequenceState, text: bool = True) -> StepEvent:
        """What ``seq`` has to show now; when it is finished (EOS, a stop string, the limit) the event carries the
        result and ``seq.result`` is set. ``text`` False: the event's text is empty until the last one, which has
        all of it (detokenizing a window at every step cost ~0.1 ms of a CPU step that nobody read in
        :meth:`generate`)."""
        finish = self._finish_reason(seq.new, seq.limit, seq.text, seq.eos, seq.shown)  # what was shown held no EOS
        if finish is not None:
            new, final_text = self._truncate(seq.new, seq.limit, seq.text, seq.eos)
            stats = seq.stats
            stats.new_tokens = len(new)
            stats.seconds = time.perf_counter() - seq.started
            stats.extra.update(seq.drafter.report())
            logprobs = seq.logprobs[: len(new)] if seq.top_logprobs is not None else None
            seq.result = GenerationResult(final_text, new, finish, stats, logprobs, seq.prompt_logprobs)
            last = new[seq.shown :]
            last_logprobs = logprobs[seq.shown :] if logprobs is not None else None
            delta = seq.text.delta(final_text, True)
            scored = seq.prompt_logprobs if seq.shown == 0 else None
            return StepEvent(last, min(seq.drafted, len(last)), delta, seq.result, last_logprobs, scored)
        shown = seq.text.delta(seq.text.current(seq.new), False) if text else ""
        logprobs = seq.logprobs[seq.shown :] if seq.top_logprobs is not None else None
        scored = seq.prompt_logprobs if seq.shown == 0 else None  # the first event (every later one shows tokens)
        event = StepEvent(seq.new[seq.shown :], seq.drafted, shown, logprobs=logprobs, prompt_logprobs=scored)
        seq.shown = len(seq.new)
        seq.clock.lap("other")
        return event

    def advance(self, seq: SequenceState) -> None:
        """One step of ``seq``: propose, verify, accept, commit (see :meth:`advance_many`)."""
        self.advance_many([seq])

    def advance_many(self, seqs: Sequence[SequenceState], step_rows: int | None = None) -> None:
        """One speculative step of every sequence in ``seqs`` (unfinished, each with its own cache) with one target
        forward: each drafter proposes a tree, the target scores them all together, each verifier accepts a path,
        the target keeps that path's cache entries and the drafter sees what was committed. ``step_rows`` caps the
        rows of the forward: each sequence's tree gets ``step_rows // len(seqs)`` nodes at most (at least its
        root), so trees shrink as the batch grows."""
        if len({id(s.cache) for s in seqs}) != len(seqs):
            raise DartspecError("sequences stepped together need KV caches of their own (start(own_state=True))")
        share = max(1, step_rows // len(seqs)) if step_rows else None
        trees = [self._propose(seq, share) for seq in seqs]
        items = [(tree, seq.cache) for tree, seq in zip(trees, seqs, strict=True)]
        bases = [seq.cache.length for seq in seqs]
        t0 = time.perf_counter()
        outs = self.target.verify_many(items, features=any(s.drafter.needs_features for s in seqs))
        verify_s = time.perf_counter() - t0
        for seq, tree, base, out in zip(seqs, trees, bases, outs, strict=True):
            seq.clock.add("verify", verify_s)  # each sequence waited for the whole forward
            self._accept(seq, tree, base, out)

    def _propose(self, seq: SequenceState, share: int | None) -> Tree:
        """``seq``'s drafter proposes a tree within the budget (its tree size, cut to ``share`` nodes in a batch;
        checked)."""
        seq.clock.restart()
        drafter = seq.drafter
        nodes = seq.tree_size if share is None else min(seq.tree_size, share)
        budget = DraftBudget(
            max_nodes=max(1, min(nodes, self.target.max_context - seq.cache.length)),
            max_depth=max(0, min(seq.max_depth, seq.limit - len(seq.new) - 1)),
            batch_cut=seq.tree_size - nodes,
            sampling=seq.verifier.draft_sampling,
        )
        tree = drafter.propose(seq.committed, budget)
        seq.clock.lap("draft", drafter.last_tree_seconds)
        if tree.tokens[0] != seq.committed[-1] or tree.size > budget.max_nodes or tree.max_depth > budget.max_depth:
            raise RuntimeError(f"drafter {drafter.name!r} proposed a tree outside its budget or root")
        return tree

    def _accept(self, seq: SequenceState, tree: Tree, base: int, out: TargetOutput) -> None:
        """The verifier accepts a path of ``tree``; the cache keeps it, the drafter and the sequence take it."""
        seq.clock.restart()
        acc = seq.verifier.accept(tree, out.logits, out.argmax)
        self.target.commit(base, acc.path, seq.cache)
        seq.clock.lap("verify")
        drafter = seq.drafter
        drafter.observe([seq.committed[-1], *acc.tokens[:-1]], _path_rows(out.features, acc.path, drafter))
        seq.stats.record_step(tree.max_depth, acc.accepted_drafts, tree.size)
        seq.committed.extend(acc.tokens)
        seq.new.extend(acc.tokens)
        if seq.top_logprobs is not None:  # token i of the path was chosen from the logits of its node i
            rows = out.logits.index_select(0, torch.tensor(acc.path, device=out.logits.device))
            seq.logprobs.extend(token_logprobs(rows, acc.tokens, seq.top_logprobs))
        seq.drafted = acc.accepted_drafts
        seq.clock.lap("other")

    @staticmethod
    def _finish_reason(
        new: list[int], limit: int, text: _TextStream, eos: frozenset[int], checked: int = 0
    ) -> str | None:
        """Why the answer ``new`` is finished, or None; its first ``checked`` tokens are known to hold none of ``eos``
        (a scan of the whole answer at every step would cost O(n^2) over it)."""
        if any(t in eos for t in new[checked:]):
            return "stop"
        if text.stop and text.find_stop(text.current(new)) is not None:
            return "stop"
        if len(new) >= limit:
            return "length"
        return None

    @staticmethod
    def _truncate(new: list[int], limit: int, text: _TextStream, eos: frozenset[int]) -> tuple[list[int], str]:
        """Cut the committed tokens at the first of ``eos``, stop string or the token limit. A token of ``eos`` that
        ended the answer stays in its tokens but not in its text (vLLM's: an EOS or a stop token id's text shows only
        with ``include_stop_str_in_output``)."""
        cut = next((i + 1 for i, t in enumerate(new) if t in eos), len(new))
        new = new[: min(cut, limit)]
        ended = bool(new) and new[-1] in eos and not text.include_stop
        full = text.full(new[:-1] if ended else new)
        at = text.find_stop(full)
        if at is not None:
            # Keep the fewest tokens whose text contains the stop string; the text ends before it.
            keep = next(n for n in range(1, len(new) + 1) if text.find_stop(text.full(new[:n])) is not None)
            new = new[:keep]
            full = text.cut(full, at)
        return new, full
