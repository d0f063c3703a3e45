"""A small decoder-only GPT (pre-norm, learned positions, tied embedding/head).

This is the model the demo trains and the inference engine serves. It is plain
PyTorch so that every parallel feature can be checked against it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    """Shape of the demo GPT."""

    vocab_size: int = 256
    block_size: int = 128  # maximum sequence length
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True

    def to_dict(self) -> dict:
        return asdict(self)


class LayerKV:
    """One layer's key/value cache for incremental decoding, preallocated to ``capacity``."""

    def __init__(self, batch: int, n_head: int, head_size: int, capacity: int, like: torch.Tensor):
        shape = (batch, n_head, capacity, head_size)  # (B, nh, capacity, hs)
        self.k = torch.empty(shape, dtype=like.dtype, device=like.device)
        self.v = torch.empty(shape, dtype=like.dtype, device=like.device)
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``(B, nh, T, hs)`` new keys/values; return every cached one so far."""
        end = self.length + k.size(2)
        self.k[:, :, self.length : end] = k
        self.v[:, :, self.length : end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]  # (B, nh, end, hs) each


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.n_embd % config.n_head != 0:
            raise ValueError(
                f"GPTConfig.n_embd={config.n_embd} must be divisible by n_head={config.n_head}"
            )
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, cache: LayerKV | None = None) -> torch.Tensor:
        B, T, C = x.shape  # (B, T, C)
        q, k, v = self.c_attn(x).split(C, dim=2)  # each (B, T, C)
        hs = C // self.n_head
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        p = self.dropout if self.training else 0.0
        if cache is None or cache.length == 0:
            if cache is not None:
                cache.append(k, v)
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:  # the new tokens attend to every cached position and causally to each other
            past = cache.length
            k, v = cache.append(k, v)  # (B, nh, past + T, hs) each
            mask = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(past)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, nh, T, hs) -> (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cache: LayerKV | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer. ``forward(idx, targets=None) -> (logits, loss)``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        cache: list[LayerKV] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``(B, T, V)`` and the loss when ``targets`` is given. With ``cache``
        (from :meth:`new_cache`) ``idx`` continues the cached sequence."""
        B, T = idx.shape  # (B, T)
        start = cache[0].length if cache else 0
        if start + T > self.config.block_size:
            raise ValueError(
                f"sequence length {start + T} exceeds GPTConfig.block_size={self.config.block_size}"
            )
        pos = torch.arange(start, start + T, device=idx.device)  # (T,)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for i, block in enumerate(self.h):
            x = block(x, cache[i] if cache else None)
        x = self.ln_f(x)
        logits = self.lm_head(x)  # (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
        return logits, loss

    def new_cache(self, batch: int, capacity: int | None = None) -> list[LayerKV]:
        """An empty per-layer KV cache for ``batch`` sequences of up to ``capacity`` tokens."""
        c = self.config
        like = self.lm_head.weight
        size = capacity or c.block_size
        return [LayerKV(batch, c.n_head, c.n_embd // c.n_head, size, like) for _ in self.h]

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        use_cache: bool = True,
    ) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled tokens (greedy at ``temperature <= 0``).

        Decodes incrementally with a KV cache while the whole sequence fits in
        ``block_size``; past that it recomputes the last ``block_size`` tokens every step.
        """
        if use_cache and idx.size(1) + max_new_tokens <= self.config.block_size:
            cache = self.new_cache(idx.size(0), idx.size(1) + max_new_tokens)
            logits, _ = self(idx, cache=cache)  # prefill: (B, T, V)
            for step in range(max_new_tokens):
                nxt = _pick_next(logits[:, -1, :].float(), temperature, top_k)  # (B, 1)
                idx = torch.cat((idx, nxt), dim=1)
                if step + 1 < max_new_tokens:
                    logits, _ = self(nxt, cache=cache)  # (B, 1, V)
            return idx
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.block_size :])
            idx = torch.cat((idx, _pick_next(logits[:, -1, :].float(), temperature, top_k)), dim=1)
        return idx

    def save_pretrained(self, directory: str | Path) -> None:
        """Write ``config.json`` and ``model.safetensors`` (tied weight stored once)."""
        from safetensors.torch import save_file

        from shardspeed.utils.io import atomic_write_text

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        state.pop("lm_head.weight", None)
        tmp = directory / "model.safetensors.tmp"
        save_file(state, str(tmp))
        tmp.replace(directory / "model.safetensors")
        cfg = {"model_type": "shardspeed_gpt", **self.config.to_dict()}
        atomic_write_text(directory / "config.json", json.dumps(cfg, indent=2))

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> GPT:
        from safetensors.torch import load_file

        directory = Path(directory)
        cfg = json.loads((directory / "config.json").read_text())
        cfg.pop("model_type", None)
        model = cls(GPTConfig(**cfg))
        state = load_file(str(directory / "model.safetensors"))
        state["lm_head.weight"] = state["wte.weight"]
        model.load_state_dict(state, strict=True)
        return model


def _pick_next(logits: torch.Tensor, temperature: float, top_k: int | None) -> torch.Tensor:
    """Next token ids ``(B, 1)`` from last-position logits ``(B, V)``."""
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        logits[logits < v[:, [-1]]] = -float("inf")
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
