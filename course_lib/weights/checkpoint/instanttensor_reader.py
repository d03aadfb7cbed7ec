"""Read safetensors files to a GPU through InstantTensor, an optional package.

InstantTensor (``pip install instanttensor``) reads a checkpoint's files with io_uring
(buffered, so a page-cached checkpoint is read from memory) into a GPU ring buffer it
manages in C++, many reads in flight, and hands out each tensor as a view of that ring.
It is the fastest public loader measured on the course's GPU machine. A hot update needs
what a loader does not, and this module adds it around InstantTensor's ``safe_open``:

- the files' identity: each file is opened and checked against the identity
  ``CheckpointReader.metadata()`` validated (``open_checked``) before InstantTensor opens it
  by name, its path is checked to still name the same file once InstantTensor has it
  open, and before each tensor is handed on, the file must not have changed since
  (``check_unchanged``): the same refusals as the engine's own reader (``pinned_reader.py``);
- each tensor's dtype and shape are compared with the header the update validated;
- each tensor handed out owns its memory (InstantTensor's ``copy=True``: a copy out of
  the ring on the device, at device-copy speed), because the layer-by-layer reload holds a layer's tensors until the
  layer is complete; so extra memory is InstantTensor's ring plus what the caller holds.
  The ring is allocated with ``cudaMalloc``, outside torch's allocator and its memory
  counters: ``last_ring_bytes`` says how large the last one was (the benchmark adds it).
  Measured on the H200 at ~8B (results/h200-2026-12-02d/): the ring was as large as the
  largest tensor (1.24 GB) and torch's peak above the start 2.5 GB, two of the largest
  tensors where the own reader's is one (likely: InstantTensor's generator still holds
  the tensor it handed out last while it copies the next; not yet confirmed): 3.74 GB in
  all against 1.25 GB, past the disk update's bound, one reason this reader is not the
  default.

Which reader a disk update uses is ``COURSE_LIB_DISK_READER`` (``settings.disk_reader``):
without the package the engine's own reader runs, whatever the setting asks, and says so
in ``reader_name``. ``python -m course_lib.bench update`` measures both side by side.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import torch

from course_lib import settings
from course_lib.weights.checkpoint.safetensors_format import (CheckpointError, check_unchanged, file_identity, open_checked,
                                                   read_safetensors_header, tensor_entries)


# Reads through the page cache (io_uring, else Linux AIO). Never a memory map: a file
# truncated while mapped kills the process with SIGBUS instead of raising.
BACKENDS_NAMES = ("URING_BUFFERED", "AIO_BUFFERED")
last_ring_bytes = 0  # the GPU ring of the last read (not counted by torch.cuda's memory statistics)


class InstantTensorRefused(CheckpointError):
    """InstantTensor would not open the files (nothing was read or handed out): under
    ``COURSE_LIB_DISK_READER=auto`` the engine's own reader reads them instead."""


def unavailable(device) -> str | None:
    """Why InstantTensor cannot read to ``device`` here, or None when it can."""
    if torch.device(device).type != "cuda":
        return "InstantTensor reads to CUDA devices only"
    try:
        import instanttensor  # noqa: F401
    except ImportError:
        return "instanttensor is not installed (pip install instanttensor)"
    return None


def numbered(device) -> torch.device:
    """``device`` with its index (InstantTensor needs the number: ``cuda`` is the current GPU)."""
    device = torch.device(device)
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def reader_name(device) -> str:
    """``"instanttensor"`` or ``"own"``: the reader a disk update to ``device`` uses now."""
    choice = settings.disk_reader()
    if choice == "own":
        return "own"
    why = unavailable(device)
    if why is None:
        return "instanttensor"
    if choice == "instanttensor":
        raise CheckpointError(f"COURSE_LIB_DISK_READER=instanttensor, but {why}")
    return "own"  # "auto": the package is optional


def iter_with_instanttensor(files: list[Path], wanted: set[str] | None, device,
                            identities: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor on ``device``) for each tensor of ``files`` (or only ``wanted``), read by
    InstantTensor; ``identities`` maps a file to ``file_identity`` as it was validated.
    Refuses (``CheckpointError``) a file rewritten or replaced since, or changed while it
    is read, before the tensors read from it after the change are handed on."""
    global last_ring_bytes
    from instanttensor import Backend, safe_open

    files = [Path(f) for f in files]
    backends = [getattr(Backend, b) for b in BACKENDS_NAMES]
    expected, owner, opened = {}, {}, {}
    try:
        for file in files:
            fd, start = open_checked(file, identities.get(file))
            opened[file] = (fd, start)
            header, _ = read_safetensors_header(file)
            for name, dtype, shape, _, _ in tensor_entries(header, file, wanted):
                expected[name], owner[name] = (dtype, shape), file
        if not expected:
            return
        names = sorted(expected)
        try:
            opened_reader = safe_open(sorted({str(f) for f in owner.values()}), framework="pt",
                                      device=numbered(device), copy=True, backend=backends,
                                      tensor_filter=names, tensor_name_match_mode="exact")
        except (ValueError, RuntimeError, TypeError) as exc:  # e.g. tensors not stored back to back
            raise InstantTensorRefused(f"InstantTensor cannot read these files ({exc})") from exc
        with opened_reader as reader:
            last_ring_bytes = int(getattr(reader, "buffer_size", 0) or 0)
            for file, (fd, start) in opened.items():  # the path still names the file checked above
                if file_identity(file) != start:
                    raise CheckpointError(f"{file}: replaced while the update opened it")
            seen = 0
            for name, tensor in reader.tensors():
                if name not in expected:
                    raise CheckpointError(f"InstantTensor returned {name!r}, which the update did not ask for")
                file = owner[name]
                check_unchanged(opened[file][0], file, opened[file][1])
                dtype, shape = expected[name]
                if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
                    raise CheckpointError(f"{file}: {name} read as {tensor.dtype} {tuple(tensor.shape)}, "
                                          f"but its header says {dtype} {tuple(shape)}")
                seen += 1
                yield name, tensor
            if seen != len(names):
                raise CheckpointError(f"InstantTensor returned {seen} of the {len(names)} tensors asked for")
    except OSError as exc:
        raise CheckpointError(f"cannot read tensor data ({exc})") from exc
    finally:
        for fd, _ in opened.values():
            os.close(fd)
