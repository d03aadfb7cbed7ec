"""Hot updates between engine steps: pausing, flushing, versions, and the update itself.

``HotUpdateMixin`` is the part of ``Engine`` that changes weights while it serves
(SGLang's offline-engine names). The order of an update, and the contracts it keeps:

1. requests in flight are handled by the pause mode (abort / wait / keep / retract);
2. the new weights are validated and staged before anything live changes;
3. they are committed through the model's own loaders, in place, then post-processed;
4. the address audit proves no kernel-read tensor moved;
5. the version and the prefix-cache salt change (old cache entries can never match);
6. every phase is timed and the pause's costs are counted.
"""
from __future__ import annotations

import time

import torch

from course_lib.layers.quant import (discard_staged_weights, kernel_tensors, pending_layers,
                                     process_weights_after_loading)
from course_lib.weights.audit import AddressMovedError
from course_lib.weights import bucket, safe_pickle
from course_lib.weights.transports import dist as dist_transport
from course_lib.weights.layerwise import LayerwiseReload
from course_lib.weights.update import PhaseTimer, UpdateError, commit, load_and_validate, stage_from_disk
from course_lib.weights.update import check_finite as refuse_non_finite
from course_lib.weights.update import validate_tensors

# Pause modes and their SGLang / vLLM names.
PAUSE_MODES = {"abort": "abort", "wait": "wait", "keep": "keep", "in_place": "keep", "retract": "retract"}


class EnginePausedError(RuntimeError):
    """New work refused while generation is paused for an update; retry after continue."""
    retryable = True


class EngineBusyError(RuntimeError):
    """An update while requests are in flight and generation is not paused."""
    retryable = False


def new_pause_record(mode: str) -> dict:
    """What one pause cost, filled in as it happens (measured, not predicted)."""
    return {"mode": mode, "aborted_requests": 0, "discarded_tokens": 0, "retracted_requests": 0,
            "reprefill_tokens": 0, "wait_s": 0.0, "mixed_requests": 0, "kv_fresh": True,
            "updates": 0, "resume_ms": 0.0}


