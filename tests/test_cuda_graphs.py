"""The CUDA-graph steps of the lean forward (dartspec.cuda_graphs), run eagerly on the CPU: the same logits and
features as the ordinary forward through tree verifications, commits and a cache that outgrows its buffers, the same
generations, and no read back to the host inside a step (what a capture needs). The capture itself needs a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import VOCAB, tiny_model, tiny_tokenizer
from host_reads import HostReads
from test_batch_decode import prompts, runtime
from test_engine import RandomDrafter
from test_lean import _with_biases

from dartspec.batch_decode import decode_batch
from dartspec.cuda_graphs import StepGraphs
from dartspec.engine import Generator
from dartspec.errors import DartspecError
from dartspec.lean import LeanTarget
from dartspec.targets import describe
from dartspec.tree import Tree


def _random_tree(rng: np.random.Generator, size: int) -> Tree:
    """A random tree of ``size`` nodes with distinct tokens (so no node has two children alike)."""
    tokens = rng.permutation(VOCAB)[:size]
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, size)]
    return Tree(tokens, np.array(parents))


def _pair(arch: str, seed: int = 5) -> tuple[LeanTarget, LeanTarget]:
    """The same float64 model as two lean targets: the ordinary forward, and the graph steps run eagerly."""
    model = _with_biases(tiny_model(arch, seed=seed), seed)
    plain, graphed = LeanTarget(model, tiny_tokenizer()), LeanTarget(model, tiny_tokenizer())
    graphed.step_graphs = StepGraphs(graphed, capture=False)
    return plain, graphed


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
@pytest.mark.parametrize("warm_up", [False, True])
def test_graph_steps_equal_the_forward_through_trees_commits_and_growth(
    arch: str, warm_up: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain, graphed = _pair(arch)
    steps = graphed.step_graphs
    assert steps is not None
    if warm_up:
        # As a CUDA capture does, run each step's body once before it is replayed: every captured step must leave the
        # state one run leaves (a commit moves entries, so it is captured on a path that moves none).
        monkeypatch.setattr(steps, "_capture", lambda body: (body(), body)[1])
    rng = np.random.default_rng(0)
    prompt = rng.integers(2, VOCAB, size=30).tolist()
    for t in (plain, graphed):
        t.prefill(prompt, features=True)  # an empty cache: the prefill runs eagerly
    assert steps.captures == 0
    # Tree sizes on and between buckets, one above the largest (eager), enough steps to outgrow the first buffers.
    sizes = [1, 3, 2, 16, 5, 64, 70, 1, 9, 33, 4, 1, 12, 1, 17, 8]
    buffers = graphed.cache.layers[0].keys
    for i in range(6 * len(sizes)):
        size = sizes[i % len(sizes)]
        tree = _random_tree(rng, size)
        base = plain.cached
        a, b = plain.verify(tree, features=True), graphed.verify(tree, features=True)
        torch.testing.assert_close(b.logits, a.logits, rtol=0, atol=1e-10)
        torch.testing.assert_close(b.features, a.features, rtol=0, atol=1e-10)
        assert graphed.cached == plain.cached == base + tree.size
        node = int(np.argmax(tree.depth))  # the deepest node, so that the cache grows
        for t in (plain, graphed):
            t.commit(base, tree.path_to(node))
    assert graphed.cached > 256 and graphed.cache.layers[0].keys is not buffers  # the cache grew: new buffers
    # Captured once per bucket used, and again on the grown buffers; 70 rows never. Commits of paths that are not the
    # tree's first nodes are graphs of their own (the logits above hold them to the eager commit).
    kinds = [key[0] for key in steps._steps[graphed.cache]]
    assert set(kinds) == {"step", "commit"} and kinds.count("step") == 7
    assert 7 + 3 < steps.captures <= 2 * (7 + 7)
    # Plain decoding's one-token steps without features are steps of their own.
    before = steps.captures
    for t in (plain, graphed):
        t.verify(Tree.root_only(3))
    assert steps.captures == before + 1


def test_graph_generations_equal_the_forward() -> None:
    plain, graphed = _pair("qwen3", seed=2)
    prompt = list(range(5, 15))
    ref = Generator(plain).generate(prompt, max_new_tokens=60)
    assert Generator(graphed).generate(prompt, max_new_tokens=60).token_ids == ref.token_ids
    spec = Generator(graphed, RandomDrafter(seed=1, reference=ref.token_ids), tree_size=12, max_depth=5)
    out = spec.generate(prompt, max_new_tokens=60)
    assert out.token_ids == ref.token_ids and out.stats.draft_tokens_accepted > 0
    # A second sequence in a cache of its own (a server's request) gets steps of its own.
    cache = graphed.new_cache()
    graphed.prefill(prompt, cache=cache)
    before = graphed.step_graphs.captures  # type: ignore[union-attr]
    got = graphed.verify(Tree.root_only(ref.token_ids[0]), cache=cache).logits
    assert graphed.step_graphs.captures == before + 1  # type: ignore[union-attr]
    assert int(got[0].argmax()) == ref.token_ids[1]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_graph_step_reads_nothing_back_from_the_device(arch: str) -> None:
    """A captured step cannot wait for the device: every input reaches it in one asynchronous copy (Gemma 3: its
    sliding layers' window masks built inside the step, past the window). The ordinary forward's step makes one
    blocking copy (its token ids), which shows the count works."""
    plain, graphed = _pair(arch)
    rng = np.random.default_rng(1)
    for t in (plain, graphed):
        t.prefill(rng.integers(2, VOCAB, size=20).tolist())
    tree = _random_tree(rng, 10)
    path = next(p for p in map(tree.path_to, range(tree.size)) if p != list(range(len(p))))  # not a prefix: moves
    graphed.verify(tree)  # the first calls capture
    graphed.commit(20, path)
    graphed.truncate(20)
    counts = []
    for t in (graphed, plain):
        with HostReads() as reads:
            t.verify(tree, features=True)
            t.commit(20, path)
        counts.append(reads.count)
    assert counts[0] == 0 and counts[1] > 0, counts
    assert graphed.cached == plain.cached == 20 + len(path)


def test_cuda_graphs_need_a_gpu_and_the_torch_forward() -> None:
    model = tiny_model("llama")
    with pytest.raises(DartspecError, match="needs a CUDA GPU"):
        LeanTarget(model, tiny_tokenizer(), cuda_graphs=True)
    lean = LeanTarget(model, tiny_tokenizer())
    assert describe(lean) == "lean/none"
    lean.step_graphs = StepGraphs(lean, capture=False)
    assert describe(lean) == "lean/none+graphs"
    from dartspec import exact

    if exact.available():  # float32 on a CPU runs the C kernels, which a graph cannot hold
        with pytest.raises(DartspecError, match="torch path"):
            StepGraphs(LeanTarget(tiny_model("llama").float(), tiny_tokenizer()), capture=False)


def test_a_failed_capture_falls_back_to_the_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    plain, graphed = _pair("llama")
    steps = graphed.step_graphs
    assert steps is not None

    def refuse(body: object) -> object:
        raise RuntimeError("operation not permitted when stream is capturing\nmore lines")

    monkeypatch.setattr(steps, "_capture", refuse)
    prompt = list(range(3, 23))
    ref = Generator(plain).generate(prompt, max_new_tokens=12).token_ids
    with pytest.warns(UserWarning, match="decoding without graphs: RuntimeError: operation not permitted"):
        got = Generator(graphed).generate(prompt, max_new_tokens=12).token_ids
    assert got == ref and steps.captures == 0 and steps.failed is not None


def test_bench_rows_take_graphs() -> None:
    from dartspec.bench.suite import _target_for, parse_methods

    ar, dart = parse_methods("ar:graphs=0,dart:graphs=1,size=32")
    assert (ar.graphs, dart.graphs, dart.tree_size) == (False, True, 32) and dart.own_target
    target = LeanTarget(tiny_model("llama"), tiny_tokenizer())
    assert _target_for(ar, target, {}) is target  # what the main target already is
    with pytest.raises(DartspecError, match="needs the lean runtime on a CUDA GPU"):
        _target_for(dart, target, {})


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_graph_batch_steps_decode_as_the_forward(arch: str) -> None:
    """The data generator's static-batch step as a graph: the same answers greedy and sampled, with rows ending at
    different steps (the batch drops them: new buffers, captured again) and reads every few steps; each step still
    reads nothing back (the generator's one read per check is all there is)."""
    plain = runtime("lean", arch)
    graphed = LeanTarget(plain.model, tiny_tokenizer())
    steps = graphed.step_graphs = StepGraphs(graphed, capture=False)
    batch = prompts(11, seed=3)
    free = decode_batch(plain, batch, 24, stop_ids=frozenset())
    stops = frozenset(a.tokens[(5 * i) % 24] for i, a in enumerate(free[:5]))
    for every in (1, 3):
        want = decode_batch(plain, batch, 24, stop_ids=stops, check_every=every)
        assert len({len(a.tokens) for a in want}) > 2
        before = steps.captures
        assert decode_batch(graphed, batch, 24, stop_ids=stops, check_every=every) == want
        assert steps.captures >= before + 2  # the first step, and again after rows were dropped
    sampled = [decode_batch(t, batch, 20, temperature=0.8, seed=4) for t in (plain, graphed)]
    assert sampled[0] == sampled[1]
    with HostReads() as reads:
        decode_batch(graphed, batch, 16, stop_ids=frozenset(), check_every=4)
    assert reads.sites == {("tolist", "batch_decode.py:decode_batch"): 4}, reads.sites


def test_graphs_are_the_default_wherever_they_can_run() -> None:
    """auto (None): on for the lean runtime on a CUDA GPU, off elsewhere; asked for where they cannot run: an error;
    the command line's on / off / auto map to True / False / None."""
    from dartspec.cli import build_parser
    from dartspec.targets import resolve_graphs

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert resolve_graphs(None, "lean", gpu) is True
    assert resolve_graphs(None, "hf", gpu) is False and resolve_graphs(None, "lean", cpu) is False
    assert resolve_graphs(False, "lean", gpu) is False
    for kind, device in (("hf", gpu), ("lean", cpu)):
        with pytest.raises(DartspecError, match="needs the lean runtime on a CUDA GPU"):
            resolve_graphs(True, kind, device)
    parser = build_parser()
    assert parser.parse_args(["generate", "--prompt", "x"]).cuda_graphs == "auto"
    assert parser.parse_args(["generate", "--prompt", "x", "--cuda-graphs", "off"]).cuda_graphs == "off"
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--prompt", "x", "--cuda-graphs", "maybe"])


def test_a_method_option_written_with_a_colon_says_how_to_write_it() -> None:
    from dartspec.bench.suite import parse_methods

    with pytest.raises(DartspecError, match="separated by commas"):
        parse_methods("dart:size=16:graphs=1")
