"""The update side's one entry: every hot update's transaction, and the state it keeps.

``Updater.update(source, options)`` is the only way weights change. A source (one per
transport, ``update/sources/``) says what arrives; ``UpdateOptions`` how requests in
flight are treated. The transaction, for every transport alike:

1. **refuse or plan**: refused while requests are in flight, generation is not paused and
   the update was not asked to abort them (the busy check lives here alone), or when told
   to (``refuse_with``: a tensor-parallel rank whose rank 0 refused); else
   ``source.validate`` returns the plan (the bytes, the writer and why not the faster
   ones). A refusal changes nothing; a sender already pushing bytes has them taken first
   (``source.refused``), so it never hangs;
2. **fetch**: ``source.fetch`` receives, reads or rebuilds the bytes (nothing live changes);
3. **snapshot**: a host copy of the weights, when the plan keeps one;
4. **requests**: the pause record (the current pause's, or a new one), ``abort_all_requests``,
   and ``wait`` mode's drain, before anything live changes;
5. **write**: the plan's writer (``update/writers.py``), the runtime config fields, and the
   address audit; a write that fails midway is put back (its rollback point, or the
   snapshot) or leaves the engine unhealthy (the health flag is set here alone);
6. **version**: the label, the prefix-cache salt and the flush (old entries never match
   again); the pause's cost record; the result (SGLang's fields, ``timings_ms``,
   ``bytes``, ``writer`` and ``writers_declined``).

Sources and writers see the engine only through ``UpdatePort`` (``update/port.py``). The
engine composes this class; SGLang's method names are a table of adapters over
``update`` (``update/methods.py``).
"""
from __future__ import annotations

import time
from dataclasses import replace

import torch

from course_lib.config import EngineConfig, ModelConfig
from course_lib.layers.quant import kernel_tensors, pending_layers
from course_lib.layers.rotary import RotaryEmbedding
from course_lib.history import UPDATE_HISTORY_SIZE, History
from course_lib.update.one_call import asks_for_one_call, with_pause
from course_lib.update.port import Parts, UpdatePort
from course_lib.update.records import (AUDIT_ALL, AUDIT_NONE, Applied, Audit, PartialWrite, PhaseTimer, Snapshot,
                                       UpdateOptions, UpdatePlan, UpdateResult)
from course_lib.update.sources.base import UpdateSource
from course_lib.update.transfers import Transfers
from course_lib.update.writers import WRITERS, restore
from course_lib.weights.commit.audit import AddressMovedError
from course_lib.weights.commit.validate import UpdateError

REFUSALS = (ValueError, RuntimeError)  # UpdateError, EngineBusyError, ReshardError, ...: nothing changed


