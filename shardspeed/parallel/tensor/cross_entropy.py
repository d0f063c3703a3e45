"""Cross-entropy over vocabulary-sharded logits: no rank ever holds the full logits.

Each tensor rank has the logits of its vocabulary slice ``[vocab_start, vocab_start + V_r)``.
Per token, with ``m`` the global max and ``t`` the target::

    m      = all_reduce_max(max_v logits_r)                      (one MAX all-reduce)
    S, z_t = all_reduce_sum(sum_v exp(logits_r - m), logit_t - m if t is local else 0)
    loss   = log S - z_t                                         (one SUM all-reduce, 2 values)
    dloss/dlogits_r = softmax_r - onehot_r(t)                    (local; no communication)

:class:`VocabParallelCausalLMLoss` plugs this into a Hugging Face model's ``loss_function``
hook, so ``model(input_ids, labels=labels).loss`` works with a vocabulary-parallel head.
"""

from __future__ import annotations

from typing import Any

import torch

from shardspeed import comm


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        group: Any,
        vocab_start: int,
        ignore_index: int,
    ) -> torch.Tensor:
        # logits: (N, V_r) this rank's vocabulary slice; target: (N,) global ids
        input_dtype = logits.dtype
        logits = logits.float()
        num_local = logits.shape[-1]
        if num_local:
            global_max = logits.amax(dim=-1)  # (N,)
        else:
            global_max = logits.new_full(target.shape, float("-inf"))
        comm.all_reduce(global_max, op=comm.ReduceOp.MAX, group=group)
        shifted = logits - global_max.unsqueeze(-1)  # (N, V_r)

        valid = target != ignore_index
        local = valid & (target >= vocab_start) & (target < vocab_start + num_local)
        local_target = (target - vocab_start).clamp(0, max(num_local - 1, 0))
        if num_local:
            target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)  # (N,)
        else:  # an empty vocabulary slice (more ranks than rows)
            target_logit = shifted.new_zeros(target.shape)
        exp = shifted.exp_()  # (N, V_r), in place: shifted is ours
        sums = torch.stack(
            [exp.sum(dim=-1), torch.where(local, target_logit, torch.zeros_like(target_logit))]
        )
        comm.all_reduce(sums, group=group)  # (2, N): sum of exp, the target's shifted logit
        sum_exp, target_logit = sums[0], sums[1]
        loss = torch.where(valid, sum_exp.log() - target_logit, torch.zeros_like(target_logit))

        softmax = exp.div_(sum_exp.unsqueeze(-1))  # (N, V_r)
        ctx.save_for_backward(softmax, local_target, local, valid)
        ctx.logits_dtype = input_dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[Any, ...]:
        softmax, local_target, local, valid = ctx.saved_tensors
        grad = softmax  # (N, V_r), reused in place (backward runs once)
        if grad.shape[-1]:
            grad.scatter_add_(-1, local_target.unsqueeze(-1), -local.to(grad.dtype).unsqueeze(-1))
        grad.mul_((grad_loss.float() * valid.float()).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    group: Any,
    *,
    vocab_start: int | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """``F.cross_entropy`` for logits sharded on the last dim over the tensor group.

    ``logits``: ``(..., V_r)`` this rank's vocabulary slice, starting at global id
    ``vocab_start`` (default: found with one all-gather of the slice widths, rank order);
    ``target``: ``(...)`` global ids, the same on every tensor rank. ``reduction`` is
    ``"mean"`` (over targets != ``ignore_index``), ``"sum"`` or ``"none"``; the result is
    the same on every tensor rank. Gradients come back in the logits' dtype.
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} and target "
            f"{tuple(target.shape)} must agree on every dim but the (sharded) vocabulary."
        )
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r}: use 'mean', 'sum' or 'none'.")
    if vocab_start is None:
        vocab_start = _vocab_start(logits.shape[-1], group, logits.device)
    dtype = logits.dtype
    loss = _VocabParallelCrossEntropy.apply(
        logits.reshape(-1, logits.shape[-1]),
        target.reshape(-1).long(),
        group,
        vocab_start,
        ignore_index,
    ).view(target.shape)
    if reduction == "none":
        return loss.to(dtype) if dtype != torch.float32 else loss
    total = loss.sum()
    if reduction == "sum":
        return total
    return total / (target != ignore_index).sum().clamp_min(1)


def _vocab_start(num_local: int, group: Any, device: torch.device) -> int:
    widths = torch.zeros(comm.get_world_size(group), dtype=torch.int64, device=device)
    comm.all_gather_into_tensor(
        widths, torch.tensor([num_local], dtype=torch.int64, device=device), group=group
    )
    return int(widths[: comm.get_rank(group)].sum())


class VocabParallelCausalLMLoss:
    """A Hugging Face ``loss_function`` for a vocabulary-parallel LM head (rank-local logits).

    Same semantics as ``transformers.loss.loss_utils.ForCausalLMLoss``: labels are shifted
    left by one, ``ignore_index`` tokens do not count, the mean is over counted tokens (or
    the sum divided by ``num_items_in_batch`` when given).
    """

    def __init__(
        self, group: Any, vocab_start: int, vocab_size: int, ignore_index: int = -100
    ) -> None:
        self.group = group
        self.vocab_start = vocab_start
        self.vocab_size = vocab_size
        self.ignore_index = ignore_index

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor | None = None,
        vocab_size: int | None = None,
        num_items_in_batch: Any = None,
        ignore_index: int | None = None,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        # logits: (B, T, V_r); labels: (B, T) global ids
        ignore = self.ignore_index if ignore_index is None else ignore_index
        if shift_labels is None:
            if labels is None:
                raise ValueError("VocabParallelCausalLMLoss needs labels or shift_labels.")
            padded = torch.nn.functional.pad(labels, (0, 1), value=ignore)  # (B, T + 1)
            shift_labels = padded[..., 1:]  # (B, T): token t predicts t + 1
        shift_labels = shift_labels.to(logits.device)
        if num_items_in_batch is None:
            return vocab_parallel_cross_entropy(
                logits, shift_labels, self.group, vocab_start=self.vocab_start, ignore_index=ignore
            )
        total = vocab_parallel_cross_entropy(
            logits, shift_labels, self.group, vocab_start=self.vocab_start, ignore_index=ignore,
            reduction="sum",
        )  # fmt: skip
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch
