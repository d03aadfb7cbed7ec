"""Chapter 03, differential: the learner's quantizers, staging loader and in-place
requantization beside the reference's, on the same random weights and layers (every float
dtype, empty and non-contiguous weights, zero rows and tiles, exact rounding ties, tiny
and huge magnitudes, NaN and infinities, partial FP8 tiles; shards through either loader,
in any order, of the wrong shape). Everything is compared bit for bit on the CPU: the
integers and scales, their shapes, dtypes and devices, which error, that the weight is
left alone, the kernel tensors' objects and addresses, what staging is left.
See ``scenarios_ch03.py`` (run in both editions) and ``shared/twin.py``.

The requantization case uses a stand-in quantizer and the staging case its own row
arithmetic, so a mistake in exercises 1 and 4 does not show up in them.
"""
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import twin
from engine_ops import DIFFERENTIAL

NOTEBOOK = "notebooks/03_checkpoint_vs_kernel_format.ipynb"
FLOATS = ["float32", "bfloat16", "float16", "float64"]
SPECIALS = ["none", "none", "none", "zero_row", "ties", "small", "large", "nan", "inf", "-inf"]


def explain(n, title):
    return f"see Exercise {n} of chapter 03 ({title}), {NOTEBOOK}"


def same(reference, scenario, kw, shown, n, title):
    mine = twin.run_here(f"scenarios_ch03:{scenario}", **kw)
    theirs = reference.run(f"scenarios_ch03:{scenario}", **kw)
    twin.compare_results(shown, mine, theirs, explain(n, title))


shapes = st.one_of(st.lists(st.integers(0, 9), min_size=2, max_size=2),
                   st.lists(st.integers(1, 4), min_size=1, max_size=3))
weights = st.fixed_dictionaries({"shape": shapes, "dtype": st.sampled_from(FLOATS),
                                 "layout": st.sampled_from(["contiguous", "contiguous", "transposed"]),
                                 "special": st.sampled_from(SPECIALS), "seed": st.integers(0, 10_000)})


def w(shape, special="none", dtype="float32", layout="contiguous", seed=0):
    return {"shape": shape, "dtype": dtype, "layout": layout, "special": special, "seed": seed}


# ---- ch03.quantize_int8 ----------------------------------------------------------------------

# The contract leaves a weight of empty rows ([out, 0]) to int8 undefined (no row has a
# largest magnitude): not drawn.
@pytest.mark.exercise("ch03.quantize_int8")
@DIFFERENTIAL
@given(weight=weights.filter(lambda x: not (len(x["shape"]) == 2 and x["shape"][1] == 0)))
@example(weight=w([4, 6], "ties"))                       # round half to even: 2.5 -> 2, -2.5 -> -2
@example(weight=w([5, 3], "ties", dtype="float64"))
@example(weight=w([3, 5], "zero_row"))                   # an all-zero row gets scale 1
@example(weight=w([0, 4]))                               # no rows
@example(weight=w([4, 4], "nan"))
@example(weight=w([4, 4], "-inf", dtype="bfloat16"))
@example(weight=w([6]))                                  # not 2-D
@example(weight=w([2, 3, 4]))
@example(weight=w([5, 7], layout="transposed", dtype="float16"))
@example(weight=w([3, 8], "small"))
@example(weight=w([3, 8], "large"))
def test_quantize_int8_matches_the_reference(reference, weight):
    same(reference, "quantize", dict(weight, which="int8"), f"quantize_int8_per_channel(a weight {weight})", 1,
         "Int8 per-channel quantization")


# ---- ch03.quantize_fp8 -----------------------------------------------------------------------

@pytest.mark.exercise("ch03.quantize_fp8")
@DIFFERENTIAL
@given(weight=weights, block=st.sampled_from([None, 1, 2, 3, 4, 128]))
@example(weight=w([5, 7]), block=4)                      # partial tiles at the right and the bottom
@example(weight=w([8, 8], "zero_row"), block=4)          # an all-zero tile gets scale 1
@example(weight=w([4, 4], "zero_row"), block=None)
@example(weight=w([130, 3], dtype="bfloat16"), block=None)  # two row tiles of the default 128
@example(weight=w([0, 5]), block=2)
@example(weight=w([5, 0]), block=2)
@example(weight=w([4, 4], "inf"), block=2)
@example(weight=w([4, 4], "nan"), block=None)
@example(weight=w([9]), block=2)
@example(weight=w([6, 5], layout="transposed", dtype="float16"), block=3)
@example(weight=w([3, 8], "small"), block=4)
@example(weight=w([3, 8], "large", dtype="float64"), block=4)
def test_quantize_fp8_matches_the_reference(reference, weight, block):
    same(reference, "quantize", dict(weight, which="fp8", block=block),
         f"quantize_fp8_block(a weight {weight}, block={block})", 4, "FP8 block quantization")


