"""Checkpoints of tensor-parallel (AutoTP) engines: save, reshard across (tp, dp, stage), export.

Layouts are (tp, dp, ZeRO stage) over tp in {1, 2}, dp in {1, 2}, stage in {1, 3}; the
global batch is the same two micro-batches in every layout (GAS = 2 / dp), so every layout
trains the same math. A checkpoint saved after 3 steps at layout A is loaded at layout B
(a fresh engine, other initial weights), re-saved at once, and trained 3 more steps:

* the re-saved checkpoint must hold exactly the saved state: every (parameter, kind) full
  tensor (fp32 masters and SGD momentum, tensor-parallel shards assembled from their tensor
  ranks' pieces) bitwise equal;
* the continued losses and the final full weights (``engine.state_dict()``) must match a
  one-process run of 6 steps (fp32, 1e-5 relative, as the other parity tests);
* at the same layout the continued losses equal the uninterrupted run's bitwise.

The manifest records the mesh; ``save_16bit_model`` and ``get_fp32_state_dict_from_checkpoint``
give the full weights in the model's own names. The default run checks a representative
subset of the 8 x 7 matrix (tp 2 -> 1, 1 -> 2, stage and dp changes together, GPT-2's fused
``c_attn``); the whole matrix is ``@pytest.mark.slow``.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from test_tp_engine import PIPE_LAYERS, PIPE_M, _pipe_batch, _pipe_config, _pipe_reference, _TPBlock

from shardspeed.testing import assert_close_rel, run_distributed

pytest.importorskip("transformers")

CONFIGS = {
    "llama": dict(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2),
    "gpt2": dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=16,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
}  # fmt: skip
MICRO, SEQ, LR, CLIP, SAVE_AT, STEPS = 2, 8, 0.1, 0.3, 3, 6
NUM_MICRO = 2  # global micro-batches per step, in every layout
Layout = tuple[int, int, int]  # (tp, dp, stage)
LAYOUTS: list[Layout] = list(itertools.product((1, 2), (1, 2), (1, 3)))


def _model(kind: str, seed: int = 0) -> Any:
    import transformers as tf

    torch.manual_seed(seed)
    if kind == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(**CONFIGS[kind]))
    return tf.LlamaForCausalLM(tf.LlamaConfig(**CONFIGS[kind]))


def _ids(step: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randint(0, 64, (MICRO, SEQ), generator=g)


def _config(layout: Layout, **zero: Any) -> dict[str, Any]:
    tp, dp, stage = layout
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": NUM_MICRO // dp,
        "gradient_clipping": CLIP,
        "tensor_parallel": {"autotp_size": tp},
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero},
    }


def _engine(kind: str, layout: Layout, seed: int = 0, **zero: Any) -> Any:
    import shardspeed

    engine, _, _, _ = shardspeed.initialize(
        model=_model(kind, seed), config=_config(layout, **zero)
    )
    assert (engine.mp_world_size, engine.dp_world_size, engine.stage) == layout
    return engine


def _train(engine: Any, steps: range) -> list[dict[int, float]]:
    """Train ``steps``; per step, this rank's loss of each global micro-batch it ran."""
    gas = NUM_MICRO // engine.dp_world_size
    out = []
    for step in steps:
        losses = {}
        for k in range(gas):
            micro = k * engine.dp_world_size + engine.dp_rank
            ids = _ids(step, micro)
            loss = engine(ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses[micro] = float(loss)
        out.append(losses)
    return out


def _full_state(engine: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in engine.state_dict().items()}


def _rank_jobs(jobs: list[dict[str, Any]]) -> list[Any]:
    from shardspeed.checkpoint import save_checkpoint

    out = []
    for job in jobs:
        kind, layout = job["kind"], job["layout"]
        if job["op"] == "save":  # 3 steps, save, 3 more (the uninterrupted run)
            engine = _engine(kind, layout)
            losses = _train(engine, range(SAVE_AT))
            save_checkpoint(engine, job["dir"])
            losses += _train(engine, range(SAVE_AT, STEPS))
            out.append(losses)
        else:  # a fresh engine (other weights) loads, re-saves, trains 3 more steps
            engine = _engine(kind, layout, seed=99)
            path, _ = engine.load_checkpoint(job["src"])
            assert path is not None and engine.global_steps == SAVE_AT
            save_checkpoint(engine, job["resave"])
            losses = _train(engine, range(SAVE_AT, STEPS))
            out.append((losses, _full_state(engine)))
        engine.destroy()
    return out


def _reference(kind: str) -> tuple[list[dict[int, float]], dict[str, torch.Tensor]]:
    """One process, the whole model, the global batch of NUM_MICRO micro-batches."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = _model(kind)
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        losses = []
        for step in range(STEPS):
            opt.zero_grad()
            per_micro = {}
            for micro in range(NUM_MICRO):
                loss = model(_ids(step, micro), labels=_ids(step, micro)).loss
                (loss / NUM_MICRO).backward()
                per_micro[micro] = float(loss.detach())
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            losses.append(per_micro)
        return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
    finally:
        torch.set_num_threads(threads)


def _all_kinds(ckpt: Path) -> dict[tuple[str, str], torch.Tensor]:
    """Every stored (parameter, kind) as its full tensor (TP shards assembled)."""
    from shardspeed.checkpoint.format import load_manifest, resolve_tag
    from shardspeed.checkpoint.shards import SliceReader

    tag_dir = ckpt / str(resolve_tag(ckpt, None))
    manifest = load_manifest(tag_dir)
    reader = SliceReader(tag_dir)
    return {
        (name, kind): reader.full(entry, kind, name)
        for name, entry in manifest["index"].items()
        for kind in entry["kinds"]
    }


def _name(layout: Layout) -> str:
    return "tp{}dp{}s{}".format(*layout)


def _run_matrix(tmp_path: Path, kind: str, pairs: list[tuple[Layout, Layout]]) -> None:
    sources = sorted({a for a, _ in pairs})
    saved = {a: str(tmp_path / f"{kind}-{_name(a)}") for a in sources}
    jobs_by_world: dict[int, list[dict[str, Any]]] = {}
    for a in sources:
        job = {"op": "save", "kind": kind, "layout": a, "dir": saved[a]}
        jobs_by_world.setdefault(a[0] * a[1], []).append(job)
    results: dict[Any, Any] = {}
    for world in sorted(jobs_by_world):  # every save first
        for job, res in zip(jobs_by_world[world], run_distributed(_rank_jobs, world,
                                                                  jobs_by_world[world],
                                                                  timeout=600)[0]):  # fmt: skip
            results[job["layout"]] = res
    loads: dict[int, list[dict[str, Any]]] = {}
    for a, b in pairs:
        resave = str(tmp_path / f"{kind}-{_name(a)}-to-{_name(b)}")
        job = {"op": "load", "kind": kind, "layout": b, "src": saved[a], "resave": resave}
        loads.setdefault(b[0] * b[1], []).append(job)
    for world, jobs in sorted(loads.items()):
        per_rank = run_distributed(_rank_jobs, world, jobs, timeout=600)
        for i, job in enumerate(jobs):
            results[(job["src"], job["layout"])] = [r[i] for r in per_rank]

    ref_losses, ref_state = _reference(kind)
    tol = {"rtol": 1e-5, "atol": 1e-6}
    for a in sources:  # the saving runs themselves train the one-process math
        for step, per_micro in enumerate(results[a]):
            for micro, value in per_micro.items():
                msg = f"{kind} {_name(a)} (before saving) step {step}"
                assert_close_rel(value, ref_losses[step][micro], **tol, msg=msg)
    for a, b in pairs:
        label = f"{kind} {_name(a)} -> {_name(b)}"
        resave = tmp_path / f"{kind}-{_name(a)}-to-{_name(b)}"
        before, after = _all_kinds(Path(saved[a])), _all_kinds(resave)
        assert set(before) == set(after), label
        assert any(k == "momentum_buffer" for _, k in before), label
        for key, tensor in before.items():
            assert torch.equal(tensor, after[key]), f"{label}: {key} changed by load + save"
        for losses, state in results[(saved[a], b)]:
            for step, per_micro in zip(range(SAVE_AT, STEPS), losses):
                for micro, value in per_micro.items():
                    expected = ref_losses[step][micro]
                    assert_close_rel(value, expected, **tol, msg=f"{label} step {step}")
            assert set(state) == set(ref_state), label
            for name, value in ref_state.items():
                assert_close_rel(state[name], value, **tol, msg=f"{label} {name}")
        if a == b:  # same layout: the resumed run is the uninterrupted one, bitwise
            straight = results[a]  # rank 0's losses of the save job
            assert results[(saved[a], b)][0][0] == straight[SAVE_AT:], label

    from shardspeed.checkpoint.format import load_manifest, resolve_tag

    for a in sources:
        tag_dir = Path(saved[a]) / str(resolve_tag(Path(saved[a]), None))
        mesh = load_manifest(tag_dir)["mesh"]
        assert mesh == {"pipe": 1, "data": a[1], "sequence": 1, "tensor": a[0]}, (a, mesh)


# worlds 2 and 4 only (the full matrix adds world 1: tp 1 x dp 1)
DEFAULT_PAIRS: list[tuple[Layout, Layout]] = [
    ((2, 1, 1), (1, 2, 1)),  # tp 2 -> 1
    ((1, 2, 1), (2, 1, 3)),  # tp 1 -> 2, stage 1 -> 3
    ((2, 2, 3), (1, 2, 1)),  # tp 2 -> 1 at dp 2, stage 3 -> 1
    ((1, 2, 3), (2, 2, 3)),  # tp 1 -> 2 at dp 2, ZeRO-3 on both sides
    ((2, 1, 3), (2, 2, 1)),  # same tp, dp 1 -> 2 and stage 3 -> 1
    ((2, 2, 3), (2, 2, 3)),  # same layout: exact resume
]


def test_tp_checkpoint_reshard_subset(tmp_path: Path) -> None:
    _run_matrix(tmp_path, "llama", DEFAULT_PAIRS)


def test_tp_checkpoint_reshard_gpt2_fused(tmp_path: Path) -> None:
    """GPT-2: Conv1D weights split along dim 1, ``c_attn`` fused q/k/v, vocab-parallel tied
    embedding."""
    _run_matrix(tmp_path, "gpt2", [((2, 1, 1), (1, 2, 3)), ((1, 2, 1), (2, 1, 3))])


@pytest.mark.slow
def test_tp_checkpoint_reshard_full_matrix(tmp_path: Path) -> None:
    """tp {1, 2} x dp {1, 2} x stage {1, 3}: every layout loads every other (56 loads)."""
    pairs = [(a, b) for a in LAYOUTS for b in LAYOUTS if a != b]
    _run_matrix(tmp_path, "llama", pairs)


def _export(out_dir: str) -> list[Any]:
    """save_16bit_model, checkpoint consolidation and ``engine.load_state_dict`` of full
    tensors at tp=2 (ZeRO 1 and 3, dp 1)."""
    from shardspeed.checkpoint import get_fp32_state_dict_from_checkpoint

    results = []
    for stage in (1, 3):
        engine = _engine("llama", (2, 1, stage), stage3_gather_16bit_weights_on_model_save=True)
        _train(engine, range(2))
        full = _full_state(engine)
        target = Path(out_dir) / f"s{stage}"
        assert engine.save_16bit_model(str(target), "model.safetensors")
        engine.save_checkpoint(str(target / "ckpt"))
        results.append((full, get_fp32_state_dict_from_checkpoint(str(target / "ckpt"))))
        other = _model("llama", seed=5).state_dict()  # full tensors in, each rank slices
        engine.load_state_dict(other)
        after = _full_state(engine)
        assert all(torch.equal(after[k], v) for k, v in other.items()), stage
        engine.destroy()
    return results


def test_tp_16bit_model_and_consolidation(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    per_rank = run_distributed(_export, 2, str(tmp_path))
    reference = _model("llama").state_dict()
    for stage, (full, consolidated) in zip((1, 3), per_rank[0]):
        saved = load_file(str(tmp_path / f"s{stage}" / "model.safetensors"))
        assert set(saved) == set(reference) == set(consolidated), stage
        for name, ref in reference.items():
            assert saved[name].shape == ref.shape, (stage, name)  # full, unsharded
            assert torch.equal(saved[name].float(), full[name]), (stage, name)
            assert torch.equal(consolidated[name], full[name]), (stage, name)
        model = _model("llama")
        model.load_state_dict(consolidated, strict=True)  # loads into the unsharded model


# -- the format in one process ----------------------------------------------------------------


def test_tp_shards_index_and_reshard_in_one_process(tmp_path: Path) -> None:
    """A fused split along dim 1 (two sub-parameters of widths (2, 1) and (1, 1)), each
    tensor rank's shard saved as two data-axis fragments: the index files them per shard,
    ``SliceReader.full`` reassembles the full tensor, and ``LocalReader`` gives any other
    split's shard (tp=3 even, and no tensor parallelism) or the same split's own shard."""
    from safetensors.torch import save_file

    from shardspeed.checkpoint.format import build_index
    from shardspeed.checkpoint.shards import FragmentWriter, SliceReader
    from shardspeed.checkpoint.tp_placement import LocalReader, Placement
    from shardspeed.parallel.tensor.partition import ShardLayout, slice_shard

    full = torch.arange(30, dtype=torch.float32).view(6, 5)
    saved = ShardLayout.fused(1, [[2, 1], [1, 1]])  # sub-parameters of 3 and 2 columns
    metas = []
    for rank in range(2):
        shard = slice_shard(full, saved, rank)  # (6, 3) or (6, 2)
        writer = FragmentWriter()
        flat = shard.reshape(-1)
        half = flat.numel() // 2
        for start, piece in ((0, flat[:half]), (half, flat[half:])):  # two data ranks
            writer.add("w", "master", list(shard.shape), start, piece, Placement(saved, rank))
        save_file(writer.tensors, str(tmp_path / f"r{rank}.safetensors"))
        metas.append({"file": f"r{rank}.safetensors", "tensors": writer.entries})
    entry = build_index(metas)["w"]
    assert entry["shape"] == [6, 5] and entry["kinds"] == {"master": []}
    assert [s["shape"] for s in entry["tp"]["shards"]] == [[6, 3], [6, 2]]
    reader = SliceReader(tmp_path)
    assert torch.equal(reader.full(entry, "master", "w"), full)
    new = ShardLayout.of(1, [2, 2, 1])
    for placement in [Placement(new, r) for r in range(3)] + [Placement(saved, 1), None]:
        expected = (
            full if placement is None else slice_shard(full, placement.layout, placement.rank)
        )
        out = torch.empty(expected.numel() - 1)
        LocalReader(reader).fill(out, entry, "master", "w", 1, placement)  # from element 1
        assert torch.equal(out, expected.reshape(-1)[1:]), placement


# -- pipeline x tensor parallelism ---------------------------------------------------------


def _pipe_engine(tp: int, base_seed: int) -> Any:
    import shardspeed
    from shardspeed.pipe import LayerSpec, PipelineModule
    from shardspeed.topology import Topology

    topology = Topology.build(pp=2, tp=tp)
    net = PipelineModule(
        [LayerSpec(_TPBlock, topology.group("tensor")) for _ in range(PIPE_LAYERS)],
        topology=topology,
        loss_fn=torch.nn.functional.mse_loss,
        seed_layers=True,
        base_seed=base_seed,
        partition_method="uniform",
    )
    engine, _, _, _ = shardspeed.initialize(model=net, config=_pipe_config())
    return engine


def _pipe_jobs(job: dict[str, Any]) -> Any:
    from shardspeed.parallel.tensor.state import gather_full_state_dict

    def batches(steps: range) -> Any:
        return iter([_pipe_batch(step, k) for step in steps for k in range(PIPE_M)])

    if job["op"] == "save":
        engine = _pipe_engine(job["tp"], base_seed=1234)  # the reference's seeds
        it = batches(range(SAVE_AT))
        losses = [float(engine.train_batch(it)) for _ in range(SAVE_AT)]
        engine.save_checkpoint(job["dir"])
        assert engine.save_16bit_model(f"{job['dir']}-export")  # every stage, tp gathered
    else:
        engine = _pipe_engine(job["tp"], base_seed=77)  # other initial weights
        engine.load_checkpoint(job["dir"])
        it = batches(range(SAVE_AT, STEPS))
        losses = [float(engine.train_batch(it)) for _ in range(SAVE_AT, STEPS)]
    full = {k: v.detach().clone() for k, v in gather_full_state_dict(engine.module).items()}
    engine.destroy()
    return losses, full


def test_pipeline_tp_checkpoint_reshards_tp(tmp_path: Path) -> None:
    """pp=2 x tp=2 (4 ranks, Megatron layers) saves after 3 steps; pp=2 x tp=1 (2 ranks)
    loads it and trains 3 more: losses and every stage's full weights match one process.
    Its ``save_16bit_model`` file holds both stages' full weights (= the consolidation)."""
    ref_losses, ref_state = _pipe_reference(STEPS)
    ckpt = str(tmp_path / "pp2tp2")
    for rank, (losses, _) in enumerate(
        run_distributed(_pipe_jobs, 4, {"op": "save", "tp": 2, "dir": ckpt}, timeout=300)
    ):
        assert_close_rel(losses, ref_losses[:SAVE_AT], rtol=1e-5, atol=1e-6, msg=f"save {rank}")
    from shardspeed.checkpoint import get_fp32_state_dict_from_checkpoint

    written = torch.load(f"{ckpt}-export/pytorch_model.bin", weights_only=True)
    consolidated = get_fp32_state_dict_from_checkpoint(ckpt)
    assert set(written) == set(consolidated)  # both stages' layers, full (tp-gathered) shapes
    for name, value in consolidated.items():
        assert torch.equal(written[name], value), name
    seen: set[str] = set()
    loaded = run_distributed(_pipe_jobs, 2, {"op": "load", "tp": 1, "dir": ckpt}, timeout=300)
    for rank, (losses, full) in enumerate(loaded):
        assert_close_rel(losses, ref_losses[SAVE_AT:], rtol=1e-5, atol=1e-6, msg=f"load {rank}")
        for name, value in full.items():
            assert_close_rel(value, ref_state[name], rtol=1e-5, atol=1e-6, msg=f"{rank} {name}")
            seen.add(name)
    assert seen == set(ref_state)
