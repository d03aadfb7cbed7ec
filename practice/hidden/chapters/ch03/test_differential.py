"""Chapter 03, differential: the learner's quantizers, staging loader and in-place
requantization beside the reference's, on the same random weights and layers (every float
dtype, empty and non-contiguous weights, zero rows and tiles, exact rounding ties, tiny
and huge magnitudes, NaN and infinities, partial FP8 tiles; shards through either loader,
in any order, of the wrong shape). Everything is compared bit for bit on the CPU: the
integers and scales, their shapes, dtypes and devices, which error, that the weight is
left alone, the kernel tensors' objects and addresses, what staging is left. And the
layer-by-layer reload buffer fed the same tensors in the same orders (layers interleaved,
names refused, one sent twice, a NaN layer, an update cut short): after every feed, what it
held and counted, what it wrote and when, what it handed to the model.
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


# ---- ch03.layerwise_buffer -------------------------------------------------------------------
#
# Compared after every feed (``scenarios_ch03.layerwise``): what feed returned or which error
# (its type; the message is left free); which layers of the model changed (a layer is written
# when its last tensor arrives, never before, and a refused name writes nothing); the held
# and peak bytes the reload counts; the tensors waiting, per layer, with their bytes, dtype,
# device and whether each is the very tensor fed (no copy on the engine's device); the names
# still to come; the layers applied; how many times ``_transfer`` and ``_apply`` were called
# and what each apply was given, bit for bit; how many fed tensors are still alive, and their
# bytes (a layer's buffers are dropped once it is written). At the end: ``finish``'s report or
# its error, and every layer of the model, bit for bit. Left free by the contract and not
# compared: a layer left with no tensor waiting may keep an empty entry in ``buffers`` or
# ``remaining``; what the reload holds after a layer's write failed (the trace stops there).

def layerwise_case(config=0, quantization=None, seed=0, bring_layers=(), drop_names=(), order="layers", faults=(),
                   stop_short=0, layout="contiguous", dtype="as_checkpoint"):
    return dict(config=config, quantization=quantization, seed=seed, bring_layers=list(bring_layers),
                drop_names=list(drop_names), order=order, faults=[list(f) for f in faults], stop_short=stop_short,
                layout=layout, dtype=dtype)


layerwise_cases = st.builds(
    layerwise_case, config=st.integers(0, 2), quantization=st.sampled_from([None, None, "int8", "fp8"]),
    seed=st.integers(0, 10_000), bring_layers=st.one_of(st.just([]), st.lists(st.integers(0, 6), max_size=3)),
    drop_names=st.one_of(st.just([]), st.lists(st.integers(0, 40), max_size=3)),
    order=st.sampled_from(["layers", "interleaved", "interleaved", "shuffled"]),
    faults=st.lists(st.tuples(st.sampled_from(["unknown", "twice", "twice", "nan"]), st.integers(0, 40),
                              st.integers(0, 40)), max_size=3),
    stop_short=st.sampled_from([0, 0, 0, 0, 1, 3]), layout=st.sampled_from(["contiguous", "contiguous", "transposed"]),
    dtype=st.sampled_from(["as_checkpoint", "as_checkpoint", "float32", "bfloat16"]))


def layerwise_same(reference, case):
    mine = twin.run_here("scenarios_ch03:layerwise", **case)
    theirs = reference.run("scenarios_ch03:layerwise", **case)
    twin.compare_traces(_feeds(theirs), mine, theirs, _told(case))


def _feeds(trace):
    return [f"feed({e['op'][1]!r}, <{e['op'][0]}>)" for e in trace if "op" in e] + ["finish()"]


def _told(case):
    return (f"the scenario (a LayerwiseReload on a tiny model, see scenarios_ch03.layerwise): {case}\n"
            + explain(5, "The layer-by-layer reload buffer"))


@pytest.mark.exercise("ch03.layerwise_buffer")
@DIFFERENTIAL
@given(case=layerwise_cases)
@example(case=layerwise_case())                                               # one layer after another
@example(case=layerwise_case(config=1, seed=1, order="interleaved"))          # some tensors of later layers early
@example(case=layerwise_case(config=1, seed=2, order="shuffled"))             # many layers waiting at once
@example(case=layerwise_case(config=1, quantization="int8", seed=3, order="interleaved"))  # staging counted too
@example(case=layerwise_case(config=0, quantization="fp8", seed=4, order="shuffled"))
@example(case=layerwise_case(config=1, seed=5, faults=[("unknown", 3, 40), ("unknown", 7, 41), ("unknown", 0, 42)]))
@example(case=layerwise_case(config=1, seed=6, bring_layers=[1, 3], faults=[("unknown", 2, 0)]))  # not in this update
@example(case=layerwise_case(config=0, seed=7, faults=[("twice", 40, 0), ("twice", 5, 3)]))  # sent twice
@example(case=layerwise_case(config=1, quantization="int8", seed=8, faults=[("nan", 0, 5)]))  # refused, not written
@example(case=layerwise_case(config=0, seed=9, faults=[("nan", 0, 0)], order="interleaved"))
@example(case=layerwise_case(config=1, seed=10, stop_short=3))                # finish: layers left incomplete
@example(case=layerwise_case(config=2, seed=11, bring_layers=[2], drop_names=[0, 3]))  # part of a layer
@example(case=layerwise_case(config=1, seed=12, layout="transposed", dtype="float32"))  # views, another dtype
@example(case=layerwise_case(config=0, quantization="int8", seed=13, layout="transposed", dtype="bfloat16"))
def test_layerwise_buffer_matches_the_reference(reference, case):
    layerwise_same(reference, case)


@pytest.mark.exercise("ch03.layerwise_buffer")
@pytest.mark.cuda
@pytest.mark.parametrize("case", [layerwise_case(config=1, seed=20, order="interleaved"),
                                  layerwise_case(config=1, quantization="int8", seed=21, order="shuffled",
                                                 faults=[("unknown", 4, 40), ("twice", 9, 2)])])
def test_layerwise_buffer_on_the_gpu_matches_the_reference(reference, case):
    """Host tensors fed to a reload on the GPU wait there (moved on arrival), and the
    allocator's peak above the start stays within 64 KiB of the reference's (block rounding)."""
    case = dict(case, device="cuda")
    mine = twin.run_here("scenarios_ch03:layerwise", **case)
    theirs = reference.run("scenarios_ch03:layerwise", **case)
    peaks = [t[-1].pop("gpu_peak_extra_bytes", None) for t in (mine, theirs)]
    twin.compare_traces(_feeds(theirs), mine, theirs, _told(case))
    assert peaks[1] is not None and peaks[0] is not None and peaks[0] <= peaks[1] + (64 << 10), (
        f"on {case}: the GPU allocator's peak above the start was {peaks[0]} bytes, the reference's {peaks[1]}: "
        f"a reload holds about one layer; {explain(5, 'The layer-by-layer reload buffer')}")
