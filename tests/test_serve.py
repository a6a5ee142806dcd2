"""The OpenAI-compatible server against real clients on loopback (tiny random model; one SmolLM2 test)."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import httpx
import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
from conftest import tiny_target  # noqa: E402

from dartspec import exact  # noqa: E402
from dartspec.bench.serve import local_server  # noqa: E402
from dartspec.drafters import NoDrafter, PromptLookupDrafter  # noqa: E402
from dartspec.engine import Generator  # noqa: E402
from dartspec.serve.app import create_app  # noqa: E402
from dartspec.serve.engine import ServeEngine, next_event  # noqa: E402

# (greeting: a variable a request may set with chat_template_kwargs)
TEMPLATE = (
    "{% if greeting is defined %}{{ greeting }} {% endif %}{% for m in messages %}{{ m['content'] }} {% endfor %}"
)


class SlowDrafter(NoDrafter):
    """Plain decoding that takes a while per step, so tests can catch a generation mid-way."""

    name = "slow"

    def propose(self, tokens, budget):
        time.sleep(0.02)
        return super().propose(tokens, budget)


def make_target():
    target = tiny_target("llama")
    target.tokenizer.chat_template = TEMPLATE
    return target


@contextmanager
def serving(drafter=None, *, target=None, **kw) -> Iterator[str]:
    target = target or make_target()
    engine = ServeEngine(
        Generator(target, drafter or PromptLookupDrafter(), tree_size=8),
        Generator(target, NoDrafter()),
        "tiny",
        max_queue=kw.pop("max_queue", 64),
        timeout_s=kw.pop("timeout_s", 60.0),
        max_batch=kw.pop("max_batch", 8),
    )
    with local_server(create_app(engine, **kw)) as u:
        yield u


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with serving() as u:
        yield u


def client(url: str, key: str = "none"):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def prompt(i: int) -> list[dict[str, str]]:
    # The tiny word-level tokenizer only round-trips single-digit names (t2..t9).
    return [{"role": "user", "content": " ".join(f"t{(i * 5 + j * (i % 3 + 1)) % 8 + 2}" for j in range(8))}]


def metric(url: str, name: str) -> float:
    """One unlabelled series of the server's /metrics."""
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise AssertionError(f"{name} is not in /metrics")


def wait_until(url: str, name: str, value: float, timeout: float = 30.0) -> None:
    """Wait for a gauge of /metrics to read ``value``: the server's own state, not a guess at how long it takes to
    get there (a loaded CI machine can take seconds)."""
    deadline = time.monotonic() + timeout
    while metric(url, name) != value:
        assert time.monotonic() < deadline, f"{name} never read {value}"
        time.sleep(0.02)


def stream_text(c, messages, **kw) -> str:
    parts = []
    for chunk in c.chat.completions.create(model="tiny", messages=messages, stream=True, temperature=0, **kw):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
    return "".join(parts)


def test_chat_stream_equals_non_stream(url: str) -> None:
    c = client(url)
    full = c.chat.completions.create(model="tiny", messages=prompt(1), max_tokens=24, temperature=0)
    assert full.choices[0].finish_reason in ("stop", "length") and full.choices[0].message.content
    assert full.usage.completion_tokens > 0
    extra = full.usage.model_extra["dartspec"]
    assert extra["target_forwards"] >= 1 and extra["tau"] >= 1.0
    assert stream_text(c, prompt(1), max_tokens=24) == full.choices[0].message.content


def test_completions_models_health_metrics(url: str) -> None:
    c = client(url)
    done = c.completions.create(model="tiny", prompt="t5 t6 t7 t5 t6 t7", max_tokens=10, temperature=0)
    assert done.choices[0].text and done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens
    assert [m.id for m in c.models.list().data] == ["tiny"]
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    metrics = httpx.get(f"{url}/metrics").text
    assert "dartspec_requests_total" in metrics and "dartspec_completion_tokens_total" in metrics
    assert "dartspec_depth_accepted_total" in metrics


def test_twenty_concurrent_streams_match_single_requests(url: str) -> None:
    c = client(url)
    single = [stream_text(c, prompt(i), max_tokens=16) for i in range(20)]
    with ThreadPoolExecutor(20) as pool:
        together = list(pool.map(lambda i: stream_text(client(url), prompt(i), max_tokens=16), range(20)))
    assert together == single


def step_batch_sizes(url: str) -> dict[str, float]:
    """The server's step batch-size histogram's sum and count so far."""
    return {
        line.split()[0]: float(line.split()[1])
        for line in httpx.get(f"{url}/metrics").text.splitlines()
        if line.startswith(("dartspec_step_batch_size_sum", "dartspec_step_batch_size_count"))
    }


def test_requests_decode_together_and_one_leaving_disturbs_no_other() -> None:
    with serving(SlowDrafter(), max_batch=4) as u:
        c = client(u)
        alone = [stream_text(c, prompt(i), max_tokens=40) for i in range(3)]
        before = step_batch_sizes(u)
        chat = f"{u}/v1/chat/completions"
        with ThreadPoolExecutor(3) as pool, httpx.Client(timeout=30) as h:
            body = {"messages": prompt(7), "max_tokens": 400, "temperature": 0, "stream": True}
            with h.stream("POST", chat, json=body) as leaving:
                lines = leaving.iter_lines()
                assert next(lines).startswith("data: ")  # decoding now; the others join it mid-generation
                others = [pool.submit(stream_text, client(u), prompt(i), max_tokens=40) for i in range(3)]
                time.sleep(0.3)
            # The first stream is closed mid-generation: it leaves the batch, the others go on undisturbed.
            assert [f.result() for f in others] == alone
        metrics = httpx.get(f"{u}/metrics").text
        assert "dartspec_cancelled_requests_total 1.0" in metrics and "dartspec_in_flight 0.0" in metrics
        after = step_batch_sizes(u)
        # The steps since the lone requests ran with several requests at once: their mean batch size is well above
        # one. (Counted since then: with the lone requests' 120 steps of one in the mean, three requests decoding
        # together gave exactly 1.5, so a slow host that closed the leaving stream early failed a `> 1.5`.)
        steps = after["dartspec_step_batch_size_count"] - before["dartspec_step_batch_size_count"]
        rows = after["dartspec_step_batch_size_sum"] - before["dartspec_step_batch_size_sum"]
        assert steps > 0 and rows / steps > 1.5


