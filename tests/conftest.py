"""Shared fixtures: small random checkpoints made from a seed (never downloaded), and the
student edition (scripts/release.py), built once per run for the modules that read it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from course_lib.weights.checkpoint import make_random, preset


REPO = Path(__file__).resolve().parents[1]

# Modules whose tests (module fixtures included) take a minute or more on two cores, longest
# first, then the notebooks and the chapters' judge runs (half a minute each).
LONGEST_MODULES = ("test_nbgrader", "test_judge", "test_release", "test_browser", "test_notebooks", "test_chapters")


def pytest_configure(config):
    """pytest-xdist hands out the groups in the order of the collection (below), not sorted
    by their number of tests (its default: a long group of few tests would be handed out last
    and keep one worker busy while the other waits). Parallel runs share two cores among the
    workers and the processes they start: torch runs one thread per process there (a process
    whose own OMP_NUM_THREADS is set, the user's included, keeps it)."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def longest_first(item) -> int:
    name = item.module.__name__
    return LONGEST_MODULES.index(name) if name in LONGEST_MODULES else len(LONGEST_MODULES)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """GPU tests are reported as skipped on a machine without CUDA, never as passed.

    Parallel runs (the README's ``pytest -n 2 --dist loadgroup``): a module's tests stay on
    one worker, so its module fixtures (engines, servers, the nbgrader course) are built once;
    the notebooks and the chapters' judge runs, long and independent of each other, spread
    over the workers one by one."""
    for item in items:
        if item.originalname not in ("test_notebook_executes", "test_each_chapters_reference_passes_the_judge"):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    # The longest groups first, so that the two workers finish together (a long group handed
    # out last keeps one worker busy while the other waits). The sort is stable: within a
    # module, the tests keep their order.
    items.sort(key=longest_first)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: run scripts/gpu_check.sh on a GPU machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def make_ckpt(tmp_path_factory):
    """make_ckpt(name="tiny", seed=0, **overrides) -> path of a cached random checkpoint."""
    cache = {}

    def make(name="tiny", seed=0, max_shard_size=None, **overrides):
        key = (name, seed, max_shard_size, tuple(sorted(overrides.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"ckpt-{name}-{seed}")
            cache[key] = make_random(path, preset(name, **overrides), seed=seed, max_shard_size=max_shard_size)
        return cache[key]
    return make


@pytest.fixture(scope="session")
def tiny_ckpt(make_ckpt):
    return make_ckpt("tiny", seed=0)


@pytest.fixture(scope="session")
def student_edition(tmp_path_factory):
    """The student edition and its nbgrader course, built once by ``scripts/release.py`` for
    every module that reads it (test_release, test_nbgrader, test_hints); in a parallel run,
    by the first worker that needs it, under a lock, for all workers.

    SimpleNamespace(edition=<student edition>, course_root=<gradebook and nbgrader folders>,
    no_judge=<why the judge's release step is unavailable, or None>, output=<release's stdout>).
    Readers copy the edition before changing anything in it; only test_nbgrader writes, and only
    its own folders (submitted/, autograded/, feedback/) under course_root."""
    pytest.importorskip("nbgrader")  # scripts/release.py runs nbgrader's generate_assignment
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the run's folder, above every worker's own
    root = shared / "student-edition"
    with FileLock(str(shared / "student-edition.lock")):
        done = root / "release-output.txt"
        if not done.is_file():
            root.mkdir(exist_ok=True)
            no_judge = judge_cannot_release()
            cmd = [sys.executable, "scripts/release.py", "--dest", str(root / "student"),
                   "--course-root", str(root / "course")] + (["--no-practice"] if no_judge else [])
            run = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
            assert run.returncode == 0, f"release failed:\n{run.stdout}\n{run.stderr}"
            (root / "no-judge.txt").write_text(no_judge or "")
            done.write_text(run.stdout)
    return SimpleNamespace(edition=root / "student", course_root=root / "course",
                           no_judge=(root / "no-judge.txt").read_text() or None, output=done.read_text())


def judge_cannot_release() -> str | None:
    """Why the judge's release step is unavailable (None when it is available)."""
    judge = REPO / "practice" / "judge.py"
    if not judge.is_file():
        return "practice/judge.py does not exist yet"
    run = subprocess.run([sys.executable, str(judge), "release", "--help"], capture_output=True, text=True, cwd=REPO)
    return None if run.returncode == 0 else f"practice/judge.py has no 'release' verb: {run.stderr.strip()[-200:]}"
