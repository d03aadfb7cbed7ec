"""A rollback point for a streamed update: host copies of just the layers already written.

``LayerwiseReload`` (layerwise.py) writes a checkpoint one decoder layer at a time, so a
fault found midway (NaN in a later layer, a file rewritten or truncated while being read,
a tensor sent twice) would leave a mix of two versions. ``GuardedLayerwiseReload`` copies
each layer's live tensors to host memory just before that layer is written; on a fault,
``RollbackPoint.restore`` copies them back in place (no tensor moves: the address audit
and captured CUDA graphs stay valid) and the engine keeps serving the old weights.

Why this design: the extra memory is host memory (at most one model's worth), while the
GPU keeps the one-layer peak of the streamed path. On a GPU the saving must not hold the
update up: every layer's save is queued at the start, in reading order, on a side stream
(device-to-host copies overlap the reads, which go the other way), and each layer's
write waits for its own save's event only; the host memory is pinned, allocated once per
model in slabs and reused by every later update. On a CPU each layer is copied just
before it is written. Checking every value before the first write instead
would need the whole new checkpoint in memory (``staging="full"``) or a second full read,
and would still not cover a file that changes between the check and the write.
"""
from __future__ import annotations

import torch

from course_lib.layers.quant import kernel_tensors
from course_lib.weights.commit.layerwise import LayerwiseReload, layer_key

# Host copies live in slabs of this size (a power of two: the pinned allocator rounds
# every allocation up to one, so a model-sized allocation could cost twice the memory).
SLAB_BYTES = 256 << 20
_STREAMS: dict[str, "torch.cuda.Stream"] = {}


