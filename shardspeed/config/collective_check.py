"""``collective_check`` (ShardSpeed addition): the collective-sequence debug check.

```json
"collective_check": {"enabled": true, "interval": 50, "history": 4096}
```

Every rank folds each collective it issues (op, group, numel, dtype, module/phase tag)
into a fingerprint; every ``interval`` optimizer steps the data-parallel ranks compare
fingerprints with one small all-reduce and, on a mismatch, all raise
``CollectiveMismatchError`` naming each rank's first divergent collective. The
environment variable ``SHARDSPEED_COLLECTIVE_CHECK=N`` turns it on with interval N
(``0`` turns it off) without editing the config. See docs/distributed.md.
"""

from __future__ import annotations

from pydantic import Field

from shardspeed.config.base import ConfigModel, Int


class CollectiveCheckConfig(ConfigModel):
    """``collective_check``: compare ranks' collective sequences every N optimizer steps."""

    json_key = "collective_check"

    enabled: bool = Field(False, description="Record and compare collective sequences.")
    interval: Int = Field(
        50, ge=1, description="Compare every this many optimizer steps (one small all-reduce)."
    )
    history: Int = Field(
        4096,
        ge=8,
        description="Records kept per rank to locate a divergence (cover one interval).",
    )
