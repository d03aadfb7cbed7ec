"""Wrong: safe but serial. Waiting for the bucket just posted before packing the next one
means the engine never applies one bucket while the trainer packs the next: the second
buffer is never used for overlap, and the transfer takes the sum of both times."""
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
        previous = holder[(slot - 1) % num_buffers]
        if previous is not None:
            wait_ack(previous)      # to be safe, the last bucket is applied before packing the next
        if holder[slot] is not None:
            wait_ack(holder[slot])
            holder[slot] = None
        need = bucket.bucket_nbytes(group)
        if buffers[slot] is None or buffers[slot].numel() < need:
            buffers[slot] = torch.empty(max(need, bucket_bytes), dtype=torch.uint8, device=group[0][1].device)
        packed = bucket.pack(group, out=buffers[slot])
        if buffers[slot].is_cuda:
            torch.cuda.current_stream().synchronize()  # the bytes are in place before the engine looks
        holder[slot] = post(safe_pickle.serialize(packed))
        sent += 1
    for receipt in holder:  # keep every buffer alive and unchanged until its bucket is applied
        if receipt is not None:
            wait_ack(receipt)
    return sent
