"""One pipeline stage's part of a ragged model: build, load and run only its layers.

A stage model is the family's own :class:`~.models.RaggedModel` built on the meta
device and pruned: its layer list becomes an ``nn.ModuleDict`` keyed by *global*
layer index (so parameter names are those of the whole model, ``layers.5.qkv_proj``
on the stage that holds layer 5), the modules other stages hold are set to None,
and only what is left is materialised and filled from the checkpoint. Each
checkpoint tensor is mapped with a whole-model twin on the meta device (the
family's ``map_weight`` unchanged) and copied if this stage holds its target.

A stage runs in three pieces chosen by a small :class:`StageAdapter` per family::

    first stage:  x = embed(batch)                      # [N, hidden]
    every stage:  x = run_layers(x, batch, kv_cache)     # its layers, local KV layers 0..n-1
    last stage:   logits = head(x[rows])                 # [M, vocab]

Families: the RMSNorm/RoPE decoder (Llama, Mistral, Qwen2/3, Phi-3, Gemma, Gemma 2,
Mixtral) and GPT-2 (and ShardSpeed's GPT); others are refused by name.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from shardspeed.inference.fastgen.loader import (
    _materialize,
    _quantize,
    _skip_param_init,
    describe_source,
    parse_dtype,
)
from shardspeed.inference.fastgen.models import RaggedModel, get_model_class
from shardspeed.inference.fastgen.models.decoder import DecoderModel
from shardspeed.inference.fastgen.models.gpt2 import GPTModel
from shardspeed.inference.fastgen.models.layers import softcap
from shardspeed.inference.fastgen.models.rope import forward_seq_lens
from shardspeed.inference.fastgen.models.tp_shard import NO_SHARD, TensorShard
from shardspeed.inference.fastgen.pipeline_parallel.partition import (
    StageLayout,
    balance_layers,
    check_num_stages,
    stage_layouts,
)
from shardspeed.utils.logging import get_logger

if TYPE_CHECKING:
    from shardspeed.inference.fastgen.kv_cache import KVCache
    from shardspeed.inference.fastgen.ragged import RaggedBatch

logger = get_logger(__name__)


@dataclass(frozen=True)
class StageAdapter:
    """Where a family keeps its layers, embeddings and head, and how to run each piece."""

    layers: str  # attribute holding the decoder layers
    embeddings: tuple[str, ...]  # first stage only
    head: tuple[str, ...]  # last stage only (final norm, lm_head)

    def hidden_size(self, model: Any) -> int:
        raise NotImplementedError

    def embed(self, model: Any, batch: RaggedBatch) -> torch.Tensor:
        raise NotImplementedError

    def run_layers(
        self, model: Any, x: torch.Tensor, batch: RaggedBatch, kv_cache: KVCache
    ) -> torch.Tensor:
        raise NotImplementedError

    def logits(self, model: Any, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class DecoderAdapter(StageAdapter):
    """:class:`~.models.decoder.DecoderModel` (see its ``forward``)."""

    def hidden_size(self, model: Any) -> int:
        return model.spec.hidden

    def embed(self, model: Any, batch: RaggedBatch) -> torch.Tensor:
        x = model.embed_tokens(batch.input_ids)  # [N, hidden]
        if model.spec.embed_scale is not None:
            x = x * torch.tensor(model.spec.embed_scale, dtype=x.dtype)
        return x

    def run_layers(
        self, model: Any, x: torch.Tensor, batch: RaggedBatch, kv_cache: KVCache
    ) -> torch.Tensor:
        rotary = model.rotary
        seq_lens = forward_seq_lens(batch) if rotary.length_dependent else None
        cos, sin = rotary(batch.positions, x.dtype, seq_lens)  # [N, rot_dim] each
        for local, layer in enumerate(model.layers.values()):
            x = layer(x, cos, sin, batch, kv_cache, local)
        return x  # [N, hidden]

    def logits(self, model: Any, x: torch.Tensor) -> torch.Tensor:
        return softcap(model.lm_head(model.norm(x)), model.spec.final_softcap)  # [M, vocab]


class GPTAdapter(StageAdapter):
    """:class:`~.models.gpt2.GPTModel` (GPT-2, ShardSpeed GPT; see its ``forward``)."""

    def hidden_size(self, model: Any) -> int:
        return model.shape.hidden

    def embed(self, model: Any, batch: RaggedBatch) -> torch.Tensor:
        return model.wte(batch.input_ids) + model.wpe(batch.positions)  # [N, hidden]

    def run_layers(
        self, model: Any, x: torch.Tensor, batch: RaggedBatch, kv_cache: KVCache
    ) -> torch.Tensor:
        for local, block in enumerate(model.h.values()):
            x = block(x, batch, kv_cache, local)
        return x  # [N, hidden]

    def logits(self, model: Any, x: torch.Tensor) -> torch.Tensor:
        return model.lm_head(model.ln_f(x))  # [M, vocab]


_ADAPTERS: tuple[tuple[type, StageAdapter], ...] = (
    (DecoderModel, DecoderAdapter("layers", ("embed_tokens",), ("norm", "lm_head"))),
    (GPTModel, GPTAdapter("h", ("wte", "wpe"), ("ln_f", "lm_head"))),
)


def adapter_for(cls: type, pipeline_parallel: int) -> StageAdapter:
    """The adapter of model class ``cls``; ``ValueError`` naming the family if none."""
    for base, adapter in _ADAPTERS:
        if issubclass(cls, base):
            return adapter
    supported = [base.__name__ for base, _ in _ADAPTERS]
    raise ValueError(
        f"EngineConfig.pipeline_parallel={pipeline_parallel}: {cls.__name__} "
        f"(model_type={getattr(cls, 'model_type', '') or cls.__name__!r}) cannot be split into "
        f"pipeline stages yet; supported families: {supported} and their subclasses "
        "(Llama, Mistral, Qwen2/3, Phi-3, Gemma, Mixtral, GPT-2). Use pipeline_parallel=1."
    )


def _meta_model(cls: type, config: dict[str, Any], shard: TensorShard = NO_SHARD) -> RaggedModel:
    with torch.device("meta"), _skip_param_init():
        if shard.sharded:  # one tensor rank's slices (``map_weight`` slices the checkpoint)
            return cls.from_config(config, shard)
        return cls.from_config(config)


def _numel(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def plan_stages(model_or_path: Any, pipeline_parallel: int) -> list[StageLayout]:
    """Every stage's layers for ``model_or_path``, parameters balanced (meta device only).

    ``ValueError`` before anything is loaded when the family cannot be staged or there
    are more stages than layers.
    """
    if isinstance(model_or_path, RaggedModel):
        raise ValueError(
            f"EngineConfig.pipeline_parallel={pipeline_parallel} needs the checkpoint to split "
            f"at load, but got an already-built {type(model_or_path).__name__}; pass its HF "
            "directory or transformers model instead, or use pipeline_parallel=1."
        )
    config, _, _ = describe_source(model_or_path)
    cls = get_model_class(config.get("model_type"))
    adapter = adapter_for(cls, pipeline_parallel)
    full = _meta_model(cls, config)
    layers = list(getattr(full, adapter.layers))
    check_num_stages(pipeline_parallel, len(layers), str(config.get("model_type")))
    first = sum(_numel(getattr(full, n)) for n in adapter.embeddings)
    last = sum(_numel(getattr(full, n)) for n in adapter.head)
    if getattr(full, "tied", False):  # the last stage holds the shared embedding as its head
        last += _numel(getattr(full, full.tied_embedding))
    bounds = balance_layers([_numel(layer) for layer in layers], pipeline_parallel, first, last)
    return stage_layouts(bounds)


@dataclass
class StageModel:
    """One stage's pruned model with its adapter and layout."""

    model: RaggedModel
    adapter: StageAdapter
    layout: StageLayout
    dtype: torch.dtype  # of the hidden states passed between stages

    @property
    def hidden_size(self) -> int:
        return self.adapter.hidden_size(self.model)

    @torch.inference_mode()
    def forward(
        self,
        batch: RaggedBatch,
        kv_cache: KVCache,
        hidden: torch.Tensor | None,
        head: bool = True,
    ) -> torch.Tensor:
        """``hidden`` ``[N, hidden]`` from the previous stage (None on the first) ->
        ``[N, hidden]`` for the next stage, or on the last stage ``[M, vocab]`` fp32
        logits of ``batch.logits_indices`` (``[N, hidden]`` with ``head=False``: the last
        stage's tensor ranks other than 0, whose logits nobody reads)."""
        m, a = self.model, self.adapter
        x = a.embed(m, batch) if self.layout.is_first else hidden
        assert x is not None, "a stage after the first needs the previous stage's hidden states"
        x = a.run_layers(m, x, batch, kv_cache)
        if not (self.layout.is_last and head):
            return x
        return a.logits(m, x[batch.logits_indices]).float()

    def layer_bytes(self) -> int:
        """Bytes of this stage's decoder-layer weights (parameters and quantized buffers)."""
        return _module_bytes(getattr(self.model, self.adapter.layers))

    def total_bytes(self) -> int:
        """Bytes of every weight this stage holds (shared tensors counted once)."""
        return _module_bytes(self.model)


