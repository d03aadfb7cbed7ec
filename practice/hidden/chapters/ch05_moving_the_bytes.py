"""Hidden tests for notebooks/05_moving_the_bytes.ipynb: the learner's bucket byte layout.

``check_pack_unpack(pack, unpack)``: random mixes of dtypes and shapes (empty tensors
included) must pack into a 1-D uint8 buffer with 16-byte aligned, correctly sized slots,
the library's ``bucket.unpack`` and the learner's ``unpack`` must both give the tensors
back bitwise, and a live engine fed the learner's buckets must end hot == cold.

Returns a list of failure messages (empty: passed); see ``__init__.py`` for why.
"""
from __future__ import annotations

import os
import random
import tempfile

import torch

from course_lib import Engine
from course_lib.testing import prompt_logits
from course_lib.weights import bucket
from course_lib.weights.checkpoint import CheckpointReader, make_random

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.int64, torch.uint8, torch.float64]


def _rng(seed) -> random.Random:
    return random.Random(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))


def _random_pairs(rng: random.Random) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    pairs = []
    for i in range(rng.randint(3, 9)):
        dtype = rng.choice(DTYPES)
        shape = tuple(rng.choice([0, 1, 3, 5, 7, 16]) if rng.random() < 0.15 else rng.randint(1, 9)
                      for _ in range(rng.randint(0, 3)))
        t = (torch.randn(shape, generator=gen) * 50).to(dtype)
        pairs.append((f"t{i}.{str(dtype).split('.')[-1]}", t))
    return pairs


def _layout_failures(where: str, packed, pairs) -> list[str]:
    if not isinstance(packed, dict) or set(packed) < {"flattened_tensor", "metadata"}:
        return [f"{where}: pack must return a dict with 'flattened_tensor' and 'metadata'"]
    flat, meta = packed["flattened_tensor"], list(packed["metadata"])
    if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1:
        return [f"{where}: flattened_tensor must be a 1-D uint8 tensor"]
    if len(meta) != len(pairs):
        return [f"{where}: {len(pairs)} tensors packed but {len(meta)} metadata entries"]
    out = []
    for m, (name, t) in zip(meta, pairs):
        if m.name != name or tuple(m.shape) != tuple(t.shape) or m.dtype != t.dtype or m.numel != t.numel():
            out.append(f"{where}: the entry for {name} {tuple(t.shape)} {t.dtype} records "
                       f"{m.name} {tuple(m.shape)} {m.dtype} numel {m.numel}")
        elif m.start_idx % bucket.ALIGN:
            out.append(f"{where}: {name} starts at byte {m.start_idx}, not a multiple of {bucket.ALIGN}")
        elif m.end_idx - m.start_idx != t.numel() * t.element_size():
            out.append(f"{where}: {name} needs {t.numel() * t.element_size()} bytes, its slot has "
                       f"{m.end_idx - m.start_idx}")
        elif not 0 <= m.start_idx <= m.end_idx <= flat.numel():
            out.append(f"{where}: {name}'s slot [{m.start_idx}, {m.end_idx}) lies outside the buffer")
    return out


def _roundtrip_failures(where: str, got, pairs, who: str) -> list[str]:
    got = list(got)
    if [n for n, _ in got] != [n for n, _ in pairs]:
        return [f"{where}: {who} returned names {[n for n, _ in got]}, expected {[n for n, _ in pairs]}"]
    out = []
    for (name, t), (_, u) in zip(pairs, got):
        if not isinstance(u, torch.Tensor) or u.dtype != t.dtype or u.shape != t.shape:
            out.append(f"{where}: {who} gave {name} back with the wrong dtype or shape")
        elif not torch.equal(u.reshape(-1).view(torch.uint8) if u.numel() else u, t.reshape(-1).view(torch.uint8) if t.numel() else t):
            out.append(f"{where}: {who} gave {name} ({t.dtype}) back with different bytes")
    return out


def check_pack_unpack(pack, unpack, seed=None) -> list[str]:
    """Failures of the learner's ``pack`` / ``unpack`` on random tensors and in a live engine."""
    rng = _rng(seed)
    cases = [_random_pairs(rng) for _ in range(6)]
    cases.append([("only.empty", torch.empty(0, dtype=torch.bfloat16)), ("odd", torch.ones(3, dtype=torch.int8)),
                  ("after.odd", torch.arange(3, dtype=torch.float64))])
    failures = []
    for i, pairs in enumerate(cases, 1):
        where = f"case {i} ({len(pairs)} tensors)"
        try:  # the candidate first, on copies
            packed = pack([(n, t.clone()) for n, t in pairs])
            mine = _layout_failures(where, packed, pairs)
            if mine:
                failures += mine
                continue
            failures += _roundtrip_failures(where, unpack(packed), pairs, "your unpack")
        except Exception as exc:  # report, do not raise: see __init__.py
            failures.append(f"{where}: {type(exc).__name__}: {exc}")
            continue
        try:
            failures += _roundtrip_failures(where, bucket.unpack(packed), pairs, "the library's unpack of your bucket")
        except Exception as exc:
            failures.append(f"{where}: the engine's bucket reader refused your bucket: {exc}")
    if failures:
        return failures
    with tempfile.TemporaryDirectory() as tmp:
        a = make_random(f"{tmp}/a", "tiny", seed=rng.randrange(10_000))
        b = make_random(f"{tmp}/b", "tiny", seed=rng.randrange(10_000, 20_000))
        tensors = list(CheckpointReader(b).iter_tensors())
        rng.shuffle(tensors)
        engine = Engine(a)
        try:
            cut = rng.randint(1, len(tensors) - 1)
            for chunk in (tensors[:cut], tensors[cut:]):
                engine.update_weights_from_tensor(pack(chunk), load_format="flattened_bucket")
        except Exception as exc:
            return [f"the engine could not load your buckets: {type(exc).__name__}: {exc}"]
        cold = Engine(b)
        ids = list(b"hot equals cold")
        if not torch.equal(prompt_logits(engine, ids), prompt_logits(cold, ids)):
            failures.append("after loading your buckets the engine's logits differ from an engine started "
                            "on the new checkpoint")
    return failures