HI = [{"role": "user", "content": "t5"}]


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        ("chat/completions", {"messages": HI, "max_tokens": "ten"}, "max_tokens", "valid integer"),
        ("chat/completions", {"messages": HI, "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ("chat/completions", {"messages": HI, "temperature": "hot"}, "temperature", "valid number"),
        ("chat/completions", {"messages": HI, "temperature": -1}, "temperature", "between 0 and 2"),
        ("chat/completions", {"messages": HI, "top_p": 0}, "top_p", "top_p must be in (0, 1]"),
        ("chat/completions", {"messages": HI, "top_p": 1.5}, "top_p", "top_p must be in (0, 1]"),
        ("chat/completions", {"messages": HI, "seed": 1.5}, "seed", "valid integer"),
        ("chat/completions", {"messages": HI, "stop": 123}, "stop", "valid string"),
        ("chat/completions", {"messages": HI, "stream": "yes"}, "stream", "valid boolean"),
        ("chat/completions", {"messages": HI, "n": 9}, "n", "less than or equal to 8"),
        ("chat/completions", {"messages": HI, "n": 0}, "n", "greater than or equal to 1"),
        ("completions", {"prompt": "t5", "n": 2, "seed": 2**63 - 1}, "seed", "with n=2 the seed must be at most"),
        ("chat/completions", {"messages": [{"role": "wizard", "content": "t5"}]}, "messages.0.role", "Input should be"),
        ("chat/completions", {"messages": []}, "messages", "at least 1"),
        ("chat/completions", {"messages": [{"role": "user", "content": "t5 " * 600}]}, "messages", "context window"),
        ("completions", {"prompt": "t5 " * 600}, "prompt", "context window of 512 tokens"),
        # A limit the context cannot hold is refused (OpenAI's and vLLM's answer), not cut silently
        ("completions", {"prompt": "t5", "max_tokens": 512}, "max_tokens", "513 were asked for (1 in the prompt"),
        ("chat/completions", {"messages": HI, "max_completion_tokens": 9999}, "max_completion_tokens", "at most"),
        ("completions", {"prompt": "t5", "max_tokens": 0}, "max_tokens", "scores the prompt with echo"),
        ("completions", {"prompt": "t5", "prompt_logprobs": 21}, "prompt_logprobs", "less than or equal to 20"),
        ("completions", {"prompt": ["t5"] * 9, "n": 8}, "prompt", "at most 64 answers a request (prompts x n)"),
        ("completions", {"prompt": ["t5", ""]}, "prompt", "must not be empty"),
        ("completions", {"prompt": [[5], [96]]}, "prompt", "96"),
        ("chat/completions", {"messages": HI, "echo": True}, "echo", "echo is not supported"),
        ("completions", {"prompt": "t5", "suffix": "t6"}, "suffix", "tiny-llama has no fill-in-the-middle tokens"),
        ("completions", {"prompt": "t5", "suffix": "t6", "echo": True}, "suffix", "echo cannot be combined"),
        ("completions", {"prompt": "t5", "best_of": 3}, "best_of", "only best_of = n, here 1"),
        ("chat/completions", {"messages": HI, "functions": [{"name": "f"}]}, "functions", "send tools and"),
        ("chat/completions", {"messages": HI, "function_call": "auto"}, "function_call", "deprecated"),
        ("chat/completions", {"messages": HI, "stop_token_ids": [96]}, "stop_token_ids", "96 is no token id of tiny"),
        ("completions", {"prompt": "t5", "allowed_token_ids": [5, 96]}, "allowed_token_ids", "token 96, outside"),
        ("completions", {"prompt": "t5", "allowed_token_ids": []}, "allowed_token_ids", "non-empty list"),
        ("completions", {"prompt": "t5", "use_beam_search": True}, "use_beam_search", "not supported"),
        ("completions", {"prompt": "t5", "bad_words": ["t6", " "]}, "bad_words", "non-empty strings"),
        ("completions", {"prompt": "t5", "bad_words": ["t6"], "guided_choice": ["t6"]}, "bad_words", "structured"),
        ("chat/completions", {"messages": HI, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "set by"),
        ("chat/completions", {"messages": HI, "chat_template_kwargs": {"a b": 1}}, "chat_template_kwargs", "no templ"),
        ("chat/completions", {"messages": HI, "continue_final_message": True}, "continue_final_message", "assistant's"),
        (
            "chat/completions",
            {"messages": HI, "continue_final_message": True, "add_generation_prompt": True},
            "continue_final_message",
            "cannot both be true",
        ),
        ("chat/completions", {"messages": HI, "skip_special_tokens": 0}, "skip_special_tokens", "valid boolean"),
        ("completions", {"prompt": ""}, "prompt", "must not be empty"),
        ("completions", {"prompt": []}, "prompt", "must not be empty"),
        ("completions", {"prompt": [5, 96]}, "prompt", "96 is no token id of tiny (0-95)"),
        ("completions", {}, "prompt", "Field required"),
        ("chat/completions", {"messages": HI, "seed": 2**70}, "seed", "less than or equal to"),
        ("chat/completions", {"messages": HI, "stop": "x" * 300}, "stop", "at most 256 characters"),
        ("completions", {"prompt": "t5", "stop": ["x"] * 33}, "stop", "at most 32 stop sequences, got 33"),
        ("chat/completions", {"messages": HI * 300}, "messages", "at most 256 items"),
        ("chat/completions", {"messages": HI, "presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
        ("chat/completions", {"messages": HI, "frequency_penalty": -3}, "frequency_penalty", "greater than or equal"),
        ("chat/completions", {"messages": HI, "repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
        ("chat/completions", {"messages": HI, "logit_bias": {"t5": 10}}, "logit_bias", "keys must be token ids"),
        ("chat/completions", {"messages": HI, "logit_bias": {"5": 101}}, "logit_bias", "from -100 to 100"),
        ("completions", {"prompt": "t5", "logit_bias": {"96": 1}}, "logit_bias", "outside tiny's vocabulary (0-95)"),
        ("chat/completions", {"messages": HI, "logit_bias": {"5": "up"}}, "logit_bias.5", "valid number"),
        ("chat/completions", {"messages": HI, "top_k": -2}, "top_k", "greater than or equal to -1"),
        ("completions", {"prompt": "t5", "min_p": 1.5}, "min_p", "less than or equal to 1"),
        ("completions", {"prompt": "t5", "min_tokens": -1}, "min_tokens", "greater than or equal to 0"),
        ("completions", {"prompt": "t5", "ignore_eos": "yes"}, "ignore_eos", "valid boolean"),
        (
            "completions",
            {"prompt": "t5", "min_tokens": 3, "response_format": {"type": "json_object"}},
            "min_tokens",
            "cannot be combined with a structured answer",
        ),
        # What the server does not implement is refused, not ignored (the text would not be what was asked for).
        ("chat/completions", {"messages": HI, "top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
        ("chat/completions", {"messages": HI, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or"),
        ("chat/completions", {"messages": HI, "logprobs": 3}, "logprobs", "valid boolean"),
        ("completions", {"prompt": "t5", "logprobs": 6}, "logprobs", "less than or equal to 5"),
        ("completions", {"prompt": "t5", "logprobs": True}, "logprobs", "valid integer"),
        ("chat/completions", {"messages": HI, "tools": [{"type": "function"}]}, "tools.0.function", "Field required"),
        ("chat/completions", {"messages": HI, "response_format": {"type": "json_schema"}}, "response_format", "needs"),
        ("chat/completions", {"messages": HI, "response_format": {"type": "grammar"}}, "response_format", "not supp"),
        (
            "chat/completions",
            {
                "messages": HI,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(a)\\1"}},
                },
            },
            "response_format",
            "backreferences are not supported",
        ),
        ("chat/completions", {"messages": HI, "response_format": {"type": "json_object"}}, None, "no token of the"),
        ("completions", {"prompt": "t5", "guided_regex": "(?=a)"}, "guided_regex", "lookahead and lookbehind"),
        ("completions", {"prompt": "t5", "guided_choice": []}, "guided_choice", "at least 1 item"),
        (
            "completions",
            {"prompt": "t5", "structured_outputs": {"grammar": "x"}},
            "structured_outputs.grammar",
            "Extra",
        ),
        (
            "completions",
            {"prompt": "t5", "structured_outputs": {"regex": "a\\b"}},
            "structured_outputs.regex",
            "word boundaries",
        ),
        (
            "completions",
            {"prompt": "t5", "guided_choice": ["a"], "response_format": {"type": "json_object"}},
            "guided_choice",
            "response_format and guided_choice exclude each other",
        ),
        (
            "completions",
            {"prompt": "t5", "guided_json": {"type": "object", "dependentRequired": {"a": ["b"]}}},
            "guided_json",
            "'dependentRequired' is not supported",
        ),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages.0.content",
            "only text content parts",
        ),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages.0.content",
            "needs a 'text' string",
        ),
        ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content", "list of text"),
    ],
)
def test_bad_input_is_a_400_in_openai_shape(url: str, path: str, body: dict, param: str, message: str) -> None:
    r = httpx.post(f"{url}/v1/{path}", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert message in err.pop("message")
    assert err == {"type": "invalid_request_error", "param": param, "code": "invalid_request"}


def test_content_parts_developer_role_and_defaults_of_unsupported_fields_are_accepted(url: str) -> None:
    """Newer OpenAI clients send content as text parts, the system prompt as role "developer", and unsupported fields
    at their defaults: the same answer as the plain form."""
    plain = {"messages": [{"role": "system", "content": "t7 t8"}, {"role": "user", "content": "t5 t6"}]}
    parts = {
        "messages": [
            {"role": "developer", "content": [{"type": "text", "text": "t7 t8"}]},
            {"role": "user", "content": [{"type": "text", "text": "t5"}, {"type": "text", "text": " t6"}]},
        ],
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "logprobs": False,
        "logit_bias": {},
        "tools": [],
        "response_format": {"type": "text"},
        "stream_options": {"include_usage": True},
        "user": "someone",
    }
    answers = [
        httpx.post(f"{url}/v1/chat/completions", json={**body, "max_tokens": 8, "temperature": 0}).json()
        for body in (plain, parts)
    ]
    assert answers[0]["choices"][0]["message"] == answers[1]["choices"][0]["message"]
    assert answers[0]["usage"]["prompt_tokens"] == answers[1]["usage"]["prompt_tokens"]


def test_chat_template_kwargs_reach_the_template(url: str) -> None:
    """vLLM's chat_template_kwargs (e.g. Qwen3's enable_thinking) are variables of the chat template: here one that
    puts a word before the conversation, so the answer is the completion of that text."""
    body = {"messages": [{"role": "user", "content": "t5 t6"}], "max_tokens": 8, "temperature": 0}
    greeted = httpx.post(f"{url}/v1/chat/completions", json={**body, "chat_template_kwargs": {"greeting": "t9"}})
    plain = httpx.post(f"{url}/v1/chat/completions", json=body).json()
    completion = httpx.post(f"{url}/v1/completions", json={"prompt": "t9 t5 t6 ", "max_tokens": 8, "temperature": 0})
    assert greeted.json()["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] + 1
    assert greeted.json()["choices"][0]["message"]["content"] == completion.json()["choices"][0]["text"]


def test_legacy_completion_fields_at_their_defaults_and_a_limit_that_fills_the_context_are_accepted(url: str) -> None:
    """echo false, an empty suffix, best_of = n and vLLM's fields at their defaults change nothing (refused otherwise,
    above); a max_tokens that just fits the context window is run, not refused."""
    body = {"prompt": "t5 t6 t7", "max_tokens": 8, "temperature": 0}
    legacy = {**body, "echo": False, "suffix": "", "best_of": 1, "stop_token_ids": [], "skip_special_tokens": True}
    texts = [httpx.post(f"{url}/v1/completions", json=b).json()["choices"][0]["text"] for b in (body, legacy)]
    assert texts[0] == texts[1]
    fits = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 512 - 3, "ignore_eos": True}, timeout=120)
    assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] == 512 - 3, fits.text


def test_tokenize_and_detokenize_as_vllm_serves_them(url: str) -> None:
    """vLLM's /tokenize gives the ids a completion or a chat request decodes from (the chat's prompt_tokens), with
    chat_template_kwargs too; /detokenize gives the text back; bad input is a 400 naming the field."""
    target = make_target()
    got = httpx.post(f"{url}/tokenize", json={"model": "tiny", "prompt": "t5 t6 t7"}).json()
    assert got == {"count": 3, "max_model_len": 512, "tokens": target.encode("t5 t6 t7")}
    messages = [{"role": "user", "content": "t5 t6"}]
    chat = httpx.post(f"{url}/tokenize", json={"messages": messages}).json()
    answer = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "max_tokens": 2}).json()
    assert chat["tokens"] == target.encode_chat(messages) and chat["count"] == answer["usage"]["prompt_tokens"]
    greeted = httpx.post(f"{url}/tokenize", json={"messages": messages, "chat_template_kwargs": {"greeting": "t9"}})
    assert greeted.json()["tokens"] == target.encode("t9") + chat["tokens"]
    back = httpx.post(f"{url}/detokenize", json={"tokens": got["tokens"]}).json()
    assert back == {"prompt": "t5 t6 t7"}
    # A completion's prompt may be those token ids (OpenAI's array of tokens): the text's answer
    answers = [
        httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0}).json()
        for prompt in ("t5 t6 t7", got["tokens"])
    ]
    assert answers[0]["choices"][0]["text"] == answers[1]["choices"][0]["text"]
    assert answers[0]["usage"]["prompt_tokens"] == answers[1]["usage"]["prompt_tokens"] == 3
    for path, body, param, message in [
        ("tokenize", {}, None, "give either prompt or messages"),
        ("tokenize", {"prompt": "t5", "messages": messages}, None, "give either prompt or messages"),
        ("tokenize", {"messages": messages, "chat_template_kwargs": {"tools": 1}}, "chat_template_kwargs", "set by"),
        ("detokenize", {"tokens": [5, 96]}, "tokens", "96 is no token id of tiny (0-95)"),
        ("detokenize", {"tokens": "t5"}, "tokens", "valid list"),
    ]:
        r = httpx.post(f"{url}/{path}", json=body)
        assert r.status_code == 400 and message in r.json()["error"]["message"], (path, body, r.text)
        assert param is None or r.json()["error"]["param"] == param
    assert httpx.post(f"{url}/tokenize", json={"model": "gpt-5", "prompt": "t5"}).status_code == 404


def test_penalties_and_logit_bias_give_the_engines_answer(url: str) -> None:
    """OpenAI's presence / frequency penalties and logit_bias, and vLLM's repetition_penalty (an extra field), whole
    and streamed, greedy and seeded with two choices: the tokens the engine gives for the same settings."""
    target = make_target()  # the same weights as the server's
    ids = target.encode_chat(prompt(2))
    settings = dict(presence_penalty=0.4, frequency_penalty=0.8, repetition_penalty=1.3, logit_bias={6: -100, 7: 3.5})
    plain = Generator(target).generate(ids, max_new_tokens=12).token_ids
    api = client(url)
    body = dict(
        model="tiny",
        messages=prompt(2),
        max_tokens=12,
        presence_penalty=0.4,
        frequency_penalty=0.8,
        logit_bias={"6": -100, "7": 3.5},
        extra_body={"repetition_penalty": 1.3},
        logprobs=True,
    )
    for temperature, n in ((0.0, 1), (0.9, 2)):
        want = [
            Generator(target).generate(ids, max_new_tokens=12, temperature=temperature, seed=5 + i, **settings)
            for i in range(n)
        ]
        got = api.chat.completions.create(**body, temperature=temperature, seed=5, n=n)
        tokens = [[target.vocab[lp.token] for lp in c.logprobs.content] for c in got.choices]
        assert tokens == [w.token_ids for w in want]
        assert all(6 not in t for t in tokens)
        streamed = [[], []]
        for chunk in api.chat.completions.create(**body, temperature=temperature, seed=5, n=n, stream=True):
            for c in chunk.choices:
                streamed[c.index] += [target.vocab[lp.token] for lp in (c.logprobs.content if c.logprobs else [])]
        assert streamed[:n] == tokens
        if temperature == 0:
            assert tokens[0] != plain  # the settings changed the answer (else the test could not fail)
    # vLLM's allowed_token_ids: only those tokens (the engine's answer under the same restriction)
    allowed = [5, 8, 9, 12]
    want = Generator(target).generate(ids, max_new_tokens=12, temperature=0.9, seed=2, allowed_token_ids=allowed)
    got = api.chat.completions.create(
        model="tiny", messages=prompt(2), max_tokens=12, temperature=0.9, seed=2, logprobs=True,
        extra_body={"allowed_token_ids": allowed},
    )  # fmt: skip
    assert [target.vocab[lp.token] for lp in got.choices[0].logprobs.content] == want.token_ids
    assert set(want.token_ids) <= set(allowed) and len(want.token_ids) == 12


GUIDED_REGEX = "(ab|c)+[0-9]?"
GUIDED_CHOICE = ["cat", "ab", "12"]


@pytest.mark.parametrize(
    "kind",
    [
        "json_object",
        "json_schema",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "structured_json",
        "structured_choice",
    ],
)
def test_json_answers_are_the_engines(kind: str) -> None:
    """response_format json_object and json_schema, vLLM's guided_json, guided_regex and guided_choice, whole and
    streamed, greedy and seeded: the engine's constrained tokens (a tiny vocabulary of JSON pieces,
    tests/test_constraint.py)."""
    from test_constraint import EOS, SCHEMA, fake_decode, texts

    from dartspec.json_grammar import Grammar

    target = make_target()
    target.__dict__["token_texts"] = texts()
    ids = target.encode("t5 t6 t7")
    fmt: Any = {
        "json_object": kind,
        "json_schema": SCHEMA,
        "guided_json": SCHEMA,
        "guided_regex": Grammar.regex(GUIDED_REGEX),
        "guided_choice": Grammar.choice(GUIDED_CHOICE),
        "structured_json": SCHEMA,
        "structured_choice": Grammar.choice(GUIDED_CHOICE),
    }[kind]
    with serving(target=target) as u:
        for temperature in (0.0, 0.9):
            want = Generator(target).generate(
                ids, max_new_tokens=16, temperature=temperature, seed=2, response_format=fmt
            )
            body = {"prompt": "t5 t6 t7", "max_tokens": 16, "temperature": temperature, "seed": 2, "logprobs": 0}
            if kind.startswith("json"):
                body["response_format"] = {"type": kind}
            if kind == "json_schema":
                body["response_format"]["json_schema"] = {"name": "answer", "schema": SCHEMA, "strict": True}
            body |= {
                "guided_json": {"guided_json": SCHEMA},
                "guided_regex": {"guided_regex": GUIDED_REGEX},
                "guided_choice": {"guided_choice": GUIDED_CHOICE},
                "structured_json": {"structured_outputs": {"json": SCHEMA}},  # vLLM's fields since v0.12
                "structured_choice": {"structured_outputs": {"choice": GUIDED_CHOICE}},
            }.get(kind, {})
            got = httpx.post(f"{u}/v1/completions", json=body, timeout=60).json()
            tokens = [target.vocab[t] for t in got["choices"][0]["logprobs"]["tokens"]]
            assert tokens == want.token_ids
            text = fake_decode([t for t in tokens if t != EOS])
            if kind == "guided_regex":  # whole where it ended, else cut by max_tokens
                assert re.fullmatch(GUIDED_REGEX, text) or tokens[-1] != EOS, text
                assert re.fullmatch(r"(ab|c)*a?", text) or re.fullmatch(GUIDED_REGEX, text), text  # a live prefix
            elif kind.endswith("_choice"):
                assert tokens[-1] == EOS and text in GUIDED_CHOICE, text
            else:
                assert text.startswith("{")
            with httpx.stream("POST", f"{u}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
                chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
            pieces = [(ch.get("logprobs") or {}).get("tokens", []) for c in chunks for ch in c["choices"]]
            streamed = [target.vocab[t] for piece in pieces for t in piece]
            assert streamed == tokens


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "sum",
            "description": "adds",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    },
    {"type": "function", "function": {"name": "now"}},  # no parameters: {} arguments
]


