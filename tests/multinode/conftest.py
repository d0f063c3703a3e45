"""Fixtures of the two-host tier: one pair of network namespaces for the whole session.

Tests that take ``two_hosts`` skip, naming the reason, where namespaces cannot be created
(not root, no ``ip``, ``ip netns add`` refused); any later failure is a test error. The
pair is removed when the session ends, at interpreter exit if the session is killed
before its finalizers run, and by the next session if even that did not happen.
"""

from __future__ import annotations

import atexit
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "dist"))  # parity_common

from hosts import (  # noqa: E402
    NamespacesUnavailable,
    TwoHosts,
    create_host_pair,
    destroy_host_pair,
)


@pytest.fixture(scope="session")
def two_hosts() -> Iterator[TwoHosts]:
    try:
        pair = create_host_pair()
    except NamespacesUnavailable as err:
        pytest.skip(f"two-host tests need network namespaces: {err}")
    atexit.register(destroy_host_pair, pair)
    try:
        yield TwoHosts(*pair)
    finally:
        destroy_host_pair(pair)
        atexit.unregister(destroy_host_pair)
