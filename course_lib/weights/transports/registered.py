"""The trainer's side of registered buffers (``weights/commit/copy_table.py``): share once, then
send bucket numbers.

``RegisteredSender`` lays out the trainer's tensors once (``stream_layout``: a tensor may
span buckets), allocates the buffers, and gives the engine one registration (the buffers'
IPC handles and the layout). Each update then packs bucket ``k`` into its buffer (the
pieces of the tensors that fall in it) and sends ``{"epoch", "buckets": [k]}``; the
engine copies from its table. As with ``BucketSender``, a buffer is reused only after the
engine acknowledged the bucket in it.

``resident=True`` is the trainer whose weights live in the shared memory itself (as a
trainer with one flat parameter buffer keeps them): ``adopt`` moves the tensors into one
registered buffer once and returns them as views of it, and an update is a single message
naming every bucket, with no packing at all. The trainer must not change those weights
until the engine has acknowledged it.
"""
from __future__ import annotations

from typing import Iterator

import torch

from course_lib.config import is_cuda
from course_lib.dtypes import dtype_name
from course_lib.weights.transports import safe_pickle
from course_lib.weights.transports.bucket import ALIGN, align_up

DEFAULT_BUCKET_BYTES = 512 << 20


class RegistrationError(ValueError):
    """A registration or a registered update refused; the message names what was wrong."""


