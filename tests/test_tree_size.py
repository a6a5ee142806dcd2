"""--tree-size auto: path estimates, prefix-closed cuts, the rate-maximising choice, calibration cache."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_target
from test_dart import model_for

from dartspec.drafters.dart import DartDrafter
from dartspec.engine import Generator
from dartspec.tree import DraftBudget, Tree
from dartspec.tree_size import CALIBRATION_QS, AutoSizer, CostCurve, calibrate, node_estimates

FLAT = CostCurve((1, 32), (0.01, 0.01))
STEEP = CostCurve((1, 2, 32), (0.01, 0.05, 1.0))


def test_node_estimates_are_path_products() -> None:
    tree = Tree(np.array([9, 3, 4, 5]), np.array([-1, 0, 1, 0]))  # 3 -> 4 on one branch, 5 on another
    logp = torch.log(torch.tensor([[0.5, 0.2, 0.3], [0.1, 0.6, 0.3]]))  # (depth 2, draft vocab 3)
    t2d = np.array([-1, -1, -1, 0, 1, 2])  # target ids 3, 4, 5 -> draft ids 0, 1, 2
    np.testing.assert_allclose(node_estimates(tree, logp, t2d), [1.0, 0.5, 0.5 * 0.6, 0.3], rtol=1e-6)


def test_subtree_keeps_tokens_and_parents() -> None:
    tree = Tree(np.array([9, 3, 4, 5, 6]), np.array([-1, 0, 1, 0, 3]))
    cut = tree.subtree(np.array([3, 1, 4]))
    assert cut.tokens.tolist() == [9, 3, 5, 6] and cut.parents.tolist() == [-1, 0, 0, 2]


@pytest.mark.parametrize("seed", range(5))
def test_choice_maximises_expected_rate(seed: int) -> None:
    rng = np.random.default_rng(seed)
    q = 12
    parents = np.array([-1, *[int(rng.integers(0, i)) for i in range(1, q)]])
    tree = Tree(np.arange(q) + 10, parents)
    est = np.ones(q)
    for i in range(1, q):
        est[i] = est[parents[i]] * rng.uniform(0.05, 0.95)
    curve = CostCurve((1, 4, 16), (0.03, 0.04, 0.09))
    sizer = AutoSizer(curve, overhead_s=0.004)
    cut, gain = sizer.choose(tree, est)
    # Brute force over prefixes of the estimate ranking.
    ranked = sorted(est[1:], reverse=True)
    rates = [(1 + sum(ranked[: r - 1])) / (curve.cost(r) + 0.004) for r in range(1, q + 1)]
    assert cut.size == int(np.argmax(rates)) + 1
    assert gain == pytest.approx(1 + sum(ranked[: cut.size - 1]))
    kept = set(cut.tokens.tolist())
    for t in cut.tokens[1:]:  # prefix closure
        parent = parents[t - 10]
        assert parent == 0 or int(parent) + 10 in kept


def test_flat_and_steep_costs() -> None:
    tree = Tree.chain(1, [2, 3, 4])
    est = np.array([1.0, 0.6, 0.3, 0.1])
    assert AutoSizer(FLAT).choose(tree, est)[0].size == 4
    assert AutoSizer(STEEP).choose(tree, est)[0].size == 1


def test_calibration_scale_follows_acceptance() -> None:
    sizer = AutoSizer(FLAT)
    tree = Tree.chain(1, [2, 3])
    for _ in range(20):
        sizer.choose(tree, np.array([1.0, 0.9, 0.8]))
        sizer.observe(0)  # predicted 1.7 draft tokens, none accepted
    assert sizer.scale < 0.3
    assert sizer.report()["sizes"] == {"3": 20}


def test_matched_depth_follows_the_tree_from_the_root() -> None:
    tree = Tree(np.array([9, 3, 4, 5]), np.array([-1, 0, 1, 0]))  # 9 -> 3 -> 4 and 9 -> 5
    assert [tree.matched_depth(t) for t in ([3, 4, 7], [5, 4], [6], [], [3, 5])] == [2, 1, 0, 0, 1]


def test_nodes_beside_the_tree_count_in_its_cost() -> None:
    """A hybrid's lookup spans are verified with the drafter's tree: a cut of R nodes costs T(R + beside)."""
    curve = CostCurve((1, 4, 8, 16), (0.010, 0.012, 0.030, 0.080))  # rows cheap up to 4, dear after
    tree, est = Tree.chain(1, [2, 3, 4]), np.array([1.0, 0.7, 0.5, 0.35])
    assert AutoSizer(curve).choose(tree, est)[0].size == 4
    # 4 more rows: rates 1 / T(5), 1.7 / T(6), 2.2 / T(7), 2.55 / T(8) = 60.6, 81.0, 86.3, 85.0
    assert AutoSizer(curve).choose(tree, est, beside=4)[0].size == 3


def test_only_the_drafters_own_nodes_count_as_its_hits() -> None:
    """Beside lookup spans (dart+pld) the accepted path can leave the drafter's tree; the sizer's calibration counts
    the accepted tokens its own tree held, not the spans' (which made it trust its estimates too much)."""
    target = tiny_target()
    sizer = AutoSizer(FLAT)
    drafter = DartDrafter(model_for(target, depth=5), target, "beam", auto_size=sizer)
    drafter._proposed = Tree(np.array([9, 3, 4, 5]), np.array([-1, 0, 1, 0]))
    drafter.observe([9, 3, 6, 7], torch.zeros(4, 8))  # 3 was the drafter's; 6 and 7 came from a span
    assert sizer.accepted == 1
    drafter._proposed = None  # a step that drafted nothing teaches nothing
    drafter.observe([7, 1], torch.zeros(2, 8))
    assert sizer.accepted == 1


