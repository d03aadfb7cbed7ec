"""Public tests for chapter 00's exercises (run them: python practice/judge.py test ch00).

ch00.cold_start_phases: ``phases_from_marks(spawned_at, marks)`` in
course_lib/bench/cold_start.py. ch00.estimate_update: ``estimate_update(nbytes,
bandwidths, phases, chunks=, num_gpus=)`` in course_lib/sim/estimate.py. Each case says
what it expected in words.
"""
import math

import pytest

from course_lib.bench.cold_start import phases_from_marks
from course_lib.sim.estimate import TRANSPORTS, estimate_update

phases_case = pytest.mark.exercise("ch00.cold_start_phases")
estimate_case = pytest.mark.exercise("ch00.estimate_update")


@phases_case
def test_cold_start_phases_from_the_previous_mark():
    got = phases_from_marks(100.0, [("import_torch", 103.0), ("load_weights", 103.5), ("first_token", 104.0)])
    assert list(got) == ["import_torch", "load_weights", "first_token", "total"], \
        f"the phases in the order of the marks, then 'total'; got keys {list(got)}"
    assert got["import_torch"] == pytest.approx(3.0), "the first phase starts when the process was spawned"
    assert got["load_weights"] == pytest.approx(0.5), "each later phase starts at the mark before it"
    assert got["first_token"] == pytest.approx(0.5)
    assert got["total"] == pytest.approx(4.0), "total runs from the spawn to the last mark"


@phases_case
def test_cold_start_phases_no_marks():
    assert phases_from_marks(5.0, []) == {"total": 0.0}, "no marks: nothing but a total of 0 s"


@phases_case
def test_cold_start_phases_refuses_a_repeated_name():
    with pytest.raises(ValueError):
        phases_from_marks(0.0, [("load", 1.0), ("load", 2.0)])


@phases_case
def test_cold_start_phases_refuses_a_clock_going_backwards():
    with pytest.raises(ValueError):
        phases_from_marks(0.0, [("a", 2.0), ("b", 1.0)])


@estimate_case
def test_estimate_update_one_phase():
    got = estimate_update(2e9, {"copy": 1.0}, ("copy",))
    assert list(got) == ["copy", "total"], f"the phases in order, then 'total'; got keys {list(got)}"
    assert got["copy"] == pytest.approx(2.0), "2e9 bytes at 1 GB/s (1 GB = 1e9 bytes) take 2 s"
    assert got["total"] == pytest.approx(2.0)


@estimate_case
def test_estimate_update_disk_phases_one_after_the_other():
    got = estimate_update(8e9, {"read": 4.0, "host_to_device": 8.0, "copy": 800.0}, TRANSPORTS["disk"])
    assert got["read"] == pytest.approx(2.0) and got["host_to_device"] == pytest.approx(1.0), \
        "each phase moves all the bytes at its own bandwidth"
    assert got["copy"] == pytest.approx(0.01)
    assert got["total"] == pytest.approx(3.01), "without chunks the phases run one after the other: their sum"


@estimate_case
def test_estimate_update_shares_over_gpus():
    got = estimate_update(8e9, {"copy": 100.0}, ("copy",), num_gpus=4)
    assert got["copy"] == pytest.approx(0.02), "each of 4 GPUs receives a quarter of the bytes, all at once"


@estimate_case
def test_estimate_update_pipelined_chunks():
    got = estimate_update(4e9, {"read": 1.0, "copy": 4.0}, ("read", "copy"), chunks=4)
    # read 4 s, copy 1 s; the first chunk takes (4 + 1) / 4, the other three leave at the read's pace
    assert got["total"] == pytest.approx((5 + 3 * 4) / 4), \
        "pipelined: the first chunk passes every phase, then each further chunk at the slowest phase's pace"
    assert math.isclose(got["read"], 4.0), "a phase's own seconds do not depend on the chunks"


@estimate_case
def test_estimate_update_refuses_a_missing_bandwidth():
    with pytest.raises(ValueError):
        estimate_update(1e9, {"read": 1.0}, ("read", "copy"))
