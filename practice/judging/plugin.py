"""pytest plugin for one graded run; the judge copies it into the run directory as conftest.py.

It gives tests the ``candidate`` fixture (the learner's module, loaded from the path in
``$COURSE_CANDIDATE``, so tests never depend on the file's name), turns GPU cases into
"not graded" on a machine without CUDA, and writes one JSON line per case to the file
named by ``$COURSE_JUDGE_RESULTS``. Any skip that is not "needs CUDA" is a failure: a
skipped case never counts as passed.

In a chapter run (``$COURSE_CHAPTER_EXERCISES`` names the chapter's exercise ids) every
case must carry exactly one ``@pytest.mark.exercise("chNN.name")`` of that chapter, or it
fails; ``$COURSE_SELECT_EXERCISES`` keeps only the cases of the exercises it names, and
an exercise id also works as a ``-k`` keyword. ``$COURSE_LIB_ROOT`` is the edition being
graded: the run records which ``course_lib`` it imported, and if that is not the one
under ``$COURSE_LIB_ROOT`` every case fails, so a grader can never grade the wrong code.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import sys

import pytest

# Read once and remove, so the code under test does not find the results file by name.
_RESULTS = os.environ.pop("COURSE_JUDGE_RESULTS", None)
# The reference edition's root, for cases that run the reference beside the learner's
# engine (hidden/chapters/shared/twin.py): removed before the learner's code is imported.
_REFERENCE_ROOT = os.environ.pop("COURSE_REFERENCE_ROOT", None)
_NEEDS_CUDA_REASON = "needs CUDA"
# The seed every hidden case draws its random inputs from (``hidden_seed()``): fixed, so the
# same code gets the same grade on every run. Maintainers widen the draw with
# COURSE_HIDDEN_SEED=<n> (another seed, or a printed one replayed) or =draw (a fresh one).
_HIDDEN_SEED = os.environ.pop("COURSE_HIDDEN_SEED", "")
FIXED_HIDDEN_SEED = 20261201
_pending: dict[str, dict] = {}
_not_graded: set[str] = set()
_broken: dict[str, str] = {}  # nodeid -> why the case fails before it runs
_exercise_of: dict[str, str] = {}
_CHAPTER = [e for e in os.environ.get("COURSE_CHAPTER_EXERCISES", "").split(",") if e]
_SELECT = {e for e in os.environ.get("COURSE_SELECT_EXERCISES", "").split(",") if e}
_LIB_ROOT = os.environ.get("COURSE_LIB_ROOT")
_wrong_course_lib: str | None = None


def _emit(record: dict) -> None:
    if _RESULTS:
        with open(_RESULTS, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def hidden_seed() -> int:
    """The run's seed for hidden cases (``from conftest import hidden_seed``): the fixed one
    unless a maintainer set ``$COURSE_HIDDEN_SEED`` (a number, or ``draw``)."""
    global _HIDDEN_SEED
    if _HIDDEN_SEED == "draw":
        _HIDDEN_SEED = str(int.from_bytes(os.urandom(4), "little"))  # one draw per run, every module alike
    return int(_HIDDEN_SEED) if _HIDDEN_SEED else FIXED_HIDDEN_SEED


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: the case needs an NVIDIA GPU; without one it is not graded")
    config.addinivalue_line("markers", "exercise(id): the chapter exercise (chNN.name) this case grades")
    if _LIB_ROOT:
        _check_course_lib()


def _check_course_lib() -> None:
    """Import course_lib now and record where it came from; a mismatch fails every case."""
    global _wrong_course_lib
    want = os.path.realpath(os.path.join(_LIB_ROOT, "course_lib"))
    try:
        import course_lib
    except BaseException as e:  # noqa: BLE001 - the learner's package may not even import
        _emit({"event": "course_lib", "file": None, "error": f"{type(e).__name__}: {e}"})
        return  # the test modules fail to import too, each with this error
    got = os.path.realpath(os.path.dirname(course_lib.__file__ or ""))
    _emit({"event": "course_lib", "file": got})
    if got != want:
        _wrong_course_lib = (f"the run imported course_lib from {got}, not the one being graded ({want}); "
                             "nothing was graded")


@pytest.hookimpl(tryfirst=True)  # before pytest's own -k selection, which reads the keywords added here
def pytest_collection_modifyitems(session, config, items):
    for item in items:
        marks = [m for m in item.iter_markers("exercise")]
        ids = [m.args[0] if m.args else None for m in marks]
        if ids:
            _exercise_of[item.nodeid] = ids[0]
            item.extra_keyword_matches.add(ids[0])
        if _wrong_course_lib:
            _broken[item.nodeid] = _wrong_course_lib
        elif _CHAPTER and len(ids) != 1:
            _broken[item.nodeid] = (f"the case is marked with {len(ids)} exercises {ids}; mark it with exactly one "
                                    "@pytest.mark.exercise(\"chNN.name\")")
        elif _CHAPTER and ids[0] not in _CHAPTER:
            _broken[item.nodeid] = f"the case is marked with exercise {ids[0]!r}, which is not one of {_CHAPTER}"
    if _SELECT:
        keep = [it for it in items if _exercise_of.get(it.nodeid) in _SELECT]
        dropped = [it for it in items if _exercise_of.get(it.nodeid) not in _SELECT]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = keep
    whole_problem = os.environ.get("COURSE_REQUIRES_CUDA") == "1"
    needing = [it for it in items if (whole_problem or it.get_closest_marker("cuda")) and it.nodeid not in _broken]
    if needing and not _cuda_available():
        for item in needing:
            item.add_marker(pytest.mark.skip(reason=_NEEDS_CUDA_REASON))
            _not_graded.add(item.nodeid)


def pytest_collection_finish(session):
    _emit({"event": "collected", "cases": [it.nodeid for it in session.items],
           "exercises": {it.nodeid: _exercise_of[it.nodeid] for it in session.items if it.nodeid in _exercise_of}})


def pytest_runtest_setup(item):
    if item.nodeid in _broken:
        pytest.fail(_broken[item.nodeid], pytrace=False)


def pytest_collectreport(report):
    if report.failed:
        _emit({"event": "case", "case": report.nodeid or "collection", "outcome": "fail",
               "message": "the tests could not be loaded: " + _message(report), "seconds": 0.0})


def pytest_runtest_logreport(report):
    state = _pending.setdefault(report.nodeid, {"outcome": "pass", "message": "", "seconds": 0.0})
    state["seconds"] += report.duration
    if state["outcome"] == "pass":
        if report.failed:
            where = {"setup": "while preparing the case: ", "teardown": "while cleaning up: "}.get(report.when, "")
            if report.nodeid in _broken:
                where = ""  # the judge's own reason, not the case's set-up
            state.update(outcome="fail", message=where + _message(report))
        elif report.skipped:
            reason = _skip_reason(report)
            if report.nodeid in _not_graded and reason == _NEEDS_CUDA_REASON:
                state.update(outcome="not graded", message=_NEEDS_CUDA_REASON)
            else:
                state.update(outcome="fail", message=f"the case was skipped ({reason}); a skip is not a pass")
    if report.when == "teardown":
        _emit({"event": "case", "case": report.nodeid, **_pending.pop(report.nodeid)})


def pytest_sessionfinish(session, exitstatus):
    _emit({"event": "finished", "exitstatus": int(exitstatus)})


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text.removeprefix("Skipped: ")


def _learner_frame(report) -> str:
    """Where in the graded course_lib an unexpected exception came from ("" if not there):
    the deepest traceback entry inside it, as course_lib/...py:line."""
    if not _LIB_ROOT:
        return ""
    root = os.path.realpath(os.path.join(_LIB_ROOT, "course_lib"))
    try:
        entries = report.longrepr.reprtraceback.reprentries
    except AttributeError:
        return ""
    for entry in reversed(entries):
        loc = getattr(entry, "reprfileloc", None)
        path = os.path.realpath(str(getattr(loc, "path", "")))
        if loc is not None and path.startswith(root + os.sep):
            return f"course_lib/{os.path.relpath(path, root)}:{loc.lineno}"
    return ""


def _message(report) -> str:
    """The failure in words: the assertion's own message, then what it compared (the
    values, and the learner's call that gave one), without pytest's own wording, colour
    codes or memory addresses; an exception the learner's code raised also says where
    (file and line)."""
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr).strip().splitlines()[-1]
    text = _plain(text)
    if not text.startswith(("AssertionError", "Failed")):
        where = _learner_frame(report)
        if where:
            text = f"{text}\n(raised in your code at {where})"
    for prefix in ("AssertionError: ", "Failed: "):
        text = text.removeprefix(prefix)
    # pytest appends the rewritten expression with the values it compared: the words come
    # first, then (one line) what the code gave against what was expected.
    if text.startswith("assert "):  # an assert without words of its own
        text, compared = "", text.removeprefix("assert ")
    else:
        text, _, compared = text.partition("\nassert ")
    if compared:
        text += "\nthe check: " + _compared("assert " + compared)
    # hypothesis's notes repeat the scenario the message shows, or count other failing examples
    text = text.split("\nFalsifying ")[0].split("\n(note: ")[0]
    # Lines kept (a case may show the inputs, the learner's value and the expected one on
    # their own lines), each line's runs of spaces folded; one screen at most.
    lines = [" ".join(line.split()) for line in text.strip().splitlines()]
    text = "\n".join(line for line in lines if line)
    return text if len(text) <= 1600 else text[:1597] + "..."


# Colour codes: pytest and other tools add them when a Jupyter kernel asks for colour.
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# Python's default reprs of functions and objects carry a memory address that tells the
# learner nothing: a function is shown by its qualified name, an object by its class.
_REPRS = [
    (re.compile(r"<bound method (\S+) of <[^<>]*>>"), r"\1"),
    (re.compile(r"<bound method (\S+) of [^<>]*>"), r"\1"),
    (re.compile(r"<(?:function|built-in method|method-wrapper) (\S+)(?: of [^<>]*?)? at 0x[0-9a-fA-F]+>"), r"\1"),
    (re.compile(r"<built-in (?:function|method) (\S+)>"), r"\1"),
    (re.compile(r"<generator object \S+ at 0x[0-9a-fA-F]+>"), "<generator>"),
    (re.compile(r"<(?:\S+\.)?(\w+) object at 0x[0-9a-fA-F]+>"), r"<\1 object>"),
    (re.compile(r" at 0x[0-9a-fA-F]+>"), ">"),
]
# A traceback inside a message (an error passed on from a child process): its frames are
# the machinery's, not the learner's; the exception line after them is kept.
_FRAMES = re.compile(r"^Traceback \(most recent call last\):\n(?:[ \t]+.*\n|\n)*", re.M)


def _plain(text: str) -> str:
    """``text`` without colour codes, pytest's ``E`` prefixes, tracebacks or memory addresses."""
    text = _FRAMES.sub("", _ANSI.sub("", text))
    text = re.sub(r"^E   ", "", text, flags=re.M)
    for pattern, repl in _REPRS:
        text = pattern.sub(repl, text)
    return text


