"""The draft tree: plain data shared by drafters (who build it) and the verifier (who walks it).

Node 0 is the root: the last committed token, whose key/value entry is not yet in the target's cache.
Nodes are stored in topological order (every parent comes before its children), so one target forward
can score all of them with an ancestor-only attention mask, each at position ``base + depth``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, eq=False)
class DraftSampling:
    """A request sampled at ``temperature`` > 0 whose verifier tests sampled drafts by rejection: a drafter that can
    draws nodes from its own distribution at that temperature with ``rng`` (seeded with the request) and attaches
    the distributions to the tree (:class:`Proposal`; see :mod:`dartspec.verify`)."""

    temperature: float
    rng: np.random.Generator


@dataclass(frozen=True)
class DraftBudget:
    """Limits for one proposal: total tree nodes (root included) and depth below the root. ``batch_cut``: how many
    nodes of the sequence's own tree size a batched step's share took away (0 when it runs alone). ``sampling``: set
    where the drafter may sample its tree (None: greedy decoding, or drafts verified by matching). ``beside``: nodes the
    verified tree will carry besides the drafter's own (a hybrid's lookup spans), which a tree sizer counts in the
    verification's cost."""

    max_nodes: int
    max_depth: int
    batch_cut: int = 0
    sampling: DraftSampling | None = None
    beside: int = 0


