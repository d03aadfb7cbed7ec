"""The update side: every hot update's transaction, versions, health, snapshots and rollback.

``Updater`` is built from a narrow core (the model, the scheduler, the block manager, the
address audit and the model runner whose KV pool and graph outputs it audits), the
engine's ``PauseControl``, and its commit step (``commit``: how validated tensors are
copied into the model; ``weights/commit/validate.py``'s ``copy_in_place`` unless another is given,
as a grader gives a learner's). The engine composes it and keeps SGLang's method names
as one-line delegations (``engine.py``).

Each ``update_weights_*`` method builds an update source (``update_sources.py``), whose
``validate`` checks everything before anything live changes, and hands the validated
update to ``apply``, which does the rest, in this order, for every transport alike:

1. the pause record (the current pause's, or a new one), ``abort_all_requests``, and
   ``wait`` mode's drain: requests are settled before anything live changes;
2. ``source.write``: the in-place writes (through the commit step or the model's
   loaders), then post-processing;
3. the address audit (all of it, or the parameters the write step names);
4. the version, the prefix-cache salt and the flush (old cache entries never match);
5. the pause's cost record and the result (SGLang's fields, ``timings_ms``, ``bytes``).
"""
from __future__ import annotations

import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from course_lib.config import EngineConfig, ModelConfig
from course_lib.engine.block_manager import BlockManager
from course_lib.engine.history import UPDATE_HISTORY_SIZE, History
from course_lib.engine.pause import PauseControl
from course_lib.engine.records import AUDIT_ALL, WAIT_TIMEOUT_S, Audit, Snapshot, UpdateOptions, UpdateResult
from course_lib.engine.scheduler import Scheduler
from course_lib.engine.transfers import Transfers
from course_lib.engine.update_sources import (BroadcastSource, DiskSource, RegisteredSource, RemoteSource,
                                              ReshardSource, SnapshotSource, SparseSource, TensorSource,
                                              ValidatedUpdate)
from course_lib.layers.quant import discard_staged_weights, kernel_tensors, pending_layers
from course_lib.layers.rotary import RotaryEmbedding
from course_lib.tokenizer import ByteTokenizer
from course_lib.weights.commit.audit import AddressAudit, AddressMovedError
from course_lib.weights.transports import delta
from course_lib.weights.commit.validate import UpdateError
from course_lib.weights.commit.copy_plan import copy_in_place


def audited_extras(model_runner) -> dict:
    """Tensors kernels read besides the model's: the KV pool, the graphs' output buffers and
    the prefill graphs' input buffers."""
    extras = {"kv_cache": model_runner.kv_cache}
    for bs, out in getattr(model_runner, "graph_outputs", {}).items():
        extras[f"cuda_graph_logits[{bs}]"] = out
    for tokens, (_, inputs, out) in getattr(model_runner, "prefill_graphs", {}).items():
        extras[f"prefill_graph_inputs[{tokens}]"] = inputs
        extras[f"prefill_graph_logits[{tokens}]"] = out
    return extras


