"""Worker: Lightning's ``convert_zero_checkpoint_to_fp32_state_dict`` on a saved checkpoint.

    python lightning_convert.py OUT_DIR CHECKPOINT_DIR WEIGHTS_PT

One process, the ``deepspeed`` compatibility distribution on ``PYTHONPATH``. Lightning's
converter calls ``deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint``,
then reads the first of ``get_optim_files(tag_dir)`` for ``optimizer_state_dict.zero_stage``
and ``get_model_state_file(tag_dir, zero_stage)`` for the Lightning client state.
``result.json`` holds the converted keys, Lightning's keys kept beside ``state_dict``, and
the largest difference from ``WEIGHTS_PT`` (the weights ``lightning_worker.py`` gathered).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("weights", type=Path)
    args = parser.parse_args()
    output = args.out / "fp32.pt"
    converted = convert_zero_checkpoint_to_fp32_state_dict(str(args.checkpoint), str(output))
    from_disk = torch.load(output, map_location="cpu", weights_only=False)
    expected = torch.load(args.weights, map_location="cpu")
    state = from_disk["state_dict"]
    common = sorted(set(state) & set(expected))
    result = {
        "keys": sorted(state),
        "expected_keys": sorted(expected),
        "client_keys": sorted(k for k in from_disk if k != "state_dict"),
        "returned_same": sorted(converted["state_dict"]) == sorted(state),
        "dtypes": sorted({str(t.dtype) for t in state.values()}),
        "shapes_equal": all(state[k].shape == expected[k].shape for k in common),
        "max_abs_diff": max(
            (float((state[k].detach().float() - expected[k]).abs().max()) for k in common),
            default=-1.0,
        ),
    }
    (args.out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
