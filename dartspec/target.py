"""The target model runtime: a Hugging Face causal LM driven with a tree-aware KV cache.

One call scores q new tokens (a draft tree) against everything already cached, with an ancestor-only
attention mask and position ids ``cached + depth``. Afterwards :meth:`Target.commit` keeps only the
accepted path: its key/value entries are moved into contiguous slots and the rest dropped, so nothing
is ever recomputed. The same forward also hands back the residual-stream hidden states that feature-
based drafters (DART, EAGLE-3) read, captured with forward pre-hooks on the chosen decoder layers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin

from dartspec.errors import ContextLengthError, DartspecError
from dartspec.kernels import rows_first_linear, use_rows_first_linears
from dartspec.tree import Tree

# Decoding ends at any of these when the tokenizer knows them: chat models close a turn with an
# end-of-turn token that is not always the config's eos_token_id (e.g. Qwen2.5's <|im_end|>).
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|endoftext|>")

PREFILL_CHUNK = 512


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """The layers whose *input* hidden states feed the drafters: low, middle, high (DART, EAGLE-3)."""
    return (min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0))


class TreeKVLayer(CacheLayerMixin):
    """One layer's key/value cache in a preallocated buffer that grows by doubling.

    Unlike transformers' DynamicLayer it never concatenates per step, and it can keep an arbitrary
    subset of the newest entries (the accepted path of a draft tree) in place.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, capacity: int = 256) -> None:
        super().__init__()
        self.length = 0
        self._capacity = capacity

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, dk = key_states.shape
        dv = value_states.shape[-1]
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states.new_empty((b, h, self._capacity, dk))
        self.values = value_states.new_empty((b, h, self._capacity, dv))
        self.is_initialized = True

    def _reserve(self, needed: int) -> None:
        cap = self.keys.shape[2]
        if needed <= cap:
            return
        while cap < needed:
            cap *= 2
        keys = self.keys.new_empty((*self.keys.shape[:2], cap, self.keys.shape[3]))
        values = self.values.new_empty((*self.values.shape[:2], cap, self.values.shape[3]))
        keys[:, :, : self.length] = self.keys[:, :, : self.length]
        values[:, :, : self.length] = self.values[:, :, : self.length]
        self.keys, self.values = keys, values

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[2]
        end = self.length + q
        self._reserve(end)
        self.keys[:, :, self.length : end] = key_states
        self.values[:, :, self.length : end] = value_states
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def keep(self, base: int, nodes: torch.Tensor) -> None:
        """Keep entries ``base + nodes`` (ascending) as positions ``base, base+1, ...``; drop the rest."""
        n = nodes.numel()
        if self.is_initialized:
            src = nodes + base
            # index_select copies first, so overlapping source and destination ranges are safe.
            self.keys[:, :, base : base + n] = self.keys.index_select(2, src)
            self.values[:, :, base : base + n] = self.values.index_select(2, src)
        self.length = base + n

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def crop(self, tokens_to_remove: int) -> None:
        self.truncate(self.length - abs(tokens_to_remove))

    def reset(self) -> None:
        self.length = 0


class TreeKVCache(Cache):
    """A transformers ``Cache`` whose layers are :class:`TreeKVLayer`."""

    def __init__(self, num_layers: int) -> None:
        super().__init__(layers=[TreeKVLayer() for _ in range(num_layers)])

    @property
    def length(self) -> int:
        return self.layers[0].length

    def keep(self, base: int, nodes: torch.Tensor) -> None:
        for layer in self.layers:
            layer.keep(base, nodes)

    def truncate(self, length: int) -> None:
        for layer in self.layers:
            layer.truncate(length)


@dataclass(frozen=True)
class TargetOutput:
    """What one target forward returns.

    Attributes:
        logits: ``(rows, vocab)`` float32 logits for the requested rows.
        features: ``(q, len(feature_layers) * hidden)`` hidden states entering the feature layers for
            every input position, or None when features were not requested.
    """

    logits: torch.Tensor
    features: torch.Tensor | None


