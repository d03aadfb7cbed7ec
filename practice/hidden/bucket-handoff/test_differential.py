"""Differential cases for bucket-handoff: your sender and the reference answer's on the same
seeded random tensors, everything observable compared.

The engine here is a stand-in in the test's process (no model): ``post`` opens the
payload's handle at once, as an engine that keeps a buffer's mapping does, and reads the
bucket's bytes only when the sender waits for it or a later one (the latest moment a busy
engine reads it) or, for buckets still unacknowledged, after ``send_weights`` returned.
Each scenario: random tensors (names, shapes, float and integer dtypes, some larger than
a bucket), a bucket size and one to four buffers. Compared: the return value and its
type (or the error type), every bucket as the engine read it (names, dtypes, shapes, a
digest of the bytes, and whether they are the bytes sent), the buckets in flight at
every post, the buffer each post used (in order of first use) and its size in bytes, the
buckets unacknowledged when it returned, and the acknowledgements waited for more than
once or for no posted bucket. The reference answer runs in another process
(solution_twin.py); scenarios are derandomized and the edge cases are explicit examples.
"""
from __future__ import annotations

import hashlib

from hypothesis import example, given
from hypothesis import strategies as st

import solution_twin
from solution_twin import DIFFERENTIAL

SLUG = "bucket-handoff"
MODULE = "test_differential"
DTYPES = ["float32", "bfloat16", "float16", "int8", "int64"]


reference = solution_twin.reference_fixture(SLUG)  # the reference answer's process, one per module


def _tensors(specs, seed):
    import torch
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (shape, dtype) in enumerate(specs):
        t = torch.randn(*shape, generator=g) * 10
        out.append((f"model.layers.{i}.weight", t.to(getattr(torch, dtype))))
    return out


def _digest(t) -> str:
    import torch
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:12]


class LazyEngine:
    def __init__(self, sent):
        self.sent = dict(sent)
        self.pending = []          # (receipt, opened bucket)
        self.keep = []             # every opened buffer, so no address is reused within a scenario
        self.buffers = {}          # data_ptr -> number, in order of first use
        self.posts, self.read, self.odd_waits, self.acked = [], [], [], set()
        self.posted = 0

    def post(self, payload):
        from course_lib.weights.transports import safe_pickle
        if not isinstance(payload, (str, bytes)):
            raise TypeError(f"post takes a serialized bucket (str or bytes), got {type(payload).__name__}")
        opened = safe_pickle.deserialize(payload)
        flat = opened["flattened_tensor"]
        self.keep.append(opened)
        number = self.buffers.setdefault(flat.untyped_storage().data_ptr(), len(self.buffers))
        receipt = self.posted
        self.posted += 1
        self.pending.append((receipt, opened))
        self.posts.append({"in_flight": len(self.pending), "buffer": number,
                           "buffer_bytes": flat.untyped_storage().nbytes(), "device": flat.device.type,
                           "dtype": str(flat.dtype)})
        return receipt

    def apply_through(self, last):
        import torch

        from course_lib.weights.transports import bucket
        while self.pending and self.pending[0][0] <= last:
            receipt, opened = self.pending.pop(0)
            tensors = bucket.unpack(opened)
            self.read.append({"receipt": receipt, "tensors": [
                [n, str(t.dtype), list(t.shape), _digest(t), n in self.sent and torch.equal(t, self.sent[n])]
                for n, t in tensors]})
            self.acked.add(receipt)

    def wait_ack(self, receipt):
        if not isinstance(receipt, int) or not 0 <= receipt < self.posted:
            self.odd_waits.append(["no such bucket", repr(receipt)])
            raise ValueError(f"no bucket with receipt {receipt!r} was posted")
        if receipt in self.acked:
            self.odd_waits.append(["already acknowledged", receipt])
            return
        self.apply_through(receipt)


def send(module, specs, seed, bucket_bytes, num_buffers):
    sent = _tensors(specs, seed)
    engine = LazyEngine(sent)
    try:
        got = module.send_weights(list(sent), engine.post, engine.wait_ack, bucket_bytes=bucket_bytes,
                                  num_buffers=num_buffers)
        result = {"returned": got if isinstance(got, int) else repr(got), "type": type(got).__name__}
    except Exception as exc:  # noqa: BLE001 - the error type is compared
        result = {"raised": type(exc).__name__}
    result["unacknowledged at return"] = [r for r, _ in engine.pending]
    engine.apply_through(float("inf"))  # what an engine would read of the rest, later
    result.update(posts=engine.posts, buckets_read=engine.read, odd_waits=engine.odd_waits,
                  tensors_never_sent=sorted(set(engine.sent) - {t[0] for b in engine.read for t in b["tensors"]}))
    return result


@st.composite
def scenarios(draw):
    n = draw(st.integers(0, 9))
    specs = [(draw(st.lists(st.integers(1, 24), min_size=1, max_size=2)), draw(st.sampled_from(DTYPES)))
             for _ in range(n)]
    return dict(specs=specs, seed=draw(st.integers(0, 10 ** 6)),
                bucket_bytes=draw(st.sampled_from([64, 256, 512, 1024, 4096])), num_buffers=draw(st.integers(1, 4)))


def _s(specs, bucket_bytes=256, num_buffers=2, seed=3):
    return dict(specs=specs, seed=seed, bucket_bytes=bucket_bytes, num_buffers=num_buffers)


MANY = [([8, 8], "float32")] * 6
@DIFFERENTIAL
@given(case=scenarios())
@example(case=_s([]))                                        # nothing to send
@example(case=_s([([4], "float32")]))                        # one small bucket
@example(case=_s(MANY, num_buffers=1))
@example(case=_s(MANY, num_buffers=2))
@example(case=_s(MANY, num_buffers=3))
@example(case=_s(MANY, num_buffers=4, bucket_bytes=64))      # every tensor larger than a bucket
@example(case=_s([([4], "float32"), ([24, 24], "float32"), ([2], "bfloat16"), ([24, 20], "float16")] * 2))
@example(case=_s(MANY, num_buffers=8))                       # more buffers than buckets
def test_differential_send_weights(candidate, reference, case):
    shown = [f"{dtype}{shape}" for shape, dtype in case["specs"]]
    solution_twin.same_as_reference(candidate, reference, f"{MODULE}:send", f"send_weights(<{len(shown)} tensors: {', '.join(shown)}>, post, wait_ack, "
        f"bucket_bytes={case['bucket_bytes']}, num_buffers={case['num_buffers']}) against an engine that reads "
        f"each bucket when you wait for it", "the numbered rules 1-4", **case)
