"""ZeRO-Inference weight offload in the FastGen engine (``offload={...}``).

Oracle: the same engine without offload. Streaming only moves bytes, so greedy
tokens must be identical (no tolerance). Device-side memory is measured as the
bytes of the distinct storages the forward can reach: the model's parameters and
buffers, the offload ring and the KV cache, sampled inside every layer's forward and
once the engine has loaded (on CUDA also with the allocator's peak over the load).
"""

from __future__ import annotations

import os

import pytest
import torch

from shardspeed.inference.fastgen import engine as engine_module
from shardspeed.inference.fastgen.offload_config import OffloadConfig
from shardspeed.inference.fastgen.offload_store import plan_layout
from shardspeed.inference.serving.pipeline import pipeline

PROMPTS = [[5, 9, 17, 33, 2, 64], [7, 7, 8], [100, 3, 50, 51, 52, 9, 10, 11, 12]]
MAX_NEW = 8
ENGINE = dict(block_size=4, max_ragged_batch_size=16, max_ragged_sequence_count=4)


def _llama(num_layers: int = 8, hidden: int = 64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128, hidden_size=hidden, intermediate_size=256, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        initializer_range=0.1,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).float().eval()


@pytest.fixture(scope="module")
def llama8():
    return _llama()


def _generate(model, **kwargs) -> tuple[list[list[int]], object]:
    pipe = pipeline(model, **{"num_blocks": 64, **ENGINE, **kwargs})
    tokens = [r.token_ids for r in pipe(PROMPTS, max_new_tokens=MAX_NEW, ignore_eos=True)]
    return tokens, pipe.engine


def _storage_bytes(tensors) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _device_tensors(engine) -> list[torch.Tensor]:
    m = engine.model
    ring = engine.weight_offload.ring if engine.weight_offload is not None else []
    return [*m.parameters(), *m.buffers(), *ring, *engine.kv_cache.k, *engine.kv_cache.v]


def test_plan_layout_aligns_every_tensor():
    slots, total = plan_layout([((3,), torch.float32), ((2, 5), torch.bfloat16), ((), torch.int8)])
    assert [s.offset for s in slots] == [0, 256, 512]
    assert [s.nbytes for s in slots] == [12, 20, 1]
    assert total == 768
    image = torch.zeros(total, dtype=torch.uint8)
    slots[1].view(image).fill_(1.5)
    assert image[256:276].view(torch.bfloat16).eq(1.5).all() and image[:256].eq(0).all()


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_cpu_offload_matches_resident(llama8, prefetch):
    want, plain = _generate(llama8)
    got, engine = _generate(llama8, offload={"device": "cpu", "prefetch": prefetch})
    assert got == want
    assert plain.weight_offload is None  # no hooks without offload
    assert not any(layer._forward_pre_hooks for layer in plain.model.layers)
    streamer = engine.weight_offload
    assert streamer.num_buffers == prefetch + 1 and len(streamer.ring) == prefetch + 1
    # the streamed layers' tensors are views of the ring, not storages of their own
    ring_ptrs = {buf.untyped_storage().data_ptr() for buf in streamer.ring}
    layer_ptrs = {p.untyped_storage().data_ptr() for p in engine.model.layers.parameters()}
    assert layer_ptrs <= ring_ptrs


def test_nvme_offload_matches_resident(llama8, tmp_path):
    want, _ = _generate(llama8)
    got, engine = _generate(llama8, offload={"device": "nvme", "path": str(tmp_path)})
    assert got == want
    store = engine.weight_offload.store
    files = sorted(p.name for p in store.directory.iterdir())
    assert len(files) == 8 and files[0] == "layer_00000.bin"
    assert sum(os.path.getsize(store.directory / f) for f in files) == store.nbytes()
    engine.weight_offload.close()
    assert not store.directory.exists()


