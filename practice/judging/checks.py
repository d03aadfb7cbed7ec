"""``judge.py check`` for chapters: the reference passes, each stub and each wrong variant fails.

For each chapter: one run of the instructor's ``course_lib`` (every exercise must pass;
cases that need a GPU this machine lacks are "not graded" and allowed). For each
exercise: one run with that region stubbed and one per wrong variant
(``hidden/chapters/chNN/wrong/<name>.<variant>.py``, a body written at column 0), each on
a temporary copy of ``course_lib`` with only that region changed, grading only that
exercise's cases; each must fail a case.
"""
from __future__ import annotations

import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from judging import regions, report
from judging.chapter_run import run_chapter
from judging.chapters import Chapter


def variant_root(repo: Path, exercise_id: str, body: str) -> Path:
    """A temporary edition whose course_lib is ``repo``'s with region ``exercise_id``'s body replaced."""
    region = next((r for r in regions.find(repo) if r.id == exercise_id), None)
    if region is None:
        raise regions.RegionError(f"no region {exercise_id} in {repo / 'course_lib'}")
    tmp = Path(tempfile.mkdtemp(prefix=f"judge-{exercise_id}-"))
    shutil.copytree(repo / "course_lib", tmp / "course_lib",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    target = tmp / region.path.relative_to(repo)
    target.write_text(regions.replace_bodies(target.read_text(encoding="utf-8"), {exercise_id: body}, target),
                      encoding="utf-8")
    regions.mark_edition(tmp, replaced=[exercise_id])  # no fast path may stand in for the swapped part
    return tmp


def _run_variant(chapter: Chapter, repo: Path, exercise_id: str, body: str, **kw):
    root = variant_root(repo, exercise_id, body)
    try:
        return run_chapter(chapter, root, exercises=[exercise_id], **kw)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def chapter_checks(chapters: list[Chapter], repo: Path, *, timeout: float, threads: int | None,
                   wanted: set[str] = frozenset()) -> list[tuple]:
    """(label, what, should_pass, run) jobs for ``run_checks``.

    ``wanted``: chapter ids and exercise ids to check (empty: all). Naming an exercise
    checks the reference on that exercise's cases, its stub and its wrong variants.
    """
    kw = dict(timeout=timeout, threads=threads)
    jobs = []
    for ch in chapters:
        picked = [ex for ex in ch.exercises if not wanted or ch.id in wanted or ex.id in wanted]
        if not picked:
            continue
        only = None if len(picked) == len(ch.exercises) else [ex.id for ex in picked]
        jobs.append((ch.id, "reference (course_lib)", True,
                     lambda ch=ch, only=only: run_chapter(ch, repo, exercises=only, **kw)))
        for ex in picked:
            stub = ch.stub(ex) + "\n"
            jobs.append((ex.id, "stub", False, lambda ch=ch, ex=ex, stub=stub: _run_variant(ch, repo, ex.id, stub, **kw)))
            for _, variant, path in ch.wrong_variants(ex):
                jobs.append((ex.id, f"wrong/{path.name}", False,
                             lambda ch=ch, ex=ex, path=path: _run_variant(
                                 ch, repo, ex.id, path.read_text(encoding="utf-8"), **kw)))
    return jobs


def run_checks(jobs: list[tuple], workers: int, repeat: int = 1) -> tuple[list[list[str]], list[dict], bool, int]:
    """Run the jobs (each its own process) ``workers`` at a time, each ``repeat`` times;
    rows for the table, records, whether no verdict is WRONG, and how many could not be
    decided here. A row holds only if every repeat holds: a wrong answer caught in some
    runs and not in others is a grade that changes with the run."""
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        flat = list(pool.map(lambda job: job[3](), [job for job in jobs for _ in range(repeat)]))
    rows, records, all_ok, undecided = [], [], True, 0
    for i, (label, what, should_pass, _) in enumerate(jobs):
        runs = flat[i * repeat:(i + 1) * repeat]
        verdicts = [report.check_verdict(should_pass, res) for res in runs]
        held = sum(v == "ok" for v in verdicts)
        verdict = next((v for v in verdicts if v != "ok"), "ok")
        if repeat > 1 and 0 < held < repeat:
            verdict = f"WRONG: holds in {held} of {repeat} runs (first other verdict: {verdict})"
        res = next((r for r, v in zip(runs, verdicts) if v != "ok"), runs[0])
        undecided += verdict.startswith(report.NOT_GRADED_HERE)
        all_ok &= verdict == "ok" or verdict.startswith(report.NOT_GRADED_HERE)
        caught_by = sorted({c.case.split("::")[0] for c in res.cases if c.outcome == "fail"})
        got = report.summary(res) + (f" ({held} of {repeat} runs as expected)" if repeat > 1 else "")
        rows.append([label, what, "pass all" if should_pass else "fail some", got, ", ".join(caught_by) or "-", verdict])
        records.append({"problem": label, "file": what, "should_pass": should_pass, "verdict": verdict,
                        "runs": repeat, "runs_as_expected": held, "result": res.to_json()})
    return rows, records, all_ok, undecided
