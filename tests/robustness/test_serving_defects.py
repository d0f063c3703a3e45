"""One test per serving defect of issue 20 (each failed before its fix), plus the input
rules that came with them: null means the default, Content-Type is checked."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from serving_helpers import make_engine, start_server

from shardspeed.inference.fastgen.request import Request
from shardspeed.inference.fastgen.sampling import sample_next_tokens
from shardspeed.inference.fastgen.sampling_params import SamplingParams

GREEDY = {"prompt": "Hello", "max_tokens": 6, "temperature": 0}


def _post(base: str, body: object, path: str = "/v1/completions") -> httpx.Response:
    """POST ``body`` (bytes as they are; anything else as ASCII JSON, so that lone
    surrogates travel as ``\ud800`` escapes)."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    return httpx.post(base + path, content=content, headers=headers, timeout=30)


def _assert_healthy(base: str) -> None:
    r = httpx.get(base + "/health", timeout=10)
    assert r.status_code == 200 and r.json() == {"status": "ok"}, r.text


# ---- defect 1: a near-zero repetition_penalty killed the engine -------------------------


@pytest.mark.parametrize("penalty", [1e-300, 1e-39])
def test_tiny_repetition_penalty_is_a_400_and_the_engine_lives(server, penalty):
    base = server[0].base_url
    before = _post(base, GREEDY).json()["choices"][0]["text"]
    body = {"prompt": "aaaa bbbb aaaa", "max_tokens": 8, "temperature": 1.0}
    r = _post(base, {**body, "repetition_penalty": penalty})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "repetition_penalty"
    assert "[0.01, 10]" in err["message"] and repr(penalty) in err["message"]
    _assert_healthy(base)
    assert _post(base, GREEDY).json()["choices"][0]["text"] == before
    assert server[1].restarts == 0


@pytest.mark.parametrize("penalty", [1e-300, 1e-39, 1e-45])
@pytest.mark.parametrize("temperature", [1.0, 1e-4])
def test_sampler_survives_extreme_penalties(penalty, temperature):
    torch.manual_seed(0)
    logits = torch.randn(2, 64) * 8  # [M, V]
    reqs = [
        Request("a", list(range(64)), SamplingParams(temperature=temperature, seed=1)),
        Request("b", list(range(0, 64, 2)), SamplingParams(temperature=temperature)),
    ]
    for r in reqs:
        r.params.repetition_penalty = penalty
    tokens = sample_next_tokens(logits, reqs)
    assert all(0 <= t < 64 for t in tokens)


def test_sampler_survives_nan_logits():
    logits = torch.full((1, 16), float("nan"))
    req = Request("a", [1], SamplingParams(temperature=1.0))
    assert 0 <= sample_next_tokens(logits, [req])[0] < 16


def test_engine_generates_with_tiny_penalty():
    engine = make_engine()
    params = SamplingParams(max_new_tokens=8, temperature=1.0, repetition_penalty=1e-300)
    out = engine.generate(["aaaa bbbb aaaa"], params)[0]
    assert len(out.output_token_ids) == 8 and out.finish_reason == "length"


# ---- defect 2: deep JSON and unencodable text were 500s --------------------------------


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 40_000,
        b"[" * 40_000 + b"]" * 40_000,
        b'{"prompt": ' + b"[" * 40_000,
        b'{"prompt": "x", "a": ' + b'{"a": ' * 5_000 + b"1" + b"}" * 5_000 + b"}",
    ],
    ids=["open", "balanced", "in-field", "objects"],
)
def test_deeply_nested_json_is_400(server, body):
    r = _post(server[0].base_url, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_json"
    assert "nest deeper" in r.json()["error"]["message"]


def test_brackets_inside_strings_do_not_count_as_depth(server):
    r = _post(server[0].base_url, {**GREEDY, "prompt": "[" * 100 + '"\\' + "{" * 100})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "a\ud800b", "max_tokens": 2}, "prompt"),
        ("/v1/completions", {"prompt": ["ok", "\udfff"], "max_tokens": 2}, "prompt.1"),
        ("/v1/completions", {"prompt": "x", "stop": ["\ud800"]}, "stop.0"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "\ud83d"}]},
            "messages.0.content",
        ),
    ],
)
def test_lone_surrogates_are_400_with_byte_tokenizer(server, path, body, param):
    r = _post(server[0].base_url, body, path=path)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert "surrogate" in r.json()["error"]["message"]


