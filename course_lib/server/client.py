"""A small client for the server: one method per endpoint, and ``sync_weights``, the RL flow.

``sync_weights`` makes the calls slime makes, in slime's order:

    POST /pause_generation {}                     (mode configurable; {} means abort)
    GET  /flush_cache                             retried until 200 (1 s apart, bounded)
    POST /update_weights_from_tensor ...          one per bucket, flattened_bucket,
                                                  flush_cache=false, then an empty bucket
         (or one POST /update_weights_from_disk)
    GET  /flush_cache                             once more: nothing computed before survives
    POST /continue_generation

A failure before any weight changed still ends with the continue (the server serves its
old weights); a failure after some buckets landed leaves the server paused. Every error comes back as ``EngineError`` carrying the server's error shape.
"""
from __future__ import annotations

import time

import httpx

from course_lib.dtypes import dtype_name
from course_lib.weights.transports import bucket, safe_pickle
from course_lib.weights.transports.ipc import DEFAULT_BUCKET_BYTES, BucketSender


class EngineError(RuntimeError):
    """A non-2xx answer: ``status``, ``code``, ``message``, ``retryable`` from the error body."""

    def __init__(self, status: int, code: str, message: str, retryable: bool = False):
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message, self.retryable = status, code, message, retryable


class EngineClient:
    """``EngineClient("http://127.0.0.1:30000", api_key=None)``; use as a context manager."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url, headers=headers, timeout=timeout)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> "EngineClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def request(self, method: str, path: str, json=None, params=None):
        """Send one request; the decoded JSON reply, or ``EngineError``."""
        reply = self.http.request(method, path, json=json, params=params)
        if reply.is_success:
            return reply.json()
        try:
            err = reply.json()["error"]
            raise EngineError(err["status"], err["code"], err["message"], err["retryable"])
        except (ValueError, KeyError, TypeError):
            raise EngineError(reply.status_code, "http_error", reply.text[:500]) from None

    # ---- one method per endpoint -------------------------------------------------------
    def health(self) -> dict:
        return self.request("GET", "/health")

    def generate(self, text=None, input_ids=None, sampling_params=None, retry_paused_s: float = 0.0,
                 retry_interval_s: float = 0.05, return_logprob=False):
        """Generate; while the server answers 503 ``paused``, retry for up to ``retry_paused_s``.
        ``return_logprob``: outputs carry ``meta_info["output_token_logprobs"]``."""
        body = {"sampling_params": sampling_params, "return_logprob": return_logprob}
        body.update({"text": text} if text is not None else {"input_ids": input_ids})
        deadline = time.monotonic() + retry_paused_s
        while True:
            try:
                return self.request("POST", "/generate", json=body)
            except EngineError as exc:
                if exc.code != "paused" or time.monotonic() >= deadline:
                    raise
            time.sleep(retry_interval_s)

    def pause_generation(self, mode: str | None = None) -> dict:
        return self.request("POST", "/pause_generation", json={} if mode is None else {"mode": mode})

    def continue_generation(self) -> dict:
        return self.request("POST", "/continue_generation", json={})

    def flush_cache(self) -> dict:
        return self.request("GET", "/flush_cache")

    def update_weights_from_disk(self, model_path, weight_version=None, flush_cache: bool = True,
                                 abort_all_requests: bool = False, load_format: str | None = None) -> dict:
        return self.request("POST", "/update_weights_from_disk", json={
            "model_path": str(model_path), "weight_version": weight_version, "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests, "load_format": load_format})

    def update_weights_from_tensor(self, serialized_named_tensors: list[str], load_format: str | None = None,
                                   flush_cache: bool = True, weight_version=None,
                                   abort_all_requests: bool = False) -> dict:
        return self.request("POST", "/update_weights_from_tensor", json={
            "serialized_named_tensors": serialized_named_tensors, "load_format": load_format,
            "flush_cache": flush_cache, "weight_version": weight_version, "abort_all_requests": abort_all_requests})

    def register_weight_buffers(self, serialized_payload: str, partial: bool = False,
                                copy_mode: str | None = None) -> dict:
        """Register a trainer's buffers and layout once (``RegisteredSender.registration()``);
        the reply's ``epoch`` goes with every ``update_weights_from_registered``."""
        return self.request("POST", "/register_weight_buffers", json={
            "serialized_payload": serialized_payload, "partial": partial, "copy_mode": copy_mode})

    def update_weights_from_registered(self, buckets, epoch: int, weight_version=None, flush_cache: bool = True,
                                       abort_all_requests: bool = False) -> dict:
        """Copy these registered buckets into the weights; returns once the buffers may be reused."""
        return self.request("POST", "/update_weights_from_registered", json={
            "buckets": list(buckets), "epoch": epoch, "weight_version": weight_version, "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests})

    def unregister_weight_buffers(self) -> dict:
        return self.request("POST", "/unregister_weight_buffers", json={})

    def update_in_one_call(self, transport: str, pause_mode: str | None = None, resume: bool | None = None,
                           **fields) -> dict:
        """One request for an update and the pause around it (``/sync_weights``, ours):
        ``transport`` ("disk", "tensor", "registered" or "distributed") and that route's
        fields; the server pauses in ``pause_mode``, updates, and continues (``resume``;
        None: when it paused). Several messages of one update: the pause on the first, the
        continue (``resume=True``) on the last. Raises ``EngineError`` as any update does."""
        return self.request("POST", "/sync_weights", json={
            "transport": transport, "pause_mode": pause_mode, "resume": resume, **fields})

    def offers_one_call(self) -> bool:
        """Whether the server has ``/sync_weights`` (SGLang's does not: 404), asked once."""
        if not hasattr(self, "_one_call"):
            try:
                self.request("POST", "/sync_weights", json={})
            except EngineError as exc:
                self._one_call = exc.status != 404  # ours refuses an empty body with 422
            else:
                self._one_call = True
        return self._one_call

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str | None = None) -> dict:
        return self.request("POST", "/init_weights_update_group", json={
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend})

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name: str = "weight_update_group",
                                        flush_cache: bool = True, weight_version=None,
                                        load_format: str | None = None, abort_all_requests: bool = False) -> dict:
        return self.request("POST", "/update_weights_from_distributed", json={
            "names": list(names), "dtypes": [dtype_name(d) for d in dtypes],
            "shapes": [list(x) for x in shapes], "group_name": group_name, "flush_cache": flush_cache,
            "weight_version": weight_version, "load_format": load_format, "abort_all_requests": abort_all_requests})

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        return self.request("POST", "/destroy_weights_update_group", json={"group_name": group_name})

    def get_weight_version(self) -> dict:
        return self.request("GET", "/get_weight_version")

    def update_weight_version(self, new_version) -> dict:
        return self.request("POST", "/update_weight_version", json={"new_version": new_version})

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        return self.request("GET", "/get_weights_by_name", params={"name": name, "truncate_size": truncate_size})

    # ---- the RL flow -------------------------------------------------------------------
    def flush_until_done(self, interval_s: float = 1.0, tries: int = 60) -> int:
        """``GET /flush_cache`` (``self.flush_cache()``) until it succeeds; returns the
        number of calls it took (1 when the first succeeded).

        The server refuses a flush with a *retryable* error while requests are still
        running or waiting (400 ``requests_in_flight``: right after an abort pause, or while
        a wait pause drains). On an ``EngineError`` whose ``retryable`` is true, sleep
        ``interval_s`` and call again, at most ``tries`` calls in all (slime: 1 s apart, 60
        tries); after the last refused call, raise that error. Any error that is not
        retryable is raised at once, without retrying. ``tries`` < 1: ``ValueError``.
        """
        # BEGIN EXERCISE ch07.flush_retry
        if tries < 1:
            raise ValueError(f"tries must be at least 1, not {tries}")
        for attempt in range(1, tries + 1):
            try:
                self.flush_cache()
                return attempt
            except EngineError as exc:
                if not exc.retryable or attempt == tries:
                    raise
            time.sleep(interval_s)
        raise AssertionError("unreachable")
        # END EXERCISE

    def sync_weights(self, named_tensors=None, model_path=None, weight_version=None, pause_mode: str | None = None,
                     bucket_bytes: int = DEFAULT_BUCKET_BYTES, flush_interval_s: float = 1.0,
                     flush_tries: int = 60) -> dict:
        """Push new weights to the server as an RL trainer does, and leave it serving them.

        Give exactly one of ``named_tensors`` ((name, tensor) pairs, sent as buckets by
        ``self.send_buckets``) or ``model_path`` (a checkpoint dir the server reads, with
        ``flush_cache=False``); both or neither: ``ValueError`` before any request.

        Promises, in this order: generation paused in ``pause_mode`` (None: the server's
        default); the prefix cache emptied (``self.flush_until_done(flush_interval_s,
        flush_tries)``); the update, carrying ``weight_version``; the cache emptied once
        more (nothing computed before survives); generation continued. Returns the seconds
        of each of those five phases (``pause_s``, ``flush_wait_s``, ``update_s``,
        ``flush_s``, ``continue_s``; ``time.perf_counter``) and ``total_s`` their sum, with
        ``flush_tries`` (the first emptying's), ``buckets`` (non-empty buckets sent; 0 from
        disk), ``bytes`` (the update replies' ``"bytes"``, summed) and
        ``num_aborted_requests`` (from the pause's reply).

        When a request after the pause fails with an ``EngineError``: while no weight can
        have changed (the first emptying gave up, the disk update or the first bucket was
        refused: each is validated before it is written), generation is continued, so the
        old weights serve, whole, then the error is raised; once some may have changed, the
        server is left paused (a mix of two versions must not serve) and the error raised.
        Other errors (a broken connection) are raised as they are, with no further request.
        """
        # BEGIN EXERCISE ch07.client_flow
        if (named_tensors is None) == (model_path is None):
            raise ValueError("give exactly one of named_tensors or model_path")
        times, t0 = {}, time.perf_counter()

        def lap(phase: str) -> None:
            nonlocal t0
            now = time.perf_counter()
            times[phase] = now - t0
            t0 = now

        pause = self.pause_generation(pause_mode)
        lap("pause_s")
        sent = {"buckets": 0, "bytes": 0}  # send_buckets counts each bucket as the server accepts it
        try:
            times["flush_tries"] = self.flush_until_done(flush_interval_s, flush_tries)
            lap("flush_wait_s")
            if model_path is not None:
                result = self.update_weights_from_disk(model_path, weight_version=weight_version, flush_cache=False)
                sent["bytes"] = result.get("bytes", 0)
            else:
                self.send_buckets(named_tensors, weight_version, bucket_bytes, sent)
            lap("update_s")
            self.flush_until_done(flush_interval_s, flush_tries)
            lap("flush_s")
        except EngineError:
            if sent["buckets"] == 0 and "update_s" not in times:  # nothing changed: serve the old weights
                self.continue_generation()
            raise
        self.continue_generation()
        lap("continue_s")
        times.update(total_s=sum(v for k, v in times.items() if k.endswith("_s")), buckets=sent["buckets"],
                     bytes=sent["bytes"], num_aborted_requests=pause.get("num_aborted_requests", 0))
        return times
        # END EXERCISE

    def send_buckets(self, named_tensors, weight_version, bucket_bytes: int, sent: dict) -> None:
        """Send ``named_tensors`` as flattened IPC buckets of about ``bucket_bytes``, one
        ``update_weights_from_tensor`` each (``flush_cache=False``), then an empty bucket
        carrying ``weight_version``, so the label changes only once every bucket landed.
        ``sent["buckets"]`` and ``sent["bytes"]`` grow as each non-empty bucket is accepted
        (so a caller knows, after an error, whether any weight changed)."""
        sender = BucketSender(bucket_bytes)
        for receipt, payload in sender.payloads(named_tensors):
            try:
                result = self.update_weights_from_tensor([payload], load_format="flattened_bucket", flush_cache=False)
            except EngineError:
                sender.release(receipt)  # a reply, even an error, means the server is done reading it
                raise
            sender.release(receipt)
            sent["buckets"] += 1
            sent["bytes"] += result.get("bytes", 0)
        empty = safe_pickle.serialize(bucket.pack([]))
        self.update_weights_from_tensor([empty], load_format="flattened_bucket", flush_cache=False,
                                        weight_version=weight_version)
