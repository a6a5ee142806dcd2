"""The lean runtime: a hand-written forward for the Llama / Qwen2 / Qwen3 / Gemma 3 families, in the spirit of gpt-fast.

After quantizing the weights (:mod:`dartspec.quant`), a CPU decode step is no longer bound by matrix
products but by the ~200 small operations and the Python around them that transformers' modules run per
forward. This forward does the same arithmetic with fewer, larger operations:

- Q, K and V are one fused projection, and so are the MLP's gate and up projections;
- rotary embedding is one complex multiply: the q/k rows of each head are permuted at load time from the
  half-split layout to interleaved pairs (dot products between queries and keys are unchanged by a shared
  permutation), and the rotation table is computed once for the whole context;
- one ``scaled_dot_product_attention`` per layer over the tree KV cache (GQA inside the kernel), with no
  mask at all for a single token or a causal prefill;
- fused ``F.rms_norm``;
- on a CPU in float32 with the ``exact-a16`` format, for up to 64 new rows (decoding, draft trees), each decoder
  block is one C call (:class:`dartspec.exact.Block`): norms, projections, attention, SiLU and residual adds.

Gemma 3 is the same block with its own touches: the embedding scaled by sqrt(hidden), norms that multiply by
``1 + w`` (kept as that factor), each branch's output normed before its residual add, GELU (tanh form) for SiLU, and
sliding-window layers (five of six) with their own rotary base, whose masks hide keys a window or more behind.

Transformers tokenizes, loads the model the first time (later default loads read the same tensors from a snapshot
without its model code, :mod:`dartspec.lean_weights`) and is the reference this forward is tested against
(``tests/test_lean.py``: logits equal transformers' forward on tiny random configs and on SmolLM2).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dartspec import exact, kquants
from dartspec.errors import ContextLengthError, DartspecError
from dartspec.formats import KV_CACHES
from dartspec.kv_cache import TreeKVCache, TreeKVLayer
from dartspec.lean_weights import LeanWeights, Rotary, load_model, panel_key
from dartspec.prefix_cache import PrefixCache
from dartspec.quant import EXACT_FORMATS, PackedLinear, check_format, fuse
from dartspec.rotary import interleave_rows
from dartspec.runtime import CausalRuntime, TargetOutput, attention_kernels, pad_sequences, tree_mask
from dartspec.tree import Tree
from dartspec.weight_cache import PackedCache, SavedWeights

#: ``config.model_type`` values the lean forward implements (same block; Qwen3 adds per-head q/k norms, Gemma 3 the
#: touches of the module docstring).
LEAN_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3_text")
#: Up to this many new rows, attention runs as one C call per layer (decoding and draft trees).
FUSED_ATTENTION_ROWS = 64


@dataclass
class _Layer:
    ln1: torch.Tensor
    ln2: torch.Tensor
    qkv: PackedLinear
    o: PackedLinear
    gate_up: PackedLinear
    down: PackedLinear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    #: Gemma 3: the norms of the attention's and the MLP's outputs before their residual adds (None elsewhere).
    post_attn: torch.Tensor | None = None
    post_ffn: torch.Tensor | None = None
    #: A sliding-window layer (Gemma 3): its own rotary table and window masks.
    sliding: bool = False
    #: The whole block as one C call (exact-a16 on a CPU), for the rows the fused attention takes.
    block: exact.Block | None = None


def _own_arithmetic(forward: Callable[..., Any]) -> Callable[..., Any]:
    """Run a forward of the runtime with autocast off: its weight format decides its arithmetic (exact-a16 serves
    the values the fidelity gate passed), not a caller's autocast (a trainer's bf16 for its drafter)."""

    @functools.wraps(forward)
    def run(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_autocast_enabled(x.device.type):  # decoding: a 0.3 us check, not a 5 us context per call
            return forward(self, x, *args, **kwargs)
        with torch.autocast(x.device.type, enabled=False):
            return forward(self, x, *args, **kwargs)

    return run


def _gpu_attention(forward: Callable[..., Any]) -> Callable[..., Any]:
    """Run a forward in :func:`dartspec.runtime.attention_kernels` (on a GPU no per-shape cuDNN graphs; elsewhere a
    no-op context, ~0.3 us)."""

    @functools.wraps(forward)
    def run(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        with attention_kernels(x.device):
            return forward(self, x, *args, **kwargs)

    return run


def lean_supported(model_type: str) -> bool:
    return model_type in LEAN_ARCHITECTURES


def _packed_cache(weights: LeanWeights, quant: str) -> PackedCache | None:
    """Where the weights packed in ``quant`` are cached (exact formats of models loaded from a folder): found from the
    model's parameters, or the cache a snapshot recorded."""
    if quant not in EXACT_FORMATS:
        return None
    if weights.model is None:  # read from a snapshot, keyed by the folder's files: the cache it recorded
        recorded = weights.packed.get(panel_key(quant))
        return None if recorded is None else PackedCache(Path(recorded[0]), recorded[1])
    panel = exact.kernel_panel() if quant == "exact-a16" else 0
    return PackedCache.for_model(weights.folder, quant, panel, weights.model.parameters())


