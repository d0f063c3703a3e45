"""How ShardSpeed pickles the one DeepSpeed object DeepSpeed's loader needs: the loss scaler.

DeepSpeed's ZeRO-3 loader assigns ``optimizer_state_dict["loss_scaler"]`` to its optimizer
and calls its methods, so the value must unpickle into DeepSpeed's own ``LossScaler``. A
plain reference to that class would make every reader without DeepSpeed installed
(PyTorch Lightning's conversion reading with ``torch.load``, plain scripts) fail with
``No module named 'deepspeed'``. So the scaler is stored as a recipe of standard-library
calls::

    locate = pydoc.locate
    locate("builtins.getattr")(locate("deepspeed.runtime.fp16.loss_scaler"), "LossScaler", float)(scale)

With DeepSpeed importable this is ``LossScaler(scale)``, the object DeepSpeed writes itself
(``cur_scale=scale, dynamic=False``); without it, the float ``scale``. ShardSpeed's own
reader (the allow-list unpickler of :mod:`shardspeed.checkpoint.deepspeed_import`) resolves
``pydoc.locate`` to an inert stand-in that knows these two paths only and never imports
anything (the pickle names no other global).

Every other value in the files is a tensor, a builtin or a ``torch.Size``; ``zero_stage`` is
a plain ``int`` (DeepSpeed's readers compare it as one).
"""

from __future__ import annotations

import os
import pydoc
from pathlib import Path
from typing import Any

import torch

LOSS_SCALER_MODULE = "deepspeed.runtime.fp16.loss_scaler"
LOSS_SCALER_CLASS = "LossScaler"


class _Located:
    """Pickles as ``pydoc.locate(path)``: the object at a dotted path, or None."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return pydoc.locate, (self.path,)

    def __call__(self, *args: Any) -> Any:  # pickle requires a callable; never called here
        raise TypeError("a pickling recipe, not a function")


class _ScalerClass(_Located):
    """Pickles as ``pydoc.locate("builtins.getattr")(<module or None>, "LossScaler", float)``."""

    def __init__(self) -> None:
        super().__init__("builtins.getattr")

    def __reduce__(self) -> tuple[Any, tuple[Any, str, type]]:  # type: ignore[override]
        return _Located("builtins.getattr"), (
            _Located(LOSS_SCALER_MODULE),
            LOSS_SCALER_CLASS,
            float,
        )


class StaticLossScaler:
    """A static loss scale that unpickles as DeepSpeed's ``LossScaler(scale)`` (see the
    module docstring); used for fp32 and bf16, where the scale is 1."""

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = float(scale)

    def __reduce__(self) -> tuple[Any, tuple[float]]:
        return _ScalerClass(), (self.scale,)


def save_pt(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save`` to a temporary name, then rename: a reader never sees half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)
