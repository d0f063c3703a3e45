"""Sampling processors, seeded reproducibility and stop handling."""

from __future__ import annotations

import math

import pytest
import torch
from fastgen_helpers import engine_for

from shardspeed.inference.fastgen.output_processor import OutputProcessor
from shardspeed.inference.fastgen.request import Request
from shardspeed.inference.fastgen.sampling import (
    apply_repetition_penalty,
    apply_top_k,
    apply_top_p,
    sample_next_tokens,
)
from shardspeed.inference.fastgen.sampling_params import SamplingParams

NEG = -math.inf


def test_top_k_keeps_k_largest_per_row():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0], [0.0, -1.0, 5.0, 6.0]])
    out = apply_top_k(logits, 2)
    assert out.tolist() == [[NEG, 4.0, 3.0, NEG], [NEG, NEG, 5.0, 6.0]]
    assert torch.equal(apply_top_k(logits, 0), logits)


def test_top_p_keeps_smallest_set_reaching_mass():
    probs = torch.tensor([[0.5, 0.2, 0.25, 0.05]])
    logits = probs.log()
    assert torch.isfinite(apply_top_p(logits, 0.5)).tolist() == [[True, False, False, False]]
    assert torch.isfinite(apply_top_p(logits, 0.7)).tolist() == [[True, False, True, False]]
    assert torch.isfinite(apply_top_p(logits, 0.96)).tolist() == [[True, True, True, True]]
    assert torch.isfinite(apply_top_p(logits, 1e-6)).sum() == 1  # argmax always kept


def test_repetition_penalty_divides_positive_multiplies_negative():
    logits = torch.tensor([[2.0, -2.0, 1.0], [2.0, -2.0, 1.0]])
    apply_repetition_penalty(logits, [[0, 1, 1], []], 2.0)
    assert logits.tolist() == [[1.0, -4.0, 1.0], [2.0, -2.0, 1.0]]


def _req(rid: str, **kw) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(**kw))


def test_greedy_with_penalty_and_mixed_param_groups():
    logits = torch.tensor([[0.0, 3.0, 2.9, 0.0], [0.0, 3.0, 2.9, 0.0]])
    reqs = [_req("a"), _req("b", repetition_penalty=1.5)]
    reqs[1].prompt_token_ids = [1]  # token 1: 3.0 / 1.5 = 2.0 < 2.9
    assert sample_next_tokens(logits, reqs) == [1, 2]


def test_seeded_sampling_reproducible_regardless_of_batch():
    logits = torch.randn(3, 50)
    a = [_req("a", temperature=1.0, seed=123) for _ in range(3)]
    draws_a = [sample_next_tokens(logits[:1], [a[0]]) for _ in range(5)]
    # same seed, batched with other (unseeded and differently seeded) requests
    b = _req("b", temperature=1.0, seed=123)
    others = [_req("x", temperature=1.0), _req("y", temperature=1.0, seed=9)]
    draws_b = [sample_next_tokens(logits, [b, *others])[:1] for _ in range(5)]
    assert draws_a == draws_b
    c = _req("c", temperature=1.0, seed=124)
    draws_c = [sample_next_tokens(logits[:1], [c]) for _ in range(5)]
    assert draws_c != draws_a


def test_top_k_one_sampling_equals_greedy():
    logits = torch.randn(4, 30)
    reqs = [_req(str(i), temperature=0.8, top_k=1) for i in range(4)]
    assert sample_next_tokens(logits, reqs) == logits.argmax(-1).tolist()


class _CharTokenizer:
    """Token t -> one lowercase letter; eos is 0."""

    eos_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return "".join(
            chr(ord("a") + (t - 1) % 26) for t in ids if not (skip_special_tokens and t == 0)
        )


def test_stop_string_trims_text_and_stop_tokens():
    proc = OutputProcessor(_CharTokenizer(), eos_token_ids=[0], max_seq_len=100)
    req = Request("r", [5], SamplingParams(max_new_tokens=20, stop=["cd", "zz"]))
    reasons = [proc.append(req, t, 0.0) for t in [1, 2, 3]]  # "abc"
    assert reasons == [None, None, None] and req.text == "abc"
    assert proc.append(req, 4, 0.0) == "stop"  # "abcd" contains "cd"
    assert req.text == "ab" and req.output_token_ids == [1, 2, 3, 4]

    req = Request("e", [5], SamplingParams(max_new_tokens=20))
    assert proc.append(req, 0, 0.0) == "stop" and req.text == ""
    req = Request("i", [5], SamplingParams(max_new_tokens=2, ignore_eos=True, stop_token_ids=[9]))
    assert proc.append(req, 0, 0.0) is None
    assert proc.append(req, 5, 0.0) == "length"
    req = Request("s", [5], SamplingParams(stop_token_ids=[9]))
    assert proc.append(req, 9, 0.0) == "stop"
    req = Request("m", [5] * 98, SamplingParams())
    assert proc.append(req, 1, 0.0) is None and proc.append(req, 1, 0.0) == "length"  # max_seq_len


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_sampling_params_validate_names_field(kwargs, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**kwargs).validate()


def test_sampling_params_accepts_single_stop_values():
    p = SamplingParams(stop="\n", stop_token_ids=2)
    assert p.stop == ["\n"] and p.stop_token_ids == [2]
    p.validate()