def _file_groups(weights: LeanWeights, quant: str) -> dict[str, exact.ExactWeight]:
    """The integer groups of the weights that the model's GGUF file alone shows (:mod:`dartspec.kquants`), by role;
    none for a model not converted from a GGUF file still on this machine. Kinds 5 and 6 (Q5_K, Q6_K) run on the
    integer-dot kernel only: not for the ``exact`` format."""
    gguf_path = kquants.source_gguf(weights.folder)
    if gguf_path is None or kquants.holds_no_groups(weights.folder):  # reading a GGUF's metadata takes seconds
        return {}
    projections = [r for r in weights.tensors if r == "head.weight" or r.endswith("_proj.weight")]
    roles = {weights.names[r]: r for r in projections if r in weights.names}
    try:
        found = kquants.file_groups(gguf_path, {n: weights.tensors[r] for n, r in roles.items()})
    except (OSError, ValueError, KeyError, IndexError) as exc:  # a damaged file: the weights are loaded already
        warnings.warn(f"could not read integer groups from {gguf_path} ({exc}): fp16 for those weights", stacklevel=3)
        return {}
    return {roles[n]: g for n, g in found.items() if g.kind in (4, 8) or quant == "exact-a16"}


def _window_pointers(
    masks: Sequence[torch.Tensor | None], window_masks: Sequence[torch.Tensor | None]
) -> np.ndarray | None:
    """The C kernels' mask pointers of sliding-window layers (a sequence's own mask where its window hides no key), or
    None where no sequence needs one."""
    if not any(w is not None for w in window_masks):
        return None
    chosen = [m if w is None else w for m, w in zip(masks, window_masks, strict=True)]
    return np.array([0 if m is None else m.data_ptr() for m in chosen], dtype=np.int64)


def _normed(y: torch.Tensor, norm: torch.Tensor | None, eps: float) -> torch.Tensor:
    """A branch's output before its residual add: as it is, or RMS-normed (Gemma 3's post-norms)."""
    return y if norm is None else F.rms_norm(y, (y.shape[-1],), norm, eps)


