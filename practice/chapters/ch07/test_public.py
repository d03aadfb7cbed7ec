"""Public tests for chapter 07's exercises (run them: python practice/judge.py test ch07).

ch07.route_rules: ``GuardMiddleware.route_rules`` in course_lib/server/guard.py.
ch07.error_status: ``from_engine_exception`` in course_lib/server/errors.py.
ch07.flush_retry: ``EngineClient.flush_until_done`` in course_lib/server/client.py.
ch07.client_flow: ``EngineClient.sync_weights`` in course_lib/server/client.py.
Every case talks to a real HTTP server on 127.0.0.1 or calls the part directly; each
reports what it expected in words.
"""
import threading
import time

import httpx
import pytest
import torch

from course_lib import Engine
from course_lib.engine.pause import EngineBusyError, EnginePausedError
from course_lib.server.client import EngineClient, EngineError
from course_lib.server.errors import from_engine_exception
from course_lib.server.guard import GuardMiddleware
from course_lib.server.runner import BackgroundServer
from course_lib.testing import assert_hot_equals_cold
from course_lib.weights.checkpoint import CheckpointReader, make_random
from course_lib.weights.transports.safe_pickle import UnsafePickleError

RULES, STATUS, FLUSH, FLOW = (pytest.mark.exercise(f"ch07.{n}")
                              for n in ("route_rules", "error_status", "flush_retry", "client_flow"))
