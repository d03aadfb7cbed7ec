"""Chapter 00, differential: the learner's cold-start timer and update estimate beside the
reference on the same random inputs (valid ones, and ones the contract refuses): the same
phases in the same order (within rounding), the same error type, inputs left unchanged.
See ``shared/twin.py``; the scenarios are in ``scenarios_ch00.py``."""
import math

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import twin
from engine_ops import DIFFERENTIAL

# Two correct answers may subtract or divide in another order: equal within rounding
# (times near 1.8e9 s carry about 2e-7 s of rounding each).
TOLERANCE = {"rel_tol": 1e-9, "abs_tol": 1e-6}
NAMES = ["import_torch", "load_weights", "first_token", "device_init", "total"]
ODD = [math.nan, math.inf, -math.inf]


def _compare(reference, scenario, call, explain, **kwargs):
    mine = twin.run_here(f"scenarios_ch00:{scenario}", **kwargs)
    theirs = reference.run(f"scenarios_ch00:{scenario}", **kwargs)
    twin.compare_results(call, mine, theirs, explain, **TOLERANCE)


@st.composite
def timelines(draw):
    """A spawn time and marks after it: steps of zero, microseconds or seconds, now and
    then a repeated or reserved name, a step back, or a time that is not finite."""
    start = draw(st.one_of(st.floats(1.6e9, 1.9e9), st.just(0.0), st.sampled_from(ODD)) if draw(st.booleans())
                 else st.floats(1.6e9, 1.9e9))
    t, marks = (start if math.isfinite(start) else 1.8e9), []
    for i in range(draw(st.integers(0, 6))):
        t += draw(st.sampled_from([0.0, 1e-6, 0.25, 3.0, -1e-3]) if draw(st.integers(0, 9)) == 0
                  else st.sampled_from([0.0, 1e-6, 1e-3, 0.25, 3.0]))
        at = draw(st.sampled_from(ODD)) if draw(st.integers(0, 19)) == 0 else t
        name = draw(st.sampled_from(NAMES)) if draw(st.integers(0, 4)) == 0 else f"phase_{i}"
        marks.append([name, at] if draw(st.booleans()) else (name, at))
    return start, marks


@pytest.mark.exercise("ch00.cold_start_phases")
@DIFFERENTIAL
@given(timeline=timelines())
@example(timeline=(1.8e9, []))
@example(timeline=(1.8e9, [("a", 1.8e9), ("b", 1.8e9)]))
@example(timeline=(100.0, [("import_torch", 103.0), ("load_weights", 103.5), ("total", 104.0)]))
@example(timeline=(100.0, [("a", 101.0), ("a", 102.0)]))
@example(timeline=(100.0, [("a", 99.0)]))
@example(timeline=(100.0, [("a", 102.0), ("b", 101.0)]))
@example(timeline=(math.nan, [("a", 1.0)]))
@example(timeline=(100.0, [["a", math.inf]]))
def test_cold_start_phases_match_the_reference(reference, timeline):
    start, marks = timeline
    _compare(reference, "phases", f"phases_from_marks({start!r}, {twin._short(marks, 200)})",
             "see chapter 00, Exercise 1 · The cold-start timer", spawned_at=start, marks=list(marks))


phase_lists = st.one_of(st.sampled_from([["read", "host_to_device", "copy"], ["copy"], ["network", "copy"]]),
                        st.lists(st.sampled_from(["read", "host_to_device", "copy", "network", "total"]), max_size=4))
rates = st.one_of(st.floats(0.5, 3000.0), st.sampled_from([0.0, -5.0, *ODD]))
counts = st.one_of(st.integers(1, 8), st.sampled_from([0, -1, True]))


@pytest.mark.exercise("ch00.estimate_update")
@DIFFERENTIAL
@given(nbytes=st.one_of(st.integers(0, 10**11), st.floats(0, 1e11), st.sampled_from([-1, *ODD])),
       phases=phase_lists,
       bandwidths=st.dictionaries(st.sampled_from(["read", "host_to_device", "copy", "network", "extra"]),
                                  st.one_of(st.floats(0.5, 3000.0), rates), max_size=5),
       chunks=counts, num_gpus=counts, fill=st.booleans())
@example(nbytes=0, phases=["read", "host_to_device", "copy"], bandwidths={"read": 5.0, "host_to_device": 50.0,
                                                                          "copy": 2000.0}, chunks=1, num_gpus=1, fill=False)
@example(nbytes=16e9, phases=["read", "host_to_device", "copy"], bandwidths={"read": 5.0, "host_to_device": 50.0,
                                                                             "copy": 2000.0}, chunks=8, num_gpus=2, fill=False)
@example(nbytes=0, phases=["copy"], bandwidths={}, chunks=1, num_gpus=1, fill=False)
@example(nbytes=1e9, phases=[], bandwidths={"copy": 1.0}, chunks=1, num_gpus=1, fill=False)
@example(nbytes=1e9, phases=["copy", "copy"], bandwidths={"copy": 1.0}, chunks=1, num_gpus=1, fill=False)
@example(nbytes=1e9, phases=["copy"], bandwidths={"copy": 1.0}, chunks=True, num_gpus=1, fill=False)
@example(nbytes=1e9, phases=["copy"], bandwidths={"copy": 1.0}, chunks=1, num_gpus=0, fill=False)
def test_estimate_update_matches_the_reference(reference, nbytes, phases, bandwidths, chunks, num_gpus, fill):
    for phase in phases if fill else []:  # half the draws: a usable rate for every phase
        bandwidths.setdefault(phase, 10.0 * (1 + len(phase)))
    _compare(reference, "estimate", f"estimate_update({nbytes!r}, {bandwidths}, {phases}, chunks={chunks!r}, "
             f"num_gpus={num_gpus!r})", "see chapter 00, Exercise 2 · How long will a hot update take?",
             nbytes=nbytes, bandwidths=bandwidths, phases=phases, chunks=chunks, num_gpus=num_gpus)
