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

import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from course_lib.exercises import is_written
from course_lib.layers.quant import kernel_tensors as quant_kernel_tensors


class AddressMovedError(RuntimeError):
    """A tensor that kernels read changed storage, shape, dtype or device."""


@dataclass(frozen=True)
class TensorAddress:
    """Where a tensor lives and what it looks like; ``storage`` (when set) keeps that
    memory allocated while the record exists (see the module docstring)."""
    data_ptr: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str
    storage: object = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorAddress":
        """``t``'s address as it is now (holding nothing)."""
        return cls(t.data_ptr(), tuple(t.shape), t.dtype, str(t.device))


def kernel_tensors(model: nn.Module, extra: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """What kernels read (parameters with storage and buffers such as scales; tied ones
    once; checkpoint-format shells on the meta device left out) plus ``extra`` (the KV pool)."""
    return {**quant_kernel_tensors(model), **(extra or {})}


class AddressAudit:
    """Addresses recorded once (after graph capture), checked after every update."""

    unwritten: str | None = None  # which part is unwritten, while chapter 04's audit is (student edition)

    def __init__(self, tensors: dict[str, torch.Tensor]):
        """Record where every tensor of ``tensors`` lives ({name: tensor}: what kernels read,
        e.g. ``kernel_tensors(model, extra)``).

        Promises: ``self.recorded`` is {name: TensorAddress} for every entry, in the same
        order, each with the tensor's address in memory, its shape as a tuple, its dtype and
        its device written as a string, exactly as ``TensorAddress.of`` would read them now;
        and each record holds the tensor's storage itself, so the recorded memory stays
        allocated for as long as the audit lives and can never be handed out again at the
        same address (the ABA hole in the module docstring). Holding it costs no memory while
        updates copy in place.

        Errors, before anything is recorded: ``tensors`` not a dict: TypeError; a value
        that is not a torch.Tensor: TypeError naming its key and its type.
        """
        # BEGIN EXERCISE ch04.record_addresses
        if not isinstance(tensors, dict):
            raise TypeError(f"expected a dict of name -> tensor, got {type(tensors).__name__}")
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        # Holding each storage costs no memory while updates copy in place (same storage).
        self.recorded = {name: TensorAddress(t.data_ptr(), tuple(t.shape), t.dtype, str(t.device),
                                             t.untyped_storage())
                         for name, t in tensors.items()}
        # END EXERCISE

    @classmethod
    def record(cls, model: nn.Module, extra: dict[str, torch.Tensor] | None = None) -> "AddressAudit":
        """The audit of ``model``'s kernel tensors plus ``extra`` (the KV pool, graph outputs).
        Whether chapter 04's parts are written is asked here, once, when the engine is built."""
        if is_written(cls.__init__, "ch04.record_addresses"):
            audit = cls(kernel_tensors(model, extra))
            if not is_written(cls.violations, "ch04.address_audit"):
                audit.unwritten = "ch04.address_audit"
            return audit
        audit = cls.__new__(cls)  # before chapter 04: an audit that records nothing, and says so
        audit.recorded, audit.unwritten = {}, "ch04.record_addresses"
        return audit

    def violations(self, model: nn.Module, extra: dict[str, torch.Tensor] | None = None,
                   only: set[str] | None = None) -> list[str]:
        """One line per recorded tensor that moved, in the order of ``self.recorded``.

        Compares each recorded TensorAddress with the tensor of the same name now:
        ``kernel_tensors(model, extra)`` (``extra``: the engine's other tensors kernels
        read, such as the KV pool and graph output buffers, audited like the weights).
        ``only``: check just these recorded names, and only among the model's parameters
        (``model._params()`` where the model has it, else ``dict(model.named_parameters())``;
        what one chunk of an update wrote: cheaper than walking every module).

        A line starts with the tensor's name: ``"{name}: no longer present"`` when a
        recorded tensor is gone (an ``only`` name that is no parameter is skipped), else
        one line per field that differs, ``"{name}: {field} changed from {was} to
        {became}"`` for field in data_ptr (written in hex), shape, dtype, device.
        An empty list means nothing moved.
        """
        # BEGIN EXERCISE ch04.address_audit
        if only is None:
            now = kernel_tensors(model, extra)
        else:  # a direct lookup per name: much cheaper than walking every module
            params = model._params() if hasattr(model, "_params") else dict(model.named_parameters())
            now = {name: params[name] for name in only if name in params}
        lines = []
        for name, before in self.recorded.items():
            if only is not None and name not in now:  # not asked for, or no parameter: skipped
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
        # END EXERCISE

    def verify(self, model: nn.Module, extra: dict[str, torch.Tensor] | None = None,
               only: set[str] | None = None) -> None:
        """Raise AddressMovedError naming what moved (nothing moved: return)."""
        unwritten = self.unwritten
        if unwritten:
            # Before chapter 04 the audit is the learner's to write: say once that updates
            # go unaudited rather than stop every earlier chapter's update here.
            warnings.warn(f"updates are not audited until chapter 04's part {unwritten} is written", stacklevel=2)
            return
        lines = self.violations(model, extra, only)
        if lines:
            raise AddressMovedError(
                f"{len(lines)} tensors read by kernels moved (a captured CUDA graph would read stale "
                f"memory; updates must copy in place): " + "; ".join(lines[:5]))
