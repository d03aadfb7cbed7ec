"""Chapter 04, differential: the learner's commit step, address record and audit beside the
reference's, on the same random scenarios (``scenarios_ch04.py``, run here and in the
reference's process through ``shared/twin.py``): sequences of in-process updates of a small
engine, good and refused (wrong shape, unknown name, int values, NaN where ``check_finite``
refuses it); parameters moved, shrunk or retyped behind the audit's back; records of views,
0-d and empty tensors. Compared after every operation: what it returned or which error type,
which parameters' bytes changed, whether anything left its memory, whether the inputs were
left alone, the audit's lines.
"""
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import twin
from engine_ops import DIFFERENTIAL

DTYPES = ["float32", "float32", "bfloat16", "float16", "float64"]
GOOD = ["good", "good", "strided", "nan"]
BAD = ["transposed", "flat", "row", "unsqueeze", "unknown"]
seeds = st.integers(0, 2)  # checkpoints made once per process and seed: the same ones on both sides


def entries(bad_kinds=BAD, good_kinds=GOOD):
    """A few good entries, sometimes one refused one somewhere among them."""
    good = st.lists(st.tuples(st.integers(0, 40), st.sampled_from(good_kinds), st.sampled_from(DTYPES)).map(list),
                    max_size=8)
    bad = st.one_of(st.none(), st.tuples(st.integers(0, 40), st.sampled_from(bad_kinds),
                                         st.sampled_from(DTYPES)).map(list))
    return st.tuples(good, bad, st.integers(0, 8)).map(
        lambda t: t[0] if t[1] is None else t[0][:t[2]] + [t[1]] + t[0][t[2]:])


apply_op = st.tuples(st.just("apply"), entries(), st.sampled_from(["list", "generator", "items"])).map(list)
update_op = st.tuples(st.just("update"), entries(BAD + ["int"]), st.booleans()).map(list)


def same_trace(reference, scenario, labels, explain, **kwargs):
    mine = twin.run_here(f"scenarios_ch04:{scenario}", **kwargs)
    theirs = reference.run(f"scenarios_ch04:{scenario}", **kwargs)
    twin.compare_traces(labels, mine, theirs, explain)


ALL = [[k, "good", "float32"] for k in range(25)]  # every checkpoint name of an untied tiny model


@pytest.mark.exercise("ch04.copy_in_place")
@DIFFERENTIAL
@given(seed=seeds, tied=st.booleans(), ops=st.lists(st.one_of(apply_op, update_op), min_size=1, max_size=6))
@example(seed=0, tied=False, ops=[["apply", ALL[:20] + [[20, kind, "float32"]] + ALL[21:], "list"]
                                  for kind in ("transposed", "flat", "row", "unsqueeze")])
@example(seed=1, tied=False, ops=[["apply", ALL + [[3, "unknown", "float32"]], "generator"],
                                  ["apply", ALL, "generator"], ["apply", [], "list"]])
@example(seed=2, tied=True, ops=[["apply", [[k, "good", "bfloat16"] for k in range(25)], "items"],
                                 ["apply", [[k, "strided", "float16"] for k in range(25)], "list"]])
@example(seed=0, tied=False, ops=[["update", [[1, "nan", "float32"], [2, "good", "float32"]], True],
                                  ["update", [[1, "nan", "float32"], [2, "good", "float32"]], False],
                                  ["update", [[4, "good", "float32"], [5, "int", "float32"]], False],
                                  ["update", [[4, "strided", "bfloat16"], [6, "row", "float32"]], False],
                                  ["update", ALL, False]])
def test_commit_step_matches_the_reference(reference, seed, tied, ops):
    same_trace(reference, "commit_trace", ops + [["(the weights at the end)"]],
               "see Exercise 1 of chapter 04 (The commit step: copy in place)", seed=seed, tied=tied, ops=ops)


VIEWS = ["whole", "rows", "row", "transposed", "column", "tail", "scalar", "empty", "clone", "fresh"]
record_specs = st.lists(st.tuples(st.integers(0, 2), st.sampled_from(VIEWS),
                                  st.sampled_from(["float32", "float32", "bfloat16", "int32"])).map(list),
                        max_size=8)


@pytest.mark.exercise("ch04.record_addresses")
@DIFFERENTIAL
@given(seed=seeds, specs=record_specs,
       container=st.sampled_from(["dict", "dict", "dict", "pairs", "none_value", "list_value"]))
@example(seed=0, specs=[[0, v, "float32"] for v in VIEWS], container="dict")
@example(seed=1, specs=[], container="dict")
@example(seed=1, specs=[], container="pairs")
@example(seed=2, specs=[[1, "empty", "float32"], [1, "scalar", "bfloat16"], [2, "tail", "int32"]],
         container="list_value")
def test_record_matches_the_reference(reference, seed, specs, container):
    call = f"AddressAudit(tensors) with {len(specs)} tensors {specs} in a {container}"
    mine = twin.run_here("scenarios_ch04:record_case", seed=seed, specs=specs, container=container)
    theirs = reference.run("scenarios_ch04:record_case", seed=seed, specs=specs, container=container)
    twin.compare_results(call, mine, theirs, "see Exercise 2 of chapter 04 (Record the addresses)")
    mine = twin.run_here("scenarios_ch04:audit_trace", seed=seed, tied=container == "pairs", ops=[])
    theirs = reference.run("scenarios_ch04:audit_trace", seed=seed, tied=container == "pairs", ops=[])
    twin.compare_results("Engine(...).address_audit.recorded (what a fresh engine records)", mine, theirs,
                         "see Exercise 2 of chapter 04 (Record the addresses)")


only = st.one_of(st.none(), st.lists(st.one_of(st.integers(0, 30), st.sampled_from(["no.such.parameter", "kv_cache"])),
                                     max_size=4))
move = st.tuples(st.sampled_from(["rebind", "shrink", "retype"]), st.integers(0, 30)).map(list)
check = st.tuples(st.just("check"), only, st.sampled_from(["engine", "engine", "none", "empty"])).map(list)
clean_update = st.tuples(st.just("update"), entries(bad_kinds=["flat"], good_kinds=["good", "strided"]).map(
    lambda es: [e for e in es if e[1] != "flat"])).map(list)


@pytest.mark.exercise("ch04.address_audit")
@DIFFERENTIAL
@given(seed=seeds, tied=st.booleans(),
       ops=st.lists(st.one_of(move, check, check, clean_update, st.just(["kv_clone"]), st.just(["verify"])),
                    min_size=1, max_size=8))
@example(seed=0, tied=False, ops=[["check", None, "engine"], ["update", [[k, "good", "float32"] for k in range(25)]],
                                  ["check", None, "engine"], ["verify"]])
@example(seed=1, tied=False, ops=[["shrink", 3], ["retype", 7], ["rebind", 11], ["check", None, "engine"],
                                  ["check", [3, 11, "no.such.parameter", "kv_cache"], "engine"], ["check", [7], "none"]])
@example(seed=2, tied=True, ops=[["kv_clone"], ["check", None, "engine"], ["check", None, "empty"],
                                 ["check", None, "none"], ["check", [], "engine"], ["verify"]])
@example(seed=0, tied=False, ops=[["rebind", 5], ["rebind", 5], ["rebind", 5], ["check", [5], "engine"],
                                  ["update", [[1, "good", "float32"]]], ["verify"]])
def test_audit_matches_the_reference(reference, seed, tied, ops):
    same_trace(reference, "audit_trace", [["(the record at start-up)"]] + ops,
               "see Exercise 3 of chapter 04 (The address audit)", seed=seed, tied=tied, ops=ops)
