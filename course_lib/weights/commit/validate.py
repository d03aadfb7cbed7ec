"""Validation: what an update must pass before the first byte of the live weights changes.

Contract: nothing in the live model changes until the whole update has been validated
(structural config, every tensor name, shape and dtype; values where asked) and, where
it cannot be streamed, staged. ``UpdateError`` is the refusal every update path raises,
naming what was wrong. The commit step that writes afterwards is ``copy_plan.py``'s; the
transaction around both is ``update/updater.py``.
"""
from __future__ import annotations

from typing import Iterable

import torch

from course_lib.config import ModelConfig
from course_lib.weights.checkpoint import CheckpointError, CheckpointReader, hf_tensor_shapes


class UpdateError(ValueError):
    """An update refused before anything changed; the message says what was wrong."""


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_NORM_DTYPES = FLOAT_DTYPES + (torch.float64,)


def validate_config(current: ModelConfig, new: ModelConfig) -> None:
    diff = current.structural_diff(new)
    if diff:
        fields = ", ".join(f"{k}: {a} -> {b}" for k, (a, b) in diff.items())
        raise UpdateError(f"the new checkpoint changes the model's structure ({fields}); "
                          f"a hot update can only change values: restart the engine for this")
    diff = current.structural_diff(new, current.restart_fields)
    if diff:
        fields = ", ".join(f"{k}: {a} -> {b}" for k, (a, b) in diff.items())
        raise UpdateError(f"the new config.json changes {fields}, which a hot update cannot apply in place "
                          f"(see ModelConfig.restart_fields): restart the engine for this")


_SHAPES_CACHE: dict[tuple, dict] = {}


def _expected_shapes(config: ModelConfig) -> dict:
    """hf_tensor_shapes, cached per structure (an update validates every bucket against it)."""
    key = tuple(getattr(config, f) for f in config.structural_fields)
    if key not in _SHAPES_CACHE:
        _SHAPES_CACHE[key] = hf_tensor_shapes(config)
    return _SHAPES_CACHE[key]


def validate_tensors(config: ModelConfig, meta: dict, partial: bool = False) -> int:
    """Check names, shapes and dtypes against the model; returns the bytes to load.

    ``meta`` is {name: (shape, dtype)}. A full update must name every tensor exactly once;
    a partial update (asked for explicitly) may name any subset.
    """
    expected = _expected_shapes(config)
    unknown = sorted(set(meta) - set(expected))
    if unknown:
        raise UpdateError(f"{len(unknown)} tensors match no parameter of this model, e.g. {unknown[:3]}")
    missing = sorted(set(expected) - set(meta))
    if missing and not partial:
        raise UpdateError(f"{len(missing)} tensors missing for a full update, e.g. {missing[:3]} "
                          f"(pass partial=True to update only some tensors)")
    if not meta:
        raise UpdateError("the update names no tensors")
    nbytes = 0
    for name, (shape, dtype) in meta.items():
        if tuple(shape) != tuple(expected[name]):
            raise UpdateError(f"{name}: shape {tuple(shape)}, expected {tuple(expected[name])}")
        if dtype not in FLOAT_DTYPES:
            raise UpdateError(f"{name}: dtype {dtype}, expected a floating-point checkpoint tensor")
        n = 1
        for s in shape:
            n *= s
        nbytes += n * dtype.itemsize
    return nbytes


def stage_from_disk(reader: CheckpointReader, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Read every tensor into host memory, so a truncated or corrupt file fails here,
    before the commit, and never halfway through it."""
    return dict(reader.iter_tensors(names))


def check_finite(named_tensors) -> None:
    """Refuse NaN or infinite weights (a diverged trainer) before they reach the model.

    One pass over each tensor and one synchronisation per device for the whole call: each
    floating tensor's largest magnitude (``vector_norm`` of order inf, a reduction that
    makes no copy of the tensor) is kept as a float32 scalar on its device; NaN and +-inf
    propagate into it, while the largest finite value stays finite. All scalars are
    checked at once; only when one fails is the first such tensor named. Empty tensors
    hold no values and pass."""
    peaks: dict[torch.device, tuple[list, list[torch.Tensor]]] = {}
    for i, (name, t) in enumerate(named_tensors):
        if t.is_floating_point() and t.numel():
            fed, values = peaks.setdefault(t.device, ([], []))
            fed.append((i, name))
            # float8 and other narrow types have no norm kernel: they are widened (rare, small).
            values.append(torch.linalg.vector_norm(t if t.dtype in _NORM_DTYPES else t.float(), float("inf")).float())
    bad = []
    for fed, values in peaks.values():
        finite = torch.isfinite(torch.stack(values))
        if not bool(finite.all()):  # the one synchronisation of this device
            bad += [entry for entry, ok in zip(fed, finite.tolist()) if not ok]
    if bad:
        raise UpdateError(f"{min(bad)[1]}: contains NaN or infinite values")  # the first one fed


def open_and_validate(model_config: ModelConfig, model_path, partial: bool = False):
    """Open a checkpoint dir for an update and validate it from its headers (structure,
    names, shapes, dtypes), reading no tensor: (reader, bytes to load)."""
    try:
        reader = CheckpointReader(model_path)
        validate_config(model_config, reader.config)
        meta = reader.metadata()
    except CheckpointError as exc:
        raise UpdateError(str(exc)) from exc
    nbytes = validate_tensors(model_config, meta, partial)
    for name, (_, dtype) in meta.items():
        if dtype != reader.config.dtype:
            raise UpdateError(f"{name}: dtype {dtype}, but config.json declares {reader.config.torch_dtype}")
    return reader, nbytes
