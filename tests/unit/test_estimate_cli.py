"""``shardspeed estimate``: the table it prints and its argument errors."""

from __future__ import annotations

import pytest

from shardspeed.launcher.cli import main


def _rows(text: str) -> list[list[str]]:
    lines = [line.split() for line in text.splitlines() if line.startswith("  ")]
    return [line for line in lines if line and line[0].isdigit()]


def test_estimate_prints_every_stage_and_offload_option(capsys: pytest.CaptureFixture) -> None:
    assert main(["estimate", "--params", "7e9", "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Estimated memory for model states: 7.00B params, 1 node(s) x 8")
    assert "stage  offload_optimizer  offload_param  per device  host per node" in out
    rows = _rows(out)
    assert [r[:3] for r in rows] == [
        ["1", "none", "none"], ["1", "cpu", "none"],
        ["2", "none", "none"], ["2", "cpu", "none"],
        ["3", "none", "none"], ["3", "cpu", "none"], ["3", "cpu", "cpu"],
    ]  # fmt: skip
    # stage 2, bf16 + Adam, 8 devices: 2P + 14P/8 bytes = 26.25e9 B = 24.45 GiB, no host
    assert rows[2][3:] == ["24.45", "GiB", "0", "B"]
    # stage 3: 16P/8 = 14e9 B = 13.04 GiB per device; with optimizer offload 4P/8 on the
    # device and 16P/8 per rank (x 8 ranks) on the host
    assert rows[4][3:5] == ["13.04", "GiB"]
    assert rows[5][3:] == ["3.26", "GiB", "104.31", "GiB"]
    assert "excludes gathered units" in out


def test_estimate_stage3_with_nodes_and_largest_layer(capsys: pytest.CaptureFixture) -> None:
    argv = ["estimate", "--params", "13B", "--gpus", "8", "--nodes", "2", "--stage", "3"]
    assert main([*argv, "--largest-layer-params", "325e6", "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "2 node(s) x 8 device(s); 4-byte params, 4-byte grads" in out
    rows = _rows(out)
    assert [r[0] for r in rows] == ["3", "3", "3"]
    # fp32: shard 4 + grad 4 + masters aliased + Adam 8 = 16 B/param over 16 ranks = 13e9 B,
    # plus 2 x 325M gathered fp32 params = 2.6e9 B -> 15.6e9 B = 14.53 GiB
    assert rows[0][3:5] == ["14.53", "GiB"]
    assert "includes 2 x 325.00M gathered params" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--params", "lots"], "'lots' is not a parameter count"),
        (["--params", "1e9", "--gpus", "0"], "'0': expected an integer >= 1"),
        (["--params", "1e9", "--stage", "4"], "invalid choice: '4'"),
        ([], "the following arguments are required: --params"),
    ],
)
def test_estimate_argument_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture
) -> None:
    assert main(["estimate", *argv]) == 2
    assert message in capsys.readouterr().err
