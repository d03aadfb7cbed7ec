"""Differential cases for fast-bucket-update: your BucketUpdater and the reference answer's
on the same seeded random buckets, everything observable compared.

Each scenario: an engine on a random small model (heads, grouped-query or not, layers,
tied embeddings), a checkpoint of float32 or bfloat16 tensors, a random subset of its
tensors in random order split into random buckets, and at times one bad entry (an unknown
name, a wrong shape, the right count in another shape, an integer dtype, offsets past the
buffer, a span that does not match numel, a misaligned offset, a name twice) at a random
place in one bucket. Compared after every ``apply``: what it returned (value and type) or
the error type and whether the message names the bad tensor, a digest of every parameter
of the model, and that the bucket's buffer was left as it was; at the end, that every
parameter kept its storage. The reference answer runs in another process
(solution_twin.py); scenarios are derandomized and the edge cases are explicit examples.
"""
from __future__ import annotations

import hashlib
import random
import tempfile

from hypothesis import example, given
from hypothesis import strategies as st

import solution_twin
from solution_twin import DIFFERENTIAL

SLUG = "fast-bucket-update"
MODULE = "test_differential"
FAULTS = ["unknown name", "wrong shape", "same count other shape", "integer dtype", "past the buffer",
          "span not numel", "misaligned", "name twice"]
_CKPTS: dict = {}


reference = solution_twin.reference_fixture(SLUG)  # the reference answer's process, one per module


def _digest(tensors) -> str:
    import torch
    h = hashlib.sha256()
    for name, t in tensors:
        h.update(name.encode() + str(t.dtype).encode() + str(list(t.shape)).encode())
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _checkpoints(shape, dtype):
    from course_lib.weights.checkpoint import preset, random_state_dict, write_checkpoint
    key = (tuple(sorted(shape.items())), dtype)
    if key not in _CKPTS:
        cfg = preset("tiny", torch_dtype=dtype, **shape)
        root = tempfile.mkdtemp(prefix="bucket-diff-")
        _CKPTS[key] = [write_checkpoint(f"{root}/{k}", cfg, random_state_dict(cfg, seed)) for k, seed in
                       (("a", 1), ("b", 2))]
    return _CKPTS[key]


def _fault(entry, kind):
    import torch

    from course_lib.weights.transports.bucket import FlattenedTensorMetadata
    size = entry.dtype.itemsize
    ok = dict(name=entry.name, shape=entry.shape, dtype=entry.dtype, start_idx=entry.start_idx,
              end_idx=entry.end_idx, numel=entry.numel)
    row = entry.numel // entry.shape[0] if len(entry.shape) else entry.numel
    changes = {
        "unknown name": dict(name=entry.name.replace("model.", "model.extra.")),
        "wrong shape": dict(shape=torch.Size([entry.shape[0] - 1, *entry.shape[1:]]), numel=entry.numel - row,
                            end_idx=entry.start_idx + (entry.numel - row) * size),
        "same count other shape": dict(shape=torch.Size([entry.numel]) if len(entry.shape) > 1
                                       else torch.Size([1, entry.numel])),
        "integer dtype": dict(dtype=torch.int32 if size == 4 else torch.int16),
        "past the buffer": dict(start_idx=entry.start_idx + (1 << 30), end_idx=entry.end_idx + (1 << 30)),
        "span not numel": dict(end_idx=entry.end_idx - size),
        "misaligned": dict(start_idx=entry.start_idx + 1, end_idx=entry.end_idx + 1),
    }
    return FlattenedTensorMetadata(**(ok | changes.get(kind, {})))


