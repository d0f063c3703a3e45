"""``python -m shardspeed.launcher`` = the ``shardspeed`` command."""

from __future__ import annotations

import sys

from shardspeed.launcher.cli import main

sys.exit(main())
