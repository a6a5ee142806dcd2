"""Lossless verification of a draft tree against the target's logits.

Greedy: follow the children whose token equals the target's argmax; the argmax at the last accepted
node is the bonus token. Sampling: at the current node draw ``y ~ p`` (the target's warped
distribution) and descend into the child carrying ``y`` if there is one, else emit ``y`` as the bonus.
Every committed token is therefore an exact draw from the target's distribution, whatever the drafter
proposed (method.md section 6, the "simpler equivalent form" of recursive rejection for a
deterministic tree).

Each committed token consumes exactly one uniform number from the verifier's generator, and tokens
are drawn by inverse CDF. So with a fixed seed, speculative sampling commits the same tokens as plain
sampling (up to float rounding between batched and single-token forwards): drafting changes speed,
never the output.

A sampled tree (some children drawn from the drafter's own distribution q, which the tree records as a
:class:`~dartspec.tree.Proposal`; ``--sampled-drafts``) is walked by recursive rejection instead: at a node with
residual r (first the warped target distribution), the i-th draw x of a proposal, made from q without the tokens
drawn before it (q_i), is accepted with probability min(1, r(x) / q_i(x)); a rejection leaves r <- (r - q_i)+,
renormalised. Then the node's fixed children as above (accept x with r(x), else drop it from r), and with every
candidate rejected the bonus token is drawn from r. Each test is one speculative-sampling step against the residual,
so the committed token is an exact draw from the target's distribution; a draft is kept with probability sum_x
min(r, q_i) instead of r(x), up to 1.75x more often at temperature 1 on SmolLM2 (BENCHMARKS.md). Each test takes a
uniform of its own, so the seed no longer gives plain sampling's tokens.

Penalties and a logit bias (:class:`~dartspec.sampling.Penalties`) are applied to the rows before any of this, each
row with the history up to its own node (:mod:`dartspec.penalties`): what is walked is then the distribution plain
decoding under the same penalties would sample from, so every rule above stays exact. A constraint on the answer
(JSON mode, a JSON Schema, a tool call: :mod:`dartspec.constraint`) is consulted at each node walked, with the grammar
state after that node's path: the token chosen there is the target's choice among the allowed tokens, as plain
decoding's would be (sampled trees are then walked by matching).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dartspec import json_grammar as jg
from dartspec.constraint import JsonConstraint, stuck_error
from dartspec.penalties import PenaltyState
from dartspec.sampling import SamplingParams
from dartspec.tree import DraftSampling, Tree


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The sampling distribution over the vocabulary (float64, sums to 1) for one row of logits."""
    scores = logits.double() / params.temperature
    if 0 < params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, -math.inf)
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1:
        sorted_p, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the token crossing it included).
        drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        drop[0] = False
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
        probs = probs / probs.sum()
    if params.min_p > 0:  # the most likely token always stays
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
        probs = probs / probs.sum()
    return probs


def sample(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw: the first token whose cumulative mass exceeds ``u * total`` (``probs`` need not sum to 1),
    never a token of zero mass."""
    cdf = probs.cumsum(-1)
    point = torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype, device=cdf.device)  # rows may be on a GPU
    idx = int(torch.searchsorted(cdf, point, right=True))
    if idx < probs.shape[-1]:
        return idx
    return int(torch.nonzero(probs)[-1])  # rounding put u * total at the very end: the last token with mass


@dataclass(frozen=True)
class Acceptance:
    """The outcome of verifying one tree.

    Attributes:
        path: accepted node indices from the root (always starts with 0).
        tokens: the newly committed tokens: the accepted draft tokens, then the bonus token.
    """

    path: list[int]
    tokens: list[int]

    @property
    def accepted_drafts(self) -> int:
        return len(self.path) - 1


class Verifier:
    """Accepts the longest path of a tree that the target would have produced itself."""

    def __init__(
        self,
        params: SamplingParams,
        *,
        sampled_drafts: bool = False,
        prompt_ids: Sequence[int] = (),
        constraint: JsonConstraint | None = None,
        min_tokens: int = 0,
        eos: frozenset[int] = frozenset(),
    ) -> None:
        """``sampled_drafts``: a sampled request's drafter may draw its tree (:attr:`draft_sampling`, seeded with the
        request), whose draws this verifier then tests by rejection; False: drafts are matched, and a seed gives
        plain sampling's tokens. ``prompt_ids``: the history the repetition penalty starts from (with penalties,
        the verifier keeps the answer's history itself: every token it returns is taken as committed).
        ``constraint``: the answer must follow it (:mod:`dartspec.constraint`); every token returned is committed to
        it too. Sampled trees are then walked by matching (their proposals ignored: still exact). ``min_tokens``: rows
        before the answer's n-th token cannot choose the ``eos`` tokens."""
        self.params = params
        self.penalties = PenaltyState(params.penalties, prompt_ids) if params.penalties.active else None
        self.constraint = constraint
        self._min_tokens, self._eos = min_tokens, eos
        self._answer = 0  # tokens committed
        self._rng = torch.Generator(device="cpu")
        self._rng.manual_seed(params.seed if params.seed is not None else torch.seed())
        self.draft_sampling = None
        if sampled_drafts and not params.greedy and constraint is None:  # constrained: drafts are matched
            rng = np.random.default_rng(None if params.seed is None else [params.seed, 1])
            self.draft_sampling = DraftSampling(params.temperature, rng)

    def _uniform(self) -> float:
        return float(torch.rand((), generator=self._rng, dtype=torch.float64))

    def next_token(self, logits: torch.Tensor, argmax: torch.Tensor | None = None) -> int:
        """One token from one row of logits (used after prefill, where there is no tree); ``argmax``: the row's
        argmax where the runtime took it already."""
        rows, argmax = self._rows(logits[None], None if argmax is None else argmax.reshape(1), None)
        token = self._choose(rows[0], None if argmax is None else int(argmax[0]), self._state())
        self._commit([token])
        return token

    def _rows(
        self, logits: torch.Tensor, argmax: torch.Tensor | None, tree: Tree | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rows the walk reads (row i after node i of ``tree``; None: one row after the committed answer): the
        penalties and the EOS ban of ``min_tokens`` applied, each row by its own path; ``argmax`` kept only where
        nothing changed them."""
        if self.penalties is not None:
            logits, argmax = self.penalties(logits, tree), None
        if self._answer < self._min_tokens:
            depth = np.zeros(1, dtype=np.int64) if tree is None else tree.depth
            logits, argmax = self._without_eos(logits, depth), None
        return logits, argmax

    def _state(self) -> jg.State | None:
        return None if self.constraint is None else self.constraint.state

    def _without_eos(self, logits: torch.Tensor, depth: np.ndarray) -> torch.Tensor:
        """``logits`` with the EOS ids at -inf in the rows (at those depths below the committed answer) that come
        before the answer's ``min_tokens``-th token."""
        rows = np.flatnonzero(self._answer + depth < self._min_tokens)
        ids = [t for t in self._eos if t < logits.shape[-1]]
        if not len(rows) or not ids:
            return logits
        logits = logits.clone()
        index = torch.from_numpy(rows).to(logits.device)
        logits[index[:, None], torch.tensor(ids, device=logits.device)[None, :]] = -math.inf
        return logits

    def _commit(self, tokens: list[int]) -> None:
        self._answer += len(tokens)
        if self.penalties is not None:
            self.penalties.commit(tokens)
        if self.constraint is not None:
            self.constraint.commit(tokens)

    def _choose(self, logits: torch.Tensor, argmax: int | None = None, state: jg.State | None = None) -> int:
        """One token from one row: the argmax or a draw, among the tokens the constraint allows after ``state``."""
        constraint = self.constraint
        if self.params.greedy:
            if constraint is None:
                return int(logits.argmax()) if argmax is None else argmax
            return constraint.greedy(logits, state, argmax)  # type: ignore[arg-type]
        if constraint is None:
            return sample(warp(logits, self.params), self._uniform())
        if self.params.truncates:  # top-k / top-p / min-p over the allowed tokens only: the whole mask needed
            allowed = constraint.mask(state, logits.shape[-1], logits.device)  # type: ignore[arg-type]
            if not bool(allowed.any()):
                raise stuck_error()
            return sample(warp(logits.masked_fill(~allowed, -math.inf), self.params), self._uniform())
        probs = warp(logits, self.params)
        return constraint.sample(probs, state, lambda p: sample(p, self._uniform()))  # type: ignore[arg-type]

    def accept(self, tree: Tree, logits: torch.Tensor, argmax: torch.Tensor | None = None) -> Acceptance:
        """Walk ``tree`` with the target's ``logits`` (row i = distribution after node i); ``argmax``: each row's
        argmax where the runtime took it already (:attr:`TargetOutput.argmax`)."""
        logits, argmax = self._rows(logits, argmax, tree)
        acc = self._walk(tree, logits, argmax)
        self._commit(acc.tokens)
        return acc

    def _walk(self, tree: Tree, logits: torch.Tensor, argmax: torch.Tensor | None = None) -> Acceptance:
        constraint = self.constraint
        if tree.proposals and not self.params.greedy and constraint is None:
            return self._accept_by_rejection(tree, logits)
        greedy = None
        if self.params.greedy:
            greedy = (logits.argmax(-1) if argmax is None else argmax).tolist()
        state = self._state()
        node = 0
        path = [0]
        tokens: list[int] = []
        while True:
            if greedy is not None and constraint is None:
                token = greedy[node]
            else:
                token = self._choose(logits[node], None if greedy is None else greedy[node], state)
            tokens.append(token)
            child = tree.child_with_token(node, token)
            if child is None:
                return Acceptance(path, tokens)
            if constraint is not None:  # the grammar state at the child: after the token just chosen
                state = constraint.after(state, token)  # type: ignore[arg-type]
            node = child
            path.append(child)

    def _accept_by_rejection(self, tree: Tree, logits: torch.Tensor) -> Acceptance:
        """Walk a sampled tree by recursive rejection (module docstring): at each node its proposals' draws in draw
        order, then its fixed children, then the bonus from what is left of the target's distribution."""
        node, path, tokens = 0, [0], []
        while True:
            residual = warp(logits[node], self.params).cpu().numpy().copy()  # rows may be on a GPU
            child = self._test_children(tree, node, residual)
            if child is None:
                tokens.append(sample(torch.from_numpy(residual), self._uniform()))
                return Acceptance(path, tokens)
            tokens.append(int(tree.tokens[child]))
            path.append(child)
            node = child

    def _test_children(self, tree: Tree, node: int, residual: np.ndarray) -> int | None:
        """The child of ``node`` the rejection tests accept, or None (``residual`` is then what the bonus token is
        drawn from; it is updated in place)."""
        proposal = tree.proposals.get(node)
        drawn = proposal.draws if proposal is not None else ()
        for i, child in enumerate(drawn):
            assert proposal is not None
            q = _without(proposal.probs, proposal.at[:i])  # the i-th draw's law: q less the earlier draws
            token = int(tree.tokens[child])
            if self._uniform() * q[proposal.at[i]] < residual[token]:
                return child
            residual[proposal.ids] = np.maximum(residual[proposal.ids] - q, 0.0)
            if not _renormalised(residual):
                return child  # r <= q everywhere: the test accepts surely, and only rounding rejected it
        for child in tree.children(node):
            if child in drawn:
                continue
            token = int(tree.tokens[child])
            if self._uniform() < residual[token]:
                return child
            residual[token] = 0.0
            if not _renormalised(residual):
                return child  # the token had all the mass
        return None


def _renormalised(residual: np.ndarray) -> bool:
    """Scale ``residual`` to sum to 1 in place; False where nothing is left (within rounding) to scale."""
    mass = float(residual.sum())
    if mass <= 1e-12:
        return False
    residual /= mass
    return True


def _without(probs: np.ndarray, at: Sequence[int]) -> np.ndarray:
    """``probs`` with the entries ``at`` removed, renormalised: the law of a draw without replacement after those."""
    if not at:
        return probs
    probs = probs.copy()
    probs[list(at)] = 0.0
    return probs / probs.sum()