@dataclass(frozen=True, eq=False)
class Proposal:
    """The distribution some children of a node were drawn from, without replacement, in the order ``draws`` (child
    node indices): ``probs`` (float64, summing to 1) over the target's tokens ``ids`` (distinct), ``at`` the index
    into ``ids`` of each draw's token. The sampling verifier tests each draw against the target by rejection, which
    accepts more than matching the target's own sample when the drafter's distribution is close to the target's
    (:meth:`dartspec.verify.Verifier.accept`)."""

    ids: np.ndarray
    probs: np.ndarray
    draws: tuple[int, ...]
    at: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class Tree:
    """A draft token tree in topological order.

    Attributes:
        tokens: ``(q,)`` int64 token ids; ``tokens[0]`` is the root (the last committed token).
        parents: ``(q,)`` int64 parent index of each node; ``parents[0] == -1`` and ``parents[i] < i``.
        depth: ``(q,)`` depth below the root (root = 0).
        ancestors: ``(q, q)`` bool, ``ancestors[i, j]`` iff node j is node i or one of its ancestors;
            this is exactly the attention mask among tree nodes.
        proposals: node -> the :class:`Proposal` some of its children were drawn from (a sampled tree); the other
            children are fixed guesses. Empty for a tree built deterministically, which the verifier walks by
            matching its own sample (exact for any tree, so a tree that drops its proposals stays lossless).
    """

    tokens: np.ndarray
    parents: np.ndarray
    proposals: Mapping[int, Proposal] = field(default_factory=dict)
    depth: np.ndarray = field(init=False)
    ancestors: np.ndarray = field(init=False)
    _children: tuple[dict[int, int], ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        tokens = np.asarray(self.tokens, dtype=np.int64).reshape(-1)
        parents = np.asarray(self.parents, dtype=np.int64).reshape(-1)
        q = len(tokens)
        if q == 0 or len(parents) != q:
            raise ValueError(f"a tree needs a root and one parent per node (got {q} tokens, {len(parents)} parents)")
        if parents[0] != -1:
            raise ValueError("node 0 must be the root (parent -1)")
        children: list[dict[int, int]] = [{} for _ in range(q)]
        if q == 1:  # plain decoding's tree, every step
            depth, ancestors, deepest = np.zeros(1, dtype=np.int64), np.ones((1, 1), dtype=bool), 0
        else:
            depth, ancestors, deepest = self._links(tokens.tolist(), parents.tolist(), children)
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "parents", parents)
        object.__setattr__(self, "depth", depth)
        object.__setattr__(self, "ancestors", ancestors)
        object.__setattr__(self, "_children", tuple(children))
        object.__setattr__(self, "_max_depth", deepest)  # read twice a step by the engine
        for node, proposal in self.proposals.items():
            draws, at = proposal.draws, proposal.at
            if len(set(draws)) != len(draws) or any(not 0 < c < q or parents[c] != node for c in draws):
                raise ValueError(f"a proposal's draws must be distinct children of its node {node}")
            if len(at) != len(draws) or any(proposal.ids[a] != tokens[c] for a, c in zip(at, draws, strict=True)):
                raise ValueError(f"a proposal of node {node} does not name its draws' tokens")

    @staticmethod
    def _links(
        tokens: list[int], parents: list[int], children: list[dict[int, int]]
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """Checks the order and fills ``children``; returns the depths, the ancestor mask and the deepest depth. In
        Python lists with one numpy call for each result: per-node numpy calls cost ~50 us a tree on a CPU right
        after a target forward (a few trees a decoding step)."""
        q = len(tokens)
        paths: list[list[int]] = [[0]]  # each node's ancestors and itself, root first
        for i in range(1, q):
            p, tok = parents[i], tokens[i]
            if not 0 <= p < i:
                raise ValueError("every non-root node's parent must be an earlier node (topological order)")
            if tok in children[p]:
                raise ValueError(f"node {p} has two children with the same token {tok}")
            children[p][tok] = i
            paths.append([*paths[p], i])
        mask = [False] * (q * q)
        for i, path in enumerate(paths):
            for j in path:
                mask[i * q + j] = True
        depth = [len(path) - 1 for path in paths]
        return np.array(depth, dtype=np.int64), np.array(mask, dtype=bool).reshape(q, q), max(depth)

    # --- constructors -------------------------------------------------------------------------

    @classmethod
    def root_only(cls, root: int) -> Tree:
        """The trivial tree of plain decoding: just the last committed token."""
        return cls(np.array([root]), np.array([-1]))

    @classmethod
    def chain(cls, root: int, draft: Sequence[int]) -> Tree:
        """A single path ``root -> draft[0] -> draft[1] -> ...``."""
        q = 1 + len(draft)
        return cls(np.array([root, *draft]), np.arange(-1, q - 1))

    @classmethod
    def from_paths(cls, root: int, paths: Sequence[Sequence[int]], max_nodes: int | None = None) -> Tree:
        """Merge token sequences that all hang below ``root`` into a prefix tree (a trie).

        Paths are inserted in order, so earlier paths keep their nodes when ``max_nodes`` cuts the tree;
        nodes past the budget are dropped, which keeps the tree prefix-closed.
        """
        return cls.root_only(root).with_paths(paths, max_nodes)

    @classmethod
    def from_nodes(
        cls, root: int, tokens: Sequence[int], parents: Sequence[int], keep: Sequence[int] | np.ndarray
    ) -> Tree:
        """The tree of ``root`` and the kept candidates: ``keep`` indexes ``tokens`` / ``parents`` (parent -1 is the
        root), must be prefix-closed, and sorted it must list parents before children (the builders' candidate
        lists are in creation order). Every builder that ranks candidates and keeps some ends here."""
        kept = sorted(int(i) for i in keep)
        index = {-1: 0} | {c: i + 1 for i, c in enumerate(kept)}
        try:
            return cls(np.array([root, *(tokens[c] for c in kept)]), np.array([-1, *(index[parents[c]] for c in kept)]))
        except KeyError as missing:
            raise ValueError(
                f"kept nodes are not prefix-closed: the parent {missing} of a kept node is not kept"
            ) from None

    def with_paths(self, paths: Sequence[Sequence[int]], max_nodes: int | None = None) -> Tree:
        """This tree (its nodes, their order and its proposals) plus token ``paths`` below the root as fixed guesses,
        merged into the nodes a path's tokens already are, new nodes appended while the tree has fewer than
        ``max_nodes`` (the sampling verifier tests a node's draws before its fixed children, whatever their order)."""
        tokens, parents = self.tokens.tolist(), self.parents.tolist()
        index = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens, strict=True)) if i > 0}
        for path in paths:
            node = 0
            for tok in path:
                key = (node, int(tok))
                child = index.get(key)
                if child is None:
                    if max_nodes is not None and len(tokens) >= max_nodes:
                        break
                    child = len(tokens)
                    tokens.append(int(tok))
                    parents.append(node)
                    index[key] = child
                node = child
        return Tree(np.array(tokens), np.array(parents), self.proposals)

    def subtree(self, keep: Sequence[int] | np.ndarray) -> Tree:
        """The root plus the (prefix-closed) nodes ``keep`` of this tree (the root itself may be listed or not)."""
        nodes = [int(n) - 1 for n in keep if int(n) > 0]
        return Tree.from_nodes(int(self.tokens[0]), self.tokens[1:].tolist(), (self.parents[1:] - 1).tolist(), nodes)

    # --- queries -------------------------------------------------------------------------------

    @property
    def size(self) -> int:
        """Number of nodes, root included (the q of the verification forward)."""
        return len(self.tokens)

    @property
    def max_depth(self) -> int:
        return self._max_depth

    def child_with_token(self, node: int, token: int) -> int | None:
        """The child of ``node`` carrying ``token``, or None."""
        return self._children[node].get(token)

    def children(self, node: int) -> list[int]:
        return list(self._children[node].values())

    def matched_depth(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` (after the root) follow a path of this tree from the root."""
        node, depth = 0, 0
        for token in tokens:
            child = self._children[node].get(int(token))
            if child is None:
                break
            node, depth = child, depth + 1
        return depth

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root down to ``node`` inclusive."""
        path = []
        while node >= 0:
            path.append(node)
            node = int(self.parents[node])
        return path[::-1]

    def leaves(self) -> list[int]:
        return [i for i in range(self.size) if not self._children[i]]

    def paths(self) -> list[list[int]]:
        """All root-to-leaf paths as lists of node indices."""
        return [self.path_to(leaf) for leaf in self.leaves()]

    def position_ids(self, base: int) -> np.ndarray:
        """Absolute positions of the nodes when ``base`` tokens are already in the cache."""
        return base + self.depth
