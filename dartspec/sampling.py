"""What a request asks of the target's distribution (temperature, top-p, top-k, seed, penalties and logit bias),
checked without torch: the command line refuses bad values before it imports anything heavy (:mod:`dartspec.verify`
warps and samples with them, :mod:`dartspec.penalties` applies the penalties)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from dartspec.errors import DartspecError

__all__ = ["MAX_LOGIT_BIAS", "MAX_PENALTY", "MAX_TOP_LOGPROBS", "Penalties", "SamplingParams", "check_logprobs"]

#: The most alternatives a token's log-probabilities list (OpenAI's ``top_logprobs`` limit).
MAX_TOP_LOGPROBS = 20


def check_logprobs(logprobs: object, name: str = "logprobs") -> None:
    """``logprobs`` asks for each token's log-probability with that many alternatives (None: none)."""
    if logprobs is not None and not (type(logprobs) is int and 0 <= logprobs <= MAX_TOP_LOGPROBS):
        raise DartspecError(f"{name} must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {logprobs!r}")


#: The largest presence / frequency penalty and logit bias, either sign (OpenAI's ranges).
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class Penalties:
    """Changes to the target's logits before temperature, top-k and top-p, in the order of transformers and vLLM:

    1. ``logit_bias``: added to the named tokens' logits (OpenAI's; ``(token_id, bias)`` pairs, or give a mapping);
    2. ``repetition``: for every token in the prompt or the answer so far, a positive logit divided by it, a negative
       one multiplied (transformers' and vLLM's ``repetition_penalty``; 1 = off);
    3. ``frequency`` and ``presence``: subtracted, the first once per time the token occurs in the answer so far, the
       second once if it occurs there at all (OpenAI's ``frequency_penalty`` / ``presence_penalty``; as in vLLM they
       count the answer, not the prompt);
    4. ``allowed``: where given, every other token is impossible (vLLM's ``allowed_token_ids``; EOS only if listed);
    5. ``bad_words``: token sequences the answer never contains: a sequence's last token is impossible where the answer
       so far ends with the rest of it (vLLM's ``bad_words``, tokenized: :func:`bad_word_tokens`; as vLLM, the
       answer, not the prompt, is what a sequence's beginning is looked for in).

    Speculative decoding stays lossless under them: the verifier applies them to each tree node's logits with the
    history up to that node (:mod:`dartspec.penalties`), so what it accepts is what plain decoding with the same
    penalties would produce.
    """

    repetition: float = 1.0
    presence: float = 0.0
    frequency: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed: tuple[int, ...] | None = None
    bad_words: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if not (_number(self.repetition) and self.repetition > 0):
            raise DartspecError(f"repetition_penalty must be a finite number > 0 (1 = off), got {self.repetition!r}")
        for name, value in (("presence_penalty", self.presence), ("frequency_penalty", self.frequency)):
            if not (_number(value) and abs(value) <= MAX_PENALTY):
                raise DartspecError(f"{name} must be a number from -{MAX_PENALTY:g} to {MAX_PENALTY:g}, got {value!r}")
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if self.allowed is not None:
            ids = list(self.allowed)
            if not ids or not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0 for t in ids):
                raise DartspecError(f"allowed_token_ids must be a non-empty list of token ids, got {self.allowed!r}")
            object.__setattr__(self, "allowed", tuple(sorted({int(t) for t in ids})))
        object.__setattr__(self, "bad_words", _token_sequences(self.bad_words))

    def check_vocabulary(self, vocab_size: int, model: str) -> None:
        """Refuse a logit bias naming a token outside ``model``'s vocabulary of ``vocab_size`` tokens."""
        bad = next((t for t, _ in self.logit_bias if t >= vocab_size), None)
        if bad is not None:
            raise DartspecError(f"logit_bias names token {bad}, outside {model}'s vocabulary (0-{vocab_size - 1})")
        if self.allowed is not None and self.allowed[-1] >= vocab_size:
            last = self.allowed[-1]
            raise DartspecError(
                f"allowed_token_ids names token {last}, outside {model}'s vocabulary (0-{vocab_size - 1})"
            )
        bad = next((t for word in self.bad_words for t in word if t >= vocab_size), None)
        if bad is not None:
            raise DartspecError(f"bad_words names token {bad}, outside {model}'s vocabulary (0-{vocab_size - 1})")

    @property
    def active(self) -> bool:
        """Whether anything changes the logits (False: the verifier skips this stage altogether)."""
        changed = self.repetition != 1 or self.presence != 0 or self.frequency != 0 or bool(self.logit_bias)
        return changed or self.allowed is not None or bool(self.bad_words)


