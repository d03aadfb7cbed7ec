"""Layouts: which box of a full tensor each rank holds, and the engine's own layouts.

A *box* is a region of a tensor, one ``[start, stop)`` per dimension in full-tensor
coordinates. A ``Layout`` gives one box (or None) per rank: a block of rows, a block of
columns, everything (replicated), or any explicit box. ``engine_layouts`` reads the
engine's layout off the modules that load each tensor (so it cannot drift from the
loaders); ``megatron_layouts`` and ``transposed_layouts`` are two trainer layouts.

"Rows" and "columns" are dimensions of the weight tensor ``[out, in]``: Megatron's
ColumnParallelLinear splits the *output* dimension (the rows), RowParallelLinear the
input dimension (the columns).
"""
from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, replace
from typing import Sequence

import torch
from torch import nn

from course_lib.config import ModelConfig
from course_lib.models.qwen3 import Qwen3ForCausalLM, hf_tensor_shapes

Box = tuple[tuple[int, int], ...]  # per dimension: [start, stop) in full-tensor coordinates


class ReshardError(ValueError):
    """A layout or plan that cannot be used; the message says which tensor and why."""


# ---- boxes -------------------------------------------------------------------------------

def volume(box: Box) -> int:
    """Number of elements in ``box``."""
    return math.prod(b - a for a, b in box)


def intersect(x: Box, y: Box) -> Box | None:
    """The box both ``x`` and ``y`` cover, or None when they do not meet."""
    out = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(x, y))
    return out if all(a < b for a, b in out) else None


def relative(box: Box, origin: Box) -> Box:
    """``box`` in the coordinates of a local tensor that starts at ``origin``'s corner."""
    return tuple((a - o, b - o) for (a, b), (o, _) in zip(box, origin))


def box_slices(box: Box) -> tuple[slice, ...]:
    """Index for ``tensor[...]`` selecting ``box``."""
    return tuple(slice(a, b) for a, b in box)


def box_shape(box: Box) -> tuple[int, ...]:
    """Shape of the tensor ``box`` selects."""
    return tuple(b - a for a, b in box)


def format_box(box: Box) -> str:
    """``[0:4, 2:4]``: the box as Python slices, for messages and summaries."""
    return "[" + ", ".join(f"{a}:{b}" for a, b in box) + "]"


# ---- layouts -----------------------------------------------------------------------------

_DIM_NAMES = {"rows": 0, "row": 0, "columns": 1, "column": 1}


@dataclass(frozen=True)
class Layout:
    """Which box of a tensor of ``shape`` each of ``world_size`` ranks holds (None: nothing).

    Ranks holding the same box are replicas (e.g. data-parallel copies of one shard); any
    other overlap is refused, because it would leave the owner of an element ambiguous.
    """

    shape: tuple[int, ...]
    boxes: tuple[Box | None, ...]
    kind: str = "explicit"

    @property
    def world_size(self) -> int:
        return len(self.boxes)

    @classmethod
    def split(cls, shape, world_size: int, dim: int) -> "Layout":
        """Contiguous blocks along ``dim``; like ``torch.tensor_split``, the first
        ``shape[dim] % world_size`` ranks get one more slice when it does not divide."""
        shape = tuple(int(s) for s in shape)
        if not 0 <= dim < len(shape):
            raise ReshardError(f"cannot split a tensor of shape {shape} along dimension {dim}")
        n = shape[dim]
        base, extra = divmod(n, world_size)
        boxes, start = [], 0
        for r in range(world_size):
            stop = start + base + (r < extra)
            box = tuple((0, s) if d != dim else (start, stop) for d, s in enumerate(shape))
            boxes.append(box if stop > start else None)
            start = stop
        return cls(shape, tuple(boxes), kind={0: "rows", 1: "columns"}.get(dim, f"dim{dim}"))

    @classmethod
    def replicated(cls, shape, world_size: int) -> "Layout":
        shape = tuple(int(s) for s in shape)
        full = tuple((0, s) for s in shape)
        return cls(shape, (full,) * world_size, kind="replicated")

    @classmethod
    def explicit(cls, shape, boxes: Sequence) -> "Layout":
        shape = tuple(int(s) for s in shape)
        norm = tuple(None if b is None else tuple((int(a), int(z)) for a, z in b) for b in boxes)
        return cls(shape, norm, kind="explicit")

    @classmethod
    def from_spec(cls, spec, shape) -> "Layout":
        """A layout from a plain description: a ``Layout``, or a dict such as
        ``{"kind": "columns", "world_size": 2}`` (also "rows", "replicated", or "split"
        with "dim"), or ``{"kind": "explicit", "slices": [box or None per rank]}``."""
        if isinstance(spec, Layout):
            return spec
        kind = spec.get("kind")
        if kind == "explicit":
            return cls.explicit(shape, spec["slices"])
        world = int(spec["world_size"])
        if kind == "replicated":
            return cls.replicated(shape, world)
        if kind == "split":
            return cls.split(shape, world, int(spec["dim"]))
        if kind in _DIM_NAMES:
            return cls.split(shape, world, _DIM_NAMES[kind])
        raise ReshardError(f"unknown layout kind {kind!r}; expected rows, columns, replicated, split "
                           f"or explicit")

    def validate(self, name: str = "tensor") -> None:
        """Every box inside the tensor, distinct boxes disjoint, and together they cover it."""
        full = tuple((0, s) for s in self.shape)
        distinct = []
        for r, box in enumerate(self.boxes):
            if box is None:
                continue
            if len(box) != len(self.shape) or any(not 0 <= a < b <= s for (a, b), s in zip(box, self.shape)):
                raise ReshardError(f"{name}: rank {r}'s box {format_box(box)} is empty or outside shape {self.shape}")
            if box not in distinct:
                distinct.append(box)
        for x, y in itertools.combinations(distinct, 2):
            if intersect(x, y) is not None:
                raise ReshardError(f"{name}: boxes {format_box(x)} and {format_box(y)} overlap without being "
                                   f"equal; an element must have one owner (or identical replicas)")
        if sum(volume(b) for b in distinct) != volume(full):
            raise ReshardError(f"{name}: the ranks' boxes do not cover the whole tensor {self.shape}")

    def local_shape(self, rank: int) -> tuple[int, ...] | None:
        box = self.boxes[rank]
        return None if box is None else box_shape(box)


