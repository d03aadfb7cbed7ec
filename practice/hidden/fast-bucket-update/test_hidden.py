"""Hidden tests for fast-bucket-update: random shapes (always one grouped-query model),
bfloat16 buckets into a float32 engine and into a bfloat16 engine (what a GPU engine
holds), random bucket sizes and orders, partial updates, an empty bucket, a buffer reused
with new bytes, every kind of bad entry placed last (the right element count in the wrong
shape among them), no temporary copies on the way in, the speed against the judge's
reference on a GPU (new bytes every timed round, checked after), and real CUDA graphs."""
import random
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import bench
import reference_updater
from course_lib import Engine
from course_lib.testing import assert_hot_equals_cold
from course_lib.weights.transports import bucket
from course_lib.weights.commit.audit import AddressMovedError
from course_lib.weights.transports.bucket import FlattenedTensorMetadata
from course_lib.weights.checkpoint import CheckpointReader, preset, random_state_dict, write_checkpoint
from course_lib.weights.commit.copy_plan import checkpoint_view
from conftest import hidden_seed  # the judge's plugin: a fixed seed, so a grade repeats

SEED = hidden_seed()
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
    # Two different seeds: an update to the same weights would change nothing and prove nothing.
    return [write_checkpoint(tmp_path / k, cfg, random_state_dict(cfg, seed))
            for k, seed in zip("ab", RNG.sample(range(10_000), 2))]


def random_buckets(tensors):
    tensors = list(tensors)
    RNG.shuffle(tensors)
    out, i = [], 0
    while i < len(tensors):
        n = RNG.randint(1, 6)
        out.append(bucket.pack(tensors[i:i + n]))
        i += n
    return out


def bucket_bytes(buckets) -> int:
    return sum(m.numel * m.dtype.itemsize for b in buckets for m in b["metadata"])


def apply_all(candidate, engine, buckets, what):
    updater = candidate.BucketUpdater(engine.model)
    applied = sum(updater.apply(b) for b in buckets)
    assert applied == bucket_bytes(buckets), (
        f"{what}: apply returns the bytes of the bucket's tensors (numel x the bucket's itemsize), "
        f"{bucket_bytes(buckets)} in all; it returned {applied} {WHY}")
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
        refused_and_unchanged(candidate, engine, packed["flattened_tensor"], metadata, what, entry.name, before)


def refused_and_unchanged(candidate, engine, flat, metadata, what, name, before):
    try:
        candidate.BucketUpdater(engine.model).apply({"flattened_tensor": flat, "metadata": metadata})
    except ValueError as exc:
        assert name in str(exc) or what == "a name twice", \
            f"the error for {what} names the tensor ({name}); it said: {exc}"
    else:
        pytest.fail(f"a bucket whose last entry has {what} is refused with ValueError, but it was applied {WHY}")
    changed = [k for k, v in engine.model.state_dict().items() if not torch.equal(v, before[k])]
    assert not changed, f"a bucket refused for {what} changes nothing, but these changed: {changed[:4]} {WHY}"


def test_the_right_element_count_in_the_wrong_shape_is_refused(candidate, tmp_path):
    # As many values as the parameter, another shape: a reshape to the parameter's shape would
    # accept it and scramble the rows.
    cfg = config(gqa=True)
    a, b = pair(tmp_path, cfg)
    engine = Engine(a)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    tensors = [(n, t) for n, t in CheckpointReader(b).iter_tensors() if "layers.0." in n and t.dim() == 2]
    RNG.shuffle(tensors)
    packed = bucket.pack(tensors)
    last = packed["metadata"][-1]
    rows, cols = last.shape
    for shape in [(rows * cols,), (cols, rows), (1, rows * cols), (rows, cols, 1)]:
        if tuple(shape) == (rows, cols):
            continue
        entry = FlattenedTensorMetadata(last.name, torch.Size(shape), last.dtype, last.start_idx, last.end_idx,
                                        last.numel)
        refused_and_unchanged(candidate, engine, packed["flattened_tensor"], packed["metadata"][:-1] + [entry],
                              f"shape {list(shape)} ({last.numel} values, as many as the [{rows}, {cols}] "
                              f"parameter)", last.name, before)


def test_an_empty_bucket_changes_nothing(candidate, tmp_path):
    cfg = config(gqa=True)
    a, _ = pair(tmp_path, cfg)
    engine = Engine(a)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    applied = candidate.BucketUpdater(engine.model).apply(bucket.pack([]))
    assert applied == 0, f"an empty bucket (no tensors, a buffer of 0 bytes) applies 0 bytes, got {applied!r}"
    changed = [k for k, v in engine.model.state_dict().items() if not torch.equal(v, before[k])]
    assert not changed, f"an empty bucket changes nothing, but these changed: {changed[:4]}"


