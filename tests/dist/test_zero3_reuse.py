"""ZeRO-3 keeps a unit gathered from its forward to its backward as the config allows.

``stage3_max_reuse_distance`` (elements of the units that run between a unit's forward and
its backward) and ``stage3_max_live_parameters`` (gathered elements alive at once) decide
whether a unit is released after its forward and gathered again for its backward. The
gathers of each unit are counted per step, and every setting must train to the same
parameters as plain PyTorch (SGD, same batch on every rank: bitwise up to the reduction).
"""

from __future__ import annotations

import torch
from test_zero3_features import _batch, _config, _fresh, _reference

from shardspeed.testing import run_distributed

UNIT_NUMEL = 16 * 16 + 16  # one Linear(16, 16) of the Stack: its unit's elements
ROOT_NUMEL = 18  # the head, Linear(16, 1): 17 elements padded to a multiple of 2 ranks


def _count_gathers(zero: dict, steps: int = 3) -> tuple[list[dict[str, int]], dict]:
    import shardspeed
    from shardspeed.zero import GatheredParameters
    from shardspeed.zero.flat_buffer import FlatGroup

    model = _fresh()
    engine, _, _, _ = shardspeed.initialize(model=model, config=_config(**zero))
    names = {id(f): u.name for u in engine.sharding.units for f in u.flats}
    per_step: list[dict[str, int]] = []
    original = FlatGroup.start_gather

    def counting(flat: FlatGroup) -> None:
        if flat.full is None and flat.residency._pending is None:  # noqa: SLF001 - a real gather
            counts[names[id(flat)]] = counts.get(names[id(flat)], 0) + 1
        original(flat)

    FlatGroup.start_gather = counting  # type: ignore[method-assign]
    try:
        for step in range(steps):
            counts: dict[str, int] = {}
            loss = engine(_batch(step))
            engine.backward(loss)
            engine.step()
            per_step.append(counts)
    finally:
        FlatGroup.start_gather = original  # type: ignore[method-assign]
    with GatheredParameters(model.parameters()):
        final = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.destroy()
    return per_step, final


def _cases() -> list:
    return [
        _count_gathers({}),  # DeepSpeed's defaults: 1e9 distance and live elements
        _count_gathers({"stage3_max_reuse_distance": 0}),
        _count_gathers({"stage3_max_live_parameters": ROOT_NUMEL + UNIT_NUMEL}),
        _count_gathers({"stage3_max_reuse_distance": UNIT_NUMEL}),
    ]


def test_reuse_distance_and_live_limit_decide_backward_gathers() -> None:
    ref = _reference(_fresh(), 3)
    results = run_distributed(_cases, 2, timeout=120)
    for rank_results in results:
        default, no_reuse, live_one, reuse_one = rank_results
        # the root unit (the head) stays gathered from its forward through its backward;
        # step 0 has no recorded order yet: every unit is gathered for forward and backward
        for per_step, _ in rank_results:
            assert per_step[0] == {"<root>": 1, "layers.0": 2, "layers.1": 2, "layers.2": 2}
        # afterwards the defaults keep every unit from its forward to its backward
        assert default[0][1:] == [{"<root>": 1, "layers.0": 1, "layers.1": 1, "layers.2": 1}] * 2
        # distance 0: only the last unit (its backward comes right after its forward)
        assert no_reuse[0][1:] == [{"<root>": 1, "layers.0": 2, "layers.1": 2, "layers.2": 1}] * 2
        # room for the root and one unit: the last one (an earlier one would overlap the
        # next unit's gather)
        assert live_one[0][1:] == [{"<root>": 1, "layers.0": 2, "layers.1": 2, "layers.2": 1}] * 2
        # distance of one unit: layers.1 (only layers.2 runs in between) and layers.2
        assert reuse_one[0][1:] == [{"<root>": 1, "layers.0": 2, "layers.1": 1, "layers.2": 1}] * 2
        for _, final in rank_results:
            for name, value in ref.items():
                torch.testing.assert_close(final[name], value, rtol=1e-6, atol=1e-7, msg=name)
            for name, value in default[1].items():  # the schedule never changes the math
                assert torch.equal(final[name], value), name
