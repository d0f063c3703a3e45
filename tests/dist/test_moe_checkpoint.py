"""Checkpoints of expert-parallel MoE engines: experts stored by global id, resharded over ep.

Model: ``test_moe_engine``'s ``dense -> MoE(4 experts, top-1, dropping) -> head``, each
global expert perturbed differently (so a mix-up of expert ids shows); Adam; fp32. The
global batch is the same ``NUM_MICRO`` micro-batches in every layout (GAS = NUM_MICRO /
world, micro-batch ``j * world + rank``), and each micro-batch is routed alone (capacity
from its own tokens), so every layout trains the same math.

A checkpoint saved after ``SAVE_AT`` steps at ep 2 (2 ranks, ZeRO 2) is loaded into a
fresh engine (other initial weights) at another layout, re-saved at once, and trained to
``STEPS``:

* the re-saved checkpoint holds exactly the saved state: every (parameter, kind) full
  tensor (fp32 masters, Adam's ``exp_avg`` / ``exp_avg_sq``) bitwise equal, every global
  expert present;
* the continued losses and the final consolidated weights (every global expert, through
  ``get_fp32_state_dict_from_checkpoint``) match the uninterrupted ep-2 run: bitwise at
  the same layout (2 -> 2), within fp32 1e-5 relative elsewhere (an expert's tokens are
  one matmul at ep 2 and per micro-batch at ep 1, so sums round in another order).

Layouts loaded: ep 2 (2 ranks, round trip), ep 1 on 1 rank, ep 1 on 2 ranks (experts
sharded over ``expert_data`` = 2), ep 4 on 4 ranks. ``slow``: saves at ZeRO 0, 1 and 3 too.

DeepSpeed's MoE layout (``layer_*_expert_*_mp_rank_00_model_states.pt`` + ZeRO partitions
of each ep rank's experts) imports with ``import_deepspeed_checkpoint``: a hand-built
folder in that layout (ep 2 over 4 ranks, padded partitions) by default; a real DeepSpeed
0.19 run (ep 2, ZeRO 2, Adam), whose imported masters and Adam moments must equal
DeepSpeed's and whose continued losses at ep 2 (2 ranks) and ep 1 (1 rank) must equal
DeepSpeed's (1e-5). That run's checkpoint folder and results are checked in under
``tests/goldens/checkpoint_import/moe_ep2_zero2/`` (the golden variant, run everywhere);
the live variant runs DeepSpeed where the peers venv has it (``tests/goldens/README.md``).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from goldens import deepspeed_oracle as golden
from test_moe_engine import EXPERT_PREFIX, EXPERTS, _batch, _local_state, _Net

from shardspeed.testing import assert_close_rel, run_distributed

NUM_MICRO, SAVE_AT, STEPS, LR = 4, 2, 4, 0.01
Layout = tuple[int, int, int]  # (world, ep, ZeRO stage)
Losses = dict[tuple[int, int], float]  # (step, global micro-batch) -> loss


def _full_initial(seed: int) -> dict[str, torch.Tensor]:
    """An ep-1 model's state (every global expert), experts made distinct."""
    torch.manual_seed(seed)
    model = _Net(1, 1)
    with torch.no_grad():
        for i, e in enumerate(model.moe.deepspeed_moe.experts.deepspeed_experts):
            for p in e.parameters():
                p.add_(0.1 * (i + 1))
    return model.state_dict()


def _engine(ep: int, stage: int, seed: int, gather_16bit: bool = False) -> Any:
    import shardspeed
    from shardspeed import comm
    from shardspeed.parallel.moe.groups import topology_for

    world = comm.get_world_size()
    model = _Net(ep, 1)
    ep_rank = topology_for(ep).rank_in("expert") if ep > 1 else 0
    model.load_state_dict(_local_state(_full_initial(seed), ep_rank, EXPERTS // ep))
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": NUM_MICRO // world,
        # off: at ZeRO 0 DeepSpeed's MoE clipping norm depends on ep (each rank's own norm,
        # averaged), so the default clipping at 1.0 would train ep 2 and ep 1 apart
        "gradient_clipping": 0.0,
        "optimizer": {"type": "Adam", "params": {"lr": LR}},
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 0,
            "stage3_gather_16bit_weights_on_model_save": gather_16bit,
        },
    }
    engine, _, _, _ = shardspeed.initialize(model=model, config=config)
    return engine


