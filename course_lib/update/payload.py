"""In-memory payloads (``update_weights_from_tensor``), decoded once.

A payload is (name, tensor) pairs or a {name: tensor} dict, or, with
``load_format="flattened_bucket"``, a bucket {"flattened_tensor", "metadata"}; or either
of those serialized (base64 text or bytes, as SGLang clients send; a list holds one
payload per tensor-parallel rank), unpickled only through the allowlist
(``weights/transports/safe_pickle.py``). ``decode`` turns any of these into a ``Decoded``:
checked pairs, or a bucket still to be checked against the model (by the bucket cache's
one lookup where its layout was seen before, else by unpacking it). The HTTP server
decodes in its thread pool, off the engine thread, and hands the engine the ``Decoded``,
which the engine does not decode again.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from course_lib.weights.commit.validate import UpdateError
from course_lib.weights.transports import bucket, safe_pickle

LOAD_FORMATS = (None, "flattened_bucket", "direct")


@dataclass(frozen=True)
class Decoded:
    """A decoded payload: ``pairs`` (checked (name, tensor) pairs), or ``bucket`` (a dict
    shaped like a flattened bucket, its entries not yet checked)."""
    pairs: list | None = None
    bucket: dict | None = None


def decode(payload, load_format: str | None, tp_rank: int = 0) -> Decoded:
    """This rank's payload as a ``Decoded``; raises ``UpdateError`` (or the allowlist's
    ``UnsafePickleError``, a ValueError) naming what is wrong."""
    if isinstance(payload, Decoded):
        return payload
    if load_format not in LOAD_FORMATS:
        raise UpdateError(f"unknown load_format {load_format!r}; expected None or 'flattened_bucket'")
    if isinstance(payload, list) and payload and all(isinstance(p, (str, bytes)) for p in payload):
        if tp_rank >= len(payload):
            raise UpdateError(f"payload has {len(payload)} per-rank entries; this engine is rank {tp_rank}")
        payload = payload[tp_rank]
    if isinstance(payload, (str, bytes)):
        payload = safe_pickle.deserialize(payload)  # raises UnsafePickleError (a ValueError)
    if load_format == "flattened_bucket":
        if isinstance(payload, dict) and "flattened_tensor" in payload and "metadata" in payload:
            return Decoded(bucket=payload)
        return Decoded(pairs=unpack(payload))  # not shaped like a bucket: refused, naming why
    return Decoded(pairs=checked_pairs(payload))


def unpack(payload) -> list[tuple[str, torch.Tensor]]:
    """A flattened bucket's (name, tensor) views, the bucket validated first."""
    try:
        return bucket.unpack(payload)
    except bucket.BucketError as exc:
        raise UpdateError(f"bad flattened bucket: {exc}") from exc


def checked_pairs(payload) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from pairs or a dict, each checked to be one."""
    if isinstance(payload, dict):
        payload = list(payload.items())
    if not isinstance(payload, (list, tuple)):
        raise UpdateError(f"expected (name, tensor) pairs, got {type(payload).__name__}")
    pairs = []
    for item in payload:
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise UpdateError("every entry must be a (name, tensor) pair")
        pairs.append((item[0], item[1]))
    return pairs
