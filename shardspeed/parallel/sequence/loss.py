"""The loss of a sequence-sharded batch: one mean over the whole sequence group's tokens.

Each rank holds the logits of its ``s/p`` tokens. The loss every rank reports is the mean
over *all* the group's (non-ignored) tokens, but its gradient flows only through this rank's
tokens, with weight ``1 / global_count``::

    loss_r = global_sum / global_count + (local_sum - local_sum.detach()) / global_count
             \\____ value: the same on every rank ___/   \\__ gradient: this rank's tokens __/

So the parameter gradients of the ranks of one sequence group *sum* to the gradient of the
full-sequence mean loss (the all-to-alls carry the cross-token terms). An engine therefore
sums gradients over the sequence axis and averages over the data axis (DeepSpeed: all-reduce
over data x sequence, divide by dp), never dividing by the sequence-parallel size.

Labels of a causal LM shift left by one token, which crosses rank boundaries: the last
token of rank ``r`` predicts the first label of rank ``r+1``. :func:`causal_lm_targets`
fetches those boundary labels (one tiny all-gather).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from shardspeed import comm

IGNORE_INDEX = -100


def causal_lm_targets(
    labels: torch.Tensor, group: Any, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Next-token targets for this rank's labels (b, s/p): shifted left across the group.

    Collective over ``group``. The last token of the last rank gets ``ignore_index``.
    """
    num_ranks, rank = comm.get_world_size(group), comm.get_rank(group)
    first = labels[..., :1].contiguous()  # (b, 1): this rank's first label
    gathered = first.new_empty((num_ranks * first.shape[0], *first.shape[1:]))  # (p * b, 1)
    comm.all_gather_into_tensor(gathered, first, group=group)
    gathered = gathered.view(num_ranks, *first.shape)  # (p, b, 1)
    if rank + 1 < num_ranks:
        boundary = gathered[rank + 1]
    else:
        boundary = torch.full_like(first, ignore_index)
    return torch.cat((labels[..., 1:], boundary), dim=-1)  # (b, s/p)


def sequence_parallel_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    group: Any,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "mean",
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Cross-entropy of this rank's tokens, summed (and counted) over the sequence group.

    ``logits``: (..., vocab) for this rank's tokens; ``targets``: (...), already aligned
    (see :func:`causal_lm_targets`). ``reduction="mean"`` divides the group's loss sum by the
    group's number of non-ignored targets (or by ``num_items_in_batch`` when given, as
    Hugging Face's gradient-accumulation convention); ``"sum"`` returns the group's sum.
    Collective over ``group`` (one all-reduce of two numbers).
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} must agree on every "
            "dim but the last (vocabulary)."
        )
    vocab = logits.shape[-1]
    targets = targets.to(logits.device)
    # (n,) tokens -> this rank's summed token loss, in fp32
    local_sum = F.cross_entropy(
        logits.float().reshape(-1, vocab),
        targets.reshape(-1),
        ignore_index=ignore_index,
        reduction="sum",
    )
    local_count = (targets != ignore_index).sum()
    totals = torch.stack((local_sum.detach().double(), local_count.double()))
    comm.all_reduce(totals, group=group)
    global_sum = totals[0].to(local_sum.dtype)
    # Value: the group's sum; gradient: d(local_sum), exactly (x - x.detach() is 0).
    loss_sum = global_sum + (local_sum - local_sum.detach())
    if reduction == "sum":
        return loss_sum
    if num_items_in_batch is not None:
        denominator = torch.as_tensor(num_items_in_batch, device=loss_sum.device)
    else:
        denominator = totals[1]
    return loss_sum / denominator.to(loss_sum.dtype).clamp_min(1)


class SequenceParallelCausalLMLoss:
    """A Hugging Face ``loss_function`` for sequence-sharded causal LMs.

    ``model.loss_function = SequenceParallelCausalLMLoss(group)`` makes
    ``model(input_ids=local_ids, labels=local_labels).loss`` the full-sequence mean: labels
    are this rank's unshifted chunk and are shifted across ranks here (or pass
    ``shift_labels``, already shifted and sharded).
    """

    def __init__(self, group: Any, ignore_index: int = IGNORE_INDEX) -> None:
        self.group = group
        self.ignore_index = ignore_index

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor | None = None,
        vocab_size: int | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        ignore_index: int | None = None,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        ignore_index = self.ignore_index if ignore_index is None else ignore_index
        if shift_labels is None:
            if labels is None:
                raise ValueError("SequenceParallelCausalLMLoss needs labels or shift_labels")
            shift_labels = causal_lm_targets(labels.to(logits.device), self.group, ignore_index)
        return sequence_parallel_cross_entropy(
            logits,
            shift_labels,
            self.group,
            ignore_index=ignore_index,
            num_items_in_batch=num_items_in_batch,
        )
