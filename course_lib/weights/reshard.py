"""Resharding: move weights from the trainer's tensor-parallel layout to the engine's.

A *layout* says which region of a full tensor each rank holds: a block of rows, a block
of columns, everything (replicated), or any explicit box per rank. The trainer and the
engine rarely agree. The classic case: a 4x4 weight whose training ranks each hold two
columns, while each inference rank needs two rows. Row [1, 2, 3, 4] then lives half on
trainer rank 0 and half on trainer rank 1, so engine rank 0 must receive a piece from
each and put the pieces side by side.

The **planner** (``plan``) intersects the two layouts and lists, per engine rank, the
pieces to receive: source trainer rank, where the piece sits in the source's local
tensor, where it goes in the destination's local shard, and its bytes. ``check`` proves
that every element each engine rank needs arrives exactly once; ``summary`` prints the
bytes each rank sends and receives.

The **executor** moves exactly those pieces over a torch.distributed group (gloo on CPU,
NCCL on GPUs): trainer ranks call ``send_pieces`` with their local tensors, engine ranks
call ``receive_shards`` and get checkpoint-format *shards* (e.g. rows 0:32 of
``q_proj.weight``), which ``load_shards`` copies in place into the engine's (possibly
fused) parameters. No rank ever builds a full tensor it does not own: a trainer sends
slices of what it holds, an engine allocates only its own shard.

A word on names: "rows" and "columns" here are dimensions of the weight tensor
``[out, in]``. Megatron's ColumnParallelLinear splits the *output* dimension, which is
the tensor's rows; its RowParallelLinear splits the input dimension, the columns.
"""
from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import torch
from torch import nn

from course_lib.config import ModelConfig

Box = tuple[tuple[int, int], ...]  # per dimension: [start, stop) in full-tensor coordinates


class ReshardError(ValueError):
    """A layout or plan that cannot be used; the message says which tensor and why."""


# ---- boxes -------------------------------------------------------------------------------

def _volume(box: Box) -> int:
    return math.prod(b - a for a, b in box)


def _intersect(x: Box, y: Box) -> Box | None:
    out = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(x, y))
    return out if all(a < b for a, b in out) else None


def _relative(box: Box, origin: Box) -> Box:
    return tuple((a - o, b - o) for (a, b), (o, _) in zip(box, origin))


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def _shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def format_box(box: Box) -> str:
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
            if _intersect(x, y) is not None:
                raise ReshardError(f"{name}: boxes {format_box(x)} and {format_box(y)} overlap without being "
                                   f"equal; an element must have one owner (or identical replicas)")
        if sum(_volume(b) for b in distinct) != _volume(full):
            raise ReshardError(f"{name}: the ranks' boxes do not cover the whole tensor {self.shape}")

    def local_shape(self, rank: int) -> tuple[int, ...] | None:
        box = self.boxes[rank]
        return None if box is None else _shape(box)


# ---- the engine's layout, read off its own modules ---------------------------------------

def _engine_split_dim(module: nn.Module) -> int | None:
    """How the engine's loaders slice a checkpoint tensor for this module (None: replicated)."""
    from course_lib.layers.embedding import VocabParallelEmbedding
    from course_lib.layers.linear import ColumnParallelLinear, LinearBase

    if isinstance(module, (VocabParallelEmbedding, ColumnParallelLinear)):
        return 0
    if isinstance(module, LinearBase) and module.tp_dim is not None:
        return module.tp_dim  # QKV and gate/up: 0 (output rows); RowParallel: 1 (input columns)
    return None


def _module_of(model, param_name: str) -> nn.Module:
    return model.get_submodule(param_name.rsplit(".", 1)[0])


