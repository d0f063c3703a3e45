"""Built-in data needing no download (the demo's corpus)."""

from shardspeed.data.stdlib_corpus import TokenWindows, load_stdlib_corpus

__all__ = ["TokenWindows", "load_stdlib_corpus"]
