"""DeepSpeed's learning-rate schedules: same names, parameters, defaults and formulas.

Every schedule counts *optimizer* steps in ``last_batch_iteration`` (the engine steps it
once per gradient-accumulation boundary and not on an fp16-overflow step). It starts at
-1: construction writes the not-yet-started lr into ``optimizer.param_groups`` (for the
warmup schedules that is the iteration-0 value, ``warmup_min_lr``), and each ``step()``
advances the iteration by one and writes the new lr. So with ``WarmupLR`` (log warmup,
10 steps, max 1e-3) the lr seen by optimizer steps 1..5 is 0, 0, 0.301e-3, 0.477e-3,
0.602e-3. Every lr-like argument may be one value or a list with one value per group.
"""

from __future__ import annotations

import argparse
import inspect
import math
from typing import Any

import torch
from torch.optim import Optimizer

from shardspeed.utils.logging import get_logger, warning_once

logger = get_logger(__name__)

LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]
WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"

# DeepSpeed's names for the scheduler.params keys (and the matching command-line options)
LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST_MIN_LR = "lr_range_test_min_lr"
LR_RANGE_TEST_STEP_RATE = "lr_range_test_step_rate"
LR_RANGE_TEST_STEP_SIZE = "lr_range_test_step_size"
LR_RANGE_TEST_STAIRCASE = "lr_range_test_staircase"
EDGE_VALUE = "edge_value"
MID_VALUE = "mid_value"
CYCLE_FIRST_STEP_SIZE = "cycle_first_step_size"
CYCLE_FIRST_STAIR_COUNT = "cycle_first_stair_count"
CYCLE_SECOND_STEP_SIZE = "cycle_second_step_size"
CYCLE_SECOND_STAIR_COUNT = "cycle_second_stair_count"
DECAY_STEP_SIZE = "decay_step_size"
CYCLE_MIN_LR = "cycle_min_lr"
CYCLE_MAX_LR = "cycle_max_lr"
DECAY_LR_RATE = "decay_lr_rate"
CYCLE_MIN_MOM = "cycle_min_mom"
CYCLE_MAX_MOM = "cycle_max_mom"
DECAY_MOM_RATE = "decay_mom_rate"
WARMUP_MIN_LR = "warmup_min_lr"
WARMUP_MAX_LR = "warmup_max_lr"
WARMUP_NUM_STEPS = "warmup_num_steps"
WARMUP_TYPE = "warmup_type"
WARMUP_MIN_RATIO = "warmup_min_ratio"
COS_MIN_RATIO = "cos_min_ratio"
TOTAL_NUM_STEPS = "total_num_steps"


def _torch_optimizer(optimizer: Any) -> Optimizer:
    """The torch optimizer itself, or the one a wrapper holds as ``.optimizer``."""
    if isinstance(optimizer, Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, Optimizer):
        return inner
    raise TypeError(
        f"LR schedules need a torch.optim.Optimizer (or a wrapper with .optimizer); "
        f"got {type(optimizer).__name__}."
    )


def _per_group(optimizer: Optimizer, value: Any, name: str) -> list[Any]:
    """One value per param group: broadcast a scalar, or check a list's length."""
    num_groups = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != num_groups:
            raise ValueError(
                f"scheduler.params.{name} has {len(value)} values but the optimizer has "
                f"{num_groups} param groups; give one value or exactly {num_groups}."
            )
        return list(value)
    return [value] * num_groups


def _check_warmup(warmup_num_steps: Any, warmup_type: str) -> int:
    if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int):
        raise ValueError(
            f"scheduler.params.warmup_num_steps={warmup_num_steps!r} must be a positive integer."
        )
    if warmup_num_steps <= 0:
        raise ValueError(
            f"scheduler.params.warmup_num_steps={warmup_num_steps} must be a positive integer "
            "(the number of optimizer steps to warm up over); use e.g. 1000."
        )
    if warmup_type not in (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE):
        raise ValueError(
            f"scheduler.params.warmup_type={warmup_type!r} is not supported; use 'log' or 'linear'."
        )
    return max(2, warmup_num_steps)  # log warmup divides by ln(W): W >= 2


