"""The engine's public update methods, by transport (SGLang's offline-engine names).

Each one builds its source (``update_sources.py``: validated before anything live
changes) and hands it to the transaction (``transaction.py``: requests, in-place
apply, address audit, version, cache, pause record). Names, keyword arguments and the
returned fields are those of SGLang's Engine, which the HTTP server, the RL loop and the
chapters call. ``WeightUpdates`` also owns the transfer state: the weight-update groups
a trainer broadcasts on and the CUDA IPC buffers recently received.
"""
from __future__ import annotations

import collections
import tempfile
import time
from pathlib import Path

import torch

from course_lib.engine import update_sources as sources
from course_lib.engine.transaction import WAIT_TIMEOUT_S, Applied, UpdateOptions, ValidatedUpdate
from course_lib.weights import registered, safe_pickle
from course_lib.weights.transports import delta, remote
from course_lib.weights.transports import dist as dist_transport
from course_lib.weights.update import PhaseTimer, UpdateError


def registered_update(engine, buckets, epoch) -> ValidatedUpdate:
    """A registered update, validated: the epoch, the bucket numbers, every destination
    where registration found it. The apply step launches the copies, checks the
    destinations again while they run, and waits for them (the trainer reuses a buffer
    once the call returns)."""
    timer = PhaseTimer()
    current, table, mode = engine._registration
    if table is None:
        raise UpdateError("no registered buffers: call register_weight_buffers first")
    if epoch != current:
        raise UpdateError(f"registration epoch {epoch!r} is not the current one ({current}): register again")
    try:
        buckets = table.check_buckets(buckets)
        table.check_destinations(buckets)
    except registered.RegistrationError as exc:
        raise UpdateError(str(exc)) from exc
    timer.lap("validate")

    def apply(timer: PhaseTimer) -> Applied:
        table.copy(buckets, mode)
        # The check after the last launch runs on the CPU while the GPU copies (it reads no
        # weight, only where each one lives); then the wait, so the trainer may reuse buffers.
        try:
            table.check_destinations(buckets)
        except registered.RegistrationError as exc:  # cannot happen unless a copy rebinds: say so loudly
            engine.unhealthy = str(exc)
            raise UpdateError(str(exc)) from exc
        timer.lap("audit")
        if engine.config.is_cuda:
            torch.cuda.current_stream(engine.config.device).synchronize()
        timer.lap("copy")
        # The check above is the audit of these parameters (identity, stride included, with
        # the storages held by the table); the full address audit runs when generation resumes.
        return Applied(audit_only=set())
    nbytes = sum(table.nbytes[k] for k in buckets)
    return ValidatedUpdate(apply, nbytes, f"copied {len(buckets)} registered buckets", timer)


