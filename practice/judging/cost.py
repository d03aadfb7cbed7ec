"""``judge.py cost chNN``: a chapter's speed part, its cost proxies counted on this machine.

A chapter with a speed part ships ``practice/chapters/chNN/cost.py``: ``scenario()`` (a
zero-argument function to count), ``PART`` (the exercise it exercises) and ``REFERENCE``
(the instructor edition's counts on the same scenario). The scenario runs in a child
process on the graded tree's ``course_lib`` alone (``course_lib/cost.py`` counts), and the
counts are printed beside the reference's. It scores nothing: the GPU speed part does.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from judging.run import plain_environment

LABELS = {"ops": "tensor operations (GPU: kernel launches)", "copies": "copy calls",
          "allocations": "allocations", "allocated_bytes": "bytes allocated", "host_waits": "host waits"}
_CHILD = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("chapter_cost", sys.argv[1])
module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)
from course_lib.cost import count_costs
try:
    fn = module.scenario()
    costs, _ = count_costs(fn)
    print(json.dumps({"costs": costs.as_dict()}))
except NotImplementedError as exc:
    print(json.dumps({"not_written": str(exc)}))
"""


def cost_file(chapter_dir: Path) -> Path | None:
    path = Path(chapter_dir) / "cost.py"
    return path if path.is_file() else None


def load(path: Path):
    spec = importlib.util.spec_from_file_location(f"cost_{path.parent.name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def count(path: Path, root: Path, timeout: float = 300.0) -> dict:
    """The scenario of cost file ``path`` counted on ``root``'s course_lib, in a child process."""
    env = plain_environment({k: v for k, v in __import__("os").environ.items()
                             if not k.startswith(("COURSE_", "PYTEST_"))})
    env.update(PYTHONPATH=str(root), PYTHONDONTWRITEBYTECODE="1")
    run = subprocess.run([sys.executable, "-c", _CHILD, str(path)], cwd=str(root), env=env, capture_output=True,
                         text=True, timeout=timeout)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("{")]
    if run.returncode != 0 or not lines:
        tail = " ".join(run.stderr.strip().splitlines()[-2:]) or f"exit code {run.returncode}"
        return {"error": f"the scenario failed: {tail}"}
    return json.loads(lines[-1])


def report(chapter: str, path: Path, root: Path) -> int:
    """Print the counts beside the reference's; 0 when counted, 1 when the scenario failed,
    3 when the part is not written yet (nothing to count)."""
    return measure(chapter, path, root)[0]


def measure(chapter: str, path: Path, root: Path) -> tuple[int, dict | None]:
    """``report``'s exit code and {proxy: (yours, reference)} (None when nothing was counted)."""
    module = load(path)
    got = count(path, root)
    print(f"{chapter} · cost proxies of {module.PART} (this machine, no GPU needed; not a grade)")
    if "not_written" in got:
        print(f"  not written yet: {got['not_written']}")
        return 3, None
    if "error" in got:
        print(f"  {got['error']}")
        return 1, None
    print(f"  {'':<42}{'yours':>14}{'reference':>14}")
    pairs = {}
    for key, label in LABELS.items():
        mine, ref = got["costs"][key], module.REFERENCE[key]
        flag = "  <- more than the reference" if mine > ref else ""
        print(f"  {label:<42}{mine:>14,}{ref:>14,}{flag}")
        pairs[key] = (mine, ref)
    return 0, pairs