def _module_bytes(module: nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for t in [*module.parameters(), *module.buffers()]:
        if t.device.type == "meta" or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def _prune(model: RaggedModel, adapter: StageAdapter, layout: StageLayout) -> None:
    """Keep ``layout``'s layers (keyed by global index), its embeddings / head only."""
    layers = getattr(model, adapter.layers)
    kept = nn.ModuleDict({str(i): layers[i] for i in layout.layers})
    setattr(model, adapter.layers, kept)
    tied = getattr(model, "tied", False)
    if not layout.is_first:
        for name in adapter.embeddings:
            if not (layout.is_last and tied and name == model.tied_embedding):
                setattr(model, name, None)
    if not layout.is_last:
        for name in adapter.head:
            setattr(model, name, None)


def _stage_weights(
    full: RaggedModel, weights: Iterator[tuple[str, torch.Tensor]], held: dict[str, nn.Parameter]
) -> Iterator[tuple[str, torch.Tensor, slice | None, str]]:
    """(our parameter, source tensor, rows, checkpoint name) of every held target."""
    unexpected = []
    for name, tensor in weights:
        targets = full.map_weight(name, tensor)
        if targets is None:
            unexpected.append(name)
            continue
        for pname, src, rows, transpose in targets:
            if pname in held:
                yield pname, (src.t() if transpose else src), rows, name
    if unexpected:
        logger.warning(
            "ignored %d unexpected checkpoint tensors, e.g. %s", len(unexpected), unexpected[:3]
        )


def _quantize_row_parallel_whole(
    model: RaggedModel, full: RaggedModel, adapter: StageAdapter, quantization: Any
) -> dict[str, Any]:
    """Have ``full`` quantize this stage's row-parallel weights whole as they load, as
    ``tensor_parallel`` alone does (``loader._load`` with the same
    :class:`~shardspeed.inference.quantization.tensor_parallel.RowParallelQuantizer`);
    returns the map this rank's slices land in, by layer name (``prequantized``).

    ``full`` maps the checkpoint and calls its ``row_parallel_hook`` with each whole
    weight cast to *its* parameter's dtype and device, so it borrows the stage's own
    layers (real parameters; the same names, ``layers.5.o_proj``) and the hook passes
    on only the weights this stage holds (other stages' layers stay on the meta device).
    """
    from shardspeed.inference.quantization import WeightQuantConfig
    from shardspeed.inference.quantization.tensor_parallel import RowParallelQuantizer

    quantizer = RowParallelQuantizer(WeightQuantConfig.parse(quantization))
    whole = getattr(full, adapter.layers)
    for index, layer in getattr(model, adapter.layers).items():
        whole[int(index)] = layer
    held = {name for name, _ in model.named_parameters()}

    def hook(name: str, tensor: torch.Tensor, pieces: list[range]) -> None:
        if name in held:
            quantizer(name, tensor, pieces)

    full.row_parallel_hook = hook
    return quantizer.slices


@torch.no_grad()
def _load_stage(
    model: RaggedModel, full: RaggedModel, weights: Iterator[tuple[str, torch.Tensor]]
) -> None:
    params = dict(model.named_parameters())
    rows_filled = dict.fromkeys(params, 0)
    for pname, src, rows, name in _stage_weights(full, weights, params):
        param = params[pname]
        dst = param[rows] if rows is not None else param
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {tuple(src.shape)} but {pname!r} expects "
                f"{tuple(dst.shape)}; does config.json match the weights?"
            )
        dst.copy_(src)
        rows_filled[pname] += dst.shape[0] if dst.dim() else 1
    missing = [n for n, p in params.items() if rows_filled[n] < (p.shape[0] if p.dim() else 1)]
    if missing:
        raise ValueError(
            f"checkpoint is missing weights for {len(missing)} parameters, e.g. {missing[:5]}; "
            "check that the directory holds every *.safetensors shard."
        )


