"""Hidden tests for chapter 07: the route rules, the error statuses, the flush retry and the
trainer's flow, against a real HTTP server on 127.0.0.1.

Fresh random keys, checkpoints, versions, bucket sizes and request lengths each run (the
seed is in every message). What the learner's client did is recorded on the server's side,
by an ASGI layer of this test wrapped around the app (method, path, status and body of
every request in arrival order), never by an object the client owns. The flow's phase
times are checked against a ``time.perf_counter`` this test moves by a known amount inside
each call (``SteppedPerfCounter``), and the flush's sleeps are recorded, never waited for:
no case depends on how long anything really took.
"""
import base64
import json
import math
import pickle
import random
import threading
import time

import httpx
import pytest

from course_lib import Engine
from course_lib.engine.pause import EngineBusyError, EnginePausedError
from course_lib.server.client import EngineClient, EngineError
from course_lib.server.errors import ApiError, from_engine_exception
from course_lib.server.guard import OPEN_ROUTES, WEIGHT_ROUTES, GuardMiddleware
from course_lib.server.runner import BackgroundServer
from course_lib.testing import assert_hot_equals_cold
from course_lib.weights.commit.audit import AddressMovedError
from course_lib.weights.checkpoint import CheckpointReader, preset, random_state_dict, write_checkpoint
from course_lib.weights.transports.safe_pickle import UnsafePickleError
from conftest import hidden_seed  # the judge's plugin: a fixed seed, so a grade repeats

RULES, STATUS, FLUSH, FLOW = (pytest.mark.exercise(f"ch07.{n}")
                              for n in ("route_rules", "error_status", "flush_retry", "client_flow"))
TRAINER_PATHS = {"/pause_generation", "/flush_cache", "/update_weights_from_tensor", "/update_weights_from_disk",
                 "/continue_generation", "/update_weight_version"}
_TOKENS = random.Random(hidden_seed() + 1)  # wrong keys and version names, drawn like the rest
PROMPTS = ["the protocol", "a trainer drives the server over HTTP"]


class Recorder:
    """ASGI layer outside the app's own: logs every request as it arrives, with its status
    and the body the app read."""

    def __init__(self, app, log: list):
        self.app, self.log = app, log

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        entry = {"method": scope["method"], "path": scope["path"], "status": None, "body": b""}
        self.log.append(entry)

        async def recording_receive():
            message = await receive()
            if message["type"] == "http.request":
                entry["body"] += message.get("body", b"")
            return message

        async def recording_send(message):
            if message["type"] == "http.response.start":
                entry["status"] = message["status"]
            await send(message)
        await self.app(scope, recording_receive, recording_send)


def start_server(path, log: list, **options) -> BackgroundServer:
    srv = BackgroundServer(Engine(path), **options)
    srv.app.add_middleware(Recorder, log=log)
    return srv.start()


class World:
    """One served engine for the module: a random key and config, three checkpoints of it."""

    def __init__(self, root):
        self.seed = hidden_seed()
        r = random.Random(self.seed)
        self.key = r.randbytes(12).hex()
        config = preset("tiny", hidden_size=r.choice([48, 64]), intermediate_size=r.choice([96, 128]),
                        num_hidden_layers=r.choice([2, 3]), tie_word_embeddings=r.random() < 0.5)
        # Three different seeds: a sync to weights equal to the served ones would prove nothing.
        self.ckpts = [write_checkpoint(root / f"v{i}", config, random_state_dict(config, seed))
                      for i, seed in enumerate(r.sample(range(10_000), 3))]
        self.log: list = []
        self.server = start_server(self.ckpts[0], self.log, allow_weight_update=True, api_key=self.key)
        self.url = self.server.url

    def client(self, **kw) -> EngineClient:
        return EngineClient(self.url, api_key=self.key, **kw)

    def calls(self, since: int) -> list[dict]:
        """The trainer's calls since log index ``since`` (generation and health left out)."""
        return [e for e in self.log[since:] if e["path"] in TRAINER_PATHS]

    def state(self):
        return self.server.worker.call_sync(lambda e: (e.paused, e.weight_version), timeout=30)

    def hot_equals_cold(self, path, what: str):
        try:
            self.server.worker.call_sync(lambda e: assert_hot_equals_cold(e, path, PROMPTS, max_new_tokens=4),
                                         timeout=60)
        except AssertionError as exc:
            raise AssertionError(f"seed {self.seed}: {what}: {exc}") from None

    def reset(self, path, version="reset"):
        """Known weights, unpaused, nothing in flight (through the plain endpoints)."""
        with self.client() as c:
            c.pause_generation("abort")
            c.flush_cache()
            c.update_weights_from_disk(path, weight_version=version, flush_cache=True)
            c.continue_generation()

    def long_request(self, tokens: int) -> threading.Thread:
        """A request of ``tokens`` tokens on a thread; returns once the engine runs it."""
        body = {"text": "a long answer", "sampling_params": {"max_new_tokens": tokens, "temperature": 0,
                                                             "ignore_eos": True}}
        thread = threading.Thread(target=lambda: httpx.post(f"{self.url}/generate", json=body, timeout=120,
                                                            headers={"X-API-Key": self.key}))
        thread.start()
        with self.client() as c:
            while c.health()["num_running"] == 0:
                time.sleep(0.002)
        return thread


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    w = World(tmp_path_factory.mktemp("ch07-hidden"))
    yield w
    w.server.stop()