# ---- ch03.requantize_in_place ----------------------------------------------------------------

@pytest.mark.exercise("ch03.requantize_in_place")
@DIFFERENTIAL
@given(method=st.sampled_from(["int8", "fp8"]), out_features=st.integers(1, 9), in_features=st.integers(1, 9),
       staged=st.sampled_from(["float", "float", "nan", "none"]),
       shards=st.sampled_from([[None], ["q", "k", "v"], [0, 1]]), seed=st.integers(0, 10_000),
       rounds=st.integers(1, 3))
@example(method="int8", out_features=4, in_features=6, staged="float", shards=["q", "k", "v"], seed=0, rounds=2)
@example(method="fp8", out_features=3, in_features=5, staged="float", shards=[0, 1], seed=1, rounds=2)
@example(method="int8", out_features=4, in_features=6, staged="none", shards=[], seed=2, rounds=1)  # nothing staged
@example(method="fp8", out_features=4, in_features=6, staged="nan", shards=[None], seed=3, rounds=1)  # refused
def test_requantize_in_place_matches_the_reference(reference, method, out_features, in_features, staged, shards,
                                                   seed, rounds):
    kw = dict(method=method, out_features=out_features, in_features=in_features, staged=staged, shards=shards,
              seed=seed, rounds=rounds)
    same(reference, "requantize", kw, f"process_weights_after_loading(layer), {rounds} rounds, on {kw}", 3,
         "Requantize in place")


# ---- ch03.stage_shard ------------------------------------------------------------------------

@st.composite
def stagings(draw):
    tp = draw(st.sampled_from([1, 2]))
    kind = draw(st.sampled_from(["plain", "merged", "qkv"]))
    if kind == "plain":
        sizes, ids = [tp * draw(st.integers(1, 4))], [None]
    elif kind == "merged":
        sizes, ids = [tp * draw(st.integers(1, 4)) for _ in range(2)], [0, 1]
    else:
        kv = tp * draw(st.integers(1, 2))
        sizes, ids = [kv * draw(st.integers(1, 2)), kv], ["q", "k", "v"]
    shard = st.tuples(st.sampled_from(ids), st.sampled_from(["weight_loader", "local_loader"]),
                      st.sampled_from(["right", "right", "right", "wrong_shape"])).map(list)
    return {"kind": kind, "sizes": sizes, "hidden": draw(st.integers(2, 5)), "tp_size": tp,
            "rank": draw(st.integers(0, tp - 1)), "method": draw(st.sampled_from(["int8", "fp8"])),
            "dtype": draw(st.sampled_from(["float32", "bfloat16"])),
            "param_name": draw(st.sampled_from([None, "model.layers.0.self_attn.qkv_proj.weight"])),
            "shards": draw(st.lists(shard, min_size=1, max_size=5)), "seed": draw(st.integers(0, 10_000))}


def staging(kind, sizes, shards, tp_size=2, rank=1, method="int8", dtype="bfloat16", param_name="w.weight"):
    return {"kind": kind, "sizes": sizes, "hidden": 4, "tp_size": tp_size, "rank": rank, "method": method,
            "dtype": dtype, "param_name": param_name, "shards": shards, "seed": 0}


@pytest.mark.exercise("ch03.stage_shard")
@DIFFERENTIAL
@given(case=stagings())
# q, k, v in another order through both loaders: one staging tensor, each shard in its rows.
@example(case=staging("qkv", [4, 2], [["v", "weight_loader", "right"], ["q", "local_loader", "right"],
                                      ["k", "weight_loader", "right"]]))
# A shard of the wrong shape is refused (named) and not recorded; the next one still lands.
@example(case=staging("merged", [4, 2], [[1, "weight_loader", "right"],
                                         [0, "local_loader", "wrong_shape"], [0, "weight_loader", "right"]]))
@example(case=staging("merged", [2, 2], [[0, "weight_loader", "wrong_shape"]], method="fp8", param_name=None))
@example(case=staging("plain", [4], [[None, "weight_loader", "right"]], tp_size=1, rank=0, dtype="float32"))
def test_stage_shard_matches_the_reference(reference, case):
    same(reference, "stage", case, f"shards fed to a quantized layer's weight shell: {case}", 2,
         "Stage each shard")
