"""The problem's reference answer beside the learner's: the same scenario run on both.

A differential case builds a scenario from a few JSON-able arguments, runs it on the
learner's module here and on the reference answer (the instructor edition's
``practice/problems/<slug>/solution.py``) in a child process, and compares everything the
scenario observed. The reference never lives in the learner's process: neither can
change the other's state (module globals, torch settings, caches), and the learner's code
cannot reach it through ``sys.modules``. The child process gets a clean environment and
only the problem's directory, this directory and the reference edition on its path.

It lives in ``hidden/shared/``, which the judge copies beside every problem's hidden tests.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

from hypothesis import HealthCheck, settings

HERE = Path(__file__).resolve().parent
# Scenarios per case, as in the chapters' differential cases: COURSE_SCENARIOS raises it
# for a maintainer's soak; the default keeps a problem's grading within seconds.
EXAMPLES = int(os.environ.get("COURSE_SCENARIOS", "40"))
DIFFERENTIAL = settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
                        suppress_health_check=list(HealthCheck), print_blob=False)


class ReferenceFailed(RuntimeError):
    """The reference could not run a scenario: a fault of the grader, never the learner's."""


def find_solution(slug: str) -> Path | None:
    """The instructor edition's solution.py for ``slug``, through the judge's path (it puts
    the edition's root on PYTHONPATH); None in an edition without it."""
    entries = os.environ.get("PYTHONPATH", "").split(os.pathsep) + sys.path
    for entry in entries:
        if entry:
            path = Path(entry) / "practice" / "problems" / slug / "solution.py"
            if path.is_file():
                return path.resolve()
    return None


def load_module(path) -> object:
    """Load a problem's answer file as the judge's ``candidate`` fixture does."""
    spec = importlib.util.spec_from_file_location("candidate", str(path))
    module = importlib.util.module_from_spec(spec)
    sys.modules["candidate"] = module
    spec.loader.exec_module(module)
    return module


def as_json(value):
    return json.loads(json.dumps(value))


def run_here(module, scenario: str, /, **kwargs):
    """Run ``scenario`` (``test_module:function``, called as function(answer_module, **kwargs))
    here on ``module``; the result goes through JSON as the reference's does."""
    name, function = scenario.split(":")
    return as_json(getattr(importlib.import_module(name), function)(module, **kwargs))


class Reference:
    """A child process running scenarios on the reference answer of ``slug``."""

    def __init__(self, slug: str):
        solution = find_solution(slug)
        if solution is None:
            raise ReferenceFailed(
                f"this case compares your answer with the reference answer of {slug}, and this edition has "
                "none (practice/problems/<slug>/solution.py): grade it from the instructor edition")
        self._log = tempfile.TemporaryFile(mode="w+")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("COURSE_", "PYTEST_"))}
        path = [str(solution.parent), str(HERE), str(solution.parents[3])]
        env.update(PYTHONPATH=os.pathsep.join(path), PYTHONDONTWRITEBYTECODE="1")
        # -P: the working directory (which holds the learner's file) is not on the child's path
        self._proc = subprocess.Popen(
            [sys.executable, "-P", "-u", "-c", "import solution_twin; solution_twin.serve()", str(solution)],
            cwd=str(HERE), env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True)
        hello = self._read()
        if hello.get("solution") != str(solution):
            self.close()
            raise ReferenceFailed(f"the reference process loaded {hello} instead of {solution}")

    def run(self, scenario: str, /, **kwargs):
        self._proc.stdin.write(json.dumps({"scenario": scenario, "kwargs": kwargs}) + "\n")
        self._proc.stdin.flush()
        reply = self._read()
        if "error" in reply:
            raise ReferenceFailed(f"the reference answer failed on {scenario}({kwargs}): {reply['error']}")
        return reply["result"]

    def _read(self) -> dict:
        line = self._proc.stdout.readline()
        if not line:
            self._log.seek(0)
            raise ReferenceFailed("the reference process stopped: " + self._log.read()[-2000:])
        return json.loads(line)

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._log.close()


def serve() -> None:
    """The child's loop: one JSON request per line on stdin, one reply per line on the
    original stdout (anything the code prints goes to stderr)."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    solution = sys.argv[1]
    module = load_module(solution)
    out.write(json.dumps({"solution": solution}) + "\n")
    out.flush()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = {"result": run_here(module, request["scenario"], **request["kwargs"])}
        except BaseException as exc:  # noqa: BLE001 - reported to the grader, which fails loudly
            reply = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


def short(value, limit: int = 300) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def first_difference(mine, theirs, path: str = "", rel_tol: float = 0.0, abs_tol: float = 0.0):
    """The first place two JSON values differ: (path, mine, theirs), or None when equal."""
    if isinstance(mine, dict) and isinstance(theirs, dict):
        for key in sorted(set(mine) | set(theirs)):
            if key not in mine or key not in theirs:
                return f"{path}.{key}", mine.get(key, "<missing>"), theirs.get(key, "<missing>")
            found = first_difference(mine[key], theirs[key], f"{path}.{key}", rel_tol, abs_tol)
            if found:
                return found
        return None
    if isinstance(mine, list) and isinstance(theirs, list) and len(mine) == len(theirs):
        for i, (a, b) in enumerate(zip(mine, theirs)):
            found = first_difference(a, b, f"{path}[{i}]", rel_tol, abs_tol)
            if found:
                return found
        return None
    if (type(mine) is float and type(theirs) is float and (rel_tol or abs_tol)
            and math.isclose(mine, theirs, rel_tol=rel_tol, abs_tol=abs_tol)):
        return None
    return None if mine == theirs and type(mine) is type(theirs) else (path or "(the result)", mine, theirs)


def compare(call: str, mine, theirs, section: str, rel_tol: float = 0.0, abs_tol: float = 0.0) -> None:
    """Assert two observations of one call are equal; the message names the call, the first
    difference (yours, expected) and the section of problem.md that decides it."""
    found = first_difference(mine, theirs, rel_tol=rel_tol, abs_tol=abs_tol)
    if not found:
        return
    where, got, want = found
    raise AssertionError(f"{call}: your answer differs from the expected behaviour at {where}:\n"
                         f"  yours:    {short(got)}\n  expected: {short(want)}\n"
                         f"(see problem.md, {section})")
