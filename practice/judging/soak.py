"""``judge.py soak``: the reference's hidden cases over many seeds (maintainers).

    python practice/judge.py soak ch01 inplace-requant --seeds 2000 [--start S] [--jobs J] [--scenarios M]

A hidden case draws its random inputs from ``hidden_seed()`` (plugin.py); a grade uses one
fixed seed. A soak grades the reference (the instructor's ``course_lib`` for a chapter, a
problem's ``solution.py``) at seeds S..S+N-1 and says, per case, at how many seeds it
passed; each failure comes with its seed, its one-line reason and the command that replays it.

Cheap per seed: the run directory, environment and plugin are a graded run's (run.py,
chapter_run.py), but each of J processes imports pytest and torch once and loops over its
share of the seeds in-process (``drive``): before each seed it forgets the test modules and
the plugin (``conftest``), sets ``$COURSE_HIDDEN_SEED`` and calls ``pytest.main`` again, so
a module-level ``SEED = hidden_seed()`` is drawn anew as in a fresh run. A seed that runs past
``--timeout`` ends its process (faulthandler); its unfinished cases fail and a new process
goes on from the next seed.

Hypothesis cases (the differential ones) are derandomized: a seed does not change them. They
are left out of the seed loop and run once with ``COURSE_SCENARIOS=M`` (``--scenarios``); the
report gives the examples each one ran.

A case that did not run (it needs CUDA and this machine has none) is "not run here", never
passed. Exit codes: 0 every case ran and passed at every seed; 1 a case failed at some seed
(or nothing ran); 3 nothing failed but some cases did not run here.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from judging import chapters, problems, report
from judging.chapter_run import _environment as chapter_environment, _verify_course_lib, copy_chapter_tests
from judging.run import Case, RunResult, _cases, _copy_tests, _environment, _run_limited, records, seal_work_dir

HYPOTHESIS = "hypothesis"  # the label of the one run of the hypothesis cases
# The soak's process: the judging package only to import this module, then the run directory
# alone first on sys.path, as under `python -m pytest`.
_DRIVER = ("import json, sys; sys.path.insert(1, {p!r}); from judging.soak import drive; "
           "sys.path.remove({p!r}); sys.exit(drive(json.loads(sys.argv[1])))")


def soak(name: str, seeds: range, *, jobs: int = 1, scenarios: int = 2000, timeout: float = 300.0,
         root: Path | None = None) -> dict:
    """Soak chapter or problem ``name`` at ``seeds``: a record per case (``lines`` puts it in words).

    ``root``: for a chapter, the edition whose course_lib is graded (default: this one)."""
    chapter = chapters.load(name) if chapters.CHAPTER_ID.fullmatch(name) else None
    problem = None if chapter else problems.load(name)
    hidden = chapter.hidden_files() if chapter else problem.hidden_files()
    if not hidden:
        raise ValueError(f"{name} has no hidden tests in this edition: nothing to soak")
    if not chapter and not problem.solution.is_file():
        raise ValueError(f"{name} has no solution.py: a soak needs the instructor edition")
    root = Path(root or problems.PRACTICE.parent).resolve()
    jobs = max(1, min(jobs, len(seeds) or 1))
    tmp = Path(tempfile.mkdtemp(prefix=f"judge-soak-{name}-"))
    start = time.perf_counter()
    try:
        work, out = tmp / "work", tmp / "results"
        work.mkdir()
        out.mkdir()
        threads = max(1, (os.cpu_count() or 1) // jobs)  # an OMP_NUM_THREADS already set wins
        if chapter:
            copy_chapter_tests(chapter, hidden, work)
            env = chapter_environment(root, out / "none", chapter, None, threads)
        else:
            _copy_tests(problem, hidden, work)
            shutil.copyfile(problem.solution, work / problem.solution.name)
            seal_work_dir(work)
            env = _environment(work / problem.solution.name, out / "none", problem, threads)
        env["COURSE_SCENARIOS"] = str(scenarios)
        spec = {"results": str(out), "basetemp": str(tmp / "basetemp"),
                "timeout": timeout, "hypothesis_timeout": timeout * max(1.0, scenarios / 40),
                "args": ["-q", "-p", "no:cacheprovider", "-c", str(work / "pytest.ini"), "--rootdir", str(work),
                         *sorted(p.name for p in hidden if p.name.startswith("test_"))]}
        chunks = [[HYPOTHESIS]] + [list(seeds[i::jobs]) for i in range(jobs)]
        chunks = [chunks[0] + chunks[1]] + chunks[2:]  # the first process also runs the hypothesis cases
        ends: dict = {}
        with ThreadPoolExecutor(max_workers=len(chunks)) as pool:
            for part in pool.map(lambda labels: _drive_all(labels, spec, work, env), chunks):
                ends.update(part)
        runs = {label: _read(out / f"{label}.jsonl", ends.get(label),
                             spec["hypothesis_timeout"] if label == HYPOTHESIS else timeout, root if chapter else None)
                for label in [HYPOTHESIS, *seeds]}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    record = _aggregate(name, problem, seeds, runs, scenarios)
    record.update(seconds=round(time.perf_counter() - start, 1), processes=jobs)
    return record


def _drive_all(labels: list, spec: dict, work: Path, env: dict) -> dict:
    """Run ``labels`` (seeds, perhaps the hypothesis run first) in as few processes as it
    takes: after a process that ended early (a run past its time limit, a crash) a new one
    goes on from the next label. Returns {label: (how it ended, exit code)} for runs cut short."""
    cut, todo = {}, list(labels)
    while todo:
        limit = sum(spec["hypothesis_timeout"] if lab == HYPOTHESIS else spec["timeout"] for lab in todo) + 120
        cmd = [sys.executable, "-c", _DRIVER.format(p=str(problems.PRACTICE)), json.dumps({**spec, "labels": todo})]
        output, code, timed_out = _run_limited(cmd, work, env, limit)
        started = [lab for lab in todo if (Path(spec["results"]) / f"{lab}.jsonl").exists()]
        if not started:  # the process failed before its first run: say so for every label
            tail = " ".join(output.strip().splitlines()[-3:]) or "no output"
            return {**cut, **{lab: (f"the soak's process ended before this run (exit code {code}): {tail}", code)
                              for lab in todo}}
        if code != 0 or timed_out:  # the last run begun was cut short: past its limit, or a crash
            begun = records(Path(spec["results"]) / f"{started[-1]}.jsonl")[0]
            late = time.time() - begun["at"] >= begun["limit"] - 1
            cut[started[-1]] = ("time" if timed_out or late else "crash", code)
        todo = todo[len(started):]
    return cut


def _read(path: Path, end, timeout: float, root: Path | None) -> tuple[list[Case], dict]:
    """One run's cases as a graded run reads them, and the hypothesis examples it counted."""
    if end is not None and end[0] not in ("time", "crash"):
        return [Case("(soak process)", "fail", end[0])], {}
    recs = records(path)
    if (any(r.get("event") == "collected" and not r["cases"] for r in recs)
            and not any(r.get("event") == "case" for r in recs)):
        return [], {}  # nothing selected: no hypothesis case in these tests
    why, code = end or ("", 0)
    cases = _cases(path, code, why == "time", timeout, "")
    if why == "crash":
        cases = [c if c.outcome != "fail" or not c.message.startswith("did not finish") else
                 Case(c.case, "fail", f"did not finish: the soak's process ended (exit code {code})", 0.0, c.exercise)
                 for c in cases]
    if root is not None:  # a chapter: the run must have imported the graded course_lib
        result = RunResult("", str(root), True, cases)
        _verify_course_lib(result, path, root)
        cases = result.cases
    return cases, next((r["counts"] for r in recs if r.get("event") == "soak_examples"), {})


