"""ZeRO-3's cross-rank agreement check before each collective of a unit.

Every rank of the data axis must gather and reduce the same units in the same order; a
data-dependent branch that skips a module on some ranks would otherwise leave ranks
waiting in mismatched collectives. One tiny all-reduce before each gather/reduction
turns that hang into the same :class:`ZeroOrderError` on every rank.
"""

from __future__ import annotations

import torch

from shardspeed import comm


class ZeroOrderError(RuntimeError):
    """Ranks issued ZeRO-3 collectives for different units (their module order diverged)."""


class OrderCheck:
    """Cross-rank check that every rank is about to run the same ZeRO-3 collective.

    One tiny all-reduce (max of ``[code, -code]``) before each gather/reduction: if all
    ranks agree the collectives that follow match; otherwise every rank raises
    :class:`ZeroOrderError` at the same point instead of hanging in mismatched collectives.
    """

    def __init__(self, dp_group: object | None, world: int, device: torch.device, enabled: bool):
        self.dp_group = dp_group
        self.enabled = enabled and world > 1
        self.device = device

    def __call__(self, code: int, what: str) -> None:
        if not self.enabled:
            return
        t = torch.tensor([code, -code], dtype=torch.int64, device=self.device)
        comm.all_reduce(t, op=comm.ReduceOp.MAX, group=self.dp_group)
        hi, lo = int(t[0]), -int(t[1])
        if hi != code or lo != code:
            raise ZeroOrderError(
                f"ZeRO-3: ranks diverged: this rank is about to {what} (code {code}) while other "
                f"ranks are at codes {lo}..{hi}. Every rank must run the same modules in the same "
                "order (a data-dependent branch that skips a module on some ranks only is not "
                "supported); run the module on every rank (e.g. multiply its output by 0) or "
                "keep its parameters unsharded by raising "
                "zero_optimization.stage3_param_persistence_threshold."
            )
