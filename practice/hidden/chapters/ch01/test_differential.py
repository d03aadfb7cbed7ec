"""Chapter 01, differential: the learner's shard placement, rank slices, in-place copies and
block hash beside the reference's, on the same random layers, tensors and calls (every rank,
valid and invalid shard ids, grouped- and multi-query heads, uneven outputs, non-contiguous
and offset tensors, shards of the wrong shape, dtype conversions, chained hashes). Every
observation is compared: values and their types, which error, views and storage, the
weight's bytes after a copy or a refusal, which hashes agree. See ``scenarios_ch01.py``
(run in both editions) and ``shared/twin.py``.
"""
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import twin
from engine_ops import DIFFERENTIAL

NOTEBOOK = "notebooks/01_the_engine.ipynb"


def explain(n, title):
    return f"see Exercise {n} of chapter 01 ({title}), {NOTEBOOK}"


def same(reference, scenario, kw, shown, n, title):
    mine = twin.run_here(f"scenarios_ch01:{scenario}", **kw)
    theirs = reference.run(f"scenarios_ch01:{scenario}", **kw)
    twin.compare_results(shown, mine, theirs, explain(n, title))


QKV_IDS = ["q", "k", "v", "o", "Q", "qk", "", None, 0, 1]


# ---- ch01.qkv_rows ---------------------------------------------------------------------------

@st.composite
def heads(draw):
    tp = draw(st.sampled_from([1, 2, 4]))
    kv = tp * draw(st.integers(1, 3))
    q = kv * draw(st.integers(1, 4))  # multi-head (1), grouped-query, multi-query per rank
    return {"hidden": draw(st.integers(1, 8)), "head_dim": draw(st.sampled_from([1, 2, 4, 16])), "num_heads": q,
            "num_kv_heads": kv, "tp_size": tp}


@pytest.mark.exercise("ch01.qkv_rows")
@DIFFERENTIAL
@given(layer=heads(), shard_ids=st.lists(st.sampled_from(QKV_IDS), min_size=1, max_size=6))
@example(layer={"hidden": 8, "head_dim": 4, "num_heads": 4, "num_kv_heads": 4, "tp_size": 1}, shard_ids=["q", "k", "v"])
@example(layer={"hidden": 8, "head_dim": 4, "num_heads": 8, "num_kv_heads": 2, "tp_size": 2}, shard_ids=["v", "k", "q"])
@example(layer={"hidden": 8, "head_dim": 16, "num_heads": 4, "num_kv_heads": 1, "tp_size": 1}, shard_ids=["k", "v"])
@example(layer={"hidden": 8, "head_dim": 2, "num_heads": 8, "num_kv_heads": 4, "tp_size": 4},
         shard_ids=["q", "k", "v", "o", None, 0, ""])
def test_qkv_rows_match_the_reference(reference, layer, shard_ids):
    kw = dict(layer, shard_ids=shard_ids)
    same(reference, "qkv_rows", kw, f"QKVParallelLinear{tuple(layer.values())}.shard_rows(s) on every rank, "
         f"s in {shard_ids}", 1, "Where q, k and v land")


# ---- ch01.gate_up_rows -----------------------------------------------------------------------

@st.composite
def merged(draw):
    tp = draw(st.sampled_from([1, 2, 3, 4]))
    sizes = [tp * draw(st.integers(1, 6)) for _ in range(draw(st.sampled_from([1, 2, 2, 3])))]
    return {"hidden": draw(st.integers(1, 8)), "output_sizes": sizes, "tp_size": tp}


@pytest.mark.exercise("ch01.gate_up_rows")
@DIFFERENTIAL
@given(layer=merged(), shard_ids=st.lists(st.sampled_from([0, 1, 2, 3, -1, "gate", "0", None]), min_size=1,
                                          max_size=6))
