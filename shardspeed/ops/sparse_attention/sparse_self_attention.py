"""``SparseSelfAttention``: DeepSpeed's module on the block-sparse kernels (PyTorch or Triton).

The module builds one *master layout* for ``max_seq_length`` at construction (a persistent
buffer, as in DeepSpeed, so checkpoints carry it) and serves shorter sequences from its
top-left corner. It converts DeepSpeed's mask conventions to additive biases:

* ``key_padding_mask`` (B, L) (any shape that squeezes to it, e.g. (B, 1, 1, L));
* ``attn_mask`` (L, L), or (B, L, L) / (B|1, H|1, L, L);
* mode ``"add"``: the mask is added to the scores; mode ``"mul"``: entries equal to 0 are
  dropped (-inf) and every other entry keeps the score unchanged;
* ``rpe`` (B|1, H|1, L, L) is added to the scaled scores and receives a gradient.

Unlike DeepSpeed (fp16 only, Triton 1.x, CUDA) it runs fp32, bf16 and fp16 on any device.
"""

from __future__ import annotations

import torch
from torch import nn

from shardspeed.ops.sparse_attention.block_plan import BlockPlan, build_plan
from shardspeed.ops.sparse_attention.block_sparse import block_sparse_attention
from shardspeed.ops.sparse_attention.kernel_choice import requested_kernel
from shardspeed.ops.sparse_attention.layout_math import num_blocks_for
from shardspeed.ops.sparse_attention.sparsity_config import SparsityConfig

MASK_MODES = ("add", "mul")


def _check_mode(name: str, mode: str) -> None:
    if mode not in MASK_MODES:
        raise ValueError(
            f"{name}={mode!r} is not supported; use 'add' (the mask is added to the scores) or "
            "'mul' (entries equal to 0 are masked out)."
        )


