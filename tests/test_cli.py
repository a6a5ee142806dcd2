"""The command line: real runs in subprocesses, and every bad input is one line with exit status 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CLI = [sys.executable, "-m", "dartspec.cli"]


def run_cli(
    *args: str, env_extra: dict[str, str] | None = None, code: str | None = None
) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", code, *args] if code else [*CLI, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def run_in_process(capsys: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess:
    """The CLI's ``main`` in this process, reported as a subprocess would be (exit status, stdout, stderr): its
    imports are loaded already, which saves ~10 s a call on this host. Any exception but the CLI's own errors
    propagates, so a traceback still fails the test."""
    from dartspec.cli import main

    code = main(list(args))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, out.out, out.err)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_unknown_model_lists_known_names() -> None:
    proc = run_cli("generate", "--model", "no-such-model", "--prompt", "hi")
    assert_one_line_error(proc, "unknown model 'no-such-model'", "smollm2-135m", "qwen2.5-coder-0.5b")


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--temperature", "-0.5"], "temperature"),
        (["--temperature", "nan"], "temperature"),
        (["--top-p", "0"], "top_p"),
        (["--top-p", "1.5"], "top_p"),
        (["--top-k", "-3"], "top_k"),
        (["--seed", "-1"], "seed"),
        (["--drafter", "magic"], "unknown drafter"),
        (["--drafter", "dart+pld:size=4"], "'size=4' are flags here: --tree-size"),
    ],
)
def test_invalid_sampling_values_fail_before_loading(flags: list[str], needle: str) -> None:
    proc = run_cli("generate", "--model", "no-such-model", "--prompt", "hi", *flags)
    assert_one_line_error(proc, needle)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["generate", "--prompt", "hi", "--temperature", "-1"], "temperature"),
        (["generate", "--prompt", "hi", "--drafter", "magic"], "unknown drafter 'magic'"),
        (["chat", "--top-p", "2"], "top_p"),
        (["serve", "--drafter", "magic"], "unknown drafter 'magic'"),
        (["generate", "--model", "no-such-model", "--prompt", "hi"], "unknown model 'no-such-model'"),
        (["chat", "--model", "./missing.gguf"], "no such file or folder"),
        (["generate", "--prompt", "hi", "--json", "--logprobs", "21"], "logprobs must be an integer from 0 to 20"),
        (["generate", "--prompt", "hi", "--logprobs", "2"], "--logprobs needs --json"),
        (["generate", "--prompt", "hi", "--prompt-logprobs", "2"], "--prompt-logprobs needs --json"),
        (["generate", "--prompt", "hi", "--json", "--prompt-logprobs", "-1"], "prompt_logprobs must be an integer"),
        (["generate", "--prompt-file", "/no/such/prompt.txt"], "cannot read --prompt-file"),
        (["generate", "--prompt", "hi", "--repetition-penalty", "0"], "repetition_penalty must be"),
        (["generate", "--prompt", "hi", "--presence-penalty", "3"], "presence_penalty must be a number from -2 to 2"),
        (["chat", "--frequency-penalty", "nan"], "frequency_penalty must be"),
        (["generate", "--prompt", "hi", "--min-p", "2"], "min_p must be in [0, 1]"),
        (["generate", "--prompt", "hi", "--min-tokens", "-2"], "--min-tokens must be >= 0"),
        (["generate", "--prompt", "hi", "--stop", ".", "--stop", ""], "--stop takes a non-empty string"),
        (["generate", "--prompt", "hi", "--logit-bias", "42"], "--logit-bias takes ID=BIAS"),
        (["generate", "--prompt", "hi", "--logit-bias", "x=1"], "--logit-bias takes ID=BIAS"),
        (["generate", "--prompt", "hi", "--logit-bias", "42=-200"], "logit_bias value must be a number from -100"),
        (["bench", "fidelity", "--dev", ".", "--formats", "lean:int4"], "unknown QUANT 'int4' in RUNTIME[:QUANT]"),
        (
            ["generate", "--prompt", "hi", "--json-schema", "[1, 2]"],
            "a schema must be an object or a boolean, got list",
        ),
        (["generate", "--prompt", "hi", "--json-schema", "false"], "admits no finite document"),
        (["bench", "fidelity", "--dev", ".", "--formats", "hf,gpu:fp16"], "'gpu:fp16': expected RUNTIME[:QUANT]"),
    ],
)
def test_a_mistyped_option_is_refused_before_torch_is_imported(args: list[str], needle: str) -> None:
    """A typo costs a fraction of a second, not the seconds of importing torch and transformers."""
    code = (
        "import sys\nfrom dartspec.cli import main\ncode = main(sys.argv[1:])\n"
        "heavy = sorted({'torch', 'transformers'} & set(sys.modules))\n"
        "assert not heavy, f'imported before the error: {heavy}'\nsys.exit(code)\n"
    )
    assert_one_line_error(run_cli(*args, code=code), needle)


def test_promote_refuses_a_missing_candidate_before_loading() -> None:
    # an unknown model would be the error if the model loaded first
    proc = run_cli("train", "promote", "--model", "no-such-model", "--candidate", "/no/such/ckpt", "--dev", ".")
    assert_one_line_error(proc, "/no/such/ckpt is not a drafter checkpoint (no config.json): the candidate is missing")


def test_serve_refuses_an_address_it_cannot_take_before_loading(tmp_path: Path) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        code = (
            "import sys\nfrom dartspec.cli import main\ncode = main(sys.argv[1:])\n"
            "assert 'torch' not in sys.modules\nsys.exit(code)\n"
        )
        proc = run_cli("serve", "--port", str(port), code=code)
    assert_one_line_error(proc, f"cannot listen on 127.0.0.1:{port}", "--port")
    proc = run_cli("serve", "--port", "70000")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "expected a port number (1-65535), got '70000'" in proc.stderr


def test_serve_answers_on_the_socket_it_took(tmp_path: Path) -> None:
    """`dartspec serve` end to end: the address taken before the model loads is the one uvicorn serves on."""
    import socket
    import time

    import httpx

    with socket.socket() as probe:  # a free port (released just before the server takes it)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(  # a named drafter: `auto` would first measure the machine
        [*CLI, "serve", "--port", str(port), "--drafter", "pld"], stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, server.stderr.read() if server.stderr else ""
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server never answered /health"
            time.sleep(0.2)
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_bench_without_matplotlib_writes_its_tables_and_says_why_there_are_no_plots(tmp_path: Path) -> None:
    code = "import sys\nsys.modules['matplotlib'] = None\nfrom dartspec.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    args = ["bench", "--methods", "ar", "--limit", "1", "--max-new-tokens", "4", "--out", str(tmp_path)]
    proc = run_cli(*args, code=code)
    assert proc.returncode == 0, proc.stderr
    assert "matplotlib is not installed: tables without plots" in proc.stderr and "| ar |" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json", "results.md"]


def test_non_integer_flag_is_a_usage_error() -> None:
    proc = run_cli("generate", "--prompt", "hi", "--max-new-tokens", "zero")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "max-new-tokens" in proc.stderr


def test_missing_optional_package_says_how_to_install(tmp_path: Path) -> None:
    # Simulate an environment without matplotlib: the plot option must say how to get it.
    code = (
        "import sys; sys.modules['matplotlib'] = None; "
        "from dartspec.bench.latency import plot_cost_curve; "
        "from dartspec.errors import DartspecError\n"
        "try:\n    plot_cost_curve({'stock': {1: 1.0}, 'rows-first': {1: 1.0}}, sys.argv[1])\n"
        "except DartspecError as e:\n    print(e); sys.exit(2)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "x.png")], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "matplotlib" in proc.stdout and "pip install" in proc.stdout


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer and a 64-token context window."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from dartspec.models import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        eos_token_id=2,
        tie_word_embeddings=True,
    )
    folder = tmp_path_factory.mktemp("tiny")
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_prompt_longer_than_context_window(tiny_model_dir: Path) -> None:
    proc = run_cli("generate", "--model", str(tiny_model_dir), "--prompt", "word " * 200)
    assert_one_line_error(proc, "context window of 64 tokens")


@pytest.mark.slow
def test_generate_json_output(tiny_model_dir: Path) -> None:
    proc = run_cli(
        "generate",
        "--model",
        str(tiny_model_dir),
        "--prompt",
        "Hello there",
        "--drafter",
        "pld",
        "--max-new-tokens",
        "12",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    for key in ("text", "token_ids", "new_tokens", "tau", "tokens_per_s", "target_forwards", "accept_per_depth"):
        assert key in data
    assert set(data["times"]) >= {"draft", "tree", "verify", "other"}
    assert data["new_tokens"] == len(data["token_ids"]) <= 12
    assert data["tau"] == pytest.approx(data["new_tokens"] / data["target_forwards"], rel=1e-3)
    assert "logprobs" not in data
    with_logprobs = run_cli(*proc.args[3:], "--logprobs", "2", "--prompt-logprobs", "1")
    scored = json.loads(with_logprobs.stdout)
    logprobs = scored["logprobs"]
    assert [lp["token_id"] for lp in logprobs] == data["token_ids"] and all(len(lp["top"]) == 2 for lp in logprobs)
    assert scored["token_ids"] == data["token_ids"]  # scoring the prompt changes no answer
    prompt = scored["prompt_logprobs"]  # the prompt's tokens after its first, with their ranks
    assert len(prompt) == data["prompt_tokens"] - 1 and all(len(lp["top"]) == 1 and lp["rank"] >= 1 for lp in prompt)


@pytest.mark.slow
def test_generate_streams_same_text_as_json(tiny_model_dir: Path) -> None:
    common = ["generate", "--model", str(tiny_model_dir), "--prompt", "Hello there", "--max-new-tokens", "10"]
    streamed = run_cli(*common)
    as_json = run_cli(*common, "--json")
    assert streamed.returncode == 0 and as_json.returncode == 0
    assert streamed.stdout.rstrip("\n") == json.loads(as_json.stdout)["text"]
    assert "tok/s" in streamed.stderr and "tau" in streamed.stderr


def test_generate_takes_penalties_logit_bias_and_a_json_format(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The options reach the engine: the same tokens as the Python API given the same settings, which differ from the
    unpenalised answer; a bias naming a token outside the vocabulary is a one-line error."""
    from dartspec.engine import Generator
    from dartspec.targets import load_target

    common = ["generate", "--model", str(tiny_model_dir), "--prompt", "Hello there", "--max-new-tokens", "12", "--json"]
    target = load_target(str(tiny_model_dir))
    plain = Generator(target).generate("Hello there", max_new_tokens=12).token_ids
    banned = sorted(set(plain))[:2]
    flags = ["--repetition-penalty", "1.5", "--frequency-penalty", "0.5", "--presence-penalty", "-0.5", "--ignore-eos"]
    flags += [f for t in banned for f in ("--logit-bias", f"{t}=-100")]
    proc = run_in_process(capsys, *common, *flags)
    assert proc.returncode == 0, proc.stderr
    settings = dict(repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=-0.5, ignore_eos=True)
    want = (
        Generator(target)
        .generate("Hello there", max_new_tokens=12, logit_bias={t: -100 for t in banned}, **settings)
        .token_ids
    )
    got = json.loads(proc.stdout)["token_ids"]
    assert got == want != plain and not set(got) & set(banned)
    bad = run_in_process(capsys, *common, "--logit-bias", f"{target.vocab_size}=1")
    assert_one_line_error(bad, f"logit_bias names token {target.vocab_size}, outside")
    # --bad-word: the Python API's answer with the same bad words (a word of the plain answer, kept out of it)
    word = target.decode(plain[2:3]).strip()
    proc = run_in_process(capsys, *common, "--bad-word", word)
    assert proc.returncode == 0, proc.stderr
    want = Generator(target).generate("Hello there", max_new_tokens=12, bad_words=[word])
    assert json.loads(proc.stdout)["token_ids"] == want.token_ids != plain
    assert_one_line_error(run_in_process(capsys, *common, "--bad-word", " "), "--bad-word takes a non-empty word")
    # --response-format json_object: the Python API's constrained answer, a prefix of a JSON object (SmolLM2's
    # tokenizer under a random model)
    from dartspec import json_grammar

    proc = run_in_process(capsys, *common, "--response-format", "json_object")
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    want = Generator(target).generate("Hello there", max_new_tokens=12, response_format="json_object")
    assert got["token_ids"] == want.token_ids and got["text"].startswith("{")
    grammar = json_grammar.Grammar.any_object()
    assert grammar.advance(grammar.start(), got["text"].encode()) is not None
    # --json-schema (a file, or inline): the Python API's answer under that schema; an unsupported keyword is a
    # one-line error before the model loads
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}}, "required": ["name"]}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    want = Generator(target).generate("Hello there", max_new_tokens=12, response_format=schema)
    for given in (str(tmp_path / "schema.json"), json.dumps(schema)):
        proc = run_in_process(capsys, *common, "--json-schema", given)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["token_ids"] == want.token_ids
    from dartspec.json_schema import compile_schema

    grammar = compile_schema(schema)  # a random model's answer: a live prefix of a document the schema admits
    assert want.text.startswith("{") and grammar.advance(grammar.start(), want.text.encode()) is not None
    bad = run_in_process(capsys, *common, "--json-schema", r'{"type": "string", "format": "x", "pattern": "(?=y)"}')
    assert_one_line_error(bad, "#/pattern: pattern '(?=y)': lookahead and lookbehind are not supported")
    assert_one_line_error(run_in_process(capsys, *common, "--json-schema", "nofile.json"), "cannot read nofile.json")
    both = run_in_process(capsys, *common, "--json-schema", "{}", "--response-format", "json_object")
    assert_one_line_error(both, "exclude each other")
    # --regex and --choice (vLLM's guided_regex / guided_choice): the Python API's answer under that grammar
    for args, grammar in (
        (("--regex", "[a-z ]+[.!]"), json_grammar.Grammar.regex("[a-z ]+[.!]")),
        (("--choice", "yes", "--choice", "no way"), json_grammar.Grammar.choice(["yes", "no way"])),
    ):
        want = Generator(target).generate("Hello there", max_new_tokens=12, response_format=grammar)
        proc = run_in_process(capsys, *common, *args)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["token_ids"] == want.token_ids
        assert grammar.advance(grammar.start(), want.text.encode()) is not None
    assert_one_line_error(run_in_process(capsys, *common, "--regex", "(a"), "a '(' without its ')'")
    assert_one_line_error(run_in_process(capsys, *common, "--regex", "a", "--choice", "b"), "exclude each other")