def _warmup_gamma(iteration: int, warmup_num_steps: int, warmup_type: str) -> float:
    """Fraction of the warmup done at ``iteration`` (0 at iteration 0, < 1 before W)."""
    if warmup_type == WARMUP_LOG_RATE:
        return math.log(iteration + 1) / math.log(warmup_num_steps)
    return iteration / warmup_num_steps


class _Schedule:
    """Shared bookkeeping: iteration counter, writing lrs, state dict."""

    def __init__(self, optimizer: Any, last_batch_iteration: int = -1) -> None:
        self.optimizer = _torch_optimizer(optimizer)
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[float] = []

    def get_lr(self) -> list[float]:
        """The lr of each param group at ``last_batch_iteration``."""
        raise NotImplementedError

    def get_last_lr(self) -> list[float]:
        """The lrs most recently written into the optimizer."""
        return list(self._last_lr)

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance to ``last_batch_iteration`` (default: the next one) and write its lr."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._apply()

    def state_dict(self) -> dict[str, int]:
        """``{'last_batch_iteration': n}``, as DeepSpeed saves it."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the iteration and write its lr into the optimizer."""
        self.last_batch_iteration = int(state_dict["last_batch_iteration"])
        self._apply()

    def _apply(self) -> None:
        lrs = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)  # keep tensor lrs (fused/capturable kernels) tensors
            else:
                group["lr"] = lr
        self._last_lr = [float(lr) for lr in lrs]


class WarmupLR(_Schedule):
    """Warm the lr from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps``, then hold.

    ``gamma = ln(i + 1) / ln(W)`` (log) or ``i / W`` (linear); ``lr = min + (max - min) * gamma``
    for ``i < W``, else ``max``. ``warmup_max_lr=None`` uses each group's current lr.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.warmup_num_steps = _check_warmup(warmup_num_steps, warmup_type)
        self.warmup_type = warmup_type
        if warmup_max_lr is None:
            warmup_max_lr = [float(g["lr"]) for g in self.optimizer.param_groups]
        self.min_lrs = _per_group(self.optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(self.optimizer, warmup_max_lr, "warmup_max_lr")
        self._apply()

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_gamma(iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def get_lr(self) -> list[float]:
        gamma = self._gamma(max(self.last_batch_iteration, 0))
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """:class:`WarmupLR`, then linear decay to 0 at ``total_num_steps``.

    After warmup ``gamma = max(0, (T - i) / max(1, T - W))``.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(
            optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
            last_batch_iteration,
        )  # fmt: skip
        if total_num_steps < self.warmup_num_steps:
            warning_once(
                f"WarmupDecayLR: total_num_steps={total_num_steps} is less than "
                f"warmup_num_steps={warmup_num_steps}; the lr decays right after warmup."
            )

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_gamma(iteration, self.warmup_num_steps, self.warmup_type)
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        return max(0.0, (self.total_num_steps - iteration) / decay_steps)


