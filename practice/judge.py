"""The practice judge: list, start, test and (for instructors) check, grade and release problems.

    python practice/judge.py list
    python practice/judge.py start inplace-requant          # copy the starter to practice/workspace/
    python practice/judge.py test inplace-requant           # grade your workspace copy
    python practice/judge.py bench fast-bucket-update       # a speed problem: your figure beside the reference's
    python practice/judge.py check                          # maintainers: references pass, starters and wrong answers fail
    python practice/judge.py grade submissions/ --out out/  # instructors: submissions/<learner>/<slug>.py
    python practice/judge.py release student/practice       # the student edition of practice/

Needs only Python, pytest and what the problems import (torch, numpy). Every run is a
separate pytest process with a time limit. Exit codes: 0 when every graded case passed,
1 when a case failed (or nothing could be graded), 2 for a usage error.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the judging package sits next to this file

from judging import gradebook, problems, report  # noqa: E402
from judging.bench import bench, has_bench  # noqa: E402
from judging.release import release  # noqa: E402
from judging.run import run  # noqa: E402

WORKSPACE = problems.PRACTICE / "workspace"


class UsageError(Exception):
    pass


def cmd_list(args) -> int:
    rows = [[p.slug, p.title, p.chapter, p.difficulty, ", ".join(p.tags), "yes" if p.needs_cuda else "no"]
            for p in problems.all_problems()]
    print(report.table(rows, ["problem", "title", "chapter", "difficulty", "tags", "needs CUDA"]))
    print("\nsome cases of a problem may still need CUDA (marked `cuda` in its tests); without a GPU they are not graded")
    return 0


def cmd_start(args) -> int:
    problem = _problem(args.slug)
    target = WORKSPACE / f"{problem.slug}.py"
    if target.exists() and not args.force:
        raise UsageError(f"{_rel(target)} already exists (your work?); add --force to replace it with the starter")
    WORKSPACE.mkdir(exist_ok=True)
    shutil.copyfile(problem.starter, target)
    print(f"wrote {_rel(target)}; read {_rel(problem.path / 'problem.md')}, edit the file, then run:\n"
          f"  python {_rel(Path(__file__))} test {problem.slug}")
    return 0


def cmd_test(args) -> int:
    problem = _problem(args.slug)
    path = _workspace_file(problem, args.file)
    result = run(problem, path, timeout=args.timeout, select=args.k)
    if args.json:
        hidden = f"from {_rel(problem.hidden_dir())}" if result.hidden else report.HIDDEN_ABSENT
        print(json.dumps({**result.to_json(), "hidden_tests": hidden}, indent=1))
    else:
        report.print_run(result, _rel(problem.hidden_dir()))
    return 0 if result.ok else 1


def cmd_bench(args) -> int:
    problem = _problem(args.slug)
    if not has_bench(problem):
        timed = ", ".join(p.slug for p in problems.all_problems() if has_bench(p)) or "none"
        raise UsageError(f"{problem.slug} is not a speed problem (problems with a benchmark: {timed})")
    path = _workspace_file(problem, args.file)
    code, output = bench(problem, path, device=args.device, as_json=args.json, timeout=args.timeout)
    print(output, end="" if output.endswith("\n") else "\n")
    return code


def cmd_check(args) -> int:
    todo = []  # (problem, file, should_pass)
    for p in problems.all_problems():
        if not p.solution.is_file():
            raise UsageError(f"{p.slug} has no solution.py: check needs the instructor edition")
        todo += [(p, p.solution, True), (p, p.starter, False)] + [(p, w, False) for w in p.wrong_answers()]
    if not todo:
        raise UsageError(f"no problems in {_rel(problems.PROBLEMS)}")
    threads = max(1, (os.cpu_count() or 1) // args.jobs)  # the runs share the cores
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:  # each run is its own process
        results = list(pool.map(lambda t: run(t[0], t[1], timeout=args.timeout, threads=threads), todo))
    rows, records, all_ok = [], [], True
    for (p, path, should_pass), res in zip(todo, results):
        verdict = report.check_verdict(should_pass, res)
        all_ok &= verdict == "ok"
        caught_by = sorted({c.case.split("::")[0] for c in res.cases if c.outcome == "fail"})
        name = path.relative_to(p.path).as_posix()
        rows.append([p.slug, name, "pass all" if should_pass else "fail some",
                     report.summary(res), ", ".join(caught_by) or "-", verdict])
        records.append({"problem": p.slug, "file": name, "should_pass": should_pass, "verdict": verdict,
                        "result": res.to_json()})
    if args.json:
        print(json.dumps({"ok": all_ok, "checks": records}, indent=1))
    else:
        print(report.table(rows, ["problem", "file", "expected", "got", "failed in", "verdict"]))
        print("\ncheck: " + ("all hold" if all_ok else "some do NOT hold (see the verdict column)"))
    return 0 if all_ok else 1


def cmd_grade(args) -> int:
    submissions = Path(args.submissions)
    if not submissions.is_dir():
        raise UsageError(f"no directory {submissions}")
    if not gradebook.learners(submissions):
        raise UsageError(f"{submissions} has no learner folders (expected {submissions}/<learner>/<slug>.py)")
    say = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    rows = gradebook.grade(submissions, problems.all_problems(), timeout=args.timeout, progress=say)
    csv_path, json_path = gradebook.write(rows, Path(args.out))
    if args.json:
        print(json.dumps({"rows": rows, "totals": gradebook.totals(rows)}, indent=1))
    else:
        print(f"wrote {csv_path} and {json_path}")
    return 0 if all(r["result"] in ("pass", "not graded") for r in rows) else 1


def cmd_release(args) -> int:
    written = release(Path(args.dest), force=args.force)
    print(f"student edition of practice/: {len(written)} files in {args.dest} "
          "(no solution.py, no wrong/, no hidden tests)")
    return 0


def _workspace_file(problem: problems.Problem, file: str | None) -> Path:
    """The learner's file: --file, or practice/workspace/<slug>.py."""
    path = Path(file) if file else WORKSPACE / f"{problem.slug}.py"
    if not path.is_file():
        if file:
            raise UsageError(f"no file {path}")
        raise UsageError(f"no {_rel(path)} yet: run `python {_rel(Path(__file__))} start {problem.slug}` "
                         "first, or pass --file PATH")
    return path


