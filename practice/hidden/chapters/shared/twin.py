"""The reference engine beside the learner's: one scenario, run on both, every observable compared.

A graded run imports the learner's ``course_lib``. The reference (the instructor edition
the judge belongs to) cannot live in the same process: both packages are called
``course_lib``. So the reference runs in a child process (``Reference``), started once per
test module, with only the reference tree on its path; a scenario is a plain function of
JSON-able arguments (``module:function``) that builds whatever it needs from a seed
(engines, checkpoints on disk, tensors) and returns what it observed as JSON. The test
runs the same function here, on the learner's code, and ``compare`` names the first
observation that differs, with both values.

The judge passes the reference tree's root in ``$COURSE_REFERENCE_ROOT``; the judge's
pytest plugin removes it from the environment before the learner's code is imported and
hands it to the ``reference`` fixture, so the learner's code cannot find it by name.
"""
from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_here(scenario: str, /, **kwargs):
    """Run scenario ``module:function`` in this process (on the learner's course_lib); the
    result goes through JSON as the reference's does, so both compare alike."""
    module, name = scenario.split(":")
    return json.loads(json.dumps(getattr(importlib.import_module(module), name)(**kwargs)))


class ReferenceFailed(RuntimeError):
    """A child process failed to run a scenario: for the reference, a fault of the grader,
    never the learner's."""


class JsonChild:
    """A child process spoken to in JSON lines: a request per line on its stdin, a reply
    per line on its stdout (``{"result": ...}`` or ``{"error": ...}``), after a first
    "hello" line that says what it loaded. ``Reference`` below runs the reference
    ``course_lib``; the practice problems' ``solution_twin.py`` runs a reference answer."""

    def _start(self, argv: list[str], pythonpath: list[str]) -> dict:
        """Start the child with only ``pythonpath`` on its path and no COURSE_/PYTEST_
        variables; returns its hello."""
        self._log = tempfile.TemporaryFile(mode="w+")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("COURSE_", "PYTEST_"))}
        env.update(PYTHONPATH=os.pathsep.join(pythonpath), PYTHONDONTWRITEBYTECODE="1")
        self._proc = subprocess.Popen([sys.executable, *argv], cwd=str(HERE), env=env, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._log, text=True)
        return self._read()

    def _failed(self, scenario: str, kwargs: dict, error: str) -> str:
        return f"the child process failed on {scenario}({kwargs}): {error}"

    def run(self, scenario: str, /, **kwargs):
        """Run scenario ``module:function`` in the child; returns what it observed."""
        self._proc.stdin.write(json.dumps({"scenario": scenario, "kwargs": kwargs}) + "\n")
        self._proc.stdin.flush()
        reply = self._read()
        if "error" in reply:
            raise ReferenceFailed(self._failed(scenario, kwargs, reply["error"]))
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


