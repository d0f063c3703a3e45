"""Record DeepSpeed 0.19.6's ``compute_elastic_config`` answers as goldens.

DeepSpeed removed ``deepspeed.elasticity`` in 0.19.7; 0.19.6 is the last release with it.
Its ``elasticity/{constants,config,elasticity}.py`` need only numpy and packaging, so this
script loads them from the release's source tarball into a stub ``deepspeed`` package (no
DeepSpeed install, no torch) and runs every case of :data:`CASES`, writing
``compute_elastic_config_0196.json`` beside this file. ``tests/unit/test_elasticity_goldens.py``
compares ShardSpeed with that file.

Re-record::

    pip download --no-deps --no-binary :all: deepspeed==0.19.6 -d /tmp/ds0196
    .venv/bin/python tests/goldens/elasticity/record_deepspeed_0196.py [/tmp/ds0196]

The argument (or ``SHARDSPEED_DS_SRC``) is the folder holding the sdist, the sdist itself,
or an unpacked source tree.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
import tarfile
import tempfile
import types
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
OUTPUT = HERE / "compute_elastic_config_0196.json"
RELEASE = "0.19.6"
FILES = ("constants", "config", "elasticity")


def _case(
    name: str,
    block: dict[str, Any] | None,
    world_size: int = 0,
    return_microbatch: bool = False,
    env: str | None = None,
    target: str = RELEASE,
) -> dict[str, Any]:
    """One call: ``compute_elastic_config({"elasticity": block}, target, world_size, ...)``.

    ``block`` None means a ds_config without the block; ``env`` is ``WORLD_SIZE``.
    """
    return {
        "name": name,
        "block": block,
        "world_size": world_size,
        "return_microbatch": return_microbatch,
        "env": env,
        "target": target,
    }


def _on(**keys: Any) -> dict[str, Any]:
    return {"enabled": True, **keys}


D = {"max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6]}

# fmt: off
CASES: list[dict[str, Any]] = [
    # ---- version 0.1 (per GPU)
    _case("v01_default_micro", _on(**D, version=0.1)),
    _case("v01_small", _on(max_train_batch_size=100, micro_batch_sizes=[1, 2, 3], version=0.1)),
    _case("v01_min_max_gpus", _on(max_train_batch_size=10000, micro_batch_sizes=[8, 12, 16, 17],
                                  min_gpus=32, max_gpus=1500, version=0.1)),
    _case("v01_prefer_smaller", _on(**D, prefer_larger_batch=False, version=0.1)),
    _case("v01_prefer_smaller_odd", _on(max_train_batch_size=300, micro_batch_sizes=[5, 7],
                                        prefer_larger_batch=False, version=0.1)),
    _case("v01_prefer_larger_odd", _on(max_train_batch_size=300, micro_batch_sizes=[5, 7],
                                       version=0.1)),
    _case("v01_world_4", _on(**D, version=0.1), world_size=4),
    _case("v01_world_7", _on(**D, version=0.1), world_size=7),
    _case("v01_world_840", _on(**D, version=0.1), world_size=840),
    _case("v01_single_micro_equal_max", _on(max_train_batch_size=16, micro_batch_sizes=[16],
                                            version=0.1)),
    _case("v01_big_lcm_skipped", _on(max_train_batch_size=50, micro_batch_sizes=[7, 9, 11],
                                     version=0.1)),
    _case("v01_duplicate_micro", _on(max_train_batch_size=500, micro_batch_sizes=[4, 4, 8],
                                     version=0.1), world_size=5),
    _case("v01_narrow_range", _on(max_train_batch_size=1000, micro_batch_sizes=[3, 8],
                                  min_gpus=5, max_gpus=9, version=0.1)),
    _case("v01_range_above_all", _on(max_train_batch_size=64, micro_batch_sizes=[4, 8],
                                     min_gpus=100, max_gpus=200, version=0.1)),
    _case("v01_return_micro_env", _on(max_train_batch_size=512, micro_batch_sizes=[4, 8],
                                      version=0.1), return_microbatch=True, env="8"),
    _case("v01_huge", _on(max_train_batch_size=5000000, micro_batch_sizes=[1], max_gpus=64,
                          version=0.1)),
    _case("v01_gpus_per_node_ignored", _on(**D, num_gpus_per_node=4, version=0.1),
          world_size=8),
    _case("v01_string_version", _on(max_train_batch_size=96, micro_batch_sizes=[2, 3],
                                    version="0.1"), world_size=6),
    # ---- version 0.2 (per node; the default version)
    _case("v02_world_8", _on(**D, num_gpus_per_node=8), world_size=8),
    _case("v02_world_16_mp2", _on(max_train_batch_size=4000, micro_batch_sizes=[1, 2, 4],
                                  num_gpus_per_node=8, model_parallel_size=2, min_gpus=8,
                                  max_gpus=128), world_size=16),
    _case("v02_world_8_mp2_dp", _on(max_train_batch_size=4000, micro_batch_sizes=[1, 2, 4],
                                    num_gpus_per_node=8, model_parallel_size=2, min_gpus=8,
                                    max_gpus=128), world_size=8),
    _case("v02_world_not_in_list", _on(max_train_batch_size=1000, micro_batch_sizes=[2, 3],
                                       num_gpus_per_node=4, min_gpus=4, max_gpus=16),
          world_size=12),
    _case("v02_return_micro_env", _on(max_train_batch_size=1024, micro_batch_sizes=[2, 4, 8],
                                      num_gpus_per_node=4), return_microbatch=True, env="4"),
    _case("v02_return_micro_fallback_env", _on(max_train_batch_size=1000,
                                               micro_batch_sizes=[3, 5], num_gpus_per_node=2,
                                               prefer_larger_batch=False),
          return_microbatch=True, env="6"),
    _case("v02_return_micro_fallback_env_larger", _on(max_train_batch_size=1000,
                                                      micro_batch_sizes=[3, 5],
                                                      num_gpus_per_node=2),
          return_microbatch=True, env="7"),
    _case("v02_default_version_world_1", _on(max_train_batch_size=256,
                                             micro_batch_sizes=[4, 8, 16]), world_size=1),
    _case("v02_default_version_world_2", _on(max_train_batch_size=256,
                                             micro_batch_sizes=[4, 8, 16]), world_size=2),
    _case("v02_default_version_world_4", _on(max_train_batch_size=256,
                                             micro_batch_sizes=[4, 8, 16]), world_size=4),
    _case("v02_world_3_prefer_smaller", _on(max_train_batch_size=300, micro_batch_sizes=[2, 5],
                                            prefer_larger_batch=False), world_size=3),
    _case("v02_env_pair", _on(max_train_batch_size=96, micro_batch_sizes=[2, 3]), env="6"),
    _case("v02_fallback_world_6", _on(max_train_batch_size=1000, micro_batch_sizes=[2, 3],
                                      num_gpus_per_node=4, min_gpus=4, max_gpus=64),
          world_size=6),
    _case("v02_fallback_prefer_smaller", _on(max_train_batch_size=1000, micro_batch_sizes=[4, 6],
                                             num_gpus_per_node=8, prefer_larger_batch=False),
          world_size=12),
    _case("v02_fallback_no_micro_divides", _on(max_train_batch_size=100, micro_batch_sizes=[3, 4],
                                               num_gpus_per_node=2, min_gpus=2, max_gpus=4),
          return_microbatch=True, env="5"),
    _case("v02_string_version_world_2", _on(max_train_batch_size=64, micro_batch_sizes=[2, 4],
                                            version="0.2"), world_size=2),
    _case("v02_two_nodes_of_2", _on(max_train_batch_size=64, micro_batch_sizes=[2, 4],
                                    num_gpus_per_node=2, min_gpus=2, max_gpus=4), world_size=2),
    _case("v02_hosts_1_to_2", _on(max_train_batch_size=16, micro_batch_sizes=[2, 4],
                                  min_gpus=1, max_gpus=2), world_size=1),
    _case("v02_hosts_1_to_2_world_2", _on(max_train_batch_size=16, micro_batch_sizes=[2, 4],
                                          min_gpus=1, max_gpus=2), world_size=2),
    # ---- errors
    _case("err_v02_fallback_mp2_world_3", _on(max_train_batch_size=500, micro_batch_sizes=[4, 6],
                                              num_gpus_per_node=4, model_parallel_size=2,
                                              min_gpus=4, max_gpus=64), world_size=3),
    _case("err_v01_world_5", _on(max_train_batch_size=64, micro_batch_sizes=[8], version=0.1),
          world_size=5),
    _case("err_v01_return_micro_env_invalid", _on(max_train_batch_size=64,
                                                  micro_batch_sizes=[8], version=0.1),
          return_microbatch=True, env="5"),
    _case("err_v01_return_micro_no_env", _on(max_train_batch_size=64, micro_batch_sizes=[8],
                                             version=0.1), return_microbatch=True),
    _case("err_missing_block", None),
    _case("err_missing_max", _on(micro_batch_sizes=[2])),
    _case("err_missing_micro", _on(max_train_batch_size=8)),
    _case("err_micro_not_list", _on(max_train_batch_size=8, micro_batch_sizes=4)),
    _case("err_micro_float", _on(max_train_batch_size=8, micro_batch_sizes=[2.0], version=0.1)),
    _case("err_micro_nonpositive", _on(max_train_batch_size=8, micro_batch_sizes=[2, 0])),
    _case("err_min_gpus_zero", _on(max_train_batch_size=8, micro_batch_sizes=[2], min_gpus=0)),
    _case("err_min_gt_max", _on(max_train_batch_size=8, micro_batch_sizes=[2], min_gpus=8,
                                max_gpus=4)),
    _case("err_mp_zero", _on(max_train_batch_size=8, micro_batch_sizes=[2],
                             model_parallel_size=0), world_size=1),
    _case("err_gpus_per_node_zero", _on(max_train_batch_size=8, micro_batch_sizes=[2],
                                        num_gpus_per_node=0), world_size=1),
    _case("err_min_time_negative", _on(max_train_batch_size=8, micro_batch_sizes=[2],
                                       min_time=-1), world_size=1),
    _case("err_v01_mp", _on(max_train_batch_size=8, micro_batch_sizes=[2], model_parallel_size=2,
                            version=0.1)),
    _case("err_version_too_new", _on(max_train_batch_size=8, micro_batch_sizes=[2], version=0.3)),
    _case("err_version_unknown", _on(max_train_batch_size=8, micro_batch_sizes=[2],
                                     version=0.15)),
    _case("err_v02_gpn_mp", _on(max_train_batch_size=64, micro_batch_sizes=[2],
                                num_gpus_per_node=6, model_parallel_size=4), world_size=4),
    _case("err_v02_no_world", _on(max_train_batch_size=64, micro_batch_sizes=[2])),
    _case("err_v02_env_not_numeric", _on(max_train_batch_size=64, micro_batch_sizes=[2]),
          env="two"),
    _case("err_micro_gt_max", _on(max_train_batch_size=4, micro_batch_sizes=[2, 8],
                                  version=0.1)),
    _case("err_v02_micro_gt_node_cap", _on(max_train_batch_size=16, micro_batch_sizes=[2, 8],
                                           num_gpus_per_node=4), world_size=4),
    _case("err_disabled", {"enabled": False, "max_train_batch_size": 8, "micro_batch_sizes": [2]}),
    _case("err_target_too_old", _on(max_train_batch_size=8, micro_batch_sizes=[2], version=0.1),
          target="0.3.0"),
]
# fmt: on


def _source_dir(location: Path) -> Path:
    """The ``deepspeed/elasticity`` folder of 0.19.6 (unpacking the sdist when needed)."""
    tree = location / "deepspeed" / "elasticity"
    if tree.is_dir():
        return tree
    nested = location / f"deepspeed-{RELEASE}" / "deepspeed" / "elasticity"
    if nested.is_dir():
        return nested
    tarball = location if location.is_file() else location / f"deepspeed-{RELEASE}.tar.gz"
    if not tarball.is_file():
        raise SystemExit(
            f"no DeepSpeed {RELEASE} source at {location}. Fix: pip download --no-deps "
            f"--no-binary :all: deepspeed=={RELEASE} -d /tmp/ds0196"
        )
    out = Path(tempfile.mkdtemp(prefix="ds0196_elasticity_"))
    with tarfile.open(tarball) as tar:
        for name in FILES:
            member = tar.extractfile(f"deepspeed-{RELEASE}/deepspeed/elasticity/{name}.py")
            assert member is not None
            (out / f"{name}.py").write_bytes(member.read())
    return out


def load_deepspeed_elasticity(location: Path) -> types.ModuleType:
    """DeepSpeed 0.19.6's ``deepspeed.elasticity.elasticity`` module, in a stub package."""
    folder = _source_dir(location)
    root = types.ModuleType("deepspeed")
    root.__path__ = []  # type: ignore[attr-defined]
    version_info = types.ModuleType("deepspeed.git_version_info")
    version_info.version = RELEASE  # type: ignore[attr-defined]
    utils = types.ModuleType("deepspeed.utils")
    utils.logger = logging.getLogger("deepspeed_0196")  # type: ignore[attr-defined]
    package = types.ModuleType("deepspeed.elasticity")
    package.__path__ = [str(folder)]  # type: ignore[attr-defined]
    for module in (root, version_info, utils, package):
        sys.modules[module.__name__] = module
    loaded = None
    for name in FILES:
        full = f"deepspeed.elasticity.{name}"
        spec = importlib.util.spec_from_file_location(full, folder / f"{name}.py")
        assert spec is not None and spec.loader is not None
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[full] = loaded
        spec.loader.exec_module(loaded)
    assert loaded is not None
    return loaded


