"""One kernel launch that copies every piece of a registered bucket (GPU, needs Triton).

A bucket of a registered update (``registered.py``) is a few hundred byte ranges, each
copied from the trainer's buffer into a weight. As ``copy_`` calls (or a CUDA graph of
them) each range is its own memcpy, with a gap between them; here one kernel reads a
table of (source address, destination address, words) chunks and every program copies
one chunk, so all pieces move in one launch. Used when asked for (copy mode
``"scatter"``); the table is built once, at registration, from the same views the
other modes copy (so the three write the same bytes: a GPU test checks it).
"""
from __future__ import annotations

import torch

CHUNK_BYTES = 1 << 20   # one program's share of a piece
WORD = 16               # bytes per element moved: pieces and addresses are 16-byte aligned

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
        n = tl.load(table + row + 2)  # 8-byte words (pieces are 16-byte multiples)
        offs = tl.arange(0, BLOCK)
        for start in range(0, n, BLOCK):
            idx = start + offs
            mask = idx < n
            tl.store(dst + idx, tl.load(src + idx, mask=mask), mask=mask)


def available() -> bool:
    return triton is not None and torch.cuda.is_available()


def build_table(sources, destinations) -> torch.Tensor | None:
    """The chunk table for these (uint8 source, uint8 destination) pairs, on their device,
    or None when a pair is not 16-byte aligned (the caller then copies another way)."""
    rows = []
    for src, dst in zip(sources, destinations):
        if src.dtype != torch.uint8 or dst.dtype != torch.uint8:
            return None
        n, a, b = src.numel(), src.data_ptr(), dst.data_ptr()
        if n % WORD or a % WORD or b % WORD:
            return None
        for start in range(0, n, CHUNK_BYTES):
            take = min(CHUNK_BYTES, n - start)
            rows.append((a + start, b + start, take // 8))
    if not rows:
        return None
    return torch.tensor(rows, dtype=torch.int64, device=sources[0].device)


def scatter(table: torch.Tensor) -> None:
    """Copy every chunk of ``table`` in one launch (on the current stream)."""
    _scatter[(table.shape[0],)](table, BLOCK=2048, num_warps=8)
