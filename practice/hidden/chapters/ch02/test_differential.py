"""Chapter 02, differential: the learner's engine and the reference replay the same random
scenarios (submit, step, pause in each mode, update, continue, abort, flush, preempt) and
must agree on every observation after every operation (queue order, outputs and their
order, versions, KV blocks, cache entries, the pause record, which error). See
``shared/twin.py`` and ``shared/engine_ops.py``.

Each case's ``@example``s are the edge cases its exercise is known for; they run every
time. The checkpoints are fixed, so the same code always meets the same scenarios.
"""
import pytest
from hypothesis import example, given

from course_lib.weights.checkpoint import make_random
from engine_ops import (DIFFERENTIAL, abort, cont, engine_kwargs, flush, pause, preempt, same_as_reference,
                        scenario, step, steps, submit, update)

A, B, C = [1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 50, 60, 70, 80], [9, 8, 7, 6, 5]
ONE_AT_A_TIME = {"block_size": 4, "max_num_seqs": 1}
TWO = {"block_size": 4, "max_num_seqs": 2}
TIGHT = {"block_size": 4, "max_num_seqs": 4, "num_kv_blocks": 12}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("ch02-differential")
    return [str(make_random(d / f"v{i}", "tiny", seed=2026 + i)) for i in range(3)]


def sub(tokens, n):
    return ["submit", tokens, n]


@pytest.mark.exercise("ch02.versions")
@DIFFERENTIAL
@given(ops=scenario(submit, step, steps, pause("keep"), update, cont), kwargs=engine_kwargs)
@example(ops=[sub(A, 8), sub(B, 6), ["steps", 2], ["pause", "keep"], ["update", 1, {}], ["continue"],
              ["steps", 2], ["pause", "keep"], ["update", 2, {}], ["continue"], ["steps", 8]], kwargs=TWO)
def test_tags_match_the_reference(reference, paths, ops, kwargs):
    same_as_reference(reference, paths, ops, kwargs, "see Exercise 1 · Which weights made each token")


@pytest.mark.exercise("ch02.retract")
@DIFFERENTIAL
@given(ops=scenario(submit, step, steps, preempt, pause("keep", "retract"), update, cont), kwargs=engine_kwargs)
@example(ops=[sub(A, 10), sub(B, 10), sub(C, 10), sub(A + C, 10), ["steps", 8]], kwargs=TIGHT)
@example(ops=[sub(A, 6), sub(B, 6), sub(C, 6), ["step"], ["pause", "keep"], ["preempt", 2], ["preempt", 0],
              ["update", 1, {}], ["continue"], ["steps", 10]], kwargs=TWO)
def test_retract_matches_the_reference(reference, paths, ops, kwargs):
    same_as_reference(reference, paths, ops, kwargs, "see Exercise 2 · Back to the queue")


@pytest.mark.exercise("ch02.pause_modes")
@DIFFERENTIAL
@given(ops=scenario(submit, step, steps, pause(), update, cont, abort), kwargs=engine_kwargs)
@example(ops=[sub(A, 8), sub(B, 8), sub(C, 8), ["steps", 2], ["pause", "abort"], ["step"], ["continue"]],
         kwargs=ONE_AT_A_TIME)
@example(ops=[sub(A, 8), sub(B, 8), sub(C, 8), ["steps", 3], ["pause", "retract"], ["update", 1, {}],
              ["continue"], ["steps", 12]], kwargs=TWO)
@example(ops=[sub(A, 8), sub(C, 8), ["steps", 2], ["update", 2, {"abort_all_requests": True}], ["step"]],
         kwargs=ONE_AT_A_TIME)
@example(ops=[sub(A, 5), ["step"], ["pause", "bogus"], ["step"], ["pause", "keep"], ["pause", "abort"],
              ["continue"], ["steps", 5]], kwargs=TWO)
def test_pause_modes_match_the_reference(reference, paths, ops, kwargs):
    same_as_reference(reference, paths, ops, kwargs, "see Exercise 3 · The four pause modes")


@pytest.mark.exercise("ch02.wait_drain")
@DIFFERENTIAL
@given(ops=scenario(submit, step, steps, pause("wait"), update, cont, abort), kwargs=engine_kwargs)
@example(ops=[sub(A, 6), sub(B, 4), sub(C, 5), ["step"], ["pause", "wait"], ["update", 1, {}], ["step"],
              ["continue"]], kwargs=ONE_AT_A_TIME)
@example(ops=[["pause", "wait"], ["update", 1, {}], ["continue"], sub(A, 3), ["steps", 4]], kwargs=TWO)
@example(ops=[sub(A, 6), sub(B, 6), ["step"], ["pause", "wait"], ["update", 1, {"wait_timeout_s": 0}],
              ["update", 2, {}], ["step"], ["continue"]], kwargs=ONE_AT_A_TIME)
@example(ops=[sub(A, 6), sub(B, 6), ["steps", 3], ["abort", 1], ["pause", "wait"], ["update", 2, {}], ["step"],
              ["continue"]], kwargs=TWO)
def test_wait_drain_matches_the_reference(reference, paths, ops, kwargs):
    same_as_reference(reference, paths, ops, kwargs, "see Exercise 4 · Waiting for the requests in flight")


@pytest.mark.exercise("ch02.versions")
@DIFFERENTIAL
@given(ops=scenario(submit, step, steps, pause("keep", "retract", "wait"), update, cont), kwargs=engine_kwargs)
@example(ops=[sub(A, 9), ["steps", 2], ["pause", "keep"], ["update", 1, {}], ["continue"], ["steps", 2],
              ["pause", "keep"], ["update", 2, {}], ["continue"], ["steps", 2], ["pause", "keep"],
              ["update", 1, {}], ["continue"], ["steps", 8]], kwargs=TWO)
def test_spans_match_the_reference(reference, paths, ops, kwargs):
    same_as_reference(reference, paths, ops, kwargs, "see Exercise 1 · Which weights made each token")


@pytest.mark.exercise("ch02.flush_rules")
@DIFFERENTIAL
@given(ops=scenario(submit, step, steps, pause(), update, cont, flush, abort), kwargs=engine_kwargs)
@example(ops=[sub(A, 3), ["steps", 4], ["flush"], sub(B, 4), ["flush"], ["step"], ["flush"], ["pause", "wait"],
              ["flush"], ["continue"], ["steps", 6], ["flush"]], kwargs=ONE_AT_A_TIME)
@example(ops=[sub(A, 6), sub(B, 6), sub(C, 6), ["steps", 2], ["pause", "keep"], ["flush"], ["continue"],
              ["pause", "retract"], ["flush"], ["continue"], ["steps", 3], ["pause", "abort"], ["flush"]],
         kwargs=ONE_AT_A_TIME)
def test_flush_rules_match_the_reference(reference, paths, ops, kwargs):
    same_as_reference(reference, paths, ops, kwargs, "see Exercise 5 · When the cache may be flushed")
