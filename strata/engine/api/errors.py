"""API errors: one exception type, the OpenAI and Anthropic error shapes, one middleware.

Every failure leaves the server as JSON with a one-line message; tracebacks go to the log only.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

from aiohttp import web

from strata.engine.api.keys import LIFECYCLE_KEY, MAX_REQUEST_BYTES
from strata.engine.api.redact import redact_text
from strata.engine.protocol import Error as ErrorEvent
from strata.engine.service.error_codes import http_status, retry_after_s
from strata.engine.service.facade import ServiceError

log = logging.getLogger(__name__)

# OpenAI's error "type" per HTTP status; llama.cpp uses the same words.
_OPENAI_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error",
    413: "invalid_request_error", 429: "rate_limit_error", 501: "not_supported_error",
    503: "unavailable_error", 507: "server_error",
}
CONTEXT_EXCEEDED = "context_length_exceeded"  # OpenAI's code for a prompt past the context
# Anthropic's error "type" per HTTP status (docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error",
    413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
}
# A command that outlived its timeout: the engine is being dealt with; retry after this.
TIMEOUT_RETRY_AFTER_S = retry_after_s("engine_timeout")


class ApiError(Exception):
    """A request failure with its HTTP status, a short machine code and a one-line message."""

    def __init__(self, status: int, message: str, code: str = "invalid_request",
                 *, param: str | None = None, retry_after_s: float | None = None,
                 details: dict[str, Any] | None = None,
                 fields: dict[str, Any] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s
        self.details = details  # Anthropic's error.details, which its SDK branches on
        self.fields = fields  # more keys of an OpenAI-shaped error (llama-server's)


def bad_request(message: str, *, param: str | None = None,
                code: str = "invalid_request") -> ApiError:
    """A 400 for a request the client must fix."""
    return ApiError(400, message, code, param=param)


def from_service_error(exc: ServiceError) -> ApiError:
    """Map the service's exception to an ApiError with the same status and code."""
    return ApiError(exc.status, exc.message, exc.code, retry_after_s=exc.retry_after_s)


def from_error_event(event: ErrorEvent) -> ApiError:
    """Map an engine Error event to an ApiError (unknown codes are server errors)."""
    return ApiError(http_status(event.code), event.message or f"the engine failed ({event.code})",
                    event.code, retry_after_s=retry_after_s(event.code))


def is_anthropic_path(path: str) -> bool:
    """Routes that answer errors in Anthropic's shape."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def is_ollama_path(path: str) -> bool:
    """Routes that answer errors in Ollama's shape: {"error": "message"}."""
    return path.startswith("/api/")


def error_body(error: ApiError, *, anthropic: bool, ollama: bool = False) -> dict[str, Any]:
    """The JSON body for an error in the shape the route's clients expect.

    Server paths in the message become file names: the client sees 'chat.bin', not where the
    server keeps it.
    """
    message = redact_text(error.message)
    if ollama:
        return {"error": message}
    if anthropic:
        kind = _ANTHROPIC_TYPES.get(error.status, "api_error")
        body: dict[str, Any] = {"type": kind, "message": message}
        if error.details is not None:
            body["details"] = error.details
        return {"type": "error", "error": body}
    # llama-server's type for a prompt past the context; the code stays OpenAI's.
    kind = "exceed_context_size_error" if error.code == CONTEXT_EXCEEDED else \
        _OPENAI_TYPES.get(error.status, "server_error")
    return {"error": {"message": message, "type": kind, "param": error.param,
                      "code": error.code, **(error.fields or {})}}


def error_response(error: ApiError, *, anthropic: bool, ollama: bool = False) -> web.Response:
    """A JSON error response, with Retry-After when the service said when to retry."""
    headers = {}
    if error.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after_s)))
    return web.json_response(error_body(error, anthropic=anthropic, ollama=ollama),
                             status=error.status, headers=headers)


def _from_http_exception(exc: web.HTTPException, request: web.Request) -> ApiError:
    if exc.status == 404:
        return ApiError(404, f"no route {request.method} {request.path}; see /v1/models, "
                        "/v1/chat/completions, /v1/messages", "not_found")
    if exc.status == 405:
        return ApiError(405, f"method {request.method} is not allowed on {request.path}",
                        "method_not_allowed")
    if exc.status == 413:
        limit_mib = MAX_REQUEST_BYTES / (1024 * 1024)
        return ApiError(413, f"request body is larger than this server's {limit_mib:g} MiB "
                        "limit; send a shorter request", "request_too_large")
    return ApiError(exc.status, exc.reason or "request failed", "http_error")


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Turn every exception a handler raises into a JSON error; log unexpected ones."""
    shape = {"anthropic": is_anthropic_path(request.path),
             "ollama": is_ollama_path(request.path)}
    started_s = time.monotonic()
    try:
        return await handler(request)
    except asyncio.CancelledError:
        # A client that goes away cancels its handler (listen.py), and so does the server's
        # shutdown: no answer is written, so aiohttp's access log has no line for either;
        # this one says which it was.
        cause = ("the server shut down" if request.config_dict[LIFECYCLE_KEY].stopping
                 else "the client went away")
        log.info("%s %s: %s after %.1f s; its request was stopped", request.method,
                 request.path, cause, time.monotonic() - started_s)
        raise
    except ApiError as exc:
        return error_response(exc, **shape)
    except ServiceError as exc:
        return error_response(from_service_error(exc), **shape)
    except web.HTTPException as exc:
        if exc.status < 400:  # redirects and the like are answers, not errors
            raise
        return error_response(_from_http_exception(exc, request), **shape)
    except TimeoutError:
        # An engine command past its timeout: the server's fault, and worth a retry.
        log.warning("%s %s: the engine did not answer in time", request.method, request.path)
        error = ApiError(503, "the engine did not answer in time; it is busy or stuck, retry "
                         "shortly", "engine_timeout", retry_after_s=TIMEOUT_RETRY_AFTER_S)
        return error_response(error, **shape)
    except RecursionError:
        # The body parser refuses deep nesting (validation.MAX_JSON_DEPTH); this is the net
        # under it: a request nested past what some later walk can take is still the client's.
        log.warning("%s %s: the request is nested too deeply", request.method, request.path,
                    exc_info=True)
        return error_response(ApiError(400, "the request is nested too deeply; send a "
                                       "flatter JSON object", "too_deep"), **shape)
    except Exception:
        log.exception("unexpected error in %s %s", request.method, request.path)
        error = ApiError(500, "internal server error; the details are in the server log",
                         "internal")
        return error_response(error, **shape)