def test_valid_surrogate_pairs_are_fine(server):
    r = _post(server[0].base_url, {**GREEDY, "prompt": "emoji \U0001f600"})
    assert r.status_code == 200, r.text


def _hf_tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "a": 3}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def test_lone_surrogate_is_400_with_hf_tokenizer():
    engine = make_engine()
    engine.tokenizer = _hf_tokenizer()
    engine.output_processor.tokenizer = engine.tokenizer
    thread, async_engine = start_server(engine)
    try:
        base = thread.base_url
        assert _post(base, {"prompt": "hello world", "max_tokens": 2}).status_code == 200
        r = _post(base, {"prompt": "hello \ud800", "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        _assert_healthy(base)
    finally:
        thread.stop()
    # Behind the API check, the engine itself turns the tokenizer's TypeError into a
    # ValueError (a 400 for the server, a clear error for pipeline() users). The server's
    # shutdown shut its engine down too, so a fresh one is asked.
    engine = make_engine()
    engine.tokenizer = engine.output_processor.tokenizer = _hf_tokenizer()
    with pytest.raises(ValueError, match="could not be tokenized"):
        engine.add_request("hello \ud800")


# ---- nulls, content types, non-JSON numbers --------------------------------------------


def test_null_means_default(server):
    base = server[0].base_url
    expected = _post(base, {**GREEDY, "max_tokens": 16}).json()["choices"][0]["text"]
    nulls = dict.fromkeys(
        [
            "max_tokens",
            "top_p",
            "n",
            "stop",
            "seed",
            "stream",
            "stream_options",
            "presence_penalty",
            "frequency_penalty",
            "logprobs",
            "echo",
            "best_of",
            "suffix",
            "user",
            "top_k",
            "repetition_penalty",
            "ignore_eos",
        ]
    )
    r = _post(base, {"prompt": "Hello", "temperature": 0, **nulls})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected
    chat = {"messages": [{"role": "user", "content": None, "name": None}], "temperature": None}
    r = _post(
        base, {**chat, "max_tokens": None, "tools": None, "logprobs": None}, "/v1/chat/completions"
    )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("content_type", "status"),
    [
        ("text/plain", 415),
        ("application/x-www-form-urlencoded", 415),
        ("multipart/form-data; boundary=x", 415),
        ("application/json; charset=utf-8", 200),
        ("application/vnd.api+json", 200),
    ],
)
def test_content_type_is_checked(server, content_type, status):
    body = b'{"prompt": "Hello", "max_tokens": 2, "temperature": 0}'
    r = httpx.post(
        server[0].base_url + "/v1/completions",
        content=body,
        headers={"content-type": content_type},
        timeout=30,
    )
    assert r.status_code == status, r.text
    if status == 415:
        assert r.json()["error"]["code"] == "unsupported_media_type"


@pytest.mark.parametrize(
    "body",
    [
        b'{"prompt": "x", "temperature": NaN}',
        b'{"prompt": "x", "top_p": Infinity}',
        b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",
        b'{"prompt": "x", "temperature": 1e999}',
        b"\xff\xfe{}",
        b"",
    ],
)
def test_non_json_numbers_and_bytes_are_400(server, body):
    assert _post(server[0].base_url, body).status_code == 400


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("temperature", 2.5, "[0, 2]"),
        ("top_p", 0, "(0, 1]"),
        ("top_k", -5, "[-1, 2147483647]"),
        ("seed", 2**64, "18446744073709551615"),
        ("presence_penalty", 2.5, "[-2, 2]"),
        ("stop", "x" * 2000, "1024 characters"),
    ],
)
def test_out_of_range_names_field_value_and_range(server, field, value, allowed):
    r = _post(server[0].base_url, {"prompt": "x", field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and allowed in err["message"]
    assert str(value)[:20] in err["message"]


def test_top_k_minus_one_means_off(server):
    base = server[0].base_url
    a = _post(base, {**GREEDY, "top_k": -1}).json()["choices"][0]["text"]
    assert a == _post(base, GREEDY).json()["choices"][0]["text"]
