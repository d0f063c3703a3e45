"""``WeightQuantConfig``: what to quantize and how (one frozen object, validated once)."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

KERNELS = ("auto", "torch", "reference")
GROUP_SIZES_INT4 = (32, 64, 128)
DEFAULT_SKIP = ("lm_head", "*.lm_head", "*.gate", "*.router")

_COMPUTE_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


@dataclass(frozen=True)
class WeightQuantConfig:
    """Weight-only quantization settings for :func:`quantize_model`.

    Attributes:
        bits: 8 (int8) or 4 (int4).
        group_size: input columns sharing one scale. None: per output channel for
            int8, 128 for int4. int4 allows 32, 64, 128; int8 allows None or any
            positive size (a group size other than per-channel runs on the
            reference path: torch's int8 kernel is per-channel only).
        symmetric: True: scale only (zero point 0); False: scale + zero point per group.
        skip_modules: ``fnmatch`` patterns of module names left unquantized. The
            default keeps the output head and MoE routers in full precision
            (embeddings are never quantized: only ``nn.Linear`` and GPT-2 ``Conv1D``).
        modules: if given, only module names matching one of these patterns (or, for
            patterns without wildcards, containing the pattern as a substring - the
            DeepSpeed ``post_init_quant`` rule) are quantized; ``skip_modules`` still applies.
        kernel: ``"auto"`` (torch's weight-only kernel when one fits, else the reference
            path), ``"torch"`` (require the kernel; error if none fits) or
            ``"reference"`` (dequantize on the fly, then ``F.linear``).
        compute_dtype: activation dtype inside quantized matmuls. None: bf16 for the
            torch kernels (their fast path on CPU, the only one for CUDA int4), the
            input's dtype for the reference path. The output is cast back to the
            input's dtype. Asymmetric int8 takes the kernel only with ``float32``
            (its zero-point correction after a bf16 output would lose precision).
    """

    bits: int = 8
    group_size: int | None = None
    symmetric: bool = True
    skip_modules: tuple[str, ...] = DEFAULT_SKIP
    modules: tuple[str, ...] | None = None
    kernel: str = "auto"
    compute_dtype: torch.dtype | str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.skip_modules, str) or (
            self.modules is not None and isinstance(self.modules, str)
        ):
            raise TypeError(
                "WeightQuantConfig.skip_modules / modules must be a list or tuple of name "
                f"patterns, got a str ({self.skip_modules!r} / {self.modules!r}); wrap it: ['...']."
            )
        object.__setattr__(self, "skip_modules", tuple(self.skip_modules))
        if self.modules is not None:
            object.__setattr__(self, "modules", tuple(self.modules))
        self._validate()

    def _validate(self) -> None:
        if isinstance(self.bits, bool) or self.bits not in (4, 8):
            raise ValueError(f"WeightQuantConfig.bits={self.bits!r} is not supported; use 8 or 4.")
        gs = self.group_size
        if gs is not None and (isinstance(gs, bool) or not isinstance(gs, int) or gs < 1):
            raise ValueError(
                f"WeightQuantConfig.group_size={gs!r} must be a positive int or None (per channel)."
            )
        if self.bits == 4 and gs is not None and gs not in GROUP_SIZES_INT4:
            raise ValueError(
                f"WeightQuantConfig.group_size={gs} is not supported for int4; "
                f"use one of {GROUP_SIZES_INT4} (None means 128)."
            )
        if not isinstance(self.symmetric, bool):
            raise TypeError(f"WeightQuantConfig.symmetric={self.symmetric!r} must be a bool.")
        if self.kernel not in KERNELS:
            raise ValueError(
                f"WeightQuantConfig.kernel={self.kernel!r} is not supported; choose one of {KERNELS}."
            )
        if self.kernel == "torch" and self.bits == 8 and gs is not None:
            raise ValueError(
                f"WeightQuantConfig(kernel='torch', bits=8, group_size={gs}): torch's int8 "
                "weight kernel is per-output-channel only; use group_size=None or kernel='auto'."
            )
        self.resolved_compute_dtype()  # raises on a bad name
        for name in (*self.skip_modules, *(self.modules or ())):
            if not isinstance(name, str) or not name:
                raise TypeError(
                    f"WeightQuantConfig module pattern {name!r} must be a non-empty str."
                )

    @property
    def effective_group_size(self) -> int | None:
        """The group size used (None = per output channel)."""
        if self.bits == 4 and self.group_size is None:
            return 128
        return self.group_size

    def resolved_compute_dtype(self) -> torch.dtype | None:
        """``compute_dtype`` as a ``torch.dtype`` (None = automatic)."""
        dt = self.compute_dtype
        if dt is None or isinstance(dt, torch.dtype):
            if dt is not None and dt not in _COMPUTE_DTYPES.values():
                raise ValueError(
                    f"WeightQuantConfig.compute_dtype={dt} is not supported; "
                    "use float32, bfloat16, float16 or None."
                )
            return dt
        key = str(dt).replace("torch.", "").lower()
        if key not in _COMPUTE_DTYPES:
            raise ValueError(
                f"WeightQuantConfig.compute_dtype={dt!r} is not supported; "
                f"use one of {sorted(_COMPUTE_DTYPES)} or None."
            )
        return _COMPUTE_DTYPES[key]

    def selects(self, name: str) -> bool:
        """Whether the module called ``name`` is to be quantized by the name filters."""
        if any(fnmatch.fnmatchcase(name, pat) for pat in self.skip_modules):
            return False
        if self.modules is None:
            return True
        return any(_matches(name, pat) for pat in self.modules)

    def with_overrides(self, **changes: Any) -> WeightQuantConfig:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    @classmethod
    def parse(cls, value: WeightQuantConfig | str | dict[str, Any]) -> WeightQuantConfig:
        """A config from a config, ``"int8"`` / ``"int4"`` / ``"int4-g64"`` or a dict of fields."""
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            known = {f.name for f in fields(cls) if not f.name.startswith("_")}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ValueError(
                    f"unknown WeightQuantConfig key(s) {unknown}; known keys: {sorted(known)}."
                )
            return cls(**value)
        if isinstance(value, str):
            return _from_name(value)
        raise TypeError(
            f"quantization={value!r} ({type(value).__name__}) is not supported; pass 'int8', "
            "'int4', 'int4-g64', a dict of WeightQuantConfig fields or a WeightQuantConfig."
        )


def _matches(name: str, pattern: str) -> bool:
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return pattern in name


_NAMES = "'int8', 'int8-asym', 'int4', 'int4-asym', 'int4-g32', 'int4-g64-asym', ..."


def _from_name(name: str) -> WeightQuantConfig:
    parts = name.lower().strip().split("-")
    head, rest = parts[0], parts[1:]
    if head not in ("int8", "int4"):
        raise ValueError(f"quantization={name!r} is not a known scheme; use {_NAMES}.")
    kwargs: dict[str, Any] = {"bits": int(head[3:])}
    for part in rest:
        if part in ("sym", "asym"):
            kwargs["symmetric"] = part == "sym"
        elif part.startswith("g") and part[1:].isdigit():
            kwargs["group_size"] = int(part[1:])
        else:
            raise ValueError(f"quantization={name!r}: unknown part {part!r}; use {_NAMES}.")
    return WeightQuantConfig(**kwargs)
