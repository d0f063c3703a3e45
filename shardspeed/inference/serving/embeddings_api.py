"""``POST /v1/embeddings``: OpenAI's request and response bodies and the handler.

``input`` is a string, a list of strings, a list of token ids or a list of such lists;
``encoding_format`` ``"float"`` (lists of numbers) or ``"base64"`` (little-endian float32
bytes, what the ``openai`` Python client asks for by default); ``dimensions`` may only
name the model's own width (the vectors are not Matryoshka-truncatable in general).
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from shardspeed.inference.serving.embedder import Embedder
from shardspeed.inference.serving.errors import APIError

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None

    def inputs(self) -> list[str | list[int]]:
        x = self.input
        if isinstance(x, str):
            return [x]
        if x and all(isinstance(t, int) for t in x):
            return [list(x)]  # type: ignore[arg-type]
        return list(x)  # type: ignore[arg-type]


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


async def create_embeddings(
    embedder: Embedder | None, req: EmbeddingRequest, model_name: str
) -> dict[str, Any]:
    """The response body for ``req`` (``APIError`` 400 on bad input or when no embedder)."""
    if embedder is None:
        raise APIError(
            400,
            "this server has no embedding model; start it with embedding_model=... "
            "(serve()) to enable /v1/embeddings",
            param="model",
        )
    inputs = req.inputs()
    if not inputs or len(inputs) > MAX_INPUTS:
        raise APIError(
            400, f"input: send 1 to {MAX_INPUTS} inputs (got {len(inputs)})", param="input"
        )
    if req.dimensions is not None and req.dimensions != embedder.dimensions:
        raise APIError(
            400,
            f"dimensions={req.dimensions} is not supported: this model's embeddings have "
            f"{embedder.dimensions} dimensions; omit dimensions or send {embedder.dimensions}",
            param="dimensions",
        )
    try:
        ids = [embedder.encode(item, i) for i, item in enumerate(inputs)]
    except ValueError as exc:
        raise APIError(400, str(exc), param="input") from exc
    vectors = await asyncio.to_thread(embedder.embed_ids, ids)  # [N, H] float32
    data = []
    for i, vec in enumerate(vectors):
        if req.encoding_format == "base64":
            raw = vec.numpy().astype("<f4").tobytes()
            value: list[float] | str = base64.b64encode(raw).decode("ascii")
        else:
            value = vec.tolist()
        data.append(EmbeddingData(index=i, embedding=value))
    tokens = sum(len(x) for x in ids)
    usage = EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)
    return EmbeddingResponse(data=data, model=model_name, usage=usage).model_dump()


__all__ = ["EmbeddingRequest", "EmbeddingResponse", "create_embeddings"]
