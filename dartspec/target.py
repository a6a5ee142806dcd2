"""The transformers runtime: a Hugging Face causal LM driven with the tree-aware KV cache.

One call scores q new tokens (a draft tree) against everything already cached, with an ancestor-only
attention mask and position ids ``cached + depth``. Afterwards :meth:`Target.commit` keeps only the
accepted path (see :mod:`dartspec.kv_cache`), so nothing is ever recomputed. The same forward also hands
back the residual-stream hidden states that feature-based drafters (DART, EAGLE-3) read, captured with
forward pre-hooks on the chosen decoder layers. Works for any architecture transformers runs; the lean
runtime (:mod:`dartspec.lean`) is the fast path for the Llama / Qwen families.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin

from dartspec.errors import ContextLengthError
from dartspec.kernels import rows_first_linear, use_rows_first_linears
from dartspec.kv_cache import TreeKVCache, TreeKVLayer
from dartspec.runtime import (
    PREFILL_CHUNK,
    CausalRuntime,
    TargetOutput,
    attention_kernels,
    default_feature_layers,
    pad_sequences,
)

__all__ = [
    "PREFILL_CHUNK",
    "CacheView",
    "Target",
    "TargetOutput",
    "TreeKVCache",
    "TreeKVLayer",
    "default_feature_layers",
]


class _LayerView(CacheLayerMixin):
    """One :class:`TreeKVLayer` through transformers' cache-layer API (what its attention modules call)."""

    is_sliding = False  # sliding windows are in the masks (Target._masks), not in the cache

    def __init__(self, layer: TreeKVLayer) -> None:
        # No base __init__: keys, values and is_initialized are the layer's own.
        self.layer = layer

    keys = property(lambda self: self.layer.keys)
    values = property(lambda self: self.layer.values)
    is_initialized = property(lambda self: self.layer.is_initialized)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.layer.lazy_initialization(key_states, value_states)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layer.update(key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.layer.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.layer.length

    def get_max_length(self) -> int:
        return -1


class CacheView(Cache):
    """A :class:`TreeKVCache` as transformers' ``Cache`` for one forward: the model appends through it; what it
    wrote stays in the cache. (The cache is no transformers class, so the lean runtime never imports transformers.)"""

    def __init__(self, cache: TreeKVCache) -> None:
        super().__init__(layers=[_LayerView(layer) for layer in cache.layers])


class Target(CausalRuntime):
    """A transformers causal LM with a tree-aware KV cache: prefill, verify a tree, commit the accepted path."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        *,
        feature_layers: Sequence[int] | None = None,
        name: str = "",
        fast_linear: bool = True,
    ) -> None:
        """Wrap a loaded causal LM.

        Args:
            model: a transformers ``*ForCausalLM`` (Llama, Qwen2, Qwen3, Gemma3 are tested).
            tokenizer: its tokenizer.
            feature_layers: decoder layers whose input hidden states are returned as features
                (default: 2, N//2, N-3).
            name: shown in messages.
            fast_linear: switch the model's linear layers to the small-row CPU dispatch of
                :mod:`dartspec.kernels` (modifies ``model`` in place; numerically a different but
                equally exact GEMM order).
        """
        self.model = model.eval()
        self.decoder = model.get_decoder()
        self.lm_head: nn.Linear = model.get_output_embeddings()
        self.vocab_size = int(self.lm_head.weight.shape[0])
        self._capture: dict[int, list[torch.Tensor]] | None = None
        self._hooks: list[Any] = []
        config = model.config.get_text_config()
        layer_types = getattr(config, "layer_types", None) or []
        self.sliding_window: int | None = int(config.sliding_window) if "sliding_attention" in layer_types else None
        self.fast_linear = False
        self.set_fast_linear(fast_linear)
        super().__init__(
            config=config,
            tokenizer=tokenizer,
            name=name or getattr(model.config, "_name_or_path", "") or type(model).__name__,
            generation_config=getattr(model, "generation_config", None),
            feature_layers=feature_layers,
        )

    # --- construction ------------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        feature_layers: Sequence[int] | None = None,
        fast_linear: bool = True,
        log: Callable[[str], None] | None = None,
    ) -> Target:
        """Load a target by known name (e.g. ``smollm2-135m``), local folder, GGUF file or hub id."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from dartspec.models import resolve_model

        folder = resolve_model(name_or_path, **({"log": log} if log else {}))
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
        tokenizer = AutoTokenizer.from_pretrained(folder)
        return cls(
            model.to(device),
            tokenizer,
            feature_layers=feature_layers,
            name=name_or_path,
            fast_linear=fast_linear,
        )

    def _make_hook(self, layer: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if self._capture is not None:
                hidden = args[0] if args else kwargs["hidden_states"]
                self._capture[layer].append(hidden)

        return hook

    def _use_feature_layers(self, layers: tuple[int, ...]) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = [
            self.decoder.layers[i].register_forward_pre_hook(self._make_hook(i), with_kwargs=True)
            for i in sorted(set(layers))
        ]

    def set_fast_linear(self, enable: bool) -> None:
        """Switch the small-row CPU matmul dispatch on or off (see :mod:`dartspec.kernels`)."""
        use_rows_first_linears(self.decoder, enable)
        self.fast_linear = enable

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    # --- forwards ----------------------------------------------------------------------------

    def _run(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        local_mask: torch.Tensor | None,
        features: bool,
        cache: TreeKVCache,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        base = cache.length
        key_positions = None
        if self.sliding_window is not None:  # the decode hot path builds them only where a window needs them
            key_positions = torch.cat([torch.arange(base, device=ids.device), positions])[None]
        mask = self._masks(self._allowed(base, ids.shape[0], local_mask)[None], positions[None], key_positions)
        self._capture = {i: [] for i in self.feature_layers} if features else None
        try:
            with attention_kernels(ids.device):
                hidden = self.decoder(
                    input_ids=ids[None],
                    attention_mask=mask,
                    position_ids=positions[None],
                    past_key_values=CacheView(cache),
                    use_cache=True,
                ).last_hidden_state[0]
            feats = torch.cat([self._capture[i][0][0] for i in self.feature_layers], dim=-1) if features else None
        finally:
            self._capture = None
        return hidden, feats

    def _run_batch(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        key_positions: torch.Tensor,
        allowed: torch.Tensor,
        cache: TreeKVCache,
    ) -> torch.Tensor:
        mask = self._masks(allowed, positions, key_positions)
        with attention_kernels(ids.device):
            return self.decoder(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=CacheView(cache),
                use_cache=True,
            ).last_hidden_state

    def _masks(self, allowed: torch.Tensor, positions: torch.Tensor, key_positions: torch.Tensor | None) -> Any:
        """Additive ``(B, 1, q, slots)`` masks from a boolean ``(B, q, slots)`` one; models with sliding-window
        layers get a dict with the window applied too (by position, so padding slots do not count; only they
        need ``key_positions``)."""
        full = self._additive(allowed)
        if self.sliding_window is None:
            return full
        assert key_positions is not None
        near = (positions[:, :, None] - key_positions[:, None, :]) < self.sliding_window
        return {"full_attention": full, "sliding_attention": self._additive(allowed & near)}

    def score_sequence(self, token_ids: Sequence[int] | torch.Tensor) -> TargetOutput:
        """Features and logits for every position of a whole sequence (training; the cache is untouched).

        Returns features ``(T, F*H)`` and logits ``(T, vocab)``: row i predicts token i+1.
        """
        out = self.score_batch([torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)])
        assert out.features is not None
        assert out.hidden is not None
        return TargetOutput(out.logits[0], out.features[0], out.hidden[0])

    @torch.inference_mode()
    def score_batch(self, sequences: Sequence[Sequence[int] | torch.Tensor]) -> TargetOutput:
        """Every position of many whole sequences in one forward, right-padded to the longest: features
        ``(B, T, F*H)`` and logits ``(B, T, vocab)``. Causal attention never lets a real position see the
        padding after it, so each sequence's rows are what it gives alone (up to the GEMMs' rounding)."""
        ids = pad_sequences(sequences, self.device)
        if ids.shape[1] > self.max_context:
            raise ContextLengthError(f"a {ids.shape[1]}-token sequence exceeds {self.name}'s context window")
        self._capture = {i: [] for i in self.feature_layers}
        try:
            with attention_kernels(ids.device):
                hidden = self.decoder(input_ids=ids, use_cache=False).last_hidden_state
            feats = torch.cat([self._capture[i][0] for i in self.feature_layers], dim=-1)
        finally:
            self._capture = None
        return TargetOutput(self.logits(hidden), feats, hidden)

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        return mask[:, None]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head on final-norm hidden states ``(rows, H)``; ``(rows, vocab)`` in float32 or wider."""
        if hidden.numel() == 0:
            return hidden.new_zeros((*hidden.shape[:-1], self.vocab_size), dtype=torch.float32)
        head = self.lm_head
        logits = rows_first_linear(hidden, head.weight, head.bias) if self.fast_linear else head(hidden)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(token_ids)

    def lm_head_weight(self) -> torch.Tensor:
        return self.lm_head.weight
