"""A rollback point for a streamed update: host copies of just the layers already written.

``LayerwiseReload`` (layerwise.py) writes a checkpoint one decoder layer at a time, so a
fault found midway (NaN in a later layer, a file rewritten or truncated while being read,
a tensor sent twice) would leave a mix of two versions. ``GuardedLayerwiseReload`` copies
each layer's live tensors to host memory just before that layer is written; on a fault,
``RollbackPoint.restore`` copies them back in place (no tensor moves: the address audit
and captured CUDA graphs stay valid) and the engine keeps serving the old weights.

Why this design: the extra memory is host memory for the layers written so far (at most
one model's worth, in host RAM, reached only at the last layer), while the GPU keeps the
one-layer peak of the streamed path. Checking every value before the first write instead
would need the whole new checkpoint in memory (``staging="full"``) or a second full read,
and would still not cover a file that changes between the check and the write.
"""
from __future__ import annotations

import torch

from course_lib.layers.quant import kernel_tensors
from course_lib.weights.layerwise import LayerwiseReload, layer_key


class RollbackPoint:
    """Host copies of live kernel tensors, saved layer by layer, restorable in place."""

    def __init__(self, model):
        self.model = model
        self.live = kernel_tensors(model)
        self.pin = any(t.is_cuda for t in self.live.values())
        self.saved: dict[str, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.saved.values())

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

    def save(self, key: str, names) -> None:
        for name in self.tensors_of(key, names):
            if name in self.saved:
                continue
            t = self.live[name]
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pin)
            host.copy_(t, non_blocking=self.pin)
            self.saved[name] = host
        if self.pin:
            torch.cuda.synchronize()

    def restore(self) -> None:
        """Copy every saved tensor back into its live tensor, in place."""
        for name, host in self.saved.items():
            self.live[name].copy_(host, non_blocking=self.pin)
        if self.pin:
            torch.cuda.synchronize()

    def release(self) -> None:
        self.saved.clear()


class GuardedLayerwiseReload(LayerwiseReload):
    """``LayerwiseReload`` that saves each layer to a rollback point before writing it
    (``rollback=None``: save nothing, e.g. when a full snapshot was taken already)."""

    def __init__(self, model, expected_names, device, rollback: RollbackPoint | None):
        super().__init__(model, expected_names, device)
        self.rollback = rollback
        self.peak_rollback_bytes = 0

    def _apply(self, key: str, tensors: list) -> None:
        if self.rollback is not None:
            self.rollback.save(key, [name for name, _ in tensors])
            self.peak_rollback_bytes = self.rollback.nbytes
        super()._apply(key, tensors)


__all__ = ["GuardedLayerwiseReload", "RollbackPoint", "layer_key"]
