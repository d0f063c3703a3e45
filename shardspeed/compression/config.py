"""DeepSpeed's ``deepspeed.compression.config`` path: the ``compression_training`` block's
typed config lives with the other ds_config blocks in :mod:`shardspeed.config.compression`."""

from __future__ import annotations

from shardspeed.config.compression import CompressionConfig, get_compression_config

__all__ = ["CompressionConfig", "get_compression_config"]
