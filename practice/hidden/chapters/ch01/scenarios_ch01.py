"""Chapter 01 scenarios for the differential cases (``test_differential.py``): plain functions
of JSON-able arguments, run on the learner's ``course_lib`` and on the reference's (see
``twin.py``); each builds its layers and tensors from the arguments (tensors from a seed)
and returns what it observed, as JSON.
"""
from __future__ import annotations


import torch

from engine_scenarios import tensor_digest as digest, error_kind

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def _outcome(f) -> dict:
    try:
        out = f()
    except Exception as exc:  # noqa: BLE001 - which error, compared with the reference's
        return {"raised": error_kind(exc)}
    if isinstance(out, (tuple, list)):
        # A pair (first row, rows): its values and whether they are plain ints (a float row
        # count, say 8.0 from a true division, reads equal in JSON and is not).
        return {"returned": list(out), "length": len(out), "plain_ints": all(type(v) is int for v in out)}
    return {"returned": repr(out)}


# ---- exercises 1 and 2: where each shard lands ----------------------------------------------

def qkv_rows(hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, tp_size: int, shard_ids: list) -> list:
    """Every rank's answer for every shard id: [rank, shard id, outcome]."""
    from course_lib.layers.linear import QKVParallelLinear
    torch.set_num_threads(1)
    out = []
    for rank in range(tp_size):
        layer = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, tp_rank=rank, tp_size=tp_size)
        for s in shard_ids:
            out.append([rank, s, _outcome(lambda: layer.shard_rows(s))])
    return out


def gate_up_rows(hidden: int, output_sizes: list, tp_size: int, shard_ids: list) -> list:
    """Every rank's answer for every shard id: [rank, shard id, outcome], and the layer's
    output sizes afterwards (read, never changed)."""
    from course_lib.layers.linear import MergedColumnParallelLinear
    torch.set_num_threads(1)
    out = []
    for rank in range(tp_size):
        layer = MergedColumnParallelLinear(hidden, list(output_sizes), tp_rank=rank, tp_size=tp_size)
        for s in shard_ids:
            out.append([rank, s, _outcome(lambda: layer.shard_rows(s))])
        out.append([rank, "output_sizes after", list(layer.output_sizes)])
    return out


# ---- exercise 3: a rank's slice -------------------------------------------------------------

def _tensor(seed: int, shape: list, dtype: str, layout: str) -> torch.Tensor:
    """A tensor of ``shape`` from ``seed``: contiguous, a transposed view (non-contiguous),
    or a view that starts inside a larger storage."""
    gen = torch.Generator().manual_seed(seed)
    if layout == "transposed" and len(shape) >= 2:
        base = torch.randn(list(reversed(shape)), generator=gen).to(DTYPES[dtype])
        return base.permute(*reversed(range(len(shape))))
    if layout == "offset":
        base = torch.randn([shape[0] + 2] + list(shape[1:]), generator=gen).to(DTYPES[dtype])
        return base[1:shape[0] + 1]
    return torch.randn(shape, generator=gen).to(DTYPES[dtype])


def tp_slice(shape: list, dtype: str, layout: str, dim: int, tp_size: int, seed: int) -> list:
    """Every rank's slice of one tensor: shape, dtype, device, values, and whether it is a
    view of the given tensor (same storage; its offset and strides), or which error; and
    the tensor afterwards (never changed)."""
    from course_lib.layers.linear import ColumnParallelLinear
    torch.set_num_threads(1)
    out = []
    for rank in range(tp_size):
        loaded = _tensor(seed, shape, dtype, layout)
        before = digest(loaded)
        layer = ColumnParallelLinear(2, tp_size, tp_rank=rank, tp_size=tp_size)
        try:
            got = layer._shard(loaded, dim)
        except Exception as exc:  # noqa: BLE001 - which error, compared with the reference's
            entry = {"raised": error_kind(exc)}
        else:
            is_tensor = isinstance(got, torch.Tensor)
            entry = {"type": type(got).__name__}
            if is_tensor:
                same = got.untyped_storage().data_ptr() == loaded.untyped_storage().data_ptr()
                entry.update(shape=list(got.shape), dtype=str(got.dtype), device=str(got.device), values=digest(got),
                             shares_the_storage=same, storage_offset=got.storage_offset() if same else None,
                             stride=list(got.stride()) if same else None)
        entry["tensor_unchanged"] = digest(loaded) == before
        out.append([rank, entry])
    return out


# ---- exercise 4: copy a shard in place ------------------------------------------------------

