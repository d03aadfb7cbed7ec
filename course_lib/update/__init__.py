"""The update side: one entry (``Updater.update(source, options)``) and one port.

``updater.py`` (the transaction), ``port.py`` (what sources and writers may use of the
engine, and which of the course's parts run), ``sources/`` (one per transport),
``writers.py`` (the registry of writers), ``records.py`` (the typed records),
``methods.py`` (SGLang's method names as adapters), ``payload.py`` (in-memory payloads
decoded once), ``transfers.py`` (what transports keep between updates).
"""
from course_lib.update.records import UpdateOptions, UpdatePlan, UpdateResult
from course_lib.update.sources import (BroadcastSource, DeltaSource, DiskSource, RegisteredSource, RemoteSource,
                                       ReshardSource, SnapshotSource, SparseSource, TensorSource, UpdateSource)

__all__ = ["BroadcastSource", "DeltaSource", "DiskSource", "RegisteredSource", "RemoteSource", "ReshardSource",
           "SnapshotSource", "SparseSource", "TensorSource", "UpdateOptions", "UpdatePlan", "UpdateResult",
           "UpdateSource"]
