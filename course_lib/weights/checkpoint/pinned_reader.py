"""Read safetensors tensors straight to the GPU at host-to-device speed.

The plain path (read into ordinary memory, then ``.to("cuda")``) is limited by pageable
host-to-device copies and a single reading thread. Here a file's wanted bytes are cut
into segments of at most ``CHUNK_BYTES`` (several small tensors share one, a large one
spans several); each segment is read with ``READ_THREADS`` threads in parallel
(``os.preadv`` releases the GIL) into one of ``RING_BUFFERS`` pinned buffers, and copied
to the GPU asynchronously on a side stream. The threads read up to the whole ring ahead
while earlier segments are being copied and while the caller works on the tensors it
was given (checks them, writes them into the model): reading, transferring and using
overlap. The ring is allocated once per device and reused by every later read (cold
starts and hot updates alike). Only the ring and the tensors not yet consumed are held;
a tensor's GPU memory is allocated when its first bytes arrive, after the tensors before
it were handed out, so a caller that drops each tensor (or layer) once used holds about
one at a time.

The file's identity is checked as the plain reader checks it (``safetensors_format``'s
``open_checked`` and ``check_unchanged``): a file rewritten or replaced since it was
validated is refused before its bytes are used, and one that changes or is truncated
while it is read is refused before the bytes of that segment are handed on.

Streams: each tensor's memory is allocated on the caller's (current) stream; the side
stream waits for the current stream before writing into it (the allocator may hand back
memory that queued work still reads), and the current stream waits for the side stream
before the tensor is handed out. So no host synchronisation is needed, and freeing a
tensor on the current stream is safe without ``record_stream``.

On a CPU device the same pipeline runs with plain buffers and synchronous copies (how
the tests exercise the segmenting, the threads and the identity checks without a GPU).
``COURSE_LIB_READ_THREADS`` and ``COURSE_LIB_READ_CHUNK_MB`` override the defaults (``settings.py``).
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Iterator

import torch

from course_lib import settings
from course_lib.weights.checkpoint.safetensors_format import (CheckpointError, check_unchanged, open_checked,
                                                   read_safetensors_header, tensor_entries, truncated)

# Read once, at import (scripts and tests set these attributes to try other values).
CHUNK_BYTES = settings.read_chunk_bytes()
RING_BUFFERS = 4
# 16 threads read a page-cached file at about 46 GB/s on a 16-core host (8: 30, 1: 6).
READ_THREADS = settings.read_threads()
MIN_PART = 1 << 20  # smaller parts cost more in thread hand-offs than they gain


def plan_segments(entries, data_start: int, chunk: int) -> list[tuple[int, int, list]]:
    """Cut the wanted tensors' bytes into segments: ``(file offset, length, pieces)`` with
    ``length <= chunk``, each a contiguous range of the file; a piece is ``(entry index,
    offset in the tensor, offset in the segment, bytes)``. An empty tensor is a piece of
    no bytes (handed out in its place, nothing read)."""
    segments: list[tuple[int, int, list]] = []
    cur = None  # [file offset, length, pieces]
    for i, (_, _, _, begin, end) in enumerate(entries):
        pos = begin
        if begin == end:
            if cur is None:
                cur = [data_start + begin, 0, []]
                segments.append(cur)
            cur[2].append((i, 0, cur[1], 0))
        while pos < end:
            if cur is None or cur[1] == chunk or cur[0] + cur[1] != data_start + pos:
                cur = [data_start + pos, 0, []]
                segments.append(cur)
            n = min(end - pos, chunk - cur[1])
            cur[2].append((i, pos - begin, cur[1], n))
            cur[1] += n
            pos += n
    return [tuple(s) for s in segments]


def _read_part(fd: int, view: memoryview, offset: int, free) -> int:
    """Fill ``view`` from ``fd`` at ``offset`` once the buffer is free (``free``: the event
    of its last copy out); returns the bytes read (fewer at the end of the file)."""
    if free is not None:
        free.synchronize()
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            break
        done += got
    return done


class _Pipeline:
    """A ring of (pinned) buffers, the reading threads and the copy stream of one device."""

    def __init__(self, device, threads: int, ring: int, chunk: int):
        self.device = torch.device(device)
        self.gpu = self.device.type == "cuda"
        self.threads, self.chunk = threads, chunk
        self.buffers = [torch.empty(chunk, dtype=torch.uint8, pin_memory=self.gpu) for _ in range(ring)]
        self.views = [memoryview(b.numpy()) for b in self.buffers]
        self.free: list = [None] * ring  # per buffer: the event after its last copy out
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="checkpoint-read")
        self.stream = torch.cuda.Stream(self.device) if self.gpu else None
        self.lock = threading.Lock()

    def _submit(self, fd: int, k: int, offset: int, n: int) -> list:
        """Start reading ``n`` bytes at ``offset`` into buffer ``k``, split across the threads."""
        step = max(MIN_PART, -(-n // self.threads))
        return [(a, min(step, n - a), self.pool.submit(_read_part, fd, self.views[k][a:a + step], offset + a,
                                                       self.free[k]))
                for a in range(0, n, step)]

    def run(self, file, fd: int, start: tuple, entries, data_start: int) -> Iterator[tuple[str, torch.Tensor]]:
        segments = plan_segments(entries, data_start, self.chunk)
        ring, pending, tensors = len(self.buffers), {}, {}
        current = torch.cuda.current_stream(self.device) if self.gpu else None

        def submit(j):
            if j < len(segments):
                pending[j] = self._submit(fd, j % ring, segments[j][0], segments[j][1])
        try:
            for j in range(min(ring, len(segments))):
                submit(j)
            for j, (_, n, pieces) in enumerate(segments):
                k = j % ring
                parts = pending.pop(j)
                for a, want, future in parts:
                    got = future.result()  # OSError from a read comes out here
                    if got < want:
                        i = next(p[0] for p in pieces if p[2] + p[3] > a + got)
                        raise truncated(file, entries[i][0], data_start + entries[i][4])
                check_unchanged(fd, file, start)
                for i, at, s, m in pieces:
                    name, dtype, shape, begin, end = entries[i]
                    if at == 0:
                        tensors[i] = torch.empty(end - begin, dtype=torch.uint8, device=self.device)
                        if self.gpu:  # the allocator may reuse memory that queued work still reads
                            self.stream.wait_stream(current)
                    if m:
                        self._copy(tensors[i][at:at + m], self.buffers[k][s:s + m])
                    if at + m == end - begin:
                        out = tensors.pop(i)
                        if self.gpu:
                            current.wait_stream(self.stream)  # the caller's stream sees the bytes
                        yield name, out.view(dtype).view(shape)
                        del out
                if self.gpu:
                    self.free[k] = self.stream.record_event()
                submit(j + ring)
        finally:
            futures = [f for parts in pending.values() for _, _, f in parts]
            for f in futures:
                f.cancel()
            wait(futures)  # no thread may still write into the ring (or read a closed fd)
            if self.gpu and tensors:  # partly written tensors: their memory is reused only after the writes
                current.wait_stream(self.stream)
            tensors.clear()

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.gpu:
            with torch.cuda.stream(self.stream):
                dst.copy_(src, non_blocking=True)
        else:
            dst.copy_(src)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


_PIPELINES: dict[tuple, _Pipeline] = {}
_PIPELINES_LOCK = threading.Lock()


def _pipeline(device) -> tuple[_Pipeline, bool]:
    """The device's kept pipeline (pinned buffers are costly to allocate), locked for
    this read; a temporary one (second return value True) when another read holds it."""
    key = (str(torch.device(device)), READ_THREADS, RING_BUFFERS, CHUNK_BYTES)
    with _PIPELINES_LOCK:
        if key not in _PIPELINES:
            _PIPELINES[key] = _Pipeline(device, READ_THREADS, RING_BUFFERS, CHUNK_BYTES)
        pipe = _PIPELINES[key]
    if pipe.lock.acquire(blocking=False):
        return pipe, False
    return _Pipeline(device, READ_THREADS, RING_BUFFERS, CHUNK_BYTES), True


def iter_safetensors_to_gpu(file, wanted: set[str] | None, device,
                            identity: tuple[int, int, int] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor on ``device``) for each tensor of ``file`` (or only ``wanted``), in
    file order. ``identity`` (``file_identity`` when the file was validated): refuse a file
    rewritten or replaced since, or changed while read (``CheckpointError``)."""
    file = Path(file)
    pipe, temporary = _pipeline(device)
    try:
        fd, start = open_checked(file, identity)
        try:
            header, data_start = read_safetensors_header(file)
            entries = tensor_entries(header, file, wanted)
            try:
                yield from pipe.run(file, fd, start, entries, data_start)
            except OSError as exc:
                raise CheckpointError(f"{file}: cannot read tensor data ({exc})") from exc
        finally:
            os.close(fd)
    finally:
        if temporary:
            pipe.close()
        else:
            pipe.lock.release()
