"""DeepSpeed's ``deepspeed.utils.zero_to_fp32`` (users import it from
:mod:`shardspeed.utils.zero_to_fp32`), mapped onto ShardSpeed's checkpoint consolidation
(:mod:`shardspeed.checkpoint.consolidate`).

The three functions keep DeepSpeed's signatures and read a checkpoint written by
``engine.save_checkpoint`` on any number of ranks, on one CPU. As a script::

    python -m shardspeed.utils.zero_to_fp32 CHECKPOINT_DIR OUTPUT_DIR [--safe_serialization]

``save_checkpoint`` also copies this file next to ZeRO checkpoints as DeepSpeed's
``zero_to_fp32.py`` (:mod:`shardspeed.checkpoint.recovery_script`), so it runs as a plain
script too: absolute imports only.
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

from shardspeed.checkpoint.consolidate import (
    _tag_dir,
    convert_to_fp32_files,
    get_fp32_state_dict_from_checkpoint,
)
from shardspeed.checkpoint.deepspeed_import import import_deepspeed_checkpoint
from shardspeed.checkpoint.deepspeed_layout import model_states_name
from shardspeed.checkpoint.foreign_load import deepspeed_tag
from shardspeed.checkpoint.format import KIND_MASTER, KIND_PARAM, load_manifest
from shardspeed.utils.logging import logger

PathLike = str | os.PathLike[str]


def _frozen_names(checkpoint_dir: PathLike, tag: str | None) -> set[str]:
    """Parameters saved without an fp32 master: the ones that were not trained."""
    index = load_manifest(_tag_dir(checkpoint_dir, tag))["index"]
    return {
        name
        for name, entry in index.items()
        if KIND_PARAM in entry["kinds"] and KIND_MASTER not in entry["kinds"]
    }


def get_model_state_file(checkpoint_dir: PathLike, zero_stage: int) -> str:
    """DeepSpeed's model states file of tag folder ``checkpoint_dir`` at ``zero_stage``
    (written with ``"checkpoint": {"layout": "deepspeed"}``; PyTorch Lightning reads it)."""
    tag_dir = Path(checkpoint_dir)
    if not tag_dir.is_dir():
        raise FileNotFoundError(f"directory {str(tag_dir)!r} does not exist")
    file = tag_dir / model_states_name(3 if int(zero_stage) == 3 else 1)
    if not file.is_file():
        raise FileNotFoundError(
            f"{str(file)!r} not found: {str(tag_dir)!r} is not a DeepSpeed-layout ZeRO-"
            f'{int(zero_stage)} tag. Save with "checkpoint": {{"layout": "deepspeed"}}.'
        )
    return str(file)


def get_optim_files(checkpoint_dir: PathLike) -> list[str]:
    """DeepSpeed's ``*_optim_states.pt`` files of tag folder ``checkpoint_dir``, in rank order."""
    found = sorted(
        Path(checkpoint_dir).glob("*_optim_states.pt"),
        key=lambda p: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)],
    )
    if not found:
        raise FileNotFoundError(
            f"no *_optim_states.pt files in {str(checkpoint_dir)!r}: not a DeepSpeed-layout "
            'ZeRO tag. Save with "checkpoint": {"layout": "deepspeed"}.'
        )
    return [str(f) for f in found]


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: PathLike,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
    lazy_mode: bool = False,
) -> dict[str, torch.Tensor]:
    """The checkpoint's full fp32 state dict (loads with ``model.load_state_dict``).

    ``tag`` defaults to the latest checkpoint; ``exclude_frozen_parameters`` drops the
    parameters that have no optimizer master. ``lazy_mode`` is accepted for DeepSpeed's
    signature: the tensors are real (``.contiguous()`` on them is a no-op), and the
    streaming :func:`shardspeed.checkpoint.iter_fp32_state_dict` is the memory-frugal path.
    """
    del lazy_mode
    ds_tag = deepspeed_tag(Path(checkpoint_dir), tag)
    if ds_tag is not None:  # DeepSpeed's files only: import them first
        with tempfile.TemporaryDirectory(prefix="shardspeed-import-") as tmp:
            import_deepspeed_checkpoint(checkpoint_dir, tmp, ds_tag)
            return get_fp32_state_dict_from_zero_checkpoint(tmp, ds_tag, exclude_frozen_parameters)
    state = get_fp32_state_dict_from_checkpoint(checkpoint_dir, tag)
    if exclude_frozen_parameters:
        for name in _frozen_names(checkpoint_dir, tag):
            state.pop(name, None)
    return state


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: PathLike,
    output_dir: PathLike,
    max_shard_size: str | int = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> None:
    """Write the fp32 weights into ``output_dir`` in Hugging Face's layout:
    ``pytorch_model.bin`` (``model.safetensors`` with ``safe_serialization``), or shards of
    at most ``max_shard_size`` with an index json."""
    if exclude_frozen_parameters and _frozen_names(checkpoint_dir, tag):
        raise ValueError(
            "convert_zero_checkpoint_to_fp32_state_dict(exclude_frozen_parameters=True): this "
            "checkpoint holds frozen parameters and the streaming conversion writes every "
            "tensor. Fix: save with engine.save_checkpoint(..., exclude_frozen_parameters=True), "
            "or save get_fp32_state_dict_from_zero_checkpoint(..., exclude_frozen_parameters="
            "True) yourself."
        )
    convert_to_fp32_files(
        checkpoint_dir,
        output_dir,
        tag=tag,
        safetensors=safe_serialization,
        max_shard_size=max_shard_size,
    )


def load_state_dict_from_zero_checkpoint(
    model: torch.nn.Module, checkpoint_dir: PathLike, tag: str | None = None
) -> torch.nn.Module:
    """Move ``model`` to the CPU and load the checkpoint's fp32 weights into it
    (``strict=False``, as DeepSpeed); returns the model."""
    logger.info("Extracting fp32 weights from %s", checkpoint_dir)
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state_dict, strict=False)
    return model


def main(argv: list[str] | None = None) -> Any:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint_dir", help="the directory given to save_checkpoint")
    parser.add_argument("output_dir", help="where to write the consolidated fp32 weights")
    parser.add_argument("--max_shard_size", default="5GB")
    parser.add_argument("--safe_serialization", action="store_true")
    parser.add_argument("-t", "--tag", default=None)
    parser.add_argument("--exclude_frozen_parameters", action="store_true")
    args = parser.parse_args(argv)
    convert_zero_checkpoint_to_fp32_state_dict(
        args.checkpoint_dir,
        args.output_dir,
        max_shard_size=args.max_shard_size,
        safe_serialization=args.safe_serialization,
        tag=args.tag,
        exclude_frozen_parameters=args.exclude_frozen_parameters,
    )


if __name__ == "__main__":
    main()
