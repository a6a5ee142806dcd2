"""The ``dartspec`` command line.

Every user-caused problem surfaces as a :class:`~dartspec.errors.DartspecError`: printed as one line
on stderr with exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dartspec.errors import DartspecError
from dartspec.formats import DATA_SOURCES, KV_CACHE_CHOICES, QUANT_CHOICES, RUNTIMES, TREE_BUILDERS

DEFAULT_MODEL = "smollm2-135m"


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _int_at_least(minimum: int, what: str) -> Callable[[str], int]:
    """An argparse type for whole numbers >= ``minimum`` (``what`` names them in the error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


_positive_int = _int_at_least(1, "a positive integer")
_count = _int_at_least(0, "a whole number >= 0")


def _port(text: str) -> int:
    value = _int_at_least(1, "a port number (1-65535)")(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a port number (1-65535), got {text!r}")
    return value


def _tree_size(text: str) -> int | str:
    """``--tree-size``: a positive integer or ``auto``."""
    if text == "auto":
        return text
    try:
        return _positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or auto, got {text!r}") from None


def _str_list(text: str) -> list[str]:
    """A comma-separated list (empty items dropped)."""
    return [s.strip() for s in text.split(",") if s.strip()]


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _drafter_kinds(text: str) -> list[str]:
    """``bench accuracy --drafter``: comma-separated dart / eagle3 / dflash."""
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    bad = [k for k in kinds if k not in ("dart", "eagle3", "dflash")]
    if not kinds or bad:
        raise argparse.ArgumentTypeError(f"expected dart, eagle3, dflash or a comma-separated list, got {text!r}")
    return list(dict.fromkeys(kinds))


def _train_setting(text: str) -> str:
    """``--settings`` item: comma-separated ``pack=N`` / ``precision=...`` / ``cache=...`` / ``target=...`` (the
    bench's own parser)."""
    from dartspec.bench.train_speed import parse_setting

    try:
        parse_setting(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def _float_where(ok: Callable[[float], bool], what: str) -> Callable[[str], float]:
    """An argparse type for numbers that pass ``ok`` (``what`` names them in the error; NaN never passes)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


_fraction = _float_where(lambda v: 0 < v < 1, "a fraction between 0 and 1")
_positive_minutes = _float_where(lambda v: v > 0, "a positive number of minutes")


def _folder_out(text: str) -> str:
    """An output folder: refused at once where a file of that name exists (mkdir failed after the whole run)."""
    if Path(text).exists() and not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text} exists and is not a folder")
    return text


def _file_out(text: str) -> str:
    """An output file: refused at once where a folder of that name exists or its folder does not (the write failed
    after the whole run)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; name a file")
    if not path.absolute().parent.is_dir():
        raise argparse.ArgumentTypeError(f"the folder of {text} does not exist")
    return text


def add_target_args(p: argparse.ArgumentParser, runtime: str = "auto", gpu_dtype: str = "float32") -> None:
    """Options shared by every command that loads a target model (``train promote`` defaults to the transformers
    runtime: the promotion's judge is the fp32 model). ``--dtype auto`` is float32 on a CPU and ``gpu_dtype`` on a
    GPU: float32 where outputs must equal plain decoding bit for bit (generate, serve, bench: in bfloat16 a tree's
    one forward rounds differently from one token at a time, and on an H200 6 of 8 MT-Bench answers left plain
    bf16 decoding at such a near-tie, while float32 decoded the 135M model no slower), bfloat16 for the throughput
    of data generation and training."""
    p.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"known name, local folder or .gguf (default {DEFAULT_MODEL})"
    )
    p.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:1, ...")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help=f"auto: float32 on a CPU, {gpu_dtype} on a GPU",
    )
    p.set_defaults(gpu_dtype=gpu_dtype)
    p.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        help="torch CPU threads (default: torch's; serve and bench serve: all cores but one)",
    )
    p.add_argument(
        "--runtime",
        default=runtime,
        choices=RUNTIMES,
        help="lean: dartspec's fast forward (Llama/Qwen2/Qwen3/Gemma 3); hf: transformers' modules (any model); "
        "auto: lean where supported (any device)",
    )
    p.add_argument(
        "--quant",
        default="auto",
        choices=QUANT_CHOICES,
        help="weight format of the lean runtime on CPU: exact-a16 (auto: the GGUF's integer weights, activations "
        "rounded to 16-bit integers, answers kept), exact (the same weights, fp32 arithmetic), fp16 (auto for weights "
        "that are no such groups: models not from a GGUF, block types such as Q2_K / Q3_K), int8 (changes answers: "
        "see README), none (as loaded)",
    )
    p.add_argument(
        "--kv-cache",
        default="auto",
        choices=KV_CACHE_CHOICES,
        help="the lean runtime's KV cache on a CPU: fp16 (each key and value rounded to fp16, half the bytes a step "
        "reads: faster on long contexts), fp32, auto (default: fp16 for the models whose answers the fidelity gate "
        "found unchanged by it, SmolLM2-135M, Qwen2.5-Coder-0.5B and Gemma 3 270M; fp32 otherwise)",
    )
    p.add_argument(
        "--cuda-graphs",
        default="auto",
        choices=["auto", "on", "off"],
        help="run the lean runtime's decode and verify steps as CUDA graphs (one launch a step instead of hundreds): "
        "auto (default) on a GPU, where plain decoding measured 2.8-3.8x as fast with them; on; off",
    )


def add_drafter_args(p: argparse.ArgumentParser, default: str = "auto") -> None:
    """Options choosing and sizing the drafter (generate, serve)."""
    p.add_argument(
        "--drafter",
        default=default,
        help="auto (default: on a CPU dart+pld where a DART drafter ships for the model, else pld, the fastest "
        "measured there, and plain decoding for requests sampled above temperature 0.5; on a GPU none: plain decoding "
        "on CUDA graphs measured fastest on chat, pass dart+pld for code), none (plain decoding), pld (prompt "
        "lookup), dart, dart+pld (both in one tree), eagle3 (baseline), dflash, draft-model (a smaller model with "
        "the target's tokenizer, named by --drafter-path) or draft-model+pld",
    )
    p.add_argument(
        "--topk", type=_positive_int, default=4, help="eagle3: nodes expanded per tree level, children per node"
    )
    p.add_argument(
        "--drafter-path",
        default=None,
        help="drafter checkpoint folder (default: the shipped one); for draft-model the draft model, named as --model "
        "names a target",
    )
    p.add_argument("--tree", default="beam", choices=TREE_BUILDERS, help="tree builder for dart")
    p.add_argument(
        "--ngram", default=None, help="static n-gram file for the beam search (default: the shipped one; off = none)"
    )
    p.add_argument("--online-ngram", action="store_true", help="also score drafts with prompt + output n-grams")
    p.add_argument(
        "--ngram-smoothing",
        type=float,
        default=0.0,
        help="0 (default): DART's longest-context rule; 0<s<1: interpolated n-gram with weight s on shorter contexts",
    )
    p.add_argument(
        "--tree-size",
        type=_tree_size,
        default=None,
        help="max draft tree nodes, root included (default on a CPU: 4, 2 for dart and eagle3; on a GPU: 16, 32 for "
        "dart, dart+pld and eagle3), or auto (dart, eagle3; pld by its gate: sized per step by measured verify costs)",
    )
    p.add_argument(
        "--draft-nodes",
        type=_positive_int,
        default=None,
        help="dart+pld: at most this many of the tree's nodes (root included) go to DART's tree, the rest to prompt "
        "lookup's spans (default with the default tree size: 3 on a CPU, where past 512 tokens of context the spans "
        "go on alone; no cap on a GPU)",
    )
    p.add_argument("--max-depth", type=int, default=8, help="max draft depth below the root")
    p.add_argument(
        "--sampled-drafts",
        action="store_true",
        help="sampled requests (temperature > 0): the drafters dart, dart+pld and dflash draw a token from their "
        "first row, draft-model and draft-model+pld each chain token from the draft model, which the verifier tests "
        "by rejection: more drafts kept (DART: tau +10-15%% on chat at temperature 1, 0-6%% elsewhere), the same "
        "distribution, but a seed no longer gives plain sampling's tokens; off by default: on a CPU it did not lift "
        "DART's sampled decoding above plain decoding",
    )


