"""The planner: intersect a trainer layout with the engine's and list the pieces.

``plan`` lists, per engine rank, the pieces to receive: source trainer rank, where the
piece sits in the source's local tensor, where it goes in the destination's local shard,
and its bytes. ``ReshardPlan.check`` proves that every element each engine rank needs
arrives exactly once; ``ReshardPlan.summary`` prints the bytes each rank sends and
receives. The pieces keep one global order that every rank follows, which is what keeps
the executor's point-to-point transfers from deadlocking.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Mapping

import torch

from course_lib.config import ModelConfig
from course_lib.models.qwen3 import hf_tensor_shapes
from course_lib.weights.reshard.layouts import (Box, Layout, ReshardError, engine_layouts, format_box, intersect,
                                                relative, volume)

# ---- the plan ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Piece:
    """One transfer: ``region`` of tensor ``name`` (full-tensor coordinates) from trainer
    rank ``src`` to engine rank ``dst``; ``src_box`` / ``dst_box`` locate it in the
    source's local tensor and in the destination's shard."""

    name: str
    src: int
    dst: int
    region: Box
    src_box: Box
    dst_box: Box
    nbytes: int

    def describe(self) -> str:
        return (f"{self.name} {format_box(self.region)} from trainer {self.src} "
                f"{format_box(self.src_box)} -> {format_box(self.dst_box)} ({self.nbytes} B)")


@dataclass
class TensorPlan:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    source: Layout
    dest: Layout
    pieces: list[Piece] = field(default_factory=list)


@dataclass
class ReshardPlan:
    """Per tensor: both layouts and the pieces, in one global order that every rank
    follows (which is what keeps point-to-point transfers from deadlocking)."""

    tensors: dict[str, TensorPlan]
    trainer_world_size: int
    engine_world_size: int

    @property
    def pieces(self) -> list[Piece]:
        return [p for t in self.tensors.values() for p in t.pieces]

    def pieces_for(self, engine_rank: int) -> list[Piece]:
        return [p for p in self.pieces if p.dst == engine_rank]

    def pieces_from(self, trainer_rank: int) -> list[Piece]:
        return [p for p in self.pieces if p.src == trainer_rank]

    def bytes_received(self, engine_rank: int) -> int:
        return sum(p.nbytes for p in self.pieces_for(engine_rank))

    def bytes_sent(self, trainer_rank: int) -> int:
        return sum(p.nbytes for p in self.pieces_from(trainer_rank))

    @property
    def total_bytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)

    def shard_shapes(self, engine_rank: int) -> dict[str, tuple[int, ...]]:
        """The checkpoint-format shard each tensor becomes on ``engine_rank``."""
        return {n: t.dest.local_shape(engine_rank) for n, t in self.tensors.items()
                if t.dest.boxes[engine_rank] is not None}

    def check(self) -> None:
        """Prove, before anything moves, that every element each engine rank needs arrives
        exactly once, from a trainer rank that holds it. For every tensor and every engine
        rank ``e`` (``t.dest.boxes[e]``, None when it holds nothing), with ``mine`` the
        pieces whose ``dst`` is ``e``:

        - a rank that holds nothing is sent no piece;
        - each piece's ``region`` lies inside its source's box ``t.source.boxes[p.src]``
          (which must not be None) and inside ``e``'s box (``intersect(x, y) == x`` says
          box ``x`` lies inside ``y``);
        - no two of ``mine`` overlap (``intersect`` is None for every pair);
        - their volumes add up to the volume of ``e``'s box: disjoint pieces inside the
          box whose sizes add up to it cover it exactly (no gap).

        Raises ``ReshardError`` at the first problem, its message starting with the
        tensor's name and saying which rank and which box; returns None when all hold.
        Changes nothing."""
        # BEGIN EXERCISE ch06.plan_check
        for t in self.tensors.values():
            for e, box in enumerate(t.dest.boxes):
                mine = [p for p in t.pieces if p.dst == e]
                if box is None:
                    if mine:
                        raise ReshardError(f"{t.name}: engine rank {e} holds nothing but is sent {len(mine)} pieces")
                    continue
                for p in mine:
                    src_box = t.source.boxes[p.src]
                    if src_box is None or intersect(p.region, src_box) != p.region:
                        raise ReshardError(f"{t.name}: trainer rank {p.src} does not hold {format_box(p.region)}")
                    if intersect(p.region, box) != p.region:
                        raise ReshardError(f"{t.name}: {format_box(p.region)} is outside engine rank {e}'s shard")
                for x, y in itertools.combinations(mine, 2):
                    if intersect(x.region, y.region) is not None:
                        raise ReshardError(f"{t.name}: engine rank {e} would receive {format_box(x.region)} and "
                                           f"{format_box(y.region)}, which overlap")
                got = sum(volume(p.region) for p in mine)
                if got != volume(box):
                    raise ReshardError(f"{t.name}: engine rank {e} would receive {got} of the {volume(box)} "
                                       f"elements of its shard")
        # END EXERCISE

    def summary(self, pieces: bool = False) -> str:
        """Bytes each trainer rank sends and each engine rank receives, and the total;
        with ``pieces=True`` every piece is listed under its engine rank."""
        lines = [f"reshard: {len(self.tensors)} tensors, {len(self.pieces)} pieces, "
                 f"trainer ranks {self.trainer_world_size} -> engine ranks {self.engine_world_size}"]
        for t in range(self.trainer_world_size):
            lines.append(f"  trainer rank {t}: sends {self.bytes_sent(t):>12,} B in {len(self.pieces_from(t))} pieces")
        for e in range(self.engine_world_size):
            srcs = sorted({p.src for p in self.pieces_for(e)})
            lines.append(f"  engine rank {e}: receives {self.bytes_received(e):>12,} B in "
                         f"{len(self.pieces_for(e))} pieces from trainer ranks {srcs}")
            if pieces:
                lines += [f"    {p.describe()}" for p in self.pieces_for(e)]
        lines.append(f"  total: {self.total_bytes:,} B")
        return "\n".join(lines)


def plan_tensor(name: str, shape, dtype: torch.dtype, source: Layout, dest: Layout) -> TensorPlan:
    """Intersect the trainer's layout ``source`` with the engine's layout ``dest`` of one
    tensor ``name`` of ``shape`` and ``dtype``: the pieces that move it.

    First refuse bad layouts, before planning anything: a layout whose ``shape`` is not
    ``shape``, or one that ``Layout.validate`` refuses (a box outside the tensor, two
    different boxes that overlap, boxes that leave a gap). Each raises ``ReshardError``
    whose message starts with ``name``.

    Then one ``Piece`` per engine rank ``e`` (skipping ranks whose box is None) and per
    *distinct* source box that meets ``e``'s box (``intersect``): ranks holding the same
    box are replicas, and only one of them sends. Of the ranks holding that box, in rank
    order, engine rank ``e`` takes it from the ``(e % number_of_holders)``-th, so replicas
    share the sending. A piece's ``region`` is the intersection in full-tensor coordinates;
    ``src_box`` is that region relative to the source's box (where it sits in the trainer's
    local tensor), ``dst_box`` relative to ``e``'s box (where it goes in the engine's
    shard; ``relative`` does both); ``nbytes`` is its element count (``volume``) times the
    dtype's element size. Uneven splits and GQA (fewer k/v rows than q rows) need nothing
    special: boxes say everything.

    Returns ``TensorPlan(name, shape, dtype, source, dest, pieces)``, ``shape`` as a tuple
    of ints; pieces in this order: engine ranks ascending, then source boxes in the order
    of their first holder."""
    # BEGIN EXERCISE ch06.plan_tensor
    shape = tuple(int(s) for s in shape)
    for role, lay in (("trainer", source), ("engine", dest)):
        if tuple(lay.shape) != shape:
            raise ReshardError(f"{name}: {role} layout is for shape {tuple(lay.shape)}, the tensor is {shape}")
        lay.validate(f"{name} ({role} layout)")
    holders: dict[Box, list[int]] = {}
    for r, box in enumerate(source.boxes):
        if box is not None:
            holders.setdefault(box, []).append(r)
    itemsize = torch.empty((), dtype=dtype).element_size()
    plan = TensorPlan(name, shape, dtype, source, dest)
    for e, want in enumerate(dest.boxes):
        if want is None:
            continue
        for box, ranks in holders.items():
            region = intersect(box, want)
            if region is None:
                continue
            src = ranks[e % len(ranks)]
            plan.pieces.append(Piece(name, src, e, region, relative(region, box), relative(region, want),
                                     volume(region) * itemsize))
    return plan
    # END EXERCISE


def plan(tensors: Mapping[str, tuple], trainer_layouts: Mapping, engine_layouts: Mapping) -> ReshardPlan:
    """The whole reshard: ``tensors`` is {name: (shape, dtype)}; each layouts mapping gives
    a ``Layout`` or a spec dict (see ``Layout.from_spec``) per name. Checked before it is
    returned."""
    missing = [n for n in tensors if n not in trainer_layouts or n not in engine_layouts]
    if missing:
        raise ReshardError(f"no layout for {len(missing)} tensors, e.g. {missing[:3]}")
    plans, worlds = {}, set()
    for name, (shape, dtype) in tensors.items():
        src = Layout.from_spec(trainer_layouts[name], shape)
        dst = Layout.from_spec(engine_layouts[name], shape)
        worlds.add((src.world_size, dst.world_size))
        plans[name] = plan_tensor(name, shape, dtype, src, dst)
    if len(worlds) != 1:
        raise ReshardError(f"layouts disagree on the number of ranks: {sorted(worlds)}")
    (t_world, e_world), = worlds
    result = ReshardPlan(plans, t_world, e_world)
    result.check()
    return result


def plan_for_model(config: ModelConfig, trainer_layouts: Mapping, tp_size: int) -> ReshardPlan:
    """Plan every checkpoint tensor of ``config`` into an engine with ``tp_size`` ranks."""
    shapes = hf_tensor_shapes(config)
    return plan({n: (s, config.dtype) for n, s in shapes.items()}, trainer_layouts, engine_layouts(config, tp_size))

