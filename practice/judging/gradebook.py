"""Grade a class: ``submissions/<learner>/`` for every learner, every chapter and every problem.

A learner's folder holds their ``course_lib/`` (graded chapter by chapter), and for
practice problems ``<slug>.py`` files (and may hold notebooks/, which the judge does not
read: nbgrader grades those). Everything a learner handed in is copied (course_lib) or
read into memory (problem files) before any learner's code runs, so code that rewrites
another learner's submission on disk cannot change that learner's grade; each chapter
and each problem is then graded in its own process and temporary directory.

Scores: an exercise earns its points (chapter.json) only when every one of its cases ran
and passed (a test-writing part, "scoring": "share", earns the share of buggy variants its
tests caught); a problem earns its ``points`` (problem.md front matter, default 1) the same
way. A case that needs a GPU this machine lacks is "not graded": the exercise is
"incomplete" and earns 0, and the learner's total is marked incomplete. A case stopped by
a later part of the chapter that the learner has not written "waits": the exercise's
status is "waits" and it earns 0 (grading again changes nothing until that part exists).
"""
from __future__ import annotations

import csv
import json
import shutil
import tempfile
from pathlib import Path

from judging.chapter_run import exercise_results, run_chapter
from judging.chapters import Chapter
from judging.problems import HIDDEN_ABSENT, Problem
from judging.run import run

CASE_FIELDS = ["learner", "item", "exercise", "case", "result", "message", "seconds"]
SCORE_FIELDS = ["learner", "item", "exercise", "status", "points", "max_points",
                "passed", "failed", "not_graded", "message"]


def learners(submissions: Path) -> list[str]:
    return sorted(p.name for p in submissions.iterdir() if p.is_dir() and not p.name.startswith("."))


def _read(path: Path) -> bytes | None:
    return path.read_bytes() if path.is_file() else None