def _aggregate(name: str, problem, seeds: range, runs: dict, scenarios: int) -> dict:
    rows: dict[tuple, dict] = {}
    for label, (cases, examples) in runs.items():
        hyp = label == HYPOTHESIS
        for c in cases:
            row = rows.setdefault((hyp, c.case), {"case": c.case, "exercise": c.exercise, "hypothesis": hyp,
                                                  "runs": 1 if hyp else len(seeds), "passed": 0, "failed": 0,
                                                  "not_run": 0, "failures": []})
            if hyp:
                row["examples"] = examples.get(c.case.split("::")[-1].split("[")[0])
            if c.outcome == "pass":
                row["passed"] += 1
            elif c.outcome == "not graded":
                row["not_run"] += 1
            else:
                row["failed"] += 1
                row["failures"].append({"seed": None if hyp else label, "message": c.message,
                                        "replay": _replay(name, problem, c, None if hyp else label, scenarios)})
    cases = sorted(rows.values(), key=lambda r: (r["hypothesis"], r["case"]))
    per_seed = [sum(c.seconds for c in got) for label, (got, _) in runs.items() if label != HYPOTHESIS]
    hyp_seconds = sum(c.seconds for c in runs[HYPOTHESIS][0])
    for row in cases:
        row["status"] = ("pass" if row["passed"] == row["runs"] else "fail" if row["failed"] or row["passed"]
                         + row["not_run"] < row["runs"] else "not run here")
    failed = any(r["status"] == "fail" for r in cases) or not any(r["passed"] for r in cases)
    status = "fail" if failed else "incomplete" if any(r["status"] != "pass" for r in cases) else "pass"
    return {"name": name, "kind": "problem" if problem else "chapter", "seeds": [seeds.start, len(seeds)],
            "scenarios": scenarios, "status": status, "cases": cases,
            "seconds_per_seed": round(sum(per_seed) / max(1, len(per_seed)), 3), "hypothesis_seconds": round(hyp_seconds, 1)}


