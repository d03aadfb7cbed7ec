"""The hidden checks of chapter 06 pass reference answers and catch plausible wrong ones
(a check that passes everything would grade nothing). Chapters 00 and 05's exercises are
regions in course_lib, checked by practice/hidden/chapters/ch00/ and ch05/."""
from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "practice" / "hidden"))

from chapters.ch06_resharding import check_plan_pieces  # noqa: E402


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


def test_ch06_plan_pieces():
    assert check_plan_pieces(solution("06_resharding.ipynb", "plan_pieces")) == []
    assert check_plan_pieces(lambda shape, src_boxes, dst_boxes: [])
