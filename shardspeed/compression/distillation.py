"""Knowledge-distillation losses for compression runs (layer reduction, XTC, ZeroQuant LKD).

* :func:`kd_loss`: soft-label loss on logits, ``T**2 * KL(softmax(t / T) || softmax(s / T))``
  averaged over positions (Hinton et al.; DeepSpeed's compression examples use it with the
  task loss);
* :func:`hidden_state_mse`: layer-wise MSE between chosen student and teacher hidden states
  (student layer ``i`` against teacher layer ``layer_map[i]``: ``teacher_layer`` of
  ``layer_reduction``);
* :class:`capture_outputs`: records the outputs of named submodules during a forward, for
  models that do not return their hidden states.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


def kd_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Soft-label distillation loss, averaged over every position.

    Args:
        student_logits: ``(..., V)`` logits of the student.
        teacher_logits: ``(..., V)`` logits of the teacher (no gradient flows into them).
        temperature: softening ``T > 0``; the loss is scaled by ``T**2`` so its gradient
            keeps its size as ``T`` changes.

    Returns:
        A scalar: ``T**2 * mean over positions of sum_v p_t log(p_t / p_s)``.
    """
    if temperature <= 0:
        raise ValueError(
            f"kd_loss(temperature={temperature}): allowed: a positive float. Fix: pass e.g. 1.0 "
            "or 2.0."
        )
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"kd_loss: student logits {tuple(student_logits.shape)} and teacher logits "
            f"{tuple(teacher_logits.shape)} differ; allowed: the same (..., vocab) shape. Fix: "
            "score the same tokens with both models."
        )
    vocab = student_logits.size(-1)
    s = F.log_softmax(student_logits.float().reshape(-1, vocab) / temperature, dim=-1)  # (P, V)
    t = F.log_softmax(teacher_logits.detach().float().reshape(-1, vocab) / temperature, dim=-1)
    kl = F.kl_div(s, t, reduction="batchmean", log_target=True)  # sum over V, mean over P
    return kl * temperature**2


def hidden_state_mse(
    student_hidden: Sequence[torch.Tensor],
    teacher_hidden: Sequence[torch.Tensor],
    layer_map: Sequence[int] | None = None,
) -> torch.Tensor:
    """Mean over student layers ``i`` of ``MSE(student_hidden[i], teacher_hidden[map[i]])``.

    ``layer_map`` None pairs the layers one to one (then the counts must match).
    """
    if layer_map is None:
        if len(student_hidden) != len(teacher_hidden):
            raise ValueError(
                f"hidden_state_mse: {len(student_hidden)} student and {len(teacher_hidden)} "
                "teacher hidden states without layer_map; allowed: equal counts, or a "
                "layer_map of one teacher index per student layer. Fix: pass layer_map "
                "(e.g. layer_reduction's teacher_layer)."
            )
        layer_map = range(len(student_hidden))
    if len(layer_map) != len(student_hidden):
        raise ValueError(
            f"hidden_state_mse: layer_map has {len(layer_map)} entries for "
            f"{len(student_hidden)} student hidden states; allowed: one teacher index per "
            "student layer. Fix: give layer_map the student's depth."
        )
    losses = [
        F.mse_loss(s.float(), teacher_hidden[t].detach().float())
        for s, t in zip(student_hidden, layer_map, strict=True)
    ]
    return torch.stack(losses).mean()


class capture_outputs:  # noqa: N801 - used as a context manager, like torch's no_grad
    """Record the forward outputs of ``model``'s submodules named ``names``, in that order.

    ::

        with capture_outputs(student, [f"h.{i}" for i in range(2)]) as hs:
            logits, _ = student(x)
        hs.outputs  # [h.0's output, h.1's output]  (tuples are cut to their first item)
    """

    def __init__(self, model: nn.Module, names: Sequence[str]) -> None:
        modules = dict(model.named_modules())
        missing = [n for n in names if n not in modules]
        if missing:
            raise ValueError(
                f"capture_outputs: no submodule named {missing} in {type(model).__name__}; "
                "allowed: names from model.named_modules(). Fix: correct the names (e.g. 'h.0')."
            )
        self._modules = [modules[n] for n in names]
        self._found: dict[int, torch.Tensor] = {}
        self._handles: list[Any] = []

    @property
    def outputs(self) -> list[torch.Tensor]:
        """The outputs of the last forward, in the order of ``names``."""
        return [self._found[i] for i in range(len(self._modules))]

    def __enter__(self) -> capture_outputs:
        for i, module in enumerate(self._modules):

            def hook(_m: nn.Module, _args: Any, out: Any, i: int = i) -> None:
                self._found[i] = out[0] if isinstance(out, tuple) else out

            self._handles.append(module.register_forward_hook(hook))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
