"""``dartspec bench accuracy``: a drafter's teacher-forced top-1 agreement with the target, per depth.

No timing, so the figures do not drift with the machine: on benchmark prompts (MT-Bench, HumanEval,
a JSONL file) the target first writes its own greedy answers; on a regenerated data folder (e.g. the
dev split) the stored answers are used. See :mod:`dartspec.train.evaluate` for what a hit means.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from dartspec.errors import DartspecError
from dartspec.train.evaluate import DepthAccuracy, depth_accuracy, greedy_samples, load_drafter_model, model_objective

Progress = Callable[[Iterable[Any], int, str], Iterable[Any]]


def format_report(acc: DepthAccuracy, meta: dict[str, Any]) -> str:
    label = "step" if meta["drafter"] == "eagle3" else "depth"
    head = " | ".join(str(i + 1) for i in range(len(acc.top1)))
    lines = [
        f"## Teacher-forced top-1 agreement: {meta['drafter']} on {meta['dataset']} ({acc.sequences} answers)",
        "",
        f"| {label} | {head} |",
        "|---|" + "---|" * len(acc.top1),
        "| top-1 | " + " | ".join(f"{a:.3f}" for a in acc.top1) + " |",
        "| scored | " + " | ".join(str(c) for c in acc.scored) + " |",
        "",
        f"chain tau estimate {acc.chain_tau_est:.2f} (1 + sum of running products; `dartspec bench` measures tau)",
    ]
    return "\n".join(lines)


def run_accuracy_bench(
    args: argparse.Namespace, target: Any, log: Callable[[str], None], progress: Progress | None = None
) -> list[dict[str, Any]]:
    """Measure each of ``args.drafters`` on the same answers; print the tables and write ``accuracy.md`` /
    ``accuracy.json`` into ``args.out`` if given.

    ``progress(items, total, label)`` wraps the loops (a tqdm bar on the command line).
    """
    from dartspec.bench.suite import encode_prompts, load_prompts

    if args.drafter_path and len(args.drafters) > 1:
        raise DartspecError("--drafter-path needs a single --drafter")
    data = Path(args.dataset)
    if data.is_dir():
        from dartspec.train.cli import samples_from

        stored = [(s.tokens, s.prompt_len) for s in samples_from(str(data))][: args.limit]
    else:
        prompts = load_prompts(args.dataset, limit=args.limit)
    # Every drafter loads before minutes of answering, so a bad checkpoint fails at once.
    models = {kind: load_drafter_model(kind, target, args.drafter_path) for kind in args.drafters}
    if data.is_dir():
        samples, source = stored, "stored answers"
    else:
        log(f"the target answers {len(prompts)} prompts greedily ({args.max_new_tokens} new tokens at most)")
        ids = [p for _, p in encode_prompts(target, prompts)]
        samples = greedy_samples(
            target, ids, args.max_new_tokens, progress and (lambda items, n: progress(items, n, "answers"))
        )
        source = f"greedy answers, <= {args.max_new_tokens} new tokens"
    if not samples:
        raise DartspecError(f"no samples in {args.dataset}")
    results, reports = [], []
    for kind, model in models.items():
        scored = progress(samples, len(samples), f"scoring {kind}") if progress else samples
        target.set_feature_layers(model.cfg.feature_layers)
        acc = depth_accuracy(target, scored, model_objective(model, anchors=args.anchors), depth=model.cfg.depth)
        meta = {
            "model": target.name,
            "drafter": kind,
            "drafter_path": args.drafter_path or "shipped",
            "dataset": args.dataset,
            "answers": source,
            "anchors": args.anchors,
        }
        reports.append(format_report(acc, meta))
        print(reports[-1] + "\n", flush=True)
        results.append({**meta, **acc.as_dict(), "scored": acc.scored, "sequences": acc.sequences})
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "accuracy.md").write_text("\n\n".join(reports) + "\n")
        (out / "accuracy.json").write_text(json.dumps(results, indent=2) + "\n")
        log(f"saved {out}/accuracy.md, accuracy.json")
    return results
