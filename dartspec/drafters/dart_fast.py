"""The drafter networks (DART's, and EAGLE-3's which shares its layer) on dartspec's CPU kernels, for float32
targets on a CPU.

The drafter network is one small decoder layer, so in torch its step is mostly the ~60 operations around its
products and their Python: 1.2 ms of a 4.6 ms two-node DART step on SmolLM2's lean runtime (3.4 ms a verify).
Here each layer is one :class:`~dartspec.exact.Block` call (the C decoder block of the lean runtime, reading
the layer's wider attention input), and the feature projection and the head are integer-dot GEMMs of the
``exact-a16`` kind. Their weights are the network's rounded to 8-bit groups of 32 (``exact.quantize8``): a lossy
copy, so proposals may differ slightly from the torch network's. That only moves acceptance (measured in
``bench``), never the output: the target verifies every token.

Same arithmetic as the torch network otherwise: :class:`FastDraftNet` runs rows through the layers against its own
draft KV cache (any positions, a causal or explicit mask), and :meth:`FastDraftNet.dart_step` is
:meth:`~dartspec.drafters.dart_model.DartModel.step` (fused features and next-token embeddings for the new real
positions, d-1 mask slots after them, only the real positions' keys and values kept, log-probabilities of the d
rows); EAGLE-3's context and tree steps use the same pieces (:mod:`dartspec.drafters.eagle3`).
"""

from __future__ import annotations

import copy

import torch

from dartspec import exact
from dartspec.drafters.dart_model import DartModel
from dartspec.kv_cache import TreeKVCache
from dartspec.rotary import interleave_rows


def _panels(*weights: torch.Tensor) -> exact.ExactWeight:
    """Weight matrices stacked along outputs, rounded to 8-bit groups, laid out for the kernel."""
    return exact.to_panels(exact.quantize8(torch.cat([_values(w) for w in weights])))


