"""Layer-by-layer reload: apply an update one decoder layer at a time.

Reading a whole checkpoint before writing it would need a second copy of the model in
memory. Instead, incoming tensors are held per decoder layer (``model.layers.7.*``; the
embedding, final norm and LM head are layers of their own) until every tensor the update
brings for that layer has arrived; then the layer is checked (finite values), run through
the model's own loaders (fusion, sharding, in-place copy) and the requantization pass
(into the existing kernel tensors), and let go. Extra memory is about one layer plus
whatever arrived early for the next, and it is measured: ``peak_held_bytes`` counts the
held tensors and staging weights at any moment; on GPU the allocator's peak above the
starting point is reported too. How the tensors are held and when a layer counts as
complete is ``feed``'s business (chapter 03); the rest of this class is the frame it
works in.

The price of streaming: a fault discovered after some layers were applied (a file that
changed since it was validated, a layer with NaNs) must be undone. The disk update uses
``GuardedLayerwiseReload`` (rollback.py), which saves each layer to host memory before
writing it and restores the written layers on a fault (see ``update/writers.py``).
"""
from __future__ import annotations

import re
import time

import torch

from course_lib.layers.quant import process_weights_after_loading, staged_bytes
from course_lib.config import is_cuda
from course_lib.exercises import is_written
from course_lib.weights.commit.validate import UpdateError, check_finite
from course_lib.weights.commit.copy_plan import copy_in_place

_LAYER = re.compile(r"^(model\.layers\.\d+)\.")


def layer_key(name: str) -> str:
    """The layer a checkpoint tensor belongs to: ``model.layers.N`` or the tensor itself."""
    m = _LAYER.match(name)
    return m.group(1) if m else name


