"""Checkpoint save/load time: shardspeed vs DeepSpeed on the same GPT and ds_config.

Each engine runs in its own ``torch.distributed.run`` launch (2 ranks, gloo on CPU, fp32,
ZeRO stage 2, AdamW). The worker trains one step so the optimizer state exists, then times
``--repeats`` saves (each to a new tag; the previous tag is deleted once measured) and
``--repeats`` loads of the last tag. Every timing is wall time on rank 0 between two
barriers, so it covers the slowest rank. Loads read files that were just written, i.e.
mostly from the page cache, for both engines alike.

    python benchmarks/checkpoint_bench.py --markdown
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench_common import (  # noqa: E402
    REPO_ROOT,
    child_env,
    default_python,
    emit_result,
    machine_description,
    peers_python,
    ratio,
    render_table,
    run_child,
)

# "shardspeed-async": save_checkpoint(async_save=True); its save time is how long the call
# blocks the training loop (snapshot to host memory), the write and commit continue in the
# background and are awaited (untimed) before the next save.
# "shardspeed-nofsync": checkpoint.fsync false (as durable as the page cache, like DeepSpeed's
# torch.save files).
ENGINES = ("shardspeed", "shardspeed-async", "shardspeed-nofsync", "deepspeed")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", default=",".join(ENGINES), help="comma-separated engines")
    p.add_argument("--n-layer", type=int, default=16, help="GPT layers (16 x 736 = 104M)")
    p.add_argument("--n-embd", type=int, default=736, help="GPT width")
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3, help="saves and loads timed per engine")
    p.add_argument("--nproc", type=int, default=2, help="ranks per launch")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each rank")
    p.add_argument("--dir", type=Path, default=None, help="scratch dir (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per launch")
    p.add_argument("--log-dir", type=Path, default=REPO_ROOT / "runs" / "checkpoint_bench")
    p.add_argument("--markdown", action="store_true", help="print the table as markdown")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--engine", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- worker


def _config() -> dict[str, Any]:
    params = {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {**params, "torch_adam": True}},
        "zero_optimization": {"stage": 2},
    }


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from shardspeed.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(
        GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, block_size=16)
    )
    n_params = sum(p.numel() for p in model.parameters())
    config = _config()
    if args.engine == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        engine, *_ = deepspeed.initialize(model=model, config=config)
        version = deepspeed.__version__
    else:
        import shardspeed

        config["optimizer"]["params"].pop("torch_adam")
        if args.engine == "shardspeed-nofsync":
            config["checkpoint"] = {"fsync": False}
        engine, *_ = shardspeed.initialize(model=model, config=config)
        version = "local"
    async_save = args.engine == "shardspeed-async"
    rank = dist.get_rank()
    tokens = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(rank))
    _, loss = engine(tokens[:, :-1], tokens[:, 1:])
    engine.backward(loss)
    engine.step()

    root = Path(args.dir)

    def timed(fn: Any) -> float:
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - start

    def save(tag: str) -> None:
        if async_save:
            engine.save_checkpoint(str(root), tag=tag, async_save=True)
        else:
            engine.save_checkpoint(str(root), tag=tag)

    saves, written, published = [], [], []
    for i in range(args.repeats):
        tag = f"bench{i}"
        saves.append(timed(lambda tag=tag: save(tag)))
        if async_save:  # until the tag is published (not part of the blocking time)
            start = time.perf_counter()
            engine.wait_checkpoint()
            dist.barrier()
            published.append(saves[-1] + time.perf_counter() - start)
        if rank == 0:
            written.append(_dir_bytes(root / tag))
            if i > 0:
                shutil.rmtree(root / f"bench{i - 1}")
        dist.barrier()
    last = f"bench{args.repeats - 1}"
    loads = [
        timed(lambda: engine.load_checkpoint(str(root), tag=last)) for _ in range(args.repeats)
    ]
    if rank == 0:
        emit_result(
            {
                "engine": args.engine,
                "version": version,
                "params": n_params,
                "save_s": saves,
                "published_s": published,
                "load_s": loads,
                "bytes_written": written[-1],
            }
        )


# ----------------------------------------------------------------------------- parent


def launch(args: argparse.Namespace, engine: str, python: str, scratch: Path) -> dict[str, Any]:
    ckpt = scratch / engine
    cmd = [python, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={args.nproc}", str(Path(__file__).resolve()), "--worker"]
    cmd += ["--engine", engine, "--dir", str(ckpt), "--repeats", str(args.repeats)]
    cmd += ["--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd)]
    cmd += ["--n-head", str(args.n_head)]
    env = child_env(threads=args.threads, device="cpu")
    code, results, tail = run_child(cmd, env, args.timeout, args.log_dir / f"{engine}.log")
    shutil.rmtree(ckpt, ignore_errors=True)
    if code != 0 or not results:
        print(f"{engine}: FAILED (exit {code})\n{tail}")
        return {"engine": engine, "error": f"exit {code}"}
    return results[0]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    peers = peers_python()
    scratch = args.dir or Path(tempfile.mkdtemp(prefix="ckpt_bench_"))
    results = {}
    for engine in engines:
        if engine == "deepspeed" and peers is None:
            print("deepspeed: .venv-peers missing (run `make bench-peers`); skipped")
            continue
        if engine not in ENGINES:
            raise SystemExit(f"--engines: unknown {engine!r}; choose from {','.join(ENGINES)}")
        python = str(peers) if engine == "deepspeed" else default_python()
        print(f"running {engine} ...", flush=True)
        results[engine] = launch(args, engine, python, scratch)
    if args.dir is None:
        shutil.rmtree(scratch, ignore_errors=True)

    base = results.get("shardspeed", {})
    rows = []
    for engine, res in results.items():
        if "error" in res:
            rows.append([engine, "-", "-", "-", "-", "-", "-", res["error"]])
            continue
        save, load = statistics.median(res["save_s"]), statistics.median(res["load_s"])
        rows.append(
            [
                f"{engine} ({res['version']})",
                f"{res['params'] / 1e6:.1f}M",
                save,
                load,
                f"{res['bytes_written'] / 2**20:.0f}",
                ratio(save, statistics.median(base["save_s"])) if "save_s" in base else None,
                ratio(load, statistics.median(base["load_s"])) if "load_s" in base else None,
                " / ".join(f"{s:.2f}" for s in res["save_s"] + res["load_s"])
                + (
                    f" (published after {' / '.join(f'{s:.2f}' for s in res['published_s'])})"
                    if res.get("published_s")
                    else ""
                ),
            ]
        )
    headers = [
        "engine",
        "params",
        "save s (median)",
        "load s (median)",
        "MiB written",
        "save vs shardspeed",
        "load vs shardspeed",
        "all saves / loads (s)",
    ]
    print(
        json.dumps(
            {
                "date": _dt.date.today().isoformat(),
                "machine": machine_description(),
                "loadavg": list(os.getloadavg()),
                "command": " ".join([os.path.relpath(sys.executable, REPO_ROOT), *sys.argv]),
            }
        )
    )
    print(render_table(headers, rows, args.markdown))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
