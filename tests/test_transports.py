"""Transports on CPU with real processes: IPC buckets through shared memory, and a gloo
broadcast from a trainer rank. Each ends hot == cold with the address audit clean."""
import base64
import multiprocessing as mp
import os
import pickle

import pytest
import torch

from course_lib import Engine
from course_lib.testing import assert_addresses_unchanged, assert_hot_equals_cold
from course_lib.weights.transports import bucket, safe_pickle
from course_lib.weights.checkpoint import CheckpointReader
from course_lib.weights.transports import trainer
from course_lib.weights.transports.ipc import BucketSender
from course_lib.weights.commit.validate import UpdateError
from course_lib.weights.transports.dist import free_port

PROMPTS = ["moving the bytes", "buckets of weights"]
CTX = mp.get_context("spawn")  # forked children hang on torch's thread pools


@pytest.fixture(scope="module")
def ckpts(make_ckpt):
    return make_ckpt("tiny", seed=31), make_ckpt("tiny", seed=32)


def snapshot(engine):
    return {k: v.clone() for k, v in engine.model.state_dict().items()}


def test_ipc_buckets_from_another_process(ckpts):
    a, b = ckpts
    engine = Engine(a)
    payloads, acks = CTX.Queue(), CTX.Queue()
    child = CTX.Process(target=trainer.push_ipc, args=(b, payloads, acks, 40_000))
    child.start()
    engine.pause_generation("retract")
    n = 0
    while (item := payloads.get(timeout=60)) is not None:
        receipt, payload = item
        result = engine.update_weights_from_tensor(payload, load_format="flattened_bucket", flush_cache=False)
        assert result["success"]
        acks.put(receipt)  # only now may the trainer free the bucket
        n += 1
    assert trainer.wait_for_exit(child) == 0 and n > 3  # several buckets, each applied on its own
    assert engine.update_weights_from_tensor([], weight_version="v2")["success"]  # empty trailing bucket
    assert engine.flush_cache()
    engine.continue_generation()
    assert engine.get_weight_version() == "v2"
    assert_hot_equals_cold(engine, b, PROMPTS)
    assert_addresses_unchanged(engine)


def test_sender_reuses_buffers_only_after_acknowledgement(ckpts):
    tensors = list(CheckpointReader(ckpts[1]).iter_tensors())
    sender = BucketSender(bucket_bytes=140_000, num_buffers=2)  # above the largest tensor
    payloads = sender.payloads(tensors)
    first, second = next(payloads), next(payloads)
    assert sender.num_alive == 2
    with pytest.raises(RuntimeError, match="unacknowledged"):
        next(payloads)  # a third bucket would overwrite the first before the engine read it
    sender = BucketSender(bucket_bytes=140_000, num_buffers=2)  # above the largest tensor
    seen = []
    for receipt, payload in sender.payloads(tensors):
        seen.append(safe_pickle.deserialize(payload)["flattened_tensor"].untyped_storage().data_ptr())
        sender.release(receipt)
    assert len(set(seen)) <= 2 < len(seen)  # many buckets, two buffers
    assert sender.num_alive == 0


def test_plain_named_tensors_and_dicts(ckpts):
    a, b = ckpts
    engine = Engine(a)
    tensors = dict(CheckpointReader(b).iter_tensors())
    engine.update_weights_from_tensor(list(tensors.items())[:10])
    engine.update_weights_from_tensor(dict(list(tensors.items())[10:]))
    assert_hot_equals_cold(engine, b, PROMPTS)


def test_broadcast_from_a_trainer_rank(ckpts):
    a, b = ckpts
    engine = Engine(a)
    port, announcements, results = free_port(), CTX.Queue(), CTX.Queue()
    child = CTX.Process(target=trainer.push_broadcast, args=(b, port, announcements, 60_000),
                        kwargs={"results": results})
    child.start()
    assert engine.init_weights_update_group("127.0.0.1", port, 1, 2, "weight_update_group", "gloo")["success"]
    engine.pause_generation("abort")
    buckets = 0
    while (request := announcements.get(timeout=60)) is not None:
        engine.update_weights_from_distributed(**request, flush_cache=False)
        buckets += 1
    stats = results.get(timeout=60)
    assert trainer.wait_for_exit(child) == 0
    assert buckets == stats["buckets"] > 2  # fixed-size buckets, two buffers used in turn
    assert stats["bytes"] >= CheckpointReader(b).nbytes()
    engine.flush_cache()
    engine.continue_generation()
    engine.destroy_weights_update_group()
    assert_hot_equals_cold(engine, b, PROMPTS)
    assert_addresses_unchanged(engine)


