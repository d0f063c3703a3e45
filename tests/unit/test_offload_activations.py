"""``CheckpointHiddenStatesOffload``: checkpoint-layer inputs go to host memory and back.

A tiny Hugging Face Llama with gradient checkpointing trains two steps inside the context
and without it; losses and gradients must be identical bit for bit. On this CPU host the
real rule skips every tensor (nothing to offload from), so the parity tests patch the
"is this on an async accelerator" predicate to exercise the copy path CPU -> host buffer.
"""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import GradientCheckpointingLayer, LlamaConfig, LlamaForCausalLM

import shardspeed as deepspeed
from shardspeed.runtime.activation_checkpointing import offload_activations as oa

NUM_LAYERS = 3
BATCH, SEQ, HIDDEN, VOCAB = 2, 16, 32, 64


def _tiny_llama(use_reentrant: bool) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        attn_implementation="eager",
        use_cache=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.activation_checkpointing_enable({"use_reentrant": use_reentrant})
    model.train()
    return model


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(2)]


def _train(model: LlamaForCausalLM, ctx: oa.CheckpointHiddenStatesOffload | None):
    """Two SGD steps; the losses and the gradients of the last step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    with ctx if ctx is not None else torch.enable_grad():
        for ids in _batches():
            optimizer.zero_grad()
            loss = model(input_ids=ids, labels=ids).loss  # ids: (B, T)
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return losses, grads


@functools.cache
def _reference(use_reentrant: bool):
    """The plain run (gradient checkpointing, no offload context), computed once."""
    return _train(_tiny_llama(use_reentrant), None)


def _assert_clean(ctx: oa.CheckpointHiddenStatesOffload) -> None:
    assert oa._manager_stack() == []
    assert "__call__" not in GradientCheckpointingLayer.__dict__
    assert oa._MarkerPatch.wrapper is None and oa._MarkerPatch.num_users == 0
    assert not (ctx._tracker or ctx._keep_last or ctx._fwd_stash or ctx._restored)
    assert not ctx._allowed


@pytest.fixture
def host_offload(monkeypatch: pytest.MonkeyPatch) -> None:
    """Treat CPU tensors as accelerator tensors so the copy path runs on this host."""
    monkeypatch.setattr(oa, "_on_async_accelerator", lambda tensor: True)


@pytest.mark.parametrize(("use_reentrant", "keep_last_count"), [(False, 1), (True, 0)])
def test_training_inside_context_matches_plain_run(
    host_offload: None, use_reentrant: bool, keep_last_count: int
):
    ref_losses, ref_grads = _reference(use_reentrant)
    module = deepspeed.runtime.activation_checkpointing.offload_activations
    ctx = module.get_checkpoint_hidden_states_offloading_ctx_manager(
        keep_last_count=keep_last_count
    )
    losses, grads = _train(_tiny_llama(use_reentrant), ctx)

    for got, want in zip(losses, ref_losses, strict=True):
        assert torch.equal(got, want)
    for name, want in ref_grads.items():
        assert torch.equal(grads[name], want), name

    # per step: 3 layer inputs marked; the newest keep_last_count stay on the device and
    # the others go to host memory and come back for the recompute
    num_offloaded = 2 * (NUM_LAYERS - keep_last_count)
    layer_input_bytes = BATCH * SEQ * HIDDEN * 4  # (B, T, H) float32
    stats = ctx.stats
    assert stats.marked_tensors == 2 * NUM_LAYERS
    assert stats.offloaded_tensors == stats.restored_tensors == num_offloaded
    assert stats.kept_last_tensors == 2 * keep_last_count
    assert stats.skipped_marked_tensors == 0
    assert stats.offloaded_bytes == stats.restored_bytes == num_offloaded * layer_input_bytes
    assert stats.saved_tensors_seen > stats.marked_tensors  # everything else passed through
    _assert_clean(ctx)


def test_cpu_host_skips_marked_tensors_as_deepspeed():
    ref_losses, ref_grads = _reference(False)
    ctx = oa.CheckpointHiddenStatesOffload()
    losses, grads = _train(_tiny_llama(False), ctx)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True))
    assert all(torch.equal(grads[n], g) for n, g in ref_grads.items())
    assert ctx.stats.marked_tensors == ctx.stats.skipped_marked_tensors == 2 * NUM_LAYERS
    assert ctx.stats.offloaded_tensors == ctx.stats.restored_tensors == 0
    _assert_clean(ctx)


def test_nothing_marked_without_grad_or_in_eval(host_offload: None):
    model = _tiny_llama(False)
    ids = _batches()[0]
    with oa.CheckpointHiddenStatesOffload() as ctx:
        with torch.no_grad():
            model(input_ids=ids)
        model.eval()
        model(input_ids=ids, labels=ids).loss.backward()
    assert ctx.stats.marked_tensors == 0 and ctx.stats.offloaded_tensors == 0
    _assert_clean(ctx)


def test_backward_after_exit_raises_a_clear_error(host_offload: None):
    model = _tiny_llama(False)
    ids = _batches()[0]
    with oa.CheckpointHiddenStatesOffload() as ctx:
        loss = model(input_ids=ids, labels=ids).loss
    with pytest.raises(RuntimeError, match="Run backward\\(\\) inside the same"):
        loss.backward()
    _assert_clean(ctx)


def test_same_instance_is_not_reentrant_but_nesting_works():
    outer, inner = oa.CheckpointHiddenStatesOffload(), oa.CheckpointHiddenStatesOffload()
    with outer:
        with pytest.raises(RuntimeError, match="not re-entrant"):
            outer.__enter__()
        with inner:
            assert oa._current_manager() is inner
            assert oa._MarkerPatch.num_users == 2
        assert oa._current_manager() is outer
        assert "__call__" in GradientCheckpointingLayer.__dict__  # outer still needs it
    _assert_clean(outer)


@pytest.mark.parametrize(
    "name",
    ["keep_last_count", "max_fwd_stash_count", "max_cpu_buffer_pool_count", "min_offload_bytes"],
)
def test_negative_counts_are_refused_by_name(name: str):
    with pytest.raises(ValueError, match=f"{name} must be >= 0, got -1"):
        oa.get_checkpoint_hidden_states_offloading_ctx_manager(**{name: -1})


def test_engine_restores_strided_tensors_and_skips_what_it_cannot_move(host_offload: None):
    engine = oa._ActivationOffloadEngine(keep_last_count=0, min_offload_bytes=64)
    source = torch.arange(24.0).view(4, 6).t()  # (6, 4), non-contiguous
    tensor_id = engine.offload_input(source)
    assert tensor_id is not None and engine.stats.offloaded_tensors == 1
    restored = engine.restore_input(tensor_id)
    assert restored.data_ptr() != source.data_ptr()
    assert torch.equal(restored, source) and restored.stride() == source.stride()
    with pytest.raises(RuntimeError, match="no longer held"):
        engine.restore_input(tensor_id)

    skipped = [
        torch.ones(4),  # below min_offload_bytes
        torch.ones(1, 64).expand(8, 64),  # stride-0 view
        torch.nn.Parameter(torch.ones(64)),
    ]
    assert all(engine.offload_input(t) is None for t in skipped)
    assert engine.stats.skipped_marked_tensors == len(skipped)


def test_explicit_patch_outlives_contexts():
    oa.patch_gradient_checkpointing_layer_marker()
    try:
        with oa.CheckpointHiddenStatesOffload():
            pass
        assert oa._MarkerPatch.wrapper is GradientCheckpointingLayer.__dict__["__call__"]
    finally:
        oa._unpatch_gradient_checkpointing_layer_marker()
    assert "__call__" not in GradientCheckpointingLayer.__dict__