@pytest.mark.parametrize(
    ("choice", "parallel", "lean"),
    [
        ("required", True, 0),
        ("required", False, 0),
        ({"type": "function", "function": {"name": "sum"}}, False, 0),
        ("auto", True, 100),  # the model leaning to "{": it calls
        (None, False, 100),  # (None: left out, "auto")
    ],
)
def test_tool_calls_are_the_engines_constrained_answer(choice: Any, parallel: bool, lean: int) -> None:
    """tool_choice "required", a named function or "auto": the answer is the engine's, decoded under the grammar of
    a call (or text), with the functions described in the system message; a call comes back as OpenAI's tool_calls
    (whole and streamed), and a conversation holding those calls and their results renders them as JSON in the shape
    the model answered with."""
    from test_constraint import PIECES, fake_decode, texts

    from dartspec.serve.schema import ChatRequest
    from dartspec.serve.tools import call_grammar, with_tools

    target = make_target()
    target.__dict__["token_texts"] = texts()
    target.__dict__["decode"] = fake_decode  # the server's text is what the fake pieces spell
    messages = [{"role": "system", "content": "t5"}, {"role": "user", "content": "t6 t7"}]
    body = {"messages": messages, "tools": TOOLS, "parallel_tool_calls": parallel}
    if choice is not None:
        body["tool_choice"] = choice
    spaces = {str(PIECES.index(w)): -100 for w in (" ", "\n", "\t", "\n  ", "  ")}  # a random model pads forever
    if lean:
        spaces[str(PIECES.index("{"))] = lean
    body |= {"max_tokens": 60, "temperature": 0.9, "seed": 5, "logit_bias": spaces}
    req = ChatRequest(**body)
    rendered = with_tools(messages, req)
    assert rendered[0]["content"].startswith("t5\n\nYou can call these functions") and len(rendered) == 2
    schema = call_grammar(req)
    bias = {int(t): b for t, b in spaces.items()}
    want = Generator(target).generate(
        target.encode_chat(rendered),
        max_new_tokens=60,
        temperature=0.9,
        seed=5,
        response_format=schema,
        logit_bias=bias,
    )
    assert want.finish_reason == "stop", want.text  # a whole call within the limit (else the test proves little)
    value = json.loads(want.text)
    calls = value if isinstance(value, list) else [value]
    assert parallel or isinstance(value, dict)
    named = [(c["name"], c["arguments"]) for c in calls]
    with serving(target=target) as u:
        got = httpx.post(f"{u}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
        assert got["finish_reason"] == "tool_calls" and got["message"]["content"] is None
        made = got["message"]["tool_calls"]
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in made] == named
        assert all(c["type"] == "function" and c["id"].startswith("call_") for c in made)
        if isinstance(choice, dict):
            assert {name for name, _ in named} == {"sum"}
        with httpx.stream("POST", f"{u}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert not any(d.get("content") for d in deltas)  # the call comes whole, never as text
        streamed = [tc for d in deltas for tc in d.get("tool_calls", [])]
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in streamed] == named
        assert [c["index"] for c in streamed] == list(range(len(named)))
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        # The calls and a result sent back: the prompt renders them as the answer's own text.
        turn = [*messages, {"role": "assistant", "content": None, "tool_calls": made}]
        turn.append({"role": "tool", "tool_call_id": made[0]["id"], "content": "t9"})
        again = {**body, "messages": turn, "tool_choice": "none", "max_tokens": 3, "logprobs": True}
        got = httpx.post(f"{u}/v1/chat/completions", json=again, timeout=60).json()
        answered = json.dumps(calls if len(calls) > 1 else calls[0], ensure_ascii=False)  # the calls' JSON
        said = ChatRequest(**{**body, "messages": turn}).messages[-2].as_chat()
        assert said == {"role": "assistant", "content": answered}  # (this tokenizer reads JSON as unknown words)
        history = [*messages, {"role": "assistant", "content": answered}, {"role": "tool", "content": "t9"}]
        prompt = target.encode_chat(with_tools(history, ChatRequest(**again)))
        assert got["usage"]["prompt_tokens"] == len(prompt)
        assert got["choices"][0]["message"]["content"] == fake_decode(
            Generator(target).generate(prompt, max_new_tokens=3, temperature=0.9, seed=5, logit_bias=bias).token_ids
        )


def test_with_tool_choice_auto_a_text_answer_streams_as_text() -> None:
    """ "auto" and an answer that does not start as JSON: the engine's text under the same grammar (it ends where the
    model ends it), whole and streamed as content, with no tool_calls."""
    from test_constraint import PIECES, fake_decode, texts

    from dartspec.serve.schema import ChatRequest
    from dartspec.serve.tools import call_grammar, with_tools

    target = make_target()
    target.__dict__["token_texts"] = texts()
    target.__dict__["decode"] = fake_decode
    messages = [{"role": "user", "content": "t6 t7"}]
    away = {PIECES.index("{"): -100, PIECES.index("["): -100}  # the model leaning away from a call
    body = {"messages": messages, "tools": TOOLS, "max_tokens": 30, "temperature": 0.9, "seed": 3}
    body["logit_bias"] = {str(t): b for t, b in away.items()}
    req = ChatRequest(**body)
    prompt = target.encode_chat(with_tools(messages, req))
    want = Generator(target).generate(
        prompt, max_new_tokens=30, temperature=0.9, seed=3, response_format=call_grammar(req), logit_bias=away
    )
    assert want.text and not want.text.startswith(("{", "["))
    with serving(target=target) as u:
        got = httpx.post(f"{u}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
        assert got["message"] == {"role": "assistant", "content": want.text}
        assert got["finish_reason"] == want.finish_reason
        with httpx.stream("POST", f"{u}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert "".join(d.get("content", "") for d in deltas) == want.text
        assert not any("tool_calls" in d for d in deltas)


def test_tool_requests_the_server_cannot_honour_are_400s_naming_the_field(url: str) -> None:
    base = {"messages": HI, "tools": TOOLS}
    cases = [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope', which is not"),
        ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools.1.function.name", "two tools are named"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "object", "dependentRequired": {"a": ["b"]}}},
                    }
                ],
                "tool_choice": "required",
            },
            "tools.0.function.parameters",
            "'dependentRequired' is not supported",
        ),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
            "cannot be combined",
        ),
        ({"response_format": {"type": "json_object"}}, "response_format", 'tool_choice "none" can'),
        ({"tools": None, "tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name", "pattern"),
        (
            {"tool_choice": "none", "messages": [{"role": "assistant", "content": None}]},
            "messages.0",
            "null only for an assistant message with tool_calls",
        ),
        (
            {
                "tool_choice": "none",
                "messages": [
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"id": "c", "function": {"name": "sum", "arguments": "{"}}],
                    }
                ],
            },
            None,
            "its arguments are not JSON",
        ),
    ]
    for extra, param, message in cases:
        r = httpx.post(f"{url}/v1/chat/completions", json={**base, **extra}, timeout=30)
        assert r.status_code == 400, (extra, r.text)
        error = r.json()["error"]
        assert message in error["message"] and error["param"] == param, (extra, error)


def test_top_k_and_min_p_give_the_engines_answer(url: str) -> None:
    """vLLM's top_k (-1 = off) and min_p: a seeded sampled completion is the engine's for the same settings."""
    target = make_target()
    ids = target.encode("t5 t6 t7")
    for top_k, min_p in ((3, 0.0), (0, 0.8), (-1, 0.9)):
        body = {"prompt": "t5 t6 t7", "max_tokens": 10, "temperature": 1.5, "seed": 3, "top_k": top_k, "min_p": min_p}
        got = httpx.post(f"{url}/v1/completions", json={**body, "logprobs": 0}, timeout=60).json()
        tokens = [target.vocab[t] for t in got["choices"][0]["logprobs"]["tokens"]]
        want = Generator(target).generate(
            ids, max_new_tokens=10, temperature=1.5, seed=3, top_k=max(top_k, 0), min_p=min_p
        )
        assert tokens == want.token_ids
    free = Generator(target).generate(ids, max_new_tokens=10, temperature=1.5, seed=3).token_ids
    for changed in (dict(top_k=3), dict(min_p=0.8)):  # each setting changes the answer (else the test could not fail)
        assert free != Generator(target).generate(ids, max_new_tokens=10, temperature=1.5, seed=3, **changed).token_ids


def test_min_tokens_and_ignore_eos_give_the_engines_answer(url: str) -> None:
    """vLLM's min_tokens and ignore_eos: with EOS made likely by a logit bias, the engine's tokens for the same
    settings (which differ from the request without them)."""
    target = make_target()
    ids = target.encode("t5 t6 t7")
    body = {"prompt": "t5 t6 t7", "max_tokens": 12, "temperature": 0, "logprobs": 0, "logit_bias": {"1": 4}}
    answers = []
    for extra in ({}, {"min_tokens": 6}, {"ignore_eos": True}):
        got = httpx.post(f"{url}/v1/completions", json={**body, **extra}, timeout=60).json()
        tokens = [target.vocab[t] for t in got["choices"][0]["logprobs"]["tokens"]]
        want = Generator(target).generate(ids, max_new_tokens=12, logit_bias={1: 4}, **extra)
        assert tokens == want.token_ids and got["choices"][0]["finish_reason"] == want.finish_reason
        answers.append(tokens)
    assert len(answers[0]) < len(answers[1]) and len(answers[2]) == 12  # each setting changed the answer
    # vLLM's truncate_prompt_tokens: the prompt's last k tokens alone (the usage counts them)
    cut = httpx.post(f"{url}/v1/completions", json={**body, "prompt": "t9 t8 t5 t6 t7", "truncate_prompt_tokens": 3})
    assert [target.vocab[t] for t in cut.json()["choices"][0]["logprobs"]["tokens"]] == answers[0]
    assert cut.json()["usage"]["prompt_tokens"] == 3
    stop = answers[2][4]  # vLLM's stop_token_ids: the answer cut after the first of them, kept
    extra = {"ignore_eos": True, "stop_token_ids": [stop]}
    got = httpx.post(f"{url}/v1/completions", json={**body, **extra}, timeout=60).json()["choices"][0]
    assert [target.vocab[t] for t in got["logprobs"]["tokens"]] == answers[2][: answers[2].index(stop) + 1]
    assert got["finish_reason"] == "stop"


def test_logprobs_are_the_engines_in_openais_shapes(url: str) -> None:
    """Chat (``logprobs`` + ``top_logprobs``) and completions (``logprobs: N``), whole and streamed: the values the
    engine gives for the same prompt (which tests/test_logprobs.py checks against transformers' forward)."""
    target = make_target()  # the same weights as the server's
    ids = target.encode_chat(prompt(4))
    want = Generator(target).generate(ids, max_new_tokens=10, logprobs=2)

    def text(token: int) -> str:
        return target.tokenizer.decode([token], skip_special_tokens=False)

    api = client(url)
    whole = api.chat.completions.create(
        model="tiny", messages=prompt(4), max_tokens=10, temperature=0, logprobs=True, top_logprobs=2
    )
    content = whole.choices[0].logprobs.content
    assert [c.token for c in content] == [text(lp.token_id) for lp in want.logprobs]
    assert [c.logprob for c in content] == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-9)
    assert [[t.token for t in c.top_logprobs] for c in content] == [
        [text(t) for t, _ in lp.top] for lp in want.logprobs
    ]
    assert all(c.bytes == list(c.token.encode()) for c in content)
    streamed = api.chat.completions.create(
        model="tiny", messages=prompt(4), max_tokens=10, temperature=0, logprobs=True, top_logprobs=2, stream=True
    )
    parts = [c for chunk in streamed for choice in chunk.choices if choice.logprobs for c in choice.logprobs.content]
    assert [p.model_dump() for p in parts] == [c.model_dump() for c in content]
    assert api.chat.completions.create(model="tiny", messages=prompt(4), max_tokens=4).choices[0].logprobs is None

    def ask(i: int) -> list[float]:
        out = api.chat.completions.create(model="tiny", messages=prompt(i), max_tokens=10, temperature=0, logprobs=True)
        return [c.logprob for c in out.choices[0].logprobs.content]

    with ThreadPoolExecutor(4) as pool:  # decoded together in batched steps: each its own numbers
        together = list(pool.map(ask, range(4)))
    assert together == [pytest.approx(ask(i), abs=1e-9) for i in range(4)]
    # The legacy completions shape
    plain = target.encode("t5 t6 t7")
    want = Generator(target).generate(plain, max_new_tokens=6, logprobs=1)
    body = {"prompt": "t5 t6 t7", "max_tokens": 6, "temperature": 0, "logprobs": 1}
    done = httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert done["tokens"] == [text(lp.token_id) for lp in want.logprobs]
    assert done["token_logprobs"] == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-9)
    assert done["top_logprobs"] == [{text(t): pytest.approx(v, abs=1e-9) for t, v in lp.top} for lp in want.logprobs]
    lengths = [len(t) for t in done["tokens"]]
    assert done["text_offset"] == [sum(lengths[:i]) for i in range(len(lengths))]
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    pieces = [e["choices"][0]["logprobs"] for e in events if e["choices"][0].get("logprobs")]
    joined = {k: [x for piece in pieces for x in piece[k]] for k in done}
    assert joined == done


