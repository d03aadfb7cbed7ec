"""Registered transfer buffers: the trainer shares its buffers and the whole layout once;
after that an update names bucket numbers and the engine copies bytes from a table.

The bucket path (``bucket.py``, ``transports/ipc.py``) sends, for every bucket of every
update, a pickle of an IPC handle and one metadata entry per tensor; the engine opens the
handle, unpickles, validates every entry, looks each name up and copies. None of that
changes between steps of an RL run: the trainer reuses the same buffers and sends the
same tensors in the same order. Here the trainer registers once:

- ``buffers``: its reusable 1-D ``uint8`` buffers (CUDA IPC handles or shared memory);
- ``buckets``: ``[buffer, offset, nbytes]`` each: bucket ``k``'s bytes are
  ``buffers[buffer][offset:offset + nbytes]`` (buckets may share a buffer in turn);
- ``tensors``: ``[name, dtype, shape, pieces]`` each, in the order their bytes are laid
  out; ``pieces`` is ``[[bucket, offset, nbytes], ...]``: a tensor may span buckets, so
  no bucket is ever larger than the buffers.

``transports/registered.py``'s ``stream_layout`` builds that layout (both sides can, from
names, dtypes and shapes).
``RegisteredTable.build`` validates it once, against the model, before anything is
mapped for use: bounds, every tensor's pieces covering its bytes exactly once, no two
pieces reading the same bytes, floating dtypes (the engine's own is copied byte for
byte; another is converted element by element, as ``copy_`` converts), destinations
(the copy plan's views: ``copy_plan.checkpoint_view``) covering every checkpoint tensor,
none overlapping another. Then, per bucket, it keeps an immutable
table of (source bytes, destination bytes) pairs: applying a bucket is those copies
only, as a ``copy_`` loop, one ``torch._foreach_copy_``, or a replayed CUDA graph of the
loop (buffers and destinations never move, so the graph captured once stays right), or
one Triton kernel over a table of chunks (``scatter_copy.py``).

Whose code copies: these copies do the work of chapter 04's commit step
(``CopyPlan.apply``) their own way, so they run only where that step is the instructor
edition's (the engine asks ``exercises.is_reference`` once, ``update/port.py``'s ``Parts``,
and names the copy mode). Where it is a learner's, the
learner's commit step copies every piece of the message (mode "commit_step"): it is handed a plan whose views
are the pieces' destinations (each a slice of a weight's bytes or elements) and the
pieces' source bytes, so a wrong commit step shows in the weights here as on every other
path. Where it is the student edition's unwritten stub, the table's own loop copies (the
part is switched off, as ``copy_plan.copy_in_place`` switches it off for the loaders).

Address safety: each destination parameter's identity (storage pointer, shape, stride,
dtype, and that it is still the module's attribute) is recorded at registration and
checked before the first copy of an update and after the last; a parameter rebound in
between (``param.data = ...``) makes the update refuse before writing anything, because
the table's views would then write memory no kernel reads. The table's views hold the
destination storages (like the address audit), so an old address is never reused.
"""
from __future__ import annotations

import torch

from course_lib import settings
from course_lib.capture import no_collection_while_capturing
from course_lib.dtypes import DtypeError, parse_dtype
from course_lib.weights.commit import scatter_copy
from course_lib.weights.commit.copy_plan import CopyPlan
from course_lib.weights.commit.destinations import Destination, DestinationCheck
from course_lib.weights.commit.validate import UpdateError, validate_tensors
from course_lib.weights.transports.registered import RegistrationError

COPY_MODES = ("loop", "foreach", "graph", "scatter")  # "commit_step" too, chosen by the engine (update/port.py)



def _nbytes(dtype: torch.dtype, shape) -> int:
    n = dtype.itemsize
    for s in shape:
        n *= int(s)
    return n


def _ints(value, what: str, count: int) -> list[int]:
    if not (isinstance(value, (list, tuple)) and len(value) == count and all(type(v) is int for v in value)):
        raise RegistrationError(f"{what} must be {count} integers, got {value!r}")
    return list(value)


def _dtype(name, what: str) -> torch.dtype:
    if not isinstance(name, str):
        raise RegistrationError(f"{what}: unknown dtype {name!r}")
    try:
        return parse_dtype(name)
    except DtypeError:
        raise RegistrationError(f"{what}: unknown dtype {name!r}") from None


