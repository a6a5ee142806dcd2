"""The draft tree as plain data."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dartspec.tree import Proposal, Tree


@st.composite
def trees(draw: st.DrawFn) -> Tree:
    n = draw(st.integers(1, 30))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = [draw(st.integers(0, 5))]
    for i in range(1, n):
        # Unique token per sibling: position-based ids never collide.
        tokens.append(1000 + i)
    return Tree(np.array(tokens), np.array(parents))


@settings(max_examples=80, deadline=None)
@given(tree=trees())
def test_derived_fields_match_brute_force(tree: Tree) -> None:
    for i in range(tree.size):
        anc = set()
        j = i
        while j >= 0:
            anc.add(j)
            j = int(tree.parents[j])
        assert set(np.flatnonzero(tree.ancestors[i]).tolist()) == anc
        assert tree.depth[i] == len(anc) - 1
        assert tree.path_to(i) == sorted(anc)
        for c in tree.children(i):
            assert tree.parents[c] == i and tree.child_with_token(i, int(tree.tokens[c])) == c
    assert (tree.position_ids(10) == 10 + tree.depth).all()
    assert tree.max_depth == max(len(tree.path_to(i)) - 1 for i in range(tree.size))
    leaves = tree.leaves()
    assert sorted(p[-1] for p in tree.paths()) == leaves
    assert all(p[0] == 0 for p in tree.paths())


def test_chain_and_root_only() -> None:
    t = Tree.chain(5, [6, 7, 8])
    assert t.tokens.tolist() == [5, 6, 7, 8] and t.parents.tolist() == [-1, 0, 1, 2]
    assert t.max_depth == 3 and t.paths() == [[0, 1, 2, 3]]
    r = Tree.root_only(9)
    assert r.size == 1 and r.max_depth == 0 and r.child_with_token(0, 9) is None


def test_from_paths_merges_prefixes_and_respects_budget() -> None:
    t = Tree.from_paths(1, [[2, 3, 4], [2, 3, 5], [6]])
    assert t.tokens.tolist() == [1, 2, 3, 4, 5, 6]
    assert t.parents.tolist() == [-1, 0, 1, 2, 2, 0]
    cut = Tree.from_paths(1, [[2, 3, 4], [2, 9, 5], [6]], max_nodes=5)
    assert cut.size == 5
    # Prefix-closed: every kept node's parent is kept (parents always point to earlier nodes).
    assert cut.tokens.tolist() == [1, 2, 3, 4, 9]


@pytest.mark.parametrize(
    ("tokens", "parents", "message"),
    [
        ([1, 2], [0, 0], "root"),
        ([1, 2, 3], [-1, 2, 0], "earlier node"),
        ([1, 2, 2], [-1, 0, 0], "same token"),
        ([1, 2], [-1], "one parent per node"),
        ([], [], "root"),
    ],
)
def test_invalid_trees(tokens: list[int], parents: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Tree(np.array(tokens, dtype=np.int64), np.array(parents, dtype=np.int64))


def test_from_nodes_reindexes_kept_candidates_and_refuses_orphans() -> None:
    # Candidates: 0 (root child, token 7), 1 (child of 0, token 8), 2 (root child, token 9), 3 (child of 1, token 5).
    tokens, parents = [7, 8, 9, 5], [-1, 0, -1, 1]
    tree = Tree.from_nodes(4, tokens, parents, [3, 0, 1])
    assert tree.tokens.tolist() == [4, 7, 8, 5] and tree.parents.tolist() == [-1, 0, 1, 2]
    with pytest.raises(ValueError, match="prefix-closed"):
        Tree.from_nodes(4, tokens, parents, [1, 2])
    with pytest.raises(ValueError, match="prefix-closed"):
        tree.subtree([0, 2])  # node 2 without its parent 1
    assert tree.subtree([1, 0]).tokens.tolist() == [4, 7]


def test_with_paths_keeps_the_tree_and_its_proposals_and_adds_fixed_guesses() -> None:
    ids = np.arange(10)
    q = np.full(10, 0.1)
    tree = Tree(np.array([9, 4, 5]), np.array([-1, 0, 1]), {0: Proposal(ids, q, (1,), (4,))})
    merged = tree.with_paths([[4, 6], [7, 8, 2], [3]], max_nodes=6)
    assert merged.tokens.tolist()[:3] == [9, 4, 5] and merged.proposals is tree.proposals
    # [4, 6] joins under the drawn 4; [7, 8, 2] takes the last two nodes the budget has and stops; [3] finds none.
    assert merged.tokens.tolist() == [9, 4, 5, 6, 7, 8]
    assert merged.parents.tolist() == [-1, 0, 1, 1, 0, 4]
    assert Tree.from_paths(9, [[4, 5], [4, 6], [7, 8]]).tokens.tolist() == merged.tokens.tolist()


@pytest.mark.parametrize(
    ("proposal", "message"),
    [
        (Proposal(np.arange(4), np.full(4, 0.25), (2,), (3,)), "distinct children of its node 0"),  # 2 is a grandchild
        (Proposal(np.arange(4), np.full(4, 0.25), (1, 1), (2, 2)), "distinct children"),
        (Proposal(np.arange(4), np.full(4, 0.25), (1,), (3,)), "does not name its draws' tokens"),
        (Proposal(np.arange(4), np.full(4, 0.25), (1,), ()), "does not name its draws' tokens"),
    ],
)
def test_proposals_must_name_children_and_their_tokens(proposal: Proposal, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Tree(np.array([0, 2, 3]), np.array([-1, 0, 1]), {0: proposal})
