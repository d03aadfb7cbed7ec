"""The server's guard and error shape: API key, the weight-route switch, body size, malformed
requests. Each status code has its own test, and every error body has the one shape."""
import asyncio

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from course_lib import Engine  # noqa: E402
from course_lib.server.guard import WEIGHT_ROUTES, GuardMiddleware  # noqa: E402
from course_lib.server.runner import BackgroundServer  # noqa: E402

KEY = "s3cret-key"


@pytest.fixture
def serve(tiny_ckpt):
    """serve(**options) -> a running BackgroundServer on 127.0.0.1; stopped after the test."""
    servers = []

    def start(**options):
        servers.append(BackgroundServer(Engine(tiny_ckpt), **options).start())
        return servers[-1]
    yield start
    for s in servers:
        s.stop()


def assert_error(reply, status: int, code: str, retryable: bool = False) -> dict:
    """The reply is ``status`` with the one error shape and the expected code."""
    assert reply.status_code == status, reply.text
    err = reply.json()["error"]
    assert set(err) == {"code", "message", "retryable", "status"}
    assert (err["code"], err["status"], err["retryable"]) == (code, status, retryable)
    assert err["message"]
    return err


def test_missing_api_key_is_401(serve):
    srv = serve(api_key=KEY)
    err = assert_error(httpx.get(f"{srv.url}/get_weight_version"), 401, "unauthorized")
    assert "Authorization: Bearer" in err["message"]
    assert_error(httpx.post(f"{srv.url}/generate", json={"text": "hi"}), 401, "unauthorized")


def test_wrong_api_key_is_403(serve):
    srv = serve(api_key=KEY)
    assert_error(httpx.get(f"{srv.url}/get_weight_version", headers={"Authorization": "Bearer nope"}),
                 403, "forbidden")
    assert_error(httpx.get(f"{srv.url}/get_weight_version", headers={"X-API-Key": KEY[:-1]}), 403, "forbidden")


def test_right_api_key_in_either_header_and_health_needs_none(serve):
    srv = serve(api_key=KEY)
    for headers in ({"Authorization": f"Bearer {KEY}"}, {"X-API-Key": KEY}):
        assert httpx.get(f"{srv.url}/get_weight_version", headers=headers).json()["weight_version"] == "default"
    assert httpx.get(f"{srv.url}/health").json()["healthy"] is True


def test_weight_routes_are_403_route_disabled_unless_allowed(serve):
    srv = serve(allow_weight_update=False)
    for route in sorted(WEIGHT_ROUTES):
        err = assert_error(httpx.post(f"{srv.url}{route}", json={}), 403, "route_disabled")
        assert "--allow-weight-update" in err["message"]
    # Serving, reading and flushing stay open (PROTOCOL.md: /flush_cache is not a weight route).
    assert httpx.get(f"{srv.url}/flush_cache").json()["success"] is True
    assert httpx.post(f"{srv.url}/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}
                      ).status_code == 200
    assert httpx.get(f"{srv.url}/get_weight_version").status_code == 200


def test_oversize_body_is_413_from_its_content_length(serve):
    srv = serve(max_body_bytes=100_000)
    err = assert_error(httpx.post(f"{srv.url}/generate", json={"text": "x" * 200_000}), 413, "payload_too_large")
    assert "100000" in err["message"]


def test_oversize_chunked_body_is_413(serve):
    srv = serve(max_body_bytes=100_000)

    def chunks():  # no Content-Length: the server counts as it reads
        for _ in range(100):
            yield b"x" * 10_000
    reply = httpx.post(f"{srv.url}/update_weights_from_tensor", content=chunks(),
                       headers={"Content-Type": "application/json"})
    assert_error(reply, 413, "payload_too_large")


def test_chunked_body_stops_being_read_at_the_limit():
    """At the ASGI level: the guard pulls no more chunks once the limit is passed."""
    pulled, sent = [], []

    async def receive():
        pulled.append(1)
        return {"type": "http.request", "body": b"x" * 1000, "more_body": True}  # endless

    async def send(message):
        sent.append(message)

    async def app(scope, receive, send):
        raise AssertionError("an oversize body reached the app")

    guard = GuardMiddleware(app, api_key=None, allow_weight_update=True, max_body_bytes=5_500)
    scope = {"type": "http", "method": "POST", "path": "/generate", "headers": []}
    asyncio.run(guard(scope, receive, send))
    assert len(pulled) == 6  # 6,000 bytes read: just past the limit, then it stopped
    assert sent[0]["status"] == 413


def test_malformed_json_is_400_bad_json(serve):
    srv = serve()
    err = assert_error(httpx.post(f"{srv.url}/generate", content=b'{"text": "hi",',
                                  headers={"Content-Type": "application/json"}), 400, "bad_json")
    assert "JSON" in err["message"]


def test_wrong_field_types_are_422_in_the_same_shape(serve):
    srv = serve()
    err = assert_error(httpx.post(f"{srv.url}/update_weights_from_tensor", json={"serialized_named_tensors": 5}),
                       422, "invalid_request")
    assert "serialized_named_tensors" in err["message"]
    assert_error(httpx.post(f"{srv.url}/get_weights_by_name", json={"truncate_size": 3}), 422, "invalid_request")


def test_unknown_route_and_wrong_method_use_the_shape(serve):
    srv = serve()
    assert_error(httpx.get(f"{srv.url}/no_such_route"), 404, "not_found")
    assert_error(httpx.get(f"{srv.url}/generate"), 405, "method_not_allowed")
