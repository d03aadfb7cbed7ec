"""Chapter 07 scenarios for the differential cases (``test_differential.py``): plain functions
of JSON-able arguments, run on the learner's ``course_lib`` and on the reference's (see
``twin.py``); each builds what it needs from its arguments and returns what it observed, as
JSON.

- ``error_status``: ``from_engine_exception`` on an exception built from a description
  (its classes, its words) and an engine healthy or not, called inside the ``except``
  that caught it, as the engine thread does;
- ``route_rules``: ``GuardMiddleware.route_rules`` on a server key, the switch, a path and
  headers;
- ``flush_retry`` and ``client_flow``: the learner's ``EngineClient`` against a scripted HTTP
  server on 127.0.0.1 (a real server, real sockets, real httpx): each endpoint answers
  from a script (success, an error in the one error shape, a body that is not JSON, or a
  dropped connection), and every request is recorded as it arrives, in one log with the
  client's ``time.sleep`` calls (recorded, never waited for). The flow's second exercise
  is graded on its own: its client's ``flush_until_done`` is this file's own
  (``own_flush_until_done``), never the learner's.
"""
from __future__ import annotations

import hashlib
import json
import logging
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from engine_scenarios import error_kind

# ---- ch07.error_status ---------------------------------------------------------------------

MESSAGE_END = "the engine refuses work until restarted"


def _exception_classes():
    from course_lib.engine.pause import EngineBusyError, EnginePausedError
    from course_lib.weights.commit.audit import AddressMovedError
    from course_lib.weights.transports.bucket import BucketError
    from course_lib.weights.commit.copy_table import RegistrationError
    from course_lib.weights.transports.safe_pickle import UnsafePickleError
    from course_lib.weights.checkpoint.safetensors_format import CheckpointError
    from course_lib.weights.commit.validate import UpdateError
    return {"EnginePausedError": EnginePausedError, "EngineBusyError": EngineBusyError,
            "UnsafePickleError": UnsafePickleError, "AddressMovedError": AddressMovedError,
            "TimeoutError": TimeoutError, "ValueError": ValueError, "UpdateError": UpdateError,
            "CheckpointError": CheckpointError, "BucketError": BucketError, "RegistrationError": RegistrationError,
            "RuntimeError": RuntimeError, "KeyError": KeyError, "OSError": OSError, "ZeroDivisionError":
                ZeroDivisionError, "AssertionError": AssertionError, "ConnectionError": ConnectionError,
            "Exception": Exception}


def _mixed(classes: list) -> type:
    """One class of ``classes`` in that order; where Python cannot order them (a class
    before its own subclass), the subclass first; where it cannot at all, the first alone."""
    if len(classes) == 1:
        return classes[0]
    for order in (classes, classes[::-1]):
        try:
            return type("Mixed", tuple(order), {})
        except TypeError:
            continue
    return classes[0]


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.NOTSET)
        self.records = []

    def emit(self, record):
        self.records.append(record)


class _Engine:
    """What ``from_engine_exception`` may read of an engine: its ``unhealthy`` reason."""

    def __init__(self, unhealthy):
        self.unhealthy = unhealthy


