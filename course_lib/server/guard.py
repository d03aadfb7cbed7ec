"""The checks every request passes before a handler reads its body: API key, route switch, size.

In this order: the API key (401 missing, 403 wrong; ``/health`` is exempt, so a load
balancer can probe without a secret), then the weight-route switch (403
``route_disabled`` unless the server started with ``--allow-weight-update``), then the
body size (413 from the ``Content-Length`` header alone, or, for a chunked body, as soon
as the bytes read so far pass the limit: an oversize body is never read whole).
"""
from __future__ import annotations

import hmac

from course_lib.server.errors import ApiError

# Routes that change weights, versions or the serving state an RL trainer drives.
# /flush_cache stays open (PROTOCOL.md); reads (versions, weights by name) are open too.
WEIGHT_ROUTES = frozenset({
    "/pause_generation", "/continue_generation", "/update_weights_from_disk", "/update_weights_from_tensor",
    "/init_weights_update_group", "/update_weights_from_distributed", "/destroy_weights_update_group",
    "/update_weight_version", "/register_weight_buffers", "/update_weights_from_registered",
    "/unregister_weight_buffers", "/sync_weights",
})
OPEN_ROUTES = frozenset({"/health"})


class GuardMiddleware:
    """Pure ASGI middleware, so it can refuse before the body is read."""

    def __init__(self, app, api_key: str | None, allow_weight_update: bool, max_body_bytes: int):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.allow_weight_update = allow_weight_update
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])  # lower-case names, as ASGI promises
        error = self.check(scope["path"], headers)
        if error is not None:
            return await error.response()(scope, receive, send)
        length = headers.get(b"content-length")
        if length is None and scope["method"] in ("POST", "PUT", "PATCH"):
            body, error = await self._read_bounded(receive)
            if error is not None:
                return await error.response()(scope, receive, send)
            receive = _replay(body, receive)
        await self.app(scope, receive, send)

    def check(self, path: str, headers: dict[bytes, bytes]) -> ApiError | None:
        """The first refusal for this request, or None: the route rules, then the body size."""
        error = self.route_rules(path, headers)
        if error is not None:
            return error
        length = headers.get(b"content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                return ApiError(400, "bad_request", f"Content-Length {length.decode(errors='replace')!r} "
                                                    f"is not a number")
            if n > self.max_body_bytes:
                return self._too_large(n)
        return None

    def route_rules(self, path: str, headers: dict[bytes, bytes]) -> ApiError | None:
        """Who may call ``path``: the ``ApiError`` to answer with, or None to let it through.

        ``self.api_key`` is the server's key as bytes (None: no key needed);
        ``self.allow_weight_update`` is the ``--allow-weight-update`` switch; ``headers``
        maps lower-case header names to values, both bytes (``{b"x-api-key": b"..."}``).
        Nothing is read but these; nothing is changed. In this order:

        1. The API key, when the server has one, on every route except those in
           ``OPEN_ROUTES`` (``/health``). The key presented is the token of
           ``Authorization: Bearer <token>`` (the scheme in any letter case, the token
           stripped of spaces) or, when that header is absent or not a non-empty Bearer
           token, the stripped value of ``X-API-Key``. No key presented (or an empty one):
           ``ApiError(401, "unauthorized", <message naming both headers>)``. A key that is
           not the server's: ``ApiError(403, "forbidden", "wrong API key")``, compared with
           ``hmac.compare_digest`` (constant time, so no prefix of the key leaks by timing).
        2. The weight routes (``WEIGHT_ROUTES``) when the server started without
           ``--allow-weight-update``: ``ApiError(403, "route_disabled", <message naming
           the path and --allow-weight-update>)``. ``/flush_cache`` is not one of them.

        Every refusal is not retryable (the default of ``ApiError``).
        """
        # BEGIN EXERCISE ch07.route_rules
        if self.api_key is not None and path not in OPEN_ROUTES:
            key = None
            auth = headers.get(b"authorization")
            if auth is not None:
                scheme, _, token = auth.partition(b" ")
                if scheme.lower() == b"bearer" and token.strip():
                    key = token.strip()
            if key is None:
                fallback = headers.get(b"x-api-key", b"").strip()
                key = fallback or None
            if key is None:
                return ApiError(401, "unauthorized", "missing API key: send 'Authorization: Bearer <key>' "
                                                     "or 'X-API-Key: <key>'")
            if not hmac.compare_digest(key, self.api_key):
                return ApiError(403, "forbidden", "wrong API key")
        if path in WEIGHT_ROUTES and not self.allow_weight_update:
            return ApiError(403, "route_disabled", f"{path} is disabled: start the server with "
                                                   f"--allow-weight-update to enable weight routes")
        return None
        # END EXERCISE

    def _too_large(self, n: int | None) -> ApiError:
        size = f"{n} bytes" if n is not None else "more bytes than that"
        return ApiError(413, "payload_too_large", f"request body is {size}; the limit is "
                                                  f"{self.max_body_bytes} bytes (--max-body-mb)")

    async def _read_bounded(self, receive) -> tuple[bytes, ApiError | None]:
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_body_bytes:
                return b"", self._too_large(None)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks), None


def _replay(body: bytes, receive):
    """A ``receive`` that yields the already-read body once, then defers to the real one."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay
