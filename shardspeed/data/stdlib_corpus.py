"""A byte-level text corpus built from the Python standard library's source files.

Every machine with Python has it, so the demo trains on real text without a download.
The file list is sorted, so the corpus is identical on every rank and every run.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset


def load_stdlib_corpus(max_bytes: int = 4_000_000) -> torch.Tensor:
    """Concatenated ``.py`` sources of the stdlib as a uint8 tensor of at most ``max_bytes``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p for p in root.rglob("*.py") if "test" not in p.parts and "site-packages" not in p.parts
    )
    chunks: list[bytes] = []
    total = 0
    for path in files:
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total == 0:
        raise RuntimeError(f"no Python sources found under the stdlib path {root}")
    blob = b"\n".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).clone()


class TokenWindows(Dataset):
    """Fixed windows of ``block_size + 1`` tokens; item = (input, target) shifted by one."""

    def __init__(self, tokens: torch.Tensor, block_size: int, stride: int | None = None) -> None:
        if tokens.numel() <= block_size + 1:
            raise ValueError(
                f"corpus of {tokens.numel()} tokens is too short for block_size={block_size}"
            )
        self.tokens = tokens.long()
        self.block_size = block_size
        self.stride = stride or block_size
        self.count = (self.tokens.numel() - block_size - 1) // self.stride + 1

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.stride
        window = self.tokens[start : start + self.block_size + 1]
        return window[:-1], window[1:]
