"""shardspeed.checkpointing: gradients match an uncheckpointed run, memory drops, config."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

import shardspeed
from shardspeed.models.gpt import Block, GPTConfig
from shardspeed.runtime.activation_checkpointing import config as ck_config

ck = shardspeed.checkpointing


@pytest.fixture(autouse=True)
def _fresh_state():
    ck_config._reset_settings()
    yield
    ck_config._reset_settings()


class DropoutLayer(nn.Module):
    """MLP block with dropout on the default generator and on the tracker stream."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor, scale: float = 1.0):
        h = self.drop(torch.relu(self.fc1(x)))  # default generator
        with ck.get_cuda_rng_tracker().fork():  # model-parallel stream
            h = self.drop(h)
        return x + scale * self.fc2(h), "aux", (h > 0).sum()


def _grads(layers: nn.ModuleList, mode: str, x0: torch.Tensor) -> list[torch.Tensor]:
    ck.model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(7)
    x = x0.clone().requires_grad_(True)
    for layer in layers:
        if mode == "plain":
            x, tag, count = layer(x, 0.5)
        elif mode == "reentrant":
            x, tag, count = ck.checkpoint(layer, x, 0.5)
        elif mode == "non_reentrant":
            x, tag, count = ck.non_reentrant_checkpoint(layer, x, 0.5)
        elif mode == "torch_no_rng":
            x, tag, count = torch.utils.checkpoint.checkpoint(
                layer, x, 0.5, use_reentrant=False, preserve_rng_state=False
            )
        assert tag == "aux" and not count.is_floating_point()
    x.pow(2).sum().backward()
    grads = [p.grad.clone() for p in layers.parameters()] + [
        x0.grad if x0.grad is not None else None
    ]
    layers.zero_grad()
    return grads


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
@pytest.mark.parametrize("cpu_checkpointing", [False, True])
def test_checkpointed_gradients_match_plain_with_dropout(mode, cpu_checkpointing):
    torch.manual_seed(0)
    layers = nn.ModuleList(DropoutLayer() for _ in range(3))
    x0 = torch.randn(8, 16)
    reference = _grads(layers, "plain", x0)
    ck.configure(None, checkpoint_in_cpu=cpu_checkpointing)
    got = _grads(layers, mode, x0)
    for ref, g in zip(reference[:-1], got[:-1]):
        torch.testing.assert_close(g, ref, rtol=0, atol=0)
    # Control: without RNG replay the recompute draws other masks and gradients differ.
    wrong = _grads(layers, "torch_no_rng", x0)
    assert not all(torch.equal(a, b) for a, b in zip(reference[:-1], wrong[:-1]))


def test_checkpoint_sequential_matches_plain():
    torch.manual_seed(0)
    seq = nn.Sequential(
        *[nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.2), nn.GELU()) for _ in range(5)]
    )
    x0 = torch.randn(4, 8)

    def run(use_ckpt: bool) -> list[torch.Tensor]:
        torch.manual_seed(3)
        x = x0.clone().requires_grad_(True)
        out = ck.checkpoint_sequential(seq, 3, x) if use_ckpt else seq(x)
        out.sum().backward()
        grads = [p.grad.clone() for p in seq.parameters()]
        seq.zero_grad()
        return grads

    for a, b in zip(run(False), run(True)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ValueError, match="segments=9"):
        ck.checkpoint_sequential(seq, 9, x0)


