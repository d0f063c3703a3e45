"""Peak dense bf16 throughput of known accelerators, for model FLOP utilisation (MFU).

MFU = achieved FLOP/s / peak FLOP/s. The peaks are the vendors' dense (no 2:4 sparsity)
BF16 tensor-core numbers; the first table entry whose key is a substring of
``torch.cuda.get_device_name()`` wins, so specific variants come before generic names.
"""

from __future__ import annotations

import torch

# (substring of the device name, peak dense bf16 FLOP/s)
PEAK_BF16_FLOPS: list[tuple[str, float]] = [
    ("H200", 989.4e12),
    ("H100 NVL", 835.0e12),
    ("H100 PCIe", 756.0e12),
    ("H100", 989.4e12),  # SXM / HBM3
    ("A100", 312.0e12),
]


def peak_bf16_flops(device_name: str | None = None) -> float | None:
    """Peak dense bf16 FLOP/s of ``device_name`` (default: the current CUDA device)."""
    if device_name is None:
        if not torch.cuda.is_available():
            return None
        device_name = torch.cuda.get_device_name()
    for key, peak in PEAK_BF16_FLOPS:
        if key in device_name:
            return peak
    return None


def device_description() -> str:
    """Human-readable name of the device the profile ran on."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return "cpu"


def mfu(achieved_flops_per_s: float, device_name: str | None = None) -> float | None:
    """Model FLOP utilisation in [0, 1] on a known GPU, else None."""
    peak = peak_bf16_flops(device_name)
    if peak is None or achieved_flops_per_s <= 0:
        return None
    return achieved_flops_per_s / peak
