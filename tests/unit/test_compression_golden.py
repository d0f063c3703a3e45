"""Golden test: one compression script, run by ShardSpeed and (recorded) by DeepSpeed 0.19.6.

The script: a 2-layer BERT-like encoder built here, ``init_compression`` with weight
quantization 8 -> 4 bits (in place, period 1, 2 groups), sparse pruning 0.5 (l1), head
pruning 0.5 (topk, q/k/v related) and row pruning 0.5 (topk, next layer related) at
different ``schedule_offset``s, 10 Adam steps with the scheduler driven as the engine drives
it, then ``redundancy_clean``. Compared with DeepSpeed: the global-RNG probe after
``init_compression``, every loss, the masks, the bits, the cleaned parameter count and the
cleaned state dict (quantized values included), the logits before cleaning; after cleaning,
the logits must equal those before (DeepSpeed's do not: it keeps the stale head count).

DeepSpeed's side lives in ``tests/goldens/compression/deepspeed_0196.{json,pt}``. To
re-record (needs DeepSpeed 0.19.6's sdist, e.g. ``pip download --no-deps --no-binary :all:
deepspeed==0.19.6 -d /tmp/ds0196``)::

    SHARDSPEED_RECORD_GOLDENS=1 .venv/bin/python -m pytest tests/unit/test_compression_golden.py

which unpacks ``deepspeed/compression`` (+ ``runtime/quantize.py``, ``config_utils.py``) into
a stub package (``SHARDSPEED_DS_SRC``, default ``/tmp/ds0196``) and runs this file as a
script against it in a subprocess (DeepSpeed's engine loop is emulated: step-0 check and MoQ
quantization before the first forward, quantize-then-``scheduler.step()`` after each step).
Two deliberate workarounds on DeepSpeed's side, both what its documentation says: the MoQ
quantizer runs on fp32 weights (DeepSpeed's engine only allows it under fp16), and sparse
pruning gets an unbounded ``schedule_offset_end`` (0.19.6 raises KeyError without it).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "goldens" / "compression"
NUM_STEPS = 10
LR = 1e-2
NUM_HEADS = 4

CONFIG: dict[str, Any] = {
    "compression_training": {
        "weight_quantization": {
            "shared_parameters": {
                "enabled": True,
                "quantizer_kernel": False,
                "schedule_offset": 0,
                "quantize_groups": 2,
                "quantize_verbose": False,
                "quantization_type": "symmetric",
                "quantize_weight_in_forward": False,
                "rounding": "nearest",
                "fp16_mixed_quantize": {"enabled": False, "quantize_change_ratio": 0.001},
            },
            "different_groups": {
                "wq1": {
                    "params": {"start_bits": 8, "target_bits": 4, "quantization_period": 1},
                    "modules": ["attention.self", "intermediate", r"layer\.\d+\.output\.dense"],
                }
            },
        },
        "sparse_pruning": {
            "shared_parameters": {"enabled": True, "schedule_offset": 2, "method": "l1"},
            "different_groups": {
                "sp1": {"params": {"dense_ratio": 0.5}, "modules": ["attention.self"]}
            },
        },
        "head_pruning": {
            "shared_parameters": {
                "enabled": True,
                "schedule_offset": 3,
                "method": "topk",
                "num_heads": NUM_HEADS,
            },
            "different_groups": {
                "hp1": {
                    "params": {"dense_ratio": 0.5},
                    "modules": ["attention.output.dense"],
                    "related_modules": [["self.query", "self.key", "self.value"]],
                }
            },
        },
        "row_pruning": {
            "shared_parameters": {"enabled": True, "schedule_offset": 4, "method": "topk"},
            "different_groups": {
                "rp1": {
                    "params": {"dense_ratio": 0.5},
                    "modules": ["intermediate.dense"],
                    "related_modules": [[r"layer\.\d+\.output\.dense"]],
                }
            },
        },
    }
}


# -- the model ---------------------------------------------------------------------------------


class SelfAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int) -> None:
        super().__init__()
        self.num_attention_heads = num_heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        heads = self.num_attention_heads

        def split(t: torch.Tensor) -> torch.Tensor:  # (B, T, H * hs) -> (B, H, T, hs)
            return t.view(batch, seq, heads, -1).transpose(1, 2)

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        att = (q @ k.transpose(-1, -2)) / math.sqrt(q.size(-1))  # (B, H, T, T)
        out = att.softmax(-1) @ v  # (B, H, T, hs)
        return out.transpose(1, 2).reshape(batch, seq, -1)  # (B, T, H * hs)


class AttentionOutput(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.LayerNorm = nn.LayerNorm(hidden)


class Attention(nn.Module):
    def __init__(self, hidden: int, num_heads: int) -> None:
        super().__init__()
        self.self = SelfAttention(hidden, num_heads)
        self.output = AttentionOutput(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output.LayerNorm(x + self.output.dense(self.self(x)))


class Intermediate(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, ffn)


class Output(nn.Module):
    def __init__(self, ffn: int, hidden: int) -> None:
        super().__init__()
        self.dense = nn.Linear(ffn, hidden)
        self.LayerNorm = nn.LayerNorm(hidden)


class Layer(nn.Module):
    def __init__(self, hidden: int, ffn: int, num_heads: int) -> None:
        super().__init__()
        self.attention = Attention(hidden, num_heads)
        self.intermediate = Intermediate(hidden, ffn)
        self.output = Output(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attention(x)
        h = torch.nn.functional.gelu(self.intermediate.dense(x))
        return self.output.LayerNorm(x + self.output.dense(h))


class Encoder(nn.Module):
    def __init__(self, hidden: int, ffn: int, num_heads: int, num_layers: int) -> None:
        super().__init__()
        self.layer = nn.ModuleList(Layer(hidden, ffn, num_heads) for _ in range(num_layers))


class TinyBert(nn.Module):
    """BERT's module names and shapes at toy size (vocab 32, hidden 16, 4 heads, ffn 32)."""

    def __init__(
        self,
        vocab: int = 32,
        hidden: int = 16,
        ffn: int = 32,
        num_layers: int = 2,
        num_labels: int = 3,
    ) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden)
        self.encoder = Encoder(hidden, ffn, NUM_HEADS, num_layers)
        self.classifier = nn.Linear(hidden, num_labels)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(tokens)  # (B, T, hidden)
        for layer in self.encoder.layer:
            x = layer(x)
        return self.classifier(x[:, 0])  # (B, num_labels)


