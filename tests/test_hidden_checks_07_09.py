"""The hidden checks of chapters 07 and 09 pass the notebooks' own answers and catch plausible
wrong ones (each wrong answer is the reference answer with one mistake the chapter warns about)."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "practice" / "hidden"))

from chapters.ch09_changing_versions_in_production import check_compare_outputs  # noqa: E402


def answer_source(notebook: str, grade_id: str) -> str:
    nb = json.loads((REPO / "notebooks" / notebook).read_text())
    for cell in nb["cells"]:
        if cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") == grade_id:
            return "".join(cell["source"])
    raise LookupError(f"{notebook} has no cell {grade_id!r}")


def define(source: str, name: str, replace: tuple[str, str] | None = None):
    """The function ``name`` from ``source``, optionally with one piece of text replaced."""
    if replace is not None:
        assert replace[0] in source, f"the reference answer no longer contains {replace[0]!r}"
        source = source.replace(*replace)
    from course_lib.server.client import EngineError
    from course_lib.weights import bucket, safe_pickle
    from course_lib.weights.transports.ipc import BucketSender
    namespace = {"time": time, "EngineError": EngineError, "bucket": bucket, "safe_pickle": safe_pickle,
                 "BucketSender": BucketSender}
    exec(compile(source, f"<{name}>", "exec"), namespace)
    return namespace[name]


CMP = ("09_changing_versions_in_production.ipynb", "compare_outputs")
CMP_WRONG = {
    "ignores answers of different lengths": ("if first is None and len(e) != len(g):", "if False:"),
    "counts matching tokens, not identical answers": (
        'sum(f is None for f in firsts) / len(firsts)',
        'sum(a == b for e, g in zip(expected, got) for a, b in zip(e, g)) / max(1, sum(map(len, expected)))'),
    "reports the length instead of the first divergence": ("first = min(len(e), len(g))", "first = max(len(e), len(g))"),
}


def test_compare_check_passes_the_reference():
    assert check_compare_outputs(define(answer_source(*CMP), "compare_outputs")) == []


@pytest.mark.parametrize("mistake", list(CMP_WRONG))
def test_compare_check_catches(mistake):
    failures = check_compare_outputs(define(answer_source(*CMP), "compare_outputs", CMP_WRONG[mistake]))
    assert failures, f"the check passed an answer that {mistake}"
