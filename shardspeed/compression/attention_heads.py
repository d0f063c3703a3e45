"""Head pruning on Hugging Face attention modules (Llama-shaped: ``q_proj`` / ``k_proj`` /
``v_proj`` / ``o_proj`` under a module that holds ``config`` and ``head_dim``).

Two things the generic head-pruning code cannot know by itself:

* **Grouped-query attention.** With ``num_key_value_heads < num_attention_heads`` each key /
  value head serves ``num_attention_heads / num_key_value_heads`` consecutive query heads
  (query head ``i`` reads kv head ``i // group``). A pruned "head" must then be a whole kv
  group: ``head_pruning.shared_parameters.num_heads`` must divide ``num_key_value_heads``
  (e.g. ``num_heads = num_key_value_heads``: block ``j`` of ``o_proj``'s input is kv head
  ``j``'s query heads, block ``j`` of ``k_proj`` / ``v_proj`` is kv head ``j``). Other
  counts would cut through a kv head and are refused at ``init_compression``.
* **The saved config.** HF attention reads its head counts from the shared model
  ``config`` (the forward infers them from shapes), so after ``redundancy_clean`` removed
  heads, ``config.num_attention_heads`` / ``num_key_value_heads`` must follow or the
  checkpoint written by ``save_pretrained`` would not load. They are updated when every
  attention module sharing the config kept the same count; otherwise (no single count
  describes the model) a warning names the layers.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from shardspeed.compression.matching import get_submodule

logger = logging.getLogger(__name__)


def hf_attention_of(model: nn.Module, projection_name: str) -> nn.Module | None:
    """The HF attention module owning ``projection_name`` (None when its parent has no
    ``config.num_attention_heads`` and integer ``head_dim``)."""
    parent_name = projection_name.rpartition(".")[0]
    parent = get_submodule(model, parent_name) if parent_name else model
    config = getattr(parent, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    if isinstance(heads, int) and isinstance(getattr(parent, "head_dim", None), int):
        return parent
    return None


def _kv_heads(config: Any) -> int:
    kv = getattr(config, "num_key_value_heads", None)
    return kv if isinstance(kv, int) and kv > 0 else config.num_attention_heads


def check_gqa_head_blocks(model: nn.Module, module_names: list[str], num_heads: int) -> None:
    """Refuse a ``num_heads`` that would split a key / value head of an HF attention."""
    for name in module_names:
        attention = hf_attention_of(model, name)
        if attention is None:
            continue
        kv = _kv_heads(attention.config)
        if kv % num_heads:
            heads = attention.config.num_attention_heads
            raise ValueError(
                f"head_pruning.shared_parameters.num_heads={num_heads} on '{name}': its "
                f"attention has {heads} query heads sharing {kv} key/value heads "
                f"(grouped-query attention), and {num_heads} blocks would cut through a "
                f"key/value head; allowed: a divisor of num_key_value_heads={kv}. Fix: set "
                f"num_heads to {kv}, so each pruned block is one key/value head with its "
                f"{heads // kv} query heads."
            )


class HeadCountSync:
    """Collects the heads each HF attention kept, then writes them to the shared config."""

    def __init__(self) -> None:
        self._kept: dict[int, tuple[Any, dict[str, tuple[int, int, int]]]] = {}

    def record(self, model: nn.Module, o_proj_name: str, num_heads: int, kept: int) -> None:
        """``o_proj_name`` kept ``kept`` of its ``num_heads`` blocks."""
        attention = hf_attention_of(model, o_proj_name)
        if attention is None:
            return
        config = attention.config
        heads, kv = config.num_attention_heads, _kv_heads(config)
        new = (heads * kept // num_heads, kv * kept // num_heads, attention.head_dim)
        self._kept.setdefault(id(config), (config, {}))[1][o_proj_name] = new

    def apply(self, model: nn.Module) -> None:
        """Write the recorded counts to each config all its attention modules agree on."""
        for config, by_layer in self._kept.values():
            counts = set(by_layer.values())
            users = sum(
                1 for _, m in model.named_modules() if getattr(m, "config", None) is config
                and isinstance(getattr(m, "head_dim", None), int)
            )  # fmt: skip
            if len(counts) != 1 or users != len(by_layer):
                logger.warning(
                    "head_pruning: the attention modules sharing one config kept different "
                    "head counts (%s; %d of %d pruned), which config.num_attention_heads "
                    "cannot describe: the config is left as it was and a checkpoint saved "
                    "with save_pretrained will not load. Prune every layer with one ratio.",
                    by_layer, len(by_layer), users,
                )  # fmt: skip
                continue
            ((heads, kv, head_dim),) = counts
            config.num_attention_heads = heads
            config.head_dim = head_dim  # no longer hidden_size // num_attention_heads
            if isinstance(getattr(config, "num_key_value_heads", None), int):
                config.num_key_value_heads = kv
            for module in model.modules():
                if getattr(module, "config", None) is config and hasattr(
                    module, "num_key_value_groups"
                ):
                    module.num_key_value_groups = heads // kv
            logger.info(
                "head_pruning: config now has %d attention heads, %d key/value heads",
                heads,
                kv,
            )
