"""Ulysses sequence parallelism on gloo against full attention / the full model on one rank.

* ``DistributedAttention`` around causal SDPA at sp=2 and sp=4 (and sp=2 x dp=2 on 4 ranks,
  groups from ``Topology(sp=2)``): output shards and q/k/v gradients equal the single-rank
  attention's slices (fp32, rtol 1e-5), for MHA, GQA, KV heads fewer than ranks
  (replicated), uneven head splits, ``batch_dim_idx`` 0 and 1; impossible head counts raise
  the same ``ValueError`` on every rank.
* A tiny Hugging Face Llama (GQA) made sequence-parallel with ``make_hf_sequence_parallel``:
  loss equal to the one-process model's on the full batch, and every parameter gradient,
  summed over data x sequence and divided by dp (the engine's rule), equal to its gradient.
* Oracle: DeepSpeed 0.19.8's ``DistributedAttention`` (torch.distributed.run, gloo) on the
  same inputs gives the same outputs and gradients: recorded in
  ``tests/goldens/ulysses/`` (the golden variant, run everywhere), and live where the peers
  venv has DeepSpeed (``tests/goldens/README.md``).

One ``run_distributed`` call per (world size, body) loops over the cases.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from goldens import deepspeed_oracle as golden

from shardspeed import comm
from shardspeed.testing import assert_close_rel, run_distributed

ROOT = Path(__file__).resolve().parents[2]
RTOL, ATOL = 1e-5, 1e-6
SEQ, BATCH, HEAD_DIM = 8, 2, 4

# (num_q_heads, num_kv_heads, batch_dim_idx) per sequence-parallel size; comments: the layout
ATTENTION_CASES = {
    2: [
        (4, 4, 1), (4, 4, 0),  # MHA, even
        (8, 2, 1), (8, 2, 0),  # GQA, one KV head per rank
        (4, 1, 1),             # MQA: the KV head replicated on both ranks
        (6, 3, 0),             # 3 KV heads on 2 ranks: replicated x2, 3 per rank
        (3, 3, 1),             # uneven: 2 heads and 1 head
    ],
    4: [
        (4, 4, 1), (4, 4, 0),
        (8, 2, 1), (8, 2, 0),  # 2 KV heads on 4 ranks: replicated x2
        (4, 1, 0),             # MQA replicated x4
        (6, 6, 1),             # uneven: 2, 2, 1, 1
        (12, 6, 0),            # replicated x2, 3 KV heads per rank
    ],
}  # fmt: skip
IMPOSSIBLE = {2: [(1, 1), (6, 4)], 4: [(3, 3), (6, 3)]}
DP_CASES = [(8, 2, 1), (4, 1, 0), (3, 3, 1)]  # sp=2 x dp=2


class CausalSDPA:
    """Local attention on (s, b, h, d) (batch_dim 1) or (b, s, h, d) (batch_dim 0), GQA aware."""

    def __init__(self, batch_dim: int) -> None:
        self.batch_dim = batch_dim

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        to_bhsd = (1, 2, 0, 3) if self.batch_dim == 1 else (0, 2, 1, 3)
        q, k, v = (t.permute(to_bhsd) for t in (q, k, v))  # (b, h, s, d)
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, h, s, d)
        return out.permute(2, 0, 1, 3) if self.batch_dim == 1 else out.permute(0, 2, 1, 3)


def _inputs(num_q: int, num_kv: int, batch_dim: int, seed: int) -> list[torch.Tensor]:
    """q, k, v and the output weight w, full sequence, identical on every rank of a seed."""
    gen = torch.Generator().manual_seed(seed)

    def shape(h: int) -> tuple[int, ...]:
        return (SEQ, BATCH, h, HEAD_DIM) if batch_dim == 1 else (BATCH, SEQ, h, HEAD_DIM)

    return [torch.randn(shape(h), generator=gen) for h in (num_q, num_kv, num_kv, num_q)]


def _run_attention(
    attention_class: Any,
    group: Any,
    case: tuple[int, int, int],
    seed: int,
    rotary: bool = False,
) -> dict[str, torch.Tensor]:
    """Ulysses forward/backward of ``(out * w).sum()`` on this rank's shard."""
    num_q, num_kv, batch_dim = case
    seq_dim = 1 - batch_dim
    q, k, v, w = _inputs(num_q, num_kv, batch_dim, seed)
    num_ranks, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)

    def shard(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(num_ranks, dim=seq_dim)[rank].contiguous()

    local = [shard(t).requires_grad_() for t in (q, k, v)]
    attention = attention_class(CausalSDPA(batch_dim), group)
    extra = (_rotary(),) if rotary else ()
    out = attention(*local, batch_dim, *extra)
    (out * shard(w)).sum().backward()
    return {"out": out.detach(), **{n: t.grad for n, t in zip("qkv", local)}}


def _rotary() -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSpeed's rotary_pos_emb: (cos, sin), each (1, s, 1, d)."""
    angle = torch.arange(SEQ)[:, None] * 0.3 ** torch.arange(HEAD_DIM // 2)[None]  # (s, d/2)
    angle = torch.cat((angle, angle), -1)[None, :, None]  # (1, s, 1, d)
    return angle.cos(), angle.sin()


def _reference(
    case: tuple[int, int, int], seed: int, rank: int, num_ranks: int
) -> dict[str, torch.Tensor]:
    """Full attention on one rank, then this rank's sequence slice of output and grads."""
    num_q, num_kv, batch_dim = case
    seq_dim = 1 - batch_dim
    q, k, v, w = _inputs(num_q, num_kv, batch_dim, seed)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    out = CausalSDPA(batch_dim)(*full)
    (out * w).sum().backward()
    return {
        name: t.chunk(num_ranks, dim=seq_dim)[rank]
        for name, t in zip(("out", "q", "k", "v"), (out.detach(), *(t.grad for t in full)))
    }


def _check_case(group: Any, case: tuple[int, int, int], seed: int, msg: str) -> None:
    from shardspeed.parallel.sequence import DistributedAttention

    got = _run_attention(DistributedAttention, group, case, seed)
    expected = _reference(case, seed, comm.get_rank(group), comm.get_world_size(group))
    for name, value in expected.items():
        assert_close_rel(got[name], value, rtol=RTOL, atol=ATOL, msg=f"{msg}: {name}")


def _attention_body(sp: int) -> dict[str, Any]:
    from shardspeed.parallel.sequence import DistributedAttention, sequence_group, topology_for

    group = sequence_group(sp)
    checked = 0
    for case in ATTENTION_CASES[sp]:
        _check_case(group, case, seed=sum(case), msg=f"sp={sp} case {case}")
        checked += 1
    errors = []
    for num_q, num_kv in IMPOSSIBLE[sp]:
        try:
            _run_attention(DistributedAttention, group, (num_q, num_kv, 1), seed=0)
        except ValueError as exc:
            errors.append(str(exc))
    return {
        "checked": checked,
        "errors": errors,
        "group": topology_for(sp).axis_ranks("sequence"),
    }


def _sp_dp_body() -> dict[str, Any]:
    from shardspeed.topology import Topology

    topology = Topology.build(sp=2)
    group = topology.group("sequence")
    data = topology.coords(topology.rank).data
    for case in DP_CASES:  # each data rank attends over different samples
        _check_case(group, case, seed=10 * data + sum(case), msg=f"sp=2 dp=2 data {data} {case}")
    return {"sequence": topology.axis_ranks("sequence"), "data": topology.axis_ranks("data")}


@pytest.mark.parametrize("sp", [2, 4])
def test_distributed_attention_matches_full_attention(sp: int) -> None:
    results = run_distributed(_attention_body, sp, sp, timeout=120)
    for rank, result in enumerate(results):
        assert result["checked"] == len(ATTENTION_CASES[sp])
        assert result["group"] == list(range(sp))
        assert len(result["errors"]) == len(IMPOSSIBLE[sp]), result["errors"]
        for message in result["errors"]:
            assert "Ulysses attention cannot split" in message, message
            assert "Sequence-parallel sizes that work" in message, message
        assert result["errors"] == results[0]["errors"], f"rank {rank} raised differently"


def test_sequence_parallel_by_data_parallel() -> None:
    results = run_distributed(_sp_dp_body, 4, timeout=120)
    assert [r["sequence"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["data"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]


# ----------------------------------------------------------------- Hugging Face Llama
VOCAB, HF_SEQ = 64, 16


def _tiny_llama(attn_implementation: str) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation=attn_implementation,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _llama_body(sp: int, attn_implementation: str) -> dict[str, Any]:
    """Loss and summed gradients of the sequence-parallel model vs the one-process model."""
    from shardspeed.parallel.sequence import (
        make_hf_sequence_parallel,
        shard_sequence,
        topology_for,
    )

    topology = topology_for(sp)
    group, dp = topology.group("sequence"), topology.dp
    data = topology.coords(topology.rank).data
    model = _tiny_llama(attn_implementation)
    reference = copy.deepcopy(model)
    ids = torch.randint(VOCAB, (2 * dp, HF_SEQ), generator=torch.Generator().manual_seed(1))

    expected_loss = reference(input_ids=ids, labels=ids).loss  # mean over the global batch
    expected_loss.backward()

    make_hf_sequence_parallel(model, group)
    mine = ids[2 * data : 2 * data + 2]  # this data rank's samples
    local = shard_sequence(mine, group)  # (2, s/p): this rank's tokens
    loss = model(input_ids=local, labels=local).loss
    loss.backward()

    # The engine's rule: sum over data x sequence, divide by dp (never by sp).
    data_loss = loss.detach().clone()
    comm.all_reduce(data_loss, group=topology.group("data"))
    assert_close_rel(data_loss / dp, expected_loss.detach(), rtol=RTOL, msg="loss")
    expected = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        grad = param.grad.clone()
        comm.all_reduce(grad, group=topology.group("data_sequence"))
        assert_close_rel(grad / dp, expected[name].grad, rtol=RTOL, atol=ATOL, msg=f"grad {name}")
    return {"loss": loss.item(), "params": len(expected)}


@pytest.mark.parametrize(
    ("world", "sp", "attn"),
    [(2, 2, "sdpa"), (2, 2, "eager"), (4, 4, "sdpa"), (4, 2, "sdpa")],
    ids=["sp2-sdpa", "sp2-eager", "sp4-sdpa", "sp2xdp2-sdpa"],
)
def test_hf_llama_matches_one_process(world: int, sp: int, attn: str) -> None:
    pytest.importorskip("transformers")
    results = run_distributed(_llama_body, world, sp, attn, timeout=150)
    assert all(r["params"] == results[0]["params"] > 0 for r in results)
    # every rank of a sequence group reports the same (full-sequence) loss
    for start in range(0, world, sp):
        assert len({results[r]["loss"] for r in range(start, start + sp)}) == 1


# ----------------------------------------------------------------- DeepSpeed oracle
ORACLE_CASES = [(4, 4, 1), (4, 4, 0), (8, 2, 1), (8, 2, 0)]  # even layouts DeepSpeed runs


def _oracle_cases(attention_class: Any, group: Any) -> dict[str, Any]:
    results = {}
    for case in ORACLE_CASES:
        results[str(case)] = _run_attention(attention_class, group, case, seed=sum(case))
    rotary_case = (4, 4, 1)
    results["rotary"] = _run_attention(attention_class, group, rotary_case, seed=3, rotary=True)
    return results


def _deepspeed_rank(result_dir: str) -> None:
    """One DeepSpeed rank (under torch.distributed.run in the peers venv)."""
    import deepspeed
    import deepspeed.comm.torch as ds_comm_torch
    from deepspeed.sequence.layer import DistributedAttention

    ds_comm_torch.build_shm_op = lambda: None  # skip a JIT build the gloo test never uses
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    group = torch.distributed.new_group([0, 1])
    results = _oracle_cases(DistributedAttention, group)
    torch.save(results, Path(result_dir) / f"rank{torch.distributed.get_rank()}.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _shardspeed_oracle_rank() -> dict[str, Any]:
    from shardspeed.parallel.sequence import sequence_group
    from shardspeed.sequence.layer import DistributedAttention

    return _oracle_cases(DistributedAttention, sequence_group(2))


def _run_deepspeed(result_dir: Path) -> dict[str, Any]:
    cmd = [golden.live_python(), "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc_per_node", "2", __file__, str(result_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=golden.live_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return {"ranks": [torch.load(result_dir / f"rank{r}.pt") for r in range(2)]}


@pytest.mark.parametrize("source", golden.ORACLE_SOURCES)
def test_distributed_attention_matches_deepspeed(source: str, tmp_path: Path) -> None:
    theirs = golden.deepspeed_side(
        source, "ulysses", "distributed_attention.pt.gz", lambda: _run_deepspeed(tmp_path)
    )["ranks"]
    ours = run_distributed(_shardspeed_oracle_rank, 2, timeout=120)
    assert all(ours[rank].keys() == theirs[rank].keys() for rank in range(2))
    for rank in range(2):
        for case, expected in theirs[rank].items():
            for name, value in expected.items():
                torch.testing.assert_close(
                    ours[rank][case][name], value, rtol=RTOL, atol=ATOL,
                    msg=f"rank {rank} case {case}: {name}",
                )  # fmt: skip


if __name__ == "__main__":  # a DeepSpeed rank, started by the oracle test
    _deepspeed_rank(sys.argv[1])