def test_damaged_or_foreign_model_folders_get_one_line_errors(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each was a traceback of transformers or safetensors before."""
    import shutil

    cases = {
        "its config.json: It looks like": ("{bad", None),
        "its config.json: Unrecognized model": ("{}", None),
        "its config.json: The checkpoint you are trying to load has model type `bogusarch`": (
            '{"model_type": "bogusarch"}',
            None,
        ),
        "its weights:": (None, b"\x00" * 5000),
        "its tokenizer:": (None, None),
    }
    for i, (needle, (config, weights)) in enumerate(cases.items()):
        folder = tmp_path / f"m{i}"
        folder.mkdir()
        for name in ("config.json", "model.safetensors"):
            shutil.copy(tiny_model_dir / name, folder / name)
        if config is not None:
            (folder / "config.json").write_text(config)
        if weights is not None:
            (folder / "model.safetensors").write_bytes(weights)
        proc = run_in_process(capsys, "generate", "--model", str(folder), "--prompt", "Hi", "--max-new-tokens", "2")
        assert_one_line_error(proc, f"{folder} is not a usable model folder: {needle}")


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--device", "meta"], "invalid --device 'meta'"),  # an autocast traceback before
        (["--device", "cpu:5"], "invalid --device 'cpu:5'"),  # silently the CPU before
        (["--device", "bogus"], "invalid --device 'bogus'"),
        (["--threads", "100000"], "--threads 100000 is more than the"),  # minutes of a first `auto` before
    ],
)
def test_devices_and_threads_the_machine_lacks_are_refused(
    tiny_model_dir: Path, flags: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", "--model", str(tiny_model_dir), "--prompt", "Hi", "--max-new-tokens", "2", *flags]
    assert_one_line_error(run_in_process(capsys, *argv), needle)


@pytest.mark.slow
def test_generate_reads_the_prompt_from_stdin_or_a_file_and_takes_a_system_message(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    common = ["generate", "--model", str(tiny_model_dir), "--max-new-tokens", "8", "--json"]
    text = "Hello there, ünïcode 🙂\nsecond line"
    (tmp_path / "prompt.txt").write_text(text, encoding="utf-8")
    given = run_cli(*common, "--prompt", text)
    piped = subprocess.run([*CLI, *common, "--prompt", "-"], input=text, capture_output=True, text=True, timeout=600)
    from_file = run_cli(*common, "--prompt-file", str(tmp_path / "prompt.txt"))
    assert given.returncode == piped.returncode == from_file.returncode == 0, piped.stderr + from_file.stderr
    from dartspec.engine import Generator
    from dartspec.targets import load_target

    target = load_target(str(tiny_model_dir))
    runs = [json.loads(proc.stdout) for proc in (given, piped, from_file)]
    assert [r["prompt_tokens"] for r in runs] == [len(target.encode(text))] * 3
    assert runs[0]["token_ids"] == runs[1]["token_ids"] == runs[2]["token_ids"]
    # --system: the prompt and tokens the Python API gives for the two messages
    system = run_cli(*common, "--chat", "--system", "Answer in French.", "--prompt", text)
    assert system.returncode == 0, system.stderr
    messages = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": text}]
    want = Generator(target).generate(messages, max_new_tokens=8)
    got = json.loads(system.stdout)
    assert (got["prompt_tokens"], got["token_ids"]) == (len(target.encode_chat(messages)), want.token_ids)
    assert_one_line_error(run_cli(*common, "--system", "x", "--prompt", text), "--system needs --chat")
    assert_one_line_error(run_cli(*common, "--prompt-file", str(tmp_path / "none.txt")), "cannot read --prompt-file")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    assert_one_line_error(run_cli(*common, "--prompt-file", str(tmp_path / "latin1.txt")), "cannot read --prompt-file")
    # bytes that are not UTF-8 in an argument or on standard input reach Python as lone surrogates (a TypeError in
    # the tokenizer before)
    raw = [os.fsencode(a) for a in [*CLI, *common]]
    in_arg = subprocess.run([*raw, b"--prompt", b"ab\xffcd"], capture_output=True, text=True, timeout=600)
    assert_one_line_error(in_arg, "the prompt is not valid UTF-8")
    in_system = subprocess.run(
        [*raw, b"--chat", b"--system", b"\xff", b"--prompt", b"x"], capture_output=True, text=True
    )
    assert_one_line_error(in_system, "--system is not valid UTF-8")
    piped = subprocess.run([*CLI, *common, "--prompt", "-"], input=b"\xff\xfe bad", capture_output=True, timeout=600)
    assert_one_line_error(
        subprocess.CompletedProcess(piped.args, piped.returncode, "", piped.stderr.decode()), "standard input is not"
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        ([], "no EAGLE-3 drafter ships for"),
        (["--drafter-path", "/nonexistent/eagle"], "not found"),
    ],
)
def test_eagle3_drafter_errors(
    tiny_model_dir: Path, flags: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    proc = run_in_process(
        capsys, "generate", "--model", str(tiny_model_dir), "--prompt", "Hi", "--drafter", "eagle3", *flags
    )
    assert_one_line_error(proc, needle)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--drafter", "dart"], "no dart drafter ships for"),
        (["--drafter", "dart,eagle3", "--drafter-path", "/x"], "needs a single --drafter"),
        (["--drafter-path", "/nonexistent/dart"], "not found"),
        (["--dataset", "nosuch"], "unknown --dataset"),
    ],
)
def test_bench_accuracy_errors(
    tiny_model_dir: Path, flags: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    proc = run_in_process(capsys, "bench", "accuracy", "--model", str(tiny_model_dir), *flags)
    assert_one_line_error(proc, needle)


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--methods", "dart:size=4,pld"], "'pld' is not one"),
        (["--methods", "dart:size=auto"], "at a fixed size"),
        (["--methods", "dart:size=4"], "no DART drafter ships for"),
        (["--methods", "dart:path=/nonexistent/dart", "--dataset", "nosuch"], "unknown --dataset"),
    ],
)
def test_bench_replay_errors(
    tiny_model_dir: Path, flags: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    proc = run_in_process(capsys, "bench", "replay", "--model", str(tiny_model_dir), *flags)
    assert_one_line_error(proc, needle)


def test_bench_accuracy_rejects_unknown_drafter_kinds() -> None:
    proc = run_cli("bench", "accuracy", "--drafter", "dart,pld")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "expected dart, eagle3, dflash or a comma-separated list" in proc.stderr


def test_fit_schedule_needs_a_time_limit(tmp_path: Path) -> None:
    proc = run_cli("train", "dart", "--data", str(tmp_path), "--out", str(tmp_path / "out"), "--fit-schedule")
    assert_one_line_error(proc, "--fit-schedule", "--max-minutes")


@pytest.mark.parametrize(
    ("argv", "gpu"),
    [
        (["generate", "--prompt", "x"], "float32"),
        (["serve"], "float32"),
        (["bench", "--methods", "ar,dart"], "float32"),
        (["data", "regenerate", "--range", "0:8", "--out", "d"], "bfloat16"),
        (["train", "dart", "--data", "d", "--out", "o"], "bfloat16"),
        (["bench", "train", "--data", "d"], "bfloat16"),
    ],
)
def test_auto_dtype_is_exact_where_output_must_equal_plain_decoding(argv: list[str], gpu: str) -> None:
    """--dtype auto: float32 on a CPU; on a GPU float32 for the commands whose greedy output must equal plain
    decoding bit for bit (bf16 tree verification tips near-ties) and bf16 for data generation and training."""
    from dartspec.cli import build_parser, dtype_for

    args = build_parser().parse_args(argv)
    assert (dtype_for(args, "cpu"), dtype_for(args, "cuda")) == ("float32", gpu)
    args = build_parser().parse_args([*argv, "--dtype", "float16"])
    assert (dtype_for(args, "cpu"), dtype_for(args, "cuda")) == ("float16", "float16")


def test_an_empty_answer_to_a_bare_prompt_suggests_chat(capsys: pytest.CaptureFixture[str]) -> None:
    """SmolLM2 ends a bare instruction at once (a completion, not a chat turn): the answer is empty, and a note on
    stderr says how to ask the chat model (with --chat, or an answer, none)."""
    ask = ["generate", "--prompt", "Write a long story about a dragon.", "--max-new-tokens", "6", "--drafter", "none"]
    bare = run_in_process(capsys, *ask)
    assert bare.returncode == 0 and not bare.stdout.strip()
    assert "note: the answer is empty; smollm2-135m is a chat model: --chat wraps" in bare.stderr
    for extra in (["--chat"], ["--json", "--chat"]):
        chat = run_in_process(capsys, *ask, *extra)
        assert chat.returncode == 0 and chat.stdout.strip() and "note:" not in chat.stderr, chat
    assert "note: the answer is empty" in run_in_process(capsys, *ask, "--json").stderr


def test_generate_with_a_draft_model(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A draft model named by --drafter-path (here the target's own weights: every first draft is accepted) gives
    plain decoding's tokens; one with another tokenizer, or none, is a one-line error."""
    common = ["generate", "--model", str(tiny_model_dir), "--prompt", "Hello there", "--max-new-tokens", "12"]
    plain = json.loads(run_in_process(capsys, *common, "--json", "--drafter", "none").stdout)
    for drafter in ("draft-model", "draft-model+pld"):
        proc = run_in_process(capsys, *common, "--json", "--drafter", drafter, "--drafter-path", str(tiny_model_dir))
        assert proc.returncode == 0, proc.stderr
        got = json.loads(proc.stdout)
        assert got["token_ids"] == plain["token_ids"] and got["drafter"] == drafter
        assert got["tau"] >= 1.5  # the twin's first token is the target's
    assert_one_line_error(run_in_process(capsys, *common, "--drafter", "draft-model"), "--drafter-path")
    from conftest import tiny_model, tiny_tokenizer

    tiny_model("llama").save_pretrained(tmp_path)  # another tokenizer: word-level, 96 words
    tiny_tokenizer().save_pretrained(tmp_path)
    other = run_in_process(capsys, *common, "--drafter", "draft-model", "--drafter-path", str(tmp_path))
    assert_one_line_error(other, "does not share the target's tokenizer")


def test_output_paths_that_cannot_be_written_are_refused_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file where a folder goes (or the reverse, or a file in a missing folder) was an error from mkdir or the
    write after the whole run (a benchmark's minutes, or a training run's start)."""
    from dartspec.cli import build_parser

    afile, adir = tmp_path / "afile", tmp_path / "adir"
    afile.write_text("x")
    adir.mkdir()
    missing = tmp_path / "none" / "x.png"
    refused = [
        (["bench", "--dataset", "d.jsonl", "--out", str(afile)], "exists and is not a folder"),
        (["bench", "latency", "--out", str(afile)], "exists and is not a folder"),
        (["bench", "latency", "--plot", str(missing)], "does not exist"),
        (["train", "dart", "--data", "d", "--out", str(afile)], "exists and is not a folder"),
        (["train", "dart", "--data", "d", "--out", str(adir), "--feature-cache", str(afile)], "is not a folder"),
        (["data", "regenerate", "--source", "self", "--range", "0:1", "--out", str(afile)], "is not a folder"),
        (["ngram", "build", "--data", "d", "--out", str(adir)], "is a folder; name a file"),
        (["train", "curve", "log.jsonl", "--plot", str(missing)], "does not exist"),
    ]
    parser = build_parser()
    for argv, needle in refused:
        with pytest.raises(SystemExit) as stop:
            parser.parse_args(argv)
        assert stop.value.code == 2 and needle in capsys.readouterr().err, argv
    ok = parser.parse_args(["bench", "latency", "--out", str(adir), "--plot", str(adir / "new.png")])
    assert (ok.out, ok.plot) == (str(adir), str(adir / "new.png"))


def test_bench_latency_refuses_trees_past_the_context_window(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = ["bench", "latency", "--model", str(tiny_model_dir), "--prompts", "0", "--skip-hf", "--repeats", "1"]
    # the tiny model holds 64 positions; a 100,000-node tree was an out-of-memory kill before
    too_far = run_in_process(capsys, *common, "--ctx", "16", "--qs", "1,49")
    assert_one_line_error(too_far, "--ctx 16 with --qs 49 is 65 positions: more than the 64")
    fits = run_in_process(capsys, *common, "--ctx", "8", "--qs", "1,4")
    assert fits.returncode == 0 and "q=4" in fits.stdout, fits.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "--temperature", "nan"],
        ["data", "regenerate", "--source", "self", "--range", "0:1", "--out", "x", "--temperature", "inf"],
    ],
)
def test_a_temperature_that_is_no_number_is_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """NaN or infinity reached the sampler (a traceback in torch.multinomial) where only < 0 was checked."""
    assert_one_line_error(run_in_process(capsys, *argv), "--temperature must be a finite number >= 0")


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["tune", "--drafters", ""], "--drafters is empty"),  # the default set ran (minutes) before
        (["tune", "--drafters", ","], "--drafters is empty"),
        (["tune", "--prompts", "100"], "--prompts 100: 16 tuning prompts ship"),  # 16 ran before
        (["demo", "--methods", ""], "--methods is empty"),  # the default rows ran before
        (["train", "dart", "--data", "d", "--out", "o", "--new-data"], "--new-data goes with --resume"),
    ],
)
def test_tune_and_demo_refuse_what_they_cannot_measure(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert_one_line_error(run_in_process(capsys, *argv, "--model", "no-such-model"), needle)


def test_ngram_build_counts_text_and_refuses_to_write_an_empty_model(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dartspec.ngram import NgramModel

    (tmp_path / "words.txt").write_text("t2 t3 t4 t2 t3 t5 t2 t3 t4")
    (tmp_path / "empty.txt").write_text("")
    common = ["ngram", "build", "--model", str(tiny_model_dir), "--order", "3"]
    built = run_in_process(capsys, *common, "--text", str(tmp_path / "words.txt"), "--out", str(tmp_path / "ng.bin"))
    assert built.returncode == 0, built.stderr
    assert NgramModel.load(tmp_path / "ng.bin").order == 3
    empty = run_in_process(capsys, *common, "--text", str(tmp_path / "empty.txt"), "--out", str(tmp_path / "e.bin"))
    assert_one_line_error(empty, "no n-grams to count (0 tokens")  # an empty model, exit status 0, before
    assert not (tmp_path / "e.bin").exists()


def test_the_servers_listening_socket_gives_connections_without_nagles_delay() -> None:
    """``dartspec serve`` binds its socket itself and hands it to uvicorn: asyncio turns Nagle's algorithm off
    (TCP_NODELAY) only on connections whose socket says TCP, inherited from the listener. Without it every keep-alive
    request after the first waited ~40 ms for the client's delayed ACK (43 ms for GET /health, measured)."""
    import asyncio
    import socket

    from dartspec.cli import listen_socket

    async def accepted_nodelay() -> int:
        sock = listen_socket("127.0.0.1", 0)
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            conn = writer.get_extra_info("socket")
            seen.set_result(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(accepted, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname())
            value = await asyncio.wait_for(seen, 10)
            writer.close()
        return value

    assert asyncio.run(accepted_nodelay()) != 0
