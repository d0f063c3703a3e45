"""The OpenAI-compatible ASGI app (Starlette): routes, validation, errors.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/embeddings``
(with an embedding model), ``GET /v1/models``, ``POST /v1/load_lora_adapter`` /
``/v1/unload_lora_adapter`` (LoRA, see :mod:`.lora_api`) (these need the API key when one
is set), ``GET /health``, ``GET /metrics``.
"""

from __future__ import annotations

import asyncio
import hmac
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from shardspeed.inference.fastgen.detokenizer import decode
from shardspeed.inference.fastgen.outputs import select_best
from shardspeed.inference.serving.async_engine import (
    AsyncEngine,
    EngineDeadError,
    RequestFailedError,
    RequestStream,
)
from shardspeed.inference.serving.chat import render_chat_prompt
from shardspeed.inference.serving.errors import APIError, api_error_from, from_validation_error
from shardspeed.inference.serving.json_body import read_json_body
from shardspeed.inference.serving.logprobs_format import chat_logprobs, completion_logprobs
from shardspeed.inference.serving.lora_api import (
    load_lora_adapter,
    model_cards,
    resolve_model,
    unload_lora_adapter,
)
from shardspeed.inference.serving.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelList,
    ResponseMessage,
    Usage,
    _SamplingFields,
    dump,
)
from shardspeed.inference.serving.sse import event_stream, finish_reason, gather_or_cancel
from shardspeed.inference.serving.structured_format import StructuredOutputError
from shardspeed.inference.serving.text_stream import truncate_at_stop
from shardspeed.utils.logging import get_logger

logger = get_logger(__name__)
M = TypeVar("M", bound=BaseModel)
_DISCONNECT_POLL_S = 0.25


@dataclass
class ServerSettings:
    """Server-side limits and identity (see :func:`~.server.serve` for each one)."""

    model_name: str
    api_key: str | None = None
    max_tokens_limit: int = 4096
    max_request_bytes: int = 1_000_000
    default_chat_max_tokens: int = 128
    chat_template: str | None = None
    body_timeout_s: float = 30.0
    lora_root: str | None = None  # POST /v1/load_lora_adapter loads only under it


class _ClientGone(Exception):
    """The client disconnected before its answer was ready."""


