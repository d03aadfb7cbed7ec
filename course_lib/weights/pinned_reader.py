"""Read safetensors tensors straight to the GPU at host-to-device speed.

The plain path (read into ordinary memory, then ``.to("cuda")``) is limited by pageable
host-to-device copies and a single reading thread. Here each tensor's bytes are read
with several threads in parallel (``os.preadv`` releases the GIL) into one of two pinned
buffers, and copied to the GPU asynchronously on a side stream while the other buffer is
being filled: reading and transferring overlap, and the transfer runs at pinned speed.
Only the two pinned buffers and the tensors not yet consumed are held.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import torch

from course_lib.weights.safetensors_format import read_safetensors_header, safetensors_dtype

CHUNK_BYTES = 128 << 20
READ_THREADS = min(8, os.cpu_count() or 1)


class _PinnedPipeline:
    def __init__(self, device):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)
        self.buffers = [torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.views = [memoryview(b.numpy()) for b in self.buffers]
        self.done: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0
        self.pool = ThreadPoolExecutor(READ_THREADS)

    def _read(self, fd: int, view: memoryview, offset: int) -> None:
        """Fill ``view`` from ``fd`` at ``offset``, split across threads."""
        n = len(view)
        step = max(1 << 20, -(-n // READ_THREADS))
        parts = [(a, min(a + step, n)) for a in range(0, n, step)]

        def read(part):
            a, b = part
            while a < b:
                got = os.preadv(fd, [view[a:b]], offset + a)
                if got <= 0:
                    raise OSError(f"unexpected end of file at byte {offset + a}")
                a += got
        list(self.pool.map(read, parts))

    def copy_in(self, fd: int, offset: int, out: torch.Tensor) -> None:
        """Fill the uint8 GPU tensor ``out`` from ``fd`` at ``offset``, chunk by chunk."""
        total = out.numel()
        for start in range(0, total, CHUNK_BYTES):
            n = min(CHUNK_BYTES, total - start)
            k = self.turn
            self.turn ^= 1
            if self.done[k] is not None:
                self.done[k].synchronize()  # this pinned buffer's last transfer has finished
            self._read(fd, self.views[k][:n], offset + start)
            with torch.cuda.stream(self.stream):
                out[start:start + n].copy_(self.buffers[k][:n], non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
            self.done[k] = event
        out.record_stream(self.stream)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)  # consumers see the bytes


_PIPELINES: dict[str, _PinnedPipeline] = {}


def iter_safetensors_to_gpu(file, wanted: set[str] | None, device) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, GPU tensor) for each tensor of ``file`` (or only ``wanted``), in file order."""
    key = str(torch.device(device))
    if key not in _PIPELINES:  # pinned buffers are costly to allocate: keep them per device
        _PIPELINES[key] = _PinnedPipeline(device)
    pipe = _PIPELINES[key]
    header, data_start = read_safetensors_header(Path(file))
    entries = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    fd = os.open(file, os.O_RDONLY)
    try:
        for name, info in entries:
            if wanted is not None and name not in wanted:
                continue
            begin, end = info["data_offsets"]
            raw = torch.empty(end - begin, dtype=torch.uint8, device=device)
            if end > begin:
                pipe.copy_in(fd, data_start + begin, raw)
            yield name, raw.view(safetensors_dtype(info["dtype"], file)).view(info["shape"])
    finally:
        os.close(fd)
