"""Differential cases for partial-rollout-sync: your answer and the reference answer on the
same seeded random batches, everything observable compared.

Each scenario: a fresh engine on a checkpoint made from a seed, a batch of prompts with
their own lengths (some finishing before the sync, none at all), an overlap and a mode.
Compared: the outputs in order (tokens, text, finish reason, token counts and each
token's weight version; request ids apart), the error type if one is raised, the calls
made on the engine (the requests submitted before the sync, in order; those submitted
again after it, in any order; the pause mode, the update's version, tensors and options;
the resume), the engine's last pause record, whether it is paused, its version label, and
what it generates afterwards. The reference answer runs in another process
(solution_twin.py); scenarios are derandomized and the edge cases are explicit examples.
"""
from __future__ import annotations

import random
import tempfile

from hypothesis import example, given
from hypothesis import strategies as st

import solution_twin
from solution_twin import DIFFERENTIAL

SLUG = "partial-rollout-sync"
MODULE = "test_differential"
MODES = ["keep", "retract", "abort", "wait"]


reference = solution_twin.reference_fixture(SLUG)  # the reference answer's process, one per module


def _record(engine, calls, new_names):
    def wrap(name, record):
        original = getattr(engine, name)

        def call(*args, **kwargs):
            calls.append(record(*args, **kwargs))
            return original(*args, **kwargs)
        setattr(engine, name, call)

    def update(named_tensors, *args, **kwargs):
        pairs = list(named_tensors) if isinstance(named_tensors, (list, tuple)) else None
        names = [n for n, _ in pairs] if pairs is not None else type(named_tensors).__name__
        return ["update_weights_from_tensor", "the new weights" if names == new_names else names,
                [repr(a) for a in args], {k: repr(v) for k, v in sorted(kwargs.items())}]

    wrap("add_request", lambda prompt=None, sampling_params=None, *a, **kw: [
        "add_request", prompt, dict(sorted((sampling_params or {}).items())), [repr(x) for x in a],
        sorted(kw)])
    wrap("pause_generation", lambda mode="abort": ["pause_generation", mode])
    wrap("continue_generation", lambda: ["continue_generation"])
    wrap("update_weights_from_tensor", update)


def _normalize(calls):
    """Requests submitted again after the pause may come in any order: sorted."""
    cut = next((i for i, c in enumerate(calls) if c[0] == "pause_generation"), len(calls))
    after = calls[cut:]
    again = sorted((c for c in after if c[0] == "add_request"), key=repr)
    return calls[:cut] + [c for c in after if c[0] != "add_request"] + [["submitted again", again]]


def _output(out):
    if not isinstance(out, dict):
        return {"not a dict": type(out).__name__}
    meta = out.get("meta_info", {})
    return {"output_ids": out.get("output_ids"), "text": out.get("text"),
            "finish_reason": meta.get("finish_reason"), "completion_tokens": meta.get("completion_tokens"),
            "prompt_tokens": meta.get("prompt_tokens"), "weight_versions": meta.get("weight_versions")}


_VERSIONS: dict = {}


def rollout(module, mode, seed, lengths, overlap, temperature):
    from course_lib import Engine
    from course_lib.weights.checkpoint import make_random, preset, random_state_dict
    rng = random.Random(seed)
    pair = seed % 3  # three pairs of versions, made once per process
    if pair not in _VERSIONS:
        tmp = tempfile.mkdtemp(prefix="rollout-diff-")
        config = preset("tiny")
        _VERSIONS[pair] = (make_random(f"{tmp}/old", config, seed=11 + pair),
                           random_state_dict(config, seed=1011 + pair))
    old, new = _VERSIONS[pair]
    engine = Engine(old, block_size=4)
    prompts = ["".join(rng.choice("abcdefgh ") for _ in range(rng.randint(1, 9))) for _ in lengths]
    params = [{"max_new_tokens": k, "temperature": temperature, "seed": rng.randrange(10 ** 6), "ignore_eos": True}
              for k in lengths]
    version = f"v{rng.randrange(100, 999)}"
    calls: list = []
    _record(engine, calls, list(new))
    try:
        outs = module.overlap_and_sync(engine, list(prompts), [dict(p) for p in params], list(new.items()),
                                       version, mode, overlap)
        result = {"returned": [_output(o) for o in outs] if isinstance(outs, list) else type(outs).__name__}
    except Exception as exc:  # noqa: BLE001 - the error type is compared
        result = {"raised": type(exc).__name__}
    for name in ("add_request", "pause_generation", "continue_generation", "update_weights_from_tensor"):
        delattr(engine, name)
    last = engine.pause_stats[-1] if engine.pause_stats else None
    result.update(calls=_normalize(calls), last_pause_mode=getattr(last, "mode", None), paused=engine.paused,
                  weight_version=engine.weight_version, version_asked=version)
    if not engine.paused:
        after = engine.generate(["hot equals cold"], {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True})
        result["generates after"] = after[0]["output_ids"]
    return result


@st.composite
def batches(draw):
    overlap = draw(st.integers(0, 5))
    n = draw(st.integers(0, 5))
    lengths = draw(st.lists(st.integers(1, overlap + 8), min_size=n, max_size=n))
    return dict(mode=draw(st.sampled_from(MODES)), seed=draw(st.integers(0, 10 ** 6)), lengths=lengths,
                overlap=overlap, temperature=draw(st.sampled_from([0.0, 1.0])))


def _b(mode, lengths, overlap, seed=7, temperature=1.0):
    return dict(mode=mode, seed=seed, lengths=lengths, overlap=overlap, temperature=temperature)


@DIFFERENTIAL
@given(case=batches())
@example(case=_b("keep", [], 2))
@example(case=_b("abort", [], 1))
@example(case=_b("retract", [6, 2, 9, 5], 3))     # the second finishes before the sync
@example(case=_b("abort", [2, 7, 5, 9], 3))       # the first asks for the fewest tokens
@example(case=_b("wait", [4, 8, 6], 2))
@example(case=_b("keep", [3, 3, 3], 3))           # all finish exactly at the sync
@example(case=_b("abort", [5, 4], 0))             # no overlap: the sync comes first
@example(case=_b("retract", [1], 4, temperature=0.0))
def test_differential_overlap_and_sync(candidate, reference, case):
    solution_twin.same_as_reference(candidate, reference, f"{MODULE}:rollout", f"overlap_and_sync(<fresh engine, seed {case['seed']}>, {len(case['lengths'])} prompts of "
        f"{case['lengths']} tokens (temperature {case['temperature']}), <new weights>, <version>, "
        f"{case['mode']!r}, overlap_steps={case['overlap']})", "steps 1-5 of the task", **case)
