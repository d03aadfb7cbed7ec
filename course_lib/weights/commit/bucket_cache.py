"""Flattened buckets sent step after step: each layout validated once, each bucket one copy.

A trainer that calls ``update_weights_from_tensor(..., load_format="flattened_bucket")``
every step (SGLang's ``FlattenedTensorBucket``, as slime and verl send it) packs the same
tensors, in the same order, into the same few buffers each step. The general path
(``bucket.unpack``, ``validate.validate_tensors``, the copy plan) redoes, for every bucket of
every update, what does not change between steps: every metadata entry checked, a view
built and a name looked up per tensor, a copy per tensor. ``BucketCache`` (one per engine
rank, held by ``update/transfers.py``) keeps what is safe to keep:

- **layouts**, keyed by the bucket's metadata (every entry's name, shape, dtype, offsets
  and numel, with the buffer's dtype and length). A key seen for the first time is
  validated exactly as the general path validates it (``bucket.validate``, then the names,
  shapes and dtypes against the model), and a bad bucket gets the general path's error;
  a key seen before was validated then, so one dictionary lookup (one hash, one
  comparison of the whole layout) stands for all those checks.
- **copy tables**, one per (buffer, layout): the registered path's own
  ``copy_table.RegisteredTable``, built as if the trainer had registered that bucket
  (source byte ranges of the buffer, destination views from the copy plan, destination
  identities). A bucket is then one copy: one scatter-kernel launch on a GPU with Triton
  (else one replayed CUDA graph), one ``torch._foreach_copy_`` call on the CPU. So the
  bytes written are the registered path's, converted the same way where dtypes differ.
- **buffers**: a table holds its buffer's storage, so the buffer's CUDA IPC mapping (or
  shared-memory mapping) stays open. torch keeps opened handles in a cache keyed by the
  handle (``torch.multiprocessing.reductions.shared_cache``) as long as someone holds the
  storage: the next message naming that handle gets the same storage back with no
  ``cudaIpcOpenMemHandle``. A table is found again by its storage's identity (the
  ``StorageImpl``, its address and size, and the bucket's offset in it), which no other
  storage can share while it is held; a storage whose address or size changed (a handle
  opened afresh, a resized buffer) misses and gets a table of its own. Nothing cached is
  ever applied to another buffer's bytes.

Before every copy each destination parameter is checked to be where the table found it
(the registered path's check; a rebound weight refuses the bucket, nothing written, and
the cache is dropped), and with ``check_finite`` the bucket's tensors are checked for
NaN and inf by the check every update path uses (``validate.check_finite``).

What a mapping costs the trainer: CUDA IPC memory the engine still maps is not returned
to the trainer's allocator when the trainer frees it (torch keeps it until the engine lets
go), so only buffers the trainer keeps anyway should stay mapped. Hence the bounds: at most
``MAX_BUFFERS`` buffers are mapped at a time (least recently used dropped first, as the
general path's keep-alive does), and at resume (``release``) a buffer stays mapped only if
it was used in the step that ends and has carried more than one bucket since it was
mapped: the buffers a trainer packs into step after step stay; one it sent once (a tensor
larger than its buffers, or a trainer that allocates every bucket afresh) goes back to the
trainer before it trains again. At most ``MAX_LAYOUTS`` layouts, and tables per buffer,
are kept. A broadcast's receive buffers (``dist.ReceivePool``) are the engine's own
memory, not a trainer's mapping: looked up as ``resident``, they keep their tables at
resume until the engine frees them (``forget``, when their group is destroyed).

Where the fast path does not apply the general path runs, unchanged: a quantized engine
or a tensor-parallel rank (no copy plan), a bucket on another device, SGLang's element
layout with a conversion (a flat buffer of one dtype holding tensors of another), and
wherever the course's parts this path stands in for (chapter 05's ``validate_bucket``,
chapter 04's commit step) are not the instructor edition's, so a learner's part is always
the one that runs and is graded (the engine reads that once: ``update/port.py``).
"""
from __future__ import annotations

