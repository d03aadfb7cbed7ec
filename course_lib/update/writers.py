"""The writers: the one place live weights are written, chosen once per update from a registry.

``WRITERS`` maps a name to a function ``(port, plan, data, timer) -> Applied``: ``data`` is
what the source fetched (pairs, a bound bucket, a checkpoint reader, ...). Which writer an
update takes is decided when it is validated (``pick``: the first candidate with no
reason against it) and recorded in its plan, with why each faster one was not taken.

Interchangeable writers of tensors in hand, fastest first where each applies:
- ``registered``: a registered bucket's copy table (one kernel per update on a GPU);
- ``receive_pool``: a broadcast bucket received into the engine's own buffer, then one copy;
- ``cached_bucket``: a flattened bucket whose layout and buffer were seen before: one copy;
- ``direct_quant``: requantized straight into the live int8 / FP8 tensors, one check first;
- ``general``: the commit step (the copy plan or the loaders), then requantization.
Writers of one transport each: ``layerwise`` (a checkpoint streamed layer by layer, with
its rollback point), ``reshard`` (this rank's pieces through the loaders), ``snapshot``
(a host snapshot copied back) and ``remote`` (a seeding engine's buckets as they arrive).

Every copy is launched, then checked on the host (where it lands: a rebinding happens on
the host, when the copy is made, so the check need not wait), then waited for:
``copy_audit_sync``, the one place that order is written.
"""
from __future__ import annotations

import contextlib
from typing import Callable

from course_lib import settings
from course_lib.layers.quant import (QuantizedLinearMethod, discard_staged_weights, kernel_tensors,
                                     process_weights_after_loading)
from course_lib.update.port import UpdatePort
from course_lib.update.records import AUDIT_ALL, AUDIT_NONE, Applied, Audit, PartialWrite, PhaseTimer, UpdatePlan
from course_lib.weights.commit import direct_quant
from course_lib.weights.commit.audit import AddressMovedError
from course_lib.weights.commit.copy_table import RegistrationError
from course_lib.weights.commit.rollback import GuardedLayerwiseReload, RollbackPoint
from course_lib.weights.commit.validate import UpdateError, check_finite
from course_lib.weights.reshard import load_shards
from course_lib.weights.transports import dist as dist_transport


def pick(candidates) -> tuple[str, dict]:
    """``candidates``: (writer, why not or None) pairs, fastest first. Returns the first
    writer with no reason against it and {writer: why not} for those before it."""
    declined = {}
    for name, why in candidates:
        if why is None:
            return name, declined
        declined[name] = why
    raise AssertionError(f"no writer applies: {declined}")  # every list ends with one that always does


def copy_audit_sync(port: UpdatePort, timer: PhaseTimer, launch: Callable[[], None],
                    check: Callable[[], None], wait: bool = True, stream_only: bool = False) -> Applied:
    """Launch the copies, check on the host that every destination is where kernels read
    (while the device copies), then wait for the copies unless ``wait`` is False (the
    caller ordered what reuses the source after them on the device); ``stream_only``: the
    copies are all on the current stream (a copy table's), so only it is waited for. The
    check raises ``AddressMovedError``. Returns the audit as done."""
    launch()
    timer.lap("copy")  # the launches (on a CPU, the copies themselves)
    check()
    timer.lap("audit")
    if wait:
        port.synchronize(stream_only)
    timer.lap("copy")
    return Applied(AUDIT_NONE)


def written_parameters(model, names) -> Audit:
    """Just the parameters these checkpoint tensors land in: what the audit checks after a
    write (the full audit runs when generation resumes), cheaper than walking every module."""
    targets = map(model.map_checkpoint_name, names)
    return Audit.of(t[0] for t in targets if t)


def requantized(model, name: str) -> bool:
    """Whether checkpoint tensor ``name`` lands in a quantized layer (requantized on arrival)."""
    target = model.map_checkpoint_name(name)
    if target is None:
        return False
    module = model.get_submodule(target[0].rpartition(".")[0])
    return isinstance(getattr(module, "quant_method", None), QuantizedLinearMethod)


def _stayed(moved: str | None, what: str) -> None:
    if moved is not None:  # cannot happen unless a copy rebinds: say so loudly
        raise AddressMovedError(f"{moved} moved while {what} was copied into it")


# ---- writers of tensors in hand ------------------------------------------------------------

def write_general(port: UpdatePort, plan: UpdatePlan, pairs, timer: PhaseTimer) -> Applied:
    """The commit step (copy in place), then requantization on a quantized engine (layers
    still waiting for shards stay staged when the update is one chunk of several)."""
    model = port.model
    if port.quantization is not None:
        # A quantizer refuses NaN and inf, but only once it reaches that layer, after
        # earlier layers (and the norms) were written: refuse them before any write.
        check_finite([(n, t) for n, t in pairs if requantized(model, n)])
    port.parts.commit(model, pairs, port.device)
    if port.quantization is None:  # checkpoint format is kernel format
        return copy_audit_sync(port, timer, lambda: None,
                               lambda: port.audit(written_parameters(model, (n for n, _ in pairs))))
    port.synchronize()
    timer.lap("copy")
    process_weights_after_loading(model, allow_pending=plan.chunk)
    timer.lap("post_process")
    return Applied(AUDIT_ALL)


