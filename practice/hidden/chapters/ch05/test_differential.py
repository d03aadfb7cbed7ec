"""Chapter 05, differential: the learner's packer, validator, IPC sender and broadcast
receiver beside the reference's, on the same random scenarios (``scenarios_ch05.py``, run
here and in the reference's process through ``shared/twin.py``): tensor groups of every
dtype and shape (0-d, empty, transposed, strided, expanded, offset views) packed into new,
exact, larger, short and wrong buffers; buckets validated whole and with one entry
corrupted; a sender whose buckets are acknowledged in random order; buckets received over
a real gloo group (rank 0 a thread in the same process, its store on a port the system
picks) and bad announcements, refused before any group is joined. Compared: metadata, bytes, which
error type and that nothing changed on a refusal, which buffer carried a bucket and whether
it was made once and reused, every bucket still in flight.
"""
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import twin
from engine_ops import DIFFERENTIAL
from scenarios_ch05 import BAD_REQUESTS, CORRUPTIONS, DTYPES

dims = st.one_of(st.integers(1, 6), st.sampled_from([0, 1, 7, 16]))
shapes = st.lists(dims, max_size=3)
VIEWS = ["contiguous", "contiguous", "transposed", "step", "expanded", "offset"]
spec = st.tuples(st.sampled_from(sorted(DTYPES)), shapes, st.sampled_from(VIEWS)).map(list)
specs = st.lists(spec, max_size=7)
seeds = st.integers(0, 2**20)


def same(reference, scenario, call, explain, **kwargs):
    mine = twin.run_here(f"scenarios_ch05:{scenario}", **kwargs)
    theirs = reference.run(f"scenarios_ch05:{scenario}", **kwargs)
    twin.compare_results(call, mine, theirs, explain)


def same_trace(reference, scenario, labels, explain, **kwargs):
    mine = twin.run_here(f"scenarios_ch05:{scenario}", **kwargs)
    theirs = reference.run(f"scenarios_ch05:{scenario}", **kwargs)
    twin.compare_traces(labels, mine, theirs, explain)


MIXED = [["float32", [3, 5], "transposed"], ["bool", [7], "contiguous"], ["bfloat16", [], "contiguous"],
         ["int64", [0, 4], "contiguous"], ["float16", [4, 3], "step"], ["int8", [5], "expanded"],
         ["float64", [2, 2], "offset"], ["uint8", [3], "contiguous"], ["int32", [1, 1, 1], "contiguous"]]


@pytest.mark.exercise("ch05.pack_bucket")
@DIFFERENTIAL
@given(seed=seeds, specs=specs, out_mode=st.sampled_from(["none", "none", "exact", "larger", "short", "float32", "2d"]),
       extra=st.integers(0, 40), device=st.sampled_from([None, None, "cpu"]))
@example(seed=1, specs=MIXED, out_mode="none", extra=0, device=None)
@example(seed=2, specs=MIXED, out_mode="exact", extra=0, device=None)
@example(seed=3, specs=MIXED, out_mode="larger", extra=17, device=None)
@example(seed=4, specs=MIXED, out_mode="short", extra=0, device=None)
@example(seed=5, specs=MIXED, out_mode="float32", extra=0, device=None)
@example(seed=6, specs=MIXED, out_mode="2d", extra=0, device=None)
@example(seed=7, specs=[], out_mode="none", extra=0, device=None)
@example(seed=8, specs=[], out_mode="larger", extra=5, device=None)
@example(seed=9, specs=[["float32", [0], "contiguous"], ["bfloat16", [], "contiguous"]], out_mode="exact", extra=0,
         device="cpu")
def test_pack_matches_the_reference(reference, seed, specs, out_mode, extra, device):
    same(reference, "pack_case", f"pack({len(specs)} tensors {specs}, out={out_mode} (+{extra} bytes), device={device})",
         "see Exercise 1 of chapter 05 (Pack a bucket)", seed=seed, specs=specs, out_mode=out_mode, extra=extra,
         device=device)


