"""Flattened buckets sent every step (weights/commit/bucket_cache.py): each layout validated once,
each bucket one copy through the registered path's copy table. The bytes written equal the
registered path's and the general path's; a bad bucket is refused whole, naming what is
wrong, with nothing changed, whether its layout was seen before or not; hot == cold."""
import multiprocessing as mp

import numpy as np
import pytest
import torch

from course_lib import Engine
from course_lib.layers.quant import kernel_tensors
from course_lib.testing import GPU_TEST_SHAPE, assert_addresses_unchanged, assert_hot_equals_cold, plugged_commit
from course_lib.weights.transports import bucket
from course_lib.weights.commit import bucket_cache
from course_lib.weights.commit.audit import AddressMovedError
from course_lib.weights.transports.bucket import FlattenedTensorMetadata
from course_lib.weights.checkpoint import CheckpointReader
from course_lib.weights.transports import trainer
from course_lib.weights.transports.ipc import BucketSender
from course_lib.weights.transports.registered import RegisteredSender
from course_lib.weights.commit.validate import UpdateError

PROMPTS = ["buckets every step", "validated once"]
CTX = mp.get_context("spawn")
BUCKET = 40_000  # tiny model: a dozen buckets, the embedding and the head each alone (larger)
PHASES = {"deserialize", "validate", "copy", "audit"}


@pytest.fixture(scope="module")
def ckpts(make_ckpt):
    return make_ckpt("tiny", seed=81), make_ckpt("tiny", seed=82)


def tensors_of(path, dtype=None, device="cpu"):
    return [(n, (t if dtype is None else t.to(dtype)).to(device)) for n, t in CheckpointReader(path).iter_tensors()]


def weights(engine):
    return {n: t.clone() for n, t in kernel_tensors(engine.model).items()}


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def cache_of(engine):
    return engine.updater.transfers.buckets


def send(engine, sender, tensors, **kwargs):
    result = None
    for receipt, payload in sender.payloads(tensors):
        result = engine.update_weights_from_tensor(payload, load_format="flattened_bucket", **kwargs)
        sender.release(receipt)
    return result


def oversize(tensors, bucket_bytes):
    """Buckets of one tensor larger than a bucket: each travels in a buffer of its own."""
    return sum(bucket.bucket_nbytes(g) > bucket_bytes for g in bucket.group_into_buckets(tensors, bucket_bytes))


# ---- the fast path, step after step ---------------------------------------------------------

def test_a_trainer_process_reusing_its_buffers_is_validated_once(ckpts):
    a, b = ckpts
    engine = Engine(a)
    payloads, acks = CTX.Queue(), CTX.Queue()
    child = CTX.Process(target=trainer.push_ipc, args=(b, payloads, acks, BUCKET, "cpu", 2, 3))
    child.start()
    engine.pause_generation("retract")
    stats, per_round = cache_of(engine).stats, []
    item = payloads.get(timeout=60)
    for _ in range(3):  # three steps through the same two buffers (shared memory)
        n = 0
        while item is not None:
            receipt, payload = item
            result = engine.update_weights_from_tensor(payload, load_format="flattened_bucket", flush_cache=False)
            assert PHASES <= set(result["timings_ms"]) and result["bytes"] > 0
            acks.put(receipt)
            n += 1
            item = payloads.get(timeout=60)
        per_round.append((n, dict(stats)))
        if len(per_round) < 3:
            item = payloads.get(timeout=60)
    assert trainer.wait_for_exit(child) == 0
    n = per_round[0][0]
    alone = oversize(tensors_of(b), BUCKET)
    assert n > 3 and alone >= 1
    first, second, last = (stats for _, stats in per_round)
    assert first["layouts_validated"] == last["layouts_validated"] == n  # every layout checked once
    assert last["layout_hits"] == 2 * n
    assert_reused_buffers_hit(second, last, n, alone)
    engine.flush_cache()
    engine.continue_generation()
    assert_addresses_unchanged(engine)
    assert_hot_equals_cold(engine, b, PROMPTS)


def assert_reused_buffers_hit(second, last, n, alone):
    """By the third step every bucket in one of the two reused buffers finds its table (a
    bucket alternates between them when a step has an odd number of buckets); a one-off
    buffer (a tensor larger than a bucket) is a new storage each step: a table of its own."""
    assert last["table_hits"] - second["table_hits"] == n - alone
    assert last["tables_built"] - second["tables_built"] == alone


