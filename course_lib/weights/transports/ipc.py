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

from typing import Iterator

import torch

from course_lib.config import is_cuda
from course_lib.weights.transports import bucket, safe_pickle

DEFAULT_BUCKET_BYTES = 256 << 20


# Consecutive groups of tensors whose packed bucket fits ``bucket_bytes`` (a larger tensor
# goes alone), padding included, so a group still fits the sender's reused buffers. One
# grouper serves every transport; this name is the one ``BucketSender.payloads`` calls.
group_into_buckets = bucket.group_into_buckets


class BucketSender:
    """Packs buckets into a fixed set of buffers used in turn, and serializes them.

    Reusing the same buffers means the engine maps each buffer's IPC handle once (it keeps
    recent mappings open) instead of once per bucket. A buffer is reused only after the
    engine has acknowledged the bucket in it: with two buffers, the next bucket is packed
    while the engine applies the current one.
    """

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, device=None, num_buffers: int = 2):
        self.bucket_bytes = bucket_bytes
        self.device = device
        self.num_buffers = num_buffers
        self._buffers: list[torch.Tensor | None] = [None] * num_buffers
        self._in_use: dict[int, int] = {}   # receipt -> buffer slot, until released
        self._oversize: dict[int, dict] = {}  # receipt -> a one-off bucket too big for the buffers
        self._next = 0

    def _buffer(self, slot: int, need: int, device) -> torch.Tensor:
        buf = self._buffers[slot]
        if buf is None:
            buf = self._buffers[slot] = torch.empty(max(need, self.bucket_bytes), dtype=torch.uint8, device=device)
        return buf

    def payloads(self, named_tensors) -> Iterator[tuple[int, str]]:
        """(receipt, base64 payload) per bucket; payloads are ``load_format="flattened_bucket"``,
        each the serialized (``safe_pickle``) byte-layout bucket of ``weights/transports/bucket.py``.

        Promises:
        - buckets group the tensors, in order, as ``group_into_buckets(named_tensors,
          self.bucket_bytes)`` does; receipts count the buckets handed over, 0, 1, 2, ...
          over the sender's life (a refused bucket takes none);
        - bucket ``r`` travels in buffer slot ``r % self.num_buffers``, a buffer made once
          (``self._buffer``) and reused by every bucket that slot carries, so the sender's
          memory does not grow with the model; a bucket larger than ``self.bucket_bytes``
          (one big tensor) travels in a buffer of its own;
        - a bucket is in flight from the moment it is yielded until ``release``: recorded
          in ``self._in_use[receipt] = slot`` (or ``self._oversize[receipt]``, which keeps
          a one-off buffer alive) before the caller sees it; a slot whose bucket is still in
          flight is never written: asking for that bucket raises ``RuntimeError`` saying
          so, with nothing written;
        - buffers live on ``self.device``, else on the first tensor's device;
        - when a payload is handed over, its bytes are in the buffer for any reader, on
          any stream or in another process, however busy the sender's GPU stream was.
        """
        # BEGIN EXERCISE ch05.ipc_sender
        for group in group_into_buckets(named_tensors, self.bucket_bytes):
            receipt = self._next
            slot = receipt % self.num_buffers
            need = bucket.bucket_nbytes(group)
            device = self.device or group[0][1].device
            if need > self.bucket_bytes:  # one tensor larger than a bucket travels alone: no slot written
                packed = bucket.pack(group, device=device)
                self._oversize[receipt] = packed
            else:
                if slot in self._in_use.values():
                    raise RuntimeError(f"buffer {slot} still holds an unacknowledged bucket: release() it first "
                                       f"(at most {self.num_buffers} buckets may be in flight)")
                packed = bucket.pack(group, out=self._buffer(slot, need, device))
                self._in_use[receipt] = slot
            self._next += 1
            if is_cuda(device):
                torch.cuda.current_stream().synchronize()  # the bytes are there before the engine reads
            yield receipt, safe_pickle.serialize(packed)
        # END EXERCISE

    def release(self, receipt: int) -> None:
        """The engine acknowledged this bucket: its buffer may be reused (or freed)."""
        if self._in_use.pop(receipt, None) is None and self._oversize.pop(receipt, None) is None:
            raise KeyError(f"no bucket {receipt} in flight")

    @property
    def num_alive(self) -> int:
        return len(self._in_use) + len(self._oversize)
