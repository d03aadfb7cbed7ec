"""The HTTP API: SGLang's weight-sync protocol over one engine (see shared PROTOCOL.md).

``create_app(engine, ...)`` returns a FastAPI app whose handlers never touch the engine
themselves: each hands ``EngineWorker`` a small function of the engine and awaits it, so
every engine call runs on the engine's own thread between two steps. Payload decoding
(base64 and the allowlisted unpickler) runs in a thread pool, off both that thread and
the event loop. Three routes are ours, not SGLang's: registered buffers (register once,
then update by bucket numbers; ``add_registered_routes``), in the same style as the rest.

Every request field is checked here or in ``schemas`` (a 400 naming the field) before the
engine sees it; a /generate whose client disconnects has its requests aborted; NaN and
infinite floats in responses are spelled "NaN", "Infinity", "-Infinity" (valid JSON).
``"stream": true`` answers server-sent events (``streaming.py``), once every prompt is
queued: a refusal (paused, too long) is still a plain error reply with its status.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
from dataclasses import replace

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from course_lib.engine.sequence import SamplingParams
from course_lib.server import schemas as s
from course_lib.server import streaming
from course_lib.server.errors import ApiError, from_engine_exception, install_handlers
from course_lib.server.guard import GuardMiddleware
from course_lib.server.worker import EngineWorker
from course_lib.update import payload as tensor_payload
from course_lib.update.records import UpdateOptions
from course_lib.update.sources import BroadcastSource, DiskSource, RegisteredSource, TensorSource
from course_lib.weights.transports import safe_pickle

DEFAULT_MAX_BODY_BYTES = 64 << 20


# A prompt's characters against the context: the byte tokenizer makes at least one token per
# character, so a text over this many characters per context token cannot fit, and is refused
# before it is tokenized (a 50 MB prompt must not cost 500 MB and seconds of the engine thread).
# A shorter one that still does not fit is refused by the engine after tokenizing.
MAX_CHARS_PER_TOKEN = 4
DISCONNECT_POLL_S = 0.05  # how often a waiting /generate or weight update checks that its client is still there


def finite(obj):
    """``obj`` with every NaN or infinite float spelled as the string "NaN", "Infinity" or
    "-Infinity" (the names JavaScript and Python's ``float()`` read back), so a response
    holding them is still valid JSON (NaN weights, -inf logprobs)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "NaN" if obj != obj else ("Infinity" if obj > 0 else "-Infinity")
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def check_prompt(item, where: str, engine) -> None:
    """One prompt (text or token ids), checked against the model before anything is queued."""
    limit, vocab = engine.config.max_model_len, engine.model_config.vocab_size
    if isinstance(item, str):
        if not item:
            raise ApiError(400, "bad_request", f"{where}: the prompt is empty")
        if len(item) >= limit * MAX_CHARS_PER_TOKEN:
            raise ApiError(400, "prompt_too_long", f"{where}: {len(item)} characters cannot fit the context of "
                                                   f"{limit} tokens (max_model_len)")
        return
    if not item:
        raise ApiError(400, "bad_request", f"{where}: the prompt is empty")
    if len(item) >= limit:
        raise ApiError(400, "prompt_too_long", f"{where}: {len(item)} tokens; the context holds {limit} "
                                               f"(max_model_len), leaving no room to generate")
    bad = [t for t in item if not 0 <= t < vocab]
    if bad:
        raise ApiError(400, "bad_request", f"{where}: token ids {bad[:5]} are outside the vocabulary [0, {vocab})")


def generate_inputs(req: s.GenerateRequest, engine) -> tuple[list, str, list[SamplingParams], list[bool], bool]:
    """(items, "prompt" or "input_ids", sampling params per item, return_logprob per item,
    whether it was a batch), every item checked before any is queued (400 naming it)."""
    if (req.text is None) == (req.input_ids is None):
        raise ApiError(400, "bad_request", "give exactly one of text or input_ids")
    if req.text is not None:
        batched = isinstance(req.text, list)
        items, key, field = (req.text if batched else [req.text]), "prompt", "text"
    else:
        batched = bool(req.input_ids) and isinstance(req.input_ids[0], list)
        items, key, field = (req.input_ids if batched else [req.input_ids]), "input_ids", "input_ids"
    if not items:
        raise ApiError(400, "bad_request", "the batch is empty")
    for i, item in enumerate(items):
        check_prompt(item, f"{field}[{i}]" if batched else field, engine)
    raw = req.sampling_params
    if isinstance(raw, list):
        if len(raw) != len(items):
            raise ApiError(400, "bad_request", f"{len(raw)} sampling_params for {len(items)} prompts")
        named = [(f"sampling_params[{i}]", p) for i, p in enumerate(raw)]
    else:
        named = [("sampling_params", raw)]
    params = []
    for where, p in named:
        try:
            params.append(SamplingParams.coerce(p))
        except (ValueError, TypeError) as exc:
            raise ApiError(400, "bad_request", f"bad {where}: {exc}") from None
    params = params if len(params) == len(items) else params * len(items)
    flags = req.return_logprob if isinstance(req.return_logprob, list) else [bool(req.return_logprob)] * len(items)
    if len(flags) != len(items):
        raise ApiError(400, "bad_request", f"{len(flags)} return_logprob flags for {len(items)} prompts")
    return items, key, params, flags, batched


async def unless_disconnected(request: Request, future: asyncio.Future):
    """Await ``future``; if the client goes away first, cancel it (the worker then aborts
    the requests nobody will read, or never runs an update nobody waits for) and answer
    499, which nobody receives."""
    while True:
        done, _ = await asyncio.wait({future}, timeout=DISCONNECT_POLL_S)
        if done:
            return future.result()
        if await request.is_disconnected():
            future.cancel()
            raise ApiError(499, "client_closed", "the client closed the connection; its requests were aborted")


async def call_unless_disconnected(worker: EngineWorker, request: Request, fn):
    """``worker.call(fn)``, except that ``fn`` never runs if the client is gone before the
    engine thread takes it up (see ``unless_disconnected``)."""
    return await unless_disconnected(request, asyncio.wrap_future(worker.submit(fn)))

async def stream_generate(worker: EngineWorker, request: Request, items, key, params, flags, batched,
                          tokenizer) -> streaming.EventStreamResponse:
    """Queue the prompts as streams, wait until they are queued (a refusal is an ordinary
    error reply), then answer the event stream; a client gone before the end has whatever
    still runs aborted."""
    loop, queue = asyncio.get_running_loop(), asyncio.Queue()
    handle = worker.stream(items, key, params, flags,
                           sink=lambda event: loop.call_soon_threadsafe(queue.put_nowait, event))
    try:
        await unless_disconnected(request, asyncio.wrap_future(handle.queued))
    except BaseException:
        handle.close()
        raise
    streams = [streaming.RequestStream(i, tokenizer.decode, flag) for i, flag in enumerate(flags)]

    def on_close() -> None:
        if not all(s.finished for s in streams):
            handle.close()
    return streaming.EventStreamResponse(streaming.events(queue, streams, batched, finite), on_close)


def create_app(engine, allow_weight_update: bool = False, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """An app serving ``engine``; the engine thread starts and stops with the app."""
    worker = EngineWorker(engine)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        worker.start()
        try:
            yield
        finally:
            worker.stop()

    app = FastAPI(title="course_lib engine", lifespan=lifespan)
    app.state.worker = worker
    app.add_middleware(GuardMiddleware, api_key=api_key, allow_weight_update=allow_weight_update,
                       max_body_bytes=max_body_bytes)
    install_handlers(app)
    add_serving_routes(app, engine, worker)
    add_update_routes(app, engine, worker)
    add_registered_routes(app, engine, worker)
    add_group_routes(app, engine, worker)
    add_read_routes(app, worker)
    return app


def add_serving_routes(app: FastAPI, engine, worker: EngineWorker) -> None:
    """/health, /generate, pausing and flushing."""

    @app.get("/health")
    async def health():
        # Read without the engine thread, so a long update cannot make the server look dead.
        e = engine
        state = {"healthy": e.unhealthy is None and worker.alive, "reason": e.unhealthy or worker.error,
                 "paused": e.paused, "pause_mode": e.pause_mode, "weight_version": e.weight_version,
                 "weight_update_count": e.weight_update_count, "num_running": len(e.scheduler.running),
                 "num_waiting": len(e.scheduler.waiting), "step_errors": worker.step_errors,
                 "last_step_error": worker.last_step_error}
        if not state["healthy"]:
            return ApiError(503, "unhealthy", f"engine is not serving: {state['reason']}").response()
        return state

    @app.post("/generate")
    async def generate(req: s.GenerateRequest, request: Request):
        items, key, params, flags, batched = generate_inputs(req, engine)
        if req.stream:
            return await stream_generate(worker, request, items, key, params, flags, batched, engine.tokenizer)
        future = asyncio.wrap_future(worker.generate(items, key, params, flags))
        outputs = await unless_disconnected(request, future)
        outputs = [finite({k: v for k, v in out.items() if k != "rid"}) for out in outputs]  # meta_info.id has it
        return JSONResponse(outputs if batched else outputs[0])

    @app.post("/pause_generation")
    async def pause_generation(req: s.PauseRequest | None = None):
        mode = (req or s.PauseRequest()).mode
        return await worker.call(lambda e: e.pause_generation(mode))

    @app.post("/continue_generation")
    async def continue_generation():
        return await worker.call(lambda e: e.continue_generation())

    def flush(e):
        if not e.flush_cache():
            n = len(e.scheduler.running) + len(e.scheduler.waiting)
            # SGLang answers 400 here too; clients (slime) retry until the requests are gone.
            raise ApiError(400, "requests_in_flight", f"cache not flushed: {n} requests are running or waiting; "
                                                      f"pause generation or let them finish, then retry",
                           retryable=True)
        return {"success": True, "entries_cleared": e.last_flush_entries, "message": "prefix cache flushed"}

    @app.get("/flush_cache")
    async def flush_cache_get(timeout: float | None = Query(default=None)):
        return await worker.call(flush)

    @app.post("/flush_cache")
    async def flush_cache_post(req: s.FlushRequest | None = None):
        return await worker.call(flush)


# ---- updates: one route per transport, each a source built from the request -------------------
# A weight update whose client is gone before the engine takes it up is not applied: a
# trainer killed with buckets in flight must not have them land after it (they would be
# acknowledged to nobody). One the engine has begun is finished: a bucket is whole or not at all.

async def disk_source(req: s.DiskUpdateRequest, engine) -> DiskSource:
    return DiskSource(await run_in_threadpool(s.checkpoint_dir, req))  # stat calls: off the event loop


async def tensor_source(req: s.TensorUpdateRequest, engine) -> TensorSource:
    """The payload decoded once, in the thread pool: the unpickling stays off the engine
    thread and the event loop (``update/payload.py``). A flattened bucket's entries are
    checked on the engine thread, after the pause rules, as an in-process caller's are (a
    bad bucket posted while requests run unpaused is refused as busy, 409, first); what is
    not even shaped like a bucket is refused here (400)."""
    try:
        decoded = await run_in_threadpool(tensor_payload.decode, req.serialized_named_tensors, req.load_format,
                                          engine.config.tp_rank)
    except Exception as exc:  # noqa: BLE001 - unsafe pickles and bad payloads become 400s
        raise from_engine_exception(exc, engine) from None
    return TensorSource(decoded, req.load_format)


async def registered_source(req: s.RegisteredUpdateRequest, engine) -> RegisteredSource:
    return RegisteredSource(req.buckets, req.epoch)


async def broadcast_source(req: s.DistributedUpdateRequest, engine) -> BroadcastSource:
    s.check_announced_tensors(req)
    return BroadcastSource(req.names, req.dtypes, req.shapes, req.group_name, req.load_format)


# path -> (request body, the source it builds, whether a client that left cancels it). A
# broadcast is not cancelled: the trainer is pushing its bytes, and they must be taken.
UPDATE_ROUTES = {
    "/update_weights_from_disk": (s.DiskUpdateRequest, disk_source, True),
    "/update_weights_from_tensor": (s.TensorUpdateRequest, tensor_source, True),
    "/update_weights_from_registered": (s.RegisteredUpdateRequest, registered_source, True),
    "/update_weights_from_distributed": (s.DistributedUpdateRequest, broadcast_source, False),
}


def update_options(req) -> UpdateOptions:
    return UpdateOptions(weight_version=s.version_text(req.weight_version), flush_cache=req.flush_cache,
                         abort_all_requests=req.abort_all_requests)


def add_update_route(app: FastAPI, engine, worker: EngineWorker, path: str, body, build, cancellable: bool) -> None:
    async def route(req, request: Request):
        source, options = await build(req, engine), update_options(req)
        if cancellable:
            return await call_unless_disconnected(worker, request, lambda e: e.update(source, options))
        # Blocks the engine thread until the trainer's broadcast has arrived; the event loop only awaits.
        return await worker.call(lambda e: e.update(source, options))
    route.__annotations__ = {"req": body, "request": Request}  # real types: FastAPI reads the body's schema
    app.post(path, name=path.strip("/"))(route)


async def json_body(request: Request) -> dict:
    """The request's JSON object, or a 400 ``bad_json`` / 422 naming what is wrong."""
    try:
        fields = json.loads(await request.body() or b"{}")
    except ValueError as exc:
        raise ApiError(400, "bad_json", f"request body is not valid JSON ({exc})") from None
    if not isinstance(fields, dict):
        raise ApiError(422, "invalid_request", "body: the request must be a JSON object")
    return fields


def add_update_routes(app: FastAPI, engine, worker: EngineWorker) -> None:
    """Updates (``UPDATE_ROUTES``), one call per update (``/sync_weights``), the version label."""
    for path, (body, build, cancellable) in UPDATE_ROUTES.items():
        add_update_route(app, engine, worker, path, body, build, cancellable)

    @app.post("/sync_weights")
    async def sync_weights(request: Request):
        """Ours, beside SGLang's routes: one request carries an update (``transport`` and that
        route's own fields) and how requests in flight are treated (``pause_mode``, ``resume``):
        the engine pauses, updates and continues between two of its steps (``update/one_call.py``)."""
        fields = await json_body(request)
        try:  # the same checks, and the same 422, as a route's own body gets
            call = s.OneCallRequest.model_validate(fields)
            body, build, cancellable = UPDATE_ROUTES[f"/update_weights_from_{call.transport}"]
            req = body.model_validate(fields)
        except ValidationError as exc:
            raise RequestValidationError(exc.errors()) from None
        source = await build(req, engine)
        options = replace(update_options(req), pause_mode=call.pause_mode, resume=call.resume)
        if cancellable:
            return await call_unless_disconnected(worker, request, lambda e: e.update(source, options))
        return await worker.call(lambda e: e.update(source, options))

    @app.post("/update_weight_version")
    async def update_weight_version(req: s.VersionRequest):
        return await worker.call(lambda e: e.update_weight_version(str(req.new_version)))


def add_registered_routes(app: FastAPI, engine, worker: EngineWorker) -> None:
    """Registered buffers (weights/commit/copy_table.py): the layout once, then bucket numbers."""

    @app.post("/register_weight_buffers")
    async def register_weight_buffers(req: s.RegisterRequest, request: Request):
        try:  # maps the trainer's buffers: off the engine thread, like a tensor payload
            payload = await run_in_threadpool(safe_pickle.deserialize, req.serialized_payload)
        except Exception as exc:  # noqa: BLE001 - unsafe or malformed pickles become 400s
            raise from_engine_exception(exc, engine) from None
        # A registration nobody waits for is not made: it would replace the live one (a new
        # epoch) and refuse the updates of the trainer still sending for it.
        return await call_unless_disconnected(worker, request, lambda e: e.register_weight_buffers(
            payload, partial=req.partial, copy_mode=req.copy_mode))

    @app.post("/unregister_weight_buffers")
    async def unregister_weight_buffers():
        return await worker.call(lambda e: e.unregister_weight_buffers())


def add_group_routes(app: FastAPI, engine, worker: EngineWorker) -> None:
    """torch.distributed weight-update groups: join and leave (the broadcast is an update route)."""

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(req: s.InitGroupRequest):
        s.check_backend(req.backend, engine.config.device)
        if req.rank_offset + getattr(engine.model, "tp_rank", 0) > 0:
            # The trainer hosts the rendezvous: see that it listens before the engine thread
            # joins, so a closed port or a dead host costs this request, not generation.
            await run_in_threadpool(s.probe_rendezvous, req.master_address, req.master_port)
        # The join itself blocks the engine thread until every rank has joined (bounded by
        # the group's connect timeout, dist.CONNECT_TIMEOUT_S).
        return await worker.call(lambda e: e.init_weights_update_group(
            req.master_address, req.master_port, req.rank_offset, req.world_size, req.group_name, req.backend))

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(req: s.DestroyGroupRequest | None = None):
        name = (req or s.DestroyGroupRequest()).group_name
        return await worker.call(lambda e: e.destroy_weights_update_group(name))


def add_read_routes(app: FastAPI, worker: EngineWorker) -> None:
    """Versions and weight values (NaN and infinities as strings, see ``finite``)."""

    @app.get("/get_weight_version")
    async def get_weight_version():
        return await worker.call(lambda e: {"weight_version": e.get_weight_version(),
                                            "weight_update_count": e.weight_update_count})

    def weights_by_name(name: str, truncate_size: int):
        def read(e):
            try:
                return finite(e.get_weights_by_name(name, truncate_size).float().cpu().tolist())
            except KeyError:
                raise ApiError(404, "not_found", f"{name!r} is not a weight of this model") from None
        return read

    @app.get("/get_weights_by_name")
    async def get_weights_by_name_get(name: str, truncate_size: int = Query(default=100, ge=1)):
        return JSONResponse(await worker.call(weights_by_name(name, truncate_size)))

    @app.post("/get_weights_by_name")
    async def get_weights_by_name_post(req: s.WeightsByNameRequest):
        return JSONResponse(await worker.call(weights_by_name(req.name, req.truncate_size)))
