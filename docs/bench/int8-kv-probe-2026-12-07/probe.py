"""Would an 8-bit KV cache keep SmolLM2's answers? A simulation on transformers' fp32 forward (greedy, 128 tokens,
the 16 tuning prompts, ShareGPT 14600-14634): keys and values rounded to int8 as an attention call reads them.

- ``pos``: keys and values each with one scale per (position, kv head) (absmax / 127);
- ``chan``: values as ``pos``; keys with one scale per (channel, kv head, block of 16 positions), the last,
  incomplete block left unrounded (a cache would round a block of keys once it is complete);
- ``vpos`` / ``kchan``: only the values as ``pos`` / only the keys as ``chan``, the others unrounded;
- ``fp16``: keys and values rounded to fp16, what the shipped fp16 KV cache holds (the bar this probe sets: the
  same answers as fp32).

.venv/bin/python docs/bench/int8-kv-probe-2026-12-07/probe.py [MODE ...]  (default: none pos chan)

"""

import json
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from dartspec.models import resolve_model
from dartspec.tune import TUNE_PROMPTS

SCHEME = {"mode": "none"}


def q8(x: torch.Tensor, dim: int) -> torch.Tensor:
    scale = x.abs().amax(dim=dim, keepdim=True).clamp_min(1e-12) / 127
    return (x / scale).round().clamp(-127, 127) * scale


def keys_by_channel(k: torch.Tensor) -> torch.Tensor:
    t = k.shape[2] // 16 * 16
    if t == 0:
        return k
    b, h, _, d = k.shape
    blocks = q8(k[:, :, :t].reshape(b, h, t // 16, 16, d), dim=3).reshape(b, h, t, d)
    return torch.cat([blocks, k[:, :, t:]], dim=2)


def attention(module, query, key, value, attention_mask, **kw):
    mode = SCHEME["mode"]
    if mode == "fp16":
        key, value = key.half().float(), value.half().float()
    if mode in ("pos", "chan", "vpos"):
        value = q8(value, dim=-1)
    if mode == "pos":
        key = q8(key, dim=-1)
    elif mode in ("chan", "kchan"):
        key = keys_by_channel(key)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)


ALL_ATTENTION_FUNCTIONS["q8"] = attention
folder = resolve_model("smollm2-135m")
tok = AutoTokenizer.from_pretrained(folder)
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="q8").eval()
prompts = [json.loads(line)["prompt"] for line in TUNE_PROMPTS.read_text().splitlines()]
answers: dict[str, list[list[int]]] = {}
nll: dict[str, float] = {}
for mode in ["none", *(sys.argv[1:] or ["pos", "chan"])]:
    SCHEME["mode"] = mode
    answers[mode], total, count = [], 0.0, 0
    for i, p in enumerate(prompts):
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt")
        ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=128, do_sample=False)
        answers[mode].append(out[0, ids.shape[1] :].tolist())
        ref = torch.tensor([ids[0].tolist() + answers["none"][i]])
        with torch.no_grad():
            logits = model(ref).logits[0, ids.shape[1] - 1 : -1]
        total += torch.nn.functional.cross_entropy(logits, ref[0, ids.shape[1] :], reduction="sum").item()
        count += ref.shape[1] - ids.shape[1]
    nll[mode] = total / count
    same = sum(a == b for a, b in zip(answers[mode], answers["none"], strict=True))
    first = [
        next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        for a, b in zip(answers[mode], answers["none"], strict=True)
    ]
    print(
        f"{mode}: {same}/{len(prompts)} answers identical to fp32's (first differences at {first}); "
        f"perplexity of fp32's answers {torch.tensor(nll[mode]).exp():.4f} "
        f"({(torch.tensor(nll[mode] - nll['none']).exp() - 1) * 100:+.2f}%)",
        flush=True,
    )