def test_the_drafted_tree_grows_only_as_far_as_recent_cuts_reach() -> None:
    """Drafting 32 nodes at depth 8 to keep 2-4 cost more than the cut saved: the drafter's budget is twice the
    largest recent cut (at least 4 nodes; 8 before any) and one level below the deepest, never more than asked."""
    wide = DraftBudget(max_nodes=32, max_depth=8)
    tree, est = Tree.chain(1, [2, 3, 4]), np.array([1.0, 0.6, 0.3, 0.1])
    steep = AutoSizer(STEEP)
    assert steep.draft_budget(wide) == DraftBudget(max_nodes=8, max_depth=8)
    steep.choose(tree, est)  # the root alone
    assert steep.draft_budget(wide) == DraftBudget(max_nodes=4, max_depth=2)
    flat = AutoSizer(FLAT)
    for _ in range(3):
        flat.choose(tree, est)  # all 4 nodes, depth 3
    assert flat.draft_budget(wide) == DraftBudget(max_nodes=8, max_depth=4)
    assert flat.draft_budget(DraftBudget(max_nodes=6, max_depth=3)) == DraftBudget(max_nodes=6, max_depth=3)
    flat.begin()  # a new generation starts from the first guess again
    assert flat.draft_budget(wide) == DraftBudget(max_nodes=8, max_depth=8)


def test_auto_sized_dart_drafts_only_as_deep_as_its_cuts() -> None:
    """Where verification is dear (each cut keeps the root alone) DART's forward predicts 2 positions after its first
    step, not the 5 its budget allows (a tree kept whole may deepen a level a step). Tokens stay plain decoding's."""
    target = tiny_target()
    prompt = list(range(2, 12))
    plain = Generator(target).generate(prompt, max_new_tokens=16)
    drafter = DartDrafter(model_for(target, depth=5), target, "beam", auto_size=AutoSizer(STEEP))
    step, depths = drafter._step, []
    drafter._step = lambda f, n, s, d: depths.append(d) or step(f, n, s, d)
    out = Generator(target, drafter, tree_size=16, max_depth=5).generate(prompt, max_new_tokens=16)
    assert out.token_ids == plain.token_ids
    assert depths[0] == 5 and len(depths) > 5 and max(depths[1:]) <= 2


