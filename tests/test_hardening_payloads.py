"""Hostile weight payloads built from allowed pickle globals only: each is refused while it is
decoded, before anything is allocated from its declared sizes and before any weight is
written; over HTTP that is a 400 with the weights and version unchanged."""
import base64
import collections
import copyreg
import pickle
import struct

import pytest
import torch
import torch._utils
import torch.multiprocessing.reductions as reductions

from course_lib.weights.transports import bucket, safe_pickle
from course_lib.weights.transports.bucket import BucketError, FlattenedTensorMetadata


class Call:
    """Pickles as ``fn(*args, **kwargs)``: how a hostile sender spells any call it likes."""

    def __init__(self, fn, *args, **kwargs):
        self.fn, self.args, self.kwargs = fn, args, kwargs

    state = None  # when set, the pickle also BUILDs the result with it

    def __reduce_ex__(self, protocol):
        if self.state is not None:
            return self.fn, self.args, self.state
        if self.kwargs:  # protocol 4's NEWOBJ_EX: cls.__new__(cls, *args, **kwargs)
            return copyreg.__newobj_ex__, (self.fn, self.args, self.kwargs)
        return self.fn, self.args


def crafted(obj) -> bytes:
    return pickle.dumps(obj, protocol=4)


def refused(data: bytes, *words) -> str:
    with pytest.raises(safe_pickle.UnsafePickleError) as info:
        safe_pickle.loads(data)
    message = str(info.value)
    for word in words:
        assert word in message, message
    return message


def one_float_storage():
    """A typed storage holding a single float, pickled by value (torch's own __reduce__)."""
    return torch.zeros(1).untyped_storage()


def test_meta_device_storage_built_from_allowed_globals_is_refused():
    meta = Call(torch.storage.UntypedStorage, 256, device="meta")
    tensor = Call(torch._utils._rebuild_tensor_v2, Call(reductions.rebuild_typed_storage, meta, torch.float32),
                  0, (64,), (1,), False, collections.OrderedDict())
    refused(crafted([("model.norm.weight", torch.ones(4)), ("model.norm.weight", tensor)]), "directly")


def test_view_larger_than_its_storage_is_refused():
    typed = Call(reductions.rebuild_typed_storage, one_float_storage(), torch.float32)
    view = Call(torch._utils._rebuild_tensor_v2, typed, 0, (64,), (1,), False, collections.OrderedDict())
    refused(crafted(view), "64", "storage")
    view = Call(reductions.rebuild_tensor, torch.Tensor, typed, (0, (64,), (1,), False))
    refused(crafted(view), "64", "storage")


def test_tensor_state_cannot_regrow_it_after_it_was_built():
    # A valid one-element tensor, then BUILD with the legacy 4-tuple state: torch's
    # Tensor.__setstate__ would call set_() and grow the storage to 64 elements.
    typed = Call(reductions.rebuild_typed_storage, one_float_storage(), torch.float32)
    ok = Call(torch._utils._rebuild_tensor_v2, typed, 0, (1,), (1,), False, collections.OrderedDict())
    ok.state = (typed, 0, (64,), (1,))
    refused(crafted(ok), "state")


def test_negative_or_overflowing_views_are_refused():
    typed = Call(reductions.rebuild_typed_storage, one_float_storage(), torch.float32)
    for offset, size, stride in [(-1, (1,), (1,)), (0, (-1,), (1,)), (0, (1,), (-1,)),
                                 (0, (2 ** 62, 2 ** 62), (1, 1)), (2 ** 64, (1,), (1,))]:
        view = Call(torch._utils._rebuild_tensor_v2, typed, offset, size, stride, False, collections.OrderedDict())
        refused(crafted(view))


@pytest.mark.parametrize("payload", [
    Call(torch.storage.UntypedStorage, 2_000_000_000),
    Call(torch.Tensor, 500_000_000),
    Call(bytearray, 2_000_000_000),
    Call(bytes, 2_000_000_000),
], ids=["UntypedStorage(2e9)", "Tensor(5e8)", "bytearray(2e9)", "bytes(2e9)"])
def test_a_tiny_pickle_cannot_allocate_gigabytes(payload):
    data = crafted(payload)
    assert len(data) < 80
    refused(data)


def test_numpy_arrays_cannot_be_allocated_from_a_declared_shape():
    np = pytest.importorskip("numpy")
    from numpy.core.multiarray import _reconstruct  # noqa: PLC0415 - the global a pickle names
    refused(crafted(Call(_reconstruct, np.ndarray, (1_000_000_000,), b"b")))
    refused(crafted(Call(np.ndarray, (1_000_000_000,))))
    small = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert (safe_pickle.loads(pickle.dumps(small)) == small).all()


