"""What the lean runtime reads from a model, and a snapshot of it that makes the next load fast.

The lean forward (:mod:`dartspec.lean`) runs none of transformers' modules: it reads a model's config, its weights by
role and its rotary frequencies, once. Loading them through transformers costs more than the rest of a
``dartspec generate`` put together on 2 cores (SmolLM2: ~3 s of ~8.5 s, mostly importing its config and model code,
which pulls in ``torch.distributed`` and ``torch._dynamo``). So after the lean runtime is built from a model folder,
:func:`write_snapshot` records what it read: the resolved text config, the rotary frequencies, the tokenizer's class
and, for every weight, its name in the folder's safetensors files (each checked equal, value for value, to the
loaded tensor; a weight that transformers changed while loading means no snapshot), keyed by the folder's files
(name, size, mtime). The next load of that folder (:func:`read_snapshot`) maps the safetensors files and builds the
same runtime from the same tensors without importing transformers' model code; the transformers model is loaded
only when something asks for it (``target.model``: the ``hf-ar`` benchmark row, the fidelity gate).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from dartspec import atomic, weight_cache
from dartspec.tokenizer import LightTokenizer, describe

#: Bump when what a snapshot records (or how the lean runtime reads it) changes.
SNAPSHOT_VERSION = 2  # 2: the tokenizer without transformers (dartspec.tokenizer)
#: Per decoder layer, the module attributes whose weights the lean runtime reads (absent ones are skipped).
LAYER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LAYER_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",  # Gemma 3
    "post_feedforward_layernorm",  # Gemma 3
    "self_attn.q_norm",  # Qwen3, Gemma 3
    "self_attn.k_norm",
)


@dataclass
class Rotary:
    """A model's rotary frequencies: ``inv_freq`` and ``attention_scaling`` by layer type, key ``""`` where all layers
    share one table (Gemma 3 has one for ``full_attention`` and one for ``sliding_attention`` layers)."""

    rope_types: list[str]
    inv_freq: dict[str, torch.Tensor]
    attention_scaling: dict[str, float]

    def table(self, layer_type: str) -> tuple[torch.Tensor, float]:
        key = "" if "" in self.inv_freq else layer_type
        return self.inv_freq[key], self.attention_scaling[key]


@dataclass
class LeanWeights:
    """Everything the lean runtime takes from a model. ``tensors`` by role: ``embed``, ``norm``, ``head.weight``,
    ``head.bias``, ``layers.{i}.{attr}.weight`` / ``.bias`` (``attr`` from :data:`LAYER_LINEARS` and
    :data:`LAYER_NORMS`); ``names``: each role's parameter name in the model (how GGUF groups and snapshots find it)."""

    config: Any
    generation_config: Any
    folder: str | None
    tensors: dict[str, torch.Tensor]
    names: dict[str, str]
    rotary: Rotary
    head_dim: int
    scaling: float
    embed_scale: torch.Tensor | None = None
    #: The transformers model they came from; None when read from a snapshot (loaded on demand, :func:`load_model`).
    model: nn.Module | None = None
    #: A snapshot's record of the packed-weight cache (path, source; None: none) the runtime used, by
    #: :func:`panel_key`; empty for weights from a model (the cache is found from its parameters).
    packed: dict[str, list[str] | None] = field(default_factory=dict)

    def get(self, role: str) -> torch.Tensor | None:
        return self.tensors.get(role)

    @classmethod
    def from_model(cls, model: nn.Module) -> LeanWeights:
        """The weights of a loaded transformers ``*ForCausalLM`` (the same tensor objects, nothing copied)."""
        config = model.config.get_text_config()
        decoder = model.get_decoder()
        tensors: dict[str, torch.Tensor | None] = {
            "embed": model.get_input_embeddings().weight,
            "norm": decoder.norm.weight,
            "head.weight": model.get_output_embeddings().weight,
            "head.bias": model.get_output_embeddings().bias,
        }
        for i, layer in enumerate(decoder.layers):
            for attr in LAYER_LINEARS:
                module = getattr(layer.mlp if attr in ("gate_proj", "up_proj", "down_proj") else layer.self_attn, attr)
                tensors[f"layers.{i}.{attr}.weight"] = module.weight
                tensors[f"layers.{i}.{attr}.bias"] = module.bias
            for attr in LAYER_NORMS:
                module = _attribute(layer, attr)
                tensors[f"layers.{i}.{attr}.weight"] = None if module is None else module.weight
        present = {role: t.detach() for role, t in tensors.items() if t is not None}
        # A tied head is the embedding's parameter, named (and saved) once, as the embedding
        by_id = {id(p): name for name, p in model.named_parameters()}
        names = {role: by_id[id(t)] for role, t in tensors.items() if t is not None and id(t) in by_id}
        rotary = decoder.rotary_emb
        rope_types = list(rotary.rope_type.values()) if isinstance(rotary.rope_type, dict) else [rotary.rope_type]
        if hasattr(rotary, "inv_freq"):
            freqs, scales = {"": rotary.inv_freq}, {"": float(rotary.attention_scaling)}
        else:  # one table per layer type (Gemma 3)
            types = [t for t in ("full_attention", "sliding_attention") if hasattr(rotary, f"{t}_inv_freq")]
            freqs = {t: getattr(rotary, f"{t}_inv_freq") for t in types}
            scales = {t: float(getattr(rotary, f"{t}_attention_scaling")) for t in types}
        attn0 = decoder.layers[0].self_attn
        scale = getattr(model.get_input_embeddings(), "embed_scale", None)
        return cls(
            config=config,
            generation_config=getattr(model, "generation_config", None),
            folder=getattr(model.config, "_name_or_path", None) or None,
            tensors=present,
            names=names,
            rotary=Rotary(rope_types, {k: v.detach() for k, v in freqs.items()}, scales),
            head_dim=int(attn0.head_dim),
            scaling=float(attn0.scaling),
            embed_scale=None if scale is None else torch.as_tensor(scale).detach(),
            model=model,
        )


