"""The safetensors file format, read by hand: the header and the dtype table.

A safetensors file is 8 bytes of little-endian header length, a JSON header ({name:
{"dtype", "shape", "data_offsets"}}, plus an optional ``__metadata__``), then the raw
tensor bytes. ``checkpoint.py`` reads the header to validate a checkpoint before any
tensor data is touched; ``pinned_reader.py`` reads it to copy each tensor's bytes straight
into pinned memory. Both import this module, and it imports neither.

``CheckpointError`` lives here because it is the one error every checkpoint reader
raises, and this is the module all of them import.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be read; the message names the file and the fault."""


SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn}


def safetensors_dtype(code: str, file) -> torch.dtype:
    """The torch dtype of a header's dtype code; CheckpointError naming ``file`` if unsupported."""
    if code not in SAFETENSORS_DTYPES:
        raise CheckpointError(f"{file}: unsupported tensor dtype {code}")
    return SAFETENSORS_DTYPES[code]


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