def test_cached_tables_carry_each_steps_new_bytes(ckpts):
    a, b = ckpts
    engine = Engine(a)
    sender = BucketSender(BUCKET, num_buffers=2)
    for step, path in enumerate([b, a, b, a]):
        send(engine, sender, tensors_of(path), weight_version=f"step-{step}")
        assert_hot_equals_cold(engine, path, PROMPTS)
    stats = cache_of(engine).stats
    assert stats["layout_hits"] == 3 * stats["layouts_validated"] and stats["table_hits"] > 0


# ---- the same bytes as the registered path and the general path -------------------------------

@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["same-dtype", "bf16-into-fp32"])
def test_the_bucket_path_writes_the_registered_paths_bytes(ckpts, dtype):
    a, b = ckpts
    sent = tensors_of(b, dtype)
    registered = Engine(a)
    sender = RegisteredSender(sent, 16 << 10, num_buffers=2)
    sender.epoch = registered.register_weight_buffers(sender.registration())["epoch"]
    for receipt, message in sender.payloads(sent):
        registered.update_weights_from_registered(**message)
        sender.release(receipt)
    general = Engine(a)
    cache_of(general).enabled = False
    fast = Engine(a)
    for engine in (general, fast):
        for _ in range(2):  # the second time from cached tables
            send(engine, BucketSender(BUCKET, num_buffers=2), sent)
    assert cache_of(fast).stats["layout_hits"] > 0 and cache_of(general).stats["layouts_validated"] == 0
    assert same(weights(fast), weights(registered))
    assert same(weights(fast), weights(general))
    if dtype is None:
        assert_hot_equals_cold(fast, b, PROMPTS)


def test_sglangs_element_layout_takes_the_fast_path_where_nothing_is_converted(ckpts):
    a, b = ckpts
    sent = tensors_of(b)
    pairs = Engine(a)
    pairs.update_weights_from_tensor(sent)
    engine = Engine(a)
    for _ in range(2):
        engine.update_weights_from_tensor(bucket.pack_sglang(sent), load_format="flattened_bucket")
    assert cache_of(engine).stats["tables_built"] == 2  # one fresh buffer each time, one layout
    assert same(weights(engine), weights(pairs))
    # Tensors of another dtype than the flat buffer's are converted on unpacking: the
    # general path applies them (the layout is cached as one it must hand over).
    mixed = [(n, t.to(torch.bfloat16) if i % 2 else t) for i, (n, t) in enumerate(sent)]
    pairs.update_weights_from_tensor([(n, t.to(torch.float32)) for n, t in mixed])
    built = cache_of(engine).stats["tables_built"]
    engine.update_weights_from_tensor(bucket.pack_sglang(mixed), load_format="flattened_bucket")
    assert cache_of(engine).stats["tables_built"] == built
    assert same(weights(engine), weights(pairs))


# ---- refusals: validate, then commit ---------------------------------------------------------

def corrupted(packed, k, **change):
    meta = list(packed["metadata"])
    m = meta[k]
    fields = dict(name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx, end_idx=m.end_idx, numel=m.numel)
    fields.update(change)
    meta[k] = FlattenedTensorMetadata(**fields)
    return {"flattened_tensor": packed["flattened_tensor"], "metadata": meta}


def bad_buckets(tensors):
    """(why, bucket, what the error must say): each bad in one way, in a buffer of its own."""
    k = next(i for i, (_, x) in enumerate(tensors) if x.dim() == 2 and x.shape[0] != x.shape[1])
    name = tensors[k][0]
    wrong_shape = [(n, x.reshape(x.shape[1], x.shape[0]) if n == name else x) for n, x in tensors]
    as_int = [(n, x.to(torch.int32) if n == name else x) for n, x in tensors]
    packed = bucket.pack(tensors)
    m = packed["metadata"][k]
    end = packed["flattened_tensor"].numel()
    return [
        ("unknown name", corrupted(packed, k, name="model.layers.0.mlp.nope.weight"), "match no parameter"),
        ("wrong shape", bucket.pack(wrong_shape), f"{name}: shape"),
        ("integer dtype", bucket.pack(as_int), f"{name}: dtype torch.int32"),
        ("offset past the end", corrupted(packed, k, start_idx=end, end_idx=end + m.end_idx - m.start_idx),
         f"{name}: offsets"),
        ("named twice", corrupted(packed, k, name=tensors[k - 1][0]), "more than once"),
    ]