def test_by_value_storage_declaring_more_bytes_than_it_carries_is_refused():
    fn, (raw,) = one_float_storage().__reduce__()
    assert b"K\x04N" in raw  # the persistent id declares 4 bytes
    huge = raw.replace(b"K\x04N", b"J" + struct.pack("<i", 2_000_000_000) + b"N", 1)
    data = crafted(Call(fn, huge))
    refused(data, "declares")
    assert safe_pickle.loads(crafted(Call(fn, raw))).nbytes() == 4  # the honest one still loads


def test_real_payloads_still_round_trip():
    tensors = [("a", torch.arange(6, dtype=torch.float32).reshape(2, 3)), ("b", torch.ones(4, dtype=torch.bfloat16))]
    for payload in (tensors, bucket.pack(tensors), bucket.pack_sglang(tensors)):
        back = safe_pickle.deserialize(safe_pickle.serialize(payload))
        assert type(back) is type(payload)
    plain = safe_pickle.loads(pickle.dumps(tensors))  # torch's plain pickling, storages by value
    assert all(torch.equal(t, u) for (_, t), (_, u) in zip(tensors, plain))
    assert all(not t.__dict__ for _, t in plain)  # no trace of the decoding left on the tensors


@pytest.mark.parametrize("field,value", [
    ("shape", torch.Size([-1, -4])), ("shape", (2.5,)), ("shape", None), ("start_idx", -16), ("end_idx", 2 ** 70),
    ("numel", True), ("name", 5),
])
def test_bucket_metadata_with_bad_fields_is_refused_naming_them(field, value):
    packed = bucket.pack([("w", torch.ones(4))])
    m = packed["metadata"][0]
    setattr(m, field, value)
    with pytest.raises(BucketError):
        bucket.unpack(packed)


def test_bucket_on_a_meta_device_or_not_a_list_is_refused():
    meta = [FlattenedTensorMetadata("w", torch.Size([4]), torch.float32, 0, 16, 4)]
    with pytest.raises(BucketError, match="meta"):
        bucket.unpack({"flattened_tensor": torch.empty(16, dtype=torch.uint8, device="meta"), "metadata": meta})
    with pytest.raises(BucketError, match="metadata"):
        bucket.unpack({"flattened_tensor": torch.empty(16, dtype=torch.uint8), "metadata": 5})
    with pytest.raises(BucketError, match="metadata"):
        bucket.unpack({"flattened_tensor": torch.empty(16, dtype=torch.uint8), "metadata": [("w", 1)]})


def test_hostile_payload_over_http_is_400_and_changes_nothing(make_ckpt):
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from course_lib import Engine
    from course_lib.server.runner import BackgroundServer

    with BackgroundServer(Engine(make_ckpt("tiny", seed=82)), allow_weight_update=True) as srv:
        name, other = "model.norm.weight", "model.layers.0.input_layernorm.weight"
        before = httpx.get(f"{srv.url}/get_weights_by_name", params={"name": name}).json()
        n = len(before)
        typed = Call(reductions.rebuild_typed_storage, one_float_storage(), torch.float32)
        view = Call(torch._utils._rebuild_tensor_v2, typed, 0, (n,), (1,), False, collections.OrderedDict())
        meta = Call(torch._utils._rebuild_tensor_v2, Call(reductions.rebuild_typed_storage,
                    Call(torch.storage.UntypedStorage, 4 * n, device="meta"), torch.float32),
                    0, (n,), (1,), False, collections.OrderedDict())
        for hostile in (view, meta):
            payload = base64.b64encode(crafted([(name, torch.zeros(n)), (other, hostile)])).decode()
            reply = httpx.post(f"{srv.url}/update_weights_from_tensor", json={"serialized_named_tensors": [payload]})
            assert reply.status_code == 400 and reply.json()["error"]["code"] == "unsafe_payload", reply.text
        assert httpx.get(f"{srv.url}/get_weights_by_name", params={"name": name}).json() == before
        assert httpx.get(f"{srv.url}/get_weight_version").json()["weight_update_count"] == 0


def test_storage_bytes_declared_by_a_shared_memory_handle_are_checked(tmp_path):
    # A handle names a file in /dev/shm; mapping it with a larger size would grow the file.
    refused(crafted(Call(reductions.rebuild_storage_filename, torch.storage.UntypedStorage,
                         b"/tmp/nowhere.sock", "/not_a_torch_segment", 1 << 30)), "shared-memory handle")
