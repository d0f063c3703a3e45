"""DeepSpeed's CIFAR-10 tutorial, written the way the tutorial uses the API (with and without MoE).

    shardspeed --nproc 2 examples/deepspeed_tutorials/cifar10_deepspeed.py --deepspeed
    shardspeed --nproc 2 examples/deepspeed_tutorials/cifar10_deepspeed.py --deepspeed \
        --moe --ep-world-size 2 --num-experts 2 4 --top-k 1 --moe-param-group

The script imports ``deepspeed``: with the compatibility distribution (``make compat``) or
real DeepSpeed installed that is what runs; otherwise it falls back to
``import shardspeed as deepspeed`` - the one-line change of a migration. The only departure
from the tutorial is the data: CIFAR-10 needs torchvision and a download, so the default
``--data synthetic`` draws a fixed random image set with a learnable rule (the label is
the brightest of ten image regions); ``--data cifar10`` uses torchvision when installed.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    import deepspeed
except ImportError:  # no DeepSpeed (or compat distribution) installed: the drop-in
    import shardspeed as deepspeed


def add_argument() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    parser.add_argument("-e", "--epochs", default=1, type=int, help="passes over the data")
    parser.add_argument("--log-interval", type=int, default=50, help="steps between logs")
    parser.add_argument("--moe", default=False, action="store_true", help="use MoE layers")
    parser.add_argument("--ep-world-size", default=1, type=int, help="expert-parallel size")
    parser.add_argument(
        "--num-experts", type=int, nargs="+", default=[1], help="experts of each MoE layer"
    )
    parser.add_argument("--mlp-type", type=str, default="standard", help="standard or residual")
    parser.add_argument("--top-k", default=1, type=int, help="experts per token (1 or 2)")
    parser.add_argument("--min-capacity", default=0, type=int)
    parser.add_argument("--noisy-gate-policy", default=None, type=str, help="None, RSample, Jitter")
    parser.add_argument(
        "--moe-param-group", default=False, action="store_true", help="MoE param groups"
    )
    parser.add_argument("--dtype", default="fp32", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--stage", default=0, type=int, choices=[0, 1, 2, 3], help="ZeRO stage")
    # the departure from the tutorial: where the images come from, how many steps
    parser.add_argument("--data", default="synthetic", choices=["synthetic", "cifar10"])
    parser.add_argument("--num-samples", default=2048, type=int, help="synthetic images")
    parser.add_argument("--max-steps", default=0, type=int, help="stop after N steps (0: all)")
    parser.add_argument("--dump-losses", default=None, help="write rank 0's losses here (JSON)")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class SyntheticCifar(torch.utils.data.Dataset):
    """Fixed random 3x32x32 images; the label is the brightest of ten horizontal bands."""

    def __init__(self, num_samples: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.images = torch.randn(num_samples, 3, 32, 32, generator=g)  # (N, 3, 32, 32)
        bands = self.images[:, :, :30].reshape(num_samples, 3, 10, 3, 32)  # (N, 3, 10, 3, 32)
        self.labels = bands.mean(dim=(1, 3, 4)).argmax(dim=1)  # (N,)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i], self.labels[i]


def training_set(args: argparse.Namespace) -> torch.utils.data.Dataset:
    if args.data == "synthetic":
        return SyntheticCifar(args.num_samples)
    import torchvision
    import torchvision.transforms as transforms

    transform = transforms.Compose(
        [transforms.ToTensor(), transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))]
    )
    return torchvision.datasets.CIFAR10(
        root="./data", train=True, download=True, transform=transform
    )


class Net(nn.Module):
    """The tutorial's LeNet-style network; with ``--moe`` the last hidden layer is MoE."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.moe = args.moe
        if self.moe:
            fc3 = nn.Linear(84, 84)
            self.moe_layer_list = nn.ModuleList(
                deepspeed.moe.layer.MoE(
                    hidden_size=84,
                    expert=fc3,
                    num_experts=n_e,
                    ep_size=args.ep_world_size,
                    use_residual=args.mlp_type == "residual",
                    k=args.top_k,
                    min_capacity=args.min_capacity,
                    noisy_gate_policy=args.noisy_gate_policy,
                )
                for n_e in args.num_experts
            )
            self.fc4 = nn.Linear(84, 10)
        else:
            self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))  # (B, 6, 14, 14)
        x = self.pool(F.relu(self.conv2(x)))  # (B, 16, 5, 5)
        x = x.view(-1, 16 * 5 * 5)  # (B, 400)
        x = F.relu(self.fc1(x))  # (B, 120)
        x = F.relu(self.fc2(x))  # (B, 84)
        if self.moe:
            for layer in self.moe_layer_list:
                x, _, _ = layer(x)
            return self.fc4(x)  # (B, 10)
        return self.fc3(x)  # (B, 10)


