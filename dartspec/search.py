"""Turning a parallel drafter's d rows of log-probabilities into a small draft tree.

Builders, all returning :class:`~dartspec.tree.Tree`:

- :class:`BeamTree`: DART's n-gram-guided beam search (method.md section 3).
- :class:`DDTree`: best-first over rank tuples of the per-depth marginals (method.md section 5).
- :class:`ChainTree`: the top-1 token per depth.
- :func:`sampled_tree`: another builder's tree with a token drawn from the first row at a sampled request's
  temperature, for the rejection verifier.

They share :func:`top_candidates` (per-depth top-k, renormalised) and never keep global state.
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from dartspec.ngram import MergedNgram, NgramModel, _address
from dartspec.tree import DraftBudget, Proposal, Tree
from dartspec.verify import sample

# Drafted EOS nodes rank below every other node (still kept if the budget allows).
EOS_PENALTY = 1e6


class Scorer(Protocol):
    order: int

    def prob(self, contexts: np.ndarray, candidates: np.ndarray) -> np.ndarray: ...


def top_candidates(logp: torch.Tensor, k: int, d2t: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Per depth, the top-``k`` target token ids and their log-probs renormalised over those k (in C on a CPU
    where dartspec's kernels build: the same ids, the renormalisation in doubles instead of floats)."""
    k = min(k, logp.shape[-1])
    kernel = _c_top_candidates() if logp.device.type == "cpu" and logp.dim() == 2 and logp.shape[0] else None
    if kernel is not None:
        rows = logp.float().contiguous()
        table = None if d2t is None else np.ascontiguousarray(d2t, dtype=np.int64)
        ids = np.empty((rows.shape[0], k), dtype=np.int64)
        lp = np.empty((rows.shape[0], k), dtype=np.float64)
        done = kernel(
            rows.data_ptr(),
            rows.shape[0],
            rows.shape[1],
            rows.shape[1],
            k,
            None if table is None else _address(table),
            _address(ids),
            _address(lp),
        )
        if done == 0:
            return ids, lp
    vals, idx = torch.topk(logp.float(), k, dim=-1)
    vals = vals - torch.logsumexp(vals, dim=-1, keepdim=True)
    ids = idx.cpu().numpy()
    return (d2t[ids] if d2t is not None else ids), vals.cpu().numpy().astype(np.float64)


@dataclass(frozen=True)
class ChainTree:
    """Top-1 per depth: a single path."""

    def __call__(
        self, root: int, logp: torch.Tensor, d2t: np.ndarray | None, tokens: Sequence[int], budget: DraftBudget
    ) -> Tree:
        depth = min(logp.shape[0], budget.max_depth, budget.max_nodes - 1)
        if depth <= 0:
            return Tree.root_only(root)
        best = logp[:depth].argmax(-1).cpu().numpy()
        return Tree.chain(root, (d2t[best] if d2t is not None else best).tolist())


def sampled_tree(
    builder: Callable[..., Tree],
    root: int,
    logp: torch.Tensor,
    d2t: np.ndarray | None,
    tokens: Sequence[int],
    budget: DraftBudget,
) -> Tree:
    """A sampled request's tree (``budget.sampling`` set): one token drawn from the first row at the request's
    temperature, tested first by rejection against that row (its :class:`~dartspec.tree.Proposal`), in the tree
    ``builder`` makes deterministically (the drawn token's node keeps the continuation the builder gave it; a token
    the tree lacks takes the place of its last node, as a leaf), whose other nodes the verifier then matches against
    what the rejection leaves of the target's distribution (:mod:`dartspec.verify`). On SmolLM2's development prompts
    at temperature 1 the draw is accepted 0.37 of the time against 0.21 for the row's top-1 by matching; deeper rows
    are marginals over the unknown token above, so below depth 1 the builder's n-gram-guided choices stay."""
    sampling = budget.sampling
    assert sampling is not None
    if budget.max_nodes < 2 or budget.max_depth < 1 or not logp.shape[0]:
        return Tree.root_only(root)
    row = logp[0].double().cpu().numpy() / sampling.temperature
    probs = np.exp(row - row.max())
    probs /= probs.sum()
    at = sample(torch.from_numpy(probs), sampling.rng.random())
    ids = np.arange(len(probs)) if d2t is None else d2t
    token = int(ids[at])
    tree = builder(root, logp, d2t, tokens, budget)
    drawn = tree.child_with_token(0, token)
    if drawn is None:  # the tree's last node is a leaf (topological order): the draw takes its place
        if tree.size >= budget.max_nodes:
            tree = tree.subtree(range(1, tree.size - 1))
        tree = tree.with_paths([[token]], budget.max_nodes)
        drawn = tree.child_with_token(0, token)
    return Tree(tree.tokens, tree.parents, {0: Proposal(ids, probs, (drawn,), (at,))})


@dataclass(frozen=True)
class BeamParams:
    """DART's published search settings."""

    top_k: int = 25
    beam_width: int = 20
    level_decay: float = 0.7  # weight (l+1)^-level_decay
    logit_decay: float = 0.9  # draft term weight logit_decay^l
    ngram_weight: float = 0.5
    eps: float = 1e-10


class BeamTree:
    """DART's beam search; the tree is the global top-R expanded nodes, kept prefix-closed.

    Path score = sum over levels l of (l+1)^-0.7 * [0.9^l * log p_draft + 0.5 * log p_ngram]; no n-gram
    term at level 0; beams ending in EOS are not expanded and rank last.
    """

    def __init__(self, params: BeamParams | None = None, ngram: Scorer | None = None, eos_ids: Sequence[int] = ()):
        self.params = params or BeamParams()
        self.ngram = ngram
        self._static = _static_ngram(ngram)  # what the C search scores with (False: it cannot)
        self.cap_width = True  # narrow beam + early stop (exact, see the loop); False: full published search
        self.use_c = True  # the same search in C (search.c) where the kernels build and the n-gram is a static one
        self.eos = np.array(sorted(eos_ids), dtype=np.int64)
        self._eos_ids = self.eos.tolist()

    def __call__(
        self, root: int, logp: torch.Tensor, d2t: np.ndarray | None, tokens: Sequence[int], budget: DraftBudget
    ) -> Tree:
        p = self.params
        depth = min(logp.shape[0], budget.max_depth, budget.max_nodes - 1)  # deeper levels cannot be kept
        if depth <= 0 or budget.max_nodes <= 1:
            return Tree.root_only(root)
        if self.cap_width and depth == 1:
            return self._one_level(root, logp[0], d2t, budget.max_nodes - 1)
        cand, cand_lp = top_candidates(logp[:depth], p.top_k, d2t)
        fast = self._c_search(root, cand, cand_lp, tokens, budget) if self.use_c else None
        if fast is not None:
            return fast
        order = self.ngram.order if self.ngram is not None else 1
        history = np.array(list(tokens)[-(order - 1) :] if order > 1 else [], dtype=np.int64)

        # Per level: the kept nodes' tokens, parents (node indices, -1 = root) and scores; node i of the tree is
        # the i-th kept node in level order.
        level_tokens: list[np.ndarray] = []
        level_parents: list[np.ndarray] = []
        level_scores: list[np.ndarray] = []
        count = 0
        # Beam state: node index (-1 = root), score, last (order-1) tokens of committed text + path.
        beam_nodes = np.array([-1])
        beam_scores = np.array([0.0])
        beam_ctx = history[None, :]
        room = budget.max_nodes - 1
        for level in range(depth):
            w = (level + 1) ** -p.level_decay
            if self.cap_width and count >= room:
                # Scores never rise along a path, so once no node of this level can beat the R-1 best
                # nodes so far (a prefix-closed set), neither this level nor any deeper one can be kept.
                best = beam_scores.max() + w * (
                    p.logit_decay**level * cand_lp[level].max() + p.ngram_weight * np.log1p(p.eps)
                )
                if best < np.partition(np.concatenate(level_scores), -room)[-room]:
                    break
            score = beam_scores[:, None] + w * p.logit_decay**level * cand_lp[level][None, :]
            kk = cand.shape[1]
            cands = np.broadcast_to(cand[level], (len(beam_nodes), kk))
            if self.ngram is not None and level > 0:
                pn = self.ngram.prob(beam_ctx, cands)
                score = score + w * p.ngram_weight * np.log(pn + p.eps)
            flat = score.reshape(-1)
            n_keep = min(p.beam_width, flat.size)
            if self.cap_width:
                # A non-EOS node with R-1 non-EOS nodes above it at its level can never make the final
                # top R-1 (scores only fall along a path; EOS nodes rank last), so a beam of R-1 plus
                # the EOS entries builds the same tree with less n-gram work.
                n_eos = len(beam_nodes) * int(self._is_eos(cand[level]).sum())
                n_keep = min(n_keep, budget.max_nodes - 1 + n_eos)
            top = np.argpartition(-flat, n_keep - 1)[:n_keep]
            top = top[np.argsort(-flat[top], kind="stable")]
            b_idx, c_idx = np.divmod(top, kk)
            new_tokens = cands[b_idx, c_idx]
            alive = ~self._is_eos(new_tokens)
            scores = flat[top]
            level_tokens.append(new_tokens)
            level_parents.append(beam_nodes[b_idx])
            # EOS ends a branch: it may be drafted but is never expanded further.
            level_scores.append(np.where(alive, scores, scores - EOS_PENALTY))
            new_nodes = count + np.arange(len(top))
            count += len(top)
            if not alive.any():
                break
            beam_nodes = new_nodes[alive]
            beam_scores = scores[alive]
            ctx = np.concatenate([beam_ctx[b_idx], new_tokens[:, None]], axis=1)[alive]
            # The last order-1 tokens (all of them while the text is shorter, as at the start of a sequence).
            beam_ctx = ctx[:, max(0, ctx.shape[1] - (order - 1)) :] if order > 1 else ctx[:, :0]
        parents = np.concatenate(level_parents).tolist()
        kept = self._top_closed(parents, np.concatenate(level_scores).tolist(), budget)
        return Tree.from_nodes(root, np.concatenate(level_tokens).tolist(), parents, kept)

    def _c_search(
        self, root: int, cand: np.ndarray, cand_lp: np.ndarray, tokens: Sequence[int], budget: DraftBudget
    ) -> Tree | None:
        """The search in C (``search.c``: the same scores, so the same tree wherever no two scores tie), or None
        where it does not apply: no C kernels here, an n-gram other than one static model, sizes beyond its limits."""
        kernel, static = _c_beam_search(), self._static
        if kernel is None or static is False:
            return None
        p = self.params
        tables: tuple[int, ...] = (0, 0, 0, 0, 0, 0, 0, 0, 1, 1)  # no n-gram: a NULL table, order 1
        history = np.zeros(0, dtype=np.int64)
        if static is not None:
            tables = static._c_tables
            width = static.order - 1
            history = np.full(width, -1, dtype=np.int64)
            tail = list(tokens[-width:]) if width else []
            history[width - len(tail) :] = tail
        cand = np.ascontiguousarray(cand, dtype=np.int64)
        cand_lp = np.ascontiguousarray(cand_lp, dtype=np.float64)
        out_tokens = np.empty(budget.max_nodes, dtype=np.int64)
        out_parents = np.empty(budget.max_nodes, dtype=np.int64)
        n = kernel(
            _address(cand),
            _address(cand_lp),
            cand.shape[0],
            cand.shape[1],
            _address(history),
            *tables,
            _address(self.eos),
            len(self.eos),
            budget.max_nodes,
            p.beam_width,
            p.level_decay,
            p.logit_decay,
            p.ngram_weight,
            p.eps,
            int(self.cap_width),
            _address(out_tokens),
            _address(out_parents),
        )
        if n < 0:
            return None
        return Tree(np.concatenate([[root], out_tokens[:n]]), np.concatenate([[-1], out_parents[:n] + 1]))

    def _is_eos(self, tokens: np.ndarray) -> np.ndarray:
        """Which of ``tokens`` are end tokens (a model has one to three: a comparison each is ~20x faster than
        ``np.isin``'s sort for these few dozen candidates, which took a fifth of a 32-node search)."""
        out = np.zeros(tokens.shape, dtype=bool)
        for eos in self._eos_ids:
            out |= tokens == eos
        return out

    def _one_level(self, root: int, logp: torch.Tensor, d2t: np.ndarray | None, room: int) -> Tree:
        """The search's tree when it has a single level (two nodes: DART's CPU default): the ``room`` best
        candidates with EOS ranked last, in rank order - the same tree (tested against the full search) without
        the per-level bookkeeping, which cost ~0.2 ms a step, as much as drafting itself."""
        _, idx = torch.topk(logp.float(), min(self.params.top_k, logp.shape[-1]))
        ids = idx.cpu().numpy()
        tokens = d2t[ids] if d2t is not None else ids
        eos = self._is_eos(tokens)
        considered = min(self.params.beam_width, len(tokens), room + int(eos.sum()))  # the search's beam
        eos = eos[:considered]
        kept = sorted([*np.flatnonzero(~eos), *np.flatnonzero(eos)][:room])
        return Tree.from_nodes(root, tokens[kept].tolist(), [-1] * len(kept), list(range(len(kept))))

    @staticmethod
    def _top_closed(parents: list[int], scores: list[float], budget: DraftBudget) -> list[int]:
        """The best ``max_nodes - 1`` nodes by score whose parents are all kept (prefix closure)."""
        order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
        kept: set[int] = set()
        room = budget.max_nodes - 1
        # Scores never increase along a path, so parents come first; a second pass picks up ties.
        for _ in range(2):
            for i in order:
                if len(kept) >= room:
                    return sorted(kept)
                if i not in kept and (parents[i] == -1 or parents[i] in kept):
                    kept.add(i)
        return sorted(kept)