class Updater:
    """Hot updates of one engine rank: the transaction and the state it keeps.

    Built from what it acts on: the model and its configs, the scheduler (the requests),
    the block manager (the prefix cache), the tokenizer (its token ids follow config.json),
    the address audit and ``extras`` (the other tensors kernels read: the KV pool, graph
    buffers), the engine's ``PauseControl``, and ``commit`` (the commit step: None for the
    engine's own; a grader plugs in a learner's)."""

    def __init__(self, *, model, config: EngineConfig, model_config: ModelConfig, scheduler, block_manager,
                 tokenizer, audit, extras, pause, commit=None, waiting_for_weights: bool = False):
        self.model, self.config, self.model_config = model, config, model_config
        self.scheduler, self.block_manager, self.tokenizer = scheduler, block_manager, tokenizer
        self.audit, self.extras, self.pause = audit, extras, pause
        self.transfers = Transfers(config.device, config.tp_rank)
        self.weight_version = "default"
        self.weight_update_count = 0
        self.history = History(UPDATE_HISTORY_SIZE)  # each update's UpdateResult, the newest ones
        self.snapshot: Snapshot | None = None   # host copy of the weights for rollback (take_snapshot)
        self.unhealthy: str | None = None       # why the engine must not serve, if it must not
        self.waiting_for_weights = waiting_for_weights  # load_format="dummy": nothing loaded yet
        self.commit = commit

    @property
    def commit(self):
        """The commit step plugged in (None: the engine's own). Setting it reads the
        course's hooks again (``Parts``), and only then."""
        return self._commit

    @commit.setter
    def commit(self, commit) -> None:
        self._commit = commit
        self.parts = Parts.read(self.model, commit)

    @property
    def port(self) -> UpdatePort:
        return UpdatePort(self.model, self.model_config, self.config.device, self.config.tp_rank, self.transfers,
                          self.parts, self.verify_addresses, self.snapshot)

    # ---- the transaction ---------------------------------------------------------------------
    def update(self, source: UpdateSource, options: UpdateOptions | None = None) -> dict:
        """Run one update (module docstring); returns SGLang's reply with our fields. With
        ``options.pause_mode`` / ``resume``, the pause and the continue too (one call per
        update: ``update/one_call.py``)."""
        options = options or UpdateOptions()
        if asks_for_one_call(options):
            plain = replace(options, pause_mode=None, resume=None)
            return with_pause(self.pause, self.continue_generation, lambda: self.update(source, plain), options,
                              lambda: self.unhealthy is None)
        timer = PhaseTimer()
        port = self.port
        plan = self._plan(source, options, port, timer)
        if plan.writer == "nothing":
            return self._nothing(plan, options)
        try:
            plan, data = source.fetch(port, plan, timer)
            if plan.keep_snapshot:
                self.take_snapshot()
                timer.lap("snapshot")
            record = self._settle_requests(options, timer)
            applied = self._write(port, plan, data, timer)
        finally:
            source.release()
        return self._finish(plan, applied, record, options, timer)

    def _plan(self, source: UpdateSource, options: UpdateOptions, port: UpdatePort, timer: PhaseTimer) -> UpdatePlan:
        """The busy check and the source's validation; a refusal first lets the source take
        any bytes a sender is already pushing."""
        try:
            if options.refuse_with is not None:
                raise UpdateError(options.refuse_with)
            self.pause.refuse_if_busy(options.abort_all_requests)
            return source.validate(port, timer)
        except REFUSALS as refusal:
            source.refused(port, refusal)
            raise

    def _settle_requests(self, options: UpdateOptions, timer: PhaseTimer):
        """Requests are settled before anything live changes; returns the pause record."""
        record = self.pause.record_for_update()
        if options.abort_all_requests:
            self.pause.abort_all("aborted by a weight update (abort_all_requests=True)", record)
        if self.pause.paused and self.pause.pause_mode == "wait":
            self.pause.drain(options.wait_timeout_s, record)
            timer.lap("wait")
        return record

    def _write(self, port: UpdatePort, plan: UpdatePlan, data, timer: PhaseTimer) -> Applied:
        """The plan's writer, the runtime config fields, the address audit (none when the
        writer checked its own destinations: ``AUDIT_NONE``)."""
        try:
            applied = WRITERS[plan.writer](port, plan, data, timer)
            if plan.config is not None:
                changed = self.apply_runtime_config(plan.config)
                if changed:
                    applied.fields["config_applied"] = changed
            if applied.audit != AUDIT_NONE:
                self.verify_addresses(applied.audit)
        except AddressMovedError as exc:
            self.unhealthy = str(exc)
            raise
        except PartialWrite as fault:
            self._after_partial_write(plan, fault)
        timer.lap("audit")
        return applied

    def _after_partial_write(self, plan: UpdatePlan, fault: PartialWrite):
        """Live weights changed and the writer could not put them back: the snapshot this
        update kept restores them (the update is refused, the engine healthy), else the
        engine serves a mix of two versions and stops (unless nothing was served yet)."""
        reason = str(fault)
        if plan.keep_snapshot and self.snapshot is not None:
            try:
                self.restore(self.snapshot)
            except Exception as restore_error:  # noqa: BLE001 - restoring itself failed: a mix of versions
                reason = f"{reason}; restoring the snapshot failed too: {restore_error}"
            else:
                raise UpdateError(f"{reason}; the weights were restored from the snapshot") from fault.cause
        if self.waiting_for_weights:  # nothing was served from these weights: still waiting for them
            raise UpdateError(reason) from fault.cause
        self.unhealthy = f"{reason}; the weights are a mix of two versions"
        raise UpdateError(self.unhealthy) from fault.cause

    def _finish(self, plan: UpdatePlan, applied: Applied, record, options: UpdateOptions, timer) -> dict:
        """The version, the salt and the flush; the pause's cost record; the result."""
        self.weight_update_count += 1
        self.block_manager.salt = self.weight_update_count  # old prefix entries can never match again
        version = plan.default_version if options.weight_version is None else options.weight_version
        if version is not None:
            self.weight_version = str(version)
        cleared = self.block_manager.flush() if options.flush_cache else 0
        timer.lap("flush")
        survivors = list(self.scheduler.running) + list(self.scheduler.waiting)
        # Several chunks may land in one pause: a request is mixed once, however many chunks.
        record.mixed_requests = max(record.mixed_requests, sum(1 for s in survivors if s.num_completion_tokens > 0))
        record.kv_fresh = record.kv_fresh and self.pause.live_kv_is_fresh(self.weight_update_count)
        record.updates += 1
        if plan.complete:
            self.waiting_for_weights = False
        fields = {**plan.fields, **applied.fields, "writer": plan.writer, "writers_declined": dict(plan.declined)}
        result = UpdateResult(plan.message, self.weight_version, self.weight_update_count, plan.nbytes, timer.ms,
                              len(survivors), cleared, fields)
        self.history.append(result)
        return result.as_dict()

    def _nothing(self, plan: UpdatePlan, options: UpdateOptions) -> dict:
        """An empty update changes nothing but the version label, when one is given."""
        if options.weight_version is not None:
            self.weight_version = str(options.weight_version)
        # The same fields as an applied update's: nothing moved, nothing cleared.
        return UpdateResult(plan.message, self.weight_version, self.weight_update_count, 0, {},
                            self.pause.in_flight(), 0, {**plan.fields, "writer": "nothing"}).as_dict()

    # ---- the address audit and health ---------------------------------------------------------
    def audited_extras(self) -> dict:
        """The engine's other tensors kernels read, audited like the weights."""
        return self.extras()

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

    # ---- snapshots (host memory, no disk read) --------------------------------------------------
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
        """Copy ``snapshot`` back into the live tensors, in place (no version, no config)."""
        restore(self.port, snapshot)

    # ---- registered buffers (no weight written) -------------------------------------------------
    def register_weight_buffers(self, payload, partial: bool = False, copy_mode: str | None = None) -> dict:
        """Map a trainer's reusable buffers and validate its whole layout once
        (``transports/registered.py``'s ``stream_layout`` shape: {"buffers", "buckets", "tensors"}, as a dict
        or serialized like ``update_weights_from_tensor``'s payloads). Replaces an earlier
        registration; returns its ``epoch``, which every ``update_weights_from_registered``
        call must name (a trainer still sending for an old registration is refused). Writes
        no weight. Refused on quantized engines and tensor-parallel ranks. ``copy_mode``:
        how each bucket's copies run ("loop", "foreach", "graph" or "scatter"; default
        ``copy_table.copy_mode``: on a GPU one scatter kernel per bucket, or a CUDA graph
        without Triton)."""
        if self.port.sharded:
            raise UpdateError("registering buffers is not supported on a tensor-parallel rank: this rank holds only "
                              "a shard of each tensor, so it cannot rebuild or send checkpoint tensors")
        return self.transfers.register(self.model, payload, partial, copy_mode)

    def unregister_weight_buffers(self) -> dict:
        """Forget the registration (unmap the trainer's buffers)."""
        return self.transfers.unregister()
