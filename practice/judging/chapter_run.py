"""One graded run of a chapter: the chapter's tests against the ``course_lib`` of an edition.

The run happens like a problem's (run.py): a fresh temporary directory holding only the
chapter's public tests, its hidden tests when this edition has them, and the judge's
plugin; pytest in its own process group with a time limit. ``PYTHONPATH`` is the graded
edition's root alone, so ``import course_lib`` is that edition's; the plugin records
which ``course_lib`` was imported, and a run that imported another one fails every case
(``$COURSE_LIB_ROOT``, see plugin.py), as does a run that cannot say.

An exercise passes only when every one of its cases ran and passed; its points are all
or nothing, except a test-writing part's (``"scoring": "share"``, chapters.py): its
``_catches_`` cases are each one buggy variant, and the share caught is the share of the
points, once every other case of the part (its tests pass on the reference) passed. A case
that belongs to no exercise (a test file that cannot be imported) counts against every
exercise of the chapter.

A failing case stopped by the stub of a LATER part of its chapter (an engine-level case
goes through the whole engine) "waits" for that part: not this part's failure, never a
pass. ``mark_waits`` decides it, once, for the judge's ``test`` and the notebooks' check
cells alike (notebook.py), so both say ``WAITS`` for the same cases in the same words.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from judging.chapters import Chapter
from judging.run import (Case, RunResult, _cases, _run_limited, plain_environment, pytest_command, records,
                         seal_work_dir)

# A stub's message (regions.stub_line): "chNN.name: write this part (chapter NN, ...)".
STUB = re.compile(r"NotImplementedError: (ch\d\d\.\w+): write this part")


def run_chapter(chapter: Chapter, root: Path, *, hidden: bool = True, timeout: float = 300.0,
                select: str | None = None, exercises: list[str] | None = None,
                threads: int | None = None) -> RunResult:
    """Grade chapter ``chapter``'s exercises in ``root``/course_lib (``exercises``: only these ids)."""
    root = Path(root).resolve()
    if not (root / "course_lib" / "__init__.py").is_file():
        raise ValueError(f"no course_lib/ to grade in {root} (expected {root / 'course_lib' / '__init__.py'})")
    for ex in exercises or []:
        chapter.exercise(ex)  # an unknown id is a usage error, named
    hidden_files = chapter.hidden_files() if hidden else []
    result = RunResult(chapter.id, str(root), bool(hidden_files))
    tmp = Path(tempfile.mkdtemp(prefix=f"judge-{chapter.id}-"))
    try:
        work = tmp / "work"
        work.mkdir()
        tests = copy_chapter_tests(chapter, hidden_files, work)
        results = tmp / "results.jsonl"  # outside the directory the tests run in
        env = _environment(root, results, chapter, exercises, threads)
        cmd = [*pytest_command(work), *[t for t in tests if t.startswith("test_")]]
        if select:
            cmd += ["-k", select]
        start = time.perf_counter()
        output, returncode, timed_out = _run_limited(cmd, work, env, timeout)
        result.seconds = time.perf_counter() - start
        result.output = output[-4000:]
        result.cases = _cases(results, returncode, timed_out, timeout, output)
        _verify_course_lib(result, results, root)
        result.cases = mark_waits(chapter, result.cases)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return result


def copy_chapter_tests(chapter: Chapter, hidden_files: list[Path], work: Path) -> list[str]:
    """Copy the chapter's public and ``hidden_files`` into run directory ``work`` and seal it
    (run.seal_work_dir); returns the file names."""
    tests = []
    for src in chapter.public_files() + hidden_files:
        if (work / src.name).exists():
            raise ValueError(f"{src} has the same name as another test file of {chapter.id}")
        shutil.copyfile(src, work / src.name)
        tests.append(src.name)
    if "test_public.py" not in tests:
        raise ValueError(f"chapter {chapter.id} has no test_public.py in {chapter.path}")
    seal_work_dir(work)
    return tests


def _environment(root: Path, results: Path, chapter: Chapter, exercises, threads) -> dict:
    drop = ("PYTEST_ADDOPTS", "COURSE_JUDGE_RESULTS", "PYTHONPATH", "COURSE_CANDIDATE")
    env = plain_environment({k: v for k, v in os.environ.items() if k not in drop})
    if threads and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(threads)  # runs side by side share the cores (see run.py)
    env.update(
        PYTHONPATH=str(root),  # only the graded edition: its course_lib, nobody else's
        COURSE_LIB_ROOT=str(root),
        COURSE_JUDGE_RESULTS=str(results),
        COURSE_CHAPTER_EXERCISES=",".join(e.id for e in chapter.exercises),
        COURSE_SELECT_EXERCISES=",".join(exercises or []),
        COURSE_REQUIRES_CUDA="0",
        COURSE_REFERENCE_ROOT=reference_root() or "",
        PYTHONDONTWRITEBYTECODE="1",
        PYTEST_DISABLE_PLUGIN_AUTOLOAD="1",
    )
    return env


