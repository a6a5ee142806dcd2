"""``dartspec bench``: methods side by side on real prompts, fair by construction.

For every prompt all methods run back to back in one process, in an order that rotates from prompt
to prompt, after one warm-up generation per method. Speedup is measured per prompt (the method's
tokens/s over plain decoding's on the same prompt) and summarised by its median and interquartile
range. Under greedy decoding every method's output is compared with plain decoding's: a lossless
method never differs, so any mismatch is reported loudly. This module runs; :mod:`dartspec.bench.report`
summarises and writes.
"""

from __future__ import annotations

import contextlib
import functools
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dartspec import atomic
from dartspec.errors import DartspecError
from dartspec.formats import DRAFTER_NAMES, DRAFTERS, KV_CACHES, QUANT_CHOICES, RUNTIMES, TREE_BUILDERS

if TYPE_CHECKING:
    from dartspec.methods import GeneratorSpec

#: Rows run by other decoders (peers): transformers generate, plain and with prompt lookup, and llama.cpp (through
#: llama-cpp-python), plain and with its prompt lookup.
_PEERS = ("hf-ar", "hf-pld", "llamacpp-ar", "llamacpp-pld")
#: Method names ``--methods`` understands (``ar`` is the drafter ``none``, plain decoding, ``auto`` what ``generate``
#: runs by default on the device, then every other drafter, then the peers); options follow a colon
#: (``dart:tree=ddtree,size=8``).
METHODS = ("ar", "auto", *(d for d in DRAFTER_NAMES if d != "none"), *_PEERS)
#: Every method of dartspec's own engine may run on another runtime / weight format than the main target.
_RUNTIME_OPTIONS = {"runtime", "quant", "graphs", "kv"}
#: Options each method takes after its colon (a drafter's come from its registry line).
_OPTIONS = {
    "auto": {*_RUNTIME_OPTIONS, "sampled"},  # sampled=1: refused where the device's default drafter cannot sample
    **{
        ("ar" if d.name == "none" else d.name): {*d.options, *_RUNTIME_OPTIONS, *(("sampled",) if d.samples else ())}
        for d in DRAFTERS
    },
    "llamacpp-ar": {"gguf"},
    "llamacpp-pld": {"gguf", "draft"},
}
#: Rows run by dartspec's engine.
_ENGINE_METHODS = tuple(m for m in METHODS if m not in _PEERS)
#: llama.cpp weight types the ``llamacpp-ar`` row can requantize the model's GGUF to (llama.cpp's own quantizer).
LLAMACPP_TYPES = ("f16", "q8_0", "q4_1")


@dataclass(frozen=True)
class MethodSpec:
    """One row of the benchmark: a drafter and its settings."""

    label: str
    kind: str  # one of METHODS
    tree: str = "beam"
    tree_size: int | str | None = None  # or "auto"; None: the drafter's default on the device
    max_depth: int = 8
    ngram: str | None = "shipped"  # "shipped", "off" or a file
    online: bool = False
    path: str | None = None
    smooth: float = 0.0  # interpolated n-gram weight (0 = DART's longest-context rule)
    topk: int = 4  # eagle3: nodes expanded per level, children per node
    # dart+pld: the DART tree's share of the nodes (None: the default budget's); llamacpp-pld: tokens a draft (None:
    # llama-cpp-python's default, 10)
    draft: int | None = None
    runtime: str | None = None  # None: the main target's; else lean / hf (see dartspec.targets)
    quant: str | None = None  # None: the main target's; else none / fp16 / int8
    graphs: bool | None = None  # None: the main target's; else CUDA graphs on / off (the lean runtime on a GPU)
    kv: str | None = None  # None: the main target's; else the lean runtime's KV cache, fp32 / fp16 (--kv-cache)
    sampled: bool = False  # sampled requests: drafts drawn from the drafter and tested by rejection
    gguf: str | None = None  # llamacpp-*: None = the model's own file, else a type of LLAMACPP_TYPES

    def generator_spec(self) -> GeneratorSpec:
        """This row as the :class:`dartspec.methods.GeneratorSpec` every front end builds a generator from."""
        from dartspec.methods import GeneratorSpec

        return GeneratorSpec(
            drafter={"ar": "none"}.get(self.kind, self.kind),
            path=self.path,
            tree_size=self.tree_size,
            max_depth=self.max_depth,
            tree=self.tree,
            ngram=None if self.ngram == "shipped" else self.ngram,
            online_ngram=self.online,
            ngram_smoothing=self.smooth,
            topk=self.topk,
            draft_nodes=self.draft,
            sampled_drafts=self.sampled,
        )

    @property
    def own_target(self) -> bool:
        """Whether this row runs on another runtime or weight format than the main target."""
        return self.runtime is not None or self.quant is not None or self.graphs is not None or self.kv is not None


