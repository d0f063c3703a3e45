"""Record the command lines DeepSpeed 0.19.8's ``launcher.multinode_runner`` backends build.

Run with the peers venv (DeepSpeed 0.19.8 installed)::

    .venv-peers/bin/python tests/goldens/multinode_runner/record_deepspeed_0198.py

For each case of ``cases.json`` (beside this file) it parses the runner flags with
DeepSpeed's ``runner.parse_args``, reads the hostfile, applies ``--include``/``--exclude``
and ``--num_nodes``/``--num_gpus`` as ``runner.main`` does, builds the backend with the world
info, adds the case's exports and calls ``get_cmd``; it writes what came back (or the error
class and message) into ``deepspeed_0198.json``. Paths that differ between machines are
written as placeholders: ``{python}`` (the interpreter), ``{cwd}``, ``{hostfile}``,
``{pid}``. ``tests/unit/test_multinode_runner.py`` builds ShardSpeed's commands from the same
cases and compares.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def placeholders(value: Any, hostfile: str) -> Any:
    """``value`` with the machine-specific strings replaced (recursively)."""
    if isinstance(value, dict):
        return {k: placeholders(v, hostfile) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [placeholders(v, hostfile) for v in value]
    if isinstance(value, str):
        for real, token in (
            (hostfile, "{hostfile}"),
            (sys.executable, "{python}"),
            (os.path.abspath("."), "{cwd}"),
            (str(os.getpid()), "{pid}"),
        ):
            value = value.replace(real, token)
    return value


def build(module: Any, runner_module: Any, case: dict[str, Any], hostfile: str) -> dict[str, Any]:
    """Run one case against a DeepSpeed-compatible ``runner`` / ``multinode_runner`` pair."""
    argv = [a.replace("{hostfile}", hostfile) for a in case["argv"]]
    args = runner_module.parse_args(argv)
    pool = runner_module.fetch_hostfile(args.hostfile)
    try:
        active = runner_module.parse_inclusion_exclusion(pool, args.include, args.exclude)
        active = runner_module.apply_num_nodes_and_gpus(active, args.num_nodes, args.num_gpus)
        world_info = runner_module.encode_world_info(active)
        cls = getattr(module, case["runner"])
        cls.validate_active_resources(active)
        if case["runner"] == "PDSHRunner":
            runner = cls(args, world_info)
        else:
            runner = cls(args, world_info, pool)
        for key, value in case["exports"].items():
            runner.add_export(key, value)
        environment = dict(case["environment"])
        with contextlib.redirect_stdout(io.StringIO()):  # IMPIRunner prints its command
            result = runner.get_cmd(environment, active)
    except (ValueError, AssertionError) as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    out: dict[str, Any] = {"world_info": world_info, "exports": dict(runner.exports)}
    if isinstance(result, tuple):
        cmd, kill, env = result
        out.update(cmd=list(cmd), kill=list(kill), environment=env)
    else:
        out["cmd"] = list(result)
    return placeholders(out, hostfile)


def main() -> None:
    from deepspeed.git_version_info import version
    from deepspeed.launcher import multinode_runner, runner

    cases = json.loads((HERE / "cases.json").read_text())
    records = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            hostfile = os.path.join(tmp, f"{case['name']}.hostfile")
            Path(hostfile).write_text(case["hostfile"])
            records[case["name"]] = build(multinode_runner, runner, case, hostfile)
    payload = {"recorded_with": f"deepspeed {version}", "results": records}
    (HERE / "deepspeed_0198.json").write_text(json.dumps(payload, indent=1) + "\n")
    print(f"recorded {len(records)} cases with deepspeed {version}")


if __name__ == "__main__":
    main()
