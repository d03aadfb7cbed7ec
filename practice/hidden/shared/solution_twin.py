"""The problem's reference answer beside the learner's: the same scenario run on both.

A differential case builds a scenario from a few JSON-able arguments, runs it on the
learner's module here and on the reference answer (the instructor edition's
``practice/problems/<slug>/solution.py``) in a child process, and compares everything the
scenario observed. The reference never lives in the learner's process: neither can
change the other's state (module globals, torch settings, caches), and the learner's code
cannot reach it through ``sys.modules``. The child process gets a clean environment and
only the problem's directory, this directory and the reference edition on its path.

It lives in ``hidden/shared/``, which the judge copies beside every problem's hidden tests
with the chapters' ``twin.py`` (the child process and the comparison are that file's).
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path

from hypothesis import HealthCheck, settings
from twin import JsonChild, ReferenceFailed, _short, first_difference, serve_json_lines  # noqa: F401 - re-exported

HERE = Path(__file__).resolve().parent
# Scenarios per case, as in the chapters' differential cases: COURSE_SCENARIOS raises it
# for a maintainer's soak; the default keeps a problem's grading within seconds.
EXAMPLES = int(os.environ.get("COURSE_SCENARIOS", "40"))
DIFFERENTIAL = settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
                        suppress_health_check=list(HealthCheck), print_blob=False)


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


class Reference(JsonChild):
    """A child process running scenarios on the reference answer of ``slug``."""

    def __init__(self, slug: str):
        solution = find_solution(slug)
        if solution is None:
            raise ReferenceFailed(
                f"this case compares your answer with the reference answer of {slug}, and this edition has "
                "none (practice/problems/<slug>/solution.py): grade it from the instructor edition")
        # -P: the working directory (which holds the learner's file) is not on the child's path
        hello = self._start(["-P", "-u", "-c", "import solution_twin; solution_twin.serve()", str(solution)],
                            [str(solution.parent), str(HERE), str(solution.parents[3])])
        if hello.get("solution") != str(solution):
            self.close()
            raise ReferenceFailed(f"the reference process loaded {hello} instead of {solution}")

    def _failed(self, scenario: str, kwargs: dict, error: str) -> str:
        return f"the reference answer failed on {scenario}({kwargs}): {error}"


def same_as_reference(candidate, reference, scenario: str, call: str, section: str, /, rel_tol: float = 0.0,
                      **kwargs) -> None:
    """Run ``scenario`` with ``kwargs`` on the learner's module here and on the reference
    answer, and ``compare`` what both observed (``call`` and ``section`` as there)."""
    mine = run_here(candidate, scenario, **kwargs)
    compare(call, mine, reference.run(scenario, **kwargs), section, rel_tol=rel_tol)


def reference_fixture(slug: str):
    """A module-scoped pytest fixture that starts ``slug``'s reference process once and
    closes it after the module's cases: ``reference = reference_fixture(SLUG)``."""
    import pytest

    @pytest.fixture(scope="module")
    def reference():
        ref = Reference(slug)
        yield ref
        ref.close()
    return reference


def serve() -> None:
    """The reference child: loads the solution file named on its command line, says so,
    then runs scenarios on it."""
    solution = sys.argv[1]
    module = load_module(solution)
    serve_json_lines({"solution": solution}, lambda scenario, **kwargs: run_here(module, scenario, **kwargs))


def compare(call: str, mine, theirs, section: str, rel_tol: float = 0.0, abs_tol: float = 0.0) -> None:
    """Assert two observations of one call are equal; the message names the call, the first
    difference (yours, expected) and the section of problem.md that decides it."""
    found = first_difference(mine, theirs, rel_tol=rel_tol, abs_tol=abs_tol, strict_types=True)
    if not found:
        return
    where, got, want = found
    raise AssertionError(f"{call}: your answer differs from the expected behaviour at {where}:\n"
                         f"  yours:    {_short(got)}\n  expected: {_short(want)}\n"
                         f"(see problem.md, {section})")