class WarmupCosineLR(_Schedule):
    """Warm up a ratio of each group's initial lr, then cosine-decay it to ``cos_min_ratio``.

    Warmup (``i < W``): ``ratio = wmr + (1 - wmr) * gamma``. After:
    ``ratio = cmr + (1 - cmr) * (1 + cos(pi * min(1, (i - W + 1) / max(1, T - W)))) / 2``.
    ``lr = ratio * lr_of_the_group_at_construction``.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float | list[float] = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float | list[float] = 0.0001,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.warmup_num_steps = _check_warmup(warmup_num_steps, warmup_type)
        self.warmup_type = warmup_type
        self.total_num_steps = total_num_steps
        self.warmup_min_ratios = _per_group(self.optimizer, warmup_min_ratio, "warmup_min_ratio")
        self.cos_min_ratios = _per_group(self.optimizer, cos_min_ratio, "cos_min_ratio")
        self.org_lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
        if total_num_steps < self.warmup_num_steps:
            warning_once(
                f"WarmupCosineLR: total_num_steps={total_num_steps} is less than "
                f"warmup_num_steps={warmup_num_steps}; the lr drops to cos_min_ratio after warmup."
            )
        self._apply()

    def get_lr_ratios(self) -> list[float]:
        """The multiplier of each group's initial lr at ``last_batch_iteration``."""
        i = max(self.last_batch_iteration, 0)
        if i < self.warmup_num_steps:
            gamma = _warmup_gamma(i, self.warmup_num_steps, self.warmup_type)
            return [wmr + (1.0 - wmr) * gamma for wmr in self.warmup_min_ratios]
        progress = min(
            1.0,
            (i - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps),
        )
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return [max(0.0, cmr + (1.0 - cmr) * cosine) for cmr in self.cos_min_ratios]

    def get_lr(self) -> list[float]:
        return [lr * ratio for lr, ratio in zip(self.org_lrs, self.get_lr_ratios())]


