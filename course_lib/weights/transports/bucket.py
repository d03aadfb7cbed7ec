"""Flattened tensor buckets: many tensors in one flat buffer plus per-tensor metadata.

One transfer of one large buffer beats hundreds of small ones (fewer calls, one IPC
handle, one broadcast). The metadata is SGLang's ``FlattenedTensorMetadata`` (name,
shape, dtype, start_idx, end_idx, numel), so a bucket an SGLang client packs can be read
unchanged. Two layouts:

- SGLang's: one flat tensor of a single dtype, offsets in elements (mixed dtypes are
  promoted by the concatenation and cast back on unpacking);
- bytes: a ``uint8`` buffer, offsets in bytes, every tensor 16-byte aligned, so mixed
  dtypes travel exactly and unpacking is a zero-copy view.

``pack`` copies each tensor once into a preallocated buffer; ``unpack`` returns views.
``validate`` refuses metadata that would read outside the buffer before anything is read.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

ALIGN = 16  # bytes; keeps every dtype view aligned
VALIDATE_STEP = "ch05.validate_bucket"  # the exercise ``validate`` holds


def align_up(n: int, to: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``to`` (the next slot's start in a byte layout)."""
    return -(-n // to) * to


@dataclass
class FlattenedTensorMetadata:
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


class BucketError(ValueError):
    """Bucket metadata that does not describe its buffer."""


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def layout(names, dtypes, shapes) -> list[FlattenedTensorMetadata]:
    """Byte offsets of each tensor in a byte-layout bucket (each start 16-byte aligned).

    Sender and receiver both derive the layout from names, dtypes and shapes alone. It is
    ``pack``'s own layout: ``pack`` run on meta tensors (no memory, no copies), so a
    receiver never disagrees with the sender about where a tensor starts."""
    names, dtypes, shapes = list(names), list(dtypes), list(shapes)
    if not len(names) == len(dtypes) == len(shapes):
        raise BucketError(f"{len(names)} names, {len(dtypes)} dtypes and {len(shapes)} shapes: one each per tensor")
    ghosts = [(n, torch.empty(tuple(s), dtype=d, device="meta")) for n, d, s in zip(names, dtypes, shapes)]
    return pack(ghosts, device="meta")["metadata"]


def bucket_nbytes(named_tensors) -> int:
    """Bytes a byte-layout bucket of these tensors needs (with alignment padding)."""
    meta = layout(*_columns(named_tensors))
    return meta[-1].end_idx if meta else 0


def group_into_buckets(named_tensors, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Split (name, tensor) pairs, in order, into consecutive groups whose byte-layout bucket
    (``bucket_nbytes`` of the group: ``pack``'s layout, alignment padding included) fits
    ``bucket_bytes``; a tensor larger than that goes alone. A generator: each group is
    yielded once complete, so a sender streaming its tensors holds one group at a time.

    Linear time: the running end of the layout is all a group's size depends on, so each
    tensor costs one step (re-measuring the whole group per tensor would be quadratic in
    the group's length). The arithmetic is ``pack``'s own, written out rather than called,
    so a plan needs neither memory nor the packer (a test checks the two agree)."""
    group, end = [], 0
    for name, t in named_tensors:
        nbytes = t.numel() * t.element_size()
        start = align_up(end)  # where this tensor would start after the group's last one
        if group and start + nbytes > bucket_bytes:
            yield group
            group, start = [], 0
        group.append((name, t))
        end = start + nbytes
    if group:
        yield group


def _columns(named_tensors):
    named_tensors = list(named_tensors)
    return ([n for n, _ in named_tensors], [t.dtype for _, t in named_tensors],
            [tuple(t.shape) for _, t in named_tensors])


def pack(named_tensors, out: torch.Tensor | None = None, device=None) -> dict:
    """Pack (name, tensor) pairs into a byte-layout bucket: ``{"flattened_tensor", "metadata"}``.

    The layout, in the order given: each tensor's bytes start at the first multiple of
    ``ALIGN`` (16) at or after the end of the previous tensor's bytes (the first at byte 0)
    and take ``numel * element_size`` bytes (an empty tensor takes none). Its metadata entry
    is ``FlattenedTensorMetadata(name, torch.Size(shape), dtype, start_idx, end_idx,
    numel)`` with offsets in bytes: the tensor's real shape, never a flattened one. The
    bucket needs as many bytes as the last tensor's ``end_idx`` (0 for no tensors).

    Each tensor is copied once, in row-major order, into its slot (a tensor on another
    device is copied across). ``out``, when given, is a sender's buffer reused bucket after
    bucket: a 1-D ``uint8`` tensor at least that long, written in place; the returned
    ``flattened_tensor`` is then ``out`` itself when exactly that long, else a view of its
    first bytes (never a new allocation). Without ``out``, a new ``uint8`` buffer of exactly
    that length is made on ``device`` (default: the first tensor's device, else ``"cpu"``).
    Padding bytes between slots hold anything.

    Errors, raised before anything is written: ``out`` that is not a 1-D uint8 tensor or
    is too short: ``BucketError`` naming its size and the bytes needed.
    """
    # BEGIN EXERCISE ch05.pack_bucket
    named_tensors = list(named_tensors)
    meta, offset = [], 0
    for name, t in named_tensors:
        offset = -(-offset // ALIGN) * ALIGN  # round up: every dtype view of the buffer stays aligned
        nbytes = t.numel() * t.element_size()
        meta.append(FlattenedTensorMetadata(name, torch.Size(t.shape), t.dtype, offset, offset + nbytes, t.numel()))
        offset += nbytes
    need = offset
    if out is None:
        device = device or (named_tensors[0][1].device if named_tensors else "cpu")
        out = torch.empty(need, dtype=torch.uint8, device=device)
    elif out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < need:
        raise BucketError(f"buffer of {out.numel()} {out.dtype} elements cannot hold {need} bytes")
    for m, (_, t) in zip(meta, named_tensors):
        # The one copy: the slot seen as the tensor's dtype and shape (aligned, so the view is
        # legal), so copy_ writes row-major whatever the tensor's strides, with no temporary.
        out[m.start_idx:m.end_idx].view(t.dtype).view(t.shape).copy_(t)
    return {"flattened_tensor": out[:need] if need < out.numel() else out, "metadata": meta}
    # END EXERCISE


DEVICES = ("cpu", "cuda")


def _check_fields(m) -> None:
    """Every metadata field of the type it claims (a payload may carry anything), so the
    checks on its values below cannot be fooled by bools, floats or negative sizes."""
    if not isinstance(m, FlattenedTensorMetadata):
        raise BucketError(f"metadata entries must be FlattenedTensorMetadata, got {type(m).__name__}")
    if not isinstance(m.name, str):
        raise BucketError(f"metadata name {m.name!r} is not a string")
    if not isinstance(m.shape, (tuple, list)) or not all(type(d) is int and d >= 0 for d in m.shape):
        raise BucketError(f"{m.name}: shape {m.shape!r} is not a tuple of non-negative integers")
    for field in ("start_idx", "end_idx", "numel"):
        value = getattr(m, field)
        if type(value) is not int:  # ranges are checked against the buffer below
            raise BucketError(f"{m.name}: {field} {value!r} is not an integer")
    if not isinstance(m.dtype, torch.dtype):
        raise BucketError(f"{m.name}: dtype {m.dtype!r} is not a torch dtype")


def validate(flat: torch.Tensor, metadata) -> None:
    """Check a whole bucket before anything reads it; raise ``BucketError`` naming the entry.

    A receiver calls this on what another process sent, before taking a single view, so a
    bucket with one bad entry is refused whole and nothing is read outside the buffer.
    ``flat`` must be a 1-D tensor on a device in ``DEVICES``; ``metadata`` a list (or
    tuple) of ``FlattenedTensorMetadata`` (``_check_fields`` checks each entry's types).
    For every entry: its name appears once in the bucket; ``numel`` equals the product of
    ``shape``; ``0 <= start_idx <= end_idx <= flat.numel()``. Then, when ``flat`` is
    ``uint8`` (the byte layout, offsets in bytes) and the entry's dtype is not ``uint8``:
    ``end_idx - start_idx == numel * dtype.itemsize`` and ``start_idx`` is a multiple of
    ``dtype.itemsize``; otherwise (SGLang's layout, offsets in elements of ``flat``):
    ``end_idx - start_idx == numel``. An empty metadata list is a valid (empty) bucket.
    Returns None; never changes ``flat``.
    """
    # BEGIN EXERCISE ch05.validate_bucket
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1:
        raise BucketError("flattened_tensor must be a 1-D tensor")
    if flat.device.type not in DEVICES:
        raise BucketError(f"flattened_tensor is on device {flat.device.type!r}; only {DEVICES} are accepted")
    if not isinstance(metadata, (list, tuple)):
        raise BucketError(f"metadata must be a list, got {type(metadata).__name__}")
    n = flat.numel()
    byte_layout = flat.dtype == torch.uint8
    seen = set()
    for m in metadata:
        _check_fields(m)
        if m.name in seen:  # two entries for one weight: which one wins would be an accident
            raise BucketError(f"{m.name}: appears more than once in the bucket")
        seen.add(m.name)
        if _numel(m.shape) != m.numel:
            raise BucketError(f"{m.name}: numel {m.numel} does not match shape {tuple(m.shape)}")
        if not (0 <= m.start_idx <= m.end_idx <= n):
            raise BucketError(f"{m.name}: offsets [{m.start_idx}, {m.end_idx}) overrun the buffer of {n} elements")
        span = m.end_idx - m.start_idx
        if byte_layout and m.dtype != torch.uint8:
            if span != m.numel * m.dtype.itemsize:
                raise BucketError(f"{m.name}: {span} bytes for {m.numel} {m.dtype} elements")
            if m.start_idx % m.dtype.itemsize:
                raise BucketError(f"{m.name}: start offset {m.start_idx} is not aligned to {m.dtype}")
        elif span != m.numel:
            raise BucketError(f"{m.name}: {span} elements for numel {m.numel}")
    # END EXERCISE


def unpack(bucket: dict) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from a bucket of either layout, validated first."""
    try:
        flat, metadata = bucket["flattened_tensor"], bucket["metadata"]
    except (KeyError, TypeError) as exc:
        raise BucketError("a bucket is a dict with 'flattened_tensor' and 'metadata'") from exc
    validate(flat, metadata)
    if flat.dtype == torch.uint8:
        return _byte_layout_views(flat, metadata)
    out = []
    for m in metadata:                             # SGLang layout: undo the promotion
        t = flat[m.start_idx:m.end_idx].view(m.shape)
        out.append((m.name, t if t.dtype == m.dtype else t.to(m.dtype)))
    return out


def _byte_layout_views(flat: torch.Tensor, metadata) -> list[tuple[str, torch.Tensor]]:
    """Zero-copy views of a byte-layout bucket's tensors. Each is one ``as_strided`` on a
    view of the whole buffer in the tensor's dtype, rather than a slice, a dtype view and a
    shape view: a third of the tensor operations, which is what an update of hundreds of
    small tensors spends its time on. (Offsets were checked by ``validate``.)"""
    typed: dict[torch.dtype, torch.Tensor | None] = {}
    strides: dict[tuple, tuple] = {}
    out = []
    for m in metadata:
        if m.dtype not in typed:
            try:
                typed[m.dtype] = flat.view(m.dtype)
            except RuntimeError:  # the buffer's length or offset is not a multiple of the item size
                typed[m.dtype] = None
        whole, shape = typed[m.dtype], tuple(m.shape)
        if whole is None:
            out.append((m.name, flat[m.start_idx:m.end_idx].view(m.dtype).view(shape)))
            continue
        if shape not in strides:
            strides[shape] = tuple(_numel(shape[i + 1:]) for i in range(len(shape)))
        offset = whole.storage_offset() + m.start_idx // m.dtype.itemsize  # as_strided counts from the storage's start
        out.append((m.name, whole.as_strided(shape, strides[shape], offset)))
    return out


def pack_sglang(named_tensors) -> dict:
    """SGLang's own layout (one dtype, element offsets), for interoperability tests."""
    named_tensors = list(named_tensors)
    flat = torch.cat([t.reshape(-1) for _, t in named_tensors])
    meta, i = [], 0
    for name, t in named_tensors:
        meta.append(FlattenedTensorMetadata(name, torch.Size(t.shape), t.dtype, i, i + t.numel(), t.numel()))
        i += t.numel()
    return {"flattened_tensor": flat, "metadata": meta}