def mask_to_bias(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """An additive bias (fp32, or fp64 for fp64 masks) from a mask in ``mode`` ('add'/'mul')."""
    dtype = mask.dtype if mask.is_floating_point() else torch.float32
    dtype = torch.promote_types(dtype, torch.float32)
    if mode == "add":
        return mask.to(dtype)
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return bias.masked_fill_(mask == 0, float("-inf"))


def _key_padding_as_2d(mask: torch.Tensor, batch: int, seq_len: int) -> torch.Tensor:
    """(B, L) from a key-padding mask of any shape whose non-batch dims squeeze to L."""
    if mask.dim() < 2 or mask.shape[0] != batch or mask.numel() != batch * seq_len:
        raise ValueError(
            f"key_padding_mask has shape {tuple(mask.shape)}; expected (batch, seq_len) = "
            f"({batch}, {seq_len}) or a shape that squeezes to it, such as (B, 1, 1, L)."
        )
    return mask.reshape(batch, seq_len)


class SparseSelfAttention(nn.Module):
    """Block-sparse self-attention of already projected (B, H, L, D) query/key/value.

    Args:
        sparsity_config: which blocks each head attends to (a :class:`SparsityConfig`).
        key_padding_mask_mode: ``"add"`` or ``"mul"`` (see the module docstring).
        attn_mask_mode: ``"add"`` or ``"mul"``.
        max_seq_length: the longest sequence served; sizes the master layout.
        kernel: ``"auto"``, ``"triton"`` or ``"torch"`` (not in DeepSpeed); default: env
            ``SHARDSPEED_SPARSE_ATTENTION_KERNEL``, else auto (Triton on CUDA when available).
    """

    def __init__(
        self,
        sparsity_config: SparsityConfig,
        key_padding_mask_mode: str = "add",
        attn_mask_mode: str = "mul",
        max_seq_length: int = 2048,
        kernel: str | None = None,
    ):
        super().__init__()
        if not isinstance(sparsity_config, SparsityConfig):
            raise ValueError(
                f"sparsity_config must be a SparsityConfig (e.g. FixedSparsityConfig("
                f"num_heads=...)), got {type(sparsity_config).__name__}."
            )
        _check_mode("key_padding_mask_mode", key_padding_mask_mode)
        _check_mode("attn_mask_mode", attn_mask_mode)
        self.sparsity_config = sparsity_config
        self.key_padding_mask_mode = key_padding_mask_mode
        self.attn_mask_mode = attn_mask_mode
        self.max_seq_length = max_seq_length
        self.kernel = None if kernel is None else requested_kernel(kernel)
        self.register_buffer("master_layout", sparsity_config.make_layout(max_seq_length))
        self._need_layout_synchronization = _has_random_blocks(sparsity_config)
        self._plans: dict[tuple[int, torch.device], BlockPlan] = {}

    def get_layout(self, seq_len: int) -> torch.Tensor:
        """The (H, L/b, L/b) layout used for sequences of ``seq_len`` tokens."""
        self._synchronize_layout()
        num_blocks = num_blocks_for(seq_len, self.sparsity_config.block)
        if num_blocks > self.master_layout.shape[-1]:
            raise ValueError(
                f"Sequence length {seq_len} exceeds max_seq_length={self.max_seq_length}; "
                "construct SparseSelfAttention with a larger max_seq_length."
            )
        return self.master_layout[..., :num_blocks, :num_blocks].cpu()

    def get_plan(self, seq_len: int, device: torch.device) -> BlockPlan:
        """The kernel's gather plan for ``seq_len``, cached per length and device."""
        key = (seq_len, device)
        if key not in self._plans:
            self._plans[key] = build_plan(self.get_layout(seq_len)).to(device)
        return self._plans[key]

    def _synchronize_layout(self) -> None:
        """Random layouts must agree across ranks: take rank 0's once (as DeepSpeed)."""
        if not self._need_layout_synchronization:
            return
        from shardspeed import comm

        if comm.is_initialized():
            holder = [self.master_layout.cpu()]
            comm.broadcast_object_list(holder, src=0)
            self.master_layout.copy_(holder[0])
            self._plans.clear()
        self._need_layout_synchronization = False

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if prefix + "master_layout" in state_dict:
            self._plans.clear()  # a loaded master_layout invalidates the cached plans
            self._need_layout_synchronization = False  # every rank loads the same layout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        rpe: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention output (B, H, L, D); ``key`` may also be given transposed (B, H, D, L)."""
        batch, num_heads, seq_len, head_dim = query.shape
        if key.dim() == 4 and key.shape[2] != seq_len and key.shape[3] == seq_len:
            key = key.transpose(2, 3)  # DeepSpeed accepts keys already transposed for q @ k
        if query.shape != key.shape or key.shape != value.shape:
            raise ValueError(
                "SparseSelfAttention is self-attention only: query, key and value must have the "
                f"same (B, H, L, D) shape; got {tuple(query.shape)}, {tuple(key.shape)}, "
                f"{tuple(value.shape)}."
            )
        if num_heads != self.sparsity_config.num_heads:
            raise ValueError(
                f"The input has {num_heads} heads but the sparsity config was built for "
                f"{self.sparsity_config.num_heads}; set num_heads={num_heads} in the config."
            )
        kp_bias = None
        if key_padding_mask is not None:
            kp = _key_padding_as_2d(key_padding_mask, batch, seq_len)
            kp_bias = mask_to_bias(kp, self.key_padding_mask_mode)
        attn_bias = None
        if attn_mask is not None:
            attn_bias = mask_to_bias(attn_mask, self.attn_mask_mode)
        return self.attend(
            query, key, value, rpe=rpe, key_padding_bias=kp_bias, attn_bias=attn_bias
        )

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        rpe: torch.Tensor | None = None,
        key_padding_bias: torch.Tensor | None = None,
        attn_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Like ``forward`` but with masks already additive (0 keeps, -inf drops)."""
        plan = self.get_plan(query.shape[2], query.device)
        return block_sparse_attention(
            query,
            key,
            value,
            plan,
            rpe=rpe,
            key_padding_bias=key_padding_bias,
            attn_bias=attn_bias,
            kernel=self.kernel,
        )


def _has_random_blocks(config: SparsityConfig) -> bool:
    return getattr(config, "num_random_blocks", 0) > 0