def later_part(chapter: Chapter, exercise_id: str, message: str) -> str | None:
    """The exercise id when ``message`` is the stub of a part that comes AFTER
    ``exercise_id`` in ``chapter`` (the notebook has not asked for it yet), else None."""
    found = STUB.search(message)
    order = [e.id for e in chapter.exercises]
    if not found or found.group(1) not in order or exercise_id not in order:
        return None
    return found.group(1) if order.index(found.group(1)) > order.index(exercise_id) else None


def wait_message(chapter: Chapter, later: str) -> str:
    """Why a case waits, in the words the judge and the notebooks print after ``WAITS``."""
    return (f"it goes through {later} (section “{chapter.exercise(later).section}”), which comes later "
            "and is not written yet")


def mark_waits(chapter: Chapter, cases: list[Case]) -> list[Case]:
    """``cases`` with each failing case stopped by a later part's stub marked "waits" (with
    that part in ``waits_for`` and ``wait_message`` as its message); the others unchanged."""
    out = []
    for c in cases:
        later = later_part(chapter, c.exercise, c.message) if c.outcome == "fail" else None
        out.append(Case(c.case, "waits", wait_message(chapter, later), c.seconds, c.exercise, later)
                   if later else c)
    return out


def reference_root() -> str | None:
    """The judge's own tree when it is the unchanged instructor edition: the reference the
    differential cases run beside the learner's engine (hidden/chapters/shared/twin.py)."""
    root = Path(__file__).resolve().parents[2]
    edition = root / "course_lib" / "edition.py"
    if not edition.is_file():
        return None
    text = edition.read_text(encoding="utf-8")
    if 'EDITION = "instructor"' not in text or "REPLACED: frozenset[str] = frozenset()" not in text:
        return None
    return str(root)


def _verify_course_lib(result: RunResult, results: Path, root: Path) -> None:
    """Fail the run loudly unless it says it imported ``root``/course_lib."""
    seen = [r for r in records(results) if r.get("event") == "course_lib"]
    want = os.path.realpath(root / "course_lib")
    if seen and (seen[0].get("file") is None or seen[0]["file"] == want):
        return  # imported the right one, or could not import it at all (each test module says why)
    why = (f"the run imported course_lib from {seen[0]['file']}, not from {want}" if seen
           else "the run did not report which course_lib it imported")
    result.cases = [Case(c.case, "fail", f"{why}; nothing was graded", c.seconds, c.exercise)
                    for c in result.cases] or [Case("(course_lib)", "fail", why)]


def exercise_results(chapter: Chapter, result: RunResult, only: list[str] | None = None) -> list[dict]:
    """Per exercise: status (pass / fail / waits / incomplete), case counts, points earned of
    points, and the notebook section that explains it."""
    out = []
    for ex in chapter.exercises:
        if only and ex.id not in only:
            continue
        cases = [c for c in result.cases if c.exercise in (ex.id, "")]
        failed = [c for c in cases if c.outcome == "fail"]
        not_graded = [c for c in cases if c.outcome == "not graded"]
        waiting = sorted({c.waits_for for c in cases if c.outcome == "waits"})
        if failed or not cases:
            status = "fail"
            message = failed[0].message if failed else "no case grades this exercise"
        elif waiting:  # nothing failed, but this part cannot be graded before the later one is written
            status = "waits"
            message = (f"{sum(c.outcome == 'waits' for c in cases)} case(s) wait for {', '.join(waiting)}, which "
                       "comes later and is not written yet; scored 0 until they run and pass")
        elif not_graded:
            status = "incomplete"
            message = f"{len(not_graded)} case(s) need a GPU and were not graded; scored 0 until they run"
        else:
            status, message = "pass", ""
        earned = ex.points if status == "pass" else 0
        if ex.scoring == "share" and status == "fail":
            earned, message = share_earned(ex, cases, message)
        out.append(dict(exercise=ex.id, title=ex.title, section=ex.section, status=status, points=ex.points,
                        scoring=ex.scoring, earned=earned,
                        passed=sum(c.outcome == "pass" for c in cases), failed=len(failed),
                        not_graded=len(not_graded), waits=sum(c.outcome == "waits" for c in cases), message=message))
    return out


CATCHES = "_catches_"  # in a test-writing part's case names: the case gives the tests one buggy variant


def share_earned(ex, cases: list[Case], message: str) -> tuple[float, str]:
    """A failing test-writing part's points and why: the share of its buggy variants caught,
    when every variant's case ran and every other case (the learner's tests pass on the
    reference and on the learner's own component) passed; else 0. The public examples of
    buggy variants count among the variants."""
    catches = [c for c in cases if CATCHES in c.case]
    gates = [c for c in cases if c not in catches]
    if not catches or any(c.outcome != "pass" for c in gates) or any(c.outcome in ("waits", "not graded")
                                                                     for c in catches):
        return 0, message
    caught = sum(c.outcome == "pass" for c in catches)
    return (round(ex.points * caught / len(catches), 2),
            f"your tests caught {caught} of {len(catches)} buggy variants; the points are that share")
