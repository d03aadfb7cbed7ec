"""Chapter 06, differential: the learner's planner, plan check and receive step beside the
reference's, on the same random layouts (rows, columns, uneven, replicated, replicas, random
boxes, engine ranks that hold nothing; layouts and plans broken on purpose) and the same
random tensors. Every observation is compared: each piece and its order, which error and
whether it names the tensor, that a refused plan is left unchanged, each shard's shape,
dtype, device and bytes, every receive posted and its order, and what stays outstanding.
See ``scenarios_ch06.py`` (run in both editions) and ``shared/twin.py``.

The check and receive cases use plans built by ``scenarios_ch06.own_plan``, never by the
learner's planner, so each exercise is graded on its own.
"""
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import twin
from engine_ops import DIFFERENTIAL

DTYPES = ["float32", "bfloat16", "float16", "int8"]
NAMES = ["w", "model.layers.0.self_attn.qkv_proj.weight", "model.layers.1.mlp.down_proj.weight", "lm_head.weight"]
HOWS = ["drop", "grow", "shrink", "shift"]

shapes = st.lists(st.integers(1, 8), min_size=1, max_size=3)
seeds = st.integers(0, 10_000)


def layouts(world):
    """A layout spec over ``world`` ranks (a strategy of one, or of several worlds)."""
    worlds = world if isinstance(world, st.SearchStrategy) else st.just(world)
    return st.one_of(
        st.builds(lambda w, d: {"kind": "split", "world": w, "dim": d}, worlds, st.integers(0, 2)),
        st.builds(lambda w: {"kind": "replicated", "world": w}, worlds),
        st.builds(lambda w, s: {"kind": "partition", "world": w, "seed": s}, worlds, seeds),
        st.builds(lambda w, s: {"kind": "replicas", "world": w, "seed": s}, worlds, seeds))


def broken(spec):
    """Sometimes a layout with one box dropped, grown, shrunk or moved, or for another shape."""
    return st.one_of(
        st.just(spec), st.just(spec), st.just(spec), st.just(spec), st.just(spec),
        st.builds(lambda how, s: dict(spec, defect=[how, s]), st.sampled_from(HOWS), seeds),
        st.builds(lambda shape: dict(spec, shape=shape), shapes))


def explain(n, title):
    return f"see Exercise {n} of chapter 06 ({title}), notebooks/06_resharding.ipynb"


# ---- ch06.plan_tensor -----------------------------------------------------------------------

def cols(world=2):
    return {"kind": "split", "world": world, "dim": 1}


def rows(world=2):
    return {"kind": "split", "world": world, "dim": 0}


def explicit(*boxes):
    return {"kind": "explicit", "boxes": list(boxes)}


@pytest.mark.exercise("ch06.plan_tensor")
@DIFFERENTIAL
@given(name=st.sampled_from(NAMES), shape=shapes, dtype=st.sampled_from(DTYPES),
       source=layouts(st.integers(1, 4)).flatmap(broken), dest=layouts(st.integers(1, 4)).flatmap(broken),
       shape_as=st.sampled_from(["list", "tuple", "size"]))
# Columns to rows: every engine shard in two pieces, one per trainer rank.
@example(name="w", shape=[4, 4], dtype="float32", source=cols(2), dest=rows(), shape_as="list")
# Uneven splits, 1-D and 3-D tensors, 1- and 2-byte elements.
@example(name="w", shape=[5, 3], dtype="bfloat16", source=rows(2), dest=rows(3), shape_as="tuple")
@example(name="w", shape=[7], dtype="int8", source=rows(3), dest=rows(2), shape_as="list")
@example(name="w", shape=[3, 4, 5], dtype="float16", source={"kind": "split", "world": 2, "dim": 2},
         dest=rows(3), shape_as="size")
# Three replicas share the sending (engine rank e takes from holder e % 3); an engine rank
# with nothing (4 rows over 5 ranks) gets no piece.
@example(name="w", shape=[4, 2], dtype="float32", source={"kind": "replicated", "world": 3}, dest=rows(5),
         shape_as="list")