@example(layer={"hidden": 4, "output_sizes": [8, 8], "tp_size": 1}, shard_ids=[0, 1, 2])
@example(layer={"hidden": 4, "output_sizes": [8, 4], "tp_size": 2}, shard_ids=[1, 0, -1, "gate", None])
@example(layer={"hidden": 4, "output_sizes": [6, 12, 3], "tp_size": 3}, shard_ids=[2, 1, 0, 3])
def test_gate_up_rows_match_the_reference(reference, layer, shard_ids):
    kw = dict(layer, shard_ids=shard_ids)
    same(reference, "gate_up_rows", kw, f"MergedColumnParallelLinear{tuple(layer.values())}.shard_rows(s) on every "
         f"rank, s in {shard_ids}", 2, "Where gate and up land")


# ---- ch01.tp_slice ---------------------------------------------------------------------------

@pytest.mark.exercise("ch01.tp_slice")
@DIFFERENTIAL
@given(shape=st.lists(st.integers(1, 8), min_size=2, max_size=3), dtype=st.sampled_from(["float32", "bfloat16"]),
       layout=st.sampled_from(["contiguous", "transposed", "offset"]), dim=st.integers(0, 1),
       tp_size=st.sampled_from([1, 2, 3, 4]), seed=st.integers(0, 1000))
@example(shape=[8, 4], dtype="float32", layout="contiguous", dim=0, tp_size=2, seed=0)
@example(shape=[4, 6], dtype="bfloat16", layout="contiguous", dim=1, tp_size=3, seed=1)
@example(shape=[6, 4], dtype="float32", layout="transposed", dim=1, tp_size=2, seed=2)
@example(shape=[6, 4], dtype="float32", layout="offset", dim=0, tp_size=3, seed=3)
@example(shape=[5, 4], dtype="float32", layout="contiguous", dim=0, tp_size=2, seed=4)   # does not divide
@example(shape=[4, 5], dtype="float32", layout="contiguous", dim=1, tp_size=4, seed=5)
@example(shape=[4, 3, 2], dtype="float32", layout="contiguous", dim=1, tp_size=3, seed=6)
@example(shape=[3, 3], dtype="float32", layout="contiguous", dim=0, tp_size=1, seed=7)
def test_tp_slice_matches_the_reference(reference, shape, dtype, layout, dim, tp_size, seed):
    kw = dict(shape=shape, dtype=dtype, layout=layout, dim=dim, tp_size=tp_size, seed=seed)
    same(reference, "tp_slice", kw, f"layer._shard(a {layout} {dtype} tensor of shape {shape}, dim={dim}) on every "
         f"rank of {tp_size}", 3, "A rank's slice")


# ---- ch01.local_loader -----------------------------------------------------------------------

@st.composite
def loads(draw):
    tp = draw(st.sampled_from([1, 2]))
    kind = draw(st.sampled_from(["plain", "merged", "qkv"]))
    if kind == "plain":
        sizes, ids = [tp * draw(st.integers(1, 4))], [None]
    elif kind == "merged":
        sizes = [tp * draw(st.integers(1, 4)) for _ in range(draw(st.sampled_from([2, 3])))]
        ids = list(range(len(sizes)))
    else:
        kv = tp * draw(st.integers(1, 2))
        sizes, ids = [kv * draw(st.integers(1, 3)), kv], ["q", "k", "v"]
    return {"kind": kind, "sizes": sizes, "hidden": draw(st.integers(1, 6)), "tp_size": tp,
            "rank": draw(st.integers(0, tp - 1)), "shard_id": draw(st.sampled_from(ids)),
            "local_shape": draw(st.sampled_from(["exact", "exact", "exact", "one_row", "flat", "transposed",
                                                 "fewer_rows", "extra_dim"])),
            "local_dtype": draw(st.sampled_from(["float32", "bfloat16", "float64"])),
            "param_kind": draw(st.sampled_from(["parameter", "tensor"])),
            "param_name": draw(st.sampled_from([None, "model.layers.0.mlp.gate_up_proj.weight"])),
            "seed": draw(st.integers(0, 1000))}


