"""The tensor-parallel workload of ``tp_bench.py``: a small Hugging Face Llama (GQA) under AutoTP.

DeepSpeed and shardspeed get the same ``LlamaForCausalLM`` (same seed, so the same initial
weights on every rank), the same token stream and the same ds_config: the GPT rows'
optimizer, clipping and precision plus ``"tensor_parallel": {"autotp_size": tp}``. Both
libraries shard the model inside ``initialize``; every rank of a tensor group trains on the
same micro-batch (data-parallel degree ``world / tp``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trainbench.engines import Runner, ds_api_runner, import_deepspeed, shardspeed_initialize
from trainbench.workload import Workload, add_workload_args, ds_config


@dataclass(frozen=True)
class LlamaWorkload(Workload):
    """A Llama shape (GQA, SwiGLU MLP) on top of the GPT workload's batch/step/optimizer fields.

    ``n_embd`` is the hidden size, ``n_head`` / ``n_kv_head`` the query / key-value heads,
    ``block_size`` the sequence length.
    """

    n_kv_head: int = 2
    intermediate_size: int = 1024

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LlamaWorkload:
        base = Workload.from_args(args).to_dict()
        return cls(**base, n_kv_head=args.n_kv_head, intermediate_size=args.intermediate_size)


def add_llama_args(parser: argparse.ArgumentParser, defaults: LlamaWorkload) -> None:
    """The GPT workload flags (with ``defaults``) plus the Llama-only ones."""
    add_workload_args(parser, defaults)
    g = parser.add_argument_group("llama")
    g.add_argument("--n-kv-head", type=int, default=defaults.n_kv_head, help="key/value heads")
    g.add_argument("--intermediate-size", type=int, default=defaults.intermediate_size)


def build_llama(workload: LlamaWorkload) -> nn.Module:
    """``LlamaForCausalLM`` of this shape, initialised identically on every rank and engine."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=workload.vocab_size,
        hidden_size=workload.n_embd,
        intermediate_size=workload.intermediate_size,
        num_hidden_layers=workload.n_layer,
        num_attention_heads=workload.n_head,
        num_key_value_heads=workload.n_kv_head,
        max_position_embeddings=workload.block_size,
        attn_implementation="sdpa",
    )
    torch.manual_seed(workload.seed)
    return LlamaForCausalLM(config)


def hf_causal_lm_loss(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Hugging Face's own causal-LM loss (it shifts ``labels`` itself, so ``y`` is unused).

    Passing ``labels`` lets each library use its tensor-parallel loss path (vocabulary-
    parallel cross-entropy where the LM head is split).
    """
    del y
    return module(input_ids=x, labels=x).loss


def tp_ds_config(workload: LlamaWorkload, stage: int, tp: int) -> dict[str, Any]:
    """The GPT rows' ds_config for ZeRO ``stage`` with AutoTP at degree ``tp``."""
    return {**ds_config(workload, stage), "tensor_parallel": {"autotp_size": tp}}


def build_tp_runner(
    engine: str, model: nn.Module, workload: LlamaWorkload, stage: int, tp: int
) -> Runner:
    """``engine`` ("deepspeed" | "shardspeed") training ``model`` with AutoTP ``tp``."""
    config = tp_ds_config(workload, stage, tp)
    if engine == "deepspeed":
        deepspeed = import_deepspeed()
        runner = ds_api_runner(deepspeed.initialize, model, config, hf_causal_lm_loss)
        runner.info["deepspeed"] = deepspeed.__version__
        return runner
    if engine == "shardspeed":
        return ds_api_runner(shardspeed_initialize(), model, config, hf_causal_lm_loss)
    raise ValueError(f"engine={engine!r} has no AutoTP row; use deepspeed or shardspeed")
