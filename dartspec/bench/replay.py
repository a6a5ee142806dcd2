"""``dartspec bench replay``: DART's tau for any tree settings, replayed from one teacher-forced pass per answer.

In greedy decoding the text is plain decoding's whatever the drafter does, and a DART drafter's rows at a step
depend on that text alone: the committed positions' features are the target's own (the verification pass computes
them for whichever path it accepted), and the mask slots follow the anchor. So one teacher-forced drafter pass over
a greedy answer gives the d rows of every step the drafter could take, and a decode replays without the target: at
anchor ``a`` (the last position with committed features; the root is token ``a + 1``) build the tree from ``a``'s
rows, accept the longest path that follows the answer, commit it and the target's next token, move on. Tau (tokens
per target forward, the prefill counted as one, as ``dartspec bench`` counts it) comes out in milliseconds per
setting instead of a decode, without timing noise, so tree builders, sizes and n-gram settings can be compared on
the same answers (``tests/test_replay.py`` holds it equal to the engine's own decode).

It replays what the engine's torch drafter computes; on a CPU drafting runs on C kernels with 8-bit weight groups
(:mod:`dartspec.drafters.dart_fast`), whose rounding can move a near-tie, so a CPU decode's tau may differ slightly.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dartspec.errors import DartspecError
from dartspec.tree import DraftBudget

Progress = Callable[[Iterable[Any], int, str], Iterable[Any]]


@dataclass
class Replay:
    """One method's replayed decodes: target forwards (prefills included) and new tokens, summed over answers."""

    label: str
    forwards: int = 0
    tokens: int = 0
    accepted: list[int] = field(default_factory=list)  # accepted drafts of every step, in order
    nodes: list[int] = field(default_factory=list)  # tree size of every step
    answer_taus: list[float] = field(default_factory=list)  # each answer's own tau

    @property
    def tau(self) -> float:
        """The median of the answers' taus (as ``dartspec bench`` reports tau)."""
        return float(np.median(self.answer_taus)) if self.answer_taus else 0.0

    @property
    def pooled_tau(self) -> float:
        """All answers' tokens over all their forwards."""
        return self.tokens / self.forwards if self.forwards else 0.0

    def accept_rate(self, depth: int) -> float:
        """Share of steps that accepted at least ``depth`` drafted tokens."""
        return float(np.mean([a >= depth for a in self.accepted])) if self.accepted else 0.0


@torch.no_grad()
def anchor_rows(
    model: Any, target: Any, tokens: Sequence[int], prompt_len: int, out: Any | None = None
) -> torch.Tensor:
    """The drafter's log-probabilities ``(A, d, draft vocab)`` at anchors ``prompt_len - 1 .. len - 3`` of a prompt
    + answer (anchor ``a``'s row t predicts token ``a + 1 + t``), all from one teacher-forced forward: the
    training layout (:func:`dartspec.train.dart_loss.anchor_layout`) with an anchor block at every position.
    ``out``: the target's ``score_sequence`` of the tokens on the model's feature layers, if already computed."""
    from dartspec.train.dart_loss import anchor_layout

    n, d = len(tokens), model.cfg.depth
    anchors = torch.arange(prompt_len - 1, n - 2)
    if anchors.numel() == 0:
        return torch.zeros(0, d, model.cfg.draft_vocab_size)
    ids = torch.as_tensor(list(tokens), dtype=torch.long, device=target.device)
    out = out if out is not None else target.score_sequence(ids)
    param = next(model.parameters())
    features = out.features[: n - 1].to(param.dtype)
    embeds = target.embed(ids[1:]).to(param.dtype)
    layout = anchor_layout(n, prompt_len, d, anchors, device=param.device)
    x_r, h_r = model.real_inputs(features, embeds)
    x_m, h_m = model.mask_inputs(anchors.numel() * (d - 1))
    hidden = model(torch.cat([x_r, x_m]), torch.cat([h_r, h_m]), layout.positions, layout.mask)
    slots = layout.n_real + torch.arange(anchors.numel() * (d - 1), device=param.device).view(-1, d - 1)
    rows = torch.cat([anchors.to(param.device)[:, None], slots], dim=1)  # (A, d): real row, then its slots
    return torch.log_softmax(model.lm_head(hidden[rows]).float(), dim=-1).cpu()