def _replay(name: str, problem, case: Case, seed, scenarios: int) -> str:
    """The command that runs this case again as a grade does, at this seed (or these scenarios)."""
    cmd = (f"COURSE_HIDDEN_SEED={seed}" if seed is not None else f"COURSE_SCENARIOS={scenarios}") + \
        f" python {_rel(problems.PRACTICE / 'judge.py')} test {name}"
    if problem:
        cmd += f" --file {_rel(problem.solution)}"
    elif case.exercise:
        cmd += f" --exercise {case.exercise}"
    if "::" in case.case:
        cmd += f" -k {case.case.split('::')[-1].split('[')[0]}"
    return cmd


def _rel(path: Path) -> str:
    try:
        return os.path.relpath(path)
    except ValueError:
        return str(path)


def lines(record: dict) -> list[str]:
    """A soak in words: a row per case, the failures with their replays, a status line."""
    first, n = record["seeds"]
    out = [f"soak {record['name']} ({record['kind']}): seeds {first}..{first + n - 1} ({n} seeds), "
           f"{record['processes']} process(es), {record['seconds']:g} s (the cases' own time: "
           f"{record['seconds_per_seed']:g} s per seed, {record['hypothesis_seconds']:g} s for the hypothesis run)"]
    seeded = [r for r in record["cases"] if not r["hypothesis"]]
    hyp = [r for r in record["cases"] if r["hypothesis"]]

    def verdict(r):
        if r["status"] == "not run here":
            return "not run here (needs CUDA)"
        what = "examples" if r["hypothesis"] else "seeds"
        text = f"passed in {r['passed']} of {r['runs']} " + ("run" if r["hypothesis"] else "seeds")
        if r["hypothesis"]:
            text = ("pass" if r["status"] == "pass" else "FAIL") + (
                f", {r['examples']} {what}" if r.get("examples") is not None else ", examples not counted")
        elif r["failed"]:
            text = f"FAIL: {text}, failed in {r['failed']}"
        missing = r["runs"] - r["passed"] - r["failed"] - r["not_run"]
        return text + (f", absent in {missing}" if missing and not r["hypothesis"] else "") + (
            f", not run here in {r['not_run']}" if r["not_run"] and r["status"] != "not run here" else "")

    if seeded:
        out.append(report.table([[r["case"], r["exercise"] or "-", verdict(r)] for r in seeded],
                                ["case", "exercise", "result"]))
    if hyp:
        out.append(f"\nhypothesis cases: run once with COURSE_SCENARIOS={record['scenarios']} (derandomized, a seed "
                   "does not change them); examples counted as they ran, explicit ones and shrinking included")
        out.append(report.table([[r["case"], r["exercise"] or "-", verdict(r)] for r in hyp],
                                ["case", "exercise", "result"]))
    bad = [r for r in record["cases"] if r["failures"]]
    if bad:
        out.append("\nfailures:")
    for r in bad:
        for f in r["failures"][:3]:
            where = f"at seed {f['seed']}" if f["seed"] is not None else "in the hypothesis run"
            out.append(f"  {r['case']} {where}: {(f['message'].splitlines() or [''])[0][:240]}")
            out.append(f"    replay: {f['replay']}")
        more = [str(f["seed"]) for f in r["failures"][3:]]
        if more:
            out.append(f"  {r['case']} failed also at seeds {', '.join(more[:30])}" + (" ..." if len(more) > 30 else ""))
    cuda = sum(r["status"] == "not run here" for r in record["cases"])
    status = {"pass": f"pass: every case ran and passed at every one of the {n} seeds",
              "incomplete": f"incomplete: nothing failed, but {cuda} case(s) did not run here (need CUDA): not a pass",
              "fail": "FAIL: some case failed at some seed (see the failures)"}[record["status"]]
    out.append(f"soak {record['name']}: {status}")
    return out