def _saved_activation_bytes(model: nn.Module, x: torch.Tensor, use_ckpt: bool) -> int:
    """Bytes autograd keeps for backward, excluding (views of) parameters."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    total = 0

    def pack(t: torch.Tensor):
        nonlocal total
        if t.untyped_storage().data_ptr() not in param_ptrs:
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        h = x
        for layer in model:
            h = ck.checkpoint(layer, h)[0] if use_ckpt else layer(h)[0]
    h.sum().backward()
    return total


class _TupleOut(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.inner(x),)


@pytest.mark.parametrize("kind", ["mlp", "transformer"])
def test_checkpointing_cuts_saved_activation_memory_by_3x(kind):
    torch.manual_seed(0)
    ck.model_parallel_cuda_manual_seed(0)
    if kind == "mlp":
        model = nn.ModuleList(DropoutLayer(32) for _ in range(8))
        x = torch.randn(64, 32, requires_grad=True)
    else:
        cfg = GPTConfig(n_embd=32, n_head=4, dropout=0.1)
        model = nn.ModuleList(_TupleOut(Block(cfg)) for _ in range(8))
        x = torch.randn(2, 16, 32, requires_grad=True)
    plain = _saved_activation_bytes(model, x, use_ckpt=False)
    ckpt = _saved_activation_bytes(model, x, use_ckpt=True)
    assert ckpt == 8 * x.numel() * x.element_size()  # one saved input per layer
    assert ckpt * 3 <= plain, (plain, ckpt)


def test_cpu_checkpointing_keeps_inputs_on_host_and_non_tensor_args_pass():
    ck.configure(None, checkpoint_in_cpu=True)
    seen = []

    def fn(x, k, *, _unused=None):
        return x * k, k

    x = torch.randn(3, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
        y, k = ck.checkpoint(fn, x, 3)
    assert k == 3
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 3.0))
    assert seen and all(t.device.type == "cpu" and t.data_ptr() != x.data_ptr() for t in seen)


def test_configure_reads_dict_path_and_object_and_explicit_args_win(tmp_path):
    block = {
        "partition_activations": True,
        "cpu_checkpointing": True,
        "number_checkpoints": 4,
        "synchronize_checkpoint_boundary": True,
        "profile": False,
    }
    ck.configure(None, deepspeed_config={"activation_checkpointing": block})
    s = ck.settings()
    assert ck.is_configured()
    assert (s.partition_activations, s.cpu_checkpointing, s.num_checkpoints, s.synchronize) == (
        True,
        True,
        4,
        True,
    )

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "activation_checkpointing": block}))
    ck.configure(None, deepspeed_config=str(path), checkpoint_in_cpu=False, num_checkpoints=2)
    s = ck.settings()
    assert (s.cpu_checkpointing, s.num_checkpoints, s.partition_activations) == (False, 2, True)

    class Block:
        partition_activations = False
        cpu_checkpointing = True
        contiguous_memory_optimization = False
        number_checkpoints = None
        synchronize_checkpoint_boundary = False
        profile = True

    class Cfg:
        activation_checkpointing = Block()

    ck.configure(None, deepspeed_config=Cfg())
    s = ck.settings()
    assert (s.cpu_checkpointing, s.profile, s.partition_activations) == (True, True, False)

    ck.set_num_layers(12)
    ck.partition_activations_in_checkpoint(True)
    assert (ck.settings().num_checkpoints, ck.settings().partition_activations) == (12, True)
    ck.reset()
    assert ck.is_configured()


def test_configure_rejects_bad_values():
    with pytest.raises(ValueError, match="needs num_checkpoints"):
        ck.configure(None, partition_activations=True, contiguous_checkpointing=True)
    with pytest.raises(ValueError, match="cpu_checkpoint.*did you mean 'cpu_checkpointing'"):
        ck.configure(None, deepspeed_config={"activation_checkpointing": {"cpu_checkpoint": True}})
    with pytest.raises(ValueError, match="no such file"):
        ck.configure(None, deepspeed_config="/nonexistent/ds.json")
    assert not ck.is_configured()


def test_rng_tracker_fork_on_cpu_and_seed_offsets():
    class FakeMpu:
        def get_model_parallel_rank(self):
            return 3

        def get_model_parallel_world_size(self):
            return 4

        def get_model_parallel_group(self):
            return None

    ck.configure(FakeMpu())
    ck.model_parallel_cuda_manual_seed(10)
    tracker = ck.get_cuda_rng_tracker()
    default_draw = torch.rand(3)  # default generator was seeded with 10
    torch.manual_seed(10)
    torch.testing.assert_close(default_draw, torch.rand(3))

    with tracker.fork():
        forked = torch.rand(3)
    torch.manual_seed(10 + 2718 + 3)
    torch.testing.assert_close(forked, torch.rand(3))

    before = torch.get_rng_state()
    with tracker.fork("model-parallel-rng"):
        torch.rand(5)
    assert torch.equal(before, torch.get_rng_state())  # default stream untouched

    states = tracker.get_states()
    with tracker.fork():
        a = torch.rand(2)
    tracker.set_states(states)
    with tracker.fork():
        b = torch.rand(2)
    torch.testing.assert_close(a, b)

    with pytest.raises(ValueError, match="no stream named 'nope'"):
        with tracker.fork("nope"):
            pass
    with pytest.raises(ValueError, match="already used"):
        tracker.add("other", 10 + 2718 + 3)
    tracker.reset()
    assert tracker.get_states() == {}


def test_reentrant_checkpoint_rejects_autograd_grad():
    x = torch.randn(3, requires_grad=True)
    y = ck.checkpoint(lambda t: t.sin(), x)
    with pytest.raises(RuntimeError, match="non_reentrant_checkpoint"):
        torch.autograd.grad(y.sum(), x)
    (g,) = torch.autograd.grad(ck.non_reentrant_checkpoint(lambda t: t.sin(), x).sum(), x)
    torch.testing.assert_close(g, x.cos())