def make_generator(args: argparse.Namespace, target):  # -> Generator
    """The generator that :func:`add_drafter_args`' options describe (``--tree-size auto`` included)."""
    from dartspec.methods import GeneratorSpec, build_generator

    spec = GeneratorSpec(
        drafter=args.drafter,
        path=args.drafter_path,
        tree_size=args.tree_size,
        draft_nodes=args.draft_nodes,
        max_depth=args.max_depth,
        tree=args.tree,
        ngram=args.ngram,
        online_ngram=args.online_ngram,
        ngram_smoothing=args.ngram_smoothing,
        topk=args.topk,
        sampled_drafts=args.sampled_drafts,
    )
    return build_generator(target, spec)


def dtype_for(args: argparse.Namespace, device_type: str) -> str:
    """The dtype a command loads its target in: ``--dtype``, or for ``auto`` float32 on a CPU (no fast bf16 math
    for batched verification there) and the command's own choice on a GPU (:func:`add_target_args`)."""
    if args.dtype != "auto":
        return args.dtype
    return "float32" if device_type == "cpu" else getattr(args, "gpu_dtype", "float32")


def load_target(args: argparse.Namespace):  # -> TargetRuntime (imported lazily: torch import is slow)
    from dartspec.models import check_model_argument

    check_model_argument(args.model)  # a mistyped model name is an error before torch's import
    import torch

    from dartspec.targets import describe
    from dartspec.targets import load_target as load

    if args.threads:
        # More threads than cores only makes every parallel region wait for preempted threads (and a first `auto`
        # would measure the machine that way: minutes)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        if args.threads > cores:
            raise DartspecError(f"--threads {args.threads} is more than the {cores} CPU cores this process may use")
        torch.set_num_threads(args.threads)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda") or (dev.type == "cpu" and dev.index not in (None, 0)):
        raise DartspecError(f"invalid --device {device!r}: use cpu, cuda or cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DartspecError("--device cuda was requested but no CUDA GPU is available")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise DartspecError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    target = load(
        args.model,
        runtime=getattr(args, "runtime", "auto"),
        quant=getattr(args, "quant", "auto"),
        device=dev,
        dtype=getattr(torch, dtype_for(args, dev.type)),
        log=_log,
        cuda_graphs={"on": True, "off": False}.get(getattr(args, "cuda_graphs", "auto")),
        kv_cache=getattr(args, "kv_cache", "auto"),
    )
    streamed = getattr(target, "weight_bytes", None)
    per_token = f", {streamed / 1e6:.0f} MB of weights per token" if streamed else ""
    _log(f"{target.name}: {describe(target)} runtime on {dev}{per_token}")
    return target


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=_positive_int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this times the top one's probability")
    p.add_argument("--seed", type=int, default=None)
    add_decoding_args(p)


def add_decoding_args(p: argparse.ArgumentParser) -> None:
    """The answer's format, its ending and the penalties (``generate``, ``chat`` and every ``bench`` row)."""
    p.add_argument("--min-tokens", type=int, default=0, help="no EOS before this many tokens (vLLM's min_tokens)")
    p.add_argument("--ignore-eos", action="store_true", help="EOS does not end the answer (load tests)")
    p.add_argument(
        "--stop-token-id",
        dest="stop_token_ids",
        type=int,
        action="append",
        default=[],
        metavar="ID",
        help="a token that ends the answer as EOS does, kept in its token ids, not its text (repeatable; vLLM's "
        "stop_token_ids)",
    )
    p.add_argument(
        "--response-format",
        choices=["text", "json_object"],
        default="text",
        help="json_object: the answer is a JSON object (constrained decoding; lossless under speculation)",
    )
    p.add_argument(
        "--json-schema",
        default=None,
        metavar="FILE|JSON",
        help="the answer is a JSON document this JSON Schema admits (a file, or the schema inline); see the README "
        "for the keywords supported",
    )
    p.add_argument(
        "--regex",
        default=None,
        metavar="PATTERN",
        help="the answer is plain text this regular expression (ECMA-262) matches whole (vLLM's guided_regex)",
    )
    p.add_argument(
        "--choice",
        action="append",
        default=None,
        metavar="TEXT",
        help="the answer is exactly one of these texts (repeatable; vLLM's guided_choice)",
    )
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="divide the positive logits of tokens in the prompt or answer so far by this, multiply the negative "
        "ones (transformers' repetition_penalty; 1 = off)",
    )
    p.add_argument(
        "--presence-penalty",
        type=float,
        default=0.0,
        help="subtract this from the logits of tokens the answer holds (OpenAI's; -2 to 2, 0 = off)",
    )
    p.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        help="subtract this times the token's count in the answer (OpenAI's; -2 to 2, 0 = off)",
    )
    p.add_argument(
        "--logit-bias",
        action="append",
        default=[],
        metavar="ID=BIAS",
        help="add BIAS (-100 to 100) to token ID's logit (repeatable; -100 bans the token in effect)",
    )
    p.add_argument(
        "--bad-word",
        dest="bad_words",
        action="append",
        default=[],
        metavar="WORD",
        help="a word the answer never contains (repeatable; vLLM's bad_words: its last token is impossible where the "
        "answer ends with the rest of it)",
    )


def _decoding_args(args: argparse.Namespace) -> dict[str, Any]:
    """The options of :func:`add_decoding_args` as :meth:`~dartspec.engine.Generator.start` takes them, checked (no
    torch needed)."""
    from dartspec.sampling import Penalties

    bias: list[tuple[int, float]] = []
    for item in args.logit_bias:
        token, _, value = item.partition("=")
        try:
            bias.append((int(token), float(value)))
        except ValueError:  # no '=' leaves the value empty
            raise DartspecError(f"--logit-bias takes ID=BIAS (e.g. 42=-100), got {item!r}") from None
    Penalties(args.repetition_penalty, args.presence_penalty, args.frequency_penalty, bias)
    if any(not word.strip() for word in args.bad_words):
        raise DartspecError(f"--bad-word takes a non-empty word, got {args.bad_words!r}")
    if args.min_tokens < 0:
        raise DartspecError(f"--min-tokens must be >= 0, got {args.min_tokens}")
    return {
        "response_format": _response_format(args),
        "min_tokens": args.min_tokens,
        "ignore_eos": args.ignore_eos,
        "stop_token_ids": args.stop_token_ids,
        "repetition_penalty": args.repetition_penalty,
        "presence_penalty": args.presence_penalty,
        "frequency_penalty": args.frequency_penalty,
        "logit_bias": dict(bias),
        "bad_words": args.bad_words,
    }


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _response_format(args: argparse.Namespace) -> Any:
    """``--response-format``, the schema of ``--json-schema`` or the grammar of ``--regex`` / ``--choice`` (read and
    checked: an unsupported keyword or pattern is an error here, before the model loads)."""
    given = [
        name
        for name, value in (
            ("--response-format json_object", args.response_format != "text"),
            ("--json-schema", args.json_schema is not None),
            ("--regex", args.regex is not None),
            ("--choice", args.choice is not None),
        )
        if value
    ]
    if len(given) > 1:
        raise DartspecError(f"{given[0]} and {given[1]} exclude each other")
    if args.regex is not None or args.choice is not None:
        from dartspec.json_grammar import Grammar

        return Grammar.regex(args.regex) if args.regex is not None else Grammar.choice(args.choice)
    if args.json_schema is None:
        return args.response_format
    from dartspec.json_schema import compile_schema

    source = args.json_schema
    # Inline JSON or a file: '{...}' is inline even if malformed (its error is "not JSON"), so is any other JSON
    # document that names no file ('[1, 2]' is a schema for compile_schema to refuse, not a missing file)
    if not source.lstrip().startswith(("{", "true")) and (Path(source).exists() or not _parses(source)):
        try:
            source = Path(source).read_text()
        except OSError as err:
            raise DartspecError(f"--json-schema: cannot read {args.json_schema}: {err.strerror}") from None
    try:
        schema = json.loads(source)
    except ValueError as err:
        raise DartspecError(f"--json-schema: not JSON ({err})") from None
    compile_schema(schema)
    return schema if isinstance(schema, dict) else {}


