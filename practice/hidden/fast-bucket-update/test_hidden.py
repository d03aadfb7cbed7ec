"""Hidden tests for fast-bucket-update: random shapes (always one grouped-query model),
bfloat16 buckets into a float32 engine, random bucket sizes and orders, partial updates,
every kind of bad entry placed last, the speed against the judge's reference on the CPU
and on a GPU, and real CUDA graphs on a GPU."""
import os
import random

import pytest
import torch

import bench
import reference_updater
from course_lib import Engine
from course_lib.testing import assert_hot_equals_cold
from course_lib.weights import bucket
from course_lib.weights.audit import AddressMovedError
from course_lib.weights.bucket import FlattenedTensorMetadata
from course_lib.weights.checkpoint import CheckpointReader, preset, random_state_dict, write_checkpoint

SEED = int.from_bytes(os.urandom(4), "little")
RNG = random.Random(SEED)
WHY = f"(random seed {SEED})"
PROMPTS = ["hidden prompt", "a longer prompt for the hidden tests of fast-bucket-update"]


def config(gqa=None, dtype="float32", **fixed):
    heads = RNG.choice([2, 4])
    kv = 1 if gqa else heads if gqa is False else RNG.choice([k for k in (1, 2, heads) if heads % k == 0])
    return preset("tiny", hidden_size=RNG.choice([32, 48, 64]), intermediate_size=RNG.choice([64, 96, 160]),
                  num_attention_heads=heads, num_key_value_heads=kv, num_hidden_layers=RNG.randint(1, 3),
                  tie_word_embeddings=RNG.random() < 0.5, torch_dtype=dtype, **fixed)


def pair(tmp_path, cfg):
    return [write_checkpoint(tmp_path / k, cfg, random_state_dict(cfg, RNG.randrange(10_000))) for k in "ab"]


def random_buckets(tensors):
    tensors = list(tensors)
    RNG.shuffle(tensors)
    out, i = [], 0
    while i < len(tensors):
        n = RNG.randint(1, 6)
        out.append(bucket.pack(tensors[i:i + n]))
        i += n
    return out


def apply_all(candidate, engine, buckets, what):
    updater = candidate.BucketUpdater(engine.model)
    for b in buckets:
        updater.apply(b)
    try:
        engine.verify_addresses()
    except AddressMovedError as exc:
        pytest.fail(f"{what}: every parameter keeps its storage, but the audit found: {str(exc)[:300]} {WHY}")
    engine.flush_cache()


def hot_equals_cold(engine, path, what):
    try:
        assert_hot_equals_cold(engine, path, PROMPTS, max_new_tokens=6)
    except AssertionError as exc:
        pytest.fail(f"{what}: the engine computes what a cold start on the new weights computes; {exc} {WHY}")


@pytest.mark.parametrize("gqa,dtype", [(True, "float32"), (None, "float32"), (None, "bfloat16")],
                         ids=["grouped-query", "random-heads", "bfloat16-into-float32"])
def test_random_models_hot_equals_cold(candidate, tmp_path, gqa, dtype):
    cfg = config(gqa, dtype)
    a, b = pair(tmp_path, cfg)
    engine = Engine(a)
    what = (f"{cfg.num_hidden_layers} layers, {cfg.num_attention_heads} q heads, {cfg.num_key_value_heads} kv heads, "
            f"{dtype} checkpoint, tied embeddings: {cfg.tie_word_embeddings}")
    apply_all(candidate, engine, random_buckets(CheckpointReader(b).iter_tensors()), what)
    hot_equals_cold(engine, b, what)


def test_partial_updates_touch_only_their_rows(candidate, tmp_path):
    cfg = config(gqa=True)
    a, b = pair(tmp_path, cfg)
    names = list(CheckpointReader(b).metadata())
    chosen = RNG.sample(names, k=RNG.randint(1, 5)) + [f"model.layers.0.self_attn.{RNG.choice('qkv')}_proj.weight"]
    new = dict(CheckpointReader(b).iter_tensors(set(chosen)))
    engine = Engine(a)
    what = f"a partial update of {sorted(new)}"
    apply_all(candidate, engine, random_buckets(new.items()), what)
    merged = write_checkpoint(tmp_path / "merged", cfg, dict(CheckpointReader(a).iter_tensors()) | new)
    hot_equals_cold(engine, merged, what)


