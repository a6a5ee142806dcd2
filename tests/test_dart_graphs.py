"""The DART drafter's step on static buffers (dartspec.drafters.dart_graphs), run eagerly on the CPU: the network's
own step through prompts, accepted paths, more positions than a graph takes and a cache that outgrows its buffers;
the same rows inside a generation on a target whose steps run as graphs; nothing read back to the host in a step
(what a capture needs). The capture itself needs a GPU."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch
from host_reads import HostReads
from test_cuda_graphs import _pair
from test_dart import model_for, tiny_target

from dartspec.drafters import dart_graphs
from dartspec.drafters.base import DraftBudget
from dartspec.drafters.dart import DartDrafter
from dartspec.drafters.dart_graphs import GraphDraftNet
from dartspec.drafters.dart_model import DraftKV
from dartspec.engine import Generator
from dartspec.search import ChainTree
from dartspec.tree import Tree


def _inputs(length: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    target = tiny_target()
    ids = np.random.default_rng(seed).integers(2, 96, size=length + 1).tolist()
    feats = target.score_sequence(ids).features[:length]
    embeds = target.model.get_input_embeddings()(torch.tensor(ids[1 : length + 1])).detach()
    return feats, embeds


@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("warm_up", [False, True])
def test_static_steps_equal_the_network_through_growth(
    monkeypatch: pytest.MonkeyPatch, num_layers: int, warm_up: bool
) -> None:
    monkeypatch.setattr(dart_graphs, "FIRST_CAPACITY", 32)  # outgrown within the test
    if warm_up:  # as a CUDA capture does: the body runs once before its replays, which must change nothing
        monkeypatch.setattr(dart_graphs, "capture", lambda body, device: (body(), body)[1])
    model = model_for(tiny_target(), depth=4, num_layers=num_layers).eval()
    feats, embeds = _inputs(120)
    net, cache = GraphDraftNet(model, capture=warm_up, max_new=6), DraftKV()
    buffers = net.keys[0]
    # A prompt (more positions than a graph takes: eager), accepted paths of 1..5 positions, shallower requests.
    chunks = [9, 1, 3, 5, 2, 1, 4, 1, 1, 5, 12, 2, 3, 1, 5, 4, 2, 1, 3, 5, 2, 4, 1, 3, 5, 2, 5, 5, 5]
    start = 0
    for i, m in enumerate(chunks):
        depth = (4, 2, 1, 3)[i % 4]
        got = net.dart_step(feats[start : start + m], embeds[start : start + m], start, depth)
        ref = model.step(feats[start : start + m], embeds[start : start + m], start, cache, depth=depth)
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-10)
        start += m
        assert net.length == cache.length == start
    assert start > 64 and net.keys[0] is not buffers  # grew twice
    # Captured once per count of new positions on the last buffers, never for more than max_new.
    assert set(net._graphs) <= set(range(1, 7)) and 12 not in net._graphs
    with pytest.raises(RuntimeError, match="out of step"):
        net.dart_step(feats[:2], embeds[:2], start + 1, 2)
    net.reset()
    torch.testing.assert_close(
        net.dart_step(feats[:9], embeds[:9], 0, 4), model.step(feats[:9], embeds[:9], 0, DraftKV()), rtol=0, atol=1e-10
    )


def test_a_static_step_reads_nothing_back_from_the_device() -> None:
    model = model_for(tiny_target(), depth=4).eval()
    feats, embeds = _inputs(20)
    net = GraphDraftNet(model, capture=False)
    net.dart_step(feats[:10], embeds[:10], 0, 4)
    net.dart_step(feats[10:13], embeds[10:13], 10, 4)  # the first call of a count "captures"
    net.length = 10
    with HostReads() as reads:
        net.dart_step(feats[10:13], embeds[10:13], 10, 4)
    assert reads.count == 0, reads.sites


class _Recording:
    """A tree builder that keeps every row it is given (and builds the chain)."""

    def __init__(self) -> None:
        self.rows: list[torch.Tensor] = []

    def __call__(
        self, root: int, logp: torch.Tensor, d2t: np.ndarray, tokens: Sequence[int], budget: DraftBudget
    ) -> Tree:
        self.rows.append(logp.clone())
        return ChainTree()(root, logp, d2t, tokens, budget)


def test_a_drafter_on_a_graphed_target_drafts_on_static_steps() -> None:
    plain, graphed = _pair("llama")
    model = model_for(plain, depth=5).eval()
    prompt = list(range(5, 25))
    ref = Generator(plain).generate(prompt, max_new_tokens=50).token_ids
    outs, rows = [], []
    for target in (plain, graphed):
        record = _Recording()
        drafter = DartDrafter(model, target, record)
        assert isinstance(drafter._net, GraphDraftNet) == (target is graphed)
        gen = Generator(target, drafter, tree_size=6, max_depth=5)
        outs.append(gen.generate(prompt, max_new_tokens=50))
        # A second sequence (the cache restarts) and a fork (a server's request) draft the same way.
        fork = drafter.fork()
        again = Generator(target, fork, tree_size=6, max_depth=5).generate(prompt, max_new_tokens=50)
        assert again.token_ids == ref and again.stats.tau == outs[-1].stats.tau
        rows.append(record.rows)
    assert outs[0].token_ids == outs[1].token_ids == ref
    assert len(rows[0]) == len(rows[1]) > 10
    for a, b in zip(rows[0], rows[1], strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-9)
    assert outs[1].stats.tau > 1.0 or outs[1].stats.tau == outs[0].stats.tau


def test_a_failed_capture_drafts_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(body, device):  # type: ignore[no-untyped-def]
        raise RuntimeError("operation not permitted when stream is capturing\nmore lines")

    monkeypatch.setattr(dart_graphs, "capture", refuse)
    model = model_for(tiny_target(), depth=4).eval()
    feats, embeds = _inputs(20)
    net, cache = GraphDraftNet(model, capture=True), DraftKV()
    with pytest.warns(UserWarning, match="drafting without graphs: RuntimeError: operation not permitted"):
        got = net.dart_step(feats[:10], embeds[:10], 0, 4)
    torch.testing.assert_close(got, model.step(feats[:10], embeds[:10], 0, cache), rtol=0, atol=1e-10)
    assert net.failed is not None and net.captures == 0
    got = net.dart_step(feats[10:12], embeds[10:12], 10, 3)  # eager from now on, without another warning
    torch.testing.assert_close(got, model.step(feats[10:12], embeds[10:12], 10, cache, depth=3), rtol=0, atol=1e-10)
