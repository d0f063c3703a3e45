"""Every rank must clip with the same gradient norm, bit for bit: the norm's parts are formed
per rank (the uncounted rest by subtraction) and differed by an ulp between tensor ranks at
ZeRO 3, so replicated parameters would drift apart over a long run. ``GradNorm`` now ends
with an exact max over the groups it summed over."""

from __future__ import annotations

from typing import Any

from test_tp_checkpoint import _engine, _train

from shardspeed.testing import run_distributed


def _norms(layout: tuple[int, int, int]) -> list[Any]:
    engine = _engine("llama", layout)
    norms = []
    for step in range(3):
        _train(engine, range(step, step + 1))
        norms.append(engine.get_global_grad_norm())
    engine.destroy()
    return norms


def test_every_rank_clips_with_the_same_norm() -> None:
    for layout in [(4, 1, 3), (2, 2, 3)]:
        per_rank = run_distributed(_norms, 4, layout)
        assert all(n is not None and n > 0 for n in per_rank[0]), per_rank
        assert all(norms == per_rank[0] for norms in per_rank), (layout, per_rank)