class RegisteredTable:
    """A validated registration: per bucket, the (source, destination) byte views to copy."""

    def __init__(self, buffers, bucket_specs, copies, labels, destinations, nbytes, names):
        self.buffers = buffers                # held: the mapped handles stay open
        self.bucket_specs = bucket_specs      # [(buffer, offset, nbytes)]
        self.copies = copies                  # per bucket: ([sources], [destinations])
        self.labels = labels                  # per bucket: each copy's "name bytes [a, b)"
        self.destinations = destinations      # per bucket: [Destination]
        self.nbytes = nbytes                  # per bucket: payload bytes
        self.names = names                    # checkpoint names registered
        self.graphs: dict[int, object] = {}   # bucket -> captured CUDA graph (mode "graph")
        self.scatter_tables: list = []        # per bucket: scatter_copy's chunk table (mode "scatter")
        self._joined: dict[tuple, torch.Tensor] = {}  # bucket numbers -> their tables joined (one launch)
        self._checks: dict[tuple, DestinationCheck] = {}  # bucket numbers -> their destinations' check

    def prepare(self, mode: str) -> None:
        """Capture the CUDA graphs or build the scatter tables now, so the first update
        runs at full speed (capturing copies nothing)."""
        if mode == "graph":
            for k in range(self.num_buckets):
                self._capture(k)
        if mode == "scatter":
            self.scatter_tables = [scatter_copy.build_table(*self.copies[k]) for k in range(self.num_buckets)]

    @property
    def num_buckets(self) -> int:
        return len(self.bucket_specs)

    # ---- building: everything is checked before a table exists --------------------------
    @classmethod
    def build(cls, model, payload, device, partial: bool = False) -> "RegisteredTable":
        """Validate ``payload`` ({"buffers", "buckets", "tensors"}) against ``model`` (one
        rank, unquantized: ``CopyPlan.for_model`` must give a plan) and build the tables."""
        plan = CopyPlan.for_model(model)
        if plan is None:
            raise RegistrationError("registered updates copy bytes straight into the weights, so they need an "
                                    "unquantized engine on one rank (a quantized engine requantizes, a "
                                    "tensor-parallel rank slices): use update_weights_from_tensor")
        if not isinstance(payload, dict) or not {"buffers", "buckets", "tensors"} <= set(payload):
            raise RegistrationError("a registration is a dict with 'buffers', 'buckets' and 'tensors'")
        buffers = cls._check_buffers(payload["buffers"], torch.device(device))
        specs = cls._check_buckets(payload["buckets"], buffers)
        return cls._tables(model, plan, payload["tensors"], buffers, specs, partial)

    @staticmethod
    def _check_buffers(buffers, device: torch.device) -> list[torch.Tensor]:
        if not isinstance(buffers, (list, tuple)) or not buffers:
            raise RegistrationError("'buffers' must be a non-empty list of 1-D uint8 tensors")
        for i, b in enumerate(buffers):
            if not (isinstance(b, torch.Tensor) and b.dim() == 1 and b.dtype == torch.uint8 and b.is_contiguous()):
                raise RegistrationError(f"buffer {i} must be a contiguous 1-D uint8 tensor")
            same = b.device.type == device.type and (device.index is None or b.device.index == device.index)
            if not same:
                raise RegistrationError(f"buffer {i} is on {b.device}, the engine on {device}: registered "
                                        f"buffers must be on the engine's device")
        return list(buffers)

    @staticmethod
    def _check_buckets(buckets, buffers) -> list[tuple[int, int, int]]:
        if not isinstance(buckets, (list, tuple)) or not buckets:
            raise RegistrationError("'buckets' must be a non-empty list of [buffer, offset, nbytes]")
        specs = []
        for k, spec in enumerate(buckets):
            b, off, n = _ints(spec, f"bucket {k}", 3)
            if not 0 <= b < len(buffers):
                raise RegistrationError(f"bucket {k} names buffer {b}; there are {len(buffers)}")
            if off < 0 or n <= 0 or off + n > buffers[b].numel():
                raise RegistrationError(f"bucket {k}: bytes [{off}, {off + n}) are not inside buffer {b} "
                                        f"of {buffers[b].numel()} bytes")
            specs.append((b, off, n))
        return specs

    @classmethod
    def _tables(cls, model, plan, tensors, buffers, specs, partial):
        meta, entries = cls._entries(model, tensors, partial)
        copies = [([], []) for _ in specs]
        labels = [[] for _ in specs]
        dests = [dict() for _ in specs]
        nbytes = [0] * len(specs)
        sources, targets = [], []  # byte intervals, checked for overlap below
        for name, dtype, shape, pieces in entries:
            view = plan.views[name]
            dst = None
            if view is not None:
                if not view.is_contiguous():
                    raise RegistrationError(f"{name}: its destination is not contiguous")
                # Same dtype: bytes to bytes (a memcpy). Another float dtype: elements, converted.
                dst = view.reshape(-1).view(torch.uint8) if view.dtype == dtype else view.reshape(-1)
                end = view.data_ptr() + view.numel() * view.element_size()
                targets.append((view.data_ptr(), end, name))
            pos = 0
            if not isinstance(pieces, (list, tuple)):
                raise RegistrationError(f"{name}: pieces must be a list of [bucket, offset, nbytes]")
            for piece in pieces:
                k, off, n = _ints(piece, f"{name}: piece", 3)
                if not 0 <= k < len(specs):
                    raise RegistrationError(f"{name}: piece in bucket {k}; there are {len(specs)} buckets")
                b, base, size = specs[k]
                if off < 0 or n <= 0 or off + n > size:
                    raise RegistrationError(f"{name}: piece [{off}, {off + n}) is outside bucket {k} of {size} bytes")
                if pos + n > _nbytes(dtype, shape):
                    raise RegistrationError(f"{name}: pieces hold more than its {_nbytes(dtype, shape)} bytes")
                start = base + off
                sources.append(((k, start), (k, start + n), name))
                nbytes[k] += n
                if dst is not None:
                    labels[k].append(f"{name} bytes [{pos}, {pos + n})")
                    src = buffers[b][start:start + n]
                    if dst.dtype == torch.uint8:
                        copies[k][0].append(src)
                        copies[k][1].append(dst[pos:pos + n])
                    else:  # pieces start and end on element boundaries (16-byte aligned stream)
                        if (start % dtype.itemsize) or (n % dtype.itemsize):
                            raise RegistrationError(f"{name}: a piece is not aligned to its {dtype} elements")
                        copies[k][0].append(src.view(dtype))
                        copies[k][1].append(dst[pos // dtype.itemsize:(pos + n) // dtype.itemsize])
                    param = model.map_checkpoint_name(name)[0]
                    owner, _, attr = param.rpartition(".")
                    dests[k][param] = Destination(model.get_submodule(owner), attr, param)
                pos += n
            if pos != _nbytes(dtype, shape):
                raise RegistrationError(f"{name}: pieces hold {pos} of its {_nbytes(dtype, shape)} bytes")
        # Buckets that share a buffer in turn overlap by design; within a bucket, no two
        # pieces may read the same bytes (positions are (bucket, offset): one sort for all).
        cls._no_overlap(sources, "read the same bytes")
        cls._no_overlap(targets, "write the same memory")
        return cls(buffers, specs, copies, labels, [list(d.values()) for d in dests], nbytes, list(meta))

    @staticmethod
    def _entries(model, tensors, partial: bool) -> tuple[dict, list]:
        """The registered tensors checked ({name: (shape, dtype)} against the model, as an
        update's tensors are) and their entries (name, dtype, shape, pieces)."""
        if not isinstance(tensors, (list, tuple)) or not tensors:
            raise RegistrationError("'tensors' must be a non-empty list of [name, dtype, shape, pieces]")
        meta, entries = {}, []
        for i, entry in enumerate(tensors):
            if not (isinstance(entry, (list, tuple)) and len(entry) == 4 and isinstance(entry[0], str)):
                raise RegistrationError(f"tensor entry {i} must be [name, dtype, shape, pieces]")
            name, dtype, shape, pieces = entry
            if name in meta:
                raise RegistrationError(f"{name}: registered more than once")
            if not (isinstance(shape, (list, tuple)) and all(type(s) is int and s >= 0 for s in shape)):
                raise RegistrationError(f"{name}: shape {shape!r} is not a list of non-negative integers")
            meta[name] = (tuple(shape), _dtype(dtype, name))
            entries.append((name, meta[name][1], tuple(shape), pieces))
        try:
            validate_tensors(model.config, meta, partial)
        except UpdateError as exc:
            raise RegistrationError(str(exc)) from exc
        return meta, entries

    @staticmethod
    def _no_overlap(intervals, what: str) -> None:
        last_end, last_name = None, None
        for start, end, name in sorted(intervals):
            if last_end is not None and start < last_end:
                raise RegistrationError(f"{last_name} and {name} {what}")
            if last_end is None or end > last_end:
                last_end, last_name = end, name

    # ---- applying ---------------------------------------------------------------------
    def check_buckets(self, buckets) -> list[int]:
        if not (isinstance(buckets, (list, tuple)) and buckets and all(type(k) is int for k in buckets)):
            raise RegistrationError(f"buckets must be a non-empty list of bucket numbers, got {buckets!r}")
        bad = [k for k in buckets if not 0 <= k < self.num_buckets]
        if bad:
            raise RegistrationError(f"bucket {bad[0]} does not exist: {self.num_buckets} buckets were registered")
        if len(set(buckets)) != len(buckets):
            raise RegistrationError("a bucket is named more than once")
        return list(buckets)

    def check_destinations(self, buckets) -> None:
        """Refuse (before any copy, or after the last) if a destination parameter of these
        buckets is no longer where registration found it (each parameter checked once)."""
        key = tuple(buckets)
        check = self._checks.get(key)
        if check is None:
            unique = {}
            for k in buckets:
                for d in self.destinations[k]:
                    unique.setdefault(d.label, (k, d))
            if len(self._checks) >= 8:  # a few bucket sets at most (a sender uses one or two)
                self._checks.pop(next(iter(self._checks)))
            check = self._checks[key] = DestinationCheck(list(unique.values()))
        moved = check.first_moved()
        if moved is not None:
            k, d = moved
            raise RegistrationError(f"{d.label} (bucket {k}) no longer lives where it was registered: "
                                    f"the weights were rebound; register the buffers again")

    def copy(self, buckets, mode: str) -> None:
        """Copy these buckets' bytes into the weights (asynchronously on a GPU), as ``mode``
        says: "loop", "foreach", "graph" or "scatter" (``copy_mode``), or "commit_step":
        chapter 04's commit step as it is now copies every piece (where it is a learner's;
        the engine decides which, once: ``update/port.py``'s ``Parts``)."""
        if mode == "commit_step":
            self.commit_step(buckets)
            return
        if mode == "scatter":
            buckets = self._scatter(buckets)  # left: buckets with unaligned or converted pieces
        for k in buckets:
            srcs, dsts = self.copies[k]
            if mode == "graph":
                graph = self.graphs.get(k) or self._capture(k)
                graph.replay()
            elif mode == "foreach":
                if dsts:
                    torch._foreach_copy_(dsts, srcs)
            else:  # a loop (also a scatter bucket with unaligned or converted pieces)
                for dst, src in zip(dsts, srcs):
                    dst.copy_(src)

    def commit_step(self, buckets) -> None:
        """Chapter 04's commit step, as it is now, copies these buckets' pieces: its plan's
        views are the pieces' destinations, its tensors the pieces' source bytes."""
        views, pairs = {}, []
        for k in buckets:
            srcs, dsts = self.copies[k]
            views.update(zip(self.labels[k], dsts))
            pairs.extend(zip(self.labels[k], srcs))
        CopyPlan.from_views(views).apply(pairs)

    def _scatter(self, buckets) -> list[int]:
        """One scatter launch for all these buckets' tables (joined once per bucket set and
        kept: a resident trainer names every bucket in each message); returns the buckets
        that have no table."""
        key = tuple(buckets)
        joined = self._joined.get(key)
        if joined is None:
            tables = [self.scatter_tables[k] for k in buckets if self.scatter_tables[k] is not None]
            joined = torch.cat(tables) if tables else torch.empty(0, 3, dtype=torch.int64)
            if len(self._joined) >= 8:  # a few bucket sets at most (a sender uses one or two)
                self._joined.pop(next(iter(self._joined)))
            self._joined[key] = joined
        if joined.shape[0]:
            scatter_copy.scatter(joined)
        return [k for k in buckets if self.scatter_tables[k] is None]

    def _capture(self, k: int):
        """Capture bucket ``k``'s copies as a CUDA graph (nothing is copied while capturing)."""
        srcs, dsts = self.copies[k]
        stream = torch.cuda.Stream(device=self.buffers[0].device)
        stream.wait_stream(torch.cuda.current_stream(self.buffers[0].device))
        graph = torch.cuda.CUDAGraph()
        with no_collection_while_capturing(), \
                torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            for dst, src in zip(dsts, srcs):
                dst.copy_(src)
        self.graphs[k] = graph
        return graph


def copy_mode(device, asked: str | None = None) -> str:
    """How a registered bucket is copied: ``asked``, else ``COURSE_LIB_REGISTERED_COPY``
    (loop, foreach, graph, scatter), else, on a GPU, the scatter kernel where Triton is
    installed and a CUDA graph where not, and a ``copy_`` loop on the CPU (a graph asked
    for on the CPU is a loop: there is nothing to capture). Measured on an H200, engine
    side, every bucket in one call (results/h200-2026-12-01d/): scatter 91%, loop 83%,
    graph 77%, foreach 44% of a device copy at ~8B; 82%, 60%, 65%, 43% at ~1.7B."""
    mode = asked or settings.registered_copy()
    if mode is None:
        if torch.device(device).type != "cuda":
            return "loop"
        return "scatter" if scatter_copy.available() else "graph"
    if mode not in COPY_MODES:
        raise RegistrationError(f"COURSE_LIB_REGISTERED_COPY={mode!r}; choose one of {COPY_MODES}")
    if mode == "graph" and torch.device(device).type != "cuda":
        return "loop"
    if mode == "scatter" and not (torch.device(device).type == "cuda" and scatter_copy.available()):
        raise RegistrationError("copy mode 'scatter' needs a GPU and Triton")
    return mode