def error_status(bases: list, words: str, unhealthy, api_error=None) -> dict:
    """``from_engine_exception`` on an exception of classes ``bases`` (several: a class made
    of them, in that order) with ``words``; or, with ``api_error`` = [status, code,
    retryable], on an ``ApiError``. ``unhealthy``: the engine's reason, or None."""
    from course_lib.server.errors import ApiError, from_engine_exception
    if api_error is not None:
        exc = ApiError(api_error[0], api_error[1], words, retryable=api_error[2])
    else:
        exc = _mixed([_exception_classes()[b] for b in bases])(words)
    args_before = exc.args
    before = {k: getattr(exc, k, None) for k in ("status", "code", "message", "retryable")}
    engine = _Engine(unhealthy)
    handler = _Records()
    logger = logging.getLogger("course_lib.server")
    logger.addHandler(handler)
    try:
        try:
            raise exc
        except BaseException as caught:  # the engine thread maps what it caught, inside its except
            try:
                got = from_engine_exception(caught, engine)
            except BaseException as bad:  # noqa: BLE001 - observed: the contract never raises
                return {"raised": type(bad).__name__}
    finally:
        logger.removeHandler(handler)
    obs = {"is_api_error": isinstance(got, ApiError), "unchanged": {
        "args": exc.args == args_before, "engine": engine.unhealthy == unhealthy,
        "fields": {k: getattr(exc, k, None) for k in before} == before}}
    if not isinstance(got, ApiError):
        return dict(obs, returned_type=type(got).__name__)
    obs["same_object"] = got is exc
    body = got.body()
    message = body["error"].pop("message", None)
    # The wire form of everything but the message, as text: 503 and "503", True and 1 differ.
    obs["wire"] = json.dumps(body, sort_keys=True, default=repr)
    obs["message_is_text"] = isinstance(message, str) and isinstance(got.message, str)
    message = str(message)
    code = body["error"].get("code")
    # The message's exact text is left free by the contract; what it must carry is compared.
    if code == "unhealthy":
        obs["names_the_reason"] = str(unhealthy) in message
    else:
        obs["carries_str_exc"] = str(exc) in message
    if code == "address_moved":
        obs["ends_as_promised"] = message.rstrip(" .").endswith(MESSAGE_END)
    if code == "internal":
        mine = [r for r in handler.records if r.name.startswith("course_lib.server")]
        obs["logged_with_traceback"] = any(r.levelno >= logging.ERROR and r.exc_info and r.exc_info[1] is exc
                                           for r in mine)
    return obs


# ---- ch07.route_rules ----------------------------------------------------------------------

def route_rules(api_key, allow_weight_update: bool, path: str, headers: list) -> dict:
    """``route_rules(path, headers)`` on a guard with this key and switch; ``headers``:
    [name, value] pairs of text (lower-cased and encoded here, as ASGI gives them)."""
    import hmac
    import secrets

    from course_lib.server.errors import ApiError
    from course_lib.server.guard import OPEN_ROUTES, GuardMiddleware
    guard = GuardMiddleware(None, api_key=api_key, allow_weight_update=allow_weight_update, max_body_bytes=1 << 20)
    given = {name.lower().encode(): value.encode() for name, value in headers}
    copy = dict(given)
    state = (guard.api_key, guard.allow_weight_update, guard.max_body_bytes)
    compared = []
    real_h, real_s = hmac.compare_digest, secrets.compare_digest

    def spy(a, b):
        compared.append(1)
        return real_h(a, b)
    hmac.compare_digest = secrets.compare_digest = spy
    try:
        got = guard.route_rules(path, given)
    except BaseException as exc:  # noqa: BLE001 - observed
        return {"raised": error_kind(exc)}
    finally:
        hmac.compare_digest, secrets.compare_digest = real_h, real_s
    obs = {"headers_unchanged": given == copy and all(type(v) is bytes for v in given.values()),
           "guard_unchanged": (guard.api_key, guard.allow_weight_update, guard.max_body_bytes) == state}
    checked_a_key = guard.api_key is not None and path not in OPEN_ROUTES
    if got is None:
        obs["result"] = None
        if checked_a_key:
            obs["compare_digest"] = bool(compared)
        return obs
    if not isinstance(got, ApiError):
        return dict(obs, result=type(got).__name__)
    body = got.body()
    message = str(body["error"].pop("message", None))
    obs["result"] = json.dumps(body, sort_keys=True, default=repr)
    code = body["error"].get("code")
    # Only what the contract says a message names is compared, never its wording.
    if code == "unauthorized":
        obs["names_both_headers"] = "authorization" in message.lower() and "x-api-key" in message.lower()
    elif code == "forbidden":
        obs["says_wrong_key"] = "wrong api key" in message.lower()
        obs["compare_digest"] = bool(compared)
    elif code == "route_disabled":
        obs["names_path_and_switch"] = path in message and "--allow-weight-update" in message
    return obs


# ---- a scripted HTTP server, for the client's exercises -------------------------------------

DEFAULT_REPLY = "ok"


