"""Resuming an elastic job: the latest committed checkpoint, at whatever world size it has now.

Under ``shardspeed --elastic`` torchrun restarts the workers whenever the membership changes
(a host lost, a host back). Each start of the training script calls :func:`resume_elastic`
once, after ``shardspeed.initialize``::

    engine, _, _, _ = shardspeed.initialize(model=model, config=config)
    resumed = resume_elastic(engine, save_dir, data_loader=loader)
    start = resumed.global_steps if resumed else 0

It loads the newest finished tag under ``save_dir`` (``latest``; a save that died midway is
skipped), resharded to this world size and ZeRO stage (ShardSpeed checkpoints load at any
world size and stage), and logs what changed. The global batch is the config's: with an
``elasticity`` block ``initialize`` already chose the micro batch and gradient accumulation
for this world size (``compute_elastic_config``), so ``micro x GAS x dp`` stays the same.

The data order is kept too. A ``DistributedSampler`` gives rank ``r`` of ``dp`` the samples
``perm[r::dp]`` of one permutation, so optimizer step ``s`` trains on exactly the samples
``perm[s * B:(s + 1) * B]`` for any ``micro x GAS x dp = B``. The loader (a
:class:`~shardspeed.runtime.dataloader.ShardSpeedDataLoader` with ``exact_resume=True``)
is moved to the first sample no step has trained on, counted in the new world's batches:
no sample is skipped or repeated (within an epoch; the sampler pads each epoch to a
multiple of ``dp``, so an epoch's last padded samples depend on it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardspeed.checkpoint.format import rank_stem, read_json, resolve_tag
from shardspeed.utils.logging import get_logger, log_dist

logger = get_logger(__name__)


class ElasticResumeError(ValueError):
    """The checkpoint cannot continue at this world size with the same data order."""


@dataclass(frozen=True)
class ElasticResume:
    """What :func:`resume_elastic` loaded, and how the job differs from the one that saved."""

    path: str
    global_steps: int
    global_samples: int
    saved_world_size: int
    world_size: int
    saved_stage: int
    stage: int
    saved_micro_batch: int
    micro_batch: int
    saved_gas: int
    gas: int
    train_batch_size: int
    data_epoch: int | None  # where the loader now is (None: no loader was moved)
    data_position: int | None

    def changes(self) -> str:
        """One line: ``world 2 -> 1, GAS 1 -> 2, ...`` (unchanged values once)."""
        pairs = [
            ("world", self.saved_world_size, self.world_size),
            ("ZeRO stage", self.saved_stage, self.stage),
            ("micro batch", self.saved_micro_batch, self.micro_batch),
            ("GAS", self.saved_gas, self.gas),
        ]
        return ", ".join(f"{n} {a} -> {b}" if a != b else f"{n} {a}" for n, a, b in pairs)


def latest_committed(save_dir: str | Path) -> str | None:
    """The tag :func:`resume_elastic` would load (None: nothing finished under ``save_dir``)."""
    return resolve_tag(save_dir, None) if Path(save_dir).is_dir() else None


def resume_elastic(
    engine: Any,
    save_dir: str | Path,
    *,
    data_loader: Any = None,
    **load_kwargs: Any,
) -> ElasticResume | None:
    """Load the latest committed checkpoint of ``save_dir`` into ``engine`` (any world size).

    Args:
        engine: the engine ``shardspeed.initialize`` returned, at the current world size.
        save_dir: the folder the job saves into (shared by every host).
        data_loader: the training loader to move past the trained samples; default the
            engine's own. It must resume exactly (``ShardSpeedDataLoader(exact_resume=True)``);
            another loader is left alone with a warning.
        load_kwargs: passed to ``engine.load_checkpoint``.

    Returns:
        None when ``save_dir`` holds no finished checkpoint (a fresh start), else what was
        loaded and what changed (also logged on rank 0).

    Raises:
        ElasticResumeError: the trained samples are not a whole number of this world's
            batches (the global batch changed), so the data order cannot continue.
    """
    tag = latest_committed(save_dir)
    if tag is None:
        log_dist(f"elastic resume: no finished checkpoint under {save_dir}; starting fresh")
        return None
    saved = read_json(Path(save_dir) / tag / f"{rank_stem(0)}.json")["engine"]
    path, _ = engine.load_checkpoint(str(save_dir), tag, **load_kwargs)
    micro = int(engine.train_micro_batch_size_per_gpu())
    dp = int(engine.dp_world_size)
    loader = data_loader if data_loader is not None else engine.training_dataloader
    epoch, position = _move_loader(loader, int(engine.global_samples), micro * dp)
    resumed = ElasticResume(
        path=str(path),
        global_steps=int(engine.global_steps),
        global_samples=int(engine.global_samples),
        saved_world_size=int(saved["dp_world_size"]),
        world_size=dp,
        saved_stage=int(saved["stage"]),
        stage=int(engine.stage),
        saved_micro_batch=_saved_micro_batch(saved),
        micro_batch=micro,
        saved_gas=int(saved["gradient_accumulation_steps"]),
        gas=int(engine.gradient_accumulation_steps()),
        train_batch_size=int(engine.train_batch_size()),
        data_epoch=epoch,
        data_position=position,
    )
    data = "data loader not moved" if epoch is None else f"data epoch {epoch} batch {position}"
    log_dist(
        f"elastic resume from {path} at step {resumed.global_steps} "
        f"({resumed.global_samples} samples, global batch {resumed.train_batch_size}): "
        f"{resumed.changes()}; {data}"
    )
    return resumed


def _saved_micro_batch(saved: dict[str, Any]) -> int:
    """The saving job's micro batch: its config's, else batch / (GAS x dp) from the counters
    (an ``elasticity`` block computes it, so the config may not hold it)."""
    micro = saved["config"].get("train_micro_batch_size_per_gpu")
    if isinstance(micro, int):
        return micro
    steps = int(saved["global_steps"])
    per_step = int(saved["global_samples"]) // steps if steps else 0
    return per_step // (int(saved["gradient_accumulation_steps"]) * int(saved["dp_world_size"]))


def _move_loader(loader: Any, samples: int, per_batch: int) -> tuple[int | None, int | None]:
    """Put an exact-resume loader at sample ``samples``; (epoch, batch) or (None, None)."""
    if loader is None:
        return None, None
    if not getattr(loader, "exact_resume", False):
        logger.warning(
            "elastic resume: the training loader does not resume exactly, so it starts its "
            "pass over and steps after the checkpoint repeat samples. Fix: build it as "
            "ShardSpeedDataLoader(..., exact_resume=True) and pass it as data_loader="
        )
        return None, None
    if samples % per_batch:
        raise ElasticResumeError(
            f"the checkpoint trained on {samples} samples, not a whole number of this world's "
            f"batches of {per_batch} (micro batch x data-parallel size), so the data order "
            "cannot continue. Fix: keep the global batch fixed across world sizes (an "
            "elasticity block, or train_batch_size with GAS that fits each world size)."
        )
    epoch, position = divmod(samples // per_batch, len(loader))
    loader.epoch, loader.position = epoch, position
    return epoch, position
