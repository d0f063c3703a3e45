"""DeepSpeed's MoE checkpoint layout, read by :mod:`shardspeed.checkpoint.deepspeed_import`.

DeepSpeed (0.19.x) saves an expert-parallel model as:

* ``mp_rank_00_model_states.pt``: the module state dict *without* expert parameters;
  ``param_shapes`` lists every optimizer group's parameters under rank 0's names (its
  local expert ids);
* ``layer_{L}_expert_{E}_mp_rank_00_model_states.pt`` (older releases:
  ``expert_{E}_mp_rank_00_model_states.pt``): expert ``E``'s weights under its *global* id
  (``...deepspeed_experts.<E>.*``), written by ``expert_data`` rank 0 of its ep rank;
* ``zero_pp_rank_{r}_mp_rank_00_optim_states.pt`` per world rank ``r``: that rank's
  partition of every group. An expert group (optimizer group with ``moe: True``, name
  ``ep_size_<E>``) holds rank ``r``'s *own* local experts, partitioned over its
  ``expert_data`` ranks. DeepSpeed's groups put ep rank ``r % E`` and ``expert_data``
  rank ``r // E`` on world rank ``r`` (its "E + D" layout), so ep rank ``k``'s flat group
  is the partitions of ranks ``k, k + E, k + 2E, ...`` concatenated.

The import renames every expert to its global id (``k * num_local_experts + local id``),
ShardSpeed's checkpoint names (:mod:`shardspeed.checkpoint.expert_placement`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

EXPERT_FILE = re.compile(r"^(?:layer_(\d+)_)?expert_(\d+)_mp_rank_00_model_states\.pt$")
_EXPERT_NAME = re.compile(r"^(.*\.deepspeed_experts\.)(\d+)\.(.+)$")
_GROUP_NAME = re.compile(r"^ep_size_(\d+)$")


def expert_files(tag_dir: Path) -> list[Path]:
    """The tag's per-expert weight files, ordered by (layer, global expert id)."""
    found = []
    for f in tag_dir.iterdir():
        match = EXPERT_FILE.match(f.name)
        if match:
            found.append((int(match.group(1) or 0), int(match.group(2)), f))
    return [f for _, _, f in sorted(found)]


def group_ep_size(hparams: dict[str, Any]) -> int:
    """The ep size of a DeepSpeed optimizer group (1 for a dense group)."""
    if not hparams.get("moe"):
        return 1
    match = _GROUP_NAME.match(str(hparams.get("name", "")))
    if match is None:
        raise ValueError(
            f"DeepSpeed optimizer group has moe=True but name={hparams.get('name')!r}, not "
            "'ep_size_<int>'; the checkpoint was not written by DeepSpeed's MoE layers."
        )
    return int(match.group(1))


def ep_rank_sources(ep_size: int, world_size: int, partition_count: int | None) -> list[list[int]]:
    """Per ep rank, the world ranks whose partitions make up its expert flat group."""
    if world_size % ep_size:
        raise ValueError(
            f"DeepSpeed checkpoint has {world_size} ZeRO optimizer files but an expert group of "
            f"ep_size={ep_size}, which must divide it; the checkpoint is incomplete."
        )
    edp = world_size // ep_size
    if partition_count is not None and int(partition_count) != edp:
        raise ValueError(
            f"DeepSpeed expert group of ep_size={ep_size} is partitioned over {partition_count} "
            f"ranks, but {world_size} ranks / ep {ep_size} gives {edp} expert_data ranks; only "
            "DeepSpeed's default E + D group layout (no tensor or pipeline parallelism) is read."
        )
    return [[k + ep_size * d for d in range(edp)] for k in range(ep_size)]


def globalise(names: list[str], ep_rank: int) -> dict[str, str]:
    """``local name -> global name`` for rank ``ep_rank``'s expert group parameter names
    (the number of local experts of each layer is read from the names themselves)."""
    num_local: dict[str, int] = {}
    for name in names:
        match = _EXPERT_NAME.match(name)
        if match is None:
            raise ValueError(
                f"DeepSpeed expert group holds {name!r}, which is not under a "
                "'.deepspeed_experts.<id>.' module; only DeepSpeed MoE layers are read."
            )
        prefix, local = match.group(1), int(match.group(2))
        num_local[prefix] = max(num_local.get(prefix, 0), local + 1)
    out = {}
    for name in names:
        match = _EXPERT_NAME.match(name)
        assert match is not None
        prefix, local, rest = match.group(1), int(match.group(2)), match.group(3)
        out[name] = f"{prefix}{ep_rank * num_local[prefix] + local}.{rest}"
    return out


def expert_suffix(name: str) -> str | None:
    """``name`` past its expert id (``"0.weight"`` of ``...deepspeed_experts.3.0.weight``)
    with its layer prefix, or None for a dense name: compares buffers across expert ids."""
    match = _EXPERT_NAME.match(name)
    return None if match is None else f"{match.group(1)}*.{match.group(3)}"


def with_expert_keys(module_keys: list[str], expert_keys: list[str]) -> list[str]:
    """State-dict order: each layer's expert keys right after the layer's other keys
    (its gate), as an ep-1 model lists them; a layer with no other keys at the end."""
    by_layer: dict[str, list[str]] = {}
    for key in expert_keys:
        layer = key.split(".deepspeed_moe.", 1)[0] if ".deepspeed_moe." in key else ""
        by_layer.setdefault(layer, []).append(key)
    last: dict[str, int] = {}
    for i, key in enumerate(module_keys):
        if ".deepspeed_moe." in key:
            last[key.split(".deepspeed_moe.", 1)[0]] = i
    out = list(module_keys)
    for layer, keys in sorted(by_layer.items(), key=lambda kv: -last.get(kv[0], len(out))):
        at = last[layer] + 1 if layer in last else len(out)
        out[at:at] = keys
    return out
