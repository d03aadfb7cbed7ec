"""The address audit: every tensor a kernel reads must keep its storage across updates.

A captured CUDA graph replays kernels with the pointers it saw at capture time. If an
update rebinds a parameter (``param.data = new``) instead of copying into it, the graph
keeps reading the old memory: wrong outputs, no error. The audit records each tensor's
storage address, shape, dtype and device when the engine starts (after graph capture)
and checks them after every update; a difference is an error that names the tensor.

The audit also holds a reference to each recorded storage. Without it, comparing integer
addresses has an ABA hole: an updater that rebinds a parameter several times (once per
fused shard, say) frees the original memory, and the allocator may hand that very address
to the last copy, so the final pointer "matches" although the graph's memory was freed
and reused. Holding the storage keeps the original address occupied, so a rebind always
shows as a new address. It costs no memory while updates copy in place (same storage).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from course_lib.layers.quant import kernel_tensors as quant_kernel_tensors


class AddressMovedError(RuntimeError):
    """A tensor that kernels read changed storage, shape, dtype or device."""


@dataclass(frozen=True)
class TensorAddress:
    data_ptr: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str
    # Keeps the recorded memory allocated so its address cannot be reused (see above).
    storage: object = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, t: torch.Tensor, hold: bool = False) -> "TensorAddress":
        storage = t.untyped_storage() if hold else None
        return cls(t.data_ptr(), tuple(t.shape), t.dtype, str(t.device), storage)


def kernel_tensors(model: nn.Module, extra: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """What kernels read (parameters with storage and buffers such as scales; tied ones
    once; checkpoint-format shells on the meta device left out) plus ``extra`` (the KV pool)."""
    return {**quant_kernel_tensors(model), **(extra or {})}


class AddressAudit:
    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.recorded = {name: TensorAddress.of(t, hold=True) for name, t in tensors.items()}

    @classmethod
    def record(cls, model: nn.Module, extra: dict[str, torch.Tensor] | None = None) -> "AddressAudit":
        return cls(kernel_tensors(model, extra))

    def violations(self, model: nn.Module, extra: dict[str, torch.Tensor] | None = None,
                   only: set[str] | None = None) -> list[str]:
        """One line per tensor whose address (or shape, dtype, device) differs, or that
        vanished. ``only``: check just these names (what one chunk of an update wrote)."""
        if only is None:
            now = kernel_tensors(model, extra)
        else:  # a direct lookup per name: much cheaper than walking every module
            params = model._params() if hasattr(model, "_params") else dict(model.named_parameters())
            now = {name: params[name] for name in only if name in params}
        lines = []
        for name, before in self.recorded.items():
            if only is not None and name not in only:
                continue
            if name not in now:
                lines.append(f"{name}: no longer present")
                continue
            after = TensorAddress.of(now[name])
            for field in ("data_ptr", "shape", "dtype", "device"):
                if getattr(before, field) != getattr(after, field):
                    was, became = getattr(before, field), getattr(after, field)
                    if field == "data_ptr":
                        was, became = hex(was), hex(became)
                    lines.append(f"{name}: {field} changed from {was} to {became}")
        return lines

    def verify(self, model: nn.Module, extra: dict[str, torch.Tensor] | None = None,
               only: set[str] | None = None) -> None:
        lines = self.violations(model, extra, only)
        if lines:
            raise AddressMovedError(
                f"{len(lines)} tensors read by kernels moved (a captured CUDA graph would read stale "
                f"memory; updates must copy in place): " + "; ".join(lines[:5]))
