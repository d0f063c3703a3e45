"""Memory estimates for model states (ZeRO stages 0-3, with offload), as the engines allocate.

Per rank, with P trainable parameters over N data-parallel ranks, f = 1/N at stages 1-3
(1 at stage 0), 16-bit or fp32 parameters of ``b_p`` bytes, gradients of ``b_g`` bytes
(the parameter dtype at GAS 1, fp32 when 16-bit gradients accumulate over micro-steps),
fp32 masters and an optimizer with ``s`` bytes of state per parameter (Adam: 8):

============  ====================================  =============================
category      no offload                            ``offload_optimizer: cpu``
============  ====================================  =============================
params        ``b_p P`` (stage 3: ``b_p P/N``)      same
grads         ``b_g P`` (stage 2/3: ``b_g P/N``)    + fp32 host copy ``4 P f``
masters       ``4 P f`` (0 for fp32: the shard)     ``4 P f`` on the host
optim state   ``s P f``                             ``s P f`` on the host
============  ====================================  =============================

Stage 3 also holds, while computing, the gathered units: the root unit (embeddings,
head: kept through forward and backward) plus the unit in use and a prefetched one,
``b_p (R + 2 L)``; parameters under ``stage3_param_persistence_threshold`` are kept whole
on every rank (``b_p`` each, besides their shard). ``offload_param: cpu`` moves the
parameter shards (``b_p P/N``) to the host (with fp32 training the masters then become a
separate fp32 copy on the device unless the optimizer is offloaded too). NVMe offload
moves the same state to files (reported as ``nvme``; the bounded swap buffers in host
memory are not included).

Bytes at rest equal ``engine.memory_breakdown()``'s categories up to bucket padding
(fewer than N elements per bucket) and the optimizer's step counters. The DeepSpeed names
(``estimate_zero2_model_states_mem_needs_all_live`` / ``_all_cold``,
``estimate_zero3_...``) log a table of the offload options and return its rows; the
``shardspeed estimate`` command prints the same table.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch.nn as nn

from shardspeed.utils.logging import log_dist

OffloadDevice = str  # "none", "cpu" or "nvme"
_DEVICES = ("none", "cpu", "nvme")


def _device(value: bool | str | None, what: str) -> str:
    if value is None or value is False:
        return "none"
    if value is True:
        return "cpu"
    if value not in _DEVICES:
        raise ValueError(f"{what}={value!r} is not an offload device; allowed: {_DEVICES}.")
    return str(value)


@dataclass(frozen=True)
class ModelStateEstimate:
    """Bytes per rank for one (stage, offload) choice, in ``memory_breakdown()``'s terms.

    ``params``/``grads``/``master_params``/``optimizer_state`` are bytes held in memory by
    this rank (device or host); ``host`` is the part of them in host memory; ``nvme`` is
    what lives in swap files; ``gathered_params`` (stage 3) is the extra device memory of
    the units gathered while computing, not held at rest.
    """

    stage: int
    offload_optimizer: str
    offload_param: str
    params: int
    grads: int
    master_params: int
    optimizer_state: int
    host: int
    nvme: int
    gathered_params: int
    devices_per_node: int

    @property
    def total(self) -> int:
        """Bytes in memory at rest (device + host), like ``memory_breakdown()["total"]``
        without buffers."""
        return self.params + self.grads + self.master_params + self.optimizer_state

    @property
    def device_at_rest(self) -> int:
        return self.total - self.host

    @property
    def device_bytes(self) -> int:
        """Peak bytes per device: at rest plus the gathered units (stage 3)."""
        return self.device_at_rest + self.gathered_params

    @property
    def host_bytes_per_node(self) -> int:
        return self.host * self.devices_per_node

    def as_row(self) -> dict[str, Any]:
        row = asdict(self)
        row.update(
            device_bytes=self.device_bytes,
            host_bytes_per_node=self.host_bytes_per_node,
            total=self.total,
        )
        return row


def estimate_model_states(
    total_params: float,
    *,
    stage: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    offload_optimizer: bool | str = False,
    offload_param: bool | str = False,
    largest_layer_params: float = 0,
    root_params: float = 0,
    persistent_params: float = 0,
    frozen_params: float = 0,
    param_bytes: int = 2,
    grad_bytes: int | None = None,
    master_bytes: int = 4,
    optimizer_state_bytes: int = 8,
) -> ModelStateEstimate:
    """Bytes per rank of the model states for one stage and offload choice.

    ``total_params`` counts trainable parameters (floats such as ``7e9`` are fine);
    ``frozen_params`` are kept whole on every rank. ``grad_bytes`` defaults to
    ``param_bytes`` (GAS 1). Stage 3 only: ``largest_layer_params`` (largest unit),
    ``root_params`` (the root unit: parameters outside the ModuleList/Sequential blocks),
    ``persistent_params`` (kept whole, under the persistence threshold).
    """
    if num_gpus_per_node < 1 or num_nodes < 1:
        raise ValueError(
            f"num_gpus_per_node={num_gpus_per_node} and num_nodes={num_nodes} must be >= 1."
        )
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage!r}: ZeRO stages are 0, 1, 2 and 3.")
    opt_dev = _device(offload_optimizer, "offload_optimizer")
    param_dev = _device(offload_param, "offload_param")
    if param_dev != "none" and stage != 3:
        raise ValueError(f"offload_param={param_dev!r} needs stage 3 (got stage {stage}).")
    if opt_dev != "none" and stage == 0:
        raise ValueError(f"offload_optimizer={opt_dev!r} needs ZeRO stage 1, 2 or 3.")
    n = num_gpus_per_node * num_nodes
    p = float(total_params)
    b_p, b_m = param_bytes, master_bytes
    b_g = param_bytes if grad_bytes is None else grad_bytes
    f = 1.0 if stage == 0 else 1.0 / n
    host = nvme = 0.0

    # parameters: full at stages 0-2; at stage 3 the shard, plus persistent ones whole
    if stage < 3:
        params = b_p * p
    else:
        shard = b_p * p / n
        params = shard + b_p * float(persistent_params)
        if param_dev == "cpu":
            host += shard
        elif param_dev == "nvme":
            params -= shard
            nvme += shard
    params += b_p * float(frozen_params)

    grads = b_g * p * (1.0 if stage <= 1 else 1.0 / n)
    if opt_dev != "none":
        grads += b_m * p * f  # the fp32 host copy the optimizer reads
        host += b_m * p * f

    # masters and optimizer state live together: device, host, or swap files
    masters_separate = opt_dev != "none" or b_p != b_m or param_dev != "none"
    masters = b_m * p * f if masters_separate else 0.0
    state = optimizer_state_bytes * p * f
    if opt_dev == "cpu":
        host += masters + state
    elif opt_dev == "nvme":
        nvme += masters + state
        masters = state = 0.0

    gathered = 0.0
    if stage == 3:
        gathered = b_p * (float(root_params) + 2 * float(largest_layer_params))
    return ModelStateEstimate(
        stage=stage,
        offload_optimizer=opt_dev,
        offload_param=param_dev,
        params=int(params),
        grads=int(grads),
        master_params=int(masters),
        optimizer_state=int(state),
        host=int(host),
        nvme=int(nvme),
        gathered_params=int(gathered),
        devices_per_node=num_gpus_per_node,
    )


# ----------------------------------------------------------------------- the table
_OPTIONS = {
    1: (("none", "none"), ("cpu", "none")),
    2: (("none", "none"), ("cpu", "none")),
    3: (("none", "none"), ("cpu", "none"), ("cpu", "cpu")),
}


def format_bytes(num: float) -> str:
    """Binary units: ``1536`` -> ``"1.50 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num) < 1024 or unit == "TiB":
            return f"{num:.0f} {unit}" if unit == "B" else f"{num:.2f} {unit}"
        num /= 1024
    return f"{num:.2f} TiB"  # pragma: no cover


