"""Public tests for chapter 06's exercises (run them: python practice/judge.py test ch06).

ch06.plan_tensor: ``plan_tensor`` in course_lib/weights/reshard/planner.py.
ch06.plan_check: ``ReshardPlan.check`` in course_lib/weights/reshard/planner.py.
ch06.receive_shards: ``receive_shards`` in course_lib/weights/reshard/executor.py.
Plans for the check and receive cases are made by hand here, so each exercise is tested
on its own. Each case reports what it expected in words.
"""
import threading

import pytest
import torch

from course_lib.weights.reshard import (Layout, Piece, ReshardError, ReshardPlan, TensorPlan, box_slices, plan_tensor,
                                        receive_shards, send_pieces, trainer_locals)
from course_lib.weights.transports.dist import free_port, new_group

PLAN, CHECK, RECEIVE = (pytest.mark.exercise(f"ch06.{n}") for n in ("plan_tensor", "plan_check", "receive_shards"))
F32 = torch.float32
COLS = Layout.split((4, 4), 2, 1)  # the trainer holds columns
ROWS = Layout.split((4, 4), 2, 0)  # the engine needs rows


def as_tuples(pieces):
    return sorted((p.src, p.dst, p.region, p.src_box, p.dst_box, p.nbytes) for p in pieces)


def hand_plan(name="w", source=COLS, dest=ROWS, pieces=None, dtype=F32):
    """The 4x4 example's plan, written out by hand (or with the pieces given)."""
    if pieces is None:
        pieces = [Piece(name, 0, 0, ((0, 2), (0, 2)), ((0, 2), (0, 2)), ((0, 2), (0, 2)), 16),
                  Piece(name, 1, 0, ((0, 2), (2, 4)), ((0, 2), (0, 2)), ((0, 2), (2, 4)), 16),
                  Piece(name, 0, 1, ((2, 4), (0, 2)), ((2, 4), (0, 2)), ((0, 2), (0, 2)), 16),
                  Piece(name, 1, 1, ((2, 4), (2, 4)), ((2, 4), (0, 2)), ((0, 2), (2, 4)), 16)]
    t = TensorPlan(name, tuple(source.shape), dtype, source, dest, list(pieces))
    return ReshardPlan({name: t}, source.world_size, dest.world_size)


# ---- ch06.plan_tensor ---------------------------------------------------------------------

@PLAN
def test_plan_tensor__columns_to_rows_gives_the_four_hand_made_pieces():
    got = plan_tensor("w", (4, 4), F32, COLS, ROWS)
    assert isinstance(got, TensorPlan) and got.name == "w" and got.shape == (4, 4), "a TensorPlan for w of (4, 4)"
    assert as_tuples(got.pieces) == as_tuples(hand_plan().pieces), \
        "engine rank 0 gets rows 0:2 as two 2x2 pieces (left from trainer 0, right from trainer 1), and so on"


@PLAN
def test_plan_tensor__an_uneven_split_is_covered_exactly_once():
    shape = (5, 3)  # 5 rows over 3 trainer ranks (2, 2, 1) into 2 engine ranks (3, 2)
    got = plan_tensor("v", shape, torch.bfloat16, Layout.split(shape, 3, 0), Layout.split(shape, 2, 0))
    count = torch.zeros(shape, dtype=torch.int64)
    for p in got.pieces:
        count[box_slices(p.region)] += 1
        assert p.nbytes == (p.region[0][1] - p.region[0][0]) * 3 * 2, f"{p.region}: nbytes counts bfloat16 (2 B)"
    assert (count == 1).all(), f"every element is sent exactly once, counts per element:\n{count}"
    assert {(p.src, p.dst) for p in got.pieces} == {(0, 0), (1, 0), (1, 1), (2, 1)}, \
        "trainer rank 1's rows 2:4 straddle the engine's boundary at row 3: one piece to each engine rank"


@PLAN
def test_plan_tensor__replicas_share_the_sending():
    shape = (4, 2)
    got = plan_tensor("n", shape, F32, Layout.replicated(shape, 2), Layout.split(shape, 2, 0))
    assert sorted((p.src, p.dst) for p in got.pieces) == [(0, 0), (1, 1)], \
        "two replicas, two engine ranks: engine rank e takes its rows from replica e % 2, once"


