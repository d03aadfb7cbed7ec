"""The safetensors file format, read by hand: the header and its dtype codes (the table is
``dtypes.SAFETENSORS_DTYPES``, with every other dtype name).

A safetensors file is 8 bytes of little-endian header length, a JSON header ({name:
{"dtype", "shape", "data_offsets"}}, plus an optional ``__metadata__``), then the raw
tensor bytes. ``checkpoint.py`` reads the header to validate a checkpoint before any
tensor data is touched; ``pinned_reader.py`` reads it to copy each tensor's bytes straight
into pinned memory. Both import this module, and it imports neither.

``iter_safetensors_file`` reads tensors without a memory map (see its docstring: a file
truncated under a memory map kills the process with SIGBUS).

``CheckpointError`` lives here because it is the one error every checkpoint reader
raises, and this is the module all of them import.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Iterator

import torch

from course_lib.dtypes import SAFETENSORS_DTYPES, DtypeError, parse_safetensors_dtype  # noqa: F401 (re-exported)


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be read; the message names the file and the fault."""


def safetensors_dtype(code: str, file) -> torch.dtype:
    """The torch dtype of a header's dtype code; CheckpointError naming ``file`` if unsupported."""
    try:
        return parse_safetensors_dtype(code)
    except DtypeError:
        raise CheckpointError(f"{file}: unsupported tensor dtype {code}") from None


def read_safetensors_header(file: Path) -> tuple[dict, int]:
    """(tensor entries of the header, byte offset where the data starts); CheckpointError if unreadable."""
    file = Path(file)
    size = file.stat().st_size
    try:
        with open(file, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            if header_len <= 0 or 8 + header_len > size:
                raise CheckpointError(f"{file}: unreadable safetensors file (header length {header_len} "
                                      f"does not fit in {size} bytes)")
            header = json.loads(f.read(header_len))
        header.pop("__metadata__", None)
        for v in header.values():
            v["data_offsets"][1]  # every entry must carry its byte offsets
    except CheckpointError:
        raise
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        raise CheckpointError(f"{file}: unreadable safetensors file (bad header: {exc})") from exc
    return header, 8 + header_len


def check_safetensors_size(file: Path) -> None:
    """A truncated file is caught here, from its header, before any tensor is read: the
    header says where the last tensor's bytes end, and the file must reach that far."""
    header, data_start = read_safetensors_header(file)
    need = data_start + max((v["data_offsets"][1] for v in header.values()), default=0)
    size = Path(file).stat().st_size
    if need > size:
        raise CheckpointError(f"{file}: truncated: the header needs {need} bytes, the file has {size}")


def file_identity(file) -> tuple[int, int, int]:
    """(inode, size, modification time in ns): changes when a file is rewritten or replaced."""
    st = os.stat(file)
    return st.st_ino, st.st_size, st.st_mtime_ns


_REWRITE_HINT = "trainers should write a new checkpoint elsewhere, then rename it into place"


def open_checked(file, identity: tuple[int, int, int] | None) -> tuple[int, tuple[int, int, int]]:
    """Open ``file`` for reading: (fd, its identity now). ``identity`` (from ``file_identity``
    when the file was validated): a file rewritten or replaced since is refused, closed
    again, before any of its bytes are used. Every reader of tensor data calls this."""
    fd = os.open(file, os.O_RDONLY)
    st = os.fstat(fd)
    now = (st.st_ino, st.st_size, st.st_mtime_ns)
    if identity is not None and now != tuple(identity):
        os.close(fd)
        raise CheckpointError(f"{file}: changed since it was validated (rewritten or replaced); {_REWRITE_HINT}")
    return fd, now


def check_unchanged(fd: int, file, start: tuple[int, int, int]) -> None:
    """Refuse a file that changed (size or modification time) since ``open_checked``:
    called after bytes were read and before they are used."""
    st = os.fstat(fd)
    if (st.st_size, st.st_mtime_ns) != tuple(start[1:]):
        raise CheckpointError(f"{file}: changed while being read; {_REWRITE_HINT}")


def truncated(file, name: str, end: int) -> CheckpointError:
    """The error for a read that found the end of ``file`` before tensor ``name`` ended."""
    return CheckpointError(f"{file}: truncated while being read ({name} ends at byte {end}); {_REWRITE_HINT}")


def tensor_entries(header: dict, file,
                   wanted: set[str] | None = None) -> list[tuple[str, torch.dtype, tuple, int, int]]:
    """(name, dtype, shape, begin, end) of each tensor in ``header`` (or only ``wanted``),
    in file order; ``begin``/``end`` are offsets from the start of the data. A byte
    range that does not fit the shape and dtype is refused."""
    out = []
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        if wanted is not None and name not in wanted:
            continue
        dtype, shape = safetensors_dtype(info["dtype"], file), tuple(info["shape"])
        begin, end = info["data_offsets"]
        if end - begin != math.prod(shape) * dtype.itemsize or begin < 0:
            raise CheckpointError(f"{file}: {name} has {end - begin} bytes for shape {shape} of {dtype}")
        out.append((name, dtype, shape, begin, end))
    return out


def iter_safetensors_file(file, wanted: set[str] | None = None,
                          identity: tuple[int, int, int] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for each tensor of ``file`` (or only ``wanted``), in file order,
    read with ``os.pread`` into fresh memory: no memory map, so a file truncated while it
    is read raises ``CheckpointError`` instead of killing the process with SIGBUS.

    ``identity`` (from ``file_identity`` when the file was validated): a file rewritten
    or replaced since is refused before its bytes are used, and one that changes while
    it is read is refused as soon as that is seen (size or modification time). The
    parallel reader (``pinned_reader.py``) makes the same checks with the same functions."""
    file = Path(file)
    fd, start = open_checked(file, identity)
    try:
        header, data_start = read_safetensors_header(file)
        for name, dtype, shape, begin, end in tensor_entries(header, file, wanted):
            raw = torch.empty(end - begin, dtype=torch.uint8)
            view, done = memoryview(raw.numpy()), 0
            while done < len(view):
                got = os.preadv(fd, [view[done:]], data_start + begin + done)
                if got <= 0:
                    raise truncated(file, name, data_start + end)
                done += got
            check_unchanged(fd, file, start)
            yield name, raw.view(dtype).view(shape)
    finally:
        os.close(fd)
