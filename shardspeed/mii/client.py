"""``mii.serve`` / ``mii.client``: a ShardSpeed server in a background thread and an
MII-shaped client that calls it over HTTP (``/v1/completions``)."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from shardspeed.inference.serving.client import Client
from shardspeed.inference.serving.pipeline import Response, resolve_temperature
from shardspeed.mii.kwargs import EXTRA_KWARGS, mii_generation_kwargs


@dataclass
class _Deployment:
    server: Any  # ServerThread
    tokenizer: Any
    max_seq_len: int
    api_key: str | None


_deployments: dict[str, _Deployment] = {}  # deployments started by serve() in this process
_lock = threading.Lock()


class MIIClient:
    """Sends generation requests to a ShardSpeed server (``mii.backend.MIIClient``'s shape).

    ``generate(prompts, **kwargs)`` returns one :class:`Response` per prompt with
    ``generated_text``, ``prompt_length``, ``generated_length`` and ``finish_reason``
    (``token_ids`` and timings are empty: HTTP answers carry text and counts only).
    """

    def __init__(
        self, base_url: str, deployment_name: str | None = None, api_key: str | None = None
    ) -> None:
        self.base_url = base_url
        self.deployment_name = deployment_name
        self._client = Client(base_url, api_key=api_key)

    def __call__(self, *args: Any, **kwargs: Any) -> list[Response]:
        return self.generate(*args, **kwargs)

    def generate(
        self,
        prompts: str | Sequence[str],
        streaming_fn: Callable[[list[Response]], None] | None = None,
        **generate_kwargs: Any,
    ) -> list[Response]:
        """Generate for ``prompts`` with MII's keywords; with ``streaming_fn`` (one prompt
        only, as MII) each text piece is passed to it as ``[Response]`` while generating."""
        prompt_list = [prompts] if isinstance(prompts, str) else list(prompts)
        if not prompt_list or not all(isinstance(p, str) for p in prompt_list):
            raise ValueError("MIIClient.generate prompts must be a str or a non-empty list of str.")
        gen = mii_generation_kwargs(generate_kwargs, "MIIClient.generate")
        if streaming_fn is not None:
            if len(prompt_list) > 1:
                raise ValueError("MIIClient streaming takes a single prompt, as MII's does.")
            return [self._stream(prompt_list[0], gen, streaming_fn)]
        with ThreadPoolExecutor(max_workers=min(len(prompt_list), 64)) as pool:
            return list(pool.map(lambda p: self._complete(p, gen), prompt_list))

    def _body(self, prompt: str, gen: dict[str, Any]) -> dict[str, Any]:
        body: dict[str, Any] = {
            "temperature": resolve_temperature(gen["do_sample"], gen.get("temperature")),
            "min_tokens": gen["min_new_tokens"],
            "echo": bool(gen.get("return_full_text", False)),
        }
        for key in ("top_p", "top_k", "stop", "ignore_eos", *sorted(EXTRA_KWARGS)):
            if gen.get(key) is not None:
                body[key] = gen[key]
        if gen.get("max_length") is not None:
            if gen.get("max_new_tokens") is not None:
                raise ValueError("pass max_length or max_new_tokens, not both.")
            body["max_tokens"] = gen["max_length"] - self._prompt_length(prompt)
        elif gen.get("max_new_tokens") is not None:
            body["max_tokens"] = gen["max_new_tokens"]
        else:  # MII's default: up to the context (the server stops there)
            body["max_tokens"] = self._max_seq_len() - self._prompt_length(prompt)
        if body["max_tokens"] < 1:
            raise ValueError(
                f"max_length={gen.get('max_length')} leaves no room after the prompt "
                f"({self._prompt_length(prompt)} tokens); raise max_length."
            )
        return body

    def _complete(self, prompt: str, gen: dict[str, Any]) -> Response:
        answer = self._client.complete(prompt, **self._body(prompt, gen))
        choice, usage = answer["choices"][0], answer["usage"]
        return Response(
            generated_text=choice["text"],
            prompt=prompt,
            token_ids=[],
            finish_reason=choice["finish_reason"],
            prompt_length=usage["prompt_tokens"],
            generated_length=usage["completion_tokens"],
            ttft=None,
            tpot=None,
            latency=None,
            request_id=answer["id"],
        )

    def _stream(
        self, prompt: str, gen: dict[str, Any], callback: Callable[[list[Response]], None]
    ) -> Response:
        body = self._body(prompt, gen)
        if body.pop("echo"):
            raise ValueError("return_full_text=True cannot be streamed; drop it or stream=False.")
        max_tokens = body.pop("max_tokens")
        pieces = []
        for delta in self._client.stream_complete(prompt, max_tokens, **body):
            pieces.append(delta)
            callback([self._piece(prompt, delta)])
        return self._piece(prompt, "".join(pieces))

    def _piece(self, prompt: str, text: str) -> Response:
        return Response(text, prompt, [], None, 0, 0, None, None, None, "")

    def _deployment(self) -> _Deployment:
        with _lock:
            dep = _deployments.get(self.deployment_name or "")
        if dep is None:
            raise ValueError(
                "max_length (and MII's default of generating up to the context) needs the "
                "model's tokenizer, which only clients of a serve() deployment in this process "
                "have; pass max_new_tokens instead."
            )
        return dep

    def _prompt_length(self, prompt: str) -> int:
        return len(self._deployment().tokenizer.encode(prompt))

    def _max_seq_len(self) -> int:
        return self._deployment().max_seq_len

    def terminate_server(self) -> None:
        """Stop the server of this deployment (only one started by ``serve`` in this process)."""
        terminate_server(self.deployment_name or self.base_url)
        self._client.close()


def serve(
    model_name_or_path: Any,
    deployment_name: str | None = None,
    tokenizer: Any = None,
    host: str = "127.0.0.1",
    port: int = 0,
    tensor_parallel: int = 1,
    replica_num: int = 1,
    **engine_config: Any,
) -> MIIClient:
    """Start ShardSpeed's OpenAI-compatible server for the model in a background thread
    and return a client; ``deployment_name`` (default: the model's name) lets
    :func:`client` find it. The server lives as long as this process (MII's outlives it).
    ``engine_config`` takes :class:`EngineConfig` fields and :func:`build_app`'s server
    options (``api_key``, ``max_queue``, ``max_tokens_limit`` - default: the context).
    """
    from shardspeed.inference.fastgen.engine import InferenceEngine
    from shardspeed.inference.serving.server import ServerThread, build_app, default_model_name

    for name, value in (("tensor_parallel", tensor_parallel), ("replica_num", replica_num)):
        if value != 1:
            raise ValueError(
                f"mii.serve({name}={value!r}) is not supported: one engine serves on one "
                f"device; pass {name}=1."
            )
    name = deployment_name or default_model_name(model_name_or_path)
    with _lock:
        if name in _deployments:
            raise ValueError(
                f"deployment_name={name!r} is already serving; terminate it first or pick "
                "another deployment_name."
            )
    server_keys = set(inspect.signature(build_app).parameters) - {"model_or_path", "tokenizer"}
    server_options = {k: engine_config.pop(k) for k in list(engine_config) if k in server_keys}
    if isinstance(model_name_or_path, InferenceEngine):
        engine = model_name_or_path
        if tokenizer is not None or engine_config:
            raise ValueError(
                "mii.serve got an InferenceEngine together with tokenizer/engine options "
                f"{sorted(engine_config) or ['tokenizer']}; configure the engine when you build it."
            )
    else:
        engine = InferenceEngine.from_pretrained(
            model_name_or_path, tokenizer=tokenizer, **engine_config
        )
    # MII generates up to the context by default: let requests ask for that much.
    server_options.setdefault("max_tokens_limit", engine.max_seq_len)
    app = build_app(engine, model_name=name, **server_options)
    server = ServerThread(app, host=host, port=port).start()
    with _lock:
        _deployments[name] = _Deployment(
            server, engine.tokenizer, engine.max_seq_len, server_options.get("api_key")
        )
    return MIIClient(server.base_url, deployment_name=name, api_key=server_options.get("api_key"))


def client(model_or_deployment_name: str, api_key: str | None = None) -> MIIClient:
    """A client of a deployment started by :func:`serve` in this process, or of any
    ShardSpeed / OpenAI-compatible server given by URL (``"http://host:port"``)."""
    if model_or_deployment_name.startswith(("http://", "https://")):
        return MIIClient(model_or_deployment_name, api_key=api_key)
    with _lock:
        dep = _deployments.get(model_or_deployment_name)
        known = sorted(_deployments)
    if dep is None:
        raise ValueError(
            f"no deployment named {model_or_deployment_name!r} in this process (running: "
            f"{known}); start it with mii.serve(..., deployment_name=...) or pass the "
            "server's URL."
        )
    return MIIClient(dep.server.base_url, model_or_deployment_name, api_key or dep.api_key)


def terminate_server(model_or_deployment_name: str) -> None:
    """Stop the server of a deployment started by :func:`serve` in this process."""
    with _lock:
        dep = _deployments.pop(model_or_deployment_name, None)
    if dep is None:
        raise ValueError(
            f"no deployment named {model_or_deployment_name!r} was started by mii.serve in "
            "this process; a server started elsewhere must be stopped where it runs."
        )
    dep.server.stop()
