"""The update transaction: what every hot update does once its source is validated.

An update source (``update_sources.py``) validates what came in and hands over a
``ValidatedUpdate``: an ``apply`` step that writes the weights in place, the bytes it
moves and a message. ``UpdateTransaction._run_update`` then does the rest, in this
order, for every transport alike:

1. the pause record (the current pause's, or a new one), ``abort_all_requests``, and
   ``wait`` mode's drain: requests are settled before anything live changes;
2. ``apply``: the in-place writes (through the model's loaders), then post-processing;
3. the address audit: no tensor a kernel or captured graph reads has moved;
4. the version, the prefix-cache salt and the flush (old cache entries never match);
5. the pause's cost record and the result (SGLang's fields, ``timings_ms``, ``bytes``).

Snapshots and rollback live here too: a host copy of every kernel-read tensor, restored
in place when asked (``rollback``) or when a streamed update fails midway.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from course_lib.engine.history import UPDATE_HISTORY_SIZE, History
from course_lib.layers.quant import discard_staged_weights, kernel_tensors
from course_lib.layers.rotary import RotaryEmbedding
from course_lib.weights.audit import AddressMovedError
from course_lib.weights.update import PhaseTimer, UpdateError

WAIT_TIMEOUT_S = 600.0  # how long an update in ``wait`` mode lets in-flight requests finish


@dataclass(frozen=True)
class UpdateOptions:
    """How an update treats the engine around the new weights (every update takes these)."""
    weight_version: str | None = None     # None: keep the current label
    flush_cache: bool = True              # forget the prefix cache (its KV came from old weights)
    abort_all_requests: bool = False      # abort in-flight requests instead of refusing
    wait_timeout_s: float = WAIT_TIMEOUT_S


@dataclass
class Applied:
    """What an update's apply step reports back to the transaction."""
    audit_only: set[str] | None = None    # audit just these parameters now (None: all of them)
    fields: dict = field(default_factory=dict)  # extra result fields (e.g. memory, pieces)


@dataclass
class ValidatedUpdate:
    """An update whose source has been validated: nothing live has changed yet."""
    apply: Callable[[PhaseTimer], Applied]  # the in-place writes; laps its phases on the timer
    nbytes: int                             # bytes the update moves
    message: str
    timer: PhaseTimer                       # started when the update was asked for
    fields: dict = field(default_factory=dict)  # extra result fields known before applying


def receive_even_if_refused(check: Callable[[], object], receive: Callable[[str | None], object]):
    """Run ``check()``; whatever it refuses, still run ``receive(refusal)`` so a sender
    that is already sending never hangs; then refuse. Returns (checked, received).

    ``refusal`` is the refusal's message (None when accepted): a receiver that forwards it
    (a tensor-parallel rank 0 to its workers) makes every rank take the bytes and refuse.
    Their refusal (an ``UpdateError``) then gives way to the original one."""
    try:
        checked, problem = check(), None
    except (ValueError, RuntimeError) as exc:  # UpdateError, EngineBusyError, ReshardError, ...
        checked, problem = None, exc
    try:
        received = receive(None if problem is None else str(problem))
    except UpdateError:
        if problem is not None:
            raise problem from None
        raise
    if problem is not None:
        raise problem
    return checked, received