# ---- the engine's layout, read off its own modules ---------------------------------------

def _engine_split_dim(module: nn.Module) -> int | None:
    """How the engine's loaders slice a checkpoint tensor for this module, as the module
    says (``tp_dim``: 0 for embeddings, column-parallel, q/k/v and gate/up layers, 1 for
    row-parallel ones); None (no ``tp_dim``, or None) means replicated."""
    return getattr(module, "tp_dim", None)


def _module_of(model, param_name: str) -> nn.Module:
    return model.get_submodule(param_name.rsplit(".", 1)[0])


def engine_layout(model, name: str, shape) -> Layout:
    """The layout the engine's loaders cut checkpoint tensor ``name`` into, read off the
    module that loads it (so it cannot drift from the loaders)."""
    target = model.map_checkpoint_name(name)
    if target is None:
        raise ReshardError(f"{name}: the engine does not load this tensor")
    dim = _engine_split_dim(_module_of(model, target[0]))
    tp = model.tp_size
    if dim is None or tp == 1:
        return Layout.replicated(shape, tp)
    if shape[dim] % tp:
        raise ReshardError(f"{name}: dimension {dim} ({shape[dim]}) is not divisible by tensor_parallel_size {tp}")
    return Layout.split(shape, tp, dim)


def _split_dims(config: ModelConfig) -> dict[str, int | None]:
    """{checkpoint name: the dimension the engine's loaders split (None: replicated)}.

    Read off the module that loads each tensor, in a miniature model of the same
    structure (one decoder layer, a few elements per dimension), so that planning for an
    8B model costs milliseconds and no weight memory; every decoder layer is built alike.
    """
    mini = replace(config, vocab_size=258, bos_token_id=256, eos_token_id=257, hidden_size=8, intermediate_size=8,
                   num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                   max_position_embeddings=8)
    with torch.device("cpu"):
        model = Qwen3ForCausalLM(mini, 0, 1)
    dims = {}
    for name in hf_tensor_shapes(config):
        probe = re.sub(r"^model\.layers\.\d+\.", "model.layers.0.", name)
        dims[name] = _engine_split_dim(_module_of(model, model.map_checkpoint_name(probe)[0]))
    return dims


def engine_layouts(config: ModelConfig, tp_size: int) -> dict[str, Layout]:
    """{checkpoint name: engine layout} for every tensor: what rank r's loaders cut."""
    dims, out = _split_dims(config), {}
    for name, shape in hf_tensor_shapes(config).items():
        dim = dims[name] if tp_size > 1 else None
        if dim is not None and shape[dim] % tp_size:
            raise ReshardError(f"{name}: dimension {dim} ({shape[dim]}) is not divisible by "
                               f"tensor_parallel_size {tp_size}")
        out[name] = Layout.replicated(shape, tp_size) if dim is None else Layout.split(shape, tp_size, dim)
    return out


def megatron_layouts(config: ModelConfig, world_size: int) -> dict[str, Layout]:
    """A Megatron-style trainer's tensor-parallel layout (it equals the engine's): q/k/v,
    gate/up, embedding and LM head split by rows; o_proj and down_proj by columns;
    norms replicated."""
    return engine_layouts(config, world_size)


def transposed_layouts(config: ModelConfig, world_size: int) -> dict[str, Layout]:
    """Every 2-D tensor split along the *other* dimension than the engine splits it, and
    every norm split too (as a sharded optimizer holds them): the worst case, where each
    engine rank needs a piece from every trainer rank."""
    dims = _split_dims(config)
    out = {}
    for name, shape in hf_tensor_shapes(config).items():
        dim = 0 if len(shape) == 1 else 1 - (dims[name] or 0)
        out[name] = Layout.split(shape, world_size, dim)
    return out
