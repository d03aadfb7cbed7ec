"""Update sources, one per transport (``base.py`` says what every source does)."""
from course_lib.update.sources.base import UpdateSource
from course_lib.update.sources.disk import DeltaSource, DiskSource
from course_lib.update.sources.group import BroadcastSource, RemoteSource, ReshardSource
from course_lib.update.sources.memory import RegisteredSource, SparseSource, TensorSource
from course_lib.update.sources.snapshot import SnapshotSource

__all__ = ["BroadcastSource", "DeltaSource", "DiskSource", "RegisteredSource", "RemoteSource", "ReshardSource",
           "SnapshotSource", "SparseSource", "TensorSource", "UpdateSource"]
