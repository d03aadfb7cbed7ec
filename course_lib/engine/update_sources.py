"""Update sources: what each transport brings, validated before anything live changes.

A source is built from what one transport delivers (a checkpoint dir, tensors in memory,
a trainer's broadcast, resharded pieces, a sparse payload, a seeding engine's buckets,
registered buffers, a host snapshot). ``source.validate(updater)`` checks it against the
model and returns a ``ValidatedUpdate`` (the source itself, the bytes it moves, a
message, the phase timer) with nothing live changed; the updater's transaction then calls
``source.write(updater, timer)``, which writes the weights in place and returns
``Applied``. The writes go through the updater's commit step (``Updater.commit``:
``weights/commit/validate.py``'s ``copy_in_place`` unless another was given), the model's loaders
and post-processing, or the layer-by-layer reload.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from course_lib.dtypes import DtypeError, parse_dtype, parse_dtypes
from course_lib.engine.records import AUDIT_ALL, AUDIT_NONE, Applied, Audit, Snapshot
from course_lib.exercises import is_reference
from course_lib.layers.quant import QuantizedLinearMethod, discard_staged_weights, process_weights_after_loading
from course_lib.models.qwen3 import hf_tensor_shapes
from course_lib.weights.transports import bucket, safe_pickle
from course_lib.weights.commit import direct_quant, copy_table
from course_lib.weights.commit.copy_plan import copy_in_place
from course_lib.weights.commit.layerwise import LayerwiseReload
from course_lib.weights.reshard import check_plan_matches, load_shards, receive_shards
from course_lib.weights.commit.rollback import GuardedLayerwiseReload, RollbackPoint
from course_lib.weights.transports import dist as dist_transport
from course_lib.weights.transports import remote, sparse
from course_lib.weights.commit.validate import (PhaseTimer, UpdateError, check_finite, open_and_validate,
                                       stage_from_disk, validate_tensors)

if TYPE_CHECKING:
    from course_lib.engine.updater import Updater


@dataclass
class ValidatedUpdate:
    """An update whose source has been validated: nothing live has changed yet."""
    source: "UpdateSource"         # its write(updater, timer) makes the in-place writes
    nbytes: int                    # bytes the update moves
    message: str
    timer: PhaseTimer              # started when the update was asked for
    fields: dict = field(default_factory=dict)  # extra result fields known before writing


class UpdateSource:
    """One transport's update: ``validate`` (nothing live changes), then ``write``."""

    def validate(self, updater: "Updater") -> ValidatedUpdate:
        raise NotImplementedError

    def write(self, updater: "Updater", timer: PhaseTimer) -> Applied:
        raise NotImplementedError


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


def deserialize_tensor_payload(payload, load_format: str | None, tp_rank: int = 0):
    """This rank's payload, unpickled through the allowlist where it is serialized (the
    bucket or the pairs themselves, not yet checked)."""
    if load_format not in (None, "flattened_bucket", "direct"):
        raise UpdateError(f"unknown load_format {load_format!r}; expected None or 'flattened_bucket'")
    if isinstance(payload, list) and payload and all(isinstance(p, (str, bytes)) for p in payload):
        if tp_rank >= len(payload):
            raise UpdateError(f"payload has {len(payload)} per-rank entries; this engine is rank {tp_rank}")
        payload = payload[tp_rank]
    if isinstance(payload, (str, bytes)):
        payload = safe_pickle.deserialize(payload)  # raises UnsafePickleError (a ValueError)
    return payload