def test_a_reused_buffer_with_new_bytes_is_applied_again(candidate, tmp_path):
    # A sender cycles through the same buffers: the same bucket object, same metadata, new bytes.
    cfg = config(gqa=True)
    a, b = pair(tmp_path, cfg)
    engine = Engine(a)
    tensors = list(CheckpointReader(b).iter_tensors())
    packed = bucket.pack(tensors)
    updater = candidate.BucketUpdater(engine.model)
    gen = torch.Generator().manual_seed(RNG.randrange(1 << 30))
    for round_ in range(3):
        if round_:
            for m in packed["metadata"]:
                packed["flattened_tensor"][m.start_idx:m.end_idx].view(m.dtype).normal_(generator=gen)
        updater.apply(packed)
        for m in packed["metadata"]:
            dest = checkpoint_view(engine.model, m.name)
            src = packed["flattened_tensor"][m.start_idx:m.end_idx].view(m.dtype).view(m.shape)
            assert dest is None or torch.equal(dest, src.to(dest.dtype)), (
                f"apply {round_ + 1} of the same buffer with new bytes: {m.name} holds the buffer's bytes "
                f"of this round; an updater must not skip a buffer it has seen before {WHY}")


class TemporaryBytes(TorchDispatchMode):
    """Counts the bytes of new tensors the code inside makes (views and in-place ops make
    none), and the most alive at once: measured here, in the test, on every torch op."""

    def __init__(self):
        super().__init__()
        self.alive = self.peak = 0

    def _gone(self, nbytes):
        self.alive -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                nbytes = t.untyped_storage().nbytes()
                self.alive += nbytes
                self.peak = max(self.peak, self.alive)
                weakref.finalize(t, self._gone, nbytes)
        return out


def test_a_bfloat16_engine_fed_bfloat16_buckets_without_temporary_copies(candidate, tmp_path):
    # What a GPU engine holds and is fed: bfloat16 into bfloat16. The bytes go straight from the
    # bucket into the parameters; a float32 copy on the way in costs twice the bucket in memory.
    cfg = config(gqa=None, dtype="bfloat16")
    a, b = pair(tmp_path, cfg)
    engine = Engine(a, dtype="bfloat16")
    buckets = random_buckets(CheckpointReader(b).iter_tensors())
    updater = candidate.BucketUpdater(engine.model)
    largest = max(m.numel * m.dtype.itemsize for bk in buckets for m in bk["metadata"])
    with TemporaryBytes() as temporary:
        applied = sum(updater.apply(bk) for bk in buckets)
    what = "a bfloat16 engine fed bfloat16 buckets"
    assert applied == bucket_bytes(buckets), \
        f"{what}: apply returns {bucket_bytes(buckets)} bytes in all (2 per value), it returned {applied} {WHY}"
    assert temporary.peak < largest // 2, (
        f"{what}: the bytes go from the bucket into the parameters with no temporary copy, but up to "
        f"{temporary.peak} bytes of temporary tensors were alive at once during apply (the largest tensor "
        f"is {largest} bytes): a float copy on the way in? {WHY}")
    try:
        engine.verify_addresses()
    except AddressMovedError as exc:
        pytest.fail(f"{what}: every parameter keeps its storage, but the audit found: {str(exc)[:300]} {WHY}")
    engine.flush_cache()
    hot_equals_cold(engine, b, what)


def graded_speed(candidate, device):
    try:
        result = bench.measure(candidate, reference_updater, device)
    except bench.NotApplied as exc:
        pytest.fail(f"on {device}: {exc}")
    assert not result["impossible"], (
        f"on {device}, your updater's {result['GB/s']['yours']:.1f} GB/s is above one flat copy of the same "
        f"bytes on the same device ({result['GB/s']['one flat copy']:.1f} GB/s): impossible, so refused")
    ratio = result["yours / reference"]
    assert ratio >= bench.FRACTION, (
        f"on {device}, your updater moves {result['GB/s']['yours']:.2f} GB/s, {ratio:.0%} of the reference's "
        f"{result['GB/s']['reference']:.2f} GB/s; at least {bench.FRACTION:.0%} asked "
        f"(one flat copy of the same bytes: {result['GB/s']['one flat copy']:.1f} GB/s)")


@pytest.mark.cuda
def test_speed_against_the_reference_on_a_gpu(candidate):
    # Graded on a GPU only: on a CPU this case is "not graded", never a pass.
    graded_speed(candidate, "cuda")


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