def load(kind, sizes, shard_id, local_shape, hidden=4, tp_size=2, rank=1, local_dtype="float32",
         param_kind="parameter", param_name="w.weight", seed=0):
    return dict(kind=kind, sizes=sizes, hidden=hidden, tp_size=tp_size, rank=rank, shard_id=shard_id,
                local_shape=local_shape, local_dtype=local_dtype, param_kind=param_kind, param_name=param_name,
                seed=seed)


@pytest.mark.exercise("ch01.local_loader")
@DIFFERENTIAL
@given(case=loads())
@example(case=load("merged", [4, 6], 1, "exact"))                        # up's rows start after gate's
@example(case=load("qkv", [4, 2], "v", "exact", local_dtype="bfloat16"))  # converted to the weight's dtype
@example(case=load("qkv", [4, 2], "k", "exact", param_kind="tensor"))
@example(case=load("plain", [4], None, "exact", tp_size=1, rank=0, param_name=None))
@example(case=load("merged", [4, 4], 0, "one_row"))                      # would broadcast: refused
@example(case=load("merged", [4, 4], 1, "flat"))                         # right size, wrong shape: refused
@example(case=load("qkv", [4, 2], "q", "transposed"))
@example(case=load("merged", [4, 4], 1, "fewer_rows"))
@example(case=load("plain", [4], None, "extra_dim", param_kind="tensor"))
def test_local_loader_matches_the_reference(reference, case):
    same(reference, "local_loader", case, f"layer.local_loader(param, local, shard_id) for {case}", 4,
         "Copy a shard in place")


# ---- ch01.block_hash -------------------------------------------------------------------------

# The last two read alike when their numbers are joined without separators.
BLOCKS = [[1, 2, 3, 4], [4, 3, 2, 1], [1, 2, 3, 5], [2, 1, 3, 4], [0, 0, 0, 0], [7, 7], [], [1, 23, 4], [12, 3, 4]]


@st.composite
def hash_calls(draw):
    """Calls that often repeat a block, a prefix or a salt, and chain on earlier hashes."""
    calls = []
    for i in range(draw(st.integers(1, 10))):
        prefixes = [-1, 0, 1, 5, 12, 12345] + [["ref", j] for j in range(i)]
        calls.append([draw(st.sampled_from([0, 1, 2, 3, 11])), draw(st.sampled_from(prefixes)),
                      draw(st.sampled_from(BLOCKS)), draw(st.booleans())])
    return calls


A, B = BLOCKS[0], BLOCKS[1]


@pytest.mark.exercise("ch01.block_hash")
@DIFFERENTIAL
@given(calls=hash_calls())
# The same block and prefix under another salt; a block and its reverse; equal blocks under
# other prefixes; a two-block chain in both orders; a list and a tuple of the same tokens.
@example(calls=[[0, -1, A, False], [1, -1, A, False], [0, -1, A, True], [0, -1, B, False], [0, 0, A, False]])
@example(calls=[[0, -1, A, False], [0, ["ref", 0], B, False], [0, -1, B, False], [0, ["ref", 2], A, False],
                [0, ["ref", 1], A, False], [0, ["ref", 3], B, False]])
@example(calls=[[1, 0, A, False], [0, 1, A, False], [1, 1, A, False], [0, 0, A, False]])
@example(calls=[[2, -1, BLOCKS[3], False], [2, -1, A, False], [2, 5, [], False], [2, 5, [0, 0, 0, 0], False]])
# Keys that read alike when their numbers are joined: [1, 23, 4] and [12, 3, 4]; salt 1 with
# prefix 12 and salt 11 with prefix 2.
@example(calls=[[0, -1, BLOCKS[7], False], [0, -1, BLOCKS[8], False], [1, 12, A, False], [11, 2, A, False]])
def test_block_hash_matches_the_reference(reference, calls):
    same(reference, "block_hash", {"calls": calls}, f"compute_hash over the calls [salt, prefix, tokens, "
         f"as a tuple] {calls}", 5, "A chained block hash")