def test_a_bad_bucket_is_refused_whole_before_and_after_its_layout_was_cached(ckpts):
    a, b = ckpts
    tensors = tensors_of(b)[:6]
    for warm in (False, True):
        engine = Engine(a)
        if warm:  # the good layout cached, in a buffer of its own
            engine.update_weights_from_tensor(bucket.pack(tensors), load_format="flattened_bucket")
        before, validated = weights(engine), cache_of(engine).stats["layouts_validated"]
        for why, bad, says in bad_buckets(tensors):
            with pytest.raises(UpdateError, match=says.replace(".", r"\.")):
                engine.update_weights_from_tensor(bad, load_format="flattened_bucket")
                pytest.fail(f"a bucket with {why} is refused")
            assert same(weights(engine), before), f"a bucket with {why} changed the weights"
        assert cache_of(engine).stats["layouts_validated"] == validated  # a refused layout is not kept


def test_non_finite_values_are_refused_in_a_cached_layout_with_nothing_changed(ckpts):
    a, b = ckpts
    tensors = tensors_of(b)[:6]
    engine = Engine(a)
    out = torch.empty(bucket.bucket_nbytes(tensors), dtype=torch.uint8)
    good = bucket.pack(tensors, out=out)
    engine.update_weights_from_tensor(good, load_format="flattened_bucket", check_finite=True)
    before, hits = weights(engine), cache_of(engine).stats["table_hits"]
    name = tensors[3][0]
    for bad_value in (float("nan"), float("inf"), float("-inf")):
        poisoned = [(n, t.clone().view(-1).index_fill_(0, torch.tensor([1]), bad_value).view(t.shape) if n == name
                     else t) for n, t in tensors]
        packed = bucket.pack(poisoned, out=out)  # the same buffer, the same layout: a cached table
        with pytest.raises(UpdateError, match=f"{name}: contains NaN or infinite values".replace(".", r"\.")):
            engine.update_weights_from_tensor(packed, load_format="flattened_bucket", check_finite=True)
        assert same(weights(engine), before)
    assert cache_of(engine).stats["table_hits"] == hits + 3
    # Without check_finite the values are taken as sent (the general path's default too).
    engine.update_weights_from_tensor(packed, load_format="flattened_bucket")
    assert not torch.isfinite(engine.get_weights_by_name(name, truncate_size=10**6)).all()


def test_a_rebound_weight_refuses_a_cached_bucket_and_clears_the_cache(ckpts):
    a, b = ckpts
    tensors = tensors_of(b)
    engine = Engine(a)
    out = torch.empty(bucket.bucket_nbytes(tensors), dtype=torch.uint8)
    engine.update_weights_from_tensor(bucket.pack(tensors, out=out), load_format="flattened_bucket")
    layer = engine.model.model.layers[0].mlp.down_proj
    layer.weight.data = layer.weight.data.clone()  # the bug the address audit exists for
    before = weights(engine)
    with pytest.raises(UpdateError, match=r"down_proj\.weight no longer lives where"):
        engine.update_weights_from_tensor(bucket.pack(tensors_of(a), out=out), load_format="flattened_bucket")
    assert same(weights(engine), before)
    assert cache_of(engine).num_buffers == 0 and not cache_of(engine).layouts
    # Sent again: the table built afresh is audited before its first copy, and the rebind
    # is the address audit's error (the engine stops serving), still before any write.
    with pytest.raises(AddressMovedError, match=r"down_proj\.weight"):
        engine.update_weights_from_tensor(bucket.pack(tensors_of(a), out=out), load_format="flattened_bucket")
    assert same(weights(engine), before) and not engine.health()["healthy"]


def test_a_cached_layout_is_never_matched_by_fields_the_general_check_refuses(ckpts):
    a, b = ckpts
    tensors = tensors_of(b)[:6]
    engine = Engine(a)
    out = torch.empty(bucket.bucket_nbytes(tensors), dtype=torch.uint8)
    good = bucket.pack(tensors, out=out)
    engine.update_weights_from_tensor(good, load_format="flattened_bucket")
    before = weights(engine)
    m = good["metadata"][3]
    # Equal to the cached layout as dictionary keys (np.int64(n) == n, with the same hash),
    # yet not what a bucket may hold: the general path's check refuses them.
    for change in ({"numel": np.int64(m.numel)}, {"shape": torch.Size([np.int64(d) for d in m.shape])}):
        with pytest.raises(UpdateError, match="not"):
            engine.update_weights_from_tensor(corrupted(good, 3, **change), load_format="flattened_bucket")
        assert same(weights(engine), before)