# ---- hostile and malformed payloads: refused, nothing changed ------------------------------

class RunsCode:
    def __reduce__(self):
        return (exec, ("import os; os.environ['PWNED'] = '1'",))


def hostile_payloads(b):
    good = bucket.pack(list(CheckpointReader(b).iter_tensors())[:3])
    overrun = dict(good, metadata=[bucket.FlattenedTensorMetadata(m.name, m.shape, m.dtype, m.start_idx,
                                                                  m.end_idx + 10_000, m.numel) for m in good["metadata"]])
    wrong_numel = dict(good, metadata=[bucket.FlattenedTensorMetadata(m.name, torch.Size([3, 3]), m.dtype,
                                                                      m.start_idx, m.end_idx, m.numel) for m in good["metadata"]])
    renamed = bucket.pack([("model.layers.0.not_a_weight", torch.ones(4))])
    return {
        "code-running pickle": (base64.b64encode(pickle.dumps(RunsCode())).decode(), "flattened_bucket"),
        "not base64": ("%%%not-base64%%%", "flattened_bucket"),
        "offsets overrun the buffer": (safe_pickle.serialize(overrun), "flattened_bucket"),
        "shape disagrees with numel": (safe_pickle.serialize(wrong_numel), "flattened_bucket"),
        "unknown tensor name": (safe_pickle.serialize(renamed), "flattened_bucket"),
        "wrong shape": ([("model.norm.weight", torch.ones(3))], None),
        "not pairs": ([1, 2, 3], None),
        "unknown load_format": ([], "zip"),
    }


HOSTILE = ["code-running pickle", "not base64", "offsets overrun the buffer", "shape disagrees with numel",
           "unknown tensor name", "wrong shape", "not pairs", "unknown load_format"]


@pytest.mark.parametrize("case", HOSTILE)
def test_malicious_or_malformed_payload_is_refused(ckpts, case, monkeypatch):
    monkeypatch.delenv("PWNED", raising=False)
    engine = Engine(ckpts[0])
    before = snapshot(engine)
    payload, fmt = hostile_payloads(ckpts[1])[case]
    with pytest.raises(ValueError) as err:
        engine.update_weights_from_tensor(payload, load_format=fmt)
    assert str(err.value)
    assert "PWNED" not in os.environ
    after = engine.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before) and engine.weight_update_count == 0


def test_refused_distributed_update_still_drains_the_broadcast(ckpts):
    """A bad request must not leave the trainer hanging mid-broadcast."""
    a, b = ckpts
    engine = Engine(a)
    port, announcements = free_port(), CTX.Queue()
    child = CTX.Process(target=trainer.push_broadcast, args=(b, port, announcements, 60_000))
    child.start()
    engine.init_weights_update_group("127.0.0.1", port, 1, 2, backend="gloo")
    before = snapshot(engine)
    first = announcements.get(timeout=60)
    bad = dict(first, names=["model.bogus.weight"] + first["names"][1:])
    with pytest.raises(UpdateError, match="match no parameter"):
        engine.update_weights_from_distributed(**bad)
    while (request := announcements.get(timeout=60)) is not None:  # the rest still flows
        engine.update_weights_from_distributed(**request)
    assert trainer.wait_for_exit(child) == 0
    # Expected: the old weights plus every bucket but the refused one.
    expected = Engine(a)
    new = dict(CheckpointReader(b).iter_tensors())
    expected.update_weights_from_tensor([(n, t) for n, t in new.items() if n not in first["names"]])
    now, want = engine.model.state_dict(), expected.model.state_dict()
    assert all(torch.equal(now[k], want[k]) for k in want)
    assert any(not torch.equal(now[k], before[k]) for k in before)


def test_transports_benchmark_measures_real_transfers(ckpts):
    """The benchmark's pieces (python -m course_lib.bench transports) run here on tiny sizes:
    a raw broadcast between two processes, and in-memory updates that really land."""
    from course_lib.bench import transports as bench_transports
    assert bench_transports.raw_broadcast([1 << 16] * 3) > 0
    a, b = ckpts
    engine = Engine(a)
    new = list(CheckpointReader(b).iter_tensors())
    for bucket_bytes in (None, 1 << 14):
        engine.update_weights_from_disk(a)
        assert bench_transports.in_memory(engine, new, bucket_bytes, "cpu") > 0
        assert_hot_equals_cold(engine, b, PROMPTS)
