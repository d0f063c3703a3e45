"""Train a small GPT on the Python standard library's source code with ShardSpeed.

    python examples/train_gpt.py                 # 2 ranks on CPU (re-launches itself)
    python examples/train_gpt.py --zero 2 --steps 300
    shardspeed --nproc 2 examples/train_gpt.py   # the same, launched explicitly

On GPUs the script uses NCCL and bf16 automatically. At the end it prints a summary
(loss curve, memory per rank, time), saves the weights, and generates text from the
trained model through the inference pipeline.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    p.add_argument("--nproc", type=int, default=2, help="ranks to launch when started directly")
    p.add_argument("--zero", type=int, default=1, choices=[0, 1, 2, 3], help="ZeRO stage")
    p.add_argument(
        "--offload",
        choices=["none", "cpu", "nvme"],
        default="none",
        help="optimizer offload: masters + optimizer state on the host (--zero 1-3) or in NVMe "
        "swap files (--zero 3)",
    )
    p.add_argument(
        "--offload-param",
        choices=["none", "cpu", "nvme"],
        default="none",
        help="parameter-shard offload (--zero 3)",
    )
    p.add_argument(
        "--nvme-path", default=None, help="directory for NVMe swap files (default: <out>/nvme)"
    )
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--gas", type=int, default=1, help="gradient accumulation steps")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--embd", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--out", default="runs/demo", help="where weights and the summary go")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-generate", action="store_true")
    args = p.parse_args(argv)
    if args.offload != "none" and args.zero == 0:
        p.error(
            f"--offload {args.offload} needs --zero 1, 2 or 3 (stage 0 has no sharded optimizer)"
        )
    if args.offload == "nvme" and args.zero != 3:
        p.error("--offload nvme needs --zero 3 (use --offload cpu at stages 1-2)")
    if args.offload_param != "none" and args.zero != 3:
        p.error(
            f"--offload-param {args.offload_param} needs --zero 3 (parameters are sharded there)"
        )
    return args


def offload_block(device: str, args: argparse.Namespace) -> dict:
    """An offload_optimizer / offload_param block; NVMe swap files go under --nvme-path."""
    if device != "nvme":
        return {"device": device}
    path = Path(args.nvme_path or Path(args.out) / "nvme")
    path.mkdir(parents=True, exist_ok=True)
    return {"device": "nvme", "nvme_path": str(path)}


def relaunch(args: argparse.Namespace) -> int:
    """Started directly (no torchrun env): run this script on --nproc ranks via our launcher."""
    cmd = [sys.executable, "-m", "shardspeed.launcher.cli", "--nproc", str(args.nproc), __file__]
    cmd += [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    print(f"launching {args.nproc} ranks: {' '.join(cmd[2:])}", flush=True)
    return subprocess.call(cmd, env=env)


def ds_config(args: argparse.Namespace, on_gpu: bool) -> dict:
    cfg: dict = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.gas,
        "gradient_clipping": 1.0,
        "steps_per_print": 0,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": args.lr, "weight_decay": 0.01, "betas": [0.9, 0.95]},
        },
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {"total_num_steps": args.steps, "warmup_num_steps": max(args.steps // 20, 2)},
        },
        "zero_optimization": {"stage": args.zero},
        "bf16": {"enabled": on_gpu},
    }
    if args.zero == 3:
        # every matrix of the small demo GPT is under DeepSpeed's default persistence threshold
        # (1e5 elements), which would keep them all unsharded; shard anything above 1000.
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 1000
    if args.offload != "none":
        cfg["zero_optimization"]["offload_optimizer"] = offload_block(args.offload, args)
    if args.offload_param != "none":
        cfg["zero_optimization"]["offload_param"] = offload_block(args.offload_param, args)
    return cfg


def sparkline(values: list[float], width: int = 60) -> str:
    bars = "▁▂▃▄▅▆▇█"
    if not values:
        return ""
    step = max(len(values) // width, 1)
    pts = [
        sum(values[i : i + step]) / len(values[i : i + step]) for i in range(0, len(values), step)
    ]
    lo, hi = min(pts), max(pts)
    span = (hi - lo) or 1.0
    return "".join(bars[min(int((v - lo) / span * (len(bars) - 1)), len(bars) - 1)] for v in pts)


def rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def train(args: argparse.Namespace) -> None:
    import shardspeed
    from shardspeed import comm
    from shardspeed.data import TokenWindows, load_stdlib_corpus
    from shardspeed.models import GPT, ByteTokenizer, GPTConfig
    from shardspeed.runtime.dataloader import RepeatingLoader
    from shardspeed.utils.progress import progress

    comm.init_distributed()
    rank, world = comm.get_rank(), comm.get_world_size()
    on_gpu = torch.cuda.is_available()
    torch.manual_seed(args.seed)
    config = GPTConfig(
        vocab_size=256,
        block_size=args.block,
        n_layer=args.layers,
        n_head=args.heads,
        n_embd=args.embd,
    )
    model = GPT(config)
    num_params = model.num_parameters()
    args.bf16 = on_gpu
    tokens = load_stdlib_corpus()
    split = int(tokens.numel() * 0.95)
    train_set = TokenWindows(tokens[:split], args.block)
    val_x, val_y = TokenWindows(tokens[split:], args.block)[0]

    engine, _, loader, _ = shardspeed.initialize(
        model=model, config=ds_config(args, on_gpu), training_data=train_set
    )
    data = iter(RepeatingLoader(loader))
    tokens_per_step = engine.train_batch_size() * args.block
    losses: list[float] = []
    t_start = time.perf_counter()
    bar = progress(range(args.steps), desc=f"train ZeRO-{args.zero}", unit="step")
    for _ in bar:
        t0 = time.perf_counter()
        loss_acc = 0.0
        for _ in range(args.gas):
            x, y = next(data)
            x, y = x.to(engine.device), y.to(engine.device)
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            loss_acc += loss.item() / args.gas
        mean = torch.tensor(loss_acc)
        comm.all_reduce(mean)
        losses.append(float(mean) / world)
        bar.set_postfix(
            loss=f"{losses[-1]:.3f}", tok_s=f"{tokens_per_step / (time.perf_counter() - t0):,.0f}"
        )
    elapsed = time.perf_counter() - t_start

    engine.eval()
    with torch.no_grad():
        _, val_loss = engine(val_x[None].to(engine.device), val_y[None].to(engine.device))
    mem = engine.memory_breakdown()
    mem["rss"] = rss_bytes()
    all_mem = [None] * world
    comm.all_gather_object(all_mem, mem)

    out = Path(args.out)
    state = engine.state_dict()  # full weights (a collective gather at ZeRO-3)
    if rank == 0:
        trained = GPT(config)
        trained.load_state_dict({k: v.float() for k, v in state.items()})
        trained.save_pretrained(out)
        print_summary(
            args,
            losses,
            float(val_loss),
            all_mem,
            elapsed,
            tokens_per_step,
            out,
            config,
            num_params,
        )
    comm.barrier()
    if rank == 0 and not args.no_generate:
        generate_samples(out, ByteTokenizer())
    engine.destroy()


def print_summary(
    args, losses, val_loss, all_mem, elapsed, tokens_per_step, out, config, num_params
) -> None:
    mib = 1 << 20
    print("\n=== ShardSpeed demo summary ===")
    print(
        f"model: GPT {config.n_layer} layers x {config.n_embd} wide, ZeRO stage {args.zero}, {len(all_mem)} ranks"
    )
    print(f"loss: first {losses[0]:.3f} -> last {losses[-1]:.3f} (val {val_loss:.3f})")
    print(f"loss curve: {sparkline(losses)}")
    print(
        f"time: {elapsed:.1f}s for {len(losses)} steps ({tokens_per_step * len(losses) / elapsed:,.0f} tokens/s)"
    )
    print(
        "memory per rank (MiB): "
        + ", ".join(
            f"rank{r}: model-states {(m['total'] - m['buffers']) / mib:.2f} "
            f"(params {m['params'] / mib:.2f}, grads {m['grads'] / mib:.2f}, master {m['master_params'] / mib:.2f}, "
            f"optim {m['optimizer_state'] / mib:.2f}), rss {m['rss'] / mib:.0f}"
            for r, m in enumerate(all_mem)
        )
    )
    keys = ("params", "grads", "master_params", "optimizer_state")
    # stage 0 with Adam holds, per rank: params + grads (param dtype), fp32 master if mixed, 2 fp32 moments
    elt = 2 if args.bf16 else 4
    stage0 = num_params * (2 * elt + (4 if elt == 2 else 0) + 8)
    mine = sum(all_mem[0][k] for k in keys)
    host = all_mem[0].get("host", 0)  # offloaded: host memory (swap buffers included)
    on_device = mine + all_mem[0].get("swap_buffers", 0) - host
    if args.zero > 0:
        where = " on the device" if host else ""
        print(
            f"ZeRO-{args.zero} model states per rank{where}: {on_device / mib:.2f} MiB vs "
            f"{stage0 / mib:.2f} MiB at stage 0 ({100 * (1 - on_device / stage0):.0f}% less)"
        )
        if host or all_mem[0].get("nvme", 0):
            print(
                f"offloaded per rank: {host / mib:.2f} MiB in host memory, "
                f"{all_mem[0].get('nvme', 0) / mib:.2f} MiB in NVMe swap files"
            )
    summary = {
        "losses": losses,
        "val_loss": val_loss,
        "elapsed_s": elapsed,
        "memory": all_mem,
        "zero": args.zero,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"weights + summary: {out}/")


def generate_samples(out: Path, tokenizer) -> None:
    prompts = ["def ", "import os\n", "class "]
    try:
        from shardspeed.inference import pipeline
    except ImportError:
        pipeline = None
    print("\n=== samples ===")
    if pipeline is not None:
        pipe = pipeline(str(out))
        for i, prompt in enumerate(prompts):
            # up to 120 new tokens, stopping at the model's 128-token context (explicit opt-in)
            (r,) = pipe(
                [prompt], max_new_tokens=120, temperature=0.7, top_k=40, seed=i, truncate=True
            )
            print(
                f"--- {prompt!r} ({r.generated_length} tokens, {r.latency * 1e3:.0f} ms)\n{prompt}{r.generated_text}"
            )
        pipe.shutdown()
        return
    from shardspeed.models import GPT

    model = GPT.from_pretrained(out).eval()
    torch.manual_seed(0)
    for prompt in prompts:
        ids = torch.tensor([tokenizer.encode(prompt)])
        text = tokenizer.decode(model.generate(ids, 80, temperature=0.8, top_k=40)[0].tolist())
        print(f"--- {prompt!r}\n{text}")


def main() -> int:
    args = parse_args()
    if "RANK" not in os.environ and args.nproc > 1:
        return relaunch(args)
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
