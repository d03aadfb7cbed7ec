"""The hidden checks of chapters 05 and 06 pass reference answers and catch plausible
wrong ones (a check that passes everything would grade nothing). Chapter 00's exercises
are regions in course_lib, checked by practice/hidden/chapters/ch00/."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from course_lib.weights import bucket

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "practice" / "hidden"))

from chapters.ch05_moving_the_bytes import check_pack_unpack  # noqa: E402


def solution(notebook: str, name: str):
    """The function ``name`` from the notebook's solution cell that defines it."""
    nb = json.loads((REPO / "notebooks" / notebook).read_text())
    for cell in nb["cells"]:
        src = "".join(cell["source"])
        if cell.get("metadata", {}).get("nbgrader", {}).get("solution") and f"def {name}(" in src:
            namespace: dict = {}
            exec(compile(src, f"<{name}>", "exec"), namespace)
            return namespace[name]
    raise LookupError(f"{notebook} has no solution cell defining {name}")


def unaligned_pack(named_tensors):
    """Plausible but wrong: tensors packed back to back, with no alignment."""
    named_tensors = list(named_tensors)
    out = torch.empty(sum(t.numel() * t.element_size() for _, t in named_tensors), dtype=torch.uint8)
    meta, offset = [], 0
    for name, t in named_tensors:
        n = t.numel() * t.element_size()
        out[offset:offset + n].copy_(t.reshape(-1).view(torch.uint8))
        meta.append(bucket.FlattenedTensorMetadata(name, torch.Size(t.shape), t.dtype, offset, offset + n, t.numel()))
        offset += n
    return {"flattened_tensor": out, "metadata": meta}


def test_ch05_pack_unpack():
    assert check_pack_unpack(bucket.pack, bucket.unpack) == []
    assert check_pack_unpack(unaligned_pack, bucket.unpack)