def _plain(value: Any) -> Any:
    """numpy scalars and tuples as JSON values."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item"):
        return value.item()
    return value


def run_case(module: types.ModuleType, case: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed's answer: ``{"result": [...]}`` or ``{"error": class name}``."""
    saved = os.environ.pop("WORLD_SIZE", None)
    if case["env"] is not None:
        os.environ["WORLD_SIZE"] = case["env"]
    ds_config = {} if case["block"] is None else {"elasticity": case["block"]}
    try:
        result = module.compute_elastic_config(
            ds_config,
            case["target"],
            world_size=case["world_size"],
            return_microbatch=case["return_microbatch"],
        )
        return {"result": _plain(result), "types": [type(v).__name__ for v in result]}
    except Exception as exc:  # noqa: BLE001 - the error class is the golden
        return {"error": type(exc).__name__, "message": str(exc)}
    finally:
        os.environ.pop("WORLD_SIZE", None)
        if saved is not None:
            os.environ["WORLD_SIZE"] = saved


def main() -> None:
    default = os.environ.get("SHARDSPEED_DS_SRC", "/tmp/ds0196")
    location = Path(sys.argv[1] if len(sys.argv) > 1 else default)
    module = load_deepspeed_elasticity(location)
    names = [case["name"] for case in CASES]
    assert len(names) == len(set(names)), "case names must be unique"
    records = [{**case, "deepspeed": run_case(module, case)} for case in CASES]
    payload = {
        "recorded_with": f"deepspeed {RELEASE} sdist, deepspeed/elasticity/*.py (stub package)",
        "cases": records,
    }
    OUTPUT.write_text(json.dumps(payload, indent=1) + "\n")
    errors = sum("error" in r["deepspeed"] for r in records)
    print(f"wrote {OUTPUT}: {len(records)} cases ({errors} errors)")


if __name__ == "__main__":
    main()