def _problem(slug: str) -> problems.Problem:
    try:
        return problems.load(slug)
    except KeyError as e:
        raise UsageError(e.args[0]) from None


def _rel(path: Path) -> str:
    try:
        return os.path.relpath(path)
    except ValueError:  # another drive on Windows
        return str(path)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="judge.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    sub.add_parser("list", help="problems with chapter, difficulty, tags and whether they need CUDA")
    p = sub.add_parser("start", help="copy a problem's starter to practice/workspace/<slug>.py")
    p.add_argument("slug")
    p.add_argument("--force", action="store_true", help="replace an existing workspace file")
    p = sub.add_parser("test", help="grade your file with the public tests (and hidden ones when present)")
    p.add_argument("slug")
    p.add_argument("--file", help="the file to grade (default: practice/workspace/<slug>.py)")
    p.add_argument("-k", metavar="EXPR", help="run only the cases whose names match (pytest -k)")
    p = sub.add_parser("bench", help="a speed problem: time your file beside the reference and the hardware's limit")
    p.add_argument("slug")
    p.add_argument("--file", help="the file to time (default: practice/workspace/<slug>.py)")
    p.add_argument("--device", help="cpu or cuda (default: cuda when there is a GPU)")
    p.add_argument("--json", action="store_true", help="machine-readable results on stdout")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before the benchmark is stopped")
    p = sub.add_parser("check", help="maintainers: references pass every case, starters and wrong answers fail one")
    p.add_argument("--jobs", type=int, default=max(1, min(4, os.cpu_count() or 1)), help="runs at once")
    p = sub.add_parser("grade", help="instructors: grade submissions/<learner>/<slug>.py into a gradebook")
    p.add_argument("submissions")
    p.add_argument("--out", default=".", help="where gradebook.csv and gradebook.json go (default: here)")
    p = sub.add_parser("release", help="copy the student edition of practice/ (no answers, no hidden tests)")
    p.add_argument("dest")
    p.add_argument("--force", action="store_true", help="replace dest if it is not empty")
    for name in ("test", "check", "grade"):
        sub.choices[name].add_argument("--json", action="store_true", help="machine-readable results on stdout")
        sub.choices[name].add_argument("--timeout", type=float, default=120.0,
                                       help="seconds per problem run; a run past it fails its unfinished cases")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        return globals()[f"cmd_{args.verb}"](args)
    except (UsageError, ValueError, FileExistsError, RuntimeError) as e:
        print(f"judge.py {args.verb}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
