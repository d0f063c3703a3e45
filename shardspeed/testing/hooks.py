"""Re-export of the reset-hook registry (it lives in :mod:`shardspeed.utils.reset_hooks`)."""

from shardspeed.utils.reset_hooks import register_reset_hook, reset_hooks, run_reset_hooks

__all__ = ["register_reset_hook", "reset_hooks", "run_reset_hooks"]