def replay_answer(
    rows: torch.Tensor,
    tokens: Sequence[int],
    prompt_len: int,
    drafter: Any,
    tree_size: int,
    max_depth: int,
    limit: int,
    into: Replay,
) -> None:
    """Replay the greedy decode of ``tokens`` (prompt + answer, written with ``limit`` new tokens at most) with
    ``drafter``'s tree builder (its d2t and online n-gram as it drafts) on :func:`anchor_rows`' ``rows``, within the
    engine's budget per step, adding its forwards, tokens and steps to ``into``."""
    n = len(tokens)
    text = list(tokens)
    online = getattr(drafter, "online", None)
    if online is not None:
        online.reset()
    forwards = 1  # the prefill, which commits the answer's first token
    a = prompt_len - 1
    while a <= n - 3:
        committed = text[: a + 2]
        new = a + 2 - prompt_len  # answer tokens committed, the root included
        budget = DraftBudget(max_nodes=tree_size, max_depth=max(0, min(max_depth, limit - new - 1)))
        depth = min(budget.max_depth, budget.max_nodes - 1)
        if online is not None:
            online.extend(committed[len(online.history) :])
        tree = drafter.tree_builder(committed[-1], rows[a - (prompt_len - 1), :depth], drafter.d2t, committed, budget)
        node, accepted = 0, 0
        while a + 2 + accepted < n:
            child = tree.child_with_token(node, text[a + 2 + accepted])
            if child is None:
                break
            node, accepted = child, accepted + 1
        forwards += 1
        into.accepted.append(accepted)
        into.nodes.append(tree.size)
        a += accepted + 1
    into.forwards += forwards
    into.tokens += n - prompt_len
    into.answer_taus.append((n - prompt_len) / forwards)


@dataclass(frozen=True)
class ReplayEntry:
    """One method to replay: a DART drafter (its network, tree builder, d2t and online n-gram) at a tree size."""

    label: str
    drafter: Any
    tree_size: int
    max_depth: int
    network: str  # entries naming the same network share one teacher-forced pass per answer


def replay_samples(
    target: Any,
    entries: Sequence[ReplayEntry],
    samples: Iterable[tuple[np.ndarray, int]],
    limit: int | None = None,
) -> list[Replay]:
    """Replay every entry on every ``(prompt + greedy answer ids, prompt length)`` sample; ``limit``: the decodes'
    token limit (None: each answer's own length, as if decoded with exactly that many new tokens)."""
    replays = [Replay(entry.label) for entry in entries]
    for tokens, prompt_len in samples:
        ids = np.asarray(tokens).tolist()
        rows: dict[str, torch.Tensor] = {}
        scored: dict[tuple[int, ...], Any] = {}  # one target pass per answer and feature layers
        for entry, replay in zip(entries, replays, strict=True):
            model = entry.drafter.model
            if entry.network not in rows:
                layers = tuple(model.cfg.feature_layers)
                if layers not in scored:
                    target.set_feature_layers(list(layers))
                    scored[layers] = target.score_sequence(ids)
                rows[entry.network] = anchor_rows(model, target, ids, prompt_len, scored[layers])
            budget = limit if limit is not None else len(ids) - prompt_len
            replay_answer(
                rows[entry.network], ids, prompt_len, entry.drafter, entry.tree_size, entry.max_depth, budget, replay
            )
    return replays


def format_replays(replays: Sequence[Replay], meta: dict[str, Any]) -> str:
    depths = range(1, 5)
    lines = [
        f"## Replayed tau: {meta['dataset']} ({meta['answers']} greedy answers, <= {meta['max_new_tokens']} new "
        f"tokens, {meta['model']})",
        "",
        "| method | tau (median) | tau (pooled) | mean nodes | steps | "
        + " | ".join(f"accept >= {d}" for d in depths)
        + " |",
        "|---|---|---|---|---|" + "---|" * len(depths),
    ]
    for r in replays:
        rates = " | ".join(f"{r.accept_rate(d):.2f}" for d in depths)
        nodes = np.mean(r.nodes or [0])
        lines.append(f"| {r.label} | {r.tau:.3f} | {r.pooled_tau:.3f} | {nodes:.1f} | {len(r.accepted)} | {rates} |")
    return "\n".join(lines)