def test_greedy_tokens_equal_argmax_of_finite_logits() -> None:
    from shardspeed.inference.fastgen.sampling import finite_logits, greedy_tokens

    inf, nan = float("inf"), float("nan")
    logits = torch.tensor(
        [
            [0.1, 2.0, -1.0, 2.0],  # a tie: the first maximum
            [0.1, inf, 3.0, inf],  # overflow to +inf: the first one
            [-inf, -inf, -5.0, -inf],  # filtered tokens stay out
            [nan, 1.0, 4.0, 0.0],  # nan is not chosen (argmax alone would pick it)
            [nan, nan, nan, 7.0],
        ]
    )
    expected = finite_logits(logits).argmax(dim=-1).tolist()
    assert greedy_tokens(logits) == expected == [1, 1, 2, 2, 3]
    assert greedy_tokens(logits[:3]) == expected[:3]


@pytest.mark.parametrize("native", [True, False], ids=["fused_kernel", "chunked_torch"])
@pytest.mark.parametrize("vocab", [255, 512, 32000, 32003, 50257])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_row_argmax_is_argmax(vocab: int, dtype: torch.dtype, native: bool) -> None:
    """The fused kernel's and the chunked argmax = torch.argmax: first maximum, ties, +inf,
    nan (in the body or tail), rows of -inf, signed zeros, rows of a wider tensor."""
    from shardspeed.inference.fastgen import cpu_fused
    from shardspeed.inference.fastgen.sampling import row_argmax

    cpu_fused.set_enabled(native)
    try:
        _check_row_argmax(row_argmax, vocab, dtype)
    finally:
        cpu_fused.set_enabled(None)


def _check_row_argmax(row_argmax, vocab: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(vocab)
    for case in range(11):
        x = torch.randn(5, vocab, generator=gen)
        if case in (1, 5):
            x = x.round()  # many ties: the first maximum must win
        if case == 2:
            x[0, [7, vocab - 1]] = float("nan")
        if case == 3:
            x[1, vocab - 1] = float("nan")  # nan only in the tail
        if case == 4:
            x[2, [vocab // 2, vocab - 1]] = float("inf")
        if case == 6:
            x[:, -1] = x.max() + 1  # the tail's maximum wins
        if case == 7:
            x[3, [3, vocab - 1]] = x[3].max() + 1  # tie between body and tail: body first
        if case == 8:
            x[0] = float("-inf")  # a row with every token filtered out
            x[1, 20:] = float("-inf")
        if case == 9:
            x = -x.abs()  # maxima at zeros of either sign
            x[4, [9, 40]] = torch.tensor([-0.0, 0.0])
        y = x.to(dtype)
        if case == 10:  # rows that are slices of a wider tensor (row stride > vocab)
            y = torch.cat([y, y[:, :7]], dim=1)[:, :vocab]
        assert torch.equal(row_argmax(y), y.argmax(-1)), (case, vocab, dtype)


def test_argmax_only_rows_sample_the_same_from_model_dtype_logits() -> None:
    """Greedy rows without processors, logprobs or grammar are sampled from bf16 logits as
    from their fp32 upcast (ties, +inf and nan rows included); other rows are not argmax-only."""
    from shardspeed.inference.fastgen.sampling import argmax_only, sample_next_tokens

    inf, nan = float("inf"), float("nan")
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 700, generator=gen).round().bfloat16()  # many ties
    logits[1, [5, 600]] = inf
    logits[2, 10] = nan
    logits[3] = float("-inf")
    logits[3, 699] = 1.0
    greedy = [Request(str(i), [1], SamplingParams(temperature=0.0)) for i in range(6)]
    assert all(argmax_only(r) for r in greedy)
    assert sample_next_tokens(logits, greedy) == sample_next_tokens(logits.float(), greedy)
    assert sample_next_tokens(logits, greedy)[1:4] == [5, int(logits[2].float().nan_to_num(
        nan=-inf).argmax()), 699]  # fmt: skip
    for params in (
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.0, repetition_penalty=1.2),
        SamplingParams(temperature=0.0, n=1, best_of=2),
    ):
        assert not argmax_only(Request("x", [1], params))
    guided = Request("g", [1], SamplingParams(temperature=0.0))
    guided.guide = object()
    assert not argmax_only(guided)


def test_engine_keeps_model_dtype_logits_only_for_argmax_only_batches(tiny_llama, monkeypatch):
    from shardspeed.inference.fastgen.model_runner import ModelRunner

    engine = engine_for(tiny_llama, dtype=torch.bfloat16)
    seen: list[bool] = []
    execute = ModelRunner.execute

    def spy(self, batch, keep_dtype=False):
        seen.append(keep_dtype)
        return execute(self, batch, keep_dtype)

    monkeypatch.setattr(ModelRunner, "execute", spy)
    greedy = SamplingParams(max_new_tokens=4, ignore_eos=True)
    reference = [o.output_token_ids for o in engine.generate([[5, 6, 7], [9, 8]], greedy)]
    assert seen and all(seen)
    seen.clear()
    with_logprobs = SamplingParams(max_new_tokens=4, ignore_eos=True, logprobs=1)
    outs = engine.generate([[5, 6, 7], [9, 8]], [greedy, with_logprobs])
    assert not any(seen)  # one row needs fp32 log-probabilities: the whole step upcasts
    assert [o.output_token_ids for o in outs] == reference
