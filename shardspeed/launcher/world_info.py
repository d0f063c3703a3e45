"""DeepSpeed's ``--world_info``: the selected ``{host: [slot, ...]}`` map as one URL-safe token.

The ``deepspeed`` runner hands every node the same token (base64 of the map's JSON, so it
survives shell quoting and ``pdsh``); each node's launcher decodes it and picks its own
slots by node rank. Dict order is node order.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence

from shardspeed.launcher.errors import LauncherError


def encode_world_info(world_info: Mapping[str, Sequence[int]]) -> str:
    """``{host: [slot, ...]}`` -> URL-safe base64 of its JSON."""
    text = json.dumps({host: list(slots) for host, slots in world_info.items()})
    return base64.urlsafe_b64encode(text.encode("utf-8")).decode("utf-8")


def decode_world_info(encoded: str) -> OrderedDict[str, list[int]]:
    """The inverse of :func:`encode_world_info` (host order kept).

    Raises:
        LauncherError: ``encoded`` is not a token made by :func:`encode_world_info`.
    """
    try:
        raw = json.loads(base64.urlsafe_b64decode(encoded.encode("utf-8")))
    except (binascii.Error, ValueError) as err:
        raise LauncherError(
            f"--world_info {encoded[:40]!r}...: not a base64 JSON host map ({err}); pass the "
            "value the deepspeed runner produced (encode_world_info)."
        ) from None
    if not isinstance(raw, dict) or not all(
        isinstance(v, list) and all(isinstance(s, int) for s in v) for v in raw.values()
    ):
        raise LauncherError(
            f"--world_info decodes to {raw!r}; expected a JSON object of host -> list of slots."
        )
    return OrderedDict((str(host), list(slots)) for host, slots in raw.items())
