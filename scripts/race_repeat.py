"""On the GPU machine: the cases that race a GPU stream, run many times on their own.

Each race case (a wrong answer that forgets a synchronization, and the reference) is graded
``--repeat`` times through ``judge.py test`` with ``-k`` picking only that case, one run
after another; the races run side by side. A wrong answer must fail every run and the
reference pass every run. Runs not started before ``--budget-s`` are reported as not run
(never as passes). ``--parallel P`` grades P runs of each race at once (a busier GPU: a
missing synchronization shows more, and the reference must still pass).

    python scripts/race_repeat.py --repeat 20 --budget-s 420 [--only bucket-handoff --parallel 4]
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PRACTICE = Path(__file__).resolve().parents[1] / "practice"
sys.path.insert(0, str(PRACTICE))
from judging.checks import variant_root  # noqa: E402

# (label, slug, exercise or None for a problem, case selector, wrong file)
RACES = [
    ("ch05.ipc_sender", "ch05", "ch05.ipc_sender", "handed_over",
     PRACTICE / "hidden/chapters/ch05/wrong/ipc_sender.no_synchronize.py"),
    ("ch09.host_snapshot", "ch09", "ch09.host_snapshot", "busy_gpu",
     PRACTICE / "hidden/chapters/ch09/wrong/host_snapshot.no_synchronize.py"),
    ("bucket-handoff", "bucket-handoff", None, "cuda_ipc_buffers",
     PRACTICE / "problems/bucket-handoff/wrong/posts_while_the_copies_are_queued.py"),
]


def grade(slug: str, exercise: str | None, selector: str, *, root: Path | None = None,
          file: Path | None = None) -> str:
    cmd = [sys.executable, str(PRACTICE / "judge.py"), "test", slug, "-k", selector, "--json"]
    if exercise:
        cmd += ["--exercise", exercise, "--root", str(root)]
    else:
        cmd += ["--file", str(file)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=PRACTICE)
    try:
        cases = json.loads(done.stdout)["cases"]
    except ValueError:
        return "error: " + (done.stderr or done.stdout).strip()[-200:]
    ran = [c for c in cases if c["outcome"] in ("pass", "fail")]
    if len(ran) != 1 or ran[0]["case"] == "(no tests ran)":
        return "not run"
    return ran[0]["outcome"]


def repeat(label, slug, exercise, selector, wrong, n, deadline, parallel=1):
    repo = PRACTICE.parent
    roots = {}
    if exercise:
        roots = {"reference": repo, "wrong": variant_root(repo, exercise, wrong.read_text(encoding="utf-8"))}
    tally = {"reference": [], "wrong": []}

    def one(who):
        if time.monotonic() > deadline:
            return who, "not run"
        if exercise:
            return who, grade(slug, exercise, selector, root=roots[who])
        file = wrong if who == "wrong" else PRACTICE / "problems" / slug / "solution.py"
        return who, grade(slug, None, selector, file=file)

    try:  # wrong and reference alternate; ``parallel`` gradings of this race at a time
        with ThreadPoolExecutor(parallel) as pool:
            for who, outcome in pool.map(one, [who for _ in range(n) for who in ("wrong", "reference")]):
                tally[who].append(outcome)
    finally:
        if exercise:
            shutil.rmtree(roots["wrong"], ignore_errors=True)
    return label, wrong.name, tally


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=420)
    ap.add_argument("--only", nargs="*", help="labels of the races to run (default: all)")
    ap.add_argument("--parallel", type=int, default=1,
                    help="gradings of one race run at a time (each its own process; default 1: one after another)")
    args = ap.parse_args()
    races = [r for r in RACES if not args.only or r[0] in args.only]
    deadline = time.monotonic() + args.budget_s
    ok = True
    with ThreadPoolExecutor(len(races)) as pool:
        for label, wrong, tally in pool.map(lambda r: repeat(*r, args.repeat, deadline, args.parallel), races):
            for who, want in (("wrong", "fail"), ("reference", "pass")):
                runs = tally[who]
                held = sum(o == want for o in runs)
                verdict = "ok" if held == args.repeat else "DOES NOT HOLD"
                ok &= held == args.repeat
                name = wrong if who == "wrong" else "reference"
                print(f"{label:20s} {name:45s} {want}: {held} of {args.repeat} runs "
                      f"(other outcomes: {sorted(set(runs) - {want}) or 'none'})  {verdict}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