# A lower rank holds the later box: pieces follow the boxes' first holders, not positions.
@example(name="w", shape=[4, 2], dtype="float32", source=explicit([[2, 4], [0, 2]], [[0, 2], [0, 2]]),
         dest=rows(2), shape_as="list")
@example(name="w", shape=[4, 2], dtype="float32",
         source=explicit([[2, 4], [0, 2]], [[0, 2], [0, 2]], [[2, 4], [0, 2]], None), dest=rows(4), shape_as="list")
# Refused before anything is planned: a gap, an overlap, a box outside, an empty box, a
# layout for another shape (trainer's or engine's).
@example(name="lm_head.weight", shape=[4, 2], dtype="float32", source=explicit([[0, 2], [0, 2]], None),
         dest=rows(), shape_as="list")
@example(name="lm_head.weight", shape=[4, 2], dtype="float32", source=explicit([[0, 3], [0, 2]], [[2, 4], [0, 2]]),
         dest=rows(), shape_as="list")
@example(name="lm_head.weight", shape=[4, 2], dtype="float32", source=rows(), dest=explicit([[0, 2], [0, 2]],
                                                                                          [[2, 5], [0, 2]]),
         shape_as="list")
@example(name="lm_head.weight", shape=[4, 2], dtype="float32", source=explicit([[0, 4], [0, 2]], [[2, 2], [0, 2]]),
         dest=rows(), shape_as="list")
@example(name="lm_head.weight", shape=[4, 2], dtype="float32", source=dict(rows(), shape=[2, 4]), dest=rows(),
         shape_as="list")
@example(name="lm_head.weight", shape=[4, 2], dtype="float32", source=rows(), dest=dict(rows(), shape=[4, 2, 1]),
         shape_as="tuple")
def test_plan_tensor_matches_the_reference(reference, name, shape, dtype, source, dest, shape_as):
    kw = dict(name=name, shape=shape, dtype=dtype, source=source, dest=dest, shape_as=shape_as)
    mine = twin.run_here("scenarios_ch06:plan_tensor", **kw)
    theirs = reference.run("scenarios_ch06:plan_tensor", **kw)
    twin.compare_results(f"plan_tensor({name!r}, {shape_as} {shape}, {dtype}, trainer {source}, engine {dest})",
                         mine, theirs, explain(1, "Plan one tensor"))


# ---- ch06.plan_check ------------------------------------------------------------------------

CORRUPTIONS = ["drop", "twice", "shift", "grow", "shrink", "other_source", "other_dest", "swap_for_same_size",
               "extra_to_empty"]


@st.composite
def plans(draw):
    """Tensors over one trainer world and one engine world, correct layouts (the engine's may
    leave a rank with nothing), and maybe one tensor's pieces broken one way."""
    T, E = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    n = draw(st.integers(1, 4))
    tensors = []
    for i in range(n):
        tensors.append({"name": f"model.layers.{i}.mlp.{draw(st.sampled_from(['gate', 'up', 'down']))}_proj.weight",
                        "shape": draw(shapes), "dtype": draw(st.sampled_from(DTYPES)),
                        "source": draw(layouts(T)), "dest": draw(layouts(E))})
    corrupt = draw(st.one_of(st.none(), st.tuples(st.integers(0, n - 1), st.sampled_from(CORRUPTIONS), seeds)))
    if corrupt is not None:
        corrupt = [tensors[corrupt[0]]["name"], corrupt[1], corrupt[2]]
    return tensors, corrupt


def tensor(name, shape, source, dest, dtype="float32"):
    return {"name": name, "shape": shape, "dtype": dtype, "source": source, "dest": dest}