def write_direct_quant(port: UpdatePort, plan: UpdatePlan, pairs, timer: PhaseTimer) -> Applied:
    """Requantized straight into the live kernel tensors (``weights/commit/direct_quant.py``):
    the same bits as the general path, less than half its memory traffic."""
    names = [n for n, _ in pairs]
    return copy_audit_sync(port, timer, lambda: direct_quant.write(port.model, pairs, port.device, port.parts.commit),
                           lambda: port.audit(written_parameters(port.model, names)))


def check_bound(port: UpdatePort, bound, refuse_non_finite: bool) -> None:
    """A cached bucket (``weights/commit/bucket_cache.py``) before anything is written: its
    destinations still where its table found them (audited once, when the table is new),
    and its values finite where asked. A refusal changes nothing."""
    moved = bound.moved_destination()
    if moved is not None:  # the table would write memory no kernel reads: check everything afresh
        port.transfers.buckets.clear()
        raise UpdateError(f"{moved} no longer lives where the bucket's copy table found it: the weights "
                          f"were rebound (updates must copy in place); nothing was written")
    if not bound.audited:  # a new table: its destinations are where the kernels read (else unhealthy)
        port.audit(written_parameters(port.model, bound.names))
        bound.audited = True
    if refuse_non_finite:
        bound.check_finite()


def write_cached_bucket(port: UpdatePort, plan: UpdatePlan, bound, timer: PhaseTimer, wait: bool = True) -> Applied:
    """A checked cached bucket: its one copy, its destinations checked again meanwhile, then
    the wait (the sender reuses the buffer next). The check is the audit of these
    parameters (identity, stride included, with the storages the table holds)."""
    return copy_audit_sync(port, timer, bound.copy, lambda: _stayed(bound.moved_destination(), "a flattened bucket"),
                           wait, stream_only=True)


def write_received_bucket(port: UpdatePort, plan: UpdatePlan, received, timer: PhaseTimer) -> Applied:
    """A broadcast bucket in the group's receive buffer (``dist.ReceivePool``): one copy
    through its table, or (no table for it) the general path over views of the buffer.
    The buffer is the engine's own: no sender waits to reuse it, and its next receive waits
    for these reads on the device (``read_launched``), so on a GPU the host goes on to the
    next bucket while this one is copied."""
    bound, pairs, pool, slot = received
    try:
        if bound is None:
            return write_general(port, plan, pairs, timer)
        return write_cached_bucket(port, plan, bound, timer, wait=not pool.overlap)
    finally:
        pool.read_launched(slot)


def write_registered(port: UpdatePort, plan: UpdatePlan, registered, timer: PhaseTimer) -> Applied:
    """Registered buckets (``registered``: the table, its copy mode, the bucket numbers)
    through the registration's copy table (or, where chapter 04's commit step is a
    learner's, through it, piece by piece: ``Parts.registered_copy``); returns once the
    copies are done, so the trainer may reuse those buffers."""
    table, mode, numbers = registered
    mode = mode if port.parts.registered_copy == "table" else port.parts.registered_copy

    def check() -> None:
        try:
            table.check_destinations(numbers)
        except RegistrationError as exc:  # cannot happen unless a copy rebinds: say so loudly
            raise AddressMovedError(str(exc)) from exc
    return copy_audit_sync(port, timer, lambda: table.copy(numbers, mode), check, stream_only=True)


# ---- writers of one transport each ----------------------------------------------------------

def write_layerwise(port: UpdatePort, plan: UpdatePlan, reader, timer: PhaseTimer) -> Applied:
    """Stream a checkpoint one decoder layer at a time (``weights/commit/layerwise.py``),
    each layer checked (finite values) and saved to a rollback point
    (``weights/commit/rollback.py``) just before it is written; a fault midway puts the
    written layers back (from the rollback point, or, where the update keeps a snapshot,
    the transaction restores that). On a GPU the tensors are read in parallel into pinned
    buffers (``weights/checkpoint/pinned_reader.py``), reads overlapping the writes."""
    model, names = port.model, plan.inputs.names
    rollback = None if plan.keep_snapshot else RollbackPoint(model)
    reload = GuardedLayerwiseReload(model, names, port.device, rollback, commit=port.parts.commit)
    device = port.device if port.is_cuda else "cpu"
    try:
        # closing: on a fault the reader stops at once (its threads joined, its file closed)
        with contextlib.closing(reader.iter_tensors(names, device=device)) as tensors:
            for name, tensor in tensors:
                reload.feed(name, tensor)
                del tensor  # its memory is free for the next tensor: one layer held at a time
        memory = reload.finish()
    except Exception as exc:
        _after_layer_fault(model, reload.applied, exc, rollback)
    finally:
        if rollback is not None:
            rollback.release()
    # Host memory: freed now on a CPU; on a GPU the pinned copy is kept for the next update.
    memory["rollback_peak_bytes"] = reload.peak_rollback_bytes
    wall = timer.ms_since_lap()
    timer.ms.update({k: v for k, v in reload.ms.items() if k != "transfer"})
    timer.ms["transfer"] = max(0.0, wall - reload.ms["copy"] - reload.ms["post_process"])  # reading + H2D
    timer.lap(None)
    return Applied(AUDIT_ALL, {"memory": memory})