# -- the script --------------------------------------------------------------------------------


def _noise_driven_parameters() -> set[str]:
    """The key projections' biases: their exact gradient is zero (adding ``q . b_k`` to every
    score of a query leaves the softmax over keys unchanged), so what reaches them is
    rounding noise, ~1e-9 against ~1e-2 for the query and value biases (checked here)."""
    torch.manual_seed(0)
    model = TinyBert()
    data = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 32, (8, 6), generator=data)
    labels = torch.randint(0, 3, (8,), generator=data)
    nn.functional.cross_entropy(model(tokens), labels).backward()
    keys = set()
    for i in range(2):
        attn = model.get_submodule(f"encoder.layer.{i}.attention.self")
        assert attn.key.bias.grad.abs().max() < 1e-6 * attn.query.bias.grad.abs().max()
        keys.add(f"encoder.layer.{i}.attention.self.key.bias")
    return keys


def run_script(backend: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The compression script; ``backend`` supplies the library's calls."""
    torch.manual_seed(0)
    model = TinyBert()
    model = backend["init_compression"](model, CONFIG)
    rng_probe = torch.rand(1).item()  # same number of global draws as DeepSpeed?
    stepper = backend["stepper"](model)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    data = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 32, (NUM_STEPS, 8, 6), generator=data)
    labels = torch.randint(0, 3, (NUM_STEPS, 8), generator=data)
    losses = []
    for step in range(NUM_STEPS):
        stepper.before_forward(step)
        loss = nn.functional.cross_entropy(model(tokens[step]), labels[step])
        loss.backward()
        optimizer.step()
        stepper.after_optimizer_step(optimizer)
        losses.append(loss.item())

    names = [f"encoder.layer.{i}" for i in range(2)]
    sparse_masks = {
        f"{n}.attention.self.{p}": _bits(
            model.get_submodule(f"{n}.attention.self.{p}").sparse_pruning_mask
        )
        for n in names
        for p in ("query", "key", "value")
    }
    head_masks = {}
    row_masks = {}
    for n in names:
        o = model.get_submodule(f"{n}.attention.output.dense")
        head_masks[n] = _kept(_topk(o.head_pruning_scores.data, 0.5))
        i = model.get_submodule(f"{n}.intermediate.dense")
        row_masks[n] = _kept(_topk(i.row_mask_scores.data, 0.5))
    num_params_before = sum(p.numel() for p in model.parameters())
    levels = {  # distinct values per quantization group (2 groups per weight)
        name: [len(torch.unique(g)) for g in module.weight.data.reshape(2, -1)]
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.startswith("encoder")
    }
    model.eval()
    with torch.no_grad():
        logits_before_clean = model(tokens[0])
    model = backend["redundancy_clean"](model, CONFIG)
    with torch.no_grad():
        logits_after_clean = model(tokens[0])
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    result = {
        "rng_probe": rng_probe,
        "losses": losses,
        "sparse_masks": sparse_masks,
        "head_kept": head_masks,
        "row_kept": row_masks,
        "num_params_before_clean": num_params_before,
        "levels_per_group": levels,
        "num_params_after_clean": sum(p.numel() for p in model.parameters()),
        "shapes": {k: list(v.shape) for k, v in state.items()},
        "logits_before_clean": logits_before_clean.tolist(),
        "logits_after_clean": logits_after_clean.tolist(),
    }
    return result, state


