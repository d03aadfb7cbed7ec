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

from chapters.ch07_the_serving_protocol import check_rl_sync  # noqa: E402


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


RL = ("07_the_serving_protocol.ipynb", "rl_sync")
RL_WRONG = {
    "gives up on the first refused flush": ("if not exc.retryable or attempt == tries:", "if True:"),
    "flushes with every bucket": ('load_format="flattened_bucket", flush_cache=False)\n',
                                  'load_format="flattened_bucket", flush_cache=True)\n'),
    "labels the first bucket with the new version": (
        'load_format="flattened_bucket", flush_cache=False)\n',
        'load_format="flattened_bucket", flush_cache=False, weight_version=weight_version)\n'),
    "never flushes after the last bucket": ("    flush_with_retries()\n    lap(\"flush_s\")", "    lap(\"flush_s\")"),
    "never continues": ("    client.continue_generation()\n", "\n"),
    "does not pause": ('    client.pause_generation("abort")\n', "\n"),
}


def test_rl_sync_check_passes_the_reference():
    assert check_rl_sync(define(answer_source(*RL), "rl_sync")) == []


@pytest.mark.parametrize("mistake", list(RL_WRONG))
def test_rl_sync_check_catches(mistake):
    failures = check_rl_sync(define(answer_source(*RL), "rl_sync", RL_WRONG[mistake]))
    assert failures, f"the check passed an answer that {mistake}"
