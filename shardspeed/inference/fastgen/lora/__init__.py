"""Multi-LoRA serving: PEFT adapters by name, several in one batch, loaded at run time.

* :mod:`.peft_format`: read ``adapter_config.json`` + ``adapter_model.safetensors``,
  refuse what is not a plain LoRA delta;
* :mod:`.placement`: put each HF-named module onto FastGen's fused projections through
  the model's own checkpoint mapping;
* :mod:`.registry`: name -> adapter within ``max_loras`` / ``max_lora_rank``;
* :mod:`.apply`: one forward hook per projection adds, per adapter in the batch, a
  segmented ``x @ A^T @ B^T`` over that adapter's tokens;
* :mod:`.manager`: what the engine holds (``engine.lora``).
"""

from shardspeed.inference.fastgen.lora.manager import LoRAManager, resolve_lora
from shardspeed.inference.fastgen.lora.registry import LoRAAdapter, LoRANotFoundError

__all__ = ["LoRAAdapter", "LoRAManager", "LoRANotFoundError", "resolve_lora"]
