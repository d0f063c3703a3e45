"""FastGen expert parallelism with spawned gloo workers: token-identical to one process.

``pipeline(model, expert_parallel=E)`` against the single-process engine on tiny
random MoE models: Mixtral from a saved directory (prefix caching, ``n=2`` seeded
samples that fork KV blocks, several prompts under a small token budget so prompts
are chunked and batched with decodes), Qwen2-MoE (shared expert, a dense-MLP
layer; the one-collective ``all_gather`` dispatch) and, in the slow tier, ep 4. Then
teardown (no worker left) and a killed expert rank (an error naming it, not a hang; the
engine stays down). Each spawned engine costs a worker start (~2 s CPU, mostly
``import torch``); every rank runs one thread.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
import torch

from shardspeed.inference.fastgen.engine import InferenceEngine
from shardspeed.inference.fastgen.expert_parallel import ExpertParallelError
from shardspeed.inference.fastgen.sampling_params import SamplingParams
from shardspeed.inference.serving.pipeline import pipeline

VOCAB = 128
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.1,
)  # fmt: skip
ENGINE = dict(block_size=4, num_blocks=256, max_ragged_batch_size=16, device="cpu")
GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)


@pytest.fixture(autouse=True)
def _one_thread_per_rank():
    """Each rank (this process and its spawned workers, which inherit the count) uses one
    thread: two ranks of two OpenMP threads on a 2-core box spin against each other."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def _hf_model(config_cls: str, **overrides: Any) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = getattr(transformers, config_cls)(**{**COMMON, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return model.float().eval()


def _mixtral(num_experts: int = 4) -> torch.nn.Module:
    return _hf_model("MixtralConfig", num_local_experts=num_experts, num_experts_per_tok=2)


def _prompts(seed: int, lengths: tuple[int, ...] = (3, 29, 11, 17, 6)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _generate(engine: InferenceEngine, prompts: list[list[int]], params: list[SamplingParams]):
    return [o.output_token_ids for o in engine.generate(prompts, params)]


def _assert_ep_matches_one_process(source: Any, prompts: list[list[int]], ep: int, **engine: Any):
    """ep tokens == one-process tokens: greedy, except the first prompt's two seeded
    samples (the second forks the first's KV blocks)."""
    forked = SamplingParams(max_new_tokens=8, ignore_eos=True, n=2, temperature=0.8, seed=7)
    params = [forked] + [GREEDY] * (len(prompts) - 1)
    kwargs = {**ENGINE, **engine}
    want = _generate(InferenceEngine.from_pretrained(source, **kwargs), prompts, params)
    pipe = pipeline(source, expert_parallel=ep, **kwargs)
    got = _generate(pipe.engine, prompts, params)
    assert got == want
    return pipe


def _gone(pid: int | None, timeout: float = 10.0) -> bool:
    """True once process ``pid`` has exited (a zombie not yet reaped counts as exited)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_mixtral_from_directory_ep2_is_token_identical(tmp_path) -> None:
    _mixtral().save_pretrained(tmp_path / "ckpt")
    prompts = _prompts(5)
    prompts.append(prompts[1][:20] + [7, 8, 9])  # shares a prefix (prefix caching)
    pipe = _assert_ep_matches_one_process(tmp_path / "ckpt", prompts, 2, enable_prefix_caching=True)
    assert pipe.engine.stats().prefix_cache_hit_blocks > 0  # the shared prefix was reused
    responses = pipe([[5, 6, 7, 8]], max_new_tokens=4, ignore_eos=True)
    assert len(responses[0].token_ids) == 4
    pids = pipe.engine.peers.worker_pids
    pipe.shutdown()
    assert all(_gone(pid) for pid in pids)


def test_qwen2_moe_shared_expert_ep2_is_token_identical_and_a_killed_rank_raises() -> None:
    qwen = _hf_model(
        "Qwen2MoeConfig", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
        shared_expert_intermediate_size=80, mlp_only_layers=[1],
    )  # fmt: skip
    pipe = _assert_ep_matches_one_process(
        qwen, _prompts(6), 2, expert_parallel_dispatch="all_gather"
    )
    engine = pipe.engine
    (pid,) = engine.peers.worker_pids
    os.kill(pid, signal.SIGKILL)
    assert _gone(pid)
    start = time.monotonic()
    with pytest.raises(
        ExpertParallelError, match="(?s)expert-parallel engine failed; .*worker rank 1 exited"
    ):
        engine.generate([[3, 4, 5]], GREEDY)
    assert time.monotonic() - start < 10
    with pytest.raises(ExpertParallelError, match="create a new engine"):
        engine.generate([[3, 4, 5]], GREEDY)  # stays down, fails fast
    pipe.shutdown()


@pytest.mark.slow  # 3 workers (~10 s here); the in-process test covers ep 4's exchange
def test_mixtral_ep4_is_token_identical() -> None:
    pipe = _assert_ep_matches_one_process(_mixtral(8), _prompts(8), 4)
    pids = pipe.engine.peers.worker_pids
    pipe.shutdown()
    assert all(_gone(pid) for pid in pids)