class OpenAIServing:
    """Request handlers bound to one :class:`AsyncEngine`."""

    def __init__(self, engine: AsyncEngine, settings: ServerSettings, embedder: Any = None) -> None:
        self.engine = engine
        self.settings = settings
        self.embedder = embedder  # an embedder.Embedder, or None (no /v1/embeddings)

    # ---- plain routes ---------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        """200 ``{"status": "ok"}`` or 503 with a ``detail``; ``restarts`` once the engine
        thread has been restarted."""
        restarts = {"restarts": self.engine.restarts} if self.engine.restarts else {}
        if self.engine.is_healthy:
            return JSONResponse({"status": "ok", **restarts})
        body = {"status": "error", "detail": self.engine.status_detail, **restarts}
        return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})

    async def metrics(self, request: Request) -> Response:
        text = self.engine.metrics.render(queue_depth=self.engine.queue_depth)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(self, request: Request) -> Response:
        self._check_auth(request)
        cards = model_cards(self.settings, self.engine.engine)  # the base, then LoRA adapters
        return JSONResponse(ModelList(data=cards).model_dump())

    async def embeddings(self, request: Request) -> Response:
        from shardspeed.inference.serving.embeddings_api import EmbeddingRequest, create_embeddings

        self._check_auth(request)
        req = self._parse(EmbeddingRequest, await self._read_json(request))
        self._check_model(req.model)
        body = await create_embeddings(self.embedder, req, self.settings.model_name)
        return JSONResponse(body)

    # ---- generation routes ----------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        self._check_auth(request)
        req = self._parse(CompletionRequest, await self._read_json(request))
        lora_name = resolve_model(self.settings, self.engine.engine, req.model)
        prompts = req.prompt_list()
        if not prompts or any(len(p) == 0 for p in prompts):
            raise APIError(400, "prompt: must be a non-empty string or token list", param="prompt")
        params = self._sampling_params(
            req, req.max_tokens, "max_tokens", explicit="max_tokens" in req.model_fields_set
        )
        params.best_of = req.best_of
        params.lora_name = lora_name
        if req.logprobs is not None:
            params.logprobs = req.logprobs
            params.prompt_logprobs = req.logprobs if req.echo else None
        self._validate(params)
        await self._add_structured_output(req, params)
        return await self._generate(request, req, prompts, params, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        self._check_auth(request)
        req = self._parse(ChatCompletionRequest, await self._read_json(request))
        lora_name = resolve_model(self.settings, self.engine.engine, req.model)
        default = min(self.settings.default_chat_max_tokens, self.settings.max_tokens_limit)
        max_tokens = req.max_completion_tokens or req.max_tokens or default
        param_name = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        explicit = bool(req.max_completion_tokens or req.max_tokens)
        params = self._sampling_params(req, max_tokens, param_name, explicit)
        params.lora_name = lora_name
        if req.logprobs:
            params.logprobs = req.top_logprobs or 0
        self._validate(params)
        await self._add_structured_output(req, params)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            prompt = render_chat_prompt(
                messages, self.engine.engine.tokenizer, self.settings.chat_template
            )
        except Exception as exc:  # a template that rejects the conversation
            raise APIError(
                400, f"messages: the chat template failed: {exc}", param="messages"
            ) from exc
        return await self._generate(request, req, [prompt], params, chat=True)

    async def _generate(
        self, request: Request, req: _SamplingFields, prompts: list[Any], params: Any, chat: bool
    ) -> Response:
        groups = self._submit_all(prompts, params)
        streams = [s for group in groups for s in group]
        try:
            firsts = await self._until_disconnect(
                request, gather_or_cancel([self._next(s) for s in streams])
            )
        except BaseException:
            for s in streams:
                s.abort()
            raise
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        if req.stream:
            events = event_stream(
                params.lora_name or self.settings.model_name,
                rid,
                streams,
                firsts,
                req.stop_list(),
                include_usage,
                chat,
                num_samples=params.num_samples,
            )
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            finals = await self._until_disconnect(
                request,
                gather_or_cancel([self._last(s, f) for s, f in zip(streams, firsts, strict=True)]),
            )
        finally:
            for s in streams:
                s.abort()
        return JSONResponse(dump(self._body(req, rid, finals, params, prompts, chat)))

    def _body(
        self,
        req: _SamplingFields,
        rid: str,
        finals: list[Any],
        params: Any,
        prompts: list[Any],
        chat: bool,
    ) -> BaseModel:
        """The non-streamed response: ``n`` choices per prompt (index ``i * n + j``)."""
        tokenizer = self.engine.engine.tokenizer
        echo = bool(getattr(req, "echo", False))
        usage = Usage()
        k = params.num_samples
        chosen: list[Any] = []
        for i in range(len(prompts)):
            group = finals[i * k : (i + 1) * k]
            usage.add(len(group[0].prompt_token_ids), 0)
            for out in group:
                usage.add(0, len(out.output_token_ids))
            chosen += select_best(group, params.n) if k > params.n else group
        choices: list[Any] = []
        for index, out in enumerate(chosen):
            text = truncate_at_stop(out.text, req.stop_list())[0]
            reason = finish_reason(out.finish_reason)
            if chat:
                lp = chat_logprobs(tokenizer, out) if params.logprobs is not None else None
                message = ResponseMessage(content=text)
                choices.append(
                    ChatChoice(index=index, message=message, logprobs=lp, finish_reason=reason)
                )
                continue
            prefix = ""
            if echo:
                prompt = prompts[index // params.n]
                prefix = prompt if isinstance(prompt, str) else decode(tokenizer, prompt)
            lpc = None
            if params.logprobs is not None:
                lpc = completion_logprobs(tokenizer, out, echo)
            choices.append(
                CompletionChoice(
                    index=index, text=prefix + text, logprobs=lpc, finish_reason=reason
                )
            )
        name = params.lora_name or self.settings.model_name
        if chat:
            return ChatCompletionResponse(id=rid, model=name, choices=choices, usage=usage)
        return CompletionResponse(id=rid, model=name, choices=choices, usage=usage)

    # ---- helpers --------------------------------------------------------------------------

    def _submit_all(self, prompts: list[Any], params: Any) -> list[list[RequestStream]]:
        """One list of sample streams per prompt."""
        groups: list[list[RequestStream]] = []
        try:
            for prompt in prompts:
                groups.append(self.engine.submit_samples(prompt, params))
        except BaseException as exc:
            for group in groups:
                for s in group:
                    s.abort()
            raise api_error_from(exc) from exc
        return groups

    @staticmethod
    async def _next(stream: RequestStream) -> Any:
        try:
            return await stream.__anext__()
        except (ValueError, EngineDeadError, RequestFailedError) as exc:
            raise api_error_from(exc) from exc

    @staticmethod
    async def _last(stream: RequestStream, first: Any) -> Any:
        out = first
        while not out.finished:
            out = await OpenAIServing._next(stream)
        return out

    async def _until_disconnect(self, request: Request, work: Awaitable[Any]) -> Any:
        """Await ``work``, cancelling it (and raising _ClientGone) if the client leaves."""
        task = asyncio.ensure_future(work)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    raise _ClientGone()
        finally:
            if not task.done():
                task.cancel()

    def _check_auth(self, request: Request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), key.encode()
        ):
            message = (
                "Incorrect API key provided."
                if header
                else "Missing API key: send 'Authorization: Bearer <key>'."
            )
            raise APIError(
                401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}
            )

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.settings.model_name:
            raise APIError(
                404,
                f"The model {model!r} does not exist; this server serves {self.settings.model_name!r}.",
                param="model",
                code="model_not_found",
            )

    async def _read_json(self, request: Request) -> Any:
        s = self.settings
        return await read_json_body(request, s.max_request_bytes, s.body_timeout_s)

    @staticmethod
    def _parse(model: type[M], data: Any) -> M:
        if not isinstance(data, dict):
            raise APIError(400, f"the JSON body must be an object, got {type(data).__name__}")
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            raise from_validation_error(exc) from exc

    def _sampling_params(
        self, req: _SamplingFields, max_tokens: int, param: str, explicit: bool = True
    ) -> Any:
        """SamplingParams of ``req`` (validate with :meth:`_validate` after adjusting).

        A ``max_tokens`` the client sent must fit the context with the prompt (400
        otherwise, as vLLM); the server's default only runs up to the context."""
        from shardspeed.inference.fastgen.sampling_params import SamplingParams

        limit = self.settings.max_tokens_limit
        if max_tokens > limit:
            raise APIError(
                400,
                f"{param}={max_tokens} exceeds this server's limit of {limit}; send {param} <= {limit}.",
                param=param,
            )
        params = SamplingParams(
            max_new_tokens=max_tokens,
            temperature=0.0 if req.temperature < 1e-5 else req.temperature,
            top_k=req.top_k,
            top_p=req.top_p,
            repetition_penalty=req.repetition_penalty,
            seed=req.seed,
            stop=req.stop_list(),
            ignore_eos=req.ignore_eos,
            n=req.n,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            min_tokens=req.min_tokens,
            logit_bias=req.logit_bias_ids(),
            truncate=not explicit,
        )
        return params

    async def _add_structured_output(self, req: _SamplingFields, params: Any) -> None:
        """Set ``params.structured_output`` from ``response_format`` / ``guided_*`` and
        compile its grammar off the event loop (the engine thread then finds it cached);
        a malformed field or one that does not compile is a 400 naming it."""
        try:
            constraint = req.structured_output()
        except StructuredOutputError as exc:
            raise APIError(400, str(exc), param=exc.param) from exc
        if constraint is None:
            return
        param, params.structured_output = constraint
        guides = getattr(self.engine.engine, "guides", None)
        if guides is None:
            raise APIError(400, f"{param}: this engine does not support structured output")
        try:
            await asyncio.to_thread(guides.new_guide, params.structured_output)
        except (ValueError, ImportError) as exc:
            raise APIError(400, f"{param}: {exc}", param=param) from exc

    @staticmethod
    def _validate(params: Any) -> None:
        try:
            params.validate()
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc


