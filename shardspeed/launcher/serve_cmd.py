"""``shardspeed serve MODEL``: run the OpenAI-compatible server on one model.

Example::

    shardspeed serve ./my-llama --port 8000 --scheduler splitfuse --api-key "$KEY"

Engine options left unset keep :class:`EngineConfig`'s defaults. The API key can also
come from the ``SHARDSPEED_API_KEY`` environment variable (keeps it out of ``ps``).
"""

from __future__ import annotations

import argparse
import os
import sys

_SCHEDULERS = ("splitfuse", "prefill_first", "static")


def _kv_memory(value: str) -> int | float:
    """Bytes (an int, or with a K/M/G suffix) or a fraction in (0, 1]."""
    text = value.strip().upper()
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    try:
        if text[-1:] in units:
            return int(float(text[:-1]) * units[text[-1]])
        number = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"--kv-cache-memory {value!r}: pass bytes (e.g. 2G, 512M, 1073741824) or a fraction in (0, 1]"
        ) from exc
    return number if 0 < number <= 1 else int(number)


def _seconds(value: str) -> float:
    """A positive, finite number of seconds."""
    try:
        number = float(value)
    except ValueError:
        number = float("nan")
    if not 0 < number < float("inf"):
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds > 0 (e.g. 10)")
    return number


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shardspeed serve",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
        "/v1/chat/completions, /v1/models, /health, /metrics). See docs/serving.md.",
    )
    p.add_argument(
        "model", help="model directory (HF llama/mistral/qwen2/gpt2 or a ShardSpeed GPT)"
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=os.environ.get("SHARDSPEED_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 (default: $SHARDSPEED_API_KEY)",
    )
    p.add_argument(
        "--model-name", default=None, help="id reported by /v1/models (default: directory name)"
    )
    p.add_argument(
        "--max-queue", type=int, default=256, help="requests waiting before 429 (default 256)"
    )
    p.add_argument(
        "--max-tokens-limit", type=int, default=4096, help="largest max_tokens a request may ask"
    )
    p.add_argument(
        "--max-request-bytes", type=int, default=1_000_000, help="largest request body (413 above)"
    )
    slow = p.add_argument_group("slow and idle clients")
    slow.add_argument(
        "--header-timeout",
        type=_seconds,
        default=10.0,
        help="seconds a client has to send its request headers (408 and close after; default 10)",
    )
    slow.add_argument(
        "--body-timeout",
        type=_seconds,
        default=30.0,
        help="seconds a client then has to send its whole body (408 after; default 30)",
    )
    slow.add_argument(
        "--keep-alive-timeout",
        type=_seconds,
        default=5.0,
        help="seconds an idle keep-alive connection stays open (default 5)",
    )
    slow.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="open connections at most; the oldest idle one is closed to admit a new one "
        "(default: the open-file limit less 512)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        help="file with a Jinja chat template overriding the tokenizer's",
    )
    engine = p.add_argument_group("engine (EngineConfig)")
    engine.add_argument("--block-size", type=int, default=None, help="tokens per KV block")
    engine.add_argument("--num-blocks", type=int, default=None, help="KV blocks in the pool")
    engine.add_argument(
        "--kv-cache-memory",
        type=_kv_memory,
        default=None,
        help="KV pool size: bytes (2G, 512M) or a fraction of free memory",
    )
    engine.add_argument(
        "--max-ragged-batch-size", type=int, default=None, help="token budget per step"
    )
    engine.add_argument(
        "--max-ragged-sequence-count", type=int, default=None, help="sequences per step"
    )
    engine.add_argument("--max-seq-len", type=int, default=None, help="longest prompt + output")
    engine.add_argument("--scheduler", choices=_SCHEDULERS, default=None)
    engine.add_argument("--enable-prefix-caching", action="store_true", default=None)
    engine.add_argument("--dtype", default=None, help="e.g. float16, bfloat16, float32")
    engine.add_argument("--device", default=None, help="e.g. cpu, cuda:0")
    engine.add_argument(
        "--cpu-prepack",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="pack linear weights once for oneDNN on CPU (default: bf16/fp16 weights; "
        "--cpu-prepack also fp32, --no-cpu-prepack never)",
    )
    engine.add_argument(
        "--speculative-config",
        type=_speculative_config,
        default=None,
        metavar="JSON",
        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
        'or \'{"model": "DRAFT_DIR", "num_speculative_tokens": 4}\' (docs/serving.md)',
    )
    lora = p.add_argument_group("LoRA adapters (see docs/serving.md)")
    lora.add_argument("--enable-lora", action="store_true", default=None)
    lora.add_argument(
        "--lora-modules",
        nargs="+",
        type=_lora_module,
        default=[],
        metavar="NAME=PATH",
        help="PEFT adapters served from the start; requests pick one with model=NAME",
    )
    lora.add_argument("--max-loras", type=int, default=None, help="adapters loaded at once")
    lora.add_argument("--max-lora-rank", type=int, default=None, help="largest adapter rank")
    lora.add_argument(
        "--allowed-lora-root",
        default=None,
        help="directory POST /v1/load_lora_adapter may load from (default: runtime loading off)",
    )
    p.add_argument(
        "--log-level", default="info", choices=("critical", "error", "warning", "info", "debug")
    )
    return p


_ENGINE_KEYS = (
    "block_size",
    "num_blocks",
    "kv_cache_memory",
    "max_ragged_batch_size",
    "max_ragged_sequence_count",
    "max_seq_len",
    "scheduler",
    "enable_prefix_caching",
    "dtype",
    "device",
    "speculative_config",
    "enable_lora",
    "max_loras",
    "max_lora_rank",
    "cpu_prepack",
)


def _speculative_config(value: str) -> dict:
    """The JSON object of ``--speculative-config`` (its keys are checked by the engine)."""
    import json

    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as err:
        msg = f"--speculative-config {value!r}: not JSON ({err})"
        raise argparse.ArgumentTypeError(msg) from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(
            f'--speculative-config {value!r}: expected a JSON object like {{"method": "ngram", '
            '"num_speculative_tokens": 4}'
        )
    return parsed


def _lora_module(value: str) -> tuple[str, str]:
    """``NAME=PATH`` of ``--lora-modules``."""
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules {value!r}: expected NAME=PATH")
    return name, path


def main(argv: list[str]) -> int:
    """Parse ``argv`` and serve until interrupted; returns the exit status."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 2
    from shardspeed.inference.serving.server import serve

    engine_config = {k: getattr(args, k) for k in _ENGINE_KEYS if getattr(args, k) is not None}
    chat_template = None
    try:
        if args.chat_template is not None:
            with open(args.chat_template, encoding="utf-8") as f:
                chat_template = f.read()
        serve(
            args.model,
            host=args.host,
            port=args.port,
            api_key=args.api_key,
            max_queue=args.max_queue,
            max_tokens_limit=args.max_tokens_limit,
            max_request_bytes=args.max_request_bytes,
            model_name=args.model_name,
            tokenizer=args.tokenizer,
            chat_template=chat_template,
            log_level=args.log_level,
            header_timeout_s=args.header_timeout,
            body_timeout_s=args.body_timeout,
            keep_alive_timeout_s=args.keep_alive_timeout,
            max_connections=args.max_connections,
            lora_modules=dict(args.lora_modules) or None,
            lora_root=args.allowed_lora_root,
            **engine_config,
        )
    except (ValueError, OSError) as err:
        sys.stderr.write(f"shardspeed serve: error: {err}\n")
        return 2
    except KeyboardInterrupt:  # uvicorn re-raises SIGINT after its graceful shutdown
        return 0
    return 0
