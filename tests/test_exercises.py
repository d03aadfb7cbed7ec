"""The course's hooks (course_lib/exercises.py) and the engine's composition.

``is_written`` tells the student edition's stub from written code; ``is_reference`` reads
the edition marker (never a source hash), so a comment edit keeps a fast path on while a
swapped region, the student edition or a function replaced at run time turn it off.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from course_lib import Engine, edition
from course_lib.exercises import is_reference, is_written
from course_lib.weights.commit.copy_plan import CopyPlan

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "practice"))
from judging import regions  # noqa: E402


def test_a_stub_is_unwritten_and_anything_else_is_written(tmp_path, monkeypatch):
    (tmp_path / "stubbed_part.py").write_text(textwrap.dedent('''
        def part(x):
            """The docstring stays."""
            # BEGIN EXERCISE ch04.copy_in_place
            raise NotImplementedError('ch04.copy_in_place: write this part (chapter 04, ...)')
            # END EXERCISE

        def written(x):
            # BEGIN EXERCISE ch04.copy_in_place
            return x
            # END EXERCISE
        '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    import stubbed_part
    assert not is_written(stubbed_part.part, "ch04.copy_in_place")
    assert is_written(stubbed_part.part, "ch04.address_audit"), "only that exercise's stub counts"
    assert is_written(stubbed_part.written, "ch04.copy_in_place")
    assert is_written(CopyPlan.apply, "ch04.copy_in_place")


def test_the_reference_is_what_the_edition_marker_says(monkeypatch):
    assert is_reference(CopyPlan.apply, "ch04.copy_in_place")
    assert is_reference(CopyPlan.for_model), "a function that is no exercise is the reference where not replaced"
    monkeypatch.setattr(edition, "REPLACED", frozenset({"ch04.copy_in_place"}))
    assert not is_reference(CopyPlan.apply, "ch04.copy_in_place")
    monkeypatch.setattr(edition, "REPLACED", frozenset())
    monkeypatch.setattr(edition, "EDITION", "student")
    assert not is_reference(CopyPlan.apply, "ch04.copy_in_place")


def test_a_function_replaced_at_run_time_is_not_the_reference(monkeypatch):
    def learners_apply(self, named_tensors):
        return None
    monkeypatch.setattr(CopyPlan, "apply", learners_apply)
    assert not is_reference(CopyPlan.apply, "ch04.copy_in_place")
    assert not is_reference(len)


def _ask(root: Path) -> str:
    code = ("from course_lib.exercises import is_reference; from course_lib.weights.commit.copy_plan import CopyPlan; "
            "print(is_reference(CopyPlan.apply, 'ch04.copy_in_place'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_a_comment_edit_keeps_the_fast_path_and_a_swapped_region_turns_it_off(tmp_path):
    """The old digest of CopyPlan.apply's source switched the registered fast path off when
    a comment changed; the marker does not. A copy whose region was swapped says so."""
    shutil.copytree(REPO / "course_lib", tmp_path / "course_lib", ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path / "course_lib" / "weights" / "commit" / "copy_plan.py"
    text = target.read_text()
    edited = re.sub(r"(# BEGIN EXERCISE ch04.copy_in_place\n)", r"\1        # a maintainer's new comment\n", text)
    assert edited != text
    target.write_text(edited)
    assert _ask(tmp_path) == "True"
    regions.mark_edition(tmp_path, replaced=["ch04.copy_in_place"])
    assert _ask(tmp_path) == "False"
    regions.mark_edition(tmp_path, student=True)
    assert _ask(tmp_path) == "False"


# ---- the engine is composed, and nothing outside it reads its private state -------------

def test_the_engine_is_composed_not_mixed_in():
    assert Engine.__bases__ == (object,)


PRIVATE_READ = re.compile(r"\b(?:engine|eng|victim|e)\._[a-z]")


@pytest.mark.parametrize("where", ["course_lib", "practice", "tests", "notebooks", "scripts"])
def test_no_module_outside_the_engine_reads_a_private_attribute_of_it(where):
    hits = []
    for path in sorted((REPO / where).rglob("*")):
        if path.suffix not in (".py", ".ipynb") or "course_lib/engine/" in path.as_posix() or path == Path(__file__):
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if PRIVATE_READ.search(line):
                hits.append(f"{path.relative_to(REPO)}:{n}: {line.strip()[:100]}")
    assert not hits, "read the engine's parts through their public names:\n" + "\n".join(hits)