def placement(model, name: str) -> tuple[str, int, int] | None:
    """Where checkpoint tensor ``name``'s shard lands in this rank's model: (parameter
    name, first row, number of rows); None for checkpoint entries the model ignores."""
    target = model.map_checkpoint_name(name)
    if target is None:
        return None
    param_name, shard_id = target
    module = _module_of(model, param_name)
    rows = model._params()[param_name].shape[0]
    if shard_id is None:
        return param_name, 0, rows
    return (param_name, *module.shard_rows(shard_id))


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
    from dataclasses import replace

    from course_lib.models.qwen3 import Qwen3ForCausalLM
    from course_lib.weights.checkpoint import hf_tensor_shapes

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
    from course_lib.weights.checkpoint import hf_tensor_shapes

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
    from course_lib.weights.checkpoint import hf_tensor_shapes

    dims = _split_dims(config)
    out = {}
    for name, shape in hf_tensor_shapes(config).items():
        dim = 0 if len(shape) == 1 else 1 - (dims[name] or 0)
        out[name] = Layout.split(shape, world_size, dim)
    return out


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
        """Every element each engine rank needs arrives exactly once, from a trainer rank
        that holds it. Disjoint pieces whose sizes add up to the shard cover it exactly."""
        for t in self.tensors.values():
            for e, box in enumerate(t.dest.boxes):
                mine = [p for p in t.pieces if p.dst == e]
                if box is None:
                    if mine:
                        raise ReshardError(f"{t.name}: engine rank {e} holds nothing but is sent {len(mine)} pieces")
                    continue
                for p in mine:
                    src_box = t.source.boxes[p.src]
                    if src_box is None or _intersect(p.region, src_box) != p.region:
                        raise ReshardError(f"{t.name}: trainer rank {p.src} does not hold {format_box(p.region)}")
                    if _intersect(p.region, box) != p.region:
                        raise ReshardError(f"{t.name}: {format_box(p.region)} is outside engine rank {e}'s shard")
                for x, y in itertools.combinations(mine, 2):
                    if _intersect(x.region, y.region) is not None:
                        raise ReshardError(f"{t.name}: engine rank {e} would receive {format_box(x.region)} and "
                                           f"{format_box(y.region)}, which overlap")
                got = sum(_volume(p.region) for p in mine)
                if got != _volume(box):
                    raise ReshardError(f"{t.name}: engine rank {e} would receive {got} of the {_volume(box)} "
                                       f"elements of its shard")

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
    """Intersect the two layouts of one tensor. Where the source has replicas of a box,
    engine rank e takes it from the (e mod replicas)-th holder, spreading the load."""
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
            region = _intersect(box, want)
            if region is None:
                continue
            src = ranks[e % len(ranks)]
            plan.pieces.append(Piece(name, src, e, region, _relative(region, box), _relative(region, want),
                                     _volume(region) * itemsize))
    return plan


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
    from course_lib.weights.checkpoint import hf_tensor_shapes

    shapes = hf_tensor_shapes(config)
    return plan({n: (s, config.dtype) for n, s in shapes.items()}, trainer_layouts, engine_layouts(config, tp_size))


# ---- executing a plan --------------------------------------------------------------------

def trainer_locals(full: Mapping[str, torch.Tensor], plan: ReshardPlan, rank: int) -> dict[str, torch.Tensor]:
    """What trainer ``rank`` holds under the plan's layouts, cut from full tensors (a test
    and notebook helper: a real trainer already holds only its part)."""
    out = {}
    for name, t in plan.tensors.items():
        box = t.source.boxes[rank]
        if box is not None:
            out[name] = full[name][_slices(box)].clone()
    return out


def read_trainer_locals(checkpoint_path, plan: ReshardPlan, rank: int) -> dict[str, torch.Tensor]:
    """Trainer ``rank``'s part of every tensor, read straight from a safetensors
    checkpoint: only the bytes of its boxes are read, never a whole tensor."""
    from safetensors import safe_open

    from course_lib.weights.checkpoint import CheckpointReader

    reader = CheckpointReader(checkpoint_path)
    if reader.format != "safetensors":
        raise ReshardError(f"{reader.path}: reading slices needs safetensors files")
    out = {}
    for file in sorted(set(reader.files.values())):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                t = plan.tensors.get(name)
                if t is not None and t.source.boxes[rank] is not None:
                    out[name] = f.get_slice(name)[_slices(t.source.boxes[rank])].contiguous()
    return out


def _check_locals(plan: ReshardPlan, rank: int, local: Mapping[str, torch.Tensor]) -> None:
    for name, t in plan.tensors.items():
        want = t.source.local_shape(rank)
        if want is None:
            continue
        if name not in local:
            raise ReshardError(f"trainer rank {rank} lacks its part of {name}")
        got = local[name]
        if tuple(got.shape) != want or got.dtype != t.dtype:
            raise ReshardError(f"{name}: trainer rank {rank} holds {tuple(got.shape)} {got.dtype}, "
                               f"the plan expects {want} {t.dtype}")


def reshard_in_memory(plan: ReshardPlan, locals_by_rank: Sequence[Mapping[str, torch.Tensor]]) -> list[dict]:
    """Run the plan inside one process: {name: shard} for every engine rank. The same
    pieces as ``send_pieces`` / ``receive_shards``, moved with slicing instead of a network."""
    for r, local in enumerate(locals_by_rank):
        _check_locals(plan, r, local)
    out = []
    for e in range(plan.engine_world_size):
        shards = _empty_shards(plan, e, torch.device("cpu"))
        for p in plan.pieces_for(e):
            shards[p.name][_slices(p.dst_box)] = locals_by_rank[p.src][p.name][_slices(p.src_box)]
        out.append(shards)
    return out


def _empty_shards(plan: ReshardPlan, engine_rank: int, device) -> dict[str, torch.Tensor]:
    return {n: torch.empty(shape, dtype=plan.tensors[n].dtype, device=device)
            for n, shape in plan.shard_shapes(engine_rank).items()}