def _values(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().contiguous()


class FastDraftNet:
    """A :class:`DartModel` (or its EAGLE-3 subclass) on the C kernels, with its own draft KV cache."""

    def __init__(self, model: DartModel) -> None:
        cfg = model.cfg
        D = cfg.head_dim
        self.cfg = cfg
        self.blocks: list[exact.Block] = []
        for i, layer in enumerate(model.layers):
            # Rotary in the kernel's adjacent-pair layout: q and k rows permuted per head (see dartspec.rotary).
            q_rows = interleave_rows(_values(layer.q_proj.weight), cfg.num_attention_heads, D)
            k_rows = interleave_rows(_values(layer.k_proj.weight), cfg.num_key_value_heads, D)
            linears = (
                (_panels(q_rows, k_rows, layer.v_proj.weight), None),
                (_panels(layer.o_proj.weight), None),
                (_panels(layer.gate_proj.weight, layer.up_proj.weight), None),
                (_panels(layer.down_proj.weight), None),
            )
            ln1 = None if i == 0 else model.input_norms[i - 1].weight.detach()
            self.blocks.append(
                exact.Block(
                    linears,
                    ln1,
                    layer.post_norm.weight.detach(),
                    None,
                    None,
                    cfg.num_attention_heads,
                    cfg.num_key_value_heads,
                    D,
                    cfg.rms_norm_eps,
                    D**-0.5,
                )
            )
        self.fc = _panels(model.fc.weight)
        self.head = _panels(model.lm_head.weight)
        self.norm_feat, self.norm_embed, self.norm = (
            _values(n.weight) for n in (model.norm_feat, model.norm_embed, model.norm)
        )
        # Final norm, head and log-softmax in one C call (torch operations after the layer's call run on cold caches)
        self._head = exact.Head(self.head, norm=self.norm, eps=cfg.rms_norm_eps, log_softmax=True)
        masks = getattr(model, "mask_input", None), getattr(model, "mask_resid", None)
        self.mask_input, self.mask_resid = (None if t is None else _values(t) for t in masks)
        # The torch network's rotary angles, computed as dart_model.rotary does (float32 position * inverse freq).
        half = D // 2
        self._inv = 1.0 / (cfg.rope_theta ** (torch.arange(half, dtype=torch.float32) / half))
        self._rot = torch.empty(0, half, 2)
        self._like = torch.empty(1, cfg.num_key_value_heads, 0, D)
        self.cache = TreeKVCache(len(self.blocks))

    @staticmethod
    def supports(model: DartModel, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether ``model`` can run here for a target on ``device`` in ``dtype`` (a float32 CPU target, the
        kernels built here, every projection's input a whole number of groups of 32)."""
        cfg = model.cfg
        widths = (len(cfg.feature_layers) * cfg.hidden_size, 2 * cfg.hidden_size, cfg.hidden_size)
        widths += (cfg.num_attention_heads * cfg.head_dim, cfg.intermediate_size)
        return (
            device.type == "cpu"
            and dtype == torch.float32
            and all(w % exact.GROUP == 0 for w in widths)
            and cfg.head_dim % 2 == 0
            and exact.available()
        )

    def reset(self) -> None:
        self.cache.truncate(0)

    def fork(self) -> FastDraftNet:
        """The same weights with a draft KV cache of its own (another sequence)."""
        twin = copy.copy(self)
        twin.cache = TreeKVCache(len(self.blocks))
        return twin

    def _rotation(self, positions: torch.Tensor) -> torch.Tensor:
        """cos/sin pairs ``(n, D/2, 2)`` of ``positions``."""
        end = int(positions.max()) + 1
        if end > self._rot.shape[0]:
            size = max(2 * self._rot.shape[0], end, 256)
            angles = torch.arange(size, dtype=torch.float32)[:, None] * self._inv
            self._rot = torch.stack([angles.cos(), angles.sin()], dim=-1).contiguous()
        return self._rot[positions].contiguous()

    def inputs(self, first: torch.Tensor, next_embeds: torch.Tensor) -> torch.Tensor:
        """Layer input ``(m, 2H)``: ``[norm_feat(first) ; norm_embed(next_embeds)]`` (``first`` is fc(features) for
        real positions, the parent's output for EAGLE-3's tree nodes)."""
        H, eps = self.cfg.hidden_size, self.cfg.rms_norm_eps
        x = torch.cat([first.float(), next_embeds.float()], -1)
        exact.rms_norm_(x[:, :H], self.norm_feat, eps)  # each half in place, in C (as the head, below)
        exact.rms_norm_(x[:, H:], self.norm_embed, eps)
        return x

    def features(self, features: torch.Tensor) -> torch.Tensor:
        """fc of the target's fused features ``(m, F*H)``."""
        return exact.linear_a16(features.float().contiguous(), self.fc)

    def run(self, x_in: torch.Tensor, resid: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None):
        """The layers over ``q`` new rows appended to the cache (the caller truncates what is not context);
        ``mask`` ``(q, cached + q)`` or None (causal). Returns the residual stream ``(q, H)`` (updated in place)."""
        resid = resid.contiguous()
        rot = self._rotation(positions)
        x_in = x_in.contiguous()
        for i, block in enumerate(self.blocks):
            keys, values, base = self.cache.layers[i].extend(resid.shape[0], self._like, self._like)
            block(resid, rot, keys, values, base, mask, attn_in=x_in if i == 0 else None)
        return resid

    def logprobs(self, resid: torch.Tensor) -> torch.Tensor:
        """Log-probabilities over the draft vocabulary of residual rows (final norm, head)."""
        return self._head(resid)[0]

    @torch.inference_mode()
    def dart_step(self, features: torch.Tensor, next_embeds: torch.Tensor, start: int, depth: int) -> torch.Tensor:
        """As :meth:`DartModel.step`: ``m`` new real positions from ``start`` plus ``depth - 1`` mask slots;
        log-probs ``(depth, Vd)``."""
        assert self.mask_input is not None and self.mask_resid is not None  # a DART network
        depth = max(1, min(depth, self.cfg.depth))
        if self.cache.length != start:
            raise RuntimeError(f"draft cache out of step: {self.cache.length} cached, step starts at {start}")
        m = features.shape[0]
        h = self.features(features)
        x_in = torch.cat([self.inputs(h, next_embeds), self.mask_input.expand(depth - 1, -1)])
        resid = torch.cat([h, self.mask_resid.expand(depth - 1, -1)])
        out = self.run(x_in, resid, torch.arange(start, start + m + depth - 1), None)
        self.cache.truncate(start + m)  # the mask slots' keys and values are not context
        return self.logprobs(out[m - 1 :])
