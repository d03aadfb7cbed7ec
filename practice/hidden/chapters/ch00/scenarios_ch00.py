"""Chapter 00's parts called on JSON inputs, observed as JSON: run here on the learner's
``course_lib`` and in the reference's process (``twin``), for the differential cases.
A result keeps its keys' order (the contract fixes it); inputs are checked unchanged."""
from __future__ import annotations

import copy
from engine_scenarios import error_kind


def _observe(f, args: list, kwargs: dict) -> dict:
    before = copy.deepcopy([args, kwargs])
    try:
        out = f(*args, **kwargs)
        seen = {"returned": [[k, v] for k, v in out.items()] if isinstance(out, dict) else repr(out)}
    except Exception as exc:  # noqa: BLE001 - which error, compared with the reference's
        seen = {"raised": error_kind(exc)}
    seen["inputs_unchanged"] = repr([args, kwargs]) == repr(before)
    return seen


def phases(spawned_at, marks) -> dict:
    from course_lib.bench.cold_start import phases_from_marks
    return _observe(phases_from_marks, [spawned_at, marks], {})


def estimate(nbytes, bandwidths, phases, chunks, num_gpus) -> dict:
    from course_lib.sim.estimate import estimate_update
    return _observe(estimate_update, [nbytes, bandwidths, phases], {"chunks": chunks, "num_gpus": num_gpus})