import operator
from collections import OrderedDict
from dataclasses import dataclass
from itertools import chain

import torch

from course_lib import settings
from course_lib.dtypes import dtype_name
from course_lib.weights.transports import bucket
from course_lib.weights.commit import copy_table
from course_lib.weights.commit.destinations import DestinationCheck
from course_lib.weights.transports.bucket import FlattenedTensorMetadata
from course_lib.weights.commit.validate import UpdateError, check_finite, validate_tensors

MAX_BUFFERS = 4     # trainer buffers kept mapped (a trainer uses two in turn)
MAX_LAYOUTS = 4096  # validated layouts kept, and tables per buffer (a step's buckets, several times over)


_FIELDS = operator.attrgetter("name", "shape", "dtype", "start_idx", "end_idx", "numel")
_SHAPE = operator.itemgetter(1)
# The only types a key's fields may have. Equal keys must mean equal buckets to the
# general path's checks, which refuse a bool or a numpy integer where an int belongs
# (``bucket._check_fields``) although ``True == 1`` and ``np.int64(3) == 3`` as keys.
_FIELD_TYPES = frozenset({str, torch.Size, torch.dtype, int})


@dataclass
class Layout:
    """A bucket layout the general path's checks accepted. ``tensors``: the registration
    entries ([name, dtype, shape, pieces], pieces in bytes of the buffer) of a bucket
    that is one piece of one buffer; ``spans``: (name, dtype, first byte, bytes) per
    tensor; ``eligible`` False where only the general path can apply it (SGLang's
    element layout with a conversion)."""
    key: tuple
    eligible: bool
    names: list
    tensors: list
    spans: list
    nbytes: int


class BoundBucket:
    """A layout bound to one buffer: the registered copy table for its bytes, the typed
    views of the buffer (for the NaN check), and the destination check."""

    def __init__(self, layout: Layout, flat: torch.Tensor, table, mode: str):
        self.layout, self.table, self.mode = layout, table, mode
        self.audited = False  # the caller audits the destinations' addresses once, before the first copy
        self.storage = flat.untyped_storage()  # held: the mapping stays open, the identity unique
        self.identity = storage_identity(flat)
        self.destinations = DestinationCheck([(0, d) for d in table.destinations[0]])
        data = flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)
        # Typed views of the bucket's floating tensors, for the NaN check (``check_finite``).
        self.floating = [(name, data[start:start + n].view(dtype)) for name, dtype, start, n in layout.spans
                         if n and dtype.is_floating_point]

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    @property
    def names(self) -> list:
        return self.layout.names

    def still_mapped(self) -> bool:
        """The held storage is still the memory the table was built on (not resized)."""
        return storage_identity_of(self.storage, self.identity[3]) == self.identity

    def moved_destination(self) -> str | None:
        """The first destination parameter no longer where the table found it, or None."""
        moved = self.destinations.first_moved()
        return None if moved is None else moved[1].label

    def check_finite(self) -> None:
        """Refuse NaN or inf in any of the bucket's floating tensors (``validate.check_finite``:
        one reduction per tensor, one synchronisation, the first bad one named)."""
        check_finite(self.floating)

    def copy(self) -> None:
        """Launch the bucket's copy (asynchronous on a GPU)."""
        self.table.copy([0], self.mode)


def storage_identity_of(storage: torch.UntypedStorage, offset: int) -> tuple:
    return storage._cdata, storage.data_ptr(), storage.nbytes(), offset


def storage_identity(flat: torch.Tensor) -> tuple:
    """Which memory ``flat`` is: its storage (the C object, unique while held), the
    storage's address and size, and where ``flat`` starts in it."""
    return storage_identity_of(flat.untyped_storage(), flat.storage_offset())


