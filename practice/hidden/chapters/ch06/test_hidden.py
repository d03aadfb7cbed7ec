"""Hidden tests for chapter 06: the planner, its check and the engine's receive step.

Fresh random shapes, layouts, dtypes and checkpoints each run (the seed is in every
message). The expected pieces, coverage counts and bytes per rank are worked out here, by
this file's own brute-force planner (``expected_pieces``), never by the code under test;
plans for the check and receive cases are built by it too, so each exercise is graded
on its own. The engine cases run a real gloo group into a TP=2 engine and compare every
rank, bitwise, with that rank cold-started on the new checkpoint.
"""
import queue
import random
import threading

import pytest
import torch

from course_lib.engine.tp import TPEngine
from course_lib.weights.checkpoint.model_loader import load_model
from course_lib.layers.quant import process_weights_after_loading
from course_lib.testing import random_partition
from course_lib.weights import reshard as R
from course_lib.weights.checkpoint import CheckpointReader, hf_tensor_shapes, make_random, preset
from course_lib.weights.transports.dist import free_port, new_group
from conftest import hidden_seed  # the judge's plugin: a fixed seed, so a grade repeats
from scenarios_ch06 import own_pieces

PLAN, CHECK, RECEIVE = (pytest.mark.exercise(f"ch06.{n}") for n in ("plan_tensor", "plan_check", "receive_shards"))
F32 = torch.float32
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8]


@pytest.fixture
def rng():
    seed = hidden_seed()
    return random.Random(seed), f"seed {seed}"


# ---- this file's own planner: the oracle -----------------------------------------------------

expected_pieces = own_pieces  # the planner written out plainly, shared with the differential cases


def own_plan(tensors: dict, sources: dict, dests: dict) -> R.ReshardPlan:
    """A ReshardPlan built from ``expected_pieces`` (no call into the planner under test)."""
    plans = {n: R.TensorPlan(n, tuple(s), d, sources[n], dests[n], expected_pieces(n, s, d, sources[n], dests[n]))
             for n, (s, d) in tensors.items()}
    first = next(iter(plans.values()))
    return R.ReshardPlan(plans, first.source.world_size, first.dest.world_size)


def key(p):
    return (p.src, p.dst, tuple(p.region), tuple(p.src_box), tuple(p.dst_box), int(p.nbytes))


