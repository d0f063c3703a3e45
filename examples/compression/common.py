"""What the compression recipes share: the demo GPT (teacher), its corpus split, batches,
held-out perplexity and the size of a compressed model.

The teacher is ``make demo``'s GPT (``runs/demo``: byte-level, 4 layers x 128, trained on
the Python standard library's sources); the held-out split is the last 5% of the corpus,
the one ``benchmarks/quant_quality.py`` scores (docs/benchmarks.md).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from shardspeed.data import load_stdlib_corpus  # noqa: E402
from shardspeed.models import GPT  # noqa: E402

DEFAULT_TEACHER = REPO_ROOT / "runs" / "demo"


def load_teacher(path: str | Path = DEFAULT_TEACHER) -> GPT:
    """The trained demo GPT in fp32 eval mode (run ``make demo`` first)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise SystemExit(
            f"no GPT checkpoint at {path}: run `make demo` (writes runs/demo) or pass --teacher"
        )
    return GPT.from_pretrained(path).float().eval()


def corpus_split() -> tuple[torch.Tensor, torch.Tensor]:
    """(train tokens, held-out tokens): the demo's 95% / 5% split of the stdlib corpus."""
    tokens = load_stdlib_corpus().long()
    split = int(tokens.numel() * 0.95)
    return tokens[:split], tokens[split:]


def batches(tokens: torch.Tensor, block: int, batch: int, seed: int):
    """Endless random ``(x, y)`` windows ``(batch, block)`` of ``tokens``."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, tokens.numel() - block - 1, (batch,), generator=gen)
        window = torch.stack([tokens[s : s + block + 1] for s in starts.tolist()])  # (B, T+1)
        yield window[:, :-1], window[:, 1:]


@torch.no_grad()
def perplexity(model: nn.Module, tokens: torch.Tensor, block: int, num_tokens: int) -> float:
    """exp(mean next-token NLL) over non-overlapping ``block`` windows of the first
    ``num_tokens + 1`` held-out tokens (quant_quality.py's scoring)."""
    model.eval()
    tokens = tokens[: num_tokens + 1]
    num_windows = (tokens.numel() - 1) // block
    x = tokens[: num_windows * block].view(num_windows, block)  # (W, T)
    y = tokens[1 : num_windows * block + 1].view(num_windows, block)  # (W, T)
    nll = 0.0
    for i in range(0, num_windows, 16):
        logits, _ = model(x[i : i + 16])  # (w, T, V)
        flat = logits.float().reshape(-1, logits.size(-1))
        nll += F.cross_entropy(flat, y[i : i + 16].reshape(-1), reduction="sum").item()
    return math.exp(nll / y.numel())


def model_bytes(model: nn.Module, weight_bits: dict[str, int], group_size: int | None) -> int:
    """Bytes of ``model`` stored compactly: the weights named in ``weight_bits`` at that many
    bits plus one fp16 scale per row and ``group_size`` columns (None: per row); every other
    tensor (embeddings, norms, biases) in fp32. A tied tensor counts once."""
    total, seen = 0, set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            continue
        seen.add(id(param))
        module_name = name.rpartition(".")[0]
        if name.endswith(".weight") and module_name in weight_bits:
            rows, cols = param.shape
            groups = rows * (1 if group_size is None else cols // group_size)
            total += math.ceil(param.numel() * weight_bits[module_name] / 8) + 2 * groups
        else:
            total += param.numel() * 4
    return total


def linear_names(model: nn.Module) -> list[str]:
    """The transformer blocks' linears (``h.<i>.attn.c_attn``, ...): what the recipes
    compress; embeddings, norms and the tied output head stay in full precision."""
    return [n for n, m in model.named_modules() if n.startswith("h.") and isinstance(m, nn.Linear)]
