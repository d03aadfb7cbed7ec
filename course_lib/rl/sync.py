"""Three ways a trainer pushes its weights into the engine, each timed phase by phase.

- ``InProcessSync``: the trainer and the engine share a process; the tensors are handed
  over as (name, tensor) pairs (``Engine.update_weights_from_tensor``).
- ``IpcSync``: the co-located path: tensors packed into flattened buckets by a
  ``BucketSender`` and passed as serialized handles (shared memory on CPU, CUDA IPC on GPU),
  one call per bucket; the version label travels with a final empty bucket, so it changes
  only once every bucket landed.
- ``HttpSync``: a separate server, driven with ``EngineClient.sync_weights`` (pause,
  flush, buckets, flush, continue, as slime does).

Every ``sync(named_tensors, version, pause_mode)`` pauses (when ``pause_mode`` is given),
updates, resumes, and returns ``{"phases_ms": {phase: ms}, "bytes": n}``. The phases inside
the update are the engine's own ``timings_ms``.
"""
from __future__ import annotations

import time

from course_lib.weights.transports import bucket, safe_pickle
from course_lib.weights.transports.ipc import BucketSender


def _add(total: dict, part: dict) -> None:
    for k, v in part.items():
        total[k] = total.get(k, 0.0) + v


class InProcessSync:
    name = "inprocess"

    def __init__(self, engine):
        self.engine = engine

    def _update(self, named_tensors, version: str) -> tuple[dict, int]:
        result = self.engine.update_weights_from_tensor(named_tensors, weight_version=version)
        return dict(result["timings_ms"]), result["bytes"]

    def sync(self, named_tensors, version: str, pause_mode: str | None = None) -> dict:
        """One sync of the RL loop: the engine takes the trainer's weights between two steps, and
        the sync says where its time went.

        ``named_tensors``: the trainer's (HF name, tensor) pairs; ``version``: the label the
        engine serves from this update on (a non-empty ``str``: every token generated after
        the sync carries it); ``pause_mode``: ``None`` when the engine is idle (the
        synchronous loop: no pause, no resume), else the pause mode for the requests in flight
        (``"abort"``, ``"wait"``, ``"keep"`` or ``"retract"``).

        Promises:
        - with a ``pause_mode``, generation is paused in that mode before any weight moves,
          and resumed afterwards, also when the update fails: a failed update never leaves
          the engine paused (the error then goes on to the caller, after the engine resumed);
        - the update itself goes through this sync's update step (the ``Sync`` subclass's
          transport), which reports the engine's own phase times and the bytes it took;
        - returns ``{"phases_ms": {"pause": ms, <the engine's phases, as reported>,
          "continue": ms}, "bytes": n}``, where "pause" and "continue" are the milliseconds the
          pause and the resume took, measured here on a monotonic clock (about 0 without a
          pause).

        A ``version`` that is not a non-empty ``str`` raises ``ValueError`` before the engine
        is touched; an unknown ``pause_mode`` is refused by the engine (``ValueError``), which
        then changes nothing.
        """
        # BEGIN EXERCISE ch08.step_sync
        if not isinstance(version, str) or not version:
            raise ValueError(f"the version label must be a non-empty string, got {version!r}")
        t0 = time.perf_counter()
        if pause_mode is not None:
            self.engine.pause_generation(pause_mode)
        phases = {"pause": 1e3 * (time.perf_counter() - t0)}
        try:
            ms, nbytes = self._update(named_tensors, version)
        finally:
            t1 = time.perf_counter()
            if pause_mode is not None:
                self.engine.continue_generation()
        _add(phases, ms)
        phases["continue"] = 1e3 * (time.perf_counter() - t1)
        return {"phases_ms": phases, "bytes": nbytes}
        # END EXERCISE

    def close(self) -> None:
        pass


class IpcSync(InProcessSync):
    name = "ipc"

    def __init__(self, engine, bucket_bytes: int = 16 << 10):
        super().__init__(engine)
        self.sender = BucketSender(bucket_bytes)

    def _update(self, named_tensors, version: str) -> tuple[dict, int]:
        phases, nbytes = {}, 0
        for receipt, payload in self.sender.payloads(named_tensors):
            try:
                result = self.engine.update_weights_from_tensor(payload, load_format="flattened_bucket",
                                                                flush_cache=False)
            finally:
                self.sender.release(receipt)  # the call returned: the engine is done reading
            _add(phases, result["timings_ms"])
            nbytes += result["bytes"]
        # The label changes last, and the one flush makes sure no KV of the old weights is reused.
        result = self.engine.update_weights_from_tensor(safe_pickle.serialize(bucket.pack([])),
                                                        load_format="flattened_bucket", weight_version=version)
        self.engine.flush_cache()
        return phases, nbytes


class HttpSync:
    """Sync through a running server; ``engine`` is only used to read the server's update
    history (through the server's engine thread) for the per-phase timings."""
    name = "http"

    def __init__(self, server, api_key: str | None = None, bucket_bytes: int = 16 << 10):
        from course_lib.server.client import EngineClient  # the HTTP stack is an optional extra

        self.server = server
        self.client = EngineClient(server.url, api_key=api_key)
        self.bucket_bytes = bucket_bytes

    def sync(self, named_tensors, version: str, pause_mode: str | None = None) -> dict:
        seen = self.server.worker.call_sync(lambda e: e.update_history.total)
        times = self.client.sync_weights(named_tensors=named_tensors, weight_version=version,
                                         pause_mode=pause_mode, bucket_bytes=self.bucket_bytes,
                                         flush_interval_s=0.01)
        history = self.server.worker.call_sync(lambda e: e.update_history.since(seen))
        inside = {}
        for result in history:
            _add(inside, result.timings_ms)
        # The client's update_s holds the engine's own phases plus HTTP and serialization.
        phases = {"pause": 1e3 * times["pause_s"], "flush_wait": 1e3 * times["flush_wait_s"], **inside,
                  "http_and_serialize": max(0.0, 1e3 * times["update_s"] - sum(inside.values())),
                  "flush": 1e3 * times["flush_s"] + inside.get("flush", 0.0),
                  "continue": 1e3 * times["continue_s"]}
        return {"phases_ms": phases, "bytes": times["bytes"]}

    def close(self) -> None:
        self.client.close()
