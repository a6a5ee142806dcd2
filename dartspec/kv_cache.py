"""The tree-aware KV cache shared by every target runtime.

Preallocated per-layer buffers that grow by doubling, never concatenate per step, and keep an arbitrary
subset of the newest entries (the accepted path of a draft tree) in place. The lean runtime writes the buffers
itself; the transformers runtime hands its model a view with transformers' ``Cache`` API (``target.CacheView``), so
this module, and a default CPU load, never import transformers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

#: Positions per block of the own keys' transposed copy (``KEYS`` of ``attend.c``).
KT_BLOCK = 16

if TYPE_CHECKING:
    from dartspec.exact import SharedPages


class TreeKVLayer:
    """One layer's key/value cache in a preallocated buffer that grows by doubling.

    Unlike transformers' DynamicLayer it never concatenates per step, and it can keep an arbitrary
    subset of the newest entries (the accepted path of a draft tree) in place.
    """

    def __init__(
        self,
        capacity: int = 256,
        epoch: list[int] | None = None,
        kt_valid: list[int] | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        #: The buffers' dtype (None: that of the first keys written; see TreeKVCache).
        self.kv_dtype = dtype
        # Counts every replacement of the buffers (shared by a cache's layers, see TreeKVCache.extend_all).
        self._epoch = [0] if epoch is None else epoch
        #: The own keys again, transposed in blocks of KT_BLOCK slots, for the C attention (``dartspec_kv.kt`` of
        #: ``qdot.h``; made by TreeKVCache where that kernel reads the cache), and the slots of it that hold the keys
        #: now (``_kt_valid[0]``, shared by a cache's layers, which move in step). Every change to the own keys below
        #: that count lowers it; the attention kernel transposes the committed blocks past it.
        self.kt: torch.Tensor | None = None
        self._kt_valid = [0] if kt_valid is None else kt_valid
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.is_initialized = False
        self.length = 0
        self._capacity = capacity
        # The first positions may live in shared pages (the prefix cache, read-only): ``shared`` is the kernel's
        # view of them, ``_pages`` the (KV, page, D) key and value tensors of each page; the own buffers then
        # hold positions ``npre`` on, position ``npre`` at slot 0.
        self.shared: SharedPages | None = None
        self._pages: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()

    @property
    def keys(self) -> torch.Tensor | None:
        return self._keys

    @keys.setter
    def keys(self, buffer: torch.Tensor | None) -> None:
        self._keys = buffer
        self._epoch[0] += 1
        self.kt, self._kt_valid[0] = None, 0  # a new buffer: its transposed copy is made again

    def _keys_change(self, slot: int) -> None:
        """Own key slots from ``slot`` on are (to be) rewritten: the transposed copy is valid below them at most."""
        self._kt_valid[0] = min(self._kt_valid[0], max(slot, 0) // KT_BLOCK * KT_BLOCK)

    @property
    def values(self) -> torch.Tensor | None:
        return self._values

    @values.setter
    def values(self, buffer: torch.Tensor | None) -> None:
        self._values = buffer
        self._epoch[0] += 1

    @property
    def npre(self) -> int:
        """Positions in shared pages (0: none)."""
        return 0 if self.shared is None else self.shared.length

    def share(self, shared: SharedPages, pages: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Start an empty layer with ``shared.length`` positions in shared pages (never written here)."""
        if self.length:
            raise ValueError("shared pages go first: the layer is not empty")
        self._keys_change(0)  # own slot 0 is a later position now
        self.shared, self._pages, self.length = shared, pages, shared.length

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, dk = key_states.shape
        dv = value_states.shape[-1]
        self.dtype, self.device = self.kv_dtype or key_states.dtype, key_states.device
        self.keys = key_states.new_empty((b, h, self._capacity, dk), dtype=self.dtype)
        self.values = value_states.new_empty((b, h, self._capacity, dv), dtype=self.dtype)
        self.is_initialized = True

    def _reserve(self, needed: int) -> None:
        """Room for ``needed`` positions in the own buffers."""
        cap = self.keys.shape[2]
        if needed <= cap:
            return
        while cap < needed:
            cap *= 2
        keys = self.keys.new_empty((*self.keys.shape[:2], cap, self.keys.shape[3]))
        values = self.values.new_empty((*self.values.shape[:2], cap, self.values.shape[3]))
        own = self.length - self.npre
        keys[:, :, :own] = self.keys[:, :, :own]
        values[:, :, :own] = self.values[:, :, :own]
        self.keys, self.values = keys, values

    def reserve(self, length: int) -> None:
        """Room for positions up to ``length`` without a reallocation (a captured CUDA graph writes the buffers it was
        captured on: :mod:`dartspec.cuda_graphs`)."""
        self._reserve(length - self.npre)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q, npre = key_states.shape[2], self.npre
        start, end = self.length - npre, self.length - npre + q
        self._reserve(end)
        self._keys_change(start)
        self.keys[:, :, start:end] = key_states
        self.values[:, :, start:end] = value_states
        self.length += q
        if not npre:
            return self.keys[:, :, :end], self.values[:, :, :end]
        # torch's attention wants one tensor: the shared pages gathered before the own positions (a slow path;
        # the lean runtime's kernels read the pages where they are).
        keys = torch.cat([*(k for k, _ in self._pages), self.keys[0, :, :end]], 1)
        values = torch.cat([*(v for _, v in self._pages), self.values[0, :, :end]], 1)
        return keys[None, :, : self.length], values[None, :, : self.length]

    def extend(
        self, q: int, like_keys: torch.Tensor, like_values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Room for ``q`` more positions, counted as written: ``(keys, values, base)``; the caller fills
        ``keys[:, :, base - npre : base - npre + q]`` and the same of ``values`` (shapes and dtype taken from
        ``like_*``, ``(1, heads, any, dim)``)."""
        if not self.is_initialized:
            self.lazy_initialization(like_keys, like_values)
        base = self.length
        self._reserve(base - self.npre + q)
        self._keys_change(base - self.npre)
        self.length = base + q
        return self.keys, self.values, base

    def keep(self, base: int, nodes: torch.Tensor) -> None:
        """Keep entries ``base + nodes`` (ascending) as positions ``base, base+1, ...``; drop the rest."""
        n, own = nodes.numel(), base - self.npre
        if own < 0:
            raise ValueError("cannot rewrite positions in shared pages")
        self._keys_change(own)
        if self.is_initialized:
            src = nodes + own
            # index_select copies first, so overlapping source and destination ranges are safe.
            self.keys[:, :, own : own + n] = self.keys.index_select(2, src)
            self.values[:, :, own : own + n] = self.values.index_select(2, src)
        self.length = base + n

    def truncate(self, length: int) -> None:
        if length < self.npre:
            raise ValueError("cannot truncate into shared pages: reset the cache instead")
        self._keys_change(length - self.npre)
        self.length = min(self.length, length)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only these batch rows (static-batch decoding drops finished sequences)."""
        if self.is_initialized:
            self.keys = self.keys.index_select(0, rows)
            self.values = self.values.index_select(0, rows)

    def reset(self) -> None:
        self.length = 0
        self._kt_valid[0] = 0
        self.shared, self._pages = None, ()


class _Buffers(NamedTuple):
    """A cache's buffers as the C kernels take them (:meth:`TreeKVCache._buffers`)."""

    epoch: int  # the count of buffer replacements it was read at
    keys: np.ndarray  # every layer's key buffer address
    values: np.ndarray
    kts: np.ndarray  # every layer's transposed keys' address (0: none)
    caps: np.ndarray  # positions each layer's own buffers hold
    room: int  # the least of them
    heads: int
    key_bytes: int  # one head's key row at one position
    value_bytes: int
    c_keep: bool  # CPU buffers of one batch row, alike in every layer: the C keep applies


class TreeKVCache:
    """A model's KV cache: one :class:`TreeKVLayer` per decoder layer."""

    def __init__(
        self, num_layers: int, capacity: int = 256, *, transposed_keys: bool = True, dtype: torch.dtype | None = None
    ) -> None:
        """``transposed_keys``: keep the C attention's transposed copy of the keys where it reads the cache (fp32 or
        fp16 CPU buffers of one batch row; the keys are then held twice, 1.5x the memory); False leaves it to
        transpose them at every step (the same results, ~4% slower). ``dtype``: the buffers' (None: that of the first
        keys written); the lean runtime's fp16 cache (``--kv-cache fp16``) stores what its fp32 forward computes
        rounded to fp16, and reads it back as fp32."""
        self.dtype = dtype
        self._epoch = [0]  # bumped whenever any layer's buffers are replaced
        self._transposed_keys = transposed_keys
        self._kt_valid = [0]  # slots of the layers' transposed keys that hold their keys (TreeKVLayer.kt)
        self.layers = [TreeKVLayer(capacity, self._epoch, self._kt_valid, dtype) for _ in range(num_layers)]
        self._table: _Buffers | None = None  # see _buffers
        self._release: Callable[[], None] | None = None
        #: The shared pages as the batched attention kernel reads them, one ``exact.KV_SLOT`` row per layer (the
        #: own-buffer fields left zero), or None.
        self.page_slots: np.ndarray | None = None

    def share(
        self,
        shared: Sequence[SharedPages],
        pages: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]],
        release: Callable[[], None],
        page_slots: np.ndarray,
    ) -> None:
        """Start the empty cache with shared pages per layer (see :meth:`TreeKVLayer.share`); ``release`` is called
        once when the cache lets them go (reset, or the cache itself is dropped)."""
        for layer, s, p in zip(self.layers, shared, pages, strict=True):
            layer.share(s, p)
        self._release, self.page_slots = release, page_slots

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()
        self.page_slots = None
        if self._release is not None:
            release, self._release = self._release, None
            release()

    def __del__(self) -> None:
        if getattr(self, "_release", None) is not None:
            self._release()

    @property
    def length(self) -> int:
        return self.layers[0].length

    def _buffers(self) -> _Buffers:
        """Every layer's buffers as the C kernels take them, rebuilt only when a buffer was replaced (the layers'
        setters count replacements): per layer, reading the addresses cost ~0.1 ms of a 2-core CPU's decoding step
        (cold caches after the weight stream). The layers grow in step (the lean runtime writes every layer's new rows
        in one call) and share one prefix length."""
        table = self._table
        if table is None or table.epoch != self._epoch[0]:
            keys, values = [layer.keys for layer in self.layers], [layer.values for layer in self.layers]
            caps = np.array([k.shape[2] for k in keys], dtype=np.int64)
            first, heads = keys[0], keys[0].shape[1]
            # What the C keep reads: CPU buffers (contiguous: this class makes them) of one batch row, in every layer
            # the same heads and row widths.
            alike = all(len({(t.shape[0], t.shape[1], t.shape[3], t.dtype) for t in ts}) == 1 for ts in (keys, values))
            # The C attention's transposed copy of the keys: CPU buffers of one batch row of the kinds it reads.
            kt = self._transposed_keys and first.device.type == "cpu" and first.shape[0] == 1
            kt = kt and first.dtype in (torch.float32, torch.float16)
            for layer in self.layers if kt else ():
                if layer.kt is None or layer.kt.shape != layer.keys.shape:
                    layer.kt = torch.empty_like(layer.keys)
            table = _Buffers(
                epoch=self._epoch[0],
                keys=np.array([k.data_ptr() for k in keys], dtype=np.int64),
                values=np.array([v.data_ptr() for v in values], dtype=np.int64),
                kts=np.array([layer.kt.data_ptr() if kt else 0 for layer in self.layers], dtype=np.int64),
                caps=caps,
                room=int(caps.min()),
                heads=heads,
                key_bytes=first.shape[3] * first.element_size(),
                value_bytes=values[0].shape[3] * values[0].element_size(),
                c_keep=alike and first.device.type == "cpu" and first.shape[0] == 1 and values[0].shape[1] == heads,
            )
            self._table = table
        return table

    def extend_all(
        self, q: int, like_keys: torch.Tensor, like_values: torch.Tensor
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`TreeKVLayer.extend` of every layer; returns the layers' key and value buffer addresses, capacities
        and transposed keys' addresses (:meth:`_buffers`), in one pass over the layers while their buffers have
        room."""
        first, table = self.layers[0], self._table
        if table is not None and table.epoch == self._epoch[0] and first.length - first.npre + q <= table.room:
            for layer in self.layers:
                layer.length += q
        else:
            for layer in self.layers:
                layer.extend(q, like_keys, like_values)
            table = self._buffers()  # after any growth
        return table.keys, table.values, table.caps, table.kts

    @property
    def half(self) -> int:
        """1 where the buffers hold fp16 numbers (the C attention's ``dartspec_kv.half``), else 0."""
        keys = self.layers[0].keys
        return int(keys is not None and keys.dtype == torch.float16)

    @property
    def kt_valid(self) -> int:
        """Slots of every layer's transposed keys that hold their keys (:attr:`TreeKVLayer.kt`)."""
        return self._kt_valid[0]

    def keys_transposed(self, base: int) -> None:
        """The C attention ran over positions ``0 .. base`` (committed before its new rows) with the transposed copies
        passed to it: it transposed every whole block of them it had not, so those are valid now."""
        own = base - self.layers[0].npre
        self._kt_valid[0] = max(self._kt_valid[0], own // KT_BLOCK * KT_BLOCK)

    def keep(self, base: int, nodes: torch.Tensor) -> None:
        """Keep entries ``base + nodes`` (ascending) of every layer as positions ``base, base+1, ...``."""
        if not self._keep_in_c(base, nodes):
            for layer in self.layers:
                layer.keep(base, nodes)

    def _keep_in_c(self, base: int, nodes: torch.Tensor) -> bool:
        """:meth:`keep` as one C call over all layers (``attend.c``) where the buffers are CPU tensors of one batch
        row and dartspec's kernels build; False where it does not apply (the caller then keeps layer by layer)."""
        first, kernel = self.layers[0], _c_kv_keep()
        own = base - first.npre
        if kernel is None or not first.is_initialized or own < 0:
            return False
        table = self._buffers()
        if not table.c_keep:
            return False
        rows = np.ascontiguousarray(nodes.cpu().numpy(), dtype=np.int64)
        first._keys_change(own)
        kernel(table.keys.ctypes.data, table.values.ctypes.data, table.caps.ctypes.data, len(self.layers), table.heads,
               table.key_bytes, table.value_bytes, own, rows.ctypes.data, len(rows))  # fmt: skip
        for layer in self.layers:
            layer.length = base + len(rows)
        return True

    def position_bytes(self) -> int:
        """Bytes one position takes in every layer's keys and values (0 before the first write)."""
        layer = self.layers[0]
        if not layer.is_initialized:
            return 0
        return 2 * len(self.layers) * layer.keys.shape[1] * layer.keys.shape[3] * layer.keys.element_size()

    def own_bytes(self) -> int:
        """Bytes of the positions this cache holds itself (shared pages not counted), the transposed keys included."""
        layer, kt = self.layers[0], 0
        if layer.kt is not None:  # the keys' share of a position again
            kt = len(self.layers) * layer.kt.shape[1] * layer.kt.shape[3] * layer.kt.element_size()
        return (self.length - layer.npre) * (self.position_bytes() + kt)

    def truncate(self, length: int) -> None:
        for layer in self.layers:
            layer.truncate(length)

    def select_rows(self, rows: torch.Tensor) -> None:
        for layer in self.layers:
            layer.select_rows(rows)

    @classmethod
    def stack_rows(cls, caches: Sequence[TreeKVCache], capacity: int = 256) -> TreeKVCache:
        """One batched cache holding the rows of ``caches`` in order (all of one length, none with shared pages),
        with room for ``capacity`` positions: static-batch decoding prefills a large batch in slices of rows."""
        length = caches[0].length
        if any(c.length != length or c.layers[0].npre for c in caches):
            raise ValueError("stacked caches need one length and no shared pages")
        out = cls(len(caches[0].layers), max(capacity, length), dtype=caches[0].dtype)
        for i, layer in enumerate(out.layers):
            parts = [c.layers[i] for c in caches]
            layer.update(
                torch.cat([p.keys[:, :, :length] for p in parts]), torch.cat([p.values[:, :, :length] for p in parts])
            )
        return out


@functools.cache
def _c_kv_keep() -> Any:
    """:meth:`TreeKVCache.keep` in C (``attend.c``), or None where dartspec's kernels cannot be built."""
    from dartspec import exact

    return exact.kernel("dartspec_kv_keep")
