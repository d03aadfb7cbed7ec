"""The serve-load benchmark's other processes: the server and the trainer.

The server runs in a process of its own (the HTTP app and its engine thread, as
``python -m course_lib serve`` runs them), so the load clients never share its
interpreter. It binds 127.0.0.1 on a free port and says which over a pipe. With a trace
(``server/step_trace.py``) it then answers, over the same pipe, each request for what the
trace holds of a window of time.

The trainer (a stand-in, like ``weights/transports/trainer.py``'s) holds the weights of
every checkpoint in memory, registers its buffers with the server once, then, on the
parent's word, makes an update every ``every_s`` seconds until the deadline or its count,
each one as an RL trainer does over HTTP: pause (the mode cycles abort, wait, keep,
retract), flush until the server agrees (so wait mode's requests run to their end first),
the update (the transport cycles registered buffers, a flattened tensor bucket, disk), then
continue. Each update's record goes back to the parent as soon as it is done.
"""
from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
import time
import traceback

TRANSPORTS = ("registered", "tensor", "disk")
PAUSE_MODES = ("abort", "wait", "keep", "retract")
CTX = mp.get_context("spawn")  # forked children hang on torch's thread pools


def serve_child(path, device: str, engine_kwargs: dict, conn, trace: bool = False) -> None:
    """The server process: an engine on ``path``, the app with weight routes on, 127.0.0.1."""
    import threading

    import uvicorn

    from course_lib import Engine
    from course_lib.server.app import create_app
    from course_lib.server.runner import bind
    from course_lib.server.step_trace import StepTrace
    from course_lib.weights.transports.trainer import share_cores

    share_cores(device)  # on a CPU, the clients and the trainer need cores too (see share_cores)
    engine = Engine(path, device=device, **engine_kwargs)
    app = create_app(engine, allow_weight_update=True)
    sock = bind("127.0.0.1", 0)
    gc.freeze()  # as ``python -m course_lib serve`` does: the engine is never walked by the collector again
    conn.send(sock.getsockname()[1])
    if trace:
        tracer = StepTrace().attach(app.state.worker)
        threading.Thread(target=answer_trace_requests, args=(conn, tracer), name="trace-pipe", daemon=True).start()
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])


def answer_trace_requests(conn, tracer) -> None:
    """Serve the parent's (start, end) requests with ``tracer.snapshot(start, end)``."""
    while True:
        try:
            start, end = conn.recv()
            conn.send(tracer.snapshot(start, end))
        except (EOFError, OSError):
            return


class ServerProcess:
    """Start with ``start()`` (returns the URL once /health answers), end with ``stop()``;
    with ``trace``, ``trace(start, end)`` returns the server's trace of that window."""

    def __init__(self, path, device: str, engine_kwargs: dict, trace: bool = False):
        self.parent, child = CTX.Pipe()
        self.process = CTX.Process(target=serve_child, args=(str(path), device, engine_kwargs, child, trace),
                                   daemon=True)
        self._child_end = child
        self.traced = trace

    def start(self, timeout: float = 900.0) -> str:
        import httpx

        self.process.start()
        self._child_end.close()  # so a child that dies shows as the pipe's end
        port = receive(self.parent, self.process, timeout, "the server")
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"the server on {self.url} never became healthy")

    def trace(self, start: float, end: float, timeout: float = 120.0) -> dict:
        if not self.traced:
            raise RuntimeError("this server was started without a trace")
        self.parent.send((start, end))
        return receive(self.parent, self.process, timeout, "the server's trace")

    def stop(self, timeout: float = 30.0) -> None:
        from course_lib.weights.transports.trainer import wait_for_exit

        if self.process.exitcode is None:
            # uvicorn shuts down gracefully (the engine thread stops), then dies of the signal
            # it caught: SIGTERM ends it quietly, where SIGINT would print a KeyboardInterrupt.
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                wait_for_exit(self.process, timeout)
            except TimeoutError:
                self.process.kill()


def receive(conn, process, timeout: float, who: str):
    """The next message from ``process`` over ``conn``, or a clear error if it died or hung."""
    deadline = time.monotonic() + timeout
    while not conn.poll(0.2):
        if process.exitcode is not None:
            raise RuntimeError(f"{who} exited with code {process.exitcode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{who} sent nothing within {timeout} s")
    try:
        return conn.recv()
    except EOFError:
        raise RuntimeError(f"{who} closed its pipe (exit code {process.exitcode})") from None