# pytest's words around a comparison that mean nothing without its options (the judge has
# none) or repeat the assert's own line.
_NOISE = re.compile(r"\buse '?-v+'? to\b|^comparison failed$|^(Obtained|Expected): |^(Omitting|Skipping) \d+ identical"
                    r"|^Max relative difference", re.I)
_WHERE = re.compile(r"^ \+  (where|and)\s+(.*)$")  # what a name in the assert held: the top level only


def _compared(explanation: str) -> str:
    """pytest's explanation of a failed assert as one line: the assert with its values, what
    each call in it returned ("where 5 = compute_hash([1, 2], -1)") and pytest's note on
    where two values differ; nested lookups, diffs and option hints are left out."""
    lines = explanation.splitlines()
    kept = [lines[0].strip()]
    for line in lines[1:]:
        stripped = line.strip()
        if stripped.startswith(("Full diff:", "...Full output truncated")):
            break
        where = _WHERE.match(line)
        if where:
            kept.append(f"{where.group(1)} {where.group(2)}")
        elif line.startswith("    ") or not stripped or _NOISE.search(stripped):
            continue  # deeper than pytest's notes: a diff's context lines, nested lookups
        elif not re.match(r"[-+?] |\+\s+(where|and)\b", stripped):  # nor a string diff's own lines
            kept.append(stripped.removeprefix("comparison failed. "))
    return " | ".join(k[:160] for k in kept[:5])


