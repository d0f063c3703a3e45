"""FastGen tensor parallelism: ``pipeline(model, tensor_parallel=2)`` is token-identical to 1.

Three tiers:

* shard math (pure): head/KV-group split, KV-head replication, refusals;
* every TP-capable family sharded in one process, its ranks run in threads that sum
  through a barrier: rank 0's logits match the unsharded model's (prefill + decode);
* real runs: spawned gloo workers on tiny random Llama (GQA, from a saved directory,
  with prefix caching and ``n=2`` samples that fork KV blocks), GPT-2 (Conv1D,
  row-parallel biases) and, marked slow, Qwen2 (one KV head, replicated); several
  prompts of different lengths under a small token budget, so prompts are chunked and
  batched with decodes. Then teardown (no worker left) and a killed worker (an error,
  not a hang). Each spawned engine costs a worker start (~2 s CPU, mostly ``import
  torch``).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest
import torch

from shardspeed.inference.fastgen.engine import InferenceEngine
from shardspeed.inference.fastgen.kv_cache import KVCache, KVCacheSpec
from shardspeed.inference.fastgen.loader import build_model
from shardspeed.inference.fastgen.models.tp_shard import TensorShard, shard_heads
from shardspeed.inference.fastgen.ragged import build_ragged_batch
from shardspeed.inference.fastgen.sampling_params import SamplingParams
from shardspeed.inference.fastgen.scheduler import ScheduledBatch, ScheduledSequence
from shardspeed.inference.fastgen.tensor_parallel import TensorParallelError
from shardspeed.inference.serving.pipeline import pipeline

VOCAB = 128
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.1,
)  # fmt: skip
ENGINE = dict(block_size=4, num_blocks=256, max_ragged_batch_size=16, device="cpu")


def _hf_model(config_cls: str, **overrides: Any) -> torch.nn.Module:
    """A tiny random transformers model with its 1-D weights (norms, biases) perturbed."""
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


def _gpt2() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=128, n_embd=64, n_layer=2, n_head=4, eos_token_id=2
    )
    return transformers.GPT2LMHeadModel(cfg).float().eval()


def _shardspeed_gpt() -> torch.nn.Module:
    from shardspeed.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, n_layer=2, n_embd=64, n_head=4, block_size=64))


def _prompts(seed: int, lengths: tuple[int, ...] = (3, 29, 11, 17, 6)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


# ------------------------------------------------------------------ shard math
def test_shard_heads_splits_kv_groups_and_replicates_when_fewer_kv_heads() -> None:
    # GQA 8 q / 4 kv heads over 2: each rank keeps whole KV groups
    r1 = shard_heads(8, 4, rank=1, world_size=2)
    assert (r1.q_heads, r1.kv_heads) == (range(4, 8), range(2, 4))
    # 8 q / 2 kv over 4: each KV head replicated on the two ranks whose q heads read it
    kv = [shard_heads(8, 2, rank=r, world_size=4).kv_heads for r in range(4)]
    assert kv == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    for r in range(4):  # every local q head's KV group is the local KV head
        s = shard_heads(8, 2, rank=r, world_size=4)
        assert {q // 4 for q in s.q_heads} == set(s.kv_heads)


@pytest.mark.parametrize(
    ("heads", "kv", "tp", "match"),
    [(6, 6, 4, "use tensor_parallel in \\[1, 2, 3, 6\\]"), (8, 3, 2, "num_key_value_heads=3")],
)
def test_shard_heads_refuses_uneven_splits(heads: int, kv: int, tp: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        shard_heads(heads, kv, rank=0, world_size=tp)


def test_tensor_shard_split_refuses_indivisible_rows() -> None:
    shard = TensorShard(0, 4, all_reduce=lambda x: x)
    with pytest.raises(ValueError, match="intermediate_size=6 .* use tensor_parallel in"):
        shard.split(6, "intermediate_size")


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_wrong_checkpoint_shape_is_named_not_silently_sliced(world_size: int) -> None:
    from shardspeed.inference.fastgen.loader import CheckpointSource, describe_source

    config, weights, dtype = describe_source(_hf_model("LlamaConfig"))
    state = dict(weights)
    name = "model.layers.0.self_attn.q_proj.weight"
    state[name] = torch.zeros(80, 64)  # 5 heads' rows for a 4-head config
    shard = TensorShard(0, world_size, all_reduce=(lambda x: x) if world_size > 1 else None)
    with pytest.raises(ValueError, match=f"{name}' has shape \\(80, 64\\)"):
        build_model(CheckpointSource(config, state, dtype), None, torch.device("cpu"), shard=shard)


# ------------------------------------------- in-process ranks (threads) per family
class _ThreadGroup:
    """All-reduce among threads: each rank posts its tensor, all sum in rank order."""

    def __init__(self, world_size: int) -> None:
        self.parts: list[torch.Tensor | None] = [None] * world_size
        self.barrier = threading.Barrier(world_size, timeout=30)

    def all_reduce_for(self, rank: int):
        def all_reduce(x: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = x.clone()
            self.barrier.wait()
            total = torch.stack(self.parts).sum(0)  # type: ignore[arg-type]
            self.barrier.wait()
            return x.copy_(total)

        return all_reduce


def _logits_of(model: Any, steps: list[ScheduledSequence]) -> list[torch.Tensor]:
    m = model
    spec = KVCacheSpec(m.num_layers, m.num_kv_heads, m.head_dim, 4, torch.float32)
    cache = KVCache(spec, 16, torch.device("cpu"))
    out = []
    with torch.inference_mode():
        for seq in steps:
            batch = build_ragged_batch(ScheduledBatch([seq]), 4, torch.device("cpu"), "torch")
            out.append(m(batch, cache))
    return out


def _steps(prompt: list[int], next_token: int) -> list[ScheduledSequence]:
    """A whole-prompt prefill (logits of every token), then one decode token."""
    n = len(prompt)
    table = list(range(-(-(n + 1) // 4)))
    prefill = ScheduledSequence(None, prompt, 0, list(range(n)), table, True, all_logits=True)  # type: ignore[arg-type]
    decode = ScheduledSequence(None, [next_token], n, [n], table, True)  # type: ignore[arg-type]
    return [prefill, decode]


FAMILIES = {
    "llama_gqa": lambda: _hf_model("LlamaConfig", attention_bias=True, mlp_bias=True),
    "qwen2_mqa": lambda: _hf_model("Qwen2Config", num_key_value_heads=1),
    "qwen3": lambda: _hf_model("Qwen3Config", head_dim=16),
    "phi3_fused": lambda: _hf_model("Phi3Config"),
    "gemma2": lambda: _hf_model(
        "Gemma2Config", head_dim=16, attn_logit_softcapping=1.5, final_logit_softcapping=2.0
    ),
    "mixtral": lambda: _hf_model("MixtralConfig", num_local_experts=4, num_experts_per_tok=2),
    "gpt2": _gpt2,
    "shardspeed_gpt": _shardspeed_gpt,
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sharded_ranks_sum_to_the_full_model(family: str) -> None:
    hf = FAMILIES[family]()
    cpu, tp = torch.device("cpu"), 2
    full, _ = build_model(hf, None, cpu)
    steps = _steps(_prompts(3, (9,))[0], 5)
    want = _logits_of(full, steps)
    group = _ThreadGroup(tp)
    ranks = [
        build_model(hf, None, cpu, shard=TensorShard(r, tp, group.all_reduce_for(r)))[0]
        for r in range(tp)
    ]
    assert ranks[1].num_kv_heads == max(1, full.num_kv_heads // tp)
    got: list[list[torch.Tensor]] = [[] for _ in range(tp)]
    threads = [
        threading.Thread(target=lambda r=r: got[r].extend(_logits_of(ranks[r], steps)))
        for r in range(tp)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for w, g in zip(want, got[0], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- bad inputs
def test_bad_tensor_parallel_options_fail_before_any_worker_starts() -> None:
    llama = _hf_model("LlamaConfig")
    with pytest.raises(ValueError, match="tensor_parallel=3 cannot split .* in \\[1, 2, 4\\]"):
        InferenceEngine.from_pretrained(llama, tensor_parallel=3, **ENGINE)
    with pytest.raises(ValueError, match="compile_decode=True with tensor_parallel=2"):
        InferenceEngine.from_pretrained(llama, tensor_parallel=2, compile_decode=True, **ENGINE)
    with pytest.raises(ValueError, match="quantization with tensor_parallel=2"):
        InferenceEngine.from_pretrained(llama, tensor_parallel=2, quantization="int8", **ENGINE)
    with pytest.raises(ValueError, match="must be an int >= 1"):
        InferenceEngine.from_pretrained(llama, tensor_parallel=0, **ENGINE)
    ragged, _ = build_model(llama, None, torch.device("cpu"))
    with pytest.raises(ValueError, match="already-built LlamaModel"):
        InferenceEngine.from_pretrained(ragged, tensor_parallel=2, **ENGINE)
    import transformers

    opt = transformers.OPTForCausalLM(
        transformers.OPTConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=1,
            ffn_dim=64,
            num_attention_heads=2,
            word_embed_proj_dim=32,
            max_position_embeddings=64,
        )  # fmt: skip
    )
    with pytest.raises(ValueError, match="model_type='opt' .* does not support tensor paral"):
        InferenceEngine.from_pretrained(opt, tensor_parallel=2, **ENGINE)


# --------------------------------------------------------- spawned gloo workers
GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)


def _generate(engine: InferenceEngine, prompts: list[list[int]], params: list[SamplingParams]):
    return [o.output_token_ids for o in engine.generate(prompts, params)]


def _assert_tp2_matches_tp1(source: Any, prompts: list[list[int]], **engine: Any):
    """tp=2 tokens == tp=1 tokens for ``prompts``: greedy, except the first prompt's two
    seeded samples (the second forks the first's KV blocks)."""
    forked = SamplingParams(max_new_tokens=8, ignore_eos=True, n=2, temperature=0.8, seed=7)
    params = [forked] + [GREEDY] * (len(prompts) - 1)
    kwargs = {**ENGINE, **engine}
    want = _generate(InferenceEngine.from_pretrained(source, **kwargs), prompts, params)
    pipe = pipeline(source, tensor_parallel=2, **kwargs)
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


def test_llama_gqa_from_directory_tp2_is_token_identical(tmp_path) -> None:
    model = _hf_model("LlamaConfig", attention_bias=True)
    model.save_pretrained(tmp_path / "ckpt")
    prompts = _prompts(5)
    prompts.append(prompts[1][:20] + [7, 8, 9])  # shares a prefix (prefix caching)
    pipe = _assert_tp2_matches_tp1(tmp_path / "ckpt", prompts, enable_prefix_caching=True)
    responses = pipe([[5, 6, 7, 8]], max_new_tokens=4, ignore_eos=True)
    assert len(responses[0].token_ids) == 4
    pids = pipe.engine.peers.worker_pids
    pipe.shutdown()
    assert all(_gone(pid) for pid in pids)


@pytest.mark.slow  # ~10 s; the in-process family test covers the replicated KV head
def test_qwen2_replicated_kv_head_tp2_is_token_identical() -> None:
    model = _hf_model("Qwen2Config", num_key_value_heads=1)
    pipe = _assert_tp2_matches_tp1(model, _prompts(6))
    pipe.shutdown()


def test_gpt2_tp2_is_token_identical_and_a_killed_worker_raises() -> None:
    pipe = _assert_tp2_matches_tp1(_gpt2(), _prompts(7))
    engine = pipe.engine
    (pid,) = engine.peers.worker_pids
    os.kill(pid, signal.SIGKILL)
    assert _gone(pid)
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="worker rank 1 exited"):
        engine.generate([[3, 4, 5]], GREEDY)
    assert time.monotonic() - start < 10
    with pytest.raises(TensorParallelError, match="create a new engine"):
        engine.generate([[3, 4, 5]], GREEDY)  # stays down, fails fast
    pipe.shutdown()


def test_async_engine_shutdown_stops_workers_at_once() -> None:
    import asyncio

    from shardspeed.inference.serving.async_engine import AsyncEngine

    engine = InferenceEngine.from_pretrained(_gpt2(), tensor_parallel=2, **ENGINE)
    async_engine = AsyncEngine(engine).start()
    deadline = time.monotonic() + 10
    while not async_engine.is_healthy and time.monotonic() < deadline:
        time.sleep(0.01)

    async def run() -> list[int]:
        stream = async_engine.submit([3, 4, 5], SamplingParams(max_new_tokens=3, ignore_eos=True))
        return [out async for out in stream][-1].output_token_ids

    assert len(asyncio.run(run())) == 3
    pids = engine.peers.worker_pids
    async_engine.shutdown()  # no pipe.shutdown() / garbage collection needed
    assert all(_gone(pid) for pid in pids)
    async_engine.shutdown()  # idempotent
