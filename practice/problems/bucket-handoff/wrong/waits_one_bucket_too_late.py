"""Wrong: before reusing a buffer it waits for a bucket, but for the one posted before the
bucket that buffer holds (an off-by-one), so the buffer can still be in the engine's hands."""
from __future__ import annotations

import torch

from course_lib.weights.transports import bucket, safe_pickle
from course_lib.weights.transports.ipc import group_into_buckets


def send_weights(named_tensors, post, wait_ack, bucket_bytes: int = 1 << 20, num_buffers: int = 2) -> int:
    buffers = [None] * num_buffers
    receipts = []
    sent = 0
    for group in group_into_buckets(named_tensors, bucket_bytes):
        slot = sent % num_buffers
        if sent > num_buffers:
            wait_ack(receipts[sent - num_buffers - 1])  # off by one: the bucket before the one in this buffer
        need = bucket.bucket_nbytes(group)
        if buffers[slot] is None or buffers[slot].numel() < need:
            buffers[slot] = torch.empty(max(need, bucket_bytes), dtype=torch.uint8, device=group[0][1].device)
        packed = bucket.pack(group, out=buffers[slot])
        if buffers[slot].is_cuda:
            torch.cuda.current_stream().synchronize()  # the bytes are in place before the engine looks
        receipts.append(post(safe_pickle.serialize(packed)))
        sent += 1
    for receipt in receipts[-num_buffers:]:
        wait_ack(receipt)
    return sent
