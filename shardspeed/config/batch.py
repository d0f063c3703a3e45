"""The batch-size triple: ``train_batch_size = micro_batch * grad_accum_steps * dp_world_size``.

DeepSpeed's rule (kept exactly): any two of the three given derive the third by integer
division, and the identity is then checked; only ``train_batch_size`` given means one
accumulation step and ``micro = train_batch_size // dp``; only the micro batch given means one
accumulation step; neither given is an error. Unlike DeepSpeed, a failure names every number,
says which values were derived and how, and proposes settings that would be consistent.
"""

from __future__ import annotations

from shardspeed.config.base import ConfigError, ConfigIssue, explain

TBS = "train_batch_size"
MICRO = "train_micro_batch_size_per_gpu"
GAS = "gradient_accumulation_steps"
BATCH_KEYS = (TBS, MICRO, GAS)

_DP_HINT = (
    "the data-parallel world size is the number of ranks / (tensor * pipeline * sequence "
    "parallel degrees); check the WORLD_SIZE your launcher exported"
)

# A tool that filled "auto" batch values counted one process while dp > 1: what Accelerate
# does on a CPU-only machine unless it is told the job is a CPU job.
_ONE_PROCESS_HINT = (
    f"{TBS} equals {MICRO} * {GAS}, as if for one process: when the Hugging Face Trainer or "
    "Accelerate filled these values on a machine without GPUs, pass use_cpu=True "
    "(`--use_cpu`) to TrainingArguments, or create accelerate.PartialState(cpu=True) before "
    "the Accelerator, so Accelerate counts every rank (not the ACCELERATE_USE_CPU variable: "
    "it turns DeepSpeed off)"
)


def _error(path: str, message: str) -> ConfigError:
    return ConfigError.from_issues([ConfigIssue(path, message)], header="Invalid batch size")


def check_batch_given(tbs: int | None, micro: int | None, gas: int | None) -> None:
    """Checks that need no world size: when all three are given, tbs must be a multiple of
    micro * gas (the quotient is the data-parallel size they imply)."""
    if tbs is None or micro is None or gas is None:
        return
    if tbs % (micro * gas) != 0:
        raise _error(
            TBS,
            explain(
                f"{TBS} ({tbs}) must be a multiple of {MICRO} ({micro}) * {GAS} ({gas}) = "
                f"{micro * gas}; the quotient is the data-parallel world size",
                fix=f"remove '{TBS}' so it is derived, or make it {micro * gas} * <dp world size>",
            ),
        )


def resolve_batch_triple(
    tbs: int | None, micro: int | None, gas: int | None, dp_world_size: int
) -> tuple[int, int, int]:
    """Return ``(train_batch_size, micro_batch_per_gpu, grad_accum_steps)`` for a world size.

    Raises:
        ConfigError: if neither tbs nor micro is given, or the values are inconsistent; the
            message contains all the numbers, e.g. ``train_batch_size (10) must equal
            train_micro_batch_size_per_gpu (3) * gradient_accumulation_steps (2) *
            data-parallel world size (1) = 6``.
    """
    if isinstance(dp_world_size, bool) or not isinstance(dp_world_size, int) or dp_world_size < 1:
        raise ConfigError(
            explain(
                "dp_world_size must be a positive integer",
                dp_world_size,
                fix="pass the number of data-parallel ranks (world size / (tp * pp * sp))",
            )
        )
    dp = dp_world_size
    derived: list[str] = []
    if tbs is not None and micro is not None and gas is not None:
        pass
    elif tbs is not None and micro is not None:
        gas = tbs // micro // dp
        derived.append(f"{GAS} = {TBS} // {MICRO} // dp = {tbs} // {micro} // {dp} = {gas}")
    elif tbs is not None and gas is not None:
        micro = tbs // dp // gas
        derived.append(f"{MICRO} = {TBS} // dp // {GAS} = {tbs} // {dp} // {gas} = {micro}")
    elif micro is not None and gas is not None:
        tbs = micro * gas * dp
    elif tbs is not None:
        gas = 1
        micro = tbs // dp
        derived.append(f"{GAS} = 1 and {MICRO} = {TBS} // dp = {tbs} // {dp} = {micro}")
    elif micro is not None:
        gas = 1
        tbs = micro * dp
    else:
        raise _error(
            TBS,
            explain(
                f"either '{TBS}' or '{MICRO}' must be given"
                + (f" ('{GAS}' = {gas} alone is not enough)" if gas is not None else ""),
                fix=f'add "{MICRO}": <per-rank batch> (and optionally "{GAS}"); '
                '"auto" values count as not given and must be filled in by the caller '
                "(the Hugging Face Trainer does this)",
            ),
        )

    assert tbs is not None and micro is not None and gas is not None
    if micro < 1:
        raise _error(
            MICRO,
            explain(
                f"{MICRO} was derived as {micro} ({'; '.join(derived)}): {TBS} ({tbs}) is "
                f"smaller than {GAS} ({gas}) * data-parallel world size ({dp})",
                fix=f"raise {TBS} to at least {gas * dp} or lower {GAS}; {_DP_HINT}",
            ),
        )
    if gas < 1:
        options = f"raise {TBS} to at least {micro * dp}"
        if tbs // dp >= 1:
            options += f" or lower {MICRO} to at most {tbs // dp}"
        raise _error(
            GAS,
            explain(
                f"{GAS} was derived as {gas} ({'; '.join(derived)}): {TBS} ({tbs}) is "
                f"smaller than {MICRO} ({micro}) * data-parallel world size ({dp})",
                fix=f"{options}; {_DP_HINT}",
            ),
        )
    product = micro * gas * dp
    if tbs != product:
        core = (
            f"{TBS} ({tbs}) must equal {MICRO} ({micro}) * {GAS} ({gas}) * "
            f"data-parallel world size ({dp}) = {product}"
        )
        how = f" (derived: {'; '.join(derived)})" if derived else ""
        options = [f"set {TBS} to {product}"]
        if tbs % (micro * dp) == 0:
            options.append(f"set {GAS} to {tbs // (micro * dp)}")
        if tbs % (gas * dp) == 0:
            options.append(f"set {MICRO} to {tbs // (gas * dp)}")
        options.append(f"give only two of the three keys; {_DP_HINT}")
        if dp > 1 and tbs == micro * gas:
            options.append(_ONE_PROCESS_HINT)
        raise _error(TBS, explain(core + how, fix=", or ".join(options)))
    return tbs, micro, gas
