"""One graded run: a learner's file against a problem's tests, in a subprocess, with a time limit.

Each run gets a fresh temporary directory holding only a copy of the learner's file, the
problem's tests and their support modules, and the judge's pytest plugin (as conftest.py);
pytest runs there as its own process group, which is killed when the time is up and
again when the run ends, so nothing the learner's code started outlives its run.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from judging.problems import PRACTICE, Problem

PLUGIN = Path(__file__).with_name("plugin.py")
# A problem may plug the learner's code into the engine; make course_lib importable even
# when it is not pip-installed (it sits next to practice/ in both editions).
REPO = PRACTICE.parent
RESERVED = {"conftest.py", "pytest.ini"}
# Colour requests a run must not inherit: a Jupyter kernel sets FORCE_COLOR, and pytest then
# writes colour codes into the very messages the learner reads as plain text.
COLOUR_VARIABLES = ("FORCE_COLOR", "PY_COLORS", "CLICOLOR_FORCE")


@dataclass
class Case:
    case: str
    outcome: str  # "pass", "fail", "not graded" (needs a GPU) or "waits" (a chapter's later part: chapter_run.py)
    message: str = ""
    seconds: float = 0.0
    exercise: str = ""  # the chapter exercise the case grades ("" for a problem's cases)
    waits_for: str = ""  # outcome "waits": the later, unwritten part it stopped at


# A run's status and the judge's exit code for it. A case that did not run to a verdict is
# never a pass: "incomplete" (nothing failed, but some cases need a GPU this machine lacks
# or wait for a later part not written yet) has its own code.
EXIT_CODES = {"pass": 0, "fail": 1, "incomplete": 3}


@dataclass
class RunResult:
    problem: str
    file: str
    hidden: bool  # were hidden tests part of this run?
    cases: list[Case] = field(default_factory=list)
    seconds: float = 0.0
    output: str = ""  # the tail of pytest's own output, for when something went badly wrong

    def count(self, outcome: str) -> int:
        return sum(c.outcome == outcome for c in self.cases)

    @property
    def graded(self) -> int:
        return self.count("pass") + self.count("fail")

    @property
    def ok(self) -> bool:
        """Every graded case passed, and at least one case was graded (some may not have run)."""
        return self.graded > 0 and self.count("fail") == 0

    @property
    def status(self) -> str:
        """'pass' (every case ran and passed), 'incomplete' (nothing failed, some did not run
        or wait for a later part) or 'fail'."""
        if not self.ok:
            return "fail"
        return "incomplete" if self.count("not graded") or self.count("waits") else "pass"

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.status]

    def to_json(self) -> dict:
        d = asdict(self)
        d.update(passed=self.count("pass"), failed=self.count("fail"), not_graded=self.count("not graded"),
                 waits=self.count("waits"), ok=self.ok, status=self.status)
        return d


def run(problem: Problem, candidate: Path, *, hidden: bool = True, timeout: float = 120.0,
        select: str | None = None, threads: int | None = None) -> RunResult:
    """Grade ``candidate`` (a .py file) with the public tests, and the hidden ones if asked and present.

    ``threads``: the CPU threads torch may use in this run (``OMP_NUM_THREADS``), for runs
    that share the machine with others; an ``OMP_NUM_THREADS`` already set wins."""
    candidate = Path(candidate)
    hidden_files = problem.hidden_files() if hidden else []
    result = RunResult(problem.slug, str(candidate), bool(hidden_files))
    root = Path(tempfile.mkdtemp(prefix=f"judge-{problem.slug}-"))
    try:
        work = root / "work"
        work.mkdir()
        tests = _copy_tests(problem, hidden_files, work)
        name = candidate.name if candidate.name not in RESERVED | {p.name for p in tests} else "submitted_" + candidate.name
        shutil.copyfile(candidate, work / name)
        seal_work_dir(work)
        results = root / "results.jsonl"  # outside the learner's directory
        env = _environment(work / name, results, problem, threads)
        cmd = [*pytest_command(work), *[p.name for p in tests if p.name.startswith("test_")]]
        if select:
            cmd += ["-k", select]
        start = time.perf_counter()
        output, returncode, timed_out = _run_limited(cmd, work, env, timeout)
        result.seconds = time.perf_counter() - start
        result.output = output[-4000:]
        result.cases = _cases(results, returncode, timed_out, timeout, output)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return result


def pytest_command(work: Path) -> list[str]:
    """pytest in run directory ``work``: quiet, no cache, no colour."""
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--color=no",
            "-c", str(work / "pytest.ini"), "--rootdir", str(work)]


def plain_environment(env: dict) -> dict:
    """``env`` without colour requests, with colour turned off for pytest and the code under test."""
    env = {k: v for k, v in env.items() if k not in COLOUR_VARIABLES}
    env.update(PY_COLORS="0", NO_COLOR="1")
    return env


def seal_work_dir(work: Path) -> None:
    """Make ``work`` a run directory of its own: an empty ``pytest.ini`` (pytest looks no
    further up) and the judge's plugin as its ``conftest.py``."""
    (work / "pytest.ini").write_text("[pytest]\n", encoding="utf-8")
    shutil.copyfile(PLUGIN, work / "conftest.py")


