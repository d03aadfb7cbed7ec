"""The one thread that owns the engine: it runs the step loop and every engine call.

The engine is not thread-safe, and a hot update must land between two steps (contract 5).
So HTTP handlers never touch the engine: they hand ``EngineWorker`` a command (a function
of the engine) and await its future. The loop runs every queued command, then one
``engine.step()``, and repeats; it sleeps on the queue while there is nothing to step.

A command may block the thread for a long time (``update_weights_from_distributed`` waits
for the trainer's broadcast); generation simply waits with it, and the HTTP event loop
stays free because handlers await futures instead of blocking.

A step that raises never stops the loop: the requests it ran end with finish_reason
``{"type": "error", "message"}`` and everything else keeps being served. A batch is queued
all or nothing, and a cancelled batch (its client disconnected) is aborted. Single
requests are ended with ``Engine.abort_request``; their outputs come out of the next step.

Streaming (``stream``): after each pass of the loop (commands, then a step), this thread
hands each streaming request's new tokens to that request's sink, and its whole output
once it finishes. The sink (the HTTP handler's, see ``streaming.py``) only schedules a
call on the event loop, so no other thread ever reads the engine. Only the Engine's
public ``requests`` (``Sequence.completion_token_ids``, ``token_versions``) are read.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from typing import Any, Callable

from course_lib.server.errors import ApiError, from_engine_exception

log = logging.getLogger("course_lib.server")
_STOP = object()


class _Batch:
    """The requests of one /generate call: resolved when the last of them finishes."""

    def __init__(self, rids: list[str], future: concurrent.futures.Future):
        self.rids, self.future, self.outputs = rids, future, {}

    def deliver(self, out: dict) -> None:
        self.outputs[out["rid"]] = out
        if len(self.outputs) == len(self.rids):
            settle(self.future, result=[self.outputs[r] for r in self.rids])


class _Stream:
    """One streaming request: where it sits in its batch, what its sink has been sent."""

    def __init__(self, index: int, sink: Callable[[tuple], None]):
        self.index, self.sink, self.sent = index, sink, 0


class StreamHandle:
    """What ``EngineWorker.stream`` returns: ``queued`` resolves with the request ids once
    they are queued (or with the refusal); ``close()`` aborts whichever still run (the
    client went away), and is harmless once they have finished."""

    def __init__(self, worker: "EngineWorker"):
        self.worker, self.rids = worker, []
        self.queued: concurrent.futures.Future = concurrent.futures.Future()

    def close(self, message: str = "the client went away") -> None:
        if not self.queued.cancelled():
            self.queued.cancel()  # not queued yet: it never will be
        if self.worker.alive:  # runs after the queueing command (commands run in order), so rids is final
            self.worker.submit(lambda e: self.worker._end_stream(self.rids, message))


def settle(future: concurrent.futures.Future, result=None, error: BaseException | None = None) -> None:
    """Resolve ``future`` unless it is already done: its HTTP caller may have gone away and
    cancelled it from another thread, which must never break the engine loop."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass


class EngineWorker:
    """Runs ``engine`` on a background thread; ``call``/``generate`` are safe from any thread."""

    def __init__(self, engine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: dict[str, _Batch] = {}  # request id -> the batch waiting for it
        self._streams: dict[str, _Stream] = {}  # request id -> its stream, until its final output
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self.error: str | None = None  # set if the loop itself died (a bug): health reports it
        self.step_errors = 0              # steps that failed and ended their requests (see _contain)
        self.last_step_error: str | None = None

    # ---- any thread --------------------------------------------------------------------
    def start(self) -> "EngineWorker":
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._commands.put(_STOP)
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the engine thread between two steps; its result or error
        (translated to an ``ApiError``) arrives on the returned future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if not self.alive:
            future.set_exception(ApiError(503, "unhealthy", f"the engine loop is not running ({self.error})"))
        else:
            self._commands.put((fn, future))
        return future

    async def call(self, fn: Callable[[Any], Any]):
        """``submit`` for async handlers: awaits without blocking the event loop."""
        return await asyncio.wrap_future(self.submit(fn))

    def call_sync(self, fn: Callable[[Any], Any], timeout: float | None = None):
        """``submit`` and wait (for tests and notebooks that hold a server in-process)."""
        return self.submit(fn).result(timeout)

    def generate(self, items: list, key: str, params: list, return_logprob: list | None = None
                 ) -> concurrent.futures.Future:
        """Queue one request per item (``key`` is "prompt" or "input_ids"); the future
        resolves with their outputs in order once every one has finished. Cancelling the
        future (its HTTP client went away) aborts whichever of its requests still run."""
        flags = return_logprob or [False] * len(items)
        done: concurrent.futures.Future = concurrent.futures.Future()
        queued: list[str] = []

        def add(engine):
            if done.cancelled():
                return
            try:
                for item, p, flag in zip(items, params, flags):
                    queued.append(engine.add_request(**{key: item}, sampling_params=p, return_logprob=flag))
            except BaseException:
                # All or nothing: the ones already queued are taken back out.
                self._end(queued, {"type": "abort", "message": "another request of its batch was refused"})
                raise
            batch = _Batch(list(queued), done)
            for rid in queued:
                self._waiting[rid] = batch

        def refused(queued_future: concurrent.futures.Future) -> None:
            if not queued_future.cancelled() and queued_future.exception() is not None:
                settle(done, error=queued_future.exception())

        def abandoned(future: concurrent.futures.Future) -> None:
            if future.cancelled():  # runs after add (commands run in order), so queued is final
                self.submit(lambda e: self._end(queued, {"type": "abort", "message": "the client went away"}))

        self.submit(add).add_done_callback(refused)
        done.add_done_callback(abandoned)
        return done

    def stream(self, items: list, key: str, params: list, return_logprob: list | None,
               sink: Callable[[tuple], None]) -> StreamHandle:
        """Queue one request per item, all or nothing, and stream them: ``sink`` is called
        on the engine thread with ``("tokens", index, new)`` for new tokens (a dict: see
        ``_push_progress``), ``("final", index, output)`` once a request finished, and
        ``("error", index, ApiError)`` if the engine loop stops serving it. ``sink`` must
        not block (it hands the event to another thread) and must not touch the engine."""
        flags = return_logprob or [False] * len(items)
        handle = StreamHandle(self)

        def add(engine):
            if not handle.queued.set_running_or_notify_cancel():
                return  # the client left before the engine thread took the batch up
            try:
                for item, p, flag in zip(items, params, flags):
                    handle.rids.append(engine.add_request(**{key: item}, sampling_params=p, return_logprob=flag))
            except BaseException as exc:
                self._end(handle.rids, {"type": "abort", "message": "another request of its batch was refused"})
                handle.rids.clear()
                handle.queued.set_exception(self._translate(exc))
                return
            for index, rid in enumerate(handle.rids):
                self._streams[rid] = _Stream(index, sink)
            handle.queued.set_result(list(handle.rids))

        self.submit(add).add_done_callback(
            lambda f: settle(handle.queued, error=f.exception()) if not f.cancelled() and f.exception() else None)
        return handle

    async def generate_async(self, items: list, key: str, params: list, return_logprob: list | None = None
                             ) -> list[dict]:
        return await asyncio.wrap_future(self.generate(items, key, params, return_logprob))

    def _end(self, rids: list[str], reason: dict) -> None:
        """Finish these requests now (engine thread) with ``reason``; their outputs come out
        of the next ``engine.step()`` and are delivered from there. Finished ones are skipped."""
        for rid in rids:
            self.engine.abort_request(rid, reason["message"], reason["type"])

    def _end_stream(self, rids: list[str], message: str) -> None:
        """Abort a stream's unfinished requests (engine thread); nothing is sent to its
        sink any more. Their outputs still come out of the next step, to nobody."""
        for rid in rids:
            self._streams.pop(rid, None)
        self._end(rids, {"type": "abort", "message": message})

    # ---- the engine thread -------------------------------------------------------------
    def _steppable(self) -> bool:
        e = self.engine
        if e.unhealthy or not e.has_unfinished_requests():
            return False
        return not e.paused or e.pause_mode == "wait"  # only wait mode keeps stepping while paused

    def _loop(self) -> None:
        try:
            while True:
                items = []
                try:  # sleep on the queue only when there is nothing to step
                    items.append(self._commands.get(block=not self._steppable()))
                    while True:
                        items.append(self._commands.get_nowait())
                except queue.Empty:
                    pass
                for item in items:
                    if item is not _STOP:
                        self._run(*item)
                if any(item is _STOP for item in items):
                    break
                self._step()
                if self._streams:
                    self._push_progress()
        except BaseException as exc:  # a bug in this loop: fail loudly, never hang callers
            self.error = f"{type(exc).__name__}: {exc}"
            log.exception("engine loop died")
            raise
        finally:
            self._fail_waiters(ApiError(503, "unhealthy", "the engine loop stopped"))
            while True:  # commands that arrived too late
                try:
                    item = self._commands.get_nowait()
                except queue.Empty:
                    break
                if item is not _STOP:
                    settle(item[1], error=ApiError(503, "unhealthy", "the engine loop stopped"))

    def _run(self, fn, future: concurrent.futures.Future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            result = fn(self.engine)
        except BaseException as exc:  # noqa: BLE001 - every error goes back to its caller
            future.set_exception(self._translate(exc))
        else:
            future.set_result(result)

    def _translate(self, exc: BaseException) -> ApiError:
        """``exc`` as the error its caller gets. A translation that itself fails (a bug, or
        the student edition's unwritten stub) becomes a 500 naming that failure, and the
        engine loop keeps running."""
        try:
            return from_engine_exception(exc, self.engine)
        except Exception as bug:  # noqa: BLE001 - the loop must outlive a broken translation
            return ApiError(500, "internal", f"{type(bug).__name__}: {bug} (while reporting "
                                             f"{type(exc).__name__}: {exc})")

    def _step(self) -> None:
        # step() also hands back outputs that finished outside a step (aborted by a pause
        # or an update), so it runs after every batch of commands, even while paused.
        if self.engine.unhealthy:
            self._fail_waiters(self._translate(RuntimeError(self.engine.unhealthy)))
            return
        before = {seq.rid for seq in self.engine.scheduler.running}
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - contained: see _contain
            if self.engine.unhealthy:
                self._fail_waiters(self._translate(exc))
                return
            outputs = self._contain(exc, before)
        self._deliver(outputs)

    def _deliver(self, outputs: list[dict]) -> None:
        for out in outputs:
            stream = self._streams.pop(out["rid"], None)
            if stream is not None:
                self._send(stream, ("final", stream.index, out))
            batch = self._waiting.pop(out["rid"], None)  # None: a duplicate, or nobody waits
            if batch is not None:
                batch.deliver(out)

    def _push_progress(self) -> None:
        """Hand each streaming request's tokens made since the last push to its sink: the
        new ids, each one's weight version and (when asked for) logprob. A request that
        finished is not here any more: ``_deliver`` sent its whole output."""
        for rid, stream in self._streams.items():
            seq = self.engine.requests.get(rid)
            if seq is None or seq.num_completion_tokens <= stream.sent:
                continue
            ids = seq.completion_token_ids[stream.sent:]
            n = stream.sent + len(ids)
            versions = list(seq.token_versions[stream.sent:n])
            versions += [None] * (len(ids) - len(versions))  # a tag not written yet (chapter 02 unsolved)
            logprobs = seq.output_logprobs[stream.sent:n] if seq.return_logprob else None
            update = {"ids": ids, "versions": versions, "logprobs": logprobs,
                      "prompt_tokens": seq.num_prompt_tokens, "rid": rid}
            stream.sent = n
            self._send(stream, ("tokens", stream.index, update))

    def _send(self, stream: _Stream, event: tuple) -> None:
        try:
            stream.sink(event)
        except Exception:  # noqa: BLE001 - a closed event loop (server stopping) must not stop this one
            log.debug("stream sink refused an event", exc_info=True)

    def _contain(self, exc: Exception, before: set[str]) -> list[dict]:
        """A step failed (say NaN logits from NaN weights): end the requests it was running
        with finish_reason ``error``, so the next step does not fail the same way forever,
        and keep serving everyone else. The step's batch is the requests a prefill admitted
        (running now, not before), or else every running request (a decode step)."""
        running = list(self.engine.scheduler.running)
        batch = [seq.rid for seq in running if seq.rid not in before] or [seq.rid for seq in running]
        if not batch:  # nothing ran, yet the step failed: end everything queued, never spin
            batch = list(self.engine.requests)
        message = f"{type(exc).__name__}: {exc}"
        self.step_errors += 1
        self.last_step_error = message
        log.error("engine step failed; ending its %d requests", len(batch), exc_info=exc)
        self._end(batch, {"type": "error", "message": message})
        return []  # their outputs come out of the next step

    def _fail_waiters(self, error: ApiError) -> None:
        for batch in set(self._waiting.values()):
            settle(batch.future, error=error)
        self._waiting.clear()
        for stream in self._streams.values():
            self._send(stream, ("error", stream.index, error))
        self._streams.clear()
