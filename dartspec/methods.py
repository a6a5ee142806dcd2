"""One way from a method's settings to a ready :class:`~dartspec.engine.Generator`, shared by every front end.

``generate`` and ``serve`` (command-line options), ``bench`` and ``demo`` (method strings such as
``dart:size=4``) describe a method the same way, as a :class:`GeneratorSpec`, and :func:`build_generator` turns
it into a drafter and a tree budget, so a sizing rule lives in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dartspec.drafters import default_max_draft_temperature, make_drafter
from dartspec.engine import Generator, default_budget, default_draft_context
from dartspec.errors import DartspecError
from dartspec.formats import DRAFTERS, drafter_kind
from dartspec.tree_size import AUTO_MAX_SIZE


@dataclass(frozen=True)
class GeneratorSpec:
    """A decoding method: the drafter and its options (see :func:`dartspec.drafters.make_drafter`).

    ``drafter``: a name of :func:`dartspec.drafters.make_drafter`, ``auto`` included. ``tree_size``: nodes verified
    per step; None picks the device's default for the drafter (:func:`dartspec.engine.default_budget`), ``"auto"``
    chooses per step from the machine's cost curve (for prompt lookup its gate, within 16 nodes).
    ``draft_nodes``: a hybrid's (``dart+pld``) cap on its network tree's nodes; None: the default budget's cap where
    the size is the default, else none."""

    drafter: str = "none"
    path: str | None = None
    tree_size: int | str | None = None
    max_depth: int = 8
    tree: str = "beam"
    ngram: str | None = None
    online_ngram: bool = False
    ngram_smoothing: float = 0.0
    topk: int = 4
    draft_nodes: int | None = None
    sampled_drafts: bool = False


#: Options only some drafters read: the spec's field, its name in a drafter's registry line (a bench row's key) and
#: its command-line flag.
_DRAFTER_OPTIONS = (
    ("tree", "tree", "--tree"),
    ("ngram", "ngram", "--ngram"),
    ("online_ngram", "online", "--online-ngram"),
    ("ngram_smoothing", "smooth", "--ngram-smoothing"),
    ("topk", "topk", "--topk"),
    ("path", "path", "--drafter-path"),
)


def check_options(spec: GeneratorSpec) -> None:
    """A clear error where ``spec`` sets an option its drafter does not read (``--tree ddtree`` with prompt lookup
    was silently ignored). ``auto``'s choice is the machine's, so DART's options there apply where it picks DART."""
    kind = drafter_kind(spec.drafter)
    if kind is None:  # auto, or a name make_drafter refuses with its own message
        return
    defaults = GeneratorSpec()
    for field, key, flag in _DRAFTER_OPTIONS:
        if getattr(spec, field) != getattr(defaults, field) and key not in kind.options:
            readers = ", ".join(d.name for d in DRAFTERS if key in d.options)
            raise DartspecError(f"{flag} ({key}=) applies to {readers} only; the drafter here is {spec.drafter}")


def build_generator(target: Any, spec: GeneratorSpec) -> Generator:
    check_options(spec)
    if spec.drafter == "auto":
        from dartspec.tune import auto_drafter

        name = auto_drafter(target, spec.path)  # measured on this machine once (dartspec.tune)
    else:
        name = spec.drafter
    auto = spec.tree_size == "auto"
    kind = drafter_kind(name)
    feature, lookup = (kind.feature, kind.lookup) if kind is not None else (False, False)
    draft_nodes = spec.draft_nodes
    draft_context = None  # the default budget's: the network drafts in short contexts only (on a CPU)
    if spec.sampled_drafts and not (kind is not None and kind.samples):
        samplers = ", ".join(d.name for d in DRAFTERS if d.samples)
        raise DartspecError(f"--sampled-drafts applies to drafters that draw their trees ({samplers}); here: {name}")
    if draft_nodes is not None and not lookup:
        hybrids = ", ".join(d.name for d in DRAFTERS if d.lookup)
        raise DartspecError(
            f"the drafter's share of the tree beside lookup spans (--draft-nodes, draft=N) applies to {hybrids} only; "
            f"the drafter here is {name}"
        )
    if auto:
        size = AUTO_MAX_SIZE if feature else 16
    elif spec.tree_size is not None:
        size = int(spec.tree_size)
    else:
        size, default_cap = default_budget(target.device, feature, lookup)
        draft_nodes = default_cap if draft_nodes is None else draft_nodes
        draft_context = default_draft_context(target.device, feature, lookup)
    drafter = make_drafter(
        name,
        target,
        spec.path,
        tree=spec.tree,
        ngram=spec.ngram,
        online_ngram=spec.online_ngram,
        auto_size=auto,
        ngram_smoothing=spec.ngram_smoothing,
        topk=spec.topk,
        draft_nodes=draft_nodes,
        draft_context=draft_context,
    )
    # Only the default drafter steps aside for sampled requests: a drafter named on purpose always drafts.
    hot = default_max_draft_temperature(target.device) if spec.drafter == "auto" else None
    return Generator(
        target,
        drafter,
        tree_size=size,
        max_depth=spec.max_depth,
        max_draft_temperature=hot,
        sampled_drafts=spec.sampled_drafts,
    )
