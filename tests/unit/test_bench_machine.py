"""``benchmarks/_bench_common.machine_description``: the CPU line every benchmark prints."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from _bench_common import machine_description  # noqa: E402

XEON = (
    "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\ncpu family\t: 6\n"
    "model\t\t: 143\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_int8\n\n"
    "processor\t: 1\nmodel name\t: something else\n"
)


def test_names_the_model_numbers_and_matrix_isa() -> None:
    line = machine_description(XEON)
    assert "Intel(R) Xeon(R) Platinum 8480+ (family 6 model 143;" in line
    assert "AVX-512 + bf16 + AMX-bf16 + AMX-int8)" in line
    assert "something else" not in line  # the first processor's block only


def test_bare_vm_names_and_missing_fields() -> None:
    vm = "model name\t: AMD EPYC\ncpu family\t: 25\nmodel\t\t: 17\nflags\t\t: fpu avx2\n"
    assert "AMD EPYC (family 25 model 17; no AVX-512)," in machine_description(vm)
    assert "(" not in machine_description("")  # no /proc/cpuinfo: no details, no crash
