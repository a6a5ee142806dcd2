"""The DART drafter's step as CUDA graphs, for a target that runs its own steps on graphs (``--cuda-graphs``).

On an H100 with the target on graphs, a DART step spent a quarter of its time in the drafter's eager forward (~60
small kernels, each launched from Python: ~1.9 ms of a ~8 ms step, the network's arithmetic being microseconds).
:class:`GraphDraftNet` runs the same network, :meth:`~dartspec.drafters.dart_model.DartModel.step`'s arithmetic,
with what a graph needs: fixed shapes and addresses. The draft KV cache is one static buffer per layer; a step's new
keys and values go to the slots after the cache length (the real positions' stay, the mask slots' are overwritten by
the next step) and attention reads the whole buffer under a mask built inside the graph from the cache length, a
device tensor. A step is captured once per count of new real positions (1 .. ``max_new``: an accepted path plus its
bonus token, at most depth + 1), always with the network's full depth (rows are causal, so a shallower request is
the first rows of the full one); more positions (the prompt's, at the first step) run the same function eagerly.

Off a GPU the same function runs eagerly (``capture=False``), which is how the tests hold it to the network's own
step.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from dartspec.cuda_graphs import capture
from dartspec.drafters.dart_model import DartModel

#: Slots of a fresh draft KV buffer (doubled, and the graphs captured again, whenever a sequence outgrows it).
FIRST_CAPACITY = 512


class GraphDraftNet:
    """A :class:`DartModel`'s drafting steps on static buffers, captured as CUDA graphs (see the module docstring).
    One per sequence (:meth:`fork`): its graphs hold its own buffers."""

    def __init__(self, model: DartModel, *, capture: bool = True, max_new: int = 16) -> None:
        cfg = model.cfg
        param = next(model.parameters())
        self.model, self.capture, self.max_new = model, capture, max_new
        self.device, self.dtype = param.device, param.dtype
        width = len(cfg.feature_layers) * cfg.hidden_size
        self.features = torch.zeros(max_new, width, dtype=self.dtype, device=self.device)
        self.embeds = torch.zeros(max_new, cfg.hidden_size, dtype=self.dtype, device=self.device)
        self.length_t = torch.zeros((), dtype=torch.long, device=self.device)  # the cache length, read by the graphs
        self.length = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._graphs: dict[int, Callable[[], torch.Tensor]] = {}
        self.captures = 0  # graphs captured so far (tests, logs)
        self.failed: str | None = None  # why a capture failed, after which every step runs eagerly
        self._allocate(FIRST_CAPACITY)

    def reset(self) -> None:
        """A new sequence: an empty cache (the buffers and graphs are kept; stale slots are masked)."""
        self.length = 0

    def fork(self) -> GraphDraftNet:
        """The same network with buffers and graphs of its own (another sequence)."""
        return GraphDraftNet(self.model, capture=self.capture, max_new=self.max_new)

    def _allocate(self, capacity: int) -> None:
        """Buffers of ``capacity`` slots holding the cache so far; graphs captured on older buffers are dropped.
        Zeroed: attention reads every slot, and a masked slot adds nothing only if it holds finite numbers."""
        cfg = self.model.cfg
        shape = (cfg.num_key_value_heads, capacity, cfg.head_dim)
        old = list(zip(self.keys, self.values, strict=True))
        self.keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(cfg.num_layers)]
        self.values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(cfg.num_layers)]
        for (k, v), (new_k, new_v) in zip(old, zip(self.keys, self.values, strict=True), strict=False):
            new_k[:, : self.length].copy_(k[:, : self.length])
            new_v[:, : self.length].copy_(v[:, : self.length])
        self.slots = torch.arange(capacity, device=self.device)
        self._graphs = {}

    def _forward(self, features: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """The step's arithmetic, device tensors in and out (what a graph holds): log-probs ``(depth, Vd)`` of the m
        new real positions (at cache length ``length_t`` on) followed by the ``depth - 1`` mask slots."""
        model = self.model
        m, depth = features.shape[0], model.cfg.depth
        x_r, h_r = model.real_inputs(features, embeds)
        x_m, h_m = model.mask_inputs(depth - 1)
        x = torch.cat([x_r, x_m.to(x_r.dtype)])
        h = torch.cat([h_r, h_m.to(h_r.dtype)])
        rows = self.length_t + self.slots[: m + depth - 1]  # each new row's position, and the slot it writes
        mask = self.slots[None, :] <= rows[:, None]  # the cache, and the new rows up to this one
        for i, layer in enumerate(model.layers):
            if i > 0:
                x = model.input_norms[i - 1](h)
            q, k, v = layer.project(x, rows)
            self.keys[i].index_copy_(-2, rows, k)
            self.values[i].index_copy_(-2, rows, v)
            h = layer.mix(q, self.keys[i], self.values[i], mask, h)
        logits = model.lm_head(model.norm(h[m - 1 :]))
        return torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)

    def _graph(self, m: int) -> Callable[[], torch.Tensor] | None:
        """The step for ``m`` new positions on the static inputs, captured on first use; None where it cannot be."""
        step = self._graphs.get(m)
        if step is not None or self.failed or m > self.max_new:
            return step

        def body() -> torch.Tensor:
            return self._forward(self.features[:m], self.embeds[:m])

        if self.capture:
            try:
                body = capture(body, self.device)
            except RuntimeError as exc:  # a step that cannot be captured still runs, eagerly
                self.failed = f"{type(exc).__name__}: {exc}".splitlines()[0]
                warnings.warn(f"CUDA graph capture failed, drafting without graphs: {self.failed}", stacklevel=3)
                return None
        self._graphs[m] = body
        self.captures += 1
        return body

    @torch.inference_mode()
    def dart_step(self, features: torch.Tensor, next_embeds: torch.Tensor, start: int, depth: int) -> torch.Tensor:
        """As :meth:`DartModel.step`: ``m`` new real positions from ``start`` plus ``depth - 1`` mask slots;
        log-probs ``(depth, Vd)``."""
        if self.length != start:
            raise RuntimeError(f"draft cache out of step: {self.length} cached, step starts at {start}")
        m, full = features.shape[0], self.model.cfg.depth
        depth = max(1, min(depth, full))
        if start + m + full - 1 > self.slots.shape[0]:
            # Whole multiples of 64 slots: GPU attention kernels want the mask's rows aligned.
            self._allocate(max(2 * self.slots.shape[0], -(-(start + m + full - 1) // 64) * 64))
        self.length_t.fill_(start)
        step = self._graph(m)
        if step is None:
            out = self._forward(features.to(self.dtype), next_embeds.to(self.dtype))
        else:
            self.features[:m].copy_(features)
            self.embeds[:m].copy_(next_embeds)
            out = step()
        self.length = start + m  # the mask slots' keys and values are not context
        return out[:depth].clone()  # a replay overwrites the graph's output
