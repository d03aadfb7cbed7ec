"""Public tests for chapter 05's exercises (run them: python practice/judge.py test ch05).

ch05.pack_bucket: ``pack`` in course_lib/weights/transports/bucket.py.
ch05.validate_bucket: ``validate`` in course_lib/weights/transports/bucket.py.
ch05.bucket_tests: ``check_bucket_validator`` in course_lib/weights/transports/bucket_checks.py
(your tests must pass on a right validator and fail on wrong ones: two are below, the judge
holds more).
ch05.ipc_sender: ``BucketSender.payloads`` in course_lib/weights/transports/ipc.py.
ch05.receive_broadcast: ``receive_bucket`` in course_lib/weights/transports/dist.py.
Each case reports what it expected in words.
"""
import threading

import pytest
import torch

from course_lib import Engine
from course_lib.testing import assert_hot_equals_cold, verdict
from course_lib.weights.transports import bucket, safe_pickle
from course_lib.weights.transports.bucket import BucketError, FlattenedTensorMetadata
from course_lib.weights.transports.bucket_checks import check_bucket_validator
from course_lib.weights.checkpoint import CheckpointReader, make_random
from course_lib.weights.transports import dist
from course_lib.weights.transports.ipc import BucketSender

PACK, VALIDATE, TESTS, SENDER, RECEIVE = (pytest.mark.exercise(f"ch05.{n}") for n in
                                          ("pack_bucket", "validate_bucket", "bucket_tests", "ipc_sender",
                                           "receive_broadcast"))
MIXED = [("a", torch.arange(5, dtype=torch.float32)), ("b", torch.ones(3, dtype=torch.bfloat16)),
         ("c", torch.empty(0, 4)), ("d", torch.tensor([[7, -1]], dtype=torch.int64)),
         ("e", torch.arange(3, dtype=torch.int8)), ("f", torch.randn(2, 3, dtype=torch.float16))]


def entry(name, shape, dtype, start, end, numel):
    return FlattenedTensorMetadata(name, torch.Size(shape), dtype, start, end, numel)


def same(got, want):
    assert [n for n, _ in got] == [n for n, _ in want], "names come back in the order packed"
    for (n, u), (_, t) in zip(got, want):
        assert u.dtype == t.dtype and u.shape == t.shape, f"{n} comes back as {tuple(t.shape)} {t.dtype}"
        assert torch.equal(u, t), f"{n} comes back with the same values"


def decode(payload):
    return bucket.unpack(safe_pickle.deserialize(payload))


# ---- ch05.pack_bucket ---------------------------------------------------------------------

