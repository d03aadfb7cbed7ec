"""Hidden tests for notebooks/06_resharding.ipynb: the learner's resharding plan.

``check_plan_pieces(plan_pieces)``: on random shapes (1 to 3 dimensions, uneven cuts),
random trainer and engine layouts (row or column splits, random box partitions, engine
replicas) and world sizes 1 to 4, the learner's pieces must (a) cover every
element each engine rank needs exactly once, from a trainer rank that holds it, with
nothing outside its box, checked element by element, and (b) equal the library planner's
pieces as a set.

Returns a list of failure messages (empty: passed); see ``__init__.py`` for why.
"""
from __future__ import annotations

import os
import random

import torch

from course_lib.testing import random_partition
from course_lib.weights import reshard as R


def _rng(seed) -> random.Random:
    return random.Random(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))


def _layout(rng: random.Random, shape, world: int, engine: bool) -> list:
    kind = rng.choice(["split", "split", "partition"] + (["replicas", "replicated"] if engine else []))
    if kind == "split":
        boxes = list(R.Layout.split(shape, world, rng.randrange(len(shape))).boxes)
        if None not in boxes:  # every rank holds something (a split finer than the dimension leaves some empty)
            return boxes
    if kind == "replicated":
        return [tuple((0, s) for s in shape)] * world
    if kind == "replicas" and world >= 2:
        half = random_partition(rng, shape, max(1, world // 2))
        return [half[i % len(half)] for i in range(world)]
    return random_partition(rng, shape, world)


def _norm(pieces) -> list:
    return sorted((int(s), int(d), tuple((int(a), int(b)) for a, b in region)) for s, d, region in pieces)


def _cases(rng: random.Random) -> list:
    cases = [((4, 4), [((0, 4), (0, 2)), ((0, 4), (2, 4))], [((0, 2), (0, 4)), ((2, 4), (0, 4))]),
             ((5, 3), list(R.Layout.split((5, 3), 3, 0).boxes), list(R.Layout.split((5, 3), 2, 0).boxes))]
    for _ in range(40):
        shape = tuple(rng.randint(1, 9) for _ in range(rng.choice([1, 2, 2, 3])))
        src = _layout(rng, shape, rng.randint(1, 4), engine=False)
        dst = _layout(rng, shape, rng.randint(1, 4), engine=True)
        cases.append((shape, src, dst))
    return cases


def check_plan_pieces(plan_pieces, seed=None) -> list[str]:
    """Failures of ``plan_pieces(shape, src_boxes, dst_boxes) -> [(src, dst, region)]``."""
    rng = _rng(seed)
    cases = _cases(rng)
    try:  # the candidate first, on copies
        answers = [plan_pieces(tuple(shape), list(src), list(dst))
                   for shape, src, dst in cases]
        answers = [_norm(a) for a in answers]
    except Exception as exc:  # report, do not raise: see __init__.py
        return [f"plan_pieces raised or returned something that is not (src, dst, region) tuples: "
                f"{type(exc).__name__}: {exc}"]
    failures = []
    for i, ((shape, src, dst), mine) in enumerate(zip(cases, answers), 1):
        where = f"case {i}: shape {shape}, {len(src)} trainer ranks, {len(dst)} engine ranks"
        problems = []
        for e, want in enumerate(dst):
            count = torch.zeros(shape, dtype=torch.int64)
            for s, d, region in mine:
                if d != e:
                    continue
                if not (0 <= s < len(src)) or len(region) != len(shape):
                    problems.append(f"a piece names trainer rank {s} or has a region of the wrong rank: {region}")
                    continue
                if R.intersect(region, src[s]) != region:
                    problems.append(f"trainer rank {s} does not hold region {R.format_box(region)}")
                count[R.box_slices(region)] += 1
            inside = torch.zeros(shape, dtype=torch.bool)
            inside[R.box_slices(want)] = True
            if (count[inside] != 1).any():
                problems.append(f"engine rank {e} receives some of its elements {int((count[inside] == 0).sum())} "
                                f"times never and {int((count[inside] > 1).sum())} more than once")
            if (count[~inside] != 0).any():
                problems.append(f"engine rank {e} is sent elements outside its box {R.format_box(want)}")
        if problems:
            failures.append(f"{where}: " + "; ".join(sorted(set(problems))[:3]))
            continue
        ref = R.plan({"t": (shape, torch.float32)}, {"t": R.Layout.explicit(shape, src)},
                     {"t": R.Layout.explicit(shape, dst)})
        want = _norm((p.src, p.dst, p.region) for p in ref.pieces)
        if mine != want:
            failures.append(f"{where}: your {len(mine)} pieces cover correctly but differ from the planner's "
                            f"{len(want)} (a region split in two, or merged across trainer ranks)")
    return failures