class LayerwiseReload:
    """Holds (name, tensor) pairs per layer and writes each layer once it is complete.

    What other code reads: ``layers`` (the plan: {layer key: the names this update brings
    for it}, fixed at creation), ``buffers`` ({layer key: [(name, tensor), ...]}, the
    tensors held for layers not yet written), ``applied`` (the layers written, in order),
    ``held_bytes`` and ``peak_held_bytes`` (``_hold``), ``ms`` (phase times).

    The frame ``feed`` works in: ``layer_key(name)`` (a name's layer), ``_transfer(t)``
    (the transfer step: ``t`` on the engine's device, timed), ``_hold(n)`` (the counter:
    ``n`` more or fewer bytes held, the peak kept with the staging weights),
    ``_apply(key, pairs)`` (the writing step: loaders, requantization pass, timing,
    ``applied``), and this module's ``check_finite(pairs)`` with the ``check_finite``
    option given to the constructor."""

    def __init__(self, model, expected_names, device, check_finite: bool = True, commit=None):
        self.model, self.device, self.check_finite = model, torch.device(device), check_finite
        # The commit step each complete layer goes through: the engine's (read once, when
        # it was built), or, when none is given, this module's ``copy_in_place`` at each layer.
        self.commit = commit
        layers: dict[str, set[str]] = {}
        for name in expected_names:
            layers.setdefault(layer_key(name), set()).add(name)
        self.layers: dict[str, frozenset[str]] = {key: frozenset(names) for key, names in layers.items()}
        self.buffers: dict[str, list[tuple[str, torch.Tensor]]] = {}
        self.applied: list[str] = []
        self.held_bytes = self.peak_held_bytes = 0
        self.ms = {"transfer": 0.0, "copy": 0.0, "post_process": 0.0}
        self._gpu = is_cuda(self.device)
        self._laps: list = []  # (phase, start event, end event) on a GPU, resolved by finish()
        # Only quantized layers stage and post-process; for a model without them, skip the
        # per-tensor and per-layer walks over every module (they cost seconds at 8B).
        self._quantized = any(hasattr(m, "staging") for m in model.modules())
        if self._gpu:
            torch.cuda.synchronize()
            self._gpu_start = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()

    def _hold(self, nbytes: int) -> None:
        """Count ``nbytes`` more (or, negative, fewer) bytes of held tensors; update the peak
        (held bytes plus the staging weights of quantized layers that exist right now)."""
        self.held_bytes += nbytes
        staged = staged_bytes(self.model) if self._quantized else 0
        self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes + staged)

    def _transfer(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` on the engine's device (the same tensor when it is there already), timed."""
        t0 = time.perf_counter()
        tensor = tensor.to(self.device, non_blocking=True)
        self.ms["transfer"] += 1e3 * (time.perf_counter() - t0)
        return tensor

    def feed(self, name: str, tensor: torch.Tensor) -> None:
        """Take one checkpoint tensor of the update; write its layer once the layer is complete.

        ``name`` is a checkpoint name (``model.layers.3.mlp.up_proj.weight``) and ``tensor``
        its new value, on any device. The update brings each name of ``self.layers`` once,
        in any order (layers may interleave). The caller may reuse ``tensor``'s memory as
        soon as this returns (a reader refills its buffers). Keep any bookkeeping of your
        own on ``self``.

        Promises:
        - a layer is written exactly when its last tensor arrives, never before and only
          once, whole: through the frame's writing step, with every (name, tensor) of that
          layer on the engine's device (moved there by the frame's transfer step: the very
          tensor when it is there already, never a second copy);
        - a name this update does not bring, or one already fed, raises ``UpdateError`` and
          changes nothing: nothing moved, held, counted or written;
        - when the update asked for the finiteness check (the constructor's option), a layer
          holding a NaN or infinite value is refused with ``UpdateError`` naming the tensor,
          before any of its weights change: when that tensor arrives, or at the latest when
          its layer is complete. After such a refusal the update is over (the caller puts
          back what was written). Without the check, values are written as they come;
        - what is held: only tensors of layers not yet written, on the engine's device, as
          ``self.buffers`` (no entry for a layer with nothing held); once a layer is
          written the reload keeps no reference to any of its tensors;
        - what is counted: through the frame's counter, ``self.held_bytes`` is, whenever
          this returns and while a layer is being written, the bytes of the tensors held,
          so ``self.peak_held_bytes`` is the most held at once (plus staging). Fed one layer
          after another, that is at most one layer.
        """
        # BEGIN EXERCISE ch03.layerwise_buffer
        key = layer_key(name)
        held = self.buffers.get(key, [])
        if name not in self.layers.get(key, ()) or key in self.applied or name in (n for n, _ in held):
            raise UpdateError(f"{name}: not expected by this update (or sent twice)")
        tensor = self._transfer(tensor)
        held.append((name, tensor))
        self.buffers[key] = held
        self._hold(tensor.numel() * tensor.element_size())
        if len(self.buffers[key]) == len(self.layers[key]):
            pairs = self.buffers.pop(key)
            if self.check_finite:
                check_finite(pairs)  # one wait for the whole layer
            self._apply(key, pairs)
            self._hold(-sum(t.numel() * t.element_size() for _, t in pairs))
        # END EXERCISE

    def _apply(self, key: str, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Write one complete layer: the model's loaders (fusion, slicing, in-place copy)
        and the requantization pass, timed; the layer is then in ``applied``. Values are
        not checked here (``feed`` does). On a GPU nothing here waits for the copies: the
        next layer's reads overlap this layer's writes, and the allocator reuses this
        layer's buffers only after the work queued on them."""
        t0 = self._mark()
        (self.commit or copy_in_place)(self.model, tensors, self.device)
        self._hold(0)  # staging weights of quantized layers exist now
        t1 = self._mark()
        if self._quantized:
            process_weights_after_loading(self.model)
        t2 = self._mark()
        self._lap("copy", t0, t1)
        self._lap("post_process", t1, t2)
        self.applied.append(key)

    def _mark(self):
        """A point in time: an event on the device's stream on a GPU (no waiting), else the clock."""
        if not self._gpu:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _lap(self, phase: str, start, end) -> None:
        """Charge ``start`` to ``end`` to ``phase`` (on a GPU when ``finish`` has the events' times)."""
        if self._gpu:
            self._laps.append((phase, start, end))
        else:
            self.ms[phase] += 1e3 * (end - start)

    def _settle_laps(self) -> None:
        if self._laps:
            self._laps[-1][2].synchronize()  # the last layer's work is done, so every earlier event
            for phase, start, end in self._laps:
                self.ms[phase] += start.elapsed_time(end)
            self._laps.clear()

    @staticmethod
    def is_written() -> bool:
        """False while ``feed`` is still chapter 03's stub (the student edition before that
        chapter): disk updates then stage the whole checkpoint instead (the plain path that
        needs no buffer), so chapters 00 to 02 can update weights."""
        return is_written(LayerwiseReload.feed, "ch03.layerwise_buffer")

    def finish(self) -> dict:
        """Check every layer was written; return the memory and time report."""
        written = set(self.applied)
        waiting = {k: sorted(names - {n for n, _ in self.buffers.get(k, ())})
                   for k, names in self.layers.items() if k not in written}
        if waiting:
            raise UpdateError(f"update ended with layers incomplete: {list(waiting.items())[:2]}")
        stats = {"layers": len(self.applied), "peak_held_bytes": self.peak_held_bytes}
        self._settle_laps()
        if self._gpu:
            stats["gpu_peak_extra_bytes"] = max(0, torch.cuda.max_memory_allocated() - self._gpu_start)
        return stats