def test_echo_and_prompt_logprobs_score_the_prompt_as_transformers_does(url: str) -> None:
    """A completion's ``echo`` (with ``logprobs``, ``max_tokens`` 0 included: OpenAI's legacy way to score a text,
    and what lm-evaluation-harness's local-completions sends, a batch of token-id prompts with ``max_tokens`` 1) and
    vLLM's ``prompt_logprobs``, whole and streamed: the prompt's tokens' log-probabilities are transformers' forward
    over the prompt, and the answer the one a plain request gets."""
    target = make_target()  # the same weights as the server's

    def text(token: int) -> str:
        return target.tokenizer.decode([token], skip_special_tokens=False)

    def scored(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = target.model(torch.tensor([ids])).logits[0].double()
        return torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]

    prompt_text = "t5 t6 t7 t8 t5 t6"
    ids = target.encode(prompt_text)
    want = Generator(target).generate(ids, max_new_tokens=4, logprobs=2)
    body = {"prompt": prompt_text, "max_tokens": 4, "temperature": 0, "logprobs": 2, "echo": True}
    got = httpx.post(f"{url}/v1/completions", json=body).json()
    choice = got["choices"][0]
    assert choice["text"] == prompt_text + want.text
    lp = choice["logprobs"]
    assert lp["tokens"] == [text(t) for t in ids + want.token_ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1 : len(ids)] == pytest.approx(scored(ids).tolist(), abs=1e-5)
    assert lp["token_logprobs"][len(ids) :] == pytest.approx([x.logprob for x in want.logprobs], abs=1e-9)
    assert all(len(top) == 2 for top in lp["top_logprobs"][1:])
    lengths = [len(t) for t in lp["tokens"]]
    assert lp["text_offset"] == [sum(lengths[:i]) for i in range(len(lengths))]
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events) == choice["text"]
    pieces = [e["choices"][0]["logprobs"] for e in events if e["choices"][0].get("logprobs")]
    assert {k: [x for piece in pieces for x in piece[k]] for k in lp} == lp
    # Scoring alone: max_tokens 0 answers the prompt's text and its tokens' log-probabilities (whole and streamed)
    bare = httpx.post(f"{url}/v1/completions", json={"prompt": prompt_text, "max_tokens": 0, "echo": True}).json()
    assert bare["choices"][0]["text"] == prompt_text and bare["choices"][0]["logprobs"] is None
    # A prompt of token ids, or one cut by truncate_prompt_tokens, is echoed as the ids decoded (what was read)
    as_ids = {"prompt": ids, "max_tokens": 0, "echo": True}
    assert httpx.post(f"{url}/v1/completions", json=as_ids).json()["choices"][0]["text"] == target.decode(ids)
    cut = {"prompt": prompt_text, "max_tokens": 0, "echo": True, "truncate_prompt_tokens": 2}
    assert httpx.post(f"{url}/v1/completions", json=cut).json()["choices"][0]["text"] == target.decode(ids[-2:])
    alone = {"prompt": prompt_text, "max_tokens": 0, "echo": True, "logprobs": 1}
    only = httpx.post(f"{url}/v1/completions", json=alone).json()
    assert only["choices"][0]["text"] == prompt_text and only["choices"][0]["finish_reason"] == "length"
    assert only["choices"][0]["logprobs"]["token_logprobs"] == lp["token_logprobs"][: len(ids)]
    assert [len(top) for top in only["choices"][0]["logprobs"]["top_logprobs"][1:]] == [1] * (len(ids) - 1)
    assert only["usage"]["completion_tokens"] == 0 and only["usage"]["prompt_tokens"] == len(ids)
    with httpx.stream("POST", f"{url}/v1/completions", json={**alone, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events) == prompt_text
    assert events[0]["choices"][0]["logprobs"] == only["choices"][0]["logprobs"]
    # lm-evaluation-harness's loglikelihood request: a batch of token-id prompts, context + continuation, max_tokens
    # 1; it sums token_logprobs[len(context):-1]
    contexts = [target.encode("t5 t6 t7"), target.encode("t9 t8")]
    continuations = [target.encode(" t8 t9"), target.encode(" t7")]
    batch = [c + x for c, x in zip(contexts, continuations, strict=True)]
    lm_eval = {"prompt": batch, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0, "seed": 1234}
    answer = httpx.post(f"{url}/v1/completions", json=lm_eval).json()
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    assert answer["usage"]["prompt_tokens"] == sum(len(p) for p in batch)
    for context, full, c in zip(contexts, batch, answer["choices"], strict=True):
        loglikelihood = sum(c["logprobs"]["token_logprobs"][len(context) : -1])
        assert loglikelihood == pytest.approx(scored(full)[len(context) - 1 :].sum().item(), abs=1e-5)
        assert len(c["logprobs"]["top_logprobs"][-1]) == 1
    # vLLM's prompt_logprobs: a completion choice's own, a chat completion's at the top; rank 1 = the most likely
    vllm = httpx.post(f"{url}/v1/completions", json={"prompt": prompt_text, "max_tokens": 2, "prompt_logprobs": 3})
    entries = vllm.json()["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for token, entry, value in zip(ids[1:], entries[1:], scored(ids).tolist(), strict=True):
        assert entry[str(token)]["logprob"] == pytest.approx(value, abs=1e-5)
        assert entry[str(token)]["decoded_token"] == text(token)
        ranked = sorted(entry.values(), key=lambda e: -e["logprob"])
        assert [e["rank"] for e in ranked][:3] == [1, 2, 3] and 3 <= len(entry) <= 4
    messages = [{"role": "user", "content": "t5 t6"}]
    chat = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "prompt_logprobs": 0})
    chat_ids = target.encode_chat(messages)
    assert [list(e) for e in chat.json()["prompt_logprobs"][1:]] == [[str(t)] for t in chat_ids[1:]]
    # vLLM's return_tokens_as_token_ids: every token named "token_id:ID", the numbers unchanged, whole and streamed
    named = {**body, "return_tokens_as_token_ids": True, "prompt_logprobs": 0}
    by_id = httpx.post(f"{url}/v1/completions", json=named).json()["choices"][0]
    assert by_id["logprobs"]["tokens"] == [f"token_id:{t}" for t in ids + want.token_ids]
    assert by_id["logprobs"]["token_logprobs"] == lp["token_logprobs"]
    assert all(k.startswith("token_id:") for top in by_id["logprobs"]["top_logprobs"][1:] for k in top)
    assert [e[str(t)]["decoded_token"] for e, t in zip(by_id["prompt_logprobs"][1:], ids[1:], strict=True)] == [
        f"token_id:{t}" for t in ids[1:]
    ]
    with httpx.stream("POST", f"{url}/v1/completions", json={**named, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    pieces = [e["choices"][0]["logprobs"] for e in events if e["choices"][0].get("logprobs")]
    assert [t for piece in pieces for t in piece["tokens"]] == by_id["logprobs"]["tokens"]
    chat_named = {"messages": messages, "max_tokens": 3, "logprobs": True, "return_tokens_as_token_ids": True}
    content = httpx.post(f"{url}/v1/chat/completions", json=chat_named).json()["choices"][0]["logprobs"]["content"]
    assert all(c["token"].startswith("token_id:") and c["bytes"] == list(c["token"].encode()) for c in content)


def test_continue_final_message_and_add_generation_prompt_render_as_transformers_does() -> None:
    """vLLM's continue_final_message (the answer goes on from the assistant's last message) and add_generation_prompt
    false: the prompt is transformers' apply_chat_template with the same flags (its continue_final_message cuts the
    text after the last message), in /tokenize too, and the answer the engine's for those ids."""
    target = make_target()
    target.tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} </s> {% endfor %}"
        "{% if add_generation_prompt %}<assistant> {% endif %}"
    )
    messages = [{"role": "user", "content": "t5 t6"}, {"role": "assistant", "content": "t7 t8"}]

    def reference(**flags: bool) -> list[int]:
        text = target.tokenizer.apply_chat_template(messages, tokenize=False, **flags)
        return target.tokenizer(text, add_special_tokens=False)["input_ids"]

    continued = reference(add_generation_prompt=False, continue_final_message=True)
    closed = reference(add_generation_prompt=False)
    assert len({tuple(continued), tuple(closed), tuple(reference(add_generation_prompt=True))}) == 3
    with serving(target=target) as url:
        for flags, want in (
            ({"continue_final_message": True}, continued),
            ({"continue_final_message": True, "add_generation_prompt": False}, continued),
            ({"add_generation_prompt": False}, closed),
        ):
            assert httpx.post(f"{url}/tokenize", json={"messages": messages, **flags}).json()["tokens"] == want
            body = {"messages": messages, "max_tokens": 6, "temperature": 0, **flags}
            got = httpx.post(f"{url}/v1/chat/completions", json=body).json()
            assert got["usage"]["prompt_tokens"] == len(want)
            answer = Generator(target).generate(want, max_new_tokens=6)
            assert got["choices"][0]["message"]["content"] == answer.text


