"""Imported once by the forkserver the warm worker pools fork their ranks from.

Every rank a pool (re)starts is a fork of that server, so a module imported here is already
loaded in each new rank instead of being imported again by each of them: about 0.5 s of CPU
per rank for shardspeed's engine and 2.5 s for transformers' model base (which many
distributed tests build models from), paid once per session instead of at every pool start
(the first start, a respawn after a failure, skip or timeout, an evicted world size).

Only imports: nothing here runs code with an effect a test could see (the harness already
reuses a rank, with whatever it imported, for every later call). A module that is missing
or fails to import is skipped; the rank that needs it imports it itself and reports the
error where the test can see it (the forkserver itself must never fail to start). Only with
a CPU-only torch build: with CUDA (or ROCm) nothing is preloaded, so no import can touch
the driver in the server the ranks are forked from (a forked child cannot use a CUDA
driver its parent initialised). ``SHARDSPEED_TEST_PRELOAD=0`` turns the preload off.
"""

from __future__ import annotations

import importlib

import torch

MODULES = (
    "shardspeed.runtime.engine",
    "shardspeed.checkpoint",
    "transformers.modeling_utils",
    "transformers.models.llama.modeling_llama",
    "transformers.models.gpt2.modeling_gpt2",
)

if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
    for _name in MODULES:
        try:
            importlib.import_module(_name)
        except Exception:  # see the module docstring
            pass
