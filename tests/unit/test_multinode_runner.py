"""DeepSpeed's ``launcher.multinode_runner`` backends: ShardSpeed's command lines against
DeepSpeed 0.19.8's.

``tests/goldens/multinode_runner/cases.json`` lists runner flags, a hostfile and exports per
case; ``deepspeed_0198.json`` is what DeepSpeed 0.19.8's backends built from them (recorded
by ``record_deepspeed_0198.py`` there, with the peers venv). This test builds ShardSpeed's
commands from the same cases through the same steps (``runner.parse_args``, hostfile,
``--include``/``--exclude``, ``--num_nodes``/``--num_gpus``, world info, ``add_export``,
``get_cmd``) and compares them with DeepSpeed's after these deliberate differences:

* the per-host launcher is ``shardspeed.launcher.launch`` (DeepSpeed's
  ``deepspeed.launcher.launch``); pdsh's kill pattern names it in full (DeepSpeed's cuts its
  last character, and shifts to the wrong words under ``--venv_script``);
* MPICH runs the script directly: ShardSpeed reads the rank from the MPI environment, so
  DeepSpeed's ``launcher_helper.py --launcher mpich [--module|--no_python]`` is not needed
  (and ``python -u -m <helper path>``, DeepSpeed's ``--module`` form, does not run);
* ``PDSH_SSH_ARGS_APPEND`` holds the same words without DeepSpeed's run of spaces.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from shardspeed.launcher import multinode_runner, runner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "goldens" / "multinode_runner"))
from record_deepspeed_0198 import build  # noqa: E402

FOLDER = Path(__file__).resolve().parents[1] / "goldens" / "multinode_runner"
CASES: list[dict[str, Any]] = json.loads((FOLDER / "cases.json").read_text())
GOLDEN: dict[str, Any] = json.loads((FOLDER / "deepspeed_0198.json").read_text())["results"]


def _expected(deepspeed: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed's answer with the deliberate differences (module docstring) applied."""
    out = json.loads(
        json.dumps(deepspeed).replace("deepspeed.launcher.launc", "shardspeed.launcher.launc")
    )
    cmd = out["cmd"]
    helper = next((i for i, a in enumerate(cmd) if a.endswith("launcher_helper.py")), None)
    if helper is not None:
        end = helper + 3 + (cmd[helper + 3] in ("--module", "--no_python"))
        out["cmd"] = cmd[:helper] + cmd[end:]
    return out


@pytest.mark.parametrize("case", CASES, ids=[case["name"] for case in CASES])
def test_command_equals_deepspeed_0198(
    case: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    hostfile = str(tmp_path / "hostfile")
    Path(hostfile).write_text(case["hostfile"])
    ours = build(multinode_runner, runner, case, hostfile)
    deepspeed = GOLDEN[case["name"]]
    if "error" in deepspeed:
        assert "error" in ours and ours["error"] == deepspeed["error"], ours
        return
    assert "error" not in ours, ours
    want = _expected(deepspeed)
    if "kill" in want:  # pdsh: DeepSpeed's pattern is a prefix of ours
        assert ours["kill"][:-1] == want["kill"][:-1]
        if "--venv_script" in case["argv"]:  # DeepSpeed's words shift: "cd ...; python -u -"
            assert "shardspeed.launcher.launch" in ours["kill"][-1]
        else:
            assert ours["kill"][-1].startswith(want["kill"][-1]), (ours["kill"], want["kill"])
        ours_env, want_env = ours.pop("environment"), want.pop("environment")
        assert {k: v.split() for k, v in ours_env.items()} == {
            k: v.split() for k, v in want_env.items()
        }
        ours.pop("kill"), want.pop("kill")
    assert ours == want


def test_golden_cases_cover_every_backend_and_filter() -> None:
    assert set(GOLDEN) == {case["name"] for case in CASES}
    runners = {case["runner"] for case in CASES}
    assert runners == {"PDSHRunner", "OpenMPIRunner", "MPICHRunner", "IMPIRunner",
                       "SlurmRunner", "MVAPICHRunner"}  # fmt: skip
    flags = {a.split("=")[0] for case in CASES for a in case["argv"]}
    assert {"--include", "--exclude", "--num_nodes", "--num_gpus", "--ssh_port"} <= flags


def test_impi_core_binding_is_refused_by_name(tmp_path: Path) -> None:
    """DeepSpeed wraps each rank in numactl; ShardSpeed refuses the flag with the fix."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-0 slots=2\n")
    args = runner.parse_args(
        ["-H", str(hostfile), "--launcher", "impi", "--bind_cores_to_rank", "t.py"]
    )
    with pytest.raises(ValueError, match="--bind_cores_to_rank"):
        multinode_runner.IMPIRunner(args, "", {"worker-0": 2})


def test_pdsh_kill_pattern_matches_the_launchers_it_started(tmp_path: Path) -> None:
    import re

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("a slots=1\nb slots=1\n")
    args = runner.parse_args(["-H", str(hostfile), "--venv_script", "/v/activate", "t.py"])
    cmd, kill, _ = multinode_runner.PDSHRunner(args, "e30=").get_cmd({}, {"a": [0], "b": [0]})
    remote = " ".join(cmd[cmd.index("-w") + 2 :])
    assert re.search(kill[-1].replace("\\ ", " "), remote), (kill[-1], remote)
    assert os.getcwd() in remote
