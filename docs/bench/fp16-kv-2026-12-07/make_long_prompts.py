"""Long-context development prompts: ShareGPT conversations 14,000-14,999 (the training side of the split) written out
as one user message of 1,500-2,500 SmolLM2 tokens, with a request to summarize them. 20 prompts, to `long20.jsonl`.

    .venv/bin/python docs/bench/fp16-kv-2026-12-07/make_long_prompts.py
"""

import json
from pathlib import Path

from dartspec.data.sources import iter_sharegpt
from dartspec.targets import load_target

ASK = "\n\nSummarize the conversation above in three sentences."
target = load_target("smollm2-135m")
out = []
for index, turns in iter_sharegpt(14_000, 15_000):
    text = "\n\n".join(f"{'User' if t['role'] == 'user' else 'Assistant'}: {t['content']}" for t in turns) + ASK
    n = len(target.encode_chat([{"role": "user", "content": text}]))
    if 1_500 <= n <= 2_500:
        out.append({"id": f"sharegpt/{index}", "prompt": text, "tokens": n})
    if len(out) == 20:
        break
path = Path(__file__).with_name("long20.jsonl")
path.write_text("".join(json.dumps(r) + "\n" for r in out))
print(f"{len(out)} prompts, {sum(r['tokens'] for r in out) / len(out):.0f} tokens on average -> {path}")
