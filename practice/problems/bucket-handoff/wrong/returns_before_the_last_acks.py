"""Wrong: buffers are reused correctly, but it returns with the last buckets still in
flight: the caller frees or overwrites memory the engine has not read yet."""
from __future__ import annotations

import torch

from course_lib.weights.transports import bucket, safe_pickle
from course_lib.weights.transports.ipc import group_into_buckets


def send_weights(named_tensors, post, wait_ack, bucket_bytes: int = 1 << 20, num_buffers: int = 2) -> int:
    buffers = [None] * num_buffers
    holder = [None] * num_buffers  # receipt of the unacknowledged bucket in each buffer
    sent = 0
    for group in group_into_buckets(named_tensors, bucket_bytes):
        slot = sent % num_buffers
        if holder[slot] is not None:
            wait_ack(holder[slot])  # the engine is done reading this buffer: now it may change
            holder[slot] = None
        need = bucket.bucket_nbytes(group)
        if buffers[slot] is None or buffers[slot].numel() < need:
            buffers[slot] = torch.empty(max(need, bucket_bytes), dtype=torch.uint8, device=group[0][1].device)
        packed = bucket.pack(group, out=buffers[slot])
        if buffers[slot].is_cuda:
            torch.cuda.current_stream().synchronize()  # the bytes are in place before the engine looks
        holder[slot] = post(safe_pickle.serialize(packed))
        sent += 1
    return sent
