"""Flattened buckets: exact round trips in both layouts, zero-copy views, and metadata
that would read outside the buffer refused before anything is read."""
import dataclasses

import pytest
import torch

from course_lib.weights.transports import bucket

PAIRS = [
    ("f32", torch.arange(5, dtype=torch.float32)),
    ("bf16", torch.randn(3, 7).to(torch.bfloat16)),
    ("empty", torch.empty(0, 4)),
    ("u8", torch.arange(7, dtype=torch.uint8)),
    ("f16", torch.randn(2, 3, 4).half()),
    ("i64", torch.arange(3, dtype=torch.int64)),
    ("scalar", torch.tensor(2.5)),
    ("transposed", torch.randn(4, 6).t()),  # not contiguous: packed by value
]


def same(got, want):
    return all(n == m and g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w)
               for (n, g), (m, w) in zip(got, want)) and len(got) == len(want)


def test_byte_layout_round_trip_is_exact_aligned_and_zero_copy():
    packed = bucket.pack(PAIRS)
    flat = packed["flattened_tensor"]
    assert flat.dtype == torch.uint8 and flat.numel() == bucket.bucket_nbytes(PAIRS)
    assert all(m.start_idx % bucket.ALIGN == 0 for m in packed["metadata"])
    got = bucket.unpack(packed)
    assert same(got, PAIRS)
    base = flat.untyped_storage().data_ptr()
    for _, t in got:  # views into the buffer, not copies
        assert t.untyped_storage().data_ptr() == base


def test_a_buffer_that_starts_inside_a_larger_one():
    packed = bucket.pack(PAIRS)
    n = packed["flattened_tensor"].numel()
    big = torch.zeros(n + 64, dtype=torch.uint8)
    big[16:16 + n] = packed["flattened_tensor"]
    assert same(bucket.unpack({"flattened_tensor": big[16:16 + n], "metadata": packed["metadata"]}), PAIRS)


def test_pack_reuses_a_larger_buffer_and_refuses_a_small_one():
    out = torch.empty(1 << 12, dtype=torch.uint8)
    packed = bucket.pack(PAIRS, out=out)
    assert packed["flattened_tensor"].data_ptr() == out.data_ptr()
    assert same(bucket.unpack(packed), PAIRS)
    with pytest.raises(bucket.BucketError, match="cannot hold"):
        bucket.pack(PAIRS, out=torch.empty(8, dtype=torch.uint8))


def test_sglang_layout_round_trip():
    pairs = [("a", torch.randn(3, 2)), ("b", torch.randn(4).to(torch.bfloat16))]
    got = bucket.unpack(bucket.pack_sglang(pairs))
    assert [n for n, _ in got] == ["a", "b"] and got[1][1].dtype == torch.bfloat16
    assert torch.equal(got[0][1], pairs[0][1]) and torch.equal(got[1][1], pairs[1][1])


@pytest.mark.parametrize("change, words", [
    (dict(end_idx=10 ** 9), "overrun the buffer"),
    (dict(start_idx=-16), "overrun the buffer"),
    (dict(numel=999), "does not match shape"),
    (dict(start_idx=2, end_idx=2 + 20), "not aligned"),
    (dict(end_idx=None), "bytes for"),
    (dict(dtype="float32"), "not a torch dtype"),
])
def test_bad_metadata_is_refused_naming_the_tensor(change, words):
    packed = bucket.pack(PAIRS[:2])  # room after the first tensor
    m = packed["metadata"][0]
    if change.get("end_idx", 0) is None:
        change = dict(end_idx=m.end_idx - 4)
    bad = dataclasses.replace(m, **change)
    with pytest.raises(bucket.BucketError, match=words) as caught:
        bucket.unpack({"flattened_tensor": packed["flattened_tensor"], "metadata": [bad, packed["metadata"][1]]})
    assert "f32" in str(caught.value)
