"""The executor: move exactly the planned pieces, and nothing larger.

Trainer ranks call ``send_pieces`` with their local tensors; engine ranks call
``receive_shards`` and get checkpoint-format *shards* (e.g. rows 0:32 of
``q_proj.weight``), which ``loading.load_shards`` copies into the engine's parameters.
Both run over a torch.distributed group (gloo on CPU, NCCL on GPUs). No rank ever builds
a full tensor it does not own: a trainer sends slices of what it holds, an engine
allocates only its own shard. ``reshard_in_memory`` runs the same plan inside one
process, and ``push_resharded`` is a stand-in trainer rank for tests and chapters.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch
from safetensors import safe_open

from course_lib.weights.checkpoint import CheckpointReader
from course_lib.weights.reshard.layouts import ReshardError, box_slices
from course_lib.weights.reshard.planner import ReshardPlan
from course_lib.weights.transports.dist import new_group

def trainer_locals(full: Mapping[str, torch.Tensor], plan: ReshardPlan, rank: int) -> dict[str, torch.Tensor]:
    """What trainer ``rank`` holds under the plan's layouts, cut from full tensors (a test
    and notebook helper: a real trainer already holds only its part)."""
    out = {}
    for name, t in plan.tensors.items():
        box = t.source.boxes[rank]
        if box is not None:
            out[name] = full[name][box_slices(box)].clone()
    return out


def read_trainer_locals(checkpoint_path, plan: ReshardPlan, rank: int) -> dict[str, torch.Tensor]:
    """Trainer ``rank``'s part of every tensor, read straight from a safetensors
    checkpoint: only the bytes of its boxes are read, never a whole tensor."""
    reader = CheckpointReader(checkpoint_path)
    if reader.format != "safetensors":
        raise ReshardError(f"{reader.path}: reading slices needs safetensors files")
    out = {}
    for file in sorted(set(reader.files.values())):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                t = plan.tensors.get(name)
                if t is not None and t.source.boxes[rank] is not None:
                    out[name] = f.get_slice(name)[box_slices(t.source.boxes[rank])].contiguous()
    return out


def check_locals(plan: ReshardPlan, rank: int, local: Mapping[str, torch.Tensor]) -> None:
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
        check_locals(plan, r, local)
    out = []
    for e in range(plan.engine_world_size):
        shards = _empty_shards(plan, e, torch.device("cpu"))
        for p in plan.pieces_for(e):
            shards[p.name][box_slices(p.dst_box)] = locals_by_rank[p.src][p.name][box_slices(p.src_box)]
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
    check_locals(plan, trainer_rank, local)
    engine_ranks = _group_ranks(plan, trainer_group_ranks, engine_group_ranks)[1]
    tags, window, n, nbytes = _tags(plan), _Window(inflight_bytes), 0, 0
    for p in plan.pieces_from(trainer_rank):
        # A column block is not contiguous in memory; the wire needs contiguous bytes.
        data = local[p.name][box_slices(p.src_box)].contiguous()
        window.add(group.send([data], engine_ranks[p.dst], tags[id(p)]), p.nbytes)
        n, nbytes = n + 1, nbytes + p.nbytes
    window.drain()
    return {"pieces": n, "bytes": nbytes}


def receive_shards(plan: ReshardPlan, engine_rank: int, group, device="cpu",
                   trainer_group_ranks: Sequence[int] | None = None, engine_group_ranks: Sequence[int] | None = None,
                   inflight_bytes: int = DEFAULT_INFLIGHT_BYTES) -> dict[str, torch.Tensor]:
    """Engine side: receive every piece engine rank ``engine_rank`` is the destination of,
    and return {checkpoint name: this rank's shard of that tensor}.

    Promises:
    - each returned shard has the shape of this rank's box of its tensor and the plan's
      dtype, on ``device``, and holds exactly the bytes the trainers sent for it: every
      piece lands at its destination box, in place, whether or not that box is a
      contiguous view (a piece received somewhere else and never copied in is lost);
    - memory is bounded: this rank allocates its own shards and nothing larger (never a
      full tensor it does not own), and at most about ``inflight_bytes`` of receives are
      outstanding at once;
    - the pieces are posted in the plan's order for this rank, with the source ranks and
      tags the senders use, translated from plan ranks to group ranks
      (``trainer_group_ranks`` / ``engine_group_ranks``: trainers may join the group after
      the engine's ranks), so no rank waits on a receive nobody has posted;
    - on return every receive has completed and been copied into place.
    """
    # BEGIN EXERCISE ch06.receive_shards
    trainer_ranks = _group_ranks(plan, trainer_group_ranks, engine_group_ranks)[0]
    shards = _empty_shards(plan, engine_rank, torch.device(device))
    tags, window = _tags(plan), _Window(inflight_bytes)
    for p in plan.pieces_for(engine_rank):
        view = shards[p.name][box_slices(p.dst_box)]
        if view.is_contiguous():  # a block of whole rows: receive straight into the shard
            window.add(group.recv([view], trainer_ranks[p.src], tags[id(p)]), p.nbytes)
        else:
            buf = torch.empty(view.shape, dtype=view.dtype, device=view.device)
            window.add(group.recv([buf], trainer_ranks[p.src], tags[id(p)]), p.nbytes,
                       done=lambda view=view, buf=buf: view.copy_(buf))
    window.drain()
    return shards
    # END EXERCISE


def _group_ranks(plan: ReshardPlan, trainer_ranks, engine_ranks) -> tuple[list[int], list[int]]:
    t = list(trainer_ranks) if trainer_ranks is not None else list(range(plan.trainer_world_size))
    e = list(engine_ranks) if engine_ranks is not None else [plan.trainer_world_size + i
                                                             for i in range(plan.engine_world_size)]
    if len(t) != plan.trainer_world_size or len(e) != plan.engine_world_size:
        raise ReshardError(f"group ranks {t} / {e} do not match the plan's {plan.trainer_world_size} trainer "
                           f"and {plan.engine_world_size} engine ranks")
    return t, e



def push_resharded(checkpoint_path, plan: ReshardPlan, trainer_rank: int, master_port: int,
                   group_name: str = "weight_update_group", backend: str = "gloo", results=None) -> None:
    """A stand-in trainer rank (a spawnable function): hold only this rank's part of each
    tensor (read from a checkpoint, slices only), join the weight-update group as rank
    ``trainer_rank`` (trainer ranks first, then the engine ranks) and send its pieces."""
    local = read_trainer_locals(checkpoint_path, plan, trainer_rank)
    world = plan.trainer_world_size + plan.engine_world_size
    group, _store = new_group("127.0.0.1", master_port, trainer_rank, world, group_name, backend)
    stats = send_pieces(plan, trainer_rank, local, group)
    stats["held_bytes"] = sum(t.numel() * t.element_size() for t in local.values())
    if results is not None:
        results.put((trainer_rank, stats))
