"""Small shared utilities (logging, accelerator helpers)."""

from shardspeed.utils.logging import get_logger, log_dist, logger

__all__ = ["get_logger", "log_dist", "logger"]
