"""The benchmark harness on a tiny random model: tables, JSON, plots, mismatch detection, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dartspec.bench.report import markdown, summarize, write_results
from dartspec.bench.suite import MethodSpec, Run, encode_prompts, load_prompts, parse_methods, run_suite
from dartspec.engine import Generator
from dartspec.errors import DartspecError
from dartspec.target import Target

PROMPTS = [("p0", "t5 t6 t7 t8 t5 t6 t7 t8 t5"), ("p1", "t9 t10 t11 t9 t10 t11 t9")]


def test_parse_methods_groups_options() -> None:
    specs = parse_methods("ar,pld,dart:tree=ddtree,size=8,online=1,dart", tree_size=12)
    assert [s.label for s in specs] == ["ar", "pld", "dart:tree=ddtree,size=8,online=1", "dart"]
    assert specs[2].tree == "ddtree" and specs[2].tree_size == 8 and specs[2].online
    assert specs[3].tree == "beam" and specs[3].tree_size == 12
    eagle = parse_methods("eagle3:size=6,topk=2,depth=4", tree_size=12)[0]
    assert (eagle.kind, eagle.tree_size, eagle.topk, eagle.max_depth) == ("eagle3", 6, 2, 4)
    assert parse_methods("eagle3:size=auto")[0].tree_size == "auto"
    lookup = parse_methods("pld:size=2,depth=5", tree_size=12)[0]
    assert (lookup.kind, lookup.tree_size, lookup.max_depth) == ("pld", 2, 5)
    auto = parse_methods("ar,auto")[1]  # what `generate` runs by default
    assert (auto.kind, auto.generator_spec().drafter) == ("auto", "auto")
    hybrid = parse_methods("dart+pld:size=3,draft=2")[0]
    assert (hybrid.tree_size, hybrid.draft, hybrid.generator_spec().draft_nodes) == (3, 2, 2)
    sampled = parse_methods("dart+pld:sampled=1,draft=2")[0]
    assert sampled.sampled and sampled.generator_spec().sampled_drafts
    peer = parse_methods("llamacpp-pld:draft=4,gguf=F16")[0]  # llama-cpp-python's prompt lookup, 4 tokens a draft
    assert (peer.kind, peer.draft, peer.gguf) == ("llamacpp-pld", 4, "f16")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("ar,medusa", "unknown method 'medusa'"),
        ("eagle3:tree=beam", "bad option 'tree=beam'"),
        ("eagle3:topk=0", "topk must be a positive integer"),
        ("dart:tree=wide", "tree must be one of beam, ddtree, chain"),
        ("dart:colour=red", "bad option 'colour=red'"),
        ("dart:draft=2", "bad option 'draft=2'"),  # only a hybrid has a DART share to cap
        ("dart+pld:draft=0", "draft must be a positive integer"),
        ("size=4", "must follow a method name"),
        ("hf-pld:size=4", "takes no options"),
        ("llamacpp-ar:draft=4", "bad option 'draft=4'"),
        ("pld:sampled=1", "bad option 'sampled=1'"),  # prompt lookup's spans are fixed guesses
        ("dart:online=maybe", "online must be 1 / on / true / yes or 0 / off / false / no"),  # silently off before
        ("eagle3:sampled=1", "bad option 'sampled=1'"),
        ("llamacpp-pld:size=4", "bad option 'size=4'"),
        ("ar,ar", "same method twice"),
        ("dart:size=4,size=8", "dart:size=4,size=8 sets size twice"),  # the last counted, silently
        ("", "empty"),
    ],
)
def test_parse_methods_errors(text: str, message: str) -> None:
    with pytest.raises(DartspecError, match=message):
        parse_methods(text)


def test_malformed_dataset_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hello"}\n{"prompt": 3}\n')
    with pytest.raises(DartspecError, match=r"p.jsonl line 2: \"prompt\" must be a non-empty string"):
        load_prompts(str(path))
    path.write_text('{"prompt": "hello"}\n{"turns": ["a", "b"]}\n')
    assert [text for _, text in load_prompts(str(path))] == ["hello", "a"]


def test_suite_writes_table_json_plots_and_flags_a_corrupting_method(tmp_path: Path, llama_target: Target) -> None:
    def corrupt(ids: list[int], max_new_tokens: int, temperature: float, seed: int) -> Run:
        run = plain(ids, max_new_tokens, temperature, seed)
        run.token_ids = [*run.token_ids[:-1], (run.token_ids[-1] + 1) % 96]
        return run

    from dartspec.bench.suite import make_runner

    plain = make_runner(MethodSpec("ar", "ar"), llama_target)
    specs = [MethodSpec("ar", "ar"), MethodSpec("pld", "pld"), MethodSpec("broken", "pld")]
    runs = run_suite(llama_target, specs, PROMPTS, max_new_tokens=12, runners={"broken": corrupt})
    assert len(runs) == 6 and {r.prompt for r in runs} == {"p0", "p1"}
    rows = {r["method"]: r for r in summarize(runs)}
    assert rows["ar"]["mismatches"] == 0 and rows["pld"]["mismatches"] == 0
    assert rows["broken"]["mismatches"] == 2
    assert rows["ar"]["speedup"] == pytest.approx(1.0)
    table = write_results(
        runs,
        list(rows.values()),
        {"model": "tiny", "dataset": "toy", "temperature": 0.0, "max_new_tokens": 12},
        tmp_path,
    )
    assert "**2 MISMATCH**" in table and "| pld |" in table
    data = json.loads((tmp_path / "results.json").read_text())
    assert len(data["runs"]) == 6 and data["summary"][0]["method"] == "ar"
    for name in ("results.md", "speedup.png", "acceptance.png"):
        assert (tmp_path / name).stat().st_size > 0


def test_sampling_runs_skip_the_token_comparison(llama_target: Target) -> None:
    runs = run_suite(llama_target, [MethodSpec("pld", "pld")], PROMPTS[:1], max_new_tokens=6, temperature=1.0)
    assert [r.method for r in runs] == ["ar", "pld"]  # plain decoding is added as the reference
    assert all(r.matches_ar is None for r in runs)


def test_penalties_reach_every_row_and_hf_generate_takes_its_own_names(llama_target: Target) -> None:
    """With a repetition penalty and a logit bias every row decodes under them (the engine's tokens) and transformers'
    row gives the same tokens (its repetition_penalty and sequence_bias); peers that cannot apply a penalty refuse."""
    from dartspec.bench.suite import make_runner

    penalties = {"repetition_penalty": 2.0, "logit_bias": {9: -100.0}, "presence_penalty": 0.0}
    specs = [MethodSpec("pld", "pld"), MethodSpec("hf-ar", "hf-ar")]
    runs = run_suite(llama_target, specs, PROMPTS, max_new_tokens=8, settings=penalties)
    rows = {r["method"]: r for r in summarize(runs)}
    assert rows["pld"]["mismatches"] == 0 and rows["hf-ar"]["mismatches"] == 0
    for run in runs:
        if run.method == "ar":
            ids = dict(encode_prompts(llama_target, PROMPTS))[run.prompt]
            want = Generator(llama_target).generate(ids, max_new_tokens=8, repetition_penalty=2.0, logit_bias={9: -100})
            assert run.token_ids == want.token_ids != Generator(llama_target).generate(ids, max_new_tokens=8).token_ids
    with pytest.raises(DartspecError, match="no presence or frequency penalty"):
        make_runner(MethodSpec("hf-ar", "hf-ar"), llama_target, {"frequency_penalty": 0.5})
    with pytest.raises(DartspecError, match="cannot apply dartspec's penalties"):
        make_runner(MethodSpec("llamacpp-ar", "llamacpp-ar"), llama_target, {"repetition_penalty": 1.1})
    with pytest.raises(DartspecError, match="bans bad words otherwise"):
        make_runner(MethodSpec("hf-ar", "hf-ar"), llama_target, {"bad_words": ["t5"]})


def test_stop_token_ids_end_every_row_as_transformers_generate_ends(llama_target: Target) -> None:
    """--stop-token-id reaches every row: the engine's answer is the plain one cut after the first stop id, and
    transformers' generate (the stop ids among its eos_token_id) gives the same tokens."""
    label, ids = encode_prompts(llama_target, PROMPTS)[0]
    full = Generator(llama_target).generate(ids, max_new_tokens=12).token_ids
    stop = full[3]
    specs = [MethodSpec("pld", "pld"), MethodSpec("hf-ar", "hf-ar")]
    runs = run_suite(llama_target, specs, PROMPTS, max_new_tokens=12, settings={"stop_token_ids": [stop]})
    assert all(r["mismatches"] == 0 for r in summarize(runs))
    first = {r.method: r.token_ids for r in runs if r.prompt == label}
    assert first["ar"] == first["hf-ar"] == full[: full.index(stop) + 1]


def test_search_speed_report(tmp_path: Path) -> None:
    from dartspec.bench.search_speed import report
    from dartspec.ngram import NgramModel

    model, _ = NgramModel.build([[1, 2, 3, 1, 2, 4] * 20], order=3, vocab=9000)
    model.save(tmp_path / "ng.bin")
    text = report([4, 8], tmp_path / "ng.bin")
    assert "| beam+ngram+online |" in text and "| ddtree |" in text and "R=8" in text
    assert "candidate probabilities per second" in text


def test_peer_with_other_numerics_differs_without_a_mismatch(llama_target: Target) -> None:
    """A quantized peer (llamacpp-ar) may produce other tokens: reported as 'differ', not as a mismatch."""
    from dartspec.bench.suite import make_runner

    plain = make_runner(MethodSpec("ar", "ar"), llama_target)

    def other_numerics(ids: list[int], max_new_tokens: int, temperature: float, seed: int) -> Run:
        run = plain(ids, max_new_tokens, temperature, seed)
        run.token_ids = [(t + 1) % 96 for t in run.token_ids]
        run.exact = False
        return run

    specs = [MethodSpec("ar", "ar"), MethodSpec("llamacpp-ar", "llamacpp-ar")]
    runs = run_suite(llama_target, specs, PROMPTS, max_new_tokens=6, runners={"llamacpp-ar": other_numerics})
    rows = {r["method"]: r for r in summarize(runs)}
    assert rows["llamacpp-ar"]["mismatches"] == 0 and rows["llamacpp-ar"]["differs"] == 2
    assert "2/2 differ (other numerics)" in markdown(list(rows.values()), "t")


@pytest.mark.parametrize("kind", ["llamacpp-ar", "llamacpp-pld"])
def test_llamacpp_row_without_the_package_says_how_to_install(
    llama_target: Target, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    import sys

    from dartspec.bench.suite import make_runner

    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    with pytest.raises(DartspecError, match=rf"{kind} needs llama-cpp-python.*pip install 'dartspec\[llamacpp\]'"):
        make_runner(MethodSpec(kind, kind), llama_target)


def test_a_crashing_llamacpp_probe_is_told_from_one_that_fails_or_works() -> None:
    """llama.cpp's AMX backend segfaulted on an Intel Xeon (2026-12-06), killing the benchmark: a child process tries
    first. Killed by a signal: no. An exception (the real load then raises its own error) or a clean exit: yes."""
    from dartspec.bench.suite import _survives

    assert not _survives("import ctypes; ctypes.string_at(0)")  # a segfault
    assert not _survives("import os, signal; os.kill(os.getpid(), signal.SIGABRT)")
    assert _survives("raise SystemExit(3)") and _survives("raise ValueError('no such file')")
    assert _survives("import sys; assert sys.argv[1] == 'x.gguf'", "x.gguf")


def test_llamacpp_model_params_are_changed_for_the_block_only() -> None:
    """`_default_model_params`: Llama's starting model parameters carry the given fields inside the block (it has no
    argument for use_extra_bufts), and llama-cpp-python's own function is back after it, also after an error."""
    import types

    from dartspec.bench.suite import _default_model_params

    def default() -> types.SimpleNamespace:
        return types.SimpleNamespace(use_extra_bufts=True, n_gpu_layers=0)

    fake = types.SimpleNamespace(llama_cpp=types.SimpleNamespace(llama_model_default_params=default))
    with _default_model_params(fake, use_extra_bufts=False):
        made = fake.llama_cpp.llama_model_default_params()
        assert (made.use_extra_bufts, made.n_gpu_layers) == (False, 0)
    assert fake.llama_cpp.llama_model_default_params is default
    with pytest.raises(RuntimeError), _default_model_params(fake, use_extra_bufts=False):
        raise RuntimeError("load failed")
    assert fake.llama_cpp.llama_model_default_params().use_extra_bufts is True


def test_train_bench_rows_and_equal_losses(tmp_path: Path) -> None:
    """`bench train`: one row per setting, all from the same start and data (same loss after the same steps)."""
    from test_dart import random_samples, small_config, tiny_target

    from dartspec.bench.train_speed import run_train_bench

    rows = run_train_bench(
        tiny_target(),
        random_samples(8, 0),
        ["pack=1", "pack=4"],
        small_config(seqs_per_step=4),
        rounds=2,
        log=lambda m: None,
        out=tmp_path,
    )
    assert [r["setting"] for r in rows] == ["pack=1", "pack=4"]
    assert all(r["tokens_per_s"] > 0 for r in rows)
    assert rows[0]["loss"] == pytest.approx(rows[1]["loss"], rel=1e-5)
    assert "| pack=4 |" in (tmp_path / "train_speed.md").read_text()


def test_train_bench_lean_scorer_trains_like_transformers(tmp_path: Path) -> None:
    """`bench train` setting target=lean: the lean runtime scores the sequences (a runtime of its own over the same
    model) and the trainer learns what it learns on transformers' scores (fp32 weights: the same loss to rounding)."""
    from test_dart import random_samples, small_config, tiny_target

    from dartspec.bench.train_speed import run_train_bench

    rows = run_train_bench(
        tiny_target(),
        random_samples(8, 0),
        ["pack=1", "pack=1,target=lean"],
        small_config(seqs_per_step=4),
        rounds=2,
        log=lambda m: None,
        out=tmp_path,
    )
    assert [r["scorer"].split("/")[0] for r in rows] == ["hf", "lean"]
    assert rows[1]["loss"] == pytest.approx(rows[0]["loss"], rel=1e-4)


def test_train_bench_settings_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    from dartspec.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "train", "--settings", "pack=x"])
    assert "expected pack=N" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "train", "--settings", "target=lean:q3"])
    assert "target=lean|hf[:QUANT]" in capsys.readouterr().err


