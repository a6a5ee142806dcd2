"""``dartspec bench fidelity``: the gate a weight format must pass before it may be a default.

A quantized target is a different model from the fp32 one (losslessness holds relative to the format
chosen), so a format is judged by how little it changes the model, against transformers' own fp32 forward:

- perplexity of the target's stored answers on the dev split within 2% of fp32's;
- greedy answers to MT-Bench's first 10 questions identical to fp32's for their first 32 tokens on at
  least 8 of 10.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dartspec.engine import Generator
from dartspec.targets import describe, wrap_format, wrap_model

PPL_TOLERANCE = 0.02
SAME_TOKENS = 32
MIN_SAME = 8


@torch.inference_mode()
def answer_perplexity(target: Any, samples: list[tuple[Any, int]]) -> float:
    """exp(mean negative log-likelihood) of the answer tokens of ``(tokens, prompt_len)`` samples."""
    nll, count = 0.0, 0
    for tokens, prompt_len in samples:
        ids = torch.as_tensor(tokens.astype("int64"))
        logp = torch.log_softmax(target.score_sequence(ids).logits[:-1].double(), dim=-1)
        picked = logp.gather(1, ids[1:, None].to(logp.device))[:, 0]
        nll -= float(picked[prompt_len - 1 :].sum())
        count += len(ids) - prompt_len
    return math.exp(nll / max(count, 1))


def run_fidelity_bench(
    target: Any,
    formats: list[str],
    *,
    dev: str,
    sequences: int,
    questions: int,
    log: Callable[[str], None],
    out: str | None = None,
) -> dict[str, Any]:
    """Perplexity and greedy-answer agreement of each ``RUNTIME:QUANT`` in ``formats`` against fp32."""
    from dartspec.bench.suite import encode_prompts, load_prompts
    from dartspec.train.cli import samples_from

    reference = wrap_model(target.model, target.tokenizer, runtime="hf", name=target.name)
    runtimes = {describe(reference): reference}
    for item in formats:
        other = wrap_format(target, item)
        runtimes.setdefault(describe(other), other)
    samples = [(s.tokens, s.prompt_len) for s in samples_from(dev)][:sequences]
    prompts = [ids for _, ids in encode_prompts(target, load_prompts("mtbench", limit=questions))]
    ref_name = describe(reference)
    answers: dict[str, list[list[int]]] = {}
    rows = []
    for name, runtime in runtimes.items():
        log(f"{name}: perplexity on {len(samples)} dev answers, greedy answers to {len(prompts)} MT-Bench questions")
        ppl = answer_perplexity(runtime, samples)
        gen = Generator(runtime)
        answers[name] = [gen.generate(ids, max_new_tokens=SAME_TOKENS).token_ids for ids in prompts]
        rows.append({"format": name, "perplexity": ppl})
    ref_ppl = rows[0]["perplexity"]
    for row in rows:
        same = sum(a == b for a, b in zip(answers[row["format"]], answers[ref_name], strict=True))
        row["ppl_change"] = row["perplexity"] / ref_ppl - 1
        row["same_answers"] = same
        row["passes"] = abs(row["ppl_change"]) <= PPL_TOLERANCE and same >= MIN_SAME * len(prompts) / 10
    lines = [
        f"### Fidelity gate: {target.name}, {len(samples)} dev answers, MT-Bench first {len(prompts)} "
        f"(greedy, first {SAME_TOKENS} tokens)",
        "",
        "| format | answer perplexity | vs fp32 | answers identical to fp32 | gate |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        gate = "reference" if r["format"] == ref_name else ("pass" if r["passes"] else "**fail**")
        lines.append(
            f"| {r['format']} | {r['perplexity']:.4f} | {r['ppl_change']:+.2%} | {r['same_answers']}/{len(prompts)} "
            f"| {gate} |"
        )
    for name in runtimes:
        if name == ref_name:
            continue
        differ = [i for i, (a, b) in enumerate(zip(answers[name], answers[ref_name], strict=True)) if a != b]
        for i in differ[:1] or [0]:
            lines += [
                "",
                f"MT-Bench question {i + 1}, {ref_name}: {target.decode(answers[ref_name][i])!r}",
                f"MT-Bench question {i + 1}, {name}: {target.decode(answers[name][i])!r}",
            ]
    report = "\n".join(lines)
    data = {"rows": rows, "answers": answers}
    if out:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "fidelity.md").write_text(report + "\n")
        (folder / "fidelity.json").write_text(json.dumps(data, indent=1))
        log(f"saved {folder}/fidelity.md, fidelity.json")
    print(report, flush=True)
    return data
