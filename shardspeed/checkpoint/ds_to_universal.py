"""DeepSpeed's ``ds_to_universal``: a ZeRO tag folder -> a universal checkpoint folder.

``python -m shardspeed.checkpoint.ds_to_universal --input_folder CKPT/global_step3
--output_folder CKPT_UNI/global_step3`` (DeepSpeed's CLI; its tuning flags are accepted and
ignored) reads a ZeRO 1/2/3 tag written by DeepSpeed or by ShardSpeed's DeepSpeed layout
(allow-list unpickler, DeepSpeed not needed) and writes the layout described in
:mod:`shardspeed.checkpoint.universal_checkpoint`, as DeepSpeed 0.19.8 does for a
data-parallel-only checkpoint: per-parameter files in the stage's form, ``optimizer_state.pt``,
the model states files copied, and ``latest_universal`` beside the output folder.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

import torch

from shardspeed.checkpoint.deepspeed_import import read_deepspeed_tag
from shardspeed.checkpoint.deepspeed_pickle import StaticLossScaler, save_pt
from shardspeed.checkpoint.format import KIND_MASTER
from shardspeed.checkpoint.universal_checkpoint import LATEST_UNIVERSAL, OPTIMIZER_STATE
from shardspeed.utils.io import atomic_write_text
from shardspeed.utils.logging import get_logger

logger = get_logger(__name__)

# stage 1/2 keys of a rank's optimizer state that are per-rank partitions, not global state
_SHARDED = ("base_optimizer_state", "param_slice_mappings", "single_partition_of_fp32_groups")


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input_folder", required=True, help="a ZeRO checkpoint tag folder")
    parser.add_argument("--output_folder", required=True, help="the universal tag folder")
    parser.add_argument("--num_extract_workers", type=int, default=4, help="ignored")
    parser.add_argument("--num_merge_workers", type=int, default=2, help="ignored")
    parser.add_argument("--keep_temp_folder", action="store_true", help="ignored")
    parser.add_argument("--strict", action="store_true", default=True, help="ignored")
    parser.add_argument("--inject_missing_state", action="store_true", help="ignored")
    return parser.parse_args(argv)


def _portable(optim: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed's objects as values any reader can unpickle (see ``deepspeed_pickle``)."""
    out = dict(optim)
    if "zero_stage" in out:
        out["zero_stage"] = int(out["zero_stage"])
    if "loss_scaler" in out:
        scaler = out["loss_scaler"]
        if getattr(scaler, "dynamic", False):
            raise ValueError(
                "the checkpoint has a dynamic (fp16) loss scaler; ds_to_universal here "
                "converts fp32 and bf16 checkpoints. Fix: use DeepSpeed's ds_to_universal."
            )
        out["loss_scaler"] = StaticLossScaler(float(getattr(scaler, "cur_scale", 1.0)))
    return out


def main(args: argparse.Namespace) -> None:
    """Convert ``args.input_folder`` into ``args.output_folder`` (DeepSpeed's entry point)."""
    source, target = Path(args.input_folder), Path(args.output_folder)
    read = read_deepspeed_tag(source)
    zero = target / "zero"
    zero.mkdir(parents=True, exist_ok=True)
    stage3 = read.stage == 3
    for entry in read.writer.entries:
        tensor = read.writer.tensors[entry["key"]].reshape(entry["shape"]).float()
        folder = zero / entry["name"]
        folder.mkdir(exist_ok=True)
        state = "fp32" if entry["kind"] == KIND_MASTER else entry["kind"]
        value = tensor.reshape(-1) if stage3 else {"param": tensor, "cat_dim": 0}
        save_pt(value, folder / f"{state}.pt")
    module = read.model["module"]
    if not stage3:
        for g, name_shapes in enumerate(read.model["param_shapes"]):
            record = read.scalars[g].get("step") if g < len(read.scalars) else None
            for name in name_shapes:
                if record is not None:
                    step = torch.tensor(record["value"], dtype=torch.float32)
                    save_pt(step, zero / name / "step.pt")
        for name, tensor in module.items():  # tied aliases, frozen parameters, buffers
            if not (zero / name / "fp32.pt").is_file():
                (zero / name).mkdir(exist_ok=True)
                save_pt({"param": tensor.float()}, zero / name / "fp32.pt")
    optim = _portable(read.optimizer)
    if stage3:
        optim.pop("fp32_flat_groups", None)
        inner = dict(optim["optimizer_state_dict"])
        inner["state"] = {k: {"step": v["step"]} for k, v in inner["state"].items() if "step" in v}
        optim["optimizer_state_dict"] = inner
        optim["param_groups"] = inner["param_groups"]
    else:
        optim["param_groups"] = read.optimizer["base_optimizer_state"]["param_groups"]
        for key in _SHARDED:
            optim.pop(key, None)
    save_pt(optim, zero / OPTIMIZER_STATE)
    for path in sorted(source.glob("*model_states.pt")):
        if not (path.name.startswith("layer_") or path.name.startswith("expert_")):
            shutil.copy2(path, target / path.name)
    atomic_write_text(target.parent / LATEST_UNIVERSAL, target.name)
    logger.info(f"wrote universal checkpoint {target}")


if __name__ == "__main__":
    main(parse_arguments())
