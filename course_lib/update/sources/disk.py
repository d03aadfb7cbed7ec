"""Sources that read a checkpoint directory: ``DiskSource`` and ``DeltaSource``.

Both are validated whole from the checkpoint's headers (structure, every name, shape and
dtype, file sizes) before anything changes, and written by the layer-by-layer reload
(``layerwise``: about one layer of extra device memory, each layer saved to a rollback
point just before it is written) or staged whole first (``staging="full"``, or before
chapter 03's buffer is written), then written as tensors in hand. ``config.json``'s
runtime fields travel in the plan and are applied with the weights.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

from course_lib.models.qwen3 import hf_tensor_shapes
from course_lib.update.port import UpdatePort
from course_lib.update.records import PhaseTimer, UpdatePlan
from course_lib.update.sources.base import UpdateSource
from course_lib.update.writers import pick, tensor_candidates
from course_lib.weights.commit.validate import UpdateError, check_finite, open_and_validate, stage_from_disk
from course_lib.weights.transports import delta

STAGINGS = ("layer", "full")


@dataclass(frozen=True)
class DiskInputs:
    """A validated checkpoint: its reader (headers read, files identified) and the names to write."""
    reader: object
    names: list


def check_staging(staging: str) -> None:
    if staging not in STAGINGS:
        raise ValueError(f"staging must be 'layer' or 'full', got {staging!r}")


def disk_writer(port: UpdatePort, staging: str, names) -> tuple[str, dict]:
    """Layer by layer where asked and written, else staged whole and written as tensors."""
    streamed = "staging='full' was asked for" if staging == "full" else port.parts.declined.get("layerwise")
    return pick([("layerwise", streamed), *tensor_candidates(port, names, chunk=False)])


def fetch_checkpoint(plan: UpdatePlan, timer: PhaseTimer) -> tuple[UpdatePlan, object]:
    """What the writer needs: the reader, to stream from; or every tensor read into host
    memory now (a truncated or corrupt file fails here, before the first write)."""
    if plan.writer == "layerwise":
        return plan, plan.inputs.reader
    staged = stage_from_disk(plan.inputs.reader)
    check_finite(staged.items())
    timer.lap("transfer")
    return plan, list(staged.items())


@dataclass
class DiskSource(UpdateSource):
    """A checkpoint dir (SGLang's ``update_weights_from_disk``). ``partial``: any subset
    of the tensors may come; ``staging``: "layer" (stream) or "full" (stage first);
    ``keep_snapshot``: a host snapshot is taken first (for ``rollback``), and is then the
    rollback point of the streamed write. ``plan.inputs``: ``DiskInputs``."""
    model_path: object
    partial: bool = False
    staging: str = "layer"
    keep_snapshot: bool = False
    kind = "disk"

    def validate(self, port: UpdatePort, timer: PhaseTimer) -> UpdatePlan:
        check_staging(self.staging)
        reader, nbytes = open_and_validate(port.model_config, self.model_path, self.partial)
        names = list(reader.metadata())
        timer.lap("validate")
        writer, declined = disk_writer(port, self.staging, names)
        return UpdatePlan("disk", f"updated from {reader.path}", writer, nbytes, declined, DiskInputs(reader, names),
                          chunk=False, complete=not self.partial, keep_snapshot=self.keep_snapshot,
                          config=reader.config)

    def fetch(self, port: UpdatePort, plan: UpdatePlan, timer: PhaseTimer):
        return fetch_checkpoint(plan, timer)


@dataclass
class DeltaSource(UpdateSource):
    """A byte delta against a base checkpoint on shared disk (``transports/delta.py``):
    the base is checked to be the delta's before anything else (a mismatch refuses), the
    new checkpoint rebuilt into a temporary directory (removed afterwards), then loaded
    as a disk update. The version label defaults to the one the delta recorded.
    ``plan.inputs``: the delta's index, then (after the fetch) ``DiskInputs``."""
    base_dir: object
    delta_path: object
    base_version: str | None = None
    staging: str = "layer"
    keep_snapshot: bool = False
    tmp_dir: object = None
    work: tempfile.TemporaryDirectory | None = field(default=None, init=False, repr=False)
    kind = "delta"

    def validate(self, port: UpdatePort, timer: PhaseTimer) -> UpdatePlan:
        check_staging(self.staging)
        try:
            index = delta.check_base(self.base_dir, self.delta_path, self.base_version)
        except delta.DeltaError as exc:
            raise UpdateError(str(exc)) from exc
        timer.lap("validate")
        writer, declined = disk_writer(port, self.staging, list(hf_tensor_shapes(port.model_config)))
        return UpdatePlan("delta", f"rebuilt from {self.delta_path}", writer, 0, declined, index, chunk=False,
                          complete=True, keep_snapshot=self.keep_snapshot,
                          default_version=index["new"]["weight_version"],
                          fields={"delta_bytes": Path(self.delta_path).stat().st_size})

    def fetch(self, port: UpdatePort, plan: UpdatePlan, timer: PhaseTimer):
        self.work = tempfile.TemporaryDirectory(prefix="delta-", dir=self.tmp_dir)
        path = Path(self.work.name) / "checkpoint"
        try:
            delta.apply_delta(self.base_dir, self.delta_path, path, self.base_version, checked=plan.inputs)
        except delta.DeltaError as exc:
            raise UpdateError(str(exc)) from exc
        timer.lap("reconstruct")
        reader, nbytes = open_and_validate(port.model_config, path)
        timer.lap("validate")
        plan = replace(plan, message=f"updated from {reader.path}", nbytes=nbytes, config=reader.config,
                       inputs=DiskInputs(reader, list(reader.metadata())))
        return fetch_checkpoint(plan, timer)

    def release(self) -> None:
        if self.work is not None:
            self.work.cleanup()
            self.work = None
