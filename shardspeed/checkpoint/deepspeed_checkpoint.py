"""DeepSpeed's ``DeepSpeedCheckpoint``: inspect a ZeRO checkpoint tag folder.

Reads a data-parallel ZeRO tag (written by DeepSpeed, or by ShardSpeed with
``"checkpoint": {"layout": "deepspeed"}``) through the allow-list unpickler; DeepSpeed is
not needed. Pipeline (``layer_*``) and tensor-parallel (``mp_rank_01``...) tags report their
degrees, but their per-layer reshaping helpers are not provided: load such checkpoints with
DeepSpeed, or convert them with its ``ds_to_universal``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from shardspeed.checkpoint.deepspeed_import import _load_trusted

UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"
ITERATION_KEY = "iteration"
_ZERO_RE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MP_RE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")


class DeepSpeedCheckpoint:
    """A ZeRO tag folder: its files, parallel degrees and per-rank optimizer states."""

    def __init__(
        self,
        dir: str,  # noqa: A002 - DeepSpeed's argument name
        tp_degree: int | None = None,
        pp_degree: int | None = None,
        dp_degree: int | None = None,
    ) -> None:
        self.dir = str(dir)
        root = Path(dir)
        self.file_list = sorted(str(p) for p in root.iterdir() if p.is_file())
        names = [Path(f).name for f in self.file_list]
        self.zero_files = [f for f, n in zip(self.file_list, names) if _ZERO_RE.match(n)]
        self.mp_rank_files = [f for f, n in zip(self.file_list, names) if _MP_RE.match(n)]
        if not self.mp_rank_files:  # stage 3: one model states file per data-parallel rank
            self.mp_rank_files = [str(root / "zero_pp_rank_0_mp_rank_00_model_states.pt")]
        self.layer_files = [f for f, n in zip(self.file_list, names) if n.startswith("layer_")]
        self.global_state = _load_trusted(Path(self.mp_rank_files[0]))
        dp_ranks = {int(_ZERO_RE.match(Path(f).name).group(1)) for f in self.zero_files}
        tp_ranks = {int(_ZERO_RE.match(Path(f).name).group(2)) for f in self.zero_files}
        self.original_tp_degree = max(len(tp_ranks), 1)
        self.original_pp_degree = 1
        self.original_dp_degree = max(len(dp_ranks), 1)
        self.tp_degree = tp_degree or self.original_tp_degree
        self.pp_degree = pp_degree or self.original_pp_degree
        self.dp_degree = dp_degree or self.original_dp_degree
        self.original_world_size = (
            self.original_tp_degree * self.original_pp_degree * self.original_dp_degree
        )
        self.world_size = self.tp_degree * self.pp_degree * self.dp_degree
        self.zero_stage = 0
        if self.zero_files:
            optim = self.get_zero_checkpoint_state(0, 0, 0)["optimizer_state_dict"]
            self.zero_stage = int(optim.get("zero_stage", 0))

    def is_change_tp_degree(self) -> bool:
        return self.tp_degree != self.original_tp_degree

    def is_change_pp_degree(self) -> bool:
        return self.pp_degree != self.original_pp_degree

    def is_change_dp_degree(self) -> bool:
        return self.dp_degree != self.original_dp_degree

    def get_iteration(self) -> int:
        """``iteration`` (Megatron's key) if the model states hold it, else ``global_steps``."""
        return int(self.global_state.get(ITERATION_KEY, self.global_state.get("global_steps", 0)))

    def get_checkpoint_info(self, info_key: str = UNIVERSAL_CHECKPOINT_INFO) -> Any:
        return self.global_state.get(info_key)

    def get_zero_files(self, pp_index: int, tp_index: int, dp_index: int) -> list[str]:
        return [
            f
            for f in self.zero_files
            if (m := _ZERO_RE.match(Path(f).name))
            and (int(m.group(1)), int(m.group(2))) == (dp_index, tp_index)
        ]

    def get_zero_checkpoint_state(
        self, pp_index: int, tp_index: int, dp_index: int, strip_tensor_paddings: bool = True
    ) -> dict[str, Any]:
        """Rank ``dp_index``'s ZeRO file (``{"optimizer_state_dict": ..., "ds_config", ...}``).
        ``strip_tensor_paddings`` is accepted for DeepSpeed's signature: ShardSpeed's and
        DeepSpeed 0.19's files already store the fp32 partitions without padding."""
        del pp_index, strip_tensor_paddings
        files = self.get_zero_files(0, tp_index, dp_index)
        if not files:
            raise ValueError(
                f"no ZeRO optimizer file for dp rank {dp_index}, tp rank {tp_index} in "
                f"{self.dir!r} (dp degree {self.original_dp_degree}); pass an index in range."
            )
        return _load_trusted(Path(files[0]))
