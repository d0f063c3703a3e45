"""``from_pretrained`` under ZeRO-3 (``HfDeepSpeedConfig``) on shardspeed, 2 gloo ranks.

``zero3_from_pretrained_worker.py`` runs under ``shardspeed --nproc 2``: transformers builds
the model inside ``deepspeed.zero.Init`` and loads the saved weights into the partitions
through ``GatheredParameters``. Checked: every parameter is partitioned (local tensor
empty, this rank's piece ``ceil(numel / 2)`` elements), loading never gathers more than a
handful of parameters at once, the gathered weights equal the saved ones bit for bit, and
4 training steps (``AdamW`` from the ds_config, clipping 1.0) give the plain PyTorch
losses within fp32 parity (rtol 1e-5, atol 1e-6).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

TOL = {"rtol": 1e-5, "atol": 1e-6}


def test_from_pretrained_partitions_weights_as_they_load(
    run_worker: Callable[..., dict[str, Any]], launch: Callable[[int], list[str]], tmp_path: Path
) -> None:
    result = run_worker("zero3_from_pretrained_worker.py", tmp_path, launcher=launch(2))
    other = json.loads((tmp_path / "result_rank1.json").read_text())
    for res in (result, other):
        assert res["world"] == 2 and res["stage"] == 3
        assert res["loaded_equal"]
        assert res["num_params"] == 21 and 1 <= res["peak_gathered"] <= 4
        for name, (local, full, piece) in res["partitions"].items():
            assert local == 0, name  # param.data is empty outside a gather
            assert piece == res["expected_piece"][name] and piece < full, name
        assert len(res["losses"]) == 4
        for a, b in zip(res["losses"], res["ref_losses"], strict=True):
            assert abs(a - b) <= TOL["atol"] + TOL["rtol"] * abs(b), (a, b)
    assert result["losses"] != other["losses"]  # each rank trained on its own micro-batch