def decode_tensor_payload(payload, load_format: str | None, tp_rank: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Turn whatever ``update_weights_from_tensor`` was given into (name, tensor) pairs."""
    if load_format not in (None, "flattened_bucket", "direct"):
        raise UpdateError(f"unknown load_format {load_format!r}; expected None or 'flattened_bucket'")
    if isinstance(payload, list) and payload and all(isinstance(p, (str, bytes)) for p in payload):
        if tp_rank >= len(payload):
            raise UpdateError(f"payload has {len(payload)} per-rank entries; this engine is rank {tp_rank}")
        payload = payload[tp_rank]
    if isinstance(payload, (str, bytes)):
        payload = safe_pickle.deserialize(payload)  # raises UnsafePickleError (a ValueError)
    if load_format == "flattened_bucket":
        try:
            return bucket.unpack(payload)
        except bucket.BucketError as exc:
            raise UpdateError(f"bad flattened bucket: {exc}") from exc
    if isinstance(payload, dict):
        payload = list(payload.items())
    if not isinstance(payload, (list, tuple)):
        raise UpdateError(f"expected (name, tensor) pairs, got {type(payload).__name__}")
    pairs = []
    for item in payload:
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise UpdateError("every entry must be a (name, tensor) pair")
        pairs.append((item[0], item[1]))
    return pairs


class HotUpdateMixin:
    def pause_generation(self, mode: str = "abort") -> dict:
        """Stop generating so weights can change between two steps. In-flight requests:

        - ``abort``: finish now with ``finish_reason {"type": "abort"}``; their tokens are discarded;
        - ``wait``: keep running until done; an update waits for them (new requests are refused);
        - ``keep`` (``in_place``): frozen; after the update they continue on the new weights
          with the KV the old weights computed;
        - ``retract``: back to the queue with their KV freed; re-prefilled (prompt plus
          generated tokens) on the new weights after ``continue_generation``.
        """
        if mode not in PAUSE_MODES:
            raise ValueError(f"unknown pause mode {mode!r}; expected one of {sorted(PAUSE_MODES)}")
        mode = PAUSE_MODES[mode]
        if self.paused:
            if mode != self.pause_mode:
                raise ValueError(f"already paused in {self.pause_mode!r} mode; continue_generation() first")
            return {"paused": True, "mode": mode, "num_aborted_requests": 0}
        record = new_pause_record(mode)
        self.pause_stats.append(record)
        aborted = 0
        if mode == "abort":
            aborted = self._abort_all("aborted by pause_generation", record)
        elif mode == "retract":
            for seq in reversed(list(self.scheduler.running)):  # reversed: keeps their order at the queue's head
                self.scheduler.preempt(seq, out_of_memory=False)
                seq.retract_record = record
                record["retracted_requests"] += 1
        self.paused, self.pause_mode = True, mode
        return {"paused": True, "mode": mode, "num_aborted_requests": aborted}

    def _abort_all(self, message: str, record: dict) -> int:
        seqs = list(self.scheduler.running) + list(self.scheduler.waiting)
        for seq in seqs:
            record["discarded_tokens"] += seq.num_completion_tokens
            self.scheduler.finish(seq, {"type": "abort", "message": message})
            self._pending.append(self._output(seq))
        record["aborted_requests"] += len(seqs)
        return len(seqs)

    def continue_generation(self) -> dict:
        """Resume: frozen and retracted requests go on with the current weights. Refused
        while a chunked update left a quantized fused layer waiting for shards."""
        waiting = pending_layers(self.model)
        if waiting:
            raise UpdateError(f"cannot resume: {len(waiting)} layers still wait for shards of an update, "
                              f"e.g. {next(iter(waiting.items()))}; send them first")
        t0 = time.perf_counter()
        if self.paused:
            self.verify_addresses()  # the full audit, once per pause, before serving again
            self.paused, self.pause_mode = False, None
            if torch.device(self.config.device).type == "cuda":
                self._ipc_keepalive.clear()  # unmap the trainer's buffers
                torch.cuda.empty_cache()  # return the update's temporaries (as SGLang does)
            self.pause_stats[-1]["resume_ms"] = 1e3 * (time.perf_counter() - t0)
        return {"paused": False}

    def flush_cache(self) -> bool:
        """Forget every prefix-cache entry. Refused (False, nothing changed) while requests
        are being served. While paused in abort, keep or retract mode it is allowed: the
        queued requests hold no cache entries, and dropping entries never touches the KV
        of a frozen request (the deadlock of SGLang #22620 cannot happen here)."""
        serving = bool(self.scheduler.running or self.scheduler.waiting)
        if serving and (not self.paused or self.pause_mode == "wait"):
            return False
        self.last_flush_entries = self.block_manager.flush()
        return True

    def _audited_extras(self) -> dict:
        extras = {"kv_cache": self.model_runner.kv_cache}
        for bs, out in getattr(self.model_runner, "graph_outputs", {}).items():
            extras[f"cuda_graph_logits[{bs}]"] = out
        return extras

    def verify_addresses(self, only: set[str] | None = None) -> None:
        """Raise AddressMovedError (and stop serving) if a tensor kernels read has moved
        (``only``: just these parameter names)."""
        try:
            self.address_audit.verify(self.model, self._audited_extras(), only)
        except AddressMovedError as exc:
            self.unhealthy = str(exc)
            raise

    def _check_healthy(self) -> None:
        if self.unhealthy:
            raise RuntimeError(f"engine is unhealthy and refuses work until restarted: {self.unhealthy}")

    def health(self) -> dict:
        waiting = getattr(self, "waiting_for_weights", False)  # load_format="dummy", nothing loaded yet
        return {"healthy": self.unhealthy is None, "ready": self.unhealthy is None and not waiting,
                "reason": self.unhealthy or ("waiting for weights" if waiting else None), "paused": self.paused,
                "weight_version": self.weight_version}

    def get_weight_version(self) -> str:
        return self.weight_version

    def update_weight_version(self, new_version: str) -> dict:
        self.weight_version = str(new_version)
        return {"success": True, "new_version": self.weight_version}

    def live_kv_is_fresh(self) -> bool:
        """True when every live KV block was computed by the current weights."""
        return all(seq.kv_epoch == self.weight_update_count
                   for seq in self.scheduler.running if seq.block_table)

    def update_weights_from_disk(self, model_path, weight_version: str | None = None, flush_cache: bool = True,
                                 abort_all_requests: bool = False, partial: bool = False, staging: str = "layer",
                                 keep_snapshot: bool = False, wait_timeout_s: float = 600.0) -> dict:
        """Load new weights from an HF checkpoint dir, in place, between two steps.

        First the whole checkpoint is validated from its headers (structure, every name,
        shape and dtype, file sizes): a bad checkpoint raises ``UpdateError`` and leaves
        the weights, the version and every request untouched. Then:

        - ``staging="layer"`` (default): stream one decoder layer at a time (extra memory
          about one layer; see layerwise.py). A fault found mid-stream rolls back to a
          snapshot when ``keep_snapshot=True``, else marks the engine unhealthy.
        - ``staging="full"``: read everything into host memory first (extra memory: the
          whole model), so even a mid-read fault changes nothing.

        ``keep_snapshot=True`` also keeps the old weights in host memory for ``rollback()``.
        Returns SGLang's fields plus ``timings_ms`` per phase, ``bytes`` and ``memory``.
        """
        if staging not in ("layer", "full"):
            raise ValueError(f"staging must be 'layer' or 'full', got {staging!r}")
        timer = PhaseTimer()
        self._refuse_if_busy(abort_all_requests)
        reader, nbytes = load_and_validate(self.model_config, model_path, partial)
        names = list(reader.metadata())
        timer.lap("validate")
        if staging == "full":
            staged = stage_from_disk(reader)
            refuse_non_finite(staged.items())
            timer.lap("transfer")
            apply = self._chunk_applier(staged.items(), allow_pending=False)
        else:
            apply = self._layerwise_applier(reader, names)
        if keep_snapshot:
            self.take_snapshot()
            timer.lap("snapshot")
        return self._commit_update(apply, nbytes, timer, weight_version, flush_cache,
                                   abort_all_requests, wait_timeout_s, f"updated from {reader.path}")

    def _chunk_applier(self, named_tensors, allow_pending: bool):
        """Apply validated tensors that are all in hand: copy through the loaders, then
        requantize (layers still waiting for shards stay staged when allowed)."""
        def apply(timer: PhaseTimer) -> dict:
            commit(self.model, named_tensors, self.config.device)
            timer.lap("copy")
            if self.quantization is None:
                # Checkpoint format is kernel format: nothing to post-process, and only the
                # parameters this chunk wrote need auditing now (the full audit runs when
                # generation resumes).
                touched = {t[0] for t in map(self.model.map_checkpoint_name, (n for n, _ in named_tensors)) if t}
                return {"audit_only": touched}
            process_weights_after_loading(self.model, allow_pending=allow_pending)
            timer.lap("post_process")
            return {}
        return apply

    def _layerwise_applier(self, reader, names):
        def apply(timer: PhaseTimer) -> dict:
            reload = LayerwiseReload(self.model, names, self.config.device)
            try:
                for name, tensor in reader.iter_tensors(names):
                    reload.feed(name, tensor)
                memory = reload.finish()
            except Exception as exc:
                self._after_midstream_fault(reload.applied, exc)
            wall = timer.ms_since_lap()
            timer.ms.update({k: v for k, v in reload.ms.items() if k != "transfer"})
            timer.ms["transfer"] = max(0.0, wall - reload.ms["copy"] - reload.ms["post_process"])  # reading + H2D
            timer.lap(None)
            return {"memory": memory}
        return apply

    def _after_midstream_fault(self, applied_layers: list[str], exc: Exception):
        discard_staged_weights(self.model)
        if not applied_layers:
            raise exc if isinstance(exc, UpdateError) else UpdateError(f"update failed before any layer "
                                                                       f"changed: {exc}") from exc
        if self.snapshot is not None:
            self._restore(self.snapshot)
            raise UpdateError(f"update failed after {len(applied_layers)} layers ({exc}); the weights were "
                              f"restored from the snapshot") from exc
        self.unhealthy = (f"update failed after {len(applied_layers)} layers were written ({exc}); "
                          f"the weights are a mix of two versions")
        raise UpdateError(self.unhealthy) from exc

    # ---- snapshots and rollback (host memory, no disk read) ------------------------------
    def take_snapshot(self) -> dict:
        """Copy every tensor the kernels read to host memory (pinned on GPU), with the
        current version label; ``rollback()`` restores it. Costs one model of host memory."""
        pin = torch.device(self.config.device).type == "cuda"
        tensors = {}
        for name, t in kernel_tensors(self.model).items():
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            host.copy_(t, non_blocking=pin)
            tensors[name] = host
        if pin:
            torch.cuda.synchronize()
        self.snapshot = {"weight_version": self.weight_version, "tensors": tensors}
        return self.snapshot

    def _restore(self, snapshot: dict) -> None:
        live = kernel_tensors(self.model)
        for name, host in snapshot["tensors"].items():
            live[name].copy_(host, non_blocking=True)
        if torch.device(self.config.device).type == "cuda":
            torch.cuda.synchronize()

    def rollback(self, flush_cache: bool = True, abort_all_requests: bool = False) -> dict:
        """Restore the snapshot (bitwise the old weights and version), in place, with no
        disk read. Same rules as any update: pause first if requests are in flight."""
        if self.snapshot is None:
            raise UpdateError("no snapshot to roll back to: take_snapshot() or update with keep_snapshot=True")
        timer = PhaseTimer()
        self._refuse_if_busy(abort_all_requests)
        snapshot = self.snapshot

        def apply(timer: PhaseTimer) -> dict:
            self._restore(snapshot)
            timer.lap("copy")
            return {}
        nbytes = sum(t.numel() * t.element_size() for t in snapshot["tensors"].values())
        return self._commit_update(apply, nbytes, timer, snapshot["weight_version"], flush_cache,
                                   abort_all_requests, 600.0, "rolled back to the snapshot")

    def update_weights_from_tensor(self, named_tensors, load_format: str | None = None, flush_cache: bool = True,
                                   weight_version: str | None = None, abort_all_requests: bool = False,
                                   check_finite: bool = False, wait_timeout_s: float = 600.0) -> dict:
        """Load tensors handed over in memory (a co-located trainer), in place.

        ``named_tensors``: (name, tensor) pairs or a {name: tensor} dict; or, with
        ``load_format="flattened_bucket"``, a bucket {"flattened_tensor", "metadata"}; or
        either of those serialized (base64 text or bytes, as SGLang clients send; a list
        holds one payload per tensor-parallel rank). Serialized payloads are unpickled
        through an allowlist. Each call is one chunk: validated whole, then applied; names
        are checkpoint names and any subset may come. An empty chunk changes nothing
        (only ``weight_version``, when given, is recorded). ``check_finite`` also refuses
        NaN/inf values; it is off by default because it reads every byte once more, which
        costs about a third of an in-memory update's speed.
        """
        timer = PhaseTimer()
        self._refuse_if_busy(abort_all_requests)
        tensors = decode_tensor_payload(named_tensors, load_format, tp_rank=getattr(self.model, "tp_rank", 0))
        if tensors and tensors[0][1].is_cuda:
            # Keep the last few received buffers mapped: a trainer that reuses its buffers
            # then costs one IPC handle opening per buffer, not one per bucket.
            self._ipc_keepalive.append(tensors[0][1].untyped_storage())
        timer.lap("deserialize")
        if not tensors:
            if weight_version is not None:
                self.weight_version = str(weight_version)
            return {"success": True, "message": "empty update: nothing to apply",
                    "weight_version": self.weight_version, "weight_update_count": self.weight_update_count,
                    "bytes": 0, "elapsed_ms": 0.0, "timings_ms": {}}
        meta = {name: (tuple(t.shape), t.dtype) for name, t in tensors}
        if len(meta) != len(tensors):
            raise UpdateError("the update names a tensor more than once")
        nbytes = validate_tensors(self.model_config, meta, partial=True)
        if check_finite:
            refuse_non_finite(tensors)
        timer.lap("validate")
        return self._commit_update(self._chunk_applier(tensors, allow_pending=True), nbytes, timer, weight_version,
                                   flush_cache, abort_all_requests, wait_timeout_s, f"updated {len(tensors)} tensors")

    # ---- torch.distributed groups (the trainer broadcasts, the engine receives) ---------
    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str | None = None) -> dict:
        """Join the trainer's weight-update group as rank ``rank_offset + tp_rank`` (blocks
        until every rank has joined). ``backend``: "nccl" on GPU, "gloo" on CPU by default."""
        groups = self._weight_groups
        if group_name in groups:
            raise ValueError(f"weight-update group {group_name!r} already exists; destroy it first")
        backend = backend or ("nccl" if torch.device(self.config.device).type == "cuda" else "gloo")
        rank = rank_offset + getattr(self.model, "tp_rank", 0)
        groups[group_name] = dist_transport.new_group(master_address, master_port, rank, world_size,
                                                      group_name, backend)
        return {"success": True, "message": f"joined {group_name!r} as rank {rank} of {world_size} ({backend})"}

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        if self._weight_groups.pop(group_name, None) is None:
            raise ValueError(f"no weight-update group named {group_name!r}")
        return {"success": True, "message": f"destroyed {group_name!r}"}

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name: str = "weight_update_group",
                                        flush_cache: bool = True, weight_version: str | None = None,
                                        load_format: str | None = None, abort_all_requests: bool = False,
                                        check_finite: bool = False, wait_timeout_s: float = 600.0,
                                        refuse_with: str | None = None) -> dict:
        """Receive tensors the trainer broadcasts (rank 0) and load them in place.

        ``load_format="flattened_bucket"``: all named tensors arrive as one byte buffer;
        otherwise one broadcast per tensor (SGLang's default). The bytes are received even
        when the update is refused (busy, unknown name, wrong shape): the trainer is
        already sending, and a receiver that walked away would leave it hanging.
        ``refuse_with``: receive, then refuse with this message (a tensor-parallel rank
        whose rank 0 refused: every rank must take the broadcast and none may apply it).
        """
        group = self._weight_groups.get(group_name)
        if group is None:
            raise ValueError(f"no weight-update group named {group_name!r}; call init_weights_update_group first")
        timer = PhaseTimer()
        try:
            dtypes = [getattr(torch, str(d).removeprefix("torch.")) for d in dtypes]
            assert all(isinstance(d, torch.dtype) for d in dtypes)
        except (AttributeError, AssertionError):
            raise UpdateError(f"unknown dtype in {dtypes}") from None
        refusal = None
        try:
            if refuse_with is not None:
                raise UpdateError(refuse_with)
            self._refuse_if_busy(abort_all_requests)
            if len(set(names)) != len(names):
                raise UpdateError("the update names a tensor more than once")
            nbytes = validate_tensors(self.model_config, {n: (tuple(s), d) for n, s, d in zip(names, shapes, dtypes)},
                                      partial=True)
        except (UpdateError, RuntimeError) as exc:
            refusal = exc
        timer.lap("validate")
        device = self.config.device
        if load_format == "flattened_bucket":
            tensors = dist_transport.receive_bucket(group[0], names, dtypes, shapes, device)
        else:
            tensors = []
            for n, d, shape in zip(names, dtypes, shapes):
                t = torch.empty(tuple(shape), dtype=d, device=device)
                dist_transport.broadcast_async(group[0], t).wait()
                tensors.append((n, t))
        timer.lap("transfer")
        if refusal is not None:
            raise refusal
        if check_finite:
            refuse_non_finite(tensors)
        return self._commit_update(self._chunk_applier(tensors, allow_pending=True), nbytes, timer, weight_version,
                                   flush_cache, abort_all_requests, wait_timeout_s,
                                   f"received {len(tensors)} tensors over {group_name!r}")

    # ---- sparse, delta and remote-seeding transports --------------------------------------
    # Thin glue: each validates first, then goes through _commit_update (pause rules, audit,
    # version, cache salt and flush, pause cost record) like every other update.
    # The transports themselves live in course_lib/weights/transports/{sparse,delta,remote}.py.

    def _refuse_sharded(self, what: str) -> None:
        if getattr(self.model, "tp_size", 1) > 1:
            raise UpdateError(f"{what} is not supported on a tensor-parallel rank: this rank holds only a "
                              f"shard of each tensor, so it cannot rebuild or send checkpoint tensors")

    def update_weights_sparse(self, payload: dict, flush_cache: bool = True, weight_version: str | None = None,
                              abort_all_requests: bool = False, wait_timeout_s: float = 600.0) -> dict:
        """Apply a sparse payload (``sparse.diff``): only changed elements, in checkpoint
        coordinates. The whole payload is validated first (names, shapes, dtypes, index
        bounds); a bad one raises ``UpdateError`` with nothing changed. Each touched
        checkpoint tensor is rebuilt from the engine's current values with the new
        elements scattered in, then loaded through the model's loaders (fusion included).

        Refused on quantized engines: they keep int8/fp8 values and scales, not the
        checkpoint's floats, and a tensor rebuilt from dequantized values would carry the
        rounding of every untouched element into the next quantization (the result would
        differ from a cold start on the new checkpoint). Send dense tensors to those
        (``update_weights_from_tensor``). Returns the usual fields; ``bytes`` counts what
        travelled (indices plus values), ``dense_bytes`` what the touched tensors weigh.
        """
        from course_lib.weights.checkpoint import hf_tensor_shapes
        from course_lib.weights.transports import sparse

        timer = PhaseTimer()
        if self.quantization is not None:
            raise UpdateError(f"sparse updates are refused on a {self.quantization}-quantized engine: it does not "
                              f"hold the checkpoint's floats to scatter into; send the touched tensors densely "
                              f"with update_weights_from_tensor")
        self._refuse_sharded("a sparse update")
        self._refuse_if_busy(abort_all_requests)
        try:
            entries = sparse.validate(payload, hf_tensor_shapes(self.model_config))
        except sparse.SparsePayloadError as exc:
            raise UpdateError(f"bad sparse payload: {exc}") from exc
        moved, dense = sparse.payload_nbytes(payload), sparse.dense_nbytes(payload)
        timer.lap("validate")
        if not entries:
            if weight_version is not None:
                self.weight_version = str(weight_version)
            return {"success": True, "message": "empty sparse update: nothing changed", "bytes": 0,
                    "dense_bytes": 0, "elements": 0, "weight_version": self.weight_version,
                    "weight_update_count": self.weight_update_count, "elapsed_ms": 0.0, "timings_ms": {}}
        rebuilt = []
        for (name, shape, _), idx, values in zip(entries, payload["indices"], payload["values"]):
            # All rows: exactly the checkpoint tensor as the engine holds it (unquantized).
            current = self.get_weights_by_name(name, truncate_size=shape[0])
            rebuilt.append((name, sparse.scatter(current, idx, values)))
        timer.lap("rebuild")
        result = self._commit_update(self._chunk_applier(rebuilt, allow_pending=True), moved, timer,
                                     weight_version, flush_cache, abort_all_requests, wait_timeout_s,
                                     f"sparse update of {sparse.num_elements(payload)} elements in "
                                     f"{len(entries)} tensors")
        result.update(dense_bytes=dense, elements=sparse.num_elements(payload))
        return result

    def update_weights_from_delta(self, base_dir, delta_path, weight_version: str | None = None,
                                  base_version: str | None = None, flush_cache: bool = True,
                                  abort_all_requests: bool = False, staging: str = "layer",
                                  keep_snapshot: bool = False, tmp_dir=None, wait_timeout_s: float = 600.0) -> dict:
        """Rebuild a checkpoint from a base snapshot on shared disk plus a byte delta
        (``delta.make_delta``), into a temporary directory, and load it through the usual
        disk update. A base that is not the delta's base raises ``UpdateError`` before
        anything is written or changed. ``weight_version`` defaults to the version the
        delta recorded for the new checkpoint. Adds ``delta_bytes`` and a ``reconstruct``
        phase to the disk update's result."""
        import tempfile
        from pathlib import Path

        from course_lib.weights.transports import delta

        self._refuse_if_busy(abort_all_requests)  # refuse cheaply, before reading any bytes
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="delta-", dir=tmp_dir) as work:
            try:
                index = delta.apply_delta(base_dir, delta_path, Path(work) / "checkpoint", base_version)
            except delta.DeltaError as exc:
                raise UpdateError(str(exc)) from exc
            reconstruct_ms = 1e3 * (time.perf_counter() - t0)
            if weight_version is None:
                weight_version = index["new"]["weight_version"]
            result = self.update_weights_from_disk(Path(work) / "checkpoint", weight_version, flush_cache,
                                                   abort_all_requests, staging=staging,
                                                   keep_snapshot=keep_snapshot, wait_timeout_s=wait_timeout_s)
        result["timings_ms"] = {"reconstruct": reconstruct_ms, **result["timings_ms"]}
        result["elapsed_ms"] += reconstruct_ms
        result["delta_bytes"] = Path(delta_path).stat().st_size
        self.waiting_for_weights = False  # a full checkpoint was loaded
        return result

    def send_weights_to_remote(self, master_address: str, master_port: int, group_name: str = "remote_seed",
                               backend: str | None = None, bucket_bytes: int | None = None) -> dict:
        """Seed a new engine: be rank 0 of a two-rank group and broadcast this engine's
        checkpoint-format weights in buckets (see remote.py). Blocks until the new engine
        joins and has received everything. Raises ``RemoteSeedError`` if it refuses them
        (a different structure), or if this engine cannot send exact weights (quantized,
        a tensor-parallel rank, itself still waiting). Requests in flight keep their
        state; the weights are only read."""
        from course_lib.weights.transports import dist as dist_mod
        from course_lib.weights.transports import remote

        return remote.send(self, master_address, master_port, group_name, backend,
                           bucket_bytes or dist_mod.DEFAULT_BUCKET_BYTES)

    def receive_weights_from_remote(self, master_address: str, master_port: int, group_name: str = "remote_seed",
                                    backend: str | None = None, weight_version: str | None = None,
                                    timeout_s: float = 300.0) -> dict:
        """Join a source engine's seeding group as rank 1, receive every weight, load them
        and become ready (an engine started with ``load_format="dummy"`` serves from then
        on). A source with a different structure is refused before any bytes move (the
        source is told, so it does not hang). ``weight_version`` defaults to the source's."""
        from course_lib.layers.quant import process_weights_after_loading as post_process
        from course_lib.weights.transports import remote

        timer = PhaseTimer()
        self._refuse_sharded("remote seeding")
        self._refuse_if_busy(False)
        device = torch.device(self.config.device)
        backend = backend or ("nccl" if device.type == "cuda" else "gloo")
        group, _store = dist_transport.new_group(master_address, master_port, 1, 2, group_name, backend, timeout_s)
        manifest = remote.receive_message(group, 0, device)
        problem = remote.check_manifest(manifest, self.model_config)
        remote.send_message(group, remote.verdict(problem), 1, device)
        if problem:
            raise UpdateError(f"remote seeding refused: {problem}")
        buckets = manifest["buckets"]
        nbytes = sum(torch.Size(s).numel() * getattr(torch, d).itemsize
                     for b in buckets for d, s in zip(b["dtypes"], b["shapes"]))
        timer.lap("handshake")

        def apply(timer: PhaseTimer) -> dict:
            try:
                for request in buckets:
                    tensors = dist_transport.receive_bucket(group, request["names"], request["dtypes"],
                                                            request["shapes"], self.config.device)
                    timer.lap("transfer")
                    self._chunk_applier(tensors, allow_pending=True)(timer)  # a fused layer may span buckets
                post_process(self.model)  # every layer complete now, or refused
            except Exception as exc:
                discard_staged_weights(self.model)
                if not self.waiting_for_weights:  # a serving engine now holds a mix of two versions
                    self.unhealthy = f"remote seeding failed midway ({exc}); the weights are a mix of two versions"
                raise UpdateError(f"remote seeding failed midway: {exc}") from exc
            timer.lap("post_process")
            return {}
        version = weight_version if weight_version is not None else manifest["weight_version"]
        result = self._commit_update(apply, nbytes, timer, version, True, False, 600.0,
                                     f"seeded {sum(len(b['names']) for b in buckets)} tensors from "
                                     f"{master_address}:{master_port}")
        self.waiting_for_weights = False
        return result

    # ---- end of sparse, delta and remote-seeding transports -----------------------------

    def _refuse_if_busy(self, abort_all_requests: bool) -> None:
        in_flight = len(self.scheduler.running) + len(self.scheduler.waiting)
        if in_flight and not self.paused and not abort_all_requests:
            raise EngineBusyError(f"{in_flight} requests in flight and generation is not paused: "
                                  f"call pause_generation(mode) first, or pass abort_all_requests=True")

    def _commit_update(self, apply, nbytes: int, timer: PhaseTimer, weight_version, flush_cache: bool,
                       abort_all_requests: bool, wait_timeout_s: float, message: str) -> dict:
        """Everything after validation: requests, ``apply(timer)`` (the in-place writes),
        audit, version, cache, and the pause's cost record."""
        if self.paused:
            record = self.pause_stats[-1]
        else:
            in_flight = bool(self.scheduler.running or self.scheduler.waiting)
            record = new_pause_record("abort" if in_flight else "none")
            self.pause_stats.append(record)
        if abort_all_requests:
            self._abort_all("aborted by a weight update (abort_all_requests=True)", record)
        if self.paused and self.pause_mode == "wait":
            self._drain(wait_timeout_s, record)
            timer.lap("wait")
        extra = apply(timer)
        self.verify_addresses(only=extra.pop("audit_only", None))
        timer.lap("audit")
        self.weight_update_count += 1
        self.block_manager.salt = self.weight_update_count  # old prefix entries can never match again
        if weight_version is not None:
            self.weight_version = str(weight_version)
        cleared = self.block_manager.flush() if flush_cache else 0
        timer.lap("flush")
        survivors = list(self.scheduler.running) + list(self.scheduler.waiting)
        # Several chunks may land in one pause: a request is mixed once, however many chunks.
        record["mixed_requests"] = max(record["mixed_requests"],
                                       sum(1 for s in survivors if s.num_completion_tokens > 0))
        record["kv_fresh"] = record["kv_fresh"] and self.live_kv_is_fresh()
        record["updates"] += 1
        result = {"success": True, "message": message,
                  "weight_version": self.weight_version, "weight_update_count": self.weight_update_count,
                  "num_paused_requests": len(survivors), "entries_cleared": cleared, "bytes": nbytes,
                  "elapsed_ms": sum(timer.ms.values()), "timings_ms": timer.ms, **extra}
        self.update_history.append(result)
        return result

    def _drain(self, timeout_s: float, record: dict) -> None:
        """``wait`` mode: run the in-flight requests to completion before the update."""
        t0 = time.perf_counter()
        while self.scheduler.running or self.scheduler.waiting:
            if time.perf_counter() - t0 > timeout_s:
                record["wait_s"] += time.perf_counter() - t0
                raise TimeoutError(f"in-flight requests did not finish within {timeout_s} s; "
                                   f"the weights were not changed")
            finished = self.step()  # returns (and clears) what was pending, plus new outputs
            self._pending += finished
        record["wait_s"] += time.perf_counter() - t0

