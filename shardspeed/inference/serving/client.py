"""A small synchronous client for the ShardSpeed (or any OpenAI-compatible) server.

::

    with Client("http://127.0.0.1:8000") as client:
        print(client.complete("DeepSpeed is", max_tokens=32)["choices"][0]["text"])
        for delta in client.stream_complete("Once upon a time", max_tokens=32):
            print(delta, end="")
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx


class APIStatusError(RuntimeError):
    """The server answered with an error status; fields mirror the OpenAI error body."""

    def __init__(
        self,
        status_code: int,
        message: str,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(f"HTTP {status_code}: {message}")
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code


class Client:
    """Calls ``/v1/completions`` and ``/v1/chat/completions``.

    ``base_url`` may end with or without ``/v1``. Generation keywords left as None are
    not sent (the server's defaults apply); extra keywords (``top_k``, ``seed``,
    ``ignore_eos``, ...) are passed through in the request body.
    """

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        api_key: str | None = None,
        model: str | None = None,
        timeout: float = 600.0,
    ) -> None:
        base = base_url.rstrip("/")
        base = base.removesuffix("/v1")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model = model
        self._http = httpx.Client(base_url=base, headers=headers, timeout=timeout)

    # ---- non-streaming --------------------------------------------------------------------

    def complete(
        self, prompt: str | list[str] | list[int], max_tokens: int | None = None, **kwargs: Any
    ) -> dict[str, Any]:
        """POST /v1/completions; returns the response body (``choices[i]["text"]``)."""
        body = self._body(prompt=prompt, max_tokens=max_tokens, **kwargs)
        return self._post("/v1/completions", body)

    def chat(
        self, messages: list[dict[str, Any]], max_tokens: int | None = None, **kwargs: Any
    ) -> dict[str, Any]:
        """POST /v1/chat/completions; returns the body (``choices[0]["message"]["content"]``)."""
        body = self._body(messages=messages, max_tokens=max_tokens, **kwargs)
        return self._post("/v1/chat/completions", body)

    # ---- streaming ------------------------------------------------------------------------

    def stream_complete(
        self, prompt: str | list[int], max_tokens: int | None = None, **kwargs: Any
    ) -> Iterator[str]:
        """Stream a completion; yields text deltas as the server sends them."""
        body = self._body(prompt=prompt, max_tokens=max_tokens, stream=True, **kwargs)
        for event in self.stream_events("/v1/completions", body):
            for choice in event.get("choices", []):
                if choice.get("text"):
                    yield choice["text"]

    def stream_chat(
        self, messages: list[dict[str, Any]], max_tokens: int | None = None, **kwargs: Any
    ) -> Iterator[str]:
        """Stream a chat completion; yields content deltas."""
        body = self._body(messages=messages, max_tokens=max_tokens, stream=True, **kwargs)
        for event in self.stream_events("/v1/chat/completions", body):
            for choice in event.get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content:
                    yield content

    def stream_events(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """POST ``body`` and yield each server-sent ``data:`` event as a dict until ``[DONE]``."""
        with self._http.stream("POST", path, json=body) as response:
            if response.status_code >= 400:
                response.read()
                raise _status_error(response)
            for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:
                    err = event["error"]
                    raise APIStatusError(
                        500,
                        err.get("message", ""),
                        err.get("type"),
                        err.get("param"),
                        err.get("code"),
                    )
                yield event

    # ---- other routes ---------------------------------------------------------------------

    def models(self) -> list[str]:
        """The model ids the server reports."""
        response = self._http.get("/v1/models")
        if response.status_code >= 400:
            raise _status_error(response)
        return [m["id"] for m in response.json()["data"]]

    def health(self) -> bool:
        """True when ``/health`` answers 200."""
        try:
            return self._http.get("/health").status_code == 200
        except httpx.HTTPError:
            return False

    def metrics(self) -> str:
        """The Prometheus text of ``/metrics``."""
        return self._http.get("/metrics").text

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- helpers --------------------------------------------------------------------------

    def _body(self, **fields: Any) -> dict[str, Any]:
        body = {k: v for k, v in fields.items() if v is not None}
        if self.model is not None:
            body.setdefault("model", self.model)
        return body

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = self._http.post(path, json=body)
        if response.status_code >= 400:
            raise _status_error(response)
        return response.json()


def _status_error(response: httpx.Response) -> APIStatusError:
    try:
        err = response.json()["error"]
        return APIStatusError(
            response.status_code,
            err.get("message", ""),
            err.get("type"),
            err.get("param"),
            err.get("code"),
        )
    except (ValueError, KeyError, TypeError):
        return APIStatusError(response.status_code, response.text)