# ---- what is cached, and for how long --------------------------------------------------------

def test_a_new_buffer_or_a_resized_storage_gets_a_table_of_its_own(ckpts):
    a, b = ckpts
    tensors = tensors_of(b)
    engine = Engine(a)
    out = torch.empty(bucket.bucket_nbytes(tensors), dtype=torch.uint8)
    engine.update_weights_from_tensor(bucket.pack(tensors, out=out), load_format="flattened_bucket")
    stats = cache_of(engine).stats
    assert (stats["tables_built"], stats["table_hits"]) == (1, 0)
    other = torch.empty_like(out)
    engine.update_weights_from_tensor(bucket.pack(tensors_of(a), out=other), load_format="flattened_bucket")
    assert (stats["tables_built"], stats["layouts_validated"]) == (2, 1)  # the same layout, another buffer
    assert_hot_equals_cold(engine, a, PROMPTS)
    storage = out.untyped_storage()
    storage.resize_(storage.nbytes() + 4096)  # the same storage object, moved to new memory
    moved = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (out.numel(),))
    engine.update_weights_from_tensor(bucket.pack(tensors, out=moved), load_format="flattened_bucket")
    assert stats["tables_built"] == 3 and stats["table_hits"] == 0
    assert_hot_equals_cold(engine, b, PROMPTS)


def test_release_keeps_the_reused_buffers_of_the_step_and_the_lru_bounds_them(ckpts):
    a, b = ckpts
    tensors = tensors_of(b)[:5]
    engine = Engine(a)
    cache = cache_of(engine)
    buffers = [torch.empty(bucket.bucket_nbytes(tensors), dtype=torch.uint8) for _ in range(bucket_cache.MAX_BUFFERS + 1)]

    def update(i):
        engine.update_weights_from_tensor(bucket.pack(tensors, out=buffers[i]), load_format="flattened_bucket")
    for i in (0, 0, 1, 2, 2):
        update(i)
    engine.updater.transfers.release()  # what a GPU engine's resume calls
    assert cache.num_buffers == 2  # buffers 0 and 2 carried two buckets; buffer 1 one: handed back
    update(0)
    engine.updater.transfers.release()
    assert cache.num_buffers == 1  # buffer 2 was not used this step: handed back
    for i in range(len(buffers)):
        update(i)
    assert cache.num_buffers == bucket_cache.MAX_BUFFERS and cache.stats["buffers_dropped"] == 3
    assert cache.stats["layouts_validated"] == 1 and cache.stats["table_hits"] == 4


# ---- where the general path runs ------------------------------------------------------------

def test_a_learners_bucket_check_runs_on_every_bucket(ckpts, monkeypatch):
    a, b = ckpts
    tensors = tensors_of(b)
    calls = []
    reference = bucket.validate

    def learners_validate(flat, metadata):  # defined here: not the instructor edition's
        calls.append(len(metadata))
        reference(flat, metadata)
    monkeypatch.setattr(bucket, "validate", learners_validate)
    engine = Engine(a)
    sender = BucketSender(BUCKET, num_buffers=2)
    for _ in range(2):
        send(engine, sender, tensors)
    assert len(calls) == 2 * len(list(bucket.group_into_buckets(tensors, BUCKET)))  # every bucket, every time
    assert sum(calls) == 2 * len(tensors) and cache_of(engine).stats["layouts_validated"] == 0
    assert_hot_equals_cold(engine, b, PROMPTS)


def test_a_plugged_commit_step_and_a_quantized_engine_take_the_general_path(ckpts):
    a, b = ckpts
    tensors = tensors_of(b)
    engine = Engine(a)
    seen = []

    def load_into(model, named_tensors):
        seen.extend(n for n, _ in named_tensors)
        model.load_weights(named_tensors)
    with plugged_commit(engine, load_into):
        engine.update_weights_from_tensor(bucket.pack(tensors), load_format="flattened_bucket")
    assert len(seen) == len(tensors) and cache_of(engine).stats["layouts_validated"] == 0
    assert_hot_equals_cold(engine, b, PROMPTS)
    quantized = Engine(a, quantization="int8")
    send(quantized, BucketSender(BUCKET, num_buffers=2), tensors)
    assert cache_of(quantized).stats["layouts_validated"] == 0
    assert_hot_equals_cold(quantized, b, PROMPTS)


# ---- on a GPU: CUDA IPC from a trainer process, and the same bytes as the registered path -----

