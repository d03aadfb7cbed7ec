"""A notebook's graded cell: run the judge on one exercise of the learner's OWN course_lib.

A chapter notebook's graded cell (nbgrader ``grade: true``) is::

    import os, pathlib, sys
    here = pathlib.Path.cwd()
    sys.path.insert(0, os.environ.get("COURSE_PRACTICE_DIR") or next(
        str(p / "practice") for p in [here, *here.parents] if (p / "practice" / "judge.py").is_file()))
    from judging.notebook import grade_exercise
    grade_exercise("ch01.block_hash")

(named so that it never shadows a notebook's own ``check`` of the public tests).
``grade_exercise`` runs ``python practice/judge.py test chNN --root ROOT --exercise ID`` with the
judge of the ``practice/`` found above (the instructor's, with hidden tests, when
nbgrader autogrades inside the instructor's repository; the learner's own, public tests
only, in the student edition), prints the judge's line per case, and raises ``NotPassed``
(an ``AssertionError`` a notebook shows as its message alone) unless every case ran and
passed. Exit code 3 (GPU cases not run on this machine, or cases that wait for a later
part) scores 0 with that reason: a case that did not run is never a pass.

Where the learner's course_lib is (ROOT), first match wins:

1. ``$COURSE_SUBMISSION_ROOT``;
2. nbgrader autograde: the notebook runs in ``<course>/autograded/<student>/<assignment>/``;
   the learner's folder is ``<course>/submitted/<student>/``, which must hold ``course_lib/``
   (nbgrader copies only the assignment folder, so course_lib is read where it was handed in);
3. otherwise the nearest folder above the notebook that holds ``course_lib/`` (the
   notebook's edition: ``student/`` for a learner, the repository for the instructor).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

JUDGE = Path(__file__).resolve().parents[1] / "judge.py"


def course_root(start: Path | None = None) -> Path:
    """The folder whose ``course_lib/`` is graded (see the module docstring for the rules)."""
    if os.environ.get("COURSE_SUBMISSION_ROOT"):
        return Path(os.environ["COURSE_SUBMISSION_ROOT"])
    here = Path(start or Path.cwd()).resolve()
    parts = here.parts
    if "autograded" in parts:
        i = len(parts) - 1 - parts[::-1].index("autograded")
        if i + 1 < len(parts):
            submitted = Path(*parts[:i]) / "submitted" / parts[i + 1]
            if submitted.is_dir():
                if not (submitted / "course_lib" / "__init__.py").is_file():
                    raise AssertionError(f"no course_lib/ was handed in with this notebook (looked in {submitted})")
                return submitted
    for folder in [here, *here.parents]:
        if (folder / "course_lib" / "__init__.py").is_file():
            return folder
    raise AssertionError(f"no course_lib/ found in {here} or any folder above it")


class Verdict(AssertionError):
    """The judge's verdict on a part, shown in a notebook as its words alone: IPython prints
    what ``_render_traceback_`` returns instead of a traceback, so the learner reads why,
    not the judge's own frames (which an exported notebook shows in colour codes)."""

    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self}"]


class NotPassed(Verdict):
    """A graded cell's exercise did not fully pass: it scores 0, for the reason given."""


class PartNotDone(Verdict):
    """A part's public cases did not all pass: Run All stops here, at the first such part."""