def parse_methods(text: str, *, tree_size: int | str | None = None) -> list[MethodSpec]:
    """``"ar,pld,dart,dart:tree=ddtree,size=8"`` -> specs (an ``x=y`` item extends the method before it)."""
    groups: list[list[str]] = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        if "=" in item and ":" not in item:
            if not groups:
                raise DartspecError(f"--methods: option {item!r} must follow a method name")
            groups[-1].append(item)
        else:
            name, _, first = item.partition(":")
            groups.append([name, *([first] if first else [])])
    if not groups:
        raise DartspecError("--methods is empty")
    specs = [_spec(group, tree_size) for group in groups]
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        raise DartspecError(f"--methods lists the same method twice: {labels}")
    return specs


def _spec(group: list[str], tree_size: int | str | None) -> MethodSpec:
    name, options = group[0], group[1:]
    if name not in METHODS:
        raise DartspecError(f"unknown method {name!r}: choose from {', '.join(METHODS)}")
    label = name + (":" + ",".join(options) if options else "")
    allowed = _OPTIONS.get(name, set())
    if options and not allowed:
        raise DartspecError(f"method {name} takes no options (got {label})")
    kw: dict[str, Any] = {"tree_size": tree_size}
    given: set[str] = set()
    for opt in options:
        key, _, value = opt.partition("=")
        if ":" in value:
            raise DartspecError(f"bad option {opt!r} in {label}: a method's options are separated by commas")
        if key not in allowed or not value:
            raise DartspecError(f"bad option {opt!r} in {label}: use {', '.join(sorted(allowed))} as key=value")
        if key in given:  # which one would count is a guess (the last did, silently)
            raise DartspecError(f"{label} sets {key} twice")
        given.add(key)
        if key == "tree":
            if value not in TREE_BUILDERS:
                raise DartspecError(f"{label}: tree must be one of {', '.join(TREE_BUILDERS)}")
            kw["tree"] = value
        elif key == "size" and value == "auto":
            kw["tree_size"] = "auto"
        elif key in ("size", "depth", "topk", "draft"):
            if not value.isdigit() or int(value) < 1:
                raise DartspecError(f"{label}: {key} must be a positive integer")
            kw[{"size": "tree_size", "depth": "max_depth"}.get(key, key)] = int(value)
        elif key == "smooth":
            try:
                kw["smooth"] = float(value)
            except ValueError:
                raise DartspecError(f"{label}: smooth must be a number in (0, 1)") from None
            if not 0 < kw["smooth"] < 1:
                raise DartspecError(f"{label}: smooth must be a number in (0, 1)")
        elif key in ("online", "graphs", "sampled"):
            if value not in ("1", "on", "true", "yes", "0", "off", "false", "no"):  # silently off before
                raise DartspecError(f"{label}: {key} must be 1 / on / true / yes or 0 / off / false / no")
            kw[key] = value in ("1", "on", "true", "yes")
        elif key == "runtime" and value not in RUNTIMES:
            raise DartspecError(f"{label}: runtime must be one of {', '.join(RUNTIMES)}")
        elif key == "quant" and value not in QUANT_CHOICES:
            raise DartspecError(f"{label}: quant must be one of {', '.join(QUANT_CHOICES)}")
        elif key == "kv" and value not in KV_CACHES:
            raise DartspecError(f"{label}: kv must be one of {', '.join(KV_CACHES)}")
        elif key == "gguf":
            if value.lower() not in LLAMACPP_TYPES:
                raise DartspecError(f"{label}: gguf must be one of {', '.join(LLAMACPP_TYPES)}")
            kw["gguf"] = value.lower()
        else:
            kw[key] = value
    return MethodSpec(label=label, kind=name, **kw)


