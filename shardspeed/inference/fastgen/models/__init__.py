"""Ragged-forward model families and their registry."""

from shardspeed.inference.fastgen.models.base import RaggedModel
from shardspeed.inference.fastgen.models.registry import (
    get_model_class,
    register_model,
    supported_model_types,
)

__all__ = ["RaggedModel", "get_model_class", "register_model", "supported_model_types"]