@PLAN
def test_plan_tensor__a_layout_with_a_gap_or_an_overlap_is_refused_naming_the_tensor():
    gap = Layout.explicit((4, 4), [((0, 2), (0, 4)), ((3, 4), (0, 4))])        # row 2 held by nobody
    overlap = Layout.explicit((4, 4), [((0, 3), (0, 4)), ((2, 4), (0, 4))])    # row 2 held twice
    for bad in (gap, overlap):
        with pytest.raises(ReshardError, match="layers.3.mlp.up_proj"):
            plan_tensor("model.layers.3.mlp.up_proj.weight", (4, 4), F32, bad, ROWS)
    with pytest.raises(ReshardError, match="o_proj"):
        plan_tensor("o_proj.weight", (4, 6), F32, COLS, Layout.split((4, 6), 2, 0))  # layout for another shape


# ---- ch06.plan_check ----------------------------------------------------------------------

@CHECK
def test_plan_check__the_hand_made_plan_passes():
    assert hand_plan().check() is None, "a plan that moves every element exactly once passes"


@CHECK
def test_plan_check__a_missing_piece_is_refused_naming_the_tensor():
    pieces = hand_plan("model.norm.weight").pieces[:3]
    with pytest.raises(ReshardError, match="model.norm.weight"):
        hand_plan("model.norm.weight", pieces=pieces).check()


@CHECK
def test_plan_check__a_doubled_piece_is_refused():
    pieces = hand_plan().pieces
    with pytest.raises(ReshardError, match="w"):
        hand_plan(pieces=pieces + [pieces[1]]).check()


@CHECK
def test_plan_check__a_piece_from_a_rank_that_does_not_hold_it_is_refused():
    first, *rest = hand_plan().pieces
    wrong = Piece("w", 1, 0, first.region, first.src_box, first.dst_box, 16)  # trainer 1 holds columns 2:4
    with pytest.raises(ReshardError, match="trainer rank 1"):
        hand_plan(pieces=[wrong, *rest]).check()


# ---- ch06.receive_shards ------------------------------------------------------------------

def over_gloo(plan, locals_by_rank, **kw):
    """Trainer ranks then engine ranks, one thread each with its own gloo group; returns
    {engine rank: shards}."""
    port, out, errors = free_port(), {}, []
    t_world, world = plan.trainer_world_size, plan.trainer_world_size + plan.engine_world_size

    def rank_main(rank):
        try:
            group, _store = new_group("127.0.0.1", port, rank, world, "ch06-public", "gloo", timeout_s=30)
            if rank < t_world:
                send_pieces(plan, rank, locals_by_rank[rank], group, **kw)
            else:
                out[rank - t_world] = receive_shards(plan, rank - t_world, group, **kw)
            out[f"keep{rank}"] = (group, _store)  # keep the store alive until every rank is done
        except Exception as exc:  # reported below, with the rank
            errors.append(f"rank {rank}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, "every rank finishes without an error: " + "; ".join(errors)
    assert not any(t.is_alive() for t in threads), "every rank finishes within a minute (a receive never posted?)"
    return {e: out[e] for e in range(plan.engine_world_size)}


@RECEIVE
def test_receive_shards__four_by_four_columns_arrive_as_rows():
    plan = hand_plan()
    full = torch.arange(1, 17, dtype=F32).view(4, 4)
    shards = over_gloo(plan, [trainer_locals({"w": full}, plan, t) for t in range(2)])
    assert set(shards[0]) == {"w"} and shards[0]["w"].shape == (2, 4), "engine rank 0 holds only its 2x4 shard"
    assert shards[0]["w"].tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]], f"engine rank 0 gets rows 0:2, got {shards[0]['w']}"
    assert shards[1]["w"].tolist() == [[9, 10, 11, 12], [13, 14, 15, 16]], f"engine rank 1 gets rows 2:4"


@RECEIVE
def test_receive_shards__column_pieces_land_in_place_with_a_small_window():
    # Engine ranks need columns, trainers hold rows: every piece is a non-contiguous view,
    # and a window of 8 bytes forces the oldest receives to finish while later ones wait.
    shape = (6, 4)
    plan = hand_plan(source=Layout.split(shape, 2, 0), dest=Layout.split(shape, 2, 1), pieces=[])
    t = plan.tensors["w"]
    for e, want in enumerate(t.dest.boxes):
        for s, have in enumerate(t.source.boxes):
            region = ((have[0][0], have[0][1]), want[1])
            src = ((0, 3), (want[1][0], want[1][1]))
            t.pieces.append(Piece("w", s, e, region, src, ((have[0][0], have[0][1]), (0, 2)), 24))
    full = torch.randn(shape)
    shards = over_gloo(plan, [trainer_locals({"w": full}, plan, s) for s in range(2)], inflight_bytes=8)
    for e in range(2):
        assert torch.equal(shards[e]["w"], full[:, 2 * e:2 * e + 2]), \
            f"engine rank {e} holds columns {2 * e}:{2 * e + 2} of the full tensor, received into place"
