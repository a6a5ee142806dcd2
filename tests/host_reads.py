"""Counting what makes the host wait for the device, on a CPU, where nothing waits.

On a GPU the host queues work and goes on; reading a value back (``.item()``, ``.tolist()``, ``float()``,
``bool()``, ``nonzero``) or copying from pageable host memory waits until the device has run everything queued
before it, and a device that waits in turn for the host's next launches runs a small model at a fraction of its
speed. The calls that would wait are the same on every device, so a CPU run under :class:`HostReads` counts them
where they are made: the batched generator and the trainer are held to their budget of reads in CI, with no GPU.
"""

from __future__ import annotations

import collections
import traceback
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

#: Tensor methods that return host values, each a wait for the device.
READS = frozenset({"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__", "nonzero"})
#: Calls that copy host data to a device: a wait unless the copy is asynchronous (``non_blocking``, pinned memory).
COPIES = frozenset({"to", "tensor", "as_tensor", "cuda"})


def _device_arg(args: tuple, kwargs: dict) -> bool:
    """A ``.to(...)``/``torch.tensor(...)`` call that names a device (not a dtype alone)."""
    if "device" in kwargs and kwargs["device"] is not None:
        return True
    return any(isinstance(a, (torch.device, str)) for a in args[1:])


class HostReads(TorchFunctionMode):
    """Counts reads and blocking copies (by kind, and by the dartspec file and function that made them) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: collections.Counter[tuple[str, str]] = collections.Counter()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        copy = name in COPIES and _device_arg(args, kwargs) and not kwargs.get("non_blocking", False)
        if name in READS or copy:
            stack = traceback.extract_stack()[:-1]
            # A library's own .to(x.device) is mostly a tensor already there (a no-op on a GPU too); dartspec's
            # copies are counted where dartspec makes them, reads wherever they are made.
            if copy and "/dartspec/" not in stack[-1].filename:
                return func(*args, **kwargs)
            # Reads that wait for nothing: dartspec's reads of host tensors (runtime.host_values / host_array check
            # they are), and AdamW's step counters, host tensors unless the optimizer is fused (as the trainer's is on a
            # GPU).
            if any(f.name in ("host_values", "host_array") or "/torch/optim/" in f.filename for f in stack):
                return func(*args, **kwargs)
            frames = [f for f in stack if "/dartspec/" in f.filename]
            where = f"{frames[-1].filename.rsplit('/dartspec/', 1)[-1]}:{frames[-1].name}" if frames else "?"
            self.sites[(name, where)] += 1
        return func(*args, **kwargs)

    @property
    def count(self) -> int:
        return sum(self.sites.values())
