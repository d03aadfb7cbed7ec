"""Hidden tests for notebooks/00_why_hot_updates.ipynb: a back-of-envelope update time.

``check_estimate_update_seconds(estimate)``: the learner's
``estimate(params, bytes_per_param, num_gpus, bandwidth_gbps) -> seconds`` is called on
fresh random sizes and compared with bytes / (GPUs x GB/s); then, on a real random
float32 checkpoint of random shape, it must predict the bytes a running engine reports
for the update, and its estimate at this machine's measured copy bandwidth must be within
a generous factor of the engine's measured in-place copy time.

Returns a list of failure messages (empty: passed); see ``__init__.py`` for why.
"""
from __future__ import annotations

import math
import os
import random
import tempfile
import time

import torch

from course_lib import Engine
from course_lib.weights.checkpoint import CheckpointReader, make_random, preset

# Measured copy times on a shared 2-core machine swing a lot; the estimate is an ideal,
# so the engine may be slower (per-tensor overhead) but hardly faster than raw memcpy.
SLOWER_BOUND, FASTER_BOUND = 200.0, 0.1


def _rng(seed) -> random.Random:
    return random.Random(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))


def _formula(params, bytes_per_param, num_gpus, bandwidth_gbps) -> float:
    return params * bytes_per_param / num_gpus / (bandwidth_gbps * 1e9)


def _call(estimate, *args):
    value = estimate(*args)
    return float(value)


def _copy_gbps(nbytes: int) -> float:
    """This machine's plain memcpy bandwidth in GB/s, best of a few tries."""
    src = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return src.numel() / best / 1e9


def check_formula(estimate, rng: random.Random) -> list[str]:
    failures = []
    cases = [(32e9, 2, 4, 400.0)]  # the handbook's question, with a round IPC bandwidth
    for _ in range(20):
        cases.append((rng.randint(10**6, 10**12), rng.choice([0.5, 1, 2, 4]), rng.choice([1, 2, 4, 8]),
                      round(rng.uniform(0.5, 2000.0), 3)))
    for params, bpp, gpus, gbps in cases:
        try:
            got = _call(estimate, params, bpp, gpus, gbps)
        except Exception as exc:  # report, do not raise: see __init__.py
            return [f"estimate_update_seconds({params}, {bpp}, {gpus}, {gbps}) raised {type(exc).__name__}: {exc}"]
        want = _formula(params, bpp, gpus, gbps)
        if not math.isfinite(got) or not math.isclose(got, want, rel_tol=1e-6):
            failures.append(f"{params:,} parameters x {bpp} bytes on {gpus} GPUs at {gbps} GB/s each: "
                            f"you estimated {got!r} s, expected {want:.6g} s (each GPU receives its share "
                            f"of the bytes at the given bandwidth, all GPUs at once; 1 GB = 1e9 bytes)")
            if len(failures) >= 3:
                break
    return failures


def check_against_engine(estimate, rng: random.Random) -> list[str]:
    # float32: on a CPU the engine computes in float32, so a bfloat16 checkpoint would also
    # time a conversion that the bytes-over-bandwidth estimate does not model.
    dtype = torch.float32
    # Wide MLPs (a few tens of MB) so that bytes, not per-tensor overhead, set the copy time.
    config = preset("small", hidden_size=256, intermediate_size=rng.choice([1024, 1536, 2048]),
                    num_hidden_layers=rng.randint(2, 4), torch_dtype=str(dtype).removeprefix("torch."))
    with tempfile.TemporaryDirectory() as tmp:
        old = make_random(f"{tmp}/old", config, seed=rng.randrange(10_000))
        new = make_random(f"{tmp}/new", config, seed=rng.randrange(10_000, 20_000))
        reader = CheckpointReader(new)
        params = sum(math.prod(shape) for shape, _ in reader.metadata().values())
        tensors = dict(reader.iter_tensors())
        engine = Engine(old, max_model_len=64)
        results = [engine.update_weights_from_tensor(tensors) for _ in range(6)][1:]  # the first touches fresh pages
    bytes_per_param = dtype.itemsize
    where = f"a {params:,}-parameter {str(dtype).removeprefix('torch.')} checkpoint"
    try:
        at_one_gbps = _call(estimate, params, bytes_per_param, 1, 1.0)
    except Exception as exc:
        return [f"estimate_update_seconds raised {type(exc).__name__} on {where}: {exc}"]
    engine_bytes = results[0]["bytes"]
    if not math.isclose(at_one_gbps * 1e9, engine_bytes, rel_tol=1e-6):
        return [f"{where}: at 1 GB/s on one GPU your estimate implies {at_one_gbps * 1e9:,.0f} bytes, "
                f"but the engine reports moving {engine_bytes:,} bytes"]
    gbps = _copy_gbps(engine_bytes)
    predicted = _call(estimate, params, bytes_per_param, 1, gbps)
    measured = min(r["timings_ms"]["copy"] for r in results) / 1e3
    if not FASTER_BOUND * predicted <= measured <= SLOWER_BOUND * predicted:
        return [f"{where}: at this machine's copy bandwidth ({gbps:.1f} GB/s) you predicted {predicted * 1e3:.3f} ms "
                f"for the in-place copy; the engine measured {measured * 1e3:.3f} ms, outside "
                f"{FASTER_BOUND}x to {SLOWER_BOUND}x of the prediction"]
    return []


def check_estimate_update_seconds(estimate, seed=None) -> list[str]:
    """Failures of ``estimate(params, bytes_per_param, num_gpus, bandwidth_gbps) -> seconds``."""
    rng = _rng(seed)
    failures = check_formula(estimate, rng)  # the candidate first, on fresh sizes
    if failures:
        return failures
    return check_against_engine(estimate, rng)