class WeightUpdates:
    """The ``update_weights_*`` entry points and the groups they receive on (mixed into ``Engine``)."""

    def _init_transfer_state(self) -> None:
        self._weight_groups: dict = {}      # torch.distributed groups a trainer broadcasts on
        self._ipc_keepalive = collections.deque(maxlen=4)  # recently received CUDA IPC buffers
        self._registration = (0, None, None)  # (epoch, RegisteredTable, copy mode): see registered.py

    def _keep_ipc_buffer(self, tensor: torch.Tensor) -> None:
        # Keep the last few received buffers mapped: a trainer that reuses its buffers
        # then costs one IPC handle opening per buffer, not one per bucket.
        self._ipc_keepalive.append(tensor.untyped_storage())

    def _release_transfer_buffers(self) -> None:
        self._ipc_keepalive.clear()  # unmap the trainer's buffers

    def _weight_group(self, group_name: str):
        if group_name not in self._weight_groups:
            raise ValueError(f"no weight-update group named {group_name!r}; call init_weights_update_group first")
        return self._weight_groups[group_name][0]

    def _refuse_sharded(self, what: str) -> None:
        if getattr(self.model, "tp_size", 1) > 1:
            raise UpdateError(f"{what} is not supported on a tensor-parallel rank: this rank holds only a "
                              f"shard of each tensor, so it cannot rebuild or send checkpoint tensors")

    # ---- from disk and from memory --------------------------------------------------------
    def update_weights_from_disk(self, model_path, weight_version: str | None = None, flush_cache: bool = True,
                                 abort_all_requests: bool = False, partial: bool = False, staging: str = "layer",
                                 keep_snapshot: bool = False, wait_timeout_s: float = WAIT_TIMEOUT_S) -> dict:
        """Load new weights from an HF checkpoint dir, in place, between two steps.

        First the whole checkpoint is validated from its headers (structure, every name,
        shape and dtype, file sizes): a bad checkpoint raises ``UpdateError`` and leaves
        the weights, the version and every request untouched. Then:

        - ``staging="layer"`` (default): stream one decoder layer at a time (extra device
          memory about one layer; see layerwise.py). Each layer's values are checked
          (finite) before it is written, and its old values are copied to host memory
          just before (a rollback point, rollback.py: host memory grows with the layers
          written, freed at the end). A fault found mid-stream (NaN or inf in a later
          tensor, a file truncated or changed while read) puts the written layers back
          and raises ``UpdateError``: the engine serves the old weights, healthy.
        - ``staging="full"``: read everything into host memory first (extra memory: the
          whole model), so even a mid-read fault changes nothing.

        ``keep_snapshot=True`` also keeps the old weights in host memory for ``rollback()``
        (and is then the rollback point). ``config.json``'s runtime fields ``rope_theta``,
        ``bos_token_id`` and ``eos_token_id`` are applied with the weights; a change to a
        field that needs a restart (structure, ``max_position_embeddings``,
        ``rms_norm_eps``) is refused before anything changes (see ``ModelConfig``).

        Trainers should write a new checkpoint to a new directory (or temporary names)
        and then rename it into place: files are read without a memory map, so a file
        rewritten in place (truncate + write) while it is read is refused cleanly and
        never crashes the server, but the update is lost and must be retried.
        Returns SGLang's fields plus ``timings_ms`` per phase, ``bytes`` and ``memory``.
        """
        if staging not in ("layer", "full"):
            raise ValueError(f"staging must be 'layer' or 'full', got {staging!r}")
        self._refuse_if_busy(abort_all_requests)
        update = sources.disk_update(self, model_path, partial, staging, keep_snapshot)
        return self._run_update(update, UpdateOptions(weight_version, flush_cache, abort_all_requests, wait_timeout_s))

    def update_weights_from_tensor(self, named_tensors, load_format: str | None = None, flush_cache: bool = True,
                                   weight_version: str | None = None, abort_all_requests: bool = False,
                                   check_finite: bool = False, wait_timeout_s: float = WAIT_TIMEOUT_S) -> dict:
        """Load tensors handed over in memory (a co-located trainer), in place.

        ``named_tensors``: (name, tensor) pairs or a {name: tensor} dict; or, with
        ``load_format="flattened_bucket"``, a bucket {"flattened_tensor", "metadata"}; or
        either of those serialized (base64 text or bytes, as SGLang clients send; a list
        holds one payload per tensor-parallel rank). Serialized payloads are unpickled
        through an allowlist. Each call is one chunk: validated whole, then applied; names
        are checkpoint names and any subset may come. An empty chunk changes nothing
        (only ``weight_version``, when given, is recorded). ``check_finite`` also refuses
        NaN/inf values; it is off by default because it reads every byte once more, which
        costs about a third of an in-memory update's speed. (A quantized engine always
        refuses NaN/inf in the tensors it requantizes, before writing anything: its
        quantizers could not quantize them.)
        """
        self._refuse_if_busy(abort_all_requests)
        update = sources.tensor_update(self, named_tensors, load_format, check_finite)
        if update is None:
            return self._nothing_to_apply(weight_version, "empty update: nothing to apply")
        return self._run_update(update, UpdateOptions(weight_version, flush_cache, abort_all_requests, wait_timeout_s))

    # ---- registered buffers (weights/registered.py): the layout once, then bucket numbers --
    def register_weight_buffers(self, payload, partial: bool = False, copy_mode: str | None = None) -> dict:
        """Map a trainer's reusable buffers and validate its whole layout once
        (``registered.stream_layout``'s shape: {"buffers", "buckets", "tensors"}, as a dict
        or serialized like ``update_weights_from_tensor``'s payloads). Replaces an earlier
        registration; returns its ``epoch``, which every ``update_weights_from_registered``
        call must name (a trainer still sending for an old registration is refused). Writes
        no weight. Refused on quantized engines and tensor-parallel ranks. ``copy_mode``:
        how each bucket's copies run ("loop", "foreach", "graph" or "scatter"; default
        ``registered.copy_mode``: on a GPU one scatter kernel per bucket, or a CUDA graph
        without Triton)."""
        self._refuse_sharded("registering buffers")
        try:
            if isinstance(payload, (str, bytes)):
                payload = safe_pickle.deserialize(payload)
            table = registered.RegisteredTable.build(self.model, payload, self.config.device, partial)
            mode = registered.copy_mode(self.config.device, copy_mode)
            table.prepare(mode)
        except registered.RegistrationError as exc:
            raise UpdateError(f"registration refused: {exc}") from exc
        self._registration = (self._registration[0] + 1, table, mode)
        return {"success": True, "epoch": self._registration[0], "buckets": table.num_buckets,
                "tensors": len(table.names), "bytes": sum(table.nbytes), "copy_mode": mode}

    def unregister_weight_buffers(self) -> dict:
        """Forget the registration (unmap the trainer's buffers)."""
        epoch, table, _ = self._registration
        self._registration = (epoch, None, None)
        return {"success": True, "message": "no registration to drop" if table is None else f"dropped epoch {epoch}"}

    def update_weights_from_registered(self, buckets, epoch: int, weight_version: str | None = None,
                                       flush_cache: bool = True, abort_all_requests: bool = False,
                                       wait_timeout_s: float = WAIT_TIMEOUT_S) -> dict:
        """Copy registered ``buckets`` (bucket numbers whose bytes the trainer has written)
        into the weights, in place, as one update. ``epoch`` must be the current
        registration's. Nothing is unpickled or looked up per tensor: the copies come from
        the table validated at registration. Each destination is checked before the first
        copy and after the last (a rebound weight refuses the update, nothing written);
        returns once the copies are done, so the trainer may reuse those buffers."""
        self._refuse_if_busy(abort_all_requests)
        update = registered_update(self, buckets, epoch)
        return self._run_update(update, UpdateOptions(weight_version, flush_cache, abort_all_requests, wait_timeout_s))

    # ---- torch.distributed groups (the trainer broadcasts, the engine receives) ---------
    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str | None = None) -> dict:
        """Join the trainer's weight-update group as rank ``rank_offset + tp_rank`` (blocks
        until every rank has joined). ``backend``: "nccl" on GPU, "gloo" on CPU by default."""
        if group_name in self._weight_groups:
            raise ValueError(f"weight-update group {group_name!r} already exists; destroy it first")
        backend = backend or ("nccl" if self.config.is_cuda else "gloo")
        rank = rank_offset + self.config.tp_rank
        self._weight_groups[group_name] = dist_transport.new_group(master_address, master_port, rank, world_size,
                                                                   group_name, backend)
        return {"success": True, "message": f"joined {group_name!r} as rank {rank} of {world_size} ({backend})"}

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        if self._weight_groups.pop(group_name, None) is None:
            raise ValueError(f"no weight-update group named {group_name!r}")
        return {"success": True, "message": f"destroyed {group_name!r}"}

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name: str = "weight_update_group",
                                        flush_cache: bool = True, weight_version: str | None = None,
                                        load_format: str | None = None, abort_all_requests: bool = False,
                                        check_finite: bool = False, wait_timeout_s: float = WAIT_TIMEOUT_S,
                                        refuse_with: str | None = None) -> dict:
        """Receive tensors the trainer broadcasts (rank 0) and load them in place.

        ``load_format="flattened_bucket"``: all named tensors arrive as one byte buffer;
        otherwise one broadcast per tensor (SGLang's default). The bytes are received even
        when the update is refused (busy, unknown name, wrong shape): the trainer is
        already sending, and a receiver that walked away would leave it hanging.
        ``refuse_with``: receive, then refuse with this message (a tensor-parallel rank
        whose rank 0 refused: every rank must take the broadcast and none may apply it).
        """
        update = sources.broadcast_update(self, group_name, names, dtypes, shapes, load_format, check_finite,
                                          abort_all_requests, refuse_with)
        return self._run_update(update, UpdateOptions(weight_version, flush_cache, abort_all_requests, wait_timeout_s))

    def update_weights_resharded(self, plan, group_name: str = "weight_update_group",
                                 weight_version: str | None = None, flush_cache: bool = True,
                                 abort_all_requests: bool = False, refuse_with: str | None = None,
                                 trainer_group_ranks=None, engine_group_ranks=None) -> dict:
        """Receive this rank's pieces of a resharded update (``weights/reshard.py``): only
        what its shard needs, from whichever trainer ranks hold them, then load them
        through the transaction. The pieces are received even when the update is refused
        (``refuse_with``, busy, a plan that does not match): the trainers are already
        sending. Adds ``received_bytes`` and ``pieces`` to the usual fields."""
        update = sources.resharded_update(self, plan, group_name, abort_all_requests, refuse_with,
                                          trainer_group_ranks, engine_group_ranks)
        return self._run_update(update, UpdateOptions(weight_version, flush_cache, abort_all_requests))

    # ---- sparse, delta and remote seeding (transports/{sparse,delta,remote}.py) -----------
    def update_weights_sparse(self, payload: dict, flush_cache: bool = True, weight_version: str | None = None,
                              abort_all_requests: bool = False, wait_timeout_s: float = WAIT_TIMEOUT_S) -> dict:
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
        if self.config.quantization is not None:
            raise UpdateError(f"sparse updates are refused on a {self.config.quantization}-quantized engine: it "
                              f"does not hold the checkpoint's floats to scatter into; send the touched tensors "
                              f"densely with update_weights_from_tensor")
        self._refuse_sharded("a sparse update")
        self._refuse_if_busy(abort_all_requests)
        update = sources.sparse_update(self, payload)
        if update is None:
            return self._nothing_to_apply(weight_version, "empty sparse update: nothing changed",
                                          dense_bytes=0, elements=0)
        return self._run_update(update, UpdateOptions(weight_version, flush_cache, abort_all_requests, wait_timeout_s))

    def update_weights_from_delta(self, base_dir, delta_path, weight_version: str | None = None,
                                  base_version: str | None = None, flush_cache: bool = True,
                                  abort_all_requests: bool = False, staging: str = "layer",
                                  keep_snapshot: bool = False, tmp_dir=None,
                                  wait_timeout_s: float = WAIT_TIMEOUT_S) -> dict:
        """Rebuild a checkpoint from a base snapshot on shared disk plus a byte delta
        (``delta.make_delta``), into a temporary directory, and load it through the usual
        disk update. A base that is not the delta's base raises ``UpdateError`` before
        anything is written or changed. ``weight_version`` defaults to the version the
        delta recorded for the new checkpoint. Adds ``delta_bytes`` and a ``reconstruct``
        phase to the disk update's result."""
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
        return remote.send(self, master_address, master_port, group_name, backend,
                           bucket_bytes or dist_transport.DEFAULT_BUCKET_BYTES)

    def receive_weights_from_remote(self, master_address: str, master_port: int, group_name: str = "remote_seed",
                                    backend: str | None = None, weight_version: str | None = None,
                                    timeout_s: float = 300.0) -> dict:
        """Join a source engine's seeding group as rank 1, receive every weight, load them
        and become ready (an engine started with ``load_format="dummy"`` serves from then
        on). A source with a different structure is refused before any bytes move (the
        source is told, so it does not hang). ``weight_version`` defaults to the source's."""
        self._refuse_sharded("remote seeding")
        self._refuse_if_busy(False)
        update, source_version = sources.remote_update(self, master_address, master_port, group_name, backend,
                                                       timeout_s)
        result = self._run_update(update, UpdateOptions(source_version if weight_version is None else weight_version))
        self.waiting_for_weights = False
        return result