class LeanTarget(CausalRuntime):
    """A Llama / Qwen2 / Qwen3 / Gemma 3 target with a lean forward and a weight format (:mod:`dartspec.quant`)."""

    def __init__(
        self,
        model: nn.Module | LeanWeights,
        tokenizer: Any,
        *,
        quant: str = "none",
        feature_layers: Sequence[int] | None = None,
        name: str = "",
        cuda_graphs: bool = False,
        fallback: str | None = None,
        kv_cache: str = "fp32",
    ) -> None:
        """Build the lean weights from a loaded transformers ``*ForCausalLM`` (kept for reference uses such as
        the ``hf-ar`` benchmark row; its decoder layers are not run), or from :class:`LeanWeights` read from a snapshot
        (the transformers model is then loaded when :attr:`model` is first asked for). ``cuda_graphs``: run
        one-sequence decode and verify steps as CUDA graphs (:mod:`dartspec.cuda_graphs`; a GPU only). ``fallback``:
        ``fp16`` with ``quant="exact-a16"``: the weights that are no integer groups it keeps (a model not from a GGUF
        file, other block types) are fp16 panels in the same fused blocks; None: such a weight is an error. A GGUF's
        K-quant tensors (Q4_K, Q5_K, Q6_K) are integer groups read from the file (:mod:`dartspec.kquants`) when it
        is there. ``kv_cache``: ``fp32``, or ``fp16`` (the C attention's cache holds each key and value rounded to
        fp16: half the bytes a step reads from it; fp32 on a CPU only)."""
        if fallback not in (None, "fp16") or (fallback is not None and quant != "exact-a16"):
            raise ValueError(f"fallback {fallback!r} is for fp16 weights beside exact-a16 ones (quant {quant!r})")
        weights = model if isinstance(model, LeanWeights) else LeanWeights.from_model(model)
        config = weights.config
        name = name or getattr(config, "_name_or_path", "") or weights.folder or type(weights.model).__name__
        if not lean_supported(config.model_type):
            raise DartspecError(
                f"the lean runtime supports {', '.join(LEAN_ARCHITECTURES)} models; {name} is "
                f"{config.model_type!r}: use --runtime hf"
            )
        if getattr(config, "final_logit_softcapping", None) or getattr(config, "attn_logit_softcapping", None):
            raise DartspecError(f"{name} caps its logits (Gemma 2), which the lean runtime does not: use --runtime hf")
        rotary = weights.rotary
        if any(t not in ("default", "linear", "llama3", "yarn", "longrope") for t in rotary.rope_types):
            raise DartspecError(f"{name}'s rope types {rotary.rope_types} are not supported by the lean runtime")
        self._layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
        #: Sliding-window layers see keys less than this many positions behind (None: every layer sees all).
        self.window = int(config.sliding_window) if "sliding_attention" in self._layer_types else None
        self._gemma = config.model_type == "gemma3_text"
        self._act = functools.partial(F.gelu, approximate="tanh") if self._gemma else F.silu
        self._model = weights.model.eval() if weights.model is not None else None
        self._folder = weights.folder
        self.quant = quant
        self.fallback = fallback
        embed = weights.tensors["embed"]
        check_format(quant, embed.device)
        fused_attention = exact.attends(embed.device, embed.dtype)
        if kv_cache not in KV_CACHES:
            raise DartspecError(f"unknown KV cache {kv_cache!r}: one of {', '.join(KV_CACHES)}")
        if kv_cache == "fp16" and not fused_attention:
            raise DartspecError("an fp16 KV cache needs the lean runtime's C attention (fp32 weights on a CPU)")
        #: ``fp32`` or ``fp16``: the numbers its KV caches hold (:attr:`kv_dtype`).
        self.kv_cache = kv_cache
        self.kv_dtype = torch.float16 if kv_cache == "fp16" else None
        self.fast_linear = embed.device.type == "cpu"
        #: Score a batch of sequences in one padded forward (:meth:`score_batch`); off on a CPU, where it is slower.
        self.batch_scoring = not self.fast_linear
        self._embed = embed
        #: Gemma's embedding is scaled by sqrt(hidden), rounded to the weights' dtype as transformers does
        scale = weights.embed_scale
        self._embed_scale = None if scale is None else scale.to(device=embed.device, dtype=embed.dtype)
        head = weights.tensors["head.weight"]
        self._head_weight = head
        self.vocab_size = int(head.shape[0])
        self._norm = self._norm_weight(weights.tensors["norm"])
        self.eps = float(config.rms_norm_eps)
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = weights.head_dim
        self.scaling = weights.scaling
        #: The packed-weight cache this runtime read or wrote (None: its format has none, or no folder identifies it).
        self.packed_cache = _packed_cache(weights, quant)
        saved = self.packed_cache.load() if self.packed_cache is not None else None
        # Weights whose integer groups only the GGUF file shows (K-quant blocks, dartspec.kquants)
        self._file_groups = _file_groups(weights, quant) if saved is None and quant in EXACT_FORMATS else {}
        self._head = self._projection("head", saved, weights, "head")
        self.layers = [self._convert(i, weights, saved) for i in range(int(config.num_hidden_layers))]
        self._stack: exact.BlockStack | None = None  # every layer's fused block in one call (_block_stack)
        if fallback is not None and all(lin.fmt == fallback for lin in self._linears().values()):
            self.quant = fallback  # no weight is of the exact format's kinds: the model is in the fallback format
        elif self.packed_cache is not None and saved is None:  # (fp16 panels alone are quicker made than read)
            self._save_packed(self.packed_cache)
        super().__init__(
            config=config,
            tokenizer=tokenizer,
            name=name,
            generation_config=weights.generation_config,
            feature_layers=feature_layers,
        )
        # Rotation of every position, once: x_pair * (cos + i sin) * attention_scaling; Gemma 3's sliding-window
        # layers have a table of their own (another base).
        self._rot = self._rotation(rotary, "full_attention", embed)
        own_table = self.window is not None and "" not in rotary.inv_freq  # else shared (Qwen2's windows)
        self._rot_local = self._rotation(rotary, "sliding_attention", embed) if own_table else None
        self._fused_attention = fused_attention
        # Shapes and dtype for a cache layer's first write (TreeKVLayer.extend): no keys, no values.
        self._no_kv = embed.new_empty((1, self.kv_heads, 0, self.head_dim))
        # exact-a16 and fp16 weights alike are panels of the C kernels (integer groups, fp16 weights)
        panels = all(lin.packed is not None and lin.packed.panel for lin in self._linears().values())
        #: The head as one C call that also takes each row's argmax (:meth:`_project`), where it is in panels.
        self._c_head: exact.Head | None = None
        if self._fused_attention and panels:
            for layer in self.layers:
                layer.block = self._block(layer)
            assert self._head.packed is not None  # panels: every linear is packed
            self._c_head = exact.Head(self._head.packed, self._head.bias)
            # The fused blocks compute every row on its own: a prefill in chunks they take is the same bit for bit
            # however it is cut (so a prefix from the prefix cache changes nothing), and faster than SDPA's
            # (measured on SmolLM2, 600 tokens, 2 cores: 331-342 ms in chunks of 64, 358-368 ms in one of 512).
            self.prefill_chunk = FUSED_ATTENTION_ROWS
        if cuda_graphs:
            from dartspec.cuda_graphs import StepGraphs

            self.step_graphs = StepGraphs(self)
        #: Sequences on the same prefix-cache pages attend to them together in a batched step (each page read once
        #: for all; the same results bit for bit). False: each sequence reads them itself (for comparison).
        self.share_prefix_attention = True

    def _rotation(self, rotary: Rotary, layer_type: str, like: torch.Tensor) -> torch.Tensor:
        """Every position's rotation ``(max_context, D/2)`` complex for ``layer_type``'s layers (one table where the
        model has one)."""
        inv_freq, scaling = rotary.table(layer_type)
        real = torch.float64 if like.dtype == torch.float64 else torch.float32
        t = torch.arange(self.max_context, device=like.device, dtype=real)
        angles = torch.outer(t, inv_freq.to(device=like.device, dtype=real))
        return torch.polar(torch.full_like(angles, float(scaling)), angles)

    def _norm_weight(self, w: torch.Tensor) -> torch.Tensor:
        """What an RMSNorm of weight ``w`` multiplies by: ``w``, or Gemma's ``1 + w`` (computed in fp32 as Gemma
        does)."""
        return (1.0 + w.float()).to(w.dtype) if self._gemma else w

    def enable_prefix_cache(self, max_bytes: int) -> PrefixCache:
        """Share prompt prefixes' KV among this runtime's requests, up to ``max_bytes`` of blocks
        (:mod:`dartspec.prefix_cache`); needs the fused exact-a16 blocks (a CPU), whose prefill is the same bit for
        bit however it is cut."""
        if self.layers[0].block is None:
            raise DartspecError(
                f"the prefix cache needs the lean runtime's exact-a16 kernels on a CPU (this target is {self.quant} "
                f"on {self.device.type})"
            )
        self.prefix_cache = PrefixCache(
            layers=len(self.layers), kv_heads=self.kv_heads, head_dim=self.head_dim, max_bytes=max_bytes
        )
        return self.prefix_cache

    @torch.inference_mode()
    def prefill(
        self,
        token_ids: Sequence[int],
        *,
        features: bool = False,
        cache: TreeKVCache | None = None,
        all_logits: bool = False,
    ) -> TargetOutput:
        """As :meth:`CausalRuntime.prefill`; with a prefix cache, an empty ``cache`` starts with the longest cached
        prefix of ``token_ids`` (shared, not computed) and the prompt's own full blocks are stored for later
        requests. ``all_logits`` does not read the prefix cache: a shared prefix has no logits to give."""
        cache = self.cache if cache is None else cache
        shared = self.prefix_cache
        if shared is None or cache.length or len(token_ids) < 2 or all_logits:
            return super().prefill(token_ids, features=features, cache=cache, all_logits=all_logits)
        chain = shared.match(token_ids, features=features)
        shared.attach(cache, chain)
        npre = cache.length
        out = super().prefill(token_ids[npre:], features=features, cache=cache)
        feats = out.features
        if features and chain:
            assert feats is not None and all(b.features is not None for b in chain)
            feats = torch.cat([*(b.features for b in chain), feats])  # type: ignore[misc]
        shared.store(token_ids, cache, chain, feats)
        return TargetOutput(out.logits, feats, argmax=out.argmax)

    def _block(self, layer: _Layer) -> exact.Block:
        linears = []
        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
            assert lin.packed is not None  # every linear is packed in panels (integer groups or fp16)
            linears.append((lin.packed, lin.bias))
        return exact.Block(
            tuple(linears),
            layer.ln1,
            layer.ln2,
            layer.q_norm,
            layer.k_norm,
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.eps,
            self.scaling,
            post_attn=layer.post_attn,
            post_ffn=layer.post_ffn,
            gelu=self._gemma,
            sliding=layer.sliding,
        )

    def _linear(
        self,
        name: str,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        saved: SavedWeights | None,
        groups: exact.ExactWeight | None = None,
    ) -> PackedLinear:
        """One projection in the runtime's format, taken from the packed-weight cache when there is one, else from
        ``groups`` (read from the model's GGUF file) where given."""
        packed = saved.get(name, tuple(weight.shape)) if saved is not None else None
        if packed is None and groups is not None:
            packed = exact.to_panels(groups) if self.quant == "exact-a16" else groups
        return PackedLinear(weight, bias, self.quant, packed=packed, fallback=self.fallback)

    def _linears(self) -> dict[str, PackedLinear]:
        out = {"head": self._head}
        for i, layer in enumerate(self.layers):
            out.update({f"layers.{i}.{n}": getattr(layer, n) for n in ("qkv", "o", "gate_up", "down")})
        return out

    @property
    def weight_format(self) -> str:
        """``quant``, or ``exact-a16+fp16`` where some weights took the fallback format (logs, benchmark rows)."""
        formats = {lin.fmt for lin in self._linears().values()}
        return "+".join([self.quant, *sorted(formats - {self.quant})])

    def _save_packed(self, cache: PackedCache) -> None:
        weights = {}
        for name, lin in self._linears().items():
            assert lin.packed is not None  # an exact format: every linear was packed (fallback weights as fp16 panels)
            weights[name] = lin.packed
        try:
            cache.save(weights)
        except OSError as exc:  # a read-only cache costs the next load its packing, nothing more
            warnings.warn(f"could not cache packed weights at {cache.path}: {exc}", stacklevel=3)

    def _convert(self, i: int, weights: LeanWeights, saved: SavedWeights | None) -> _Layer:
        H, K, D = self.heads, self.kv_heads, self.head_dim
        p = f"layers.{i}."
        q_norm, k_norm = weights.get(p + "self_attn.q_norm.weight"), weights.get(p + "self_attn.k_norm.weight")
        # q and k rows in rotary's adjacent-pair layout (module docstring)
        rotary = (lambda t: interleave_rows(t, H, D), lambda t: interleave_rows(t, K, D))
        gemma, norm = self._gemma, self._norm_weight

        def proj(name: str, *parts: str, **kw: Any) -> PackedLinear:
            return self._projection(f"{p}{name}", saved, weights, *(p + part for part in parts), **kw)

        def norm_of(attr: str) -> torch.Tensor:
            return norm(weights.tensors[f"{p}{attr}.weight"])

        return _Layer(
            ln1=norm_of("input_layernorm"),
            # Gemma 3 norms the MLP's input with its own norm and each branch's output (post_attn, post_ffn)
            ln2=norm_of("pre_feedforward_layernorm" if gemma else "post_attention_layernorm"),
            qkv=proj("qkv", "q_proj", "k_proj", "v_proj", rows=rotary),
            o=proj("o", "o_proj"),
            gate_up=proj("gate_up", "gate_proj", "up_proj"),
            down=proj("down", "down_proj"),
            q_norm=None if q_norm is None else interleave_rows(norm(q_norm), 1, D),
            k_norm=None if k_norm is None else interleave_rows(norm(k_norm), 1, D),
            post_attn=norm_of("post_attention_layernorm") if gemma else None,
            post_ffn=norm_of("post_feedforward_layernorm") if gemma else None,
            sliding=self._layer_types[i] == "sliding_attention",
        )

    def _projection(
        self,
        name: str,
        saved: SavedWeights | None,
        weights: LeanWeights,
        *parts: str,
        rows: Sequence[Callable[[torch.Tensor], torch.Tensor]] = (),
    ) -> PackedLinear:
        """The linears of roles ``parts`` stacked along outputs as one projection (the first ``len(rows)`` parts'
        weight and bias rows reordered by ``rows``), with the integer groups the GGUF file gives them where it does."""
        order = [*rows, *[None] * (len(parts) - len(rows))]

        def reorder(t: torch.Tensor | None, f: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor | None:
            return None if t is None else t if f is None else f(t)

        mats = [reorder(weights.tensors[f"{r}.weight"], f) for r, f in zip(parts, order, strict=True)]
        bias = fuse(*(reorder(weights.get(f"{r}.bias"), f) for r, f in zip(parts, order, strict=True)))
        weight = mats[0] if len(mats) == 1 else torch.cat(mats)  # type: ignore[arg-type]
        # The file's groups, reordered as the weights are, where every part has groups: of one kind, concatenated;
        # for the integer-dot kernel also parts of different kinds, each part its own panels (exact.stack). A part
        # without file groups may still be groups the weights show (exact.pack: a Q8_0 value beside Q4_K q and k).
        found = [self._file_groups.get(f"{r}.weight") for r in parts]
        groups = None
        if any(g is not None for g in found):
            if self.quant == "exact-a16" and len(parts) > 1:
                found = [
                    g if g is not None else exact.pack(weights.tensors[f"{r}.weight"])
                    for g, r in zip(found, parts, strict=True)
                ]
            if all(g is not None for g in found):
                mapped = [g if f is None else exact.map_rows(g, f) for g, f in zip(found, order, strict=True)]
                groups = exact.stack(mapped) if self.quant == "exact-a16" else exact.concat(mapped)
        return self._linear(name, weight, bias, saved, groups)

    @property
    def model(self) -> nn.Module:
        """The transformers model the weights came from, for reference uses (the ``hf-ar`` benchmark row, the
        fidelity gate, another runtime over the same model); a runtime read from a snapshot loads it on first use."""
        if self._model is None:
            if self._folder is None:
                raise DartspecError(f"{self.name} has no transformers model and no folder to load one from")
            self._model = load_model(self._folder, dtype=self.dtype, device=self.device)
        return self._model

    @property
    def device(self) -> torch.device:
        return self._embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self._embed.dtype

    @property
    def weight_bytes(self) -> int:
        """Bytes of linear weights one decode step streams (LM head included)."""
        return sum(lin.nbytes for lin in self._linears().values())

    # --- forwards ----------------------------------------------------------------------------

    def _run(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        local_mask: torch.Tensor | None,
        features: bool,
        cache: TreeKVCache,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        q, base = ids.shape[0], cache.length
        # Without a tree mask the new tokens are causal among themselves: one token sees everything and a
        # prefill into an empty cache takes SDPA's own causal path, so neither builds a mask.
        plain = local_mask is None and (q == 1 or base == 0)
        mask = None if plain else self._allowed(base, q, local_mask)
        return self._layers(self.embed(ids), positions, mask, plain and q > 1, cache, features)

    @_own_arithmetic
    @_gpu_attention
    def _layers(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None,
        causal: bool,
        cache: TreeKVCache,
        features: bool,
        key_positions: torch.Tensor | None = None,
        window: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x`` ``(q, hidden)`` of one sequence, or ``(B, q, hidden)`` of a batch with ``positions`` ``(B, q)``,
        ``mask`` ``(B, 1, q, context)`` and ``key_positions`` ``(B, context)`` (:meth:`forward_batch`); returns the
        same leading shape. ``window``: the sliding-window layers' mask where the caller built it (a CUDA graph's
        step, which cannot ask the host whether some key is past the window), else built here where needed."""
        batched = x.dim() == 3
        # The weight formats' kernels take rows; only attention needs the (B, q) split (one sequence: B = 1).
        b, q = x.shape[:2] if batched else (1, x.shape[0])
        x = x.reshape(b * q, x.shape[-1])
        H, K, eps = self.heads, self.kv_heads, self.eps
        rot = self._rot[positions].reshape(b, q, -1)  # complex
        # Sliding-window layers (Gemma 3): their own rotation, and a mask where the window hides some key
        rot_local = rot if self._rot_local is None else self._rot_local[positions].reshape(b, q, -1)
        if window is None and self.window is not None:
            window = self._window_mask(positions, mask, cache.length, key_positions)
        # A few new rows of one sequence (decoding, trees): the whole attention block is one C call
        # (exact.attend); long prefills and batches keep SDPA's kernels.
        fused = self._fused_attention and q <= FUSED_ATTENTION_ROWS and not batched
        if fused:
            rot_pairs = torch.view_as_real(rot[0]).contiguous()
            local_pairs = rot_pairs if self._rot_local is None else torch.view_as_real(rot_local[0]).contiguous()
        if fused and (stack := self._block_stack()) is not None:  # every layer in one C call
            feats = self._run_blocks(stack, x, rot_pairs, [cache], [q], [mask], features, local_pairs, [window])
            return x, feats  # the stack's final norm: x holds the final-norm hidden states
        captured = []
        for i, layer in enumerate(self.layers):
            if features and i in self.feature_layers:
                captured.append(x.clone() if fused and layer.block is not None else x)
            windowed = layer.sliding and window is not None
            layer_mask, layer_causal = (window, False) if windowed else (mask, causal)
            if fused:
                layer_pairs = local_pairs if layer.sliding else rot_pairs
            if fused and layer.block is not None:  # the whole block in one C call, x updated in place
                keys, values, base = cache.layers[i].extend(q, self._no_kv, self._no_kv)
                layer.block(x, layer_pairs, keys, values, base, layer_mask, pages=cache.layers[i].shared)
                continue
            qkv = layer.qkv(F.rms_norm(x, (x.shape[-1],), layer.ln1, eps))
            if fused:
                keys, values, base = cache.layers[i].extend(q, self._no_kv, self._no_kv)
                norms = (layer.q_norm, layer.k_norm)
                attn = exact.attend(qkv, H, K, layer_pairs, keys, values, base, layer_mask, *norms, eps, self.scaling)
            else:
                layer_rot = rot_local if layer.sliding else rot
                qkv = qkv.view(b, q, -1)
                attn = self._attention(qkv, layer_rot, cache.layers[i], layer_mask, layer_causal, layer).flatten(0, 1)
            x = x + _normed(layer.o(attn), layer.post_attn, eps)
            gu = layer.gate_up(F.rms_norm(x, (x.shape[-1],), layer.ln2, eps))
            half = gu.shape[-1] // 2
            x = x + _normed(layer.down(self._act(gu[:, :half]) * gu[:, half:]), layer.post_ffn, eps)
        feats = None
        if features:
            by_layer = dict(zip(sorted(set(self.feature_layers)), captured, strict=True))
            feats = torch.cat([by_layer[i] for i in self.feature_layers], dim=-1)
        hidden = self._final_norm(x)
        if batched:
            return hidden.view(b, q, -1), None if feats is None else feats.view(b, q, -1)
        return hidden, feats

    def _final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm of ``(rows, hidden)``; with the C kernels (fp32 on a CPU) theirs, as the fused stack's."""
        if not self._fused_attention:
            return F.rms_norm(x, (x.shape[-1],), self._norm, self.eps)
        return exact.rms_norm_(x.contiguous().clone(), self._norm, self.eps)

    def _window_mask(
        self, positions: torch.Tensor, mask: torch.Tensor | None, base: int, key_positions: torch.Tensor | None
    ) -> torch.Tensor | None:
        """The sliding-window layers' boolean mask (``mask``'s shape; transformers' rule: a key is seen when less than
        ``window`` positions behind), or None where the window hides no key: those layers then take ``mask`` as the
        others do. ``mask`` None: causal among the new rows (one row: it sees everything); ``key_positions``: every
        key's position (a batch's), else the cached ``0 .. base`` and the new rows'."""
        if self.window is None:
            return None
        # No position is past its slot (a tree's deepest row is at most its last; a batch's padding only adds slots)
        # and none is below 0: with fewer slots than the window no key is hidden, known without reading the device.
        slots = base + positions.shape[-1] if key_positions is None else key_positions.shape[-1]
        if slots - 1 < self.window:
            return None
        if key_positions is None:
            key_positions = torch.cat([torch.arange(base, device=positions.device), positions])
        behind = positions[..., :, None] - key_positions[..., None, :]  # (q, T) or (B, q, T)
        near = behind < self.window
        if mask is None:
            return (near & (behind >= 0)).contiguous()
        return (mask & (near if mask.dim() == near.dim() else near[:, None])).contiguous()

    @torch.inference_mode()
    def verify_many(self, items: Sequence[tuple[Tree, TreeKVCache]], *, features: bool = False) -> list[TargetOutput]:
        """Many sequences' trees in one forward (continuous batching): each decoder block is one C call whose
        projections run over every sequence's rows together (the weights are streamed once per step, not once per
        sequence) and whose attention runs per sequence against its own cache. Each sequence's logits are those of
        its own :meth:`verify`, bit for bit (every row is computed on its own). Elsewhere (no fused blocks:
        another format or device) the sequences are verified one after another."""
        stack = self._block_stack()
        if not items or stack is None or any(t.size > FUSED_ATTENTION_ROWS for t, _ in items):
            return super().verify_many(items, features=features)
        for tree, cache in items:
            self._check_room(cache, tree)
        caches = [cache for _, cache in items]
        sizes = [tree.size for tree, _ in items]
        bases = np.array([cache.length for cache in caches], dtype=np.int64)
        masks = [  # kept alive for the C calls; a chain is causal (NULL)
            None if (m := tree_mask(tree)) is None else self._allowed(int(b), tree.size, m)
            for (tree, _), b in zip(items, bases, strict=True)
        ]
        ids = torch.from_numpy(np.concatenate([tree.tokens for tree, _ in items]))
        depths = [tree.depth + b for (tree, _), b in zip(items, bases, strict=True)]
        positions = np.concatenate(depths)
        # The rotations gathered in numpy from (positions, D/2, 2) tables: one copy, no torch operations (each costs
        # 10-20 us right after a step's weight stream)
        rot = torch.from_numpy(self._rot_pairs[0][positions])
        local = None if self._rot_local is None else torch.from_numpy(self._rot_pairs[1][positions])
        windows: list[torch.Tensor | None] = [None] * len(items)
        if self.window is not None:
            windows = [
                self._window_mask(torch.from_numpy(d), m, int(b), None)
                for d, m, b in zip(depths, masks, bases, strict=True)
            ]
        x = self.embed(ids)
        feats = self._run_blocks(stack, x, rot, caches, sizes, masks, features, local, windows)
        logits, argmax = self._project(x)  # x: the stack's final-norm hidden states
        none = [None] * len(items)
        argmaxes = none if argmax is None else argmax.split(sizes)
        parts = none if feats is None else feats.split(sizes)
        return [
            TargetOutput(lg, part, argmax=am) for lg, part, am in zip(logits.split(sizes), parts, argmaxes, strict=True)
        ]

    @functools.cached_property
    def _rot_pairs(self) -> tuple[np.ndarray, np.ndarray | None]:
        """The rotary tables (full and sliding-window layers') as fp32 cos/sin pairs ``(positions, D/2, 2)`` in numpy,
        for :meth:`verify_many` on a CPU."""
        pairs = [
            None if t is None else torch.view_as_real(t).contiguous().cpu().numpy()
            for t in (self._rot, self._rot_local)
        ]
        return pairs[0], pairs[1]

    def _block_stack(self) -> exact.BlockStack | None:
        """Every layer's fused block as one C call (:class:`exact.BlockStack`), or None where a layer has none."""
        blocks = [layer.block for layer in self.layers]
        if any(b is None for b in blocks):
            return None
        if self._stack is None or any(a is not b for a, b in zip(self._stack.blocks, blocks, strict=True)):
            self._stack = exact.BlockStack(blocks, self._norm, self.eps)
        return self._stack

    def _run_blocks(
        self,
        stack: exact.BlockStack,
        x: torch.Tensor,
        rot_pairs: torch.Tensor,
        caches: Sequence[TreeKVCache],
        sizes: Sequence[int],
        masks: Sequence[torch.Tensor | None],
        features: bool,
        rot_local: torch.Tensor | None = None,
        window_masks: Sequence[torch.Tensor | None] = (),
    ) -> torch.Tensor | None:
        """The new rows of ``caches`` (``sizes`` each, ``x`` and ``rot_pairs`` holding them one sequence after
        another) through every layer's fused block and the final norm in one C call, ``x`` in place (to the final-norm
        hidden states); returns the feature layers' inputs
        ``(rows, F * hidden)`` when ``features``. Sliding-window layers take ``rot_local`` and ``window_masks`` (a
        sequence's None: its ``masks`` entry). Every cache grows by its rows, or none does (an interrupted call
        leaves no half-written entries behind)."""
        bases = [cache.length for cache in caches]
        slots = self.sequence_slots(caches, sizes, masks, window_masks)
        feats = x.new_empty((x.shape[0], len(self.feature_layers) * x.shape[1])) if features else None
        layers = np.asarray(self.feature_layers, dtype=np.int64) if features else None
        try:
            self.extend_layers(slots, caches, sizes)
            stack(x, rot_pairs, slots, self.share_prefix_attention, layers, feats, rot_local)
        except BaseException:
            for cache, base in zip(caches, bases, strict=True):
                cache.truncate(base)
            raise
        for cache, base in zip(caches, bases, strict=True):
            cache.keys_transposed(base)
        return feats

    def sequence_slots(
        self,
        caches: Sequence[TreeKVCache],
        sizes: Sequence[int],
        masks: Sequence[torch.Tensor | None],
        window_masks: Sequence[torch.Tensor | None] = (),
    ) -> exact.SequenceSlots:
        """Where the batched kernels find each sequence: rows ``sizes`` each after ``cache.length`` cached positions,
        their masks (None: causal; kept alive by the caller) and sliding-window layers' (None: the same), the shared
        prefix pages of every layer. The own buffers are filled in by :meth:`extend_layers`."""
        n, layers = len(caches), len(self.layers)
        kv = np.zeros((layers, n), dtype=exact.KV_SLOT)
        kv["page"] = 1
        for s, cache in enumerate(caches):  # shared prefix pages: fixed for the whole forward
            if cache.page_slots is not None:
                kv[:, s] = cache.page_slots
        return exact.SequenceSlots(
            count=n,
            starts=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
            kv=kv,
            bases=np.array([cache.length for cache in caches], dtype=np.int64),
            masks=np.array([0 if m is None else m.data_ptr() for m in masks], dtype=np.int64),
            window_masks=_window_pointers(masks, window_masks),
        )

    def extend_layers(self, slots: exact.SequenceSlots, caches: Sequence[TreeKVCache], sizes: Sequence[int]) -> None:
        """Room for each sequence's new rows in every layer of its cache, and the slots pointed at them (one numpy
        write per field and sequence: per layer and field they cost ~3% of a SmolLM2 decode step)."""
        for s, (cache, q) in enumerate(zip(caches, sizes, strict=True)):
            kv = slots.kv[:, s]
            kv["k"], kv["v"], kv["cap"], kv["kt"] = cache.extend_all(q, self._no_kv, self._no_kv)
            kv["kt_valid"], kv["half"] = cache.kt_valid, cache.half

    def _attention(
        self,
        qkv: torch.Tensor,
        rot: torch.Tensor,
        cache: TreeKVLayer,
        mask: torch.Tensor | None,
        causal: bool,
        layer: _Layer,
    ) -> torch.Tensor:
        """Per-head norms, rotary, cache write and attention in torch operations: ``(B, q, H D)`` from ``qkv``
        ``(B, q, (H + 2 KV) D)`` and ``rot`` ``(B, q, D/2)``."""
        b, q = qkv.shape[:2]
        H, K, D, eps = self.heads, self.kv_heads, self.head_dim, self.eps
        qk = qkv[..., : (H + K) * D].view(b, q, H + K, D)
        if layer.q_norm is not None:
            qk = torch.cat(
                [F.rms_norm(qk[:, :, :H], (D,), layer.q_norm, eps), F.rms_norm(qk[:, :, H:], (D,), layer.k_norm, eps)],
                2,
            )
        qk = self._rotate(qk, rot[:, :, None])
        v = qkv[..., (H + K) * D :].view(b, q, K, D)
        keys, values = cache.update(qk[:, :, H:].transpose(1, 2), v.transpose(1, 2))
        queries = qk[:, :, :H].transpose(1, 2)
        keys, values = keys.to(queries.dtype), values.to(queries.dtype)  # an fp16 cache (--kv-cache fp16)
        if mask is None or H == K:
            attn = F.scaled_dot_product_attention(
                queries,
                keys,
                values,
                attn_mask=mask,
                is_causal=causal and mask is None,
                scale=self.scaling,
                enable_gqa=H != K,
            )
            return attn.transpose(1, 2).reshape(b, q, H * D)
        # With a mask, SDPA's GQA runs on the math kernel on a GPU (KV repeated per query head, scores in fp32):
        # instead the G query heads of each KV head become G x q query rows against that head (the same dot
        # products), which the masked fused kernels take; the mask is repeated over the groups (a view for q=1).
        G = H // K
        rows = queries.reshape(b, K, G * q, D)
        m = mask.reshape(-1, 1, *mask.shape[-2:])  # (q, T) of one sequence or (B, 1, q, T) of a batch
        grouped = m[:, :, None].expand(-1, -1, G, -1, -1).reshape(m.shape[0], 1, G * q, m.shape[-1])
        attn = F.scaled_dot_product_attention(rows, keys, values, attn_mask=grouped, scale=self.scaling)
        # reshape, not view: the fused kernels may return a strided view (a GPU's memory-efficient kernel does).
        return attn.reshape(b, H, q, D).transpose(1, 2).reshape(b, q, H * D)

    def _rotate(self, qk: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
        """Rotary embedding as a complex multiply of adjacent pairs (half precisions go through float32)."""
        pairs = qk.unflatten(-1, (qk.shape[-1] // 2, 2))
        if pairs.dtype in (torch.float16, torch.bfloat16):
            turned = torch.view_as_complex(pairs.float().contiguous()) * rot
            return torch.view_as_real(turned).flatten(-2).to(qk.dtype)
        return torch.view_as_real(torch.view_as_complex(pairs) * rot).flatten(-2)

    def _run_batch(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        key_positions: torch.Tensor,
        allowed: torch.Tensor,
        cache: TreeKVCache,
    ) -> torch.Tensor:
        return self._layers(self.embed(ids), positions, allowed[:, None], False, cache, False, key_positions)[0]

    @torch.inference_mode()
    def score_sequence(self, token_ids: Sequence[int] | torch.Tensor) -> TargetOutput:
        """Features and logits for every position of a whole sequence (the cache is untouched)."""
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device).reshape(-1)
        if ids.shape[0] > self.max_context:
            raise ContextLengthError(f"a {ids.shape[0]}-token sequence exceeds {self.name}'s context window")
        positions = torch.arange(ids.shape[0], device=self.device)
        hidden, feats = self._layers(self.embed(ids), positions, None, True, self.new_cache(), True)
        return TargetOutput(self.logits(hidden), feats, hidden)

    @torch.inference_mode()
    def score_batch(self, sequences: Sequence[Sequence[int] | torch.Tensor]) -> TargetOutput:
        """Many whole sequences in one forward (the trainer's packed step), right-padded to the longest: causal
        attention never lets a real position see the padding after it, so each sequence's rows are what
        :meth:`score_sequence` gives it, up to the rounding of batched products. On a CPU (``batch_scoring``
        False) sequences are scored one at a time: there one forward of 8 training sequences measured 1.3x slower
        than eight, its padded rows costing more than the saved calls."""
        if len(sequences) == 1 or not self.batch_scoring:
            return super().score_batch(sequences)
        ids = pad_sequences(sequences, self.device)
        b, width = ids.shape
        if width > self.max_context:
            raise ContextLengthError(f"a {width}-token sequence exceeds {self.name}'s context window")
        positions = torch.arange(width, device=self.device).expand(b, -1)
        hidden, feats = self._layers(self.embed(ids), positions, None, True, self.new_cache(), True)
        return TargetOutput(self.logits(hidden.flatten(0, 1)).view(b, width, -1), feats, hidden)

    @_own_arithmetic
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[0] == 0:
            return hidden.new_zeros((0, self.vocab_size), dtype=torch.float32)
        logits = self._head(hidden)
        return logits.to(torch.promote_types(logits.dtype, torch.float32))

    def _project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        # The C head (weights in panels) takes each row's argmax while the logits are in cache; the same logits
        # as :meth:`logits` (the same kernel on the same rows).
        if self._c_head is None or hidden.shape[0] == 0:
            return super()._project(hidden)
        return self._c_head(hidden)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        x = F.embedding(token_ids, self._embed)
        return x if self._embed_scale is None else x * self._embed_scale

    def lm_head_weight(self) -> torch.Tensor:
        return self._head_weight