def _check_generation_args(args: argparse.Namespace) -> None:
    """Reject bad sampling values, an unknown drafter or model before the (slow) model load (``generate``, ``chat``)
    and without importing torch: a mistyped option is an error in a fraction of a second, not after seconds of
    imports."""
    from dartspec.formats import check_drafter_name
    from dartspec.models import check_model_argument
    from dartspec.sampling import SamplingParams, check_logprobs

    SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed, min_p=args.min_p)
    _decoding_args(args)
    check_logprobs(getattr(args, "logprobs", None))
    check_logprobs(getattr(args, "prompt_logprobs", None), "prompt_logprobs")
    for stop in args.stop or []:
        if not stop:  # it would stop nothing (the engine skips it), which is not what was meant
            raise DartspecError("--stop takes a non-empty string")
        _utf8(stop, "--stop")
    check_drafter_name(args.drafter)
    check_model_argument(args.model)


def _check_temperature(value: float) -> None:
    """``bench`` and ``data regenerate``'s temperature (``generate``'s is SamplingParams'): NaN too is refused, which
    reached the sampler as a traceback."""
    if not 0 <= value < float("inf"):
        raise DartspecError("--temperature must be a finite number >= 0")


def _utf8(text: str, what: str) -> str:
    """``text`` if it is valid Unicode: bytes that are not UTF-8 reach Python's argv and stdin as lone surrogates,
    which the tokenizer rejects with a TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise DartspecError(f"{what} is not valid UTF-8 text") from None
    return text


def _read_prompt(args: argparse.Namespace) -> Any:
    """The prompt ``generate`` decodes: ``--prompt`` text (``-``: standard input) or ``--prompt-file``; with
    ``--system``, the system and user messages (``--chat`` only). Read before the model loads, so a missing file or
    bad input costs no load."""
    if args.prompt_file is not None:
        try:
            text = Path(args.prompt_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise DartspecError(f"cannot read --prompt-file {args.prompt_file}: {err}") from None
    elif args.prompt == "-":
        try:
            text = sys.stdin.read()
        except UnicodeDecodeError as err:
            raise DartspecError(f"standard input is not UTF-8 text ({err})") from None
    else:
        text = args.prompt
    text = _utf8(text, "standard input" if args.prompt == "-" and args.prompt_file is None else "the prompt")
    if args.system is None:
        return text
    if not args.chat:
        raise DartspecError("--system needs --chat (a system message is part of the chat template)")
    system = _utf8(args.system, "--system")
    return [{"role": "system", "content": system}, {"role": "user", "content": text}]


def cmd_generate(args: argparse.Namespace) -> int:
    _check_generation_args(args)
    for flag, value in (("--logprobs", args.logprobs), ("--prompt-logprobs", args.prompt_logprobs)):
        if value is not None and not args.json:
            raise DartspecError(f"{flag} needs --json (they are listed in its output)")
    prompt = _read_prompt(args)
    target = load_target(args)
    gen = make_generator(args, target)
    kwargs = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        stop=args.stop or (),
        chat=args.chat,
        logprobs=args.logprobs,
        prompt_logprobs=args.prompt_logprobs,
        **_decoding_args(args),
    )
    if args.json:
        result = gen.generate(prompt, **kwargs)
        print(json.dumps(result.as_dict(), ensure_ascii=False))
    else:
        result = None
        for event in gen.stream(prompt, **kwargs):
            sys.stdout.write(event.text)
            sys.stdout.flush()
            result = event.result or result
        assert result is not None
        sys.stdout.write("\n")
        _log(_stats_line(result))
    if not args.chat and not result.text.strip() and result.finish_reason == "stop" and target.has_chat_template:
        # An instruct model given a bare prompt often ends it at once: an empty answer, not an error, but puzzling
        _log(f"note: the answer is empty; {target.name} is a chat model: --chat wraps the prompt in its chat template")
    return 0


def _stats_line(result: Any) -> str:
    """A generation's figures, as ``generate`` and ``chat`` print them after the text."""
    s = result.stats
    hot = s.extra.get("plain_above_temperature")
    why_plain = f" (sampled above temperature {hot}: drafts do not pay here)" if hot is not None else ""
    return (
        f"[{s.new_tokens} tokens, {s.tokens_per_s:.1f} tok/s, tau {s.tau:.2f}, drafter {s.drafter}{why_plain}, "
        f"{s.target_forwards} target forwards, finish: {result.finish_reason}]"
    )


def cmd_chat(args: argparse.Namespace) -> int:
    _check_generation_args(args)
    system = None if args.system is None else _utf8(args.system, "--system")
    from dartspec.chat import HELP, run_chat

    target = load_target(args)
    enable_prefix_cache(args, target)
    gen = make_generator(args, target)
    interactive = sys.stdin.isatty()

    def read() -> str | None:
        while True:
            try:
                line = input("> ") if interactive else (sys.stdin.readline() or None)
            except (EOFError, KeyboardInterrupt):  # Ctrl-D or Ctrl-C at the prompt: the conversation ends
                return None
            try:
                return line if line is None else _utf8(line, "that line")
            except DartspecError as err:  # the conversation goes on
                _log(f"error: {err}; type it again")

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    _log(f"chatting with {target.name}: {HELP}")
    run_chat(
        gen,
        read,
        write,
        _log,
        system=system,
        seed=args.seed,
        report=_stats_line if args.stats else None,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        stop=args.stop or (),
        **_decoding_args(args),
    )
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from dartspec.models import known_models

    for spec in known_models():
        print(f"{spec.name:22s} {spec.description}")
    return 0


def cmd_bench_latency(args: argparse.Namespace) -> int:
    from dartspec.bench.latency import run_latency_bench
    from dartspec.errors import require

    if args.plot:  # fail before minutes of measuring, not after
        require("matplotlib", extra="bench", purpose="plotting (--plot)")
    run_latency_bench(args, load_target(args), log=_log)
    return 0


def cmd_bench_load(args: argparse.Namespace) -> int:
    from pathlib import Path

    import httpx

    from dartspec.bench.load import report_json, run_load
    from dartspec.bench.suite import load_prompts

    key = api_key(args)
    url = args.url.rstrip("/")
    try:
        models = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=10)
        models.raise_for_status()
        model = models.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as err:
        found = type(err).__name__
        raise DartspecError(f"no dartspec server answers at {url} ({found}): start one with dartspec serve") from None
    prompts = [text for _, text in load_prompts(args.dataset, limit=args.limit)]
    _log(f"{args.requests} requests from {args.clients} clients and 4 hostile ones against {model} at {url}...")
    report = run_load(
        url,
        prompts,
        model=model,
        clients=args.clients,
        requests=args.requests,
        max_tokens=args.max_new_tokens,
        api_key=key,
        timeout_s=args.timeout,
    )
    print(report.markdown())
    for line in report.failures[:3]:
        _log(f"failed: {line.splitlines()[0]}")
    if args.out:
        folder = Path(args.out)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "load.md").write_text(report.markdown() + "\n")
        (folder / "load.json").write_text(report_json(report))
    healthy = report.mismatches == 0 and not report.failures and all(400 <= c < 500 for c in report.hostile.values())
    return 0 if healthy else 1


