"""The update side's records: typed, so a reader sees every field in one place.

- ``PauseRecord``: what one pause cost, filled in as it happens (measured, never
  predicted); ``PauseControl.stats`` keeps the newest ones.
- ``UpdateOptions``: how an update treats the engine around the new weights.
- ``Audit``: which parameters the address audit checks right after an update's writes:
  ``AUDIT_ALL`` or ``AUDIT_NONE`` (two named values), or ``Audit.of(names)``.
- ``Applied``: what an update source's write step reports back to the transaction.
- ``UpdateResult``: one update's outcome; ``as_dict()`` is SGLang's reply with our fields.
- ``Snapshot``: a host copy of every kernel-read tensor, for ``rollback``.
- ``Registration``: a trainer's registered buffers (``weights/commit/copy_table.py``) and its epoch.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

WAIT_TIMEOUT_S = 600.0  # how long an update in ``wait`` mode lets in-flight requests finish


@dataclass
class PauseRecord:
    """What one pause cost (mode "none": an update made without a pause)."""
    mode: str
    aborted_requests: int = 0       # requests a pause (or abort_all_requests) finished early
    discarded_tokens: int = 0       # their generated tokens, thrown away
    retracted_requests: int = 0     # requests sent back to the queue with their KV freed
    reprefill_tokens: int = 0       # tokens computed again when those came back (measured)
    wait_s: float = 0.0             # seconds ``wait`` mode's drain took
    mixed_requests: int = 0         # requests whose tokens span two weight versions
    kv_fresh: bool = True           # every live KV block was computed by the new weights
    updates: int = 0                # updates made during this pause
    resume_ms: float = 0.0          # how long continue_generation took

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class UpdateOptions:
    """How an update treats the engine around the new weights (every update takes these)."""
    weight_version: str | None = None     # None: keep the current label
    flush_cache: bool = True              # forget the prefix cache (its KV came from old weights)
    abort_all_requests: bool = False      # abort in-flight requests instead of refusing
    wait_timeout_s: float = WAIT_TIMEOUT_S


@dataclass(frozen=True)
class Audit:
    """The parameters to audit right after an update's writes: ``names`` None means every
    kernel-read tensor. The full audit runs again when generation resumes either way."""
    names: frozenset[str] | None

    @classmethod
    def of(cls, names) -> "Audit":
        return cls(frozenset(names))


AUDIT_ALL = Audit(None)              # walk every kernel-read tensor now
AUDIT_NONE = Audit(frozenset())      # the write step checked its own destinations


@dataclass
class Applied:
    """What an update source's write step reports back to the transaction."""
    audit: Audit = AUDIT_ALL
    fields: dict = field(default_factory=dict)  # extra result fields (e.g. memory, pieces)


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
    fields: dict = field(default_factory=dict)  # what this transport adds (memory, pieces, ...)
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
    table: object | None = None         # a weights.copy_table.RegisteredTable
    copy_mode: str | None = None
