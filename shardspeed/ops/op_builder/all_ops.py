"""``ALL_OPS``: one builder instance per op name (DeepSpeed's ``op_builder.all_ops``).

``ds_report``-style tools iterate it: ``{name: builder for every builder class}``.
"""

from __future__ import annotations

from shardspeed.ops import op_builder
from shardspeed.ops.op_builder.builder import OpBuilder


def _all_builders() -> dict[str, OpBuilder]:
    builders = {}
    for name in op_builder.__all__:
        cls = getattr(op_builder, name)
        if isinstance(cls, type) and issubclass(cls, OpBuilder) and cls.NAME:
            builders[cls.NAME] = cls()
    return builders


ALL_OPS: dict[str, OpBuilder] = _all_builders()

__all__ = ["ALL_OPS"]