DEFAULT_INFLIGHT_BYTES = 64 << 20


def _tags(plan: ReshardPlan) -> dict[int, int]:
    return {id(p): i for i, p in enumerate(plan.pieces)}


class _Window:
    """Point-to-point operations in flight, at most ``limit`` bytes of them. Every rank
    posts in the plan's global order and waits on its oldest first, so the earliest
    unfinished piece always has both ends posted: no deadlock, bounded memory."""

    def __init__(self, limit: int):
        self.limit, self.ops, self.bytes = limit, [], 0

    def add(self, work, nbytes: int, done=None) -> None:
        self.ops.append((work, nbytes, done))
        self.bytes += nbytes
        while self.bytes > self.limit and len(self.ops) > 1:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        work, nbytes, done = self.ops.pop(0)
        work.wait()
        if done is not None:
            done()
        self.bytes -= nbytes

    def drain(self) -> None:
        while self.ops:
            self._finish_oldest()


def send_pieces(plan: ReshardPlan, trainer_rank: int, local: Mapping[str, torch.Tensor], group,
                trainer_group_ranks: Sequence[int] | None = None, engine_group_ranks: Sequence[int] | None = None,
                inflight_bytes: int = DEFAULT_INFLIGHT_BYTES) -> dict:
    """Trainer side: send every piece this rank is the source of. ``group`` is a process
    group (backend) object with ``send``/``recv``; by default trainer ranks are group ranks
    0..T-1 and engine rank e is group rank T+e. Returns {"pieces", "bytes"}."""
    _check_locals(plan, trainer_rank, local)
    engine_ranks = _group_ranks(plan, trainer_group_ranks, engine_group_ranks)[1]
    tags, window, n, nbytes = _tags(plan), _Window(inflight_bytes), 0, 0
    for p in plan.pieces_from(trainer_rank):
        # A column block is not contiguous in memory; the wire needs contiguous bytes.
        data = local[p.name][_slices(p.src_box)].contiguous()
        window.add(group.send([data], engine_ranks[p.dst], tags[id(p)]), p.nbytes)
        n, nbytes = n + 1, nbytes + p.nbytes
    window.drain()
    return {"pieces": n, "bytes": nbytes}


def receive_shards(plan: ReshardPlan, engine_rank: int, group, device="cpu",
                   trainer_group_ranks: Sequence[int] | None = None, engine_group_ranks: Sequence[int] | None = None,
                   inflight_bytes: int = DEFAULT_INFLIGHT_BYTES) -> dict[str, torch.Tensor]:
    """Engine side: allocate this rank's shards (nothing larger) and receive every piece
    into place; returns {checkpoint name: shard}."""
    trainer_ranks = _group_ranks(plan, trainer_group_ranks, engine_group_ranks)[0]
    shards = _empty_shards(plan, engine_rank, torch.device(device))
    tags, window = _tags(plan), _Window(inflight_bytes)
    for p in plan.pieces_for(engine_rank):
        view = shards[p.name][_slices(p.dst_box)]
        if view.is_contiguous():  # a block of whole rows: receive straight into the shard
            window.add(group.recv([view], trainer_ranks[p.src], tags[id(p)]), p.nbytes)
        else:
            buf = torch.empty(view.shape, dtype=view.dtype, device=view.device)
            window.add(group.recv([buf], trainer_ranks[p.src], tags[id(p)]), p.nbytes,
                       done=lambda view=view, buf=buf: view.copy_(buf))
    window.drain()
    return shards


def _group_ranks(plan: ReshardPlan, trainer_ranks, engine_ranks) -> tuple[list[int], list[int]]:
    t = list(trainer_ranks) if trainer_ranks is not None else list(range(plan.trainer_world_size))
    e = list(engine_ranks) if engine_ranks is not None else [plan.trainer_world_size + i
                                                             for i in range(plan.engine_world_size)]
    if len(t) != plan.trainer_world_size or len(e) != plan.engine_world_size:
        raise ReshardError(f"group ranks {t} / {e} do not match the plan's {plan.trainer_world_size} trainer "
                           f"and {plan.engine_world_size} engine ranks")
    return t, e


# ---- loading shards into the engine ------------------------------------------------------

