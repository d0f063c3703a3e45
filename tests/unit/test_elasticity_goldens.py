"""``compute_elastic_config`` against DeepSpeed 0.19.6's recorded answers.

``tests/goldens/elasticity/compute_elastic_config_0196.json`` holds DeepSpeed 0.19.6's own
``compute_elastic_config`` output (or the class of the error it raised) for each case, recorded
by ``tests/goldens/elasticity/record_deepspeed_0196.py`` from the release's source tarball.
This test needs no DeepSpeed: it runs ShardSpeed on the same inputs and compares.

One deliberate difference: where no candidate batch suits any GPU count in
``[min_gpus, max_gpus]`` DeepSpeed returns ``None`` for the list of valid counts (which then
fails with a ``TypeError`` on use); ShardSpeed returns an empty list.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from shardspeed.elasticity import (
    ElasticityConfigError,
    ElasticityError,
    ElasticityIncompatibleWorldSize,
    compute_elastic_config,
)

GOLDEN = Path(__file__).resolve().parents[1] / "goldens" / "elasticity"
RECORD = json.loads((GOLDEN / "compute_elastic_config_0196.json").read_text())
CASES: list[dict[str, Any]] = RECORD["cases"]

ERRORS: dict[str, type[Exception]] = {
    "ElasticityError": ElasticityError,
    "ElasticityConfigError": ElasticityConfigError,
    "ElasticityIncompatibleWorldSize": ElasticityIncompatibleWorldSize,
    "ValueError": ValueError,
    "NotImplementedError": NotImplementedError,
}


def _run(case: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    if case["env"] is not None:
        monkeypatch.setenv("WORLD_SIZE", case["env"])
    ds_config = {} if case["block"] is None else {"elasticity": case["block"]}
    return compute_elastic_config(
        ds_config,
        case["target"],
        world_size=case["world_size"],
        return_microbatch=case["return_microbatch"],
    )


def test_goldens_cover_the_cases_the_brief_asks_for():
    names = [case["name"] for case in CASES]
    assert len(names) == len(set(names)) >= 25
    blocks = [case["block"] or {} for case in CASES if "result" in case["deepspeed"]]
    assert {float(b.get("version", 0.2)) for b in blocks} == {0.1, 0.2}
    assert {b.get("prefer_larger_batch", True) for b in blocks} == {True, False}
    assert any(b.get("model_parallel_size", 1) > 1 for b in blocks)
    assert any(b.get("num_gpus_per_node", 1) > 1 for b in blocks)
    assert sum("error" in case["deepspeed"] for case in CASES) >= 10


@pytest.mark.parametrize("case", CASES, ids=[case["name"] for case in CASES])
def test_compute_elastic_config_equals_deepspeed_0196(
    case: dict[str, Any], monkeypatch: pytest.MonkeyPatch
):
    expected = case["deepspeed"]
    if "error" in expected:
        with pytest.raises(ERRORS[expected["error"]]) as info:
            _run(case, monkeypatch)
        if isinstance(info.value, ElasticityError):
            assert "Fix:" in str(info.value), str(info.value)  # house style: says how to fix
        return
    result = _run(case, monkeypatch)
    want = list(expected["result"])
    if want[1] is None:  # the deliberate difference (module docstring)
        want[1] = []
    assert list(result) == want
    assert all(type(value) is int for value in (result[0], *result[2:]))
