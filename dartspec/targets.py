"""Choosing and loading a target runtime: ``--runtime auto|lean|hf`` and ``--quant auto|<format>``.

``auto`` picks the fastest choice that passes the fidelity gate (README "CPU runtime"): the lean forward for
the Llama / Qwen2 / Qwen3 / Gemma 3 families, on a CPU with the ``exact-a16`` format where the model's weights are
integer groups (GGUF-converted models) and the kernel builds, else fp16 (exact-a16 is the fastest format at every tree
size measured, BENCHMARKS.md, so plain and speculative decoding use the same one); on a GPU in the model's dtype
(one H200, float32, one stream: plain decoding 1.8-1.9x transformers' modules, DART 1.2-1.7x on top of that), where
its fused weight copies fit (:func:`lean_copy_fits`). Transformers' modules for other architectures.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from dartspec import exact
from dartspec.errors import DartspecError
from dartspec.formats import KV_CACHE_CHOICES, QUANT_CHOICES, RUNTIMES, parse_format
from dartspec.quant import check_format
from dartspec.runtime import describe

__all__ = [
    "describe",
    "lean_copy_fits",
    "load_target",
    "resolve_graphs",
    "resolve_runtime",
    "wrap_format",
    "wrap_model",
]

#: The CPU weight formats ``--quant auto`` tries, fastest first; each passes the fidelity gate.
CPU_DEFAULT_QUANTS = ("exact-a16", "fp16")


def resolve_runtime(runtime: str, quant: str, model_type: str, device: torch.device) -> tuple[str, str]:
    """``(runtime, quant)`` with ``auto`` replaced; a one-line error for impossible combinations."""
    from dartspec.lean import LEAN_ARCHITECTURES, lean_supported

    if runtime not in RUNTIMES:
        raise DartspecError(f"unknown --runtime {runtime!r}: choose one of {', '.join(RUNTIMES)}")
    if quant not in QUANT_CHOICES:
        raise DartspecError(f"unknown --quant {quant!r}: choose one of {', '.join(QUANT_CHOICES)}")
    if runtime == "auto":
        runtime = "lean" if lean_supported(model_type) else "hf"
    if runtime == "lean" and not lean_supported(model_type):
        raise DartspecError(
            f"the lean runtime supports {', '.join(LEAN_ARCHITECTURES)} models, not {model_type!r}: use --runtime hf"
        )
    if quant == "auto":
        quant = CPU_DEFAULT_QUANTS[0] if runtime == "lean" and device.type == "cpu" else "none"
        if quant == CPU_DEFAULT_QUANTS[0] and not exact.available():
            quant = CPU_DEFAULT_QUANTS[1]
    if quant != "none" and runtime == "hf":
        raise DartspecError(f"--quant {quant} needs the lean runtime (--runtime lean or auto)")
    check_format(quant, device)
    return runtime, quant


def resolve_graphs(cuda_graphs: bool | None, runtime: str, device: torch.device) -> bool:
    """Whether the lean runtime's one-sequence steps run as CUDA graphs: ``None`` (auto, the default) wherever they
    can, the lean runtime on a CUDA GPU (the fourth GPU window, one H100, float32: plain decoding 2.8-3.8x as fast
    as without, DART with lookup spans 1.9-2.0x, the same tokens); ``True`` where they cannot is a one-line error
    (checked before a model loads)."""
    possible = runtime == "lean" and device.type == "cuda"
    if cuda_graphs and not possible:
        raise DartspecError(f"--cuda-graphs needs the lean runtime on a CUDA GPU (here: {runtime} runtime on {device})")
    return possible if cuda_graphs is None else cuda_graphs


def wrap_model(
    model: Any,
    tokenizer: Any,
    *,
    runtime: str = "auto",
    quant: str = "auto",
    name: str = "",
    feature_layers: Sequence[int] | None = None,
    cuda_graphs: bool | None = None,
    kv_cache: str = "auto",
) -> Any:  # -> Target | LeanTarget
    """A runtime over an already loaded transformers model (several runtimes may share one model); ``cuda_graphs``:
    the lean runtime's one-sequence steps as CUDA graphs (:mod:`dartspec.cuda_graphs`; None: wherever they can run,
    :func:`resolve_graphs`); ``kv_cache``: the lean runtime's KV cache (:func:`resolve_kv_cache`)."""
    from dartspec.lean import LeanTarget
    from dartspec.target import Target

    device = model.get_input_embeddings().weight.device
    model_type = model.config.get_text_config().model_type
    chosen_runtime, chosen = resolve_runtime(runtime, quant, model_type, device)
    if runtime == "auto" and chosen_runtime == "lean" and not lean_copy_fits(model, device):
        chosen_runtime = "hf"
    graphs = resolve_graphs(cuda_graphs, chosen_runtime, device)
    kv = resolve_kv_cache(kv_cache, chosen_runtime, device, model.dtype, model.config.get_text_config())
    if chosen_runtime == "hf":
        return Target(model, tokenizer, name=name, feature_layers=feature_layers)
    fallback = auto_fallback(chosen) if quant == "auto" else None
    kw: dict[str, Any] = {"name": name, "feature_layers": feature_layers, "cuda_graphs": graphs, "kv_cache": kv}
    return LeanTarget(model, tokenizer, quant=chosen, fallback=fallback, **kw)


