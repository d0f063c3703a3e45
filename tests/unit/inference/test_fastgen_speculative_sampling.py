"""Speculative rejection sampling keeps the target's distribution (chi-square tests).

A 16-token vocabulary, one fixed prompt, thousands of 5-token samples: the joint
distribution of the 2nd and 3rd sampled tokens (both from speculative steps proposing
3 tokens: rejection draws, residual draws and accepted proposals) is compared with the
target's exact one (from the HF model, after temperature / top-k / top-p). The
draft is a different random model, so many proposals are rejected and the residual
``norm(max(0, p - q))`` draws matter; the same samples measured against the draft's own
distribution must fail the test (it has the power to see a wrong sampler).
"""

from __future__ import annotations

import math

import pytest
import torch

from shardspeed.inference.fastgen.engine import EngineConfig, InferenceEngine
from shardspeed.inference.fastgen.sampling import apply_top_k, apply_top_p
from shardspeed.inference.fastgen.sampling_params import SamplingParams

V = 16
PROMPT = [3, 4, 5, 3, 4, 5, 3, 4]  # repetitive: prompt lookup proposes [5, 3, 4]
NUM_SAMPLES = 2000


def _llama(layers: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      initializer_range=0.3)  # fmt: skip
    return LlamaForCausalLM(cfg).float().eval()


def _probs(model, rows: list[list[int]], params: SamplingParams) -> torch.Tensor:
    """Next-token sampling distribution after each row of equal-length ids (``[R, V]``)."""
    with torch.no_grad():
        logits = model(torch.tensor(rows)).logits[:, -1].float() / params.temperature
    return apply_top_p(apply_top_k(logits, params.top_k), params.top_p).softmax(-1)


def _joint(model, params: SamplingParams) -> torch.Tensor:
    """Exact ``P(t2, t3)`` of the model's sampling after ``PROMPT`` (``[V, V]``): the
    second and third sampled tokens, which speculative steps produce (the first comes
    from the prompt's forward)."""
    p1 = _probs(model, [PROMPT], params)[0]  # [V]
    p2 = _probs(model, [[*PROMPT, a] for a in range(V)], params)  # [V(t1), V(t2)]
    rows = [[*PROMPT, a, b] for a in range(V) for b in range(V)]
    p3 = _probs(model, rows, params).view(V, V, V)  # [t1, t2, t3]
    return (p1[:, None, None] * p2[:, :, None] * p3).sum(0)  # [V(t2), V(t3)]


def _chi_square_rejects(counts: torch.Tensor, expected_p: torch.Tensor) -> tuple[bool, float]:
    """Pearson's test at p = 1e-3 (cells with expected count < 5 pooled into one)."""
    n = float(counts.sum())
    expected = expected_p.flatten().double() * n
    counts = counts.flatten().double()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    z = 3.09  # one-sided 1e-3; Wilson-Hilferty approximation of the chi-square quantile
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat > critical, stat / critical


PARAMS = {
    "temperature": SamplingParams(max_new_tokens=5, temperature=1.0, ignore_eos=True),
    "top_k_top_p": SamplingParams(max_new_tokens=5, temperature=0.8, top_k=8, top_p=0.9,
                                  ignore_eos=True),
}  # fmt: skip


# two of the four cases run with the slow tier (each is ~3 s of CPU here)
CASES = [
    ("draft_model", "temperature"),
    ("ngram", "top_k_top_p"),
    pytest.param("ngram", "temperature", marks=pytest.mark.slow),
    pytest.param("draft_model", "top_k_top_p", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("method", "name"), CASES)
def test_speculative_samples_follow_the_target_distribution(method, name):
    target, draft = _llama(2, seed=0), _llama(1, seed=1)
    draft.load_state_dict(target.state_dict(), strict=False)  # early exit: layer 0 + head
    params = PARAMS[name]
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        spec["model"] = draft
    config = EngineConfig(block_size=4, num_blocks=2048, max_ragged_batch_size=2048,
                          max_ragged_sequence_count=256, speculative_config=spec)  # fmt: skip
    engine = InferenceEngine(target, config=config)
    torch.manual_seed(1234)
    outs = engine.generate([PROMPT] * NUM_SAMPLES, params)
    counts = torch.zeros(V * V)
    for o in outs:
        t2, t3 = o.output_token_ids[1:3]
        counts[t2 * V + t3] += 1
    stats = engine.speculator.stats
    assert stats.num_draft_tokens > 0 and 0.05 < stats.acceptance_rate < 0.95, stats
    rejected, ratio = _chi_square_rejects(counts, _joint(target, params))
    assert not rejected, f"chi-square / critical = {ratio:.2f}"
    if method == "draft_model":  # the test tells the draft's distribution apart
        assert _chi_square_rejects(counts, _joint(draft, params))[0]