def error_of(reply, seed, what: str) -> dict:
    """The reply's error body, checked to be the one shape with its own status."""
    try:
        err = reply.json()["error"]
    except (ValueError, KeyError, TypeError):
        raise AssertionError(f"seed {seed}: {what}: the body is not the error shape: {reply.text[:200]}") from None
    assert set(err) == {"code", "message", "retryable", "status"}, f"seed {seed}: {what}: error fields {set(err)}"
    assert err["status"] == reply.status_code and err["message"], f"seed {seed}: {what}: {err}"
    return err


def expect(reply, status: int, code: str, retryable: bool, seed, what: str) -> dict:
    assert reply.status_code == status, f"seed {seed}: {what}: expected {status} {code}, got {reply.status_code} " \
                                        f"{reply.text[:200]}"
    err = error_of(reply, seed, what)
    assert (err["code"], err["retryable"]) == (code, retryable), \
        f"seed {seed}: {what}: expected code {code!r} retryable={retryable}, got {err['code']!r} {err['retryable']}"
    return err


# ---- ch07.route_rules ---------------------------------------------------------------------

@RULES
def test_every_route_wants_the_key_401_missing_403_wrong(world):
    url, key, seed = world.url, world.key, world.seed
    routes = [("GET", "/get_weight_version"), ("GET", "/flush_cache"), ("POST", "/generate"),
              ("POST", "/pause_generation"), ("POST", "/update_weight_version"), ("GET", "/get_weights_by_name")]
    wrong = [{"Authorization": f"Bearer {key[:-1]}"}, {"Authorization": f"Bearer {key}x"},
             {"X-API-Key": key[: len(key) // 2]}, {"Authorization": f"Bearer {key.upper()}"},
             {"Authorization": f"Bearer {_TOKENS.randbytes(12).hex()}", "X-API-Key": key}]
    missing = [{}, {"Authorization": "Bearer"}, {"Authorization": f"Basic {key}"}, {"X-API-Key": ""}]
    with httpx.Client(base_url=url) as http:
        for method, route in routes:
            for headers in missing:
                expect(http.request(method, route, headers=headers), 401, "unauthorized", False, seed,
                       f"{method} {route} with headers {list(headers)} and no usable key")
            for headers in wrong:
                expect(http.request(method, route, headers=headers), 403, "forbidden", False, seed,
                       f"{method} {route} with a wrong key in {list(headers)}")
    assert world.state()[0] is False, f"seed {seed}: refused requests paused the server"


@RULES
def test_the_key_in_either_header_form_passes_and_health_needs_none(world):
    url, key, seed = world.url, world.key, world.seed
    for headers in ({"Authorization": f"Bearer {key}"}, {"Authorization": f"bearer  {key}"}, {"X-API-Key": key},
                    {"Authorization": f"Basic {_TOKENS.randbytes(4).hex()}", "X-API-Key": key}):
        reply = httpx.get(f"{url}/get_weight_version", headers=headers)
        assert reply.status_code == 200, f"seed {seed}: the right key in {headers} is let through, got " \
                                         f"{reply.status_code} {reply.text[:200]}"
    for route in sorted(OPEN_ROUTES):
        assert httpx.get(f"{url}{route}").status_code == 200, f"seed {seed}: {route} answers without a key"


@RULES
def test_weight_routes_are_403_route_disabled_unless_opted_in(world):
    seed, log = world.seed, []
    srv = start_server(world.ckpts[0], log, allow_weight_update=False)
    try:
        for route in sorted(WEIGHT_ROUTES):
            err = expect(httpx.post(f"{srv.url}{route}", json={}), 403, "route_disabled", False, seed,
                         f"{route} on a server without --allow-weight-update")
            assert route in err["message"] and "--allow-weight-update" in err["message"], \
                f"seed {seed}: the message names the route and the switch: {err['message']!r}"
        assert all(e["body"] == b"" for e in log), f"seed {seed}: a disabled route's body is never read"
        state = srv.worker.call_sync(lambda e: (e.paused, e.weight_version, e.weight_update_count), timeout=30)
        assert state == (False, "default", 0), f"seed {seed}: refused weight routes changed the engine: {state}"
        open_calls = [("GET", "/flush_cache", None), ("GET", "/get_weight_version", None),
                      ("POST", "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}})]
        for method, route, body in open_calls:
            reply = httpx.request(method, f"{srv.url}{route}", json=body)
            assert reply.status_code == 200, f"seed {seed}: {route} stays open without the switch, got " \
                                             f"{reply.status_code} {reply.text[:200]}"
    finally:
        srv.stop()


@RULES
def test_the_key_is_checked_before_the_weight_route_switch(world):
    seed, key = world.seed, _TOKENS.randbytes(8).hex()
    srv = start_server(world.ckpts[0], [], allow_weight_update=False, api_key=key)
    try:
        route = random.Random(seed).choice(sorted(WEIGHT_ROUTES))
        expect(httpx.post(f"{srv.url}{route}", json={}), 401, "unauthorized", False, seed,
               f"{route} without a key on a locked server (who you are comes first)")
        expect(httpx.post(f"{srv.url}{route}", json={}, headers={"X-API-Key": key}), 403, "route_disabled", False,
               seed, f"{route} with the right key on a server without --allow-weight-update")
    finally:
        srv.stop()


@RULES
def test_a_401_names_both_headers_a_key_may_come_in_and_a_403_route_disabled_the_switch(world):
    """The contract's messages: 401 "naming both headers", route_disabled "naming the path
    and --allow-weight-update" (checked on the rules themselves, every missing-key form)."""
    seed = world.seed
    r = random.Random(f"{seed}-messages")
    key = r.randbytes(10).hex()
    locked = GuardMiddleware(None, api_key=key, allow_weight_update=False, max_body_bytes=1 << 20)
    route = r.choice(sorted(WEIGHT_ROUTES))
    for headers in ({}, {b"authorization": b"Bearer"}, {b"authorization": b"Basic " + key.encode()},
                    {b"x-api-key": b"  "}, {b"authorization": b"bearer   ", b"x-api-key": b""}):
        err = locked.route_rules(route, headers)
        assert isinstance(err, ApiError) and (err.status, err.code) == (401, "unauthorized"), \
            f"seed {seed}: {route} with headers {headers}: expected 401 unauthorized, got {err!r}"
        words = err.message.lower()
        assert "authorization" in words and "x-api-key" in words, \
            f"seed {seed}: a 401's message names both headers a key may come in (Authorization: Bearer and " \
            f"X-API-Key), so the client knows what to send; got {err.message!r}"
    err = locked.route_rules(route, {b"x-api-key": key.encode()})
    assert isinstance(err, ApiError) and (err.status, err.code) == (403, "route_disabled") \
        and route in err.message and "--allow-weight-update" in err.message, \
        f"seed {seed}: {route} with the right key, switch off: 403 route_disabled naming the path and " \
        f"--allow-weight-update; got {err!r} {getattr(err, 'message', '')!r}"


# ---- ch07.error_status --------------------------------------------------------------------

@STATUS
def test_a_live_server_answers_409_400_503_in_the_error_shape(world):
    seed, url, h = world.seed, world.url, {"X-API-Key": world.key}
    # Aborted below, so its length costs nothing: long enough to outlast the three calls on a busy machine
    # (a tiny model makes about 500 tokens a second on one core).
    tokens = random.Random(seed).randrange(800, 900)
    world.reset(world.ckpts[0])
    thread = world.long_request(tokens)
    try:
        expect(httpx.post(f"{url}/update_weights_from_disk", headers=h, json={"model_path": str(world.ckpts[1])}),
               409, "conflict", False, seed, "an update while unpaused with a request in flight")
        expect(httpx.get(f"{url}/flush_cache", headers=h), 400, "requests_in_flight", True, seed,
               "a flush while a request runs")
        with world.client() as c:
            c.pause_generation("abort")
        expect(httpx.post(f"{url}/generate", headers=h, json={"text": "hi"}), 503, "paused", True, seed,
               "generate while paused")
    finally:
        with world.client() as c:
            c.continue_generation()
        thread.join()
    world.hot_equals_cold(world.ckpts[0], "refused requests changed no weight")


@STATUS
def test_bad_payloads_are_400_unsafe_payload_or_bad_request(world, tmp_path):
    seed, url, h = world.seed, world.url, {"X-API-Key": world.key}
    marker = tmp_path / f"ran-{seed}"

    class RunsCode:
        def __reduce__(self):
            return (exec, (f"open({str(marker)!r}, 'w').close()",))
    evil = base64.b64encode(pickle.dumps(RunsCode())).decode()
    with world.client() as c:
        c.pause_generation("abort")
        try:
            expect(httpx.post(f"{url}/update_weights_from_tensor", headers=h, json={
                "serialized_named_tensors": [evil], "load_format": "flattened_bucket"}), 400, "unsafe_payload", False,
                seed, "a payload that would run code")
            other = preset("tiny", hidden_size=32, intermediate_size=64, num_hidden_layers=1)
            wrong = write_checkpoint(tmp_path / "other", other, random_state_dict(other, seed % 1000))
            expect(httpx.post(f"{url}/update_weights_from_disk", headers=h, json={"model_path": str(wrong)}),
                   400, "bad_request", False, seed, "an update from a checkpoint of another shape")
        finally:
            c.continue_generation()
    assert not marker.exists(), f"seed {seed}: the pickle's code ran"


@STATUS
def test_each_engine_error_maps_to_its_status_code_and_retry_flag(world):
    seed = world.seed
    words = f"words-{seed}"

    class Sick:
        unhealthy = f"NaN logits ({seed})"

    class Well:
        unhealthy = None
    cases = [(EnginePausedError(words), Well, (503, "paused", True)),
             (EngineBusyError(words), Well, (409, "conflict", False)),
             (UnsafePickleError(words), Well, (400, "unsafe_payload", False)),
             (AddressMovedError(words), Well, (500, "address_moved", False)),
             (TimeoutError(words), Well, (504, "timeout", True)),
             (ValueError(words), Well, (400, "bad_request", False)),
             (RuntimeError(words), Sick, (503, "unhealthy", False)),
             (RuntimeError(words), Well, (500, "internal", False)),
             (KeyError(words), Well, (500, "internal", False))]
    for exc, engine, want in random.Random(seed).sample(cases, len(cases)):
        got = from_engine_exception(exc, engine)
        assert isinstance(got, ApiError), f"seed {seed}: {type(exc).__name__} gives an ApiError, not {got!r}"
        assert (got.status, got.code, got.retryable) == want, \
            f"seed {seed}: {type(exc).__name__} (engine unhealthy: {engine.unhealthy!r}) maps to {want}, " \
            f"got {(got.status, got.code, got.retryable)}"
        if want[1] == "unhealthy":
            assert Sick.unhealthy in got.message, f"seed {seed}: the message names the reason: {got.message!r}"
        else:
            assert words in got.message, f"seed {seed}: the message keeps the error's words: {got.message!r}"
    same = ApiError(418, f"teapot-{seed}", words, retryable=True)
    assert from_engine_exception(same, Sick) is same, f"seed {seed}: an ApiError is returned unchanged"


@STATUS
def test_messages_say_what_the_contract_promises(world):
    """Messages carry ``str(exc)``; the address audit's ends in "the engine refuses work until
    restarted"; an unhealthy engine's names its reason; an internal error's keeps the words."""
    seed = world.seed
    r = random.Random(f"{seed}-status-messages")
    words = f"layer {r.randrange(100)} weight moved from 0x{r.randrange(1 << 40):x}"

    class Well:
        unhealthy = None

    class Sick:
        unhealthy = f"NaN in layer {r.randrange(100)}"
    got = from_engine_exception(AddressMovedError(words), Well)
    assert (got.status, got.code) == (500, "address_moved") and words in got.message \
        and got.message.rstrip(" .").endswith("the engine refuses work until restarted"), \
        f"seed {seed}: AddressMovedError({words!r}): 500 address_moved, the message keeps the error's words and " \
        f"ends in 'the engine refuses work until restarted'; got {got.status} {got.code} {got.message!r}"
    got = from_engine_exception(RuntimeError(words), Sick)
    assert Sick.unhealthy in got.message, \
        f"seed {seed}: an unhealthy engine's 503 names its reason {Sick.unhealthy!r}; got {got.message!r}"
    for exc in (EnginePausedError(words), EngineBusyError(words), UnsafePickleError(words), TimeoutError(words),
                ValueError(words), RuntimeError(words)):
        got = from_engine_exception(exc, Well)
        assert words in got.message, \
            f"seed {seed}: {type(exc).__name__}: the message carries str(exc) {words!r}; got {got.message!r}"


# ---- ch07.flush_retry ---------------------------------------------------------------------

def flush_replies(world, since: int) -> list:
    return [e["status"] for e in world.log[since:] if e["path"] == "/flush_cache"]


@FLUSH
def test_flush_is_retried_while_a_wait_pause_drains(world):
    seed = world.seed
    # The drain runs it to its end, but it must outlast the pause and the first flush: at about 500 tokens a
    # second, 100 tokens left a busy machine too little time (a run saw only 3 flushes before the drain ended).
    tokens = random.Random(seed).randrange(300, 400)
    thread = world.long_request(tokens)
    since = len(world.log)
    with world.client() as c:
        c.pause_generation("wait")
        try:
            tries = c.flush_until_done(interval_s=0.005, tries=10_000)
        finally:
            c.continue_generation()
    thread.join()
    seen = flush_replies(world, since)
    assert len(seen) > 1 and seen[-1] == 200 and set(seen[:-1]) == {400}, \
        f"seed {seed}: refused flushes (400) retried until one succeeded; the server saw {seen[:8]}..."
    assert tries == len(seen), f"seed {seed}: returned {tries} tries; the server saw {len(seen)} flushes"


@FLUSH
def test_flush_gives_up_after_its_tries_with_the_last_error(world):
    seed = world.seed
    n = random.Random(seed).randrange(2, 6)
    thread = world.long_request(900)  # not paused: every flush is refused while it runs (aborted below)
    since = len(world.log)
    try:
        with world.client() as c, pytest.raises(EngineError) as info:
            c.flush_until_done(interval_s=0.001, tries=n)
    finally:
        with world.client() as c:
            c.pause_generation("abort")
            c.continue_generation()
        thread.join()
    seen = flush_replies(world, since)
    assert seen == [400] * n, f"seed {seed}: exactly {n} refused tries, then give up; the server saw {seen}"
    assert (info.value.status, info.value.code) == (400, "requests_in_flight"), \
        f"seed {seed}: the last refusal is raised, got {info.value}"


@FLUSH
def test_flush_raises_a_refusal_that_is_not_retryable_at_once(world):
    seed = world.seed
    since = len(world.log)
    with EngineClient(world.url, api_key=_TOKENS.randbytes(6).hex()) as c, pytest.raises(EngineError) as info:
        c.flush_until_done(interval_s=0.001, tries=random.Random(seed).randrange(3, 9))
    assert info.value.status == 403, f"seed {seed}: the wrong key's 403 is raised, got {info.value}"
    assert flush_replies(world, since) == [403], f"seed {seed}: not retried; the server saw " \
                                                 f"{flush_replies(world, since)}"
    with world.client() as c:
        since = len(world.log)
        assert c.flush_until_done(interval_s=0.001, tries=1) == 1, f"seed {seed}: an idle server flushes at once"
        with pytest.raises(ValueError):
            c.flush_until_done(interval_s=0.001, tries=0)
    assert flush_replies(world, since) == [200], f"seed {seed}: tries=0 is refused before any call"


class ScriptedFlushes:
    """Stands in for ``client.flush_cache``: refuses with the given errors in turn, then
    succeeds; counts the calls. ``time.sleep`` is recorded (this thread's calls only) and
    returns at once, so slime's pace (1 s apart) costs this test nothing."""

    def __init__(self, monkeypatch, refusals: list):
        self.refusals, self.calls, self.sleeps = list(refusals), 0, []
        me, real_sleep = threading.get_ident(), time.sleep

        def recorded_sleep(seconds):
            if threading.get_ident() != me:
                return real_sleep(seconds)
            self.sleeps.append((self.calls, seconds))
        monkeypatch.setattr(time, "sleep", recorded_sleep)

    def __call__(self):
        self.calls += 1
        if self.refusals:
            raise self.refusals.pop(0)
        return {"flushed": True}


def busy(n: int) -> EngineError:
    return EngineError(400, "requests_in_flight", f"refusal number {n}: requests still in flight", retryable=True)


@FLUSH
@pytest.mark.parametrize("ending", ["succeeds", "succeeds_on_the_last_try", "gives_up", "not_retryable",
                                    "first_call"])
def test_flush_sleeps_interval_s_between_calls_and_never_after_the_last(world, monkeypatch, ending):
    """The contract: on a retryable refusal, sleep ``interval_s`` and call again, at most
    ``tries`` calls; after the last refused call raise that error (no sleep after it); an
    error that is not retryable is raised at once. The sleeps are recorded, in seconds."""
    r = random.Random(f"{world.seed}-sleeps-{ending}")
    seed, tries, interval = world.seed, r.randint(3, 8), r.choice([1.0, 0.25, 2.5])
    if ending == "succeeds":
        refused = r.randint(1, tries - 1)
        refusals = [busy(i + 1) for i in range(refused)]
        calls, sleeps = refused + 1, refused
    elif ending == "succeeds_on_the_last_try":
        refusals = [busy(i + 1) for i in range(tries - 1)]
        calls, sleeps = tries, tries - 1
    elif ending == "gives_up":
        refusals = [busy(i + 1) for i in range(tries + 2)]
        calls, sleeps = tries, tries - 1
    elif ending == "not_retryable":
        refused = r.randint(1, tries - 1)
        refusals = [busy(i + 1) for i in range(refused)] + [EngineError(403, "forbidden", "wrong API key")]
        calls, sleeps = refused + 1, refused
    else:
        refusals, calls, sleeps = [], 1, 0
    with EngineClient("http://127.0.0.1:9") as c:  # never connects: flush_cache is scripted
        script = ScriptedFlushes(monkeypatch, refusals)
        c.flush_cache = script
        try:
            got = c.flush_until_done(interval_s=interval, tries=tries)
            raised = None
        except EngineError as exc:
            got, raised = None, exc
        finally:
            monkeypatch.undo()
    what = f"seed {seed}: {ending}: interval_s={interval}, tries={tries}"
    assert script.calls == calls, f"{what}: expected {calls} flush calls, got {script.calls}"
    want = [(i + 1, interval) for i in range(sleeps)]
    assert script.sleeps == want, \
        f"{what}: expected {sleeps} sleep(s) of interval_s={interval} s, one after each refused call that is " \
        f"followed by another call (none after the last), as (calls so far, seconds): {want}; got {script.sleeps}"
    if ending in ("succeeds", "succeeds_on_the_last_try", "first_call"):
        assert raised is None and got == calls, f"{what}: returns the calls it took ({calls}); got {got!r} {raised!r}"
    elif ending == "gives_up":
        assert raised is not None and raised.message.startswith(f"refusal number {tries}:"), \
            f"{what}: after the last refused call, that error (refusal number {tries}) is raised; got {raised!r}"
    else:
        assert raised is not None and raised.status == 403, f"{what}: the 403 is raised at once; got {raised!r}"


# ---- ch07.client_flow ---------------------------------------------------------------------

def body(entry) -> dict:
    return json.loads(entry["body"]) if entry["body"] else {}


def split_flow(calls: list[dict], update_path: str, seed) -> tuple:
    """(pause, first flushes, updates, last flushes, continues) of one flow, checked in order."""
    paths = [e["path"] for e in calls]
    assert paths and paths[0] == "/pause_generation", f"seed {seed}: the flow starts with the pause: {paths}"
    i = 1
    first = []
    while i < len(paths) and paths[i] == "/flush_cache":
        first.append(calls[i])
        i += 1
    updates = []
    while i < len(paths) and paths[i] == update_path:
        updates.append(calls[i])
        i += 1
    last = []
    while i < len(paths) and paths[i] == "/flush_cache":
        last.append(calls[i])
        i += 1
    rest = paths[i:]
    assert first and updates and last and rest == ["/continue_generation"], \
        f"seed {seed}: expected pause, flush (retried), {update_path}, flush, continue; got {paths}"
    for name, flushes in (("first", first), ("last", last)):
        statuses = [e["status"] for e in flushes]
        assert statuses[-1] == 200 and set(statuses[:-1]) <= {400}, \
            f"seed {seed}: the {name} flush is retried until 200: {statuses}"
    return calls[0], first, updates, last


@FLOW
@pytest.mark.parametrize("mode", [None, "abort", "retract", "wait"])
def test_sync_from_tensors_makes_the_calls_in_order_and_is_hot_equal_cold(world, mode):
    r = random.Random(f"{world.seed}-{mode}")
    seed, version, bucket_bytes = world.seed, f"step-{r.randrange(10**6)}", r.choice([20_000, 40_000, 80_000])
    new = world.ckpts[r.choice([1, 2])]
    world.reset(world.ckpts[0])
    thread = world.long_request(r.randrange(60, 120)) if mode == "wait" else None
    since = len(world.log)
    with world.client() as c:
        times = c.sync_weights(named_tensors=CheckpointReader(new).iter_tensors(), weight_version=version,
                               pause_mode=mode, bucket_bytes=bucket_bytes, flush_interval_s=0.005, flush_tries=10_000)
    if thread is not None:
        thread.join()
    pause, first, updates, last = split_flow(world.calls(since), "/update_weights_from_tensor", seed)
    assert body(pause) == ({} if mode is None else {"mode": mode}), \
        f"seed {seed}: pause_mode {mode!r} posts {({} if mode is None else {'mode': mode})}, not {body(pause)}"
    bodies = [body(e) for e in updates]
    assert all(b.get("flush_cache") is False and b.get("load_format") == "flattened_bucket" for b in bodies), \
        f"seed {seed}: every bucket goes with flush_cache=false and load_format flattened_bucket"
    assert [b.get("weight_version") for b in bodies] == [None] * (len(bodies) - 1) + [version], \
        f"seed {seed}: only the last (empty) bucket carries the version {version!r}"
    assert all(e["status"] == 200 for e in updates), f"seed {seed}: every bucket was accepted"
    assert times["buckets"] == len(updates) - 1 > 0, \
        f"seed {seed}: {len(updates) - 1} non-empty buckets went out; the result says {times['buckets']}"
    assert times["flush_tries"] == len(first), \
        f"seed {seed}: the first flush took {len(first)} calls; the result says {times['flush_tries']}"
    phases = [times[k] for k in ("pause_s", "flush_wait_s", "update_s", "flush_s", "continue_s")]
    assert min(phases) >= 0 and abs(times["total_s"] - sum(phases)) < 1e-6, \
        f"seed {seed}: total_s is the sum of the five phases: {times}"
    assert world.state() == (False, version), f"seed {seed}: serving again, labelled {version!r}: {world.state()}"
    world.hot_equals_cold(new, f"after a sync with pause mode {mode!r}")


class SteppedPerfCounter:
    """``time.perf_counter`` (and its ``_ns`` form) running as usual plus an offset that only
    this test moves forward: each wrapped client call moves it by a known number of seconds
    once its reply is in, so the phase a figure belongs to is known whatever the machine's
    speed. The server's clocks that matter here (the event loop's ``time.monotonic``) are
    left alone, and the server is idle, so nothing of it waits on this clock meanwhile."""

    def __init__(self, monkeypatch):
        self.offset, self.spent = 0.0, dict.fromkeys(CALL_S, 0.0)
        real, real_ns = time.perf_counter, time.perf_counter_ns
        monkeypatch.setattr(time, "perf_counter", lambda: real() + self.offset)
        monkeypatch.setattr(time, "perf_counter_ns", lambda: real_ns() + int(self.offset * 1e9))

    def spend(self, client, method: str, phase):
        """``client.method`` moves the clock by its phase's ``CALL_S`` (``phase``: a name, or a
        function giving it at call time)."""
        original = getattr(client, method)

        def costs_a_known_time(*args, **kwargs):
            name = phase() if callable(phase) else phase
            try:
                return original(*args, **kwargs)
            finally:
                self.offset += CALL_S[name]
                self.spent[name] += CALL_S[name]
        setattr(client, method, costs_a_known_time)  # the instance's attribute: the flow's calls go through it


# Seconds each client call moves time.perf_counter, by the phase it belongs to. Each is far longer
# than anything the test really runs for, so a phase that holds another phase's call, or a figure
# in ms, cannot pass for the right one.
CALL_S = {"pause_s": 2.0e5, "flush_wait_s": 3.0e5, "update_s": 5.0e5, "flush_s": 4.0e5, "continue_s": 6.0e5}
REAL_BOUND_S = 1.0e5  # what the real calls of a phase add stays far below this


@FLOW
@pytest.mark.parametrize("source", ["tensors", "disk"])
def test_each_phase_is_the_seconds_of_its_own_calls_on_perf_counter(world, monkeypatch, source):
    """The contract: ``pause_s`` .. ``continue_s`` are the seconds each step took, measured
    with ``time.perf_counter`` (each from the end of the step before it), ``total_s`` their sum."""
    r = random.Random(f"{world.seed}-clock-{source}")
    seed, version = world.seed, f"clock-{r.randrange(10**6)}"
    mode = r.choice([None, "abort", "retract", "wait"])
    new = world.ckpts[r.choice([1, 2])]
    world.reset(world.ckpts[0])
    updated = []
    with world.client() as c:
        clock = SteppedPerfCounter(monkeypatch)
        clock.spend(c, "pause_generation", "pause_s")
        clock.spend(c, "flush_cache", lambda: "flush_s" if updated else "flush_wait_s")
        for method in ("update_weights_from_tensor", "update_weights_from_disk"):
            clock.spend(c, method, lambda: updated.append(1) or "update_s")
        clock.spend(c, "continue_generation", "continue_s")
        try:
            if source == "tensors":
                times = c.sync_weights(named_tensors=CheckpointReader(new).iter_tensors(), weight_version=version,
                                       pause_mode=mode, bucket_bytes=r.choice([20_000, 80_000]),
                                       flush_interval_s=0.005)
            else:
                times = c.sync_weights(model_path=new, weight_version=version, pause_mode=mode,
                                       flush_interval_s=0.005)
        finally:
            monkeypatch.undo()
    what = f"seed {seed}: sync from {source}, pause mode {mode!r}"
    assert world.state() == (False, version), f"{what}: serving again as {version!r}: {world.state()}"
    spent = clock.spent
    for name, own in spent.items():
        got = times.get(name)
        assert isinstance(got, (int, float)) and own <= got < own + REAL_BOUND_S, \
            f"{what}: {name} is the seconds its own step took on time.perf_counter, from the end of the step " \
            f"before it: this test moved that clock by {own:.0f} s during the step's calls (and by " \
            f"{sum(spent.values()) - own:.0f} s during the other steps' calls), so {name} must be {own:.0f} s " \
            f"plus the calls' real time; got {got!r}"
    parts = [times[k] for k in CALL_S]
    assert math.isclose(times.get("total_s", math.nan), sum(parts), rel_tol=1e-9), \
        f"{what}: total_s is the sum of the five phases {parts}, got {times.get('total_s')!r}"


@FLOW
def test_sync_from_disk_makes_the_calls_in_order(world):
    seed, version = world.seed, f"disk-{_TOKENS.randbytes(3).hex()}"
    world.reset(world.ckpts[0])
    since = len(world.log)
    with world.client() as c:
        times = c.sync_weights(model_path=world.ckpts[2], weight_version=version, flush_interval_s=0.005)
    _, _, updates, _ = split_flow(world.calls(since), "/update_weights_from_disk", seed)
    assert len(updates) == 1 and body(updates[0]).get("flush_cache") is False \
        and body(updates[0]).get("weight_version") == version, \
        f"seed {seed}: one disk update with flush_cache=false and the version: {[body(e) for e in updates]}"
    assert times["buckets"] == 0 and times["bytes"] > 0, f"seed {seed}: no buckets, the disk update's bytes: {times}"
    assert world.state() == (False, version), f"seed {seed}: serving again as {version!r}: {world.state()}"
    world.hot_equals_cold(world.ckpts[2], "after a sync from disk")


def failing_sync(world, what: str, **kwargs):
    since = len(world.log)
    with world.client() as c, pytest.raises(EngineError) as info:
        c.sync_weights(flush_interval_s=0.001, **kwargs)
    return info.value, [e["path"] for e in world.calls(since)]


@FLOW
def test_a_failure_before_any_weight_changed_still_continues(world, tmp_path):
    seed = world.seed
    tensors = list(CheckpointReader(world.ckpts[1]).iter_tensors())
    name, t = tensors[0]
    cases = [("a refused disk update", dict(model_path=tmp_path)),
             ("a refused first bucket", dict(named_tensors=[(name, t.reshape(-1))] + tensors[1:],
                                             bucket_bytes=40_000))]
    for what, kwargs in cases:
        world.reset(world.ckpts[0], version="before")
        error, paths = failing_sync(world, what, weight_version="never", **kwargs)
        assert error.status == 400, f"seed {seed}: {what} is a 400, got {error}"
        assert paths[-1] == "/continue_generation", \
            f"seed {seed}: {what} changed nothing, so the flow still continues; calls: {paths}"
        assert world.state() == (False, "before"), f"seed {seed}: {what}: serving the old version: {world.state()}"
        world.hot_equals_cold(world.ckpts[0], f"{what} changed no weight")
    # A first flush that never succeeds (a wait pause whose request outlives the tries).
    world.reset(world.ckpts[0], version="before")
    thread = world.long_request(400)  # outlasts the pause and two flushes on a busy machine too
    try:
        error, paths = failing_sync(world, "flush gave up", named_tensors=tensors, weight_version="never",
                                    pause_mode="wait", flush_tries=2)
    finally:
        thread.join()
    assert error.code == "requests_in_flight" and "/update_weights_from_tensor" not in paths \
        and paths[-1] == "/continue_generation", \
        f"seed {seed}: when the first flush gives up, no bucket is sent and generation continues; calls: {paths}"
    assert world.state() == (False, "before"), f"seed {seed}: serving the old version: {world.state()}"


@FLOW
def test_a_bucket_refused_halfway_leaves_the_server_paused(world):
    seed = world.seed
    tensors = list(CheckpointReader(world.ckpts[1]).iter_tensors())
    cut = random.Random(seed).randrange(len(tensors) // 2, len(tensors))
    name, t = tensors[cut]
    broken = tensors[:cut] + [(name, t.reshape(-1)[: t.numel() - 1])] + tensors[cut + 1:]
    world.reset(world.ckpts[0], version="before")
    try:
        error, paths = failing_sync(world, "a later bucket refused", named_tensors=broken, weight_version="half",
                                    bucket_bytes=20_000)
        assert error.status == 400, f"seed {seed}: the bad bucket is a 400, got {error}"
        assert paths.count("/update_weights_from_tensor") > 1 and "/continue_generation" not in paths, \
            f"seed {seed}: buckets landed before the refusal: the server must stay paused; calls: {paths}"
        assert world.state() == (True, "before"), \
            f"seed {seed}: paused, and the label unchanged (no version bucket): {world.state()}"
    finally:
        with world.client() as c:
            c.continue_generation()


@FLOW
def test_one_source_exactly_before_any_call(world):
    since = len(world.log)
    with world.client() as c:
        for kwargs in ({}, {"named_tensors": [], "model_path": world.ckpts[1]}):
            with pytest.raises(ValueError):
                c.sync_weights(**kwargs)
    assert world.calls(since) == [], f"seed {world.seed}: a bad call is refused before any request"
