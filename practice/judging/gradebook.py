"""Grade a class: ``submissions/<learner>/<slug>.py`` for every learner and every problem.

Every learner's file is read into memory before any learner's code runs, so code that
rewrites another learner's submission on disk cannot change that learner's grade; each
file is then graded alone in its own process and temporary directory (see run.py).
"""
from __future__ import annotations

import csv
import json
import shutil
import tempfile
from pathlib import Path

from judging.problems import HIDDEN_ABSENT, Problem
from judging.run import run

FIELDS = ["learner", "problem", "case", "result", "message", "seconds"]


def learners(submissions: Path) -> list[str]:
    return sorted(p.name for p in submissions.iterdir() if p.is_dir() and not p.name.startswith("."))


def snapshot(submissions: Path, problems: list[Problem]) -> dict[str, dict[str, bytes | None]]:
    return {who: {p.slug: _read(submissions / who / f"{p.slug}.py") for p in problems}
            for who in learners(submissions)}


def _read(path: Path) -> bytes | None:
    return path.read_bytes() if path.is_file() else None


def grade(submissions: Path, problems: list[Problem], *, timeout: float, progress=print) -> list[dict]:
    """Rows of the gradebook, one per (learner, problem, case); a missing file is one 'not submitted' row."""
    files = snapshot(submissions, problems)
    for problem in problems:
        if not problem.hidden_files():
            progress(f"{problem.slug}: {HIDDEN_ABSENT}")
    rows = []
    for who, by_slug in files.items():
        for problem in problems:
            source = by_slug[problem.slug]
            if source is None:
                rows.append(dict(learner=who, problem=problem.slug, case="-", result="not submitted",
                                 message=f"no file {who}/{problem.slug}.py", seconds=0.0))
                progress(f"{who} / {problem.slug}: not submitted")
                continue
            staging = Path(tempfile.mkdtemp(prefix="judge-submission-"))
            try:
                path = staging / f"{problem.slug}.py"
                path.write_bytes(source)
                result = run(problem, path, timeout=timeout)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
            rows += [dict(learner=who, problem=problem.slug, case=c.case, result=c.outcome,
                          message=c.message, seconds=c.seconds) for c in result.cases]
            progress(f"{who} / {problem.slug}: {result.count('pass')}/{result.graded} graded cases passed"
                     + (f", {result.count('not graded')} not graded (needs CUDA)" if result.count("not graded") else ""))
    return rows


def totals(rows: list[dict]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for r in rows:
        t = out.setdefault(r["learner"], {"pass": 0, "fail": 0, "not graded": 0, "not submitted": 0})
        t[r["result"]] += 1
    return out


def write(rows: list[dict], out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    csv_path, json_path = out / "gradebook.csv", out / "gradebook.json"
    with open(csv_path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    json_path.write_text(json.dumps({"rows": rows, "totals": totals(rows)}, indent=1) + "\n", encoding="utf-8")
    return csv_path, json_path