def trainer_child(url: str, ckpts: list, device: str, every_s: float, max_updates: int, bucket_bytes: int,
                  conn, one_call: bool = False) -> None:
    """The trainer process; see the module docstring. Messages to the parent: ("ready", info),
    ("update", record) per update, ("done", None) or ("failed", traceback)."""
    try:
        _train(url, ckpts, device, every_s, max_updates, bucket_bytes, conn, one_call)
        conn.send(("done", None))
    except BaseException:  # noqa: BLE001 - the parent reports it
        conn.send(("failed", traceback.format_exc()))


def _train(url, ckpts, device, every_s, max_updates, bucket_bytes, conn, one_call: bool = False) -> None:
    from course_lib.server.client import EngineClient
    from course_lib.weights.checkpoint import CheckpointReader
    from course_lib.weights.transports.ipc import BucketSender
    from course_lib.weights.transports.registered import RegisteredSender
    from course_lib.weights.transports.trainer import share_cores

    share_cores(device)
    weights = [[(n, t.to(device)) for n, t in CheckpointReader(p).iter_tensors()] for p in ckpts]
    with EngineClient(url, timeout=600) as client:
        registered = RegisteredSender(weights[0], bucket_bytes, device, num_buffers=2)
        registered.epoch = client.register_weight_buffers(registered.registration())["epoch"]
        senders = {"registered": registered, "tensor": BucketSender(bucket_bytes, device)}
        one_call = one_call and client.offers_one_call()  # the server's /sync_weights, where it has one
        conn.send(("ready", {"buckets": registered.num_buckets, "one_call": one_call}))
        start, deadline = conn.recv()  # the parent's word: when the loaded phase starts and ends
        for k in range(1, max_updates + 1):
            at = start + k * every_s
            if at >= deadline:
                break
            time.sleep(max(0.0, at - time.monotonic()))
            update = one_update_in_one_call if one_call else one_update
            conn.send(("update", update(client, k, ckpts, weights, senders)))
        client.unregister_weight_buffers()


def one_update(client, k: int, ckpts, weights, senders) -> dict:
    """Update ``k``: pause, flush, the update, continue; its record (times are monotonic)."""
    transport, mode = TRANSPORTS[(k - 1) % len(TRANSPORTS)], PAUSE_MODES[(k - 1) % len(PAUSE_MODES)]
    target = k % len(ckpts)
    rec = {"update": k, "transport": transport, "mode": mode, "version": f"u{k}", "checkpoint": target,
           "own_ms": 0.0, "messages": 0, "error": None, "t_done": None}
    rec["t_pause_sent"] = time.monotonic()
    try:
        rec["num_aborted_requests"] = client.pause_generation(mode)["num_aborted_requests"]
        rec["t_paused"] = time.monotonic()
        rec["flush_tries"] = client.flush_until_done(interval_s=0.01, tries=6000)  # wait mode: until drained
        rec["t_update_start"] = time.monotonic()
        for reply in send_update(client, transport, rec["version"], ckpts[target], weights[target], senders):
            rec["own_ms"] += reply.get("elapsed_ms", 0.0)
            rec["messages"] += 1
        rec["t_update_end"] = time.monotonic()
        client.continue_generation()
        rec["t_done"] = time.monotonic()
    except Exception as exc:  # noqa: BLE001 - an HTTP error, a refusal, a sender's check: recorded
        rec["error"] = f"{type(exc).__name__}: {exc}"
        try:  # serve on rather than leave the load paused; the record says what happened
            client.continue_generation()
        except Exception as again:  # noqa: BLE001
            rec["error"] += f"; continue_generation failed too: {again}"
    return rec


def one_update_in_one_call(client, k: int, ckpts, weights, senders) -> dict:
    """Update ``k`` as ``one_update`` does, with no call of its own for the pause, the flush
    or the continue: the pause rides on the update's first message, the continue on its
    last (``/sync_weights``); the engine's own flush and drain replace the client's."""
    transport, mode = TRANSPORTS[(k - 1) % len(TRANSPORTS)], PAUSE_MODES[(k - 1) % len(PAUSE_MODES)]
    target = k % len(ckpts)
    rec = {"update": k, "transport": transport, "mode": mode, "version": f"u{k}", "checkpoint": target,
           "own_ms": 0.0, "messages": 0, "error": None, "t_done": None, "one_call": True, "flush_tries": 0}
    rec["t_pause_sent"] = rec["t_paused"] = rec["t_update_start"] = time.monotonic()
    try:
        for reply in send_update(client, transport, rec["version"], ckpts[target], weights[target], senders, mode):
            rec["own_ms"] += reply.get("elapsed_ms", 0.0)
            rec["messages"] += 1
            rec.setdefault("num_aborted_requests", reply.get("num_aborted_requests", 0))
        rec["t_update_end"] = rec["t_done"] = time.monotonic()
    except Exception as exc:  # noqa: BLE001 - recorded; the server continued unless a weight changed
        rec["error"] = f"{type(exc).__name__}: {exc}"
        try:
            if client.health().get("paused"):  # a later message failed: serve on, as one_update does
                client.continue_generation()
        except Exception as again:  # noqa: BLE001
            rec["error"] += f"; continue_generation failed too: {again}"
    return rec


