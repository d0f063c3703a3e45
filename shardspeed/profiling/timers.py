"""Wall-clock timers for the training loop (DeepSpeed's ``SynchronizedWallClockTimer``).

``Timers`` holds named timers; the engine times ``forward``, ``backward``,
``backward_inner``, ``backward_reduce``, ``step`` and ``allgather`` and, with
``wall_clock_breakdown``, logs a line such as
``forward: 12.31 ms | backward: 25.02 ms | step: 3.10 ms``. On a GPU every start/stop
synchronizes the device so the time covers the queued kernels, not just their launch.

``ThroughputTimer`` measures whole iterations and reports samples/s and tokens/s.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from shardspeed.accelerator import get_accelerator
from shardspeed.utils.logging import log_dist

ENGINE_TIMER_NAMES = (
    "forward",
    "backward",
    "backward_inner",
    "backward_reduce",
    "step",
    "allgather",
)


def _should_sync(synchronize: bool | None) -> bool:
    return get_accelerator().name == "cuda" if synchronize is None else synchronize


class Timer:
    """One named timer; accumulates the time between ``start()`` and ``stop()`` pairs."""

    def __init__(self, name: str, synchronize: bool | None = None) -> None:
        self.name = name
        self.synchronize = _should_sync(synchronize)
        self.started = False
        self._start = 0.0
        self._elapsed_s = 0.0
        self._count = 0

    def _now(self) -> float:
        if self.synchronize:
            get_accelerator().synchronize()
        return time.perf_counter()

    def start(self) -> None:
        """Start an interval (a second ``start`` without ``stop`` is an error)."""
        if self.started:
            raise RuntimeError(f"timer {self.name!r} was started twice without stop()")
        self._start = self._now()
        self.started = True

    def stop(self) -> None:
        """End the interval and add it to the total."""
        if not self.started:
            raise RuntimeError(f"timer {self.name!r} was stopped without start()")
        self._elapsed_s += self._now() - self._start
        self._count += 1
        self.started = False

    def reset(self) -> None:
        """Clear the total (a running interval keeps running)."""
        self._elapsed_s = 0.0
        self._count = 0

    def elapsed(self, reset: bool = True) -> float:
        """Total milliseconds over finished intervals (plus the running one, if any)."""
        total = self._elapsed_s
        if self.started:
            total += self._now() - self._start
        if reset:
            self.reset()
        return total * 1e3

    def mean(self) -> float:
        """Milliseconds per finished interval (0 if none)."""
        return self._elapsed_s * 1e3 / self._count if self._count else 0.0

    @property
    def count(self) -> int:
        """Number of finished intervals since the last reset."""
        return self._count


class Timers:
    """A group of named timers: ``timers('forward').start()`` ... ``timers.log([...])``."""

    def __init__(self, synchronize: bool | None = None) -> None:
        self.synchronize = synchronize
        self.timers: dict[str, Timer] = {}

    def __call__(self, name: str) -> Timer:
        """The timer called ``name`` (created on first use)."""
        if name not in self.timers:
            self.timers[name] = Timer(name, self.synchronize)
        return self.timers[name]

    def has(self, name: str) -> bool:
        return name in self.timers

    def __contains__(self, name: str) -> bool:
        return name in self.timers

    def get_mean(
        self, names: Iterable[str], normalizer: float = 1.0, reset: bool = True
    ) -> dict[str, float]:
        """``{name: elapsed ms / normalizer}`` for the timers that exist."""
        if normalizer <= 0:
            raise ValueError(f"Timers: normalizer must be > 0, got {normalizer}")
        return {
            name: self.timers[name].elapsed(reset=reset) / normalizer
            for name in names
            if name in self.timers
        }

    def log(
        self,
        names: Iterable[str],
        normalizer: float = 1.0,
        reset: bool = True,
        ranks: list[int] | None = None,
    ) -> str:
        """Log and return ``"forward: 12.31 ms | backward: 25.02 ms | ..."``.

        Each value is the timer's elapsed milliseconds divided by ``normalizer`` (e.g. the
        number of micro-batches, for a per-micro-batch time). Unknown names are skipped.
        """
        means = self.get_mean(names, normalizer=normalizer, reset=reset)
        line = " | ".join(f"{name}: {ms:.2f} ms" for name, ms in means.items())
        if line:
            log_dist(line, ranks=ranks)
        return line


class ThroughputTimer:
    """Samples/s and tokens/s over training iterations (``start()`` / ``stop()`` per step).

    The first ``start_step - 1`` steps are not counted (warm-up). ``seq_length`` turns
    samples into tokens; ``stop(tokens=...)`` overrides it for variable-length batches.
    Every ``steps_per_output`` counted steps the rates are logged through ``logging_fn``.
    """

    def __init__(
        self,
        batch_size: int,
        seq_length: int | None = None,
        start_step: int = 2,
        steps_per_output: int = 50,
        synchronize: bool | None = None,
        logging_fn: Callable[[str], None] | None = None,
    ) -> None:
        if batch_size <= 0:
            raise ValueError(f"ThroughputTimer: batch_size must be > 0, got {batch_size}")
        self.batch_size = batch_size
        self.seq_length = seq_length
        self.start_step = start_step
        self.steps_per_output = steps_per_output
        self.logging_fn = logging_fn or (lambda msg: log_dist(msg))
        self._timer = Timer("throughput", synchronize)
        self.global_step_count = 0
        self.total_elapsed_s = 0.0
        self.total_samples = 0
        self.total_tokens = 0
        self.last_step_s = 0.0
        self._last_samples = 0
        self._last_tokens = 0

    def start(self) -> None:
        """Begin timing one iteration (an unfinished previous one is discarded)."""
        self._timer.started = False
        self._timer.reset()
        self._timer.start()

    def stop(
        self, global_step: bool = True, report_speed: bool = True, tokens: int | None = None
    ) -> None:
        """End the iteration; ``global_step=False`` for a micro-step that is not counted."""
        self._timer.stop()
        if not global_step:
            return
        self.global_step_count += 1
        self.last_step_s = self._timer.elapsed(reset=True) / 1e3
        if tokens is None and self.seq_length is not None:
            tokens = self.batch_size * self.seq_length
        self._last_samples, self._last_tokens = self.batch_size, tokens or 0
        if self.global_step_count < self.start_step:
            return
        self.total_elapsed_s += self.last_step_s
        self.total_samples += self.batch_size
        self.total_tokens += tokens or 0
        counted = self.global_step_count - self.start_step + 1
        if report_speed and self.steps_per_output and counted % self.steps_per_output == 0:
            self.logging_fn(self.summary())

    def avg_samples_per_sec(self) -> float:
        """Samples/s over the counted steps (0 before the first counted step)."""
        return self.total_samples / self.total_elapsed_s if self.total_elapsed_s else 0.0

    def avg_tokens_per_sec(self) -> float:
        """Tokens/s over the counted steps (0 without token counts)."""
        return self.total_tokens / self.total_elapsed_s if self.total_elapsed_s else 0.0

    def samples_per_sec(self) -> float:
        """Samples/s of the last step."""
        return self._last_samples / self.last_step_s if self.last_step_s else 0.0

    def tokens_per_sec(self) -> float:
        """Tokens/s of the last step."""
        return self._last_tokens / self.last_step_s if self.last_step_s else 0.0

    def summary(self) -> str:
        text = (
            f"step={self.global_step_count} samples/s: {self.avg_samples_per_sec():.2f} "
            f"(last {self.samples_per_sec():.2f})"
        )
        if self.total_tokens:
            text += (
                f" | tokens/s: {self.avg_tokens_per_sec():.1f} (last {self.tokens_per_sec():.1f})"
            )
        return text
