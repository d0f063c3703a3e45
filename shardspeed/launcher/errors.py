"""The launcher's user-error type."""

from __future__ import annotations


class LauncherError(ValueError):
    """A launcher flag, hostfile or env file is wrong; the message names it and the fix.

    ``shardspeed`` turns it into ``shardspeed: error: <message>`` and exit status 2.
    """
