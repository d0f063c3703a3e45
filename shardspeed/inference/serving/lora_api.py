"""LoRA adapters over HTTP, with vLLM's names.

* a request picks an adapter with ``"model": "<adapter name>"`` (the base model by its
  own name); an unknown name is a 404 naming it and the served names;
* ``GET /v1/models`` lists the base model, then each loaded adapter (``parent``: the base);
* ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` loads one while the server
  runs; ``lora_path`` must be a directory under the server's ``lora_root`` (its real path,
  links resolved), otherwise 403; without a ``lora_root`` runtime loading is refused;
* ``POST /v1/unload_lora_adapter`` ``{"lora_name"}``: new requests for it get a 404 at
  once; requests already generating with it finish with it.
"""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from shardspeed.inference.fastgen.lora import LoRANotFoundError
from shardspeed.inference.serving.errors import APIError
from shardspeed.inference.serving.protocol import ModelCard

if TYPE_CHECKING:
    from shardspeed.inference.serving.app import OpenAIServing, ServerSettings


class LoadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM clients send it; names identify adapters here


def lora_manager(engine: Any) -> Any:
    """The engine's :class:`~shardspeed.inference.fastgen.lora.LoRAManager` or None."""
    return getattr(engine, "lora", None)


def resolve_model(settings: ServerSettings, engine: Any, model: str | None) -> str | None:
    """The adapter ``model`` names (None: the base model); 404 when it names neither."""
    if model is None or model == settings.model_name:
        return None
    manager = lora_manager(engine)
    names = manager.names() if manager is not None else []
    if model in names:
        return model
    served = [settings.model_name, *names]
    raise APIError(
        404,
        f"The model {model!r} does not exist; this server serves {served}"
        + ("" if manager is None else " (LoRA adapters load with POST /v1/load_lora_adapter)"),
        param="model",
        code="model_not_found",
    )


def model_cards(settings: ServerSettings, engine: Any) -> list[ModelCard]:
    """The base model's card, then one per loaded adapter."""
    manager = lora_manager(engine)
    cards = [ModelCard(id=settings.model_name)]
    for name in manager.names() if manager is not None else []:
        cards.append(ModelCard(id=name, parent=settings.model_name))
    return cards


async def load_lora_adapter(serving: OpenAIServing, request: Request) -> Response:
    serving._check_auth(request)
    req = serving._parse(LoadLoRARequest, await serving._read_json(request))
    manager = _require_lora(serving)
    path = _allowed_path(serving.settings.lora_root, req.lora_path)
    if req.lora_name == serving.settings.model_name:
        raise APIError(
            400,
            f"lora_name {req.lora_name!r} is the base model's name; pick another name.",
            param="lora_name",
        )
    try:  # reading and placing the adapter runs off the event loop
        await asyncio.to_thread(manager.load, req.lora_name, path)
    except ValueError as exc:
        raise APIError(400, str(exc), param="lora_path") from exc
    return JSONResponse({"status": "ok", "lora_name": req.lora_name})


async def unload_lora_adapter(serving: OpenAIServing, request: Request) -> Response:
    serving._check_auth(request)
    req = serving._parse(UnloadLoRARequest, await serving._read_json(request))
    manager = _require_lora(serving)
    try:
        manager.unload(req.lora_name)
    except LoRANotFoundError as exc:
        raise APIError(404, str(exc), param="lora_name", code="lora_not_found") from exc
    return JSONResponse({"status": "ok", "lora_name": req.lora_name})


def _require_lora(serving: OpenAIServing) -> Any:
    manager = lora_manager(serving.engine.engine)
    if manager is None:
        raise APIError(
            400,
            "this server was started without LoRA support; restart it with enable_lora=True "
            "(--enable-lora) to load adapters.",
        )
    return manager


def _allowed_path(root: str | None, path: str) -> str:
    """``path`` resolved, when it lies under ``root``; 403 otherwise."""
    if root is None:
        raise APIError(
            403,
            "loading LoRA adapters at run time is disabled; start the server with "
            "lora_root=<dir> (--allowed-lora-root) to allow adapters under that directory.",
            type="permission_error",
            param="lora_path",
        )
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    if os.path.commonpath([real_root, real]) != real_root:
        raise APIError(
            403,
            f"lora_path {path!r} is outside the directory this server may load adapters from "
            f"({root!r}); copy the adapter under it.",
            type="permission_error",
            param="lora_path",
        )
    return real
