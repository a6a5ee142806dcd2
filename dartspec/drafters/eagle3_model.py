"""The EAGLE-3 baseline network: DART's layer and inputs, run autoregressively on its own outputs.

Real positions are DART's: ``fc(h_i)`` (fused target features) paired with the embedding of token
x_{i+1}. There are no mask slots. Instead, a draft node at depth k >= 2 pairs the drafter's own
residual output at its parent with the embedding of the node's token, so each tree depth costs one
more drafter forward (method.md section 5). Depth 1 is computed exactly like DART's first row, which
lets a trained DART checkpoint warm-start this network (``Eagle3Model.from_dart``).

Training uses "training-time test" (:mod:`dartspec.train.eagle3_loss`): the network is unrolled
``cfg.depth`` steps on its own hidden states over every position of a sequence at once.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from dartspec.drafters.dart_model import DartConfig, DartModel, DraftKV

FORMAT = "dartspec-eagle3"


class Eagle3Model(DartModel):
    """EAGLE-3-style drafter; ``cfg.depth`` is the number of unrolled steps it was trained for."""

    FORMAT = FORMAT

    def __init__(self, cfg: DartConfig) -> None:
        if cfg.format != FORMAT:
            cfg = replace(cfg, format=FORMAT)
        super().__init__(cfg)
        # No mask slots: registering None removes DART's parameters from the module and its checkpoints.
        self.mask_input = None
        self.mask_resid = None

    @classmethod
    def config_for_target(cls, target: Any, **kw: Any) -> DartConfig:
        return replace(DartConfig.for_target(target, **kw), format=FORMAT)

    @classmethod
    def from_dart(
        cls, folder: str | Path, *, depth: int, device: str | torch.device = "cpu", target: Any = None
    ) -> Eagle3Model:
        """A network whose first step equals the DART drafter's depth-1 row (warm start); ``target`` as for
        :meth:`DartModel.load`."""
        dart = DartModel.load(folder, device=device, dtype=torch.float32, target=target)
        model = cls(replace(dart.cfg, depth=depth, extra={**dart.cfg.extra, "init": str(folder)})).to(device)
        state = {k: v for k, v in dart.state_dict().items() if k not in ("mask_input", "mask_resid")}
        model.load_state_dict(state)
        return model

    def node_inputs(self, parent_hidden: torch.Tensor, token_embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer input ``(n, 2H)`` and residual ``(n, H)`` of draft nodes (the parent's output replaces fc(h))."""
        return torch.cat([self.norm_feat(parent_hidden), self.norm_embed(token_embeds)], dim=-1), parent_hidden

    def logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.norm(hidden))
        return torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)

    @torch.inference_mode()
    def context_step(
        self, features: torch.Tensor, next_embeds: torch.Tensor, start: int, cache: DraftKV
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append m committed positions to ``cache``; depth-1 log-probs ``(Vd,)`` and the last residual ``(H,)``."""
        m = features.shape[0]
        x_in, resid = self.real_inputs(features, next_embeds)
        past = cache.length
        positions = torch.arange(start, start + m, device=features.device)
        mask = torch.ones(m, past + m, dtype=torch.bool, device=features.device)
        mask[:, past:] = torch.ones(m, m, dtype=torch.bool, device=features.device).tril_()
        hidden = self.residual(x_in, resid, positions, mask, cache=cache, keep=m)[-1]
        return self.logprobs(hidden[None])[0], hidden

    @torch.inference_mode()
    def tree_step(
        self,
        parent_hidden: torch.Tensor,
        token_embeds: torch.Tensor,
        positions: torch.Tensor,
        tree_mask: torch.Tensor,
        cache: DraftKV,
        tree: DraftKV,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One tree level of n nodes: log-probs of their children ``(n, Vd)`` and their residuals ``(n, H)``.

        ``tree_mask (n, T + n)`` says which of the T earlier tree nodes and the n new ones each node
        sees (its ancestors and itself); every node sees the whole committed ``cache``.
        """
        n = parent_hidden.shape[0]
        x_in, resid = self.node_inputs(parent_hidden, token_embeds)
        ctx = torch.ones(n, cache.length, dtype=torch.bool, device=tree_mask.device)
        hidden = self.residual(x_in, resid, positions, torch.cat([ctx, tree_mask], dim=1), cache=cache, tree=tree)
        return self.logprobs(hidden), hidden