def _topk(scores: torch.Tensor, ratio: float) -> torch.Tensor:
    flat = scores.flatten()
    keep = torch.zeros_like(flat)
    keep[flat.sort(descending=True)[1][: math.ceil(ratio * flat.numel())]] = 1
    return keep


def _kept(mask: torch.Tensor) -> list[int]:
    return [int(i) for i in mask.flatten().nonzero().flatten()]


def _bits(mask: torch.Tensor) -> str:
    return "".join("1" if v else "0" for v in mask.flatten().tolist())


# -- backends ----------------------------------------------------------------------------------


class _ShardSpeedStepper:
    def __init__(self, model: nn.Module) -> None:
        from shardspeed.compression import build_compression_hook

        self.hook = build_compression_hook(model, CONFIG)

    def before_forward(self, step: int) -> None:
        self.hook.before_forward(step)

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad()
        self.hook.after_optimizer_step(applied=True)


def shardspeed_backend() -> dict[str, Any]:
    from shardspeed.compression import compress

    return {
        "init_compression": compress.init_compression,
        "redundancy_clean": compress.redundancy_clean,
        "stepper": _ShardSpeedStepper,
    }


class _DeepSpeedEngineEmulation:
    """DeepSpeed 0.19.6's engine calls around compression, in its order (fp16 MoQ path)."""

    def __init__(self, model: nn.Module) -> None:
        from deepspeed.compression.config import get_compression_config
        from deepspeed.compression.scheduler import compression_scheduler
        from deepspeed.runtime.quantize import Quantizer

        config = get_compression_config(json.loads(json.dumps(CONFIG)))
        self.model = model
        self.scheduler = compression_scheduler(model, config)
        sp = self.scheduler.different_compression_methods["sparse_pruning"]
        sp["shared_parameters"]["schedule_offset_end"] = float("inf")  # 0.19.6 KeyError
        wq = config["weight_quantization"]["shared_parameters"]
        self.quantizer = Quantizer(
            q_groups=wq["quantize_groups"],
            q_mixed_fp16=wq["fp16_mixed_quantize"],
            q_change_ratio=wq["quantize_change_ratio"],
            q_type=wq["quantization_type"],
            q_rounding=wq["rounding"],
            q_verbose=wq["quantize_verbose"],
            q_eigenvalue=False,
            use_quantizer_kernel=wq["quantizer_kernel"],
            layer_num=0,
        )

    def _quantize(self) -> None:
        if self.scheduler.weight_quantization_enabled:
            self.quantizer.quantize([list(self.model.parameters())], False, False, None)

    def before_forward(self, step: int) -> None:
        if step == 0:
            self.scheduler.step(step_zero_check=True)
            self._quantize()

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self._quantize()
        optimizer.zero_grad()
        self.scheduler.step()


def deepspeed_backend() -> dict[str, Any]:
    from deepspeed.compression import compress

    return {
        "init_compression": compress.init_compression,
        "redundancy_clean": compress.redundancy_clean,
        "stepper": _DeepSpeedEngineEmulation,
    }


# -- recording ---------------------------------------------------------------------------------

_DS_FILES = [
    "deepspeed/compression/__init__.py",
    "deepspeed/compression/basic_layer.py",
    "deepspeed/compression/compress.py",
    "deepspeed/compression/config.py",
    "deepspeed/compression/constants.py",
    "deepspeed/compression/helper.py",
    "deepspeed/compression/scheduler.py",
    "deepspeed/compression/utils.py",
    "deepspeed/runtime/config_utils.py",
    "deepspeed/runtime/quantize.py",
]
_DS_STUBS = {
    "deepspeed/__init__.py": "",
    "deepspeed/utils/__init__.py": 'import logging\nlogger = logging.getLogger("ds")\n',
    "deepspeed/comm/__init__.py": "",
    "deepspeed/runtime/__init__.py": "",
    "deepspeed/ops/__init__.py": "",
    "deepspeed/ops/quantizer/__init__.py": "def ds_quantizer(*args, **kwargs):\n"
    "    raise RuntimeError('CUDA kernel stub')\n",
}


