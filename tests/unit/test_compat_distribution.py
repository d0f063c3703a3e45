"""The compatibility distribution (``compat/deepspeed``, ``make compat``): installed into a
scratch directory, ``import deepspeed`` is shardspeed and transformers / accelerate report
DeepSpeed as available; the installer refuses to replace a real DeepSpeed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
INSTALL = ROOT / "compat" / "install.py"

_CHECK = """
import importlib.metadata, json
import deepspeed, shardspeed
import deepspeed.runtime.engine as engine
from deepspeed.runtime.zero.partition_parameters import Init
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
out = {
    "metadata": importlib.metadata.version("deepspeed"),
    "version": deepspeed.__version__,
    "same_engine": engine.DeepSpeedEngine is shardspeed.runtime.engine.ShardSpeedEngine,
    "same_module": engine is shardspeed.runtime.engine and Init is shardspeed.zero.Init,
    "initialize": deepspeed.initialize is shardspeed.initialize,
}
try:
    import deepspeed.no_such_module
except ModuleNotFoundError:
    out["missing_raises"] = True
try:
    from transformers.integrations import is_deepspeed_available
    out["transformers"] = is_deepspeed_available()
except ImportError:
    pass
try:
    from accelerate.utils import is_deepspeed_available
    out["accelerate"] = is_deepspeed_available()
except ImportError:
    pass
print(json.dumps(out))
"""


def _run(code: str, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )


def test_compat_distribution_is_shardspeed_behind_deepspeeds_name(tmp_path: Path) -> None:
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, str(INSTALL), "--target", str(site)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert not (ROOT / "compat" / "deepspeed" / "build").exists()  # built out of tree
    result = _run(_CHECK, site)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["metadata"] == out["version"] == "0.19.8+shardspeed.1"
    assert out["same_engine"] and out["same_module"] and out["initialize"]
    assert out["missing_raises"]
    if importlib.util.find_spec("transformers") is not None:
        assert out["transformers"] is True
    if importlib.util.find_spec("accelerate") is not None:
        assert out["accelerate"] is True
    # a second install replaces the shim
    again = subprocess.run([sys.executable, str(INSTALL), "--target", str(site)])
    assert again.returncode == 0


def test_installer_refuses_to_replace_a_real_deepspeed(tmp_path: Path) -> None:
    site = tmp_path / "site"
    info = site / "deepspeed-0.16.4.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.16.4\n")
    done = subprocess.run(
        [sys.executable, str(INSTALL), "--target", str(site)], capture_output=True, text=True
    )
    assert done.returncode == 1
    assert "DeepSpeed 0.16.4 is installed" in done.stderr and "pip uninstall" in done.stderr
    assert not (site / "deepspeed").exists()


_TRAINER = """
import json, sys, torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
ds_config = {
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto",
        "warmup_max_lr": "auto", "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True,
        "reduce_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"},
}
args = TrainingArguments(output_dir=sys.argv[1], per_device_train_batch_size=2, max_steps=2,
    deepspeed=ds_config, use_cpu=True, report_to=[], save_steps=2, logging_steps=1)
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=16))
data = [{"input_ids": torch.randint(0, 50, (8,)), "labels": torch.randint(0, 50, (8,))}
        for _ in range(4)]
trainer = Trainer(model=model, args=args, train_dataset=data)
loss = trainer.train().training_loss
print(json.dumps({"engine": type(trainer.model_wrapped).__name__, "loss": loss}))
"""


# Suite time: tests/integrations/test_hf_trainer.py (z3_ds_opt) runs the Trainer at ZeRO 3 with
# "auto" values through the same installed distribution in make test, and checks more
@pytest.mark.slow
def test_hf_trainer_zero3_runs_on_the_compat_distribution(tmp_path: Path) -> None:
    """Smoke test: Trainer(deepspeed=ds_config with "auto" values) trains and saves through
    shardspeed (loss parity with plain PyTorch is the integration tests' job)."""
    for name in ("transformers", "accelerate"):
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"{name} is not installed")
    site = tmp_path / "site"
    subprocess.run([sys.executable, str(INSTALL), "--target", str(site)], check=True)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]),
        **{"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"},
        "MASTER_PORT": str(29400 + os.getpid() % 500),
    }
    out_dir = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-c", _TRAINER, str(out_dir)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["engine"] == "ShardSpeedEngine" and result["loss"] > 0
    assert (out_dir / "checkpoint-2" / "model.safetensors").is_file()