class Updater:
    """Hot updates of one engine rank: the transaction and the state it keeps."""

    def __init__(self, *, model, config: EngineConfig, model_config: ModelConfig, scheduler: Scheduler,
                 block_manager: BlockManager, tokenizer: ByteTokenizer, audit: AddressAudit, model_runner,
                 pause: PauseControl, commit=copy_in_place, waiting_for_weights: bool = False):
        self.model, self.config, self.model_config = model, config, model_config
        self.scheduler, self.block_manager, self.tokenizer = scheduler, block_manager, tokenizer
        self.audit, self.model_runner, self.pause = audit, model_runner, pause
        self.commit = commit                    # (model, named_tensors, device): the commit step
        self.transfers = Transfers(config.device, config.tp_rank)
        self.weight_version = "default"
        self.weight_update_count = 0
        self.history = History(UPDATE_HISTORY_SIZE)  # each update's UpdateResult, the newest ones
        self.snapshot: Snapshot | None = None   # host copy of the weights for rollback (take_snapshot)
        self.unhealthy: str | None = None       # why the engine must not serve, if it must not
        self.waiting_for_weights = waiting_for_weights  # load_format="dummy": nothing loaded yet

    # ---- the transaction ---------------------------------------------------------------------
    def apply(self, update: ValidatedUpdate, options: UpdateOptions) -> dict:
        """Everything after validation (see the module docstring); returns SGLang's reply."""
        timer, pause = update.timer, self.pause
        record = pause.record_for_update()
        if options.abort_all_requests:
            pause.abort_all("aborted by a weight update (abort_all_requests=True)", record)
        if pause.paused and pause.pause_mode == "wait":
            pause.drain(options.wait_timeout_s, record)
            timer.lap("wait")
        applied = update.source.write(self, timer)
        self.verify_addresses(applied.audit)
        timer.lap("audit")
        self.weight_update_count += 1
        self.block_manager.salt = self.weight_update_count  # old prefix entries can never match again
        if options.weight_version is not None:
            self.weight_version = str(options.weight_version)
        cleared = self.block_manager.flush() if options.flush_cache else 0
        timer.lap("flush")
        survivors = list(self.scheduler.running) + list(self.scheduler.waiting)
        # Several chunks may land in one pause: a request is mixed once, however many chunks.
        record.mixed_requests = max(record.mixed_requests, sum(1 for s in survivors if s.num_completion_tokens > 0))
        record.kv_fresh = record.kv_fresh and pause.live_kv_is_fresh(self.weight_update_count)
        record.updates += 1
        result = UpdateResult(update.message, self.weight_version, self.weight_update_count, update.nbytes,
                              timer.ms, len(survivors), cleared, {**update.fields, **applied.fields})
        self.history.append(result)
        return result.as_dict()

    def nothing_to_apply(self, weight_version: str | None, message: str, **fields) -> dict:
        """An empty update changes nothing but the version label, when one is given."""
        if weight_version is not None:
            self.weight_version = str(weight_version)
        # The same fields as an applied update's: nothing moved, nothing cleared.
        return UpdateResult(message, self.weight_version, self.weight_update_count, 0, {},
                            self.pause.in_flight(), 0, fields).as_dict()

    # ---- the address audit and health ---------------------------------------------------------
    def audited_extras(self) -> dict:
        """The engine's other tensors kernels read, audited like the weights."""
        return audited_extras(self.model_runner)

    def verify_addresses(self, audit: Audit = AUDIT_ALL) -> None:
        """Raise AddressMovedError (and stop serving) if a tensor kernels read has moved
        (``audit``: every one, or just the named parameters)."""
        try:
            self.audit.verify(self.model, self.audited_extras(), None if audit.names is None else set(audit.names))
        except AddressMovedError as exc:
            self.unhealthy = str(exc)
            raise

    def check_healthy(self) -> None:
        if self.unhealthy:
            raise RuntimeError(f"engine is unhealthy and refuses work until restarted: {self.unhealthy}")

    def health(self) -> dict:
        waiting = self.waiting_for_weights
        return {"healthy": self.unhealthy is None, "ready": self.unhealthy is None and not waiting,
                "reason": self.unhealthy or ("waiting for weights" if waiting else None),
                "paused": self.pause.paused, "weight_version": self.weight_version}

    def update_weight_version(self, new_version: str) -> dict:
        self.weight_version = str(new_version)
        return {"success": True, "new_version": self.weight_version}

    def continue_generation(self) -> dict:
        """Resume: frozen and retracted requests go on with the current weights. Refused
        while a chunked update left a quantized fused layer waiting for shards."""
        waiting = pending_layers(self.model)
        if waiting:
            raise UpdateError(f"cannot resume: {len(waiting)} layers still wait for shards of an update, "
                              f"e.g. {next(iter(waiting.items()))}; send them first")
        t0 = time.perf_counter()
        if self.pause.paused:
            self.verify_addresses()  # the full audit, once per pause, before serving again
            record = self.pause.resume()
            if self.config.is_cuda:
                self.transfers.release()
                torch.cuda.empty_cache()  # return the update's temporaries (as SGLang does)
            record.resume_ms = 1e3 * (time.perf_counter() - t0)
        return {"paused": False}

    def apply_runtime_config(self, new) -> dict:
        """Apply ``config.json``'s runtime fields (``ModelConfig.runtime_fields``) from
        ``new``, as a cold start on that directory would have them: the rotary tables
        recomputed in place for ``rope_theta``, the tokenizer's and the scheduler's token
        ids. Returns {field: [old, new]} for what changed. Fields that need a restart
        were refused before anything changed (``validate_config``)."""
        current = self.model_config
        changed = {f: [getattr(current, f), getattr(new, f)] for f in current.runtime_fields
                   if getattr(current, f) != getattr(new, f)}
        for name, (_, value) in changed.items():
            setattr(current, name, value)
        if "rope_theta" in changed:
            for module in self.model.modules():
                if isinstance(module, RotaryEmbedding):
                    module.set_theta(current.rope_theta)
        self.tokenizer.bos_token_id = current.bos_token_id
        self.tokenizer.eos_token_id = self.scheduler.eos_token_id = current.eos_token_id
        return changed

    # ---- snapshots and rollback (host memory, no disk read) ------------------------------------
    def take_snapshot(self) -> Snapshot:
        """Keep a host copy of every tensor the kernels read, with the current version label;
        ``rollback()`` copies it back in place. Costs one model of host memory.

        Promises: sets and returns ``self.snapshot``, a ``Snapshot`` whose
        ``weight_version`` is the label live now, whose ``tensors`` map every name of
        ``kernel_tensors(self.model)`` (parameters, fused q/k/v and gate/up, quantization
        scales, the rotary tables) to a host tensor of the same shape and dtype holding
        the values live now (a later update must not change them), and whose ``config`` is
        a copy of ``self.model_config`` with the runtime fields as they are now (an update
        may change ``rope_theta``, ``eos_token_id``, ... in place; a rollback puts them
        back). On CUDA (``self.config.is_cuda``) the host tensors are pinned, and every
        copy has finished when this returns, at the cost of at most one synchronization."""
        # BEGIN EXERCISE ch09.host_snapshot
        pin = self.config.is_cuda
        tensors = {}
        for name, t in kernel_tensors(self.model).items():
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            host.copy_(t, non_blocking=pin)
            tensors[name] = host
        if pin:
            torch.cuda.synchronize(self.config.device)
        runtime = {f: getattr(self.model_config, f) for f in self.model_config.runtime_fields}
        self.snapshot = Snapshot(self.weight_version, tensors, replace(self.model_config, **runtime))
        return self.snapshot
        # END EXERCISE

    def restore(self, snapshot: Snapshot) -> None:
        live = kernel_tensors(self.model)
        for name, host in snapshot.tensors.items():
            live[name].copy_(host, non_blocking=True)
        if self.config.is_cuda:
            torch.cuda.synchronize()

    def rollback(self, flush_cache: bool = True, abort_all_requests: bool = False) -> dict:
        """Restore the snapshot (bitwise the old weights and version), in place, with no
        disk read. Same rules as any update: pause first if requests are in flight."""
        if self.snapshot is None:
            raise UpdateError("no snapshot to roll back to: take_snapshot() or update with keep_snapshot=True")
        self.pause.refuse_if_busy(abort_all_requests)
        update = SnapshotSource(self.snapshot).validate(self)
        return self.apply(update, UpdateOptions(self.snapshot.weight_version, flush_cache, abort_all_requests))

    def after_midstream_fault(self, applied_layers: list[str], exc: Exception, rollback=None):
        """A streamed update failed after validation: nothing written yet (refuse), or put
        the written layers back (``rollback``: a ``RollbackPoint`` of just those layers,
        else the snapshot when one was kept) and refuse: the engine serves the old weights.
        Only when neither exists (or restoring fails) does it stop serving a mix of two versions."""
        discard_staged_weights(self.model)
        if not applied_layers:
            raise exc if isinstance(exc, UpdateError) else UpdateError(f"update failed before any layer "
                                                                       f"changed: {exc}") from exc
        try:
            if rollback is not None:
                rollback.restore()
                raise UpdateError(f"update refused after {len(applied_layers)} layers were written ({exc}); "
                                  f"those layers were restored: the engine serves the old weights") from exc
            if self.snapshot is not None:
                self.restore(self.snapshot)
                raise UpdateError(f"update failed after {len(applied_layers)} layers ({exc}); the weights "
                                  f"were restored from the snapshot") from exc
        except UpdateError:
            raise
        except Exception as restore_error:  # noqa: BLE001 - restoring itself failed: a mix of versions
            exc = RuntimeError(f"{exc}; restoring the old layers failed too: {restore_error}")
        self.unhealthy = (f"update failed after {len(applied_layers)} layers were written ({exc}); "
                          f"the weights are a mix of two versions")
        raise UpdateError(self.unhealthy) from exc

    def refuse_sharded(self, what: str) -> None:
        if getattr(self.model, "tp_size", 1) > 1:  # the model's own word: what its weights hold
            raise UpdateError(f"{what} is not supported on a tensor-parallel rank: this rank holds only a "
                              f"shard of each tensor, so it cannot rebuild or send checkpoint tensors")

    # ---- the update methods (SGLang's names and fields) ---------------------------------------
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
        self.pause.refuse_if_busy(abort_all_requests)
        update = DiskSource(model_path, partial, staging, keep_snapshot).validate(self)
        return self.apply(update, UpdateOptions(weight_version, flush_cache, abort_all_requests, wait_timeout_s))

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
        self.pause.refuse_if_busy(abort_all_requests)
        update = TensorSource(named_tensors, load_format, check_finite).validate(self)
        if update is None:
            return self.nothing_to_apply(weight_version, "empty update: nothing to apply")
        return self.apply(update, UpdateOptions(weight_version, flush_cache, abort_all_requests, wait_timeout_s))

    def register_weight_buffers(self, payload, partial: bool = False, copy_mode: str | None = None) -> dict:
        """Map a trainer's reusable buffers and validate its whole layout once
        (``copy_table.stream_layout``'s shape: {"buffers", "buckets", "tensors"}, as a dict
        or serialized like ``update_weights_from_tensor``'s payloads). Replaces an earlier
        registration; returns its ``epoch``, which every ``update_weights_from_registered``
        call must name (a trainer still sending for an old registration is refused). Writes
        no weight. Refused on quantized engines and tensor-parallel ranks. ``copy_mode``:
        how each bucket's copies run ("loop", "foreach", "graph" or "scatter"; default
        ``copy_table.copy_mode``: on a GPU one scatter kernel per bucket, or a CUDA graph
        without Triton)."""
        self.refuse_sharded("registering buffers")
        return self.transfers.register(self.model, payload, partial, copy_mode)

    def unregister_weight_buffers(self) -> dict:
        """Forget the registration (unmap the trainer's buffers)."""
        return self.transfers.unregister()

    def update_weights_from_registered(self, buckets, epoch: int, weight_version: str | None = None,
                                       flush_cache: bool = True, abort_all_requests: bool = False,
                                       wait_timeout_s: float = WAIT_TIMEOUT_S) -> dict:
        """Copy registered ``buckets`` (bucket numbers whose bytes the trainer has written)
        into the weights, in place, as one update. ``epoch`` must be the current
        registration's. Nothing is unpickled or looked up per tensor: the copies come from
        the table validated at registration. Each destination is checked before the first
        copy and after the last (a rebound weight refuses the update, nothing written);
        returns once the copies are done, so the trainer may reuse those buffers."""
        self.pause.refuse_if_busy(abort_all_requests)
        update = RegisteredSource(buckets, epoch).validate(self)
        return self.apply(update, UpdateOptions(weight_version, flush_cache, abort_all_requests, wait_timeout_s))

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
        source = BroadcastSource(group_name, names, dtypes, shapes, load_format, check_finite, abort_all_requests,
                                 refuse_with)
        return self.apply(source.validate(self),
                          UpdateOptions(weight_version, flush_cache, abort_all_requests, wait_timeout_s))

    def update_weights_resharded(self, plan, group_name: str = "weight_update_group",
                                 weight_version: str | None = None, flush_cache: bool = True,
                                 abort_all_requests: bool = False, refuse_with: str | None = None,
                                 trainer_group_ranks=None, engine_group_ranks=None) -> dict:
        """Receive this rank's pieces of a resharded update (``weights/reshard/``): only
        what its shard needs, from whichever trainer ranks hold them, then load them
        through the transaction. The pieces are received even when the update is refused
        (``refuse_with``, busy, a plan that does not match): the trainers are already
        sending. Adds ``received_bytes`` and ``pieces`` to the usual fields."""
        source = ReshardSource(plan, group_name, abort_all_requests, refuse_with, trainer_group_ranks,
                               engine_group_ranks)
        return self.apply(source.validate(self), UpdateOptions(weight_version, flush_cache, abort_all_requests))

    def update_weights_sparse(self, payload: dict, read_weight, flush_cache: bool = True,
                              weight_version: str | None = None, abort_all_requests: bool = False,
                              wait_timeout_s: float = WAIT_TIMEOUT_S) -> dict:
        """Apply a sparse payload (``sparse.diff``): only changed elements, in checkpoint
        coordinates. The whole payload is validated first (names, shapes, dtypes, index
        bounds); a bad one raises ``UpdateError`` with nothing changed. Each touched
        checkpoint tensor is rebuilt from the engine's current values (``read_weight(name,
        rows)``) with the new elements scattered in, then loaded through the model's
        loaders (fusion included).

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
        self.refuse_sharded("a sparse update")
        self.pause.refuse_if_busy(abort_all_requests)
        update = SparseSource(payload, read_weight).validate(self)
        if update is None:
            return self.nothing_to_apply(weight_version, "empty sparse update: nothing changed",
                                         dense_bytes=0, elements=0)
        return self.apply(update, UpdateOptions(weight_version, flush_cache, abort_all_requests, wait_timeout_s))

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
        self.pause.refuse_if_busy(abort_all_requests)  # refuse cheaply, before reading any bytes
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

    def receive_weights_from_remote(self, master_address: str, master_port: int, group_name: str = "remote_seed",
                                    backend: str | None = None, weight_version: str | None = None,
                                    timeout_s: float = 300.0) -> dict:
        """Join a source engine's seeding group as rank 1, receive every weight, load them
        and become ready (an engine started with ``load_format="dummy"`` serves from then
        on). A source with a different structure is refused before any bytes move (the
        source is told, so it does not hang). ``weight_version`` defaults to the source's."""
        self.refuse_sharded("remote seeding")
        self.pause.refuse_if_busy(False)
        source = RemoteSource(master_address, master_port, group_name, backend, timeout_s)
        update = source.validate(self)
        result = self.apply(update, UpdateOptions(source.source_version if weight_version is None
                                                  else weight_version))
        self.waiting_for_weights = False
        return result