#: The most bad words a generation may ban (each variant is looked for at every tree row of every step).
MAX_BAD_WORDS = 128


def _token_sequences(words: object) -> tuple[tuple[int, ...], ...]:
    """``bad_words`` as distinct non-empty token-id tuples, checked."""
    try:
        seqs = [tuple(word) for word in words]  # type: ignore[union-attr]
    except TypeError:
        raise DartspecError(f"bad_words must be token-id sequences, got {words!r}") from None
    for seq in seqs:
        if not seq or not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0 for t in seq):
            raise DartspecError(f"a bad word must be a non-empty sequence of token ids, got {list(seq)!r}")
    out = tuple(dict.fromkeys(tuple(int(t) for t in seq) for seq in seqs))
    if len(out) > 2 * MAX_BAD_WORDS:
        raise DartspecError(f"at most {MAX_BAD_WORDS} bad words")
    return out


def bad_word_tokens(
    words: Sequence[str | Sequence[int]], encode: Callable[[str], list[int]]
) -> tuple[tuple[int, ...], ...]:
    """Bad words as the token sequences the answer must not contain, as vLLM bans them: a word (a string) at the start
    of a text and after a space (its tokens differ: " word" is often one token and "word" another), ``encode``
    tokenizing without special tokens; a sequence of token ids as it is."""
    if isinstance(words, str) or any(isinstance(w, str) and not w.strip() for w in words):
        raise DartspecError(f"bad_words must be a list of non-empty strings (or token-id lists), got {words!r}")
    if len(words) > MAX_BAD_WORDS:
        raise DartspecError(f"at most {MAX_BAD_WORDS} bad words, got {len(words)}")
    seqs: list[Sequence[int]] = []
    for word in words:
        seqs += [encode(p + word.lstrip()) for p in ("", " ")] if isinstance(word, str) else [word]
    return _token_sequences(seqs)


def _bias_pairs(bias: object) -> tuple[tuple[int, float], ...]:
    """``(token_id, bias)`` pairs sorted by id from a mapping or pairs, each checked (a bias of 0 dropped)."""
    items: Iterable[object] = bias.items() if isinstance(bias, Mapping) else bias  # type: ignore[assignment]
    try:
        pairs = [tuple(item) for item in items]  # type: ignore[arg-type]
    except TypeError:
        raise DartspecError(f"logit_bias must map token ids to biases, got {bias!r}") from None
    out: dict[int, float] = {}
    for pair in pairs:
        if len(pair) != 2:
            raise DartspecError(f"logit_bias must map token ids to biases, got {bias!r}")
        token, value = pair
        if not (isinstance(token, numbers.Integral) and not isinstance(token, bool) and token >= 0):
            raise DartspecError(f"a logit_bias token must be a token id (an integer >= 0), got {token!r}")
        token = int(token)
        if not (_number(value) and abs(value) <= MAX_LOGIT_BIAS):
            limit = f"{MAX_LOGIT_BIAS:g}"
            raise DartspecError(f"a logit_bias value must be a number from -{limit} to {limit}, got {value!r}")
        if token in out:
            raise DartspecError(f"logit_bias names token {token} twice")
        out[token] = float(value)
    return tuple(sorted((t, v) for t, v in out.items() if v != 0))


@dataclass(frozen=True)
class SamplingParams:
    """How the target's next-token distribution is warped; ``temperature == 0`` means greedy.

    The order is the one transformers uses: the penalties (:class:`Penalties`), temperature, then top-k, then top-p,
    then min-p (tokens less likely than ``min_p`` times the most likely one dropped; 0 = off).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    penalties: Penalties = field(default_factory=Penalties)
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)):
            raise DartspecError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.temperature < 0:
            raise DartspecError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise DartspecError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise DartspecError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (_number(self.min_p) and 0 <= self.min_p <= 1):
            raise DartspecError(f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**64):
            # torch's generators take 64 bits: a larger seed was an overflow traceback at the first draw
            raise DartspecError(f"seed must be an integer from 0 to 2**64 - 1, got {self.seed!r}")
        if not isinstance(self.penalties, Penalties):
            raise DartspecError(f"penalties must be a dartspec.sampling.Penalties, got {self.penalties!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def truncates(self) -> bool:
        """Whether top-k, top-p or min-p cut the distribution (its tail then depends on which tokens are allowed)."""
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0