@pytest.mark.exercise("ch05.validate_bucket")
@DIFFERENTIAL
@given(seed=seeds, specs=specs, corruption=st.sampled_from(CORRUPTIONS), k=st.integers(0, 10),
       layout=st.sampled_from(["bytes", "bytes", "bytes", "elements"]))
@example(seed=1, specs=MIXED, corruption="none", k=0, layout="bytes")
@example(seed=1, specs=MIXED, corruption="none", k=0, layout="elements")
@example(seed=2, specs=[], corruption="none", k=0, layout="bytes")
@example(seed=3, specs=MIXED, corruption="misaligned", k=0, layout="bytes")
@example(seed=3, specs=MIXED, corruption="misaligned", k=1, layout="bytes")
@example(seed=4, specs=MIXED, corruption="numel", k=4, layout="bytes")
@example(seed=4, specs=MIXED, corruption="past_end", k=8, layout="bytes")
@example(seed=4, specs=MIXED, corruption="negative_start", k=6, layout="bytes")
@example(seed=4, specs=MIXED, corruption="start_after_end", k=0, layout="bytes")
@example(seed=5, specs=MIXED, corruption="span", k=6, layout="elements")
@example(seed=5, specs=MIXED, corruption="duplicate", k=8, layout="bytes")
@example(seed=5, specs=MIXED, corruption="span_long", k=0, layout="bytes")
@example(seed=5, specs=MIXED, corruption="shifted_out", k=4, layout="bytes")
@example(seed=5, specs=MIXED, corruption="shape_grown", k=0, layout="bytes")
@example(seed=5, specs=MIXED, corruption="negative_dims", k=0, layout="bytes")
@example(seed=5, specs=MIXED, corruption="bool_dim", k=2, layout="bytes")
@example(seed=6, specs=MIXED, corruption="bool_numel", k=2, layout="bytes")
@example(seed=6, specs=MIXED, corruption="float_start", k=3, layout="bytes")
@example(seed=6, specs=MIXED, corruption="dtype_str", k=0, layout="bytes")
@example(seed=6, specs=MIXED, corruption="not_metadata", k=5, layout="bytes")
@example(seed=7, specs=MIXED, corruption="meta_dict", k=0, layout="bytes")
@example(seed=7, specs=MIXED, corruption="tuple_meta", k=0, layout="bytes")
@example(seed=7, specs=MIXED, corruption="flat_2d", k=0, layout="bytes")
@example(seed=7, specs=MIXED, corruption="flat_meta_device", k=0, layout="elements")
@example(seed=7, specs=MIXED, corruption="empty_list", k=0, layout="bytes")
def test_validate_matches_the_reference(reference, seed, specs, corruption, k, layout):
    same(reference, "validate_case", f"validate(a {layout} bucket of {specs}, entry {k} corrupted: {corruption})",
         "see Exercise 2 of chapter 05 (Validate a bucket before reading it)", seed=seed, specs=specs,
         corruption=corruption, k=k, layout=layout)


sender_dtypes = ["float32", "bfloat16", "float16", "int8", "int64", "uint8", "float64"]
round_ = st.tuples(st.just("round"), st.lists(st.tuples(st.sampled_from(sender_dtypes), st.integers(1, 96)).map(list),
                                               min_size=1, max_size=14)).map(list)
big_round = st.tuples(st.just("round"), st.lists(st.tuples(st.sampled_from(sender_dtypes), st.one_of(
    st.integers(1, 40), st.integers(100, 160))).map(list), min_size=1, max_size=8)).map(list)
nxt = st.just(["next"])
release = st.tuples(st.just("release"), st.integers(0, 5)).map(list)


def rounds(*ops):
    """A round first, then pulls, acknowledgements in random order, and sometimes new rounds."""
    return st.tuples(round_, st.lists(st.one_of(*ops), max_size=16)).map(lambda t: [t[0]] + t[1])