def random_layout(r, shape, world, replicas: bool) -> R.Layout:
    kind = r.choice(["split", "split", "partition"] + (["replicated", "replicas"] if replicas else []))
    if kind == "split":
        lay = R.Layout.split(shape, world, r.randrange(len(shape)))
        if None not in lay.boxes:  # an engine rank with nothing is its own case below
            return lay
    if kind == "replicated":
        return R.Layout.replicated(shape, world)
    if kind == "replicas" and world >= 2:
        half = random_partition(r, shape, max(1, world // 2))
        return R.Layout.explicit(shape, [half[i % len(half)] for i in range(world)])
    boxes = random_partition(r, shape, world)
    return R.Layout.explicit(shape, boxes + [None] * (world - len(boxes)))


def random_case(r):
    shape = tuple(r.randint(1, 9) for _ in range(r.choice([1, 2, 2, 3])))
    return (shape, r.choice(DTYPES), random_layout(r, shape, r.choice([1, 2, 3, 4]), True),
            random_layout(r, shape, r.choice([1, 2, 4]), True))


def model_layouts(r, config, world):
    """A random trainer layout per tensor: rows or columns (uneven where world does not
    divide), Megatron's, or the transposed one."""
    kind = r.choice(["megatron", "transposed", "mixed"])
    if kind == "megatron" and world in (1, 2, 4):
        return R.megatron_layouts(config, world), kind
    if kind == "transposed":
        return R.transposed_layouts(config, world), kind
    return {n: R.Layout.split(s, world, r.randrange(len(s))) for n, s in hf_tensor_shapes(config).items()}, "mixed"


# ---- ch06.plan_tensor -----------------------------------------------------------------------

@PLAN
def test_random_layouts_give_exactly_the_expected_pieces(rng):
    r, seed = rng
    for i in range(60):
        shape, dtype, src, dst = random_case(r)
        where = f"{seed}, case {i}: shape {shape} {dtype}, trainer boxes {src.boxes}, engine boxes {dst.boxes}"
        got = R.plan_tensor(f"t{i}", list(shape), dtype, src, dst)
        assert got.name == f"t{i}" and got.shape == shape and got.dtype == dtype, f"{where}: name, shape or dtype"
        count = torch.zeros(shape, dtype=torch.int64)
        for p in got.pieces:
            assert p.name == f"t{i}", f"{where}: a piece named {p.name!r}"
            if dst.boxes[p.dst] is not None:
                count[R.box_slices(p.region)] += 1
        want = sorted(map(key, expected_pieces(f"t{i}", shape, dtype, src, dst)))
        mine = sorted(map(key, got.pieces))
        if mine != want:
            extra, missing = sorted(set(mine) - set(want))[:2], sorted(set(want) - set(mine))[:2]
            raise AssertionError(f"{where}: pieces differ; unexpected {extra}, missing {missing} "
                                 f"(src, dst, region, src_box, dst_box, nbytes)")
        for e, s in enumerate(src.boxes):
            sent = sum(p.nbytes for p in got.pieces if p.src == e)
            assert sent == sum(p[5] for p in want if p[0] == e), f"{where}: bytes trainer rank {e} sends"


@PLAN
def test_replicas_share_the_sending_and_no_piece_is_sent_twice(rng):
    r, seed = rng
    shape = (r.randint(4, 12), r.randint(2, 6))
    shards = r.choice([1, 2])
    base = R.Layout.split(shape, shards, r.randrange(2))
    copies = r.choice([2, 3])
    src = R.Layout.explicit(shape, [base.boxes[i % shards] for i in range(shards * copies)])
    dst = R.Layout.split(shape, 4, 0)
    got = R.plan_tensor("model.norm.weight", shape, F32, src, dst)
    count = torch.zeros(shape, dtype=torch.int64)
    for p in got.pieces:
        count[R.box_slices(p.region)] += 1
    assert (count == 1).all(), f"{seed}: with {copies} replicas of each box, each element is still sent once"
    assert sorted(map(key, got.pieces)) == sorted(map(key, expected_pieces("model.norm.weight", shape, F32, src, dst))), \
        f"{seed}: engine rank e takes a replicated box from its (e % {copies})-th holder"


@PLAN
def test_bad_layouts_are_refused_naming_the_tensor(rng):
    r, seed = rng
    rows, cols = r.randint(4, 10), r.randint(2, 6)
    cut = r.randint(1, rows - 2)
    name = f"model.layers.{r.randrange(8)}.self_attn.{r.choice('qkvo')}_proj.weight"
    good = R.Layout.split((rows, cols), 2, 0)
    bad = {"a gap": [((0, cut), (0, cols)), ((cut + 1, rows), (0, cols))],
           "an overlap": [((0, cut + 1), (0, cols)), ((cut, rows), (0, cols))],
           "a box outside the tensor": [((0, cut), (0, cols)), ((cut, rows + 1), (0, cols))]}
    for label, boxes in bad.items():
        lay = R.Layout.explicit((rows, cols), boxes)
        for src, dst, side in [(lay, good, "trainer"), (good, lay, "engine")]:
            with pytest.raises(R.ReshardError, match=name.replace(".", r"\.")):
                R.plan_tensor(name, (rows, cols), F32, src, dst)
    with pytest.raises(R.ReshardError, match=name.replace(".", r"\.")):
        R.plan_tensor(name, (rows, cols), F32, good, R.Layout.split((rows + 1, cols), 2, 0))


@PLAN
def test_a_whole_model_planned_from_a_random_trainer_layout_loads_hot_equal_cold(tmp_path, rng):
    # GQA: 2 kv heads, so a trainer of 4 ranks holds half a head of k_proj and v_proj.
    r, seed = rng
    config = preset("tiny", hidden_size=r.choice([48, 64]), tie_word_embeddings=r.random() < 0.5)
    a, b = make_random(tmp_path / "a", config, seed=r.randrange(1000)), make_random(tmp_path / "b", config, seed=1001)
    world = r.choice([1, 2, 3, 4])
    layouts, kind = model_layouts(r, config, world)
    shapes = hf_tensor_shapes(config)
    engine = R.engine_layouts(config, 2)
    pieces = {n: R.plan_tensor(n, s, config.dtype, layouts[n], engine[n]) for n, s in shapes.items()}
    plan = R.ReshardPlan(pieces, world, 2)  # not plan(): the check is another exercise
    full = dict(CheckpointReader(b).iter_tensors())
    shards = R.reshard_in_memory(plan, [R.trainer_locals(full, plan, t) for t in range(world)])
    for rank in range(2):
        hot = load_model(CheckpointReader(a), "cpu", F32, rank, 2)
        R.load_shards(hot, shards[rank])
        process_weights_after_loading(hot)
        cold = load_model(CheckpointReader(b), "cpu", F32, rank, 2).state_dict()
        differ = [k for k, v in hot.state_dict().items() if not torch.equal(v, cold[k])]
        assert not differ, f"{seed}: {kind} trainer of {world} ranks: engine rank {rank} differs from a cold " \
                           f"start in {differ[:3]}"
        want = sum(p.nbytes for n in shapes for p in expected_pieces(n, shapes[n], config.dtype, layouts[n],
                                                                     engine[n]) if p.dst == rank)
        assert plan.bytes_received(rank) == want, f"{seed}: engine rank {rank} receives {want} B"


def ordered(pieces):
    return [key(p) for p in pieces]


def order_cases(r):
    """Explicit layouts where the contract's order shows, then random ones."""
    rows, cols = 2 * r.randint(2, 5), 2 * r.randint(1, 4)
    shape = (rows, cols)
    cut = r.randint(1, rows - 1)
    flipped = R.Layout.explicit(shape, [((cut, rows), (0, cols)), ((0, cut), (0, cols))])  # rank 0 holds the end
    cases = [
        ("trainer rows to engine columns", shape, R.Layout.split(shape, 2, 0), R.Layout.split(shape, 2, 1)),
        ("a trainer whose rank 0 holds the last rows", shape, flipped, R.Layout.split(shape, 2, 1)),
        ("that trainer into one engine rank", shape, flipped, R.Layout.replicated(shape, 1)),
        ("replicas, the later box held first", shape,
         R.Layout.explicit(shape, [flipped.boxes[0], flipped.boxes[1], flipped.boxes[0], flipped.boxes[1]]),
         R.Layout.split(shape, 4, 0)),
        ("three trainer column blocks to two engine row blocks", (rows, 3), R.Layout.split((rows, 3), 3, 1),
         R.Layout.split((rows, 3), 2, 0)),
        ("the same row split on both sides (boxes that only touch meet nowhere)", shape,
         R.Layout.split(shape, 2, 0), R.Layout.split(shape, 2, 0)),
        ("an uneven engine split", (rows + 1, cols), R.Layout.split((rows + 1, cols), 2, 1),
         R.Layout.split((rows + 1, cols), 2, 0)),
    ]
    for i in range(40):
        shape, dtype, src, dst = random_case(r)
        cases.append((f"random case {i}", shape, src, dst))
    return cases


@PLAN
def test_pieces_come_in_the_contracts_order(rng):
    # The order is part of the contract (every rank walks the plan in it): engine ranks
    # ascending, then the distinct source boxes in the order of their first holder.
    r, seed = rng
    for label, shape, src, dst in order_cases(r):
        want = ordered(expected_pieces("w", shape, F32, src, dst))
        got = ordered(R.plan_tensor("w", shape, F32, src, dst).pieces)
        where = f"{seed}, {label}: shape {shape}, trainer boxes {src.boxes}, engine boxes {dst.boxes}"
        assert sorted(got) == sorted(want), f"{where}: other pieces than expected"
        at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        assert at is None, (f"{where}: the right pieces in another order; piece {at} should be {want[at]}, got "
                            f"{got[at]} (src, dst, region, src_box, dst_box, nbytes). The order: engine ranks "
                            f"ascending, then source boxes in the order of their first holder")


# ---- ch06.plan_check ------------------------------------------------------------------------

def checked_case(r):
    """A random correct plan of one tensor with at least two pieces for one engine rank."""
    while True:
        shape, dtype, src, dst = random_case(r)
        name = f"model.layers.{r.randrange(9)}.mlp.{r.choice(['gate', 'up', 'down'])}_proj.weight"
        plan = own_plan({name: (shape, dtype)}, {name: src}, {name: dst})
        if len(plan.pieces) >= 2:
            return name, plan


def with_pieces(plan, pieces):
    (t,) = plan.tensors.values()
    return R.ReshardPlan({t.name: R.TensorPlan(t.name, t.shape, t.dtype, t.source, t.dest, list(pieces))},
                         plan.trainer_world_size, plan.engine_world_size)


def shifted(p, d, by):
    region = tuple((a + by, b + by) if i == d else (a, b) for i, (a, b) in enumerate(p.region))
    return R.Piece(p.name, p.src, p.dst, region, p.src_box, p.dst_box, p.nbytes)


@CHECK
def test_correct_random_plans_pass_and_are_left_unchanged(rng):
    r, seed = rng
    for _ in range(40):
        name, plan = checked_case(r)
        before = list(plan.pieces)
        assert plan.check() is None, f"{seed}: a correct plan of {name} passes"
        assert plan.pieces == before, f"{seed}: check changes nothing"


@CHECK
def test_a_gap_a_double_send_or_a_shifted_piece_is_refused_naming_the_tensor(rng):
    r, seed = rng
    rows = 2 * r.randint(1, 4)
    cols_to_rows = own_plan({"w": ((rows, rows), F32)}, {"w": R.Layout.split((rows, rows), 2, 1)},
                            {"w": R.Layout.split((rows, rows), 2, 0)})
    left, right = [p for p in cols_to_rows.pieces if p.dst == 0]  # two pieces of one size
    with pytest.raises(R.ReshardError, match="w"):
        with_pieces(cols_to_rows, [p for p in cols_to_rows.pieces if p is not right] + [left]).check()
        raise AssertionError(f"{seed}: engine rank 0 sent its left half twice and its right half never: passed")
    for i in range(30):
        name, plan = checked_case(r)
        pieces = plan.pieces
        k = r.randrange(len(pieces))
        p = pieces[k]
        d = r.randrange(len(p.region))
        bad = {"a missing piece (a gap)": pieces[:k] + pieces[k + 1:],
               "a piece sent twice": pieces + [p],
               "a piece moved one element past its shard": pieces[:k] + [shifted(p, d, 1)] + pieces[k + 1:]}
        same_rank = [q for q in pieces if q.dst == p.dst and q is not p]
        if same_rank:  # a gap made up by an overlap of the same size: only the overlap test sees it
            other = r.choice(same_rank)
            if R.volume(other.region) == R.volume(p.region):
                bad["a gap made up by a double"] = [q for q in pieces if q is not p] + [other]
        for label, wrong in bad.items():
            with pytest.raises(R.ReshardError, match=name.replace(".", r"\.")):
                with_pieces(plan, wrong).check()
                raise AssertionError(f"{seed}: case {i}: {label} in {name} passed the check")


@CHECK
def test_pieces_from_a_non_holder_or_to_an_empty_rank_are_refused(rng):
    r, seed = rng
    shape = (r.randint(4, 9), r.randint(2, 5))
    name = "lm_head.weight"
    src, dst = R.Layout.split(shape, 2, 0), R.Layout.explicit(shape, [((0, shape[0]), (0, shape[1])), None])
    plan = own_plan({name: (shape, F32)}, {name: src}, {name: dst})
    plan.check()
    p = plan.pieces[0]
    liar = R.Piece(name, 1 - p.src, p.dst, p.region, p.src_box, p.dst_box, p.nbytes)
    with pytest.raises(R.ReshardError, match="lm_head"):
        with_pieces(plan, [liar] + plan.pieces[1:]).check()
    stray = R.Piece(name, p.src, 1, p.region, p.src_box, p.dst_box, p.nbytes)
    with pytest.raises(R.ReshardError, match="lm_head"):
        with_pieces(plan, plan.pieces + [stray]).check()


def defects(plan, e, r):
    """Ways to break engine rank ``e``'s pieces of a one-tensor plan, each one the check refuses."""
    pieces = plan.pieces
    mine = [p for p in pieces if p.dst == e]
    p = r.choice(mine)
    (t,) = plan.tensors.values()
    others = [s for s, b in enumerate(t.source.boxes) if b is None or R.intersect(p.region, b) != p.region]
    out = {"a missing piece (a gap)": [q for q in pieces if q is not p],
           "a piece sent twice": pieces + [p],
           "a piece moved one element past its shard": [shifted(p, r.randrange(len(p.region)), 1) if q is p else q
                                                         for q in pieces]}
    if others:
        liar = R.Piece(p.name, others[0], p.dst, p.region, p.src_box, p.dst_box, p.nbytes)
        out["a piece from a trainer rank that does not hold it"] = [liar if q is p else q for q in pieces]
    empty = [d for d, b in enumerate(t.dest.boxes) if b is None]
    if empty:
        out["a piece to an engine rank that holds nothing"] = pieces + [R.Piece(p.name, p.src, empty[0], p.region,
                                                                                 p.src_box, p.dst_box, p.nbytes)]
    return out


def many_tensor_plan(r, n):
    """A correct plan of ``n`` tensors over one trainer world and one engine world (one engine
    rank with nothing in the last tensor, so that defect has somewhere to go)."""
    T, E = r.choice([1, 2, 3, 4]), r.choice([2, 3, 4])
    tensors, sources, dests = {}, {}, {}
    for i in range(n):
        shape = tuple(r.randint(2, 8) for _ in range(r.choice([1, 2, 2, 3])))
        name = f"model.layers.{i}.mlp.{r.choice(['gate', 'up', 'down'])}_proj.weight"
        tensors[name] = (shape, r.choice(DTYPES))
        sources[name] = random_layout(r, shape, T, True)
        if i == n - 1:
            boxes = random_partition(r, shape, E - 1)
            dests[name] = R.Layout.explicit(shape, boxes + [None] * (E - len(boxes)))
        else:
            dests[name] = random_layout(r, shape, E, True)
    return own_plan(tensors, sources, dests)


def replaced(plan, name, pieces):
    ts = {n: (R.TensorPlan(n, t.shape, t.dtype, t.source, t.dest, list(pieces)) if n == name else t)
          for n, t in plan.tensors.items()}
    return R.ReshardPlan(ts, plan.trainer_world_size, plan.engine_world_size)


@CHECK
def test_every_tensor_and_every_rank_of_a_plan_is_checked(rng):
    # A plan holds many tensors: a fault in the last one, at its last engine rank, is refused
    # like one in the first.
    r, seed = rng
    for i in range(8):
        n = r.randint(2, 5)
        plan = many_tensor_plan(r, n)
        assert plan.check() is None, f"{seed}: a correct plan of {n} tensors passes"
        names = list(plan.tensors)
        for at in sorted({0, n // 2, n - 1}):
            name = names[at]
            t = plan.tensors[name]
            one = R.ReshardPlan({name: t}, plan.trainer_world_size, plan.engine_world_size)
            ranks = sorted({p.dst for p in t.pieces})
            for e in sorted({ranks[0], ranks[-1]}):
                for label, wrong in defects(one, e, r).items():
                    bad = replaced(plan, name, wrong)
                    with pytest.raises(R.ReshardError, match=name.replace(".", r"\.")):
                        bad.check()
                        raise AssertionError(
                            f"{seed}: plan {i}: {label} in tensor {at + 1} of {n} ({name}), engine rank {e}, passed "
                            f"the check: every tensor and every engine rank of a plan is checked")


# ---- ch06.receive_shards --------------------------------------------------------------------

def over_gloo(plan, locals_by_rank, trainer_first=True, inflight_bytes=R.DEFAULT_INFLIGHT_BYTES):
    """Trainer and engine ranks as threads of this process, each with its own gloo group
    object; trainer ranks first in the group, or engine ranks first."""
    T, E = plan.trainer_world_size, plan.engine_world_size
    t_ranks = list(range(T)) if trainer_first else list(range(E, E + T))
    e_ranks = list(range(T, T + E)) if trainer_first else list(range(E))
    port, out, errors = free_port(), {}, []
    kw = dict(trainer_group_ranks=t_ranks, engine_group_ranks=e_ranks, inflight_bytes=inflight_bytes)

    def rank_main(role, i):
        try:
            rank = (t_ranks if role == "trainer" else e_ranks)[i]
            group, store = new_group("127.0.0.1", port, rank, T + E, "ch06-hidden", "gloo", timeout_s=20)
            if role == "trainer":
                out[("t", i)] = R.send_pieces(plan, i, locals_by_rank[i], group, **kw)
            else:
                out[("e", i)] = R.receive_shards(plan, i, group, **kw)
            out[("keep", role, i)] = (group, store)
        except Exception as exc:
            errors.append(f"{role} rank {i}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=rank_main, args=(role, i), daemon=True)
               for role, n in (("trainer", T), ("engine", E)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(45)
    return out, errors, any(t.is_alive() for t in threads)


@RECEIVE
@pytest.mark.parametrize("trainer_first", [True, False])
def test_random_tensors_arrive_in_place_over_gloo(rng, trainer_first):
    r, seed = rng
    T = r.choice([1, 2, 4])
    tensors, sources, dests = {}, {}, {}
    for i in range(4):
        shape = (r.randint(2, 9), r.randint(2, 9))
        name = f"t{i}"
        tensors[name] = (shape, r.choice([torch.float32, torch.bfloat16]))
        sources[name] = R.Layout.split(shape, T, r.randrange(2))
        if None in sources[name].boxes:
            sources[name] = R.Layout.replicated(shape, T)
        dests[name] = R.Layout.split(shape, 2, i % 2) if min(shape) >= 2 else R.Layout.replicated(shape, 2)
    plan = own_plan(tensors, sources, dests)
    gen = torch.Generator().manual_seed(r.randrange(1 << 30))  # values from the printed seed too
    full = {n: (torch.randn(s, generator=gen) * 100).to(d) for n, (s, d) in tensors.items()}
    out, errors, hung = over_gloo(plan, [R.trainer_locals(full, plan, t) for t in range(T)], trainer_first,
                                  inflight_bytes=r.choice([1, 64, 1 << 20]))
    where = f"{seed}: {T} trainer ranks ({'trainers' if trainer_first else 'engines'} first in the group)"
    assert not errors and not hung, f"{where}: every rank finishes without error: {errors or 'a rank hung'}"
    for e in range(2):
        shards = out[("e", e)]
        assert set(shards) == set(tensors), f"{where}: engine rank {e} returns one shard per tensor it holds"
        for n, t in plan.tensors.items():
            want = full[n][R.box_slices(t.dest.boxes[e])]
            got = shards[n]
            assert got.shape == want.shape and got.dtype == want.dtype, \
                f"{where}: {n} on engine rank {e} is its shard {tuple(want.shape)} {want.dtype}, " \
                f"got {tuple(got.shape)} {got.dtype} (never a whole tensor)"
            assert torch.equal(got, want), f"{where}: {n} on engine rank {e} holds other values than its shard"


@RECEIVE
def test_column_pieces_and_several_pieces_per_shard_arrive_in_place(rng):
    # Explicit, whatever the draw: every engine shard gets two pieces from two trainer ranks;
    # for w0 each piece is a block of columns of the shard (not a contiguous view), for w1 a
    # block of rows, for w2 uneven blocks of columns; a small window makes receives wait.
    r, seed = rng
    rows, cols = 2 * r.randint(2, 4), 2 * r.randint(2, 4)
    tensors = {"w0": ((rows, cols), torch.float32), "w1": ((rows, cols), torch.bfloat16),
               "w2": ((rows, cols + 1), torch.float32)}
    sources = {"w0": R.Layout.split((rows, cols), 2, 1), "w1": R.Layout.split((rows, cols), 2, 0),
               "w2": R.Layout.split((rows, cols + 1), 2, 1)}
    dests = {"w0": R.Layout.split((rows, cols), 2, 0), "w1": R.Layout.split((rows, cols), 2, 1),
             "w2": R.Layout.split((rows, cols + 1), 2, 0)}
    plan = own_plan(tensors, sources, dests)
    gen = torch.Generator().manual_seed(r.randrange(1 << 30))
    full = {n: (torch.randn(sh, generator=gen) * 100).to(d) for n, (sh, d) in tensors.items()}
    out, errors, hung = over_gloo(plan, [R.trainer_locals(full, plan, t) for t in range(2)], False, inflight_bytes=64)
    where = f"{seed}: 2 trainer ranks (engines first in the group), each engine shard in two pieces"
    assert not errors and not hung, f"{where}: every rank finishes without error: {errors or 'a rank hung'}"
    for e in range(2):
        shards = out[("e", e)]
        assert set(shards) == set(tensors), f"{where}: engine rank {e} returns one shard per tensor it holds"
        for n, t in plan.tensors.items():
            want, got = full[n][R.box_slices(t.dest.boxes[e])], shards[n]
            assert got.shape == want.shape and got.dtype == want.dtype, \
                f"{where}: {n} on engine rank {e} is its shard {tuple(want.shape)} {want.dtype}, " \
                f"got {tuple(got.shape)} {got.dtype}"
            for p in plan.pieces_for(e):
                if p.name == n:
                    part = R.box_slices(p.dst_box)
                    assert torch.equal(got[part], want[part]), \
                        f"{where}: {n} on engine rank {e}: the piece from trainer rank {p.src} at " \
                        f"{p.dst_box} of the shard holds other values than were sent (received somewhere else?)"


@RECEIVE
def test_a_tp2_engine_takes_a_random_trainer_layout_hot_equal_cold(tmp_path, rng):
    r, seed = rng
    config = preset("tiny")
    a, b = make_random(tmp_path / "a", config, seed=r.randrange(1000)), make_random(tmp_path / "b", config, seed=1001)
    world = r.choice([1, 2, 4])
    layouts, kind = model_layouts(r, config, world)
    shapes = {n: (s, config.dtype) for n, s in hf_tensor_shapes(config).items()}
    plan = own_plan(shapes, layouts, R.engine_layouts(config, 2))
    sent = queue.Queue()
    where = f"{seed}: {kind} trainer of {world} ranks"
    with TPEngine(a, tensor_parallel_size=2, max_model_len=64) as engine:
        port = free_port()
        for t in range(world):
            threading.Thread(target=R.push_resharded, args=(b, plan, t, port), kwargs={"results": sent},
                             daemon=True).start()
        engine.init_weights_update_group("127.0.0.1", port, world, world + 2, "weight_update_group", "gloo")
        engine.pause_generation("abort")
        out = engine.update_weights_resharded(plan, weight_version="resharded")
        engine.continue_generation()
        assert out["success"], f"{where}: the update succeeds: {out}"
        assert out["received_bytes"] == sum(p.nbytes for p in plan.pieces_for(0)), \
            f"{where}: engine rank 0 received the bytes of exactly its pieces"
        for rank in range(2):
            cold = load_model(CheckpointReader(b), "cpu", F32, rank, 2).state_dict()
            hot = engine.rank_parameters(rank)
            differ = [k for k in cold if not torch.equal(hot[k], cold[k])]
            assert not differ, f"{where}: engine rank {rank} differs from a cold start on the new weights in {differ[:3]}"
        engine.verify_addresses_on_every_rank()
        engine.destroy_weights_update_group()
