"""The Ulysses workload of ``tp_bench.py``: a long-sequence causal LM, sequence-parallel or not.

One small decoder (RMSNorm, fused q/k/v projection with grouped-query heads, causal SDPA,
SwiGLU-free SiLU MLP) whose attention is pluggable:

- ``full``: the local causal attention on the whole sequence, one rank;
- ``shardspeed`` / ``deepspeed``: that same local attention wrapped in the library's
  ``DistributedAttention`` over ``sp`` ranks, each holding ``s/sp`` tokens of every sample.

Everything but the attention is per-token, so a sequence-parallel rank runs it on its own
tokens. Weights are replicated; after backward the gradients are summed over the sequence
group and divided by ``sp`` (each rank's loss is the mean over its ``s/sp`` tokens, so the
average of the ranks' losses is the full-sequence loss and the averaged gradient is the
full model's). Optimizer and clipping are the GPT rows' (``torch.optim.AdamW``, 1.0).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from trainbench.engines import Runner, import_deepspeed
from trainbench.llama import LlamaWorkload
from trainbench.workload import GRAD_CLIP, torch_optimizer

ULYSSES_ENGINES = ("full", "deepspeed", "shardspeed")


class CausalAttention(nn.Module):
    """Causal SDPA on ``(b, s, h, d)`` tensors (``batch_dim_idx=0``), GQA by repeating KV heads."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (b, h, s, d); k, v: (b, kv, s, d)
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, h, s, d)
        return out.transpose(1, 2)  # (b, s, h, d)


class UlyssesAttention(nn.Module):
    """Adapts a ``DistributedAttention`` (either library's) to ``(q, k, v)`` in ``(b, s, h, d)``."""

    def __init__(self, distributed_attention: nn.Module) -> None:
        super().__init__()
        self.inner = distributed_attention

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.inner(q, k, v, 0)  # batch_dim_idx=0: (b, s/p, h, d) in and out


class Block(nn.Module):
    """Pre-norm decoder block over this rank's tokens ``(b, s, n_embd)``."""

    def __init__(self, workload: LlamaWorkload, attention: nn.Module) -> None:
        super().__init__()
        d, self.head_dim = workload.n_embd, workload.n_embd // workload.n_head
        self.num_heads, self.num_kv_heads = workload.n_head, workload.n_kv_head
        qkv_width = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.norm1 = nn.RMSNorm(d)
        self.qkv = nn.Linear(d, qkv_width, bias=False)
        self.attention = attention
        self.out = nn.Linear(d, d, bias=False)
        self.norm2 = nn.RMSNorm(d)
        self.mlp = nn.Sequential(
            nn.Linear(d, workload.intermediate_size, bias=False),
            nn.SiLU(),
            nn.Linear(workload.intermediate_size, d, bias=False),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape  # s: this rank's tokens
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv(self.norm1(x)).split([q_width, kv_width, kv_width], dim=-1)
        q = q.view(b, s, self.num_heads, self.head_dim)  # (b, s, h, hd)
        k = k.view(b, s, self.num_kv_heads, self.head_dim)  # (b, s, kv, hd)
        v = v.view(b, s, self.num_kv_heads, self.head_dim)  # (b, s, kv, hd)
        context = self.attention(q, k, v)  # (b, s, h, hd)
        x = x + self.out(context.reshape(b, s, d))
        return x + self.mlp(self.norm2(x))


class SequenceLM(nn.Module):
    """Token embedding, ``n_layer`` blocks, LM head; ``forward(x, y)`` returns the mean loss."""

    def __init__(self, workload: LlamaWorkload, make_attention: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.embed = nn.Embedding(workload.vocab_size, workload.n_embd)
        self.blocks = nn.ModuleList(
            Block(workload, make_attention()) for _ in range(workload.n_layer)
        )
        self.norm = nn.RMSNorm(workload.n_embd)
        self.head = nn.Linear(workload.n_embd, workload.vocab_size, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)  # (b, s, d)
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm(h))  # (b, s, vocab)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def attention_factory(engine: str, sp: int) -> Callable[[], nn.Module]:
    """A constructor of one layer's attention for ``engine`` at sequence-parallel degree ``sp``."""
    if engine == "full":
        return CausalAttention
    ranks = list(range(sp))
    if engine == "shardspeed":
        from shardspeed.parallel.sequence import sequence_group
        from shardspeed.sequence.layer import DistributedAttention

        group = sequence_group(sp)
    elif engine == "deepspeed":
        deepspeed = import_deepspeed()
        deepspeed.init_distributed(dist_backend="gloo")
        from deepspeed.sequence.layer import DistributedAttention

        group = dist.new_group(ranks)
    else:
        raise ValueError(f"engine={engine!r}: Ulysses rows are {', '.join(ULYSSES_ENGINES)}")
    return lambda: UlyssesAttention(DistributedAttention(CausalAttention(), group))


def build_sequence_lm(workload: LlamaWorkload, engine: str, sp: int) -> SequenceLM:
    """The Ulysses workload's model, initialised identically for every engine and rank."""
    make_attention = attention_factory(engine, sp)
    torch.manual_seed(workload.seed)
    return SequenceLM(workload, make_attention)


def shard_tokens(t: torch.Tensor, sp: int, rank: int) -> torch.Tensor:
    """This rank's contiguous ``s/sp`` tokens of ``(b, s)`` token ids."""
    return t.chunk(sp, dim=1)[rank].contiguous()  # (b, s/sp)


def build_ulysses_runner(model: nn.Module, sp: int) -> Runner:
    """Plain data-replicated training: backward, average gradients over ``sp``, clip, AdamW."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch_optimizer(params)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = model(x, y)
        loss.backward()
        if sp > 1:
            grads = [p.grad for p in params]
            flat = _flatten_dense_tensors(grads)  # (total numel,) one all-reduce
            dist.all_reduce(flat)
            flat.div_(sp)
            for grad, averaged in zip(grads, _unflatten_dense_tensors(flat, grads)):
                grad.copy_(averaged)
        torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return Runner(step, {"optimizer": type(optimizer).__name__, "sequence_parallel": sp})
