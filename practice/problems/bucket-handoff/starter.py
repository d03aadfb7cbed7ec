"""bucket-handoff: a trainer's sender that hands buckets to an engine in another process.

It packs each bucket into one of ``num_buffers`` reused buffers, serializes it (on a GPU
a CUDA IPC handle to the buffer, on a CPU a shared-memory handle: the bytes themselves
are not copied into the message) and posts it. Run the public tests: something is wrong.
"""
from __future__ import annotations

import torch

from course_lib.weights.transports import bucket, safe_pickle
from course_lib.weights.transports.ipc import group_into_buckets


def send_weights(named_tensors, post, wait_ack, bucket_bytes: int = 1 << 20, num_buffers: int = 2) -> int:
    """Hand (name, tensor) pairs to the engine in buckets; returns the number of buckets.

    ``post(payload) -> receipt`` sends one serialized bucket and returns at once;
    ``wait_ack(receipt)`` blocks until the engine has applied that bucket.
    """
    buffers = [None] * num_buffers
    receipts = []
    for i, group in enumerate(group_into_buckets(named_tensors, bucket_bytes)):
        slot = i % num_buffers
        need = bucket.bucket_nbytes(group)
        if buffers[slot] is None or buffers[slot].numel() < need:
            buffers[slot] = torch.empty(max(need, bucket_bytes), dtype=torch.uint8, device=group[0][1].device)
        packed = bucket.pack(group, out=buffers[slot])
        receipts.append(post(safe_pickle.serialize(packed)))
    if receipts:
        wait_ack(receipts[-1])  # the engine applies buckets in order: the last ack means all are done
    return len(receipts)