def build_stage_model(
    model_or_path: Any,
    layout: StageLayout,
    dtype: torch.dtype | str | None,
    device: torch.device,
    quantization: Any = None,
    shard: TensorShard = NO_SHARD,
) -> StageModel:
    """Stage ``layout``'s part of ``model_or_path`` on ``device``, loaded (and quantized
    as the one-process engine quantizes the same layers). With a sharded ``shard`` (pipeline
    x tensor parallel) it is that tensor rank's slices of the stage's layers, as
    ``tensor_parallel`` alone slices (and quantizes) them (:mod:`~.models.tp_shard`)."""
    config, weights, source_dtype = describe_source(model_or_path)
    dtype = parse_dtype(dtype)
    if dtype is None:
        dtype = source_dtype or torch.float32
        if device.type == "cpu" and dtype == torch.float16:
            dtype = torch.float32
    cls = get_model_class(config.get("model_type"))
    adapter = adapter_for(cls, layout.num_stages)
    full = _meta_model(cls, config, shard)  # maps (and slices) checkpoint tensors; no memory
    model = _meta_model(cls, config, shard)
    _prune(model, adapter, layout)
    _materialize(model, dtype, device)
    if layout.is_last:
        model.tie_weights()
    prequantized = None  # a tensor rank's slices of row-parallel weights quantized whole
    if shard.sharded and quantization is not None:
        prequantized = _quantize_row_parallel_whole(model, full, adapter, quantization)
    _load_stage(model, full, weights)
    _quantize(model, quantization, device, prequantized)
    stage = StageModel(model.eval(), adapter, layout, dtype)
    logger.info(
        "pipeline stage %d/%d%s: %s layers [%d, %d)%s%s, %.1f MiB of weights on %s as %s",
        layout.stage, layout.num_stages,
        f" tensor rank {shard.rank}/{shard.world_size}" if shard.sharded else "",
        cls.__name__, layout.first_layer, layout.end_layer,
        " + embeddings" if layout.is_first else "", " + norm/lm_head" if layout.is_last else "",
        stage.total_bytes() / 2**20, device, str(dtype).replace("torch.", ""),
    )  # fmt: skip
    return stage
