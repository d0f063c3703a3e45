"""Memory estimates for ZeRO-3 model states, matching what ``Stage3Engine`` allocates.

Per GPU, with N = GPUs in total, P = trainable parameters, L = parameters of the largest
unit, 16-bit parameters and an Adam-like optimizer (two fp32 states):

* parameter shards ``2 P / N`` + gradient shards ``g P / N`` (g = 2, or 4 when gradients
  accumulate in fp32) + gathered units ``2 * 2 L`` (the unit in use and a prefetched one);
* without offload also fp32 masters and optimizer state: ``(4 + 8) P / N``;
* with ``offload_optimizer: cpu`` those ``12 P / N`` plus a 4-byte host gradient copy live
  in host memory instead, per node ``(4 + 8 + 4) P / N * gpus_per_node``.
"""

from __future__ import annotations

import torch.nn as nn

from shardspeed.utils.logging import log_dist


def estimate_zero3_model_states_mem_needs(
    total_params: int,
    largest_layer_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    offload_optimizer: bool = False,
    grad_bytes: int = 2,
) -> tuple[int, int]:
    """``(bytes per GPU, host bytes per node)`` for ZeRO-3 model states."""
    if num_gpus_per_node < 1 or num_nodes < 1:
        raise ValueError(
            f"num_gpus_per_node={num_gpus_per_node} and num_nodes={num_nodes} must be >= 1."
        )
    n = num_gpus_per_node * num_nodes
    per_gpu = (2 + grad_bytes) * total_params / n + 4 * largest_layer_params
    host = 0.0
    if offload_optimizer:
        host = 16 * total_params / n * num_gpus_per_node
    else:
        per_gpu += 12 * total_params / n
    return int(per_gpu), int(host)


def _model_sizes(model: nn.Module) -> tuple[int, int]:
    from shardspeed.zero.stage3_engine import assign_params, split_units

    units = split_units(model)
    owner = assign_params(model, units)
    sizes = [0] * len(units)
    seen: set[int] = set()
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            sizes[owner.get(id(p), 0)] += p.numel()
    return sum(sizes), max(sizes[1:], default=sizes[0])


def estimate_zero3_model_states_mem_needs_all_live(
    model: nn.Module, num_gpus_per_node: int = 1, num_nodes: int = 1
) -> list[dict[str, object]]:
    """Estimates for ``model`` with and without optimizer offload; logged as a table."""
    total, largest = _model_sizes(model)
    return estimate_zero3_model_states_mem_needs_all_cold(
        total, largest, num_gpus_per_node, num_nodes
    )


def estimate_zero3_model_states_mem_needs_all_cold(
    total_params: int, largest_layer_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1
) -> list[dict[str, object]]:
    """Estimates from parameter counts alone, with and without optimizer offload."""
    rows = []
    lines = [
        f"ZeRO-3 model-state memory for {total_params:,} params (largest unit "
        f"{largest_layer_params:,}) on {num_nodes} node(s) x {num_gpus_per_node} GPU(s):",
        "  per GPU     per node (host)   options",
    ]
    for offload in (False, True):
        gpu, host = estimate_zero3_model_states_mem_needs(
            total_params, largest_layer_params, num_gpus_per_node, num_nodes, offload
        )
        rows.append({"offload_optimizer": offload, "gpu_bytes": gpu, "host_bytes": host})
        lines.append(
            f"  {gpu / 2**30:8.2f}GB  {host / 2**30:8.2f}GB         offload_optimizer={offload}"
        )
    log_dist("\n".join(lines))
    return rows