def send_update(client, transport: str, version: str, path, tensors, senders, one_call_mode: str | None = None):
    """The update's replies, one per message; the version label changes with the last one,
    which also flushes the prefix cache. ``one_call_mode``: each message goes to
    ``/sync_weights``, the first pausing in that mode, the last continuing."""
    from course_lib.weights.transports import bucket, safe_pickle

    if transport == "disk":
        yield send_one(client, "disk", {"model_path": str(path), "weight_version": version, "flush_cache": True},
                       one_call_mode, first=True, last=True)
    elif transport == "tensor":
        sender, first = senders["tensor"], True
        for receipt, payload in sender.payloads(tensors):
            reply = send_one(client, "tensor", {"serialized_named_tensors": [payload], "load_format": "flattened_bucket",
                                                "flush_cache": False}, one_call_mode, first=first, last=False)
            sender.release(receipt)  # the reply means the server is done reading it
            first = False
            yield reply
        empty = safe_pickle.serialize(bucket.pack([]))
        yield send_one(client, "tensor", {"serialized_named_tensors": [empty], "load_format": "flattened_bucket",
                                          "flush_cache": True, "weight_version": version},
                       one_call_mode, first=first, last=True)
    else:
        sender = senders["registered"]
        for i, (receipt, message) in enumerate(sender.payloads(tensors)):
            last = i == sender.num_buckets - 1
            fields = {"buckets": message["buckets"], "epoch": message["epoch"],
                      "weight_version": version if last else None, "flush_cache": last}
            reply = send_one(client, "registered", fields, one_call_mode, first=i == 0, last=last)
            sender.release(receipt)
            yield reply


SEPARATE = {"disk": "update_weights_from_disk", "tensor": "update_weights_from_tensor",
            "registered": "update_weights_from_registered"}


def send_one(client, transport: str, fields: dict, one_call_mode: str | None, first: bool, last: bool) -> dict:
    """One message of an update: to its SGLang route, or to ``/sync_weights`` with the pause
    (first message) and the continue (last message)."""
    if one_call_mode is None:
        return client.request("POST", "/" + SEPARATE[transport], json=fields)
    return client.update_in_one_call(transport, pause_mode=one_call_mode if first else None,
                                     resume=True if last else (False if first else None), **fields)


class TrainerProcess:
    """``start()`` waits until it registered its buffers; ``go(start, deadline)`` lets it
    update; ``poll()`` collects the records that arrived; ``finish()`` waits for its end."""

    def __init__(self, url: str, ckpts: list, device: str, every_s: float, max_updates: int, bucket_bytes: int,
                 one_call: bool = False):
        self.parent, child = CTX.Pipe()
        self.process = CTX.Process(target=trainer_child, daemon=True, args=(
            url, [str(p) for p in ckpts], device, every_s, max_updates, bucket_bytes, child, one_call))
        self._child_end = child
        self.updates: list[dict] = []
        self.failure: str | None = None
        self.finished = False

    def start(self, timeout: float = 900.0) -> dict:
        self.process.start()
        self._child_end.close()
        kind, info = receive(self.parent, self.process, timeout, "the trainer")
        if kind != "ready":
            raise RuntimeError(f"the trainer failed to start:\n{info}")
        return info

    def go(self, start: float, deadline: float) -> None:
        self.parent.send((start, deadline))

    def poll(self) -> None:
        while not self.finished and self.parent.poll():
            try:
                kind, info = self.parent.recv()
            except EOFError:
                self.failure, self.finished = f"the trainer died (exit code {self.process.exitcode})", True
                return
            if kind == "update":
                self.updates.append(info)
            else:
                self.finished = True
                self.failure = info if kind == "failed" else None

    def finish(self, timeout: float = 600.0) -> None:
        from course_lib.weights.transports.trainer import wait_for_exit

        deadline = time.monotonic() + timeout
        while not self.finished and time.monotonic() < deadline:
            if not self.parent.poll(0.2) and self.process.exitcode is not None:
                self.poll()
                if not self.finished:
                    self.failure, self.finished = f"the trainer exited with code {self.process.exitcode}", True
                break
            self.poll()
        if not self.finished:
            self.failure = f"the trainer did not finish within {timeout} s"
            self.process.kill()
        try:
            wait_for_exit(self.process, 60)
        except TimeoutError:
            self.process.kill()
