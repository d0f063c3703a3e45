"""The ``zero_to_fp32.py`` script that DeepSpeed writes next to each ZeRO checkpoint.

``save_checkpoint`` (rank 0, ZeRO stage >= 1 or bf16, as DeepSpeed) copies
:mod:`shardspeed.checkpoint.zero_to_fp32` (DeepSpeed's ``deepspeed.utils.zero_to_fp32``)
into the save directory as an executable ``zero_to_fp32.py``, so the habit
``cd CKPT && python zero_to_fp32.py . OUT_DIR`` keeps working. Unlike DeepSpeed's
self-contained script, this one imports shardspeed (the consolidation lives once, in
:mod:`shardspeed.checkpoint.consolidate`).
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from shardspeed.utils.logging import get_logger

logger = get_logger(__name__)

SCRIPT_NAME = "zero_to_fp32.py"


def _source() -> Path:
    return Path(__file__).resolve().with_name(SCRIPT_NAME)  # checkpoint/zero_to_fp32.py


def wants_recovery_script(stage: int, bf16: bool) -> bool:
    """DeepSpeed writes the script when ZeRO (stage >= 1) or bf16 is on."""
    return stage > 0 or bf16


def write_recovery_script(save_dir: str | os.PathLike[str]) -> Path:
    """Copy the script into ``save_dir`` and make it executable; returns its path."""
    target = Path(save_dir) / SCRIPT_NAME
    shutil.copyfile(_source(), target)
    try:
        os.chmod(target, os.stat(target).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    except OSError as err:  # some file shares refuse chmod; the script still runs via python
        logger.info(f"could not make {target} executable ({err}); run it with python")
    return target
