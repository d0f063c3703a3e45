"""1-bit LAMB (Li et al., 2021, arXiv:2104.06069): DeepSpeed's ``OneBitLamb``.

LAMB scales each parameter's Adam update by a trust ratio ``||p|| / ||u||``. 1-bit LAMB:

```
warm-up      t <= freeze_step: LAMB on the full-precision average of the gradients;
             per parameter, coeff_freeze = EMA(coeff_beta) of the clamped trust ratios
             (started at 0; divided by 1 - coeff_beta^k after k updates if bias_correction);
             at t == freeze_step v_fresh = v (a copy that keeps learning)
compression  t > freeze_step, v frozen:
             once: s_i = ||m_i|| / sqrt(n_i), c_i = mean_j(s_j) / s_i    (momentum scaling)
             m = beta1 m + (1 - beta1) g_local ; m_i *= c_i ; m = compressed_average(m) ; m_i /= c_i
             g~ = (m - beta1 m_prev) / (1 - beta1) ; v_fresh = EMA(beta2) of g~^2
             u = m_hat / (sqrt(v_hat) + eps) + wd p
             factor_i = max((sqrt(v) + eps) / (sqrt(v_fresh) + eps)) over parameter i, of the
                        raw (uncorrected) averages as in DeepSpeed, blended by the weight-decay share,
                        clamped to [factor_min, factor_max] and to last_factor * (1 +- factor_threshold)
             p_i -= lr * coeff_freeze_i * factor_i * u_i
```

The per-parameter quantities need parameter boundaries inside the engine's flat buckets:
the engine hands them over with :meth:`OnebitLamb.set_param_segments`. Without them each
bucket counts as one parameter (and a warning says so). The per-parameter scalars live in
the param groups (``lamb_coeff_freeze``, ``lamb_coeff_count``, ``last_factor``,
``scaling_coeff``: one list per master, one value per segment), which checkpoints store per rank.

Differences from DeepSpeed 0.19.6: no dummy first step; ``bias_correction`` honoured (as
:class:`~shardspeed.ops.lamb.Lamb`, which the warm-up equals), including the frozen trust
ratio: its EMA starts at 0, so it is divided by ``1 - coeff_beta ** updates`` (DeepSpeed
keeps 0.65 of the ratio after a 10-step warm-up); the momentum is compressed
per bucket rather than as one flat buffer of all parameters; a zero momentum scale gives
the coefficient 1 instead of a division by zero.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from shardspeed.optim.onebit.common import Key, OnebitOptimizer
from shardspeed.utils.logging import get_logger, warning_once

logger = get_logger(__name__)

SHORT_WARMUP_STEPS = 5  # freeze_step * (1 - coeff_beta) below this: warned (docs/onebit.md)

Segment = tuple[int, int]  # (offset, numel) of one parameter inside a master
_PER_SEGMENT_KEYS = ("lamb_coeff_freeze", "lamb_coeff_count", "last_factor", "scaling_coeff")


class OnebitLamb(OnebitOptimizer):
    """1-bit LAMB with DeepSpeed's ``OneBitLamb`` arguments.

    Args:
        params, lr, betas, eps, weight_decay, bias_correction, eps_inside_sqrt, amsgrad,
            cuda_aware, comm_backend_name, comm_group: as :class:`~shardspeed.optim.onebit.adam.OnebitAdam`.
        freeze_step: full-precision LAMB steps before compression starts.
        max_coeff, min_coeff: clamp of the warm-up trust ratio.
        coeff_beta: EMA rate of the trust ratio frozen for the compression stage.
        factor_max, factor_min: clamp of the compression-stage variance factor.
        factor_threshold: largest relative change of the factor per step.
    """

    _title = "OneBitLamb"
    elementwise = True  # per-parameter norms over set_param_segments(), not the bucket

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        freeze_step: int = 100000,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
        comm_group: Any = None,
    ) -> None:
        if int(freeze_step) < 0:
            raise ValueError(f"OneBitLamb: freeze_step={freeze_step!r} must be >= 0.")
        if not 0 <= min_coeff <= max_coeff:
            raise ValueError(
                f"OneBitLamb: need 0 <= min_coeff <= max_coeff, got min_coeff={min_coeff!r}, "
                f"max_coeff={max_coeff!r}."
            )
        if not 0 < factor_min <= factor_max:
            raise ValueError(
                f"OneBitLamb: need 0 < factor_min <= factor_max, got factor_min={factor_min!r}, "
                f"factor_max={factor_max!r}."
            )
        if not 0 <= coeff_beta < 1 or factor_threshold < 0:
            raise ValueError(
                f"OneBitLamb: coeff_beta={coeff_beta!r} must lie in [0, 1) and "
                f"factor_threshold={factor_threshold!r} must be >= 0."
            )
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=tuple(betas),
            eps=eps,
            eps_inside_sqrt=eps_inside_sqrt,
            weight_decay=weight_decay,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )
        self.freeze_step = int(freeze_step)
        self.coeff_beta = float(coeff_beta)
        self.factor_max = float(factor_max)
        self.factor_min = float(factor_min)
        self.factor_threshold = float(factor_threshold)
        long_enough = math.ceil(round(SHORT_WARMUP_STEPS / (1.0 - self.coeff_beta), 6))
        if 0 < self.freeze_step < long_enough:
            warning_once(
                f"OneBitLamb: freeze_step={self.freeze_step} is short for coeff_beta="
                f"{self.coeff_beta}: the frozen trust ratios and variance come from "
                f"{self.freeze_step} steps. Measured on 2-rank MLP regressions, freeze_step 10 "
                "ended at 0.77x-1.34x uncompressed LAMB's loss (DeepSpeed 0.19.6's OneBitLamb: "
                "0.55x-1.13x; docs/onebit.md, 'Short warm-ups'). Fix: "
                f"freeze_step >= {long_enough} "
                "(DeepSpeed's guidance: freeze_step >= 1 / (1 - coeff_beta), BERT used "
                "thousands).",
                __name__,
            )
        super().__init__(
            params,
            defaults,
            amsgrad=amsgrad,
            cuda_aware=cuda_aware,
            comm_backend_name=comm_backend_name,
            comm_group=comm_group,
        )
        for group in self.param_groups:  # present from the start so checkpoints restore them
            for name in _PER_SEGMENT_KEYS:
                group.setdefault(name, [])
        self._segments: dict[Key, list[Segment]] = {}
        self._warned_no_segments = False
        self._lamb_coeffs: list[float] = []

    # -- parameter boundaries ---------------------------------------------------------------
    def set_param_segments(
        self,
        segments: Sequence[Sequence[Sequence[tuple[int, int, int]]]],
        groups: Any = None,
        param_counts: Any = None,
    ) -> None:
        """Parameter boundaries: ``segments[group][master]`` lists ``(offset, numel,
        param_index)`` of every parameter inside that master (padding left out). ``groups``
        is for sharded masters, which 1-bit LAMB refuses (ZeRO stage 0 only); it must be
        None for every param group."""
        if groups is not None and any(g is not None for g in groups):
            raise ValueError("OneBitLamb steps whole parameters: it needs ZeRO stage 0.")
        self._segments = {
            (gi, pi): [(int(o), int(n)) for o, n, *_ in segs if n > 0]
            for gi, per_group in enumerate(segments)
            for pi, segs in enumerate(per_group)
        }

    def segments(self, key: Key, p: torch.Tensor) -> list[Segment]:
        segs = self._segments.get(key)
        if segs:
            return segs
        if not self._warned_no_segments:
            self._warned_no_segments = True
            logger.warning(
                "OneBitLamb: no parameter boundaries were given (set_param_segments); each "
                "flat bucket gets one trust ratio as if it were one parameter"
            )
        return [(0, p.numel())]

    def get_lamb_coeffs(self) -> list[float]:
        """Coefficients applied by the last :meth:`step`, one per parameter segment."""
        return list(self._lamb_coeffs)

    def _per_segment(self, group: dict[str, Any], name: str, pi: int, count: int, fill: float):
        """``group[name][pi]``: a list of ``count`` floats, (re)built with ``fill`` if absent."""
        table = group.setdefault(name, [])  # absent from checkpoints saved before the key
        while len(table) < len(group["params"]):
            table.append([])
        if len(table[pi]) != count:
            table[pi] = [fill] * count
        return table[pi]

    # -- the step ------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.check_replicated()
        self._lamb_coeffs = []
        items = list(self.masters())
        for key, _, p in items:
            state = self.state_of(key, p)
            if not state:
                state.update(
                    step=0,
                    variance_steps=0,
                    exp_avg=torch.zeros_like(p, memory_format=torch.preserve_format),
                    exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format),
                )
            state["step"] += 1
        if not items:
            return loss
        if self.state[items[0][2]]["step"] <= self.freeze_step:
            for key, group, p in items:
                self._warmup_step(key, group, p, self.state[p])
        else:
            self._ensure_scaling_coeffs(items)
            for key, group, p in items:
                self._compressed_step(key, group, p, self.state[p])
        return loss

    def _denom(self, v: torch.Tensor, group: dict[str, Any], steps: int) -> torch.Tensor:
        bc2 = 1.0 - group["betas"][1] ** steps if group["bias_correction"] else 1.0
        if group["eps_inside_sqrt"]:
            return (v / bc2).add_(group["eps"]).sqrt_()
        return (v / bc2).sqrt_().add_(group["eps"])

    def _momentum_hat(self, m: torch.Tensor, group: dict[str, Any], steps: int) -> torch.Tensor:
        bc1 = 1.0 - group["betas"][0] ** steps if group["bias_correction"] else 1.0
        return m / bc1

    def _warmup_step(
        self, key: Key, group: dict[str, Any], p: torch.Tensor, state: dict[str, Any]
    ) -> None:
        beta1, beta2 = group["betas"]
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        grad = self.average_(p.grad)
        exp_avg.lerp_(grad, 1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        state["variance_steps"] += 1
        if state["step"] == self.freeze_step:
            state["exp_avg_sq_fresh"] = exp_avg_sq.clone()
        update = self._momentum_hat(exp_avg, group, state["step"])
        update.div_(self._denom(exp_avg_sq, group, state["variance_steps"]))
        if group["weight_decay"] != 0.0:
            update.add_(p, alpha=group["weight_decay"])
        segs = self.segments(key, p)
        frozen = self._per_segment(group, "lamb_coeff_freeze", key[1], len(segs), 0.0)
        counts = self._per_segment(group, "lamb_coeff_count", key[1], len(segs), 0.0)
        norms = _segment_norms([p, update], segs)  # (2, num_segments)
        for s, ((offset, numel), (w_norm, u_norm)) in enumerate(zip(segs, norms.T.tolist())):
            coeff = 1.0
            if w_norm != 0 and u_norm != 0:
                coeff = min(max(w_norm / u_norm, group["min_coeff"]), group["max_coeff"])
            if coeff != 1.0:
                frozen[s] = self.coeff_beta * frozen[s] + (1.0 - self.coeff_beta) * coeff
                counts[s] += 1.0
            self._lamb_coeffs.append(coeff)
            p.narrow(0, offset, numel).add_(
                update.narrow(0, offset, numel), alpha=-group["lr"] * coeff
            )

    def _ensure_scaling_coeffs(self, items: list[tuple[Key, dict[str, Any], torch.Tensor]]) -> None:
        """Momentum scaling of the compression stage, fixed at its first step: brings every
        parameter's momentum to the same RMS so one compression scale suits them all."""
        if all(
            len(g["scaling_coeff"]) > k[1]
            and len(g["scaling_coeff"][k[1]]) == len(self.segments(k, p))
            for k, g, p in items
        ):
            return
        scales = []  # per master: per segment RMS of the momentum
        for key, _, p in items:
            segs = self.segments(key, p)
            norms = _segment_norms([self.state[p]["exp_avg"]], segs)[0].tolist()
            scales.append([n / math.sqrt(numel) for n, (_, numel) in zip(norms, segs)])
        flat = [s for per_master in scales for s in per_master]
        united = sum(flat) / len(flat)
        for (key, group, _), per_master in zip(items, scales):
            coeffs = self._per_segment(group, "scaling_coeff", key[1], len(per_master), 1.0)
            coeffs[:] = [united / s if s > 0 else 1.0 for s in per_master]

    def _compressed_step(
        self, key: Key, group: dict[str, Any], p: torch.Tensor, state: dict[str, Any]
    ) -> None:
        beta1, beta2 = group["betas"]
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        if "exp_avg_sq_fresh" not in state:  # freeze_step == 0
            state["exp_avg_sq_fresh"] = exp_avg_sq.clone()
        fresh = state["exp_avg_sq_fresh"]
        segs = self.segments(key, p)
        scaling = self._per_segment(group, "scaling_coeff", key[1], len(segs), 1.0)
        last = self._per_segment(group, "last_factor", key[1], len(segs), 1.0)
        frozen = self._per_segment(group, "lamb_coeff_freeze", key[1], len(segs), 0.0)
        counts = self._per_segment(group, "lamb_coeff_count", key[1], len(segs), 0.0)

        previous = exp_avg.clone()
        exp_avg.mul_(beta1).add_(p.grad, alpha=1.0 - beta1)
        _scale_segments_(exp_avg, segs, scaling)
        exp_avg.copy_(self.compressed_average(key, exp_avg))
        _scale_segments_(exp_avg, segs, [1.0 / c for c in scaling])

        grad_estimate = exp_avg.sub(previous, alpha=beta1).div_(1.0 - beta1)
        fresh.mul_(beta2).addcmul_(grad_estimate, grad_estimate, value=1.0 - beta2)
        denom = self._denom(exp_avg_sq, group, max(state["variance_steps"], 1))
        # the factor compares the raw averages, as DeepSpeed (bias-corrected ones overshoot:
        # measured 2.30 vs 2.83 final loss in benchmarks/onebit_bench.py at lr 1e-2)
        raw = exp_avg_sq.sqrt().add_(group["eps"])
        raw_fresh = fresh.sqrt().add_(group["eps"])
        update_prelim = self._momentum_hat(exp_avg, group, state["step"]).div_(denom)
        update = update_prelim
        if group["weight_decay"] != 0.0:
            update = update_prelim.add(p, alpha=group["weight_decay"])
        norms = _segment_norms([update_prelim, update], segs).T.tolist()
        ratio_max = torch.stack(
            [(raw.narrow(0, o, n) / raw_fresh.narrow(0, o, n)).max() for o, n in segs]
        ).tolist()
        for s, (offset, numel) in enumerate(segs):
            factor = ratio_max[s]
            prelim_norm, update_norm = norms[s]
            if group["weight_decay"] != 0.0 and update_norm > 0:
                share = min(1.0, prelim_norm / update_norm)
                factor = factor * share + (1.0 - share)
            factor = min(max(factor, self.factor_min), self.factor_max)
            factor = min(factor, last[s] * (1.0 + self.factor_threshold))
            factor = max(factor, last[s] * (1.0 - self.factor_threshold))
            last[s] = factor
            coeff = self._frozen_coeff(frozen[s], counts[s], group) * factor
            self._lamb_coeffs.append(coeff)
            p.narrow(0, offset, numel).add_(
                update.narrow(0, offset, numel), alpha=-group["lr"] * coeff
            )

    def _frozen_coeff(self, ema: float, count: float, group: dict[str, Any]) -> float:
        """The warm-up trust ratio frozen for the compression stage: the EMA (started at
        0) divided by ``1 - coeff_beta ** count`` when ``bias_correction`` is set, as Adam
        corrects its moments. DeepSpeed uses the raw EMA, which after ``freeze_step`` steps
        holds only ``1 - coeff_beta ** freeze_step`` of the ratio (0.65 at 10 steps)."""
        if not group["bias_correction"] or count <= 0:
            return ema
        return ema / (1.0 - self.coeff_beta**count)


def _segment_norms(tensors: list[torch.Tensor], segs: list[Segment]) -> torch.Tensor:
    """``(len(tensors), len(segs))`` fp32 L2 norms of every segment of every tensor."""
    return torch.stack(
        [
            torch.stack([torch.linalg.vector_norm(t.narrow(0, o, n).float()) for o, n in segs])
            for t in tensors
        ]
    )


def _scale_segments_(t: torch.Tensor, segs: list[Segment], factors: list[float]) -> None:
    for (offset, numel), factor in zip(segs, factors):
        t.narrow(0, offset, numel).mul_(factor)