def snapshot(submissions: Path, problems: list[Problem], staging: Path) -> dict[str, dict]:
    """Each learner's problem files (bytes) and a private copy of their course_lib, taken before anything runs."""
    out = {}
    for who in learners(submissions):
        lib = submissions / who / "course_lib"
        root = None
        if (lib / "__init__.py").is_file():
            root = staging / who
            shutil.copytree(lib, root / "course_lib", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        out[who] = {"root": root, "files": {p.slug: _read(submissions / who / f"{p.slug}.py") for p in problems}}
    return out


def grade(submissions: Path, problems: list[Problem], chapters: list[Chapter], *, timeout: float,
          progress=print, speeds: list | None = None) -> tuple[list[dict], list[dict]]:
    """(score rows: one per learner and exercise or problem, case rows: one per case).
    ``speeds``: when a list, each chapter's speed part is also measured (judging/speed.py)
    and its record appended there: a separate score, never part of the points."""
    staging = Path(tempfile.mkdtemp(prefix="judge-class-"))
    try:
        taken = snapshot(submissions, problems, staging)
        for item in [*chapters, *problems]:
            if not item.hidden_files():
                progress(f"{getattr(item, 'slug', None) or item.id}: {HIDDEN_ABSENT}")
        scores, cases = [], []
        for who, sub in taken.items():
            for ch in chapters:
                _grade_chapter(who, ch, sub["root"], timeout, scores, cases, progress)
                if speeds is not None and ch.speed and sub["root"] is not None:
                    speeds.append(_speed(who, ch, sub["root"], scores, progress))
            for problem in problems:
                _grade_problem(who, problem, sub["files"][problem.slug], timeout, scores, cases, progress)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return scores, cases


def _grade_chapter(who, ch: Chapter, root, timeout, scores, cases, progress) -> None:
    if root is None:
        for ex in ch.exercises:
            scores.append(_score(who, ch.id, ex.id, "not submitted", 0, ex.points, message=f"no {who}/course_lib/"))
        progress(f"{who} / {ch.id}: not submitted (no course_lib/)")
        return
    result = run_chapter(ch, root, timeout=timeout)
    cases += [dict(learner=who, item=ch.id, exercise=c.exercise, case=c.case, result=c.outcome,
                   message=c.message, seconds=c.seconds) for c in result.cases]
    for ex in exercise_results(ch, result):
        scores.append(_score(who, ch.id, ex["exercise"], ex["status"], ex["earned"], ex["points"],
                             ex["passed"], ex["failed"], ex["not_graded"], ex["message"]))
    progress(f"{who} / {ch.id}: {result.count('pass')}/{result.graded} graded cases passed"
             + (f", {result.count('not graded')} not graded (needs CUDA)" if result.count("not graded") else ""))


def _speed(who, ch: Chapter, root, scores, progress) -> dict:
    from judging import speed

    passed = any(r["learner"] == who and r["exercise"] == ch.speed["exercise"] and r["status"] == "pass"
                 for r in scores)
    if not passed:  # only a correct part has a speed worth ranking
        rec = dict(chapter=ch.id, exercise=ch.speed["exercise"], scenario=ch.speed["scenario"],
                   status="not scored", why="the part does not pass its graded cases")
    else:
        rec = speed.measure(ch, Path(root))
    rec["learner"] = who
    progress(f"{who} / {speed.line(rec)}")
    return rec


def _grade_problem(who, problem: Problem, source, timeout, scores, cases, progress) -> None:
    top = problem.points
    if source is None:
        scores.append(_score(who, problem.slug, "", "not submitted", 0, top, message=f"no file {who}/{problem.slug}.py"))
        cases.append(dict(learner=who, item=problem.slug, exercise="", case="-", result="not submitted",
                          message=f"no file {who}/{problem.slug}.py", seconds=0.0))
        progress(f"{who} / {problem.slug}: not submitted")
        return
    staging = Path(tempfile.mkdtemp(prefix="judge-submission-"))
    try:
        path = staging / f"{problem.slug}.py"
        path.write_bytes(source)
        result = run(problem, path, timeout=timeout)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    cases += [dict(learner=who, item=problem.slug, exercise="", case=c.case, result=c.outcome,
                   message=c.message, seconds=c.seconds) for c in result.cases]
    first_failure = next((c.message for c in result.cases if c.outcome == "fail"), "")
    scores.append(_score(who, problem.slug, "", result.status, top if result.status == "pass" else 0, top,
                         result.count("pass"), result.count("fail"), result.count("not graded"), first_failure))
    progress(f"{who} / {problem.slug}: {result.count('pass')}/{result.graded} graded cases passed"
             + (f", {result.count('not graded')} not graded (needs CUDA)" if result.count("not graded") else ""))


def _score(who, item, exercise, status, points, top, passed=0, failed=0, not_graded=0, message=""):
    return dict(learner=who, item=item, exercise=exercise, status=status, points=points, max_points=top,
                passed=passed, failed=failed, not_graded=not_graded, message=message)


def totals(scores: list[dict]) -> dict[str, dict]:
    """Per learner: points of max_points, and whether every case of every item was graded."""
    out: dict[str, dict] = {}
    for r in scores:
        t = out.setdefault(r["learner"], {"points": 0, "max_points": 0, "complete": True,
                                          "pass": 0, "fail": 0, "waits": 0, "incomplete": 0,
                                          "not submitted": 0})
        t["points"] += r["points"]
        t["max_points"] += r["max_points"]
        t[r["status"]] += 1
        t["complete"] &= r["status"] != "incomplete"
    return out


SPEED_FIELDS = ["learner", "exercise", "status", "vs_reference", "vs_copy", "learner_gbps", "reference_gbps",
                "copy_gbps", "why"]


def write(scores: list[dict], cases: list[dict], out: Path, speeds: list[dict] | None = None) -> list[Path]:
    """gradebook.csv (a row per learner and exercise or problem, then a TOTAL row per learner),
    cases.csv (a row per case) and gradebook.json (all of it, with totals); with ``speeds``,
    also speed.csv (a row per learner and speed part) and gradebook.json's "speed"."""
    out.mkdir(parents=True, exist_ok=True)
    sums = totals(scores)
    rows = []
    for who in sorted(sums):
        rows += [r for r in scores if r["learner"] == who]
        t = sums[who]
        rows.append(_score(who, "TOTAL", "", "complete" if t["complete"] else "incomplete", t["points"],
                           t["max_points"], message=f"{t['pass']} passed, {t['fail']} failed, {t['incomplete']} "
                                                    f"incomplete (GPU cases not run), {t['not submitted']} not submitted"))
    paths = [out / "gradebook.csv", out / "cases.csv", out / "gradebook.json"]
    for path, fields, data in [(paths[0], SCORE_FIELDS, rows), (paths[1], CASE_FIELDS, cases)]:
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(data)
    book = {"totals": sums, "scores": scores, "cases": cases}
    if speeds is not None:
        book["speed"] = speeds
        paths.append(out / "speed.csv")
        with open(paths[-1], "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=SPEED_FIELDS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(speeds)
    paths[2].write_text(json.dumps(book, indent=1) + "\n", encoding="utf-8")
    return paths
