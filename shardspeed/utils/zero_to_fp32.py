"""DeepSpeed's import path ``deepspeed.utils.zero_to_fp32``: re-exports
:mod:`shardspeed.checkpoint.zero_to_fp32` (DeepSpeed's three functions over ShardSpeed's
checkpoint consolidation). As a script: ``python -m shardspeed.utils.zero_to_fp32
CHECKPOINT_DIR OUTPUT_DIR``."""

from shardspeed.checkpoint.zero_to_fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    get_model_state_file,
    get_optim_files,
    load_state_dict_from_zero_checkpoint,
    main,
)

__all__ = [
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "get_model_state_file",
    "get_optim_files",
    "load_state_dict_from_zero_checkpoint",
]

if __name__ == "__main__":
    main()