def check_plan_matches(model, plan: ReshardPlan) -> None:
    """Refuse a plan whose engine layout is not this model's (wrong tp_size, a shard cut
    differently from what the loaders cut), before anything is received or written."""
    from course_lib.weights.checkpoint import hf_tensor_shapes

    if plan.engine_world_size != model.tp_size:
        raise ReshardError(f"the plan is for {plan.engine_world_size} engine ranks; this engine has "
                           f"tensor_parallel_size {model.tp_size}")
    expected = hf_tensor_shapes(model.config)
    for name, t in plan.tensors.items():
        if name not in expected:
            raise ReshardError(f"{name}: matches no parameter of this model")
        if t.shape != tuple(expected[name]):
            raise ReshardError(f"{name}: plan shape {t.shape}, the model's is {tuple(expected[name])}")
        mine = engine_layout(model, name, t.shape).boxes[model.tp_rank]
        if t.dest.boxes[model.tp_rank] != mine:
            raise ReshardError(f"{name}: the plan gives engine rank {model.tp_rank} "
                               f"{format_box(t.dest.boxes[model.tp_rank])}, its loaders hold {format_box(mine)}")


def load_shards(model, shards: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> set[str]:
    """Copy checkpoint-format shards into this rank's parameters in place: q/k/v and
    gate/up shards into their rows of the fused parameter, the rest whole. A quantized
    layer stages the shard (as its loader would) and is requantized by
    ``process_weights_after_loading``. Returns the names loaded."""
    items = shards.items() if isinstance(shards, Mapping) else shards
    params, loaded = model._params(), set()
    for name, shard in items:
        where = placement(model, name)
        if where is None:
            continue
        param_name, offset, rows = where
        param, module = params[param_name], _module_of(model, param_name)
        if param.device.type == "meta":  # quantized: the shell has no memory; stage instead
            if module.staging is None:
                module.staging = torch.empty(param.shape, dtype=param.dtype, device=module.qweight.device)
            target = module.staging
            module.staged_shards.add(model.map_checkpoint_name(name)[1])
        else:
            target = param.data
        dest = target.narrow(0, offset, rows)
        if tuple(shard.shape) != tuple(dest.shape):
            raise ReshardError(f"{name}: shard has shape {tuple(shard.shape)}, {param_name} rows "
                               f"{offset}:{offset + rows} expect {tuple(dest.shape)}")
        dest.copy_(shard)
        loaded.add(name)
    return loaded


def apply_resharded_update(engine, plan: ReshardPlan, group_name: str = "weight_update_group",
                           weight_version: str | None = None, flush_cache: bool = True,
                           abort_all_requests: bool = False, refusal: str | None = None,
                           trainer_group_ranks=None, engine_group_ranks=None) -> dict:
    """One engine rank's side of a resharded update, through the engine's own update
    transaction (pause rules, address audit, version, cache flush, timings).

    The pieces are received even when the update is refused (``refusal``, a busy engine,
    a plan that does not match): the trainers are already sending, and a receiver that
    walked away would leave them hanging."""
    from course_lib.layers.quant import process_weights_after_loading
    from course_lib.weights.update import PhaseTimer, UpdateError

    group = engine._weight_groups.get(group_name)
    if group is None:
        raise ValueError(f"no weight-update group named {group_name!r}; call init_weights_update_group first")
    timer = PhaseTimer()
    rank = engine.model.tp_rank
    problem: Exception | None = UpdateError(refusal) if refusal else None
    if problem is None:
        try:
            engine._refuse_if_busy(abort_all_requests)
            check_plan_matches(engine.model, plan)
        except (RuntimeError, ReshardError) as exc:
            problem = exc
    timer.lap("validate")
    shards = receive_shards(plan, rank, group[0], engine.config.device, trainer_group_ranks, engine_group_ranks)
    timer.lap("transfer")
    if problem is not None:
        raise problem
    nbytes = sum(t.numel() * t.element_size() for t in shards.values())

    def apply(timer: PhaseTimer) -> dict:
        load_shards(engine.model, shards)
        timer.lap("copy")
        process_weights_after_loading(engine.model, allow_pending=False)
        timer.lap("post_process")
        return {"received_bytes": nbytes, "pieces": len(plan.pieces_for(rank))}
    return engine._commit_update(apply, nbytes, timer, weight_version, flush_cache, abort_all_requests, 600.0,
                                 f"resharded {len(shards)} tensors into rank {rank}")


def push_resharded(checkpoint_path, plan: ReshardPlan, trainer_rank: int, master_port: int,
                   group_name: str = "weight_update_group", backend: str = "gloo", results=None) -> None:
    """A stand-in trainer rank (a spawnable function): hold only this rank's part of each
    tensor (read from a checkpoint, slices only), join the weight-update group as rank
    ``trainer_rank`` (trainer ranks first, then the engine ranks) and send its pieces."""
    from course_lib.weights.transports.dist import new_group

    local = read_trainer_locals(checkpoint_path, plan, trainer_rank)
    world = plan.trainer_world_size + plan.engine_world_size
    group, _store = new_group("127.0.0.1", master_port, trainer_rank, world, group_name, backend)
    stats = send_pieces(plan, trainer_rank, local, group)
    stats["held_bytes"] = sum(t.numel() * t.element_size() for t in local.values())
    if results is not None:
        results.put((trainer_rank, stats))
