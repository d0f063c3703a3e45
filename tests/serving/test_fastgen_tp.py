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
from shardspeed.inference.quantization import WeightQuantConfig
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
    "gpt_neox_parallel": lambda: _hf_model(
        "GPTNeoXConfig",
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
    ),  # fmt: skip
    "gpt_neox_sequential": lambda: _hf_model(
        "GPTNeoXConfig", use_parallel_residual=False, attention_bias=False
    ),
    "opt_pre_norm": lambda: _hf_model("OPTConfig", ffn_dim=96),
    "opt_post_norm_projected": lambda: _hf_model(
        "OPTConfig", ffn_dim=96, do_layer_norm_before=False, word_embed_proj_dim=32
    ),
    "falcon_multi_query": lambda: _hf_model("FalconConfig", bias=True, ffn_hidden_size=96),
    "falcon_new_arch_gqa": lambda: _hf_model(
        "FalconConfig", new_decoder_architecture=True, num_kv_heads=2, ffn_hidden_size=96
    ),
    "falcon_new_arch_one_kv_head": lambda: _hf_model(
        "FalconConfig", new_decoder_architecture=True, num_kv_heads=1, ffn_hidden_size=96
    ),
    "falcon_sequential_mha": lambda: _hf_model(
        "FalconConfig", multi_query=False, parallel_attn=False, bias=True, ffn_hidden_size=96
    ),
}