TWO = [tensor("a.weight", [4, 4], cols(2), rows(2)), tensor("b.weight", [6, 3], rows(2), cols(2), "bfloat16")]
EMPTY_RANK = [tensor("a.weight", [4, 4], cols(2), rows(2)),
              tensor("lm_head.weight", [5, 2], {"kind": "replicated", "world": 2},
                     explicit([[0, 5], [0, 2]], None))]


@pytest.mark.exercise("ch06.plan_check")
@DIFFERENTIAL
@given(case=plans())
@example(case=(TWO, None))
@example(case=(EMPTY_RANK, None))
@example(case=(TWO, ["b.weight", "drop", 1]))                   # a gap
@example(case=(TWO, ["b.weight", "twice", 2]))                  # a piece sent twice
@example(case=(TWO, ["a.weight", "shift", 3]))                  # a piece one element past its place
@example(case=(TWO, ["b.weight", "shrink", 4]))
@example(case=(TWO, ["a.weight", "swap_for_same_size", 0]))     # a gap made up by an overlap
@example(case=(TWO, ["b.weight", "other_source", 1]))           # from a trainer rank that does not hold it
@example(case=(EMPTY_RANK, ["lm_head.weight", "extra_to_empty", 0]))  # to a rank that holds nothing
@example(case=(EMPTY_RANK, ["lm_head.weight", "other_dest", 5]))
def test_plan_check_matches_the_reference(reference, case):
    tensors, corrupt = case
    mine = twin.run_here("scenarios_ch06:plan_check", tensors=tensors, corrupt=corrupt)
    theirs = reference.run("scenarios_ch06:plan_check", tensors=tensors, corrupt=corrupt)
    twin.compare_results(f"ReshardPlan.check() on tensors {tensors}, broken by {corrupt}", mine, theirs,
                         explain(2, "Check the plan"))


# ---- ch06.receive_shards --------------------------------------------------------------------

@st.composite
def transfers(draw):
    T, E = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    tensors = [{"name": f"t{i}", "shape": draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)),
                "dtype": draw(st.sampled_from(DTYPES)), "source": draw(layouts(T)), "dest": draw(layouts(E))}
               for i in range(draw(st.integers(1, 4)))]
    order = draw(st.permutations(list(range(T + E))))
    return tensors, list(order)


@pytest.mark.exercise("ch06.receive_shards")
@DIFFERENTIAL
@given(case=transfers(), seed=seeds, inflight_bytes=st.sampled_from([None, 1, 16, 64, 1 << 20]))
# Column pieces (not contiguous views of the shard), several pieces per shard, trainers
# after the engines in the group, a window of one byte.
@example(case=([tensor("w0", [4, 6], cols(2), rows(2)), tensor("w1", [4, 6], rows(2), cols(2), "bfloat16"),
                tensor("w2", [4, 7], cols(2), rows(2))], [2, 3, 0, 1]), seed=0, inflight_bytes=1)
# An engine rank that holds nothing of a tensor; replicas that share the sending; int8.
@example(case=([tensor("a", [5, 2], {"kind": "replicated", "world": 2}, explicit([[0, 5], [0, 2]], None, None),
                       "int8"),
                tensor("b", [3, 4], {"kind": "replicated", "world": 2}, {"kind": "split", "world": 3, "dim": 1})],
               [0, 1, 2, 3, 4]), seed=1, inflight_bytes=None)
@example(case=([tensor("a", [8, 8], rows(1), cols(2))], [2, 0, 1]), seed=2, inflight_bytes=64)
def test_receive_shards_matches_the_reference(reference, case, seed, inflight_bytes):
    tensors, order = case
    kw = dict(tensors=tensors, seed=seed, group_order=order, inflight_bytes=inflight_bytes)
    mine = twin.run_here("scenarios_ch06:receive_shards", **kw)
    theirs = reference.run("scenarios_ch06:receive_shards", **kw)
    twin.compare_results(f"receive_shards on every engine rank of tensors {tensors}, group ranks {order} "
                         f"(trainers, then engines), inflight_bytes={inflight_bytes}", mine, theirs,
                         explain(3, "Receive the shards"))