W = [["float32", 40]] * 12  # 160 bytes each, 3 to a 512-byte bucket


@pytest.mark.exercise("ch05.ipc_sender")
@DIFFERENTIAL
@given(seed=seeds, bucket_bytes=st.sampled_from([256, 512, 800]), num_buffers=st.integers(1, 3),
       ops=rounds(nxt, nxt, nxt, release, release, round_, big_round))
@example(seed=1, bucket_bytes=512, num_buffers=2,
         ops=[["round", W], ["next"], ["next"], ["next"], ["release", 1], ["next"], ["release", 0], ["release", 0],
              ["next"], ["release", 0], ["round", W[:4]], ["next"], ["next"], ["release", 0], ["release", 0]])
@example(seed=2, bucket_bytes=512, num_buffers=2,
         ops=[["round", W[:6] + [["float64", 150]] + W[:6]], ["next"], ["release", 0], ["next"], ["next"],
              ["release", 0], ["next"], ["release", 1], ["next"], ["release", 0], ["next"], ["release", 0], ["next"]])
@example(seed=3, bucket_bytes=256, num_buffers=1,
         ops=[["round", [["float32", 10]] * 6], ["next"], ["next"], ["release", 0], ["next"], ["release", 0]])
@example(seed=4, bucket_bytes=256, num_buffers=3,
         ops=[["release", 0], ["round", [["int8", 200], ["float32", 96], ["uint8", 1]]], ["next"], ["next"], ["next"],
              ["next"], ["release", 2], ["release", 0], ["release", 0], ["release", 0]])
@example(seed=6, bucket_bytes=512, num_buffers=2,  # receipt 4 wants slot 0 while receipt 2 is still in it
         ops=[["round", W + W], ["next"], ["next"], ["release", 0], ["next"], ["release", 0], ["next"], ["next"],
              ["release", 1], ["next"], ["release", 0], ["release", 0]])
@example(seed=5, bucket_bytes=256, num_buffers=2,  # buckets of exactly bucket_bytes fit the reused buffers
         ops=[["round", [["float32", 32], ["float32", 32], ["float32", 64], ["int8", 3]]], ["next"], ["next"],
              ["release", 0], ["next"], ["release", 0], ["release", 0]])
def test_sender_matches_the_reference(reference, seed, bucket_bytes, num_buffers, ops):
    same_trace(reference, "sender_trace", ops, f"see Exercise 4 of chapter 05 (The double-buffered sender); "
               f"BucketSender(bucket_bytes={bucket_bytes}, num_buffers={num_buffers})",
               seed=seed, bucket_bytes=bucket_bytes, num_buffers=num_buffers, ops=ops)


forms = st.sampled_from(["name", "torch", "dtype", "mixed"])
receive_op = st.one_of(st.tuples(st.just("bucket"), specs, forms).map(list),
                       st.tuples(st.just("bad"), st.sampled_from(BAD_REQUESTS), st.lists(spec, max_size=3)).map(list))


@pytest.mark.exercise("ch05.receive_broadcast")
@DIFFERENTIAL
@given(seed=seeds, ops=st.lists(receive_op, min_size=1, max_size=5))
@example(seed=1, ops=[["bucket", MIXED, "mixed"], ["bucket", [], "name"], ["bucket", MIXED, "torch"],
                      ["bucket", [["float32", [0], "contiguous"]], "dtype"]])
@example(seed=2, ops=[["bad", kind, MIXED[:3]] for kind in BAD_REQUESTS] + [["bucket", MIXED[:4], "name"]])
def test_receive_matches_the_reference(reference, seed, ops):
    same_trace(reference, "receive_trace", ops + [["(rank 0 at the end)"]],
               "see Exercise 5 of chapter 05 (Receive a broadcast bucket)", seed=seed, ops=ops)