def stream_layout(metas, bucket_bytes: int, num_buffers: int | None = 2) -> dict:
    """The registration layout of ``metas`` ([(name, dtype, shape)] in send order): each
    tensor's bytes start 16-byte aligned in one stream, cut into buckets of ``bucket_bytes``.

    ``num_buffers``: bucket ``k`` lives at the start of buffer ``k % num_buffers`` (a
    trainer packing into a few reused buffers), or, with None, every bucket is a range of
    one buffer holding the whole stream (a trainer whose weights live in that buffer: no
    packing at all). Returns {"buffer_bytes": [...], "buckets": [...], "tensors": [...]}."""
    if bucket_bytes <= 0 or bucket_bytes % ALIGN:
        raise RegistrationError(f"bucket_bytes must be a positive multiple of {ALIGN}, got {bucket_bytes}")
    tensors, pos = [], 0
    for name, dtype, shape in metas:
        pos = align_up(pos)
        n, pieces = (torch.Size(shape).numel() * dtype.itemsize), []
        start, end = pos, pos + (torch.Size(shape).numel() * dtype.itemsize)
        while start < end:
            k, off = divmod(start, bucket_bytes)
            take = min(end - start, bucket_bytes - off)
            pieces.append([k, off, take])
            start += take
        tensors.append([name, dtype_name(dtype), [int(s) for s in shape], pieces])
        pos += n
    num_buckets = -(-pos // bucket_bytes)
    sizes = [min(bucket_bytes, pos - k * bucket_bytes) for k in range(num_buckets)]
    if num_buffers is None:
        return {"buffer_bytes": [pos], "tensors": tensors,
                "buckets": [[0, k * bucket_bytes, sizes[k]] for k in range(num_buckets)]}
    if num_buffers < 1:
        raise RegistrationError(f"num_buffers must be at least 1 (or None), got {num_buffers}")
    used = min(num_buffers, num_buckets)
    return {"buffer_bytes": [max(sizes[k::num_buffers]) for k in range(used)], "tensors": tensors,
            "buckets": [[k % num_buffers, 0, sizes[k]] for k in range(num_buckets)]}


class RegisteredSender:
    """One registration, then bucket numbers; see the module docstring."""

    def __init__(self, metas, bucket_bytes: int = DEFAULT_BUCKET_BYTES, device="cpu", num_buffers: int = 2,
                 resident: bool = False):
        """``metas``: (name, dtype, shape) per tensor, in the order they will be sent (or
        (name, tensor) pairs)."""
        metas = [(m[0], m[1].dtype, tuple(m[1].shape)) if len(m) == 2 else tuple(m) for m in metas]
        self.names = [m[0] for m in metas]
        self.layout = stream_layout(metas, bucket_bytes, None if resident else num_buffers)
        self.resident, self.device = resident, torch.device(device)
        self.buffers = [torch.empty(n, dtype=torch.uint8, device=device) for n in self.layout["buffer_bytes"]]
        self.epoch: int | None = None
        self._in_use: dict[int, list[int]] = {}  # receipt -> buckets it holds, until released
        self._next = 0
        # Per bucket: (tensor index, byte offset in the tensor, byte offset in the buffer, nbytes).
        self._pieces: list[list[tuple[int, int, int, int]]] = [[] for _ in self.layout["buckets"]]
        for i, (_, _, _, pieces) in enumerate(self.layout["tensors"]):
            pos = 0
            for k, off, n in pieces:
                self._pieces[k].append((i, pos, self.layout["buckets"][k][1] + off, n))
                pos += n

    @property
    def num_buckets(self) -> int:
        return len(self.layout["buckets"])

    def registration(self, serialized: bool = True) -> str | dict:
        """The payload for ``register_weight_buffers``: serialized for another process (the
        buffers travel as CUDA IPC handles or shared memory, the layout as plain lists), or
        the dict itself for an engine in this process (a CUDA IPC handle cannot be opened
        by the process that made it)."""
        payload = {"buffers": self.buffers, "buckets": self.layout["buckets"], "tensors": self.layout["tensors"]}
        return safe_pickle.serialize(payload) if serialized else payload

    def adopt(self, named_tensors) -> list[tuple[str, torch.Tensor]]:
        """(resident only) Copy the tensors into the registered buffer once and return
        them as views of it: the trainer's weights from now on."""
        if not self.resident:
            raise RuntimeError("adopt() is for a resident sender (RegisteredSender(..., resident=True))")
        out = []
        for (name, t), (reg_name, _, shape, pieces) in zip(named_tensors, self.layout["tensors"]):
            if name != reg_name:
                raise ValueError(f"tensor {name!r} comes where {reg_name!r} was laid out")
            start = self.layout["buckets"][pieces[0][0]][1] + pieces[0][1] if pieces else 0
            view = self.buffers[0][start:start + t.numel() * t.element_size()].view(t.dtype).view(shape)
            view.copy_(t)
            out.append((name, view))
        return out

    def _pack(self, k: int, tensors) -> None:
        buf = self.buffers[self.layout["buckets"][k][0]]
        for i, pos, at, n in self._pieces[k]:
            src = tensors[i][1].reshape(-1).view(torch.uint8)[pos:pos + n]
            dst = buf[at:at + n]
            if src.data_ptr() != dst.data_ptr():  # a resident tensor is already in place
                dst.copy_(src)

    def payloads(self, named_tensors) -> Iterator[tuple[int, dict]]:
        """(receipt, message) per update message; the message is
        ``update_weights_from_registered``'s keyword arguments ``buckets`` and ``epoch``.
        Packs one bucket per message (all of them, unpacked, when resident). Raises
        ``RuntimeError`` before packing into a buffer an unacknowledged bucket still holds."""
        if self.epoch is None:
            raise RuntimeError("set sender.epoch to what register_weight_buffers returned first")
        tensors = list(named_tensors)
        if [n for n, _ in tensors] != self.names:
            raise ValueError("send the tensors registered, in the order registered")
        groups = [list(range(self.num_buckets))] if self.resident else [[k] for k in range(self.num_buckets)]
        for group in groups:
            busy = {self.layout["buckets"][k][0] for ks in self._in_use.values() for k in ks}
            if not self.resident and self.layout["buckets"][group[0]][0] in busy:
                raise RuntimeError(f"buffer {self.layout['buckets'][group[0]][0]} still holds an unacknowledged "
                                   f"bucket: release() it first")
            for k in group:
                self._pack(k, tensors)
            if is_cuda(self.device):
                torch.cuda.current_stream(self.device).synchronize()  # the bytes are there before the engine reads
            receipt, self._next = self._next, self._next + 1
            self._in_use[receipt] = group
            yield receipt, {"epoch": self.epoch, "buckets": group}

    def release(self, receipt: int) -> None:
        """The engine acknowledged this message: its buffers may be reused."""
        if self._in_use.pop(receipt, None) is None:
            raise KeyError(f"no message {receipt} in flight")