def grade_exercise(exercise_id: str, root: Path | None = None, timeout: float = 900.0) -> float | None:
    """Grade one exercise of the learner's course_lib; print the judge's line per case; raise
    ``NotPassed`` unless it fully passed. A test-writing part (scored by share) returns its
    points instead, also when only a share was earned: nbgrader reads a graded cell's numeric
    result as its partial credit."""
    from judging.report import case_line
    from judging.run import Case

    chapter = exercise_id.split(".", 1)[0]
    root = Path(root) if root else course_root()
    cmd = [sys.executable, str(JUDGE), "test", chapter, "--root", str(root), "--exercise", exercise_id, "--json"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if run.returncode == 2 or not run.stdout.strip():
        raise NotPassed(f"{exercise_id}: the judge could not grade it: {run.stderr.strip()[-800:]}")
    result = json.loads(run.stdout)
    print(f"{exercise_id}: graded in {result['file']} ({'hidden tests too' if result['hidden'] else 'public tests'})")
    for case in result["cases"]:
        print(case_line(Case(**case)))  # the same lines as `judge.py test`
    (exercise,) = result["exercises"]
    if run.returncode == 0:
        print(f"{exercise_id}: every case ran and passed")
        return exercise["points"] if exercise["scoring"] == "share" else None
    if exercise["scoring"] == "share" and exercise["earned"]:
        print(f"{exercise_id}: {exercise['message']}: {exercise['earned']:g} of {exercise['points']:g} points")
        return exercise["earned"]
    if exercise["status"] == "incomplete":
        raise NotPassed(f"{exercise_id}: incomplete: {exercise['not_graded']} case(s) need a GPU and were not "
                        "run on this machine; this exercise scores 0 until they run on a GPU")
    failed = [c for c in result["cases"] if c["outcome"] == "fail"]
    why = f"{len(failed)} case(s) failed; first: {failed[0]['message']}" if failed else exercise["message"]
    raise NotPassed(f"{exercise_id}: {why}; read {result['notebook']}, section “{exercise['section']}”")


def cost_proxies(chapter_id: str, root: Path | None = None) -> dict | None:
    """A chapter's speed part counted on the learner's course_lib (``judge.py cost``):
    prints each proxy beside the reference's and returns {proxy: (yours, reference)}, or
    None when the part is not written yet or its scenario failed (said in the print). Not
    a grade: it never raises for a count above the reference's."""
    from judging import cost
    path = cost.cost_file(JUDGE.parent / "chapters" / chapter_id)
    if path is None:
        raise ValueError(f"{chapter_id} has no cost proxies (practice/chapters/{chapter_id}/cost.py)")
    return cost.measure(chapter_id, path, Path(root) if root else course_root())[1]


def public_checks(exercise_id: str, root: Path | None = None, timeout: float = 900.0) -> None:
    """Run the public tests of one exercise (``"ch02.wait_drain"``) on the learner's own
    course_lib (``root``: the edition holding it, found as ``course_root`` does), print one
    line per case (a failing case with its message), and raise ``PartNotDone`` naming the
    part and the notebook section that explains it unless every case ran and passed.

    One exception, so that a notebook runs top to bottom: a case that reached the stub of
    a LATER part of the same chapter (the engine-level cases go through the whole engine)
    waits for that part (``chapter_run.mark_waits``, the judge's own rule): it is listed as
    ``WAITS``, not as this part's failure. When every case that did not pass waits, the
    check says so ("not complete yet") and returns without raising. Those cases pass only
    when run again after the later part is written; the judge grades every case and never
    counts one that did not pass."""
    from judging import chapters  # the registries beside this judge
    from judging.chapter_run import STUB, run_chapter  # the judge's own run and its rule for waits

    chapter_id, name = exercise_id.split(".", 1)
    chapter = chapters.load(chapter_id)
    exercise = next((e for e in chapter.exercises if e.id == exercise_id), None)
    if exercise is None:
        raise ValueError(f"{exercise_id}: no such exercise in {chapter_id} "
                         f"(its parts: {', '.join(e.id for e in chapter.exercises)})")
    root = Path(root) if root else course_root()
    result = run_chapter(chapter, root, hidden=False, exercises=[exercise_id], timeout=timeout)
    cases = [c for c in result.cases if c.exercise == exercise_id]
    waits: dict[str, int] = {}
    for c in cases:
        case = c.case.split("::")[-1].removeprefix(f"test_{name}_").lstrip("_")
        if c.outcome == "waits":
            waits[c.waits_for] = waits.get(c.waits_for, 0) + 1
        label = {"pass": "PASSED", "fail": "FAILED", "waits": "WAITS"}.get(c.outcome, "NOT RUN")
        message = "\n        ".join(c.message.splitlines())
        print(f"{label:7} {case}" + (f": {message}" if message else ""))
    passed = sum(c.outcome == "pass" for c in cases)
    if passed and passed == len(cases):
        print(f"{exercise_id}: all {passed} public cases passed")
        return
    where = f"{chapter.notebook}, section “{exercise.section}”"
    waiting = sum(waits.values())
    if waits and passed and passed + waiting == len(cases):
        print(f"{exercise_id}: {passed} of {len(cases)} public cases passed; the other "
              f"{waiting} wait for {', '.join(sorted(waits))}. Not complete yet: check this part "
              f"again once that part is written (the judge grades every case).")
        return
    if not cases:
        said = " ".join(c.message for c in result.cases)[-300:] or "no case of this part was found"
        raise PartNotDone(f"{exercise_id}: no public case ran ({said}); see {where}")
    # Cases stopped by the stub of a part that should be written by now (earlier in this
    # chapter, or another chapter's): name it, rather than "what each expected".
    needed = sorted({m.group(1) for m in (STUB.search(c.message) for c in cases if c.outcome == "fail")
                     if m and m.group(1) != exercise_id})
    needs = (f"; some stopped at {', '.join(needed)}, not written yet: write "
             f"{'it' if len(needed) == 1 else 'them'} first (each message above says where)") if needed else ""
    raise PartNotDone(f"{exercise_id}: {len(cases) - passed - waiting} of {len(cases)} public cases did not pass "
                      + (f"and {waiting} wait for a later part " if waiting else "")
                      + f"(the lines above say what each expected){needs}; see {where}")


def edition_mismatch() -> str | None:
    """Why the ``course_lib`` Python imports is not this notebook's edition's (one
    environment reused for two editions: the student's notebooks would run the
    instructor's engine), or None when it is, or when grading decides the root itself."""
    if os.environ.get("COURSE_SUBMISSION_ROOT") or "autograded" in Path.cwd().parts:
        return None
    import course_lib
    imported = Path(course_lib.__file__).resolve().parents[1]
    try:
        here = course_root().resolve()
    except AssertionError:
        return None
    if imported == here:
        return None
    return (f"this notebook belongs to {here}, but Python imports course_lib from {imported}: "
            f"your edits in {here / 'course_lib'} would not run. Run `bash scripts/setup.sh` in {here} "
            f"(or `pip install -e {here}`) and restart the kernel.")


def chapter_checks(chapter_id: str):
    """``public_checks`` for one chapter's parts by short name: ``check = chapter_checks("ch02")``
    then ``check("wait_drain")``."""
    problem = edition_mismatch()
    if problem:
        print(f"WARNING: {problem}")
    def check(name: str) -> None:
        public_checks(f"{chapter_id}.{name}")
    check.__doc__ = f"Run the public tests of {chapter_id}.<name> on your course_lib; raises until they all pass."
    return check
