"""One error shape for every failure the server reports, and how engine errors map onto it.

Every error body is ``{"error": {"code", "message", "retryable", "status"}}`` (the GR
server's strict shape), whether it comes from the engine, from validation, from the
auth and size guard, or from FastAPI itself (unknown route, malformed JSON). ``code`` is a
stable word a client can switch on; ``retryable`` says whether the same request may
succeed later unchanged (503 ``paused`` does, a 400 for a bad payload never does).
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from course_lib.engine.pause import EngineBusyError, EnginePausedError
from course_lib.weights.commit.audit import AddressMovedError
from course_lib.weights.transports.safe_pickle import UnsafePickleError

log = logging.getLogger("course_lib.server")

# Starlette's own errors (unknown route, wrong method) get a code from their status.
CODES = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "method_not_allowed",
         409: "conflict", 413: "payload_too_large", 422: "invalid_request", 500: "internal", 503: "unavailable"}


class ApiError(Exception):
    """An error the server answers with ``status`` and the one error shape."""

    def __init__(self, status: int, code: str, message: str, retryable: bool = False):
        super().__init__(message)
        self.status, self.code, self.message, self.retryable = status, code, message, retryable

    def body(self) -> dict:
        return {"error": {"code": self.code, "message": self.message, "retryable": self.retryable,
                          "status": self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def from_engine_exception(exc: BaseException, engine) -> ApiError:
    """The ``ApiError`` an engine call's exception ``exc`` is answered with (engine thread).

    The status, the stable ``code`` and ``retryable`` by what went wrong, first match wins:

    - already an ``ApiError``: itself, unchanged;
    - ``EnginePausedError`` (new work while paused): 503 ``paused``, retryable (it works
      after ``/continue_generation``);
    - ``EngineBusyError`` (an update while unpaused with requests in flight): 409 ``conflict``;
    - ``UnsafePickleError`` (a payload outside the unpickling allowlist): 400 ``unsafe_payload``;
    - ``AddressMovedError`` (the audit found moved memory): 500 ``address_moved``, the
      message ending in "the engine refuses work until restarted";
    - ``TimeoutError`` (a wait-mode drain gave up before changing anything): 504
      ``timeout``, retryable;
    - any other ``ValueError`` (an update refused before any write: nothing changed):
      400 ``bad_request``;
    - anything else while the engine is unhealthy (its ``unhealthy`` reason is set): 503
      ``unhealthy`` with that reason in the message;
    - anything else: 500 ``internal``, and the module's logger records it with its
      traceback at error level (an operator must be able to find it).

    Messages carry ``str(exc)``; retryable is False unless stated. Pure: it changes nothing.
    """
    # BEGIN EXERCISE ch07.error_status
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, EnginePausedError):
        return ApiError(503, "paused", str(exc), retryable=True)
    if isinstance(exc, EngineBusyError):
        return ApiError(409, "conflict", str(exc))
    if isinstance(exc, UnsafePickleError):
        return ApiError(400, "unsafe_payload", str(exc))
    if isinstance(exc, AddressMovedError):
        return ApiError(500, "address_moved", f"{exc}; the engine refuses work until restarted")
    if isinstance(exc, TimeoutError):
        return ApiError(504, "timeout", str(exc), retryable=True)
    if isinstance(exc, ValueError):  # UpdateError, CheckpointError, BucketError: nothing was changed
        return ApiError(400, "bad_request", str(exc))
    if getattr(engine, "unhealthy", None):
        return ApiError(503, "unhealthy", f"engine is unhealthy and refuses work until restarted: "
                                          f"{engine.unhealthy}")
    log.error("engine call failed", exc_info=exc)
    return ApiError(500, "internal", f"{type(exc).__name__}: {exc}")
    # END EXERCISE


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


def install_handlers(app: FastAPI) -> None:
    """Route FastAPI's and Starlette's own errors through the one error shape."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        if any(err.get("type") == "json_invalid" for err in exc.errors()):
            return ApiError(400, "bad_json", f"request body is not valid JSON ({_validation_message(exc)})").response()
        return ApiError(422, "invalid_request", _validation_message(exc)).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        code = CODES.get(exc.status_code, "http_error")
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.url.path}"
        return ApiError(exc.status_code, code, message).response()

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        log.error("unhandled error on %s", request.url.path, exc_info=exc)
        return ApiError(500, "internal", f"{type(exc).__name__}: {exc}").response()