def test_long_prompts_get_the_speedup_after_the_prefill_too() -> None:
    """Where the prefill is a large share of the rows' time (long prompts), the table adds each row's speedup after
    the prefill (per prompt, medians): what the method changes, which the shared prefill otherwise hides; rows
    without a prefill time (peers) get none, and short prompts keep the plain column."""
    from dartspec.bench.suite import Run

    def run(prompt: str, method: str, seconds: float, prefill: float | None) -> Run:
        times = {} if prefill is None else {"prefill": prefill, "verify": seconds - prefill}
        return Run(prompt, method, 10, seconds, 1.0, [], times, token_ids=[1] * 10)

    long = [run(p, "ar", 10.0, 8.0) for p in ("a", "b")] + [run(p, "fast", 9.0, 8.0) for p in ("a", "b")]
    long += [run(p, "peer", 9.0, None) for p in ("a", "b")]
    rows = {r["method"]: r for r in summarize(long)}
    assert rows["fast"]["speedup"] == pytest.approx(10 / 9) and rows["fast"]["decode_speedup"] == pytest.approx(2.0)
    assert rows["ar"]["decode_speedup"] == pytest.approx(1.0) and rows["peer"]["decode_speedup"] is None
    table = markdown(list(rows.values()), "long")
    assert "| fast | 1.00 | 1.1 | 1.11x (1.11-1.11); after the prefill 2.00x |" in table
    assert "| peer | 1.00 | 1.1 | 1.11x (1.11-1.11) |" in table
    short = [run(p, "ar", 10.0, 0.5) for p in ("a", "b")] + [run(p, "fast", 5.0, 0.5) for p in ("a", "b")]
    assert "after the prefill" not in markdown(summarize(short), "short")