def test_a_suffix_fills_in_the_middle_with_the_models_fim_tokens() -> None:
    """OpenAI's completions suffix on a model with FIM tokens (Qwen2.5-Coder's names): the prompt is prefix, suffix,
    middle in its tokens (BOS first where the tokenizer adds one), the answer the engine's for it; a batch of prompts
    each gets the suffix, token-id prompts as the prefix's tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from dartspec.infill import infill_prompt
    from dartspec.target import Target

    names = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]
    vocab = {f"t{i}": i for i in range(93)} | {name: 93 + i for i, name in enumerate(names)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1", unk_token="t0")
    fast.add_special_tokens({"additional_special_tokens": names})
    target = Target(make_target().model, fast, name="tiny-fim")
    ids = infill_prompt(target, "t5 t6", "t7 t8 t9")
    assert ids == [93, 5, 6, 94, 7, 8, 9, 95]
    assert ids == target.encode("<|fim_prefix|> t5 t6 <|fim_suffix|> t7 t8 t9 <|fim_middle|>")
    with serving(target=target) as url:
        body = {"prompt": "t5 t6", "suffix": "t7 t8 t9", "max_tokens": 6, "temperature": 1, "seed": 3}
        body["logit_bias"] = {"93": -100, "94": -100, "95": -100}  # the tiny model would repeat <|fim_middle|>
        settings = dict(max_new_tokens=6, temperature=1, seed=3, logit_bias={93: -100, 94: -100, 95: -100})
        got = httpx.post(f"{url}/v1/completions", json=body).json()
        assert got["choices"][0]["text"] == Generator(target).generate(ids, **settings).text
        assert got["usage"]["prompt_tokens"] == len(ids)
        batch = httpx.post(f"{url}/v1/completions", json={**body, "prompt": ["t5 t6", "t3"]}).json()
        by_ids = httpx.post(f"{url}/v1/completions", json={**body, "prompt": [5, 6]}).json()
        texts = [c["text"] for c in batch["choices"] + by_ids["choices"]]
        second = Generator(target).generate(infill_prompt(target, "t3", "t7 t8 t9"), **settings).text
        assert texts == [got["choices"][0]["text"], second, got["choices"][0]["text"]]
        third = infill_prompt(target, "t3", "t7 t8 t9")  # each prompt of the batch with the suffix (the counts tell)
        assert batch["usage"]["prompt_tokens"] == len(ids) + len(third) and by_ids["usage"]["prompt_tokens"] == len(ids)


def test_bad_words_are_the_engines(url: str) -> None:
    """vLLM's bad_words: the answer the engine gives with them (tests/test_penalties.py checks it against a naive loop),
    whole and streamed, without the banned words."""
    target = make_target()
    body = {"prompt": "t5 t6 t7", "max_tokens": 12, "temperature": 0}
    free = httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0]["text"]
    banned = free.split()[2:4]  # two of the answer's words (the tiny tokenizer's words are tokens)
    want = Generator(target).generate(target.encode("t5 t6 t7"), max_new_tokens=12, bad_words=banned)
    got = httpx.post(f"{url}/v1/completions", json={**body, "bad_words": banned}).json()["choices"][0]["text"]
    assert got == want.text != free and not set(banned) & set(got.split())
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "bad_words": banned, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events) == got


def test_skip_special_tokens_false_is_the_engines(url: str) -> None:
    """vLLM's skip_special_tokens false: the engine's text with special tokens shown (tests/test_engine.py checks it
    against the tokenizer's decoding), whole and streamed."""
    target = make_target()
    body = {"prompt": "t5 t6 t7", "max_tokens": 16, "temperature": 0, "ignore_eos": True, "logit_bias": {"1": 4}}
    want = Generator(target).generate(
        target.encode("t5 t6 t7"), max_new_tokens=16, ignore_eos=True, logit_bias={1: 4}, skip_special_tokens=False
    )
    assert 1 in want.token_ids
    shown = {**body, "skip_special_tokens": False}
    assert httpx.post(f"{url}/v1/completions", json=shown).json()["choices"][0]["text"] == want.text
    assert httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0]["text"] != want.text
    with httpx.stream("POST", f"{url}/v1/completions", json={**shown, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events) == want.text


def test_n_choices_are_the_answers_of_n_requests_seeded_one_apart(url: str) -> None:
    """``n``: choice i is what a lone request with seed + i answers (decoded together, in the batch), whole and
    streamed; greedy choices agree; the usage counts the prompt once and every choice's tokens."""
    api = client(url)

    def one(seed: int) -> str:
        out = api.chat.completions.create(model="tiny", messages=prompt(2), max_tokens=10, temperature=1.0, seed=seed)
        return out.choices[0].message.content

    many = api.chat.completions.create(model="tiny", messages=prompt(2), max_tokens=10, temperature=1.0, seed=7, n=3)
    assert [c.index for c in many.choices] == [0, 1, 2]
    texts = [c.message.content for c in many.choices]
    assert texts == [one(7), one(8), one(9)] and len(set(texts)) > 1
    lone = api.chat.completions.create(model="tiny", messages=prompt(2), max_tokens=10, temperature=1.0, seed=7)
    assert many.usage.prompt_tokens == lone.usage.prompt_tokens
    assert many.usage.completion_tokens > lone.usage.completion_tokens
    streamed = api.chat.completions.create(
        model="tiny", messages=prompt(2), max_tokens=10, temperature=1.0, seed=7, n=3, stream=True, logprobs=True
    )
    parts: dict[int, str] = {0: "", 1: "", 2: ""}
    roles, finished, usages, logprobs = set(), set(), [], {0: 0, 1: 0, 2: 0}
    for event in streamed:
        if event.usage is not None:
            usages.append(event.usage)
        for c in event.choices:
            parts[c.index] += c.delta.content or ""
            roles |= {c.index} if c.delta.role else set()
            finished |= {c.index} if c.finish_reason else set()
            logprobs[c.index] += len(c.logprobs.content) if c.logprobs else 0
    assert list(parts.values()) == texts and roles == finished == {0, 1, 2}
    assert [u.completion_tokens for u in usages] == [many.usage.completion_tokens]  # once, when the last is done
    assert sum(logprobs.values()) == many.usage.completion_tokens
    greedy = httpx.post(f"{url}/v1/completions", json={"prompt": "t5 t6", "max_tokens": 6, "temperature": 0, "n": 2})
    assert [c["index"] for c in greedy.json()["choices"]] == [0, 1]
    assert greedy.json()["choices"][0]["text"] == greedy.json()["choices"][1]["text"]


def test_malformed_json(url: str) -> None:
    r = httpx.post(f"{url}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    body = b'{"messages": [{"role": "user", "content": "t5"}]}'
    as_text = httpx.post(f"{url}/v1/chat/completions", content=body, headers={"content-type": "text/plain"})
    assert as_text.status_code == 400  # "body: Input should be a valid dictionary" before
    assert as_text.json()["error"]["message"] == (
        "the request body must be a JSON object (its Content-Type was text/plain: send application/json)"
    )
    array = httpx.post(f"{url}/v1/completions", json=[1, 2])
    assert array.status_code == 400 and array.json()["error"]["message"] == "the request body must be a JSON object"


def test_api_key() -> None:
    with serving(api_key="sekret") as u:
        with pytest.raises(openai.AuthenticationError):
            client(u, "wrong").chat.completions.create(model="tiny", messages=prompt(0), max_tokens=4)
        for headers in ({"Authorization": "Bearer wrong"}, {}):
            r = httpx.get(f"{u}/v1/models", headers=headers)
            assert r.status_code == 401
            assert r.json()["error"] == {
                "message": "invalid API key",
                "type": "authentication_error",
                "param": None,
                "code": "invalid_api_key",
            }
        ok = client(u, "sekret").chat.completions.create(model="tiny", messages=prompt(0), max_tokens=4, temperature=0)
        assert ok.choices[0].message.content
        assert httpx.get(f"{u}/health").status_code == 200  # health stays open for probes


def test_queue_overflow_is_429_and_disconnect_frees_the_engine() -> None:
    with serving(SlowDrafter(), max_queue=1, max_batch=1) as u:
        body = {"messages": prompt(2), "max_tokens": 400, "temperature": 0, "stream": True}
        with httpx.Client(timeout=30) as h:
            with h.stream("POST", f"{u}/v1/chat/completions", json=body) as running:
                lines = running.iter_lines()
                assert next(lines).startswith("data: ")  # generating now
                short = {**body, "stream": False, "max_tokens": 20}
                waiting = threading.Thread(
                    target=httpx.post, args=(f"{u}/v1/chat/completions",), kwargs={"json": short, "timeout": 60}
                )
                waiting.start()
                wait_until(u, "dartspec_waiting", 1)  # the second request is queued
                over = httpx.post(f"{u}/v1/chat/completions", json={**body, "stream": False})
                assert over.status_code == 429 and over.json()["error"]["type"] == "rate_limit_error"
            # Leaving the block closed the stream mid-generation: the queued request gets the engine.
            start = time.time()
            waiting.join(30)
            assert not waiting.is_alive() and time.time() - start < 5  # not the ~8 s the stream had left
        metrics = httpx.get(f"{u}/metrics").text
        assert "dartspec_rejected_requests_total 1.0" in metrics and "dartspec_in_flight 0.0" in metrics
        assert "dartspec_waiting 0.0" in metrics


def test_clients_that_give_up_free_their_queue_place_and_the_engine() -> None:
    with serving(SlowDrafter(), max_queue=1, max_batch=1) as u:
        long = {"messages": prompt(2), "max_tokens": 480, "temperature": 0}  # 480 steps: about 10 s here
        chat = f"{u}/v1/chat/completions"
        with httpx.Client(timeout=30) as h:
            with h.stream("POST", chat, json={**long, "stream": True}) as running:
                lines = running.iter_lines()  # kept: a discarded line iterator closes the connection
                assert next(lines).startswith("data: ")
                # A queued client that gives up leaves the queue: the next one is queued, not refused.
                with ThreadPoolExecutor(1) as pool:
                    gives_up = pool.submit(httpx.post, chat, json=long, timeout=2.0)
                    wait_until(u, "dartspec_waiting", 1)
                    with pytest.raises(httpx.ReadTimeout):
                        gives_up.result()
                    wait_until(u, "dartspec_waiting", 0)  # its disconnect is noticed within a poll (0.2 s)
                    queued = pool.submit(httpx.post, chat, json={**long, "max_tokens": 3}, timeout=60)
                    wait_until(u, "dartspec_waiting", 1)
                    running.close()  # hands the engine on
                    assert queued.result().status_code == 200
            # A client that gives up on a non-streamed answer mid-generation stops it.
            with pytest.raises(httpx.ReadTimeout):
                h.post(chat, json=long, timeout=1.0)
            start = time.time()
            assert h.post(chat, json={**long, "max_tokens": 3}).status_code == 200
            assert time.time() - start < 5  # not the ~9 s the abandoned generation had left
        metrics = httpx.get(f"{u}/metrics").text
        assert "dartspec_cancelled_requests_total 2.0" in metrics and "dartspec_in_flight 0.0" in metrics
        assert "dartspec_rejected_requests_total 0.0" in metrics


def test_a_client_that_leaves_a_request_of_n_choices_stops_all_of_them() -> None:
    """Streamed or not, the n sequences of a request that its client gave up leave the batch (nothing keeps
    decoding for nobody), and a request of more choices than the queue has room for is a 429."""
    with serving(SlowDrafter(), max_queue=1, max_batch=2) as u:
        long = {"messages": prompt(2), "max_tokens": 480, "temperature": 0.5, "seed": 1, "n": 2}
        chat = f"{u}/v1/chat/completions"
        with httpx.Client(timeout=30) as h:
            with h.stream("POST", chat, json={**long, "stream": True}) as running:
                lines = running.iter_lines()
                assert next(lines).startswith("data: ")
                wait_until(u, "dartspec_in_flight", 2)
            wait_until(u, "dartspec_in_flight", 0)
            with pytest.raises(httpx.ReadTimeout):
                h.post(chat, json=long, timeout=1.0)
            wait_until(u, "dartspec_in_flight", 0)
            for stream in (False, True):
                crowd = h.post(chat, json={**long, "n": 4, "max_tokens": 3, "stream": stream})
                assert crowd.status_code == 429 and crowd.json()["error"]["type"] == "rate_limit_error"
            # Nothing is left behind: the choices it had started leave the batch at its next step (until then they
            # still hold their places, so a request right after may find the queue full for a moment).
            deadline = time.time() + 10
            while (after := h.post(chat, json={**long, "max_tokens": 3})).status_code == 429 and time.time() < deadline:
                time.sleep(0.05)
            assert after.status_code == 200
            wait_until(u, "dartspec_in_flight", 0)


def test_a_request_cancelled_as_its_event_arrives_is_cancelled() -> None:
    """The race that let abandoned generations run on: cancelled after an event reached its queue, before it woke."""

    async def race() -> tuple[bool, int]:
        events: asyncio.Queue[int] = asyncio.Queue()
        waiting = asyncio.ensure_future(next_event(events, asyncio.get_running_loop().time() + 60))
        await asyncio.sleep(0)  # it waits on the queue
        events.put_nowait(1)  # wakes the waiting task on the loop's next turn...
        waiting.cancel()  # ...but another task (the server's disconnect check) cancels it first
        await asyncio.wait({waiting})
        return waiting.cancelled(), events.qsize()

    cancelled, left = asyncio.run(race())
    assert cancelled and left == 1  # the item stays for nobody, rather than the cancellation being lost


def test_next_event_times_out_at_its_deadline() -> None:
    async def wait() -> None:
        await next_event(asyncio.Queue(), asyncio.get_running_loop().time() + 0.05)

    with pytest.raises(TimeoutError):
        asyncio.run(wait())


def test_stop_and_seed(url: str) -> None:
    c = client(url)

    def text(stream: bool = False, **kw) -> str:
        args = {"model": "tiny", "messages": prompt(5), "max_tokens": 16, "temperature": 0.9, "seed": 7, **kw}
        if stream:
            return "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(stream=True, **args))
        return c.chat.completions.create(**args).choices[0].message.content

    # With a seed, sampling is reproducible: streamed or not, and drafted or not (one uniform per committed
    # token, so the drafter changes nothing).
    full = text()
    plain = text(extra_body={"dartspec": {"drafter": "none"}})
    assert full and [text(), text(stream=True), plain] == [full, full, full]
    assert text(seed=8) != full  # (the tiny model's greedy output is one word repeated; sampled it varies)

    # A stop string ends the text before its first occurrence (the same seed gives the same tokens up to it).
    stop = next(w for w in full.split() if full.find(w) > 0)
    cut = c.chat.completions.create(
        model="tiny", messages=prompt(5), max_tokens=16, temperature=0.9, seed=7, stop=["t99", stop]
    )
    # vLLM takes more than OpenAI's 4 (lm-evaluation-harness adds the model's EOS text to a task's own)
    five = c.chat.completions.create(
        model="tiny",
        messages=prompt(5),
        max_tokens=16,
        temperature=0.9,
        seed=7,
        stop=["t90", "t91", "t92", "t93", stop],
    )
    assert five.choices[0].message.content == cut.choices[0].message.content
    assert cut.choices[0].message.content == full[: full.find(stop)] and cut.choices[0].finish_reason == "stop"
    assert text(stream=True, stop=stop) == full[: full.find(stop)]
    kept = {"stop": stop, "extra_body": {"include_stop_str_in_output": True}}  # vLLM's: the text through it
    assert text(**kept) == text(stream=True, **kept) == full[: full.find(stop) + len(stop)]
    done = c.completions.create(model="tiny", prompt="t3 t8 t4 t2", max_tokens=4, temperature=0, stop="t2")
    assert done.choices[0].text == "" and done.choices[0].finish_reason == "stop"


def test_timeout_is_504() -> None:
    with serving(SlowDrafter(), timeout_s=2.0) as u:
        # Greedy (prompt 3 runs 400 tokens, 8 s here): sampled, the tiny model may end before the timeout.
        long = {"messages": prompt(3), "max_tokens": 400, "temperature": 0}
        r = httpx.post(f"{u}/v1/chat/completions", json=long, timeout=30)
        assert r.status_code == 504 and "timeout" in r.json()["error"]["message"]
        assert r.json()["error"]["code"] == "timeout"
        with (
            httpx.Client(timeout=30) as h,
            h.stream("POST", f"{u}/v1/chat/completions", json={**long, "stream": True}) as s,
        ):
            events = [line for line in s.iter_lines() if line.startswith("data: ")]
        # Mid-stream the status line is sent already: the error comes as the last event, with no [DONE].
        assert '"timeout_error"' in events[-1] and "data: [DONE]" not in events
        # The Responses API's stream ends in its error event instead of response.completed
        ask = {"input": prompt(3), "max_output_tokens": 400, "temperature": 0, "stream": True}
        with httpx.Client(timeout=30) as h, h.stream("POST", f"{u}/v1/responses", json=ask) as s:
            kinds = [json.loads(line[6:])["type"] for line in s.iter_lines() if line.startswith("data: ")]
        assert kinds[0] == "response.created" and kinds[-1] == "error" and "response.completed" not in kinds
        # The engine was released: a short request gets through (its wait for the turn counts against the same
        # 2 s timeout, so a loaded machine may need another try).
        codes = []
        for _ in range(5):
            ok = httpx.post(f"{u}/v1/chat/completions", json={"messages": prompt(3), "max_tokens": 1}, timeout=30)
            codes.append(ok.status_code)
            if ok.status_code == 200:
                break
        assert codes[-1] == 200, codes


def test_plain_decoding_switch_gives_the_same_text(url: str) -> None:
    body = {"messages": prompt(4), "max_tokens": 20, "temperature": 0}
    spec = httpx.post(f"{url}/v1/chat/completions", json=body).json()
    plain = httpx.post(f"{url}/v1/chat/completions", json={**body, "dartspec": {"drafter": "none"}}).json()
    assert spec["choices"][0]["message"] == plain["choices"][0]["message"]
    assert plain["usage"]["dartspec"]["accepted_draft_tokens"] == 0


@pytest.mark.slow
def test_smollm2_streaming_chat() -> None:
    from dartspec.targets import load_target

    target = load_target("smollm2-135m")  # what `dartspec serve` loads on a CPU (the lean runtime)
    with serving(target=target, aliases=("smollm2-135m",)) as u:
        c = client(u)
        text = stream_text(c, [{"role": "user", "content": "Name three primary colours."}], max_tokens=24)
        full = c.chat.completions.create(
            model="smollm2-135m",
            messages=[{"role": "user", "content": "Name three primary colours."}],
            max_tokens=24,
            temperature=0,
        )
        assert text and text == full.choices[0].message.content
        # A tool call through the official client: the function and arguments its schema admits, the same streamed
        # (greedy), and the result sent back gets a text answer.
        weather = {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The current weather in a city",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                    "required": ["city", "unit"],
                },
            },
        }
        ask = [{"role": "user", "content": "What is the weather like in Paris?"}]
        kw: dict[str, Any] = {"model": "smollm2-135m", "tools": [weather], "tool_choice": "required", "temperature": 0}
        out = c.chat.completions.create(messages=ask, max_tokens=60, **kw)
        (call,) = out.choices[0].message.tool_calls
        assert out.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
        arguments = json.loads(call.function.arguments)
        assert list(arguments) == ["city", "unit"] and arguments["unit"] in ("celsius", "fahrenheit")
        streamed = [
            tc
            for chunk in c.chat.completions.create(messages=ask, max_tokens=60, stream=True, **kw)
            for tc in (chunk.choices[0].delta.tool_calls or [] if chunk.choices else [])
        ]
        assert [(s.function.name, s.function.arguments) for s in streamed] == [("get_weather", call.function.arguments)]
        back = [*ask, out.choices[0].message.model_dump(exclude_none=True)]
        back.append({"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"})
        reply = c.chat.completions.create(messages=back, max_tokens=24, **{**kw, "tool_choice": "none"})
        assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls
        # ... and through the Responses API (functions declared flat): the same call, then its result sent back
        flat = {"type": "function", **weather["function"]}
        asked = c.responses.create(
            model="smollm2-135m", input=ask, tools=[flat], tool_choice="required", temperature=0, max_output_tokens=60
        )
        (item,) = asked.output
        assert (item.type, item.name, item.arguments) == ("function_call", "get_weather", call.function.arguments)
        result = {"type": "function_call_output", "call_id": item.call_id, "output": "18 degrees and sunny"}
        answer = c.responses.create(
            model="smollm2-135m", input=[*ask, item.model_dump(), result], tools=[flat], tool_choice="none",
            temperature=0, max_output_tokens=24,
        )  # fmt: skip
        assert answer.output_text == reply.choices[0].message.content
        # Structured outputs as the official client asks for them: a pydantic model (its strict schema, a date format
        # in it) comes back parsed; vLLM's guided_choice in extra_body
        import datetime

        import pydantic

        class Event(pydantic.BaseModel):
            name: str = pydantic.Field(max_length=40)
            day: datetime.date
            guests: list[Annotated[str, pydantic.Field(max_length=20)]] = pydantic.Field(max_length=3)

        ask = [{"role": "user", "content": "Invent a birthday party as JSON: its name, day and guests."}]
        # sampled (the API's default temperature): an unseeded draw ran past 100 tokens in one run (whitespace between
        # JSON tokens is free), so a seed makes the draw repeatable, and it gets room
        parsed = c.chat.completions.parse(
            model="smollm2-135m", messages=ask, response_format=Event, max_tokens=200, seed=7
        )
        event = parsed.choices[0].message.parsed
        assert parsed.choices[0].finish_reason == "stop" and isinstance(event, Event), parsed.choices[0].message
        # ... and through the Responses API: the chat completion's answer (greedy both), parsed
        answered = c.responses.parse(
            model="smollm2-135m", input=ask, text_format=Event, max_output_tokens=100, temperature=0
        )
        greedy = c.chat.completions.parse(
            model="smollm2-135m", messages=ask, response_format=Event, max_tokens=100, temperature=0
        )
        assert answered.status == "completed" and greedy.choices[0].finish_reason == "stop"
        assert isinstance(answered.output_parsed, Event) and answered.output_parsed == greedy.choices[0].message.parsed
        chosen = c.chat.completions.create(
            model="smollm2-135m",
            messages=[{"role": "user", "content": "Is water wet? yes or no"}],
            max_tokens=8,
            extra_body={"guided_choice": ["yes", "no"]},
        )
        assert chosen.choices[0].message.content in ("yes", "no")


