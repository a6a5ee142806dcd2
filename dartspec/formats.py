"""Names of the target runtimes, weight formats, drafters and tree builders, in one place and without importing torch
(the CLI lists them in its help before anything heavy is loaded). What they mean: :mod:`dartspec.targets`,
:mod:`dartspec.quant`, :mod:`dartspec.drafters`, :mod:`dartspec.search`."""

from __future__ import annotations

from dataclasses import dataclass

from dartspec.errors import DartspecError

RUNTIMES = ("auto", "lean", "hf")
QUANT_FORMATS = ("none", "fp16", "int8", "exact", "exact-a16")
QUANT_CHOICES = ("auto", *QUANT_FORMATS)
#: The lean runtime's KV cache on a CPU: fp32, or each key and value rounded to fp16 (half the bytes a step reads).
KV_CACHES = ("fp32", "fp16")
KV_CACHE_CHOICES = ("auto", *KV_CACHES)


@dataclass(frozen=True)
class DrafterKind:
    """A drafter in the registry.

    ``builder`` is ``"module:function"``, imported only when the drafter is built (listing names imports no torch)
    and called as ``function(target, DrafterOptions) -> Drafter``. ``feature``: it runs a network over the target's
    features every step (``--tree-size auto`` applies; it gets the larger default tree). ``lookup``: it also
    proposes prompt lookup's spans, so its default budget gives the spans prompt lookup's size and the network's
    tree its own (:func:`dartspec.engine.default_budget`). ``samples``: for a sampled request it can draw its tree
    from its own distribution, for the verifier's rejection tests (``--sampled-drafts``; a bench method's
    ``sampled=1``). ``options``: what a bench method string may set for it (``dart:tree=ddtree,size=8``) besides the
    runtime, the weight format and ``sampled``."""

    name: str
    builder: str
    feature: bool = False
    lookup: bool = False
    samples: bool = False
    options: frozenset[str] = frozenset()


_DART_OPTIONS = frozenset({"tree", "size", "depth", "ngram", "online", "path", "smooth"})
_HYBRID_OPTIONS = _DART_OPTIONS | {"draft"}
_EAGLE3_OPTIONS = frozenset({"size", "depth", "path", "topk"})
#: Every drafter, one line each (:func:`dartspec.drafters.make_drafter` builds them); ``none`` is plain decoding.
DRAFTERS = (
    DrafterKind("none", "dartspec.drafters.base:build_none"),
    DrafterKind("pld", "dartspec.drafters.pld:build", options=frozenset({"size", "depth"})),
    DrafterKind("dart", "dartspec.drafters.dart:build", feature=True, samples=True, options=_DART_OPTIONS),
    DrafterKind(
        "dart+pld", "dartspec.drafters.hybrid:build", feature=True, lookup=True, samples=True, options=_HYBRID_OPTIONS
    ),
    DrafterKind("eagle3", "dartspec.drafters.eagle3:build", feature=True, options=_EAGLE3_OPTIONS),
    DrafterKind("dflash", "dartspec.drafters.dflash:build", feature=True, samples=True, options=_DART_OPTIONS),
    DrafterKind(
        "draft-model", "dartspec.drafters.draft_model:build", samples=True, options=frozenset({"size", "depth", "path"})
    ),
    DrafterKind(
        "draft-model+pld",
        "dartspec.drafters.hybrid:build_draft_model",
        lookup=True,
        samples=True,
        options=frozenset({"size", "depth", "path", "draft"}),
    ),
)
DRAFTER_NAMES = tuple(d.name for d in DRAFTERS)


def drafter_kind(name: str) -> DrafterKind | None:
    return next((d for d in DRAFTERS if d.name == name), None)


def check_drafter_name(name: str) -> DrafterKind | None:
    """``name``'s registry line (None for ``auto``, which the target's device resolves); an unknown name is an error
    that lists the known ones."""
    kind = drafter_kind(name)
    if kind is None and name != "auto":
        hint, (head, _, options) = "", name.partition(":")
        if options and (head == "auto" or drafter_kind(head)):  # a `bench --methods` spec where a bare name goes
            hint = f" (options such as {options!r} are flags here: --tree-size, --tree, --draft-nodes, ...)"
        raise DartspecError(f"unknown drafter {name!r}: choose one of auto, {', '.join(DRAFTER_NAMES)}{hint}")
    return kind


def parse_format(spec: str) -> tuple[str, str, str]:
    """``RUNTIME[:QUANT][:kv=KV]`` (``lean:fp16``, ``hf``, ``lean:auto:kv=fp16``) -> ``(runtime, quant, kv)``, quant
    ``none`` and kv ``auto`` when left out; DartspecError if a part is unknown."""
    runtime, *rest = spec.split(":")
    kv = rest.pop()[3:] if rest and rest[-1].startswith("kv=") else "auto"
    usage = "RUNTIME[:QUANT][:kv=KV]"
    if runtime not in RUNTIMES:
        raise DartspecError(f"{spec!r}: expected {usage}, RUNTIME one of {'|'.join(RUNTIMES)}")
    if len(rest) > 1 or (rest and rest[0] not in QUANT_CHOICES):
        raise DartspecError(f"{spec!r}: unknown QUANT {':'.join(rest)!r} in {usage}, one of {'|'.join(QUANT_CHOICES)}")
    if kv not in KV_CACHE_CHOICES:
        raise DartspecError(f"{spec!r}: unknown KV {kv!r} in {usage}, one of {'|'.join(KV_CACHE_CHOICES)}")
    return runtime, (rest[0] if rest else "none"), kv


#: Tree builders for a parallel drafter's rows (:func:`dartspec.search.make_tree_builder`).
TREE_BUILDERS = ("beam", "ddtree", "chain")
#: Where ``data regenerate`` takes user turns from: ShareGPT conversations, or requests the target writes itself.
DATA_SOURCES = ("sharegpt", "self")