def _copy_tests(problem: Problem, hidden_files: list[Path], work: Path) -> list[Path]:
    copied = []
    for src in problem.public_files() + hidden_files:
        if (work / src.name).exists():
            raise ValueError(f"{src} has the same name as another test file of {problem.slug}")
        shutil.copyfile(src, work / src.name)
        copied.append(work / src.name)
    if not any(p.name.startswith("test_") for p in copied):
        raise ValueError(f"problem {problem.slug} has no test_public.py")
    return copied


def _environment(candidate: Path, results: Path, problem: Problem, threads: int | None = None) -> dict:
    drop = ("PYTEST_ADDOPTS", "COURSE_JUDGE_RESULTS")
    env = plain_environment({k: v for k, v in os.environ.items() if k not in drop})
    if threads and "OMP_NUM_THREADS" not in env:
        # Runs side by side must not each start a thread per core: OpenMP threads that
        # outnumber the cores spin against each other and slow every run down many times.
        env["OMP_NUM_THREADS"] = str(threads)
    path = [str(candidate.parent)] + ([str(REPO)] if (REPO / "course_lib").is_dir() else [])
    env.update(
        COURSE_CANDIDATE=str(candidate),
        COURSE_JUDGE_RESULTS=str(results),
        COURSE_REQUIRES_CUDA="1" if problem.needs_cuda else "0",
        PYTHONPATH=os.pathsep.join(path + [p for p in [env.get("PYTHONPATH")] if p]),
        PYTHONDONTWRITEBYTECODE="1",
        PYTEST_DISABLE_PLUGIN_AUTOLOAD="1",  # the run depends on pytest and our plugin only
    )
    return env


def _run_limited(cmd, cwd, env, timeout):
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    timed_out = False
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(proc)
        out, _ = proc.communicate()
    _kill_group(proc)  # anything the code under test left running in the background
    return out.decode("utf-8", "replace"), proc.returncode, timed_out


def _kill_group(proc):
    try:
        if hasattr(os, "killpg"):
            os.killpg(proc.pid, signal.SIGKILL)
        elif proc.poll() is None:  # Windows: no process groups here, so stop the run itself
            proc.kill()
    except (ProcessLookupError, PermissionError):
        pass


def records(results: Path) -> list[dict]:
    """The plugin's JSON lines (see plugin.py)."""
    out = []
    if results.exists():
        for line in results.read_text(encoding="utf-8").splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a half-written last line from a killed run
    return out


def _cases(results: Path, returncode: int, timed_out: bool, timeout: float, output: str) -> list[Case]:
    collected, done, exercise_of = [], {}, {}
    for rec in records(results):
        if rec.get("event") == "collected":
            collected, exercise_of = rec["cases"], rec.get("exercises", {})
        elif rec.get("event") == "case":
            done[rec["case"]] = Case(rec["case"], rec["outcome"], rec["message"], round(rec["seconds"], 3),
                                     exercise_of.get(rec["case"], ""))
    if timed_out:
        why = f"did not finish within the time limit of {timeout:g} s"
    else:
        why = f"did not finish: the test process ended early (exit code {returncode})"
    cases = [done.pop(c, None) or Case(c, "fail", why, exercise=exercise_of.get(c, "")) for c in collected]
    cases += done.values()  # collection errors
    if not cases:
        tail = " ".join(output.strip().splitlines()[-3:]) or "no output"
        cases.append(Case("(no tests ran)", "fail", f"{why if timed_out else 'no test case ran'}; pytest said: {tail}"))
    return cases