def test_responses_api_answers_as_the_chat_completion_of_the_same_conversation(url: str) -> None:
    """OpenAI's Responses API through the official client: the output text is the chat completion's answer to the
    same conversation (instructions as a system message first), whole and streamed (typed events in order, their
    deltas adding up, the last one completed or incomplete as the answer finished), with usage in its names; a string
    input is one user turn; a seeded sampled answer is the seeded chat completion's."""
    c = client(url)
    turns = [
        {"role": "user", "content": "t5 t6 t7"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "t8"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "t9 t5"}]},
    ]
    as_chat = [{"role": "system", "content": "t2 t3"}, turns[0], {"role": "assistant", "content": "t8"}]
    as_chat.append({"role": "user", "content": "t9 t5"})
    statuses = set()
    for max_tokens in (3, 60):
        kw = {"model": "tiny", "max_output_tokens": max_tokens, "temperature": 0}
        want = c.chat.completions.create(model="tiny", messages=as_chat, max_tokens=max_tokens, temperature=0)
        got = c.responses.create(instructions="t2 t3", input=turns, **kw)
        assert got.output_text == want.choices[0].message.content and got.output_text
        assert got.status == ("incomplete" if want.choices[0].finish_reason == "length" else "completed")
        statuses.add(got.status)
        assert (got.usage.input_tokens, got.usage.output_tokens) == (
            want.usage.prompt_tokens,
            want.usage.completion_tokens,
        )
        assert got.id.startswith("resp_") and got.output[0].role == "assistant"
        events = list(c.responses.create(instructions="t2 t3", input=turns, stream=True, **kw))
        kinds = [e.type for e in events]
        assert kinds[:4] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
        ]
        assert kinds[-4:] == [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            f"response.{got.status}",
        ]
        assert set(kinds[4:-4]) == {"response.output_text.delta"}
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert deltas == got.output_text == events[-1].response.output_text == events[-4].text
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert events[-1].response.usage.output_tokens == got.usage.output_tokens
        with c.responses.stream(instructions="t2 t3", input=turns, **kw) as helper:  # the client's accumulator
            assert "".join(e.delta for e in helper if e.type == "response.output_text.delta") == got.output_text
    assert statuses == {"incomplete"}  # (a finished answer's "completed": the JSON test below)
    alone = c.responses.create(model="tiny", input="t5 t6 t7", max_output_tokens=8, temperature=0)
    one = c.chat.completions.create(model="tiny", messages=[turns[0]], max_tokens=8, temperature=0)
    assert alone.output_text == one.choices[0].message.content
    drawn = c.responses.create(model="tiny", input="t5 t6 t7", max_output_tokens=8, extra_body={"seed": 3})
    seeded = c.chat.completions.create(model="tiny", messages=[turns[0]], max_tokens=8, seed=3)
    assert drawn.output_text == seeded.choices[0].message.content != one.choices[0].message.content


def test_responses_api_json_schema_answers_are_the_chat_completions() -> None:
    """text.format json_schema (and json_object) as response_format does in a chat completion: the same answer for
    the same seed, whole and streamed, not the free one, and a finished one "completed" (a tiny vocabulary of JSON
    pieces for the constraint, tests/test_constraint.py; the texts are the tokenizer's words)."""
    from test_constraint import SCHEMA, texts

    target = make_target()
    target.__dict__["token_texts"] = texts()
    ask = [{"role": "user", "content": "t5 t6 t7"}]
    statuses = set()
    with serving(target=target) as u:
        c = client(u)
        for seed in range(4):
            kw = {
                "model": "tiny",
                "input": ask,
                "max_output_tokens": 40,
                "temperature": 0.9,
                "extra_body": {"seed": seed},
            }
            free = c.responses.create(**kw).output_text
            for fmt in ({"type": "json_schema", "name": "card", "schema": SCHEMA}, {"type": "json_object"}):
                chat_fmt = fmt if fmt["type"] == "json_object" else {"type": "json_schema", "json_schema": fmt}
                want = c.chat.completions.create(
                    model="tiny", messages=ask, max_tokens=40, temperature=0.9, seed=seed, response_format=chat_fmt
                )
                got = c.responses.create(**kw, text={"format": fmt})
                assert got.output_text == want.choices[0].message.content != free
                assert got.text.format.type == fmt["type"]
                assert got.status == ("completed" if want.choices[0].finish_reason == "stop" else "incomplete")
                statuses.add(got.status)
                events = list(c.responses.create(**kw, text={"format": fmt}, stream=True))
                assert events[-1].type == f"response.{got.status}"
                assert events[-1].response.output_text == got.output_text
                if got.status == "completed":  # the client's accumulator takes the final response from that event
                    with c.responses.stream(**kw, text={"format": fmt}) as helper:
                        assert helper.get_final_response().output_text == got.output_text
    assert "completed" in statuses