# --- prompts -------------------------------------------------------------------------------------


def load_prompts(dataset: str, *, turn: int = 1, limit: int | None = None) -> list[tuple[str, str]]:
    """``(label, user message)`` pairs from ``mtbench``, ``humaneval`` or a JSONL file."""
    from dartspec.data.sources import load_humaneval, load_mtbench, load_prompts_jsonl

    if turn != 1:
        raise DartspecError("only --turn 1 is supported for now")
    if dataset == "mtbench":
        items = [(f"mtbench/{q['question_id']}", q["turns"][0]) for q in load_mtbench()]
    elif dataset == "humaneval":
        items = [(q["task_id"].lower(), "Complete this Python function:\n\n" + q["prompt"]) for q in load_humaneval()]
    elif dataset.endswith(".jsonl") or Path(dataset).is_file():
        records = load_prompts_jsonl(dataset)
        items = [
            (str(r.get("id", f"{Path(dataset).stem}/{i}")), r["prompt"] if "prompt" in r else r["turns"][0])
            for i, r in enumerate(records)
        ]
    else:
        raise DartspecError(f"unknown --dataset {dataset!r}: use mtbench, humaneval or a .jsonl file")
    return items[:limit] if limit else items


def encode_prompts(target: Any, prompts: Sequence[tuple[str, str]]) -> list[tuple[str, list[int]]]:
    """``(label, token ids)``: one user turn in the chat template (base models get the raw text)."""
    chat = bool(getattr(target.tokenizer, "chat_template", None))
    return [
        (label, target.encode_chat([{"role": "user", "content": text}]) if chat else target.encode(text))
        for label, text in prompts
    ]


# --- running -------------------------------------------------------------------------------------


@dataclass
class Run:
    """One generation of one method on one prompt."""

    prompt: str
    method: str
    new_tokens: int
    seconds: float
    tau: float
    accept_per_depth: list[float]
    times: dict[str, float]
    token_ids: list[int] = field(repr=False)
    matches_ar: bool | None = None
    first_difference: int | None = None
    #: False for peers that run other numerics (quantized kernels): a difference from ``ar`` is then
    #: reported as "differs", not as a mismatch, since they never promised ``ar``'s tokens.
    exact: bool = True
    runtime: str = ""  # the runtime and weight format it ran on (dartspec.targets.describe), "" for peers


Runner = Callable[[list[int], int, float, int], Run]


def make_runner(spec: MethodSpec, target: Any, settings: Mapping[str, Any] | None = None) -> Runner:
    """A function ``(prompt ids, max new tokens, temperature, seed) -> Run`` for ``spec``; ``settings``: keyword
    arguments of :meth:`dartspec.engine.Generator.start` of :data:`PLAIN_SETTINGS` (``repetition_penalty``,
    ``response_format``, ...) every run takes (a peer that cannot apply them as dartspec does is refused)."""
    settings = changed_settings(settings or {})
    if spec.kind in ("hf-ar", "hf-pld"):
        return _hf_runner(spec, target, settings)
    if spec.kind in ("llamacpp-ar", "llamacpp-pld"):
        if settings:  # its repeat_penalty reads the last 64 tokens only, its presence / frequency the prompt too
            raise DartspecError(
                f"{spec.kind} cannot apply dartspec's penalties, JSON format or EOS settings as defined: leave them out"
            )
        return _llamacpp_runner(target, spec)
    from dartspec.methods import build_generator

    gen = build_generator(target, spec.generator_spec())

    from dartspec.targets import describe

    runtime = describe(target)

    def run(ids: list[int], max_new_tokens: int, temperature: float, seed: int) -> Run:
        res = gen.generate(ids, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, **settings)
        s = res.stats
        return Run(
            "",
            spec.label,
            len(res.token_ids),
            s.seconds,
            s.tau,
            s.accept_per_depth,
            dict(s.times),
            res.token_ids,
            runtime=runtime,
        )

    return run


#: The decoding settings every row may take (keyword arguments of ``Generator.start``) at values that change nothing.
PLAIN_SETTINGS: dict[str, Any] = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "logit_bias": {},
    "response_format": "text",
    "min_tokens": 0,
    "ignore_eos": False,
    "stop_token_ids": [],
    "bad_words": [],
}