def _ranks_logits(
    source: Any, steps: list[ScheduledSequence], quantization: Any = None, tp: int = 2
) -> tuple[list[torch.Tensor], list[Any]]:
    """Rank 0's logits of ``steps`` with ``tp`` in-process ranks (threads), and the ranks."""
    cpu, group = torch.device("cpu"), _ThreadGroup(tp)
    ranks = [
        build_model(source, None, cpu, quantization, TensorShard(r, tp, group.all_reduce_for(r)))[0]
        for r in range(tp)
    ]
    got: list[list[torch.Tensor]] = [[] for _ in range(tp)]
    threads = [
        threading.Thread(target=lambda r=r: got[r].extend(_logits_of(ranks[r], steps)))
        for r in range(tp)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return got[0], ranks


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sharded_ranks_sum_to_the_full_model(family: str) -> None:
    hf = FAMILIES[family]()
    full, _ = build_model(hf, None, torch.device("cpu"))
    steps = _steps(_prompts(3, (9,))[0], 5)
    want = _logits_of(full, steps)
    got, ranks = _ranks_logits(hf, steps)
    assert ranks[1].num_kv_heads == max(1, full.num_kv_heads // 2)
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- bad inputs
def test_bad_tensor_parallel_options_fail_before_any_worker_starts(monkeypatch) -> None:
    llama = _hf_model("LlamaConfig")
    with pytest.raises(ValueError, match="tensor_parallel=3 cannot split .* in \\[1, 2, 4\\]"):
        InferenceEngine.from_pretrained(llama, tensor_parallel=3, **ENGINE)
    with pytest.raises(ValueError, match="compile_decode=True with tensor_parallel=2"):
        InferenceEngine.from_pretrained(llama, tensor_parallel=2, compile_decode=True, **ENGINE)
    with pytest.raises(ValueError, match="group_size=64 with tensor_parallel=2: layer "
                       "'layers.0.o_proj' holds 32 input columns per rank"):  # fmt: skip
        InferenceEngine.from_pretrained(llama, tensor_parallel=2, quantization="int4-g64", **ENGINE)
    with pytest.raises(ValueError, match="must be an int >= 1"):
        InferenceEngine.from_pretrained(llama, tensor_parallel=0, **ENGINE)
    ragged, _ = build_model(llama, None, torch.device("cpu"))
    with pytest.raises(ValueError, match="already-built LlamaModel"):
        InferenceEngine.from_pretrained(ragged, tensor_parallel=2, **ENGINE)
    from shardspeed.inference.fastgen.models.opt import OPTModel

    with monkeypatch.context() as patch:  # every built-in family shards: pretend one does not
        patch.setattr(OPTModel, "supports_tensor_parallel", False)
        with pytest.raises(ValueError, match="model_type='opt' .* does not support tensor paral"):
            InferenceEngine.from_pretrained(FAMILIES["opt_pre_norm"](), tensor_parallel=2, **ENGINE)


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


@pytest.mark.parametrize(
    "family",
    [
        "falcon_new_arch_gqa",
        pytest.param("gpt_neox_parallel", marks=pytest.mark.slow),
        pytest.param("opt_post_norm_projected", marks=pytest.mark.slow),
    ],
)
def test_layernorm_families_tp2_are_token_identical(family: str) -> None:
    """GPT-NeoX / OPT / Falcon (fused QKV layouts, parallel residual, post-norm)."""
    pipe = _assert_tp2_matches_tp1(FAMILIES[family](), _prompts(9))
    pipe.shutdown()


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


def test_async_engine_gives_up_on_a_dead_worker_instead_of_restarting() -> None:
    """A dead tensor-parallel worker cannot be cured by a new engine thread: the request
    fails, the supervisor stops the engine (the surviving workers exit) and does not
    restart it, health names the error and new requests fail at once."""
    import asyncio

    from shardspeed.inference.serving.async_engine import AsyncEngine, EngineDeadError

    engine = InferenceEngine.from_pretrained(_gpt2(), tensor_parallel=2, **ENGINE)
    async_engine = AsyncEngine(engine, restart_backoff_s=0.05).start()
    deadline = time.monotonic() + 10
    while not async_engine.is_healthy and time.monotonic() < deadline:
        time.sleep(0.01)
    (pid,) = engine.peers.worker_pids
    os.kill(pid, signal.SIGKILL)
    assert _gone(pid)

    async def run() -> None:
        stream = async_engine.submit([3, 4, 5], SamplingParams(max_new_tokens=3, ignore_eos=True))
        with pytest.raises(EngineDeadError, match="worker rank 1 exited"):
            [out async for out in stream]

    asyncio.run(run())
    deadline = time.monotonic() + 10
    while "restart the server" not in async_engine.status_detail and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "cannot be restarted" in async_engine.status_detail
    time.sleep(0.3)  # several backoffs: still no restart
    assert async_engine.restarts == 0 and not async_engine.is_healthy

    async def again() -> None:
        with pytest.raises(EngineDeadError, match="restart the server"):
            async_engine.submit([3], SamplingParams(max_new_tokens=1))

    asyncio.run(again())
    async_engine.shutdown()


# ---------------------------------------------------------- quantized weights
QUANT_LLAMA = dict(hidden_size=128, intermediate_size=256)  # per rank: 64 / 128 input columns


def _quantized_layers(model: Any) -> dict[str, Any]:
    from shardspeed.inference.quantization import QuantizedLinear

    return {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}


@pytest.mark.parametrize(("bits", "group_size"), [(8, None), (8, 16), (4, 32)])
def test_slice_quantized_equals_slicing_the_dequantized_weight(bits, group_size) -> None:
    from shardspeed.inference.quantization.qtensor import (
        dequantize_weight,
        quantize_weight,
        slice_quantized,
    )

    w = torch.randn(12, 128, generator=torch.Generator().manual_seed(0))
    qw = quantize_weight(w, bits, group_size, symmetric=False)
    whole = dequantize_weight(qw)
    pieces = [range(32, 64), range(96, 128)]
    cols = slice_quantized(qw, pieces, dim=1)
    assert torch.equal(dequantize_weight(cols), torch.cat([whole[:, 32:64], whole[:, 96:]], 1))
    rows = slice_quantized(qw, [range(2, 5), range(9, 12)], dim=0)
    assert torch.equal(dequantize_weight(rows), torch.cat([whole[2:5], whole[9:12]]))
    if group_size is not None:
        with pytest.raises(ValueError, match="every cut must be a multiple of the group size"):
            slice_quantized(qw, [range(8, 40)], dim=1, name="layers.0.o_proj")


@pytest.mark.parametrize("scheme", ["int8", "int8-asym", "int4-g32", "int4-g64-asym"])
def test_quantized_ranks_hold_slices_of_the_tp1_quantization(scheme: str) -> None:
    """Every quantized layer of each rank dequantizes to exactly its slice of tp=1's."""
    config = WeightQuantConfig.parse(scheme).with_overrides(kernel="reference")
    hf = _hf_model("LlamaConfig", **QUANT_LLAMA)
    cpu, tp = torch.device("cpu"), 2
    full = _quantized_layers(build_model(hf, None, cpu, config)[0])
    for r in range(tp):
        shard = TensorShard(r, tp, all_reduce=lambda x: x)
        ranks = _quantized_layers(build_model(hf, None, cpu, config, shard)[0])
        assert ranks.keys() == full.keys()
        for name, layer in ranks.items():
            whole = full[name].dequantized_weight()  # (N, K)
            n, k = layer.out_features, layer.in_features
            row_parallel = name.endswith(("o_proj", "down_proj"))
            if row_parallel:
                want = whole[:, r * k : (r + 1) * k]
            elif name.endswith("gate_up_proj"):  # [gate rows of r | up rows of r]
                half = whole.shape[0] // 2
                gate, up = whole[:half], whole[half:]
                want = torch.cat(
                    [gate[r * n // 2 : (r + 1) * n // 2], up[r * n // 2 : (r + 1) * n // 2]]
                )
            else:  # qkv_proj: [q heads of r | kv heads of r | kv heads of r]
                q, kv = 2 * 32, 32  # per rank: 2 of 4 q heads, 1 of 2 kv heads (head_dim 32)
                parts = whole.split([2 * q, 2 * kv, 2 * kv])
                want = torch.cat(
                    [parts[0][r * q : (r + 1) * q]] + [p[r * kv : (r + 1) * kv] for p in parts[1:]]
                )
            assert torch.equal(layer.dequantized_weight(), want), (scheme, r, name)


@pytest.mark.parametrize(
    "family",
    ["mixtral", "gpt2", "gpt_neox_parallel", "opt_post_norm_projected", "falcon_new_arch_gqa"],
)
def test_int8_quantized_ranks_sum_to_the_quantized_full_model(family: str) -> None:
    """Per-channel int8 (scales over whole rows) on every layer kind of the other families."""
    quant = WeightQuantConfig(bits=8, kernel="reference", compute_dtype="float32")
    hf = FAMILIES[family]()
    steps = _steps(_prompts(3, (9,))[0], 5)
    want = _logits_of(build_model(hf, None, torch.device("cpu"), quant)[0], steps)
    got, ranks = _ranks_logits(hf, steps, quant)
    assert len(_quantized_layers(ranks[0])) == len(_quantized_layers(ranks[1])) > 0
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("scheme", ["int8", "int4-g32"])
def test_quantized_ranks_with_bf16_compute_agree_to_bf16_rounding(scheme: str) -> None:
    """The torch kernels' default bf16 compute rounds each rank's partial output: tp=2
    then differs from tp=1 by no more than bf16 compute differs from fp32 (times 2)."""
    quant = WeightQuantConfig.parse(scheme)
    hf = _hf_model("LlamaConfig", **QUANT_LLAMA)
    cpu, steps = torch.device("cpu"), _steps(_prompts(3, (9,))[0], 5)
    want = torch.cat(_logits_of(build_model(hf, None, cpu, quant)[0], steps))
    fp32 = quant.with_overrides(compute_dtype="float32")
    bf16_error = (want - torch.cat(_logits_of(build_model(hf, None, cpu, fp32)[0], steps))).abs()
    got = torch.cat(_ranks_logits(hf, steps, quant)[0])
    assert (got - want).abs().max() <= 2 * bf16_error.max()


@pytest.mark.parametrize(
    ("scheme", "kernel"),
    [
        ("int8", "reference"),
        pytest.param("int4-g32", "reference", marks=pytest.mark.slow),
        pytest.param("int4-g64-asym", "auto", marks=pytest.mark.slow),  # torch's int4 kernel
    ],
)
def test_quantized_llama_gqa_tp2_is_token_identical(scheme: str, kernel: str) -> None:
    """Same integers and scales as tp=1 (test above); fp32 compute, so the ranks' partial
    sums are not rounded to bf16 (the default bf16 compute agrees to bf16 rounding only:
    logits within ~1e-2, which can flip a near-tie)."""
    quant = WeightQuantConfig.parse(scheme).with_overrides(compute_dtype="float32", kernel=kernel)
    model = _hf_model("LlamaConfig", **QUANT_LLAMA)
    pipe = _assert_tp2_matches_tp1(model, _prompts(8), quantization=quant)
    pipe.shutdown()
