"""Prefix cache: the KV of prompt prefixes, computed once and shared by reference among requests.

Prompts are cut into blocks of ``block`` tokens. A cached block holds the keys and values of its tokens in every
layer (and the feature rows feature drafters read), and is found by the whole token prefix it ends (a trie: a
block's key is its parent block and its own tokens). A request whose prompt starts with cached blocks attaches them
to its empty KV cache as shared, read-only pages (:meth:`TreeKVCache.share`) and computes only the rest; its own
full blocks are then copied into the cache for the requests after it. The chat template's system prompt is the
first thing every chat request shares; any longer common prefix (few-shot examples, a document) is shared the same
way.

Blocks are reference-counted (a request holds every block it attached until its cache lets them go) and evicted
least recently used, leaves first, when the cache is over its byte budget; a block in use is never evicted.

Exactness: the lean runtime computes every row of a prefill on its own (fused blocks, chunk-independent bit for
bit), so a prompt's logits are the same whether its prefix came from this cache or was computed afresh.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dartspec.exact import KV_SLOT, SharedPages
from dartspec.kv_cache import TreeKVCache


@dataclass(eq=False)
class PrefixBlock:
    """``block`` tokens' keys and values in every layer, ``kv`` ``(layers, 2, KV heads, block, head dim)``, and their
    feature rows ``(block, F)`` if a feature drafter's prefill computed them."""

    uid: int
    parent: PrefixBlock | None
    tokens: tuple[int, ...]
    kv: torch.Tensor
    features: torch.Tensor | None = None
    refs: int = 0
    children: int = 0

    @property
    def key(self) -> tuple[int, tuple[int, ...]]:
        """Where the cache files it: the parent's uid (0 at the start of a prompt) and its own tokens."""
        return (self.parent.uid if self.parent else 0, self.tokens)

    @property
    def nbytes(self) -> int:
        extra = 0 if self.features is None else self.features.numel() * self.features.element_size()
        return self.kv.numel() * self.kv.element_size() + extra


@dataclass
class PrefixStats:
    """Counters for ``/metrics`` and ``bench serve``."""

    hit_tokens: int = 0
    prompt_tokens: int = 0