def test_auto_sized_drafter_is_lossless_and_reports(tmp_path: Path) -> None:
    target = tiny_target()
    model = model_for(target, depth=5)
    plain = Generator(target).generate(list(range(2, 12)), max_new_tokens=30)
    sizer = AutoSizer(CostCurve((1, 4, 16), (0.01, 0.011, 0.02)))
    gen = Generator(target, DartDrafter(model, target, "beam", auto_size=sizer), tree_size=16, max_depth=5)
    out = gen.generate(list(range(2, 12)), max_new_tokens=30)
    assert out.token_ids == plain.token_ids
    report = out.stats.as_dict()["tree_size_auto"]
    # One choice per drafting step (the prefill and a last step with no room to draft have none).
    assert out.stats.target_forwards - 2 <= sum(report["sizes"].values()) <= out.stats.target_forwards - 1
    assert report["cost_ms"]["4"] == pytest.approx(11.0)


def test_auto_sized_eagle3_is_lossless_and_follows_the_cost_curve() -> None:
    from test_eagle3 import eagle_for

    from dartspec.drafters.eagle3 import Eagle3Drafter

    target = tiny_target()
    prompt = list(range(2, 12))
    plain = Generator(target).generate(prompt, max_new_tokens=24)
    sizes, levels = {}, {}
    for name, curve in (("flat", FLAT), ("steep", STEEP)):
        drafter = Eagle3Drafter(eagle_for(target), target, topk=3, auto_size=AutoSizer(curve))
        step = drafter.model.tree_step
        calls = []
        drafter.model.tree_step = lambda *a, calls=calls, step=step, **kw: calls.append(1) or step(*a, **kw)
        out = Generator(target, drafter, tree_size=16, max_depth=4).generate(prompt, max_new_tokens=24)
        assert out.token_ids == plain.token_ids
        sizes[name] = out.stats.as_dict()["tree_size_auto"]["mean_size"]
        levels[name] = len(calls)
    # Free verification keeps the whole dynamic tree; verification that doubles per node keeps the root,
    # and the drafter does not even expand a second level for it.
    assert sizes["steep"] == 1 and sizes["flat"] > 4
    assert levels["steep"] == 0 and levels["flat"] > 0


def test_growing_is_worth_it_only_if_a_new_node_can_raise_the_rate() -> None:
    est = np.array([1.0, 0.5, 0.2])
    assert AutoSizer(FLAT).worth_growing(est, bound=0.1, new_nodes=3, extra_s=0.0)
    assert not AutoSizer(FLAT).worth_growing(est, bound=0.1, new_nodes=0, extra_s=0.0)
    assert not AutoSizer(STEEP).worth_growing(est, bound=0.2, new_nodes=3, extra_s=0.0)
    # On a flat curve a node must pay for the extra drafting: 0.1 more tokens cannot pay 10 ms on 10 ms.
    assert not AutoSizer(FLAT).worth_growing(est, bound=0.1, new_nodes=1, extra_s=0.01)


def test_calibration_is_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import dartspec.tree_size as tree_size

    target = tiny_target()
    calls = []
    real = tree_size.verify_cost_curve

    def counting(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(tree_size, "verify_cost_curve", counting)
    first = calibrate(target, cache=tmp_path, repeats=1, ctx=16)
    second = calibrate(target, cache=tmp_path, repeats=1, ctx=16)
    assert calls == [1] and first == second
    assert first.qs == CALIBRATION_QS and all(s > 0 for s in first.seconds)
    (file,) = (tmp_path / "calibration").iterdir()
    file.write_text("{broken")
    calibrate(target, cache=tmp_path, repeats=1, ctx=16)  # a damaged entry is measured again
    assert calls == [1, 1] and json.loads(file.read_text())["qs"][0] == 1


def test_calibration_is_remeasured_for_new_kernels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A curve measured with one build of the C kernels is not reused after they change (a faster kernel would
    otherwise keep the old curve's tree sizes); other runtimes' curves do not depend on them."""
    import dartspec.exact as exact
    import dartspec.tree_size as tree_size

    target = tiny_target()
    plain = tree_size.calibration_file(target, tmp_path)
    monkeypatch.setattr(tree_size, "describe", lambda t: "lean/exact-a16")
    monkeypatch.setattr(exact, "build_key", lambda: "build-one")
    first = tree_size.calibration_file(target, tmp_path)
    monkeypatch.setattr(exact, "build_key", lambda: "build-two")
    second = tree_size.calibration_file(target, tmp_path)
    assert "build-one" in first.name and first != second
    assert "build" not in plain.name
