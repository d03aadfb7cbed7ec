"""The ``bench`` verb: time a learner's file with a problem's own ``bench.py``.

A speed problem ships a ``bench.py`` beside its tests, with a command line
``--candidate PATH [--reference PATH] [--device D] [--json]``; it prints the learner's
figure beside the reference's and the hardware's limit, and exits 1 when the learner is
too slow. The judge runs it like a graded run: in a fresh directory with a copy of the
learner's file and the problem's support files, in its own process group, with a time
limit. The reference is the hidden directory's ``reference*.py``, when this edition has
one; without it the benchmark reports the learner's figure and the hardware's limit only.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from judging.problems import Problem
from judging.run import _environment, _run_limited


def has_bench(problem: Problem) -> bool:
    return (problem.path / "bench.py").is_file()


def reference_file(problem: Problem) -> Path | None:
    found = sorted(problem.hidden_dir().glob("reference*.py")) if problem.hidden_dir().is_dir() else []
    return found[0] if found else None


def bench(problem: Problem, candidate: Path, *, device: str | None = None, as_json: bool = False,
          timeout: float = 300.0) -> tuple[int, str]:
    """(exit code, output) of the problem's benchmark on ``candidate``."""
    if not has_bench(problem):
        raise ValueError(f"problem {problem.slug} has no benchmark (no bench.py)")
    root = Path(tempfile.mkdtemp(prefix=f"bench-{problem.slug}-"))
    try:
        work = root / "work"
        work.mkdir()
        for src in problem.public_files():
            shutil.copyfile(src, work / src.name)
        mine = work / "candidate_under_test.py"
        shutil.copyfile(candidate, mine)
        cmd = [sys.executable, "bench.py", "--candidate", mine.name]
        reference = reference_file(problem)
        if reference is not None:
            shutil.copyfile(reference, root / "reference.py")  # outside the learner's directory
            cmd += ["--reference", str(root / "reference.py")]
        if device:
            cmd += ["--device", device]
        if as_json:
            cmd.append("--json")
        env = _environment(mine, root / "unused.jsonl", problem)
        output, returncode, timed_out = _run_limited(cmd, work, env, timeout)
        if timed_out:
            return 1, output + f"\nthe benchmark did not finish within {timeout:g} s"
        return returncode, output
    finally:
        shutil.rmtree(root, ignore_errors=True)
