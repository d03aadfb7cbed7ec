"""What a piece of code costs, counted on any machine: operations, copies, allocations, host waits.

A speed figure needs a GPU; a cost proxy does not. ``count_costs(fn)`` runs ``fn`` once
under a torch dispatch mode that sees every tensor operation, and returns ``Costs``:

- ``ops``: tensor operations dispatched (on a GPU, each is at least one kernel launch);
- ``copies``: copy operations (``copy_``, ``_foreach_copy_``, ``to`` / ``clone`` that copy),
  one per call however many tensors it copies (a grouped copy is one launch);
- ``allocations`` / ``allocated_bytes``: operations whose result lives in new memory (a
  view of its input does not count), and that memory's size;
- ``host_waits``: places the host must wait for the device: reading a value back
  (``.item()``, ``bool(t)``, ``nonzero``, ``equal``) and explicit ``synchronize`` calls.

These are what a learner can change (group copies, write in place, wait once), and they
predict the GPU figure's direction; the graded speed stays the GPU's (``judge.py speed``).
"""
from __future__ import annotations

from contextlib import ExitStack
from dataclasses import asdict, dataclass
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

COPY_OPS = frozenset({"copy_", "_foreach_copy_", "_to_copy", "clone", "copy"})
READ_BACK_OPS = frozenset({"_local_scalar_dense", "item", "nonzero", "equal", "is_nonzero", "allclose"})


@dataclass
class Costs:
    ops: int = 0
    copies: int = 0
    allocations: int = 0
    allocated_bytes: int = 0
    host_waits: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def _storages(obj, out: set) -> set:
    if isinstance(obj, torch.Tensor):
        out.add(obj.untyped_storage().data_ptr() if obj.numel() and obj.device.type != "meta" else id(obj))
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _storages(item, out)
    elif isinstance(obj, dict):
        for item in obj.values():
            _storages(item, out)
    return out


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)


class _Counting(TorchDispatchMode):
    def __init__(self, costs: Costs):
        super().__init__()
        self.costs = costs
        self.new: list[tuple[str, int]] = []  # (operation, bytes) per allocation, in order

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        before = _storages(args, set()) | _storages(kwargs, set())
        out = func(*args, **kwargs)
        if all(t.device.type == "meta" for t in (*_tensors(list(args)), *_tensors(out))):
            return out  # shapes worked out on the meta device: no memory, no kernel
        name = func.overloadpacket.__name__
        c = self.costs
        c.ops += 1
        c.copies += name in COPY_OPS
        c.host_waits += name in READ_BACK_OPS
        for t in _tensors(out):
            if t.numel() and t.device.type != "meta" and t.untyped_storage().data_ptr() not in before:
                c.allocations += 1
                c.allocated_bytes += t.untyped_storage().nbytes()
                self.new.append((str(func), t.untyped_storage().nbytes()))
                before.add(t.untyped_storage().data_ptr())  # a tuple of views of one new storage: once
        return out


class AllocationWatch(_Counting):
    """``with AllocationWatch() as watch: ...``: every tensor an operation returns in memory
    that none of its inputs used, as (operation, bytes) in ``watch.new`` (views and in-place
    writes allocate nothing); what a step allocates while it runs."""

    def __init__(self):
        super().__init__(Costs())


def count_costs(fn, *args, **kwargs) -> tuple[Costs, object]:
    """Run ``fn(*args, **kwargs)`` once, counting its costs (module docstring); returns
    (the costs, what ``fn`` returned)."""
    costs = Costs()

    def waited(original):
        def wait(*a, **k):
            costs.host_waits += 1
            return original(*a, **k)
        return wait

    with ExitStack() as stack:
        for owner, attr in ((torch.cuda, "synchronize"), (torch.cuda.Stream, "synchronize"),
                            (torch.cuda.Event, "synchronize")):
            stack.enter_context(mock.patch.object(owner, attr, waited(getattr(owner, attr))))
        stack.enter_context(_Counting(costs))
        result = fn(*args, **kwargs)
    return costs, result