def updates(module, shape, dtype, seed, fraction, fault, fault_at):
    """Buckets of the second checkpoint applied to an engine on the first; what each apply did."""
    from course_lib import Engine
    from course_lib.weights.transports import bucket
    from course_lib.weights.checkpoint import CheckpointReader
    a, b = _checkpoints(shape, dtype)
    rng = random.Random(seed)
    tensors = list(CheckpointReader(b).iter_tensors())
    rng.shuffle(tensors)
    tensors = tensors[:max(1, round(len(tensors) * fraction))] if fraction else []
    buckets, i = [], 0
    while i < len(tensors):
        n = rng.randint(1, 6)
        buckets.append(bucket.pack(tensors[i:i + n]))
        i += n
    if not buckets:
        buckets = [bucket.pack([])]
    bad_name = None
    if fault:
        which = buckets[min(fault_at, len(buckets) - 1)]
        if which["metadata"]:
            k = rng.randrange(len(which["metadata"]))
            entry = which["metadata"][k]
            bad = _fault(entry, fault)
            bad_name = bad.name
            if fault == "name twice":
                which["metadata"] = which["metadata"] + [bad]
            else:
                which["metadata"] = which["metadata"][:k] + [bad] + which["metadata"][k + 1:]
    engine = Engine(a)
    params = {n: p.data_ptr() for n, p in engine.model.state_dict().items()}
    updater = module.BucketUpdater(engine.model)
    steps = []
    for bk in buckets:
        flat_before = _digest([("flat", bk["flattened_tensor"])])
        try:
            got = updater.apply(bk)
            step = {"returned": got if isinstance(got, (int, float)) else repr(got), "type": type(got).__name__}
        except Exception as exc:  # noqa: BLE001 - the error type is compared
            step = {"raised": type(exc).__name__,
                    "names the tensor": bool(bad_name) and type(exc) is ValueError and bad_name in str(exc)}
        step["model"] = _digest(sorted(engine.model.state_dict().items()))
        step["bucket unchanged"] = _digest([("flat", bk["flattened_tensor"])]) == flat_before
        steps.append(step)
    moved = sorted(n for n, p in engine.model.state_dict().items() if p.data_ptr() != params[n])
    return {"applies": steps, "parameters that moved": moved}


@st.composite
def scenarios(draw):
    heads = draw(st.sampled_from([2, 4]))
    shape = dict(hidden_size=draw(st.sampled_from([32, 48, 64])), intermediate_size=draw(st.sampled_from([64, 96])),
                 num_attention_heads=heads,
                 num_key_value_heads=draw(st.sampled_from([k for k in (1, 2, 4) if heads % k == 0])),
                 num_hidden_layers=draw(st.integers(1, 2)), tie_word_embeddings=draw(st.booleans()))
    fault = draw(st.sampled_from([None, None, None] + FAULTS))
    return dict(shape=shape, dtype=draw(st.sampled_from(["float32", "bfloat16"])), seed=draw(st.integers(0, 10**6)),
                fraction=draw(st.sampled_from([0.0, 0.1, 0.5, 1.0, 1.0])), fault=fault,
                fault_at=draw(st.integers(0, 20)))


BASE = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            num_hidden_layers=1, tie_word_embeddings=False)


def _s(fault=None, fault_at=0, fraction=1.0, dtype="float32", **shape):
    return dict(shape={**BASE, **shape}, dtype=dtype, seed=5, fraction=fraction, fault=fault, fault_at=fault_at)


@DIFFERENTIAL
@given(case=scenarios())
@example(case=_s())
@example(case=_s(dtype="bfloat16", tie_word_embeddings=True))
@example(case=_s(num_key_value_heads=1))
@example(case=_s(fraction=0.0))                        # one empty bucket
@example(case=_s(fraction=0.1))                        # a partial update
@example(case=_s(fault="unknown name", fault_at=2))
@example(case=_s(fault="wrong shape", fault_at=1))
@example(case=_s(fault="same count other shape", fault_at=3))
@example(case=_s(fault="integer dtype"))
@example(case=_s(fault="past the buffer", fault_at=4))
@example(case=_s(fault="span not numel", fault_at=2))
@example(case=_s(fault="misaligned", fault_at=1, dtype="bfloat16"))
@example(case=_s(fault="name twice", fault_at=99))
def test_differential_bucket_updater(candidate, reference, case):
    solution_twin.same_as_reference(candidate, reference, f"{MODULE}:updates", f"BucketUpdater(model).apply(bucket) for each bucket (model {case['shape']}, {case['dtype']} checkpoint, "
        f"{case['fraction']:.0%} of its tensors in random buckets (seed {case['seed']}), bad entry: {case['fault']} "
        f"in bucket {case['fault_at']})", "sections 'Write BucketUpdater' and 'The rules' (1-3)", **case)