@PACK
def test_pack_bucket__slots_are_16_byte_aligned_and_exactly_sized():
    packed = bucket.pack(MIXED)
    flat, meta = packed["flattened_tensor"], packed["metadata"]
    assert flat.dtype == torch.uint8 and flat.dim() == 1, "the buffer is one 1-D uint8 tensor"
    want_start, end = 0, 0
    for m, (name, t) in zip(meta, MIXED):
        want_start = -(-end // 16) * 16
        assert (m.name, tuple(m.shape), m.dtype, m.numel) == (name, tuple(t.shape), t.dtype, t.numel()), \
            f"{name}'s entry records its name, real shape, dtype and numel"
        assert m.start_idx == want_start, f"{name} starts at byte {want_start} (the first multiple of 16 after the last)"
        assert m.end_idx - m.start_idx == t.numel() * t.element_size(), f"{name}'s slot is numel * element_size bytes"
        end = m.end_idx
    assert flat.numel() == end, f"the buffer is exactly {end} bytes (the last end_idx)"
    same(bucket.unpack(packed), MIXED)


@PACK
def test_pack_bucket__writes_into_the_given_buffer_and_reuses_it():
    out = torch.full((4096,), 0xAB, dtype=torch.uint8)
    first = bucket.pack(MIXED, out=out)
    assert first["flattened_tensor"].data_ptr() == out.data_ptr(), "the bucket lives in the buffer given as out"
    new = [(n, t + 1) for n, t in MIXED]
    second = bucket.pack(new, out=out)
    assert second["flattened_tensor"].data_ptr() == out.data_ptr(), "the same buffer holds the next bucket"
    same(bucket.unpack(second), new)


@PACK
def test_pack_bucket__refuses_a_short_buffer_and_writes_nothing():
    out = torch.zeros(40, dtype=torch.uint8)
    with pytest.raises(BucketError):
        bucket.pack(MIXED, out=out)
    assert not out.any(), "a refused pack writes nothing into the buffer"


@PACK
def test_pack_bucket__an_empty_bucket_has_no_bytes():
    packed = bucket.pack([])
    assert packed["flattened_tensor"].numel() == 0 and list(packed["metadata"]) == [], "no tensors: 0 bytes, no entries"


@PACK
def test_pack_bucket__the_engine_loads_your_buckets_hot_equal_cold(tmp_path):
    a, b = make_random(tmp_path / "a", "tiny", seed=1), make_random(tmp_path / "b", "tiny", seed=2)
    engine = Engine(a, max_model_len=128)
    tensors = list(CheckpointReader(b).iter_tensors())
    for chunk in (tensors[:7], tensors[7:]):
        engine.update_weights_from_tensor(bucket.pack(chunk), load_format="flattened_bucket")
    assert_hot_equals_cold(engine, b, ["moving the bytes"], max_new_tokens=4)


# ---- ch05.validate_bucket -----------------------------------------------------------------

@VALIDATE
def test_validate_bucket__accepts_good_and_empty_buckets():
    packed = bucket.pack(MIXED)
    bucket.validate(packed["flattened_tensor"], packed["metadata"])
    bucket.validate(torch.empty(0, dtype=torch.uint8), [])


@VALIDATE
def test_validate_bucket__refuses_an_offset_past_the_end():
    flat = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(BucketError, match="w"):
        bucket.validate(flat, [entry("w", (8,), torch.float32, 48, 80, 8)])


@VALIDATE
def test_validate_bucket__refuses_a_shape_that_disagrees_with_numel():
    flat = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(BucketError, match="w"):  # 16 bytes of 4 float32, but the shape says 8 elements
        bucket.validate(flat, [entry("w", (2, 4), torch.float32, 0, 16, 4)])


@VALIDATE
def test_validate_bucket__refuses_misaligned_or_wrongly_sized_slots_and_repeated_names():
    flat = torch.zeros(64, dtype=torch.uint8)
    bad = {"misaligned": [entry("w", (2,), torch.float32, 2, 10, 2)],
           "4 bytes for 4 float32": [entry("w", (4,), torch.float32, 0, 4, 4)],
           "twice": [entry("w", (2,), torch.float32, 0, 8, 2), entry("w", (2,), torch.float32, 16, 24, 2)]}
    for why, meta in bad.items():
        with pytest.raises(BucketError):
            bucket.validate(flat, meta)
            pytest.fail(f"a bucket with {why} is refused")


@VALIDATE
def test_validate_bucket__the_engine_refuses_a_bad_bucket_and_changes_nothing(tmp_path):
    a = make_random(tmp_path / "a", "tiny", seed=1)
    engine = Engine(a, max_model_len=128)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    tensors = list(CheckpointReader(make_random(tmp_path / "b", "tiny", seed=2)).iter_tensors())[:4]
    packed = bucket.pack(tensors)
    last = packed["metadata"][-1]
    packed["metadata"][-1] = entry(last.name, last.shape, last.dtype, last.start_idx + 16, last.end_idx + 16, last.numel)
    with pytest.raises(ValueError):
        engine.update_weights_from_tensor(packed, load_format="flattened_bucket")
    for k, v in engine.model.state_dict().items():
        assert torch.equal(v, before[k]), f"a refused bucket changes nothing, but {k} changed"


# ---- ch05.bucket_tests --------------------------------------------------------------------


def accepts_everything(flat, metadata):
    """Returns without looking: every bucket passes."""


def counts_elements_only(flat, metadata):
    """Checks names, shapes and bounds, but compares every slot's length with numel, as if
    every dtype were one byte wide (right for SGLang's layout, wrong for the byte layout)."""
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or flat.device.type not in ("cpu", "cuda"):
        raise BucketError("the buffer must be a 1-D tensor on the CPU or a GPU")
    if type(metadata) not in (list, tuple):
        raise BucketError("metadata must be a list")
    seen = set()
    for m in metadata:
        bucket._check_fields(m)
        if m.name in seen or torch.Size(m.shape).numel() != m.numel:
            raise BucketError(f"{m.name}: repeated, or numel disagrees with the shape")
        seen.add(m.name)
        if not 0 <= m.start_idx <= m.end_idx <= flat.numel() or m.end_idx - m.start_idx != m.numel:
            raise BucketError(f"{m.name}: slot [{m.start_idx}, {m.end_idx}) does not hold {m.numel} elements")


@TESTS
def test_bucket_tests__pass_on_your_own_validator():
    # Your validator passes its own public cases above; a right test passes on it.
    failed = verdict(check_bucket_validator, bucket.validate)
    assert failed is None, (f"check_bucket_validator fails on your own validate: {type(failed).__name__}: {failed}. "
                            "If your validator passes its cases above, the test asks for more than the contract says")


@TESTS
@pytest.mark.parametrize("validator", [accepts_everything, counts_elements_only],
                         ids=["accepts everything", "counts elements only"])
def test_bucket_tests__catches_a_public_wrong_validator(validator):
    assert verdict(check_bucket_validator, validator) is not None, \
        f"check_bucket_validator passes on a wrong validator: {validator.__doc__}"


# ---- ch05.ipc_sender ----------------------------------------------------------------------

def numbered(n, size=64):
    return [(f"t{i}", torch.full((size,), float(i))) for i in range(n)]


@SENDER
def test_ipc_sender__payloads_carry_every_tensor_in_buckets():
    tensors = numbered(6)
    sender = BucketSender(bucket_bytes=600, num_buffers=2)
    got = []
    for receipt, payload in sender.payloads(tensors):
        got += [(n, t.clone()) for n, t in decode(payload)]
        sender.release(receipt)
    same(got, tensors)
    assert sender.num_alive == 0, "every released bucket is let go"


@SENDER
def test_ipc_sender__never_overwrites_a_bucket_still_in_flight():
    sender = BucketSender(bucket_bytes=600, num_buffers=2)
    stream = sender.payloads(numbered(9))
    r0, p0 = next(stream)
    r1, p1 = next(stream)
    with pytest.raises(RuntimeError):
        next(stream)  # bucket 2 needs buffer 0, whose bucket was never acknowledged
        pytest.fail("a third bucket with two unacknowledged ones raises RuntimeError")
    same(decode(p0), numbered(9)[:2])


@SENDER
def test_ipc_sender__a_released_buffer_carries_the_new_bytes():
    tensors = numbered(6)
    sender = BucketSender(bucket_bytes=600, num_buffers=2)
    seen = []
    for receipt, payload in sender.payloads(tensors):
        seen.append(decode(payload))  # held, not copied: the views read the shared buffer
        if len(seen) >= 2:
            sender.release(receipt - 1)
    sender.release(receipt)
    same(seen[-1], tensors[4:])


@SENDER
def test_ipc_sender__a_tensor_bigger_than_a_bucket_travels_alone():
    tensors = numbered(8, size=32) + [("big", torch.arange(400.0)), ("tail", torch.zeros(8))]
    sender = BucketSender(bucket_bytes=512, num_buffers=2)  # two buckets of four fill both buffers first
    got = []
    for receipt, payload in sender.payloads(tensors):
        got += [(n, t.clone()) for n, t in decode(payload)]
        sender.release(receipt)
    same(got, tensors)


# ---- ch05.receive_broadcast ---------------------------------------------------------------

def broadcast_from_thread(port, buckets):
    """Rank 0 in a thread: broadcasts each bucket of (name, tensor) pairs, packed as describe() says."""
    send = dist.broadcast_async  # the real one, whatever a test puts in its place for rank 1

    def run():
        group, _ = dist.new_group("127.0.0.1", port, 0, 2, "public", "gloo", timeout_s=30)
        for pairs in buckets:
            send(group, bucket.pack(pairs)["flattened_tensor"]).wait()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def lengths_checked(monkeypatch, buckets):
    """Rank 1's broadcasts go through a check of the buffer's byte length first. A buffer of
    another length would abort the whole process inside the collective, with no message;
    instead the check completes the broadcast with a buffer of the right length (so rank 0
    is not left waiting) and fails the case saying what was wrong."""
    send, sizes = dist.broadcast_async, iter([bucket.pack(pairs)["flattened_tensor"].numel() for pairs in buckets])

    def checked(group, tensor):
        want, got = next(sizes), tensor.numel() * tensor.element_size()
        if got != want:
            send(group, torch.empty(want, dtype=torch.uint8)).wait()
            raise AssertionError(f"receive_bucket joined the broadcast with a buffer of {got} bytes, but the sender "
                                 f"packed {want} (the layout's last end): both ranks must pass exactly that length")
        return send(group, tensor)
    monkeypatch.setattr(dist, "broadcast_async", checked)


@RECEIVE
def test_receive_broadcast__receives_views_of_each_bucket_over_gloo(monkeypatch):
    first, second = MIXED, [(n, t * 2 if t.dtype.is_floating_point else t + 1) for n, t in MIXED]
    port = dist.free_port()
    thread = broadcast_from_thread(port, [first, second, []])
    lengths_checked(monkeypatch, [first, second, []])
    group, _ = dist.new_group("127.0.0.1", port, 1, 2, "public", "gloo", timeout_s=30)
    spec = dist.describe(first)
    got1 = dist.receive_bucket(group, spec["names"], spec["dtypes"], spec["shapes"], "cpu")
    got2 = dist.receive_bucket(group, spec["names"], ["torch." + d for d in spec["dtypes"]], spec["shapes"], "cpu")
    assert dist.receive_bucket(group, [], [], [], "cpu") == [], "an empty bucket gives no tensors"
    thread.join(30)
    same(got2, second)
    same(got1, first)  # the first bucket's views still hold the first bytes


@RECEIVE
def test_receive_broadcast__refuses_bad_requests_before_receiving():
    bad = {"unknown dtype": (["w"], ["float33"], [[2]]), "not a dtype": (["w"], ["Size"], [[2]]),
           "negative dim": (["w"], ["float32"], [[-1, 2]]), "lengths differ": (["w", "v"], ["float32"], [[2]])}
    for why, (names, dtypes, shapes) in bad.items():
        with pytest.raises(ValueError):
            dist.receive_bucket(None, names, dtypes, shapes, "cpu")  # no group: it must refuse first
            pytest.fail(f"a request with {why} raises ValueError before any receive")