def changed_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The ``settings`` whose values differ from :data:`PLAIN_SETTINGS` (unknown names are an error)."""
    return {k: v for k, v in settings.items() if v != PLAIN_SETTINGS[k]}


def _hf_runner(spec: MethodSpec, target: Any, settings: Mapping[str, Any]) -> Runner:
    """transformers' ``generate``: its ``repetition_penalty`` and ``sequence_bias`` are dartspec's repetition penalty
    and logit bias; it has no presence or frequency penalty."""
    import torch

    if "presence_penalty" in settings or "frequency_penalty" in settings:
        raise DartspecError(f"{spec.kind} has no presence or frequency penalty (transformers' generate lacks them)")
    if "response_format" in settings:
        raise DartspecError(f"{spec.kind} cannot constrain its answer to JSON: leave --response-format out")
    if settings.get("ignore_eos"):
        raise DartspecError(f"{spec.kind} cannot ignore EOS here: leave --ignore-eos out")
    if "bad_words" in settings:  # its bad_words_ids also match across the prompt's end: another definition
        raise DartspecError(f"{spec.kind} bans bad words otherwise than vLLM and dartspec: leave --bad-word out")
    extra: dict[str, Any] = {}
    if "min_tokens" in settings:
        extra["min_new_tokens"] = settings["min_tokens"]
    if "repetition_penalty" in settings:
        extra["repetition_penalty"] = settings["repetition_penalty"]
    if "logit_bias" in settings:
        extra["sequence_bias"] = {(int(t),): float(b) for t, b in settings["logit_bias"].items()}
    ends = target.eos_token_ids | frozenset(settings.get("stop_token_ids", ()))  # both end an answer, kept

    def run(ids: list[int], max_new_tokens: int, temperature: float, seed: int) -> Run:
        kw: dict[str, Any] = {"do_sample": False}
        if temperature > 0:
            torch.manual_seed(seed)
            kw = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        if spec.kind == "hf-pld":
            kw["prompt_lookup_num_tokens"] = 10
        kw.update(extra)
        x = torch.tensor([ids], device=target.device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = target.model.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=max_new_tokens,
                eos_token_id=sorted(ends),
                pad_token_id=min(target.eos_token_ids),
                **kw,
            )
        seconds = time.perf_counter() - start
        new = out[0, len(ids) :].tolist()
        for i, tok in enumerate(new):
            if tok in ends:
                new = new[: i + 1]
                break
        return Run("", spec.label, len(new), seconds, float("nan"), [], {}, new)

    return run


def _llamacpp_runner(target: Any, spec: MethodSpec) -> Runner:
    """llama.cpp (llama-cpp-python) decoding the model's GGUF file (or a requantized copy) with its kernels: plainly
    (``llamacpp-ar``) or with llama-cpp-python's prompt lookup (``llamacpp-pld``: a draft of up to ``spec.draft``
    tokens copied from the context after the last match of its final 1-2 tokens, verified in one batch)."""
    try:
        import llama_cpp
    except ImportError:
        raise DartspecError(
            f"{spec.kind} needs llama-cpp-python, which PyPI ships as source only: "
            "pip install 'dartspec[llamacpp]' (compiles llama.cpp, about 15 minutes on 2 cores)"
        ) from None
    import torch

    from dartspec.models import gguf_file

    path = gguf_file(target.name)
    if spec.gguf:
        path = _llamacpp_requantized(llama_cpp, path, spec.gguf)
    drafts = None
    if spec.kind == "llamacpp-pld":
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        drafts = _CountedDrafts(LlamaPromptLookupDecoding(num_pred_tokens=spec.draft or 10))
    with _default_model_params(llama_cpp, use_extra_bufts=_llamacpp_extra_buffers(path)):
        llm = llama_cpp.Llama(
            model_path=str(path),
            n_ctx=target.max_context,
            n_threads=torch.get_num_threads(),
            draft_model=drafts,
            verbose=False,
        )

    def run(ids: list[int], max_new_tokens: int, temperature: float, seed: int) -> Run:
        llm.reset()  # no prefix reuse from the previous prompt: every method pays its own prefill
        llm.set_seed(seed)
        new: list[int] = []
        if drafts is not None:
            drafts.calls = 0
        start = time.perf_counter()
        for tok in llm.generate(ids, temp=temperature, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
            new.append(int(tok))
            if tok in target.eos_token_ids or len(new) >= max_new_tokens:
                break
        seconds = time.perf_counter() - start
        tau = len(new) / (drafts.calls + 1) if drafts is not None else float("nan")
        return Run("", spec.label, len(new), seconds, tau, [], {}, new, exact=False)

    return run


#: Loads ``sys.argv[1]`` with llama.cpp's defaults and decodes three tokens (:func:`_llamacpp_extra_buffers`).
_LLAMACPP_PROBE = """
import sys
import llama_cpp
llama_cpp.Llama(model_path=sys.argv[1], n_ctx=32, n_threads=1, verbose=False).eval([1, 2, 3])
"""


@functools.cache
def _llamacpp_extra_buffers(path: Path) -> bool:
    """Whether llama.cpp decodes ``path`` with its default extra weight buffers (AMX tiles, repacked weights). On an
    Intel Xeon with AMX-INT8 (2026-12-06) llama-cpp-python 0.3.36's AMX backend segfaulted at the first decode of
    SmolLM2's Q4_1 file, which took the whole benchmark (and ``dartspec demo``) down with it; a child process finds
    out first (once a file: its rows share the answer). A probe that fails otherwise (an exception) says yes: the
    real load then reports its own error."""
    if _survives(_LLAMACPP_PROBE, str(path)):
        return True
    print(
        "llama.cpp crashed decoding with its extra weight buffers (AMX, repacked weights) on this CPU: "
        f"its rows load {path.name} without them",
        file=sys.stderr,
    )
    return False


def _survives(code: str, *args: str) -> bool:
    """Whether ``python -c code args`` ends without being killed by a signal (a segfault, an abort)."""
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, timeout=600)
    return done.returncode >= 0


@contextlib.contextmanager
def _default_model_params(llama_cpp: Any, **fields: Any) -> Iterator[None]:
    """llama-cpp-python's ``Llama`` with ``fields`` set in the model parameters it starts from (it takes no argument
    for ``use_extra_bufts``), for the constructions inside the block."""
    module = llama_cpp.llama_cpp
    default = module.llama_model_default_params

    def params() -> Any:
        made = default()
        for name, value in fields.items():
            setattr(made, name, value)
        return made

    module.llama_model_default_params = params
    try:
        yield
    finally:
        module.llama_model_default_params = default


class _CountedDrafts:
    """A llama-cpp-python draft model that counts its calls: llama-cpp-python drafts once after each forward but the
    last, so a generation's forwards are its calls plus one (the prefill counts as one, as in dartspec's tau)."""

    def __init__(self, lookup: Callable[..., Any]) -> None:
        self.lookup, self.calls = lookup, 0

    def __call__(self, input_ids: Any, /, **kwargs: Any) -> Any:
        self.calls += 1
        return self.lookup(input_ids, **kwargs)


def _llamacpp_requantized(llama_cpp: Any, source: Path, kind: str) -> Path:
    """``source`` converted by llama.cpp's own quantizer to ``kind`` (f16, q8_0, ...), made once next to it."""
    import ctypes

    dest = source.with_name(f"{source.stem}.{kind.upper()}.gguf")
    if source.name.lower().endswith(f".{kind}.gguf"):
        return source
    if dest.is_file():
        return dest
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind.upper()}")
    params.allow_requantize = True
    with atomic.atomic_path(dest) as tmp:
        if llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
            raise DartspecError(f"llama.cpp could not requantize {source.name} to {kind}")
    return dest