def drive(spec: dict) -> int:
    """Inside a soak's process (cwd: the run directory): one ``pytest.main`` per label, as a
    fresh graded run would do it; the plugin's results go to ``<results>/<label>.jsonl``."""
    import faulthandler

    import pytest

    import gc

    here = tuple({os.getcwd() + os.sep, os.path.realpath(os.getcwd()) + os.sep})
    reference = os.environ.get("COURSE_REFERENCE_ROOT", "")  # the plugin takes it out at each import
    os.makedirs(spec["basetemp"], exist_ok=True)
    for i, label in enumerate(spec["labels"]):
        if i == 1:  # torch and the rest are imported now: pytest's gc.collect() at each session's end
            gc.collect()  # walks them no more (it took a second per seed)
            gc.freeze()
        hyp = label == HYPOTHESIS
        results = os.path.join(spec["results"], f"{label}.jsonl")
        limit = spec["hypothesis_timeout" if hyp else "timeout"]
        Path(results).write_text(json.dumps({"event": "soak_start", "label": label, "at": time.time(), "limit": limit})
                                 + "\n", encoding="utf-8")
        for mod_name, mod in list(sys.modules.items()):  # the next import of a test module runs it anew
            if mod_name == "conftest" or (getattr(mod, "__file__", None) or "").startswith(here):
                del sys.modules[mod_name]
        os.environ.update(COURSE_JUDGE_RESULTS=results, COURSE_REFERENCE_ROOT=reference,
                          COURSE_HIDDEN_SEED="" if hyp else str(label))
        counts: dict[str, int] = {}
        count = _count_examples(counts) if hyp else None
        faulthandler.dump_traceback_later(limit, exit=True)  # past its limit, the process ends
        # Each run its own tmp_path root, removed after it: pytest's default numbered ones stay
        # locked while this process lives, and each session's exit handler scans them all.
        basetemp = os.path.join(spec["basetemp"], str(label))
        try:
            pytest.main([*spec["args"], "--basetemp", basetemp], plugins=[_Select(hyp)])
        finally:
            faulthandler.cancel_dump_traceback_later()
            shutil.rmtree(basetemp, ignore_errors=True)
            if count is not None:
                from hypothesis.internal.observability import remove_observability_callback
                remove_observability_callback(count)
        if hyp:
            with open(results, "a", encoding="utf-8") as f:
                f.write(json.dumps({"event": "soak_examples", "counts": counts}) + "\n")
    return 0


def _count_examples(counts: dict):
    """Count, per test function, the examples hypothesis runs (None without hypothesis)."""
    try:
        from hypothesis.internal.observability import add_observability_callback
    except ImportError:
        return None

    def count(obs):
        if getattr(obs, "type", "") == "test_case" and getattr(obs, "status", "") in ("passed", "failed"):
            counts[obs.property] = counts.get(obs.property, 0) + 1
    add_observability_callback(count)
    return count


class _Select:
    """Keeps only the hypothesis cases (``only_hypothesis``) or only the others."""

    def __init__(self, only_hypothesis: bool):
        self.only_hypothesis = only_hypothesis

    def pytest_collection_modifyitems(self, config, items):
        def is_hypothesis(item):
            return bool(getattr(getattr(item, "obj", None), "is_hypothesis_test", False))
        drop = [it for it in items if is_hypothesis(it) != self.only_hypothesis]
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = [it for it in items if is_hypothesis(it) == self.only_hypothesis]
