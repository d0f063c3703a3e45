"""Build a ragged model from an HF directory, a transformers model or our GPT.

The weights are always *copied* into our own ragged modules: the source model's
``forward`` is never called. Sources:

* a directory with ``config.json`` and ``model.safetensors`` (or a sharded
  ``model.safetensors.index.json``), HF layout or ``GPT.save_pretrained``'s;
* a ``transformers`` ``PreTrainedModel`` (its ``config`` and ``state_dict``);
* a :class:`shardspeed.models.gpt.GPT`;
* a :class:`CheckpointSource` (config dict + state dict: how an in-memory model
  reaches tensor-parallel worker processes);
* an already-built :class:`RaggedModel` (moved to ``device``/``dtype``).

With a sharded :class:`~.models.tp_shard.TensorShard` the model is built with one
tensor-parallel rank's shapes and ``map_weight`` slices each checkpoint tensor as
it streams past, so a rank keeps only its part. A quantized rank gets exactly its
slice of the ``tensor_parallel=1`` quantization (row-parallel weights are quantized
whole as they pass; see :mod:`shardspeed.inference.quantization.tensor_parallel`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from shardspeed.inference.fastgen.models import RaggedModel, get_model_class
from shardspeed.inference.fastgen.models.tp_shard import NO_SHARD, TensorShard
from shardspeed.utils.logging import get_logger

logger = get_logger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """``torch.dtype``, a name like ``"bf16"``, or None/``"auto"`` (= the checkpoint's)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).replace("torch.", "").lower()
    if key == "auto":
        return None
    if key not in _DTYPES:
        raise ValueError(
            f"dtype={dtype!r} is not supported; use one of {sorted(_DTYPES)} or 'auto'."
        )
    return _DTYPES[key]


def load_hf_config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    if not path.is_file():
        raise ValueError(
            f"model path {str(directory)!r} has no config.json; pass an HF model directory, "
            "a transformers model object or a shardspeed GPT."
        )
    return json.loads(path.read_text())


def safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [directory / f for f in sorted(set(weight_map.values()))]
    single = directory / "model.safetensors"
    files = [single] if single.is_file() else sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"no *.safetensors weights in {str(directory)!r}; the engine loads safetensors only "
            "(convert a pytorch_model.bin with transformers' save_pretrained(safe_serialization=True))."
        )
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            for key in fh.keys():
                yield key, fh.get_tensor(key)


def _config_dtype(config: dict[str, Any]) -> torch.dtype | None:
    name = config.get("torch_dtype") or config.get("dtype")
    return _DTYPES.get(str(name).replace("torch.", "")) if name else None


@dataclass(frozen=True)
class CheckpointSource:
    """A model as plain data: its config dict (with ``model_type``), state dict and dtype."""

    config: dict[str, Any]
    weights: dict[str, torch.Tensor]
    dtype: torch.dtype | None


def describe_source(
    model_or_path: Any,
) -> tuple[dict[str, Any], Iterator[tuple[str, torch.Tensor]], torch.dtype | None]:
    """(config dict with ``model_type``, weight iterator, checkpoint dtype) of a source."""
    from shardspeed.models.gpt import GPT

    if isinstance(model_or_path, CheckpointSource):
        src = model_or_path
        return dict(src.config), iter(src.weights.items()), src.dtype
    if isinstance(model_or_path, (str, Path)):
        directory = Path(model_or_path)
        config = load_hf_config(directory)
        return config, iter_safetensors(safetensors_files(directory)), _config_dtype(config)
    if isinstance(model_or_path, GPT):
        config = {"model_type": "shardspeed_gpt", **model_or_path.config.to_dict()}
        dtype = next(model_or_path.parameters()).dtype
        return config, iter(model_or_path.state_dict().items()), dtype
    hf_config = getattr(model_or_path, "config", None)
    if isinstance(model_or_path, nn.Module) and hasattr(hf_config, "to_dict"):
        config = hf_config.to_dict()
        dtype = next(model_or_path.parameters()).dtype
        return config, iter(model_or_path.state_dict().items()), dtype
    raise ValueError(
        f"cannot build an inference model from {type(model_or_path).__name__}; pass an HF model "
        "directory, a transformers PreTrainedModel, a shardspeed GPT or a RaggedModel."
    )