def _faults(name, t, start):
    """(what, metadata entry) for each way an entry can be wrong; ``start`` is its real offset."""
    n, size = t.numel(), t.element_size()
    ok = dict(name=name, shape=t.shape, dtype=t.dtype, start_idx=start, end_idx=start + n * size, numel=n)
    bad = lambda **kw: FlattenedTensorMetadata(**(ok | kw))  # noqa: E731
    return [
        ("an unknown name", bad(name=name.replace("layers.0", "layers.99"))),
        ("a wrong shape", bad(shape=torch.Size([t.shape[0] - 1, *t.shape[1:]]), numel=n - t[0].numel(),
                              end_idx=start + (n - t[0].numel()) * size)),
        ("an integer dtype", bad(dtype=torch.int32 if size == 4 else torch.int16)),
        ("offsets past the buffer", bad(start_idx=start + (1 << 30), end_idx=start + (1 << 30) + n * size)),
        ("a span that does not match numel", bad(end_idx=start + n * size - size)),
        ("a misaligned offset", bad(start_idx=start + 1, end_idx=start + 1 + n * size)),
        ("a name twice", bad()),
    ]


def test_every_bad_last_entry_is_refused_and_changes_nothing(candidate, tmp_path):
    cfg = config(gqa=True)
    a, b = pair(tmp_path, cfg)
    engine = Engine(a)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    tensors = [(n, t) for n, t in CheckpointReader(b).iter_tensors() if "layers.0." in n]
    packed = bucket.pack(tensors)
    last = packed["metadata"][-1]
    for what, entry in _faults(last.name, tensors[-1][1], last.start_idx):
        metadata = packed["metadata"] + [entry] if what == "a name twice" else packed["metadata"][:-1] + [entry]
        try:
            candidate.BucketUpdater(engine.model).apply({"flattened_tensor": packed["flattened_tensor"],
                                                         "metadata": metadata})
        except ValueError as exc:
            name = entry.name
            assert name in str(exc) or what == "a name twice", \
                f"the error for {what} names the tensor ({name}); it said: {exc}"
        else:
            pytest.fail(f"a bucket whose last entry has {what} is refused with ValueError, but it was applied")
        changed = [k for k, v in engine.model.state_dict().items() if not torch.equal(v, before[k])]
        assert not changed, f"a bucket refused for {what} changes nothing, but these changed: {changed[:4]}"


@pytest.fixture(scope="module")
def cpu_workload():
    return bench.workload("cpu")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_speed_against_the_reference(candidate, device, request):
    work = request.getfixturevalue("cpu_workload") if device == "cpu" else bench.workload("cuda")
    result = bench.measure(candidate, reference_updater, device, work=work)
    ratio = result["yours / reference"]
    assert ratio >= bench.FRACTION, (
        f"on {device}, your updater moves {result['GB/s']['yours']:.2f} GB/s, {ratio:.0%} of the reference's "
        f"{result['GB/s']['reference']:.2f} GB/s; at least {bench.FRACTION:.0%} asked "
        f"(one flat copy of the same bytes: {result['GB/s']['one flat copy']:.1f} GB/s)")


@pytest.mark.cuda
def test_cuda_graphs_see_the_update(candidate, tmp_path):
    cfg = preset("small", num_hidden_layers=2, hidden_size=256, head_dim=64, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=512, torch_dtype="bfloat16")
    a, b = pair(tmp_path, cfg)
    engine = Engine(a, device="cuda")
    assert engine.model_runner.graphs, "the GPU engine captured CUDA graphs"
    tensors = [(n, t.cuda()) for n, t in CheckpointReader(b).iter_tensors()]
    apply_all(candidate, engine, random_buckets(tensors), "a GPU engine with CUDA graphs")
    hot_equals_cold(engine, b, "a GPU engine with CUDA graphs")
