"""``judge.py mutate``: one-line mutants of the exercise regions' references, graded like a
learner's answer, to measure the hidden tests (maintainers).

A mutant changes one line of a region's reference body: the line deleted (``pass`` in
its place), or one operator, comparison, boolean, constant or slice bound swapped for a
neighbouring one (``<`` for ``<=``, ``and`` for ``or``, ``n`` for ``n + 1``, ...). Each
mutant that still compiles is put into a copy of ``course_lib`` (as ``judge.py check``
puts a wrong answer) and that exercise's public and hidden cases run on it:

- **killed**: some case failed;
- **survived**: every case ran and passed; read it, then either write a case that kills
  it or show next to the region why it is equivalent;
- **not graded here**: it passed every case run on this machine, and GPU cases did not run;
- **equivalent**: it survived, and ``hidden/chapters/equivalent_mutants.json`` lists it (the
  region, the line before and after) with why no test can tell it from the reference. The
  score counts killed mutants among those not shown equivalent.

Which mutants are drawn per region is seeded (``--seed``), so a run can be repeated.
"""
from __future__ import annotations

import ast
import json
import os
import random
import re
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from judging import regions, report
from judging.chapter_run import run_chapter
from judging.checks import variant_root

# Token swaps: each pattern's match is replaced by its partner (the first match on the line).
SWAPS = [(" == ", " != "), (" != ", " == "), (" <= ", " < "), (" >= ", " > "), (" < ", " <= "), (" > ", " >= "),
         (" and ", " or "), (" or ", " and "), ("True", "False"), ("False", "True"), (" + ", " - "),
         (" - ", " + "), (" * ", " // "), ("not ", ""), ("[:", "[1:"), ("[-1]", "[0]"), ("[0]", "[-1]")]
_NUMBER = re.compile(r"(?<![\w.])(\d+)(?![\w.])")


EQUIVALENT = Path(__file__).resolve().parent.parent / "hidden" / "chapters" / "equivalent_mutants.json"


@dataclass
class Mutant:
    exercise: str
    line: int          # 1-based, in the region's body
    what: str          # how the line changed, for the table
    body: str          # the whole mutated body, at column 0
    before: str = ""   # the line, stripped, as the reference has it
    after: str = ""    # and as the mutant has it ("pass" when deleted)


def equivalent_mutants(path: Path = EQUIVALENT) -> dict[tuple[str, str, str], str]:
    """(exercise, line before, line after) -> why the mutant is equivalent, from the registry."""
    if not path.is_file():
        return {}
    return {(e["exercise"], e["before"], e["after"]): e["why"] for e in json.loads(path.read_text(encoding="utf-8"))}


def _compiles(body: str) -> bool:
    try:
        ast.parse("def _f(self, *a, **k):\n" + "".join("    " + ln + "\n" for ln in body.splitlines()))
    except SyntaxError:
        return False
    return True


def _in_code(line: str, at: int) -> bool:
    """Whether position ``at`` of ``line`` is code: outside string literals and before a
    comment (a swap inside a message or a comment changes nothing a test could see)."""
    quote = None
    for i, ch in enumerate(line[:at]):
        if quote:
            if ch == quote and line[i - 1] != "\\":
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch == "#":
            return False
    return quote is None


def mutants_of(region: regions.Region) -> list[Mutant]:
    """Every one-line mutant of a region's body that still compiles."""
    lines = regions.dedent_body(region).splitlines()
    found = []
    for i, line in enumerate(lines):
        code = line.strip()
        if not code or code.startswith("#"):
            continue
        indent = line[:len(line) - len(line.lstrip())]
        candidates = []
        if not code.endswith(":"):  # a block opener deleted would leave its body hanging
            candidates.append((f"{indent}pass", "deleted"))
        for old, new in SWAPS:
            at = next((m.start() for m in re.finditer(re.escape(old), line) if _in_code(line, m.start())), None)
            if at is not None:
                candidates.append((line[:at] + new + line[at + len(old):], f"{old.strip()} -> {new.strip() or 'nothing'}"))
        m = next((m for m in _NUMBER.finditer(line) if _in_code(line, m.start())), None)
        if m:
            n = int(m.group(1))
            candidates.append((line[:m.start()] + str(n + 1) + line[m.end():], f"{n} -> {n + 1}"))
        for new_line, what in candidates:
            body = "\n".join(lines[:i] + [new_line] + lines[i + 1:]) + "\n"
            if new_line != line and _compiles(body):
                found.append(Mutant(region.id, i + 1, f"line {i + 1}: {what}", body, code, new_line.strip()))
    return found


def draw(repo, exercise_ids, per_region: int, seed: int) -> list[Mutant]:
    """Up to ``per_region`` seeded mutants of each named region (0: all of them)."""
    rng = random.Random(seed)
    found = {r.id: r for r in regions.find(repo)}
    picked = []
    for exercise_id in exercise_ids:
        pool = mutants_of(found[exercise_id])
        picked += pool if per_region <= 0 or per_region >= len(pool) else rng.sample(pool, per_region)
    return picked


def grade(chapter, repo, mutant: Mutant, timeout: float, threads: int | None,
          equivalent: dict | None = None) -> tuple[list, dict]:
    """Grade one mutant like a learner's answer: (row for the table, record). A survivor
    the registry lists (``equivalent``) is "equivalent", with the registry's reason."""
    root = variant_root(repo, mutant.exercise, mutant.body)
    try:
        result = run_chapter(chapter, root, exercises=[mutant.exercise], timeout=timeout, threads=threads)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    verdict = report.check_verdict(False, result)
    outcome = ("killed" if verdict == "ok" else
               "not graded here" if verdict.startswith(report.NOT_GRADED_HERE) else "SURVIVED")
    why = (equivalent or {}).get((mutant.exercise, mutant.before, mutant.after))
    if outcome in ("SURVIVED", "not graded here") and why:  # listed: no case on any machine tells it apart
        outcome = "equivalent"
    return ([mutant.exercise, mutant.what, report.summary(result), outcome],
            {"exercise": mutant.exercise, "mutant": mutant.what, "before": mutant.before, "after": mutant.after,
             "outcome": outcome, "why": why if outcome == "equivalent" else None, "body": mutant.body,
             "result": result.to_json()})


def mutate(work, repo, per_region: int, seed: int, timeout: float, jobs: int = 1):
    """Grade the drawn mutants of each (chapter, exercise ids) in ``work``, ``jobs`` at a
    time (each run in its own process; the cores are shared out); returns rows and records
    in the order drawn."""
    todo = [(chapter, m) for chapter, ids in work for m in draw(repo, ids, per_region, seed)]
    threads = max(1, (os.cpu_count() or 1) // max(1, jobs))
    equivalent = equivalent_mutants()
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        graded = list(tqdm(pool.map(lambda cm: grade(cm[0], repo, cm[1], timeout, threads, equivalent), todo),
                           total=len(todo), desc="mutants", unit="mutant", file=sys.stderr))
    return [g[0] for g in graded], [g[1] for g in graded]
