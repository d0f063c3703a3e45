"""FastGen expert parallelism in one process: placement math, the exchange, refusals.

* placement (pure): which experts and token slices each rank has; layouts refused
  with the numbers named;
* the exchange (both dispatches): every MoE family built as ``E`` expert-parallel
  ranks in this process, the ranks running in threads whose all-to-all / all-gather go through
  a barrier; rank 0's logits must equal the single-process model's *bitwise*
  (each expert sees the same rows in the same order; each token's routes are
  summed in the same order);
* per-rank weight bytes: ep 2 holds half the routed experts;
* refusals before any worker starts (bad options, dense models, built models).

Spawned-worker runs (token identity, killed ranks) are in tests/dist/test_fastgen_ep_spawn.py.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from shardspeed.inference.fastgen.engine import InferenceEngine
from shardspeed.inference.fastgen.expert_parallel import ExpertPlacement, check_expert_layout
from shardspeed.inference.fastgen.expert_parallel.attach import (
    attach_experts,
    expert_parameter_bytes,
    parameter_bytes,
)
from shardspeed.inference.fastgen.expert_parallel.placement import token_bounds
from shardspeed.inference.fastgen.kv_cache import KVCache, KVCacheSpec
from shardspeed.inference.fastgen.loader import build_model
from shardspeed.inference.fastgen.ragged import build_ragged_batch
from shardspeed.inference.fastgen.scheduler import ScheduledBatch, ScheduledSequence

VOCAB = 128
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.1,
)  # fmt: skip
QWEN_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2)),
    # shared expert + gate, one dense-MLP layer (mlp_only_layers)
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(**QWEN_MOE, shared_expert_intermediate_size=80, mlp_only_layers=[1]),
    ),
    "qwen3_moe": ("Qwen3MoeConfig", dict(**QWEN_MOE, head_dim=16, norm_topk_prob=True)),
}


@pytest.fixture(autouse=True)
def _one_thread():
    """The rank threads each run matmuls: one intra-op thread each (no OpenMP spinning)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def _hf_model(family: str) -> torch.nn.Module:
    """A tiny random transformers MoE model with its 1-D weights (norms, biases) perturbed."""
    import transformers

    config_cls, overrides = FAMILIES[family]
    torch.manual_seed(0)
    cfg = getattr(transformers, config_cls)(**{**COMMON, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return model.float().eval()


# ------------------------------------------------------------------ placement math
def test_placement_holds_contiguous_experts_and_names_the_owner() -> None:
    places = [ExpertPlacement(8, 4, r) for r in range(4)]
    assert [p.local_experts for p in places] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert [places[0].owner(e) for e in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_token_slices_cover_every_token_once() -> None:
    assert token_bounds(5, 2) == [0, 3, 5]
    assert token_bounds(1, 4) == [0, 1, 1, 1, 1]  # a decode token: ranks 1..3 send nothing
    assert token_bounds(8, 4) == [0, 2, 4, 6, 8]


@pytest.mark.parametrize(
    ("experts", "ep", "tp", "world", "match"),
    [
        (8, 3, 1, None, "expert_parallel=3 does not divide the model's num_experts=8 .* in "
                        "\\[1, 2, 4, 8\\]"),
        (8, 2, 2, 2, "expert_parallel=2 x tensor_parallel=2 = 4 ranks, but the world has 2"),
        (0, 2, 1, None, "needs a mixture-of-experts model"),
        (8, 0, 1, None, "must be an int >= 1"),
    ],
)  # fmt: skip
def test_bad_layouts_are_refused_with_their_numbers(experts, ep, tp, world, match) -> None:
    with pytest.raises(ValueError, match=match):
        check_expert_layout(experts, ep, tp, world)


# -------------------------------------------------------- in-process ranks (threads)
class _ThreadComm:
    """All-to-all and all-gather among ``world_size`` threads (one per rank)."""

    def __init__(self, world_size: int, rank: int, shared: dict[str, Any]) -> None:
        self.world_size, self.rank, self.shared = world_size, rank, shared

    def _post(self, value: Any) -> list[Any]:
        slots, barrier = self.shared["slots"], self.shared["barrier"]
        slots[self.rank] = value
        barrier.wait()
        everyone = list(slots)
        barrier.wait()
        return everyone

    def all_to_all(self, x, output_splits, input_splits):
        sent = self._post(list(x.split(input_splits)))
        out = torch.cat([sent[src][self.rank] for src in range(self.world_size)])
        assert [sent[src][self.rank].shape[0] for src in range(self.world_size)] == output_splits
        return out

    def all_gather(self, x):
        return [t.clone() for t in self._post(x)]


def _thread_ranks(
    source: Any, ep: int, dispatch: str = "all_to_all", quantization: Any = None
) -> list[Any]:
    shared = {"slots": [None] * ep, "barrier": threading.Barrier(ep, timeout=60)}
    ranks = []
    for r in range(ep):
        comm = _ThreadComm(ep, r, shared)

        def prepare(m, r=r, comm=comm) -> None:
            attach_experts(m, ExpertPlacement(8, ep, r), comm, dispatch)

        cpu = torch.device("cpu")
        ranks.append(build_model(source, None, cpu, quantization, prepare=prepare)[0])
    return ranks


def _logits_of(model: Any, steps: list[ScheduledSequence]) -> list[torch.Tensor]:
    m = model
    spec = KVCacheSpec(m.num_layers, m.num_kv_heads, m.head_dim, 4, torch.float32)
    cache = KVCache(spec, 32, torch.device("cpu"))
    out = []
    with torch.inference_mode():
        for seq in steps:
            batch = build_ragged_batch(ScheduledBatch(list(seq)), 4, torch.device("cpu"), "torch")
            out.append(m(batch, cache))
    return out


def _steps() -> list[list[ScheduledSequence]]:
    """Two prompts prefilled together (every token's logits), then both decode one token."""
    g = torch.Generator().manual_seed(3)
    a, b = (torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (11, 6))
    ta, tb = list(range(0, 4)), list(range(4, 8))  # 4 blocks of 4 slots each

    def seq(tokens, start, table, logits_all):
        slots = [table[p // 4] * 4 + p % 4 for p in range(start, start + len(tokens))]
        request: Any = None  # the forward never reads it
        return ScheduledSequence(request, tokens, start, slots, table, True, all_logits=logits_all)

    prefill = [seq(a, 0, ta, True), seq(b, 0, tb, True)]
    decode = [seq([5], len(a), ta, False), seq([9], len(b), tb, False)]
    return [prefill, decode]


def _run_ranks(ranks: list[Any], steps: list[list[ScheduledSequence]]) -> list[list[torch.Tensor]]:
    got: list[list[torch.Tensor]] = [[] for _ in ranks]
    threads = [
        threading.Thread(target=lambda r=r: got[r].extend(_logits_of(ranks[r], steps)))
        for r in range(len(ranks))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(len(g) == len(steps) for g in got), "a rank thread failed"
    return got


@pytest.mark.parametrize("dispatch", ["all_to_all", "all_gather"])
@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_expert_parallel_ranks_reproduce_the_single_process_logits(
    family: str, ep: int, dispatch: str
) -> None:
    hf = _hf_model(family)
    full, _ = build_model(hf, None, torch.device("cpu"))
    steps = _steps()
    want = _logits_of(full, steps)
    ranks = _thread_ranks(hf, ep, dispatch)
    got = _run_ranks(ranks, steps)
    for rank_logits in got:  # every rank computes the same logits (rank 0's are used)
        for w, g in zip(want, rank_logits, strict=True):
            assert torch.equal(g, w), (family, ep, dispatch, (g - w).abs().max())


def test_int8_weights_compose_with_expert_parallelism() -> None:
    """Each rank quantizes its whole experts: the same int8 model as one process."""
    hf = _hf_model("mixtral")
    full, _ = build_model(hf, None, torch.device("cpu"), "int8")
    steps = _steps()
    want = _logits_of(full, steps)
    got = _run_ranks(_thread_ranks(hf, 2, quantization="int8"), steps)
    for w, g in zip(want, got[0], strict=True):
        assert torch.equal(g, w)


def test_ep2_holds_half_the_routed_experts_per_rank() -> None:
    hf = _hf_model("qwen2_moe")
    full, _ = build_model(hf, None, torch.device("cpu"))
    ranks = _thread_ranks(hf, 2)
    whole = expert_parameter_bytes(full)
    for r, model in enumerate(ranks):
        held = expert_parameter_bytes(model)
        assert held <= 0.55 * whole, (r, held, whole)
        assert held == whole // 2
        # everything else (attention, norms, router, shared expert, embeddings) replicated
        assert parameter_bytes(full) - whole == parameter_bytes(model) - held
        assert sorted(model.layers[0].mlp.experts) == [str(e) for e in range(4 * r, 4 * r + 4)]


# ---------------------------------------------------------------- refusals
ENGINE = dict(block_size=4, num_blocks=64, device="cpu")


def test_bad_expert_parallel_options_fail_before_any_worker_starts() -> None:
    import multiprocessing

    before = set(multiprocessing.active_children())  # e.g. the test pool's warm workers
    mixtral = _hf_model("mixtral")
    with pytest.raises(ValueError, match="expert_parallel=3 does not divide .* num_experts=8"):
        InferenceEngine.from_pretrained(mixtral, expert_parallel=3, **ENGINE)
    with pytest.raises(ValueError, match="expert_parallel=2 with tensor_parallel=2"):
        InferenceEngine.from_pretrained(mixtral, expert_parallel=2, tensor_parallel=2, **ENGINE)
    with pytest.raises(ValueError, match="compile_decode=True with expert_parallel=2"):
        InferenceEngine.from_pretrained(mixtral, expert_parallel=2, compile_decode=True, **ENGINE)
    with pytest.raises(ValueError, match="expert_parallel_dispatch='ring' is not supported"):
        InferenceEngine.from_pretrained(
            mixtral, expert_parallel=2, expert_parallel_dispatch="ring", **ENGINE
        )
    with pytest.raises(ValueError, match="expert_parallel=0 must be an int >= 1"):
        InferenceEngine.from_pretrained(mixtral, expert_parallel=0, **ENGINE)
    ragged, _ = build_model(mixtral, None, torch.device("cpu"))
    with pytest.raises(ValueError, match="already-built MixtralModel"):
        InferenceEngine.from_pretrained(ragged, expert_parallel=2, **ENGINE)
    import transformers

    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON))
    with pytest.raises(
        ValueError, match="has no routed experts|no routed experts \\(num_experts=0"
    ):
        InferenceEngine.from_pretrained(llama, expert_parallel=2, **ENGINE)
    assert set(multiprocessing.active_children()) <= before  # no engine worker started


def test_init_inference_moe_layouts_are_refused_with_their_numbers() -> None:
    from shardspeed.inference.moe_config import InferenceMoEConfig
    from shardspeed.inference.moe_serving import check_moe_layout
    from shardspeed.moe.layer import MoE

    layer = MoE(8, torch.nn.Linear(8, 8), num_experts=4, ep_size=2)  # no groups yet
    ep2 = InferenceMoEConfig(ep_size=2)
    check_moe_layout([layer], ep2, 1, 2)
    with pytest.raises(ValueError, match="moe.ep_size=2 x tensor_parallel=1 = 2 ranks, but the "
                       "world has 4"):  # fmt: skip
        check_moe_layout([layer], ep2, 1, 4)
    with pytest.raises(ValueError, match="moe.ep_size=2 with tensor_parallel.tp_size=2"):
        check_moe_layout([layer], ep2, 2, 4)
    with pytest.raises(ValueError, match="has no shardspeed.moe.layer.MoE layers"):
        check_moe_layout([], ep2, 1, 2)
    with pytest.raises(ValueError, match="moe.type='residual', but MoE layer 0 has use_resid"):
        check_moe_layout([layer], InferenceMoEConfig(ep_size=2, type="residual"), 1, 2)
