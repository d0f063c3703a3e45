"""MoE training step time: ShardSpeed vs DeepSpeed 0.19.8 at equal config on CPU/gloo.

Model: a small GPT-ish MoE (vocab 256, ``--embd`` 64, ``--layers`` 2 blocks of causal
self-attention + ``MoE(ep_size=--ep (2), num_experts=8, k=2)`` FFN, tied head), fp32, ZeRO stage
``--stage``, torch Adam over ``split_params_into_different_moe_groups_for_optimizer`` groups,
gradient clipping 1.0, loss ``cross-entropy + 0.01 * sum(l_aux)``; tokens dropped at
capacity factor 1.0, or none with ``--no-drop``. The same script runs on ``--ranks`` (2)
ranks under ``torch.distributed.run`` with ``import deepspeed`` (``.venv-peers``) and with
``import shardspeed as deepspeed`` (same interpreter and torch build, ``PYTHONPATH`` = repo),
same seeds and data.

Each run: ``--warmup`` steps, then ``--steps`` timed steps (``perf_counter`` around
forward + backward + step, a barrier before each); the step time is the median over steps
of the slower rank (also its CPU time, ``process_time``: the work done, less sensitive to a
loaded machine than wall time). ``torch.distributed.all_to_all_single`` (which both libraries call for
the MoE dispatch and combine) is wrapped to time every call and count its bytes: the
all-to-all share is that time over the step time. Rounds alternate DeepSpeed / ShardSpeed
(``--rounds``, order flipped every round) so machine load drifts hit both; the ratio is per
round and the median of those ratios is reported.

Usage::

    .venv/bin/python benchmarks/moe_bench.py                   # 3 rounds, markdown table
    .venv/bin/python benchmarks/moe_bench.py --rounds 5 --steps 20 --stage 2 --no-drop
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(BENCH_DIR.parent))

from _bench_common import (  # noqa: E402
    child_env,
    emit_result,
    machine_description,
    peak_rss_mb,
    peers_python,
    ratio,
    render_table,
    run_child,
)

VOCAB, SEQ, EXPERTS, TOP_K, EP = 256, 64, 8, 2, 2


# ----------------------------------------------------------------------------- worker
def _build_model(moe_class: Any, embd: int, layers: int, drop: bool, ep: int) -> Any:
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(embd), nn.LayerNorm(embd)
            self.qkv, self.proj = nn.Linear(embd, 3 * embd), nn.Linear(embd, embd)
            expert = nn.Sequential(nn.Linear(embd, 4 * embd), nn.GELU(), nn.Linear(4 * embd, embd))
            self.moe = moe_class(
                embd, expert, num_experts=EXPERTS, ep_size=ep, k=TOP_K, drop_tokens=drop
            )

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            b, t, c = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, 4, c // 4).permute(2, 0, 3, 1, 4)
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, 4, t, c/4)
            x = x + self.proj(att.transpose(1, 2).reshape(b, t, c))
            out, l_aux, _ = self.moe(self.ln2(x))
            return x + out, l_aux

    class MoEGPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe = nn.Embedding(VOCAB, embd), nn.Embedding(SEQ, embd)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(embd)
            nn.init.normal_(self.wte.weight, std=0.02)  # tied head: GPT-2's scale

        def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
            aux = torch.zeros(())
            for block in self.blocks:
                x, l_aux = block(x)
                aux = aux + l_aux
            logits = self.ln_f(x) @ self.wte.weight.t()  # (b, t, vocab)
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
            return loss + 0.01 * aux

    return MoEGPT()


class _AllToAllTimer:
    """Wraps ``torch.distributed.all_to_all_single``: total seconds, calls and input bytes."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.seconds, self.calls, self.bytes, self.on = 0.0, 0, 0, False
        self._inner = dist.all_to_all_single

        def timed(output: Any, input: Any, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            result = self._inner(output, input, *args, **kwargs)
            if self.on:
                self.seconds += time.perf_counter() - start
                self.calls += 1
                self.bytes += input.numel() * input.element_size()
            return result

        dist.all_to_all_single = timed


def worker(args: argparse.Namespace) -> None:
    """One rank (under torch.distributed.run)."""
    import torch

    torch.set_num_threads(1)
    if args.worker == "deepspeed":
        import deepspeed
        import deepspeed.comm.torch as ds_comm_torch

        ds_comm_torch.build_shm_op = lambda: None  # gloo only; skip a JIT build
    else:
        import shardspeed as deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    MoE = deepspeed.moe.layer.MoE
    split_params_into_different_moe_groups_for_optimizer = (
        deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer
    )

    rank = torch.distributed.get_rank()
    timer = _AllToAllTimer()
    torch.manual_seed(1234)
    model = _build_model(MoE, args.embd, args.layers, not args.no_drop, args.ep)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"name": "params", "params": list(model.parameters())}
    )
    optimizer = torch.optim.Adam(groups, lr=1e-3)
    config = {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": args.stage},
        "steps_per_print": 10**9,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    expert_numel = sum(p.numel() for p in model.parameters() if not getattr(p, "allreduce", True))
    times, cpu, a2a, losses = [], [], [], []
    for step in range(args.warmup + args.steps):
        g = torch.Generator().manual_seed(step * 100 + rank)
        tokens = torch.randint(0, VOCAB, (args.micro, SEQ + 1), generator=g)
        torch.manual_seed(step * 100 + rank)  # RTS / second-expert draws
        timer.on, timer.seconds = step >= args.warmup, 0.0
        torch.distributed.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
        if step >= args.warmup:
            times.append(elapsed)
            cpu.append(elapsed_cpu)
            a2a.append(timer.seconds)
            losses.append(float(loss.detach()))
    stats = [statistics.median(times), statistics.median(a2a), statistics.median(cpu)]
    stats = torch.tensor(stats, dtype=torch.float64)
    torch.distributed.all_reduce(stats, op=torch.distributed.ReduceOp.MAX)
    rss = torch.tensor([peak_rss_mb()], dtype=torch.float64)
    torch.distributed.all_reduce(rss, op=torch.distributed.ReduceOp.MAX)
    if rank == 0:
        emit_result(
            {
                "step_ms": float(stats[0]) * 1e3,
                "a2a_ms": float(stats[1]) * 1e3,
                "cpu_ms": float(stats[2]) * 1e3,
                "a2a_calls_per_step": timer.calls / args.steps,
                "a2a_mb_per_step": timer.bytes / args.steps / 2**20,
                "expert_params_per_rank": expert_numel,
                "total_params": sum(p.numel() for p in model.parameters()),
                "peak_rss_mb": float(rss[0]),
                "last_loss": losses[-1],
            }
        )
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


# ----------------------------------------------------------------------------- parent
def _run(framework: str, python: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
    cmd += [str(args.ranks), __file__, "--worker", framework, "--stage", str(args.stage)]
    cmd += ["--ep", str(args.ep), "--ranks", str(args.ranks), "--steps"]
    cmd += [str(args.steps), "--warmup", str(args.warmup), "--embd", str(args.embd)]
    cmd += ["--layers", str(args.layers), "--micro", str(args.micro)]
    cmd += ["--no-drop"] if args.no_drop else []
    code, results, tail = run_child(cmd, child_env(threads=1, device="cpu"), 900, None)
    if code != 0 or not results:
        raise RuntimeError(f"{framework} run failed (exit {code}):\n{tail}")
    return results[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", choices=("deepspeed", "shardspeed"), help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--stage", type=int, default=1, choices=(0, 1, 2))
    parser.add_argument("--embd", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=2, help="processes (2 cores: 4 oversubscribe)")
    parser.add_argument("--ep", type=int, default=EP, help="expert-parallel size (divides ranks)")
    parser.add_argument(
        "--no-drop", action="store_true", help="drop_tokens=False (default: capacity 1.0, drop)"
    )
    args = parser.parse_args()
    if args.ranks % args.ep or EXPERTS % args.ep:
        parser.error(f"--ep {args.ep} must divide --ranks {args.ranks} and {EXPERTS} experts")
    if args.worker:
        worker(args)
        return
    python = peers_python()
    if python is None:
        sys.exit("DeepSpeed 0.19.8 (.venv-peers) is needed for the comparison: make bench-peers")
    print(f"machine: {machine_description()}; load average {os.getloadavg()}")
    print(
        f"config: {args.ranks} ranks gloo, ep {args.ep}, {EXPERTS} experts top-{TOP_K}, embd {args.embd}, "
        f"{args.layers} layers, seq {SEQ}, micro {args.micro}, ZeRO {args.stage}, fp32, "
        f"{'no-drop' if args.no_drop else 'capacity_factor 1.0 (drop)'}, "
        f"{args.warmup} warm-up + {args.steps} timed steps, {args.rounds} rounds"
    )
    rows, ratios = [], []
    for round_index in range(args.rounds):
        order = ("deepspeed", "shardspeed")[:: 1 if round_index % 2 == 0 else -1]
        result = {fw: _run(fw, str(python), args) for fw in order}
        ds, ss = result["deepspeed"], result["shardspeed"]
        ratios.append(ratio(ss["step_ms"], ds["step_ms"]))
        for fw, r in (("DeepSpeed 0.19.8", ds), ("ShardSpeed", ss)):
            rows.append(
                [
                    round_index, fw, r["step_ms"], r["cpu_ms"], r["a2a_ms"],
                    100 * r["a2a_ms"] / r["step_ms"],
                    r["a2a_calls_per_step"], r["a2a_mb_per_step"], r["expert_params_per_rank"],
                    r["peak_rss_mb"], r["last_loss"],
                ]
            )  # fmt: skip
        print(f"round {round_index}: ShardSpeed / DeepSpeed step time {ratios[-1]:.3f}", flush=True)
    headers = [
        "round", "library", "step ms (median)", "CPU ms/step", "all-to-all ms", "all-to-all %",
        "a2a calls/step",
        "a2a MiB/step (rank)", "expert params/rank", "peak RSS MiB", "last loss",
    ]  # fmt: skip
    print(render_table(headers, rows, markdown=True))
    valid = [r for r in ratios if r is not None]
    print(f"step-time ratio ShardSpeed / DeepSpeed per round: {[round(r, 3) for r in valid]}")
    print(f"median ratio: {statistics.median(valid):.3f}; load average now {os.getloadavg()}")
    cpu = [ratio(b[3], a[3]) for a, b in zip(rows[::2], rows[1::2])]
    print(f"CPU-time ratio ShardSpeed / DeepSpeed per round: {[round(r, 3) for r in cpu if r]}")


if __name__ == "__main__":
    main()
