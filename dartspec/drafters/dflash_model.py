"""The DFlash drafter network: a block [anchor, MASK x d] drafted in one forward by L layers that read the target's
context as injected keys and values (method.md section 5).

Context: the target's hidden states entering K feature layers (the reference reads 5, spread over the depth),
concatenated, projected (``fc``, K H -> H) and normed: one row per position the target has processed. Every draft
layer passes these rows through its *own* key and value projections (RoPE at their positions) and attends to them
as extra keys and values before the block's: KV injection, the same as running the layer's attention over
[context rows ; block rows] with the context rows' queries and outputs unused (tested).

Block: the target's embedding of the last committed token (the anchor, the tree root) and d learned mask vectors,
at positions t .. t + d; inside the block attention is non-causal, and every block row sees every context row
before t. Rows 1..d give depths 1..d through a final norm and the target's LM head restricted to the draft
vocabulary (``d2t``), kept frozen. Unlike DART the context is not a sequence the drafter runs its layers over:
only its keys and values are computed, once per committed position and layer.

Shares :class:`~dartspec.drafters.dart_model.DartModel`'s config (``depth`` = mask slots, ``num_layers`` = L),
persistence (``config.json`` + ``model.safetensors``, format ``dartspec-dflash``) and target checks.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dartspec.drafters.dart_model import DartConfig, DartModel, DraftKV, RMSNorm, attend, rotary

FORMAT = "dartspec-dflash"


def dflash_feature_layers(num_layers: int, count: int = 5) -> tuple[int, ...]:
    """``count`` target layers spread evenly from the second to the second-to-last (the reference's 5)."""
    if num_layers <= count:
        return tuple(range(num_layers))
    lo, hi = 1, num_layers - 2
    return tuple(sorted({round(lo + (hi - lo) * i / (count - 1)) for i in range(count)}))


class DFlashLayer(nn.Module):
    """A Llama-style decoder layer whose attention also reads injected context keys and values."""

    def __init__(self, cfg: DartConfig) -> None:
        super().__init__()
        H, hd = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.input_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(H, cfg.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(H, cfg.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(H, cfg.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, H, bias=False)
        self.post_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(H, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(H, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, H, bias=False)

    def _heads(self, x: torch.Tensor, count: int) -> torch.Tensor:
        return x.unflatten(-1, (count, self.cfg.head_dim)).transpose(-2, -3)

    def kv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (rotated) and values ``(..., kv_heads, N, head_dim)`` of rows ``x (..., N, H)``."""
        cfg = self.cfg
        k = rotary(self._heads(self.k_proj(x), cfg.num_key_value_heads), positions, cfg.rope_theta)
        return k, self._heads(self.v_proj(x), cfg.num_key_value_heads)

    def forward(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        context: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Block rows ``h (..., N, H)`` at ``positions``, attending to the injected ``context`` keys/values and to
        each other; ``mask (..., N, C + N)`` bool over [context ; block] (None: everything)."""
        cfg = self.cfg
        x = self.input_norm(h)
        q = rotary(self._heads(self.q_proj(x), cfg.num_attention_heads), positions, cfg.rope_theta)
        k, v = self.kv(x, positions)
        if context is not None:
            k, v = torch.cat([context[0], k], -2), torch.cat([context[1], v], -2)
        attn = attend(q, k, v, mask)
        h = h + self.o_proj(attn.transpose(-2, -3).flatten(-2))
        x = self.post_norm(h)
        return h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashModel(DartModel):
    """The DFlash drafter network (see the module docstring)."""

    FORMAT = FORMAT
    #: The head is the target's rows of the draft vocabulary, frozen: rebuilt from the target, never stored.
    TARGET_TIED = ("lm_head.weight",)

    def __init__(self, cfg: DartConfig) -> None:
        nn.Module.__init__(self)  # DartModel's persistence and checks, not its modules
        if cfg.format != FORMAT:
            cfg = replace(cfg, format=FORMAT)
        H = cfg.hidden_size
        self.cfg = cfg
        self.fc = nn.Linear(len(cfg.feature_layers) * H, H, bias=False)
        self.norm_context = RMSNorm(H, cfg.rms_norm_eps)
        self.mask_embed = nn.Parameter(torch.randn(H) * 0.02)
        self.layers = nn.ModuleList([DFlashLayer(cfg) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.arange(cfg.draft_vocab_size, dtype=torch.long), persistent=True)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
        # The target's head rows (init_head_from_target), shared and not trained, as in the reference.
        self.lm_head.weight.requires_grad_(False)

    def tie_to_target(self, target: Any) -> None:
        with torch.no_grad():
            rows = target.lm_head_weight()[self.d2t.to(target.device)]
            self.lm_head.weight.copy_(rows.to(self.lm_head.weight))

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """Context rows ``(..., m, H)`` from target features ``(..., m, K H)``."""
        return self.norm_context(self.fc(features))

    def block_inputs(self, anchor_embeds: torch.Tensor) -> torch.Tensor:
        """Block rows ``(..., d + 1, H)``: each anchor's embedding ``(..., H)`` then the d mask vectors."""
        masks = self.mask_embed.to(anchor_embeds.dtype).expand(*anchor_embeds.shape[:-1], self.cfg.depth, -1)
        return torch.cat([anchor_embeds.unsqueeze(-2), masks], -2)

    def block(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        contexts: list[tuple[torch.Tensor, torch.Tensor]],
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final-norm hidden states of block rows ``h`` through every layer (layer i injects ``contexts[i]``)."""
        for layer, context in zip(self.layers, contexts, strict=True):
            h = layer(h, positions, context, mask)
        return self.norm(h)

    @torch.inference_mode()
    def step(
        self,
        features: torch.Tensor,
        next_embeds: torch.Tensor,
        start: int,
        cache: DraftKV,
        depth: int | None = None,
    ) -> torch.Tensor:
        """One drafting forward (DART's interface): features ``(m, K H)`` of the newly committed positions
        ``start .. start + m - 1`` and the embeddings of the tokens after each (the last: the root, this block's
        anchor); their injected keys/values join ``cache``, then the block of the root and every mask slot (the
        block is non-causal, so it always runs whole) gives log-probs ``(depth, Vd)`` of depths 1..depth."""
        m = features.shape[0]
        ctx = self.context(features)
        ctx_positions = torch.arange(start, start + m, device=features.device)
        for i, layer in enumerate(self.layers):
            cache.append(i, *layer.kv(ctx, ctx_positions))
        anchor = start + m
        positions = torch.arange(anchor, anchor + self.cfg.depth + 1, device=features.device)
        contexts = list(zip(cache.keys, cache.values, strict=True))
        hidden = self.block(self.block_inputs(next_embeds[-1]), positions, contexts)
        depth = self.cfg.depth if depth is None else max(1, min(depth, self.cfg.depth))
        logits = self.lm_head(hidden[1 : depth + 1])
        return torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
