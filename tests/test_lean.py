"""The lean runtime against transformers' own forward, tree verification on every weight format, and its errors."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from conftest import VOCAB, tiny_model, tiny_tokenizer
from test_engine import RandomDrafter

from dartspec import exact, weight_cache
from dartspec.engine import Generator
from dartspec.errors import DartspecError
from dartspec.kv_cache import TreeKVCache
from dartspec.lean import LeanTarget
from dartspec.quant import PackedLinear, check_format
from dartspec.runtime import FeatureSource, TargetRuntime
from dartspec.target import Target
from dartspec.targets import FUSED_PROJECTIONS, describe, lean_copy_fits, resolve_runtime, wrap_model
from dartspec.tree import Tree

LEAN_ARCHS = ["llama", "qwen2", "qwen3", "gemma3"]


def _with_biases(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Random q/k/v biases (Qwen2 has them; zero-initialised they would test nothing)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.get_decoder().layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                if proj.bias is not None:
                    proj.bias.copy_(torch.randn(proj.bias.shape, generator=gen, dtype=proj.bias.dtype) * 0.5)
    return model


def _feature_atol(arch: str) -> float:
    return 1e-5 if arch == "gemma3" else 1e-6


@pytest.mark.parametrize("arch", LEAN_ARCHS)
def test_lean_logits_and_features_equal_transformers(arch: str) -> None:
    model = _with_biases(tiny_model(arch, seed=3), 3)
    lean = LeanTarget(model, tiny_tokenizer(), name=f"tiny-{arch}")
    hf = Target(model, tiny_tokenizer(), name=f"tiny-{arch}", fast_linear=False)
    ids = torch.randint(2, VOCAB, (40,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids[None]).logits[0]
    got = lean.score_sequence(ids)
    # transformers' RMSNorm rounds through float32 even for a float64 model: that sets the tolerance (Gemma 3's
    # residual stream, the features, starts at the embedding times sqrt(hidden) and passes four such norms a layer).
    torch.testing.assert_close(got.logits, ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(got.features, hf.score_sequence(ids).features, rtol=0, atol=_feature_atol(arch))
    # Incremental: prefill, then a second chunk against the cache, with features.
    for t in (lean, hf):
        t.reset()
        t.prefill(ids[:25].tolist(), features=True)
    a, b = lean.prefill(ids[25:].tolist(), features=True), hf.prefill(ids[25:].tolist(), features=True)
    torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(a.features, b.features, rtol=0, atol=_feature_atol(arch))


@pytest.mark.skipif(not exact.available(), reason="needs gcc and an AVX2 CPU")
@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "qwen3-d64", "gemma3"])
def test_fused_attention_equals_transformers_in_float32(arch: str) -> None:
    # float32 on CPU: up to 64 new rows take the C attention block (per-head norms, rotary, cache write,
    # masked softmax), longer prefills SDPA; both against transformers' own forward. 64-dimension heads have
    # their own value sum in C. Gemma 3's sliding-window layers (a window of 8 here) see only the keys within it.
    arch, head_dim = ("qwen3", 64) if arch == "qwen3-d64" else (arch, 8)
    model = _with_biases(tiny_model(arch, seed=7, head_dim=head_dim), 7).float()
    lean = LeanTarget(model, tiny_tokenizer())
    assert lean._fused_attention
    ids = torch.randint(2, VOCAB, (100,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids[None]).logits[0]
    torch.testing.assert_close(lean.score_sequence(ids).logits, ref, rtol=0, atol=1e-4)  # SDPA (100 rows)
    torch.testing.assert_close(lean.score_sequence(ids[:40]).logits, ref[:40], rtol=0, atol=1e-4)  # fused
    lean.prefill(ids[:70].tolist())
    chain = Tree.chain(int(ids[70]), ids[71:80].tolist())
    torch.testing.assert_close(lean.verify(chain).logits, ref[70:80], rtol=0, atol=1e-4)  # fused, causal mask


def _random_tree(rng: np.random.Generator, root: int, size: int) -> Tree:
    tokens, parents = [root], [-1]
    while len(tokens) < size:
        tokens.append(int(rng.integers(0, VOCAB)))
        parents.append(int(rng.integers(0, len(tokens) - 1)))
    return Tree(np.array(tokens), np.array(parents))


def _step_by_step(t: LeanTarget, prompt: list[int], seq: list[int]) -> torch.Tensor:
    """Logits after ``prompt + seq`` decoded one token at a time on the same runtime (q = 1 forwards)."""
    t.reset()
    out = t.prefill(prompt)
    for tok in seq:
        out = t.verify(Tree.root_only(tok))
    return out.logits[-1]


@pytest.mark.parametrize(
    ("arch", "quant"),
    [("llama", "none"), ("qwen3", "none"), ("llama", "fp16"), ("qwen2", "int8")]
    + ([(a, q) for a in [*LEAN_ARCHS, "qwen3-d64"] for q in ("exact", "exact-a16")] if exact.available() else [])
    + ([(a, "exact-a16+kv16") for a in ("llama", "gemma3", "qwen3-d64")] if exact.available() else []),
)
def test_tree_verification_equals_sequential_decoding(arch: str, quant: str) -> None:
    # "qwen3-d64": heads of 64 dimensions, the size the C attention has a dedicated value sum for (SmolLM2's).
    # "+kv16": an fp16 KV cache (--kv-cache fp16), which a tree must read as decoding does.
    arch, head_dim = ("qwen3", 64) if arch == "qwen3-d64" else (arch, 8)
    quant, _, kv = quant.partition("+")
    model = _with_biases(tiny_model(arch, seed=5, head_dim=head_dim), 5)
    if quant != "none":
        model = model.float()  # the quantized kernels take float32 activations
    if quant.startswith("exact"):
        model = _with_biases(_gguf_like(model), 5)  # integer weight groups (biases stay float)
    t = LeanTarget(model, tiny_tokenizer(), quant=quant, kv_cache="fp16" if kv else "fp32")
    # The exact formats and fp16 on dartspec's C kernels compute every row alone (integer or row-wise GEMMs, fused
    # attention summing in position order), so a tree row equals the same token decoded alone bit for bit: a
    # summation order that depended on cache slots or row counts (a real bug once, 1 mismatch in 10 benchmark
    # answers) fails here. fbgemm's fp16 (no C kernels) and int8 GEMMs round per row count (same format, other
    # order); fp32 "none" differs by SDPA's reduction order.
    exact_fp16 = quant == "fp16" and exact.available()
    atol = {"none": 1e-9, "exact-a16": 0.0, "exact": 0.0}.get(quant, 0.0 if exact_fp16 else 2e-4)
    rng = np.random.default_rng(0)
    for _ in range(3):
        prompt = rng.integers(0, VOCAB, size=int(rng.integers(3, 30))).tolist()
        tree = _random_tree(rng, int(rng.integers(0, VOCAB)), int(rng.integers(2, 17)))
        t.reset()
        t.prefill(prompt)
        base = t.cached
        got = t.verify(tree).logits
        for node in range(tree.size):
            path = [int(tree.tokens[i]) for i in tree.path_to(node)]
            ref = _step_by_step(t, prompt, path)
            torch.testing.assert_close(got[node].to(ref.dtype), ref, rtol=0, atol=atol)
            assert int(got[node].argmax()) == int(ref.argmax())
        # Commit a branch and continue: the cache holds exactly prompt + that path.
        t.reset()
        t.prefill(prompt)
        t.verify(tree)
        node = int(rng.integers(0, tree.size))
        t.commit(base, tree.path_to(node))
        after = t.verify(Tree.chain(7, [3])).logits
        seq = [int(tree.tokens[i]) for i in tree.path_to(node)]
        torch.testing.assert_close(after[-1].to(ref.dtype), _step_by_step(t, prompt, [*seq, 7, 3]), rtol=0, atol=atol)


@pytest.mark.skipif(not exact.available(), reason="dartspec's C kernels do not build here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_transposed_keys_follow_every_change_to_the_cache(dtype: torch.dtype) -> None:
    """The C attention keeps the committed keys transposed in the cache and transposes only blocks past the count it
    is told is valid: every change to the keys (a kept path, a truncation, growth, new buffers) must lower that count,
    or it reads keys that are no longer there. Two caches in lockstep, one without the copy, give the same logits bit
    for bit through ~150 positions of random trees, commits and truncations across block boundaries (fp32 and fp16
    caches: the copy holds the cache's numbers)."""
    model = _gguf_like(tiny_model("qwen3", seed=3, head_dim=64).float())
    t = LeanTarget(model, tiny_tokenizer(), quant="exact-a16")
    kept = TreeKVCache(t.num_layers, capacity=16, dtype=dtype)
    plain = TreeKVCache(t.num_layers, capacity=16, transposed_keys=False, dtype=dtype)
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, VOCAB, size=12).tolist()
    for cache in (kept, plain):
        t.prefill(prompt, cache=cache)
    most = 0
    for step in range(60):
        tokens = rng.choice(VOCAB, size=int(rng.integers(1, 9)), replace=False)  # no two siblings alike
        parents = [-1] + [int(rng.integers(0, i)) for i in range(1, len(tokens))]
        tree = Tree(tokens, np.array(parents))
        base = kept.length
        got, ref = (t.verify(tree, cache=c).logits for c in (kept, plain))
        assert torch.equal(got, ref), f"step {step}: logits differ after {base} positions"
        path = tree.path_to(int(rng.integers(0, tree.size)))
        for cache in (kept, plain):
            t.commit(base, path, cache=cache)
        if step % 7 == 6:  # back across a block boundary, then on with other tokens
            length = max(len(prompt), kept.length - int(rng.integers(1, 24)))
            for cache in (kept, plain):
                cache.truncate(length)
        if step == 30:  # new buffers behind the table's back (static batching's select_rows)
            for cache in (kept, plain):
                cache.select_rows(torch.tensor([0]))
        most = max(most, kept.kt_valid)
    assert most >= 64 and plain.layers[0].kt is None  # the copy was used, the other cache had none
    assert kept.layers[0].kt.dtype == kept.layers[0].keys.dtype == dtype


