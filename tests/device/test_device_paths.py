"""The training engine and the inference engines on a device: CPU here, CUDA when lent.

Each test runs once per device: ``cpu`` in every run of the suite (so the test itself is
known to be right) and ``cuda`` only with a GPU (marker ``gpu``: ``make test-gpu``, or
``tools/gpu/session.sh`` on a lent machine). What CUDA adds over the CPU runs elsewhere:
NCCL (world of one), the engine's device placement and streams, pinned host buffers of the
CPU-offloaded optimizer, FastGen's attention and KV cache on the device, and CUDA-graph
decoding.

* training: ZeRO 0-3 (fp32) and ZeRO 2 with the optimizer offloaded to the host train like
  the single-process fp32 reference of the parity tests (``tests/dist/parity_common.py``,
  computed on the CPU); fp32 on both devices (TF32 off, torch's default for matmuls), so
  within rtol 1e-4 / atol 1e-5 across devices (1e-5 within one: the reduction order of
  CUDA kernels differs from the CPU's). bf16 ZeRO 3 on the device is a sanity check
  against the fp32 reference (losses within 2e-2 relative);
* inference: FastGen greedy tokens equal Hugging Face ``generate`` on the same device and
  weights (fp32); ``init_inference`` with kernel injection equals the plain model (logits
  1e-4, tokens identical); CUDA-graph decoding equals eager decoding (CUDA only).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from shardspeed.testing import assert_close_rel, run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist"))
from parity_common import ParitySpec, micro_batch, reference_run  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
BACKEND = {"cpu": "gloo", "cuda": "nccl"}
VOCAB = 128


# ------------------------------------------------------------------------------ training
def _train(spec: ParitySpec) -> tuple[list[float], dict[str, torch.Tensor], str]:
    """``shardspeed.initialize`` on this process's device (world of one); batches moved there."""
    from parity_common import make_model

    import shardspeed

    engine, _, _, _ = shardspeed.initialize(model=make_model(spec), config=spec.config())
    losses = []
    for step in range(spec.steps):
        x, y = (t.to(engine.device) for t in micro_batch(spec, step, 0))
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    final = {n: p.detach().float().cpu() for n, p in engine.module.named_parameters()}
    device = str(next(engine.module.parameters()).device)
    engine.destroy()
    return losses, final, device


def _check_training(device: str, spec: ParitySpec, rtol: float, atol: float) -> None:
    losses, final, where = run_distributed(_train, 1, spec, backend=BACKEND[device], timeout=300)[0]
    assert where.startswith(device), f"the engine trained on {where}, not {device}"
    ref_losses, ref_final = reference_run(ParitySpec(**{**spec.__dict__, "precision": "fp32"}))
    assert_close_rel(losses, ref_losses, rtol=rtol, atol=atol, msg=f"{device} losses")
    if spec.precision == "fp32":
        for name, value in ref_final.items():
            assert_close_rel(final[name], value, rtol=rtol, atol=atol, msg=f"{device} {name}")


def _tolerance(device: str) -> tuple[float, float]:
    return (1e-5, 1e-6) if device == "cpu" else (1e-4, 1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stage_trains_like_the_reference(device: str, stage: int) -> None:
    spec = ParitySpec(stage=stage, world=1, steps=3, clip=1.0)
    _check_training(device, spec, *_tolerance(device))


@pytest.mark.parametrize("device", DEVICES)
def test_offloaded_optimizer_trains_like_the_reference(device: str) -> None:
    """ZeRO 2 with the optimizer on the host (pinned buffers on CUDA, the native CPU Adam)."""
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": device == "cuda"}}
    spec = ParitySpec(stage=2, world=1, steps=3, clip=1.0, extra={"zero_optimization": zero})
    _check_training(device, spec, *_tolerance(device))


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_zero3_trains(device: str) -> None:
    spec = ParitySpec(stage=3, world=1, steps=3, clip=1.0, precision="bf16")
    _check_training(device, spec, rtol=2e-2, atol=0.0)


# ----------------------------------------------------------------------------- inference
def _llama() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    model.generation_config.eos_token_id = None
    return model.float().eval()


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 17, 9, 30)]


def _hf_greedy(model: torch.nn.Module, prompts: list[list[int]], device: str) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            gen = model.generate(ids, do_sample=False, max_new_tokens=8, pad_token_id=0)
            out.append(gen[0, len(p) :].tolist())
    return out


def _fastgen(model: torch.nn.Module, device: str, **config: Any) -> Any:
    from shardspeed.inference.fastgen.engine import EngineConfig, InferenceEngine

    cfg = EngineConfig(
        device=device, dtype=torch.float32, block_size=4, num_blocks=128,
        max_ragged_batch_size=32, max_ragged_sequence_count=4, **config,
    )  # fmt: skip
    return InferenceEngine(model, config=cfg)


def _greedy(engine: Any, prompts: list[list[int]]) -> list[list[int]]:
    from shardspeed.inference.fastgen.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    return [o.output_token_ids for o in engine.generate(prompts, [params] * len(prompts))]


@pytest.mark.parametrize("device", DEVICES)
def test_fastgen_greedy_equals_hf_generate(device: str) -> None:
    model, prompts = _llama(), _prompts()
    engine = _fastgen(model, device, compile_decode=False)
    assert engine.device.type == device
    got = _greedy(engine, prompts)
    assert got == _hf_greedy(model.to(device), prompts, device)


@pytest.mark.gpu
def test_cuda_graph_decode_equals_eager() -> None:
    model, prompts = _llama(), _prompts()
    eager = _greedy(_fastgen(model, "cuda", compile_decode=False), prompts)
    graphed = _fastgen(model, "cuda", compile_decode="cuda_graph")
    assert _greedy(graphed, prompts) == eager


@pytest.mark.parametrize("device", DEVICES)
def test_init_inference_kernel_injection_equals_the_model(device: str) -> None:
    import shardspeed

    model, prompts = _llama().to(device), _prompts()
    ids = torch.tensor([prompts[1]], device=device)
    with torch.no_grad():
        want = model(ids).logits
    engine = shardspeed.init_inference(
        _llama().to(device), dtype=torch.float32, replace_with_kernel_inject=True
    )
    with torch.no_grad():
        got = engine(ids).logits
    assert got.device.type == device
    assert_close_rel(got.float().cpu(), want.float().cpu(), rtol=1e-4, atol=1e-4, msg=device)
    with torch.no_grad():
        a = engine.generate(ids, do_sample=False, max_new_tokens=8, pad_token_id=0)
        b = model.generate(ids, do_sample=False, max_new_tokens=8, pad_token_id=0)
    assert a.tolist() == b.tolist()