KEY = "public-key"
LONG = {"max_new_tokens": 300, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ch07")
    return make_random(root / "a", "tiny", seed=70), make_random(root / "b", "tiny", seed=71)


@pytest.fixture(scope="module")
def server(ckpts):
    with BackgroundServer(Engine(ckpts[0]), allow_weight_update=True) as srv:
        yield srv


def guard(api_key=None, allow=True):
    return GuardMiddleware(None, api_key=api_key, allow_weight_update=allow, max_body_bytes=1 << 20)


def status_of(error):
    return None if error is None else (error.status, error.code, error.retryable)


def start_long_request(url):
    """A 300-token request on a thread; returns once the server runs it."""
    thread = threading.Thread(target=lambda: httpx.post(f"{url}/generate", json={"text": "long", "sampling_params": LONG},
                                                        timeout=60))
    thread.start()
    with EngineClient(url) as c:
        while c.health()["num_running"] == 0:
            time.sleep(0.002)
    return thread


# ---- ch07.route_rules ---------------------------------------------------------------------

@RULES
def test_route_rules__missing_key_is_401_and_wrong_key_is_403():
    g = guard(api_key=KEY)
    assert status_of(g.route_rules("/generate", {})) == (401, "unauthorized", False), \
        "no key presented: 401 unauthorized"
    assert status_of(g.route_rules("/generate", {b"authorization": b"Bearer nope"})) == (403, "forbidden", False), \
        "a wrong key: 403 forbidden"
    assert g.route_rules("/generate", {b"authorization": f"Bearer {KEY}".encode()}) is None, "the right key passes"


@RULES
def test_route_rules__both_header_forms_and_health_needs_no_key():
    g = guard(api_key=KEY)
    assert g.route_rules("/get_weight_version", {b"x-api-key": KEY.encode()}) is None, "X-API-Key: <key> passes"
    assert g.route_rules("/health", {}) is None, "/health needs no key"


@RULES
def test_route_rules__weight_routes_need_the_switch():
    off = guard(allow=False)
    assert status_of(off.route_rules("/pause_generation", {})) == (403, "route_disabled", False), \
        "a weight route on a server without --allow-weight-update: 403 route_disabled"
    assert off.route_rules("/flush_cache", {}) is None, "/flush_cache is not a weight route"
    assert guard(allow=True).route_rules("/pause_generation", {}) is None, "weight routes pass when allowed"


@RULES
def test_route_rules__a_live_server_answers_401_in_the_error_shape(ckpts):
    with BackgroundServer(Engine(ckpts[0]), api_key=KEY) as srv:
        reply = httpx.get(f"{srv.url}/get_weight_version")
        assert reply.status_code == 401, f"no key over HTTP: 401, got {reply.status_code}"
        assert set(reply.json()["error"]) == {"code", "message", "retryable", "status"}, "the one error shape"
        ok = httpx.get(f"{srv.url}/get_weight_version", headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200, "the right key gets through"


# ---- ch07.error_status --------------------------------------------------------------------

@STATUS
def test_error_status__paused_is_503_retryable_and_busy_is_409():
    assert status_of(from_engine_exception(EnginePausedError("paused"), None)) == (503, "paused", True), \
        "new work while paused: 503 paused, retryable"
    assert status_of(from_engine_exception(EngineBusyError("busy"), None)) == (409, "conflict", False), \
        "an update under running requests: 409 conflict"


@STATUS
def test_error_status__bad_payloads_are_400_with_their_own_code():
    assert status_of(from_engine_exception(UnsafePickleError("exec"), None)) == (400, "unsafe_payload", False), \
        "a payload outside the allowlist: 400 unsafe_payload"
    assert status_of(from_engine_exception(ValueError("shape"), None)) == (400, "bad_request", False), \
        "a refused update: 400 bad_request"


@STATUS
def test_error_status__a_paused_server_answers_503(server):
    with EngineClient(server.url) as c:
        c.pause_generation()
        try:
            reply = httpx.post(f"{server.url}/generate", json={"text": "hi"})
        finally:
            c.continue_generation()
    assert reply.status_code == 503 and reply.json()["error"]["retryable"] is True, \
        f"generate while paused: 503 retryable, got {reply.status_code} {reply.text[:200]}"


# ---- ch07.flush_retry ---------------------------------------------------------------------

@FLUSH
def test_flush_retry__retries_while_a_wait_pause_drains(server):
    thread = start_long_request(server.url)
    with EngineClient(server.url) as c:
        c.pause_generation("wait")  # the running request keeps going: flushes are refused until it ends
        try:
            tries = c.flush_until_done(interval_s=0.01, tries=2000)
        finally:
            c.continue_generation()
    thread.join()
    assert tries > 1, f"the first flush is refused while the request drains, so more than one try; got {tries}"


@FLUSH
def test_flush_retry__an_idle_server_needs_one_try(server):
    with EngineClient(server.url) as c:
        assert c.flush_until_done(interval_s=0.01) == 1, "an idle server flushes at the first call"


@FLUSH
def test_flush_retry__a_refusal_that_is_not_retryable_is_raised_at_once(ckpts):
    calls = []
    with BackgroundServer(Engine(ckpts[0]), api_key=KEY) as srv, EngineClient(srv.url, api_key="wrong") as c:
        c.http.event_hooks["request"] = [lambda r: calls.append(r.url.path)]
        with pytest.raises(EngineError) as info:
            c.flush_until_done(interval_s=0.01, tries=5)
    assert info.value.status == 403, "the 403 of a wrong key is raised"
    assert calls == ["/flush_cache"], f"a refusal that is not retryable is not retried; calls: {calls}"


# ---- ch07.client_flow ---------------------------------------------------------------------

@FLOW
def test_client_flow__calls_in_order_and_serves_the_new_weights(server, ckpts):
    calls = []
    with EngineClient(server.url) as c:
        c.http.event_hooks["request"] = [lambda r: calls.append(r.url.path)]
        times = c.sync_weights(named_tensors=CheckpointReader(ckpts[1]).iter_tensors(), weight_version="v1",
                               bucket_bytes=60_000, flush_interval_s=0.01)
    n = times["buckets"]
    want = (["/pause_generation", "/flush_cache"] + ["/update_weights_from_tensor"] * (n + 1)
            + ["/flush_cache", "/continue_generation"])
    assert n > 1 and calls == want, f"pause, flush, {n} buckets and the version bucket, flush, continue; got {calls}"
    assert set(times) >= {"pause_s", "flush_wait_s", "update_s", "flush_s", "continue_s", "total_s", "flush_tries"}
    server.worker.call_sync(lambda e: assert_hot_equals_cold(e, ckpts[1], ["after the sync"], max_new_tokens=4),
                            timeout=60)


@FLOW
def test_client_flow__a_refused_disk_update_still_continues(server, tmp_path):
    with EngineClient(server.url) as c:
        with pytest.raises(EngineError) as info:
            c.sync_weights(model_path=tmp_path, weight_version="never", flush_interval_s=0.01)
        assert info.value.status == 400, "an empty folder is not a checkpoint: 400"
        assert c.health()["paused"] is False, "nothing changed, so the server is generating again"


@FLOW
def test_client_flow__a_bucket_refused_halfway_leaves_the_server_paused(server, ckpts):
    tensors = list(CheckpointReader(ckpts[0]).iter_tensors())
    broken = tensors[:-1] + [(tensors[-1][0], torch.zeros(3))]  # the last tensor has a wrong shape
    with EngineClient(server.url) as c:
        try:
            with pytest.raises(EngineError):
                c.sync_weights(named_tensors=broken, weight_version="half", bucket_bytes=60_000, flush_interval_s=0.01)
            assert c.health()["paused"] is True, "some buckets landed: the server stays paused, not on a mix"
        finally:
            c.continue_generation()
