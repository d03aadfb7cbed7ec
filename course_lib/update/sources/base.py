"""What every update source is: a transport's request, validated into a plan, then fetched.

A source is a frozen dataclass of what one call of one transport brings (SGLang's field
names: a checkpoint dir, tensors in memory, a broadcast's announcement, ...). The
transaction (``update/updater.py``) asks it, through the narrow ``UpdatePort`` alone:

1. ``validate(port, timer) -> UpdatePlan``: check everything that can be checked before
   any byte arrives, choose the writer (``writers.pick``), and change nothing;
2. ``fetch(port, plan, timer) -> (plan, data)``: receive, read or rebuild the bytes the
   writer needs (a broadcast received, a checkpoint staged, a group joined), still
   changing nothing live; the plan may be completed by what arrived (its bytes, the
   source's version label, a config);
3. ``refused(port, refusal)``: the update was refused (busy, invalid, or refused on
   another rank) while a sender may already be pushing bytes: take them and drop them,
   so no sender hangs (the default: nothing to take);
4. ``release()``: after the update, done or failed (a temporary directory removed).
"""
from __future__ import annotations

from course_lib.update.port import UpdatePort
from course_lib.update.records import PhaseTimer, UpdatePlan


class UpdateSource:
    """One transport's update (module docstring)."""

    kind = "update"

    def validate(self, port: UpdatePort, timer: PhaseTimer) -> UpdatePlan:
        raise NotImplementedError

    def fetch(self, port: UpdatePort, plan: UpdatePlan, timer: PhaseTimer) -> tuple[UpdatePlan, object]:
        return plan, plan.inputs

    def refused(self, port: UpdatePort, refusal: BaseException) -> None:
        return None

    def release(self) -> None:
        return None
