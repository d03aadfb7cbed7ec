"""``judge.py mutate``: mutants of the exercise regions' references, each graded like a
learner's answer, to measure the hidden tests (maintainers).

The mutants come from ``mutants.py`` (cosmic-ray's operator set and the judge's
additions; ``--tool oneline``: the earlier one-line set). Each valid mutant is put into a
copy of ``course_lib`` with only that region changed (``checks.variant_root``, as
``judge.py check`` puts a wrong answer), and that exercise's public and hidden cases run
on it in a child process. Its verdict:

- **killed**: a case failed (``how``: a case failed, the time limit, the run ended early);
- **survived**: every case ran and passed; read it, then either write a case that kills
  it or show next to the region why it is equivalent;
- **equivalent-listed**: it survived (or could not be decided here), and
  ``hidden/chapters/equivalent_mutants.json`` lists it with why no test can tell it from
  the reference;
- **not graded here**: it passed every case run on this machine, and GPU cases did not run;
- **invalid**: it does not compile; listed, never graded.

The share killed counts killed mutants among the graded ones not listed as equivalent
("not graded here" is not a kill). Two things keep a campaign short. A mutant's run
stops at its first failing case (``pytest -x``), and hypothesis does not shrink the
failing scenario it found (a smaller example would only make a better message). And the
time limit is ``LIMIT_FACTOR`` times what the unchanged reference took in the same
conditions (at least ``LIMIT_FLOOR_S``, at most ``--timeout``): that run comes first, per
region, and a region whose reference fails stops the campaign, since nothing could be
learned from its mutants. A region whose every case needs a GPU this machine lacks is not
run at all: each of its mutants is "not graded here".
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from judging import chapter_run, mutants, regions, report
from judging.chapter_run import copy_chapter_tests
from judging.checks import variant_root
from judging.run import RunResult, _cases, _run_limited

LIMIT_FACTOR = 4
LIMIT_FLOOR_S = 30.0
ENDED_EARLY = "did not finish: the test process ended early"
# Loaded into every mutant's run (pytest -p): settings objects the tests make inherit this
# profile, so a failing scenario is reported as found, without shrinking it.
_FAST_PLUGIN = "judge_mutant_run"
_FAST_PLUGIN_TEXT = '''"""The judge's mutant runs: hypothesis reports a failing scenario without shrinking it."""
try:
    from hypothesis import Phase, settings
except ImportError:
    pass
else:
    settings.register_profile("judge-mutant", phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target])
    settings.load_profile("judge-mutant")