def _target_for(spec: MethodSpec, target: Any, others: dict[tuple[str, str, bool, str], Any]) -> Any:
    """The main target, or (made once, sharing its loaded model) the runtime / format the row asks for."""
    if not spec.own_target:
        return target
    from dartspec.targets import wrap_model

    main_graphs = getattr(target, "step_graphs", None) is not None
    graphs = main_graphs if spec.graphs is None else spec.graphs
    main_kv = getattr(target, "kv_cache", "fp32")
    kv = spec.kv or main_kv
    if spec.runtime is None and spec.quant is None and graphs == main_graphs and kv == main_kv:
        return target  # graphs=... or kv=... the main target already has
    key = (spec.runtime or "auto", spec.quant or "auto", graphs, kv if spec.kv else "auto")
    if key not in others:
        others[key] = wrap_model(
            target.model,
            target.tokenizer,
            runtime=key[0],
            quant=key[1],
            name=target.name,
            cuda_graphs=graphs,
            kv_cache=key[3],
        )
    return others[key]


def run_suite(
    target: Any,
    specs: Sequence[MethodSpec],
    prompts: Sequence[tuple[str, str]],
    *,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    seed: int = 0,
    runners: dict[str, Runner] | None = None,
    progress: Callable[[Iterable[Any], int], Iterable[Any]] | None = None,
    settings: Mapping[str, Any] | None = None,
) -> list[Run]:
    """Run every method on every prompt (rotating order); plain decoding is added as the reference. ``settings``:
    every row decodes with them (:func:`make_runner`).

    Every runtime that drafted rows run on (rows may name ``runtime=`` / ``quant=``) gets a plain-decoding row
    of its own, their reference for losslessness.
    """
    from dartspec.targets import describe

    if not prompts:
        raise DartspecError("no prompts to benchmark")
    specs = list(specs)
    if not any(s.kind == "ar" and not s.own_target for s in specs):
        specs.insert(0, MethodSpec("ar", "ar"))
    runners = dict(runners or {})
    others: dict[tuple[str, str, bool, str], Any] = {}
    targets = {s.label: _target_for(s, target, others) for s in specs}
    plain = {describe(targets[s.label]) for s in specs if s.kind == "ar"}
    for s in list(specs):
        own = describe(targets[s.label])
        if s.kind in _ENGINE_METHODS and own not in plain:
            quant = getattr(targets[s.label], "quant", "none")
            runtime = own.partition("/")[0]
            graphs = getattr(targets[s.label], "step_graphs", None) is not None
            kv = getattr(targets[s.label], "kv_cache", None)  # named where it is not the main target's
            kv = None if kv == getattr(target, "kv_cache", None) else kv
            label = f"ar:runtime={runtime},quant={quant}" + (",graphs=1" if graphs else "")
            label += f",kv={kv}" if kv else ""
            ref = MethodSpec(label, "ar", runtime=runtime, quant=quant, graphs=graphs, kv=kv)
            specs.insert(1, ref)
            targets[ref.label] = targets[s.label]
            plain.add(own)
    for s in specs:
        if s.label not in runners:  # not setdefault: building a runner loads a drafter or a peer
            runners[s.label] = make_runner(s, targets[s.label], settings)
    encoded = encode_prompts(target, prompts)
    for s in specs:  # warm-up: first-call allocations and lazy initialisation stay out of the timings
        runners[s.label](encoded[0][1], 8, temperature, seed)
    runs: list[Run] = []
    items = progress(list(enumerate(encoded)), len(encoded)) if progress else enumerate(encoded)
    for i, (label, ids) in items:
        order = specs[i % len(specs) :] + specs[: i % len(specs)]
        got = {}
        for s in order:
            run = runners[s.label](ids, max_new_tokens, temperature, seed + i)
            run.prompt, run.method = label, s.label
            got[s.label] = run
        main = next(got[s.label] for s in specs if s.kind == "ar" and not s.own_target)
        # Lossless means identical to plain decoding on the same runtime and weight format: each row is held to
        # the ar row of its runtime when there is one, else compared with the main one as "other numerics".
        same = {got[s.label].runtime: got[s.label] for s in specs if s.kind == "ar"}
        for s in specs:
            run = got[s.label]
            ref = same.get(run.runtime, main)
            if run.runtime and run.runtime not in same:
                run.exact = False
            if temperature == 0:
                run.matches_ar = run.token_ids == ref.token_ids
                if not run.matches_ar:
                    run.first_difference = next(
                        (j for j, (a, b) in enumerate(zip(run.token_ids, ref.token_ids, strict=False)) if a != b),
                        min(len(run.token_ids), len(ref.token_ids)),
                    )
            runs.append(run)
    return runs
