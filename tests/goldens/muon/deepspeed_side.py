"""DeepSpeed 0.19.8's side of ``tests/unit/test_muon_deepspeed_golden.py`` (peers venv).

    python deepspeed_side.py INPUTS.pt SETTINGS_JSON OUT.pt

Steps ``SingleDeviceMuonWithAuxAdam`` (Newton-Schulz forced to fp32) on the initial
parameters ``p{i}`` and gradients ``g{step}_{i}`` of INPUTS, for each ``ns_method`` in the
settings; the first three tensors use Muon, the rest the auxiliary AdamW. Writes the
parameters after the last step as ``{method}_{i}``.
"""

from __future__ import annotations

import json
import os
import sys

import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def main(inputs_path: str, settings_json: str, out_path: str) -> None:
    from deepspeed.runtime.zero.muon import original_muon

    original_muon.ns_compute_dtype = lambda method="gram": torch.float32
    inputs = torch.load(inputs_path, weights_only=True)
    settings = json.loads(settings_json)
    count = sum(1 for k in inputs if k.startswith("p"))
    out = {}
    for method in settings["methods"]:
        params = [inputs[f"p{i}"].clone() for i in range(count)]
        adam = {**settings["adam"], "betas": tuple(settings["adam"]["betas"])}
        opt = original_muon.SingleDeviceMuonWithAuxAdam(
            [dict(params=params[:3], use_muon=True, ns_method=method, **settings["muon"]),
             dict(params=params[3:], use_muon=False, **adam)]
        )  # fmt: skip
        for step in range(settings["steps"]):
            for i, p in enumerate(params):
                p.grad = inputs[f"g{step}_{i}"].clone()
            opt.step()
        out.update({f"{method}_{i}": p.detach().clone() for i, p in enumerate(params)})
    torch.save(out, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:4])