def _train(engine: Any, first: int, last: int) -> Losses:
    from shardspeed import comm

    world, rank = comm.get_world_size(), comm.get_rank()
    losses = {}
    for step in range(first, last):
        for j in range(NUM_MICRO // world):
            micro = j * world + rank
            loss = engine(*_batch(step, micro))
            engine.backward(loss)
            engine.step()
            losses[(step, micro)] = float(loss)
    return losses


def _save_run(root: str, stage: int) -> Losses:
    """ep 2: train SAVE_AT steps, save ``saved``, train on to STEPS, save ``final``."""
    engine = _engine(2, stage, seed=0)
    losses = _train(engine, 0, SAVE_AT)
    engine.save_checkpoint(f"{root}/orig", tag="saved")
    losses.update(_train(engine, SAVE_AT, STEPS))
    engine.save_checkpoint(f"{root}/orig", tag="final")
    engine.destroy()
    return losses


def _load_run(root: str, layout: Layout) -> Losses:
    """Load ``saved`` at ``layout``, re-save it at once, train on to STEPS, save ``final``."""
    _, ep, stage = layout
    engine = _engine(ep, stage, seed=1)
    path, _ = engine.load_checkpoint(f"{root}/orig", tag="saved")
    assert path is not None and engine.global_steps == SAVE_AT
    out = f"{root}/{_name(layout)}"
    engine.save_checkpoint(out, tag="resaved")
    losses = _train(engine, SAVE_AT, STEPS)
    engine.save_checkpoint(out, tag="final")
    engine.destroy()
    return losses


def _save_and_load(root: str, stage: int, layouts: list[Layout]) -> list[Losses]:
    """One spawn of 2 ranks: the ep-2 save, then each 2-rank load."""
    return [_save_run(root, stage), *(_load_run(root, layout) for layout in layouts)]


def _name(layout: Layout) -> str:
    world, ep, stage = layout
    return f"world{world}_ep{ep}_zero{stage}"


def _merge(per_rank: list[Losses]) -> Losses:
    out: Losses = {}
    for losses in per_rank:
        out.update(losses)
    return out


def _full_tensors(tag_dir: Path) -> dict[tuple[str, str], torch.Tensor]:
    """Every (name, kind) full tensor of a checkpoint tag."""
    from shardspeed.checkpoint.format import load_manifest
    from shardspeed.checkpoint.shards import SliceReader

    index = load_manifest(tag_dir)["index"]
    reader = SliceReader(tag_dir)
    return {
        (name, kind): reader.full(entry, kind, name)
        for name, entry in index.items()
        for kind in entry["kinds"]
    }


def _check_load(root: Path, layout: Layout, orig: Losses, loaded: Losses) -> None:
    from shardspeed.checkpoint import get_fp32_state_dict_from_checkpoint

    world, ep, _ = layout
    saved = _full_tensors(root / "orig" / "saved")
    resaved = _full_tensors(root / _name(layout) / "resaved")
    experts = {n.split(".")[4] for n, _ in saved if n.startswith(EXPERT_PREFIX)}
    assert experts == {str(i) for i in range(EXPERTS)}, experts
    assert {k for _, k in saved} >= {"master", "exp_avg", "exp_avg_sq"}
    assert set(resaved) == set(saved), set(resaved) ^ set(saved)
    for key, value in saved.items():
        assert torch.equal(resaved[key], value), f"{_name(layout)}: re-saved {key} differs"
    continued = {k: v for k, v in orig.items() if k[0] >= SAVE_AT}
    assert set(loaded) == set(continued)
    final = get_fp32_state_dict_from_checkpoint(root / "orig", tag="final")
    mine = get_fp32_state_dict_from_checkpoint(root / _name(layout), tag="final")
    assert list(mine) == list(final)
    if (world, ep) == (2, 2):  # same layout: the uninterrupted run exactly
        assert loaded == continued
        for name, value in final.items():
            assert torch.equal(mine[name], value), name
        return
    keys = sorted(continued)
    tol = {"rtol": 1e-5, "atol": 1e-6}
    what = _name(layout)
    assert_close_rel([loaded[k] for k in keys], [continued[k] for k in keys], **tol, msg=what)
    for name, value in final.items():
        assert_close_rel(mine[name], value, **tol, msg=f"{what} {name}")


def _run_matrix(root: Path, stage: int, loads: list[Layout]) -> None:
    two = [layout for layout in loads if layout[0] == 2]
    results = run_distributed(_save_and_load, 2, str(root), stage, two, timeout=300)
    orig = _merge([r[0] for r in results])
    for i, layout in enumerate(two):
        _check_load(root, layout, orig, _merge([r[i + 1] for r in results]))
    for layout in loads:
        if layout[0] != 2:
            loaded = _merge(run_distributed(_load_run, layout[0], str(root), layout, timeout=300))
            _check_load(root, layout, orig, loaded)


def test_moe_checkpoint_reshards_ep2_to_ep1_and_ep4(tmp_path: Path) -> None:
    loads = [(2, 2, 2), (2, 1, 1), (1, 1, 2), (4, 4, 2)]
    _run_matrix(tmp_path, 2, loads)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 3])
