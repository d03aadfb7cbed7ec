"""Layer-by-layer reload: about one layer of extra memory, quantized layers completed across
buckets, and what happens to a fault found mid-stream (the written layers restored)."""
import shutil

import pytest
import torch

from course_lib import Engine
from course_lib.layers.quant import kernel_tensors, pending_layers
from course_lib.testing import assert_addresses_unchanged, assert_hot_equals_cold
from course_lib.weights.checkpoint import CheckpointReader, write_checkpoint
from course_lib.weights.transports.ipc import BucketSender
from course_lib.weights.commit.validate import UpdateError

PROMPTS = ["layer by layer", "one layer of extra memory"]


@pytest.fixture(scope="module")
def ckpts(make_ckpt):
    return make_ckpt("small", seed=41), make_ckpt("small", seed=42)


def layer_bytes(ckpt, prefix):
    meta = CheckpointReader(ckpt).metadata()
    return sum(torch.Size(s).numel() * d.itemsize for n, (s, d) in meta.items() if n.startswith(prefix))


def test_extra_memory_is_about_one_layer(ckpts):
    a, b = ckpts
    result = Engine(a).update_weights_from_disk(b)
    total = CheckpointReader(b).nbytes()
    one_layer = layer_bytes(b, "model.layers.0.")
    biggest_single = max(layer_bytes(b, n) for n in ("model.embed_tokens.weight", "lm_head.weight"))
    peak = result["memory"]["peak_held_bytes"]
    assert result["memory"]["layers"] == 4 + 3  # decoder layers + embedding, final norm, LM head
    assert peak <= max(one_layer, biggest_single) * 1.01, (peak, one_layer, biggest_single)
    assert peak < total / 2


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_quantized_disk_update_is_hot_equals_cold(ckpts, quantization):
    a, b = ckpts
    engine = Engine(a, quantization=quantization)
    for target in (b, a):
        result = engine.update_weights_from_disk(target)
        assert result["timings_ms"]["post_process"] > 0  # requantization is its own phase
        assert_hot_equals_cold(engine, target, PROMPTS)
        assert_addresses_unchanged(engine)


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_buckets_that_split_a_fused_layer(ckpts, quantization):
    """Buckets small enough that q, k and v of a layer arrive in different calls: each
    quantized layer waits, staged, until its last shard arrives; resuming before that is refused."""
    a, b = ckpts
    engine = Engine(a, quantization=quantization)
    engine.pause_generation("abort")
    tensors = sorted(CheckpointReader(b).iter_tensors(), key=lambda nt: nt[0])
    sender = BucketSender(bucket_bytes=20_000)
    split = False
    for receipt, payload in sender.payloads(tensors):
        engine.update_weights_from_tensor(payload, load_format="flattened_bucket", flush_cache=False)
        sender.release(receipt)
        if pending_layers(engine.model):
            split = True
            with pytest.raises(UpdateError, match="wait for shards"):
                engine.continue_generation()  # never serve a layer that is half new, half old
    assert split, "no bucket boundary split a fused layer; make the buckets smaller"
    assert not pending_layers(engine.model)
    engine.continue_generation()
    assert_hot_equals_cold(engine, b, PROMPTS)


def nan_in_a_late_layer(src, dst):
    tensors = dict(CheckpointReader(src).iter_tensors())
    tensors["model.layers.3.mlp.down_proj.weight"][0, 0] = float("nan")
    return write_checkpoint(dst, CheckpointReader(src).config, tensors)


def snapshot(engine):
    return {k: v.clone() for k, v in kernel_tensors(engine.model).items()}


def test_midstream_fault_without_snapshot_restores_the_written_layers(ckpts, tmp_path):
    a, b = ckpts
    engine = Engine(a)
    before = snapshot(engine)
    with pytest.raises(UpdateError, match="layers were restored: the engine serves the old weights"):
        engine.update_weights_from_disk(nan_in_a_late_layer(b, tmp_path / "nan"))
    after = kernel_tensors(engine.model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert engine.health()["healthy"] and engine.weight_update_count == 0
    assert_hot_equals_cold(engine, a, PROMPTS)


def test_midstream_fault_with_snapshot_restores_the_old_weights(ckpts, tmp_path):
    a, b = ckpts
    engine = Engine(a)
    before = snapshot(engine)
    with pytest.raises(UpdateError, match="restored from the snapshot"):
        engine.update_weights_from_disk(nan_in_a_late_layer(b, tmp_path / "nan"), keep_snapshot=True)
    after = kernel_tensors(engine.model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert engine.health()["healthy"] and engine.get_weight_version() == "default"


def test_full_staging_refuses_the_fault_before_any_change(ckpts, tmp_path):
    a, b = ckpts
    engine = Engine(a)
    before = snapshot(engine)
    with pytest.raises(UpdateError, match="NaN"):
        engine.update_weights_from_disk(nan_in_a_late_layer(b, tmp_path / "nan"), staging="full")
    assert all(torch.equal(before[k], kernel_tensors(engine.model)[k]) for k in before)
    assert engine.health()["healthy"]


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_rollback_restores_bitwise_without_reading_disk(ckpts, tmp_path, quantization):
    a, b = ckpts
    old = shutil.copytree(a, tmp_path / "old")
    engine = Engine(old, quantization=quantization)
    before = snapshot(engine)
    engine.update_weights_from_disk(b, weight_version="v2", keep_snapshot=True)
    shutil.rmtree(old)  # the old checkpoint is gone: rollback must not need it
    result = engine.rollback()
    assert result["weight_version"] == "default" == engine.get_weight_version()
    after = kernel_tensors(engine.model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert_hot_equals_cold(engine, a, PROMPTS)
    assert_addresses_unchanged(engine)


def test_rollback_without_snapshot_is_refused(ckpts):
    with pytest.raises(UpdateError, match="no snapshot"):
        Engine(ckpts[0]).rollback()