class PrefixCache:
    """Shared prompt-prefix KV blocks of one runtime (see the module docstring)."""

    def __init__(
        self, *, layers: int, kv_heads: int, head_dim: int, max_bytes: int, block: int = 16, device=None
    ) -> None:
        if block < 16 or block & (block - 1):
            raise ValueError(f"the block size must be a power of two of at least 16, got {block}")
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.block, self.max_bytes = block, max_bytes
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self._blocks: OrderedDict[tuple[int, tuple[int, ...]], PrefixBlock] = OrderedDict()  # oldest use first
        self._next_uid = 1
        self.nbytes = 0
        self.stats = PrefixStats()
        # The server's scheduler is the only writer today; the lock keeps the counts right if that changes.
        self._lock = threading.Lock()

    @property
    def block_bytes(self) -> int:
        return self.layers * 2 * self.kv_heads * self.block * self.head_dim * 4

    def __len__(self) -> int:
        return len(self._blocks)

    # --- lookup ------------------------------------------------------------------------------

    def match(self, token_ids: Sequence[int], *, features: bool = False) -> list[PrefixBlock]:
        """The longest chain of cached blocks that starts ``token_ids``, leaving at least its last token to compute
        (its logits are what the prefill is for); with ``features`` only blocks that kept their feature rows."""
        with self._lock:
            self.stats.prompt_tokens += len(token_ids)
            chain: list[PrefixBlock] = []
            parent = 0
            for start in range(0, len(token_ids) - 1 - self.block + 1, self.block):
                key = (parent, tuple(int(t) for t in token_ids[start : start + self.block]))
                found = self._blocks.get(key)
                if found is None or (features and found.features is None):
                    break
                chain.append(found)
                parent = found.uid
            for b in chain:
                self._blocks.move_to_end(b.key)
            self.stats.hit_tokens += len(chain) * self.block
            return chain

    def attach(self, cache: TreeKVCache, chain: Sequence[PrefixBlock]) -> None:
        """Start the empty ``cache`` with ``chain`` as shared pages; the blocks stay in use until the cache lets
        them go (its reset, or the cache dropped)."""
        if not chain:
            return
        with self._lock:
            for b in chain:
                b.refs += 1
        if chain[0].kv.dtype != (cache.dtype or torch.float32):
            raise ValueError(f"pages of {chain[0].kv.dtype} numbers for a cache of {cache.dtype}")
        base = np.array([b.kv.data_ptr() for b in chain], dtype=np.int64)
        layer_stride = 2 * self.kv_heads * self.block * self.head_dim * chain[0].kv.element_size()
        half = layer_stride // 2
        npre = len(chain) * self.block
        shared, pages = [], []
        for layer in range(self.layers):
            keys = base + layer * layer_stride
            shared.append(SharedPages(keys=keys, values=keys + half, length=npre, page=self.block))
            pages.append([(b.kv[layer, 0], b.kv[layer, 1]) for b in chain])
        # The batched kernel's per-layer view of these pages, built once here rather than at every step.
        slots = np.zeros(self.layers, dtype=KV_SLOT)
        slots["kpages"] = [p.keys.ctypes.data for p in shared]
        slots["vpages"] = [p.values.ctypes.data for p in shared]
        slots["npre"], slots["page"] = npre, self.block

        def release() -> None:  # the cache calls it once
            with self._lock:
                for b in chain:
                    b.refs -= 1

        cache.share(shared, pages, release, slots)

    # --- insertion ---------------------------------------------------------------------------

    def store(
        self,
        token_ids: Sequence[int],
        cache: TreeKVCache,
        chain: Sequence[PrefixBlock],
        features: torch.Tensor | None,
    ) -> None:
        """Copy the full blocks of ``token_ids`` past ``chain`` (the attached ones) from ``cache`` into the prefix
        cache; ``features`` ``(len(token_ids), F)`` are kept with them if given (and fill in blocks that lacked
        them). Then evict down to the budget."""
        full = len(token_ids) // self.block
        with self._lock:
            parent: PrefixBlock | None = chain[-1] if chain else None
            npre = len(chain) * self.block
            for index in range(len(chain), full):
                start = index * self.block
                tokens = tuple(int(t) for t in token_ids[start : start + self.block])
                key = (parent.uid if parent else 0, tokens)
                rows = None if features is None else features[start : start + self.block].detach().clone()
                found = self._blocks.get(key)
                if found is not None:  # cached meanwhile, or matched without its features
                    if found.features is None and rows is not None:
                        found.features = rows
                        self.nbytes += rows.numel() * rows.element_size()
                    self._blocks.move_to_end(key)
                    parent = found
                    continue
                kv = torch.empty(  # the cache's numbers (fp16 with --kv-cache fp16)
                    (self.layers, 2, self.kv_heads, self.block, self.head_dim),
                    dtype=cache.layers[0].keys.dtype,
                    device=self.device,
                )
                own = start - npre
                for i, layer in enumerate(cache.layers):
                    kv[i, 0] = layer.keys[0, :, own : own + self.block]
                    kv[i, 1] = layer.values[0, :, own : own + self.block]
                block = PrefixBlock(uid=self._next_uid, parent=parent, tokens=tokens, kv=kv, features=rows)
                self._next_uid += 1
                if parent is not None:
                    parent.children += 1
                self._blocks[key] = block
                self.nbytes += block.nbytes
                parent = block
            self._evict()

    def _evict(self) -> None:
        """Least recently used first, leaves only (a parent goes after its children), never a block in use."""
        while self.nbytes > self.max_bytes:
            victim = next(
                ((k, b) for k, b in self._blocks.items() if b.refs == 0 and b.children == 0),
                None,
            )
            if victim is None:
                return  # everything left is in use: over budget until requests finish
            key, block = victim
            del self._blocks[key]
            self.nbytes -= block.nbytes
            if block.parent is not None:
                block.parent.children -= 1

    def clear(self) -> None:
        """Drop every block no request uses."""
        with self._lock:
            budget, self.max_bytes = self.max_bytes, 0
            self._evict()
            self.max_bytes = budget


def positions_read(caches: Sequence[TreeKVCache], share: bool) -> tuple[int, int]:
    """KV positions one batched step's attention reads, by layout: ``(read, unshared)``. With ``share``, caches
    whose shared pages begin alike read their common pages once (as the lean runtime's batched attention does);
    unshared, every cache reads all its positions."""
    unshared = sum(c.length for c in caches)
    if not share:
        return unshared, unshared
    groups: dict[int, list[SharedPages]] = {}
    for c in caches:
        pages = c.layers[0].shared
        if pages is not None and len(pages.keys):
            groups.setdefault(int(pages.keys[0]), []).append(pages)
    saved = 0
    for members in groups.values():
        n = min(len(m.keys) for m in members)
        same = np.all([m.keys[:n] == members[0].keys[:n] for m in members], axis=0)
        common = n if same.all() else int(np.argmin(same))  # pages equal in every member
        saved += (len(members) - 1) * common * members[0].page
    return unshared - saved, unshared
