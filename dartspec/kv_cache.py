"""The tree-aware KV cache shared by every target runtime.

Preallocated per-layer buffers that grow by doubling, never concatenate per step, and keep an arbitrary
subset of the newest entries (the accepted path of a draft tree) in place. It implements transformers'
``Cache`` API so the transformers runtime can pass it to the model; the lean runtime calls
:meth:`TreeKVLayer.update` directly.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


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

    def extend(
        self, q: int, like_keys: torch.Tensor, like_values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Room for ``q`` more positions, counted as written: ``(keys, values, base)``; the caller fills
        ``keys[:, :, base : base + q]`` and the same of ``values`` (shapes and dtype taken from ``like_*``,
        ``(1, heads, any, dim)``)."""
        if not self.is_initialized:
            self.lazy_initialization(like_keys, like_values)
        base = self.length
        self._reserve(base + q)
        self.length = base + q
        return self.keys, self.values, base

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

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only these batch rows (static-batch decoding drops finished sequences)."""
        if self.is_initialized:
            self.keys = self.keys.index_select(0, rows)
            self.values = self.values.index_select(0, rows)

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

    def select_rows(self, rows: torch.Tensor) -> None:
        for layer in self.layers:
            layer.select_rows(rows)
