"""Gemma 3 270M past its sliding window: an 800-token prompt (the start of README.md), greedy answers of the lean
runtime (plain and with prompt lookup) against transformers' modules, and the argmax of the last 300 positions."""

from pathlib import Path

from dartspec.drafters import PromptLookupDrafter
from dartspec.engine import Generator
from dartspec.targets import load_target

lean = load_target("gemma3-270m")
hf = load_target("gemma3-270m", runtime="hf")
ids = lean.tokenizer(Path("README.md").read_text()[:4000])["input_ids"][:800]
print("prompt tokens", len(ids), lean.weight_format)
outs = {}
for name, target, drafter in (("lean", lean, None), ("lean+pld", lean, PromptLookupDrafter()), ("hf", hf, None)):
    result = Generator(target, drafter).generate(ids, max_new_tokens=48)
    outs[name] = result.token_ids
    print(name, result.stats.tokens_per_s, repr(result.text[:80]))
print("lean == hf:", outs["lean"] == outs["hf"], "pld == hf:", outs["lean+pld"] == outs["hf"])
a, b = lean.score_sequence(ids).logits[-300:], hf.score_sequence(ids).logits[-300:]
agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
print("logit diff last 300", (a - b).abs().max().item(), "argmax agree", agree)