@pytest.fixture(scope="session")
def candidate():
    """The module under test, loaded from $COURSE_CANDIDATE (the judge sets it)."""
    path = os.environ.get("COURSE_CANDIDATE")
    if not path:
        pytest.fail("COURSE_CANDIDATE is not set: run the tests through `python practice/judge.py test <slug>`",
                    pytrace=False)
    spec = importlib.util.spec_from_file_location("candidate", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["candidate"] = module  # dataclasses and pickling look modules up by name
    try:
        spec.loader.exec_module(module)
    except BaseException as e:  # noqa: BLE001 - a SyntaxError or sys.exit in the file is the learner's failure
        pytest.fail(f"could not import {os.path.basename(path)}: {type(e).__name__}: {e}", pytrace=False)
    return module


@pytest.fixture(scope="session")
def reference_root() -> str:
    """The reference edition's root, for cases that read its code (a test-writing part's
    reference component: hidden/chapters/shared/suites.py, or the reference engine); a run
    without one fails them."""
    if not _REFERENCE_ROOT:
        pytest.fail("this case compares your part with the reference, and no reference edition was given "
                    "($COURSE_REFERENCE_ROOT): grade it with practice/judge.py from the instructor edition",
                    pytrace=False)
    return _REFERENCE_ROOT


@pytest.fixture(scope="module")
def reference(reference_root):
    """The reference engine in a child process (twin.Reference), for cases that compare the
    learner's engine with it; a run without a reference edition fails such cases."""
    import twin
    ref = twin.Reference(reference_root)
    yield ref
    ref.close()