@pytest.mark.parametrize("quant", ["none", "fp16", "int8"])
def test_speculative_greedy_equals_plain_decoding_on_each_format(quant: str) -> None:
    model = tiny_model("llama", seed=2).float()
    t = LeanTarget(model, tiny_tokenizer(), quant=quant)
    plain = Generator(t).generate(list(range(5, 15)), max_new_tokens=40)
    spec = Generator(t, RandomDrafter(seed=1, reference=plain.token_ids), tree_size=12, max_depth=5)
    out = spec.generate(list(range(5, 15)), max_new_tokens=40)
    assert out.token_ids == plain.token_ids
    assert out.stats.draft_tokens_accepted > 0


@pytest.mark.skipif(not exact.available(), reason="needs gcc and an AVX2 CPU")
def test_an_fp16_kv_cache_holds_the_fp32_caches_numbers_rounded_on_every_path() -> None:
    """``--kv-cache fp16``: a 100-token prompt goes through torch's attention (one forward past the C attention's 64
    rows), a chain after it through the C attention; the first layer's keys and values (which no rounding upstream
    changes) are the fp32 cache's rounded to fp16 on both paths, and speculative decoding over such a cache still
    gives plain decoding's tokens."""
    model = tiny_model("qwen3", seed=4, head_dim=64).float()
    t32 = LeanTarget(model, tiny_tokenizer(), quant="none")
    t16 = LeanTarget(model, tiny_tokenizer(), quant="none", kv_cache="fp16")
    prompt = np.random.default_rng(4).integers(2, VOCAB, size=100).tolist()
    for t in (t32, t16):
        t.prefill(prompt)
        t.verify(Tree.chain(5, [6, 7]))
    assert t16.cache.layers[0].keys.dtype == torch.float16 and t32.cache.layers[0].keys.dtype == torch.float32
    for name in ("keys", "values"):
        got, ref = (getattr(t.cache.layers[0], name)[:, :, :103] for t in (t16, t32))
        assert torch.equal(got, ref.half()), name
    plain = Generator(t16).generate(prompt, max_new_tokens=30)
    spec = Generator(t16, RandomDrafter(seed=1, reference=plain.token_ids), tree_size=12, max_depth=5)
    out = spec.generate(prompt, max_new_tokens=30)
    assert out.token_ids == plain.token_ids and out.stats.draft_tokens_accepted > 0


def test_kv_cache_choices_and_their_errors() -> None:
    """``--kv-cache auto`` is fp16 only where the C attention reads the cache and the model passed the fidelity gate
    with it; fp16 elsewhere is a one-line error; a format string names it as ``:kv=``."""
    from types import SimpleNamespace

    from dartspec.formats import parse_format
    from dartspec.targets import resolve_kv_cache

    smol = SimpleNamespace(model_type="llama", num_hidden_layers=30, hidden_size=576, vocab_size=49152)
    other = SimpleNamespace(model_type="llama", num_hidden_layers=2, hidden_size=576, vocab_size=49152)
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    expected_auto = "fp16" if exact.available() else "fp32"
    assert resolve_kv_cache("auto", "lean", cpu, torch.float32, smol) == expected_auto
    assert resolve_kv_cache("auto", "lean", cpu, torch.float32, other) == "fp32"
    assert resolve_kv_cache("auto", "hf", cpu, torch.float32, smol) == "fp32"
    assert resolve_kv_cache("auto", "lean", gpu, torch.float32, smol) == "fp32"
    assert resolve_kv_cache("auto", "lean", cpu, torch.bfloat16, smol) == "fp32"
    assert resolve_kv_cache("fp32", "lean", cpu, torch.float32, smol) == "fp32"
    for bad in (("fp16", "hf", cpu, torch.float32), ("fp16", "lean", gpu, torch.float32)):
        with pytest.raises(DartspecError, match="--kv-cache fp16 needs the lean runtime's C attention"):
            resolve_kv_cache(*bad, smol)
    with pytest.raises(DartspecError, match="unknown --kv-cache 'int8'"):
        resolve_kv_cache("int8", "lean", cpu, torch.float32, smol)
    assert parse_format("lean:auto:kv=fp16") == ("lean", "auto", "fp16")
    assert parse_format("lean:kv=fp32") == ("lean", "none", "fp32")
    assert parse_format("hf") == ("hf", "none", "auto")
    for bad_spec in ("lean:auto:kv=fp8", "lean:auto:fp16", "lean:auto:kv=fp16:x"):
        with pytest.raises(DartspecError, match="RUNTIME\\[:QUANT\\]\\[:kv=KV\\]"):
            parse_format(bad_spec)
    with pytest.raises(DartspecError, match="fp16 KV cache needs"):
        LeanTarget(tiny_model("llama", seed=0).double(), tiny_tokenizer(), kv_cache="fp16")
    if exact.available():
        t = LeanTarget(tiny_model("llama", seed=0).float(), tiny_tokenizer(), quant="none", kv_cache="fp16")
        assert describe(t) == "lean/none+kv16" and t.new_cache().dtype == torch.float16


def test_runtimes_satisfy_the_protocols() -> None:
    model = tiny_model("llama")
    for t in (LeanTarget(model, tiny_tokenizer()), Target(model, tiny_tokenizer())):
        assert isinstance(t, TargetRuntime)
        assert isinstance(t, FeatureSource)


def test_packed_linear_formats_approximate_fp32() -> None:
    gen = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(48, 32, generator=gen), torch.randn(48, generator=gen), torch.randn(5, 32, generator=gen)
    ref = torch.nn.functional.linear(x, w, b)
    torch.testing.assert_close(PackedLinear(w, b, "none")(x), ref)
    torch.testing.assert_close(PackedLinear(w, b, "fp16")(x), ref, rtol=0, atol=1e-2)
    err = (PackedLinear(w, b, "int8")(x) - ref).abs().max()
    assert 0 < err < 0.3  # 8-bit weights and per-row 8-bit activations: close, not equal


