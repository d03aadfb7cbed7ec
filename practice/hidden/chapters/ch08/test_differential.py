"""Chapter 08, differential: the learner's token weights beside the reference on the same
random rollouts (versions the trainer holds, the current one, ones it dropped; labels that
sort differently as text; NaN and infinite log-probabilities; clips below and above 1;
spans that do not tile the rollout; float32, float64 and bfloat16 inputs): the same
weights (within float32 rounding), dtype and shape, the same error type, inputs unchanged.
And the learner's per-step sync beside the reference's on the same engines, tensors, pause
modes, labels and faults: what it returns, which error, the engine calls it makes and in
which order, the engine afterwards (see the step_sync section below).
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


# ---- ch08.step_sync ----------------------------------------------------------------------------
#
# What is compared (``scenarios_ch08.sync_step``): what the sync returns (its fields; the phases
# in order, "pause" first, the engine's phases as the update step reported them, "continue"
# last; each engine figure and its type; the bytes and their type) or which error it raises;
# the engine calls it made, in order, with their arguments (pause in which mode, the update
# step, update and flush calls, continue); the engine afterwards (paused or not, its label,
# its pause records, its update count) and what the requests in flight became.
# Timing: "pause" and "continue" are checked by construction only, as the contract states
# them (milliseconds, on a monotonic clock, of the pause and of the resume): every engine call
# moves the monotonic clocks by its own known amount (pause 1e5 s, update 1e6 s per call,
# flush 1e7 s, continue 1e4 s), and the figures are compared in units of 1000 s, so a figure
# in seconds, on the wall clock, or holding another call's time differs, while the real time
# of a call (milliseconds here; a phase would need over 500 s of it to round differently)
# never shows. The exact message of an error is left free by the contract: only its type is
# compared. The engine's own phase figures are replaced by fixed ones inside the engine's
# update call, so they compare exactly.

SYNC_EXPLAIN = "see chapter 08, Exercise 1 · The per-step sync (notebooks/08_hot_updates_in_an_rl_loop.ipynb)"
MODES = ["keep", "retract", "abort", "wait"]
BAD_LABELS = ["", None, 5, "<bytes>", ["step-1"]]  # "<bytes>" stands for b"step-1"


def sync_case(transport="inprocess", pause_mode=None, version="step-1", seed=0, fault=None, in_flight=0,
              paused_before=None, bucket_kb=4):
    return dict(transport=transport, pause_mode=pause_mode, version=version, seed=seed, fault=fault,
                in_flight=in_flight, paused_before=paused_before, bucket_kb=bucket_kb)


sync_cases = st.builds(
    sync_case, transport=st.sampled_from(["inprocess", "inprocess", "ipc"]),
    pause_mode=st.sampled_from([None, None] + MODES + ["freeze"]),
    version=st.one_of(st.sampled_from(["step-1", "step-10", "v2"]), st.sampled_from(BAD_LABELS)),
    seed=st.integers(0, 10_000), fault=st.sampled_from([None, None, None, "shape", "name", "dtype"]),
    in_flight=st.integers(0, 3), paused_before=st.sampled_from([None, None, None] + MODES),
    bucket_kb=st.sampled_from([4, 16]))


@pytest.mark.exercise("ch08.step_sync")
@DIFFERENTIAL
@given(case=sync_cases)
@example(case=sync_case())                                            # idle engine: no pause, no resume, about 0
@example(case=sync_case(pause_mode="keep", in_flight=3, seed=1))
@example(case=sync_case(pause_mode="retract", in_flight=2, seed=2))
@example(case=sync_case(pause_mode="abort", in_flight=2, seed=3))
@example(case=sync_case(pause_mode="wait", in_flight=1, seed=4))
@example(case=sync_case("ipc", "keep", in_flight=2, seed=5))           # the same sync through IpcSync
@example(case=sync_case("ipc", None, seed=6, bucket_kb=16))
@example(case=sync_case(pause_mode="abort", fault="shape", in_flight=2, seed=7))  # resumed, then the error
@example(case=sync_case(pause_mode="keep", fault="dtype", in_flight=1, seed=8))
@example(case=sync_case("ipc", "retract", fault="name", in_flight=2, seed=9))
@example(case=sync_case(fault="name", seed=10))                        # fails with no pause: no resume either
@example(case=sync_case(in_flight=2, seed=11))                         # busy engine, no pause: the engine refuses
@example(case=sync_case(pause_mode="freeze", in_flight=2, seed=12))    # unknown mode: refused, nothing changes
@example(case=sync_case(pause_mode="keep", paused_before="wait", in_flight=2, seed=13))  # refused: stays paused
@example(case=sync_case(pause_mode="retract", paused_before="retract", in_flight=2, seed=14))
@example(case=sync_case(pause_mode="abort", version="", in_flight=1, seed=15))  # bad labels: nothing touched
@example(case=sync_case(pause_mode="keep", version=None, seed=16))
@example(case=sync_case(version=5, seed=17))
@example(case=sync_case(pause_mode="wait", version="<bytes>", seed=18))
@example(case=sync_case("ipc", "keep", version=["step-1"], seed=19))
def test_step_sync_matches_the_reference(reference, case):
    mine = twin.run_here("scenarios_ch08:sync_step", **case)
    theirs = reference.run("scenarios_ch08:sync_step", **case)
    sync = "InProcessSync" if case["transport"] == "inprocess" else f"IpcSync(bucket_bytes={case['bucket_kb']} << 10)"
    version = 'b"step-1"' if case["version"] == "<bytes>" else repr(case["version"])
    call = (f"{sync}(engine).sync(<the trainer's tensors{', one ' + case['fault'] + ' fault' if case['fault'] else ''}>, "
            f"{version}, pause_mode={case['pause_mode']!r}) on an engine with {case['in_flight']} request(s) in "
            f"flight{', already paused in ' + case['paused_before'] if case['paused_before'] else ''} (seed "
            f"{case['seed']}; engine calls move the monotonic clocks by pause 1e5 s, update 1e6 s each, flush "
            f"1e7 s, continue 1e4 s; 'pause' and 'continue' shown in units of 1000 s)")
    twin.compare_results(call, mine, theirs, SYNC_EXPLAIN)