def _after_layer_fault(model, applied: list, exc: Exception, rollback: RollbackPoint | None):
    """A streamed update failed after validation: nothing written yet (refuse), or the
    written layers put back from the rollback point (refuse: the old weights serve). Where
    there is none (a snapshot was kept) or restoring fails: ``PartialWrite``."""
    discard_staged_weights(model)
    if not applied:
        raise exc if isinstance(exc, UpdateError) else UpdateError(f"update failed before any layer "
                                                                   f"changed: {exc}") from exc
    if rollback is None:
        raise PartialWrite(f"update failed after {len(applied)} layers ({exc})", exc)
    try:
        rollback.restore()
    except Exception as restore_error:  # noqa: BLE001 - restoring itself failed: a mix of versions
        raise PartialWrite(f"update failed after {len(applied)} layers were written ({exc}); restoring "
                           f"the old layers failed too: {restore_error}", exc) from exc
    raise UpdateError(f"update refused after {len(applied)} layers were written ({exc}); "
                      f"those layers were restored: the engine serves the old weights") from exc


def write_shards(port: UpdatePort, plan: UpdatePlan, shards, timer: PhaseTimer) -> Applied:
    """This rank's resharded pieces through its layers' loaders, then requantization."""
    load_shards(port.model, shards)
    timer.lap("copy")
    process_weights_after_loading(port.model, allow_pending=False)
    timer.lap("post_process")
    return Applied(AUDIT_ALL)


def write_snapshot(port: UpdatePort, plan: UpdatePlan, snapshot, timer: PhaseTimer) -> Applied:
    """A host snapshot copied back in place (the rotary tables are kernel tensors: restored
    too; its runtime config is the plan's)."""
    restore(port, snapshot)
    timer.lap("copy")
    return Applied(AUDIT_ALL)


def restore(port: UpdatePort, snapshot) -> None:
    """Copy ``snapshot``'s host tensors back into the live kernel tensors, in place."""
    live = kernel_tensors(port.model)
    for name, host in snapshot.tensors.items():
        live[name].copy_(host, non_blocking=True)
    port.synchronize()


def write_remote(port: UpdatePort, plan: UpdatePlan, seeding, timer: PhaseTimer) -> Applied:
    """A seeding engine's buckets, each received and written as it arrives (a fused layer
    may span buckets: it waits, staged, for the rest), then every layer requantized."""
    group, buckets = seeding
    try:
        for request in buckets:
            pairs = dist_transport.receive_bucket(group, request["names"], request["dtypes"], request["shapes"],
                                                  port.device)
            timer.lap("transfer")
            write_general(port, plan, pairs, timer)
        process_weights_after_loading(port.model)  # every layer complete now, or refused
    except Exception as exc:
        discard_staged_weights(port.model)
        raise PartialWrite(f"remote seeding failed midway: {exc}", exc) from exc
    timer.lap("post_process")
    return Applied(AUDIT_ALL)


WRITERS: dict[str, Callable[[UpdatePort, UpdatePlan, object, PhaseTimer], Applied]] = {
    "registered": write_registered,
    "receive_pool": write_received_bucket,
    "cached_bucket": write_cached_bucket,
    "direct_quant": write_direct_quant,
    "general": write_general,
    "layerwise": write_layerwise,
    "reshard": write_shards,
    "snapshot": write_snapshot,
    "remote": write_remote,
}


def direct_quant_reason(port: UpdatePort, names, chunk: bool) -> str | None:
    """Why an update of checkpoint ``names`` may not take the direct requantization writer:
    the engine's parts (read once), the maintainers' switch, or this update's shards."""
    why = port.parts.declined.get("direct_quant")
    if why is None and not settings.direct_quant():
        why = "COURSE_LIB_DIRECT_QUANT=0"
    return why or direct_quant.update_reason(port.model, names, chunk)


def tensor_candidates(port: UpdatePort, names, chunk: bool) -> list:
    """The writers of tensors in hand this engine has, fastest first (for ``pick``)."""
    if port.quantization is None:
        return [("general", None)]
    return [("direct_quant", direct_quant_reason(port, names, chunk)), ("general", None)]
