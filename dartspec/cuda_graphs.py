"""CUDA graphs of the lean forward's one-sequence steps: decoding and tree verification (``--cuda-graphs``).

On a GPU a small model's step is bound by kernel launches, not arithmetic: SmolLM2-135M's lean forward launches
~450 kernels a step (~9 ms a token on an H200 in the third GPU window) for well under a millisecond of work. A CUDA
graph launches a whole step's kernels at once. A graph fixes every shape and address, so a step is captured once per
bucket of new rows (1, 2, 4, ..., 64: trees are padded up to their bucket) against the cache's own buffers, and what
changes from step to step lives in one small device tensor the graph reads: the cache length, the new tokens, their
positions and the tree mask (one host-to-device copy a step). The new keys and values go to the slots after the
cache length, and attention covers the whole buffer under a mask built inside the graph (masked slots add nothing;
a few thousand of them cost a 135M model microseconds). Padding rows see only themselves and write slots past the
new cache length, which the next step overwrites.

The data generator's static-batch decode step (:mod:`dartspec.batch_decode`, one token for each of B rows, ~12 ms a
step on the H200 whatever B) is captured the same way per batch (:meth:`StepGraphs.run_batch`): it reads the batch's
own slot-position table, and the new slot's column, tokens and positions; a batch that drops finished rows has new
buffers and is captured again.

Off a GPU the same steps run eagerly (``capture=False``): the tests hold them to the ordinary forward and check that
they read nothing back to the host, the two things a capture needs.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from dartspec.errors import DartspecError
from dartspec.kv_cache import TreeKVCache, TreeKVLayer
from dartspec.runtime import host_array

if TYPE_CHECKING:
    from dartspec.lean import LeanTarget

T = TypeVar("T")
#: A captured step's kind ("step": decode / verify, "batch": the static batch, "commit": keeping a path), its rows,
#: and whether it returns features.
StepKey = tuple[str, int, bool]

#: Rows a step is captured for; a step of q new rows runs in the smallest bucket >= q (larger ones run eagerly).
BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class _StaticLayer:
    """A cache layer as a captured step writes it: new keys and values go to the slots a device tensor names, and
    attention reads the whole buffer (the mask says which slots count)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
        self.keys, self.values, self.slots = keys, values, slots

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys.index_copy_(2, self.slots, key_states)
        self.values.index_copy_(2, self.slots, value_states)
        return self.keys, self.values


@dataclass
class _Step:
    """One captured step: its bucket, the cache buffers it was captured on, its input block (on the device, and the
    pinned host copy the host writes it from: one sequence's steps), the step as a function of that block (``body``,
    whose closure holds the device tensors the graph reads, so they live as long as the step) and the call that runs
    it and returns its outputs ``(hidden, features or None)``: the graph's replay once captured."""

    rows: int
    buffers: tuple[torch.Tensor, ...]
    host: torch.Tensor | None
    meta: torch.Tensor
    body: Callable[[], tuple[torch.Tensor, torch.Tensor | None]]
    run: Callable[[], tuple[torch.Tensor, torch.Tensor | None]]
    copied: torch.cuda.Event | None = None

    def on(self, buffers: Sequence[torch.Tensor]) -> bool:
        """Whether the cache still has the buffers this step was captured on (a cache that grew has new ones)."""
        return len(buffers) == len(self.buffers) and all(a is b for a, b in zip(self.buffers, buffers, strict=True))


