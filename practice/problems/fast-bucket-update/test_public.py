"""Public tests for fast-bucket-update: your BucketUpdater inside a real engine."""
import pytest
import torch

from course_lib import Engine
from course_lib.testing import assert_hot_equals_cold
from course_lib.weights.transports import bucket
from course_lib.weights.commit.audit import AddressMovedError
from course_lib.weights.checkpoint import CheckpointReader, make_random

import bench

PROMPTS = ["apply the bucket", "in place and fast"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    return make_random(root / "a", "tiny", seed=1), make_random(root / "b", "tiny", seed=2)


def buckets_of(path, per_bucket=4):
    tensors = list(CheckpointReader(path).iter_tensors())
    return [bucket.pack(tensors[i:i + per_bucket]) for i in range(0, len(tensors), per_bucket)]


def test_full_update_is_hot_equals_cold_and_in_place(candidate, ckpts):
    a, b = ckpts
    engine = Engine(a)
    updater = candidate.BucketUpdater(engine.model)
    applied = sum(updater.apply(bk) for bk in buckets_of(b))
    assert applied == CheckpointReader(b).nbytes(), \
        f"apply returns the bytes it applied: {applied} in all, the checkpoint holds {CheckpointReader(b).nbytes()}"
    try:
        engine.verify_addresses()
    except AddressMovedError as exc:
        pytest.fail(f"every parameter keeps its storage, but the audit found: {str(exc)[:300]}")
    engine.flush_cache()
    assert_hot_equals_cold(engine, b, PROMPTS)


def test_a_bad_last_entry_changes_nothing(candidate, ckpts):
    a, b = ckpts
    engine = Engine(a)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    tensors = list(CheckpointReader(b).iter_tensors())[:5]
    bad_name, bad = tensors[-1]
    tensors[-1] = (bad_name, bad[:-1])  # one row short
    with pytest.raises(ValueError) as caught:
        candidate.BucketUpdater(engine.model).apply(bucket.pack(tensors))
    changed = [k for k, v in engine.model.state_dict().items() if not torch.equal(v, before[k])]
    assert not changed, f"a refused bucket changes nothing, but these changed: {changed[:4]}"
    assert bad_name in str(caught.value), f"the error names the bad tensor ({bad_name}); it said: {caught.value}"


@pytest.mark.cuda
def test_at_least_half_the_speed_of_the_engine_loaders(candidate):
    # Speed is graded on a GPU only; without one this case is reported as not graded.
    try:
        result = bench.measure(candidate, device="cuda")
    except bench.NotApplied as exc:
        pytest.fail(str(exc))
    assert not result["impossible"], (
        f"your updater's {result['GB/s']['yours']:.1f} GB/s is above one flat copy of the same bytes "
        f"({result['GB/s']['one flat copy']:.1f} GB/s): impossible, so the figure is refused")
    ratio = result["yours / engine loaders"]
    assert ratio >= bench.FRACTION, (
        f"your updater moves {result['GB/s']['yours']:.2f} GB/s, {ratio:.0%} of the engine's general loaders "
        f"({result['GB/s']['engine loaders']:.2f} GB/s); at least {bench.FRACTION:.0%} asked here")
