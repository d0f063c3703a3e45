"""FastGen structured output at the engine level (llguidance token masks): the masks
leave unconstrained rows untouched, every sample of a constrained request matches its
grammar (n > 1, preemption), and bad constraints fail with a message naming them."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from shardspeed.inference.fastgen.engine import InferenceEngine
from shardspeed.inference.fastgen.sampling_params import SamplingParams
from shardspeed.inference.fastgen.structured import StructuredOutputParams, apply_guides
from shardspeed.inference.fastgen.structured.masks import allowed_tokens, compute_bitmask
from shardspeed.models.gpt import GPT, GPTConfig
from shardspeed.models.tokenizer import ByteTokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "n"],
    "additionalProperties": False,
}


def _engine(**config) -> InferenceEngine:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=256))
    config = {"block_size": 4, **config}
    return InferenceEngine.from_pretrained(model, tokenizer=ByteTokenizer(), device="cpu", **config)


@pytest.fixture(scope="module")
def engine() -> InferenceEngine:
    return _engine()


def _json(**kw) -> SamplingParams:
    so = StructuredOutputParams(json=SCHEMA)
    return SamplingParams(max_new_tokens=80, temperature=1.0, structured_output=so, **kw)


def test_unconstrained_requests_keep_their_tokens_in_a_mixed_batch(engine):
    plain = ["alpha beta", "gamma", "delta epsilon zeta"]
    greedy = SamplingParams(max_new_tokens=12)
    alone = [o.output_token_ids for o in engine.generate(plain, greedy)]
    mixed = engine.generate(plain + ["json:"] * 4, [greedy] * 3 + [_json(seed=s) for s in range(4)])
    assert [o.output_token_ids for o in mixed[:3]] == alone
    for out in mixed[3:]:
        jsonschema.validate(json.loads(out.text), SCHEMA)
        assert out.finish_reason == "stop"


def test_masks_touch_only_guided_rows(engine):
    logits = torch.randn(3, 256)
    reqs = [type("R", (), {"guide": None})() for _ in range(3)]
    before = logits.clone()
    assert apply_guides(logits, reqs) is logits  # no guided row: no copy, no work
    so = StructuredOutputParams(regex="[ab]c")
    reqs[1].guide = engine.guides.new_guide(so)
    out = apply_guides(logits, reqs)  # in place
    assert torch.equal(out[0], before[0]) and torch.equal(out[2], before[2])
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [ord("a"), ord("b")]
    allowed = allowed_tokens(compute_bitmask([reqs[1].guide]), 300)  # wider than the mask
    assert allowed.shape == (1, 300) and allowed.sum().item() == 2


def test_samples_preemption_regex_and_choice():
    engine = _engine(num_blocks=24, max_ragged_sequence_count=8)  # too few blocks: preempts
    outs = engine.generate(["json:"], _json(n=6, seed=1))
    assert engine.stats().num_preemptions > 0
    for out in outs:
        jsonschema.validate(json.loads(out.text), SCHEMA)
    regex = StructuredOutputParams(regex=r"[a-z]{3}@[a-z]{2}\.(com|org)")
    params = SamplingParams(max_new_tokens=30, temperature=1.0, n=4, seed=2)
    params.structured_output = regex
    for out in engine.generate(["mail:"], params):
        assert re.fullmatch(regex.regex, out.text) and out.finish_reason == "stop"
    pick = SamplingParams(
        max_new_tokens=8, structured_output=StructuredOutputParams(choice=["left", "right"])
    )
    assert engine.generate(["go"], pick)[0].text in ("left", "right")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({}, "exactly one of"),
        ({"regex": "a", "choice": ["b"]}, "exactly one of"),
        ({"choice": ["ok", ""]}, "choice"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"json": 3}, "must be a JSON schema"),
    ],
)
def test_bad_constraints_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(structured_output=StructuredOutputParams(**kwargs)).validate()


def test_constraints_that_do_not_compile_are_refused_at_add(engine):
    for so, match in [
        (StructuredOutputParams(regex="(a"), "regex"),
        (StructuredOutputParams(json={"type": "objekt"}), "json"),
        (StructuredOutputParams(grammar="start: missing"), "grammar"),
    ]:
        with pytest.raises(ValueError, match=match):
            engine.add_request("x", SamplingParams(structured_output=so))
    assert not engine.has_unfinished()
