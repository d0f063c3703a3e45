"""DeepSpeed's pipeline-parallelism tutorial (AlexNet on CIFAR-10), written as the tutorial does.

    shardspeed --nproc 2 examples/deepspeed_tutorials/pipeline_alexnet.py \
        --deepspeed_config examples/deepspeed_tutorials/ds_config_pipeline.json -s 20

The AlexNet layers are flattened into a list (``join_layers``: features, pooling, a
flatten lambda, classifier) and handed to ``PipelineModule`` with
``partition_method='parameters'``; ``engine.train_batch()`` runs one whole batch through
the pipeline schedule. ``--pipeline-parallel-size 0`` trains the same network without a
pipeline (the tutorial's ``train_base``).

Departures from the tutorial, for a machine without torchvision or downloads: AlexNet is
defined here with torchvision's layer structure sized for 32x32 inputs (``--width``
scales it), and the default ``--data synthetic`` is a fixed random image set with a
learnable label rule; ``--data cifar10`` uses torchvision when installed.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn as nn

try:
    import deepspeed
except ImportError:  # no DeepSpeed (or compat distribution) installed: the drop-in
    import shardspeed as deepspeed


class AlexNet(nn.Module):
    """torchvision's AlexNet structure (features / avgpool / classifier), for 32x32 images."""

    def __init__(self, num_classes: int = 10, width: int = 64) -> None:
        super().__init__()
        w = width
        self.features = nn.Sequential(
            nn.Conv2d(3, w, kernel_size=3, stride=2, padding=1),  # (B, w, 16, 16)
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=2),  # (B, w, 8, 8)
            nn.Conv2d(w, 3 * w, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=2),  # (B, 3w, 4, 4)
            nn.Conv2d(3 * w, 6 * w, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(6 * w, 4 * w, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(4 * w, 4 * w, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=2),  # (B, 4w, 2, 2)
        )
        self.avgpool = nn.AdaptiveAvgPool2d((2, 2))
        self.classifier = nn.Sequential(
            nn.Dropout(),
            nn.Linear(4 * w * 2 * 2, 16 * w),
            nn.ReLU(inplace=True),
            nn.Dropout(),
            nn.Linear(16 * w, 16 * w),
            nn.ReLU(inplace=True),
            nn.Linear(16 * w, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


def cifar_trainset(args: argparse.Namespace) -> torch.utils.data.Dataset:
    if args.data == "cifar10":
        import torchvision
        import torchvision.transforms as transforms

        transform = transforms.Compose(
            [transforms.ToTensor(), transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))]
        )
        return torchvision.datasets.CIFAR10(
            root="/tmp/cifar10-data", train=True, download=True, transform=transform
        )
    g = torch.Generator().manual_seed(0)
    images = torch.randn(args.num_samples, 3, 32, 32, generator=g)  # (N, 3, 32, 32)
    labels = images[:, 0, :, :30].reshape(args.num_samples, 10, 96).mean(-1).argmax(-1)  # (N,)
    return torch.utils.data.TensorDataset(images, labels)


def get_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    parser.add_argument("-s", "--steps", type=int, default=100, help="batches to train")
    parser.add_argument("--pipeline-parallel-size", type=int, default=2, help="pipeline stages")
    parser.add_argument("--backend", type=str, default=None, help="nccl or gloo (default: auto)")
    parser.add_argument("--seed", type=int, default=1138, help="PRNG seed")
    parser.add_argument("--data", default="synthetic", choices=["synthetic", "cifar10"])
    parser.add_argument("--num-samples", type=int, default=4096, help="synthetic images")
    parser.add_argument("--width", type=int, default=16, help="AlexNet channel width")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def join_layers(vision_model: AlexNet) -> list:
    """The network as one flat list of layers (what PipelineModule partitions)."""
    return [
        *vision_model.features,
        vision_model.avgpool,
        lambda x: torch.flatten(x, 1),
        *vision_model.classifier,
    ]


def train_base(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    net = AlexNet(num_classes=10, width=args.width)
    engine, _, dataloader, __ = deepspeed.initialize(
        args=args,
        model=net,
        model_parameters=[p for p in net.parameters() if p.requires_grad],
        training_data=cifar_trainset(args),
    )
    data_iter = iter(deepspeed.utils.RepeatingLoader(dataloader))
    criterion = nn.CrossEntropyLoss()
    for step in range(args.steps):
        inputs, labels = next(data_iter)
        loss = criterion(engine(inputs), labels)
        engine.backward(loss)
        engine.step()
        if engine.global_rank == 0 and (step + 1) % 10 == 0:
            print(f"step {step + 1}: loss {loss.item():.4f}")


def train_pipe(args: argparse.Namespace, part: str = "parameters") -> None:
    torch.manual_seed(args.seed)
    deepspeed.runtime.utils.set_random_seed(args.seed)
    net = AlexNet(num_classes=10, width=args.width)
    net = deepspeed.pipe.PipelineModule(
        layers=join_layers(net),
        loss_fn=torch.nn.CrossEntropyLoss(),
        num_stages=args.pipeline_parallel_size,
        partition_method=part,
        activation_checkpoint_interval=0,
    )
    engine, _, _, _ = deepspeed.initialize(
        args=args,
        model=net,
        model_parameters=[p for p in net.parameters() if p.requires_grad],
        training_data=cifar_trainset(args),
    )
    for _ in range(args.steps):
        engine.train_batch()


if __name__ == "__main__":
    args = get_args()
    deepspeed.init_distributed(dist_backend=args.backend)
    args.local_rank = int(os.environ["LOCAL_RANK"])
    deepspeed.accelerator.get_accelerator().set_device(args.local_rank)
    if args.pipeline_parallel_size == 0:
        train_base(args)
    else:
        train_pipe(args)
