"""The judge: list, start, test and (for instructors) check, grade and release chapters and problems.

    python practice/judge.py list
    python practice/judge.py test ch01                      # grade chapter 01's exercises in this course_lib
    python practice/judge.py test ch01 --root DIR --exercise ch01.block_hash
    python practice/judge.py start inplace-requant          # copy the starter to practice/workspace/
    python practice/judge.py test inplace-requant           # grade your workspace copy
    python practice/judge.py bench fast-bucket-update       # a speed problem: your figure beside the reference's
    python practice/judge.py speed ch04                     # a chapter's speed part on this GPU beside the reference's
    python practice/judge.py board RESULTS/                 # instructors: the class leaderboard of the speed parts
    python practice/judge.py check                          # maintainers: references pass, starters and wrong answers fail
    python practice/judge.py check ch01.block_hash inplace-requant   # the same for some exercises or problems only
    python practice/judge.py soak ch01 inplace-requant --seeds 2000  # maintainers: the reference's hidden cases at many seeds
    python practice/judge.py grade submissions/ --out out/  # instructors: submissions/<learner>/{course_lib/,<slug>.py}
    python practice/judge.py grade submissions/ --only ch05 ch06  # only this week's chapters (and/or problems)
    python practice/judge.py release student/practice       # the student edition of practice/

Needs only Python, pytest and what the tests import (torch, numpy). Every run is a
separate pytest process with a time limit. Exit codes of test: 0 every case ran and
passed; 1 a case failed (or nothing could be graded); 3 nothing failed but some cases
were not graded (they need a GPU, or wait for a later part of the chapter that is not
written yet, printed WAITS as in the notebooks): incomplete, not a pass; 2 a usage error. check
exits 0 when every rule holds, 3 when everything decided here holds but some rows need a
GPU case to be decided ("not graded here"), else 1; grade exits 0 when the gradebook is written and
every case of every learner was graded, 3 when it is written but some cases need a GPU.
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

from judging import chapters, gradebook, problems, regions, report  # noqa: E402
from judging.bench import bench, has_bench  # noqa: E402
from judging.chapter_run import exercise_results, run_chapter  # noqa: E402
from judging.checks import chapter_checks, run_checks, variant_root  # noqa: E402
from judging.release import release  # noqa: E402
from judging.run import run  # noqa: E402

WORKSPACE = problems.PRACTICE / "workspace"
REPO = problems.PRACTICE.parent


class UsageError(Exception):
    pass


def cmd_list(args) -> int:
    chapter_rows = [[ch.id, ch.title, ex.id, ex.title, f"{ex.points:g}"]
                    for ch in chapters.all_chapters() for ex in ch.exercises]
    if chapter_rows:
        print(report.table(chapter_rows, ["chapter", "title", "exercise", "exercise title", "points"]))
        warmups = [f"{ch.id} {w}" for ch in chapters.all_chapters() for w in ch.warmups]
        if warmups:
            print("\nnotebook warm-ups (not graded by the judge: each notebook's own cell checks its answer): "
                  + ", ".join(warmups))
        print("\ngrade a chapter: python practice/judge.py test chNN [--root DIR]\n")
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
    if chapters.CHAPTER_ID.fullmatch(args.slug):
        return _test_chapter(args)
    if args.root or args.exercise:
        raise UsageError("--root and --exercise grade a chapter (chNN); a problem grades --file")
    problem = _problem(args.slug)
    path = _workspace_file(problem, args.file)
    result = run(problem, path, timeout=args.timeout, select=args.k)
    if args.json:
        hidden = f"from {_rel(problem.hidden_dir())}" if result.hidden else report.HIDDEN_ABSENT
        print(json.dumps({**result.to_json(), "hidden_tests": hidden}, indent=1))
    else:
        report.print_run(result, _rel(problem.hidden_dir()))
    return result.exit_code


def _test_chapter(args) -> int:
    if args.file:
        raise UsageError("a chapter grades the course_lib under --root DIR, not --file")
    chapter = _chapter(args.slug)
    root = Path(args.root) if args.root else REPO
    try:
        result = run_chapter(chapter, root, timeout=args.timeout, select=args.k, exercises=args.exercise)
    except KeyError as e:
        raise UsageError(e.args[0]) from None
    per_exercise = exercise_results(chapter, result, args.exercise)
    status = report.chapter_status(result, per_exercise)
    if args.json:
        hidden = f"from {_rel(chapter.hidden_dir())}" if result.hidden else report.HIDDEN_ABSENT
        print(json.dumps({**result.to_json(), "status": status, "hidden_tests": hidden, "notebook": chapter.notebook,
                          "exercises": per_exercise,
                          "points": sum(e["earned"] for e in per_exercise),
                          "max_points": sum(e["points"] for e in per_exercise)}, indent=1))
    else:
        report.print_chapter(chapter, result, per_exercise, _rel(chapter.hidden_dir()))
    return {"pass": 0, "fail": 1, "incomplete": 3}[status]


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
    wanted = set(args.names)  # problem slugs, chapter ids or exercise ids; none: everything
    all_chapters = chapters.all_chapters()
    known = {p.slug for p in problems.all_problems()} | {ch.id for ch in all_chapters} | {
        ex.id for ch in all_chapters for ex in ch.exercises}
    if wanted - known:
        raise UsageError(f"no problem, chapter or exercise named {', '.join(sorted(wanted - known))}")
    todo = []  # (problem, file, should_pass)
    for p in problems.all_problems():
        if wanted and p.slug not in wanted:
            continue
        if not p.solution.is_file():
            raise UsageError(f"{p.slug} has no solution.py: check needs the instructor edition")
        todo += [(p, p.solution, True), (p, p.starter, False)] + [(p, w, False) for w in p.wrong_answers()]
    if not todo and not all_chapters:
        raise UsageError(f"no problems in {_rel(problems.PROBLEMS)} and no chapters in {_rel(chapters.CHAPTERS)}")
    threads = max(1, (os.cpu_count() or 1) // args.jobs)  # the runs share the cores
    jobs = [(p.slug, path.relative_to(p.path).as_posix(), should_pass,
             lambda p=p, path=path: run(p, path, timeout=args.timeout, threads=threads))
            for p, path, should_pass in todo]
    jobs += chapter_checks(all_chapters, REPO, timeout=args.timeout, threads=threads, wanted=wanted)
    rules = chapters.consistency(REPO, all_chapters) + [
        f"{ex.id} has no wrong variant (hidden/chapters/{ch.id}/wrong/{ex.name}.<variant>.py)"
        for ch in all_chapters for ex in ch.exercises if not ch.wrong_variants(ex)]
    rows, records, all_ok, undecided = run_checks(jobs, args.jobs, max(1, args.repeat))
    all_ok &= not rules
    if args.json:
        print(json.dumps({"ok": all_ok, "not_graded_here": undecided, "rules": rules, "checks": records}, indent=1))
    else:
        print(report.table(rows, ["problem or exercise", "file", "expected", "got", "failed in", "verdict"]))
        for rule in rules:
            print(f"WRONG: {rule}")
        if not all_ok:
            print("\ncheck: some do NOT hold (see the verdict column)")
        elif undecided:
            print(f"\ncheck: incomplete: everything decided here holds; {undecided} row(s) not graded here "
                  f"(only a GPU case decides them: run the check on a GPU machine)")
        else:
            print("\ncheck: all hold")
    return 1 if not all_ok else 3 if undecided else 0


def cmd_mutate(args) -> int:
    from judging.mutate import command

    return command(args, chapters.all_chapters(), REPO)


def cmd_soak(args) -> int:
    from judging import soak

    for name in args.names:  # an unknown name is a usage error before anything runs
        _chapter(name) if chapters.CHAPTER_ID.fullmatch(name) else _problem(name)
    if args.seeds < 1 or args.jobs < 1 or args.scenarios < 1:
        raise UsageError("--seeds, --jobs and --scenarios must be at least 1")
    records = [soak.soak(name, range(args.start, args.start + args.seeds), jobs=args.jobs,
                         scenarios=args.scenarios, timeout=args.timeout) for name in args.names]
    if args.json:
        print(json.dumps(records, indent=1))
    else:
        print("\n\n".join("\n".join(soak.lines(r)) for r in records))
    statuses = {r["status"] for r in records}
    return 1 if "fail" in statuses else 3 if "incomplete" in statuses else 0


def cmd_grade(args) -> int:
    submissions = Path(args.submissions)
    if not submissions.is_dir():
        raise UsageError(f"no directory {submissions}")
    if not gradebook.learners(submissions):
        raise UsageError(f"{submissions} has no learner folders (expected {submissions}/<learner>/course_lib/ "
                         "and/or <learner>/<slug>.py)")
    say = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    all_problems, all_chapters = problems.all_problems(), chapters.all_chapters()
    if args.only:  # this week's items: the gradebook has their rows and totals over them alone
        known = {p.slug for p in all_problems} | {c.id for c in all_chapters}
        unknown = sorted(set(args.only) - known)
        if unknown:
            raise UsageError(f"--only: no chapter or problem {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        all_problems = [p for p in all_problems if p.slug in args.only]
        all_chapters = [c for c in all_chapters if c.id in args.only]
    speeds = [] if args.speed else None
    scores, cases = gradebook.grade(submissions, all_problems, all_chapters, timeout=args.timeout, progress=say,
                                    speeds=speeds)
    paths = gradebook.write(scores, cases, Path(args.out), speeds)
    sums = gradebook.totals(scores)
    if args.json:
        print(json.dumps({"totals": sums, "scores": scores, "cases": cases}, indent=1))
    else:
        print(report.table([[who, f"{t['points']:g}/{t['max_points']:g}", "complete" if t["complete"] else "INCOMPLETE"]
                            for who, t in sorted(sums.items())], ["learner", "points", "graded"]))
        print("wrote " + ", ".join(str(p) for p in paths))
    # A learner's failures are grades, not errors; 3 says some cases could not run here.
    return 0 if all(t["complete"] for t in sums.values()) else 3


def cmd_speed(args) -> int:
    from judging import speed

    all_chapters = {ch.id: ch for ch in chapters.all_chapters()}
    names = args.names or [c for c, ch in all_chapters.items() if ch.speed]
    unknown = [n for n in names if n not in all_chapters or not all_chapters[n].speed]
    if unknown:
        raise UsageError(f"no speed part in {', '.join(unknown)} (chapters with one: "
                         f"{', '.join(c for c, ch in all_chapters.items() if ch.speed)})")
    root, made = Path(args.root).resolve(), None
    if args.file:  # a body for the speed part, put into a copy of this course (as check does)
        if len(names) != 1:
            raise UsageError("--file needs exactly one chapter")
        made = root = variant_root(REPO, all_chapters[names[0]].speed["exercise"], Path(args.file).read_text("utf-8"))
    try:
        records = [speed.measure(all_chapters[n], root) for n in names]
    finally:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
    if args.json:
        print(json.dumps(records, indent=1))
    else:
        for rec in records:
            print(speed.line(rec))
    return 3 if any(r["status"] == "not measured here" for r in records) else 0


def cmd_cost(args) -> int:
    """A chapter's speed part, its cost proxies counted here (any machine) beside the reference's."""
    from judging import cost

    all_chapters = {ch.id: ch for ch in chapters.all_chapters()}
    with_costs = [c for c, ch in all_chapters.items() if cost.cost_file(ch.path)]
    names = args.names or with_costs
    unknown = [n for n in names if n not in with_costs]
    if unknown:
        raise UsageError(f"no cost proxies for {', '.join(unknown)} (chapters with them: {', '.join(with_costs)})")
    codes = [cost.report(n, cost.cost_file(all_chapters[n].path), Path(args.root).resolve()) for n in names]
    return max(codes)


def cmd_board(args) -> int:
    from judging import speed

    books = sorted(Path(args.results).rglob("gradebook.json"))
    if not books:
        raise UsageError(f"no gradebook.json under {args.results} (write one with `judge.py grade --speed`)")
    records = [r for b in books for r in json.loads(b.read_text(encoding="utf-8")).get("speed", [])]
    print(speed.board(records))
    return 0


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


def _chapter(chapter_id: str) -> chapters.Chapter:
    try:
        return chapters.load(chapter_id)
    except KeyError as e:
        raise UsageError(e.args[0]) from None


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
    sub.add_parser("list", help="chapters with their exercises; problems with chapter, difficulty, tags, CUDA")
    p = sub.add_parser("start", help="copy a problem's starter to practice/workspace/<slug>.py")
    p.add_argument("slug")
    p.add_argument("--force", action="store_true", help="replace an existing workspace file")
    p = sub.add_parser("test", help="grade a chapter (chNN) or a problem with the public tests (and hidden ones when present)")
    p.add_argument("slug", help="a chapter (ch01) or a problem slug")
    p.add_argument("--file", help="a problem: the file to grade (default: practice/workspace/<slug>.py)")
    p.add_argument("--root", help="a chapter: the folder whose course_lib/ is graded (default: this checkout)")
    p.add_argument("--exercise", action="append", metavar="ID",
                   help="a chapter: grade only this exercise (chNN.name); repeatable")
    p.add_argument("-k", metavar="EXPR", help="run only the cases whose names (or exercise ids) match (pytest -k)")
    p = sub.add_parser("bench", help="a speed problem: time your file beside the reference and the hardware's limit")
    p.add_argument("slug")
    p.add_argument("--file", help="the file to time (default: practice/workspace/<slug>.py)")
    p.add_argument("--device", help="cpu or cuda (default: cuda when there is a GPU)")
    p.add_argument("--json", action="store_true", help="machine-readable results on stdout")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before the benchmark is stopped")
    p = sub.add_parser("check", help="maintainers: references pass every case; starters, stubs and wrong answers fail one")
    p.add_argument("names", nargs="*", metavar="NAME",
                   help="only these problems, chapters (ch01) or exercises (ch01.block_hash); default: all")
    p.add_argument("--jobs", type=int, default=max(1, min(4, os.cpu_count() or 1)), help="runs at once")
    p.add_argument("--repeat", type=int, default=1,
                   help="run every check this many times; a row holds only if every run holds (the grade repeats)")
    p = sub.add_parser("soak", help="maintainers: the reference's hidden cases at many seeds; per case, passed at k of N")
    p.add_argument("names", nargs="+", metavar="NAME", help="chapters (ch01) and problems")
    p.add_argument("--seeds", type=int, required=True, help="how many seeds (N)")
    p.add_argument("--start", type=int, default=0, help="the first seed (S): seeds S..S+N-1")
    p.add_argument("--jobs", type=int, default=1, help="processes, each looping over its share of the seeds")
    p.add_argument("--scenarios", type=int, default=2000,
                   help="COURSE_SCENARIOS for the one run of the hypothesis cases (a seed does not change them)")
    p.add_argument("--json", action="store_true", help="machine-readable records on stdout")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds one seed's run may take (the hypothesis run: this times scenarios/40)")
    p = sub.add_parser("mutate", help="maintainers: mutants of the region references (cosmic-ray's operators), "
                                      "graded; survivors listed")
    p.add_argument("names", nargs="+", metavar="NAME", help="chapters (ch02) or exercises (ch02.wait_drain)")
    p.add_argument("--tool", choices=["cosmic-ray", "oneline"], default="cosmic-ray",
                   help="the operator set (oneline: the earlier one-line mutants)")
    p.add_argument("--per-region", default="3", help="mutants drawn per region: a number, or all")
    p.add_argument("--seed", type=int, default=0, help="which mutants are drawn")
    p.add_argument("--jobs", type=int, default=1, help="mutants graded at once (each in its own process)")
    p.add_argument("--list", action="store_true", help="list the mutants, grade none")
    p = sub.add_parser("grade", help="instructors: grade submissions/<learner>/ (course_lib/, <slug>.py) into a gradebook")
    p.add_argument("submissions")
    p.add_argument("--out", default=".", help="where gradebook.csv and gradebook.json go (default: here)")
    p.add_argument("--only", nargs="+", metavar="ITEM", help="grade only these chapters (chNN) and problems")
    p.add_argument("--speed", action="store_true", help="also measure each chapter's speed part (GPU; a separate "
                                                        "score in speed.csv and gradebook.json)")
    p = sub.add_parser("speed", help="a chapter's 'make it fast' part on this GPU beside the reference's (ch03-ch05)")
    p.add_argument("names", nargs="*", metavar="CHAPTER", help="chapters (default: every one with a speed part)")
    p.add_argument("--root", default=str(REPO), help="the course whose course_lib is measured (default: this one)")
    p.add_argument("--file", help="a body for the chapter's speed part, measured in a copy of this course")
    p.add_argument("--json", action="store_true", help="machine-readable records on stdout")
    p = sub.add_parser("cost", help="a chapter's speed part on any machine: copies, allocations, host waits, "
                                    "operations, beside the reference's (not a grade)")
    p.add_argument("names", nargs="*", metavar="CHAPTER", help="chapters (default: every one with cost proxies)")
    p.add_argument("--root", default=str(REPO), help="the course whose course_lib is counted (default: this one)")
    p = sub.add_parser("board", help="instructors: a class leaderboard of the speed parts from gradebook.json files")
    p.add_argument("results", help="a folder holding gradebook.json files (judge.py grade --speed)")
    p = sub.add_parser("release", help="copy the student edition of practice/ (no answers, no hidden tests)")
    p.add_argument("dest")
    p.add_argument("--force", action="store_true", help="replace dest if it is not empty")
    for name in ("test", "check", "grade", "mutate"):
        sub.choices[name].add_argument("--json", action="store_true", help="machine-readable results on stdout")
        sub.choices[name].add_argument("--timeout", type=float, default=120.0,
                                       help="seconds per problem run; a run past it fails its unfinished cases")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        return globals()[f"cmd_{args.verb}"](args)
    except (UsageError, ValueError, FileExistsError, RuntimeError, regions.RegionError) as e:
        print(f"judge.py {args.verb}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
