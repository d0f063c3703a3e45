"""PipelineModule, LayerSpec/TiedLayerSpec, partitioning and topology classes (one process)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from shardspeed.parallel.pipeline.p2p import ActivationMeta
from shardspeed.parallel.pipeline.partition import (
    layer_weights,
    partition_balanced,
    partition_layers,
    partition_uniform,
)
from shardspeed.pipe import (
    LayerSpec,
    PipeDataParallelTopology,
    PipelineModule,
    PipeModelDataParallelTopology,
    ProcessTopology,
    TiedLayerSpec,
)
from shardspeed.topology import Topology


class Counted(nn.Linear):
    built: list[int] = []

    def __init__(self, width: int, tag: int) -> None:
        super().__init__(width, width)
        Counted.built.append(tag)


class Embed(nn.Embedding):
    pass


def stage_module(layers: list, stage: int, num_stages: int, **kwargs) -> PipelineModule:
    return PipelineModule(
        layers, topology=Topology(num_stages, pp=num_stages, rank=stage), **kwargs
    )


# ---------------------------------------------------------------------------- partitioning
def test_partition_uniform() -> None:
    assert partition_uniform(8, 4) == [0, 2, 4, 6, 8]
    assert partition_uniform(10, 4) == [0, 3, 6, 8, 10]
    with pytest.raises(ValueError, match="cannot split 3 layers into 4"):
        partition_uniform(3, 4)


@pytest.mark.parametrize(
    ("weights", "parts", "expected"),
    [
        ([1, 1, 1, 1], 2, [0, 2, 4]),
        ([4, 1, 1, 1, 1], 2, [0, 1, 5]),
        ([1, 1, 1, 10], 2, [0, 3, 4]),
        ([0, 1, 1, 1, 1, 0, 0], 2, [0, 3, 7]),  # zero-weight layers join a neighbour
        ([5, 5, 0, 0, 0, 0], 3, [0, 1, 5, 6]),  # every part gets a layer
        ([0, 0, 0, 0], 2, [0, 2, 4]),
    ],
)
def test_partition_balanced(weights: list[int], parts: int, expected: list[int]) -> None:
    assert partition_balanced(weights, parts) == expected


def test_partition_balanced_is_optimal_on_random_weights() -> None:
    import itertools
    import random

    rng = random.Random(0)
    for _ in range(200):
        n, k = rng.randint(1, 8), rng.randint(1, 4)
        if n < k:
            continue
        w = [rng.randint(0, 9) for _ in range(n)]
        got = partition_balanced(w, k)
        assert got[0] == 0 and got[-1] == n and all(a < b for a, b in itertools.pairwise(got))
        best = min(
            max(sum(w[a:b]) for a, b in itertools.pairwise((0, *cuts, n)))
            for cuts in itertools.combinations(range(1, n), k - 1)
        )
        assert max(sum(w[a:b]) for a, b in itertools.pairwise(got)) == best


def test_layer_weights_methods() -> None:
    layers = [LayerSpec(Embed, 10, 4), LayerSpec(nn.Linear, 4, 4), torch.tanh, nn.Linear(4, 2)]
    assert layer_weights("parameters", layers) == [40, 20, 0, 10]
    assert layer_weights("uniform", layers) == [1, 1, 1, 1]
    assert layer_weights("type:linear", layers) == [0, 1, 0, 1]  # case-insensitive
    assert partition_layers("type:^Embed$", layers, 1) == [0, 4]
    with pytest.raises(ValueError, match="matches no layer"):
        layer_weights("type:Conv", layers)
    with pytest.raises(ValueError, match="not a valid regex"):
        layer_weights("type:(", layers)
    with pytest.raises(NotImplementedError, match="profile"):
        layer_weights("profile", layers)
    with pytest.raises(ValueError, match="partition_method='best'"):
        layer_weights("best", layers)


# ---------------------------------------------------------------------------- LayerSpec
def test_layer_spec_builds_and_counts_without_allocating() -> None:
    spec = LayerSpec(nn.Linear, 3, 5, bias=False)
    assert spec.num_trainable_parameters() == 15
    layer = spec.build()
    assert isinstance(layer, nn.Linear) and layer.weight.shape == (5, 3) and layer.bias is None
    assert "Linear" in repr(spec)
    with pytest.raises(ValueError, match="torch.nn.Module subclass"):
        LayerSpec(nn.Linear(3, 3))


def test_layers_built_only_on_owning_stage() -> None:
    layers = [LayerSpec(Counted, 4, i) for i in range(8)]
    Counted.built.clear()
    module = stage_module(layers, stage=2, num_stages=4, partition_method="uniform")
    assert Counted.built == [4, 5]
    assert module.stage_layer_indices() == [4, 5]
    assert [n for n, _ in module.named_parameters()] == ["4.weight", "4.bias", "5.weight", "5.bias"]
    assert module.num_stages == 4 and module.stage_id == 2


def test_seed_layers_makes_weights_independent_of_partition() -> None:
    layers = [LayerSpec(nn.Linear, 4, 4) for _ in range(6)]
    full = stage_module(layers, 0, 1, seed_layers=True, base_seed=99)
    part = stage_module(layers, 1, 3, seed_layers=True, base_seed=99, partition_method="uniform")
    for name, p in part.named_parameters():
        torch.testing.assert_close(p, dict(full.named_parameters())[name], rtol=0, atol=0)
    seeds = []
    stage_module(layers, 0, 1, seed_layers=True, seed_fn=seeds.append, base_seed=10)
    assert seeds == [10, 11, 12, 13, 14, 15]


def test_stage_forward_matches_sequential() -> None:
    layers = [LayerSpec(nn.Linear, 4, 4), torch.tanh, LayerSpec(nn.Linear, 4, 4), nn.ReLU()]
    full = stage_module(layers, 0, 1, seed_layers=True)
    first = stage_module(layers, 0, 2, seed_layers=True, partition_method="uniform")
    second = stage_module(layers, 1, 2, seed_layers=True, partition_method="uniform")
    x = torch.randn(3, 4)
    torch.testing.assert_close(second(first(x)), full(x))


def test_tied_layers_share_one_module_per_stage() -> None:
    head = TiedLayerSpec("embed", Embed, 10, 4, forward_fn=lambda emb, x: x @ emb.weight.t())
    layers = [TiedLayerSpec("embed", Embed, 10, 4), LayerSpec(nn.Linear, 4, 4),
              LayerSpec(nn.Linear, 4, 4), head]  # fmt: skip
    single = stage_module(layers, 0, 1, partition_method="uniform")
    assert list(single.tied_modules) == ["embed"]
    assert single.tie_owners() == {"embed": [0]}
    out = single(torch.tensor([[1, 2, 3]]))
    assert out.shape == (1, 3, 10)  # (B, T, V)
    first = stage_module(layers, 0, 2, partition_method="uniform")
    last = stage_module(layers, 1, 2, partition_method="uniform")
    assert first.tie_owners() == {"embed": [0, 1]}
    assert first.replicated_parameters() == []
    assert last.replicated_parameters() == [last.tied_modules["embed"].weight]
    assert "tied_modules.embed.weight" in dict(last.named_parameters())
    with pytest.raises(ValueError, match="tied_weight_attr='nope'"):
        stage_module([TiedLayerSpec("e", Embed, 3, 2, tied_weight_attr="nope")], 0, 1)


def test_activation_checkpointing_gives_the_same_gradients() -> None:
    layers = [LayerSpec(nn.Linear, 4, 4) for _ in range(4)]
    plain = stage_module(layers, 0, 1, seed_layers=True)
    ckpt = stage_module(
        layers, 0, 1, seed_layers=True, activation_checkpoint_interval=2,
        activation_checkpoint_func=lambda fn, *a: torch.utils.checkpoint.checkpoint(fn, *a, use_reentrant=False),
    )  # fmt: skip
    x = torch.randn(2, 4, requires_grad=True)
    plain(x).sum().backward()
    ckpt(x).sum().backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), ckpt.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "needs num_stages=<int> or topology="),
        ({"num_stages": 3}, "needs torch.distributed"),
        ({"topology": PipeDataParallelTopology(2, 1)}, "init_distributed"),
        ({"num_stages": 1, "schedule": "zigzag"}, "schedule='zigzag'"),
        ({"num_stages": 1, "virtual_stages": 2}, "virtual_stages > 1 goes with"),
        ({"topology": "pipe"}, "expected a ProcessTopology"),
        ({"num_stages": 2, "topology": Topology(2, pp=1, rank=0)}, "disagrees"),
    ],
)
def test_module_errors_name_the_argument(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        PipelineModule([LayerSpec(nn.Linear, 2, 2)], **kwargs)


def test_too_few_layers_for_the_stages() -> None:
    with pytest.raises(ValueError, match="cannot split 2 layers into 4"):
        stage_module([LayerSpec(nn.Linear, 2, 2)] * 2, 0, 4)


# ---------------------------------------------------------------------------- topology
def test_process_topology_matches_the_shardspeed_grid() -> None:
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=3)
    assert topo.get_axis_names() == ["pipe", "data", "model"]
    assert topo.world_size() == 12 and topo.get_dim("data") == 3 and topo.get_dim("x") == 0
    grid = topo.to_topology()
    for rank in range(12):
        c = topo.get_coord(rank)
        assert grid.rank_of(pipe=c.pipe, data=c.data, tensor=c.model) == rank
        assert topo.get_rank(pipe=c.pipe, data=c.data, model=c.model) == rank
    assert topo.get_axis_comm_lists("pipe")[0] == [0, 6]
    assert topo.filter_match(pipe=1, data=0) == [6, 7]
    assert topo.get_axis_list("pipe", 0) == list(range(6))
    assert topo.get_rank_repr(7) == "model_01"
    pd = PipeDataParallelTopology(num_pp=4, num_dp=2)
    assert pd.get_axis_comm_lists("data") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert pd.to_topology(rank=5).stage_id == 2
    with pytest.raises(ValueError, match="cannot be mapped"):
        ProcessTopology(["data", "pipe"], [2, 2]).to_topology()


def test_activation_meta_round_trip() -> None:
    value = (
        torch.zeros(2, 3, requires_grad=True),
        torch.ones(4, dtype=torch.bool),
        torch.tensor(3),
    )
    meta = ActivationMeta.of(value)
    assert ActivationMeta.decode(meta.encode()) == meta
    assert meta.is_tuple and [t.requires_grad for t in meta.tensors] == [True, False, False]
    single = ActivationMeta.of(torch.zeros(5, dtype=torch.bfloat16))
    assert ActivationMeta.decode(single.encode()) == single and not single.is_tuple
    with pytest.raises(ValueError, match="tensor or a tuple of tensors"):
        ActivationMeta.of((torch.zeros(1), "mask"))
