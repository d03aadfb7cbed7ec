"""The notebook's check helper in the order the notebook asks for the parts.

A part's public engine-level cases may go through a part the notebook asks for later
(chapter 02's version tags are checked across an update, which needs a pause mode). Such a
case is listed as waiting for that part, the check says "not complete yet" and Run All goes
on; a case stopped by a part that should already be written (earlier in the chapter, or
another chapter's) still stops the notebook, naming that part.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PRACTICE = REPO / "practice"
sys.path.insert(0, str(PRACTICE))
from judging import chapters, regions  # noqa: E402
from judging.notebook import PartNotDone, public_checks  # noqa: E402


@pytest.fixture(scope="module")
def pause_modes_unwritten(tmp_path_factory):
    """An edition whose chapter 02 part 3 (the pause modes) is still the stub."""
    root = tmp_path_factory.mktemp("edition")
    shutil.copytree(REPO / "course_lib", root / "course_lib", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(PRACTICE / "chapters", root / "practice" / "chapters", ignore=shutil.ignore_patterns("__pycache__"))
    ch02 = chapters.load("ch02")
    stub = ch02.stub(next(e for e in ch02.exercises if e.id == "ch02.pause_modes")) + "\n"
    target = root / "course_lib" / "engine" / "pause.py"
    target.write_text(regions.replace_bodies(target.read_text(), {"ch02.pause_modes": stub}, target))
    return root


def test_a_case_through_a_later_part_waits_and_run_all_goes_on(pause_modes_unwritten, capsys):
    public_checks("ch02.versions", root=pause_modes_unwritten)  # part 1: must not raise
    out = capsys.readouterr().out
    assert "WAITS   tags_in_the_engine_across_an_update: it goes through ch02.pause_modes" in out, out
    assert "PASSED  tags_one_per_token_in_order" in out, out
    assert "Not complete yet" in out and "all 7 public cases passed" not in out, out


def test_a_case_stopped_by_an_earlier_unwritten_part_stops_run_all_naming_it(pause_modes_unwritten, capsys):
    with pytest.raises(PartNotDone, match=r"ch02.wait_drain: 3 of 3 public cases did not pass.*"
                                          r"some stopped at ch02.pause_modes, not written yet: write it first"):
        public_checks("ch02.wait_drain", root=pause_modes_unwritten)  # part 4, after part 3
    assert "WAITS" not in capsys.readouterr().out


def test_a_submission_folder_with_course_lib_only_is_checked_with_this_judges_tests(tmp_path, capsys):
    """nbgrader autograde runs the notebook beside the learner's handed-in course_lib, which
    has no practice/ folder: the check cells use the judge's own public tests then."""
    shutil.copytree(REPO / "course_lib", tmp_path / "course_lib", ignore=shutil.ignore_patterns("__pycache__"))
    public_checks("ch02.flush_rules", root=tmp_path)
    assert "all 5 public cases passed" in capsys.readouterr().out