def _deepspeed_stub(root: Path) -> Path:
    """Unpack DeepSpeed 0.19.6's pure-PyTorch compression code into a stub package."""
    source = Path(os.environ.get("SHARDSPEED_DS_SRC", "/tmp/ds0196"))
    tarballs = sorted(source.glob("deepspeed-0.19.6*.tar.gz"))
    if not tarballs:
        raise FileNotFoundError(f"no deepspeed-0.19.6 sdist in {source} (SHARDSPEED_DS_SRC)")
    with tarfile.open(tarballs[0]) as tar:
        for relative in _DS_FILES:
            member = tar.extractfile(f"deepspeed-0.19.6/{relative}")
            assert member is not None
            (root / relative).parent.mkdir(parents=True, exist_ok=True)
            (root / relative).write_bytes(member.read())
    for relative, text in _DS_STUBS.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text)
    return root


def record(out_dir: Path) -> None:
    """Run the script under DeepSpeed (this process must import the stub package)."""
    result, state = run_script(deepspeed_backend())
    result["recorded_with"] = f"deepspeed 0.19.6 compression (stub), torch {torch.__version__}"
    result["command"] = "SHARDSPEED_RECORD_GOLDENS=1 pytest tests/unit/test_compression_golden.py"
    (out_dir / "deepspeed_0196.json").write_text(json.dumps(result, indent=1) + "\n")
    torch.save(state, out_dir / "deepspeed_0196_state.pt")


def _record_with_subprocess(tmp: Path) -> None:
    stub = _deepspeed_stub(tmp / "stub")
    env = {**os.environ, "PYTHONPATH": str(stub)}
    subprocess.run(
        [sys.executable, __file__, str(GOLDEN_DIR)],
        check=True,
        env=env,
        cwd=str(tmp),
    )


# -- the test ----------------------------------------------------------------------------------


def test_compression_script_matches_deepspeed_0196(tmp_path: Path) -> None:
    if os.environ.get("SHARDSPEED_RECORD_GOLDENS") == "1":
        _record_with_subprocess(tmp_path)
    golden = json.loads((GOLDEN_DIR / "deepspeed_0196.json").read_text())
    golden_state = torch.load(GOLDEN_DIR / "deepspeed_0196_state.pt")
    result, state = run_script(shardspeed_backend())

    assert result["rng_probe"] == golden["rng_probe"]  # same global-RNG draws
    assert result["sparse_masks"] == golden["sparse_masks"]
    assert result["head_kept"] == golden["head_kept"]
    assert result["row_kept"] == golden["row_kept"]
    assert result["num_params_before_clean"] == golden["num_params_before_clean"]
    assert result["num_params_after_clean"] == golden["num_params_after_clean"]
    assert result["shapes"] == golden["shapes"]
    assert result["levels_per_group"] == golden["levels_per_group"]
    quantized = [n for n in result["levels_per_group"] if "attention.output" not in n]
    assert all(max(result["levels_per_group"][n]) <= 2**4 for n in quantized)  # 4 bits
    # what the ratios predict: per layer q/k/v and the output projection lose half their
    # heads, the FFN half its rows (and the next layer those columns); scores are dropped
    hidden, ffn, heads = 16, 32, NUM_HEADS
    saved_per_layer = (
        3 * (hidden * hidden + hidden) // 2  # q, k, v: half the rows and biases
        + hidden * hidden // 2  # attention.output.dense: half the input columns
        + (ffn * hidden + ffn) // 2  # intermediate.dense: half the rows and biases
        + hidden * ffn // 2  # output.dense: half the input columns
        + heads  # head scores
        + ffn  # row scores
    )
    assert result["num_params_after_clean"] == result["num_params_before_clean"] - 2 * (
        saved_per_layer
    )
    torch.testing.assert_close(result["losses"], golden["losses"], rtol=1e-5, atol=1e-6)
    noise_only = _noise_driven_parameters()
    for key, value in golden_state.items():
        if key in noise_only:
            # Adam turns this parameter's rounding-noise gradient into lr-sized steps whose
            # signs depend on the CPU's summation order (AVX2 and AVX-512 GEMMs differ), so
            # it is checked against Adam's reach, not the recording machine's noise.
            assert torch.isfinite(state[key]).all(), key
            assert (state[key] - value).abs().max() <= 2 * NUM_STEPS * LR, key
            continue
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)
    torch.testing.assert_close(
        result["logits_before_clean"], golden["logits_before_clean"], rtol=1e-5, atol=1e-6
    )
    # Cleaning must not change the function. DeepSpeed leaves the attention's head count at
    # 4 after removing half the q/k/v heads (its cleaned model splits 8 features into 4
    # heads of 2), so its logits after cleaning differ; ShardSpeed updates the count.
    torch.testing.assert_close(
        result["logits_after_clean"], result["logits_before_clean"], rtol=1e-5, atol=1e-5
    )
    assert result["logits_after_clean"] != golden["logits_after_clean"]


if __name__ == "__main__":
    record(Path(sys.argv[1]))
