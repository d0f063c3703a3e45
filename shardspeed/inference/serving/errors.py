"""OpenAI-style API errors: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from pydantic import ValidationError
from starlette.responses import JSONResponse

from shardspeed.inference.serving.protocol import ErrorInfo, ErrorResponse


class APIError(Exception):
    """An error the server turns into an HTTP status and an OpenAI-style body."""

    def __init__(
        self,
        status_code: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def to_response(self) -> JSONResponse:
        body = ErrorResponse(
            error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        )
        return JSONResponse(body.model_dump(), status_code=self.status_code, headers=self.headers)


def from_validation_error(exc: ValidationError) -> APIError:
    """A 400 naming the first invalid field, e.g. ``max_tokens: Input should be >= 1``."""
    err = exc.errors()[0]
    param = ".".join(str(p) for p in err.get("loc", ())) or None
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    if err.get("type") == "missing":
        msg = "this field is required"
    text = f"{param}: {msg}" if param else msg
    if "input" in err and err.get("type") != "missing":
        got = repr(err["input"])
        text += f" (got {got if len(got) <= 80 else got[:77] + '...'})"
    return APIError(400, text, param=param, code="invalid_value")


def api_error_from(exc: BaseException) -> APIError:
    """The HTTP error for an exception raised while serving a request."""
    from shardspeed.inference.fastgen.lora import LoRANotFoundError
    from shardspeed.inference.serving.async_engine import (
        EngineDeadError,
        QueueFullError,
        RequestFailedError,
    )

    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFullError):
        return APIError(
            429, str(exc), type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"}
        )
    if isinstance(exc, EngineDeadError):
        return APIError(
            503,
            str(exc),
            type="server_error",
            code="engine_unavailable",
            headers={"Retry-After": "1"},
        )
    if isinstance(exc, RequestFailedError):  # this request only; the engine serves on
        return APIError(500, str(exc), type="server_error", code="request_failed")
    if isinstance(exc, LoRANotFoundError):  # unloaded after the request's model was checked
        return APIError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, ValueError):
        return APIError(400, str(exc))
    return APIError(500, f"internal error: {type(exc).__name__}", type="server_error")