def replay_methods(text: str) -> list[Any]:
    """``dartspec bench`` method strings that replay can run (DART at a fixed size on the main target), checked."""
    from dartspec.bench.suite import parse_methods

    specs = parse_methods(text)
    for spec in specs:
        if spec.kind not in ("dart", "dart+pld") or spec.own_target or spec.tree_size == "auto":
            raise DartspecError(
                "bench replay replays DART's trees (dart, dart+pld) on the main target at a fixed size; "
                f"{spec.label!r} is not one"
            )
    return specs


class LookupReplay:
    """``dart+pld`` replayed: a DART drafter's trees with prompt-lookup spans merged in as the hybrid drafter merges
    them (:func:`dartspec.drafters.hybrid.hybrid_tree`, with its cap on DART's share); spans are a function of the
    committed tokens alone."""

    def __init__(self, hybrid: Any) -> None:
        self.dart, self.lookup, self.draft_nodes = hybrid.drafter, hybrid.lookup, hybrid.draft_nodes
        self.model, self.d2t = self.dart.model, self.dart.d2t
        self.online = getattr(self.dart, "online", None)

    def tree_builder(
        self, root: int, logp: torch.Tensor, d2t: np.ndarray, tokens: Sequence[int], budget: DraftBudget
    ) -> Any:
        from dartspec.drafters.hybrid import hybrid_tree

        def dart(room: DraftBudget) -> Any:
            return self.dart.tree_builder(root, logp, d2t, tokens, room)

        return hybrid_tree(self.lookup, tokens, budget, dart, self.draft_nodes)


def run_replay_bench(
    args: argparse.Namespace, target: Any, log: Callable[[str], None], progress: Progress | None = None
) -> list[dict[str, Any]]:
    """Replay each of ``args.methods`` (DART rows of ``dartspec bench``'s method strings) on the target's greedy
    answers to ``args.dataset``; print the table and write ``replay.md`` / ``replay.json`` into ``args.out``."""
    from dartspec.bench.suite import encode_prompts, load_prompts
    from dartspec.methods import build_generator
    from dartspec.train.evaluate import greedy_samples

    specs = replay_methods(args.methods)
    data = Path(args.dataset)
    if data.is_dir():  # a regenerated data folder: its prompts, answered again greedily
        from dartspec.train.cli import samples_from

        prompt_ids = [s.tokens[: s.prompt_len].tolist() for s in samples_from(str(data))][: args.limit]
    else:
        prompt_ids = [p for _, p in encode_prompts(target, load_prompts(args.dataset, limit=args.limit))]
    if not prompt_ids:
        raise DartspecError(f"no prompts in {args.dataset}")
    generators = [build_generator(target, spec.generator_spec()) for spec in specs]
    log(f"the target answers {len(prompt_ids)} prompts greedily ({args.max_new_tokens} new tokens at most)")
    samples = greedy_samples(
        target, prompt_ids, args.max_new_tokens, progress and (lambda items, n: progress(items, n, "answers"))
    )
    entries = [
        ReplayEntry(
            spec.label,
            LookupReplay(gen.drafter) if spec.kind == "dart+pld" else gen.drafter,
            gen.tree_size,
            gen.max_depth,
            spec.path or "shipped",
        )
        for spec, gen in zip(specs, generators, strict=True)
    ]
    items = progress(samples, len(samples), "replay") if progress else samples
    replays = replay_samples(target, entries, items, args.max_new_tokens)
    meta = {
        "model": target.name,
        "dataset": args.dataset,
        "answers": len(samples),
        "max_new_tokens": args.max_new_tokens,
    }
    report = format_replays(replays, meta)
    print(report + "\n", flush=True)
    results = [
        {
            **meta,
            "method": r.label,
            "tau": round(r.tau, 4),
            "pooled_tau": round(r.pooled_tau, 4),
            "answer_taus": [round(t, 4) for t in r.answer_taus],
            "steps": len(r.accepted),
            "mean_nodes": float(np.mean(r.nodes or [0])),
        }
        for r in replays
    ]
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "replay.md").write_text(report + "\n")
        (out / "replay.json").write_text(json.dumps(results, indent=2, default=float) + "\n")
        log(f"saved {out}/replay.md, replay.json")
    return results