def create_app(
    engine: AsyncEngine, settings: ServerSettings, own_engine: bool = True, embedder: Any = None
) -> Starlette:
    """The ASGI app serving ``engine`` (and ``/v1/embeddings`` with ``embedder``, an
    :class:`~.embedder.Embedder`); starts the engine on startup and, if ``own_engine``,
    shuts it down on shutdown."""
    serving = OpenAIServing(engine, settings, embedder)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            if own_engine:
                await asyncio.to_thread(engine.shutdown)

    async def on_api_error(request: Request, exc: Exception) -> Response:
        return api_error_from(exc).to_response()

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return APIError(exc.status_code, str(exc.detail), code=str(exc.status_code)).to_response()

    async def on_client_gone(request: Request, exc: Exception) -> Response:
        return Response(status_code=499)

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return api_error_from(exc).to_response()

    routes = [
        Route("/v1/completions", serving.completions, methods=["POST"]),
        Route("/v1/chat/completions", serving.chat_completions, methods=["POST"]),
        Route("/v1/embeddings", serving.embeddings, methods=["POST"]),
        Route("/v1/models", serving.models, methods=["GET"]),
        Route("/v1/load_lora_adapter", partial(load_lora_adapter, serving), methods=["POST"]),
        Route("/v1/unload_lora_adapter", partial(unload_lora_adapter, serving), methods=["POST"]),
        Route("/health", serving.health, methods=["GET"]),
        Route("/metrics", serving.metrics, methods=["GET"]),
    ]
    handlers = {
        APIError: on_api_error,
        HTTPException: on_http_error,
        _ClientGone: on_client_gone,
        ClientDisconnect: on_client_gone,  # left (or was cut off) while sending its body
        Exception: on_unexpected,
    }
    return Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)  # type: ignore[arg-type]
