"""Chapter 08, differential: the learner's token weights beside the reference on the same
random rollouts (versions the trainer holds, the current one, ones it dropped; labels that
sort differently as text; NaN and infinite log-probabilities; clips below and above 1;
spans that do not tile the rollout; float32, float64 and bfloat16 inputs): the same
weights (within float32 rounding), dtype and shape, the same error type, inputs unchanged.
See ``shared/twin.py``; the scenarios are in ``scenarios_ch08.py``."""
import math

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import twin
from engine_ops import DIFFERENTIAL

LABELS = ["step-9", "step-10", "step-11", "v2"]  # "step-10" < "step-9" as text
ODD = [math.nan, math.inf, -math.inf]
logp = st.one_of(st.floats(-12.0, 0.0), st.sampled_from([0.0, -30.0]), st.sampled_from(ODD))


@st.composite
def rollouts(draw):
    lengths = draw(st.lists(st.integers(1, 4), max_size=4))
    spans, start = [], 0
    for n in lengths:
        spans.append({"version": draw(st.sampled_from(LABELS)), "start": start, "end": start + n})
        start += n
    tokens = start
    fault = draw(st.sampled_from([None] * 6 + ["gap", "overlap", "empty", "short", "long"]))
    if fault and spans:
        i = draw(st.integers(0, len(spans) - 1))
        if fault == "gap":
            spans[i] = {**spans[i], "start": spans[i]["start"] + 1}
        elif fault == "overlap" and i > 0:
            spans[i] = {**spans[i], "start": spans[i]["start"] - 1}
        elif fault == "empty":  # an extra empty span where another starts: the rest still tiles
            spans.insert(i, {"version": draw(st.sampled_from(LABELS)), "start": spans[i]["start"],
                             "end": spans[i]["start"]})
    if fault == "short":
        tokens = max(tokens - 1, 0)
    elif fault == "long":
        tokens += 1
    current = draw(st.sampled_from(LABELS))
    held = draw(st.lists(st.sampled_from(LABELS), unique=True, max_size=4))
    now = draw(st.lists(logp, min_size=tokens, max_size=tokens))
    by_version = {v: draw(st.lists(logp, min_size=tokens, max_size=tokens)) for v in held}
    clip = draw(st.one_of(st.sampled_from([0.5, 1.0, 2.0, 5.0, 1e9]), st.floats(0.01, 20.0),
                          st.sampled_from([0.0, -1.0, math.nan])))
    return spans, current, now, by_version, clip


@pytest.mark.exercise("ch08.token_weights")
@DIFFERENTIAL
@given(rollout=rollouts(), dtype=st.sampled_from(["float32", "float32", "float64", "bfloat16"]))
@example(rollout=([], "v2", [], {}, 2.0), dtype="float32")
@example(rollout=([{"version": "step-9", "start": 0, "end": 2}, {"version": "step-10", "start": 2, "end": 3}],
                  "step-10", [-1.0, -2.0, -0.5], {"step-9": [-3.0, -1.0, -9.0], "step-10": [-9.0, -9.0, -9.0]}, 2.0),
         dtype="float32")
@example(rollout=([{"version": "step-9", "start": 0, "end": 3}], "step-10", [-1.0, math.nan, 0.0],
                  {"step-9": [-1.0, -2.0, -math.inf]}, 3.0), dtype="float64")
@example(rollout=([{"version": "step-9", "start": 0, "end": 2}], "v2", [-1.0, -5.0], {"step-9": [-2.0, -1.0]}, 0.5),
         dtype="bfloat16")
@example(rollout=([{"version": "v2", "start": 0, "end": 2}], "v2", [-1.0, -2.0], {}, 0.0), dtype="float32")
@example(rollout=([{"version": "v2", "start": 0, "end": 2}, {"version": "v2", "start": 3, "end": 4}], "v2",
                  [-1.0] * 4, {}, 2.0), dtype="float32")
@example(rollout=([{"version": "v2", "start": 0, "end": 2}], "v2", [-1.0] * 3, {}, 2.0), dtype="float32")
@example(rollout=([{"version": "v2", "start": 0, "end": 2}, {"version": "step-9", "start": 2, "end": 2},
                   {"version": "v2", "start": 2, "end": 3}], "v2", [-1.0] * 3, {}, 2.0), dtype="float32")
def test_token_weights_match_the_reference(reference, rollout, dtype):
    spans, current, now, by_version, clip = rollout
    kwargs = dict(spans=spans, current=current, logp_now=now, logp_by_version=by_version, clip=clip, dtype=dtype)
    mine = twin.run_here("scenarios_ch08:weights", **kwargs)
    theirs = reference.run("scenarios_ch08:weights", **kwargs)
    call = (f"importance({twin._short(spans, 160)}, current={current!r}, logp_now={twin._short(now, 80)} ({dtype}), "
            f"held={sorted(by_version)}, clip={clip!r})")
    # float32 weights: two correct answers may round the ratio apart by an ulp or two.
    twin.compare_results(call, mine, theirs, "see chapter 08, Exercise 2 · Weigh every token by its version",
                         rel_tol=1e-6, abs_tol=1e-7)