'''


def run_mutant(chapter, root: Path, exercise: str, *, timeout: float, threads: int | None) -> RunResult:
    """A graded run of ``exercise``'s cases on ``root``/course_lib, as ``chapter_run.run_chapter``
    makes it (same tests, plugin, environment and checks), stopped at the first failing case."""
    root = Path(root).resolve()
    hidden_files = chapter.hidden_files()
    result = RunResult(chapter.id, str(root), bool(hidden_files))
    tmp = Path(tempfile.mkdtemp(prefix=f"judge-mutant-{chapter.id}-"))
    try:
        work = tmp / "work"
        work.mkdir()
        tests = copy_chapter_tests(chapter, hidden_files, work)
        (work / f"{_FAST_PLUGIN}.py").write_text(_FAST_PLUGIN_TEXT, encoding="utf-8")
        results = tmp / "results.jsonl"
        env = chapter_run._environment(root, results, chapter, [exercise], threads)
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", _FAST_PLUGIN, "-p", "no:cacheprovider",
               "-c", str(work / "pytest.ini"), "--rootdir", str(work), *[t for t in tests if t.startswith("test_")]]
        start = time.perf_counter()
        output, returncode, timed_out = _run_limited(cmd, work, env, timeout)
        result.seconds = time.perf_counter() - start
        result.output = output[-4000:]
        result.cases = _cases(results, returncode, timed_out, timeout, output)
        chapter_run._verify_course_lib(result, results, root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return result


def _graded(chapter, repo: Path, exercise: str, body: str, timeout: float, threads: int | None) -> RunResult:
    root = variant_root(repo, exercise, body)
    try:
        return run_mutant(chapter, root, exercise, timeout=timeout, threads=threads)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def verdict(result: RunResult, why_equivalent: str | None) -> dict:
    """The mutant's verdict from its run (see the module's docstring), with how it died or why it is listed."""
    failed = [c for c in result.cases if c.outcome == "fail"]
    if failed:
        first = next((c for c in failed if not c.message.startswith(ENDED_EARLY)), failed[0])
        how = ("the time limit" if "within the time limit" in first.message else
               "the run ended early" if first.message.startswith(ENDED_EARLY) else "a case failed")
        return {"verdict": "killed", "how": how, "first_failure": {"case": first.case, "message": first.message[:400]}}
    outcome = "not graded here" if result.count("not graded") else "survived"
    if why_equivalent:
        return {"verdict": "equivalent-listed", "why": why_equivalent}
    return {"verdict": outcome}


def _cases_run(result: RunResult) -> int:
    """Cases that ran: not those left when the run stopped at its first failure."""
    return sum(not (c.outcome == "fail" and c.message.startswith(ENDED_EARLY)) for c in result.cases)


def totals(records: list[dict], dropped: int = 0) -> dict:
    n = Counter(r["verdict"] for r in records)
    counted = n["killed"] + n["survived"] + n["not graded here"]  # graded, not listed as equivalent
    return {"mutants": len(records), "killed": n["killed"], "survived": n["survived"],
            "equivalent_listed": n["equivalent-listed"], "not_graded_here": n["not graded here"],
            "invalid": n["invalid"], "identical_dropped": dropped,
            "killed_share": round(n["killed"] / counted, 4) if counted else None,
            "grading_seconds": round(sum(r.get("seconds", 0.0) for r in records), 1)}


def campaign(work, repo: Path, *, tool: str, per_region: int, seed: int, timeout: float, jobs: int,
             listed: dict | None = None, grade: bool = True) -> dict:
    """Make, draw and grade the mutants of each (chapter, exercise ids) in ``work``;
    ``grade`` False only lists them. Returns the report (``--json`` prints it)."""
    started = time.perf_counter()
    listed = mutants.equivalent_mutants() if listed is None else listed
    found = {r.id: r for r in regions.find(repo)}
    plan = []  # (chapter, exercise, every mutant, dropped, drawn)
    for chapter, ids in work:
        for exercise in ids:
            made, dropped = mutants.mutants_of(found[exercise], tool)
            plan.append((chapter, exercise, made, dropped, mutants.draw(made, per_region, seed)))
    threads = max(1, (os.cpu_count() or 1) // max(1, jobs))
    region_info, graded = {}, {}
    if grade:
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            refs = list(pool.map(lambda p: _graded(p[0], repo, p[1], regions.dedent_body(found[p[1]]), timeout, threads),
                                 plan))
            todo = []
            for (chapter, exercise, _, _, drawn), ref in zip(plan, refs):
                region_info[exercise] = _reference_info(exercise, ref, timeout)
                if region_info[exercise]["every_case_needs_a_gpu_here"]:
                    continue
                todo += [(chapter, m, region_info[exercise]["limit_s"]) for m in drawn]
            todo.sort(key=lambda t: -t[2])  # the longest first, so the runs end together
            graded = dict(zip((id(t[1]) for t in todo), _progress(pool.map(
                lambda t: _graded(t[0], repo, t[1].exercise, t[1].body, t[2], threads), todo), len(todo))))
    chapters_out = {}
    for chapter, exercise, made, dropped, drawn in plan:
        out = chapters_out.setdefault(chapter.id, {"chapter": chapter.id, "title": chapter.title, "regions": [],
                                                   "mutants": [], "dropped": 0})
        info = region_info.get(exercise, {})
        out["regions"].append({"exercise": exercise, "file": found[exercise].path.relative_to(repo).as_posix(),
                               "made": sum(m.valid for m in made), "drawn": len(drawn),
                               "invalid": sum(not m.valid for m in made), "identical_dropped": dropped, **info})
        out["dropped"] += dropped
        keys = {m.key for m in made}  # the registry names cosmic-ray's mutants: another set may lack some
        out.setdefault("stale_equivalents", []).extend(
            {"exercise": k[0], "before": k[1], "after": k[2]} for k in listed
            if k[0] == exercise and k not in keys and tool == "cosmic-ray")
        for m in [m for m in made if not m.valid] + drawn:
            record = m.to_json()
            if not m.valid:
                record.update(verdict="invalid")
            elif not grade:
                record.update(verdict=None)
            elif info.get("every_case_needs_a_gpu_here"):  # not run: no case of it runs here
                record.update({"verdict": "equivalent-listed", "why": listed[m.key]} if m.key in listed else
                              {"verdict": "not graded here", "how": "every case of this exercise needs a GPU"})
            else:
                result = graded[id(m)]
                record.update(verdict(result, listed.get(m.key)), seconds=round(result.seconds, 2),
                              cases=len(result.cases), cases_run=_cases_run(result))
            out["mutants"].append(record)
    for out in chapters_out.values():
        out["mutants"].sort(key=lambda r: (r["exercise"], r["line"]))
        out["totals"] = totals(out["mutants"], out.pop("dropped"))
    every = [r for out in chapters_out.values() for r in out["mutants"]]
    return {"tool": _tool_name(tool), "per_region": per_region or "all", "seed": seed, "jobs": jobs,
            "graded": grade, "seconds": round(time.perf_counter() - started, 1),
            "chapters": list(chapters_out.values()),
            "totals": totals(every, sum(o["totals"]["identical_dropped"] for o in chapters_out.values()))}


def _reference_info(exercise: str, ref: RunResult, timeout: float) -> dict:
    bad = next((c for c in ref.cases if c.outcome == "fail"), None)
    if bad is not None:
        raise RuntimeError(f"{exercise}: the unchanged reference fails {bad.case}: {bad.message[:300]} "
                           "(its mutants cannot be graded until it passes)")
    return {"reference_s": round(ref.seconds, 2),
            "limit_s": round(min(timeout, max(LIMIT_FLOOR_S, LIMIT_FACTOR * ref.seconds)), 1),
            "every_case_needs_a_gpu_here": ref.graded == 0}


def _progress(results, total: int):
    from tqdm import tqdm

    return tqdm(results, total=total, desc="mutants", unit="mutant", file=sys.stderr)


def _tool_name(tool: str) -> str:
    if tool != "cosmic-ray":
        return tool
    from importlib.metadata import version

    return f"cosmic-ray {version('cosmic-ray')} (+ the judge's operators)"


def command(args, all_chapters, repo: Path) -> int:
    """``judge.py mutate NAMES [--tool T] [--per-region N|all] [--seed S] [--jobs J] [--list] [--json]``.
    Exit 1 when a mutant survived, 3 when some could not be graded here, else 0."""
    by_id = {ch.id: ch for ch in all_chapters}
    todo: dict[str, list[str]] = {}
    for name in args.names:
        chapter_id = name.split(".", 1)[0]
        if chapter_id not in by_id or ("." in name and name not in {e.id for e in by_id[chapter_id].exercises}):
            raise ValueError(f"no chapter or exercise named {name}")
        ids = [name] if "." in name else [e.id for e in by_id[chapter_id].exercises]
        todo.setdefault(chapter_id, []).extend(i for i in ids if i not in todo.get(chapter_id, []))
    per_region = str(args.per_region)
    if not (per_region == "all" or per_region.isdigit()):
        raise ValueError(f"--per-region takes a number or 'all', not {per_region!r}")
    result = campaign([(by_id[c], ids) for c, ids in todo.items()], repo, tool=args.tool,
                      per_region=0 if per_region == "all" else int(per_region), seed=args.seed,
                      timeout=args.timeout, jobs=args.jobs, grade=not args.list)
    if args.json:
        import json
        print(json.dumps(result, indent=1))
    else:
        print(text(result))
    t = result["totals"]
    return 0 if args.list else 1 if t["survived"] else 3 if t["not_graded_here"] else 0


def text(result: dict) -> str:
    """The report for people: per chapter, every mutant that was not killed, then the totals."""
    out = []
    for ch in result["chapters"]:
        t = ch["totals"]
        out.append(f"{ch['chapter']} · {ch['title']}: {t['mutants']} mutants of {len(ch['regions'])} region(s) "
                   f"({result['tool']}; {result['per_region']} per region)")
        rows = [[r["exercise"], r["line"], r["operator"], _change(r), r["verdict"] or "-"]
                for r in ch["mutants"] if r["verdict"] != "killed"]
        if rows:
            out.append(report.table(rows, ["exercise", "line", "operator", "change", "verdict"]))
        out.append(_summary(ch["chapter"], t, result["graded"]))
        out += [f"  stale: equivalent_mutants.json lists {s['exercise']}: {s['before']!r} -> {s['after']!r}, "
                "which no mutant makes now" for s in ch.get("stale_equivalents", [])]
        out.append("")
    if len(result["chapters"]) > 1:
        out.append(_summary("all", result["totals"], result["graded"]))
    out.append(f"({result['seconds']:g} s)")
    return "\n".join(out)


def _change(record: dict) -> str:
    change = f"{' / '.join(record['before'].splitlines())} -> {' / '.join(record['after'].splitlines())}"
    return change if len(change) <= 100 else change[:97] + "..."


def _summary(name: str, t: dict, graded: bool) -> str:
    if not graded:
        return f"{name}: {t['mutants'] - t['invalid']} mutants listed, {t['invalid']} invalid, " \
               f"{t['identical_dropped']} identical to the reference or another dropped (nothing graded: --list)"
    share = f"{t['killed_share']:.1%}" if t["killed_share"] is not None else "-"
    counted = t["killed"] + t["survived"] + t["not_graded_here"]
    return (f"{name}: {t['killed']} of {counted} killed ({share}), {t['survived']} survived"
            + (f", {t['not_graded_here']} not graded here (need a GPU)" if t["not_graded_here"] else "")
            + (f"; {t['equivalent_listed']} more listed as equivalent" if t["equivalent_listed"] else "")
            + f"; {t['invalid']} invalid, {t['identical_dropped']} identical dropped")
