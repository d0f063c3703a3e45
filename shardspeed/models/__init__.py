"""Reference models shipped with the library (the demo GPT) and its byte tokenizer."""

from shardspeed.models.gpt import GPT, GPTConfig
from shardspeed.models.tokenizer import ByteTokenizer

__all__ = ["GPT", "GPTConfig", "ByteTokenizer"]
