"""Structured output through the real ``openai`` client: ``response_format``
(``json_schema`` / ``json_object``) and vLLM's ``guided_json`` / ``guided_regex`` /
``guided_grammar`` / ``guided_choice`` (``extra_body``), on a tiny random Llama over a
byte-level BPE vocabulary (tests/serving/structured_helpers.py). Sampling at
temperature 1 makes the random model wander over the whole vocabulary, so every
output that parses and validates was shaped by the token masks alone.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import jsonschema
import openai
import pytest
from serving_helpers import MODEL_NAME, start_server
from structured_helpers import bpe_tokenizer, tiny_llama

from shardspeed.inference.fastgen.engine import InferenceEngine
from shardspeed.inference.fastgen.sampling_params import SamplingParams
from shardspeed.inference.fastgen.structured import StructuredOutputParams

# Bounded schemas: a random model ends each value because the grammar makes it.
SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "age", "ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "city": {"enum": ["Paris", "Lima", "Oslo"]},
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 4},
                "minItems": 1,
                "maxItems": 3,
            },
        },
        "required": ["city", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": -50, "maximum": 50},
            "items": {
                "type": "array",
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {"ok": {"type": "boolean"}, "n": {"type": "null"}},
                    "required": ["ok"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["id", "items"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 4},
]


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    tokenizer = bpe_tokenizer()
    engine = InferenceEngine.from_pretrained(
        tiny_llama(len(tokenizer)), tokenizer=tokenizer, device="cpu", block_size=8
    )
    thread, _ = start_server(engine, max_tokens_limit=512)
    yield openai.OpenAI(base_url=thread.base_url + "/v1", api_key="unused", max_retries=0)
    thread.stop()


def _chat(client: openai.OpenAI, **kwargs):
    messages = [{"role": "user", "content": "Answer in JSON."}]
    return client.chat.completions.create(model=MODEL_NAME, messages=messages, **kwargs)


def test_100_json_objects_validate_against_their_schema(client):
    checked = 0
    for i, schema in enumerate(SCHEMAS):
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}
        texts = []
        for n in (16, 9):  # 25 objects per schema (the server allows n <= 16)
            r = _chat(client, response_format=fmt, n=n, temperature=1.0, seed=i, max_tokens=200)
            assert len(r.choices) == n
            for choice in r.choices:
                assert choice.finish_reason == "stop", choice.message.content
                jsonschema.validate(json.loads(choice.message.content), schema)
                texts.append(choice.message.content)
        checked += len(texts)
        assert len(set(texts)) > 5  # sampled, not one answer
    assert checked == 100


def test_json_object(client):
    r = _chat(client, response_format={"type": "json_object"}, n=4, temperature=1.0, max_tokens=300)
    for choice in r.choices:
        if choice.finish_reason == "stop":  # an open-ended object may run to max_tokens
            assert isinstance(json.loads(choice.message.content), dict)
        assert choice.message.content.startswith("{")


def test_guided_json_on_completions_and_streamed(client):
    schema = SCHEMAS[0]
    body = dict(model=MODEL_NAME, prompt="JSON:", max_tokens=100, temperature=1.0, seed=3)
    r = client.completions.create(**body, extra_body={"guided_json": schema})
    jsonschema.validate(json.loads(r.choices[0].text), schema)
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(**body, stream=True, extra_body={"guided_json": schema})
    )
    assert streamed == r.choices[0].text


def test_guided_regex_choice_and_grammar(client):
    pattern = r"[A-Z][a-z]{2,5}-\d{3}"
    r = client.completions.create(
        model=MODEL_NAME, prompt="Code:", max_tokens=30, temperature=1.0, n=5, seed=1,
        extra_body={"guided_regex": pattern},
    )  # fmt: skip
    for c in r.choices:
        assert re.fullmatch(pattern, c.text), c.text
        assert c.finish_reason == "stop"
    choices = ["yes", "no", "maybe so"]
    r = _chat(client, n=6, temperature=1.0, extra_body={"guided_choice": choices})
    assert {c.message.content for c in r.choices} <= set(choices)
    lark = 'start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,2}/'
    r = client.completions.create(
        model=MODEL_NAME, prompt="Sum:", max_tokens=60, temperature=1.0, n=4, seed=2,
        extra_body={"guided_grammar": lark},
    )  # fmt: skip
    for c in r.choices:
        if c.finish_reason == "stop":
            assert re.fullmatch(r"\(\d{1,2}(\+\d{1,2})*\)", c.text), c.text


def test_structured_output_errors_are_400_naming_the_field(client):
    cases = [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
        ),
        ({"extra_body": {"guided_json": {"type": "objekt"}}}, "guided_json"),
        ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex"),
        ({"extra_body": {"guided_grammar": "start: undefined_rule"}}, "guided_grammar"),
        ({"extra_body": {"guided_choice": []}}, "guided_choice"),
        (
            {"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a+"}},
            "guided_regex",
        ),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            _chat(client, max_tokens=5, **kwargs)
        assert info.value.body["param"] == param, info.value.body
    ok = _chat(client, max_tokens=3, response_format={"type": "text"})  # free text
    assert ok.choices[0].finish_reason == "length"


def test_tokenizer_without_eos_ends_at_grammar_end():
    """Engine level: a virtual EOS id lets llguidance end; it is never sampled."""
    tokenizer = bpe_tokenizer(eos=False)
    model = tiny_llama(len(tokenizer) + 8)  # padded vocabulary: ids the tokenizer lacks
    engine = InferenceEngine.from_pretrained(model, tokenizer=tokenizer, device="cpu")
    assert engine.output_processor.eos_token_ids == set()
    params = SamplingParams(
        max_new_tokens=80,
        temperature=1.0,
        n=5,
        seed=3,
        structured_output=StructuredOutputParams(json=SCHEMAS[0]),
    )
    outs = engine.generate(["x"], params)
    for out in outs:
        assert max(out.output_token_ids) < len(tokenizer)  # neither padding nor virtual EOS
        jsonschema.validate(json.loads(out.text), SCHEMAS[0])
        assert out.finish_reason == "stop"
    engine.mask_prefetch.enabled = False  # masks computed after the forward: same tokens
    again = engine.generate(["x"], params)
    assert [o.output_token_ids for o in again] == [o.output_token_ids for o in outs]