def test_responses_api_calls_functions_as_chat_completions_do() -> None:
    """Function tools: with the same seed the Responses API answers what the chat completion answers, a call as
    function_call output items (whole, and streamed as an item per call with its arguments in one delta and no text),
    text as the message (a call cut by max_output_tokens too); calls and their results sent back as input items give
    the chat completion's answer to the conversation holding those tool_calls and tool messages."""
    from test_constraint import fake_decode, texts

    target = make_target()
    target.__dict__["token_texts"] = texts()
    target.__dict__["decode"] = fake_decode  # the server's text is what the fake pieces spell
    flat = [{"type": "function", **t["function"]} for t in TOOLS]  # this API declares functions flat
    ask = [{"role": "user", "content": "t6 t7"}]
    seen, made = set(), None
    with serving(target=target) as u:

        def post(path: str, body: dict[str, Any]) -> dict[str, Any]:
            return httpx.post(f"{u}/v1/{path}", json=body, timeout=60).json()

        def streamed(body: dict[str, Any]) -> list[dict[str, Any]]:
            with httpx.stream("POST", f"{u}/v1/responses", json={**body, "stream": True}, timeout=60) as r:
                return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]

        named = {"type": "function", "name": "sum"}
        for choice, seeds in (("required", range(3)), ("auto", (8, 9)), (named, (2,))):
            chat_choice = {"type": "function", "function": {"name": "sum"}} if choice is named else choice
            for seed in seeds:
                sampling = {"temperature": 0.9, "seed": seed}
                asked = {"messages": ask, "tools": TOOLS, "tool_choice": chat_choice, "max_tokens": 60, **sampling}
                want = post("chat/completions", asked)["choices"][0]
                body = {"input": ask, "tools": flat, "tool_choice": choice, "max_output_tokens": 60, **sampling}
                got = post("responses", body)
                calls = want["message"].get("tool_calls")
                if calls:
                    seen.add("call")
                    expected = [("function_call", c["function"]["name"], c["function"]["arguments"]) for c in calls]
                    assert [(o["type"], o["name"], o["arguments"]) for o in got["output"]] == expected
                    assert got["status"] == "completed" and all(o["call_id"].startswith("call_") for o in got["output"])
                    made = got["output"]
                else:
                    seen.add(want["finish_reason"])
                    (message,) = got["output"]
                    assert message["type"] == "message" and message["content"][0]["text"] == want["message"]["content"]
                events = streamed(body)
                final = events[-1]["response"]["output"]
                same = lambda items: [{k: v for k, v in o.items() if k not in ("id", "call_id")} for o in items]  # noqa: E731
                assert same(final) == same(got["output"])
                kinds = [e["type"] for e in events]
                if calls:
                    per_call = ["response.output_item.added", "response.function_call_arguments.delta"]
                    per_call += ["response.function_call_arguments.done", "response.output_item.done"]
                    assert kinds == [
                        "response.created",
                        "response.in_progress",
                        *per_call * len(calls),
                        "response.completed",
                    ]
                    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
                    assert deltas == [c["function"]["arguments"] for c in calls]
                else:
                    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
                    assert text == want["message"]["content"]
        assert seen == {"call", "length", "stop"}  # calls, a call cut short, text (else a branch went untested)
        assert made is not None
        # The official client reads the calls
        kw = {"tools": flat, "tool_choice": "required", "max_output_tokens": 60, "temperature": 0.9}
        call = client(u).responses.create(model="tiny", input=ask, **kw, extra_body={"seed": 2}).output[0]
        assert call.type == "function_call" and call.name == "sum" and json.loads(call.arguments)["a"] == 4009
        # Calls and a result sent back as items: the chat completion of those tool_calls and that tool message
        items = [*ask, *({k: o[k] for k in ("type", "call_id", "name", "arguments")} for o in made)]
        items.append({"type": "function_call_output", "call_id": made[0]["call_id"], "output": "t9"})
        sent = [{"id": o["call_id"], "type": "function", "function": {"name": o["name"], "arguments": o["arguments"]}}
                for o in made]  # fmt: skip
        turn = [*ask, {"role": "assistant", "content": None, "tool_calls": sent}]
        turn.append({"role": "tool", "tool_call_id": made[0]["call_id"], "content": "t9"})
        again = {"tool_choice": "none", "temperature": 0.9, "seed": 5}
        back = post("responses", {"input": items, "tools": flat, "max_output_tokens": 3, **again})
        want = post("chat/completions", {"messages": turn, "tools": TOOLS, "max_tokens": 3, **again})
        assert back["output"][0]["content"][0]["text"] == want["choices"][0]["message"]["content"]
        assert back["usage"]["input_tokens"] == want["usage"]["prompt_tokens"]
    # Parallel calls sent back are one assistant turn's tool_calls, as a chat completion holds them
    from dartspec.serve.responses import ResponsesRequest

    two = [{"type": "function_call", "call_id": f"call_{i}", "name": "now", "arguments": "{}"} for i in range(2)]
    chat = ResponsesRequest(input=[*ask, *two, {"type": "function_call_output", "call_id": "call_1", "output": "x"}])
    roles = [(m.role, len(m.tool_calls or [])) for m in chat.as_chat().messages]
    assert roles == [("user", 0), ("assistant", 2), ("tool", 0)]


def test_responses_api_continues_stored_responses(url: str) -> None:
    """previous_response_id continues a stored response's conversation: the answer is the chat completion of the
    earlier input, the stored answer and the new input (the earlier instructions left out, the new ones first),
    whole and streamed; a stored response reads back as it was answered, a deleted one and one asked with store: false
    are not found."""
    c = client(url)
    kw = {"model": "tiny", "max_output_tokens": 6, "temperature": 0}
    first = c.responses.create(instructions="t2", input="t5 t6 t7", **kw)
    assert first.store and first.previous_response_id is None
    second = c.responses.create(previous_response_id=first.id, instructions="t3", input="t9 t5", **kw)
    turns = [
        {"role": "system", "content": "t3"},
        {"role": "user", "content": "t5 t6 t7"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "t9 t5"},
    ]
    want = c.chat.completions.create(model="tiny", messages=turns, max_tokens=6, temperature=0)
    assert second.output_text == want.choices[0].message.content and second.previous_response_id == first.id
    assert second.usage.input_tokens == want.usage.prompt_tokens  # the same conversation, token for token
    # A chain: the third continues the second's conversation, streamed (stored when it finishes)
    events = list(c.responses.create(previous_response_id=second.id, input="t4", stream=True, **kw))
    third = events[-1].response
    turns = [*turns[1:], {"role": "assistant", "content": second.output_text}, {"role": "user", "content": "t4"}]
    want = c.chat.completions.create(model="tiny", messages=turns, max_tokens=6, temperature=0)
    assert third.output_text == want.choices[0].message.content
    assert third.usage.input_tokens == want.usage.prompt_tokens
    assert c.responses.retrieve(third.id).output_text == third.output_text
    assert c.responses.retrieve(first.id).model_dump() == first.model_dump()
    c.responses.delete(first.id)
    for rid in (first.id, "resp_nothing"):
        r = httpx.get(f"{url}/v1/responses/{rid}", timeout=30)
        assert r.status_code == 404 and r.json()["error"]["param"] == "response_id"
        assert httpx.delete(f"{url}/v1/responses/{rid}", timeout=30).status_code == 404
    r = httpx.post(f"{url}/v1/responses", json={"input": "t5", "previous_response_id": first.id}, timeout=30)
    assert r.status_code == 404 and "no stored response" in r.json()["error"]["message"]
    # The second's conversation was stored whole: forgetting the first does not break the chain after it
    assert c.responses.create(previous_response_id=second.id, input="t4", **kw).output_text == third.output_text
    unstored = c.responses.create(input="t5", store=False, **kw)
    assert unstored.store is False
    assert httpx.get(f"{url}/v1/responses/{unstored.id}", timeout=30).status_code == 404