def format_count(num: float) -> str:
    """``7e9`` -> ``"7.00B"``."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if num >= div:
            return f"{num / div:.2f}{suffix}"
    return f"{num:.0f}"


def estimate_table(
    total_params: float,
    stages: tuple[int, ...],
    *,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    largest_layer_params: float = 0,
    additional_buffer_factor: float = 1.0,
    **kwargs: Any,
) -> tuple[str, list[dict[str, Any]]]:
    """The options table (text) and its rows for ``stages`` (offload choices per stage).

    ``additional_buffer_factor`` (DeepSpeed's headroom knob) multiplies the host column;
    the default 1.0 reports exactly what the engines allocate.
    """
    rows = []
    for stage in stages:
        for opt_dev, param_dev in _OPTIONS[stage]:
            est = estimate_model_states(
                total_params,
                stage=stage,
                num_gpus_per_node=num_gpus_per_node,
                num_nodes=num_nodes,
                offload_optimizer=opt_dev,
                offload_param=param_dev,
                largest_layer_params=largest_layer_params,
                **kwargs,
            )
            row = est.as_row()
            row["host_bytes_per_node"] = int(row["host_bytes_per_node"] * additional_buffer_factor)
            rows.append(row)
    b_p = kwargs.get("param_bytes", 2)
    b_g = kwargs.get("grad_bytes") or b_p
    header = (
        f"Estimated memory for model states: {format_count(float(total_params))} params, "
        f"{num_nodes} node(s) x {num_gpus_per_node} device(s); {b_p}-byte params, "
        f"{b_g}-byte grads, fp32 masters, {kwargs.get('optimizer_state_bytes', 8)} bytes of "
        "optimizer state per param (Adam)"
    )
    table = [("stage", "offload_optimizer", "offload_param", "per device", "host per node")]
    for r in rows:
        table.append(
            (
                str(r["stage"]),
                r["offload_optimizer"],
                r["offload_param"],
                format_bytes(r["device_bytes"]),
                format_bytes(r["host_bytes_per_node"]),
            )
        )
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    lines = [header]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in table]
    if 3 in stages:
        if largest_layer_params:
            lines.append(
                f"  stage 3 per device includes 2 x {format_count(float(largest_layer_params))} "
                "gathered params (the unit in use and a prefetched one)"
            )
        else:
            lines.append(
                "  stage 3 per device excludes gathered units: pass the largest layer's "
                "params to include them"
            )
    return "\n".join(lines), rows


# ----------------------------------------------------------------------- a live model
@dataclass(frozen=True)
class ModelSizes:
    """Parameter counts of a model as the stage-3 engine would split it."""

    trainable: int
    frozen: int
    root: int  # sharded params of the root unit
    largest_unit: int  # largest sharded non-root unit
    persistent: int  # kept whole (under the persistence threshold)


def model_sizes(
    model: nn.Module,
    param_persistence_threshold: int = 0,
    model_persistence_threshold: int | None = None,
) -> ModelSizes:
    """Count ``model``'s parameters the way stage 3 (``UnitSharding``) groups them (shared ones once)."""
    from shardspeed.zero.unit_sharding import assign_params, split_units

    units = split_units(model)
    owner = assign_params(model, units)
    budget = model_persistence_threshold if model_persistence_threshold is not None else 2**62
    sizes = [0] * len(units)
    trainable = frozen = persistent = 0
    seen: set[int] = set()
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        numel = p.numel()
        if not p.requires_grad:
            frozen += numel
            continue
        trainable += numel
        if numel < param_persistence_threshold and numel <= budget:
            budget -= numel
            persistent += numel
        else:
            sizes[owner.get(id(p), 0)] += numel
    return ModelSizes(trainable, frozen, sizes[0], max(sizes[1:], default=0), persistent)


def estimate_from_config(
    model: nn.Module, config: Any, num_gpus_per_node: int = 1, num_nodes: int = 1
) -> ModelStateEstimate:
    """The estimate for ``model`` trained with ds_config ``config`` (dict, path or loaded)."""
    from shardspeed.config import ShardSpeedConfig, load_config
    from shardspeed.precision.policy import MixedPrecision

    n = num_gpus_per_node * num_nodes
    cfg = config if isinstance(config, ShardSpeedConfig) else load_config(config, dp_world_size=n)
    zc = cfg.zero_optimization
    precision = MixedPrecision.from_config(cfg)
    stage = zc.stage
    sizes = model_sizes(
        model,
        int(zc.stage3_param_persistence_threshold) if stage == 3 else 0,
        int(zc.stage3_model_persistence_threshold),
    )
    gas = cfg.gradient_accumulation_steps or 1
    return estimate_model_states(
        sizes.trainable,
        stage=stage,
        num_gpus_per_node=num_gpus_per_node,
        num_nodes=num_nodes,
        offload_optimizer=zc.offload_optimizer_device,
        offload_param=zc.offload_param_device,
        largest_layer_params=sizes.largest_unit,
        root_params=sizes.root,
        persistent_params=sizes.persistent,
        frozen_params=sizes.frozen,
        param_bytes=precision.param_dtype.itemsize,
        grad_bytes=precision.grad_dtype(gas).itemsize,
        master_bytes=precision.master_dtype.itemsize,
    )


# ----------------------------------------------------------------------- DeepSpeed's names
def estimate_zero2_model_states_mem_needs(
    total_params: float,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    additional_buffer_factor: float = 1.0,
) -> tuple[int, int]:
    """``(host bytes per node, bytes per device)`` at ZeRO stage 2, DeepSpeed's return order.

    16-bit parameters and gradients, fp32 masters, Adam.
    """
    est = estimate_model_states(
        total_params,
        stage=2,
        num_gpus_per_node=num_gpus_per_node,
        num_nodes=num_nodes,
        offload_optimizer=cpu_offload,
    )
    return int(est.host_bytes_per_node * additional_buffer_factor), est.device_bytes


def estimate_zero2_model_states_mem_needs_all_cold(
    total_params: float,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.0,
    **kwargs: Any,
) -> list[dict[str, Any]]:
    """Log the stage 1 and 2 options table for ``total_params``; return its rows.

    Keyword options of :func:`estimate_model_states` (``param_bytes``, ``grad_bytes``,
    ``optimizer_state_bytes``, ``frozen_params``) change the dtype assumptions.
    """
    text, rows = estimate_table(
        total_params,
        (1, 2),
        num_gpus_per_node=num_gpus_per_node,
        num_nodes=num_nodes,
        additional_buffer_factor=additional_buffer_factor,
        **kwargs,
    )
    log_dist(text)
    return rows


def estimate_zero2_model_states_mem_needs_all_live(
    model: nn.Module,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.0,
    **kwargs: Any,
) -> list[dict[str, Any]]:
    """:func:`estimate_zero2_model_states_mem_needs_all_cold` with counts from ``model``."""
    sizes = model_sizes(model)
    kwargs.setdefault("frozen_params", sizes.frozen)
    return estimate_zero2_model_states_mem_needs_all_cold(
        sizes.trainable, num_gpus_per_node, num_nodes, additional_buffer_factor, **kwargs
    )


def estimate_zero3_model_states_mem_needs(
    total_params: float,
    largest_layer_params: float,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    cpu_offload_params: bool = True,
    zero_init: bool = True,
    additional_buffer_factor: float = 1.0,
) -> tuple[int, int, int]:
    """``(host bytes per node, bytes per device, gathered-layer bytes)``, DeepSpeed's order.

    ``zero_init`` is accepted for compatibility (construction-time memory is not modelled).
    """
    est = estimate_model_states(
        total_params,
        stage=3,
        num_gpus_per_node=num_gpus_per_node,
        num_nodes=num_nodes,
        offload_optimizer=cpu_offload,
        offload_param=cpu_offload and cpu_offload_params,
        largest_layer_params=largest_layer_params,
    )
    host = int(est.host_bytes_per_node * additional_buffer_factor)
    return host, est.device_bytes, est.gathered_params


def estimate_zero3_model_states_mem_needs_all_cold(
    total_params: float,
    largest_layer_params: float,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.0,
    **kwargs: Any,
) -> list[dict[str, Any]]:
    """Log the stage 3 options table (no offload, optimizer offload, + parameter offload)."""
    text, rows = estimate_table(
        total_params,
        (3,),
        num_gpus_per_node=num_gpus_per_node,
        num_nodes=num_nodes,
        largest_layer_params=largest_layer_params,
        additional_buffer_factor=additional_buffer_factor,
        **kwargs,
    )
    log_dist(text)
    return rows


def estimate_zero3_model_states_mem_needs_all_live(
    model: nn.Module,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.0,
    **kwargs: Any,
) -> list[dict[str, Any]]:
    """Stage 3 table for ``model``: units, root unit and frozen parameters taken from it.

    ``param_persistence_threshold`` (default 0 here: everything sharded) mirrors
    ``stage3_param_persistence_threshold``.
    """
    sizes = model_sizes(model, int(kwargs.pop("param_persistence_threshold", 0)))
    kwargs.setdefault("frozen_params", sizes.frozen)
    kwargs.setdefault("root_params", sizes.root)
    kwargs.setdefault("persistent_params", sizes.persistent)
    return estimate_zero3_model_states_mem_needs_all_cold(
        sizes.trainable,
        sizes.largest_unit,
        num_gpus_per_node,
        num_nodes,
        additional_buffer_factor,
        **kwargs,
    )
