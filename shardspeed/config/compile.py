"""``compile``: a compiled training step (``torch.compile`` of the model's forward).

```json
"compile": {"enabled": true, "backend": "inductor", "kwargs": {"mode": "default"}}
```

``enabled``/``backend``/``kwargs`` are the keys of DeepSpeed's first ``compile`` block
(0.14); DeepSpeed 0.19.8 dropped them in favour of calling ``engine.compile(backend=...,
compile_kwargs=...)``, which ShardSpeed also has. The other keys are DeepSpeed 0.19.8's
DeepCompile options: ``deepcompile: true`` is refused (DeepCompile's graph passes are not
implemented) and its knobs are warned about by name (they tune a feature that is off).
See docs/compile.md.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from shardspeed.config.base import ConfigModel, Int


class CompileConfig(ConfigModel):
    """``compile``: compile the model's forward inside the engine (per unit at ZeRO-3)."""

    json_key = "compile"

    enabled: bool = Field(
        False,
        description="Compile the model's forward with torch.compile when the engine is built "
        "(at ZeRO-3 each unit's forward; falls back to eager with a warning if the model "
        "does not compile).",
    )
    backend: str = Field(
        "inductor", description="torch.compile backend ('inductor', 'aot_eager', 'eager', ...)."
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra torch.compile keyword arguments (mode, dynamic, fullgraph, options).",
    )
    deepcompile: bool = Field(
        False, description="DeepSpeed's DeepCompile graph passes (not implemented: refused)."
    )
    # DeepSpeed 0.19.8's DeepCompile knobs: accepted, warned about by name when set.
    autoep_non_moe: bool = Field(False, description="DeepSpeed: compile around AutoEP layers.")
    free_activation: bool = Field(False, description="DeepCompile: free activations eagerly.")
    free_activation_threshold: Int = Field(
        10 * 1024 * 1024, description="DeepCompile: free-activation size threshold (bytes)."
    )
    offload_activation: bool = Field(False, description="DeepCompile: offload activations.")
    offload_activation_pin_memory: bool = Field(
        True, description="DeepCompile: pin activation offload buffers."
    )
    offload_opt_states: bool = Field(False, description="DeepCompile: offload optimizer states.")
    double_buffer: bool = Field(True, description="DeepCompile: double buffering.")
    symmetric_memory: bool = Field(False, description="DeepCompile: symmetric memory.")
    debug_log: bool = Field(False, description="DeepCompile: dump graphs.")
    offload_parameters: bool = Field(False, description="DeepCompile: offload parameters.")
    sync_before_reduce: bool = Field(False, description="DeepCompile: sync before reduce.")
    sync_after_reduce: bool = Field(False, description="DeepCompile: sync after reduce.")
    sync_before_allgather: bool = Field(False, description="DeepCompile: sync before all-gather.")
    sync_after_allgather: bool = Field(False, description="DeepCompile: sync after all-gather.")
    keep_int_input_tensors: bool = Field(
        True, description="DeepCompile: keep int input tensors' values."
    )
    keep_all_input_tensors: bool = Field(
        False, description="DeepCompile: keep all input tensors' values."
    )
    passes: list[str] | None = Field(None, description="DeepCompile: the passes to compose.")


DEEPCOMPILE_KNOBS: tuple[str, ...] = tuple(
    f"compile.{name}"
    for name in CompileConfig.model_fields
    if name not in ("enabled", "backend", "kwargs", "deepcompile")
)
"""The DeepCompile option keys (ignored knobs: DeepCompile itself is refused)."""
