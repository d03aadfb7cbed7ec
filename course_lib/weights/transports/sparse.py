"""Sparse updates: send only the elements that changed (vLLM's ``sparse_nccl`` idea).

Between two RL steps most weights may be bitwise unchanged (a frozen embedding, a LoRA-
like update, a few rows touched). A sparse payload carries, per changed tensor, its
checkpoint name, shape and dtype, the flat indices of the changed elements (int64, in
*checkpoint coordinates*: the Hugging Face tensor's own shape, never the engine's fused
or sharded layout) and their new values. Tensors with no change are left out.

The engine applies a payload through the model's own loaders (see
``Engine.update_weights_sparse``): it rebuilds each touched checkpoint tensor from
its current values, scatters the new values in, and loads the whole tensor, so fusion
(q/k/v, gate/up) and the in-place copy are the same code as every other update.

A payload is a plain dict of aligned lists (SGLang-style field names)::

    {"names": [...], "shapes": [[...], ...], "dtypes": ["float32", ...],
     "indices": [int64 tensor [n_i], ...], "values": [tensor [n_i], ...]}
"""
from __future__ import annotations

import torch

from course_lib.dtypes import DtypeError, dtype_name, parse_dtype

FIELDS = ("names", "shapes", "dtypes", "indices", "values")

# Integer views with the same width: comparing bits, not values, means a NaN that stays
# NaN is "unchanged" and 0.0 -> -0.0 is "changed" (the bytes differ, so must the engine's).
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class SparsePayloadError(ValueError):
    """A payload that does not describe a valid sparse update; the message says why."""


def _as_dict(tensors) -> dict[str, torch.Tensor]:
    return dict(tensors.items() if isinstance(tensors, dict) else tensors)


def changed_indices(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Flat int64 indices where ``new`` differs bitwise from ``old`` (same shape and dtype)."""
    bits = _BITS[old.element_size()]
    a = old.detach().contiguous().reshape(-1).view(bits)
    b = new.detach().contiguous().reshape(-1).view(bits)
    return torch.nonzero(a != b).reshape(-1).to(torch.int64)


def diff(old_tensors, new_tensors) -> dict:
    """The sparse payload that turns ``old_tensors`` into ``new_tensors``.

    Both are {name: tensor} (or (name, tensor) pairs) in checkpoint format. ``new_tensors``
    may name a subset; every name it has must be in ``old_tensors`` with the same shape and
    dtype (a changed shape or dtype is not a sparse update: send the tensor densely).
    """
    old, new = _as_dict(old_tensors), _as_dict(new_tensors)
    payload = {f: [] for f in FIELDS}
    for name, b in new.items():
        if name not in old:
            raise SparsePayloadError(f"{name}: not in the old tensors, so there is nothing to diff against")
        a = old[name]
        if a.shape != b.shape or a.dtype != b.dtype:
            raise SparsePayloadError(f"{name}: {tuple(a.shape)} {a.dtype} -> {tuple(b.shape)} {b.dtype}; "
                                     f"only values can change in a sparse update")
        idx = changed_indices(a, b)
        if idx.numel() == 0:
            continue
        payload["names"].append(name)
        payload["shapes"].append(list(b.shape))
        payload["dtypes"].append(dtype_name(b.dtype))
        payload["indices"].append(idx.to(b.device))
        payload["values"].append(b.detach().reshape(-1)[idx.to(b.device)].clone())
    return payload


def payload_nbytes(payload: dict) -> int:
    """Bytes that travel: indices plus values (names and shapes are negligible)."""
    return sum(t.numel() * t.element_size() for f in ("indices", "values") for t in payload[f])


def dense_nbytes(payload: dict) -> int:
    """Bytes the touched tensors would take if sent whole."""
    total = 0
    for shape, dtype in zip(payload["shapes"], payload["dtypes"]):
        total += torch.Size(shape).numel() * parse_dtype(dtype).itemsize
    return total


def num_elements(payload: dict) -> int:
    return sum(int(t.numel()) for t in payload["indices"])


def validate(payload, expected_shapes: dict[str, tuple[int, ...]],
             allowed_dtypes=(torch.float32, torch.float16, torch.bfloat16)) -> list[tuple[str, tuple, torch.dtype]]:
    """Check a payload completely before anything is applied; returns [(name, shape, dtype)].

    Refuses (``SparsePayloadError``): missing fields or lists of different lengths, a name
    twice or unknown to the model, a wrong shape, a non-float dtype, values whose dtype is
    not the declared one, indices that are not a 1-D int64 tensor, out of bounds or
    repeated (a repeated index would make the result depend on the order of the writes).
    """
    if not isinstance(payload, dict) or any(f not in payload for f in FIELDS):
        raise SparsePayloadError(f"a sparse payload is a dict with fields {list(FIELDS)}")
    lengths = {f: len(payload[f]) for f in FIELDS}
    if len(set(lengths.values())) != 1:
        raise SparsePayloadError(f"fields have different lengths: {lengths}")
    names = list(payload["names"])
    if len(set(names)) != len(names):
        raise SparsePayloadError("the payload names a tensor more than once")
    out = []
    for name, shape, dtype, idx, values in zip(*(payload[f] for f in FIELDS)):
        if not isinstance(name, str) or name not in expected_shapes:
            raise SparsePayloadError(f"{name!r}: matches no tensor of this model")
        shape = tuple(int(s) for s in shape)
        if shape != tuple(expected_shapes[name]):
            raise SparsePayloadError(f"{name}: shape {shape}, expected {tuple(expected_shapes[name])}")
        try:
            dt = parse_dtype(dtype, allowed=allowed_dtypes)
        except DtypeError:
            raise SparsePayloadError(f"{name}: dtype {dtype!r}, expected a floating-point checkpoint dtype") from None
        if not (isinstance(idx, torch.Tensor) and idx.dtype == torch.int64 and idx.dim() == 1):
            raise SparsePayloadError(f"{name}: indices must be a 1-D int64 tensor")
        if not (isinstance(values, torch.Tensor) and values.dim() == 1 and values.dtype == dt):
            raise SparsePayloadError(f"{name}: values must be a 1-D {dt} tensor")
        if values.numel() != idx.numel():
            raise SparsePayloadError(f"{name}: {idx.numel()} indices but {values.numel()} values")
        numel = torch.Size(shape).numel()
        if idx.numel():
            lo, hi = int(idx.min()), int(idx.max())
            if lo < 0 or hi >= numel:
                raise SparsePayloadError(f"{name}: index {lo if lo < 0 else hi} is outside [0, {numel})")
            if torch.unique(idx).numel() != idx.numel():
                raise SparsePayloadError(f"{name}: an index appears more than once")
        out.append((name, shape, dt))
    return out


def scatter(base: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``base`` (a checkpoint-format tensor, not modified) with the new values written in."""
    out = base.detach().clone()
    out.view(-1)[indices.to(out.device)] = values.to(out.device, out.dtype)
    return out
