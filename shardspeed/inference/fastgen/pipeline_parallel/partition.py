"""Which decoder layers each pipeline stage holds (pure partition math, no processes).

Stages hold contiguous layer ranges; the first stage also holds the embeddings, the
last the final norm and the LM head (and, with tied weights, the embedding the head
shares its weight with)::

    stage 0        stage 1        ...  stage P-1
    embeddings     layers[b1:b2]       layers[b_{P-1}:L]
    layers[0:b1]                       norm, lm_head

The boundaries minimise the largest stage's parameter count (embeddings and head
included), so parameters are balanced as DeepSpeed's ``partition_method="parameters"``
balances them; every stage keeps at least one layer.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageLayout:
    """One stage's place in the pipeline: its layers ``[first_layer, end_layer)``."""

    stage: int
    num_stages: int
    first_layer: int
    end_layer: int

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def num_layers(self) -> int:
        return self.end_layer - self.first_layer

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.end_layer)


def check_num_stages(num_stages: int, num_layers: int, model_type: str = "model") -> None:
    """``ValueError`` when ``num_stages`` cannot each hold at least one of ``num_layers``."""
    if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
        raise ValueError(f"EngineConfig.pipeline_parallel={num_stages!r} must be an int >= 1.")
    if num_stages > num_layers:
        raise ValueError(
            f"pipeline_parallel={num_stages} stages but this {model_type} model has "
            f"{num_layers} decoder layers: every stage needs at least one layer; use "
            f"pipeline_parallel <= {num_layers}."
        )


def balance_layers(
    layer_params: list[int], num_stages: int, first_extra: int = 0, last_extra: int = 0
) -> list[int]:
    """Stage boundaries ``[0, b1, ..., L]`` minimising the largest stage's parameters.

    ``layer_params[i]`` is layer ``i``'s parameter count; ``first_extra`` /
    ``last_extra`` are what the first / last stage hold besides layers (embeddings,
    norm + head). Exact (dynamic programming over prefixes); among equal optima the
    earliest cut is kept.
    """
    num_layers = len(layer_params)
    check_num_stages(num_stages, num_layers)
    prefix = [0]
    for p in layer_params:
        prefix.append(prefix[-1] + p)

    def cost(stage: int, lo: int, hi: int) -> int:
        extra = (first_extra if stage == 0 else 0) + (last_extra if stage == num_stages - 1 else 0)
        return prefix[hi] - prefix[lo] + extra

    inf = float("inf")
    # best[s][j]: the smallest max-stage cost putting layers [0, j) on stages 0..s-1
    best = [[inf] * (num_layers + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (num_layers + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for s in range(1, num_stages + 1):
        for j in range(s, num_layers - (num_stages - s) + 1):
            for i in range(s - 1, j):
                value = max(best[s - 1][i], cost(s - 1, i, j))
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    bounds = [num_layers]
    for s in range(num_stages, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    return bounds[::-1]


def stage_layouts(bounds: list[int]) -> list[StageLayout]:
    """One :class:`StageLayout` per stage from boundaries ``[0, b1, ..., L]``."""
    n = len(bounds) - 1
    return [StageLayout(s, n, bounds[s], bounds[s + 1]) for s in range(n)]
