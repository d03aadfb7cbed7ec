"""The port: the narrow, typed view of the engine that update sources and writers get.

A source validates and fetches, a writer writes, through ``UpdatePort`` alone: the model
and its config, the device, the transports' state (``Transfers``), the commit step and
which of the course's parts run (``Parts``), the address audit of named parameters, and
the snapshot kept. Nothing in a source or a writer can touch the requests, the pause,
the version label or the health flag: those belong to the transaction
(``update/updater.py``), which is the only place they change.

``Parts`` is where the course's hooks are read, once: when the engine is built and when a
commit step is plugged in, never per update or per layer. In the student edition a part
may still be a stub (the engine then takes the plain path that needs no such part) or be
a learner's (a fast writer that does that part's work its own way must then stand aside,
so the learner's part is the one that runs and is graded). ``Parts.declined`` records,
per fast writer, why this engine may not use it; the plan copies the reason into the
update's result, so a learner or a benchmark sees why a path was slow. Switches meant
for maintainers' comparisons (``COURSE_LIB_*`` variables, ``BucketCache.enabled``) are
read when each update is planned, as before.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping

import torch
from torch import nn

from course_lib.config import ModelConfig, is_cuda
from course_lib.exercises import is_reference, is_written
from course_lib.update.records import Audit, Snapshot
from course_lib.update.transfers import Transfers
from course_lib.weights.commit import direct_quant
from course_lib.weights.commit.copy_plan import COMMIT_STEP, CopyPlan, copy_in_place
from course_lib.weights.commit.layerwise import LayerwiseReload
from course_lib.weights.transports import bucket
from course_lib.weights.transports import dist as dist_transport

LAYERWISE_STEP = "ch03.layerwise_buffer"


def loaders_commit(model, named_tensors, device) -> None:
    """The commit step through the model's own loaders (fusion, slicing, staging for
    requantization): what runs where the copy plan cannot (quantized layers, a
    tensor-parallel rank) or its part is not written yet."""
    model.load_weights((name, t.to(device, non_blocking=True)) for name, t in named_tensors)


def engine_commit_step(model) -> Callable:
    """The engine's own commit step for ``model``, chosen once: the copy plan's
    (chapter 04's ``CopyPlan.apply``) where the model has a plan and that part is written,
    else the loaders (the student edition before chapter 04: the part is switched off,
    never routed around once written)."""
    plan = CopyPlan.for_model(model)
    if plan is None or not is_written(CopyPlan.apply, COMMIT_STEP):
        return loaders_commit

    def plan_commit(model, named_tensors, device) -> None:
        plan.apply(named_tensors)  # copies from wherever the tensors are, straight into the weights
    return plan_commit


def _bucket_reason(model, plugged: bool) -> str | None:
    """Why a flattened bucket may not be copied through a cached copy table, or None."""
    if plugged:
        return "a commit step is plugged in: it writes every tensor"
    if CopyPlan.for_model(model) is None:
        return "a quantized engine or a tensor-parallel rank: the loaders must run (no copy plan)"
    if not is_reference(CopyPlan.apply, COMMIT_STEP):
        return f"{COMMIT_STEP} is not the instructor edition's: it writes every tensor"
    if not is_reference(bucket.validate, bucket.VALIDATE_STEP):
        return f"{bucket.VALIDATE_STEP} is not the instructor edition's: it checks every bucket"
    return None


@dataclass(frozen=True)
class Parts:
    """The course's parts one engine runs, read once (see the module docstring)."""
    commit: Callable                     # the commit step: (model, named_tensors, device) -> None
    plugged: bool                        # a commit step plugged in (a grader's, a learner's), not the engine's
    declined: Mapping[str, str] = field(default_factory=dict)  # fast writer -> why this engine may not use it
    # Who copies a registered bucket's pieces: "table" (its copy table, as registered),
    # "commit_step" (a learner's commit step, piece by piece) or "loop" (the table's own
    # loop: chapter 04's part is the unwritten stub, switched off).
    registered_copy: str = "table"

    def __post_init__(self):
        object.__setattr__(self, "declined", MappingProxyType(dict(self.declined)))

    @classmethod
    def read(cls, model: nn.Module, commit: Callable | None = None) -> "Parts":
        """Read the hooks for ``model`` with ``commit`` (None, or the engine's own
        ``copy_in_place``: the engine's commit step) as the commit step."""
        plugged = commit is not None and commit is not copy_in_place
        declined = {}
        if not is_written(LayerwiseReload.feed, LAYERWISE_STEP):
            declined["layerwise"] = f"{LAYERWISE_STEP} is not written yet: a disk update stages the whole checkpoint"
        why = _bucket_reason(model, plugged)
        if why:
            declined["cached_bucket"] = why
        if why or not is_reference(dist_transport.receive_bucket, dist_transport.RECEIVE_STEP):
            declined["receive_pool"] = why or (f"{dist_transport.RECEIVE_STEP} is not the instructor edition's: "
                                               f"it receives every bucket")
        why = "a commit step is plugged in: it writes every tensor" if plugged else direct_quant.model_reason(model)
        if why:
            declined["direct_quant"] = why
        if CopyPlan.for_model(model) is None:
            declined["registered"] = "a quantized engine or a tensor-parallel rank: bytes cannot be copied straight in"
        copy = ("table" if is_reference(CopyPlan.apply, COMMIT_STEP)
                else "commit_step" if is_written(CopyPlan.apply, COMMIT_STEP) else "loop")
        return cls(commit if plugged else engine_commit_step(model), plugged, declined, copy)


@dataclass(frozen=True)
class UpdatePort:
    """What an update source or a writer may use of one engine rank (module docstring)."""
    model: nn.Module
    model_config: ModelConfig
    device: str
    tp_rank: int
    transfers: Transfers
    parts: Parts
    audit: Callable[[Audit], None]       # the address audit of these parameters (AddressMovedError if one moved)
    snapshot: Snapshot | None            # the host snapshot kept, if any

    @property
    def is_cuda(self) -> bool:
        return is_cuda(self.device)

    @property
    def quantization(self) -> str | None:
        return getattr(self.model, "quantization", None)

    @property
    def sharded(self) -> bool:
        """A tensor-parallel rank: its weights hold only a shard of each tensor."""
        return getattr(self.model, "tp_size", 1) > 1

    def synchronize(self, stream_only: bool = False) -> None:
        """Wait for every copy queued on this rank's device, or (``stream_only``) on its
        current stream alone, where the writer queued everything it launched: a stream's
        wait is cheaper than the device's. Nothing to wait for on a CPU."""
        if not self.is_cuda:
            return
        if stream_only:
            torch.cuda.current_stream(self.device).synchronize()
        else:
            torch.cuda.synchronize(self.device)