def serve_json_lines(hello: dict, run) -> None:
    """The child's loop: ``hello`` first, then for each request line ``run(scenario,
    **kwargs)``'s result (or the error) as one reply line on the original stdout;
    anything the code prints goes to stderr instead."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    out.write(json.dumps(hello) + "\n")
    out.flush()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = {"result": run(request["scenario"], **request["kwargs"])}
        except BaseException as exc:  # noqa: BLE001 - reported to the grader, which fails loudly
            reply = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


class Reference(JsonChild):
    """A child process running scenarios on the reference ``course_lib`` under ``root``
    (``require_reference=False``: on any edition's, e.g. a learner's for the speed tier)."""

    def __init__(self, root: str, require_reference: bool = True):
        self.root = str(Path(root).resolve())
        # The reference and the scenarios (beside this file) only.
        hello = self._start(["-u", "-c", "import twin; twin.serve()"], [self.root, str(HERE)])
        want = os.path.realpath(os.path.join(self.root, "course_lib"))
        if hello.get("course_lib") != want or (require_reference and not hello.get("reference")):
            self.close()
            raise ReferenceFailed(f"the reference process imported {hello} instead of the reference edition at {want}")

    def _failed(self, scenario: str, kwargs: dict, error: str) -> str:
        return f"the course_lib in {self.root} failed on {scenario}({kwargs}): {error}"


def serve() -> None:
    """The reference child: says which course_lib it imported, then runs scenarios."""
    import course_lib
    from course_lib import edition
    reference = edition.EDITION == "instructor" and not edition.REPLACED
    serve_json_lines({"course_lib": os.path.realpath(os.path.dirname(course_lib.__file__)),
                      "reference": reference}, run_here)


def _short(value, limit: int = 300) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def first_difference(mine, theirs, path: str = "", rel_tol: float = 0.0, abs_tol: float = 0.0,
                     strict_types: bool = False):
    """The first place two JSON values differ: (path, mine, theirs), or None when equal.
    Floats are equal within ``rel_tol``/``abs_tol`` (exact by default: a contract that
    fixes the arithmetic's order; a tolerance where two correct answers may round apart).
    ``strict_types``: equal values of other types differ too (``True`` and ``1``, ``1``
    and ``1.0``)."""
    if isinstance(mine, dict) and isinstance(theirs, dict):
        for key in sorted(set(mine) | set(theirs)):
            if key not in mine or key not in theirs:
                return f"{path}.{key}", mine.get(key, "<missing>"), theirs.get(key, "<missing>")
            found = first_difference(mine[key], theirs[key], f"{path}.{key}", rel_tol, abs_tol, strict_types)
            if found:
                return found
        return None
    if isinstance(mine, list) and isinstance(theirs, list) and len(mine) == len(theirs):
        for i, (a, b) in enumerate(zip(mine, theirs)):
            found = first_difference(a, b, f"{path}[{i}]", rel_tol, abs_tol, strict_types)
            if found:
                return found
        return None
    if (type(mine) is float and type(theirs) is float and (rel_tol or abs_tol)
            and math.isclose(mine, theirs, rel_tol=rel_tol, abs_tol=abs_tol)):
        return None
    same = mine == theirs and (not strict_types or type(mine) is type(theirs))
    return None if same else (path or "(the result)", mine, theirs)


def compare_traces(ops: list, mine: list, theirs: list, explain: str = "", engine_kwargs: dict | None = None) -> None:
    """Assert two traces (one observation per operation) are equal; on the first difference,
    the message shows the operations up to it (and the engine's settings, when given: what a
    learner needs to replay them), what the learner's engine showed and what the reference
    showed there."""
    for i, (a, b) in enumerate(zip(mine, theirs)):
        found = first_difference(a, b)
        if found:
            where, got, want = found
            steps = "\n".join(f"  {j}: {_short(op, 160)}" for j, op in enumerate(ops[:i + 1]))
            # a trace may end with observations made after the last operation (the weights)
            after = f"operation {i} ({_short(ops[i], 160)})" if i < len(ops) else "the last operation"
            raise AssertionError(
                f"your engine and the reference differ after {after}, at {where}:\n"
                f"  yours:    {_short(got)}\n  expected: {_short(want)}\n"
                f"the operations (replay them on a fresh engine{_made_with(engine_kwargs)} to see it):\n{steps}"
                + (f"\n{explain}" if explain else ""))
    if len(mine) != len(theirs):
        raise AssertionError(f"your engine made {len(mine)} observations, the reference {len(theirs)}, over {ops}")


def _made_with(engine_kwargs: dict | None) -> str:
    if not engine_kwargs:
        return ""
    return " made with " + ", ".join(f"{k}={v!r}" for k, v in sorted(engine_kwargs.items()))


def compare_results(call, mine, theirs, explain: str = "", rel_tol: float = 0.0, abs_tol: float = 0.0) -> None:
    """Assert two observations of one call are equal (floats within the tolerances),
    naming the first difference."""
    found = first_difference(mine, theirs, rel_tol=rel_tol, abs_tol=abs_tol)
    if found and isinstance(mine, dict) and isinstance(theirs, dict) and ("raised" in mine) != ("raised" in theirs):
        yours = f"raised {mine['raised']}" if "raised" in mine else f"returned {_short(mine.get('returned'))}"
        expected = f"raises {theirs['raised']}" if "raised" in theirs else f"returns {_short(theirs.get('returned'))}"
        raise AssertionError(f"{call}: yours {yours}; the contract {expected} here"
                             + (f"\n{explain}" if explain else ""))
    if found:
        where, got, want = found
        raise AssertionError(f"{call}: your result differs from the reference at {where}:\n"
                             f"  yours:    {_short(got)}\n  expected: {_short(want)}"
                             + (f"\n{explain}" if explain else ""))
