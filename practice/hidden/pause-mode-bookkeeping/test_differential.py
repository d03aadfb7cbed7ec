"""Differential cases for pause-mode-bookkeeping: your answer and the reference answer on the
same seeded random lists of requests, everything observable compared.

Each scenario is a list of unfinished requests as ``pause_ledger`` receives them (running
or queued, some queued with generated tokens as after a preemption; prompts built from a
few whole blocks so requests share prefixes, whole-block lengths, twins), a block size and
a mode (the four, ``in_place``, and unknown ones). Compared: the ledger's keys, values and
their types (a count is an int, ``kv_fresh`` a bool), the error type where one is raised,
and that the requests were left as they were. The reference answer runs in another
process (solution_twin.py); scenarios are derandomized and the edge cases are explicit
examples.
"""
from __future__ import annotations

import copy
import random

from hypothesis import example, given
from hypothesis import strategies as st

import solution_twin
from solution_twin import DIFFERENTIAL

SLUG = "pause-mode-bookkeeping"
MODULE = "test_differential"
MODES = ["abort", "wait", "keep", "in_place", "retract"]


reference = solution_twin.reference_fixture(SLUG)  # the reference answer's process, one per module


def ledger(module, mode, requests, block_size):
    given_requests = copy.deepcopy(requests)
    try:
        got = module.pause_ledger(mode, given_requests, block_size)
        if isinstance(got, dict):
            result = {"returned": {str(k): v if isinstance(v, (bool, int, float, str, type(None))) else repr(v)
                                   for k, v in got.items()},
                      "types": {str(k): type(v).__name__ for k, v in got.items()}}
        else:
            result = {"returned": repr(got)[:200], "types": type(got).__name__}
    except Exception as exc:  # noqa: BLE001 - the error type is compared
        result = {"raised": type(exc).__name__}
    result["requests unchanged"] = given_requests == requests
    return result


@st.composite
def loads(draw):
    block_size = draw(st.sampled_from([1, 2, 3, 4, 8]))
    r = random.Random(draw(st.integers(0, 2**31)))
    blocks = [[r.randrange(256) for _ in range(block_size)] for _ in range(3)]
    requests = []
    for i in range(draw(st.integers(0, 7))):
        if requests and draw(st.integers(0, 3)) == 0:  # a twin of an earlier one (greedy duplicates)
            twin = dict(requests[draw(st.integers(0, len(requests) - 1))])
            twin["rid"] = f"r{i}"
            twin["running"] = draw(st.booleans())
            requests.append(twin)
            continue
        prompt = [t for b in draw(st.lists(st.integers(0, 2), max_size=3)) for t in blocks[b]]
        prompt += [r.randrange(256) for _ in range(draw(st.integers(0 if prompt else 1, block_size + 1)))]
        running = draw(st.booleans())
        generated = draw(st.integers(0, 2 * block_size + 2)) if running or draw(st.booleans()) else 0
        out = [t for b in draw(st.lists(st.integers(0, 2), max_size=1)) for t in blocks[b]][:generated]
        out += [r.randrange(256) for _ in range(generated - len(out))]
        requests.append({"rid": f"r{i}", "running": running, "token_ids": prompt + out,
                         "num_prompt_tokens": len(prompt)})
    mode = draw(st.sampled_from(MODES + MODES + ["Retract", "drain", ""]))
    return dict(mode=mode, requests=requests, block_size=block_size)


def _req(rid, running, prompt, out=()):
    return {"rid": rid, "running": running, "token_ids": list(prompt) + list(out), "num_prompt_tokens": len(prompt)}


A, B = [1, 2, 3, 4], [5, 6, 7, 8]
# two running twins of whole blocks, a running request sharing one block, one preempted, one queued
MIXED = [_req("a", True, A, B), _req("b", True, A, B), _req("c", True, A, [9]), _req("d", False, B, [1, 2]),
         _req("e", False, [7, 7, 7])]


@DIFFERENTIAL
@given(case=loads())
@example(case=dict(mode="retract", requests=[], block_size=4))
@example(case=dict(mode="keep", requests=[], block_size=4))
@example(case=dict(mode="abort", requests=[], block_size=4))
@example(case=dict(mode="retract", requests=MIXED, block_size=4))
@example(case=dict(mode="keep", requests=MIXED, block_size=4))
@example(case=dict(mode="in_place", requests=MIXED, block_size=4))
@example(case=dict(mode="abort", requests=MIXED, block_size=4))
@example(case=dict(mode="wait", requests=MIXED, block_size=4))
@example(case=dict(mode="retract", requests=MIXED, block_size=2))
@example(case=dict(mode="keep", requests=[_req("q", False, A), _req("p", False, A, [3])], block_size=4))
@example(case=dict(mode="retract", requests=[_req("x", True, A + B), _req("y", True, A + B)], block_size=4))
@example(case=dict(mode="retract", requests=[_req("x", True, A, B), _req("y", True, B, A)], block_size=4))
@example(case=dict(mode="restart", requests=MIXED, block_size=4))
def test_differential_pause_ledger(candidate, reference, case):
    shown = [(r["rid"], "running" if r["running"] else "queued", r["token_ids"], r["num_prompt_tokens"])
             for r in case["requests"]]
    solution_twin.same_as_reference(candidate, reference, f"{MODULE}:ledger", f"pause_ledger({case['mode']!r}, requests (rid, state, token_ids, num_prompt_tokens) = "
                          f"{shown}, block_size={case['block_size']})", "section `What the engine does, and what you return`", **case)
