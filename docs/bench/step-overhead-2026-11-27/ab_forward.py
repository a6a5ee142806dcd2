"""The lean step's own Python cut (one sequence on the batched C path with rotations gathered in numpy, KV slot
addresses from a cached table, Tree keeping its depth) against the code before, interleaved in one process.

Old is the same code with the earlier pieces patched back in (one sequence verified through ``CausalRuntime``'s
generic ``verify``, the slots filled layer by layer, ``Tree.max_depth`` computed by numpy), switched before every
decode. Usage and output as ``ab_overhead.py``: python ab_forward.py FIRST LAST [MODEL].
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from ab_overhead import run

from dartspec import exact, tree
from dartspec.kv_cache import TreeKVCache
from dartspec.lean import LeanTarget
from dartspec.runtime import CausalRuntime


def extend_layers_before(self: LeanTarget, slots: exact.SequenceSlots, caches: Sequence[TreeKVCache], sizes) -> None:
    like = self._no_kv
    for s, (cache, q) in enumerate(zip(caches, sizes, strict=True)):
        rooms = [layer.extend(q, like, like) for layer in cache.layers]
        slots.kv["k"][:, s] = [keys.data_ptr() for keys, _, _ in rooms]
        slots.kv["v"][:, s] = [values.data_ptr() for _, values, _ in rooms]
        slots.kv["cap"][:, s] = [keys.shape[2] for keys, _, _ in rooms]


batched = LeanTarget.verify_many


def verify_many_before(self: LeanTarget, items, *, features: bool = False):
    if len(items) < 2:
        return CausalRuntime.verify_many(self, items, features=features)
    return batched(self, items, features=features)


OLD = {
    (LeanTarget, "verify_many"): verify_many_before,
    (LeanTarget, "extend_layers"): extend_layers_before,
    (tree.Tree, "max_depth"): property(lambda self: int(self.depth.max())),
}

if __name__ == "__main__":
    run(OLD, int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:4])
