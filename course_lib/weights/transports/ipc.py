"""The co-located trainer's side of an in-memory (IPC) update.

The trainer packs its tensors into flattened buckets, serializes each bucket with torch's
multiprocessing reductions (a CUDA IPC handle on GPU, a shared-memory file name on CPU:
the bytes are not copied into the message), and sends the text to the engine, which
unpickles it through an allowlist and copies from the shared memory into its weights.

Handle lifetime is explicit: the memory a handle points to belongs to the sender, so the
sender must keep each bucket alive until the engine has acknowledged it (the HTTP reply,
or the return of ``update_weights_from_tensor``). ``BucketSender`` holds every bucket it
sent until ``release`` is called with that bucket's receipt.
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch

from course_lib.weights import bucket, safe_pickle

DEFAULT_BUCKET_BYTES = 256 << 20


def group_into_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
                       ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of tensors of about ``bucket_bytes`` each (a larger tensor goes alone)."""
    group, size = [], 0
    for name, t in named_tensors:
        nbytes = t.numel() * t.element_size()
        if group and size + nbytes > bucket_bytes:
            yield group
            group, size = [], 0
        group.append((name, t))
        size += nbytes
    if group:
        yield group


class BucketSender:
    """Packs and serializes buckets, keeping each alive until its receipt is released."""

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, device=None):
        self.bucket_bytes = bucket_bytes
        self.device = device
        self._alive: dict[int, dict] = {}
        self._next = 0

    def payloads(self, named_tensors) -> Iterator[tuple[int, str]]:
        """(receipt, base64 payload) per bucket; payloads are ``load_format="flattened_bucket"``."""
        for group in group_into_buckets(named_tensors, self.bucket_bytes):
            packed = bucket.pack(group, device=self.device)
            receipt, self._next = self._next, self._next + 1
            self._alive[receipt] = packed  # the engine reads this memory until it acknowledges
            yield receipt, safe_pickle.serialize(packed)

    def release(self, receipt: int) -> None:
        """The engine acknowledged this bucket: its memory may now be freed."""
        self._alive.pop(receipt)

    @property
    def num_alive(self) -> int:
        return len(self._alive)