def _own_rows(kind, sizes, tp_size, shard_id):
    """Where each shard lands, worked out here (not by the learner's exercises 1 and 2)."""
    if kind == "plain":
        return 0, sum(sizes) // tp_size
    if kind == "merged":
        return sum(s // tp_size for s in sizes[:shard_id]), sizes[shard_id] // tp_size
    q, kv = sizes  # heads: rows are heads * head_dim (head_dim 2 here)
    qr, kr = q // tp_size * 2, kv // tp_size * 2
    return {"q": (0, qr), "k": (qr, kr), "v": (qr + kr, kr)}[shard_id]


def _layer(kind, sizes, hidden, tp_size, rank):
    from course_lib.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear
    if kind == "plain":
        return ColumnParallelLinear(hidden, sizes[0], tp_rank=rank, tp_size=tp_size)
    if kind == "merged":
        return MergedColumnParallelLinear(hidden, list(sizes), tp_rank=rank, tp_size=tp_size)
    return QKVParallelLinear(hidden, 2, sizes[0], sizes[1], tp_rank=rank, tp_size=tp_size)


def local_loader(kind: str, sizes: list, hidden: int, tp_size: int, rank: int, shard_id, local_shape: str,
                 local_dtype: str, param_kind: str, param_name, seed: int) -> dict:
    """Copy one shard into a layer's weight (filled with random values first, so a stray
    write shows): what it returned or which error (and whether the message names the
    parameter), the weight's values, dtype and shape afterwards, whether its storage and
    the layer's parameter object are the same as before, and the shard afterwards.

    ``local_shape``: "exact" (the rows' shape), "one_row" ([1, in], would broadcast), "flat"
    (the same number of elements), "transposed", "fewer_rows", "extra_dim"."""
    torch.set_num_threads(1)
    layer = _layer(kind, sizes, hidden, tp_size, rank)
    layer.shard_rows = lambda s=None: _own_rows(kind, sizes, tp_size, s)  # exercises 1 and 2, as they should be
    gen = torch.Generator().manual_seed(seed)
    weight = layer.weight
    with torch.no_grad():
        weight.copy_(torch.randn(weight.shape, generator=gen))
    param = weight if param_kind == "parameter" else weight.detach().clone()
    if param_name is not None:
        param.param_name = param_name
    start, rows = _own_rows(kind, sizes, tp_size, shard_id)
    cols = param.shape[1]
    shape = {"exact": [rows, cols], "one_row": [1, cols], "flat": [rows * cols], "transposed": [cols, rows],
             "fewer_rows": [max(rows - 1, 0), cols], "extra_dim": [1, rows, cols]}[local_shape]
    local = (torch.randn(shape, generator=gen) * 10).to(DTYPES[local_dtype])
    local_before, param_before, ptr = digest(local), digest(param), param.data_ptr()
    try:
        returned = layer.local_loader(param, local, shard_id)
        out = {"returned": repr(returned)}
    except Exception as exc:  # noqa: BLE001 - which error, compared with the reference's
        out = {"raised": error_kind(exc),
               "message_names_the_parameter": param_name is None or param_name in str(exc)}
    want = param.detach().clone()
    want_rows = None
    out.update(param_values=digest(param), param_unchanged=digest(param) == param_before,
               param_dtype=str(param.dtype), param_shape=list(param.shape), same_storage=param.data_ptr() == ptr,
               layer_weight_is_the_same_object=layer.weight is weight, local_unchanged=digest(local) == local_before)
    if "returned" in out:
        # The rows hold the shard (in the weight's dtype); every other row is as it was.
        want_rows = local.to(param.dtype).reshape(rows, cols) if local_shape == "exact" else None
        out["rows_hold_the_shard"] = want_rows is not None and torch.equal(want[start:start + rows], want_rows)
    return out


# ---- exercise 5: a chained block hash -------------------------------------------------------

def block_hash(calls: list) -> list:
    """``calls``: [salt, prefix, tokens, as_tuple]; a prefix ["ref", j] is the hash call j
    returned. Per call: whether it returned a plain int, whether that is -1 (the "no hash"
    mark), the first call that returned the same value (which calls agree is what the
    contract fixes, not the numbers), and whether its tokens were left unchanged."""
    from course_lib.engine.block_manager import BlockManager
    torch.set_num_threads(1)
    bm = BlockManager(4, 4)
    values, out = [], []
    for salt, prefix, tokens, as_tuple in calls:
        if isinstance(prefix, list):
            prefix = values[prefix[1]]
        bm.salt = salt
        given = tuple(tokens) if as_tuple else list(tokens)
        try:
            h = bm.compute_hash(given, prefix)
        except Exception as exc:  # noqa: BLE001 - which error, compared with the reference's
            values.append(None)
            out.append({"raised": error_kind(exc)})
            continue
        same = next((i for i, v in enumerate(values) if v is not None and type(v) is type(h) and v == h), None)
        values.append(h)
        out.append({"plain_int": type(h) is int, "is_minus_one": h == -1, "same_as_call": same,
                    "tokens_unchanged": list(given) == list(tokens)})
    return out
