"""What one drafting step costs: DFlash at several depths of network against DART (torch and C kernels).

Random DFlash weights (the cost does not depend on training), the shipped DART drafter; a context of --context
positions, then one newly committed position per step (as in decoding), medians of --repeats steps.

    python scripts/drafter_cost.py --depth 8 --layers 1,2,3,5
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from dartspec.drafters import make_drafter
from dartspec.drafters.dart_model import DartConfig, DraftKV
from dartspec.drafters.dflash_model import DFlashModel, dflash_feature_layers
from dartspec.quant import use_fast_linears
from dartspec.targets import load_target


def median_ms(step: Callable[[int], None], first: int, repeats: int) -> float:
    times = []
    for r in range(repeats):
        started = time.perf_counter()
        step(first + r)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--layers", default="1,2,3,5")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=40)
    args = ap.parse_args()
    target = load_target(args.model)
    H, ctx = target.hidden_size, args.context
    embeds = torch.randn(ctx + args.repeats, H)
    for layers in (int(x) for x in args.layers.split(",")):
        target.set_feature_layers(dflash_feature_layers(target.num_layers))
        cfg = DartConfig.for_target(target, draft_vocab_size=8192, depth=args.depth, num_layers=layers)
        model = DFlashModel(cfg).eval()
        use_fast_linears(model, target)  # as the drafter runs it
        feats = torch.randn(ctx + args.repeats, len(cfg.feature_layers) * H)
        cache = DraftKV()
        model.step(feats[:ctx], embeds[:ctx], 0, cache)

        def step(n: int, model=model, feats=feats, cache=cache) -> None:
            model.step(feats[n : n + 1], embeds[n : n + 1], n, cache)

        ms = median_ms(step, ctx, args.repeats)
        print(f"DFlash, {layers} layer(s), depth {args.depth}: {ms:.2f} ms a step")
    dart = make_drafter("dart", target)
    feats = torch.randn(ctx + args.repeats, 3 * H)
    if dart._net is not None:
        dart._net.dart_step(feats[:ctx], embeds[:ctx], 0, args.depth)
        ms = median_ms(
            lambda n: dart._net.dart_step(feats[n : n + 1], embeds[n : n + 1], n, args.depth), ctx, args.repeats
        )
        print(f"DART, {type(dart._net).__name__}, depth {args.depth}: {ms:.2f} ms a step")
    cache = DraftKV()
    dart.model.step(feats[:ctx], embeds[:ctx], 0, cache, depth=args.depth)
    ms = median_ms(
        lambda n: dart.model.step(feats[n : n + 1], embeds[n : n + 1], n, cache, depth=args.depth), ctx, args.repeats
    )
    print(f"DART, torch, depth {args.depth}: {ms:.2f} ms a step")


if __name__ == "__main__":
    main()