class Target:
    """A causal LM with a tree-aware KV cache: prefill, verify a tree, commit the accepted path."""

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
        self.tokenizer = tokenizer
        self.name = name or getattr(model.config, "_name_or_path", "") or type(model).__name__
        self.config = model.config.get_text_config()
        self.decoder = model.get_decoder()
        self.lm_head: nn.Linear = model.get_output_embeddings()
        self.num_layers = int(self.config.num_hidden_layers)
        self.hidden_size = int(self.config.hidden_size)
        self.vocab_size = int(self.lm_head.weight.shape[0])
        self.max_context = int(getattr(self.config, "max_position_embeddings", 2048))
        self.softcap = getattr(self.config, "final_logit_softcapping", None)
        layer_types = getattr(self.config, "layer_types", None) or []
        self.sliding_window: int | None = (
            int(self.config.sliding_window) if "sliding_attention" in layer_types else None
        )
        self.fast_linear = False
        self.set_fast_linear(fast_linear)
        self.eos_token_ids = self._find_eos_ids()
        self.cache = TreeKVCache(self.num_layers)
        self._capture: dict[int, list[torch.Tensor]] | None = None
        self._hooks: list[Any] = []
        self.feature_layers: tuple[int, ...] = ()
        self.set_feature_layers(feature_layers)

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

    def _find_eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for source in (self.config, getattr(self.model, "generation_config", None), self.tokenizer):
            value = getattr(source, "eos_token_id", None)
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        vocab = self.tokenizer.get_vocab() if self.tokenizer is not None else {}
        ids.update(vocab[t] for t in _END_OF_TURN_TOKENS if t in vocab)
        return frozenset(ids)

    def _make_hook(self, layer: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if self._capture is not None:
                hidden = args[0] if args else kwargs["hidden_states"]
                self._capture[layer].append(hidden[0])

        return hook

    def set_feature_layers(self, layers: Sequence[int] | None) -> None:
        """Return features from these decoder layers' inputs from now on (None: 2, N//2, N-3).

        Drafters call this with their checkpoint's layers before each generation, so drafters trained on
        other layers can share one target.
        """
        wanted = tuple(int(i) for i in layers) if layers is not None else default_feature_layers(self.num_layers)
        if wanted == self.feature_layers:
            return
        for i in wanted:
            if not 0 <= i < self.num_layers:
                raise DartspecError(f"feature layer {i} is out of range for a {self.num_layers}-layer target")
        for handle in self._hooks:
            handle.remove()
        self._hooks = [
            self.decoder.layers[i].register_forward_pre_hook(self._make_hook(i), with_kwargs=True)
            for i in sorted(set(wanted))
        ]
        self.feature_layers = wanted

    def set_fast_linear(self, enable: bool) -> None:
        """Switch the small-row CPU matmul dispatch on or off (see :mod:`dartspec.kernels`)."""
        use_rows_first_linears(self.decoder, enable)
        self.fast_linear = enable

    # --- state -------------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def cached(self) -> int:
        """Number of positions whose keys and values are in the cache."""
        return self.cache.length

    def reset(self) -> None:
        """Forget the cached sequence (the buffers are kept for reuse)."""
        self.cache.truncate(0)

    # --- forwards ----------------------------------------------------------------------------

    def prefill(self, token_ids: Sequence[int], *, features: bool = False) -> TargetOutput:
        """Append ``token_ids`` to the cache (chunked causal forwards); logits of the last position only."""
        if len(token_ids) == 0:
            raise DartspecError("the prompt is empty")
        if self.cached + len(token_ids) > self.max_context:
            raise ContextLengthError(
                f"the prompt is {len(token_ids)} tokens but {self.name} has a context window of "
                f"{self.max_context} tokens"
            )
        outs = []
        for start in range(0, len(token_ids), PREFILL_CHUNK):
            chunk = list(token_ids[start : start + PREFILL_CHUNK])
            n = len(chunk)
            causal = torch.ones(n, n, dtype=torch.bool).tril_()
            last = start + n == len(token_ids)
            outs.append(
                self._forward(chunk, torch.arange(n), causal, logit_rows=[n - 1] if last else [], features=features)
            )
        feats = torch.cat([o.features for o in outs]) if features else None
        return TargetOutput(outs[-1].logits, feats)

    def verify(self, tree: Tree, *, features: bool = False) -> TargetOutput:
        """Score every node of ``tree`` in one forward; logits row i predicts the token after node i."""
        if self.cached + tree.size > self.max_context:
            raise ContextLengthError(f"the sequence reached {self.name}'s context window of {self.max_context} tokens")
        return self._forward(
            tree.tokens.tolist(),
            torch.from_numpy(tree.depth),
            torch.from_numpy(tree.ancestors),
            logit_rows=None,
            features=features,
        )

    @torch.inference_mode()
    def commit(self, base: int, nodes: Sequence[int]) -> None:
        """After a verify at cache length ``base``, keep the entries of ``nodes`` (the accepted path)."""
        n = len(nodes)
        if list(nodes) == list(range(n)):
            self.cache.truncate(base + n)
        else:
            self.cache.keep(base, torch.as_tensor(nodes, dtype=torch.long, device=self.device))

    @torch.inference_mode()
    def _forward(
        self,
        token_ids: list[int],
        offsets: torch.Tensor,
        local_mask: torch.Tensor,
        *,
        logit_rows: list[int] | None,
        features: bool,
    ) -> TargetOutput:
        """Run q new tokens at positions ``cached + offsets`` that see the whole cache plus ``local_mask``."""
        base = self.cached
        q = len(token_ids)
        device = self.device
        ids = torch.tensor([token_ids], dtype=torch.long, device=device)
        positions = offsets.to(device=device, dtype=torch.long) + base
        allowed = torch.ones(q, base + q, dtype=torch.bool, device=device)
        allowed[:, base:] = local_mask.to(device)
        masks: dict[str, torch.Tensor] = {"full_attention": self._additive(allowed)}
        if self.sliding_window is not None:
            key_pos = torch.cat([torch.arange(base, device=device), positions])
            near = (positions[:, None] - key_pos[None, :]) < self.sliding_window
            masks["sliding_attention"] = self._additive(allowed & near)
        mask: Any = masks if self.sliding_window is not None else masks["full_attention"]

        self._capture = {i: [] for i in self.feature_layers} if features else None
        try:
            hidden = self.decoder(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions[None],
                past_key_values=self.cache,
                use_cache=True,
            ).last_hidden_state[0]
            feats = torch.cat([self._capture[i][0] for i in self.feature_layers], dim=-1) if features else None
        except BaseException:
            # A failed forward must not leave half-written entries that later steps would attend to.
            self.cache.truncate(base)
            raise
        finally:
            self._capture = None
        rows = hidden if logit_rows is None else hidden[logit_rows]
        return TargetOutput(self.logits(rows), feats)

    @torch.inference_mode()
    def score_sequence(self, token_ids: Sequence[int] | torch.Tensor) -> TargetOutput:
        """Features and logits for every position of a whole sequence (training; the cache is untouched).

        Returns features ``(T, F*H)`` and logits ``(T, vocab)``: row i predicts token i+1.
        """
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device).reshape(1, -1)
        if ids.shape[1] > self.max_context:
            raise ContextLengthError(f"a {ids.shape[1]}-token sequence exceeds {self.name}'s context window")
        self._capture = {i: [] for i in self.feature_layers}
        try:
            hidden = self.decoder(input_ids=ids, use_cache=False).last_hidden_state[0]
            feats = torch.cat([self._capture[i][0] for i in self.feature_layers], dim=-1)
        finally:
            self._capture = None
        return TargetOutput(self.logits(hidden), feats)

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        return mask[None, None]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head on final-norm hidden states ``(rows, H)``; ``(rows, vocab)`` in float32 or wider."""
        if hidden.shape[0] == 0:
            return hidden.new_zeros((0, self.vocab_size), dtype=torch.float32)
        head = self.lm_head
        logits = rows_first_linear(hidden, head.weight, head.bias) if self.fast_linear else head(hidden)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    # --- text --------------------------------------------------------------------------------

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Apply the model's chat template (with the assistant turn opened) and tokenize."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise DartspecError(f"{self.name} has no chat template; pass a plain prompt without --chat")
        ids = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer(text, add_special_tokens=True)["input_ids"]]

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)
