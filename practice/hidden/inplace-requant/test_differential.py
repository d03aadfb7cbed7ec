"""Differential cases for inplace-requant: your answer and the reference answer on the same
seeded random inputs, everything observable compared.

``quantize``: random weights (shapes, float dtypes, numpy or torch, zero rows, exact ties,
tiny and huge values, wrong ranks): the result's types, dtypes, shapes, devices and every
value, the error type where one is raised, and the input left unchanged. ``hot_update``: a
layer holding an earlier version and a new weight of the right shape or a wrong one (one
a broadcast would accept, transposed, the same number of elements, another rank): the
error type, every value of qweight and scale after, and that they are the same objects at
the same address with the same shape, dtype, device and strides, and on a refusal that
nothing changed. ``pause_costs``: random requests as lists, numpy arrays or torch tensors,
every mode and an unknown one: the five entries (values; booleans apart from numbers).
The reference answer runs in another process (solution_twin.py); scenarios are
derandomized and the edge cases are explicit examples.
"""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import solution_twin
from solution_twin import DIFFERENTIAL

SLUG = "inplace-requant"
MODULE = "test_differential"
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}


reference = solution_twin.reference_fixture(SLUG)  # the reference answer's process, one per module


def weight(shape, seed, dtype="float32", kind="torch", zero_rows=(), ties=False, magnitude=1.0, device="cpu"):
    """A weight made from a seed the same way in both processes."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g, dtype=torch.float64) * magnitude
    if ties and len(shape) == 2 and shape[1] > 1:
        # row max 127 (scale 1) and halves elsewhere: every value is a tie
        halves = torch.randint(-120, 120, tuple(shape), generator=g).double() + 0.5
        halves[:, 0] = 127.0
        w = halves
    if len(shape) == 2:
        for r in zero_rows:
            if r < shape[0]:
                w[r] = 0
    if dtype == "float16":
        w = w.clamp(-6e4, 6e4)  # finite in float16
    w = w.to(DTYPES[dtype])
    if kind == "numpy":
        return w.float().numpy() if dtype == "bfloat16" else w.numpy()
    return w.to(device)


def describe(t):
    if isinstance(t, torch.Tensor):
        c = t.detach().cpu()
        values = c.tolist() if c.dtype != torch.bfloat16 else c.float().tolist()
        return {"type": "Tensor", "dtype": str(t.dtype), "shape": list(t.shape), "device": t.device.type,
                "values": values}
    if isinstance(t, np.ndarray):
        return {"type": "ndarray", "dtype": str(t.dtype), "shape": list(t.shape), "values": t.tolist()}
    return {"type": type(t).__name__, "repr": repr(t)[:200]}


def quantized(module, shape, seed, dtype, kind, zero_rows, ties, magnitude, device="cpu"):
    w = weight(shape, seed, dtype, kind, zero_rows, ties, magnitude, device)
    before = describe(w)
    try:
        got = module.quantize(w)
        result = {"returned": [describe(x) for x in got] if isinstance(got, tuple) else describe(got),
                  "returned a tuple of": len(got) if isinstance(got, tuple) else None}
    except Exception as exc:  # noqa: BLE001 - the error type is compared
        result = {"raised": type(exc).__name__}
    result["input unchanged"] = describe(w) == before
    return result


@st.composite
def quantize_cases(draw):
    rows, cols = draw(st.integers(1, 6)), draw(st.integers(1, 9))
    return dict(shape=[rows, cols], seed=draw(st.integers(0, 2**31)),
                dtype=draw(st.sampled_from(list(DTYPES))), kind=draw(st.sampled_from(["torch", "numpy"])),
                zero_rows=draw(st.lists(st.integers(0, rows - 1), max_size=2, unique=True)),
                ties=draw(st.booleans()), magnitude=draw(st.sampled_from([1.0, 1e-3, 50.0, 1e4])))


def _q(shape, **kw):
    base = dict(seed=1, dtype="float32", kind="torch", zero_rows=[], ties=False, magnitude=1.0)
    return {"shape": shape, **base, **kw}


@DIFFERENTIAL
@given(case=quantize_cases())
@example(case=_q([3, 4], ties=True))
@example(case=_q([3, 4], ties=True, kind="numpy"))
@example(case=_q([2, 5], zero_rows=[0, 1]))
@example(case=_q([1, 1]))
@example(case=_q([4, 3], dtype="float64", magnitude=50.0))
@example(case=_q([4, 3], dtype="bfloat16"))
@example(case=_q([4, 3], dtype="float16", kind="numpy", zero_rows=[2]))
@example(case=_q([0, 3]))       # no rows
@example(case=_q([5]))          # not 2-D
@example(case=_q([2, 3, 4]))    # not 2-D
def test_differential_quantize(candidate, reference, case):
    solution_twin.same_as_reference(candidate, reference, f"{MODULE}:quantized", f"quantize(<{case['kind']} {case['dtype']} weight of shape {case['shape']}, "
                          f"zero rows {case['zero_rows']}, ties {case['ties']}, scale {case['magnitude']}>)", "section `quantize(w)`", **case)


def _storage(t):
    return {"data_ptr": t.data_ptr(), "shape": list(t.shape), "dtype": str(t.dtype), "device": str(t.device),
            "stride": list(t.stride())}


def updated(module, rows, cols, new_shape, seed, dtype, kind, device="cpu"):
    """hot_update on a layer holding an earlier version; what the kernels would see after."""
    from layer import Int8Layer
    g = torch.Generator().manual_seed(seed + 1)
    layer = Int8Layer(torch.randint(-127, 128, (rows, cols), generator=g, dtype=torch.int8).to(device),
                      (torch.rand(rows, generator=g) + 0.01).to(device))
    q0, s0 = layer.qweight, layer.scale
    where_q, where_s = _storage(q0), _storage(s0)
    old_q, old_s = describe(q0), describe(s0)
    w = weight(new_shape, seed, dtype, kind, device=device)
    try:
        result = {"returned": repr(module.hot_update(layer, w))}
    except Exception as exc:  # noqa: BLE001 - the error type is compared
        result = {"raised": type(exc).__name__}
    result.update(
        qweight=describe(layer.qweight), scale=describe(layer.scale),
        same_objects=[layer.qweight is q0, layer.scale is s0],
        same_storage=[_storage(layer.qweight) == where_q, _storage(layer.scale) == where_s],
        captured_tensors_see=[describe(q0), describe(s0)],
        unchanged=[describe(layer.qweight) == old_q, describe(layer.scale) == old_s])
    return result


@st.composite
def update_cases(draw):
    rows, cols = draw(st.integers(1, 6)), draw(st.integers(1, 8))
    right = draw(st.integers(0, 2)) > 0  # two in three of the right shape
    new_shape = [rows, cols] if right else draw(st.sampled_from(
        [[1, cols], [cols], [cols, rows], [rows * cols], [rows, cols + 1], [rows + 1, cols], [1, rows, cols]]))
    return dict(rows=rows, cols=cols, new_shape=new_shape, seed=draw(st.integers(0, 2**31)),
                dtype=draw(st.sampled_from(list(DTYPES))), kind=draw(st.sampled_from(["torch", "numpy"])))


def _u(rows, cols, new_shape, **kw):
    return dict(rows=rows, cols=cols, new_shape=new_shape, **{"seed": 3, "dtype": "float32", "kind": "torch", **kw})


@DIFFERENTIAL
@given(case=update_cases())
@example(case=_u(3, 4, [3, 4]))
@example(case=_u(3, 4, [3, 4], kind="numpy", dtype="float64"))
@example(case=_u(3, 4, [1, 4]))      # a broadcast would copy one row into every row
@example(case=_u(3, 4, [4]))
@example(case=_u(3, 4, [4, 3]))      # transposed
@example(case=_u(2, 6, [3, 4]))      # the same number of elements
@example(case=_u(2, 6, [12], kind="numpy"))
@example(case=_u(1, 1, [1, 1]))
@example(case=_u(1, 4, [4]))
@example(case=_u(3, 4, [1, 3, 4]))
@example(case=_u(0, 4, [0, 4]))      # a layer with no rows
@example(case=_u(0, 4, [1, 4]))
def test_differential_hot_update(candidate, reference, case):
    solution_twin.same_as_reference(candidate, reference, f"{MODULE}:updated", f"hot_update(<layer [{case['rows']}, {case['cols']}] holding an earlier version>, "
                          f"<{case['kind']} {case['dtype']} weight of shape {case['new_shape']}>)", "section `hot_update(layer, new_w)`", **case)


def _plain(v):
    """A value as JSON: numbers as floats (an int and a float of one value are equal), booleans apart."""
    if isinstance(v, (bool, np.bool_)) or (isinstance(v, torch.Tensor) and v.dtype == torch.bool and v.numel() == 1):
        return {"bool": bool(v)}
    try:
        return {"number": float(v)}
    except (TypeError, ValueError):
        return {"other": type(v).__name__}


def costs(module, mode, done, left, prompt, step_ms, kind):
    convert = {"list": list, "numpy": np.array, "torch": torch.tensor}[kind]
    args = (convert(list(done)), convert(list(left)))
    try:
        got = module.pause_costs(mode, *args, prompt, step_ms)
        result = {"returned": {str(k): _plain(v) for k, v in got.items()} if isinstance(got, dict)
                  else {"not a dict": type(got).__name__}}
    except Exception as exc:  # noqa: BLE001 - the error type is compared
        result = {"raised": type(exc).__name__}
    result["arguments unchanged"] = [list(map(int, a)) for a in args] == [list(done), list(left)]
    return result


@st.composite
def cost_cases(draw):
    n = draw(st.integers(0, 6))
    return dict(mode=draw(st.sampled_from(["abort", "wait", "keep", "retract", "retract", "drain"])),
                done=draw(st.lists(st.integers(0, 40), min_size=n, max_size=n)),
                left=draw(st.lists(st.integers(0, 40), min_size=n, max_size=n)),
                prompt=draw(st.integers(0, 64)), step_ms=draw(st.sampled_from([0, 1, 7, 12.5, 33.3, 0.1])),
                kind=draw(st.sampled_from(["list", "numpy", "torch"])))


def _c(mode, done, left, **kw):
    return dict(mode=mode, done=done, left=left, **{"prompt": 5, "step_ms": 10, "kind": "list", **kw})


@DIFFERENTIAL
@given(case=cost_cases())
@example(case=_c("abort", [], []))
@example(case=_c("wait", [], []))
@example(case=_c("keep", [], []))
@example(case=_c("retract", [], []))
@example(case=_c("keep", [0, 3, 2, 0], [4, 0, 1, 0]))
@example(case=_c("retract", [0, 3, 2, 0], [4, 0, 1, 0], kind="numpy"))
@example(case=_c("abort", [0, 3, 2], [4, 0, 1], kind="torch"))
@example(case=_c("wait", [1, 2], [30, 7], step_ms=33.3, kind="torch"))
@example(case=_c("Retract", [1], [1]))
@example(case=_c("", [1], [1]))
def test_differential_pause_costs(candidate, reference, case):
    solution_twin.same_as_reference(candidate, reference, f"{MODULE}:costs", f"pause_costs({case['mode']!r}, done={case['done']}, left={case['left']} (as {case['kind']}), "
                          f"prompt={case['prompt']}, step_ms={case['step_ms']})", "section `pause_costs(mode, done, left, prompt, step_ms)`", rel_tol=1e-9, **case)

