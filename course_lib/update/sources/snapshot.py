"""``SnapshotSource``: the host snapshot (``Updater.take_snapshot``) copied back in place,
with its version label and runtime config fields, with no disk read (``rollback``)."""
from __future__ import annotations

from dataclasses import dataclass

from course_lib.update.port import UpdatePort
from course_lib.update.records import PhaseTimer, UpdatePlan
from course_lib.update.sources.base import UpdateSource
from course_lib.weights.commit.validate import UpdateError


@dataclass
class SnapshotSource(UpdateSource):
    """The snapshot this engine rank keeps. ``plan.inputs``: that ``Snapshot``."""
    kind = "snapshot"

    def validate(self, port: UpdatePort, timer: PhaseTimer) -> UpdatePlan:
        snapshot = port.snapshot
        if snapshot is None:
            raise UpdateError("no snapshot to roll back to: take_snapshot() or update with keep_snapshot=True")
        return UpdatePlan("snapshot", "rolled back to the snapshot", "snapshot", snapshot.nbytes, inputs=snapshot,
                          chunk=False, config=snapshot.config, default_version=snapshot.weight_version)