def test_responses_api_gives_log_probabilities_as_the_chat_completion_does(url: str) -> None:
    """include: ["message.output_text.logprobs"] with top_logprobs: the output text's tokens, their log-probabilities
    and alternatives are the chat completion's (whole and streamed, the deltas' adding up); none unless asked; another
    include is a 400 naming the field."""
    c = client(url)
    kw = {"model": "tiny", "max_output_tokens": 6, "temperature": 0}
    want = c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "t5 t6"}], max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=2,
    ).choices[0].logprobs.model_dump()["content"]  # fmt: skip
    assert want and all(len(e["top_logprobs"]) == 2 for e in want)
    got = c.responses.create(input="t5 t6", include=["message.output_text.logprobs"], top_logprobs=2, **kw)
    assert [lp.model_dump() for lp in got.output[0].content[0].logprobs] == want
    events = list(
        c.responses.create(input="t5 t6", include=["message.output_text.logprobs"], top_logprobs=2, stream=True, **kw)
    )
    deltas = [lp.model_dump() for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    done = events[-1].response.output[0].content[0].logprobs
    assert deltas == want == [lp.model_dump() for lp in done]
    plain = c.responses.create(input="t5 t6", **kw)
    assert not plain.output[0].content[0].logprobs
    r = httpx.post(f"{url}/v1/responses", json={"input": "t5", "include": ["reasoning.encrypted_content"]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "include"


def test_response_store_keeps_the_newest() -> None:
    from dartspec.serve.responses import ResponseStore
    from dartspec.serve.schema import Message

    store = ResponseStore(2)
    for i in range(3):
        store.put({"id": f"r{i}", "output": [{"type": "message", "content": [{"text": f"a{i}"}]}]}, [])
    assert (store.get("r0"), len(store)) == (None, 2)
    assert store.get("r2").conversation == [Message(role="assistant", content="a2")]
    calls = [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}]
    store.put({"id": "r3", "output": calls}, [Message(role="user", content="q")])
    held = store.get("r3").conversation
    assert [m.role for m in held] == ["user", "assistant"] and held[1].tool_calls[0].id == "c1"
    none = ResponseStore(0)
    none.put({"id": "r", "output": []}, [])
    assert none.get("r") is None


def test_responses_api_refuses_what_it_cannot_honour_naming_the_field(url: str) -> None:
    cases = [
        ({"tools": [{"type": "web_search"}]}, "tools.0.type", "'function'"),
        ({"tools": [{"type": "function", "name": "a b"}]}, "tools.0.name", "should match pattern"),
        ({"tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
        ({"previous_response_id": "resp_1"}, "previous_response_id", "no stored response 'resp_1'"),
        ({"input": []}, "input", "must not be empty"),
        ({"input": [{"role": "user", "content": "t5"}] * 300}, "input", "at most 256 items"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input", "item 0 is 'reasoning'"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input", "(got 'input_image')"),
        ({"text": {"format": {"type": "json_schema", "name": "a"}}}, "text.format.schema", "needs a schema"),
        ({"text": {"format": {"type": "json_schema", "schema": {"type": "date"}}}}, "text.format", "#/type must be"),
        ({"input": "t5 " * 600}, "input", "context window"),
        ({"max_output_tokens": 600}, "max_output_tokens", "context window is 512 tokens"),
        ({"model": "gpt-5"}, "model", "is not served here"),
    ]
    for extra, param, message in cases:
        r = httpx.post(f"{url}/v1/responses", json={"input": "t5", **extra}, timeout=30)
        assert r.status_code in (400, 404), (extra, r.text)
        error = r.json()["error"]
        assert message in error["message"] and error["param"] == param, (extra, error)


def test_web_page_streams_in_headless_chromium(url: str, tmp_path: Path) -> None:
    import os
    import shutil

    webdriver = pytest.importorskip("selenium.webdriver")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if not chromium or not driver_path:
        missing = "needs the Debian packages chromium and chromium-driver"
        if os.environ.get("DARTSPEC_REQUIRE_BROWSER"):  # CI (.ci/run) installs them: a missing browser is a failure
            pytest.fail(missing)
        pytest.skip(missing)
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    driver.set_window_size(1000, 700)
    try:
        driver.get(url + "/")
        WebDriverWait(driver, 20).until(lambda d: "model tiny" in d.find_element(By.ID, "meta").text)
        find = lambda i: driver.find_element(By.ID, i)  # noqa: E731

        def ask(text: str) -> None:
            find("prompt").clear()
            find("prompt").send_keys(text)
            find("send").click()

        done = lambda d: d.find_element(By.ID, "send").is_enabled() and d.find_element(By.ID, "tau").text != "-"  # noqa: E731
        ask("t5 t6 t7 t5 t6 t7 t5 t6")
        WebDriverWait(driver, 30).until(done)
        speculative = find("out").text
        assert speculative.strip()
        assert int(find("ntok").text) > 0
        assert float(find("tps").text) > 0
        # This prompt repeats itself, so prompt lookup gets drafts accepted, and the page colours them.
        assert float(find("tau").text) > 1
        assert int(find("ndraft").text) > 0
        assert driver.find_elements(By.CSS_SELECTOR, "#out span.drafted")
        shot = tmp_path / "web-demo.png"
        driver.save_screenshot(str(shot))
        assert shot.stat().st_size > 1000
        print(f"screenshot: {shot}")

        # The switch runs the question with plain decoding: in a new chat, the same text, nothing drafted.
        find("new").click()
        assert not find("log").text and not find("out").text and find("tau").text == "-"
        find("plain").click()
        ask("t5 t6 t7 t5 t6 t7 t5 t6")
        WebDriverWait(driver, 30).until(lambda d: done(d) and d.find_element(By.ID, "tau").text == "1.00")
        assert find("out").text == speculative and find("ndraft").text == "0"
        assert not driver.find_elements(By.CSS_SELECTOR, "#out span.drafted")
        driver.save_screenshot(str(tmp_path / "web-demo-plain.png"))
        find("plain").click()

        # A second question continues the conversation: the first turn moves up into the log, and the model sees it
        # (the answer is the engine's to the whole conversation, not to the second question alone)
        from selenium.webdriver.common.keys import Keys

        find("prompt").send_keys("t9 t8", Keys.CONTROL, Keys.ENTER)  # Ctrl+Enter sends too
        WebDriverWait(driver, 30).until(lambda d: done(d) and d.find_element(By.ID, "asked").text == "t9 t8")
        assert "t5 t6 t7 t5 t6 t7 t5 t6" in find("log").text and speculative in find("log").text
        second = find("out").text
        target = make_target()
        turns = [
            {"role": "user", "content": "t5 t6 t7 t5 t6 t7 t5 t6"},
            {"role": "assistant", "content": speculative},
            {"role": "user", "content": "t9 t8"},
        ]
        assert second == Generator(target).generate(turns, chat=True, max_new_tokens=128).text.strip()

        # Compare: the same request again with plain decoding, its speed beside the drafter's and the text checked
        find("new").click()
        find("compare").click()
        ask("t5 t6 t7 t5 t6 t7 t5 t6")
        WebDriverWait(driver, 60).until(lambda d: "same text" in d.find_element(By.ID, "compared").text)
        assert re.fullmatch(
            r"plain decoding [0-9.]+ tokens/s, with the drafter [0-9.]+ tokens/s: [0-9.]+x · same text: yes",
            find("compared").text,
        ), find("compared").text
        find("compare").click()

        # Stop ends the stream at once (the server drops the request); what came stays, marked, and Send is back
        find("new").click()
        find("max").clear()
        find("max").send_keys("400")
        ask("t5 t6 t7 t5 t6 t7 t5 t6")
        find("stop").click()
        WebDriverWait(driver, 30).until(lambda d: d.find_element(By.ID, "send").is_enabled())
        assert find("out").text.endswith("[stopped]") and not find("stop").is_enabled(), find("out").text
        find("max").clear()
        find("max").send_keys("128")

        # Answer formats: one of some choices (the tiny vocabulary's words), sent as structured_outputs
        from selenium.webdriver.support.ui import Select

        find("new").click()
        Select(find("format")).select_by_value("choice")
        assert find("spec").is_displayed() and find("spec").get_attribute("value") == "yes\nno"  # the example
        find("spec").clear()
        find("spec").send_keys("t7\nt4")
        ask("t5 t6 t7 t5 t6 t7 t5 t6")
        WebDriverWait(driver, 30).until(done)
        assert find("out").text in ("t7", "t4"), find("out").text
        # A JSON Schema that is no JSON is caught in the page; the JSON switch asks for a JSON object, which this tiny
        # word vocabulary cannot write: the page shows the server's one-line refusal and keeps the question
        Select(find("format")).select_by_value("schema")
        assert find("spec").get_attribute("value").startswith("{")
        find("spec").send_keys("oops")
        ask("t5 t6")
        assert "the JSON Schema is no valid JSON" in find("compared").text
        Select(find("format")).select_by_value("json")
        assert not find("spec").is_displayed()
        find("send").click()
        refused = "no token of the vocabulary continues the constrained answer"
        WebDriverWait(driver, 30).until(lambda d: refused in d.find_element(By.ID, "out").text)
        assert find("prompt").get_attribute("value") == "t5 t6"
    finally:
        driver.quit()


def test_hostile_requests_get_4xx_not_500s(url: str) -> None:
    chat = f"{url}/v1/chat/completions"
    # A lone surrogate in a message (valid JSON, not Unicode text) is the client's error.
    as_json = {"content-type": "application/json"}
    r = httpx.post(chat, content=b'{"messages": [{"role": "user", "content": "t5 \\ud800"}]}', headers=as_json)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content"
    r = httpx.post(f"{url}/v1/completions", content=b'{"prompt": "t5 \\ud800"}', headers=as_json)
    assert r.status_code == 400 and "unpaired surrogate" in r.json()["error"]["message"]
    # An invalid UTF-8 body answers in OpenAI's shape too.
    r = httpx.post(chat, content=b'{"messages": [{"role": "user", "content": "\xff"}]}', headers=as_json)
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.get(f"{url}/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["code"] is None
    # Another model's name is a 404, not silently this model.
    r = httpx.post(chat, json={"model": "gpt-4", "messages": HI, "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found" and "tiny" in r.text
    assert httpx.post(chat, json={"messages": HI, "max_tokens": 2, "temperature": 0}).status_code == 200


def test_oversized_bodies_are_413_while_health_stays_fast() -> None:
    with serving(max_body_bytes=64 * 1024) as u:
        big = {"messages": [{"role": "user", "content": "t5 " * 400_000}]}  # 1.2 MB
        r = httpx.post(f"{u}/v1/chat/completions", json=big, timeout=30)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunks():  # no content-length: the limit counts what arrives
            for _ in range(40):
                yield b"x" * 4096

        r = httpx.post(f"{u}/v1/chat/completions", content=chunks(), timeout=30)
        assert r.status_code == 413
        with ThreadPoolExecutor(4) as pool:
            posts = [pool.submit(httpx.post, f"{u}/v1/chat/completions", json=big, timeout=30) for _ in range(4)]
            start = time.perf_counter()
            assert httpx.get(f"{u}/health", timeout=5).status_code == 200
            assert time.perf_counter() - start < 0.5
            assert all(f.result().status_code == 413 for f in posts)
        ok = httpx.post(f"{u}/v1/chat/completions", json={"messages": HI, "max_tokens": 2, "temperature": 0})
        assert ok.status_code == 200


def test_zero_queue_serves_a_free_engine_and_the_wait_counts_against_the_timeout() -> None:
    with serving(SlowDrafter(), max_queue=0, timeout_s=1.5, max_batch=1) as u:
        chat = f"{u}/v1/chat/completions"
        assert httpx.post(chat, json={"messages": HI, "max_tokens": 2, "temperature": 0}).status_code == 200
        long = {"messages": prompt(3), "max_tokens": 400, "temperature": 0, "stream": True}
        with httpx.Client(timeout=30) as h, h.stream("POST", chat, json=long) as running:
            lines = running.iter_lines()  # kept: a discarded line iterator closes the connection
            assert next(lines).startswith("data: ")
            refused = httpx.post(chat, json={"messages": HI, "max_tokens": 2})
            assert refused.status_code == 429  # 0 waiting places: busy means refused
    with serving(SlowDrafter(), max_queue=4, timeout_s=1.0, max_batch=1) as u:
        chat = f"{u}/v1/chat/completions"
        long = {"messages": prompt(3), "max_tokens": 400, "temperature": 0}
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(httpx.post, chat, json=long, timeout=30)
            wait_until(u, "dartspec_in_flight", 1)
            start = time.perf_counter()
            second = httpx.post(chat, json=long, timeout=30)
            # It waited for the first to time out (most of a second), and its own 1 s ran meanwhile: a 504 after ~1 s
            # (a clock started at its turn would give the 504 after ~1.7-2 s).
            assert second.status_code == 504 and time.perf_counter() - start < 1.45
            assert first.result().status_code == 504


def test_protect_all_guards_the_page_and_metrics_but_not_health() -> None:
    with serving(api_key="k", protect_all=True) as u:
        assert httpx.get(f"{u}/metrics").status_code == 401 and httpx.get(f"{u}/").status_code == 401
        assert httpx.get(f"{u}/metrics", headers={"Authorization": "Bearer k"}).status_code == 200
        assert httpx.get(f"{u}/health").status_code == 200


def test_internal_errors_do_not_echo_their_text() -> None:
    class Broken(NoDrafter):
        name = "broken"

        # begin, not propose: a sampled first token may be EOS, and then nothing is ever proposed (a flaky pass).
        def begin(self, prompt_ids):
            raise RuntimeError("/secret/path/inside")

    with serving(Broken()) as u:
        r = httpx.post(f"{u}/v1/chat/completions", json={"messages": HI, "max_tokens": 4})
        assert r.status_code == 500 and "secret" not in r.text and r.json()["error"]["type"] == "server_error"


def test_api_key_from_the_environment_or_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from dartspec.cli import api_key
    from dartspec.errors import DartspecError

    def args(**kw) -> argparse.Namespace:
        return argparse.Namespace(**{"api_key": None, "api_key_file": None, **kw})

    monkeypatch.delenv("DARTSPEC_API_KEY", raising=False)
    assert api_key(args()) is None
    monkeypatch.setenv("DARTSPEC_API_KEY", "from-env")
    assert api_key(args()) == "from-env" and api_key(args(api_key="flag")) == "flag"
    (tmp_path / "key").write_text("from-file\n")
    assert api_key(args(api_key_file=str(tmp_path / "key"))) == "from-file"
    with pytest.raises(DartspecError, match="not both"):
        api_key(args(api_key="a", api_key_file=str(tmp_path / "key")))
    (tmp_path / "empty").write_text("")
    with pytest.raises(DartspecError, match="empty"):
        api_key(args(api_key_file=str(tmp_path / "empty")))
    for empty in ("", "  "):  # the server ran open before, without a word
        with pytest.raises(DartspecError, match="--api-key is empty"):
            api_key(args(api_key=empty))


def test_load_of_64_clients_with_hostile_requests_stays_exact_and_live() -> None:
    from dartspec.bench.load import run_load

    prompts = [prompt(i)[0]["content"] for i in range(8)]
    with serving(max_queue=80) as u:
        rep = run_load(u, prompts, model="tiny", clients=64, requests=64, max_tokens=16, timeout_s=240)
    assert rep.completed == 64 and rep.mismatches == 0 and not rep.failures, rep.failures[:3]
    assert rep.hostile == {"oversized body": 413, "malformed JSON": 400, "lone surrogate": 400, "seed 2^70": 400}
    assert rep.largest_body_bytes > 4 * 2**20 and rep.health_checks > 0
    # /health is served by the event loop while generation runs in a worker thread: it must stay live. (A
    # liveness bound, not a speed figure: `dartspec bench load` measures the real one, README "Serving".)
    assert rep.health_worst_ms < 2000


def test_bench_serve_measures_levels_and_checks_answers(tmp_path: Path) -> None:
    from dartspec.bench.serve import markdown, run_serve_bench, write_results

    texts = [prompt(i)[0]["content"] for i in range(6)]
    with serving(SlowDrafter(), max_batch=4) as u:
        levels = run_serve_bench(u, texts, model="tiny", concurrency=[4, 2], max_tokens=12)
    assert [lv.concurrency for lv in levels] == [1, 2, 4]
    assert all(lv.requests == 6 and not lv.failures and lv.mismatches == 0 for lv in levels)
    assert levels[0].mean_batch == 1.0 and levels[2].mean_batch > 1.5
    assert levels[0].vs_one == 1.0 and all(lv.tokens > 0 and lv.per_token_ms[0] > 0 for lv in levels)
    write_results(levels, {"drafter": "slow"}, tmp_path, plot=False)
    assert "| 4 |" in (tmp_path / "serve.md").read_text() and "mismatches" in markdown(levels, {})


@pytest.mark.skipif(not exact.available(), reason="no C compiler for dartspec's kernels")
def test_bench_serve_with_a_shared_system_prompt_shares_its_kv(tmp_path: Path) -> None:
    """16 requests behind one long system message: the prefix cache supplies most prompt tokens, the KV held
    is a fraction of the unshared, and every answer equals the answer without the cache."""
    from test_batching import lean_target

    from dartspec.bench.serve import markdown, run_serve_bench

    system = " ".join(f"t{2 + i % 8}" for i in range(64))
    texts = [prompt(i)[0]["content"] for i in range(8)]
    runs, answers = {}, {}
    for cached in (False, True):
        target = lean_target()
        target.tokenizer.chat_template = TEMPLATE
        if cached:
            target.enable_prefix_cache(1 << 28)
        with serving(target=target, max_batch=8) as u:
            runs[cached] = run_serve_bench(
                u, texts, model="tiny", concurrency=[8], max_tokens=12, system=system, kv_poll_s=0.002
            )
            with_system = [[{"role": "system", "content": system}, {"role": "user", "content": t}] for t in texts[:3]]
            answers[cached] = [stream_text(client(u), m, max_tokens=12) for m in with_system]
    for levels in runs.values():
        assert all(not lv.failures and lv.mismatches == 0 for lv in levels)
    plain, shared = runs[False][-1], runs[True][-1]
    assert plain.prefix_hit == 0 and shared.prefix_hit > 0.8  # 64 of every ~70 prompt tokens
    assert 0 < shared.kv_mb < 0.6 * shared.kv_unshared_mb
    # the batched steps' attention read the 64 shared tokens once per step, not once per request
    assert 0 < shared.kv_read_mb < 0.6 * shared.kv_read_unshared_mb
    assert plain.kv_read_mb == pytest.approx(plain.kv_read_unshared_mb)
    assert "prefix cache" in markdown(runs[True], {"prefix_cache_mb": 256})
    assert answers[True] == answers[False] and all(answers[True])