def test_moe_checkpoint_reshards_other_stages(tmp_path: Path, stage: int) -> None:
    loads = [(2, 2, stage), (2, 1, 0), (1, 1, 3), (4, 4, stage), (4, 2, stage)]
    _run_matrix(tmp_path, stage, loads)


# -- one-file export at ep > 1 ------------------------------------------------------------
def _export_run(root: str, stage: int) -> dict[str, torch.Tensor]:
    """ep 2: train, save_16bit_model + a checkpoint; rank 0 returns the consolidated dict."""
    engine = _engine(2, stage, seed=0, gather_16bit=True)
    _train(engine, 0, 2)
    assert engine.save_16bit_model(f"{root}/export") is True
    engine.save_checkpoint(f"{root}/ckpt", tag="t")
    consolidated = engine._zero3_consolidated_16bit_state_dict()
    engine.destroy()
    # the export loads back at ep 2: each rank takes its own experts from global ids
    fresh = _engine(2, stage, seed=1, gather_16bit=True)
    written = torch.load(f"{root}/export/pytorch_model.bin", weights_only=True)
    fresh.load_state_dict(written)
    assert fresh.save_16bit_model(f"{root}/reexport") is True
    fresh.destroy()
    return consolidated


@pytest.mark.parametrize("world,stage", [(2, 0), (2, 2), (2, 3), (4, 3)])
def test_save_16bit_model_at_ep2_writes_every_global_expert(
    tmp_path: Path, world: int, stage: int
) -> None:
    """The export is the ep-1 model holding all 4 experts (rank 1's local 0, 1 under global
    ids 2, 3), equal to the checkpoint's consolidated weights, loadable strictly into an
    ``ep_size=1`` module; Accelerate's ``_zero3_consolidated_16bit_state_dict`` matches;
    ``engine.load_state_dict`` of it into a fresh ep-2 engine gives every rank its own
    experts back (re-exported: equal)."""
    from shardspeed.checkpoint import get_fp32_state_dict_from_checkpoint

    consolidated = run_distributed(_export_run, world, str(tmp_path), stage, timeout=300)
    assert all(part == {} for part in consolidated[1:])
    written = torch.load(tmp_path / "export" / "pytorch_model.bin", weights_only=True)
    reference = get_fp32_state_dict_from_checkpoint(tmp_path / "ckpt", tag="t")
    ep1 = _Net(1, 1)
    assert list(written) == list(ep1.state_dict())
    ep1.load_state_dict(written, strict=True)
    for name, value in reference.items():
        assert torch.equal(written[name], value), name
        assert torch.equal(consolidated[0][name], value), name
    experts = {n.split(".")[4] for n in written if n.startswith(EXPERT_PREFIX)}
    assert experts == {str(i) for i in range(EXPERTS)}
    reloaded = torch.load(tmp_path / "reexport" / "pytorch_model.bin", weights_only=True)
    assert list(reloaded) == list(written)
    for name, value in written.items():
        assert torch.equal(reloaded[name], value), f"load_state_dict at ep 2: {name}"
    # the experts differ (so a mix-up of ids would show)
    assert not torch.equal(
        written[f"{EXPERT_PREFIX}0.0.weight"], written[f"{EXPERT_PREFIX}2.0.weight"]
    )


