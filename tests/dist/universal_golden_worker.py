"""Records ``tests/goldens/deepspeed_layout/universal``: real DeepSpeed 0.19.8 (2 ranks,
ZeRO 2, fp32) trains the tiny MLP 3 steps, saves, trains 3 more (losses recorded); its own
``ds_to_universal`` converts the tag. Run from the repository root with the peers venv::

    .venv-peers/bin/python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        tests/dist/universal_golden_worker.py OUT_DIR
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from deepspeed_layout_common import SCHEDULER, tiny_model, tiny_train


def main(out: Path) -> None:
    import deepspeed

    model = tiny_model()
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 2},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True},
        },
        "scheduler": SCHEDULER,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    rank = torch.distributed.get_rank()
    tiny_train(engine, range(3), rank)
    engine.save_checkpoint(str(out / "zero"), tag="global_step3")
    more = tiny_train(engine, range(3, 6), rank)
    gathered = [None, None]
    torch.distributed.all_gather_object(gathered, more)
    if rank == 0:
        (out / "losses.json").write_text(json.dumps({"more": gathered}, indent=1) + "\n")
        cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder"]
        cmd += [str(out / "zero" / "global_step3"), "--output_folder"]
        cmd += [str(out / "universal" / "global_step3"), "--inject_missing_state"]
        subprocess.run(cmd, check=True, capture_output=True)
    engine.destroy()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