def serving_threads(args: argparse.Namespace) -> None:
    """A server computes on all cores but one by default: the event loop, the HTTP work and local clients need a
    core, and when they take one from the model's OpenMP threads each parallel region waits for a preempted thread
    (SmolLM2 on 2 cores, one client: 257 tok/s with 1 thread, 110 with 2; 8 clients: 442 against 391-425)."""
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 2) - 1)


def add_prefix_cache_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prefix-cache-mb",
        type=float,
        default=None,
        help="memory for shared prompt prefixes' KV (chat template, common system prompts; default 256 where the "
        "runtime has it: the lean runtime's exact-a16 kernels on a CPU; 0: off)",
    )


def enable_prefix_cache(args: argparse.Namespace, target: Any) -> None:
    """``--prefix-cache-mb``: on by default where the runtime supports it, an error only where asked for."""
    wanted = args.prefix_cache_mb
    if wanted is not None and wanted < 0:
        raise DartspecError("--prefix-cache-mb must be >= 0")
    if wanted == 0:
        return
    try:
        target.enable_prefix_cache(int((256 if wanted is None else wanted) * (1 << 20)))
    except DartspecError as err:
        if wanted is not None:
            raise
        _log(f"prefix cache off: {err}")


def cmd_bench_serve(args: argparse.Namespace) -> int:
    try:
        import openai  # noqa: F401

        from dartspec.serve.app import create_app
        from dartspec.serve.engine import ServeEngine
    except ImportError as err:
        raise DartspecError(f"bench serve needs {err.name}: pip install 'dartspec[serve]'") from None
    from dartspec.bench.serve import local_server, markdown, run_serve_bench, shared_system_prompt, write_results
    from dartspec.bench.suite import load_prompts
    from dartspec.drafters import NoDrafter
    from dartspec.engine import Generator
    from dartspec.errors import require
    from dartspec.runtime import describe

    if args.plot:
        require("matplotlib", extra="bench", purpose="plotting (--plot)")
    prompts = [text for _, text in load_prompts(args.dataset, limit=args.limit)]
    if args.shared_prefix < 0:
        raise DartspecError("--shared-prefix must be >= 0")
    serving_threads(args)
    target = load_target(args)
    enable_prefix_cache(args, target)
    system = shared_system_prompt(target, args.shared_prefix) if args.shared_prefix else None
    engine = ServeEngine(
        make_generator(args, target),
        Generator(target, NoDrafter()),
        target.name,
        max_queue=max(args.concurrency) + 8,
        max_batch=args.max_batch or max(args.concurrency),
        step_rows=args.step_rows,
    )
    meta = {
        "model": target.name,
        "runtime": describe(target),
        "drafter": engine.drafter_name,
        "max_batch": engine.max_batch,
        "step_rows": engine.step_rows,
        "dataset": args.dataset,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "shared_prefix_tokens": len(target.encode(system)) if system else 0,
        "prefix_cache_mb": round(target.prefix_cache.max_bytes / (1 << 20)) if target.prefix_cache is not None else 0,
    }
    _log(f"{len(prompts)} prompts at concurrency {', '.join(map(str, sorted(set(args.concurrency) | {1})))}...")
    with local_server(create_app(engine)) as url:
        levels = run_serve_bench(
            url,
            prompts,
            model=target.name,
            concurrency=args.concurrency,
            max_tokens=args.max_new_tokens,
            system=system,
        )
    print(markdown(levels, meta))
    for level in levels:
        for line in level.failures[:3]:
            _log(f"failed at {level.concurrency} clients: {line.splitlines()[0]}")
    if args.out:
        write_results(levels, meta, args.out, args.plot)
    return 0 if all(not lv.failures and not lv.mismatches for lv in levels) else 1


def cmd_demo(args: argparse.Namespace) -> int:
    from dartspec.bench.demo import demo_peers, run_demo
    from dartspec.drafters import shipped_checkpoint

    if args.methods is not None and not _str_list(args.methods):  # the default rows ran before
        raise DartspecError("--methods is empty")
    target = load_target(args)
    methods = _str_list(args.methods) if args.methods else ["none", "pld"]
    if not args.methods and shipped_checkpoint("dart", target.name) is not None:
        methods += ["dart", "dart+pld"]
    if not args.methods:
        methods += demo_peers(target)
    print(run_demo(target, methods, args.max_new_tokens, log=_log))
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from dartspec.bench.report import markdown
    from dartspec.formats import check_drafter_name
    from dartspec.targets import describe
    from dartspec.tune import TUNE_PROMPTS, busy_warning, candidates, measure, save_tuned, tuned_file

    if args.drafters is not None and not _str_list(args.drafters):  # the default set ran (minutes) before
        raise DartspecError("--drafters is empty: name the drafters to compare (e.g. --drafters dart+pld,pld)")
    shipped = len(TUNE_PROMPTS.read_text(encoding="utf-8").splitlines())
    if args.prompts > shipped:  # it measured on the 16 without a word before
        raise DartspecError(f"--prompts {args.prompts}: {shipped} tuning prompts ship")
    for name in _str_list(args.drafters) if args.drafters else []:
        if check_drafter_name(name) is None:  # a mistyped name is an error before the model loads
            raise DartspecError("--drafters lists what auto may choose among: name drafters, not auto")
    target = load_target(args)
    drafters = _str_list(args.drafters) if args.drafters else list(candidates(target))
    if drafters == ["none"]:
        raise DartspecError(
            f"on {target.device} --drafter auto is plain decoding and nothing else is measured: name drafters to "
            "compare with --drafters (e.g. --drafters dart+pld,pld)"
        )
    if (busy := busy_warning()) is not None:  # asked for now: measured and kept, but said
        _log(f"warning: {busy}; run `dartspec tune` again when the machine is idle")
    tuned, rows = measure(
        target,
        drafters,
        path=args.drafter_path,
        prompts=args.prompts,
        new_tokens=args.max_new_tokens,
        progress=lambda items, n: tqdm(items, total=n, desc="tune", unit="prompt"),
    )
    title = f"dartspec tune: {target.name} ({describe(target)}), greedy, {args.max_new_tokens} new tokens"
    print(markdown(rows, title))
    file = tuned_file(target, args.drafter_path)
    save_tuned(file, tuned)
    print(f"--drafter auto is now {tuned.summary()} on this machine (saved in {file})")
    return 0 if not any(tuned.mismatches.values()) else 1


