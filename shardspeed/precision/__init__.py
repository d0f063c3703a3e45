"""Precision policies and loss scaling."""

from shardspeed.precision.policy import MixedPrecision

__all__ = ["MixedPrecision"]