#: The projections the lean forward fuses into copies of its own (QKV, gate/up) beside the model's, which it keeps
#: (several runtimes may share one model, and the model stays transformers' reference).
FUSED_PROJECTIONS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")


def lean_copy_fits(model: Any, device: torch.device) -> bool:
    """Whether ``--runtime auto`` may take the lean forward for ``model`` on ``device``: on a GPU its fused copies
    (~2/3 of the layers' weights) must take at most half the free memory, or a model that fits transformers'
    modules with room for its KV cache would run out of memory by default; host memory is not checked."""
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    copies = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n.endswith(FUSED_PROJECTIONS))
    return 2 * copies <= free


def wrap_format(target: Any, spec: str) -> Any:  # -> Target | LeanTarget
    """``target``'s loaded model in another runtime / format, given as ``RUNTIME[:QUANT][:kv=KV]`` (``lean:fp16``,
    ``hf``, ``lean:auto:kv=fp16``)."""
    runtime, quant, kv = parse_format(spec)
    return wrap_model(target.model, target.tokenizer, runtime=runtime, quant=quant, name=target.name, kv_cache=kv)


@contextlib.contextmanager
def _unusable(folder: Path | str, part: str) -> Iterator[None]:
    """Errors of transformers or safetensors reading ``part`` of a model folder as one line: a damaged or foreign
    folder (config.json that is not JSON or names no known model type, weights that are not safetensors, no
    tokenizer) gave their tracebacks before."""
    from safetensors import SafetensorError

    try:
        yield
    except DartspecError:
        raise
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
        raise DartspecError(f"{folder} is not a usable model folder: {part}: {first}") from None


def load_target(
    name_or_path: str,
    *,
    runtime: str = "auto",
    quant: str = "auto",
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    feature_layers: Sequence[int] | None = None,
    log: Callable[[str], None] | None = None,
    cuda_graphs: bool | None = None,
    kv_cache: str = "auto",
) -> Any:  # -> Target | LeanTarget
    """Load a target by known name (e.g. ``smollm2-135m``), local folder or GGUF file into a runtime.

    Example::

        target = load_target("smollm2-135m")                 # lean runtime, exact-a16 weights on a CPU
        exact = load_target("smollm2-135m", runtime="hf")     # transformers' modules, fp32
    """
    from dartspec.lean import LeanTarget
    from dartspec.models import resolve_model

    dev = torch.device(device)
    folder = resolve_model(name_or_path, **({"log": log} if log else {}))
    # The default on a CPU (the lean runtime, its default format): a snapshot of an earlier load of this folder
    # builds the same runtime without importing transformers' model code (dartspec.lean_weights).
    snapshot_quant = _snapshot_format(runtime, quant, dev, dtype, cuda_graphs)
    if snapshot_quant is not None:
        from dartspec.lean_weights import read_snapshot

        found = read_snapshot(folder, snapshot_quant)
        if found is not None:
            weights, tokenizer = found
            return LeanTarget(
                weights,
                tokenizer,
                quant=snapshot_quant,
                fallback=auto_fallback(snapshot_quant),
                name=name_or_path,
                feature_layers=feature_layers,
                kv_cache=resolve_kv_cache(kv_cache, "lean", dev, dtype, weights.config),
            )
    from transformers import AutoConfig, AutoTokenizer

    from dartspec.lean_weights import load_model

    # Check the combination before loading hundreds of MB.
    with _unusable(folder, "its config.json"):
        config = AutoConfig.from_pretrained(folder).get_text_config()
    chosen, _ = resolve_runtime(runtime, quant, config.model_type, dev)
    resolve_graphs(cuda_graphs, chosen, dev)
    resolve_kv_cache(kv_cache, chosen, dev, dtype, config)
    with _unusable(folder, "its weights"):
        model = load_model(folder, dtype=dtype, device=dev)
    with _unusable(folder, "its tokenizer"):
        tokenizer = AutoTokenizer.from_pretrained(folder)
    target = wrap_model(
        model,
        tokenizer,
        runtime=runtime,
        quant=quant,
        name=name_or_path,
        feature_layers=feature_layers,
        cuda_graphs=cuda_graphs,
        kv_cache=kv_cache,
    )
    if snapshot_quant is not None and isinstance(target, LeanTarget):
        from dartspec.lean_weights import LeanWeights, write_snapshot

        write_snapshot(target, LeanWeights.from_model(model), tokenizer, snapshot_quant)
    return target