def named_tensors_of(payload, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from a deserialized payload: a bucket unpacked (validated
    first), or pairs and dicts checked to be pairs."""
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


# ---- writing ----------------------------------------------------------------------------------

def requantized(model, name: str) -> bool:
    """Whether checkpoint tensor ``name`` lands in a quantized layer (requantized on arrival)."""
    target = model.map_checkpoint_name(name)
    if target is None:
        return False
    module = model.get_submodule(target[0].rpartition(".")[0])
    return isinstance(getattr(module, "quant_method", None), QuantizedLinearMethod)


def written_parameters(model, named_tensors) -> Audit:
    """Just the parameters these tensors land in: what the audit checks after a chunk (the
    full audit runs when generation resumes), cheaper than walking every module."""
    targets = map(model.map_checkpoint_name, (n for n, _ in named_tensors))
    return Audit.of(t[0] for t in targets if t)


def write_tensors(updater: "Updater", named_tensors, allow_pending: bool, timer: PhaseTimer) -> Applied:
    """Write validated tensors that are all in hand: the commit step (copy in place), then
    requantization (layers still waiting for shards stay staged when ``allow_pending``).

    A quantized engine on one rank requantizes straight into its kernel tensors where
    ``weights/commit/direct_quant.py`` may (the same bits, less than half the memory traffic),
    unless the updater's commit step is another than the engine's own: that one runs."""
    model, config = updater.model, updater.config
    if (config.quantization is not None and updater.commit is copy_in_place
            and direct_quant.apply(model, named_tensors, config.device, allow_pending)):
        # The direct path wrote the quantized layers through views of the qweight and
        # weight_scale they hold now (it never rebinds); the rest went through the loaders.
        return audit_while_copying(updater, written_parameters(model, named_tensors), timer)
    if config.quantization is not None:
        # A quantizer refuses NaN and inf, but only once it reaches that layer, after
        # earlier layers (and the norms) were written: refuse them before any write.
        check_finite([(n, t) for n, t in named_tensors if requantized(model, n)])
    updater.commit(model, named_tensors, config.device)
    if config.quantization is None:  # checkpoint format is kernel format
        return audit_while_copying(updater, written_parameters(model, named_tensors), timer)
    if config.is_cuda:
        torch.cuda.synchronize()
    timer.lap("copy")
    process_weights_after_loading(model, allow_pending=allow_pending)
    timer.lap("post_process")
    return Applied(AUDIT_ALL)


def audit_while_copying(updater: "Updater", audit: Audit, timer: PhaseTimer) -> Applied:
    """The address audit of what the commit step just wrote, while the GPU still copies:
    the audit reads addresses on the host (a rebinding happens there, when the commit
    step runs), so it need not wait for the copies, which it overlaps. Then wait for
    them. Returns the audit as done (the caller audits nothing more)."""
    timer.lap("copy")  # the launches (on a CPU, the copies themselves)
    updater.verify_addresses(audit)
    timer.lap("audit")
    if updater.config.is_cuda:
        torch.cuda.synchronize()
    timer.lap("copy")
    return Applied(AUDIT_NONE)


def write_layerwise(updater: "Updater", reader, names, use_snapshot: bool, timer: PhaseTimer) -> Applied:
    """Stream a checkpoint one decoder layer at a time (``weights/commit/layerwise.py``), each
    layer checked (finite values) before it is written and saved to a rollback point
    (``weights/commit/rollback.py``) just before; a fault midway puts the written layers back
    (from the rollback point, or from the full snapshot when ``use_snapshot``).
    On a GPU the tensors are read in parallel into pinned buffers and arrive on the GPU
    (``weights/checkpoint/pinned_reader.py``), reads overlapping the transfers and the writes."""
    model, config = updater.model, updater.config
    rollback = None if use_snapshot else RollbackPoint(model)
    reload = GuardedLayerwiseReload(model, names, config.device, rollback)
    device = config.device if config.is_cuda else "cpu"
    try:
        # closing: on a fault the reader stops at once (its threads joined, its file closed)
        with contextlib.closing(reader.iter_tensors(names, device=device)) as tensors:
            for name, tensor in tensors:
                reload.feed(name, tensor)
                del tensor  # its memory is free for the next tensor: one layer held at a time
        memory = reload.finish()
    except Exception as exc:
        updater.after_midstream_fault(reload.applied, exc, rollback)
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


def check_bound(updater: "Updater", bound, cache, refuse_non_finite: bool) -> None:
    """A cached bucket (``weights/commit/bucket_cache.py``) before anything is written: its
    destinations still where its table found them (audited once, when the table is new),
    and its values finite where asked."""
    moved = bound.moved_destination()
    if moved is not None:  # the table would write memory no kernel reads: check everything afresh
        cache.clear()
        raise UpdateError(f"{moved} no longer lives where the bucket's copy table found it: the weights "
                          f"were rebound (updates must copy in place); nothing was written")
    if not bound.audited:  # a new table: its destinations are where the kernels read (else unhealthy)
        updater.verify_addresses(written_parameters(updater.model, ((n, None) for n in bound.names)))
        bound.audited = True
    if refuse_non_finite:
        bound.check_finite()


def write_bound(updater: "Updater", bound, timer: PhaseTimer, wait: bool = True) -> Applied:
    """Write a checked cached bucket as a registered bucket is written
    (``RegisteredSource.write``): launch the one copy, check the destinations again while
    it runs, then wait (the sender reuses the buffer next) unless ``wait`` is False."""
    bound.copy()
    timer.lap("copy")  # all of it on the CPU; on a GPU the launch, the wait comes below
    moved = bound.moved_destination()
    if moved is not None:  # cannot happen unless a copy rebinds: say so loudly
        updater.unhealthy = f"{moved} moved while a flattened bucket was copied into it"
        raise UpdateError(updater.unhealthy)
    timer.lap("audit")
    if updater.config.is_cuda and wait:
        torch.cuda.current_stream(updater.config.device).synchronize()
    timer.lap("copy")
    # The check above audits these parameters (identity, stride included, with the
    # storages held by the table); the full address audit runs when generation resumes.
    return Applied(AUDIT_NONE)


# ---- sources ----------------------------------------------------------------------------------

@dataclass
class DiskSource(UpdateSource):
    """A checkpoint dir, validated whole from its headers; streamed per layer or staged.
    ``config.json``'s runtime fields are applied after every weight is written (a refused
    update changes neither)."""
    model_path: object
    partial: bool = False
    staging: str = "layer"
    keep_snapshot: bool = False

    def validate(self, updater: "Updater") -> ValidatedUpdate:
        timer = PhaseTimer()
        self.reader, nbytes = open_and_validate(updater.model_config, self.model_path, self.partial)
        self.names = list(self.reader.metadata())
        timer.lap("validate")
        self.staged = None
        if self.staging == "full" or not LayerwiseReload.is_written():
            self.staged = stage_from_disk(self.reader)
            check_finite(self.staged.items())
            timer.lap("transfer")
        if self.keep_snapshot:
            updater.take_snapshot()
            timer.lap("snapshot")
        return ValidatedUpdate(self, nbytes, f"updated from {self.reader.path}", timer)

    def write(self, updater: "Updater", timer: PhaseTimer) -> Applied:
        if self.staged is not None:
            applied = write_tensors(updater, list(self.staged.items()), False, timer)
        else:
            applied = write_layerwise(updater, self.reader, self.names, self.keep_snapshot, timer)
        changed = updater.apply_runtime_config(self.reader.config)
        if changed:
            applied.fields["config_applied"] = changed
        return applied


@dataclass
class TensorSource(UpdateSource):
    """Tensors handed over in memory (pairs, a dict, a flattened bucket, or serialized).
    ``validate`` returns None for an empty chunk.

    A flattened bucket whose layout was validated before, in a buffer seen before, takes
    the fast path (``weights/commit/bucket_cache.py``): one lookup stands for the checks, and
    ``write`` makes one copy from the registered path's copy table; any other bucket is
    validated and then cached the same way, or, where the fast path does not apply,
    unpacked and written as pairs."""
    payload: object
    load_format: str | None = None
    refuse_non_finite: bool = False

    def validate(self, updater: "Updater") -> ValidatedUpdate | None:
        timer = PhaseTimer()
        payload = deserialize_tensor_payload(self.payload, self.load_format, tp_rank=updater.config.tp_rank)
        self.bound = None
        cache = updater.transfers.buckets
        if self.load_format == "flattened_bucket" and cache.applies(updater.model, updater.commit):
            timer.lap("deserialize")
            self.bound = cache.lookup(updater.model, payload)  # refuses a bad bucket (UpdateError)
        if self.bound is not None:
            return self.validate_bound(updater, cache, timer)
        self.tensors = named_tensors_of(payload, self.load_format)
        if self.tensors and self.tensors[0][1].is_cuda:
            updater.transfers.keep_ipc_buffer(self.tensors[0][1])
        timer.lap("deserialize")
        if not self.tensors:
            return None
        meta = {name: (tuple(t.shape), t.dtype) for name, t in self.tensors}
        if len(meta) != len(self.tensors):
            raise UpdateError("the update names a tensor more than once")
        nbytes = validate_tensors(updater.model_config, meta, partial=True)
        if self.refuse_non_finite:
            check_finite(self.tensors)
        timer.lap("validate")
        return ValidatedUpdate(self, nbytes, f"updated {len(self.tensors)} tensors", timer)

    def validate_bound(self, updater: "Updater", cache, timer: PhaseTimer) -> ValidatedUpdate:
        check_bound(updater, self.bound, cache, self.refuse_non_finite)
        timer.lap("validate")
        return ValidatedUpdate(self, self.bound.nbytes, f"updated {len(self.bound.names)} tensors", timer)

    def write(self, updater: "Updater", timer: PhaseTimer) -> Applied:
        if self.bound is None:
            return write_tensors(updater, self.tensors, True, timer)
        return write_bound(updater, self.bound, timer)


@dataclass
class BroadcastSource(UpdateSource):
    """A trainer's broadcast over a weight-update group, received even when refused.

    An accepted flattened bucket is received into the group's receive buffer for its
    layout (``Transfers.receive_pooled``) and, where the bucket cache applies, written as
    a cached bucket (``TensorSource``'s fast path): from the second step on, one broadcast
    and one copy. Elsewhere (a refused update, a tensor-parallel rank, a quantized engine,
    a learner's ``receive_bucket``) ``dist.receive_bucket`` receives it into fresh memory."""
    group_name: str
    names: list
    dtypes: list
    shapes: list
    load_format: str | None = None
    refuse_non_finite: bool = False
    abort_all_requests: bool = False
    refuse_with: str | None = None

    def validate(self, updater: "Updater") -> ValidatedUpdate:
        group = updater.transfers.group(self.group_name)
        timer = PhaseTimer()
        try:
            dtypes = parse_dtypes(self.dtypes)
        except DtypeError as exc:
            raise UpdateError(f"unknown dtype in {self.dtypes}: {exc}") from None

        def check() -> int:
            if self.refuse_with is not None:
                raise UpdateError(self.refuse_with)
            updater.pause.refuse_if_busy(self.abort_all_requests)
            if len(set(self.names)) != len(self.names):
                raise UpdateError("the update names a tensor more than once")
            meta = {n: (tuple(s), d) for n, s, d in zip(self.names, self.shapes, dtypes)}
            nbytes = validate_tensors(updater.model_config, meta, partial=True)
            timer.lap("validate")
            return nbytes

        def receive(refusal):
            device = updater.config.device
            if self.load_format == "flattened_bucket" and refusal is None and self.pooled(updater):
                tensors = self.receive_pooled(updater, dtypes)
            elif self.load_format == "flattened_bucket":  # all tensors in one byte buffer
                tensors = dist_transport.receive_bucket(group, self.names, dtypes, self.shapes, device)
            else:  # one broadcast per tensor (SGLang's default)
                tensors = []
                for n, d, shape in zip(self.names, dtypes, self.shapes):
                    t = torch.empty(tuple(shape), dtype=d, device=device)
                    dist_transport.broadcast_async(group, t).wait()
                    tensors.append((n, t))
            timer.lap("transfer")
            return tensors
        self.bound, self.slot = None, None
        nbytes, self.tensors = receive_even_if_refused(check, receive)
        if self.bound is not None:
            check_bound(updater, self.bound, updater.transfers.buckets, self.refuse_non_finite)
            timer.lap("validate")
        elif self.refuse_non_finite:
            check_finite(self.tensors)
        return ValidatedUpdate(self, nbytes, f"received {len(self.names)} tensors over {self.group_name!r}",
                               timer)

    @staticmethod
    def pooled(updater: "Updater") -> bool:
        """The engine's own parts run here: the bucket cache applies, and ``receive_bucket``
        is the instructor edition's (a learner's is always the one that runs)."""
        return (updater.transfers.buckets.applies(updater.model, updater.commit)
                and is_reference(dist_transport.receive_bucket, dist_transport.RECEIVE_STEP))

    def receive_pooled(self, updater: "Updater", dtypes) -> list:
        """Receive into the group's buffer for this layout; bind it to its copy table
        (``self.bound``, returning no pairs) or, where no table applies, return views."""
        self.slot, flat, metadata = updater.transfers.receive_pooled(self.group_name, self.names, dtypes,
                                                                     self.shapes)
        payload = {"flattened_tensor": flat, "metadata": metadata}
        self.bound = updater.transfers.buckets.lookup(updater.model, payload, resident=True)
        return [] if self.bound is not None else bucket.unpack(payload)

    def write(self, updater: "Updater", timer: PhaseTimer) -> Applied:
        if self.bound is None:
            try:
                return write_tensors(updater, self.tensors, True, timer)
            finally:  # views of a pooled buffer (no table applied): its next receive waits for these reads
                if self.slot is not None:
                    updater.transfers.receive_pool(self.group_name).read_launched(self.slot)
        # The receive buffer is the engine's own: no sender waits to reuse it, and the next
        # receive into it waits for this copy on the device (``ReceivePool.read_launched``),
        # so on a GPU the host goes on to the next bucket while this one is copied. What runs
        # next on the engine's stream (a forward pass, a snapshot, a read) sees the new weights.
        pool = updater.transfers.receive_pool(self.group_name)
        applied = write_bound(updater, self.bound, timer, wait=not pool.overlap)
        pool.read_launched(self.slot)
        return applied


@dataclass
class ReshardSource(UpdateSource):
    """This rank's pieces of a resharded update (``weights/reshard/``), received even
    when refused (busy, or a plan that does not match this rank's loaders)."""
    plan: object
    group_name: str
    abort_all_requests: bool = False
    refuse_with: str | None = None
    trainer_group_ranks: object = None
    engine_group_ranks: object = None

    def validate(self, updater: "Updater") -> ValidatedUpdate:
        group = updater.transfers.group(self.group_name)
        timer = PhaseTimer()
        rank = updater.config.tp_rank

        def check() -> None:
            if self.refuse_with is not None:
                raise UpdateError(self.refuse_with)
            updater.pause.refuse_if_busy(self.abort_all_requests)
            check_plan_matches(updater.model, self.plan)
            timer.lap("validate")

        def receive(_refusal):
            shards = receive_shards(self.plan, rank, group, updater.config.device, self.trainer_group_ranks,
                                    self.engine_group_ranks)
            timer.lap("transfer")
            return shards
        _, self.shards = receive_even_if_refused(check, receive)
        nbytes = sum(t.numel() * t.element_size() for t in self.shards.values())
        fields = {"received_bytes": nbytes, "pieces": len(self.plan.pieces_for(rank))}
        return ValidatedUpdate(self, nbytes, f"resharded {len(self.shards)} tensors into rank {rank}", timer,
                               fields)

    def write(self, updater: "Updater", timer: PhaseTimer) -> Applied:
        load_shards(updater.model, self.shards)
        timer.lap("copy")
        process_weights_after_loading(updater.model, allow_pending=False)
        timer.lap("post_process")
        return Applied(AUDIT_ALL)


@dataclass
class SparseSource(UpdateSource):
    """Only changed elements, in checkpoint coordinates (``transports/sparse.py``): each
    touched tensor is rebuilt from the engine's current values with the new elements
    scattered in. ``validate`` returns None for an empty payload."""
    payload: dict
    read_weight: Callable[[str, int], torch.Tensor]  # (name, rows) -> the engine's current tensor

    def validate(self, updater: "Updater") -> ValidatedUpdate | None:
        timer = PhaseTimer()
        try:
            entries = sparse.validate(self.payload, hf_tensor_shapes(updater.model_config))
        except sparse.SparsePayloadError as exc:
            raise UpdateError(f"bad sparse payload: {exc}") from exc
        timer.lap("validate")
        if not entries:
            return None
        self.tensors = []
        for (name, shape, _), idx, values in zip(entries, self.payload["indices"], self.payload["values"]):
            # All rows: exactly the checkpoint tensor as the engine holds it (unquantized).
            self.tensors.append((name, sparse.scatter(self.read_weight(name, shape[0]), idx, values)))
        timer.lap("rebuild")
        n = sparse.num_elements(self.payload)
        return ValidatedUpdate(self, sparse.payload_nbytes(self.payload),
                               f"sparse update of {n} elements in {len(entries)} tensors", timer,
                               {"dense_bytes": sparse.dense_nbytes(self.payload), "elements": n})

    def write(self, updater: "Updater", timer: PhaseTimer) -> Applied:
        return write_tensors(updater, self.tensors, True, timer)


@dataclass
class RemoteSource(UpdateSource):
    """A seeding engine's weights: ``validate`` joins its group as rank 1 and checks its
    manifest (a source with a different structure is refused, and told, before any bytes
    move); ``write`` receives and loads the buckets. ``source_version``: the source's."""
    master_address: str
    master_port: int
    group_name: str
    backend: str | None = None
    timeout_s: float = 300.0

    def validate(self, updater: "Updater") -> ValidatedUpdate:
        timer = PhaseTimer()
        config = updater.config
        device = torch.device(config.device)
        backend = self.backend or ("nccl" if config.is_cuda else "gloo")
        self.group, _store = dist_transport.new_group(self.master_address, self.master_port, 1, 2,
                                                      self.group_name, backend, self.timeout_s)
        manifest = remote.receive_message(self.group, 0, device)
        problem = remote.check_manifest(manifest, updater.model_config)
        remote.send_message(self.group, remote.verdict(problem), 1, device)
        if problem:
            raise UpdateError(f"remote seeding refused: {problem}")
        self.buckets, self.source_version = manifest["buckets"], manifest["weight_version"]
        nbytes = sum(torch.Size(s).numel() * parse_dtype(d).itemsize
                     for b in self.buckets for d, s in zip(b["dtypes"], b["shapes"]))
        timer.lap("handshake")
        message = (f"seeded {sum(len(b['names']) for b in self.buckets)} tensors from "
                   f"{self.master_address}:{self.master_port}")
        return ValidatedUpdate(self, nbytes, message, timer)

    def write(self, updater: "Updater", timer: PhaseTimer) -> Applied:
        try:
            for request in self.buckets:
                tensors = dist_transport.receive_bucket(self.group, request["names"], request["dtypes"],
                                                        request["shapes"], updater.config.device)
                timer.lap("transfer")
                write_tensors(updater, tensors, True, timer)  # a fused layer may span buckets
            process_weights_after_loading(updater.model)  # every layer complete now, or refused
        except Exception as exc:
            discard_staged_weights(updater.model)
            if not updater.waiting_for_weights:  # a serving engine now holds a mix of two versions
                updater.unhealthy = f"remote seeding failed midway ({exc}); the weights are a mix of two versions"
            raise UpdateError(f"remote seeding failed midway: {exc}") from exc
        timer.lap("post_process")
        return Applied(AUDIT_ALL)


@dataclass
class RegisteredSource(UpdateSource):
    """Registered buckets (``weights/commit/copy_table.py``): the epoch, the bucket numbers and
    every destination checked where registration found it. ``write`` launches the copies,
    checks the destinations again while they run, and waits for them (the trainer reuses a
    buffer once the call returns)."""
    buckets: object
    epoch: int

    def validate(self, updater: "Updater") -> ValidatedUpdate:
        timer = PhaseTimer()
        registration = updater.transfers.registration
        if registration.table is None:
            raise UpdateError("no registered buffers: call register_weight_buffers first")
        if self.epoch != registration.epoch:
            raise UpdateError(f"registration epoch {self.epoch!r} is not the current one ({registration.epoch}): "
                              f"register again")
        self.table, self.copy_mode = registration.table, registration.copy_mode
        try:
            self.numbers = self.table.check_buckets(self.buckets)
            self.table.check_destinations(self.numbers)
        except copy_table.RegistrationError as exc:
            raise UpdateError(str(exc)) from exc
        timer.lap("validate")
        nbytes = sum(self.table.nbytes[k] for k in self.numbers)
        return ValidatedUpdate(self, nbytes, f"copied {len(self.numbers)} registered buckets", timer)

    def write(self, updater: "Updater", timer: PhaseTimer) -> Applied:
        self.table.copy(self.numbers, self.copy_mode)
        # The check after the last launch runs on the CPU while the GPU copies (it reads no
        # weight, only where each one lives); then the wait, so the trainer may reuse buffers.
        try:
            self.table.check_destinations(self.numbers)
        except copy_table.RegistrationError as exc:  # cannot happen unless a copy rebinds: say so loudly
            updater.unhealthy = str(exc)
            raise UpdateError(str(exc)) from exc
        timer.lap("audit")
        if updater.config.is_cuda:
            torch.cuda.current_stream(updater.config.device).synchronize()
        timer.lap("copy")
        # The check above is the audit of these parameters (identity, stride included, with
        # the storages held by the table); the full address audit runs when generation resumes.
        return Applied(AUDIT_NONE)


@dataclass
class SnapshotSource(UpdateSource):
    """A host snapshot (``Updater.take_snapshot``), copied back in place with no disk read."""
    snapshot: Snapshot

    def validate(self, updater: "Updater") -> ValidatedUpdate:
        return ValidatedUpdate(self, self.snapshot.nbytes, "rolled back to the snapshot", PhaseTimer())

    def write(self, updater: "Updater", timer: PhaseTimer) -> Applied:
        updater.restore(self.snapshot)  # the rotary tables are kernel tensors: restored here too
        updater.apply_runtime_config(self.snapshot.config)
        timer.lap("copy")
        return Applied(AUDIT_ALL)
