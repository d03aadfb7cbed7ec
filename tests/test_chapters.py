"""Each chapter's reference (this checkout's course_lib) passes the chapter's public and hidden
cases through the judge, the way a chapter notebook's graded cells grade it: one judge run per
chapter (the notebooks' execution test leaves the graded cells and check cells out for this;
chapter 01's run is in tests/test_judge.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
CHAPTERS = sorted(p.name for p in (REPO / "practice" / "chapters").glob("ch[0-9][0-9]"))
# Chapter 01's reference is graded the same way, and held to more (exit 0, every exercise
# passing with full points), by tests/test_judge.py::test_chapter_reference_passes_every_exercise.
GRADED_ELSEWHERE = {"ch01"}


@pytest.mark.parametrize("chapter", [ch for ch in CHAPTERS if ch not in GRADED_ELSEWHERE])
def test_each_chapters_reference_passes_the_judge(chapter):
    env = {k: v for k, v in os.environ.items() if k not in ("COURSE_HIDDEN_DIR", "PYTHONPATH")}
    # The differential cases' random scenarios: 10 here for the suite's time (a graded run
    # draws 40; the reference's soaks at 2,000 are recorded in results/).
    env["COURSE_SCENARIOS"] = "10"
    run = subprocess.run([sys.executable, "practice/judge.py", "test", chapter, "--json"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert run.stdout.strip(), run.stderr[-2000:]
    result = json.loads(run.stdout)
    failed = [(c["case"], c["message"][:300]) for c in result["cases"] if c["outcome"] == "fail"]
    assert not failed and result["hidden"], failed or "the hidden tests were not found"
    # 3: nothing failed but GPU cases could not run, which is only right where there is no GPU.
    assert run.returncode == 0 or (run.returncode == 3 and not torch.cuda.is_available()), run.stdout[-2000:]
    assert result["points"] == result["max_points"] or run.returncode == 3


class _Collected:
    """A pytest plugin that keeps the items a --collect-only run found."""

    def __init__(self):
        self.items = []

    def pytest_collection_modifyitems(self, items):
        self.items.extend(items)


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_a_check_cell_runs_exactly_its_exercises_public_cases(chapter):
    """A notebook's check cell runs ``pytest -k test_<name>_`` on the chapter's public tests:
    the cases that selects must be exactly those marked with that exercise (a case of
    another exercise there would fail at that exercise's stub, in a cell that is not about it)."""
    collected = _Collected()
    public = REPO / "practice" / "chapters" / chapter / "test_public.py"
    code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "--import-mode=importlib",
                        str(public)],
                       plugins=[collected])
    assert code == 0 and collected.items, f"{public} could not be collected"
    registry = json.loads((public.parent / "chapter.json").read_text())
    for exercise in registry["exercises"]:
        name = exercise["id"].split(".", 1)[1]
        by_name = {i.name for i in collected.items if f"test_{name}_" in i.name}
        by_mark = {i.name for i in collected.items if i.get_closest_marker("exercise").args[0] == exercise["id"]}
        assert by_name == by_mark and by_mark, (exercise["id"], sorted(by_name ^ by_mark))