def _attribute(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
    return obj


def load_model(folder: str | Path, *, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The transformers model of ``folder``, as every runtime loads it."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa").to(device).eval()


# --- snapshots ------------------------------------------------------------------------------------


class _Config(SimpleNamespace):
    """A snapshot's text config: the same attributes as transformers' config had."""

    def get_text_config(self) -> _Config:
        return self


def panel_key(quant: str) -> str:
    """A format and the C kernels' panel width on this machine: a packed-weight cache holds one of each."""
    from dartspec import exact

    return f"{quant}/p{exact.kernel_panel() if quant == 'exact-a16' else 0}"


def _snapshot_path(folder: Path, quant: str) -> Path:
    from dartspec.assets import cache_dir

    key = hashlib.sha256(f"{folder}\0{quant}".encode()).hexdigest()[:16]
    return cache_dir() / "lean" / f"{folder.name[:60]}-{quant}-{key}.json"


def _folder_files(folder: Path) -> list[list[Any]]:
    """Name, size and mtime of every file in ``folder``: a config, tokenizer or weight file changed in place changes
    its mtime, and the snapshot no longer applies."""
    return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in sorted(folder.iterdir()) if f.is_file()]


def _weight_files(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return {f.name: load_file(f) for f in sorted(folder.glob("*.safetensors"))}


def write_snapshot(target: Any, weights: LeanWeights, tokenizer: Any, quant: str) -> Path | None:
    """Record what ``target`` (a lean runtime just built from ``weights``) read, for :func:`read_snapshot`. Returns
    the snapshot's path, or None where a fast load could not give the same runtime (a weight not in the folder's
    safetensors files as loaded, a tokenizer class not importable by name, a model not from a folder)."""
    if weights.folder is None or not Path(weights.folder).is_dir():
        return None
    folder = Path(weights.folder).resolve()
    tok_class = type(tokenizer)
    try:
        if getattr(importlib.import_module(tok_class.__module__), tok_class.__qualname__) is not tok_class:
            return None
    except (ImportError, AttributeError):
        return None
    files = _weight_files(folder)
    where: dict[str, list[str]] = {}
    for role, tensor in weights.tensors.items():
        name = weights.names.get(role)
        found = [f for f, ts in files.items() if name in ts]
        if not found or not _same(files[found[0]][name], tensor):
            return None  # renamed, converted or changed while loading: only transformers knows how
        where[role] = [found[0], name]
    config = json.loads(weights.config.to_json_string(use_diff=False))
    eos = getattr(weights.generation_config, "eos_token_id", None)
    cache = getattr(target, "packed_cache", None)
    path = _snapshot_path(folder, quant)
    try:
        light = describe(tokenizer, folder, path.parent / "tokenizers")
    except OSError as exc:  # its file could not be written: the class below loads the tokenizer, as before
        warnings.warn(f"could not record the tokenizer for a load without transformers: {exc}", stacklevel=2)
        light = None
    snapshot = {
        "version": SNAPSHOT_VERSION,
        "folder": str(folder),
        "files": _folder_files(folder),
        "quant": quant,
        # Another transformers may read the folder otherwise (config defaults, the tokenizer's class); another
        # packed layout means another packed-weight cache than the one recorded below
        "transformers": _transformers_version(),
        "packed_version": weight_cache.PACKED_VERSION,
        "config": config,
        "name_or_path": getattr(weights.config, "_name_or_path", str(folder)),
        "generation_eos_token_id": eos,
        "tokenizer": [tok_class.__module__, tok_class.__qualname__],
        # What the tokenizer answers, for a load without transformers; None: the class above loads it
        "light_tokenizer": light,
        "tensors": where,
        "rotary": {
            "rope_types": weights.rotary.rope_types,
            # float32 values written as Python floats read back exactly
            "inv_freq": {k: [float(x) for x in v.float().tolist()] for k, v in weights.rotary.inv_freq.items()},
            "inv_freq_dtype": {k: _dtype_name(v) for k, v in weights.rotary.inv_freq.items()},
            "attention_scaling": weights.rotary.attention_scaling,
        },
        "head_dim": weights.head_dim,
        "scaling": weights.scaling,
        "embed_scale": None if weights.embed_scale is None else float(weights.embed_scale),
        "embed_scale_dtype": None if weights.embed_scale is None else _dtype_name(weights.embed_scale),
        # The packed-weight cache the runtime read or wrote (None: it has none), for this kernel's panel width
        "packed": {panel_key(quant): [str(cache.path), cache.source] if cache and cache.manifest.is_file() else None},
    }
    try:
        atomic.write_text(path, json.dumps(snapshot) + "\n")
    except OSError as exc:  # a read-only cache costs later loads their speed, nothing more
        warnings.warn(f"could not write the lean runtime's snapshot {path}: {exc}", stacklevel=2)
        return None
    return path


def _transformers_version() -> str:
    from importlib.metadata import version

    return version("transformers")


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b.detach().cpu())


