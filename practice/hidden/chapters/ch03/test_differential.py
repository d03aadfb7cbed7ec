"""Chapter 03, differential: the learner's quantizers, requantization pass and
layer-by-layer reload beside the reference's, on the same random weights and layers.

The quantizers: every float dtype, empty and non-contiguous weights, sizes that are and are
not multiples of the block (the default 128 included), zero rows and tiles, exact rounding
ties, tiny and huge magnitudes, NaN and infinities; every block size drawn, the default
included. The pass: up to four layers of every kind (plain, gate/up, q/k/v), in rounds of
shards that complete a layer or leave it waiting, NaN in a staged weight, with and without
``allow_pending``, staging in every model dtype. The reload: tensors fed in the same orders
(layers interleaved, names refused, one sent twice, a NaN layer, an update cut short,
``check_finite`` on and off): after every feed, what it held and counted, what it wrote and
when, what it handed to the model. Everything is compared bit for bit on the CPU.
See ``scenarios_ch03.py`` (run in both editions) and ``shared/twin.py``.

The pass uses a stand-in quantizer, so a mistake in exercises 1 and 2 does not show up in it.
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
                   st.lists(st.integers(0, 9), min_size=2, max_size=2),
                   st.lists(st.integers(120, 300), min_size=2, max_size=2),  # around the default block
                   st.tuples(st.integers(1, 300), st.integers(1, 300)).map(list),
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
@example(weight=w([256, 129], "zero_row", dtype="float16"), block=None)
@example(weight=w([3, 260], "ties"), block=128)
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
         f"quantize_fp8_block(a weight {weight}, block={block})", 2, "FP8 block quantization")


# ---- ch03.requantize_layers ------------------------------------------------------------------

SHARDS = {"plain": 1, "merged": 2, "qkv": 3}


@st.composite
def passes(draw):
    kinds = [[draw(st.sampled_from(list(SHARDS))), draw(st.integers(1, 5)), draw(st.integers(1, 6))]
             for _ in range(draw(st.integers(1, 4)))]

    def spec(kind):
        every = list(range(SHARDS[kind]))
        arrive = st.one_of(st.just(every), st.just(every), st.just([]),
                           st.lists(st.sampled_from(every), max_size=SHARDS[kind], unique=True))
        return st.tuples(arrive, st.sampled_from(["float", "float", "float", "nan"])).map(list)
    rounds = [[draw(spec(k[0])) for k in kinds] for _ in range(draw(st.integers(1, 3)))]
    return {"method": draw(st.sampled_from(["int8", "fp8"])), "kinds": kinds, "rounds": rounds,
            "allow_pending": draw(st.lists(st.sampled_from([True, False, None]), min_size=1, max_size=3)),
            "dtype": draw(st.sampled_from(["float32", "bfloat16", "float16"])), "seed": draw(st.integers(0, 10_000))}


def a_pass(kinds, rounds, allow_pending=(False,), method="int8", dtype="bfloat16", seed=0):
    return {"method": method, "kinds": kinds, "rounds": rounds, "allow_pending": list(allow_pending), "dtype": dtype,
            "seed": seed}


ALL = [0, 1, 2]


@pytest.mark.exercise("ch03.requantize_layers")
@DIFFERENTIAL
@given(case=passes())
# Three complete layers: each written in place, nothing staged left, in order.
@example(case=a_pass([["qkv", 2, 3], ["plain", 3, 4], ["merged", 2, 5]], [[[ALL, "float"], [[0], "float"], [[0, 1], "float"]]]))
# q alone, then (with allow_pending) the rest in a second round.
@example(case=a_pass([["qkv", 2, 3], ["plain", 2, 2]], [[[[0], "float"], [[0], "float"]], [[[1, 2], "float"], [[], "float"]]],
                     allow_pending=[True, False], method="fp8"))
# The same without allow_pending (left out: its default): refused whole, nothing written, nothing kept.
@example(case=a_pass([["plain", 2, 2], ["qkv", 2, 3]], [[[[0], "float"], [[0], "float"]]], allow_pending=[None]))
# A NaN in the last layer: the first one must not have been written.
@example(case=a_pass([["plain", 3, 4], ["merged", 2, 2]], [[[[0], "float"], [[0, 1], "nan"]]], dtype="float32"))
# A NaN in a waiting layer with allow_pending: it waits; nothing refuses yet.
@example(case=a_pass([["plain", 3, 4], ["qkv", 1, 2]], [[[[0], "float"], [[0], "nan"]]], allow_pending=[True]))
# Nothing staged at all.
@example(case=a_pass([["plain", 2, 2]], [[[[], "float"]]]))
def test_requantize_layers_matches_the_reference(reference, case):
    same(reference, "requantize", case, f"rounds of staging then process_weights_after_loading(...), on {case}", 3,
         "The requantization pass")


# ---- ch03.layerwise_buffer -------------------------------------------------------------------
#
# Compared after every feed (``scenarios_ch03.layerwise``): what feed returned or which error
# (its type; the message is left free); which layers of the model changed (a layer is written
# when its last tensor arrives, never before, and a refused name writes nothing); the held
# and peak bytes the reload counts; the tensors waiting, per layer, with their bytes, dtype,
# device and whether each is the very tensor fed (no copy on the engine's device); the layers
# applied; how many times ``_transfer`` and ``_apply`` were called and what each apply was
# given, bit for bit; how many fed tensors are still alive, and their bytes (a layer's
# tensors are let go once it is written). At the end: ``finish``'s report or its error, and
# every layer of the model, bit for bit. Left free by the contract and not compared: the
# order of a layer's tensors in ``buffers``; the reload's own bookkeeping; what it holds
# after a layer's write failed (the trace stops there); where a NaN is refused (when it
# arrives or when its layer completes: after a NaN is fed only the refusal and that layer's
# weights are compared).

def layerwise_case(config=0, quantization=None, seed=0, bring_layers=(), drop_names=(), order="layers", faults=(),
                   stop_short=0, layout="contiguous", dtype="as_checkpoint", check_finite=True):
    return dict(config=config, quantization=quantization, seed=seed, bring_layers=list(bring_layers),
                drop_names=list(drop_names), order=order, faults=[list(f) for f in faults], stop_short=stop_short,
                layout=layout, dtype=dtype, check_finite=check_finite)


layerwise_cases = st.builds(
    layerwise_case, config=st.integers(0, 2), quantization=st.sampled_from([None, None, "int8", "fp8"]),
    seed=st.integers(0, 10_000), bring_layers=st.one_of(st.just([]), st.lists(st.integers(0, 6), max_size=3)),
    drop_names=st.one_of(st.just([]), st.lists(st.integers(0, 40), max_size=3)),
    order=st.sampled_from(["layers", "interleaved", "interleaved", "shuffled"]),
    faults=st.lists(st.tuples(st.sampled_from(["unknown", "twice", "twice", "nan"]), st.integers(0, 40),
                              st.integers(0, 40)), max_size=3),
    stop_short=st.sampled_from([0, 0, 0, 0, 1, 3]), layout=st.sampled_from(["contiguous", "contiguous", "transposed"]),
    dtype=st.sampled_from(["as_checkpoint", "as_checkpoint", "float32", "bfloat16"]),
    check_finite=st.sampled_from([True, True, None, False]))  # None: the option left out


def layerwise_same(reference, case):
    mine = twin.run_here("scenarios_ch03:layerwise", **case)
    theirs = reference.run("scenarios_ch03:layerwise", **case)
    twin.compare_traces(_feeds(theirs), mine, theirs, _told(case))


def _feeds(trace):
    return [f"feed({e['op'][1]!r}, <{e['op'][0]}>)" for e in trace if "op" in e] + ["finish()"]


def _told(case):
    return (f"the scenario (a LayerwiseReload on a tiny model, see scenarios_ch03.layerwise): {case}\n"
            + explain(4, "The layer-by-layer reload"))


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
@example(case=layerwise_case(config=0, seed=14, faults=[("nan", 0, 3)], check_finite=False))  # written as it came
@example(case=layerwise_case(config=1, quantization="fp8", seed=15, faults=[("nan", 0, 2)], check_finite=False))
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
        f"a reload holds about one layer; {explain(4, 'The layer-by-layer reload')}")
