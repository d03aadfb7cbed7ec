"""The update side's records: typed, so a reader sees every field in one place.

- ``UpdateOptions``: how an update treats the engine around the new weights (every
  update takes these, whatever its transport).
- ``UpdatePlan``: what validation returns: what will be written, its bytes, the writer
  chosen and why the faster ones were not; nothing live has changed when it exists.
- ``Audit``: which parameters the address audit checks right after an update's writes:
  ``AUDIT_ALL`` or ``AUDIT_NONE`` (two named values), or ``Audit.of(names)``.
- ``Applied``: what a writer reports back to the transaction.
- ``PartialWrite``: a writer failed after live weights changed and could not put them back.
- ``UpdateResult``: one update's outcome; ``as_dict()`` is SGLang's reply with our fields.
- ``Snapshot``: a host copy of every kernel-read tensor, for ``rollback``.
- ``Registration``: a trainer's registered buffers (``weights/commit/copy_table.py``) and its epoch.
- ``PhaseTimer``: the milliseconds of each named phase of one update.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

import torch

WAIT_TIMEOUT_S = 600.0  # how long an update in ``wait`` mode lets in-flight requests finish


@dataclass(frozen=True)
class UpdateOptions:
    """How an update treats the engine around the new weights (every update takes these)."""
    weight_version: str | None = None     # None: keep the current label (or the source's own, see UpdatePlan)
    flush_cache: bool = True              # forget the prefix cache (its KV came from old weights)
    abort_all_requests: bool = False      # abort in-flight requests instead of refusing
    wait_timeout_s: float = WAIT_TIMEOUT_S
    # Refuse with this message, after taking any bytes a sender is already pushing: a
    # tensor-parallel rank whose rank 0 refused (every rank takes the broadcast, none applies it).
    refuse_with: str | None = None
    # One call per update (``update/one_call.py``): pause generation in this mode first
    # (None: no pause; an update while requests run unpaused is refused), and continue it
    # afterwards (None: when this call paused). A failed call continues only where no
    # weight of this pause changed.
    pause_mode: str | None = None
    resume: bool | None = None


@dataclass(frozen=True)
class Audit:
    """The parameters to audit right after an update's writes: ``names`` None means every
    kernel-read tensor. The full audit runs again when generation resumes either way."""
    names: frozenset[str] | None

    @classmethod
    def of(cls, names) -> "Audit":
        return cls(frozenset(names))


AUDIT_ALL = Audit(None)              # walk every kernel-read tensor now
AUDIT_NONE = Audit(frozenset())      # the writer checked its own destinations


@dataclass(frozen=True)
class UpdatePlan:
    """A validated update: what will be written and how. Nothing live has changed.

    ``writer`` names the writer that will run (``update/writers.py``'s registry; "nothing"
    for an empty update) and ``declined`` says, for each faster writer this transport
    could have used, why it was not chosen: both reach the ``UpdateResult``, so a slow
    update says why it was slow. ``inputs`` is what the source validated for its fetch
    step and the writer (each source's docstring says what it holds)."""
    source: str                           # the transport: "disk", "tensor", "broadcast", ...
    message: str
    writer: str
    nbytes: int = 0                       # bytes the update moves (known after the fetch for some)
    declined: Mapping[str, str] = field(default_factory=dict)   # faster writer -> why not
    inputs: object = None
    chunk: bool = True                    # one chunk of several: a fused layer may wait for a later one
    complete: bool = False                # brings every weight: an engine waiting for weights is ready after it
    keep_snapshot: bool = False           # take a host snapshot first (``rollback``; the rollback point too)
    config: object = None                 # a ModelConfig whose runtime fields are applied with the weights
    default_version: str | None = None    # the version label when the caller gives none
    fields: Mapping = field(default_factory=dict)  # result fields known before writing

    def __post_init__(self):
        object.__setattr__(self, "declined", MappingProxyType(dict(self.declined)))
        object.__setattr__(self, "fields", MappingProxyType(dict(self.fields)))


@dataclass
class Applied:
    """What a writer reports back to the transaction."""
    audit: Audit = AUDIT_ALL
    fields: dict = field(default_factory=dict)  # extra result fields (memory, ...)


class PartialWrite(Exception):
    """A writer failed after changing live weights and did not put them back; the
    transaction restores a snapshot kept for this update, or marks the engine unhealthy."""

    def __init__(self, what: str, cause: BaseException):
        super().__init__(what)
        self.cause = cause


@dataclass
class UpdateResult:
    """One update's outcome. ``as_dict()``: SGLang's fields (success, message) plus ours."""
    message: str
    weight_version: str
    weight_update_count: int
    bytes: int
    timings_ms: dict
    num_paused_requests: int = 0
    entries_cleared: int = 0
    fields: dict = field(default_factory=dict)  # what this transport adds (memory, pieces, writer, ...)
    success: bool = True

    @property
    def elapsed_ms(self) -> float:
        return sum(self.timings_ms.values())

    def as_dict(self) -> dict:
        return {"success": self.success, "message": self.message, "weight_version": self.weight_version,
                "weight_update_count": self.weight_update_count, "num_paused_requests": self.num_paused_requests,
                "entries_cleared": self.entries_cleared, "bytes": self.bytes, "elapsed_ms": self.elapsed_ms,
                "timings_ms": dict(self.timings_ms), **self.fields}


@dataclass
class Snapshot:
    """Host copies of every kernel-read tensor, the version label and the runtime config
    fields they were taken with (``Updater.take_snapshot``)."""
    weight_version: str
    tensors: dict[str, torch.Tensor]
    config: object                      # a ModelConfig copy: the runtime fields as they were

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass(frozen=True)
class Registration:
    """A trainer's registered buffers: ``epoch`` counts registrations (an update must name
    the current one); ``table`` is None when nothing is registered."""
    epoch: int = 0
    table: object | None = None         # a weights.commit.copy_table.RegisteredTable
    copy_mode: str | None = None


class PhaseTimer:
    """Collects the milliseconds of each named phase of an update."""

    def __init__(self):
        self.ms: dict[str, float] = {}
        self._t = time.perf_counter()

    def lap(self, phase: str | None) -> None:
        """Charge the time since the last lap to ``phase`` (None: charge it nowhere)."""
        now = time.perf_counter()
        if phase is not None:
            self.ms[phase] = self.ms.get(phase, 0.0) + 1e3 * (now - self._t)
        self._t = now

    def ms_since_lap(self) -> float:
        return 1e3 * (time.perf_counter() - self._t)
