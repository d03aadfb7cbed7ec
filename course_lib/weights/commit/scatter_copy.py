"""One kernel launch that copies every piece of a registered bucket (GPU, needs Triton).

A bucket of a registered update (``registered.py``) is a few hundred byte ranges, each
copied from the trainer's buffer into a weight. As ``copy_`` calls (or a CUDA graph of
them) each range is its own memcpy, with a gap between them; here one kernel reads a
table of (source, destination, words) chunks and every program copies one chunk, so all
pieces move in one launch. Used when asked for (copy mode ``"scatter"``, the default on
a GPU with Triton); the table is built once, at registration, from the same views the
other modes copy (so all modes write the same bytes: a GPU test checks it).

What sets its speed, measured on an H200 (``python -m course_lib.bench copy-kernels``,
results/h200-2026-12-01d/): small chunks (256 KiB), so a bucket of a few large weights
still spreads over every SM, and 4096 words per program per iteration with 8 warps (16
words in flight per thread). That reaches 92% of one device copy of the same bytes at
~1.7B (316 pieces) and 93% at ~8B, against 87% and 89% with 1 MiB chunks and 2048-word
blocks. Declaring the addresses 16-byte aligned (``tl.multiple_of`` on offsets from an
aligned base) was no faster (1 to 3% slower in the same run), so the kernel does not.
"""
from __future__ import annotations

import torch

WORD = 16                 # pieces and addresses are 16-byte aligned (and lengths multiples of 16)
CHUNK_BYTES = 256 << 10   # one program's share of a piece      (measured: see the docstring)
BLOCK = 4096              # 8-byte words per program per iteration
NUM_WARPS = 8

try:  # Triton ships with CUDA builds of torch; CPU builds have none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

if triton is not None:
    @triton.jit
    def _scatter(table, BLOCK: tl.constexpr):
        row = tl.program_id(0) * 3
        src = tl.load(table + row).to(tl.pointer_type(tl.int64))
        dst = tl.load(table + row + 1).to(tl.pointer_type(tl.int64))
        n = tl.load(table + row + 2)  # 8-byte words
        offs = tl.arange(0, BLOCK)
        for start in range(0, n, BLOCK):
            idx = start + offs
            mask = idx < n
            tl.store(dst + idx, tl.load(src + idx, mask=mask), mask=mask)


def available() -> bool:
    return triton is not None and torch.cuda.is_available()


def build_table(sources, destinations, chunk_bytes: int | None = None) -> torch.Tensor | None:
    """The chunk table for these (uint8 source, uint8 destination) pairs, on their device:
    one row (source address, destination address, 8-byte words) per chunk of at most
    ``chunk_bytes`` (default ``CHUNK_BYTES``); None when a pair is not 16-byte aligned
    (the caller then copies another way)."""
    chunk = chunk_bytes or CHUNK_BYTES
    if chunk % WORD:
        raise ValueError(f"chunk_bytes must be a multiple of {WORD}, got {chunk}")
    rows = []
    for src, dst in zip(sources, destinations):
        if src.dtype != torch.uint8 or dst.dtype != torch.uint8:
            return None
        n, a, b = src.numel(), src.data_ptr(), dst.data_ptr()
        if n % WORD or a % WORD or b % WORD:
            return None
        for start in range(0, n, chunk):
            rows.append((a + start, b + start, min(chunk, n - start) // 8))
    if not rows:
        return None
    return torch.tensor(rows, dtype=torch.int64, device=sources[0].device)


def scatter(table: torch.Tensor, block: int | None = None, num_warps: int | None = None) -> None:
    """Copy every chunk of ``table`` in one launch (on the current stream). The settings
    default to the module's measured ones; the benchmark passes others to compare."""
    _scatter[(table.shape[0],)](table, BLOCK=block or BLOCK, num_warps=num_warps or NUM_WARPS)