def test_local_state_takes_this_ranks_experts_from_global_ids() -> None:
    from shardspeed.checkpoint.expert_placement import ExpertBlock, ExpertNames

    prefix = "moe.experts.deepspeed_experts."
    names = ExpertNames([ExpertBlock(prefix, 2, 2, ep_rank=1, expert_data_rank=0)])
    glob = {"dense.w": 0, **{f"{prefix}{g}.w": g for g in range(4)}}
    assert names.local_state(glob) == {"dense.w": 0, f"{prefix}0.w": 2, f"{prefix}1.w": 3}
    local = {"dense.w": 0, f"{prefix}0.w": 5, f"{prefix}1.w": 6}
    assert names.local_state(local) == local  # already this rank's names
    with pytest.raises(ValueError, match="names expert 7, but the layer has 4 experts"):
        names.local_state({f"{prefix}7.w": 0})


# -- DeepSpeed's MoE layout --------------------------------------------------------------
def test_import_hand_built_deepspeed_moe_layout(tmp_path: Path) -> None:
    """ep 2 over 4 world ranks (expert_data 2): ep rank k's expert flat group is the
    partitions of world ranks k and k + 2; rank 0's local names become global ids."""
    from shardspeed.checkpoint.deepspeed_import import import_deepspeed_checkpoint

    prefix = "moe.deepspeed_moe.experts.deepspeed_experts."
    dense = {"dense.weight": torch.Size([2, 3])}
    local = {f"{prefix}0.w": torch.Size([3]), f"{prefix}1.w": torch.Size([2])}
    full = {"dense.weight": torch.arange(6.0)}
    for g in range(4):  # global expert g: ep rank g // 2, local id g % 2
        full[f"{prefix}{g}.w"] = torch.arange(3.0 if g % 2 == 0 else 2.0) + 10 * (g + 1)
    pad = torch.tensor([-1.0])
    dense_parts = [full["dense.weight"][i : i + 2] for i in (0, 2, 4)] + [torch.cat([pad, pad])]
    experts = {}  # ep rank -> its flat group (5 elements + 1 padding) in two partitions
    for k in (0, 1):
        flat = torch.cat([full[f"{prefix}{2 * k}.w"], full[f"{prefix}{2 * k + 1}.w"], pad])
        experts[k] = [flat[:3], flat[3:]]
    tag = tmp_path / "ds" / "global_step5"
    tag.mkdir(parents=True)
    for r in range(4):  # world rank r: ep rank r % 2, expert_data rank r // 2
        flats = [dense_parts[r], experts[r % 2][r // 2]]
        state = {i: {"step": torch.tensor(5.0), "exp_avg": 2 * f} for i, f in enumerate(flats)}
        groups = [
            {"lr": 0.1, "params": [0]},
            {"lr": 0.1, "moe": True, "name": "ep_size_2", "params": [1]},
        ]
        optim = {
            "zero_stage": 2,
            "partition_count": [4, 2],
            "single_partition_of_fp32_groups": flats,
            "base_optimizer_state": {"state": state, "param_groups": groups},
        }
        torch.save(
            {"optimizer_state_dict": optim}, tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
        )
    module = {"dense.weight": full["dense.weight"].view(2, 3)}
    model = {
        "module": module,
        "param_shapes": [dense, local],
        "buffer_names": [],
        "global_steps": 5,
    }
    torch.save(model, tag / "mp_rank_00_model_states.pt")
    for g in range(4):  # the per-expert weight files, under global ids
        name = f"{prefix}{g}.w"
        torch.save({name: full[name]}, tag / f"layer_0_expert_{g}_mp_rank_00_model_states.pt")
    (tmp_path / "ds" / "latest").write_text("global_step5")

    out = import_deepspeed_checkpoint(tmp_path / "ds", tmp_path / "ss")
    imported = _full_tensors(out)
    assert {n for n, _ in imported} == set(full)
    for name, value in full.items():
        expected = value.view(dense[name]) if name in dense else value
        assert torch.equal(imported[(name, "master")], expected), name
        assert torch.equal(imported[(name, "exp_avg")], 2 * expected), name
    from shardspeed.checkpoint.format import load_manifest

    order = load_manifest(out)["param_order"]
    assert order == ["dense.weight", *(f"{prefix}{g}.w" for g in range(4))]


def _deepspeed_moe_rank(save_dir: str, result_dir: str) -> None:
    """One DeepSpeed rank: ep 2, ZeRO 2, torch Adam; 2 steps, save, 2 more steps."""
    import deepspeed
    from deepspeed.moe.layer import MoE
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from test_moe_engine import FFN, HIDDEN

    deepspeed.init_distributed("gloo")
    rank = torch.distributed.get_rank()

    class Net(torch.nn.Module):  # test_moe_engine._Net on DeepSpeed's MoE
        def __init__(self) -> None:
            super().__init__()
            lin = torch.nn.Linear
            expert = torch.nn.Sequential(lin(HIDDEN, FFN), torch.nn.GELU(), lin(FFN, HIDDEN))
            self.dense = lin(HIDDEN, HIDDEN)
            self.moe = MoE(
                HIDDEN, expert, num_experts=EXPERTS, ep_size=2, k=1, capacity_factor=1.0,
                min_capacity=1, use_rts=False, top2_2nd_expert_sampling=False,
            )  # fmt: skip
            self.head = lin(HIDDEN, 1)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            h, l_aux, _ = self.moe(torch.tanh(self.dense(x)))
            return (self.head(h).squeeze(-1) - y).pow(2).mean() + 0.01 * l_aux

    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():  # global expert 2 * rank + i, as _full_initial
        for i, e in enumerate(model.moe.deepspeed_moe.experts.deepspeed_experts):
            for p in e.parameters():
                p.add_(0.1 * (2 * rank + i + 1))
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "params"}
    )
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.Adam(groups, lr=LR), config=config
    )
    losses = []
    for step in range(STEPS):
        if step == SAVE_AT:
            engine.save_checkpoint(save_dir)
            state = {}
            for name, p in model.named_parameters():
                state[name] = {"master": safe_get_full_fp32_param(p).clone()}
                if not name.startswith(EXPERT_PREFIX):
                    for kind in ("exp_avg", "exp_avg_sq"):
                        state[name][kind] = safe_get_full_optimizer_state(p, kind).clone()
            # DeepSpeed's safe_get_full_optimizer_state has no expert moments: read them from
            # this rank's expert flat partition (expert_data is 1 rank: the whole group)
            names = {p: n for n, p in model.named_parameters()}
            flat = engine.optimizer.single_partition_of_fp32_groups[1]
            moments = engine.optimizer.optimizer.state[flat]
            offset = 0
            for p in engine.optimizer.bit16_groups[1]:
                for kind in ("exp_avg", "exp_avg_sq"):
                    piece = moments[kind][offset : offset + p.numel()]
                    state[names[p]][kind] = piece.view(p.shape).clone()
                offset += p.numel()
        loss = engine(*_batch(step, rank))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    torch.save({"state": state, "losses": losses[SAVE_AT:]}, Path(result_dir) / f"rank{rank}.pt")
    engine.destroy()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _resume_imported(ckpt_dir: str, ep: int) -> list[float]:
    """Load the imported checkpoint at ``ep`` and train on (DeepSpeed's 2 micro-batches a
    step: one per rank at world 2, both on one rank at world 1)."""
    import shardspeed
    from shardspeed import comm
    from shardspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    world, rank = comm.get_world_size(), comm.get_rank()
    torch.manual_seed(999)  # other weights: everything must come from the checkpoint
    model = _Net(ep, 1)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "params"}
    )
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2 // world}
    engine, *_ = shardspeed.initialize(
        model=model, optimizer=torch.optim.Adam(groups, lr=LR), config=config
    )
    path, _ = engine.load_checkpoint(ckpt_dir)
    assert path is not None and engine.global_steps == SAVE_AT
    losses = []
    for step in range(SAVE_AT, STEPS):
        for micro in range(rank, 2, world):
            loss = engine(*_batch(step, micro))
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
    engine.destroy()
    return losses


