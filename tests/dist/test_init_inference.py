"""``init_inference`` with tensor parallelism on spawned gloo ranks, against the plain model.

Tiny random Hugging Face models (Llama with GQA, Qwen2 with q/k/v biases, GPT-2 with a
tied head) built from configs with a fixed seed, so every rank and the reference hold the
same weights. Each rank wraps its copy with ``init_inference(tensor_parallel={"tp_size":
world}, dtype=fp32)`` and checks, on a left-padded batch:

* logits equal the unsharded model's within 1e-4 (fp32; TP only reorders sums);
* greedy ``generate`` (eos/pad ids, attention_mask) is token-identical;
* parameter bytes per rank <= 0.55x of the full model at tp=2 (embeddings counted: the
  input embedding is split by vocabulary rows and the LM head by vocabulary columns);
* the same with ``replace_with_kernel_inject=True`` (fused modules on the shards);
* one all-reduce per attention block and per MLP block (plus one for the embedding);
* a checkpoint saved with ``save_pretrained`` is sliced at load into a differently
  initialised model and gives the reference logits.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardspeed.testing import run_distributed

pytest.importorskip("transformers")

CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=4),
    "qwen2": dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=4),
    "gpt2": dict(vocab_size=64, n_embd=64, n_layer=2, n_head=4, n_positions=32),
}  # fmt: skip
PAD, EOS = 0, 1
TOL = 1e-4


def make_model(kind: str, seed: int = 0) -> Any:
    import transformers as tf

    torch.manual_seed(seed)
    config = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "gpt2": tf.GPT2Config}[kind]
    return tf.AutoModelForCausalLM.from_config(
        config(**CONFIGS[kind], pad_token_id=PAD, eos_token_id=EOS)
    ).eval()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """A left-padded batch of two prompts (lengths 5 and 7)."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(2, 64, (2, 7), generator=g)
    mask = torch.ones_like(ids)
    ids[0, :2], mask[0, :2] = PAD, 0
    return ids, mask


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # shared: once