def create_moe_param_groups(model: nn.Module) -> list[dict]:
    """The tutorial's optimizer groups: expert parameters split into their own groups."""
    # the tutorial writes `from deepspeed.moe.utils import ...`; the attribute path works for
    # the `import shardspeed as deepspeed` fallback too
    split = deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer
    parameters = {"params": [p for p in model.parameters()], "name": "parameters"}
    return split(parameters)


def get_ds_config(args: argparse.Namespace) -> dict:
    """The tutorial's ds_config (legacy keys such as ``cpu_offload`` included)."""
    return {
        "train_batch_size": 16,
        "steps_per_print": 2000,
        "optimizer": {
            "type": "Adam",
            "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000},
        },
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "bf16": {"enabled": args.dtype == "bf16"},
        "fp16": {
            "enabled": args.dtype == "fp16",
            "fp16_master_weights_and_grads": False,
            "loss_scale": 0,
            "loss_scale_window": 500,
            "hysteresis": 2,
            "min_loss_scale": 1,
            "initial_scale_power": 15,
        },
        "wall_clock_breakdown": False,
        "zero_optimization": {
            "stage": args.stage,
            "allgather_partitions": True,
            "reduce_scatter": True,
            "allgather_bucket_size": 50000000,
            "reduce_bucket_size": 50000000,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "cpu_offload": False,
        },
    }


def main() -> None:
    args = add_argument()
    deepspeed.init_distributed()
    torch.manual_seed(1234)  # the same initial weights on every rank (and in every library)
    net = Net(args)
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    if args.moe_param_group:
        parameters = create_moe_param_groups(net)
    ds_config = None if args.deepspeed_config else get_ds_config(args)
    model_engine, optimizer, trainloader, __ = deepspeed.initialize(
        args=args,
        model=net,
        model_parameters=parameters,
        training_data=training_set(args),
        config=ds_config,
    )
    local_device = deepspeed.accelerator.get_accelerator().device_name(model_engine.local_rank)
    target_dtype = {"bf16": torch.bfloat16, "fp16": torch.half}.get(args.dtype)
    criterion = nn.CrossEntropyLoss()
    losses: list[float] = []
    for epoch in range(args.epochs):
        running_loss = 0.0
        for i, data in enumerate(trainloader):
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            losses.append(loss.item())
            running_loss += loss.item()
            if model_engine.local_rank == 0 and i % args.log_interval == args.log_interval - 1:
                print(f"[{epoch + 1: d}, {i + 1: 5d}] loss: {running_loss / args.log_interval:.3f}")
                running_loss = 0.0
            if args.max_steps and len(losses) >= args.max_steps:
                break
    if args.dump_losses and model_engine.global_rank == 0:
        with open(args.dump_losses, "w") as f:
            json.dump(losses, f)
    print(
        f"rank {model_engine.global_rank}: finished {len(losses)} steps, last loss {losses[-1]:.4f}"
    )


if __name__ == "__main__":
    main()
