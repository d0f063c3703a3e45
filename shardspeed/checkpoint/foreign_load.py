"""Loading DeepSpeed-layout folders with ``load_checkpoint``: convert, then load natively.

``load_checkpoint`` reads ShardSpeed's manifest-indexed files. Two other folders load too:

* a **DeepSpeed ZeRO tag** (``mp_rank_00_model_states.pt`` / ``zero_pp_rank_*`` files and no
  ``manifest.json``: written by DeepSpeed, or ShardSpeed's DeepSpeed layout with the native
  files removed) when the folder has no finished native tag;
* a **universal checkpoint** when the config says ``"checkpoint": {"load_universal": true}``.

Each rank converts the folder into a private temporary ShardSpeed checkpoint
(:func:`~shardspeed.checkpoint.deepspeed_import.import_deepspeed_checkpoint`,
:func:`~shardspeed.checkpoint.universal_checkpoint.import_universal_checkpoint`), loads it
as usual (any world size and stage) and deletes it. Cost: every rank reads the whole folder
and holds the full fp32 model and optimizer state once, on the host.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from shardspeed.checkpoint.deepspeed_import import (
    _model_states_file,
    import_deepspeed_checkpoint,
)
from shardspeed.checkpoint.format import LATEST, MANIFEST, resolve_tag
from shardspeed.checkpoint.integrity import inside, read_tag_file
from shardspeed.checkpoint.universal_checkpoint import (
    import_universal_checkpoint,
    resolve_universal_tag,
)
from shardspeed.utils.logging import get_logger

logger = get_logger(__name__)


def wants_universal(engine: Any) -> bool:
    cfg = getattr(getattr(engine, "_config", None), "checkpoint", None)
    return bool(cfg is not None and cfg.load_universal)


def deepspeed_tag(load_dir: Path, tag: str | None) -> str | None:
    """The DeepSpeed ZeRO tag to import from ``load_dir``, or None when ``load_dir`` has a
    finished native tag (or nothing DeepSpeed wrote)."""
    if tag is None:
        if resolve_tag(load_dir, None) is not None or not (load_dir / LATEST).is_file():
            return None
        tag = read_tag_file(load_dir / LATEST)
    elif (load_dir / tag / MANIFEST).is_file():
        return None
    tag_dir = inside(load_dir, tag, "DeepSpeed tag")
    return tag if tag_dir.is_dir() and _model_states_file(tag_dir) is not None else None


@contextmanager
def staged_checkpoint(
    engine: Any, load_dir: Path, tag: str | None
) -> Iterator[tuple[Path, str | None]]:
    """Yield ``(dir, tag)`` for the native loader: ``load_dir``/``tag`` themselves, or a
    temporary conversion of a universal or DeepSpeed ZeRO folder (deleted afterwards)."""
    if wants_universal(engine):
        tag = resolve_universal_tag(load_dir, tag)
        convert = lambda out: import_universal_checkpoint(load_dir / tag, out, tag)  # noqa: E731
        what = "universal"
    else:
        ds_tag = deepspeed_tag(load_dir, tag)
        if ds_tag is None:
            yield load_dir, tag
            return
        tag = ds_tag
        convert = lambda out: import_deepspeed_checkpoint(load_dir, out, tag)  # noqa: E731
        what = "DeepSpeed ZeRO"
    tmp = Path(tempfile.mkdtemp(prefix="shardspeed-import-"))
    try:
        logger.info(f"converting {what} checkpoint {load_dir / tag} for loading")
        convert(tmp)
        yield tmp, tag
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
