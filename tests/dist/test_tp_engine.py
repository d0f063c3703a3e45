"""AutoTP training through ``shardspeed.initialize`` against a one-process reference.

A DeepSpeed AutoTP script: a tiny Hugging Face Llama (GQA) or GPT-2, ``"tensor_parallel":
{"autotp_size": tp}`` in the config, ``initialize`` shards the model, the engine trains it
with ZeRO over the data axis (at stage 3 each tensor rank's shards are sharded again over
the data axis, unit by unit, and released after use). The reference trains the unsharded
model in one process on the same global batch (the mean of the data ranks' micro-batch
losses), with the same optimizer and gradient clipping (so the global norm must count
tensor-parallel shards over the tensor axis and replicated parameters once). The
optimizer is SGD with momentum, as in the 16-bit parity tests: tensor parallelism
legitimately reorders the forward's sums (a row-parallel matmul adds partial products
across ranks), and Adam would turn those rounding differences on near-zero gradients into
whole ``lr``-sized steps (seen: 1.1e-6 on one element after 4 AdamW steps), while SGD keeps
them at rounding level. Compared: every rank's loss every step and the full weights from
``engine.state_dict()`` (gathered, the model's own names) at the end; ranks of one tensor
group must see the same micro-batch (the dataloader shards over the data axis only).

Tolerances are the other parity tests' (``test_zero_parity.py``): fp32 1e-5 relative
(+1e-6 absolute); bf16 (the reference applies the same precision policy: bf16 forward and
backward, fp32 gradient sums and masters) rtol = 2 * eps, atol = lr * steps * eps with
eps = 2**-8.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from shardspeed.testing import assert_close_rel, run_distributed

pytest.importorskip("transformers")

CONFIGS = {
    "llama": dict(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2),
    # 4 KV heads (GQA 8/4) so that tp=4 keeps one whole KV group per rank
    "llama_kv4": dict(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=4),
    "gpt2": dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=16,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
}  # fmt: skip
STEPS, MICRO, SEQ, LR, CLIP = 4, 2, 8, 0.1, 0.3
BF16_EPS = 2.0**-8


@dataclass(frozen=True)
class Case:
    kind: str  # a CONFIGS key
    tp: int
    stage: int
    precision: str = "fp32"
    zero_init: bool = False  # build the model under zero.Init (partitioned at construction)

    def config(self) -> dict[str, Any]:
        zero: dict[str, Any] = {"stage": self.stage}
        if self.stage == 3:  # every parameter in a unit flat (released after use)
            zero["stage3_param_persistence_threshold"] = 0
        config = {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_clipping": CLIP,
            "tensor_parallel": {"autotp_size": self.tp},
            "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
            "zero_optimization": zero,
        }
        if self.precision == "bf16":
            config["bf16"] = {"enabled": True}
        return config

    def tolerance(self) -> dict[str, float]:
        if self.precision == "fp32":
            return {"rtol": 1e-5, "atol": 1e-6}
        return {"rtol": 2 * BF16_EPS, "atol": LR * STEPS * BF16_EPS}


def _model(kind: str) -> Any:
    import transformers as tf

    torch.manual_seed(0)
    if kind == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(**CONFIGS[kind]))
    return tf.LlamaForCausalLM(tf.LlamaConfig(**CONFIGS[kind]))


def _ids(step: int, data_rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + data_rank)
    return torch.randint(0, 64, (MICRO, SEQ), generator=g)


def _reference(case: Case, dp: int) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """One process, the whole model, the global batch of ``dp`` micro-batches: forward and
    backward in the training dtype, gradients summed in fp32 in data-rank order, fp32
    masters (the engine's precision policy without any sharding). One intra-op thread,
    like the ranks."""
    from shardspeed.optim import build_optimizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = _model(case.kind).to(torch.bfloat16 if case.precision == "bf16" else torch.float32)
        params = list(model.parameters())
        masters = [p.detach().float().clone() for p in params]
        opt = build_optimizer("SGD", {"lr": LR, "momentum": 0.9}, masters)
        losses = []
        for step in range(STEPS):
            grads = [torch.zeros_like(m) for m in masters]
            per_rank = []
            for d in range(dp):
                loss = model(_ids(step, d), labels=_ids(step, d)).loss
                loss.backward()
                for g, p in zip(grads, params):
                    g.add_(p.grad.float())
                    p.grad = None
                per_rank.append(float(loss))
            for m, g in zip(masters, grads):
                m.grad = g / dp
            torch.nn.utils.clip_grad_norm_(masters, CLIP)
            opt.step()
            with torch.no_grad():
                for p, m in zip(params, masters):
                    p.copy_(m)
            losses.append(per_rank)
        return losses, {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    finally:
        torch.set_num_threads(threads)


def _train(cases: list[Case]) -> list[dict[str, Any]]:
    import shardspeed
    from shardspeed import comm

    out = []
    for case in cases:
        if case.zero_init:
            with shardspeed.zero.Init(config_dict_or_path=case.config()):
                model = _model(case.kind)
            assert all(p.numel() == 0 for p in model.parameters())
            # "pretrained" weights into the partitioned model, as a zero.Init user loads them
            params = list(model.parameters())
            with shardspeed.zero.GatheredParameters(params, modifier_rank=0):
                model.load_state_dict(_model(case.kind).state_dict())
        else:
            model = _model(case.kind)
        engine, _, _, _ = shardspeed.initialize(model=model, config=case.config())
        data_rank = engine.topology.coords(comm.get_rank()).data
        losses = []
        for step in range(STEPS):
            ids = _ids(step, data_rank)
            loss = engine(ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        released = all(p.numel() == 0 for p in engine.module.parameters())
        ref_losses, ref_state = _reference(case, engine.dp_world_size)
        out.append(
            {
                "case": case,
                "losses": losses,
                "ref": [r[data_rank] for r in ref_losses],
                "state": {k: v.detach().float().clone() for k, v in engine.state_dict().items()},
                "ref_state": ref_state,
                "mp": engine.mp_world_size,
                "released": released,
            }
        )
        engine.destroy()
    return out


def _check(results: list[list[dict[str, Any]]]) -> None:
    for per_rank in results:
        for r in per_rank:
            case: Case = r["case"]
            tol = case.tolerance()
            assert r["mp"] == case.tp
            # stage 3: every parameter is sharded over the data axis and released after use
            assert r["released"] == (case.stage == 3), case
            assert_close_rel(r["losses"], r["ref"], **tol, msg=f"{case} losses")
            assert set(r["state"]) == set(r["ref_state"])
            for name, value in r["ref_state"].items():
                assert_close_rel(r["state"][name], value, **tol, msg=f"{case} {name}")


def _cases(kind: str, tp: int, stages: list[int], precision: str = "fp32") -> list[Case]:
    return [Case(kind, tp, stage, precision) for stage in stages]


def test_autotp_training_tp2_matches_reference() -> None:
    """tp=2 at ZeRO 0-3, and at ZeRO-3 from a model built under zero.Init (gathered, then
    sliced by AutoTP, then sharded over the data axis again)."""
    cases = _cases("llama", 2, [0, 1, 2, 3]) + [Case("llama", 2, 3, zero_init=True)]
    _check(run_distributed(_train, 2, cases, timeout=300))


def test_autotp_training_tp2_dp2_matches_reference() -> None:
    _check(run_distributed(_train, 4, _cases("llama", 2, [1, 2, 3]), timeout=300))


def test_autotp_gpt2_matches_reference() -> None:
    """GPT-2 (fused c_attn Conv1D, vocabulary-parallel tied head): tp=2 at ZeRO 0-3, then
    tp=2 x dp=2 and tp=4 at ZeRO 3."""
    _check(run_distributed(_train, 2, _cases("gpt2", 2, [0, 1, 2, 3]), timeout=300))
    _check(run_distributed(_train, 4, _cases("gpt2", 2, [3]) + _cases("gpt2", 4, [3]), timeout=300))


def test_autotp_training_tp4_matches_reference() -> None:
    _check(run_distributed(_train, 4, _cases("llama_kv4", 4, [0, 1, 2, 3]), timeout=300))


def test_autotp_bf16_matches_reference() -> None:
    cases = _cases("llama", 2, [1, 2, 3], "bf16") + _cases("gpt2", 2, [3], "bf16")
    _check(run_distributed(_train, 2, cases, timeout=300))


def _memory(tps: list[int]) -> list[dict[str, Any]]:
    """Per-rank bytes of the bf16 parameters, fp32 masters and AdamW state after one step
    at ZeRO 0 (nothing sharded over the data axis, so only TP divides): the engine's
    ``memory_breakdown()`` for the whole model, and per parameter name computed from the
    engine's param groups (``param_fragments``: this rank's elements of each master), since
    the breakdown is per category, not per layer."""
    import shardspeed
    from shardspeed.zero.fragments import param_fragments

    out = []
    for tp in tps:
        config = {
            "train_micro_batch_size_per_gpu": MICRO,
            "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 0},
            "tensor_parallel": {"autotp_size": tp},
        }
        engine, _, _, _ = shardspeed.initialize(model=_model("llama"), config=config)
        ids = _ids(0, 0)
        engine.backward(engine(ids, labels=ids).loss)
        engine.step()
        names = {id(p): n for n, p in engine.module.named_parameters()}
        state = engine.basic_optimizer.state
        scalars = 0  # per-master state that is not elementwise (AdamW's `step`)
        for master in (m for g in engine.flat_groups for m in g.masters):
            scalars += sum(v.nbytes for v in state[master].values() if v.numel() != master.numel())
        per_name: dict[str, int] = {}
        for group in engine.flat_groups:
            for f in param_fragments(group):
                master = group.masters[f.master_index]
                # optimizer bytes per master element: the elementwise state tensors
                state_bytes = sum(
                    v.element_size() for v in state[master].values() if v.numel() == master.numel()
                )
                param_bytes = f.param.numel() * f.param.element_size()
                per_name[names[id(f.param)]] = param_bytes + f.length * (
                    master.element_size() + state_bytes
                )
        sharded = [
            n for n, p in engine.module.named_parameters() if getattr(p, "tensor_model_parallel", 0)
        ]
        out.append(
            {
                "breakdown": engine.memory_breakdown(),
                "per_name": per_name,
                "scalars": scalars,
                "sharded": sharded,
            }
        )
        engine.destroy()
    return out


def test_autotp_halves_sharded_layer_memory() -> None:
    """Per-rank parameter + master + optimizer-state bytes of the tensor-parallel layers at
    tp=2 are at most 0.55x of tp=1 (an even split gives 0.5; replicated layers -- norms,
    the untied input embedding -- stay whole and are excluded)."""
    results = run_distributed(_memory, 2, [1, 2])
    kept = ("params", "master_params", "optimizer_state")
    for one, two in results:
        for r in (one, two):  # the per-name numbers account for the engine's breakdown exactly
            total = sum(r["breakdown"][k] for k in kept)
            assert sum(r["per_name"].values()) + r["scalars"] == total, r["breakdown"]
        assert not one["sharded"] and two["sharded"]
        full = sum(one["per_name"][n] for n in two["sharded"])
        ratio = sum(two["per_name"][n] for n in two["sharded"]) / full
        assert ratio <= 0.55, f"sharded layers use {ratio:.3f}x of tp=1's bytes per rank"


# -- pipeline x tensor parallelism -----------------------------------------------------------

PIPE_WIDTH, PIPE_HIDDEN, PIPE_LAYERS, PIPE_MICRO, PIPE_M = 8, 16, 4, 2, 2


class _TPBlock(torch.nn.Module):
    """Residual MLP, Megatron style: column-parallel up, row-parallel down; (B, T, W)."""

    def __init__(self, group: Any) -> None:
        from shardspeed.parallel.tensor import ColumnParallelLinear, RowParallelLinear

        super().__init__()
        self.up = ColumnParallelLinear(PIPE_WIDTH, PIPE_HIDDEN, group=group)
        self.down = RowParallelLinear(PIPE_HIDDEN, PIPE_WIDTH, group=group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class _RefBlock(torch.nn.Module):
    """The unsharded block (same init order, so the same weights for one seed)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(PIPE_WIDTH, PIPE_HIDDEN)
        self.down = torch.nn.Linear(PIPE_HIDDEN, PIPE_WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


def _pipe_batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * step + micro)
    shape = (PIPE_MICRO, 4, PIPE_WIDTH)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _pipe_config(dp: int = 1) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": PIPE_MICRO,
        "gradient_accumulation_steps": PIPE_M // dp,  # PIPE_M micro-batches per step in all
        "gradient_clipping": 0.05,
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
    }