class HostStore:
    """Host memory for a byte copy of each of ``live``'s tensors: slabs of ``SLAB_BYTES``
    filled in order (a tensor may continue in the next slab), each allocated when first
    used. ``pieces[name]`` lists ``(host bytes, live bytes)`` view pairs."""

    def __init__(self, live: dict[str, torch.Tensor], pin: bool):
        self.pin = pin
        self.signature = _signature(live)
        self.slabs: list[torch.Tensor | None] = []
        self.layout: dict[str, list[tuple[int, int, int, int]]] = {}  # (slab, at, offset in tensor, bytes)
        pos = 0
        for name, t in live.items():
            n, at, pieces = t.numel() * t.element_size(), 0, []
            while at < n:
                slab, off = divmod(pos, SLAB_BYTES)
                m = min(n - at, SLAB_BYTES - off)
                pieces.append((slab, off, at, m))
                at, pos = at + m, pos + m
            self.layout[name] = pieces
        self.total = pos
        self.slabs = [None] * -(-pos // SLAB_BYTES)

    def pieces(self, name: str, t: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        flat = t.detach().reshape(-1).view(torch.uint8)  # contiguous: a view of the live memory
        out = []
        for slab, off, at, m in self.layout[name]:
            if self.slabs[slab] is None:
                size = min(SLAB_BYTES, self.total - slab * SLAB_BYTES)
                self.slabs[slab] = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
            out.append((self.slabs[slab][off:off + m], flat[at:at + m]))
        return out


def _signature(live: dict[str, torch.Tensor]) -> tuple:
    return tuple((n, t.numel() * t.element_size()) for n, t in live.items())


def _store_for(model, live: dict[str, torch.Tensor], pin: bool) -> HostStore:
    """Pinned slabs are costly to allocate (about a second per few GB): kept with the
    model and reused while its kernel tensors stay the same. Plain host memory is not kept."""
    if not pin:
        return HostStore(live, pin)
    store = model.__dict__.get("_rollback_store")
    if store is None or store.signature != _signature(live):
        store = model.__dict__["_rollback_store"] = HostStore(live, pin)
    return store


class RollbackPoint:
    """Host copies of live kernel tensors, saved layer by layer, restorable in place."""

    def __init__(self, model):
        self.model = model
        self.live = kernel_tensors(model)
        devices = [t.device for t in self.live.values() if t.is_cuda]
        self.device = devices[0] if devices else None
        self.pin = self.device is not None
        contiguous = {n: t for n, t in self.live.items() if t.is_contiguous()}
        self.store = _store_for(model, contiguous, self.pin)
        self.saved: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # name -> (host, live) pairs
        self.events: dict[str, torch.cuda.Event] = {}  # layer key -> its save has ended (GPU)
        self.written: list[str] = []  # the saved tensors a write may have changed since

    @property
    def nbytes(self) -> int:
        return sum(host.numel() * host.element_size() for pieces in self.saved.values() for host, _ in pieces)

    def tensors_of(self, key: str, names) -> list[str]:
        """The live kernel tensors that writing layer ``key`` (checkpoint ``names``) changes:
        everything under the decoder layer's module, or under the modules the names map to."""
        prefixes = set()
        if key.startswith("model.layers."):
            prefixes.add(key + ".")
        for name in names:
            target = self.model.map_checkpoint_name(name)
            if target is not None:
                prefixes.add(target[0].rsplit(".", 1)[0] + ".")
        return [n for n in self.live if n.startswith(tuple(prefixes))]

    def _copy_out(self, key: str, names) -> None:
        for name in self.tensors_of(key, names):
            if name in self.saved:
                continue
            t = self.live[name]
            if name in self.store.layout:
                pieces = self.store.pieces(name, t)
            else:  # not contiguous (no flat byte view): a host tensor of its own
                pieces = [(torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin), t)]
            for host, live in pieces:
                host.copy_(live, non_blocking=self.pin)
            self.saved[name] = pieces

    def save_ahead(self, layers) -> None:
        """On a GPU: queue the saves of every layer (``(key, names)`` pairs, in the order
        they will be written) on a side stream now; ``save`` then only waits for one."""
        if not self.pin:
            return
        if str(self.device) not in _STREAMS:
            _STREAMS[str(self.device)] = torch.cuda.Stream(self.device)
        stream = _STREAMS[str(self.device)]
        stream.wait_stream(torch.cuda.current_stream(self.device))  # after every write queued so far
        with torch.cuda.stream(stream):
            for key, names in layers:
                self._copy_out(key, names)
                self.events[key] = stream.record_event()

    def save(self, key: str, names) -> None:
        """Make sure layer ``key``'s old values are saved before it is written: on a GPU
        the write (queued next on the current stream) waits for the save's event, the
        host does not wait; on a CPU the copy is made now."""
        if key in self.events:
            torch.cuda.current_stream(self.device).wait_event(self.events[key])
        else:
            self._copy_out(key, names)
            if self.pin:
                torch.cuda.current_stream(self.device).synchronize()
        self.written.extend(self.tensors_of(key, names))

    def restore(self) -> None:
        """Copy every saved tensor a write may have changed back into its live tensor, in place."""
        if self.pin:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(_STREAMS.get(str(self.device), current))  # every save has ended
        for name in dict.fromkeys(self.written):
            for host, live in self.saved[name]:
                live.copy_(host, non_blocking=self.pin)
        if self.pin:
            torch.cuda.synchronize(self.device)

    def release(self) -> None:
        self.saved.clear()
        self.events.clear()
        self.written.clear()


class GuardedLayerwiseReload(LayerwiseReload):
    """``LayerwiseReload`` that saves each layer to a rollback point before writing it
    (``rollback=None``: save nothing, e.g. when a full snapshot was taken already). On a
    GPU every layer's save is queued at once, in the order the layers are expected."""

    def __init__(self, model, expected_names, device, rollback: RollbackPoint | None, commit=None):
        super().__init__(model, expected_names, device, commit=commit)
        self.rollback = rollback
        self.peak_rollback_bytes = 0
        if rollback is not None:
            rollback.save_ahead([(key, sorted(names)) for key, names in self.layers.items()])

    def _apply(self, key: str, tensors: list) -> None:
        if self.rollback is not None:
            self.rollback.save(key, [name for name, _ in tensors])
            self.peak_rollback_bytes = self.rollback.nbytes
        super()._apply(key, tensors)


__all__ = ["GuardedLayerwiseReload", "HostStore", "RollbackPoint", "layer_key"]
