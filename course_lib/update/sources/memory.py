"""Sources whose bytes are already in memory: tensors handed over, sparse elements,
registered buffers.

- ``TensorSource`` (SGLang's ``update_weights_from_tensor``): pairs, a dict or a
  flattened bucket, decoded once (``update/payload.py``). A bucket whose layout and
  buffer were seen before is one lookup and one copy (``weights/commit/bucket_cache.py``);
  anything else is validated tensor by tensor.
- ``SparseSource``: only changed elements, in checkpoint coordinates
  (``transports/sparse.py``); each touched tensor is rebuilt from the engine's current
  values with the new elements scattered in, then written like any tensor.
- ``RegisteredSource``: bucket numbers of a trainer's registered buffers
  (``weights/commit/copy_table.py``): the epoch, the numbers and every destination checked.
"""
from __future__ import annotations

from dataclasses import dataclass

from course_lib.models.qwen3 import hf_tensor_shapes
from course_lib.update.payload import decode, unpack
from course_lib.update.port import UpdatePort
from course_lib.update.records import PhaseTimer, UpdatePlan
from course_lib.update.sources.base import UpdateSource
from course_lib.update.writers import check_bound, pick, tensor_candidates
from course_lib.weights.commit.copy_plan import read_checkpoint_tensor
from course_lib.weights.commit.copy_table import RegistrationError
from course_lib.weights.commit.validate import UpdateError, check_finite, validate_tensors
from course_lib.weights.transports import sparse


def checked_pairs_plan(port: UpdatePort, kind: str, pairs, refuse_non_finite: bool, declined: dict) -> UpdatePlan:
    """Tensors in hand, checked against the model (names, shapes, dtypes; values where
    asked); written by the fastest tensor writer that applies. An empty list: nothing."""
    if not pairs:
        return UpdatePlan(kind, "empty update: nothing to apply", "nothing")
    meta = {name: (tuple(t.shape), t.dtype) for name, t in pairs}
    if len(meta) != len(pairs):
        raise UpdateError("the update names a tensor more than once")
    nbytes = validate_tensors(port.model_config, meta, partial=True)
    if refuse_non_finite:
        check_finite(pairs)
    writer, more = pick(tensor_candidates(port, meta, chunk=True))
    return UpdatePlan(kind, f"updated {len(pairs)} tensors", writer, nbytes, {**declined, **more}, pairs)


@dataclass
class TensorSource(UpdateSource):
    """Tensors handed over in memory (module docstring). ``check_finite`` also refuses
    NaN and inf (off by default: it reads every byte once more). ``plan.inputs``: the
    checked pairs, or the bound bucket (``cached_bucket``)."""
    named_tensors: object
    load_format: str | None = None
    check_finite: bool = False
    kind = "tensor"

    def validate(self, port: UpdatePort, timer: PhaseTimer) -> UpdatePlan:
        decoded = decode(self.named_tensors, self.load_format, port.tp_rank)
        timer.lap("deserialize")
        declined = {}
        if decoded.bucket is None:
            pairs = decoded.pairs
        else:
            why = port.parts.declined.get("cached_bucket")
            if why is None:
                found = port.transfers.buckets.lookup(port.model, decoded.bucket)  # refuses a bad bucket
                if not isinstance(found, str):
                    check_bound(port, found, self.check_finite)
                    timer.lap("validate")
                    return UpdatePlan("tensor", f"updated {len(found.names)} tensors", "cached_bucket",
                                      found.nbytes, inputs=found)
                why = found
            declined["cached_bucket"] = why
            pairs = unpack(decoded.bucket)
            timer.lap("deserialize")
        plan = checked_pairs_plan(port, "tensor", pairs, self.check_finite, declined)
        timer.lap("validate")
        return plan

    def fetch(self, port: UpdatePort, plan: UpdatePlan, timer: PhaseTimer):
        pairs = plan.inputs
        if plan.writer != "cached_bucket" and pairs[0][1].is_cuda:
            port.transfers.keep_ipc_buffer(pairs[0][1])  # a trainer's CUDA IPC buffer stays mapped a while
        return plan, pairs


@dataclass
class SparseSource(UpdateSource):
    """A sparse payload (``sparse.diff``): refused on quantized engines (they do not hold
    the checkpoint's floats to scatter into) and tensor-parallel ranks. ``bytes`` counts
    what travelled (indices plus values), ``dense_bytes`` what the touched tensors weigh.
    ``plan.inputs``: the validated entries."""
    payload: dict
    kind = "sparse"

    def validate(self, port: UpdatePort, timer: PhaseTimer) -> UpdatePlan:
        if port.quantization is not None:
            raise UpdateError(f"sparse updates are refused on a {port.quantization}-quantized engine: it does not "
                              f"hold the checkpoint's floats to scatter into; send the touched tensors densely "
                              f"with update_weights_from_tensor")
        if port.sharded:
            raise UpdateError("a sparse update is not supported on a tensor-parallel rank: this rank holds only a "
                              "shard of each tensor, so it cannot rebuild checkpoint tensors")
        try:
            entries = sparse.validate(self.payload, hf_tensor_shapes(port.model_config))
        except sparse.SparsePayloadError as exc:
            raise UpdateError(f"bad sparse payload: {exc}") from exc
        timer.lap("validate")
        if not entries:
            return UpdatePlan("sparse", "empty sparse update: nothing changed", "nothing",
                              fields={"dense_bytes": 0, "elements": 0})
        n = sparse.num_elements(self.payload)
        return UpdatePlan("sparse", f"sparse update of {n} elements in {len(entries)} tensors", "general",
                          sparse.payload_nbytes(self.payload), inputs=entries,
                          fields={"dense_bytes": sparse.dense_nbytes(self.payload), "elements": n})

    def fetch(self, port: UpdatePort, plan: UpdatePlan, timer: PhaseTimer):
        pairs = []
        for (name, shape, _), idx, values in zip(plan.inputs, self.payload["indices"], self.payload["values"]):
            # All rows: exactly the checkpoint tensor as the engine holds it (unquantized).
            current = read_checkpoint_tensor(port.model, name, shape[0])
            pairs.append((name, sparse.scatter(current, idx, values)))
        timer.lap("rebuild")
        return plan, pairs


@dataclass
class RegisteredSource(UpdateSource):
    """Registered buckets: ``epoch`` must be the current registration's, ``buckets`` its
    bucket numbers; every destination is checked where registration found it (a rebound
    weight refuses, nothing written). ``plan.inputs``: (table, copy mode, numbers)."""
    buckets: object
    epoch: int
    kind = "registered"

    def validate(self, port: UpdatePort, timer: PhaseTimer) -> UpdatePlan:
        registration = port.transfers.registration
        if registration.table is None:
            raise UpdateError("no registered buffers: call register_weight_buffers first")
        if self.epoch != registration.epoch:
            raise UpdateError(f"registration epoch {self.epoch!r} is not the current one ({registration.epoch}): "
                              f"register again")
        table = registration.table
        try:
            numbers = table.check_buckets(self.buckets)
            table.check_destinations(numbers)
        except RegistrationError as exc:
            raise UpdateError(str(exc)) from exc
        timer.lap("validate")
        return UpdatePlan("registered", f"copied {len(numbers)} registered buckets", "registered",
                          sum(table.nbytes[k] for k in numbers), inputs=(table, registration.copy_mode, numbers))
