"""DeepSpeed's ``deepspeed.git_version_info``: version, git hash and the op table that
``ds_report``-style tools read. No ops are prebuilt: the one native op (CPU Adam) is
JIT-built on first use, so ``installed_ops`` is all False, as in a DeepSpeed install
without ``DS_BUILD_OPS``."""

from __future__ import annotations

import torch

from shardspeed import __git_hash__, __version__

version = __version__
git_hash = __git_hash__
git_branch = "unknown"
installed_ops = {"cpu_adam": False}
compatible_ops = {"cpu_adam": True}
accelerator_name = "cuda" if torch.cuda.is_available() else "cpu"
torch_info = {
    "version": ".".join(torch.__version__.split("+")[0].split(".")[:2]),
    "cuda_version": torch.version.cuda or "0.0",
    "nccl_version": "0.0",
    "hip_version": "0.0",
}

__all__ = [
    "accelerator_name",
    "compatible_ops",
    "git_branch",
    "git_hash",
    "installed_ops",
    "torch_info",
    "version",
]
