"""Chapter 06 scenarios for the differential cases (``test_differential.py``): plain functions
of JSON-able arguments, run on the learner's ``course_lib`` and on the reference's (see
``twin.py``); each builds its layouts, plans and tensors from the arguments and returns what
it observed, as JSON.

Layouts are described by specs, built here with the library's own ``Layout`` (not an
exercise), and may be broken on purpose (``defect``):

    {"kind": "split", "world": w, "dim": d}      Layout.split
    {"kind": "replicated", "world": w}
    {"kind": "partition", "world": w, "seed": s}  random boxes that cover the tensor, None padded
    {"kind": "replicas", "world": w, "seed": s}   random boxes, each held by several ranks
    {"kind": "explicit", "boxes": [box or None]}
    optional "shape": the layout's own shape (a mismatch); "defect": [how, seed] with how in
    drop / grow / shrink / shift (one box changed: a gap, an overlap, a box outside).

Plans for the check and the receive cases are built by this file's own planner
(``own_pieces``), never by the code under test, so each exercise is compared on its own.
"""
from __future__ import annotations

import random

import torch

from course_lib.testing import random_partition
from course_lib.weights import reshard as R
from engine_scenarios import error_kind

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8,
          "float64": torch.float64, "int32": torch.int32}


# ---- layouts and plans built here ---------------------------------------------------------