def read_snapshot(folder: str | Path, quant: str) -> tuple[LeanWeights, Any] | None:
    """``(weights, tokenizer)`` of ``folder`` from its snapshot, read without transformers' model code; None where
    there is none or it no longer applies (a file in the folder changed: the caller loads the slow way and writes a
    new one). A damaged snapshot is a warning and None: it is a cache, rebuilt from the folder."""
    folder = Path(folder).resolve()
    path = _snapshot_path(folder, quant)
    if not path.is_file():
        return None
    try:
        snap = json.loads(path.read_text(encoding="utf-8"))
        if snap.get("version") != SNAPSHOT_VERSION or snap.get("folder") != str(folder) or snap.get("quant") != quant:
            return None
        if snap["files"] != _folder_files(folder) or snap["transformers"] != _transformers_version():
            return None
        if snap["packed_version"] != weight_cache.PACKED_VERSION:
            return None
        module, qualname = snap["tokenizer"]

        def full_tokenizer() -> Any:
            return getattr(importlib.import_module(module), qualname).from_pretrained(folder)

        light = snap["light_tokenizer"]
        tokenizer = full_tokenizer() if light is None else LightTokenizer.from_record(light, folder, full_tokenizer)
        files = _weight_files(folder)
        tensors = {role: files[file][name] for role, (file, name) in snap["tensors"].items()}
        rot = snap["rotary"]
        freqs = {k: torch.tensor(v, dtype=getattr(torch, rot["inv_freq_dtype"][k])) for k, v in rot["inv_freq"].items()}
        scale = snap["embed_scale"]
        config = _Config(**snap["config"])
        config._name_or_path = snap["name_or_path"]
        weights = LeanWeights(
            config=config,
            generation_config=SimpleNamespace(eos_token_id=snap["generation_eos_token_id"]),
            folder=str(folder),
            tensors=tensors,
            names={role: name for role, (_, name) in snap["tensors"].items()},
            rotary=Rotary(list(rot["rope_types"]), freqs, {k: float(v) for k, v in rot["attention_scaling"].items()}),
            head_dim=int(snap["head_dim"]),
            scaling=float(snap["scaling"]),
            embed_scale=None if scale is None else torch.tensor(scale, dtype=getattr(torch, snap["embed_scale_dtype"])),
            packed=snap["packed"],
        )
        if panel_key(quant) not in weights.packed:  # written where the kernel's panel width differs
            return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError, ImportError) as exc:
        warnings.warn(f"ignoring the lean runtime's snapshot {path} ({type(exc).__name__}: {exc})", stacklevel=2)
        return None
    return weights, tokenizer