def test_auto_takes_the_lean_forward_on_a_gpu_only_where_its_copies_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lean forward keeps fused QKV and gate/up copies beside the model's own weights: on a GPU, ``auto`` takes
    it only if those copies need at most half the free memory (the free memory is faked; the model is on a CPU)."""
    model = tiny_model("llama", seed=1)
    copies = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n.endswith(FUSED_PROJECTIONS))
    # q, k, v, gate, up in every layer: what the lean forward copies, and nothing else.
    assert copies == sum(
        m.weight.numel() * m.weight.element_size()
        for layer in model.get_decoder().layers
        for m in (
            layer.self_attn.q_proj,
            layer.self_attn.k_proj,
            layer.self_attn.v_proj,
            layer.mlp.gate_proj,
            layer.mlp.up_proj,
        )
    )
    gpu = torch.device("cuda")
    for free, fits in [(2 * copies, True), (2 * copies - 1, False)]:
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device, free=free: (free, 10 * free))
        assert lean_copy_fits(model, gpu) is fits
    assert lean_copy_fits(model, torch.device("cpu"))  # host memory is not checked


def test_quant_and_runtime_errors_are_one_line() -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert resolve_runtime("auto", "auto", "llama", cpu) == ("lean", "exact-a16" if exact.available() else "fp16")
    assert resolve_runtime("auto", "auto", "gemma3_text", cpu) == resolve_runtime("auto", "auto", "llama", cpu)
    assert resolve_runtime("auto", "auto", "llama", gpu) == ("lean", "none")  # measured faster on a GPU too
    assert resolve_runtime("auto", "auto", "gemma3_text", gpu) == ("lean", "none")
    assert resolve_runtime("auto", "auto", "mistral", cpu) == ("hf", "none")
    for args, words in [
        (("auto", "int4", "llama", cpu), "unknown --quant 'int4'"),
        (("fast", "auto", "llama", cpu), "unknown --runtime 'fast'"),
        (("lean", "auto", "mistral", cpu), "lean runtime supports"),
        (("hf", "fp16", "llama", cpu), "needs the lean runtime"),
        (("lean", "fp16", "llama", gpu), "CPU format"),
    ]:
        with pytest.raises(DartspecError, match=words) as err:
            resolve_runtime(*args)
        assert "\n" not in str(err.value)
    with pytest.raises(DartspecError, match="CPU format"):
        check_format("int8", gpu)
    capped = tiny_model("gemma3")
    capped.config.final_logit_softcapping = 30.0  # as Gemma 2 has it
    with pytest.raises(DartspecError, match="caps its logits"):
        LeanTarget(capped, tiny_tokenizer())


def _gguf_like(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every linear weight made of Q4_1-style groups (``d * q + m``, q in 0..15, d and m fp16), the embedding
    of Q8_0-style groups (``d * q``, q int8): what a model converted from a GGUF file looks like."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() != 2:
                continue
            out, k = p.shape
            shape = (out, k // 32, 32)
            d = (torch.rand(out, k // 32, 1, generator=gen) * 0.02 + 0.001).half().float()
            if "embed" in name:
                q = torch.randint(-127, 128, shape, generator=gen).float()
                q[..., 0] = 127
                p.copy_((q * d).reshape(out, k))
            else:
                q = torch.randint(0, 16, shape, generator=gen).float()
                q[..., 0], q[..., 1] = 0, 15
                m = (torch.rand(out, k // 32, 1, generator=gen) * -0.15).half().float()
                p.copy_((q * d + m).reshape(out, k))
    return model


def test_exact_format_packs_gguf_groups_bit_for_bit_and_refuses_others() -> None:
    model = _gguf_like(tiny_model("llama", seed=4).float())
    for name, p in model.named_parameters():
        if p.dim() == 2:
            packed = exact.pack(p)
            assert packed is not None and packed.kind == (8 if "embed" in name else 4)
            assert torch.equal(exact.unpack(packed), p)
            if not exact.available():  # no C compiler / AVX2 here: the GEMM is tested where it builds
                continue
            x = torch.randn(5, p.shape[1])
            ref = torch.nn.functional.linear(x.double(), p.double()).float()
            torch.testing.assert_close(exact.linear(x, packed), ref, rtol=1e-5, atol=1e-5)
    assert exact.pack(torch.randn(8, 64)) is None  # random floats are no integer groups
    assert exact.pack(torch.randn(8, 48)) is None  # rows that are no whole number of groups


@pytest.mark.skipif(not exact.available(), reason="needs gcc and an AVX2 CPU")
@pytest.mark.parametrize("kind", [4, 8])
@pytest.mark.parametrize("half", [True, False])
def test_integer_dot_kernel_equals_its_reference_and_computes_each_row_alone(kind: int, half: bool) -> None:
    """``half``: scales and offsets that are half-precision numbers (as a GGUF's blocks store them) are kept in fp16,
    others in fp32; both compute the same thing."""
    gen = torch.Generator().manual_seed(kind)
    out, k = 37, 96  # 37: a last panel that is only partly filled
    d = (torch.rand(out, k // 32, 1, generator=gen) * 0.02 + 0.001).half().float()
    if kind == 4:
        q = torch.randint(0, 16, (out, k // 32, 32), generator=gen).float()
        q[..., 0], q[..., 1] = 0, 15
        m = (torch.rand(out, k // 32, 1, generator=gen) * -0.15).half().float()
    else:
        q = torch.randint(-127, 128, (out, k // 32, 32), generator=gen).float()
        q[..., 0], m = 127, torch.zeros(out, k // 32, 1)
    scaled, offset = (q * d).reshape(out, k), m.expand(-1, -1, 32).reshape(out, k)
    rows = exact.pack(scaled + offset)
    assert rows is not None and torch.equal(exact.unpack(rows), scaled + offset)
    if not half:  # scales exact in fp32 (11 + 1 significant bits) but no longer half-precision numbers
        rows = dataclasses.replace(rows, scale=rows.scale * (1 + 2**-20))
        scaled = (q * rows.scale[..., None]).reshape(out, k)
    packed = exact.to_panels(rows)
    assert packed.kind == kind and packed.panel in (8, 16)
    assert packed.scale.dtype == (torch.float16 if half else torch.float32)
    assert packed.offset is None or packed.offset.dtype == packed.scale.dtype
    x, bias = torch.randn(11, k, generator=gen) * 3, torch.randn(out, generator=gen)
    x[:, 7] = 40.0  # an outlier: only its own group's inputs lose precision
    y = exact.linear_a16(x, packed, bias)
    if half:  # the same numbers as fp32 scales: the same result, bit for bit
        wide = dataclasses.replace(
            packed, scale=packed.scale.float(), offset=None if packed.offset is None else packed.offset.float()
        )
        assert torch.equal(exact.linear_a16(x, wide, bias), y)
    # The kernel's arithmetic: d * q against inputs rounded to 16 bits per group, m against the exact inputs.
    ref = exact.quantize_activations(x).double() @ scaled.double().T + x.double() @ offset.double().T + bias
    torch.testing.assert_close(y.double(), ref, rtol=0, atol=1e-4)
    assert (y.double() - x.double() @ (scaled + offset).double().T - bias).abs().max() < 0.05
    for r in (0, 5, 10):  # a row's result does not depend on the rows beside it: trees compute what decoding does
        assert torch.equal(exact.linear_a16(x[r : r + 1], packed, bias)[0], y[r])


@pytest.mark.skipif(not exact.available(), reason="needs gcc and an AVX2 CPU")
@pytest.mark.parametrize("largest", [16, 8])
def test_q5_0_and_q4_0_groups_run_in_5_bits_and_compute_what_8_bits_do(largest: int) -> None:
    """8-bit groups whose values fit 5 bits (a GGUF's Q5_0 blocks, ``d * (q - 16)``; Q4_0's ``d * (q - 8)``) are laid
    out in 5 bits (kind 7: 20 bytes an output's group instead of 32) and give, row by row and bit for bit, what the
    same rows give in 8 bits (a weight with one more output, a Q8_0 group, keeps 8 bits)."""
    gen = torch.Generator().manual_seed(largest)
    out, k = 37, 96
    d = (torch.rand(out + 1, k // 32, 1, generator=gen) * 0.02 + 0.001).half().float()
    q = torch.randint(-largest, largest, (out + 1, k // 32, 32), generator=gen).float()
    q[:, :, 0] = -largest
    q[::3] *= -1  # a negative d (GGUF's Q5_0 and Q4_0 have either sign): values -15..16, negated in 5 bits
    q[out, 0, 1] = 127  # the extra output: a Q8_0 group
    rows = exact.pack((q * d).reshape(out + 1, k))
    assert rows is not None and rows.kind == 8
    eight = exact.to_panels(rows)
    five = exact.to_panels(dataclasses.replace(rows, data=rows.data[:out], scale=rows.scale[:out], out_features=out))
    assert (eight.kind, five.kind) == (8, 7) and five.scale.dtype == torch.float16
    assert five.data.nbytes == -(-out // five.panel) * five.panel * k * 5 // 8
    x, bias = torch.randn(11, k, generator=gen) * 3, torch.randn(out + 1, generator=gen)
    x[:, 7] = 40.0
    y = exact.linear_a16(x, five, bias[:out])
    assert torch.equal(y, exact.linear_a16(x, eight, bias)[:, :out])
    ref = exact.quantize_activations(x).double() @ (q[:out] * d[:out]).reshape(out, k).double().T + bias[:out]
    torch.testing.assert_close(y.double(), ref, rtol=0, atol=1e-4)
    for r in (0, 5, 10):
        assert torch.equal(exact.linear_a16(x[r : r + 1], five, bias[:out])[0], y[r])
    assert torch.equal(exact.linear_a16(x, exact.from_tensors(exact.to_tensors(five)), bias[:out]), y)


@pytest.mark.skipif(not exact.available(), reason="needs gcc and an AVX2 CPU")
@pytest.mark.parametrize("block", ["Q5_K", "Q6_K"])
def test_integer_dot_kernel_on_k_quant_groups_equals_its_reference(block: str) -> None:
    """Kinds 5 (a GGUF's Q5_K blocks: uint8 ``d * q + m``) and 6 (Q6_K: int8 groups whose halves of 16 have a scale
    each): gguf's own dequantization against inputs rounded to 16 bits per group of 32, each row computed alone."""
    gguf = pytest.importorskip("gguf")
    from test_kquants import random_q5_k, random_q6_k

    from dartspec import kquants

    out, k = 37, 512  # 37: a last panel that is only partly filled
    make, read = (random_q5_k, kquants.q5_k_groups) if block == "Q5_K" else (random_q6_k, kquants.q6_k_groups)
    raw = make(np.random.default_rng(6), out, k)
    weight = torch.from_numpy(gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, block)).astype(np.float32))
    packed = exact.to_panels(read(raw, out, k))
    assert (packed.scale.dtype, packed.offset.dtype) == (
        (torch.float32,) * 2 if block == "Q5_K" else (torch.int8, torch.float16)
    )
    rows = -(-out // packed.panel) * packed.panel
    assert packed.data.nbytes == rows * k * (1 if block == "Q5_K" else 3 / 4)  # Q6_K's values in 6 bits, as in the file
    gen = torch.Generator().manual_seed(6)
    x, bias = torch.randn(11, k, generator=gen) * 3, torch.randn(out, generator=gen)
    x[:, 7] = 40.0
    y = exact.linear_a16(x, packed, bias)
    # d * q against inputs rounded to 16 bits per group; an offset against the exact inputs (as for kind 4)
    q_only = read(raw, out, k)
    scaled = exact.unpack(dataclasses.replace(q_only, offset=None if q_only.offset is None else 0 * q_only.offset))
    ref = exact.quantize_activations(x).double() @ scaled.double().T + x.double() @ (weight - scaled).double().T + bias
    torch.testing.assert_close(y.double(), ref, rtol=0, atol=1e-4)
    for r in (0, 5, 10):
        assert torch.equal(exact.linear_a16(x[r : r + 1], packed, bias)[0], y[r])
    with pytest.raises(ValueError, match="kind"):
        exact.linear(x, q_only)  # the exact format's fp32 kernel has no such groups


@pytest.mark.skipif(not exact.available(), reason="needs gcc and an AVX2 CPU")
@pytest.mark.parametrize("block", ["Q4_K", "Q6_K"])
def test_integer_dot_kernel_on_k_quant_codes_computes_what_fp32_scales_do(block: str) -> None:
    """A K-quant weight in the file's own form (codes per group or half group, fp16 numbers per 256 inputs; the kernel
    forms their products) gives what its fp32 scales and offsets give, bit for bit, in fewer bytes; also from the
    packed-weight cache."""
    from test_kquants import random_q4_k, random_q6_k

    from dartspec import kquants

    out, k = 37, 512
    make, read = (random_q4_k, kquants.q4_k_groups) if block == "Q4_K" else (random_q6_k, kquants.q6_k_groups)
    rows = read(make(np.random.default_rng(4), out, k), out, k)
    compact, wide = exact.to_panels(rows), exact.to_panels(dataclasses.replace(rows, codes=None))
    assert compact.scale.dtype in (torch.uint8, torch.int8) and wide.scale.dtype == torch.float32
    assert compact.nbytes < (0.8 if block == "Q4_K" else 0.9) * wide.nbytes
    x, bias = torch.randn(11, k, generator=torch.Generator().manual_seed(4)) * 3, torch.randn(out)
    y = exact.linear_a16(x, compact, bias)
    assert torch.equal(y, exact.linear_a16(x, wide, bias))
    assert torch.equal(exact.linear_a16(x, exact.from_tensors(exact.to_tensors(compact)), bias), y)
    for r in (0, 5, 10):
        assert torch.equal(exact.linear_a16(x[r : r + 1], compact, bias)[0], y[r])


@pytest.mark.skipif(not exact.available(), reason="needs gcc and an AVX2 CPU")
def test_a_chain_of_parts_of_different_kinds_computes_what_each_part_does() -> None:
    """A fused projection whose parts are groups of different kinds (a Q4_K_M file's Q4_K query and key beside a Q6_K
    value) is a chain: each run of one kind concatenated, each part into its own columns, bit for bit what the part
    computes alone; also from the packed-weight cache's tensors."""
    from test_kquants import random_q4_k, random_q6_k

    from dartspec import kquants

    rng, k = np.random.default_rng(9), 512
    q4 = [kquants.q4_k_groups(random_q4_k(rng, n, k), n, k) for n in (40, 24, 8)]
    q6 = kquants.q6_k_groups(random_q6_k(rng, 21, k), 21, k)
    rows = exact.stack([q4[0], q4[1], q6, q4[2]])
    assert rows is not None and rows.out_features == 93
    assert [(p.kind, p.out_features) for p in exact.parts(rows)] == [(4, 64), (6, 21), (4, 8)]
    assert torch.equal(exact.unpack(rows), torch.cat([exact.unpack(w) for w in (*q4[:2], q6, q4[2])]))
    assert exact.stack([q4[0], q4[1]]).rest is None  # one kind: one part
    packed = exact.to_panels(rows)
    x, bias = torch.randn(6, k, generator=torch.Generator().manual_seed(9)), torch.randn(93)
    y = exact.linear_a16(x, packed, bias)
    alone = [exact.linear_a16(x, exact.to_panels(w)) for w in (exact.concat(q4[:2]), q6, q4[2])]
    assert torch.equal(y, torch.cat(alone, dim=1) + bias)
    assert torch.equal(exact.linear_a16(x, exact.from_tensors(exact.to_tensors(packed)), bias), y)
    assert packed.nbytes == sum(p.nbytes for p in exact.parts(packed))


def _attention_reference(qkv, heads, kv_heads, rot, keys, values, base, allowed, scale, stored=None):
    """Float64 attention of the C kernel's inputs: rotary on the new rows' queries and keys (adjacent pairs), the new
    keys and values after ``base`` cached ones, softmax over ``allowed`` ``(q, base + q)`` positions, GQA groups.
    ``stored``: the new rows' keys and values as the cache holds them ((q, KV, D) each; an fp16 cache's roundings),
    attended to instead of the exact ones."""
    q, dim = qkv.shape[0], keys.shape[-1]
    x = qkv.double()
    qs = x[:, : heads * dim].view(q, heads, dim)
    ks = x[:, heads * dim : (heads + kv_heads) * dim].view(q, kv_heads, dim)
    vs = x[:, (heads + kv_heads) * dim :].view(q, kv_heads, dim)

    def rotate(t: torch.Tensor) -> torch.Tensor:
        c, s = rot[:, None, :, 0].double(), rot[:, None, :, 1].double()
        out = torch.empty_like(t)
        out[..., 0::2] = t[..., 0::2] * c - t[..., 1::2] * s
        out[..., 1::2] = t[..., 0::2] * s + t[..., 1::2] * c
        return out

    qs, ks = rotate(qs), rotate(ks)
    new_k, new_v = (ks, vs) if stored is None else (t.double() for t in stored)
    all_k = torch.cat([keys[0, :, :base].double().permute(1, 0, 2), new_k])  # (base + q, KV, D)
    all_v = torch.cat([values[0, :, :base].double().permute(1, 0, 2), new_v])
    group = heads // kv_heads
    out = torch.empty(q, heads, dim, dtype=torch.float64)
    for i in range(q):
        for h in range(heads):
            scores = (all_k[:, h // group] @ qs[i, h]) * scale
            scores[~allowed[i]] = -float("inf")
            out[i, h] = torch.softmax(scores, 0) @ all_v[:, h // group]
    return out.view(q, heads * dim), ks, vs


def test_the_c_kernels_build_wherever_they_can() -> None:
    """Where the CPU and a compiler allow them, the C kernels build: a compile error in dartspec's own C fails here,
    instead of skipping every test that needs them (those skip where :func:`exact.available` is False)."""
    import platform
    import shutil

    flags = exact._cpu_flags()
    if platform.machine() not in ("x86_64", "AMD64") or not {"avx2", "fma", "f16c"} <= flags:
        pytest.skip("not an x86-64 CPU with AVX2, FMA and F16C")
    if shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("no C compiler")
    exact._library()  # raises with the compiler's first error line


@pytest.mark.skipif(not exact.available(), reason="needs gcc and an AVX2 CPU")
@pytest.mark.parametrize("dim", [64, 8])
@pytest.mark.parametrize("kv", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads_kv", [(6, 2), (7, 1), (8, 2), (4, 4)])
def test_c_attention_equals_a_float64_reference_with_and_without_a_cached_prefix(
    dim: int, kv: torch.dtype, heads_kv: tuple[int, int]
) -> None:
    """The fused C attention (exact.attend: rotary, the cache write, GQA attention) against float64 torch, causal and
    with a tree's mask, past an empty cache and past 5, 40 and 100 cached positions (64-wide heads: the AVX-512 paths;
    8-wide: the generic ones); each tree row's output equals that row's alone after its ancestors (a tree computes what
    decoding does). An fp16 cache (``--kv-cache fp16``): the new rows' keys and values are stored rounded to fp16
    (torch's rounding), and attention is that over the fp16 numbers the cache holds. Groups of 3, 7, 4 and 1 query
    heads a kv head: the value sums of up to 3 heads share each value row's read (chunks 3; 3, 2, 2; 2, 2; 1)."""
    (heads, kv_heads), scale = heads_kv, dim**-0.5
    gen = torch.Generator().manual_seed(dim)
    for base in (0, 5, 40, 100):
        cap = base + 8
        keys, values = (
            torch.randn(1, kv_heads, cap, dim, generator=gen).to(kv),
            torch.randn(1, kv_heads, cap, dim, generator=gen).to(kv),
        )
        tree = _random_tree(np.random.default_rng(base), 3, 5)
        for q, mask in ((1, None), (4, None), (5, "tree")):
            qkv = torch.randn(q, (heads + 2 * kv_heads) * dim, generator=gen) * 2
            rot = torch.nn.functional.normalize(torch.randn(q, dim // 2, 2, generator=gen), dim=-1)
            allowed = torch.ones(q, base + q, dtype=torch.bool)
            allowed[:, base:] = torch.ones(q, q, dtype=torch.bool).tril()
            if mask == "tree":
                allowed[:, base:] = torch.from_numpy(tree.ancestors)
            k_cache, v_cache = keys.clone(), values.clone()
            got = exact.attend(
                qkv,
                heads,
                kv_heads,
                rot,
                k_cache,
                v_cache,
                base,
                None if mask is None else allowed,
                None,
                None,
                1e-6,
                scale,
            )
            new_rows = tuple(c[0, :, base : base + q].permute(1, 0, 2) for c in (k_cache, v_cache))
            stored = None if kv == torch.float32 else new_rows
            ref, ks, vs = _attention_reference(qkv, heads, kv_heads, rot, keys, values, base, allowed, scale, stored)
            torch.testing.assert_close(got.double(), ref, rtol=0, atol=2e-5)
            # fp16: the rounding of a key the kernel rotated in fp32 (at most an fp16 step from the exact one's)
            rtol = 0 if kv == torch.float32 else 2**-10
            torch.testing.assert_close(new_rows[0].double(), ks, rtol=rtol, atol=1e-5)
            assert torch.equal(new_rows[1], vs.to(kv))
            if mask == "tree":  # each row alone: the prefix and its ancestors as a chain, the row last
                for row in (1, 4):
                    path = [int(j) for j in torch.nonzero(allowed[row, base:]).flatten()]
                    k_alone, v_alone = keys.clone(), values.clone()
                    exact.attend(
                        qkv[path[:-1]],
                        heads,
                        kv_heads,
                        rot[path[:-1]],
                        k_alone,
                        v_alone,
                        base,
                        None,
                        None,
                        None,
                        1e-6,
                        scale,
                    )
                    alone = exact.attend(
                        qkv[path[-1:]],
                        heads,
                        kv_heads,
                        rot[path[-1:]],
                        k_alone,
                        v_alone,
                        base + len(path) - 1,
                        None,
                        None,
                        None,
                        1e-6,
                        scale,
                    )
                    assert torch.equal(alone[0], got[row])


@pytest.mark.skipif(not exact.available(), reason="needs gcc and an AVX2 CPU")
def test_the_c_head_gives_the_kernels_logits_and_torchs_argmax_with_ties_and_nans() -> None:
    """:class:`exact.Head` (the lean runtime's LM head on a CPU): the logits are :func:`exact.linear_a16`'s bit for
    bit, on one kind and on a chain of kinds, and each row's argmax is ``torch.argmax``'s: the first of tied largest
    logits (rows of the head repeated), the first NaN where a row has one, 0 for a row of -inf only (a bias)."""
    from test_kquants import random_q4_k, random_q6_k

    from dartspec import kquants

    gen = torch.Generator().manual_seed(3)
    out, k = 1000, 96  # a vocabulary that is no whole number of panels
    q = torch.randint(-127, 128, (out, k // 32, 32), generator=gen).float()
    q[..., 0] = 127
    d = (torch.rand(out, k // 32, 1, generator=gen) * 0.01 + 0.001).half().float()
    w = (q * d).reshape(out, k)
    w[[400, 700, 999]] = w[123].clone()  # four rows with the same logits everywhere
    eight = exact.to_panels(exact.pack(w))
    rng = np.random.default_rng(3)
    q4 = kquants.q4_k_groups(random_q4_k(rng, 40, 256), 40, 256)
    q6 = kquants.q6_k_groups(random_q6_k(rng, 21, 256), 21, 256)
    mixed = exact.to_panels(exact.stack([q4, q6]))
    assert mixed.rest is not None
    for packed in (eight, mixed):
        x = torch.randn(9, packed.in_features, generator=gen)
        logits, argmax = exact.Head(packed)(x)
        assert torch.equal(logits, exact.linear_a16(x, packed))
        assert argmax.dtype == torch.int64 and torch.equal(argmax, logits.argmax(-1))
        for r in (0, 4, 8):  # alone or beside other rows: the same (a tree row is what a decode step computes)
            alone = exact.Head(packed)(x[r : r + 1])
            assert torch.equal(alone[0][0], logits[r]) and int(alone[1][0]) == int(argmax[r])
    x = w[123].repeat(2, 1)  # rows aligned with the repeated head row: a four-way tie at the top
    logits, argmax = exact.Head(eight)(x)
    assert argmax.tolist() == [123, 123] and logits[0, 123] == logits[0, 999] == logits[0].max()
    nan = torch.zeros(out)
    nan[[600, 800]] = float("nan")  # NaN logits (a bias): the first NaN, as torch.argmax
    logits, argmax = exact.Head(eight, nan)(x)
    assert argmax.tolist() == [600, 600] and torch.equal(argmax, logits.argmax(-1))
    logits, argmax = exact.Head(eight, torch.full((out,), -float("inf")))(x)  # nothing but -inf: the first
    assert argmax.tolist() == [0, 0] and torch.equal(argmax, logits.argmax(-1))
    with pytest.raises(ValueError, match="rows of 96 values"):
        exact.Head(eight)(x[:, :64])
    # A drafter's head: an RMSNorm before, log-probabilities after (the norm's rows may be any row stride)
    norm, x = torch.rand(k, generator=gen) + 0.5, torch.randn(4, 2 * k, generator=gen) * 5
    logp, argmax = exact.Head(eight, norm=norm, eps=1e-5, log_softmax=True)(x[:, :k])
    ref = torch.log_softmax(exact.linear_a16(torch.nn.functional.rms_norm(x[:, :k], (k,), norm, 1e-5), eight), -1)
    torch.testing.assert_close(logp, ref, rtol=0, atol=1e-5)
    assert torch.equal(argmax, ref.argmax(-1))
    halves = x.clone()
    exact.rms_norm_(halves[:, k:], norm, 1e-5)  # in place, one half of each row
    assert torch.equal(halves[:, :k], x[:, :k])
    torch.testing.assert_close(halves[:, k:], torch.nn.functional.rms_norm(x[:, k:], (k,), norm, 1e-5))


@pytest.mark.skipif(not exact.available(), reason="needs gcc and an AVX2 CPU")
def test_the_lean_runtime_hands_the_verifier_each_rows_argmax() -> None:
    """On a CPU the lean runtime's outputs carry each row's argmax (taken in C with the logits; the verifier uses it
    instead of a torch argmax), equal to the logits' own; the final norm runs in C on every path (the fused stack,
    blocks one at a time) and equals torch's within rounding."""
    model = _gguf_like(tiny_model("llama", seed=2).float())
    lean = LeanTarget(model, tiny_tokenizer(), quant="exact-a16")
    ids = torch.randint(3, VOCAB, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    out = lean.prefill(ids)
    assert out.argmax is not None and torch.equal(out.argmax, out.logits.argmax(-1))
    tree = _random_tree(np.random.default_rng(2), ids[-1], 7)
    out = lean.verify(tree)
    assert out.argmax is not None and torch.equal(out.argmax, out.logits.argmax(-1))
    x = torch.randn(5, model.config.hidden_size)
    ref = torch.nn.functional.rms_norm(x, (x.shape[-1],), lean._norm, lean.eps)
    torch.testing.assert_close(lean._final_norm(x), ref, rtol=1e-6, atol=1e-6)
    hf = LeanTarget(model, tiny_tokenizer(), quant="none")  # no C head (weights as loaded): the verifier's argmax
    hf._fused_attention = False
    assert hf.prefill(ids).argmax is None


@pytest.mark.skipif(not exact.available(), reason="needs gcc and an AVX2 CPU")
def test_fp16_scales_compute_what_fp32_scales_do_through_the_fused_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GGUF's group scales are half-precision numbers, so exact-a16 keeps them in fp16 (fewer bytes a step); a model
    whose scales are not (other GGUF block types) keeps fp32 ones. Both layouts give the same logits, bit for bit."""
    model = _gguf_like(tiny_model("llama", seed=3).float())
    half = LeanTarget(model, tiny_tokenizer(), quant="exact-a16")
    assert all(lin.packed.scale.dtype == torch.float16 for lin in half._linears().values())
    to_panels = exact.to_panels

    def fp32_panels(packed: exact.ExactWeight, panel: int | None = None) -> exact.ExactWeight:
        p = to_panels(packed, panel)
        return dataclasses.replace(p, scale=p.scale.float(), offset=None if p.offset is None else p.offset.float())

    monkeypatch.setattr(exact, "to_panels", fp32_panels)
    wide = LeanTarget(model, tiny_tokenizer(), quant="exact-a16")
    assert all(lin.packed.scale.dtype == torch.float32 for lin in wide._linears().values())
    assert wide.weight_bytes > half.weight_bytes
    ids = list(range(3, 40))
    for t in (half, wide):
        t.prefill(ids[:30])
    tree = Tree.chain(ids[30], ids[31:36])
    assert torch.equal(half.verify(tree).logits, wide.verify(tree).logits)  # one C call for every block
    assert torch.equal(half.score_sequence(ids).logits, wide.score_sequence(ids).logits)


@pytest.mark.skipif(not exact.available(), reason="needs gcc and an AVX2 CPU")
@pytest.mark.parametrize("quant", ["exact", "exact-a16"])
def test_exact_runtimes_equal_fp32_and_verify_trees_like_sequential_decoding(quant: str) -> None:
    model = _gguf_like(tiny_model("qwen3", seed=6).float())
    t = LeanTarget(model, tiny_tokenizer(), quant=quant)
    ref = LeanTarget(model, tiny_tokenizer(), quant="none")
    ids = list(range(3, 40))
    tol = 1e-4 if quant == "exact" else 5e-3  # exact-a16 rounds activations to 1/32767 of their group's range
    torch.testing.assert_close(t.score_sequence(ids).logits, ref.score_sequence(ids).logits, rtol=tol, atol=tol)
    plain = Generator(t).generate(ids[:10], max_new_tokens=30)
    spec = Generator(t, RandomDrafter(seed=2, reference=plain.token_ids), tree_size=10, max_depth=4)
    assert spec.generate(ids[:10], max_new_tokens=30).token_ids == plain.token_ids
    # auto picks exact-a16 for such a model and falls back to fp16 for one that is not made of groups.
    assert describe(wrap_model(model, tiny_tokenizer())) == "lean/exact-a16"
    assert describe(wrap_model(tiny_model("qwen3").float(), tiny_tokenizer())) == "lean/fp16"
    with pytest.raises(DartspecError, match="not integer groups"):
        wrap_model(tiny_model("qwen3").float(), tiny_tokenizer(), quant=quant)


@pytest.mark.parametrize("arch", LEAN_ARCHS)
def test_score_batch_scores_each_sequence_as_transformers_does_alone(arch: str) -> None:
    """The trainer's packed step: sequences of different lengths in one right-padded forward give each sequence
    transformers' own logits and features for it alone (no row sees the padding or another sequence)."""
    model = _with_biases(tiny_model(arch, seed=4), 4)
    lean = LeanTarget(model, tiny_tokenizer(), name=f"tiny-{arch}")
    lean.batch_scoring = True  # as on a GPU (a CPU scores one sequence at a time)
    hf = Target(model, tiny_tokenizer(), name=f"tiny-{arch}", fast_linear=False)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(2, VOCAB, (n,), generator=gen).tolist() for n in (7, 23, 15)]
    got = lean.score_batch(seqs)
    assert got.logits.shape[:2] == (3, 23) and torch.isfinite(got.logits).all()
    for i, ids in enumerate(seqs):
        n = len(ids)
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(got.logits[i, :n], ref, rtol=0, atol=1e-6)
        want = hf.score_sequence(ids).features
        torch.testing.assert_close(got.features[i, :n], want, rtol=0, atol=_feature_atol(arch))
    one = lean.score_batch(seqs[1:2])
    assert one.logits.shape == (1, 23, VOCAB)
    torch.testing.assert_close(one.logits[0], got.logits[1], rtol=0, atol=1e-6)


@pytest.mark.skipif(not exact.available(), reason="needs gcc and an AVX2 CPU")
@pytest.mark.parametrize("quant", ["exact-a16", "fp16", "none"])
def test_a_callers_autocast_does_not_reach_the_runtime(quant: str) -> None:
    """A trainer's bf16 autocast (for its drafter) leaves the target's features and logits as served, bit for bit:
    under autocast, SDPA's bf16 output once reached the C GEMMs, which read it as float32 rows (all NaN)."""
    model = tiny_model("llama", seed=5).float()
    t = LeanTarget(_gguf_like(model) if quant == "exact-a16" else model, tiny_tokenizer(), quant=quant)
    ids = [list(range(3, 40)), list(range(50, 70))]
    ref = t.score_batch(ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = t.score_batch(ids)
    assert torch.equal(got.logits, ref.logits) and torch.equal(got.features, ref.features)
    packed = exact.pack(t.lm_head_weight().detach()) if quant == "exact-a16" else None
    if packed is not None:  # the GEMM widens a half-precision input instead of reading past its end
        x = torch.randn(3, packed.in_features).bfloat16()
        assert torch.equal(exact.linear(x, packed), exact.linear(x.float(), packed))


@pytest.mark.skipif(not exact.available(), reason="needs gcc and an AVX2 CPU")
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_fused_block_equals_the_op_by_op_forward(arch: str) -> None:
    # exact-a16 runs each decoder block as one C call (norms, projections, attention, SiLU, residuals); the same
    # runtime without it runs them as torch operations around the same kernels. Only the norms' and SiLU's
    # rounding differs (C's sums and expf against torch's vectorized ones); the 16-bit activation rounding that
    # follows can turn that into a step of 1/32767 of a group's range, as large as exact-a16's own distance from
    # fp32 (logits up to ~40 here, measured differences ~1e-3 between any two of fused, op-by-op and fp32;
    # features up to ~4, differences ~1e-4).
    model = _with_biases(_gguf_like(tiny_model(arch, seed=8).float()), 8)
    fused, ops = (LeanTarget(model, tiny_tokenizer(), quant="exact-a16") for _ in range(2))
    assert all(layer.block is not None for layer in fused.layers)
    for layer in ops.layers:
        layer.block = None
    ids = list(range(3, 43))
    a, b = fused.score_sequence(ids), ops.score_sequence(ids)
    torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=5e-3)
    torch.testing.assert_close(a.features, b.features, rtol=0, atol=5e-4)
    tree = _random_tree(np.random.default_rng(3), 9, 12)
    for t in (fused, ops):
        t.reset()
        t.prefill(ids[:30], features=True)
    a, b = fused.verify(tree, features=True), ops.verify(tree, features=True)
    torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=5e-3)
    torch.testing.assert_close(a.features, b.features, rtol=0, atol=5e-4)


@pytest.mark.skipif(not exact.available(), reason="needs gcc and an AVX2 CPU")
@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_all_layers_in_one_call_equal_one_call_per_layer(arch: str) -> None:
    """exact-a16 runs every decoder block of a forward in one C call (exact.BlockStack); the same blocks called one
    layer at a time from Python compute the same thing bit for bit: logits, the feature layers' inputs (unsorted and
    repeated here), the caches after a prefill, a tree and a batch of trees (Gemma 3: past its window of 8, each
    sliding layer with its own rotary table and window masks)."""
    from dartspec.kv_cache import TreeKVCache

    model = _gguf_like(tiny_model(arch, seed=4).float())
    layers = [2, 0, 2]
    stacked, per_layer = (LeanTarget(model, tiny_tokenizer(), quant="exact-a16", feature_layers=layers) for _ in "ab")
    per_layer._block_stack = lambda: None  # layer.block calls one by one; verify_many: one sequence at a time
    assert stacked._block_stack() is not None
    rng = np.random.default_rng(5)
    ids = rng.integers(3, VOCAB, size=50).tolist()
    for t in (stacked, per_layer):
        t.reset()
    a, b = stacked.prefill(ids, features=True), per_layer.prefill(ids, features=True)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.features, b.features)
    assert a.features.shape[-1] == len(layers) * model.config.hidden_size
    for la, lb in zip(stacked.cache.layers, per_layer.cache.layers, strict=True):
        n = la.length
        assert n == lb.length == len(ids) and torch.equal(la.keys[:, :, :n], lb.keys[:, :, :n])
    tree = _random_tree(rng, ids[-1], 9)
    a, b = stacked.verify(tree, features=True), per_layer.verify(tree, features=True)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.features, b.features)
    items = {}
    for name, t in (("stacked", stacked), ("per_layer", per_layer)):
        caches = [TreeKVCache(len(t.layers)), TreeKVCache(len(t.layers))]
        t.prefill(ids[:20], cache=caches[0])
        t.prefill(ids[:33], cache=caches[1])
        items[name] = t.verify_many([(_random_tree(np.random.default_rng(s), 7, 6), c) for s, c in enumerate(caches)])
    for a, b in zip(items["stacked"], items["per_layer"], strict=True):
        assert torch.equal(a.logits, b.logits)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_qwen2_sliding_window_layers_equal_transformers(dtype: torch.dtype) -> None:
    """A Qwen2 configuration with sliding-window layers (``use_sliding_window``: the layers from ``max_window_layers``
    on) was refused by the lean runtime; its layers now take the window (one rotary table for all), and its logits equal
    transformers' past the window, where ignoring it would not (float32: the fused C attention)."""
    model = tiny_model(
        "qwen2", layers=4, max_positions=256, use_sliding_window=True, sliding_window=8, max_window_layers=2
    ).to(dtype)
    lean = LeanTarget(model, tiny_tokenizer())
    assert lean.window == 8 and [layer.sliding for layer in lean.layers] == [False, False, True, True]
    ids = torch.randint(2, VOCAB, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids[None]).logits[0]
    atol = 1e-6 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(lean.score_sequence(ids).logits, ref, rtol=0, atol=atol)
    lean.prefill(ids[:20].tolist())
    chain = Tree.chain(int(ids[20]), ids[21:30].tolist())
    torch.testing.assert_close(lean.verify(chain).logits, ref[20:30], rtol=0, atol=atol)
    lean.window = None  # the same forward without its window: far off
    assert (lean.score_sequence(ids).logits - ref).abs().max() > 100 * atol


@pytest.mark.skipif(not exact.available(), reason="needs gcc and an AVX2 CPU")
def test_gemma3_blocks_in_c_compute_what_transformers_does() -> None:
    """Gemma 3's touches in the fused C block (the embedding's scale, norms of 1 + w, the branches' output norms,
    GELU, sliding-window layers with their own rotary base) against transformers' forward of the same integer-group
    weights, past the window: within what rounding activations to 16 bits moves (weights scaled down so the random
    network is not chaotic; a missing touch moves logits by whole units)."""
    model = _gguf_like(tiny_model("gemma3", seed=7).float())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.mul_(0.125)  # still the same integer groups, d and m scaled by a power of two
    lean = LeanTarget(model, tiny_tokenizer(), quant="exact-a16")
    assert lean._block_stack() is not None and lean.window == 8
    ids = torch.randint(2, VOCAB, (60,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids[None]).logits[0]
    torch.testing.assert_close(lean.score_sequence(ids).logits, ref, rtol=0, atol=0.02)  # logits up to ~50
    lean.prefill(ids[:30].tolist())
    chain = Tree.chain(int(ids[30]), ids[31:45].tolist())
    torch.testing.assert_close(lean.verify(chain).logits, ref[30:45], rtol=0, atol=0.02)


def test_pack_finds_q5_0_groups_and_gives_up_on_other_numbers_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GGUF's Q5_0 blocks (``d * (q - 16)``, 5-bit q, fp16 d: a group's largest |q| is anything up to 16) are 8-bit
    symmetric groups too; random floats are tried twice per group, not seventeen times."""
    gen = torch.Generator().manual_seed(5)
    out, k = 24, 128
    d = (torch.rand(out, k // 32, 1, generator=gen) * 0.02 + 0.001).half().float()
    q = torch.randint(0, 32, (out, k // 32, 32), generator=gen).float() - 16
    q[0, 0], q[1, 1], q[2, 2] = 0, 1, torch.tensor([3.0, -2.0]).repeat(16)  # all-zero group; |q| at most 1; 3
    w = (q * d).reshape(out, k)
    packed = exact.pack(w)
    assert packed is not None and packed.kind == 8 and torch.equal(exact.unpack(packed), w)
    tried: list[list[int]] = []  # the values of n each search tried, in order

    class Recorded(tuple):
        def __iter__(self):  # type: ignore[no-untyped-def]
            tried.append([])
            for n in tuple.__iter__(self):
                tried[-1].append(n)
                yield n

    monkeypatch.setattr(exact, "_LARGEST_Q", Recorded(exact._LARGEST_Q))
    assert exact.pack(w) is not None and tried[0][:2] == [127, 16] and len(tried[0]) > 3
    tried.clear()
    assert exact.pack(torch.randn(out, k, generator=gen)) is None
    assert tried == [[127, 16, 15]]  # the third try is where it gives up
    # A large weight is searched on a sample of rows first; the values of n the sample needed are tried first on the
    # whole, most frequent first, and the others still follow.
    big = torch.cat([w.repeat(1, 8)] * 4)  # 96 rows of 1024 inputs: 3072 groups
    big[90, 32:64] = (torch.arange(-127, 129, 8).clamp(-127, 127)).float() * 0.001  # a Q8_0 group past the sample
    tried.clear()
    packed = exact.pack(big)
    assert packed is not None and torch.equal(exact.unpack(packed), big)
    assert exact._try_order(torch.tensor([16.0, 15, 16, 15, 3, 127])) == (16, 15, 127, 3, *range(14, 3, -1), 2, 1)
    big[95, 0] = 0.123456  # one number no group holds: the whole weight is refused
    assert exact.pack(big) is None


@pytest.mark.skipif(not exact.available(), reason="needs gcc and an AVX2 CPU")
def test_auto_keeps_exact_weights_where_it_can_and_fp16_for_the_others(tmp_path, monkeypatch) -> None:
    """Some weights are integer groups exact-a16 keeps, others not (here: random numbers; in a GGUF, block types whose
    groups neither the weights nor the file show): ``--quant auto`` takes exact-a16 for the first and fp16 panels for
    the others, weight by weight, in the same fused
    blocks, which compute every row on its own: a tree row equals that token decoded alone bit for bit (fbgemm's fp16
    GEMM does not), and a batch of sequences equals each alone. ``--quant exact-a16`` itself refuses such a model;
    the packed-weight cache holds both kinds."""
    from transformers import AutoModelForCausalLM

    model = _gguf_like(tiny_model("qwen2", seed=9, head_dim=8).float())
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            if i % 2:
                layer.mlp.down_proj.weight.normal_(0, 0.02)  # no integer groups
    monkeypatch.setenv("DARTSPEC_CACHE", str(tmp_path / "cache"))
    model.save_pretrained(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    mixed = wrap_model(model, tiny_tokenizer())
    assert describe(mixed) == "lean/exact-a16+fp16"
    formats = {name: lin.fmt for name, lin in mixed._linears().items()}
    odd = range(1, len(mixed.layers), 2)
    assert {n for n, f in formats.items() if f == "fp16"} == {f"layers.{i}.down" for i in odd}
    assert all(layer.block is not None for layer in mixed.layers)  # one C call a block, a forward
    with pytest.raises(DartspecError, match=r"not integer groups.*--quant auto"):
        wrap_model(model, tiny_tokenizer(), quant="exact-a16")
    ids = list(range(3, 40))
    ref = LeanTarget(model, tiny_tokenizer(), quant="none")
    torch.testing.assert_close(mixed.score_sequence(ids).logits, ref.score_sequence(ids).logits, rtol=5e-3, atol=5e-3)
    rng = np.random.default_rng(1)
    prompt, tree = ids[:12], _random_tree(rng, 7, 9)
    mixed.prefill(prompt)
    got = mixed.verify(tree).logits
    for node in range(tree.size):
        path = [int(tree.tokens[i]) for i in tree.path_to(node)]
        assert torch.equal(got[node], _step_by_step(mixed, prompt, path))
    caches = [mixed.new_cache() for _ in range(3)]
    trees = [_random_tree(np.random.default_rng(s), 7, 5 + s) for s in range(3)]
    for s, cache in enumerate(caches):
        mixed.prefill(ids[: 8 + s], cache=cache)
    alone = [mixed.verify(tree, cache=cache).logits for tree, cache in zip(trees, caches, strict=True)]
    for tree, cache in zip(trees, caches, strict=True):
        cache.truncate(cache.length - tree.size)
    batch = mixed.verify_many(list(zip(trees, caches, strict=True)))
    assert all(torch.equal(a, b.logits) for a, b in zip(alone, batch, strict=True))
    monkeypatch.setattr(exact, "pack", lambda w: pytest.fail("packed again although the cache has it"))
    again = wrap_model(model, tiny_tokenizer())
    assert describe(again) == "lean/exact-a16+fp16"
    assert torch.equal(again.score_sequence(ids).logits, mixed.score_sequence(ids).logits)
    # A model of no groups at all is the fp16 format (its panels are quicker made than read: no cache file).
    monkeypatch.undo()
    monkeypatch.setenv("DARTSPEC_CACHE", str(tmp_path / "cache"))
    tiny_model("qwen2", seed=10).float().save_pretrained(tmp_path / "plain")
    cached = sorted((tmp_path / "cache" / "packed").iterdir())
    plain = wrap_model(AutoModelForCausalLM.from_pretrained(tmp_path / "plain"), tiny_tokenizer())
    assert describe(plain) == "lean/fp16" and all(layer.block is not None for layer in plain.layers)
    assert sorted((tmp_path / "cache" / "packed").iterdir()) == cached


@pytest.mark.skipif(not exact.available(), reason="needs gcc and an AVX2 CPU")
def test_packed_weights_are_cached_and_a_damaged_cache_is_a_clear_error(tmp_path, monkeypatch) -> None:
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("DARTSPEC_CACHE", str(tmp_path / "cache"))
    _gguf_like(tiny_model("llama", seed=8).float()).save_pretrained(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    ids = list(range(3, 30))
    first = LeanTarget(model, tiny_tokenizer(), quant="exact-a16")
    files = sorted((tmp_path / "cache" / "packed").iterdir())
    assert [f.suffix for f in files] == [".json", ".safetensors"]
    monkeypatch.setattr(exact, "pack", lambda w: pytest.fail("packed again although the cache has it"))
    again = LeanTarget(model, tiny_tokenizer(), quant="exact-a16")
    assert torch.equal(again.score_sequence(ids).logits, first.score_sequence(ids).logits)
    # A flipped byte in the weights file: a one-line error naming the files to delete, not wrong weights.
    weights = files[1]
    raw = bytearray(weights.read_bytes())
    raw[-3] ^= 0xFF
    weights.write_bytes(bytes(raw))
    with pytest.raises(DartspecError, match=r"damaged .*sha256.*delete") as err:
        LeanTarget(model, tiny_tokenizer(), quant="exact-a16")
    assert "\n" not in str(err.value)
    files[0].write_text("{")  # an unreadable manifest
    with pytest.raises(DartspecError, match="manifest is unreadable"):
        LeanTarget(model, tiny_tokenizer(), quant="exact-a16")
    # A save interrupted before its manifest was written leaves no manifest: the next load packs and saves again.
    files[0].unlink()
    monkeypatch.undo()
    monkeypatch.setenv("DARTSPEC_CACHE", str(tmp_path / "cache"))
    rebuilt = LeanTarget(model, tiny_tokenizer(), quant="exact-a16")
    assert torch.equal(rebuilt.score_sequence(ids).logits, first.score_sequence(ids).logits)
    assert files[0].is_file()
    # Weights changed in memory after loading are packed anew, never taken from the files' cache.
    with torch.no_grad():
        model.lm_head.weight[0] = model.lm_head.weight[1]  # still integer groups
    changed = LeanTarget(model, tiny_tokenizer(), quant="exact-a16")
    assert not torch.equal(changed.score_sequence(ids).logits, first.score_sequence(ids).logits)
    assert len(list((tmp_path / "cache" / "packed").iterdir())) == 4
    # A new layout version replaces its own predecessor on disk and leaves other weights' caches alone.
    monkeypatch.setattr(weight_cache, "PACKED_VERSION", weight_cache.PACKED_VERSION + 1)
    LeanTarget(model, tiny_tokenizer(), quant="exact-a16")
    left = sorted((tmp_path / "cache" / "packed").iterdir())
    assert len(left) == 4 and files[0] in left and files[1] in left  # the cache of the weights before the change


def test_wrap_model_shares_one_model_between_runtimes() -> None:
    model = tiny_model("qwen2").float()
    lean = wrap_model(model, tiny_tokenizer(), quant="fp16")
    hf = wrap_model(model, tiny_tokenizer(), runtime="hf")
    assert (describe(lean), describe(hf)) == ("lean/fp16", "hf/float32")
    assert lean.model is hf.model
    ids = list(range(3, 20))
    a, b = lean.prefill(ids).logits, hf.prefill(ids).logits
    torch.testing.assert_close(a, b, rtol=0, atol=1e-2)


def test_fast_linears_for_drafters_keep_fp16_weights_exactly() -> None:
    from dartspec.quant import FormatLinear, use_fast_linears

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.SiLU(), torch.nn.Linear(48, 16, bias=False))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(p.half().float())  # the shipped drafters are stored in fp16
    x = torch.randn(3, 5, 32)
    ref = net(x)
    use_fast_linears(net, object())
    assert all(type(m) is FormatLinear for m in (net[0], net[2]))
    torch.testing.assert_close(net(x), ref, rtol=1e-5, atol=1e-5)  # only the summation order differs
    assert set(net.state_dict()) == {"0.weight", "0.bias", "2.weight"}


def test_attention_runs_without_per_shape_cudnn_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU attention leaves out cuDNN (it builds a graph for every new shape, and decoding's and training's
    shapes change every step); every forward of both runtimes and of the drafter enters that context once."""
    import dartspec.drafters.dart_model as dart_model
    import dartspec.lean as lean_module
    import dartspec.target as target_module
    from dartspec.batch_decode import decode_batch
    from dartspec.drafters.dart_model import DartConfig, DartModel
    from dartspec.runtime import attention_kernels

    with attention_kernels(torch.device("cuda")):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored on the way out

    entered: list[str] = []

    def recording(module: str) -> object:
        def kernels(device: torch.device) -> object:
            entered.append(module)
            return attention_kernels(device)

        return kernels

    for module in (lean_module, target_module, dart_model):
        monkeypatch.setattr(module, "attention_kernels", recording(module.__name__))
    model = tiny_model("llama", seed=1)
    prompts = [[3, 4, 5], [6, 7]]
    for runtime in (LeanTarget(model, tiny_tokenizer()), Target(model, tiny_tokenizer())):
        name = type(runtime).__module__
        entered.clear()
        runtime.prefill([3, 4, 5, 6])
        assert entered == [name]
        entered.clear()
        decode_batch(runtime, prompts, 3, stop_ids=frozenset())
        assert entered == [name] * 3  # the prefill and two steps
        entered.clear()
        runtime.score_batch(prompts)
        assert entered and set(entered) == {name}
    drafter = DartModel(DartConfig.for_target(runtime, draft_vocab_size=16, depth=3))
    entered.clear()
    drafter(
        torch.zeros(2, 2 * drafter.cfg.hidden_size),
        torch.zeros(2, drafter.cfg.hidden_size),
        torch.arange(2),
        torch.ones(2, 2, dtype=torch.bool),
    )
    assert entered == ["dartspec.drafters.dart_model"]


@pytest.mark.skipif(not exact.available(), reason="needs the exact kernels (x86-64 with AVX2, gcc)")
def test_the_avx2_kernels_pass_the_kernel_tests_on_any_machine() -> None:
    """The C kernels have AVX-512 and AVX2 paths and a machine compiles only its own: the kernel and tree tests run
    again in a process whose kernels are built for AVX2 (DARTSPEC_MARCH=x86-64-v3), so both paths are tested
    wherever the suite runs (on an AVX2 machine this repeats them: ~15 s)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = "integer_dot or exact_runtimes or tree_verification_equals_sequential or fused_block or fused_attention"
    tests += " or c_attention_equals or shared_prefix_attention_equals"  # the last: value sums cut at a shared prefix
    files = [str(Path(__file__)), str(Path(__file__).with_name("test_prefix_cache.py"))]
    env = {**os.environ, "DARTSPEC_MARCH": "x86-64-v3"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files, "-k", tests],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout


def test_prefetch_hint_follows_the_cpu_vendor_and_names_the_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GEMM's weight prefetch goes into L2 on Intel and is non-temporal elsewhere (both measured);
    DARTSPEC_PREFETCH_HINT overrides it, a bad value is a one-line error, and the hint is part of the build key (a
    library built with one hint is never loaded for another)."""
    monkeypatch.delenv("DARTSPEC_PREFETCH_HINT", raising=False)
    vendor = {"vendor_id": "GenuineIntel", "flags": "avx2 fma f16c"}
    monkeypatch.setattr(exact, "_cpu_field", lambda name: vendor.get(name, ""))
    assert exact._prefetch_hint() == 2
    intel = exact.build_key()
    vendor["vendor_id"] = "AuthenticAMD"
    assert exact._prefetch_hint() == 0
    assert exact.build_key() != intel
    monkeypatch.setenv("DARTSPEC_PREFETCH_HINT", "2")
    assert exact._prefetch_hint() == 2 and exact.build_key() == intel
    monkeypatch.setenv("DARTSPEC_PREFETCH_HINT", "nta")
    with pytest.raises(DartspecError, match="DARTSPEC_PREFETCH_HINT"):
        exact._prefetch_hint()
    with pytest.raises(DartspecError, match="DARTSPEC_PREFETCH_HINT"):  # not "no kernels here": no silent fallback
        exact.available()