def cmd_bench(args: argparse.Namespace) -> int:
    import datetime
    import platform
    from pathlib import Path

    from tqdm import tqdm

    from dartspec.bench.report import summarize, write_results
    from dartspec.bench.suite import changed_settings, load_prompts, parse_methods, run_suite
    from dartspec.targets import describe

    _check_temperature(args.temperature)
    settings = _decoding_args(args)
    # Plots need the optional matplotlib: said now, not as an error after minutes of measuring
    try:
        import matplotlib  # noqa: F401

        plots = True
    except ImportError:
        plots = False
    if not plots:
        _log("matplotlib is not installed: tables without plots (pip install 'dartspec[bench]' for them)")
    specs = parse_methods(args.methods, tree_size=args.tree_size)
    prompts = load_prompts(args.dataset, turn=args.turn, limit=args.limit)
    target = load_target(args)
    runs = run_suite(
        target,
        specs,
        prompts,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
        settings=settings,
        progress=lambda items, n: tqdm(items, total=n, desc="bench", unit="prompt"),
    )
    rows = summarize(runs)
    meta = {
        "model": target.name,
        "dataset": args.dataset,
        "prompts": len(prompts),
        "temperature": args.temperature,
        **changed_settings(settings),
        "max_new_tokens": args.max_new_tokens,
        "methods": [r["method"] for r in rows],
        "device": str(target.device),
        "runtime": describe(target),
        "threads": __import__("torch").get_num_threads(),
        "machine": platform.platform(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    if any(s.kind == "auto" and not s.own_target for s in specs):
        from dartspec.tune import auto_drafter

        meta["auto"] = auto_drafter(target)  # measured on this machine (dartspec.tune), cached by the row's run
        _log(f"auto ran {meta['auto']} here (the choice `dartspec tune` measures for this machine)")
    named = "".join(f"-{k}" for k in changed_settings(settings))  # e.g. -repetition_penalty-response_format
    default_out = Path("bench-results") / f"{args.dataset.replace('/', '_')}-t{args.temperature:g}{named}"
    out = Path(args.out) if args.out else default_out
    print(write_results(runs, rows, meta, out, plots=plots))
    bad = [r["method"] for r in rows if r["mismatches"]]
    if bad:
        _log(f"MISMATCH: {', '.join(bad)} produced output different from plain greedy decoding")
    _log(f"saved {out}/results.md, results.json" + (", speedup.png, acceptance.png" if plots else ""))
    return 1 if bad else 0


def api_key(args: argparse.Namespace) -> str | None:
    """The server's API key: --api-key, else --api-key-file, else $DARTSPEC_API_KEY, else none."""
    from pathlib import Path

    if args.api_key is not None and args.api_key_file:
        raise DartspecError("give --api-key or --api-key-file, not both")
    if args.api_key is not None and not args.api_key.strip():  # it would have served with no key at all
        raise DartspecError("--api-key is empty")
    if args.api_key_file:
        try:
            lines = Path(args.api_key_file).read_text(encoding="utf-8").splitlines()
        except OSError as err:
            raise DartspecError(f"cannot read --api-key-file {args.api_key_file}: {err.strerror}") from None
        key = lines[0].strip() if lines else ""
        if not key:
            raise DartspecError(f"--api-key-file {args.api_key_file} is empty")
        return key
    return args.api_key or os.environ.get("DARTSPEC_API_KEY") or None


def cmd_serve(args: argparse.Namespace) -> int:
    from dartspec.formats import check_drafter_name

    check_drafter_name(args.drafter)
    if args.timeout <= 0:
        raise DartspecError("--timeout must be positive")
    if args.protect_all and not api_key(args):
        raise DartspecError("--protect-all needs an API key (--api-key, --api-key-file or DARTSPEC_API_KEY)")
    # The address is taken before the model loads: a port in use is an error at once, not after the load
    sock = listen_socket(args.host, args.port)
    try:
        import uvicorn

        from dartspec.serve.app import create_app
        from dartspec.serve.engine import ServeEngine
    except ImportError as err:
        raise DartspecError(f"serving needs {err.name}: pip install 'dartspec[serve]'") from None
    from dartspec.drafters import NoDrafter
    from dartspec.engine import Generator

    serving_threads(args)
    target = load_target(args)
    enable_prefix_cache(args, target)
    generator = make_generator(args, target)
    engine = ServeEngine(
        generator,
        Generator(target, NoDrafter()),
        target.name,
        max_queue=args.max_queue,
        timeout_s=args.timeout,
        max_batch=args.max_batch,
        step_rows=args.step_rows,
    )
    app = create_app(
        engine,
        api_key=api_key(args),
        protect_all=args.protect_all,
        default_max_tokens=args.default_max_tokens,
        max_body_bytes=args.max_body_kb * 1024,
        aliases=tuple(args.alias),
        max_stored_responses=args.max_stored_responses,
    )
    where = f"http://[{args.host}]:{args.port}/" if ":" in args.host else f"http://{args.host}:{args.port}/"
    _log(f"serving {target.name} with drafter {generator.drafter.name} on {where} (web demo at /)")
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
    return 0


def listen_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` as uvicorn binds one (IPv6 where the host has a colon, SO_REUSEADDR), or a
    one-line error naming the address and why."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto given: asyncio sets TCP_NODELAY on accepted connections only where their proto says TCP, and they
    # inherit the listener's; with the default 0 every keep-alive request after the first waited ~40 ms (Nagle's
    # algorithm against the client's delayed ACK: 44 ms for GET /health from httpx, the openai client's transport)
    sock = socket.socket(family=family, proto=socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except (OSError, OverflowError) as exc:
        sock.close()
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise DartspecError(f"cannot listen on {host}:{port} ({why}): choose another --host or --port") from None
    return sock


def cmd_bench_accuracy(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from dartspec.bench.accuracy import run_accuracy_bench

    target = load_target(args)
    run_accuracy_bench(
        args, target, log=_log, progress=lambda items, n, label: tqdm(items, total=n, desc=label, unit="seq")
    )
    return 0


def _add_answer_args(p: argparse.ArgumentParser, folder: str) -> None:
    """``--dataset``, ``--limit`` and ``--max-new-tokens`` of the benches that score the target's greedy answers;
    ``folder`` says what a data folder given as ``--dataset`` stands for."""
    p.add_argument("--dataset", default="mtbench", help=f"mtbench, humaneval, a .jsonl file of prompts, or {folder}")
    p.add_argument("--limit", type=_positive_int, default=None, help="first N prompts or samples only")
    p.add_argument("--max-new-tokens", type=_positive_int, default=128)


def cmd_bench_replay(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from dartspec.bench.replay import replay_methods, run_replay_bench

    replay_methods(args.methods)  # a bad method fails before the model loads
    target = load_target(args)
    run_replay_bench(
        args, target, log=_log, progress=lambda items, n, label: tqdm(items, total=n, desc=label, unit="answer")
    )
    return 0


def cmd_bench_fidelity(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dartspec.formats import parse_format

    if not Path(args.dev).is_dir():
        raise DartspecError(f"--dev {args.dev!r} is not a folder of regenerated shards")
    for spec in args.formats:  # a typo costs no model load
        parse_format(spec)
    from dartspec.bench.fidelity import run_fidelity_bench

    run_fidelity_bench(
        load_target(args),
        args.formats,
        dev=args.dev,
        sequences=args.sequences,
        questions=args.questions,
        log=_log,
        out=args.out,
    )
    return 0


def cmd_bench_train(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from dartspec.bench.train_speed import run_train_bench
    from dartspec.train.cli import samples_from, trainer_kind
    from dartspec.train.dart import TrainConfig

    trainer_cls, defaults = trainer_kind(args.kind)
    cfg = TrainConfig.from_file(args.config) if args.config else TrainConfig(**defaults)
    cfg = replace(cfg, seqs_per_step=args.seqs_per_step, init=args.init or cfg.init)
    folders = args.data or ["data/smollm2-135m-sharegpt-dev"]
    train = samples_from(folders)
    if len(train) < args.seqs_per_step:
        raise DartspecError(
            f"{', '.join(folders)} hold {len(train)} samples, fewer than --seqs-per-step {args.seqs_per_step}"
        )
    run_train_bench(
        load_target(args),
        train,
        args.settings,
        cfg,
        trainer_cls=trainer_cls,
        rounds=args.rounds,
        log=_log,
        out=args.out,
    )
    return 0


def cmd_bench_search(args: argparse.Namespace) -> int:
    import torch

    from dartspec.bench.search_speed import report
    from dartspec.drafters import shipped_checkpoint

    if args.threads:
        torch.set_num_threads(args.threads)
    path = args.ngram
    if path is None:
        shipped = shipped_checkpoint("dart", DEFAULT_MODEL)
        path = shipped / "ngram.bin" if shipped and (shipped / "ngram.bin").is_file() else None
    print(report(args.sizes, path))
    return 0


def cmd_data_regenerate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dartspec.data.regenerate import RegenConfig, parse_range, regenerate

    start, stop = parse_range(args.range, args.source)
    _check_temperature(args.temperature)
    cfg = RegenConfig(
        model=args.model,
        source=args.source,
        start=start,
        stop=stop,
        max_prompt_tokens=args.max_prompt_tokens,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
        shard_size=args.shard_size,
        turns=args.turns,
    )
    target = load_target(args)
    # Throughput grows with the batch until the device is busy: 2 CPU cores are at ~32 rows, a GPU far later.
    batch_size = args.batch_size or (32 if target.device.type == "cpu" else 256)
    max_seconds = args.max_minutes * 60 if args.max_minutes is not None else None
    summary = regenerate(
        target, cfg, Path(args.out), resume=args.resume, batch_size=batch_size, log=_log, max_seconds=max_seconds
    )
    _log("summary: " + json.dumps(summary))
    return 0


def cmd_ngram_build(args: argparse.Namespace) -> int:
    from dartspec.ngram_build import build_ngram

    build_ngram(args, log=_log)
    return 0


def cmd_train_promote(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dartspec.drafters import checkpoint_folder
    from dartspec.train.cli import samples_from
    from dartspec.train.promote import check_checkpoint, promote

    if not Path(args.dev).is_dir():
        raise DartspecError(f"--dev {args.dev!r} is not a folder of regenerated shards")
    check_checkpoint(Path(args.candidate), "candidate")  # before the model loads
    target = load_target(args)
    into = Path(args.into) if args.into else checkpoint_folder(args.kind, target, None)
    samples = [(s.tokens, s.prompt_len) for s in samples_from(args.dev)][: args.limit]
    promote(
        target, Path(args.candidate), into, samples, kind=args.kind, replay=args.replay, dry_run=args.dry_run, log=_log
    )
    return 0


def cmd_train_curve(args: argparse.Namespace) -> int:
    from dartspec.train.curve import describe, load_curve, plot

    curve = load_curve(args.logs)
    print(describe(curve, args.goal))
    if args.plot:
        plot(curve, args.plot, args.title)
        _log(f"saved {args.plot}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from dartspec.train.cli import run_training

    if args.fit_schedule and args.max_minutes is None:
        raise DartspecError("--fit-schedule fits the schedule to --max-minutes: give both")
    if args.new_data and not args.resume:  # it meant nothing, silently
        raise DartspecError("--new-data goes with --resume (a new run trains on whatever --data names)")
    run_training(args.train_command, args, load_target(args), log=_log)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dartspec", description="Fast, lossless LLM inference by speculative decoding."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="generate text, streamed as it is accepted")
    add_target_args(p)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the prompt text; - reads it from standard input")
    source.add_argument("--prompt-file", help="read the prompt from this UTF-8 text file")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn in the chat template")
    p.add_argument("--system", default=None, help="with --chat: a system message before the prompt")
    add_drafter_args(p)
    add_sampling_args(p)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object with text and stats instead of streaming")
    p.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="K",
        help="with --json: each token's log-probability under the model, with its K most likely alternatives (0-20)",
    )
    p.add_argument(
        "--prompt-logprobs",
        type=int,
        default=None,
        metavar="K",
        help="with --json: the same for the prompt's tokens after its first (prompt_logprobs; scoring a text)",
    )
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="a conversation on the terminal, answers streamed as they are accepted")
    add_target_args(p)
    p.add_argument("--system", default=None, help="a system message that opens the conversation")
    add_drafter_args(p)
    add_sampling_args(p)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--no-stats", dest="stats", action="store_false", help="no figures line after each answer")
    add_prefix_cache_arg(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with streaming, metrics and a web demo")
    add_target_args(p)
    add_drafter_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=_port, default=8000)
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/ endpoints (visible in ps: prefer DARTSPEC_API_KEY or "
        "--api-key-file)",
    )
    p.add_argument("--api-key-file", default=None, help="read the API key from this file (first line)")
    p.add_argument(
        "--max-stored-responses",
        type=_count,
        default=1000,
        help="Responses API answers kept in memory for previous_response_id and GET/DELETE /v1/responses/ID, the "
        "newest first (default 1000; 0: none)",
    )
    p.add_argument("--protect-all", action="store_true", help="with a key, also guard / and /metrics (not /health)")
    p.add_argument("--alias", action="append", default=[], help="another model name requests may use (repeatable)")
    p.add_argument(
        "--max-body-kb", type=_positive_int, default=1024, help="largest request body in KiB (default 1024; then 413)"
    )
    p.add_argument(
        "--max-queue", type=int, default=64, help="requests that may wait for a place (0: none wait; then 429)"
    )
    p.add_argument(
        "--max-batch",
        type=_positive_int,
        default=8,
        help="requests decoded together, one target forward per step (default 8; 1: one at a time)",
    )
    p.add_argument(
        "--step-rows",
        type=_positive_int,
        default=None,
        help="rows of one batched forward: each request's tree gets rows / requests nodes (default: 4 on a CPU, "
        "64 on a GPU; trees shrink to plain decoding as the batch fills)",
    )
    add_prefix_cache_arg(p)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take, its wait included")
    p.add_argument("--default-max-tokens", type=_positive_int, default=256)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("demo", help="speculative vs plain decoding on three real prompts (what `make demo` runs)")
    add_target_args(p)
    p.add_argument(
        "--methods", default=None, help="drafters to compare (default: none,pld and dart,dart+pld if shipped)"
    )
    p.add_argument("--max-new-tokens", type=_positive_int, default=128)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser(
        "tune", help="measure which drafter --drafter auto runs on this machine (otherwise done at its first use)"
    )
    add_target_args(p)
    p.add_argument(
        "--drafters",
        default=None,
        help="comma-separated candidates (default: dart+pld,pld where a DART drafter ships, else the static default)",
    )
    p.add_argument("--drafter-path", default=None, help="the DART checkpoint the candidates load (default: shipped)")
    p.add_argument("--prompts", type=_positive_int, default=16, help="tuning prompts (16 ship; default 16)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=48)
    p.set_defaults(func=cmd_tune)

    data = sub.add_parser("data", help="training data").add_subparsers(dest="data_command", required=True)
    p = data.add_parser("regenerate", help="let the target write its own answers to ShareGPT or its own prompts")
    add_target_args(p, gpu_dtype="bfloat16")
    p.add_argument(
        "--source",
        default="sharegpt",
        choices=list(DATA_SOURCES),
        help="sharegpt: ShareGPT user turns; self: requests the target writes itself from seeded openers",
    )
    p.add_argument(
        "--range",
        required=True,
        help="source indices START:STOP (sharegpt: train < 14000, dev 14000:15000; self: any seed indices)",
    )
    p.add_argument("--out", type=_folder_out, required=True, help="output folder of token-id shards")
    p.add_argument(
        "--batch-size",
        type=_positive_int,
        default=None,
        help="prompts per static batch (default 32 on CPU, 256 on GPU)",
    )
    p.add_argument("--max-prompt-tokens", type=_positive_int, default=512)
    p.add_argument("--max-new-tokens", type=_positive_int, default=512)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-size", type=_positive_int, default=256, help="source indices per shard")
    p.add_argument(
        "--turns",
        type=_positive_int,
        default=1,
        help="user turns answered per conversation (default 1; turn k follows the target's answers to 1..k-1)",
    )
    p.add_argument("--resume", action="store_true", help="continue an interrupted run (skips finished shards)")
    p.add_argument(
        "--max-minutes",
        type=_positive_minutes,
        default=None,
        help="stop after the shard that crosses this time (e.g. a GPU window's slice); --resume goes on",
    )
    p.set_defaults(func=cmd_data_regenerate)

    train = sub.add_parser("train", help="train drafters").add_subparsers(dest="train_command", required=True)
    for kind, what, init_help in (
        ("dart", "a DART drafter", "warm start from this DART checkpoint (e.g. the shipped one)"),
        (
            "eagle3",
            "the EAGLE-3 baseline (training-time test)",
            "warm start from this EAGLE-3 checkpoint, or from a DART one (same layer; its depth-1 row)",
        ),
        (
            "dflash",
            "a DFlash block drafter (without --config: 2 layers, 5 feature layers, CE weighted exp(-(k-1)/7))",
            "warm start from this DFlash checkpoint",
        ),
    ):
        p = train.add_parser(kind, help=f"train {what} online against the target")
        # auto: the lean runtime, which scores the training sequences ~2x faster than transformers on a CPU (with
        # the features a drafter reads when it serves there, its default format) and 1.35x on a GPU (bf16).
        add_target_args(p, gpu_dtype="bfloat16")
        p.add_argument(
            "--data", required=True, action="append", help="regenerated training shards (repeatable; data regenerate)"
        )
        p.add_argument("--dev", default=None, help="regenerated dev shards (default: none, no dev metrics)")
        p.add_argument("--out", type=_folder_out, required=True, help="checkpoint folder")
        p.add_argument("--config", default=None, help="YAML file of TrainConfig fields")
        p.add_argument(
            "--max-steps", type=int, default=None, help="override the number of optimizer steps (0: from the epochs)"
        )
        p.add_argument("--stop-after", type=int, default=None, help="stop after this many steps (resume later)")
        p.add_argument(
            "--max-minutes",
            type=_positive_minutes,
            default=None,
            help="stop (evaluated and checkpointed) after the step that ends this many minutes in (resume later)",
        )
        p.add_argument(
            "--fit-schedule",
            action="store_true",
            help="with --max-minutes: after the warmup, shorten the learning-rate schedule to the steps that fit in "
            "the time, so it has decayed when time is up (a GPU window's run)",
        )
        p.add_argument("--resume", action="store_true", help="continue the run in --out exactly")
        p.add_argument(
            "--new-data",
            action="store_true",
            help="with --resume: continue on other training data than the run's (refused otherwise)",
        )
        p.add_argument("--init", default=None, help=init_help)
        p.add_argument(
            "--feature-cache",
            type=_folder_out,
            default=None,
            help="folder of an fp16 cache of the target's features: epochs after the first skip the target (CPU)",
        )
        p.set_defaults(func=cmd_train)

    p = train.add_parser(
        "promote", help="install a trained drafter over the shipped one only if it scores better on dev"
    )
    add_target_args(p, runtime="hf")
    p.add_argument("--candidate", required=True, help="the trained checkpoint folder")
    p.add_argument("--kind", default="dart", choices=["dart", "eagle3", "dflash"])
    p.add_argument("--into", default=None, help="the installed drafter folder (default: the shipped one)")
    p.add_argument("--dev", default="data/smollm2-135m-sharegpt-dev", help="regenerated dev shards")
    p.add_argument("--limit", type=_positive_int, default=200, help="dev answers compared (default 200)")
    p.add_argument(
        "--replay",
        type=_count,
        default=40,
        help="DART: also replay both drafters' trees (16 nodes) on this many of the dev answers and report tau "
        "(0: skip; default 40)",
    )
    p.add_argument("--dry-run", action="store_true", help="score and report, change nothing")
    p.set_defaults(func=cmd_train_promote)

    p = train.add_parser("curve", help="learning curve of one or more training logs (in training order), with a fit")
    p.add_argument("logs", nargs="+", help="train_log.jsonl files, first run first (warm starts after it)")
    p.add_argument("--plot", type=_file_out, default=None, help="draw it to this PNG (needs matplotlib)")
    p.add_argument("--title", default="", help="plot title")
    p.add_argument(
        "--goal", type=_fraction, default=None, help="dev depth-1 top-1 to extrapolate to, e.g. 0.70: tokens needed"
    )
    p.set_defaults(func=cmd_train_curve)

    ng = sub.add_parser("ngram", help="n-gram models").add_subparsers(dest="ngram_command", required=True)
    p = ng.add_parser("build", help="count n-grams of regenerated data (and optional text files)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="the target whose tokenizer ids are counted")
    p.add_argument("--data", action="append", default=[], help="regenerated shard folder (repeatable)")
    p.add_argument("--text", nargs="*", default=[], help="plain text files, tokenized with the target's tokenizer")
    p.add_argument("--order", type=_positive_int, default=3)
    p.add_argument("--min-count", type=_positive_int, default=1, help="drop rarer n-grams (n >= 2) to shrink the file")
    p.add_argument("--out", type=_file_out, required=True, help="output n-gram file")
    p.set_defaults(func=cmd_ngram_build)

    p = sub.add_parser("models", help="list the known model names")
    p.set_defaults(func=cmd_models)

    bp = sub.add_parser(
        "bench",
        help="methods side by side on real prompts (or: bench latency)",
        description="Run methods back to back on each prompt (rotating order), compare outputs with plain "
        "decoding, print a Markdown table and save results.md, results.json and plots.",
    )
    add_target_args(bp)
    bp.add_argument(
        "--methods",
        default="ar,pld,dart",
        help="comma-separated: ar, pld, dart, dart+pld, eagle3, hf-ar, hf-pld; options after a colon, e.g. "
        "dart:tree=ddtree,size=8,online=1,ngram=off or eagle3:size=8,topk=4 (default ar,pld,dart)",
    )
    bp.add_argument("--dataset", default="mtbench", help="mtbench, humaneval or a .jsonl file of prompts")
    bp.add_argument("--turn", type=int, default=1, choices=[1])
    bp.add_argument("--limit", type=_positive_int, default=None, help="first N prompts only")
    bp.add_argument("--max-new-tokens", type=_positive_int, default=256)
    bp.add_argument("--temperature", type=float, default=0.0)
    bp.add_argument("--seed", type=int, default=0)
    add_decoding_args(bp)
    bp.add_argument(
        "--tree-size",
        type=_tree_size,
        default=None,
        help="tree size of rows that set none (default: each drafter's default on the device, as `generate` uses; "
        "or auto)",
    )
    bp.add_argument("--out", type=_folder_out, default=None, help="folder for results.md, results.json and plots")
    bp.set_defaults(func=cmd_bench)
    bench = bp.add_subparsers(dest="bench_command", required=False)
    p = bench.add_parser("search", help="tree-builder time per step and n-gram query throughput")
    p.add_argument("--sizes", type=_int_list, default=[8, 16, 32, 64], help="tree sizes R (default 8,16,32,64)")
    p.add_argument("--ngram", default=None, help="n-gram file (default: the shipped SmolLM2 drafter's)")
    p.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads (default: torch's)")
    p.set_defaults(func=cmd_bench_search)

    p = bench.add_parser(
        "accuracy",
        help="a drafter's teacher-forced top-1 agreement with the target per depth (no timing)",
        description="The target answers the prompts greedily (or a regenerated data folder's answers are "
        "used); the drafter predicts every answer position at every depth from the true prefix.",
    )
    add_target_args(p)
    p.add_argument(
        "--drafter",
        dest="drafters",
        type=_drafter_kinds,
        default=["dart"],
        help="dart, eagle3 or both (dart,eagle3: one set of answers, a table each)",
    )
    p.add_argument("--drafter-path", default=None, help="drafter checkpoint folder (default: the shipped one)")
    _add_answer_args(p, "a regenerated data folder (e.g. the dev split: its stored answers)")
    p.add_argument(
        "--anchors",
        type=_positive_int,
        default=256,
        help="DART anchor blocks per answer (default 256: all of 256 tokens)",
    )
    p.add_argument("--out", type=_folder_out, default=None, help="folder for accuracy.md and accuracy.json")
    p.set_defaults(func=cmd_bench_accuracy)

    p = bench.add_parser(
        "replay",
        help="DART's tau for tree settings, replayed on greedy answers from one teacher-forced pass (no timing)",
        description="The target answers the prompts greedily; the drafter's rows at every position come from one "
        "teacher-forced pass, and each method's decode is replayed on them: tau per tree builder, size and n-gram "
        "setting in seconds, without the target's verification forwards.",
    )
    add_target_args(p)
    p.add_argument(
        "--methods",
        default="dart:size=4,dart:size=8,dart:size=16,dart:size=32",
        help="DART rows (dart, dart+pld) as in `dartspec bench --methods` (tree=, size=, depth=, ngram=, online=, "
        "smooth=, path=)",
    )
    _add_answer_args(p, "a regenerated data folder (its prompts, answered again)")
    p.add_argument("--out", type=_folder_out, default=None, help="folder for replay.md and replay.json")
    p.set_defaults(func=cmd_bench_replay)

    p = bench.add_parser(
        "train",
        help="training tokens/s of a drafter trainer: packed batches vs one sequence at a time, bf16 vs fp32",
        description="One trainer per setting from the same start and data order, one optimizer step each per "
        "round in rotating order; medians over --rounds counted steps.",
    )
    add_target_args(p, gpu_dtype="bfloat16")
    p.add_argument("--kind", default="dart", choices=["dart", "eagle3", "dflash"], help="which trainer (default dart)")
    p.add_argument(
        "--data", action="append", default=None, help="regenerated shards (default data/smollm2-135m-sharegpt-dev)"
    )
    p.add_argument(
        "--settings",
        nargs="+",
        type=_train_setting,
        default=["pack=1,precision=fp32", "pack=1", "pack=64"],
        help="TrainConfig overrides to compare (default pack=1,precision=fp32 pack=1 pack=64): pack=N sequences per "
        "forward (1: one at a time; 0: auto), precision=bf16|fp32|auto|bf16-drafter, cache=0|1 (fp16 feature cache, "
        "timed filled), target=RUNTIME[:QUANT] (what scores the sequences: e.g. hf, lean:exact-a16)",
    )
    p.add_argument("--seqs-per-step", type=_positive_int, default=8, help="sequences per optimizer step (default 8)")
    p.add_argument("--rounds", type=_positive_int, default=4, help="counted steps per setting (default 4)")
    p.add_argument("--config", default=None, help="YAML file of TrainConfig fields (default: the built-in ones)")
    p.add_argument("--init", default=None, help="start from this drafter checkpoint (default: a fresh network)")
    p.add_argument("--out", type=_folder_out, default=None, help="folder for train_speed.md and train_speed.json")
    p.set_defaults(func=cmd_bench_train)

    p = bench.add_parser("fidelity", help="the fidelity gate of weight formats: perplexity and greedy answers vs fp32")
    add_target_args(p)
    p.add_argument(
        "--formats",
        type=_str_list,
        default=["lean:none", "lean:fp16", "lean:int8"],
        help="runtimes to judge against transformers fp32, as RUNTIME[:QUANT] (default lean:none,lean:fp16,lean:int8)",
    )
    p.add_argument("--dev", default="data/smollm2-135m-sharegpt-dev", help="regenerated dev shards")
    p.add_argument("--sequences", type=_positive_int, default=100, help="dev answers scored for perplexity")
    p.add_argument("--questions", type=_positive_int, default=10, help="MT-Bench questions answered greedily")
    p.add_argument("--out", type=_folder_out, default=None, help="folder for fidelity.md and fidelity.json")
    p.set_defaults(func=cmd_bench_fidelity)

    p = bench.add_parser("load", help="many clients and hostile requests against a running server (loopback)")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (dartspec serve)")
    p.add_argument("--clients", type=_positive_int, default=64, help="concurrent clients")
    p.add_argument("--requests", type=_positive_int, default=128, help="well-formed requests in all")
    p.add_argument("--dataset", default="mtbench", help="prompts: mtbench, humaneval or a JSONL file")
    p.add_argument("--limit", type=_positive_int, default=8, help="distinct prompts (cycled over the requests)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=32)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole test")
    p.add_argument("--api-key", default=None, help="the server's key (or --api-key-file / DARTSPEC_API_KEY)")
    p.add_argument("--api-key-file", default=None)
    p.add_argument("--out", type=_folder_out, default=None, help="folder for load.md and load.json")
    p.set_defaults(func=cmd_bench_load)

    p = bench.add_parser("serve", help="aggregate tokens/s and latency of the server under 1..N concurrent clients")
    add_target_args(p)
    add_drafter_args(p)
    p.add_argument(
        "--concurrency", type=_int_list, default=[1, 2, 4, 8], help="concurrent clients per level (default 1,2,4,8)"
    )
    p.add_argument("--dataset", default="mtbench", help="prompts: mtbench, humaneval or a JSONL file")
    p.add_argument("--limit", type=_positive_int, default=16, help="prompts sent at each level (default 16)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=128)
    p.add_argument(
        "--max-batch", type=_positive_int, default=None, help="the server's batch (default: the most clients)"
    )
    p.add_argument("--step-rows", type=_positive_int, default=None, help="rows of a batched step (default: serve's)")
    add_prefix_cache_arg(p)
    p.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        help="give every request the same system message of about N tokens (measures the prefix cache)",
    )
    p.add_argument(
        "--out", type=_folder_out, default=None, help="folder for serve.md, serve.json (and serve.png with --plot)"
    )
    p.add_argument("--plot", action="store_true", help="also draw serve.png")
    p.set_defaults(func=cmd_bench_serve)

    p = bench.add_parser("latency", help="verify cost curve T(q)/T(1) and plain decoding vs transformers generate")
    add_target_args(p)
    p.add_argument(
        "--qs",
        type=_int_list,
        default=[1, 2, 4, 8, 16, 32],
        help="tree sizes to time (default 1,2,4,8,16,32)",
    )
    p.add_argument("--ctx", type=_positive_int, default=256, help="cached context length for the curve")
    p.add_argument("--repeats", type=_positive_int, default=9, help="interleaved rounds per q")
    p.add_argument(
        "--formats",
        type=_str_list,
        default=["hf", "lean:none", "lean:fp16", "lean:int8"],
        help="other runtimes to time beside --runtime/--quant, as RUNTIME[:QUANT] (default hf,lean:none,lean:fp16,"
        "lean:int8; empty for none)",
    )
    p.add_argument(
        "--prompts",
        type=_count,
        default=3,
        help="MT-Bench prompts for the decoding comparison (0 skips)",
    )
    p.add_argument("--max-new-tokens", type=_positive_int, default=128)
    p.add_argument("--skip-hf", action="store_true", help="skip the transformers generate comparison")
    p.add_argument("--out", type=_folder_out, default=None, help="folder for latency.md and latency.json")
    p.add_argument(
        "--plot", type=_file_out, default=None, help="also draw the cost curve to this PNG (needs matplotlib)"
    )
    p.set_defaults(func=cmd_bench_latency)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dartspec`` command; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _quiet_transformers()
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except DartspecError as err:
        _log(f"error: {err}")
        return 2
    except KeyboardInterrupt:
        _log("interrupted")
        return 130
    except BrokenPipeError:
        return 0


def _quiet_transformers() -> None:
    """Our own messages say what is happening; transformers' per-load progress bars only add noise. As defaults of
    the environment variables transformers reads when first imported (a user's own setting wins), not by importing it
    here: that would cost a second before a mistyped option's error; where it is imported already, directly."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()


if __name__ == "__main__":
    sys.exit(main())