def resolve_kv_cache(kv_cache: str, runtime: str, device: torch.device, dtype: torch.dtype, config: Any) -> str:
    """The lean runtime's KV cache for ``--kv-cache``: ``auto`` is fp16 where the C attention reads the cache (fp32
    on a CPU) and the model is one whose answers the fidelity gate found unchanged by it (:data:`FP16_KV_MODELS`),
    else fp32; ``fp16`` where no C attention runs, or with ``--runtime hf``, is a one-line error."""
    if kv_cache not in KV_CACHE_CHOICES:
        raise DartspecError(f"unknown --kv-cache {kv_cache!r}: one of {', '.join(KV_CACHE_CHOICES)}")
    possible = runtime != "hf" and exact.attends(device, dtype)
    if kv_cache == "fp16" and not possible:
        raise DartspecError(f"--kv-cache fp16 needs the lean runtime's C attention (fp32 on a CPU; here {runtime} "
                            f"runtime, {str(dtype).removeprefix('torch.')} on {device})")  # fmt: skip
    if kv_cache != "auto":
        return kv_cache
    return "fp16" if possible and _fingerprint(config) in FP16_KV_MODELS else "fp32"


def _fingerprint(config: Any) -> tuple[str, int, int, int]:
    """A model's architecture as :data:`FP16_KV_MODELS` names it: type, layers, hidden size, vocabulary."""
    return (config.model_type, config.num_hidden_layers, config.hidden_size, config.vocab_size)


#: Models whose answers an fp16 KV cache left unchanged in the fidelity gate (``dartspec bench fidelity --formats
#: lean:auto:kv=fp16``): there ``--kv-cache auto`` takes it.
FP16_KV_MODELS = frozenset(
    {
        ("llama", 30, 576, 49152),  # SmolLM2-135M(-Instruct): +0.00% perplexity, 10/10 answers (BENCHMARKS.md)
        ("qwen2", 24, 896, 151936),  # Qwen2.5-Coder-0.5B (and models of its shape): -0.02%, 10/10
        ("gemma3_text", 18, 640, 262144),  # Gemma 3 270M: -0.00%, 10/10
    }
)


def auto_fallback(chosen: str) -> str | None:
    """The format ``--quant auto`` gives the weights ``chosen`` cannot hold: with exact-a16 (integer groups only, all
    of a model not from a GGUF file), fp16 panels in the same fused blocks, weight by weight; none otherwise."""
    return CPU_DEFAULT_QUANTS[1] if chosen == CPU_DEFAULT_QUANTS[0] else None


def _snapshot_format(
    runtime: str, quant: str, device: torch.device, dtype: torch.dtype, cuda_graphs: bool | None
) -> str | None:
    """The weight format a lean snapshot of this load is kept under: only the CPU default (``--runtime auto|lean``,
    ``--quant auto``, float32), whose choice depends on nothing but the folder and this machine; None otherwise."""
    if runtime not in ("auto", "lean") or quant != "auto" or device.type != "cpu" or dtype != torch.float32:
        return None
    if cuda_graphs:  # (an error on a CPU, which the full load reports)
        return None
    return CPU_DEFAULT_QUANTS[0] if exact.available() else CPU_DEFAULT_QUANTS[1]