def _deepspeed_moe_checkpoint(source: str, tmp_path: Path) -> tuple[Path, list[dict]]:
    """(DeepSpeed's MoE checkpoint folder, each rank's results): checked in, or run live."""
    topic, folder = "checkpoint_import", "moe_ep2_zero2"
    recorded = golden.golden_path(topic, folder)
    if source == "golden":
        return recorded / "checkpoint", golden.load(topic, f"{folder}/expected.pt")["ranks"]
    ds_dir, results = tmp_path / "ds", tmp_path / "ds_results"
    results.mkdir()
    cmd = [golden.live_python(), "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc_per_node", "2", __file__, str(ds_dir), str(results)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=golden.live_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ds = [torch.load(results / f"rank{r}.pt") for r in range(2)]
    if golden.recording():
        shutil.rmtree(recorded / "checkpoint", ignore_errors=True)
        # zero_to_fp32.py: DeepSpeed's consolidation script, copied into every save folder
        shutil.copytree(ds_dir, recorded / "checkpoint", ignore=shutil.ignore_patterns("*.py"))
        golden.save(
            topic,
            f"{folder}/expected.pt",
            {"ranks": ds, **{"recorded_with": golden.recorded_with()}},
        )
    return ds_dir, ds


@pytest.mark.parametrize("source", golden.ORACLE_SOURCES)
def test_import_real_deepspeed_moe_checkpoint_and_resume(source: str, tmp_path: Path) -> None:
    from shardspeed.checkpoint.deepspeed_import import import_deepspeed_checkpoint

    ds_dir, ds = _deepspeed_moe_checkpoint(source, tmp_path)
    assert sorted(p.name for p in (ds_dir / f"global_step{SAVE_AT}").glob("layer_0_expert_*")) == [
        f"layer_0_expert_{g}_mp_rank_00_model_states.pt" for g in range(EXPERTS)
    ]
    out = import_deepspeed_checkpoint(ds_dir, tmp_path / "ss")
    imported = _full_tensors(out)
    for rank, result in enumerate(ds):  # DeepSpeed's names: each rank's local expert ids
        for name, kinds in result["state"].items():
            if name.startswith(EXPERT_PREFIX):
                idx, rest = name[len(EXPERT_PREFIX) :].split(".", 1)
                name = f"{EXPERT_PREFIX}{rank * (EXPERTS // 2) + int(idx)}.{rest}"
            assert set(kinds) == {"master", "exp_avg", "exp_avg_sq"}, name
            assert float(kinds["exp_avg"].abs().max()) > 0, name  # real Adam state
            for kind, value in kinds.items():
                torch.testing.assert_close(imported[(name, kind)], value, rtol=0, atol=1e-6)
    for ep, world in ((2, 2), (1, 1)):
        ours = run_distributed(_resume_imported, world, str(tmp_path / "ss"), ep, timeout=300)
        if world == 2:  # per step: rank 0's then rank 1's micro-batch
            mine = [ours[r][s] for s in range(STEPS - SAVE_AT) for r in range(2)]
        else:
            mine = ours[0]
        theirs = [ds[r]["losses"][s] for s in range(STEPS - SAVE_AT) for r in range(2)]
        assert_close_rel(mine, theirs, rtol=1e-5, atol=1e-5, msg=f"ep {ep} world {world}")


if __name__ == "__main__":  # a DeepSpeed rank, started by the real-DeepSpeed import test
    _deepspeed_moe_rank(sys.argv[1], sys.argv[2])
