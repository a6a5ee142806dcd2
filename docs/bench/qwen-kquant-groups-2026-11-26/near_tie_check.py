from unittest import mock

import dartspec.weight_cache as wc
from dartspec import kquants
from dartspec.bench.suite import encode_prompts, load_prompts
from dartspec.methods import GeneratorSpec, build_generator
from dartspec.targets import load_target

new = load_target("qwen2.5-coder-0.5b")
hf = load_target("qwen2.5-coder-0.5b", runtime="hf")
with (
    mock.patch.object(kquants, "source_gguf", lambda folder: None),
    mock.patch.object(wc.PackedCache, "for_model", lambda *a, **k: None),
):
    old = load_target("qwen2.5-coder-0.5b")
ids = encode_prompts(new, load_prompts("mtbench", limit=8))[6][1]
outs = {
    k: build_generator(t, GeneratorSpec(drafter="none")).generate(ids, max_new_tokens=128).token_ids
    for k, t in (("hf", hf), ("new", new), ("old", old))
}
ref = outs["hf"]
for k in ("new", "old"):
    first = next((i for i, (a, b) in enumerate(zip(ref, outs[k], strict=False)) if a != b), None)
    print(k, "same as hf fp32" if outs[k] == ref else f"differs from hf at token {first}")
