"""Hidden checks behind notebooks/01_the_engine.ipynb's graded cells.

``check_exercise(exercise_id)``: the chapter's hidden tests for one exercise the learner
wrote inside ``course_lib`` (``practice/hidden/chapters/ch01/test_hidden.py``, the same
cases ``python practice/judge.py test ch01`` runs), against the course_lib the notebook
imported.

``check_predict_cached_tokens(predict)``: the warm-up; the learner predicts how many
prompt tokens the prefix cache will serve; the real engine serves the same prompts and
reports the truth.

Both return a list of failure messages (empty: passed); see ``__init__.py`` for why.
"""
from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path

from course_lib import Engine
from course_lib.weights.checkpoint import make_random

GREEDY = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}


def _rng(seed) -> random.Random:
    return random.Random(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))


def _serve_one_by_one(engine: Engine, prompts, params) -> list[dict]:
    """Each prompt alone, finished before the next arrives (so the cache state is well defined)."""
    return [engine.generate(input_ids=[list(p)], sampling_params=params)[0] for p in prompts]


class _Outcomes:
    """A pytest plugin that keeps each case's outcome and its error's message (never the source)."""

    def __init__(self):
        self.cases: dict[str, tuple[str, str]] = {}
        self.messages: dict[str, str] = {}

    def pytest_runtest_makereport(self, item, call):
        if call.excinfo is not None and item.nodeid not in self.messages:
            first = (str(call.excinfo.value).strip().splitlines() or [""])[0]  # the words, not the values diff
            self.messages[item.nodeid] = f"{call.excinfo.typename}: {first}"

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":  # keep the worst of setup, call, teardown
            if self.cases.get(report.nodeid, ("passed",))[0] == "passed":
                self.cases[report.nodeid] = (report.outcome, self.messages.get(report.nodeid, ""))


def check_exercise(exercise_id: str) -> list[str]:
    """Failures of the hidden tests of ``exercise_id`` (``ch01.qkv_rows``, ...) run in this
    process against the course_lib it imported (the learner's). A case that did not run
    (skipped, or none collected) is a failure: nothing unrun counts as passed."""
    import contextlib
    import io

    import pytest

    name = exercise_id.split(".", 1)[1]
    tests = Path(__file__).resolve().parent / "ch01" / "test_hidden.py"
    plugin = _Outcomes()
    autoload = os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD")
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # the hidden tests need no third-party plugin
    try:
        with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
            code = pytest.main([str(tests), "-q", "--tb=no", "-k", f"test_{name}", "-p", "no:cacheprovider",
                                "--import-mode=importlib", "--capture=sys", "--basetemp", tmp,
                                "-W", "ignore::pytest.PytestUnknownMarkWarning"], plugins=[plugin])
    finally:
        if autoload is None:
            del os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"]
        else:
            os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = autoload
    failures = [f"{nodeid.rsplit('::', 1)[-1]}: {outcome}{' - ' + message if message else ''}"
                for nodeid, (outcome, message) in plugin.cases.items() if outcome != "passed"]
    if not plugin.cases:
        failures.append(f"no hidden case of {exercise_id} ran (pytest exit code {int(code)})")
    return failures


def _prediction_prompts(rng: random.Random, bs: int) -> list[list[int]]:
    def tokens(n):
        return [rng.randrange(256) for _ in range(n)]

    system = tokens(rng.randint(2 * bs + 1, 3 * bs - 1))
    first = system + tokens(rng.randint(1, 2 * bs))
    other = tokens(rng.randint(2 * bs, 3 * bs))
    exact = tokens(3 * bs)  # a whole number of blocks
    cut = rng.randint(bs + 1, 2 * bs - 1)
    return [
        first,
        system + tokens(rng.randint(1, 2 * bs)),  # shares the system prompt
        other,
        list(first),                              # a repeat
        exact,
        list(exact),                              # a repeat that is a whole number of blocks
        other[:cut] + tokens(bs),                 # matches an older prompt, not the latest
        tokens(rng.randint(1, bs - 1)),           # shorter than one block
        system[: bs * 2],                         # a prefix of earlier prompts, whole blocks
    ]


def check_predict_cached_tokens(predict, seed=None) -> list[str]:
    """Failures of ``predict(prompt, earlier_prompts, block_size) -> int`` against the real engine."""
    rng = _rng(seed)
    cases = [(bs, _prediction_prompts(rng, bs)) for bs in (4, 8, 16)]
    try:  # the candidate first; it gets copies, so it cannot change the test's prompts
        predicted = [[predict(list(p), [list(e) for e in prompts[:i]], bs) for i, p in enumerate(prompts)]
                     for bs, prompts in cases]
    except Exception as exc:
        return [f"predict_cached_tokens raised {type(exc).__name__}: {exc}"]
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        path = make_random(tmp, "tiny", seed=rng.randrange(10_000))
        for (bs, prompts), guesses in zip(cases, predicted):
            served = _serve_one_by_one(Engine(path, block_size=bs), prompts, {"max_new_tokens": 1, "temperature": 0})
            for i, (p, guess, out) in enumerate(zip(prompts, guesses, served), 1):
                actual = out["meta_info"]["cached_tokens"]
                if guess != actual:
                    failures.append(f"block size {bs}, prompt {i} of {len(prompts)} ({len(p)} tokens, after "
                                    f"{i - 1} earlier prompts): you predicted {guess!r}, the engine reused {actual}")
    return failures