def test_model_4x_over_budget_generates_within_budget(monkeypatch):
    model = _llama(num_layers=12)
    want, _ = _generate(model)
    weight_bytes = _storage_bytes([*model.parameters(), *model.buffers()])
    budget = weight_bytes // 4
    builds = []

    def spy_build_model(*args, **kwargs):
        builds.append((args[2], kwargs.get("target_device")))
        return build_model(*args, **kwargs)

    build_model = engine_module.build_model
    monkeypatch.setattr(engine_module, "build_model", spy_build_model)
    pipe = pipeline(model, offload={"device": "cpu", "budget_bytes": budget}, **ENGINE)
    engine = pipe.engine
    # load: built on the host for the compute device; then the device holds only what
    # the streamer placed there (resident modules + ring), also under the budget
    assert builds == [(torch.device("cpu"), engine.device)]
    streamer = engine.weight_offload
    loaded = _storage_bytes([*engine.model.parameters(), *engine.model.buffers(), *streamer.ring])
    assert loaded == streamer.load_peak_bytes == streamer.device_weight_bytes
    assert 0 < streamer.load_peak_bytes < budget, (streamer.load_peak_bytes, budget)
    assert all(
        p.numel() == 0
        or p.untyped_storage().data_ptr() in {b.untyped_storage().data_ptr() for b in streamer.ring}
        for p in engine.model.layers.parameters()
    )  # no layer keeps a host copy of its own
    peak = 0

    def measure(module, args):
        nonlocal peak
        peak = max(peak, _storage_bytes(_device_tensors(engine)))

    for layer in engine.model.layers:
        layer.register_forward_pre_hook(measure)
    got = [r.token_ids for r in pipe(PROMPTS, max_new_tokens=MAX_NEW, ignore_eos=True)]
    assert got == want
    assert weight_bytes >= 4 * budget
    assert 0 < peak < budget, (peak, budget)
    kv_bytes = _storage_bytes([*engine.kv_cache.k, *engine.kv_cache.v])
    assert peak == streamer.device_weight_bytes + kv_bytes


@pytest.mark.gpu
def test_cuda_load_peak_stays_under_budget():
    model = _llama(num_layers=12, hidden=128)  # on the host, like a checkpoint
    weight_bytes = _storage_bytes([*model.parameters(), *model.buffers()])
    budget = weight_bytes // 4
    want, _ = _generate(model, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    offload = {"device": "cpu", "budget_bytes": budget}
    pipe = pipeline(model, device="cuda", offload=offload, num_blocks=64, **ENGINE)
    load_peak = torch.cuda.max_memory_allocated() - base
    assert 0 < load_peak < budget, (load_peak, budget)
    got = [r.token_ids for r in pipe(PROMPTS, max_new_tokens=MAX_NEW, ignore_eos=True)]
    assert got == want
    assert torch.cuda.max_memory_allocated() - base < budget
    pipe.shutdown()


def test_shutdown_closes_weight_offload_and_is_idempotent(llama8, tmp_path):
    pipe = pipeline(llama8, offload={"device": "nvme", "path": str(tmp_path)}, **ENGINE)
    engine = pipe.engine
    streamer = engine.weight_offload
    assert engine.generate([PROMPTS[0]])[0].output_token_ids
    directory = streamer.store.directory
    assert directory.exists()
    worker_threads = set(streamer._worker._threads)
    assert worker_threads and all(t.is_alive() for t in worker_threads)
    engine.shutdown()
    assert streamer.closed and not directory.exists()
    assert not any(t.is_alive() for t in worker_threads)
    assert not any(layer._forward_pre_hooks for layer in engine.model.layers)
    engine.shutdown()  # idempotent
    pipe.shutdown()  # the pipeline's shutdown reaches the same engine: still fine
    with pytest.raises(RuntimeError, match="was shut down"):
        engine.add_request(PROMPTS[0])


def test_quantize_for_another_target_device_keeps_buffers_on_the_host():
    from shardspeed.inference.quantization import quantize_model
    from shardspeed.inference.quantization.linear import QuantizedLinear

    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        pytest.skip("this torch build has no CPU int4 kernel to contrast with")
    torch.manual_seed(0)
    here = quantize_model(torch.nn.Sequential(torch.nn.Linear(128, 64)), "int4")
    # "meta" stands in for a device this host cannot run: no torch kernel fits it, so
    # the choice must come from target_device, not from where the weight is
    there = quantize_model(torch.nn.Sequential(torch.nn.Linear(128, 64)), "int4", "meta")
    assert isinstance(here[0], QuantizedLinear) and isinstance(there[0], QuantizedLinear)
    assert here[0].kernel.name == "torch_int4_cpu"
    assert there[0].kernel.name == "reference"
    assert all(b.device.type == "cpu" for b in there[0].buffers())


def test_int4_offload_matches_int4_resident(tmp_path):
    model = _llama(num_layers=4, hidden=128)
    want, _ = _generate(model, quantization="int4")
    got, engine = _generate(
        model, quantization="int4", offload={"device": "nvme", "path": str(tmp_path)}
    )
    assert got == want
    layer0 = engine.model.layers[0]
    assert any(name.endswith("qweight") for name, _ in layer0.named_buffers())


def test_demo_gpt_offload_matches_resident(tmp_path):
    from shardspeed.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=128, block_size=64, n_layer=4, n_head=2, n_embd=32)).eval()
    with torch.no_grad():  # larger weights: each layer changes the argmax (GPT's init is 0.02)
        for p in gpt.parameters():
            p.mul_(10.0)
    want, _ = _generate(gpt)
    assert _generate(gpt, offload={"device": "cpu", "prefetch": 2})[0] == want
    assert _generate(gpt, offload={"device": "nvme", "path": str(tmp_path)})[0] == want