def injection_policy(kind: str) -> dict[Any, tuple[str, ...]]:
    """DeepSpeed's AutoTP policy convention: block class -> its row-parallel output linears."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    if kind == "gpt2":
        return {GPT2Block: ("attn.c_proj", "mlp.c_proj")}
    block = {"llama": LlamaDecoderLayer, "qwen2": Qwen2DecoderLayer}[kind]
    return {block: ("self_attn.o_proj", "mlp.down_proj")}


def _check(
    cases: list[tuple[str, str]], checkpoint_dir: str | None = None, tp_size: int | None = None
) -> list[dict]:
    """``mode``: "auto" (AutoTP policy), "inject" (kernel injection), "policy" (injection_policy)."""
    import shardspeed

    ids, mask = batch()
    out = []
    for kind, mode in cases:
        reference = make_model(kind)
        seed = 1 if checkpoint_dir else 0  # with a checkpoint: start from other weights
        extra: dict[str, Any] = {"checkpoint": checkpoint_dir} if checkpoint_dir else {}
        if mode == "policy":
            extra["injection_policy"] = injection_policy(kind)
        engine = shardspeed.init_inference(
            make_model(kind, seed),
            tensor_parallel={"tp_size": tp_size or torch.distributed.get_world_size()},
            dtype=torch.float32,
            replace_with_kernel_inject=mode == "inject",
            keep_module_on_host=True,  # gloo ranks on the CPU, also on a GPU box
            **extra,
        )
        with torch.no_grad():
            want = reference(ids, attention_mask=mask).logits
            got = engine(ids, attention_mask=mask).logits
        gen = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=PAD)
        out.append(
            {
                "case": (kind, mode),
                "logits_diff": float((got - want)[mask.bool()].abs().max()),
                "tokens_equal": torch.equal(
                    reference.generate(ids, **gen), engine.generate(ids, **gen)
                ),
                "bytes_ratio": param_bytes(engine.module) / param_bytes(reference),
            }
        )
    return out


def _assert(results: list[list[dict]], max_ratio: float | None) -> None:
    for rank_results in results:
        for r in rank_results:
            assert r["logits_diff"] <= TOL, r
            assert r["tokens_equal"], r
            if max_ratio is not None:
                assert r["bytes_ratio"] <= max_ratio, r


def test_tp2_matches_plain_model() -> None:
    cases = [("llama", "auto"), ("qwen2", "auto"), ("gpt2", "auto"), ("llama", "inject"),
             ("qwen2", "inject"), ("llama", "policy"), ("gpt2", "policy")]  # fmt: skip
    results = run_distributed(_check, 2, cases)
    _assert(results, max_ratio=0.55)


def test_tp4_matches_plain_model() -> None:
    results = run_distributed(_check, 4, [("llama", "inject")])  # one KV head per rank
    _assert(results, max_ratio=0.30)


def test_tp2_inside_a_world_of_4() -> None:
    """Two tensor groups ([0, 1], [2, 3]) of the cached Topology, each serving the model."""
    results = run_distributed(_check, 4, [("gpt2", "auto")], None, 2)
    _assert(results, max_ratio=0.55)


@pytest.mark.slow
def test_tp4_more_models() -> None:
    cases = [("llama", "auto"), ("qwen2", "auto"), ("gpt2", "auto"), ("gpt2", "policy")]
    _assert(run_distributed(_check, 4, cases), max_ratio=0.30)


def test_tp2_checkpoint_sliced_at_load(tmp_path: Any) -> None:
    make_model("qwen2").save_pretrained(tmp_path)
    results = run_distributed(_check, 2, [("qwen2", "inject")], str(tmp_path))
    _assert(results, max_ratio=0.55)


def _count_all_reduces(kind: str, mode: str) -> int:
    """All-reduces in one forward of the sharded model (counted at ``shardspeed.comm``)."""
    import shardspeed
    from shardspeed import comm

    engine = shardspeed.init_inference(
        make_model(kind), tensor_parallel={"tp_size": 2}, dtype="fp32",
        replace_with_kernel_inject=mode == "inject", keep_module_on_host=True,
    )  # fmt: skip
    calls = []
    real = comm.all_reduce

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    comm.all_reduce = counting
    try:
        with torch.no_grad():
            engine(batch()[0])
    finally:
        comm.all_reduce = real
    return len(calls)


@pytest.mark.parametrize(("kind", "mode"), [("llama", "inject"), ("gpt2", "auto")])
def test_one_all_reduce_per_attention_and_mlp_block(kind: str, mode: str) -> None:
    layers = 2
    counts = run_distributed(_count_all_reduces, 2, kind, mode)
    assert counts == [2 * layers + 1] * 2  # + 1: the vocabulary-parallel input embedding


class _MPU:
    """A Megatron-style model-parallel unit handing in the tensor group."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def get_model_parallel_group(self) -> Any:
        return self.group


def _with_user_group(how: str) -> float:
    import shardspeed
    from shardspeed.parallel.tensor.groups import tensor_group

    group = tensor_group(2)
    tp = {"tp_size": 2, **({"mpu": _MPU(group)} if how == "mpu" else {"tp_group": group})}
    engine = shardspeed.init_inference(
        make_model("llama"), tensor_parallel=tp, dtype="fp32", keep_module_on_host=True
    )
    assert engine.mp_group is group and engine.module.lm_head.group is group
    ids, mask = batch()
    with torch.no_grad():
        got = engine(ids, attention_mask=mask).logits
        want = make_model("llama")(ids, attention_mask=mask).logits
    return float((got - want)[mask.bool()].abs().max())


@pytest.mark.parametrize("how", ["mpu", "tp_group"])
def test_tp2_with_a_user_process_group(how: str) -> None:
    assert max(run_distributed(_with_user_group, 2, how)) <= TOL


def _sampling_agrees() -> list[int]:
    import shardspeed

    engine = shardspeed.init_inference(make_model("llama"), tensor_parallel={"tp_size": 2},
                                       dtype="fp32", keep_module_on_host=True)  # fmt: skip
    torch.manual_seed(100 + torch.distributed.get_rank())  # different streams per rank
    ids, mask = batch()
    out = engine.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=True,
                          pad_token_id=PAD)  # fmt: skip
    return out.flatten().tolist()


def test_tp2_sampling_is_the_same_on_every_rank() -> None:
    tokens = run_distributed(_sampling_agrees, 2)
    assert tokens[0] == tokens[1]
