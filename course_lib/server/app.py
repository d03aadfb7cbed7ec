"""The HTTP API: SGLang's weight-sync protocol over one engine (see shared PROTOCOL.md).

``create_app(engine, ...)`` returns a FastAPI app whose handlers never touch the engine
themselves: each hands ``EngineWorker`` a small function of the engine and awaits it, so
every engine call runs on the engine's own thread between two steps. Payload decoding
(base64 and the allowlisted unpickler) runs in a thread pool, off both that thread and
the event loop.
"""
from __future__ import annotations

import contextlib

from fastapi import FastAPI, Query
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from course_lib.engine.update_sources import decode_tensor_payload
from course_lib.engine.sequence import SamplingParams
from course_lib.server import schemas as s
from course_lib.server.errors import ApiError, from_engine_exception, install_handlers
from course_lib.server.guard import GuardMiddleware
from course_lib.server.worker import EngineWorker

DEFAULT_MAX_BODY_BYTES = 64 << 20


def generate_inputs(req: s.GenerateRequest) -> tuple[list, str, list[SamplingParams], list[bool], bool]:
    """(items, "prompt" or "input_ids", sampling params per item, return_logprob per item,
    whether it was a batch)."""
    if (req.text is None) == (req.input_ids is None):
        raise ApiError(400, "bad_request", "give exactly one of text or input_ids")
    if req.stream:
        raise ApiError(400, "unsupported", "stream=true is not supported; responses come whole")
    if req.text is not None:
        batched = isinstance(req.text, list)
        items, key = (req.text if batched else [req.text]), "prompt"
    else:
        batched = bool(req.input_ids) and isinstance(req.input_ids[0], list)
        items, key = (req.input_ids if batched else [req.input_ids]), "input_ids"
    if not items:
        raise ApiError(400, "bad_request", "the batch is empty")
    raw = req.sampling_params
    if isinstance(raw, list):
        if len(raw) != len(items):
            raise ApiError(400, "bad_request", f"{len(raw)} sampling_params for {len(items)} prompts")
    else:
        raw = [raw] * len(items)
    try:  # all checked before any request is queued
        params = [SamplingParams.coerce(p) for p in raw]
    except (ValueError, TypeError) as exc:
        raise ApiError(400, "bad_request", f"bad sampling_params: {exc}") from None
    flags = req.return_logprob if isinstance(req.return_logprob, list) else [bool(req.return_logprob)] * len(items)
    if len(flags) != len(items):
        raise ApiError(400, "bad_request", f"{len(flags)} return_logprob flags for {len(items)} prompts")
    return items, key, params, flags, batched


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

    @app.get("/health")
    async def health():
        # Read without the engine thread, so a long update cannot make the server look dead.
        e = engine
        state = {"healthy": e.unhealthy is None and worker.alive, "reason": e.unhealthy or worker.error,
                 "paused": e.paused, "pause_mode": e.pause_mode, "weight_version": e.weight_version,
                 "weight_update_count": e.weight_update_count, "num_running": len(e.scheduler.running),
                 "num_waiting": len(e.scheduler.waiting)}
        if not state["healthy"]:
            return ApiError(503, "unhealthy", f"engine is not serving: {state['reason']}").response()
        return state

    @app.post("/generate")
    async def generate(req: s.GenerateRequest):
        items, key, params, flags, batched = generate_inputs(req)
        outputs = await worker.generate_async(items, key, params, flags)
        outputs = [{k: v for k, v in out.items() if k != "rid"} for out in outputs]  # meta_info.id has it
        return outputs if batched else outputs[0]

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

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(req: s.DiskUpdateRequest):
        path = s.checkpoint_dir(req)
        version = s.version_text(req.weight_version)
        return await worker.call(lambda e: e.update_weights_from_disk(
            path, weight_version=version, flush_cache=req.flush_cache, abort_all_requests=req.abort_all_requests))

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(req: s.TensorUpdateRequest):
        try:
            tensors = await run_in_threadpool(decode_tensor_payload, req.serialized_named_tensors, req.load_format)
        except Exception as exc:  # noqa: BLE001 - unsafe pickles and bad buckets become 400s
            raise from_engine_exception(exc, engine) from None
        version = s.version_text(req.weight_version)
        return await worker.call(lambda e: e.update_weights_from_tensor(
            tensors, flush_cache=req.flush_cache, weight_version=version,
            abort_all_requests=req.abort_all_requests))

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(req: s.InitGroupRequest):
        # Blocks the engine thread until every rank has joined (the trainer is rank 0).
        return await worker.call(lambda e: e.init_weights_update_group(
            req.master_address, req.master_port, req.rank_offset, req.world_size, req.group_name, req.backend))

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(req: s.DistributedUpdateRequest):
        if not len(req.names) == len(req.dtypes) == len(req.shapes):
            raise ApiError(400, "bad_request", f"names, dtypes and shapes differ in length "
                                               f"({len(req.names)}, {len(req.dtypes)}, {len(req.shapes)})")
        version = s.version_text(req.weight_version)
        # Blocks the engine thread until the trainer's broadcast has arrived; the event loop only awaits.
        return await worker.call(lambda e: e.update_weights_from_distributed(
            req.names, req.dtypes, req.shapes, group_name=req.group_name, flush_cache=req.flush_cache,
            weight_version=version, load_format=req.load_format, abort_all_requests=req.abort_all_requests))

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(req: s.DestroyGroupRequest | None = None):
        name = (req or s.DestroyGroupRequest()).group_name
        return await worker.call(lambda e: e.destroy_weights_update_group(name))

    @app.get("/get_weight_version")
    async def get_weight_version():
        return await worker.call(lambda e: {"weight_version": e.get_weight_version(),
                                            "weight_update_count": e.weight_update_count})

    @app.post("/update_weight_version")
    async def update_weight_version(req: s.VersionRequest):
        return await worker.call(lambda e: e.update_weight_version(str(req.new_version)))

    def weights_by_name(name: str, truncate_size: int):
        def read(e):
            try:
                return e.get_weights_by_name(name, truncate_size).float().cpu().tolist()
            except KeyError:
                raise ApiError(404, "not_found", f"{name!r} is not a weight of this model") from None
        return read

    @app.get("/get_weights_by_name")
    async def get_weights_by_name_get(name: str, truncate_size: int = Query(default=100, ge=1)):
        return JSONResponse(await worker.call(weights_by_name(name, truncate_size)))

    @app.post("/get_weights_by_name")
    async def get_weights_by_name_post(req: s.WeightsByNameRequest):
        return JSONResponse(await worker.call(weights_by_name(req.name, req.truncate_size)))

    return app
