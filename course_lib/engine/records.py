"""The engine's pause record: what one pause cost, filled in as it happens (measured,
never predicted); ``PauseControl.stats`` keeps the newest ones. The update side's records
are in ``update/records.py``."""
from __future__ import annotations

from dataclasses import asdict, dataclass


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
