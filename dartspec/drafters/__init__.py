"""Drafters: everything that proposes draft trees. ``make_drafter`` builds one by name."""

from __future__ import annotations

from collections.abc import Callable

from dartspec.drafters.base import DraftBudget, Drafter, NoDrafter
from dartspec.drafters.pld import PromptLookupDrafter
from dartspec.errors import DartspecError
from dartspec.target import Target

_FACTORIES: dict[str, Callable[[Target | None], Drafter]] = {
    "none": lambda target: NoDrafter(),
    "pld": lambda target: PromptLookupDrafter(),
}


def drafter_names() -> list[str]:
    return list(_FACTORIES)


def make_drafter(name: str, target: Target | None) -> Drafter:
    """A drafter for ``target`` by name (``none``, ``pld``)."""
    factory = _FACTORIES.get(name)
    if factory is None:
        raise DartspecError(f"unknown drafter {name!r}: choose one of {', '.join(_FACTORIES)}")
    return factory(target)


__all__ = ["DraftBudget", "Drafter", "NoDrafter", "PromptLookupDrafter", "drafter_names", "make_drafter"]