@contextlib.contextmanager
def _skip_param_init() -> Iterator[None]:
    """Make ``torch.nn.init`` fills no-ops: weights are loaded right after construction.

    (Random init on the meta device is wasted work and, for ``normal_``, imports
    ``torch._dynamo`` - seconds of start-up.)
    """
    names = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "ones_", "zeros_")
    saved = {n: getattr(nn.init, n) for n in names}
    try:
        for n in names:
            setattr(nn.init, n, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for n, fn in saved.items():
            setattr(nn.init, n, fn)


def _materialize(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Replace meta parameters with uninitialised ones (cheaper than ``to_empty``)."""
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            empty = torch.empty(p.shape, dtype=dtype, device=device)
            setattr(module, name, nn.Parameter(empty, requires_grad=False))


def checkpoint_source(model_or_path: Any) -> str | CheckpointSource:
    """``model_or_path`` in a form to send to another process: a directory stays a path
    string, an in-memory model becomes a :class:`CheckpointSource`."""
    if isinstance(model_or_path, (str, Path)):
        return str(model_or_path)
    if isinstance(model_or_path, CheckpointSource):
        return model_or_path
    config, weights, dtype = describe_source(model_or_path)
    return CheckpointSource(config, dict(weights), dtype)


def check_shardable(model_or_path: Any, world_size: int, quantization: Any = None) -> None:
    """``ValueError`` unless ``model_or_path`` can be split over ``world_size`` tensor-parallel
    ranks (supported family, heads and MLP rows divisible, and with ``quantization`` whole
    groups per rank); builds it on the meta device."""
    if isinstance(model_or_path, RaggedModel):
        raise ValueError(
            f"EngineConfig.tensor_parallel={world_size} needs the checkpoint to slice at load, "
            f"but got an already-built {type(model_or_path).__name__}; pass its HF directory or "
            "transformers model instead, or use tensor_parallel=1."
        )
    config, _, _ = describe_source(model_or_path)
    cls = get_model_class(config.get("model_type"))
    if not cls.supports_tensor_parallel:
        from shardspeed.inference.fastgen.models.registry import supported_model_types

        supported = [
            t for t in supported_model_types() if get_model_class(t).supports_tensor_parallel
        ]
        raise ValueError(
            f"EngineConfig.tensor_parallel={world_size}: model_type={config.get('model_type')!r} "
            f"({cls.__name__}) does not support tensor parallelism yet; supported: {supported}. "
            "Use tensor_parallel=1 for this model."
        )
    shard = TensorShard(0, world_size, all_reduce=_unused_all_reduce)
    with torch.device("meta"), _skip_param_init():
        model = cls.from_config(config, shard)  # type: ignore[call-arg]
    if quantization is not None:
        from shardspeed.inference.quantization import WeightQuantConfig
        from shardspeed.inference.quantization.tensor_parallel import check_group_alignment

        check_group_alignment(model, WeightQuantConfig.parse(quantization), world_size)


def _unused_all_reduce(x: torch.Tensor) -> torch.Tensor:
    raise AssertionError("check_shardable builds on the meta device and never runs a forward")


def meta_model(cls: type[RaggedModel], config: dict[str, Any]) -> RaggedModel:
    """``cls.from_config(config)`` on the meta device (shapes only, nothing allocated)."""
    with torch.device("meta"), _skip_param_init():
        return cls.from_config(config)


def build_model(
    model_or_path: Any,
    dtype: torch.dtype | str | None,
    device: torch.device,
    quantization: Any = None,
    shard: TensorShard = NO_SHARD,
    target_device: torch.device | None = None,
    prepare: Callable[[RaggedModel], None] | None = None,
) -> tuple[RaggedModel, dict[str, Any]]:
    """A ragged model on ``device`` in ``dtype`` (None: checkpoint dtype; fp16 -> fp32 on CPU).

    ``quantization`` (a :class:`~shardspeed.inference.quantization.WeightQuantConfig`,
    its name or dict) quantizes the linear layers once the weights are loaded.
    ``shard`` builds one tensor-parallel rank's part (see :func:`check_shardable`).
    ``target_device`` is where the model will run when that is not ``device`` (weight
    offload builds on the host for a GPU): the default dtype and the quantized kernels'
    layout follow it; None means ``device``. ``prepare`` runs on the meta model before
    its weights exist (expert parallelism keeps this rank's experts there).
    """
    target = device if target_device is None else target_device
    dtype = parse_dtype(dtype)
    if shard.sharded:
        check_shardable(model_or_path, shard.world_size, quantization)
    if isinstance(model_or_path, RaggedModel):
        model = model_or_path.to(device=device, dtype=dtype) if dtype else model_or_path.to(device)
        _quantize(model, quantization, target)
        return model.eval(), {"model_type": model.model_type}
    config, weights, source_dtype = describe_source(model_or_path)
    if dtype is None:
        dtype = source_dtype or torch.float32
        if target.type == "cpu" and dtype == torch.float16:
            dtype = torch.float32
    cls = get_model_class(config.get("model_type"))
    with torch.device("meta"), _skip_param_init():
        if shard.sharded:
            model = cls.from_config(config, shard)  # type: ignore[call-arg]
        else:
            model = cls.from_config(config)
        if prepare is not None:
            prepare(model)
    _materialize(model, dtype, device)
    model.tie_weights()
    prequantized = _load(model, weights, quantization if shard.sharded else None)
    _quantize(model, quantization, target, prequantized)
    n_params = sum(p.numel() for p in model.parameters())
    part = f", tensor-parallel rank {shard.rank}/{shard.world_size}" if shard.sharded else ""
    place = f"{device} (for {target})" if target != device else str(device)
    logger.info(
        "loaded %s (%s, %.1fM params%s) on %s as %s", cls.__name__, config.get("model_type"),
        n_params / 1e6, part, place, str(dtype).replace("torch.", ""),
    )  # fmt: skip
    return model.eval(), config


def _load(
    model: RaggedModel, weights: Iterator[tuple[str, torch.Tensor]], quantization: Any
) -> dict[str, Any] | None:
    """Load ``weights``; with a tensor-parallel rank's ``quantization``, also quantize each
    row-parallel weight whole as it passes and return this rank's slices by layer name
    (so its scales are those of ``tensor_parallel=1``, see
    :mod:`shardspeed.inference.quantization.tensor_parallel`)."""
    if quantization is None:
        model.load_weights(weights)
        return None
    from shardspeed.inference.quantization import WeightQuantConfig
    from shardspeed.inference.quantization.tensor_parallel import RowParallelQuantizer

    quantizer = RowParallelQuantizer(WeightQuantConfig.parse(quantization))
    model.row_parallel_hook = quantizer
    try:
        model.load_weights(weights)
    finally:
        model.row_parallel_hook = None
    return quantizer.slices


def _quantize(
    model: RaggedModel,
    quantization: Any,
    target_device: torch.device,
    prequantized: dict[str, Any] | None = None,
) -> None:
    """Weight-only quantization of ``model``'s linear layers in place (None: nothing), with
    kernels for ``target_device``; ``prequantized``: layers' weights already quantized."""
    if quantization is None:
        return
    from shardspeed.inference.quantization import quantize_model

    quantize_model(model, quantization, target_device, prequantized)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def resolve_tokenizer(model_or_path: Any, tokenizer: Any) -> Any:
    """The tokenizer to use: given one (or a path for ``AutoTokenizer``), else a default.

    Defaults: :class:`ByteTokenizer` for our GPT; ``AutoTokenizer`` from the model
    directory (or a transformers model's ``name_or_path``) when tokenizer files
    are there; otherwise None (prompts must then be token ids).
    """
    from shardspeed.models.gpt import GPT
    from shardspeed.models.tokenizer import ByteTokenizer

    if tokenizer is not None and not isinstance(tokenizer, (str, Path)):
        return tokenizer
    if tokenizer is not None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(tokenizer))
    directory: Path | None = None
    if isinstance(model_or_path, GPT):
        return ByteTokenizer()
    if isinstance(model_or_path, (str, Path)):
        directory = Path(model_or_path)
        if load_hf_config(directory).get("model_type") == "shardspeed_gpt":
            return ByteTokenizer()
    elif isinstance(model_or_path, RaggedModel):
        return ByteTokenizer() if model_or_path.model_type == "shardspeed_gpt" else None
    else:
        name = getattr(getattr(model_or_path, "config", None), "name_or_path", "") or ""
        directory = Path(name) if name and Path(name).is_dir() else None
    if directory is not None and any((directory / f).is_file() for f in _TOKENIZER_FILES):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(directory))
    logger.info("no tokenizer found for the model; prompts must be token id lists")
    return None
