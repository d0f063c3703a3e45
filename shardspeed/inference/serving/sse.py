"""Server-sent events for streamed (chat) completions.

Each event is ``data: <json>\\n\\n``; the stream ends with ``data: [DONE]``. Chat streams
open with a ``{"role": "assistant"}`` delta per choice; the last content chunk of a
choice carries its ``finish_reason``; with ``stream_options.include_usage`` a final
chunk with empty ``choices`` carries ``usage``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from pydantic import BaseModel

from shardspeed.inference.serving.async_engine import RequestStream
from shardspeed.inference.serving.errors import api_error_from
from shardspeed.inference.serving.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
    Usage,
    dump,
)
from shardspeed.inference.serving.text_stream import TextDeltaStream


def sse(data: dict[str, Any]) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


def finish_reason(reason: str | None) -> str | None:
    """The engine's finish reason in OpenAI terms (``abort`` never reaches a client)."""
    return "length" if reason == "length" else None if reason is None else "stop"


async def event_stream(
    model: str,
    rid: str,
    streams: list[RequestStream],
    firsts: list[Any],
    stop: list[str],
    include_usage: bool,
    chat: bool,
    num_samples: int = 1,
) -> AsyncIterator[str]:
    """Server-sent events of one (chat) completion: chunks, optional usage, ``[DONE]``.

    ``streams`` holds ``num_samples`` consecutive sample streams per prompt (choice
    index = stream index); usage counts each prompt once."""
    deltas = [TextDeltaStream(stop) for _ in streams]
    usage = Usage()
    try:
        if chat:
            for i in range(len(streams)):
                role = ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                yield sse(dump(ChatCompletionChunk(id=rid, model=model, choices=[role])))
        async for i, out in merge_streams(streams, firsts):
            delta = deltas[i].update(out.text, out.finished)
            if not delta and not out.finished:
                continue
            reason = finish_reason(out.finish_reason) if out.finished else None
            if chat:
                msg = DeltaMessage(content=delta or None)
                chunk: BaseModel = ChatCompletionChunk(
                    id=rid,
                    model=model,
                    choices=[ChatChunkChoice(index=i, delta=msg, finish_reason=reason)],
                )
            else:
                chunk = CompletionResponse(
                    id=rid,
                    model=model,
                    choices=[CompletionChoice(index=i, text=delta, finish_reason=reason)],
                )
            yield sse(dump(chunk))
            if out.finished:
                num_prompt = len(out.prompt_token_ids) if i % num_samples == 0 else 0
                usage.add(num_prompt, len(out.output_token_ids))
        if include_usage:
            cls = ChatCompletionChunk if chat else CompletionResponse
            yield sse(dump(cls(id=rid, model=model, choices=[], usage=usage)))
    except Exception as exc:  # engine died mid-stream: tell the client in-band
        err = api_error_from(exc)
        yield sse(
            {
                "error": {
                    "message": err.message,
                    "type": err.type,
                    "param": None,
                    "code": err.code,
                }
            }
        )
    finally:
        for s in streams:
            s.abort()
    yield "data: [DONE]\n\n"


async def gather_or_cancel(coros: list[Awaitable[Any]]) -> list[Any]:
    """``asyncio.gather`` that cancels the siblings when one fails."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()


async def merge_streams(
    streams: list[RequestStream], firsts: list[Any]
) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several request streams as (choice index, output) pairs."""
    if len(streams) == 1:
        yield 0, firsts[0]
        async for out in streams[0]:
            yield 0, out
        return
    merged: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream, first: Any) -> None:
        await merged.put((i, first))
        try:
            async for out in stream:
                await merged.put((i, out))
        except Exception as exc:
            await merged.put((i, exc))

    tasks = [
        asyncio.ensure_future(pump(i, s, f))
        for i, (s, f) in enumerate(zip(streams, firsts, strict=True))
    ]
    remaining = len(streams)
    try:
        while remaining:
            i, item = await merged.get()
            if isinstance(item, Exception):
                raise item
            yield i, item
            remaining -= int(item.finished)
    finally:
        for t in tasks:
            t.cancel()