class LRRangeTest(_Schedule):
    """Grow the lr from ``lr_range_test_min_lr`` to find the largest stable lr.

    ``lr = min_lr * (1 + step_rate * interval)``, ``interval = (i + 1) / step_size``
    (floored when ``lr_range_test_staircase``).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        lr_range_test_min_lr: float | list[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        if lr_range_test_step_size <= 0:
            raise ValueError(
                f"scheduler.params.lr_range_test_step_size={lr_range_test_step_size} must be > 0."
            )
        self.min_lrs = _per_group(self.optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        self._apply()

    def get_lr(self) -> list[float]:
        interval = (self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [lr * (1.0 + self.step_rate * interval) for lr in self.min_lrs]


class OneCycle(_Schedule):
    """1Cycle: lr rises min -> max over ``cycle_first_step_size`` steps, falls back over
    ``cycle_second_step_size``, then decays as ``min_lr / (1 + decay_lr_rate * n / decay_step_size)``
    (``n`` = steps after the cycle; no decay while ``decay_step_size`` or the rate is 0).

    The cycle position uses ``i + 1``, so construction (``i = -1``) writes ``cycle_min_lr``.
    Stair counts > 0 hold the lr flat on that many stairs per half cycle. With
    ``cycle_momentum`` the momentum (``betas[0]``, or SGD's ``momentum``) moves inversely,
    ``cycle_max_mom`` -> ``cycle_min_mom`` -> ``cycle_max_mom``, then
    ``max_mom * (1 + decay_mom_rate * n / decay_step_size)``; ``betas[1]`` is left as set.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        cycle_min_lr: float | list[float],
        cycle_max_lr: float | list[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | list[float] = 0.8,
        cycle_max_mom: float | list[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        if cycle_second_step_size is None:
            cycle_second_step_size = cycle_first_step_size
        for name, size in (
            ("cycle_first_step_size", cycle_first_step_size),
            ("cycle_second_step_size", cycle_second_step_size),
        ):
            if size <= 0:
                raise ValueError(f"scheduler.params.{name}={size} must be > 0.")
        self.first_step_size = cycle_first_step_size
        self.second_step_size = cycle_second_step_size
        self.total_size = cycle_first_step_size + cycle_second_step_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (
            cycle_first_stair_count
            if cycle_second_stair_count is None
            else cycle_second_stair_count
        )
        self.decay_step_size = decay_step_size
        self.decay_lr_rate = decay_lr_rate
        self.decay_mom_rate = decay_mom_rate
        self.min_lrs = _per_group(self.optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(self.optimizer, cycle_max_lr, "cycle_max_lr")
        self.min_moms = _per_group(self.optimizer, cycle_min_mom, "cycle_min_mom")
        self.max_moms = _per_group(self.optimizer, cycle_max_mom, "cycle_max_mom")
        self.cycle_momentum = cycle_momentum and self._has_momentum()
        self._apply()

    def _has_momentum(self) -> bool:
        if all("betas" in g or "momentum" in g for g in self.optimizer.param_groups):
            return True
        warning_once(
            f"OneCycle: cycle_momentum is disabled because {type(self.optimizer).__name__} has "
            "neither 'betas' nor 'momentum' in its param groups."
        )
        return False

    def _scale(self) -> float:
        """Position in the cycle: 0 at cycle_min_lr, 1 at cycle_max_lr."""
        position = (self.last_batch_iteration + 1) % self.total_size
        if position <= self.first_step_size:
            offset, size, stairs = position, self.first_step_size, self.first_stair_count
        else:
            offset, size, stairs = (
                self.total_size - position,
                self.second_step_size,
                self.second_stair_count,
            )
        if stairs > 0:  # floor from integer offsets: exact at stair edges
            return math.floor(offset * stairs / size) / stairs
        return offset / size

    def _decay_interval(self) -> float:
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.decay_step_size == 0 or self.decay_lr_rate == 0:
            return list(self.min_lrs)
        return [lo / (1.0 + self.decay_lr_rate * self._decay_interval()) for lo in self.min_lrs]

    def get_mom(self) -> list[float] | None:
        """The momentum (``betas[0]``) of each group, or None without ``cycle_momentum``."""
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            return [hi - (hi - lo) * scale for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.decay_step_size == 0 or self.decay_mom_rate == 0:
            return list(self.max_moms)
        return [hi * (1.0 + self.decay_mom_rate * self._decay_interval()) for hi in self.max_moms]

    def _apply(self) -> None:
        super()._apply()
        moms = self.get_mom()
        if moms is None:
            return
        for group, mom in zip(self.optimizer.param_groups, moms):
            if "betas" in group:
                group["betas"] = (mom, *tuple(group["betas"])[1:])
            else:
                group["momentum"] = mom


def build_lr_scheduler(type_name: str, params: dict[str, Any] | None, optimizer: Any) -> Any:
    """Construct the schedule named by ds_config ``scheduler.type`` with ``scheduler.params``.

    Names in :data:`VALID_LR_SCHEDULES` match case-insensitively; any other name must be a
    ``torch.optim.lr_scheduler`` class (as in DeepSpeed). Unknown names, unknown or missing
    params raise ``ValueError`` naming the valid choices.
    """
    classes: dict[str, type] = {
        c.__name__.lower(): c
        for c in (LRRangeTest, OneCycle, WarmupLR, WarmupDecayLR, WarmupCosineLR)
    }
    cls = classes.get(str(type_name).lower())
    if cls is None:
        torch_cls = getattr(torch.optim.lr_scheduler, str(type_name), None)
        if not (
            isinstance(torch_cls, type)
            and issubclass(torch_cls, torch.optim.lr_scheduler.LRScheduler)
        ):
            raise ValueError(
                f"scheduler.type={type_name!r} is not a known LR schedule. Valid: "
                f"{', '.join(VALID_LR_SCHEDULES)}, or a torch.optim.lr_scheduler class name "
                "(e.g. 'CosineAnnealingLR')."
            )
        cls = torch_cls
        optimizer = _torch_optimizer(optimizer)
    kwargs = dict(params or {})
    _check_scheduler_kwargs(str(type_name), cls, kwargs)
    return cls(optimizer, **kwargs)


def _check_scheduler_kwargs(type_name: str, cls: type, kwargs: dict[str, Any]) -> None:
    parameters = list(inspect.signature(cls.__init__).parameters.values())[2:]  # self, optimizer
    accepted = [p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown and not any(p.kind is p.VAR_KEYWORD for p in parameters):
        raise ValueError(
            f"scheduler {type_name!r} does not accept scheduler.params key(s) {unknown}; "
            f"accepted keys: {accepted}."
        )
    missing = [
        p.name
        for p in parameters
        if p.default is p.empty
        and p.name not in kwargs
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if missing:
        raise ValueError(
            f"scheduler {type_name!r} needs scheduler.params key(s) {missing}; accepted keys: "
            f"{accepted}."
        )


# -- command-line tuning options (DeepSpeed's ``add_tuning_arguments`` and friends) -----------
# option -> (type, default, help); bools are store_true flags
_TUNING_OPTIONS: dict[str, tuple[type, Any, str]] = {
    LR_SCHEDULE: (str, None, "LR schedule for training."),
    LR_RANGE_TEST_MIN_LR: (float, 0.001, "Starting lr value."),
    LR_RANGE_TEST_STEP_RATE: (float, 1.0, "scaling rate for LR range test."),
    LR_RANGE_TEST_STEP_SIZE: (int, 1000, "training steps per LR change."),
    LR_RANGE_TEST_STAIRCASE: (bool, False, "use staircase scaling for LR range test."),
    CYCLE_FIRST_STEP_SIZE: (int, 1000, "size of first step of 1Cycle schedule (training steps)."),
    CYCLE_FIRST_STAIR_COUNT: (int, -1, "first stair count for 1Cycle schedule."),
    CYCLE_SECOND_STEP_SIZE: (int, -1, "size of second step of 1Cycle schedule."),
    CYCLE_SECOND_STAIR_COUNT: (int, -1, "second stair count for 1Cycle schedule."),
    DECAY_STEP_SIZE: (int, 1000, "size of intervals for applying post cycle decay."),
    CYCLE_MIN_LR: (float, 0.01, "1Cycle LR lower bound."),
    CYCLE_MAX_LR: (float, 0.1, "1Cycle LR upper bound."),
    DECAY_LR_RATE: (float, 0.0, "post cycle LR decay rate."),
    "cycle_momentum": (bool, False, "Enable 1Cycle momentum schedule."),
    CYCLE_MIN_MOM: (float, 0.8, "1Cycle momentum lower bound."),
    CYCLE_MAX_MOM: (float, 0.9, "1Cycle momentum upper bound."),
    DECAY_MOM_RATE: (float, 0.0, "post cycle momentum decay rate."),
    WARMUP_MIN_LR: (float, 0, "WarmupLR minimum/initial LR value."),
    WARMUP_MAX_LR: (float, 0.001, "WarmupLR maximum LR value."),
    WARMUP_NUM_STEPS: (int, 1000, "WarmupLR step count for LR warmup."),
    WARMUP_TYPE: (str, WARMUP_LOG_RATE, "WarmupLR increasing function during warmup."),
    WARMUP_MIN_RATIO: (float, 0.01, "WarmupCosineLR: warmup starts at this ratio of the lr."),
    COS_MIN_RATIO: (float, 0.01, "WarmupCosineLR: cosine ends at this ratio of the lr."),
}

# which options each schedule family takes from the command line
_LR_RANGE_TEST_KEYS = (
    LR_RANGE_TEST_MIN_LR,
    LR_RANGE_TEST_STEP_RATE,
    LR_RANGE_TEST_STEP_SIZE,
    LR_RANGE_TEST_STAIRCASE,
)
_ONE_CYCLE_KEYS = (
    CYCLE_FIRST_STEP_SIZE,
    CYCLE_FIRST_STAIR_COUNT,
    CYCLE_SECOND_STEP_SIZE,
    CYCLE_SECOND_STAIR_COUNT,
    DECAY_STEP_SIZE,
    CYCLE_MIN_LR,
    CYCLE_MAX_LR,
    DECAY_LR_RATE,
    CYCLE_MIN_MOM,
    CYCLE_MAX_MOM,
    DECAY_MOM_RATE,
)
_WARMUP_LR_KEYS = (WARMUP_MIN_LR, WARMUP_MAX_LR, WARMUP_NUM_STEPS, WARMUP_TYPE)
_WARMUP_COSINE_KEYS = (WARMUP_NUM_STEPS, WARMUP_TYPE, WARMUP_MIN_RATIO, COS_MIN_RATIO)


def add_tuning_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's "Convergence Tuning" options (``--lr_schedule``, ``--warmup_max_lr``,
    ...; same names and defaults) to ``parser``; returns it."""
    group = parser.add_argument_group("Convergence Tuning", "Convergence tuning configurations")
    for name, (kind, default, help_text) in _TUNING_OPTIONS.items():
        if kind is bool:
            group.add_argument(f"--{name}", default=default, action="store_true", help=help_text)
        else:
            group.add_argument(f"--{name}", type=kind, default=default, help=help_text)
    return parser


def parse_arguments() -> tuple[argparse.Namespace, list[str]]:
    """Parse the tuning options from ``sys.argv``; returns (known, unknown arguments)."""
    return add_tuning_arguments(argparse.ArgumentParser()).parse_known_args()


def _override(args: Any, params: dict[str, Any], keys: tuple[str, ...]) -> None:
    for key in keys:
        value = getattr(args, key, None)
        if value is not None:
            params[key] = value


def override_lr_range_test_params(args: Any, params: dict[str, Any]) -> None:
    """Copy the ``LRRangeTest`` options set in ``args`` into ``params``."""
    _override(args, params, _LR_RANGE_TEST_KEYS)


def override_1cycle_params(args: Any, params: dict[str, Any]) -> None:
    """Copy the ``OneCycle`` options set in ``args`` into ``params``."""
    _override(args, params, _ONE_CYCLE_KEYS)


def override_warmupLR_params(args: Any, params: dict[str, Any]) -> None:  # noqa: N802
    """Copy the ``WarmupLR`` / ``WarmupDecayLR`` options set in ``args`` into ``params``."""
    _override(args, params, _WARMUP_LR_KEYS)


def override_warmupCosineLR_params(args: Any, params: dict[str, Any]) -> None:  # noqa: N802
    """Copy the ``WarmupCosineLR`` options (ratios, no absolute lr) into ``params``."""
    _override(args, params, _WARMUP_COSINE_KEYS)


def override_params(args: Any, params: dict[str, Any]) -> None:
    """Copy every schedule option set in ``args`` into ``params``."""
    for keys in (_LR_RANGE_TEST_KEYS, _ONE_CYCLE_KEYS, _WARMUP_LR_KEYS, _WARMUP_COSINE_KEYS):
        _override(args, params, keys)


def get_config_from_args(args: Any) -> tuple[dict[str, Any] | None, str | None]:
    """The ``scheduler`` block (``{"type", "params"}``) the command line describes, or
    ``(None, reason)`` when ``--lr_schedule`` is missing or unknown."""
    schedule = getattr(args, LR_SCHEDULE, None)
    if schedule is None:
        return None, f"--{LR_SCHEDULE} not specified on command line"
    if schedule not in VALID_LR_SCHEDULES:
        return None, f"{schedule} is not supported LR schedule"
    keys = {
        LR_RANGE_TEST: _LR_RANGE_TEST_KEYS,
        ONE_CYCLE: _ONE_CYCLE_KEYS,
        WARMUP_COSINE_LR: _WARMUP_COSINE_KEYS,
    }.get(schedule, _WARMUP_LR_KEYS)
    params: dict[str, Any] = {}
    _override(args, params, keys)
    return {"type": schedule, "params": params}, None


def get_lr_from_config(config: dict[str, Any]) -> tuple[float | None, str]:
    """The learning rate a ``scheduler`` block sets (range test: its min lr; 1Cycle: its
    max lr; warmup schedules: ``warmup_max_lr``), or ``(None, reason)``."""
    if "type" not in config:
        return None, "LR schedule type not defined in config"
    if "params" not in config:
        return None, "LR schedule params not defined in config"
    schedule, params = config["type"], config["params"]
    if schedule not in VALID_LR_SCHEDULES:
        return None, f"{schedule} is not a valid LR schedule"
    if schedule == WARMUP_COSINE_LR:
        return None, (
            f"{WARMUP_COSINE_LR} scales the optimizer learning rate by a ratio, so its params "
            "define no lr"
        )
    key = {LR_RANGE_TEST: LR_RANGE_TEST_MIN_LR, ONE_CYCLE: CYCLE_MAX_LR}.get(
        schedule, WARMUP_MAX_LR
    )
    return params[key], ""