class StepGraphs:
    """Captured decode / verify steps of one lean target, per cache and bucket (see the module docstring)."""

    def __init__(self, target: LeanTarget, *, capture: bool = True, buckets: Sequence[int] = BUCKETS) -> None:
        if target._fused_attention:
            raise DartspecError("CUDA graphs take the lean forward's torch path (a GPU), not the CPU's C kernels")
        if capture and target.device.type != "cuda":
            raise DartspecError(f"--cuda-graphs needs a CUDA GPU (the target is on {target.device})")
        self.target, self.capture, self.buckets = target, capture, tuple(sorted(buckets))
        # Per cache (a sequence, or a server's request): its steps by (bucket, features). Weak keys: a finished
        # request's cache takes its graphs with it; nothing in a step refers back to the cache itself.
        self._steps: weakref.WeakKeyDictionary[TreeKVCache, dict[StepKey, _Step]] = weakref.WeakKeyDictionary()
        self.captures = 0  # steps captured so far (logs, tests)
        self.failed: str | None = None  # why capturing failed, after which every step runs eagerly

    def bucket(self, q: int) -> int | None:
        return next((b for b in self.buckets if b >= q), None)

    def run(
        self,
        token_ids: Sequence[int],
        offsets: torch.Tensor,
        local_mask: torch.Tensor | None,
        features: bool,
        cache: TreeKVCache,
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The step :meth:`dartspec.runtime.CausalRuntime._forward` asks for (new tokens at ``cache.length +
        offsets``, ``local_mask`` None for causal), run as a graph: ``(final hidden (q, H), features or None)``, or
        None where no graph applies (too many rows, an empty cache, shared prefix pages, capture failed)."""
        q, base = len(token_ids), cache.length
        rows = self.bucket(q)
        first = cache.layers[0]
        if self.failed or rows is None or not first.is_initialized or first.npre:
            return None
        if base + rows > self.target.max_context:
            return None  # the padding would not fit the context: run this step eagerly
        for layer in cache.layers:
            layer.reserve(base + rows)
        steps, buffers = self._steps_on(cache)
        key = ("step", rows, features)
        step = steps.get(key)
        if step is None:
            step = self._new_step(cache.layers, rows, features, buffers)
        self._fill(step, base, token_ids, offsets, local_mask)
        if key not in steps and not self._captured(steps, key, step):
            return None
        hidden, feats = step.run()
        for layer in cache.layers:
            layer.length = base + q
        # Copies: the next replay overwrites the graph's outputs, and callers keep features across steps.
        return hidden[:q].clone(), None if feats is None else feats[:q].clone()

    def run_batch(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        key_positions: torch.Tensor,
        column: int,
        cache: TreeKVCache,
    ) -> torch.Tensor | None:
        """The static batch's decode step (:meth:`dartspec.runtime.CausalRuntime.decode_step`: one token a row, its
        key and value written to slot ``column``) as a graph: the final hidden states ``(B, H)``, or None where no
        graph applies (capture failed, a cache with no room for the column)."""
        first = cache.layers[0]
        if self.failed or not first.is_initialized or first.npre or column >= first.keys.shape[2]:
            return None
        steps, buffers = self._steps_on(cache, key_positions)
        key = ("batch", len(tokens), False)
        step = steps.get(key)
        if step is None:
            step = self._new_batch_step(cache.layers, len(tokens), key_positions, buffers)
        # Inputs already on the device: copied into the step's own (no host block, no read).
        step.meta[0].fill_(column)
        step.meta[1 : 1 + len(tokens)].copy_(tokens)
        step.meta[1 + len(tokens) :].copy_(positions)
        if key not in steps and not self._captured(steps, key, step):
            return None
        hidden, _ = step.run()
        for layer in cache.layers:
            layer.length = column + 1
        return hidden.clone()

    def commit(self, base: int, nodes: Sequence[int], cache: TreeKVCache) -> bool:
        """Keep the entries ``base + nodes`` (ascending) as positions ``base, base + 1, ...`` (what
        :meth:`dartspec.kv_cache.TreeKVCache.keep` does: an index_select and a copy per layer's keys and values, ~120
        launches on a 30-layer model) as one graph per bucket of path lengths; False where no graph applies (the
        caller keeps them eagerly). Padding entries copy a slot onto itself."""
        n = len(nodes)
        rows = self.bucket(n)
        first = cache.layers[0]
        if self.failed or rows is None or not first.is_initialized or first.npre or base + rows > first.keys.shape[2]:
            return False
        steps, buffers = self._steps_on(cache)
        key = ("commit", rows, False)
        step = steps.get(key)
        if step is None:
            step = self._new_commit(cache.layers, rows, buffers)
            # A capture runs its body once before recording it, and a commit is not idempotent (a second run would
            # move moved entries again): it is captured on the identity path, which moves nothing.
            self._fill_commit(step, base, range(rows))
            if not self._captured(steps, key, step):
                return False
        self._fill_commit(step, base, nodes)
        step.run()
        for layer in cache.layers:
            layer.length = base + n
        return True

    def _fill_commit(self, step: _Step, base: int, nodes: Sequence[int]) -> None:
        """Write a commit's inputs (padding entries name their own slot) and send them."""
        if step.copied is not None:
            step.copied.synchronize()
        assert step.host is not None
        block = host_array(step.host)
        block[0] = base
        block[1:] = np.arange(step.rows)
        block[1 : 1 + len(nodes)] = nodes
        self._send(step)

    def _new_commit(self, layers: Sequence[TreeKVLayer], rows: int, buffers: tuple[torch.Tensor, ...]) -> _Step:
        """A path's commit: its input block ``[base, nodes (rows, padded with their own index)]``."""
        device = self.target.device
        host = torch.zeros(1 + rows, dtype=torch.long, pin_memory=device.type == "cuda")
        meta = torch.zeros(1 + rows, dtype=torch.long, device=device)
        new = torch.arange(rows, device=device)
        kv = [(buffers[2 * i], buffers[2 * i + 1]) for i in range(len(layers))]

        def body() -> tuple[torch.Tensor, None]:
            src, dst = meta[0] + meta[1:], meta[0] + new
            for keys, values in kv:
                keys.index_copy_(2, dst, keys.index_select(2, src))  # gathered first: overlaps are safe
                values.index_copy_(2, dst, values.index_select(2, src))
            return meta, None

        return _Step(rows, buffers, host, meta, body, body)

    def _steps_on(
        self, cache: TreeKVCache, *tables: torch.Tensor
    ) -> tuple[dict[StepKey, _Step], tuple[torch.Tensor, ...]]:
        """The steps captured on ``cache``'s current buffers (and the given tables, which the steps read in place),
        and those buffers. Steps captured on older ones (the cache grew, or a batch dropped rows) are dropped."""
        buffers = (*(t for layer in cache.layers for t in (layer.keys, layer.values)), *tables)
        steps = self._steps.setdefault(cache, {})
        if not steps or not next(iter(steps.values())).on(buffers):
            # First steps on these buffers. Attention reads every slot, and a masked slot adds nothing only if it
            # holds finite numbers (0 x NaN is NaN): fresh buffers hold whatever memory they were given, so their
            # free slots are zeroed once; after that they hold only keys and values this model wrote.
            steps.clear()
            for layer, own in ((layer, layer.length - layer.npre) for layer in cache.layers):
                layer.keys[:, :, own:].zero_()
                layer.values[:, :, own:].zero_()
        return steps, buffers

    def _captured(self, steps: dict[StepKey, _Step], key: StepKey, step: _Step) -> bool:
        """Capture a new step (its inputs written) and keep it; False (and every later step eager) if that fails."""
        try:
            step.run = self._capture(step.body)
        except RuntimeError as exc:  # a step that cannot be captured still runs, eagerly
            self.failed = f"{type(exc).__name__}: {exc}".splitlines()[0]
            warnings.warn(f"CUDA graph capture failed, decoding without graphs: {self.failed}", stacklevel=3)
            return False
        steps[key] = step
        self.captures += 1
        return True

    def _new_step(
        self, layers: Sequence[TreeKVLayer], rows: int, features: bool, buffers: tuple[torch.Tensor, ...]
    ) -> _Step:
        """A step's input block and the function of it that the graph captures (which refers to the cache's buffers,
        never to the cache object)."""
        target, device = self.target, self.target.device
        # The input block, int64: [cache length, token ids (rows), positions (rows), tree mask (rows x rows)].
        size = 1 + 2 * rows + rows * rows
        host = torch.zeros(size, dtype=torch.long, pin_memory=device.type == "cuda")
        meta = torch.zeros(size, dtype=torch.long, device=device)
        new = torch.arange(rows, device=device)
        cap = buffers[0].shape[2]
        slots_all = torch.arange(cap, device=device)
        kv = [(buffers[2 * i], buffers[2 * i + 1]) for i in range(len(layers))]

        def body() -> tuple[torch.Tensor, torch.Tensor | None]:
            base = meta[0]
            ids, positions = meta[1 : 1 + rows], meta[1 + rows : 1 + 2 * rows]
            local = meta[1 + 2 * rows :].view(rows, rows).bool()
            slots = base + new
            rel = slots_all - base  # each buffer slot relative to the first new row
            inside = (rel >= 0) & (rel < rows)
            mask = (rel < 0) | (inside & local[:, rel.clamp(0, rows - 1)])  # (rows, cap): cached, or the tree's
            window = None
            if target.window is not None:  # sliding-window layers: also no key a window or more behind
                keys = torch.where(inside, positions[rel.clamp(0, rows - 1)], slots_all)  # each slot's position
                window = mask & (positions[:, None] - keys[None, :] < target.window)
            cache = _StaticKV([_StaticLayer(k, v, slots) for k, v in kv])
            return target._layers(target.embed(ids), positions, mask, False, cache, features, window=window)

        return _Step(rows, buffers, host, meta, body, body)

    def _new_batch_step(
        self, layers: Sequence[TreeKVLayer], rows: int, key_positions: torch.Tensor, buffers: tuple[torch.Tensor, ...]
    ) -> _Step:
        """A static batch's step: its inputs ``[column, tokens (rows), positions (rows)]`` in one device tensor, the
        batch's slot-position table read in place (the caller writes the new column before each step)."""
        target, device = self.target, self.target.device
        meta = torch.zeros(1 + 2 * rows, dtype=torch.long, device=device)
        slot_ids = torch.arange(key_positions.shape[1], device=device)
        kv = [(buffers[2 * i], buffers[2 * i + 1]) for i in range(len(layers))]

        def body() -> tuple[torch.Tensor, torch.Tensor | None]:
            column = meta[:1]
            tokens, positions = meta[1 : 1 + rows, None], meta[1 + rows :, None]
            # As forward_batch: a row sees the slots at or before its position, and its new slot (a padding row,
            # whose slots are all -1, sees only that); later columns are still -1.
            own = slot_ids == column
            allowed = ((key_positions >= 0) & (key_positions <= positions)) | own
            window = None
            if target.window is not None:  # sliding-window layers: also no key a window or more behind
                window = (allowed & ((positions - key_positions < target.window) | own))[:, None, None]
            cache = _StaticKV([_StaticLayer(k, v, column) for k, v in kv])
            x = target.embed(tokens)
            at = positions.clamp_min(0)
            hidden, _ = target._layers(x, at, allowed[:, None, None], False, cache, False, window=window)
            return hidden[:, -1], None

        return _Step(-rows, buffers, None, meta, body, body)

    def _fill(
        self, step: _Step, base: int, token_ids: Sequence[int], offsets: torch.Tensor, local_mask: torch.Tensor | None
    ) -> None:
        """Write this step's inputs into the step's block: one copy to the device."""
        rows, q = step.rows, len(token_ids)
        if step.copied is not None:
            step.copied.synchronize()  # the last copy out of the pinned block is done before it is rewritten
        assert step.host is not None  # one sequence's steps are written by the host
        # The pinned block written through numpy (a microsecond an operation; torch's are several on tiny tensors).
        block = host_array(step.host)
        block[:] = 0
        block[0] = base
        block[1 : 1 + q] = token_ids
        positions = block[1 + rows : 1 + 2 * rows]
        positions[:] = base  # padding rows: any position inside the context
        positions[:q] += host_array(offsets)  # offsets and the mask are host tensors (from the tree's arrays)
        local = block[1 + 2 * rows :].reshape(rows, rows)
        np.fill_diagonal(local, 1)  # padding rows see themselves only, which keeps their softmax finite
        local[:q, :q] = np.tri(q, dtype=np.int64) if local_mask is None else host_array(local_mask)
        self._send(step)

    def _send(self, step: _Step) -> None:
        """Copy the step's host block to its device block without waiting (the next write waits for this copy)."""
        assert step.host is not None
        step.meta.copy_(step.host, non_blocking=True)
        if self.capture:
            step.copied = torch.cuda.Event()
            step.copied.record()

    def _capture(
        self, body: Callable[[], tuple[torch.Tensor, torch.Tensor | None]]
    ) -> Callable[[], tuple[torch.Tensor, torch.Tensor | None]]:
        """``body`` as a CUDA graph (a function that replays it and returns its outputs); eagerly off a GPU."""
        return capture(body, self.target.device) if self.capture else body


def capture(body: Callable[[], T], device: torch.device) -> Callable[[], T]:
    """``body`` captured as a CUDA graph on ``device``: a function that replays it and returns its outputs (the same
    tensors each time, overwritten by the next replay). Raises RuntimeError where the body cannot be captured."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        body()  # warm-up off the capture: cuBLAS handles, workspaces and kernel choices are made here
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = body()

    def replay() -> T:
        graph.replay()
        return outputs

    return replay


class _StaticKV:
    """The cache a captured step passes to the lean forward: its layers write to fixed slots (duck-types the
    ``layers`` of :class:`dartspec.kv_cache.TreeKVCache` for :meth:`dartspec.lean.LeanTarget._attention`)."""

    def __init__(self, layers: list[_StaticLayer]) -> None:
        self.layers: list[Any] = layers