class UpdateTransaction:
    """The transaction, versions, health, snapshots and rollback (mixed into ``Engine``)."""

    def _init_update_state(self) -> None:
        self.weight_version = "default"
        self.weight_update_count = 0
        self.update_history = History(UPDATE_HISTORY_SIZE)  # each update's result, the newest ones
        self.snapshot: dict | None = None    # host copy of the weights for rollback (take_snapshot)
        self.unhealthy: str | None = None    # why the engine must not serve, if it must not

    def _run_update(self, update: ValidatedUpdate, options: UpdateOptions) -> dict:
        """Everything after validation (see the module docstring); returns the result."""
        timer = update.timer
        record = self._pause_record_for_update()
        if options.abort_all_requests:
            self._abort_all("aborted by a weight update (abort_all_requests=True)", record)
        if self.paused and self.pause_mode == "wait":
            self._drain(options.wait_timeout_s, record)
            timer.lap("wait")
        applied = update.apply(timer)
        self.verify_addresses(only=applied.audit_only)
        timer.lap("audit")
        self.weight_update_count += 1
        self.block_manager.salt = self.weight_update_count  # old prefix entries can never match again
        if options.weight_version is not None:
            self.weight_version = str(options.weight_version)
        cleared = self.block_manager.flush() if options.flush_cache else 0
        timer.lap("flush")
        survivors = list(self.scheduler.running) + list(self.scheduler.waiting)
        # Several chunks may land in one pause: a request is mixed once, however many chunks.
        record["mixed_requests"] = max(record["mixed_requests"],
                                       sum(1 for s in survivors if s.num_completion_tokens > 0))
        record["kv_fresh"] = record["kv_fresh"] and self.live_kv_is_fresh()
        record["updates"] += 1
        result = {"success": True, "message": update.message,
                  "weight_version": self.weight_version, "weight_update_count": self.weight_update_count,
                  "num_paused_requests": len(survivors), "entries_cleared": cleared, "bytes": update.nbytes,
                  "elapsed_ms": sum(timer.ms.values()), "timings_ms": timer.ms, **update.fields,
                  **applied.fields}
        self.update_history.append(result)
        return result

    def _nothing_to_apply(self, weight_version: str | None, message: str, **fields) -> dict:
        """An empty update changes nothing but the version label, when one is given."""
        if weight_version is not None:
            self.weight_version = str(weight_version)
        return {"success": True, "message": message, "bytes": 0, **fields,
                "weight_version": self.weight_version, "weight_update_count": self.weight_update_count,
                "elapsed_ms": 0.0, "timings_ms": {}}

    # ---- the address audit and health ---------------------------------------------------
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

    def _apply_runtime_config(self, new) -> dict:
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

    # ---- snapshots and rollback (host memory, no disk read) ------------------------------
    def take_snapshot(self) -> dict:
        """Copy every tensor the kernels read to host memory, with the current version label;
        ``rollback()`` copies it back in place. Costs one model of host memory.

        Every tensor of ``kernel_tensors(self.model)`` (name -> the live tensor a kernel reads:
        parameters, fused q/k/v and gate/up, quantization scales, the rotary tables) gets a
        new host tensor of the same shape and dtype holding a *copy* of its values (a
        reference to the live tensor would follow the next update and restore nothing).
        When the engine runs on CUDA (``self.config.is_cuda``) the host tensors are pinned and
        the copies non-blocking, with one synchronization of the device after the last.
        Sets and returns ``self.snapshot = {"weight_version": self.weight_version,
        "tensors": {name: host tensor}, "config": ...}``, where "config" is a copy of
        ``self.model_config`` taken now (``dataclasses.replace`` with each of its
        ``runtime_fields`` set to the current value): an update may change those fields
        (``rope_theta``, ``eos_token_id``, ...) in place, and a rollback puts them back too."""
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
        self.snapshot = {"weight_version": self.weight_version, "tensors": tensors,
                         "config": replace(self.model_config, **runtime)}
        return self.snapshot
        # END EXERCISE

    def _restore(self, snapshot: dict) -> None:
        live = kernel_tensors(self.model)
        for name, host in snapshot["tensors"].items():
            live[name].copy_(host, non_blocking=True)
        if self.config.is_cuda:
            torch.cuda.synchronize()

    def rollback(self, flush_cache: bool = True, abort_all_requests: bool = False) -> dict:
        """Restore the snapshot (bitwise the old weights and version), in place, with no
        disk read. Same rules as any update: pause first if requests are in flight."""
        if self.snapshot is None:
            raise UpdateError("no snapshot to roll back to: take_snapshot() or update with keep_snapshot=True")
        timer = PhaseTimer()
        self._refuse_if_busy(abort_all_requests)
        snapshot = self.snapshot

        def apply(timer: PhaseTimer) -> Applied:
            self._restore(snapshot)  # the rotary tables are kernel tensors: restored here too
            self._apply_runtime_config(snapshot["config"])
            timer.lap("copy")
            return Applied()
        nbytes = sum(t.numel() * t.element_size() for t in snapshot["tensors"].values())
        update = ValidatedUpdate(apply, nbytes, "rolled back to the snapshot", timer)
        return self._run_update(update, UpdateOptions(snapshot["weight_version"], flush_cache, abort_all_requests))

    def _after_midstream_fault(self, applied_layers: list[str], exc: Exception, rollback=None):
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
                self._restore(self.snapshot)
                raise UpdateError(f"update failed after {len(applied_layers)} layers ({exc}); the weights "
                                  f"were restored from the snapshot") from exc
        except UpdateError:
            raise
        except Exception as restore_error:  # noqa: BLE001 - restoring itself failed: a mix of versions
            exc = RuntimeError(f"{exc}; restoring the old layers failed too: {restore_error}")
        self.unhealthy = (f"update failed after {len(applied_layers)} layers were written ({exc}); "
                          f"the weights are a mix of two versions")
        raise UpdateError(self.unhealthy) from exc
