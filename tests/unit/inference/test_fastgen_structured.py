"""FastGen structured output at the engine level (llguidance token masks): the masks
leave unconstrained rows untouched, every sample of a constrained request matches its
grammar (n > 1, preemption), and bad constraints fail with a message naming them."""

from __future__ import annotations

import json
import re
import time

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


def test_numpy_and_torch_fills_match_masked_fill(engine):
    """CPU float32 rows are masked in numpy (fmin with a NaN / -inf bias), other dtypes
    with masked_fill_: both equal masked_fill_ of the unpacked mask, NaN and inf logits
    included; ids past the mask (a padded vocabulary) are blocked."""
    so = StructuredOutputParams(regex="[a-c]{2}x")
    reqs = [type("R", (), {"guide": engine.guides.new_guide(so)})() for _ in range(2)]
    reqs[1].guide.accept(ord("a"))
    reqs.insert(1, type("R", (), {"guide": None})())
    logits = torch.randn(3, 300)
    logits[:, 97:101] = torch.tensor([float("nan"), float("inf"), -0.0, float("nan")])
    blocked = ~allowed_tokens(compute_bitmask([reqs[0].guide, reqs[2].guide]), 300)
    expected = logits.clone()
    expected[0].masked_fill_(blocked[0], float("-inf"))
    expected[2].masked_fill_(blocked[1], float("-inf"))
    for dtype in (torch.float32, torch.float64):
        got = apply_guides(logits.to(dtype), reqs).float()
        assert torch.equal(got.isnan(), expected.isnan())
        assert torch.equal(got.nan_to_num(5.0), expected.nan_to_num(5.0))
        assert torch.equal(got.signbit(), expected.signbit())
    assert (~blocked[0]).nonzero().flatten().tolist() == [ord("a"), ord("b"), ord("c")]
    assert (~blocked[1]).nonzero().flatten().tolist() == [ord("a"), ord("b"), ord("c")]


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


# ------------------------------------------------ masks computed during the forward
def _run_steps(engine, prefetch: bool, fail_id: str | None = None) -> dict:
    """A mixed batch stepped by hand (plain greedy, JSON samplers, one JSON request with
    n=2, one aborted after 3 steps, ``fail_id``'s forward failing at step 2): request id
    -> (tokens, finish reason)."""
    engine.mask_prefetch.enabled = prefetch
    engine.add_request("alpha beta", SamplingParams(max_new_tokens=10), "plain")
    for s in range(3):
        engine.add_request("json:", _json(seed=s), f"json{s}")
    engine.add_request("two:", _json(n=2, seed=7), "pair")
    finals, steps = {}, 0
    execute = engine.runner.execute

    def failing(batch, *args):
        if steps >= 2 and any(s.request.request_id == fail_id for s in batch.sequences):
            raise RuntimeError("injected forward failure")
        return execute(batch, *args)

    engine.runner.execute = failing
    try:
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = (out.output_token_ids, out.finish_reason)
            steps += 1
            if steps == 3:
                engine.abort("json1")
    finally:
        del engine.runner.execute
    if fail_id is not None:
        assert engine.take_error(fail_id) is not None
    return finals


@pytest.mark.parametrize("fail_id", [None, "json2"])
def test_prefetched_masks_give_the_same_tokens(engine, monkeypatch, fail_id):
    import shardspeed.inference.fastgen.structured.masks as masks

    computed_now = []  # guided rows whose masks were computed after the forward
    real = masks.compute_bitmask
    monkeypatch.setattr(masks, "compute_bitmask", lambda g: computed_now.append(len(g)) or real(g))
    taken = []
    take = engine.mask_prefetch.take
    monkeypatch.setattr(engine.mask_prefetch, "take", lambda: taken.append(take()) or taken[-1])
    reference = _run_steps(engine, prefetch=False, fail_id=fail_id)
    assert sum(m is not None for m in taken) == 0 and sum(computed_now) > 50
    taken.clear()
    computed_now.clear()
    assert _run_steps(engine, prefetch=True, fail_id=fail_id) == reference
    assert sum(m is not None for m in taken) > 10  # precomputed masks were used...
    assert sum(computed_now) == 2  # ...except at the fork: "pair#0" and its copy "pair#1"
    assert reference["json1"][1] == "abort"
    assert reference["json2"][1] == ("error" if fail_id else "stop")
    for rid in ("json0", "pair#0", "pair#1"):
        assert reference[rid][1] == "stop"
        jsonschema.validate(json.loads(ByteTokenizer().decode(reference[rid][0])), SCHEMA)


def test_prefetched_rows_are_used_only_at_the_state_they_were_computed_for(engine, monkeypatch):
    import shardspeed.inference.fastgen.structured.prefetch as prefetch

    so = StructuredOutputParams(regex="[ab]c[de]")
    req = type("R", (), {"fork_ids": []})()
    req.guide = engine.guides.new_guide(so)
    other = type("R", (), {"fork_ids": [], "guide": engine.guides.new_guide(so)})()
    slow = prefetch.fill_bitmask

    def slow_fill(guides, bitmask):
        time.sleep(0.05)
        slow(guides, bitmask)

    monkeypatch.setattr(prefetch, "fill_bitmask", slow_fill)
    prefetcher = prefetch.MaskPrefetcher()
    prefetcher.submit([req])
    pending = req.guide.in_flight
    assert pending is not None and not pending.done()
    copy = req.guide.fresh()  # waits for the computation reading the matcher
    assert pending.done() and copy.num_accepted == 0
    masks = prefetcher.take()
    assert masks.row_of(req.guide) == 0 and masks.row_of(copy) is None
    assert masks.row_of(other.guide) is None
    req.guide.accept(ord("a"))  # the guide moves on: its precomputed row is stale
    assert masks.row_of(req.guide) is None
    logits = torch.zeros(2, 256)
    apply_guides(logits, [req, other], masks)  # both rows recomputed now
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [ord("c")]
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [ord("a"), ord("b")]

    def broken(guides, bitmask):
        raise RuntimeError("worker failure")

    monkeypatch.setattr(prefetch, "fill_bitmask", broken)
    prefetcher.submit([req, other])
    assert prefetcher.take() is None  # the engine then computes every mask itself
    prefetcher.enabled = False
    prefetcher.submit([req])
    assert prefetcher.take() is None and req.guide.in_flight is None
    prefetcher.close()


def test_speculative_steps_mask_their_guided_rows_themselves():
    """Decode steps of a speculative engine never submit masks (the speculator masks its
    guided rows, which it does not speculate for, after its forward); prompt steps do."""
    engine = _engine(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    prompts = ["ab ab ab ab ab", "json:", "json:"]
    params = [SamplingParams(max_new_tokens=12)] + [_json(seed=s) for s in range(2)]
    runs = []
    for prefetch in (True, False):
        engine.mask_prefetch.enabled = prefetch
        runs.append([o.output_token_ids for o in engine.generate(prompts, params)])
    assert runs[0] == runs[1] and engine.speculator.stats.num_verified > 0
    for tokens in runs[0][1:]:
        jsonschema.validate(json.loads(ByteTokenizer().decode(tokens)), SCHEMA)