def copy_mode(device) -> str:
    """How a bucket's table copies: ``COURSE_LIB_REGISTERED_COPY`` where set, else one
    ``_foreach_copy_`` on the CPU and the registered path's default on a GPU."""
    if settings.registered_copy() is None and torch.device(device).type != "cuda":
        return "foreach"
    return copy_table.copy_mode(device)


class BucketCache:
    """Validated layouts and per-buffer copy tables of one engine rank (module docstring)."""

    def __init__(self, device, max_buffers: int = MAX_BUFFERS, max_layouts: int = MAX_LAYOUTS):
        self.device = torch.device(device)
        self.enabled = True  # False: every bucket takes the general path (to compare the two)
        self.max_buffers, self.max_layouts = max_buffers, max_layouts
        self.layouts: OrderedDict[tuple, Layout] = OrderedDict()
        self.buffers: OrderedDict[tuple, dict] = OrderedDict()  # storage identity -> {layout key: BoundBucket}
        self.used: set[tuple] = set()                            # buffers used since the last release
        self.uses: dict[tuple, int] = {}                         # buckets each buffer carried since mapped
        self.resident: set[tuple] = set()  # the engine's own buffers (``lookup(..., resident=True)``): kept
        self.stats = {"layouts_validated": 0, "layout_hits": 0, "tables_built": 0, "table_hits": 0,
                      "buffers_dropped": 0}

    # ---- the lookup ---------------------------------------------------------------------------
    def on_engine_device(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is on the engine's device (on a GPU: the engine's GPU, not another)."""
        if t.device.type != self.device.type:
            return False
        if self.device.type != "cuda":
            return True
        return t.device.index == (torch.cuda.current_device() if self.device.index is None else self.device.index)

    def lookup(self, model, payload, resident: bool = False) -> BoundBucket | str:
        """The validated bucket bound to its buffer, or, where the general path must apply
        it, why (see the module docstring). Raises ``UpdateError`` naming what is wrong
        with a bad bucket; nothing is written either way. ``resident``: the buffer is the
        engine's own (a broadcast's receive buffer, ``dist.ReceivePool``), not a trainer's
        mapping: its tables stay until ``forget``, whatever ``release`` finds. Whether the
        engine may use cached tables at all is the caller's question (``update/port.py``)."""
        if not self.enabled:
            return "the bucket cache is switched off (BucketCache.enabled)"
        if not isinstance(payload, dict):
            return "not a flattened bucket"
        flat, metadata = payload.get("flattened_tensor"), payload.get("metadata")
        if not (isinstance(flat, torch.Tensor) and isinstance(metadata, (list, tuple)) and metadata
                and flat.dim() == 1 and flat.is_contiguous()):
            return "not a contiguous 1-D buffer with metadata"
        if not self.on_engine_device(flat):
            return f"the buffer is on {flat.device}, not the engine's device"
        if set(map(type, metadata)) != {FlattenedTensorMetadata}:
            return "metadata entries of other types"  # the general path names what is wrong
        entries = tuple(map(_FIELDS, metadata))
        if not (set(map(type, chain.from_iterable(entries))) <= _FIELD_TYPES
                and set(map(type, chain.from_iterable(map(_SHAPE, entries)))) <= {int}):
            return "metadata fields of other types"  # a bool offset, ...: the general path names what is wrong
        key = (flat.dtype, flat.numel(), entries)
        layout = self.layouts.get(key)
        if layout is None:
            layout = self._validate(model, flat, metadata, key)
        else:
            self.layouts.move_to_end(key)
            self.stats["layout_hits"] += 1
        if not layout.eligible:
            return "SGLang's element layout with a conversion (a buffer of one dtype holding tensors of another)"
        identity = storage_identity(flat)
        tables = self.buffers.get(identity)
        bound = None if tables is None else tables.get(key)
        if bound is not None and bound.still_mapped():
            self.buffers.move_to_end(identity)
            self.stats["table_hits"] += 1
        else:
            bound = self._bind(model, flat, layout, identity)
            if bound is None:
                return "the copy table refuses this buffer"  # the general path runs, in its own words
        self.used.add(identity)
        self.uses[identity] += 1
        if resident:
            self.resident.add(identity)
        return bound

    def _validate(self, model, flat, metadata, key) -> Layout:
        """The general path's checks, in its order and with its errors, then the layout kept."""
        try:
            bucket.validate(flat, metadata)
        except bucket.BucketError as exc:
            raise UpdateError(f"bad flattened bucket: {exc}") from exc
        meta = {m.name: (tuple(m.shape), m.dtype) for m in metadata}
        nbytes = validate_tensors(model.config, meta, partial=True)
        byte_layout = flat.dtype == torch.uint8
        eligible = byte_layout or all(m.dtype == flat.dtype for m in metadata)
        scale = 1 if byte_layout else flat.dtype.itemsize  # offsets in bytes, or in the buffer's elements
        spans = [(m.name, m.dtype, m.start_idx * scale, m.numel * m.dtype.itemsize) for m in metadata]
        tensors = [[name, dtype_name(dtype), [int(s) for s in m.shape], [[0, start, n]] if n else []]
                   for (name, dtype, start, n), m in zip(spans, metadata)]
        layout = Layout(key, eligible, [m.name for m in metadata], tensors, spans, nbytes)
        if len(self.layouts) >= self.max_layouts:
            self.layouts.popitem(last=False)
        self.layouts[key] = layout
        self.stats["layouts_validated"] += 1
        return layout

    def _bind(self, model, flat, layout: Layout, identity) -> BoundBucket | None:
        """Build the copy table of ``layout`` over ``flat``'s bytes (None: the table refuses
        what the general path accepts, e.g. a buffer on another GPU: the general path)."""
        data = flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)
        registration = {"buffers": [data], "buckets": [[0, 0, data.numel()]], "tensors": layout.tensors}
        try:
            mode = copy_mode(self.device)
            table = copy_table.RegisteredTable.build(model, registration, self.device, partial=True)
            table.prepare(mode)
        except (copy_table.RegistrationError, UpdateError):
            return None
        bound = BoundBucket(layout, flat, table, mode)
        tables = self.buffers.get(identity)
        if tables is None:
            while len(self.buffers) >= self.max_buffers:  # the least recently used, a trainer's first
                self._drop(next((i for i in self.buffers if i not in self.resident), next(iter(self.buffers))))
            tables = self.buffers[identity] = {}
            self.uses[identity] = 0
        self.buffers.move_to_end(identity)
        if len(tables) >= self.max_layouts:
            tables.pop(next(iter(tables)))
        tables[layout.key] = bound
        self.stats["tables_built"] += 1
        return bound

    # ---- forgetting ---------------------------------------------------------------------------
    def _drop(self, identity) -> None:
        self.buffers.pop(identity, None)
        self.used.discard(identity)
        self.uses.pop(identity, None)
        self.resident.discard(identity)
        self.stats["buffers_dropped"] += 1

    def release(self) -> None:
        """At resume: unmap every buffer but those used in the step that ends which have
        carried more than one bucket (the trainer's reused buffers keep their tables) and
        the engine's own (resident) buffers."""
        for identity in [i for i in self.buffers
                         if i not in self.resident and (i not in self.used or self.uses[i] < 2)]:
            self._drop(identity)
        self.used.clear()

    def forget(self, storages) -> None:
        """Drop every table built on these storages (the engine frees or replaces them)."""
        gone = {s._cdata for s in storages}
        for identity in [i for i in self.buffers if i[0] in gone]:
            self._drop(identity)

    def clear(self) -> None:
        """Forget every layout and table (a destination moved: everything is checked afresh)."""
        for identity in list(self.buffers):
            self._drop(identity)
        self.layouts.clear()

    @property
    def num_buffers(self) -> int:
        return len(self.buffers)