class _Scripted(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # a reply's head and body in two writes: no 40 ms wait between them

    def log_message(self, *args):  # quiet
        pass

    def _handle(self):
        srv = self.server
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        path = self.path.split("?")[0]
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = {"unreadable": raw[:100].decode(errors="replace")}
        entry = [self.command, path, srv.summarize(path, body)]
        srv.log.append(entry)
        reply = srv.next_reply(path)
        if reply == "drop":  # the connection breaks before any answer
            self.close_connection = True
            self.connection.shutdown(2)
            return
        if reply == "ok":
            status, payload = 200, json.dumps(srv.ok_body(path, body)).encode()
            kind = "application/json"
        elif reply[0] == "error":
            _, status, code, retryable = reply
            payload = json.dumps({"error": {"code": code, "message": f"scripted {code}", "retryable": retryable,
                                            "status": status}}).encode()
            kind = "application/json"
        else:  # ["text", status]: a proxy's page, not the error shape
            status, payload, kind = reply[1], b"<html>bad gateway</html>", "text/html"
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = _handle


class ScriptedServer(ThreadingHTTPServer):
    """Answers each endpoint from ``script`` (path -> replies in turn; then success)."""

    daemon_threads = True

    def __init__(self, script: dict, log: list, aborted: int = 0, disk_bytes: int = 0):
        super().__init__(("127.0.0.1", 0), _Scripted)
        self._lock = threading.Lock()
        self.reset(script, aborted, disk_bytes, log)
        self.thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def reset(self, script: dict, aborted: int = 0, disk_bytes: int = 0, log: list | None = None):
        """A new script and an empty log (for the next scenario)."""
        with self._lock:
            self.script = {k: list(v) for k, v in script.items()}
            self.log = [] if log is None else log
            self.aborted, self.disk_bytes = aborted, disk_bytes
            self.bucket_bytes = []  # bytes of each tensor bucket received, for its reply

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def next_reply(self, path: str):
        with self._lock:
            replies = self.script.get(path.lstrip("/"), [])
            return replies.pop(0) if replies else DEFAULT_REPLY

    def summarize(self, path: str, body):
        """What a request said, comparable across processes (a tensor payload by its contents)."""
        if path != "/update_weights_from_tensor" or not isinstance(body, dict):
            return body
        out = {k: v for k, v in body.items() if k != "serialized_named_tensors"}
        payloads = body.get("serialized_named_tensors") or []
        out["payloads"], nbytes = [], 0
        for p in payloads:
            try:
                named = _decode_bucket(p)
            except Exception as exc:  # noqa: BLE001 - recorded as such
                out["payloads"].append(f"undecodable: {type(exc).__name__}")
                continue
            out["payloads"].append([[n, list(t.shape), str(t.dtype), _sha(t)] for n, t in named])
            nbytes += sum(t.numel() * t.element_size() for _, t in named)
        self.bucket_bytes.append(nbytes)
        return out

    def ok_body(self, path: str, body) -> dict:
        if path == "/pause_generation":
            return {"success": True, "num_aborted_requests": self.aborted}
        if path == "/flush_cache":
            return {"success": True, "message": "flushed"}
        if path == "/update_weights_from_tensor":
            return {"success": True, "bytes": self.bucket_bytes[-1] if self.bucket_bytes else 0}
        if path == "/update_weights_from_disk":
            return {"success": True, "bytes": self.disk_bytes}
        return {"success": True}


def _decode_bucket(payload: str):
    from course_lib.weights.transports import bucket, safe_pickle
    return bucket.unpack(safe_pickle.deserialize(payload))


def _sha(t) -> str:
    import torch
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


class _SleepLog:
    """``time.sleep`` on this thread is logged into the request log (never waited for);
    other threads sleep as usual."""

    def __init__(self, log: list):
        self.log, self.me, self.real = log, threading.get_ident(), time.sleep

    def __enter__(self):
        def sleep(seconds):
            if threading.get_ident() != self.me:
                return self.real(seconds)
            self.log.append(["sleep", seconds])
        time.sleep = sleep
        return self

    def __exit__(self, *exc):
        time.sleep = self.real


_SERVED: list = []


def _served(script: dict, aborted: int = 0, disk_bytes: int = 0):
    """This process's scripted server and a client of it (one each, made once: a client
    costs ~30 ms to make), the server's script and log set afresh for one scenario."""
    from course_lib.server.client import EngineClient
    if not _SERVED:
        server = ScriptedServer({}, [])
        _SERVED.extend([server, EngineClient(server.url, timeout=30)])
    server, client = _SERVED
    server.reset(script, aborted, disk_bytes)
    return server, client


def _error_of(exc: BaseException) -> dict:
    out = {"raised": error_kind(exc)}
    for k in ("status", "code", "retryable"):
        if hasattr(exc, k):
            out[k] = getattr(exc, k)
    return out


# ---- ch07.flush_retry ----------------------------------------------------------------------

def flush_retry(script: list, interval_s: float, tries: int) -> dict:
    """``flush_until_done(interval_s, tries)`` against a server whose ``/flush_cache``
    answers ``script`` in turn (then success): what it returned or raised, and every request
    and sleep in order."""
    server, client = _served({"flush_cache": script})
    with _SleepLog(server.log):
        try:
            got = client.flush_until_done(interval_s=interval_s, tries=tries)
            out = {"returned": got, "returned_type": type(got).__name__}
        except Exception as exc:  # noqa: BLE001 - observed
            out = _error_of(exc)
    return dict(out, log=server.log)


# ---- ch07.client_flow ----------------------------------------------------------------------

def own_flush_until_done(self, interval_s: float = 1.0, tries: int = 60) -> int:
    """The flow's flush, this file's own (so the flow is graded apart from Exercise 3)."""
    if tries < 1:
        raise ValueError("tries < 1")
    from course_lib.server.client import EngineError
    for attempt in range(1, tries + 1):
        try:
            self.flush_cache()
            return attempt
        except EngineError as exc:
            if not exc.retryable or attempt == tries:
                raise
        time.sleep(interval_s)
    raise AssertionError("unreachable")


DTYPES = ["float32", "bfloat16", "float16", "int8"]


def _tensors(seed: int, count: int):
    import torch
    r = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        shape = [r.randint(1, 12) for _ in range(r.randint(1, 2))]
        dtype = getattr(torch, r.choice(DTYPES))
        t = (torch.randint(-100, 100, shape, generator=g) if dtype == torch.int8
             else torch.randn(shape, generator=g)).to(dtype)
        out.append((f"model.layers.{i}.mlp.weight", t))
    return out


def client_flow(source: str, seed: int, count: int, bucket_bytes: int, weight_version, pause_mode,
                flush_interval_s: float, flush_tries: int, script: dict, aborted: int = 0,
                disk_bytes: int = 0, as_list: bool = False) -> dict:
    """``sync_weights`` from ``source`` ("tensors", "disk", "both", "neither") against a server
    answering each endpoint from ``script``: what it returned (the non-timing figures, the
    timing figures' types and their sum) or raised, and every request and sleep in order."""
    server, client = _served(script, aborted=aborted, disk_bytes=disk_bytes)
    tensors = _tensors(seed, count)
    named = tensors if as_list else iter(tensors)
    kwargs = {"tensors": dict(named_tensors=named), "disk": dict(model_path=f"/checkpoints/step-{seed}"),
              "both": dict(named_tensors=named, model_path=f"/checkpoints/step-{seed}"), "neither": {}}[source]
    client.flush_until_done = own_flush_until_done.__get__(client)
    try:
        with _SleepLog(server.log):
            try:
                got = client.sync_weights(weight_version=weight_version, pause_mode=pause_mode,
                                          bucket_bytes=bucket_bytes, flush_interval_s=flush_interval_s,
                                          flush_tries=flush_tries, **kwargs)
                out = {"returned": _figures(got)}
            except Exception as exc:  # noqa: BLE001 - observed
                out = _error_of(exc)
    finally:
        del client.flush_until_done
    return dict(out, log=server.log)


PHASES = ("pause_s", "flush_wait_s", "update_s", "flush_s", "continue_s")


def _figures(got) -> dict:
    """The result's keys and counts; of the seconds (timings, never compared as values) only
    their types, that none is negative, and that ``total_s`` is their sum."""
    if not isinstance(got, dict):
        return {"type": type(got).__name__}
    out = {"keys": sorted(got)}
    for k in ("flush_tries", "buckets", "bytes", "num_aborted_requests"):
        out[k] = [got.get(k), type(got.get(k)).__name__]
    secs = [got.get(k) for k in PHASES]
    numbers = all(isinstance(s, (int, float)) and not isinstance(s, bool) for s in secs)
    out["seconds_are_numbers"] = numbers
    out["seconds_not_negative"] = numbers and all(s >= 0 for s in secs)
    total = got.get("total_s")
    out["total_is_the_sum"] = (numbers and isinstance(total, (int, float))
                               and abs(total - sum(secs)) <= 1e-9 * max(1.0, abs(total)))
    return out
