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
only, in the student edition), prints one line per case, and raises ``AssertionError``
unless every case ran and passed. Exit code 3 (GPU cases not run on this machine) scores
0 with that reason: a case that did not run is never a pass.

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
import re
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


def grade_exercise(exercise_id: str, root: Path | None = None, timeout: float = 900.0) -> None:
    """Grade one exercise of the learner's course_lib; print a line per case; raise unless it fully passed."""
    chapter = exercise_id.split(".", 1)[0]
    root = Path(root) if root else course_root()
    cmd = [sys.executable, str(JUDGE), "test", chapter, "--root", str(root), "--exercise", exercise_id, "--json"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if run.returncode == 2 or not run.stdout.strip():
        raise AssertionError(f"{exercise_id}: the judge could not grade it: {run.stderr.strip()[-800:]}")
    result = json.loads(run.stdout)
    print(f"{exercise_id}: graded in {result['file']} ({'hidden tests too' if result['hidden'] else 'public tests'})")
    for case in result["cases"]:
        verdict = {"pass": "pass", "not graded": "not graded: " + case["message"]}.get(case["outcome"],
                                                                                     "FAIL: " + case["message"])
        print(f"  {case['case']} ... {verdict}")
    if run.returncode == 3:
        raise AssertionError(f"{exercise_id}: incomplete: {result['not_graded']} case(s) need a GPU and were not "
                             "run on this machine; this exercise scores 0 until they run on a GPU")
    if run.returncode != 0:
        failed = [c for c in result["cases"] if c["outcome"] == "fail"]
        raise AssertionError(f"{exercise_id}: {len(failed)} case(s) failed; first: {failed[0]['message']}"
                             if failed else f"{exercise_id}: not passed ({result['status']})")
    print(f"{exercise_id}: every case ran and passed")


class PartNotDone(AssertionError):
    """A part's public cases did not all pass: Run All stops here, at the first such part."""


# A stub's message (regions.stub_line): "chNN.name: write this part (chapter NN, ...)".
_STUB = re.compile(r"NotImplementedError: (ch\d\d\.\w+): write this part")


def _later_part(chapter, exercise_id: str, message: str) -> str | None:
    """The exercise id when ``message`` is the stub of a part that comes AFTER
    ``exercise_id`` in its chapter (the notebook has not asked for it yet), else None."""
    found = _STUB.search(message)
    order = [e.id for e in chapter.exercises]
    if not found or found.group(1) not in order or exercise_id not in order:
        return None
    return found.group(1) if order.index(found.group(1)) > order.index(exercise_id) else None


def public_checks(exercise_id: str, root: Path | None = None, timeout: float = 900.0) -> None:
    """Run the public tests of one exercise (``"ch02.wait_drain"``) on the learner's own
    course_lib (``root``: the edition holding it, found as ``course_root`` does), print one
    line per case (a failing case with its message), and raise ``PartNotDone`` naming the
    part and the notebook section that explains it unless every case ran and passed.

    One exception, so that a notebook runs top to bottom: a case that reached the stub of
    a LATER part of the same chapter (the engine-level cases go through the whole engine)
    is listed as waiting for that part, not as this part's failure. When every case that
    did not pass is such a wait, the check says so ("not complete yet") and returns without
    raising. Those cases pass only when run again after the later part is written; the
    judge grades every case and never counts one that did not pass."""
    from judging import chapters  # the registries beside this judge

    chapter_id, name = exercise_id.split(".", 1)
    chapter = chapters.load(chapter_id)
    exercise = next((e for e in chapter.exercises if e.id == exercise_id), None)
    if exercise is None:
        raise ValueError(f"{exercise_id}: no such exercise in {chapter_id} "
                         f"(its parts: {', '.join(e.id for e in chapter.exercises)})")
    root = Path(root) if root else course_root()
    from judging.chapter_run import run_chapter  # the judge's own run: its messages show the values compared
    result = run_chapter(chapter, root, hidden=False, exercises=[exercise_id], timeout=timeout)
    cases = [c for c in result.cases if c.exercise == exercise_id]
    waits: dict[str, int] = {}
    for c in cases:
        case = c.case.split("::")[-1].removeprefix(f"test_{name}_").lstrip("_")
        later = _later_part(chapter, exercise_id, c.message) if c.outcome == "fail" else None
        if later:
            waits[later] = waits.get(later, 0) + 1
            section = next(e.section for e in chapter.exercises if e.id == later)
            print(f"WAITS   {case}: it goes through {later} (section “{section}”), which comes later "
                  "and is not written yet")
            continue
        label = {"pass": "PASSED", "fail": "FAILED"}.get(c.outcome, "NOT RUN")
        message = "\n        ".join(c.message.splitlines())
        print(f"{label:7} {case}" + (f": {message}" if message else ""))
    passed = sum(c.outcome == "pass" for c in cases)
    if passed and passed == len(cases):
        print(f"{exercise_id}: all {passed} public cases passed")
        return
    where = f"{chapter.notebook}, section “{exercise.section}”"
    if waits and passed and passed + sum(waits.values()) == len(cases):
        print(f"{exercise_id}: {passed} of {len(cases)} public cases passed; the other "
              f"{sum(waits.values())} wait for {', '.join(sorted(waits))}. Not complete yet: check this part "
              f"again once that part is written (the judge grades every case).")
        return
    if not cases:
        said = " ".join(c.message for c in result.cases)[-300:] or "no case of this part was found"
        raise PartNotDone(f"{exercise_id}: no public case ran ({said}); see {where}")
    # Cases stopped by the stub of a part that should be written by now (earlier in this
    # chapter, or another chapter's): name it, rather than "what each expected".
    needed = sorted({m.group(1) for m in (_STUB.search(c.message) for c in cases if c.outcome == "fail")
                     if m and m.group(1) != exercise_id and m.group(1) not in waits})
    needs = (f"; some stopped at {', '.join(needed)}, not written yet: write "
             f"{'it' if len(needed) == 1 else 'them'} first (each message above says where)") if needed else ""
    waiting = sum(waits.values())
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