def test_interrupted_forward_restarts_prefetch(llama8):
    want, _ = _generate(llama8)
    pipe = pipeline(llama8, offload={"device": "cpu", "prefetch": 2}, num_blocks=64, **ENGINE)
    streamer = pipe.engine.weight_offload
    streamer._before_layer(5)  # a forward that died after entering layer 5
    got = [r.token_ids for r in pipe(PROMPTS, max_new_tokens=MAX_NEW, ignore_eos=True)]
    assert got == want


@pytest.mark.parametrize(
    "offload,match",
    [
        ({"device": "cpu", "prefetch_depth": 2}, r"unknown key\(s\) \['prefetch_depth'\]"),
        ({"device": "gpu"}, r"offload\['device'\]='gpu'.*'cpu', 'nvme', 'none'"),
        ({"device": "nvme"}, r"needs 'path'"),
        ({"device": "cpu", "path": "/tmp"}, r"only used with device='nvme'"),
        ({"device": "cpu", "prefetch": -1}, r"offload\['prefetch'\]=-1 must be an int >= 0"),
        ({"device": "cpu", "budget_bytes": 0}, r"offload\['budget_bytes'\]=0"),
        ({"device": "cpu", "pin_memory": "yes"}, r"pin_memory"),
        ("cpu", r"must be a dict"),
    ],
)
def test_bad_offload_dicts(offload, match):
    with pytest.raises(ValueError, match=match):
        OffloadConfig.parse(offload)


def test_bad_nvme_paths(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(ValueError, match="not an existing directory"):
        OffloadConfig.parse({"device": "nvme", "path": str(not_a_dir)})
    if os.geteuid() != 0:  # root may write anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ValueError, match="not writable"):
            OffloadConfig.parse({"device": "nvme", "path": str(locked)})
    assert OffloadConfig.parse({"device": "none"}) is None
    assert OffloadConfig.parse({"device": "nvme", "path": tmp_path}).path == str(tmp_path)


def test_engine_level_offload_errors(llama8):
    with pytest.raises(ValueError, match="compile_decode"):
        pipeline(llama8, offload={"device": "cpu"}, compile_decode=True, **ENGINE)
    with pytest.raises(ValueError, match="budget_bytes'\\]=1000 is too small"):
        pipeline(llama8, offload={"device": "cpu", "budget_bytes": 1000}, **ENGINE)
    with pytest.raises(ValueError, match="kv_cache_memory=10000000 B does not fit"):
        pipeline(
            llama8, offload={"device": "cpu", "budget_bytes": 2**20},
            kv_cache_memory=10_000_000, **ENGINE,
        )  # fmt: skip