GPU_SHAPE = GPU_TEST_SHAPE


@pytest.mark.cuda
def test_cuda_ipc_every_step_opens_each_reused_buffer_once(make_ckpt):
    a, b = make_ckpt("small", seed=83, **GPU_SHAPE), make_ckpt("small", seed=84, **GPU_SHAPE)
    bucket_bytes = 1 << 20
    engine = Engine(a, device="cuda", enable_cuda_graph=True)
    payloads, acks = CTX.Queue(), CTX.Queue()
    child = CTX.Process(target=trainer.push_ipc, args=(b, payloads, acks, bucket_bytes, "cuda", 2, 3))
    child.start()
    stats, per_round = cache_of(engine).stats, []
    item = payloads.get(timeout=120)
    for step in range(3):  # a trainer's steps: pause, buckets, resume
        engine.pause_generation("retract")
        n = 0
        while item is not None:
            receipt, payload = item
            result = engine.update_weights_from_tensor(payload, load_format="flattened_bucket", flush_cache=False,
                                                       weight_version=f"step-{step}")
            assert PHASES <= set(result["timings_ms"])
            acks.put(receipt)
            n += 1
            item = payloads.get(timeout=120)
        per_round.append((n, dict(stats)))
        engine.flush_cache()
        engine.continue_generation()  # unmaps only the buffers not used in this step
        if step < 2:
            item = payloads.get(timeout=120)
    assert trainer.wait_for_exit(child, 120) == 0
    n, alone = per_round[0][0], oversize(tensors_of(b), bucket_bytes)
    first, second, last = (stats for _, stats in per_round)
    assert n > 1 and first["layouts_validated"] == last["layouts_validated"] == n
    assert_reused_buffers_hit(second, last, n, alone)
    cache = cache_of(engine)
    assert {bound.mode for tables in cache.buffers.values() for bound in tables.values()} <= {"scatter", "graph"}
    assert_addresses_unchanged(engine)
    assert_hot_equals_cold(engine, b, PROMPTS, max_new_tokens=12)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("dtype", [None, torch.float32], ids=["same-dtype", "fp32-into-bf16"])
def test_bf16_bucket_bytes_equal_the_registered_paths_and_non_finite_values_are_refused(make_ckpt, device, dtype):
    a, b = make_ckpt("small", seed=85, **GPU_SHAPE), make_ckpt("small", seed=86, **GPU_SHAPE)
    options = {"device": "cuda", "enable_cuda_graph": True} if device == "cuda" else {}
    sent = tensors_of(b, dtype, device)
    registered = Engine(a, **options)
    sender = RegisteredSender(sent, 1 << 20, device=device, resident=True)
    mine = sender.adopt(sent)
    sender.epoch = registered.register_weight_buffers(sender.registration(serialized=False))["epoch"]
    for receipt, message in sender.payloads(mine):
        registered.update_weights_from_registered(**message)
        sender.release(receipt)
    general, fast = Engine(a, **options), Engine(a, **options)
    cache_of(general).enabled = False
    groups = list(bucket.group_into_buckets(sent, 1 << 20))
    out = torch.empty(max(bucket.bucket_nbytes(g) for g in groups), dtype=torch.uint8, device=device)
    for engine in (general, fast):
        for _ in range(2):  # the second time from cached tables (one buffer, reused)
            for group in groups:
                engine.update_weights_from_tensor(bucket.pack(group, out=out), load_format="flattened_bucket",
                                                  check_finite=True)
    assert cache_of(fast).stats["table_hits"] == len(groups) and cache_of(general).stats["tables_built"] == 0
    assert same(weights(fast), weights(registered)) and same(weights(fast), weights(general))
    if dtype is None:
        assert_hot_equals_cold(fast, b, PROMPTS, max_new_tokens=12)
    before, (name, t) = weights(fast), groups[-1][-1]
    for bad_value in (float("nan"), float("inf"), float("-inf")):
        poisoned = [(n, x.clone().view(-1).index_fill_(0, torch.tensor([2], device=device), bad_value).view(x.shape)
                     if n == name else x) for n, x in groups[-1]]
        with pytest.raises(UpdateError, match=f"{name}: contains NaN".replace(".", r"\.")):
            fast.update_weights_from_tensor(bucket.pack(poisoned, out=out), load_format="flattened_bucket",
                                            check_finite=True)
        assert same(weights(fast), before)
    assert_addresses_unchanged(fast)