@functools.cache
def _c_top_candidates() -> Any:
    """:func:`top_candidates` in C (``search.c``), or None where dartspec's kernels cannot be built."""
    from dartspec import exact

    return exact.kernel("dartspec_top_candidates")


@functools.cache
def _c_beam_search() -> Any:
    """The C beam search (``search.c``), or None where dartspec's kernels cannot be built."""
    from dartspec import exact

    return exact.kernel("dartspec_beam_search")


def _static_ngram(scorer: Scorer | None) -> NgramModel | bool | None:
    """The one static n-gram model behind ``scorer`` (None: no n-gram), or False where it is something else (online
    counts, smoothing), which only the numpy search scores."""
    if isinstance(scorer, MergedNgram) and scorer.online is None:
        scorer = scorer.static
    if scorer is None or type(scorer) is NgramModel:
        return scorer
    return False


@dataclass(frozen=True)
class DDTree:
    """Best-first tree over rank tuples of per-depth marginals (DDTree, method.md section 5).

    Optimal for the surrogate sum over nodes of the product of marginals along the path.
    """

    top_k: int = 16

    def __call__(
        self, root: int, logp: torch.Tensor, d2t: np.ndarray | None, tokens: Sequence[int], budget: DraftBudget
    ) -> Tree:
        depth = min(logp.shape[0], budget.max_depth)
        if depth <= 0 or budget.max_nodes <= 1:
            return Tree.root_only(root)
        vals, idx = torch.topk(logp[:depth].float(), min(self.top_k, logp.shape[-1]), dim=-1)
        ids = idx.cpu().numpy()
        cand = d2t[ids] if d2t is not None else ids
        lp = vals.cpu().numpy().astype(np.float64)  # marginals, not renormalised
        k = lp.shape[1]
        out_tokens, out_parents = [root], [-1]
        # Heap entries: (-log score, tie-break, depth index l, rank r, parent tree index).
        heap = [(-lp[0, 0], 0, 0, 0, 0)]
        counter = 1
        while heap and len(out_tokens) < budget.max_nodes:
            neg, _, level, rank, parent = heapq.heappop(heap)
            node = len(out_tokens)
            out_tokens.append(int(cand[level, rank]))
            out_parents.append(parent)
            if rank + 1 < k:  # next sibling: same parent, next rank
                heapq.heappush(heap, (neg + lp[level, rank] - lp[level, rank + 1], counter, level, rank + 1, parent))
                counter += 1
            if level + 1 < depth:  # first child
                heapq.heappush(heap, (neg - lp[level + 1, 0], counter, level + 1, 0, node))
                counter += 1
        return Tree(np.array(out_tokens), np.array(out_parents))


def make_tree_builder(name: str, *, ngram: Scorer | None = None, eos_ids: Sequence[int] = ()):
    """``beam`` (DART), ``ddtree`` or ``chain``."""
    from dartspec.errors import DartspecError
    from dartspec.formats import TREE_BUILDERS

    if name == "beam":
        return BeamTree(ngram=ngram, eos_ids=eos_ids)
    if name == "ddtree":
        return DDTree()
    if name == "chain":
        return ChainTree()
    raise DartspecError(f"unknown tree builder {name!r}: choose one of {', '.join(TREE_BUILDERS)}")
