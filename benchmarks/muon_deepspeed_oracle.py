"""ShardSpeed's Muon against DeepSpeed 0.19.8's ``SingleDeviceMuonWithAuxAdam`` (fp32).

    .venv-peers/bin/python benchmarks/muon_deepspeed_oracle.py

Three matrices (tall, wide, square) with Muon and one vector with the auxiliary AdamW,
weight decay 0.1, 5 steps of random gradients, both ``ns_method`` values. DeepSpeed picks
its Newton-Schulz dtype from the accelerator (bf16 for ``standard`` on this CPU); both run
fp32 here so the comparison is of the algorithm. Prints the largest difference relative to
the largest parameter. Result: docs/muon.md.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = [(24, 8), (8, 24), (16, 16), (24,)]


def main() -> None:
    from deepspeed.runtime.zero.muon import original_muon

    from shardspeed.ops.muon import Muon

    native = (original_muon.ns_compute_dtype("standard"), original_muon.ns_compute_dtype("gram"))
    print(f"DeepSpeed's Newton-Schulz dtypes here (standard, gram): {native}; compared in fp32")
    original_muon.ns_compute_dtype = lambda method="gram": torch.float32
    torch.manual_seed(0)
    init = [torch.randn(*s) * 0.1 for s in SHAPES]
    for method in ("standard", "gram"):
        theirs, ours = [t.clone() for t in init], [t.clone() for t in init]
        reference = original_muon.SingleDeviceMuonWithAuxAdam(
            [
                dict(params=theirs[:3], use_muon=True, lr=0.02, momentum=0.95, weight_decay=0.1, ns_method=method),
                dict(params=theirs[3:], use_muon=False, lr=1e-2, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.1),
            ]
        )  # fmt: skip
        muon = Muon(
            [{"params": ours[:3], "use_muon": True}, {"params": ours[3:], "use_muon": False}],
            muon_lr=0.02,
            adam_lr=1e-2,
            weight_decay=0.1,
            ns_method=method,
        )
        g = torch.Generator().manual_seed(1)
        for _ in range(5):
            for a, b, s in zip(theirs, ours, SHAPES):
                a.grad = torch.randn(*s, generator=g)
                b.grad = a.grad.clone()
            reference.step()
            muon.step()
        diff = max(float((a - b).abs().max() / a.abs().max()) for a, b in zip(theirs, ours))
        print(f"{method:8s} max |ours - DeepSpeed| / max |p| after 5 steps: {diff:.2e}")


if __name__ == "__main__":
    main()