def _pipe_train(dp: int = 1) -> tuple[list[float], dict[str, torch.Tensor]]:
    import shardspeed
    from shardspeed.parallel.tensor.state import gather_full_state_dict
    from shardspeed.pipe import LayerSpec, PipelineModule
    from shardspeed.topology import Topology

    topology = Topology.build(pp=2, tp=2, dp=dp)
    group = topology.group("tensor")
    net = PipelineModule(
        [LayerSpec(_TPBlock, group) for _ in range(PIPE_LAYERS)],
        topology=topology,
        loss_fn=torch.nn.functional.mse_loss,
        seed_layers=True,
        partition_method="uniform",
    )
    engine, _, _, _ = shardspeed.initialize(model=net, config=_pipe_config(dp))
    d = engine.dp_rank

    def data():
        for step in range(STEPS):
            for k in range(PIPE_M // dp):
                yield _pipe_batch(step, k * dp + d)

    it = data()
    losses = [float(engine.train_batch(it)) for _ in range(STEPS)]
    full = {k: v.detach().clone() for k, v in gather_full_state_dict(engine.module).items()}
    engine.destroy()
    return losses, full


def _pipe_reference(steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor]]:
    layers = []
    for i in range(PIPE_LAYERS):
        torch.manual_seed(1234 + i)  # PipelineModule(seed_layers=True)
        layers.append(_RefBlock())
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        for k in range(PIPE_M):
            x, y = _pipe_batch(step, k)
            loss = torch.nn.functional.mse_loss(model(x), y)
            (loss / PIPE_M).backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        losses.append(total / PIPE_M)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _check_pipe(results: list[tuple[list[float], dict[str, torch.Tensor]]]) -> None:
    ref_losses, ref_state = _pipe_reference()
    seen: set[str] = set()
    for rank, (losses, full) in enumerate(results):
        assert_close_rel(losses, ref_losses, rtol=1e-5, atol=1e-6, msg=f"rank {rank} losses")
        for name, value in full.items():
            assert_close_rel(value, ref_state[name], rtol=1e-5, atol=1e-6, msg=f"{rank} {name}")
            seen.add(name)
    assert seen == set(ref_state)


def test_pipeline_x_tensor_parallel_matches_reference() -> None:
    """pp=2 x tp=2 (4 ranks) on a PipelineModule of Megatron layers, ZeRO-1, clipping on:
    every rank's batch loss and its stage's gathered full weights against one process."""
    _check_pipe(run_distributed(_pipe_train, 4, timeout=300))


@pytest.mark.slow
def test_pipeline_x_data_x_tensor_parallel_matches_reference() -> None:
    """pp=2 x dp=2 x tp=2 (8 ranks): ZeRO-1 over the data axis as well."""
    _check_pipe(run_distributed(_pipe_train, 8, 2, timeout=600))


def _pipe_autotp_refused() -> str:
    import shardspeed
    from shardspeed.pipe import PipelineModule

    net = PipelineModule([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)], num_stages=2)
    config = {**_pipe_config(), "tensor_parallel": {"autotp_size": 2}}
    with pytest.raises(ValueError) as err:
        shardspeed.initialize(model=net, config=config)
    return str(err.value)


def test_pipeline_module_refuses_autotp_size() -> None:
    message = run_distributed(_pipe_autotp_refused, 2)[0]
    assert "autotp_size=2" in message and "ColumnParallelLinear" in message
