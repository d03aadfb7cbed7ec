"""Where a copy table writes: each destination parameter as it was found, checked cheaply.

A copy table (``copy_table.py``, ``bucket_cache.py``) holds views of the weights it
writes. Those views are right only while every destination parameter is still the module's
attribute with the same storage pointer, shape, stride and dtype: a weight rebound since
(``param.data = ...``) would have the table write memory no kernel reads. A table checks
its destinations before its first copy and after its last, with a few C calls per
parameter (an update of hundreds of them checks in microseconds).
"""
from __future__ import annotations

import operator

import torch


class Destination:
    """A destination parameter as registration found it: the module's parameter dict, the
    attribute, the Parameter object and its identity (see the module docstring). Checked
    with a few C calls per parameter: an update of hundreds of them checks in microseconds."""
    __slots__ = ("params", "attr", "param", "identity", "label")

    def __init__(self, module: torch.nn.Module, attr: str, label: str):
        self.params, self.attr, self.label = module._parameters, attr, label
        self.param = self.params[attr]
        self.identity = self.identity_of(self.param)

    @staticmethod
    def identity_of(p: torch.Tensor) -> tuple:
        return (p.data_ptr(), p.shape, p.stride(), p.dtype)

    def moved(self) -> bool:
        p = self.params.get(self.attr)
        return p is not self.param or self.identity_of(p) != self.identity


class DestinationCheck:
    """The destinations of one set of buckets, each parameter once, checked together:
    the modules still hold the same Parameter objects, and their pointers, shapes,
    strides and dtypes are unchanged, each compared as one list (the attribute reads run
    in C through ``map``; about a third less time than one call per parameter, which
    matters for a ~1.7B model, whose whole copy takes under two milliseconds). Only when
    something moved is it looked for one by one, to name it."""

    def __init__(self, destinations: list[tuple[int, Destination]]):
        self.destinations = destinations  # (bucket, destination)
        self.dicts = [d.params for _, d in destinations]
        self.attrs = [d.attr for _, d in destinations]
        self.params = [d.param for _, d in destinations]
        # As registration recorded them (this check may be made later, after a rebind).
        self.identity = tuple(map(list, zip(*(d.identity for _, d in destinations))))

    @staticmethod
    def _identity(params) -> tuple:
        t = torch.Tensor
        return (list(map(t.data_ptr, params)), list(map(t.size, params)), list(map(t.stride, params)),
                list(map(_DTYPE, params)))

    def first_moved(self) -> tuple[int, Destination] | None:
        held = all(map(operator.is_, map(dict.get, self.dicts, self.attrs), self.params))
        if held and self._identity(self.params) == self.identity:
            return None
        return next(((k, d) for k, d in self.destinations if d.moved()), self.destinations[0])


_DTYPE = operator.attrgetter("dtype")
