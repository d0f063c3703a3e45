"""Rotary position embeddings with HF's scaling types.

Supported ``rope_type`` values (numerics follow transformers'
``ROPE_INIT_FUNCTIONS``): ``default``, ``linear``, ``llama3``, ``yarn``,
``longrope`` and ``dynamic`` (NTK). ``partial_rotary_factor`` < 1 rotates only
the first ``int(head_dim * factor)`` dims of each head.

``dynamic`` and ``longrope`` change the frequencies with the sequence length.
HF picks them per forward call from ``max(position_ids) + 1``: the whole prompt's
length for every prompt token, then each generated token's own length. Here each
token carries that length (``RaggedBatch.rope_lens``, :func:`forward_seq_lens`),
so chunked prompts and recomputed sequences are rotated as HF's ``generate`` rotates
them (already-cached keys keep the rotation they were written with, as in HF). For
longrope, HF's Phi-3 drops its cache and recomputes once a sequence reaches
``original_max_position_embeddings + 1`` tokens; the model exposes that length
(``rope_recompute_len``) and the scheduler does the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from shardspeed.inference.fastgen import cpu_fused

if TYPE_CHECKING:
    from shardspeed.inference.fastgen.ragged import RaggedBatch

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")
_REQUIRED = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "yarn": (),
    "longrope": ("long_factor", "short_factor"),
}
# keys each rope type reads (anything else in rope_parameters is rejected)
_KNOWN_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {
        "factor", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
        "original_max_position_embeddings", "truncate",
    },
    "longrope": {
        "factor", "attention_factor", "long_factor", "short_factor",
        "original_max_position_embeddings",
    },
}  # fmt: skip
# HF ignores these where the type does not use them (e.g. ``factor`` of ``default``): so do we
_COMMON_KEYS = {
    "rope_type", "type", "rope_theta", "partial_rotary_factor", "factor",
    "original_max_position_embeddings",
}  # fmt: skip


@dataclass
class RopeSpec:
    """Resolved RoPE settings of one model."""

    rope_type: str
    theta: float
    rot_dim: int  # rotated dims per head (head_dim * partial_rotary_factor)
    max_positions: int | None  # config max_position_embeddings
    params: dict[str, Any] = field(default_factory=dict)


def rope_spec(config: dict[str, Any], head_dim: int, model_type: str) -> RopeSpec:
    """RoPE settings from the new ``rope_parameters`` or the old ``rope_theta``/``rope_scaling`` keys.

    Raises ``ValueError`` for an unknown rope type, a missing required key or
    a key the type does not use (rather than computing something else).
    """
    params = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError(
            f"{model_type} config rope_parameters is nested per layer type ({sorted(params)}); "
            "per-layer RoPE is not supported by the FastGen engine."
        )
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "su":  # old Phi-3 name
        rope_type = "longrope"
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"{model_type} config rope_type={rope_type!r} is not supported by the FastGen engine; "
            f"supported: {list(ROPE_TYPES)}."
        )
    missing = [k for k in _REQUIRED.get(rope_type, ()) if params.get(k) is None]
    if missing:
        raise ValueError(
            f"{model_type} config rope_type={rope_type!r} needs {missing} in rope_parameters; "
            "add them (see the model card) or use rope_type='default'."
        )
    unknown = sorted(set(params) - _COMMON_KEYS - _KNOWN_KEYS[rope_type])
    if unknown:
        raise ValueError(
            f"{model_type} config rope_parameters keys {unknown} are not used by rope_type="
            f"{rope_type!r} in the FastGen engine (known: {sorted(_KNOWN_KEYS[rope_type])}); "
            "remove them or use a supported rope type."
        )
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial is None:
        partial = 1.0
    if not 0.0 < float(partial) <= 1.0:
        raise ValueError(
            f"{model_type} config partial_rotary_factor={partial!r} (in rope_parameters or "
            "top level) must be in (0, 1]; fix the config."
        )
    max_positions = config.get("max_position_embeddings")
    if rope_type in ("llama3", "yarn", "longrope"):
        # HF: a top-level original_max_position_embeddings (Phi-3) wins over the nested one
        orig = config.get("original_max_position_embeddings") or params.get(
            "original_max_position_embeddings"
        )
        params["original_max_position_embeddings"] = orig or max_positions
    return RopeSpec(
        rope_type=rope_type,
        theta=float(theta),
        rot_dim=int(head_dim * float(partial)),
        max_positions=max_positions,
        params=params,
    )


def _base_inv_freq(theta: float | torch.Tensor, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (theta**exponents)


def _yarn(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    p, dim, base = spec.params, spec.rot_dim, spec.theta
    orig = p["original_max_position_embeddings"]
    factor = p.get("factor") or spec.max_positions / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = p.get("attention_factor")
    if attention is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention = mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(orig / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1 => keep the original frequency
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(attention)


def _llama3(spec: RopeSpec) -> torch.Tensor:
    p = spec.params
    inv_freq = _base_inv_freq(spec.theta, spec.rot_dim)
    factor = float(p["factor"])
    low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_ctx = float(p["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _longrope_attention_factor(spec: RopeSpec) -> float:
    p = spec.params
    orig = p["original_max_position_embeddings"]
    factor = p.get("factor") or spec.max_positions / orig
    if p.get("attention_factor") is not None:
        return float(p["attention_factor"])
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))


def _longrope_inv_freq(spec: RopeSpec, long: bool) -> torch.Tensor:
    ext = torch.tensor(spec.params["long_factor" if long else "short_factor"], dtype=torch.float32)
    if ext.numel() != spec.rot_dim // 2:
        raise ValueError(
            f"rope_parameters {'long' if long else 'short'}_factor has {ext.numel()} entries; "
            f"rotary dim {spec.rot_dim} needs {spec.rot_dim // 2}."
        )
    shape = torch.arange(0, spec.rot_dim, 2, dtype=torch.int64).float() / spec.rot_dim
    return 1.0 / (ext * spec.theta**shape)


def _dynamic_inv_freq(spec: RopeSpec, seq_len: int) -> torch.Tensor:
    # float32 tensor arithmetic like HF (its seq_len is a tensor there)
    max_pos = spec.max_positions
    factor = float(spec.params["factor"])
    seq = torch.tensor(max(seq_len, max_pos), dtype=torch.int64)
    dim = spec.rot_dim
    base = spec.theta * ((factor * seq / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    return _base_inv_freq(base, dim)


def static_inv_freq(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    """``(inv_freq [rot_dim // 2], attention_factor)`` at the pre-trained length."""
    if spec.rope_type == "linear":
        return _base_inv_freq(spec.theta, spec.rot_dim) / float(spec.params["factor"]), 1.0
    if spec.rope_type == "llama3":
        return _llama3(spec), 1.0
    if spec.rope_type == "yarn":
        return _yarn(spec)
    if spec.rope_type == "longrope":
        return _longrope_inv_freq(spec, long=False), _longrope_attention_factor(spec)
    return _base_inv_freq(spec.theta, spec.rot_dim), 1.0  # default, dynamic below its limit


def forward_seq_lens(batch: RaggedBatch) -> torch.Tensor:
    """``[N]``: for each token, the sequence length its RoPE is computed for
    (``batch.rope_lens``; without it, the context length of its sequence after this forward)."""
    if batch.rope_lens is not None:
        return batch.rope_lens
    meta = batch.attn
    positions = batch.positions
    if meta.backend == "flash":
        q_lens = (meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]).long()
        k_lens = (meta.cu_seqlens_k[1:] - meta.cu_seqlens_k[:-1]).long()
        return torch.repeat_interleave(k_lens, q_lens)
    seq_lens = positions + 1  # decodes: one token, context = its position + 1
    for c in meta.chunks:
        seq_lens[c.token_start : c.token_start + c.num_tokens] = c.context_len
    return seq_lens


_MAX_TABLE = 32768  # positions a cos/sin table covers (fp32, rot_dim 128: 32 MiB for both)


class RotaryEmbedding(nn.Module):
    """``cos``/``sin`` ``[N, rot_dim]`` per token (half-rotation layout, HF's ``rotate_half``)."""

    def __init__(self, spec: RopeSpec):
        super().__init__()
        self.spec = spec
        self.rot_dim = spec.rot_dim
        with torch.device("cpu"):  # real values even when the model is built on "meta"
            inv_freq, self.attention_factor = static_inv_freq(spec)
            self.long_inv_freq_cpu = (
                _longrope_inv_freq(spec, long=True) if spec.rope_type == "longrope" else None
            )
        self.inv_freq_cpu = inv_freq  # not a buffer: survives meta init
        self.length_dependent = spec.rope_type in ("dynamic", "longrope")
        # static types: (device, dtype) -> cos/sin rows of positions 0..len-1, grown on demand
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def recompute_len(self) -> int | None:
        """longrope: the sequence length at which keys rotated with the short factors must be
        recomputed with the long ones (``original_max_position_embeddings + 1``); else None."""
        if self.spec.rope_type != "longrope":
            return None
        return int(self.spec.params["original_max_position_embeddings"]) + 1

    def cache_key(self, rope_base_len: int) -> bytes:
        """What, besides the tokens, a sequence's cached keys depend on (see
        ``Request.rope_base_len``): b"" when nothing."""
        if self.spec.rope_type == "longrope":
            return b"long" if rope_base_len >= self.recompute_len else b"short"
        if self.spec.rope_type == "dynamic" and rope_base_len > self.spec.max_positions:
            return f"dynamic{rope_base_len}".encode()
        return b""

    def _per_token_inv_freq(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """``[N, rot_dim // 2]`` frequencies for length-dependent rope types."""
        device = seq_lens.device
        if self.spec.rope_type == "longrope":
            orig = self.spec.params["original_max_position_embeddings"]
            long = (seq_lens > orig).unsqueeze(-1)  # [N, 1]
            return torch.where(
                long, self.long_inv_freq_cpu.to(device), self.inv_freq_cpu.to(device)
            )
        out = self.inv_freq_cpu.to(device).expand(seq_lens.numel(), -1).clone()  # [N, rot_dim / 2]
        for length in seq_lens.unique().tolist():
            if length > self.spec.max_positions:  # HF rescales only beyond the trained length
                out[seq_lens == length] = _dynamic_inv_freq(self.spec, int(length)).to(device)
        return out

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype, seq_lens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.length_dependent:
            if seq_lens is None:
                raise ValueError(f"rope_type={self.spec.rope_type!r} needs per-token seq_lens")
            freqs = positions.float().unsqueeze(-1) * self._per_token_inv_freq(seq_lens)
        else:
            table = None
            if positions.device.type == "cpu" and not torch.compiler.is_compiling():
                table = self._table(positions, dtype)  # (on CPU: reading the max syncs nothing)
            if table is not None:
                return table[0][positions], table[1][positions]
            freqs = positions.float().unsqueeze(-1) * self.inv_freq_cpu.to(positions.device)
        return self._cos_sin(freqs, dtype)

    def _cos_sin(
        self, freqs: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        emb = torch.cat((freqs, freqs), dim=-1)  # [N, rot_dim]
        cos, sin = emb.cos() * self.attention_factor, emb.sin() * self.attention_factor
        return cos.to(dtype), sin.to(dtype)

    def _table(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos/sin ``[L, rot_dim]`` of positions ``0..L-1`` covering ``positions`` (static
        rope types): the same elementwise values as computing them per step, built once and
        doubled when a position passes the end; None past :data:`_MAX_TABLE` positions."""
        key = (positions.device, dtype)
        table = self._tables.get(key)
        if table is None or (positions.numel() and int(positions.max()) >= table[0].shape[0]):
            need = int(positions.max()) + 1 if positions.numel() else 1
            if need > _MAX_TABLE:
                return None
            length = min(max(need, 2 * (table[0].shape[0] if table else 0), 256), _MAX_TABLE)
            steps = torch.arange(length, device=positions.device)
            freqs = steps.float().unsqueeze(-1) * self.inv_freq_cpu.to(positions.device)
            table = self._tables[key] = self._cos_sin(freqs, dtype)
        return table


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` dims of ``x`` ``[N, heads, D]``; the rest pass through."""
    rot_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    half = rot_dim // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)  # [N, heads, rot_dim]
    out = x_rot * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)
    return out if x_pass.shape[-1] == 0 else torch.cat((out, x_pass), dim=-1)


def apply_rope_owned(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rope` for an ``x`` the caller owns (a fresh projection output): on CPU
    outside autograd it is rotated in place by the fused kernel, with the same bits."""
    if (
        x.dim() == 3
        and x.stride(-1) == 1
        and cos.dtype == x.dtype
        and cos.is_contiguous()
        and sin.is_contiguous()
        and cpu_fused.active(x)
    ):
        return cpu_fused.rope_(x, cos, sin)
    return apply_rope(x, cos, sin)