def _boxes(spec: dict, shape: tuple) -> list:
    kind, world = spec["kind"], spec.get("world", 1)
    if kind == "split":
        return list(R.Layout.split(shape, world, spec["dim"] % len(shape)).boxes)
    if kind == "replicated":
        return list(R.Layout.replicated(shape, world).boxes)
    if kind == "partition":
        boxes = random_partition(random.Random(spec["seed"]), shape, world)
        return boxes + [None] * (world - len(boxes))
    if kind == "replicas":
        half = random_partition(random.Random(spec["seed"]), shape, max(1, world // 2))
        return [half[i % len(half)] for i in range(world)]
    if kind == "explicit":
        return [None if b is None else tuple(tuple(x) for x in b) for b in spec["boxes"]]
    raise ValueError(f"unknown layout spec {spec}")


def _defect(boxes: list, how: str, seed: int) -> list:
    r = random.Random(seed)
    held = [i for i, b in enumerate(boxes) if b is not None]
    if not held:
        return boxes
    k = r.choice(held)
    box = [list(x) for x in boxes[k]]
    d = r.randrange(len(box))
    if how == "drop":
        boxes[k] = None
        return boxes
    if how == "grow":
        box[d][1] += 1
    elif how == "shrink":
        if box[d][1] - box[d][0] < 2:
            return boxes
        box[d][1] -= 1
    elif how == "shift":
        box[d] = [box[d][0] + 1, box[d][1] + 1]
    boxes[k] = tuple(tuple(x) for x in box)
    return boxes


def layout(spec: dict, shape) -> R.Layout:
    shape = tuple(int(s) for s in shape)
    boxes = _boxes(spec, shape)
    if "defect" in spec:
        boxes = _defect(boxes, *spec["defect"])
    own = tuple(spec.get("shape", shape))
    return R.Layout(own, tuple(None if b is None else tuple(tuple(int(v) for v in x) for x in b) for b in boxes),
                    spec["kind"])


def own_pieces(name, shape, dtype, source: R.Layout, dest: R.Layout) -> list:
    """This file's planner (the contract of exercise 1, written out plainly)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    holders: dict = {}
    for r, box in enumerate(source.boxes):
        if box is not None:
            holders.setdefault(box, []).append(r)
    out = []
    for e, want in enumerate(dest.boxes):
        if want is None:
            continue
        for box, ranks in holders.items():
            region = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(box, want))
            if any(a >= b for a, b in region):
                continue
            n = 1
            for a, b in region:
                n *= b - a
            out.append(R.Piece(name, ranks[e % len(ranks)], e, region,
                               tuple((a - o, b - o) for (a, b), (o, _) in zip(region, box)),
                               tuple((a - o, b - o) for (a, b), (o, _) in zip(region, want)), n * itemsize))
    return out


def own_plan(tensors: list) -> R.ReshardPlan:
    """tensors: [{"name", "shape", "dtype", "source": spec, "dest": spec}] over one pair of worlds."""
    plans = {}
    for t in tensors:
        shape, dtype = tuple(t["shape"]), DTYPES[t["dtype"]]
        src, dst = layout(t["source"], shape), layout(t["dest"], shape)
        plans[t["name"]] = R.TensorPlan(t["name"], shape, dtype, src, dst, own_pieces(t["name"], shape, dtype, src, dst))
    first = next(iter(plans.values()))
    return R.ReshardPlan(plans, first.source.world_size, first.dest.world_size)


def _ints(value) -> bool:
    """Every number in a (nested) box or value is a plain int."""
    if isinstance(value, (tuple, list)):
        return all(_ints(v) for v in value)
    return type(value) is int


def _piece(p) -> dict:
    try:
        hash(p)
        hashable = True
    except TypeError:
        hashable = False
    fields = [p.src, p.dst, p.region, p.src_box, p.dst_box, p.nbytes]
    return {"type": type(p).__name__, "name": p.name, "src": p.src, "dst": p.dst,
            "region": [list(x) for x in p.region], "src_box": [list(x) for x in p.src_box],
            "dst_box": [list(x) for x in p.dst_box], "nbytes": p.nbytes, "plain_ints": _ints(fields),
            "boxes_are_tuples": all(isinstance(b, tuple) and all(isinstance(x, tuple) for x in b)
                                    for b in (p.region, p.src_box, p.dst_box)),
            "hashable": hashable}


# ---- exercise 1: plan_tensor ----------------------------------------------------------------

def plan_tensor(name: str, shape: list, dtype: str, source: dict, dest: dict, shape_as: str = "list") -> dict:
    """Plan one tensor: the pieces (every field, in order) and the plan's fields, or which
    error and whether its message starts with the tensor's name."""
    torch.set_num_threads(1)
    src, dst = layout(source, shape), layout(dest, shape)
    given = {"list": list, "tuple": tuple, "size": torch.Size}[shape_as](shape)
    try:
        tp = R.plan_tensor(name, given, DTYPES[dtype], src, dst)
    except Exception as exc:  # noqa: BLE001 - which error, compared with the reference's
        return {"raised": error_kind(exc), "message_starts_with_the_name": str(exc).startswith(name)}
    return {"returned": {
        "type": type(tp).__name__, "name": tp.name, "shape": list(tp.shape),
        # a tuple of ints, as the docstring says (torch.Size is one too)
        "shape_is_a_tuple_of_ints": isinstance(tp.shape, tuple) and _ints(tp.shape),
        "dtype": str(tp.dtype), "source_is_the_given_layout": tp.source is src,
        "dest_is_the_given_layout": tp.dest is dst, "pieces_type": type(tp.pieces).__name__,
        "pieces": [_piece(p) for p in tp.pieces]}}


# ---- exercise 2: plan_check -----------------------------------------------------------------

def _corrupt(plan: R.ReshardPlan, name: str, how: str, seed: int) -> None:
    """Break tensor ``name``'s pieces one way (the plan may stay correct: e.g. a source
    swapped for a replica holding the same box)."""
    r = random.Random(seed)
    t = plan.tensors[name]
    pieces = t.pieces
    if not pieces:
        return
    k = r.randrange(len(pieces))
    p = pieces[k]
    d = r.randrange(len(p.region))

    def moved(by_start, by_stop):
        region = tuple((a + by_start, b + by_stop) if i == d else (a, b) for i, (a, b) in enumerate(p.region))
        return R.Piece(p.name, p.src, p.dst, region, p.src_box, p.dst_box, p.nbytes)

    if how == "drop":
        del pieces[k]
    elif how == "twice":
        pieces.insert(r.randrange(len(pieces) + 1), p)
    elif how == "shift":
        pieces[k] = moved(1, 1)
    elif how == "grow":
        pieces[k] = moved(0, 1)
    elif how == "shrink":
        pieces[k] = moved(0, -1) if p.region[d][1] - p.region[d][0] > 1 else moved(-1, 0)
    elif how == "other_source":  # a rank that does not hold the region when there is one
        lacking = [s for s, b in enumerate(t.source.boxes) if b is None or R.intersect(p.region, b) != p.region]
        src = r.choice(lacking) if lacking else r.randrange(t.source.world_size)
        pieces[k] = R.Piece(p.name, src, p.dst, p.region, p.src_box, p.dst_box, p.nbytes)
    elif how == "other_dest":
        pieces[k] = R.Piece(p.name, p.src, r.randrange(t.dest.world_size), p.region, p.src_box, p.dst_box,
                            p.nbytes)
    elif how == "swap_for_same_size":
        same = [q for q in pieces if q.dst == p.dst and q is not p and R.volume(q.region) == R.volume(p.region)]
        if same:
            pieces[k] = r.choice(same)
    elif how == "extra_to_empty":
        empty = [e for e, b in enumerate(t.dest.boxes) if b is None]
        if empty:
            pieces.append(R.Piece(p.name, p.src, r.choice(empty), p.region, p.src_box, p.dst_box, p.nbytes))
    else:
        raise ValueError(how)


def _names_in(message: str, names) -> str | None:
    starts = [n for n in names if message.startswith(n)]
    return max(starts, key=len) if starts else None


def plan_check(tensors: list, corrupt: list | None = None) -> dict:
    """Check a plan built here (one tensor's pieces broken by ``corrupt`` = [name, how, seed]):
    what it returned or which error, the tensor its message starts with, and that the plan
    is left as it was (the same piece objects in the same order)."""
    torch.set_num_threads(1)
    plan = own_plan(tensors)
    if corrupt:
        _corrupt(plan, *corrupt)
    before = {n: list(t.pieces) for n, t in plan.tensors.items()}
    order = list(plan.tensors)
    try:
        out = {"returned": repr(plan.check())}
    except Exception as exc:  # noqa: BLE001 - which error, compared with the reference's
        out = {"raised": error_kind(exc), "message_starts_with": _names_in(str(exc), plan.tensors)}
    out["plan_unchanged"] = (list(plan.tensors) == order and all(
        len(t.pieces) == len(before[n]) and all(a is b for a, b in zip(t.pieces, before[n]))
        for n, t in plan.tensors.items()))
    return out


# ---- exercise 3: receive_shards -------------------------------------------------------------

class _Work:
    def __init__(self, group, buf, data):
        self.group, self.buf, self.data, self.done = group, buf, data, False

    def wait(self, *args, **kwargs):
        if not self.done:
            self.done = True
            self.buf.view(-1).copy_(self.data.reshape(-1))  # the bytes arrive when the receive completes
            self.group.outstanding -= self.data.numel() * self.data.element_size()
        return True

    def is_completed(self):
        return self.done


class FakeGroup:
    """A process group of one engine rank: ``recv`` checks the buffer as a real backend
    does (one contiguous tensor of the sent size and dtype, from the rank that sends that
    tag), records the call and returns a work whose ``wait`` delivers the bytes."""

    def __init__(self, plan, full, trainer_ranks, engine_ranks, engine_rank):
        self.plan, self.full, self.t_ranks, self.engine_rank = plan, full, trainer_ranks, engine_ranks[engine_rank]
        self.plan_rank = engine_rank
        self.pieces = plan.pieces
        self.recvs, self.works, self.outstanding, self.peak = [], [], 0, 0

    def rank(self):
        return self.engine_rank

    def size(self):
        return len(self.t_ranks) + self.plan.engine_world_size

    def send(self, *args, **kwargs):
        raise RuntimeError("an engine rank sends nothing while it receives its shards")

    def recv(self, tensors, src, tag=0):
        if not isinstance(tensors, list) or len(tensors) != 1:
            raise RuntimeError("recv takes a list of exactly one tensor")
        buf = tensors[0]
        record = {"src": src, "tag": tag, "dtype": str(buf.dtype), "nbytes": buf.numel() * buf.element_size(),
                  "device": str(buf.device)}
        self.recvs.append((record, buf))
        if not buf.is_contiguous():
            raise RuntimeError("Tensors must be contiguous")
        if not 0 <= tag < len(self.pieces):
            raise RuntimeError(f"no rank sends tag {tag}")
        p = self.pieces[tag]
        if self.t_ranks[p.src] != src or p.dst != self.plan_rank:
            raise RuntimeError(f"group rank {src} sends nothing with tag {tag} to this rank")
        box = self.plan.tensors[p.name].source.boxes[p.src]
        data = self.full[p.name][R.box_slices(box)][R.box_slices(p.src_box)].contiguous()
        if buf.dtype != data.dtype or buf.numel() != data.numel():
            raise RuntimeError(f"a receive of {buf.numel()} {buf.dtype} for a message of {data.numel()} {data.dtype}")
        work = _Work(self, buf, data)
        self.works.append(work)
        self.outstanding += data.numel() * data.element_size()
        self.peak = max(self.peak, self.outstanding)
        return work

    def barrier(self, *args, **kwargs):
        raise RuntimeError("receive_shards needs no barrier")


def _storage(t):
    return t.untyped_storage().data_ptr()


def receive_shards(tensors: list, seed: int, group_order: list, inflight_bytes: int | None = None) -> dict:
    """Every engine rank receives its shards through a recording group: per rank, what it
    returned (names in order; each shard's shape, dtype, device, whether it holds exactly the
    sent bytes, whether it owns its storage and nothing larger), every receive it posted in
    order (source group rank, tag, bytes, dtype), whether every receive completed before it
    returned, whether more than ``inflight_bytes`` plus one piece was ever outstanding, and
    whether any buffer outside the shards was larger than its piece."""
    torch.set_num_threads(1)
    plan = own_plan(tensors)
    T, E = plan.trainer_world_size, plan.engine_world_size
    gen = torch.Generator().manual_seed(seed)
    full = {}
    for name, t in plan.tensors.items():
        x = torch.randn(t.shape, generator=gen) * 100
        if not t.dtype.is_floating_point:
            x = x.round().clamp(torch.iinfo(t.dtype).min, torch.iinfo(t.dtype).max)
        full[name] = x.to(t.dtype)
    t_ranks, e_ranks = group_order[:T], group_order[T:T + E]
    kw = {} if inflight_bytes is None else {"inflight_bytes": inflight_bytes}
    largest = max((p.nbytes for p in plan.pieces), default=0)
    out = []
    for e in range(E):
        group = FakeGroup(plan, full, t_ranks, e_ranks, e)
        entry = {}
        try:
            shards = R.receive_shards(plan, e, group, device="cpu", trainer_group_ranks=list(t_ranks),
                                      engine_group_ranks=list(e_ranks), **kw)
        except Exception as exc:  # noqa: BLE001 - which error, compared with the reference's
            entry["raised"] = error_kind(exc)
            shards = None
        if shards is not None:
            got = {}
            for name, s in (shards.items() if isinstance(shards, dict) else []):
                t = plan.tensors.get(name)
                box = None if t is None else t.dest.boxes[e]
                want = None if box is None else full[name][R.box_slices(box)]
                got[name] = {"type": type(s).__name__, "shape": list(s.shape), "dtype": str(s.dtype),
                             "device": str(s.device),
                             "holds_the_sent_bytes": want is not None and s.shape == want.shape
                             and s.dtype == want.dtype and torch.equal(s, want),
                             "owns_exactly_its_storage": s.untyped_storage().nbytes() == s.numel() * s.element_size()}
            entry["returned"] = {"type": type(shards).__name__, "names": list(got), "shards": got}
            storages = {_storage(s) for s in (shards.values() if isinstance(shards, dict) else [])}
            entry["buffer_outside_larger_than_its_piece"] = any(
                _storage(buf) not in storages and buf.untyped_storage().nbytes() > rec["nbytes"]
                for rec, buf in group.recvs)
        entry["receives"] = [[rec["src"], rec["tag"], rec["nbytes"], rec["dtype"], rec["device"]]
                             for rec, _ in group.recvs]
        entry["all_completed_before_return"] = all(w.done for w in group.works)
        limit = R.DEFAULT_INFLIGHT_BYTES if inflight_bytes is None else inflight_bytes
        # A window may run one piece past its limit (the piece that crosses it), and a piece
        # larger than the limit goes alone.
        entry["outstanding_over_the_limit"] = group.peak > max(limit, largest) + largest
        out.append(entry)
    return {"ranks": out}

