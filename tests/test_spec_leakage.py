"""Maintainers' check: the exercise regions' docstrings state contracts, not recipes.

For each region, the functions and methods its reference answer calls (builtins left out,
and types left out: a contract may name what it returns or raises) are compared with what
its docstring spells out as code: a name inside ``double backticks`` or written as
``name(``, quoted strings (dict keys, messages) not counted. The share spelled out is the
region's leakage: a docstring that names most of the calls turns the exercise into
transcription (COURSE.md, "Contracts, not recipes"). The tools a learner may use are
introduced in the chapter's notebook instead. Run this file with ``-s`` to see the table.
"""
from __future__ import annotations

import ast
import builtins
import re
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "practice"))
from judging import regions  # noqa: E402

MEDIAN_GOAL, MAX_GOAL = 0.30, 0.60


def holder(region: regions.Region) -> ast.FunctionDef:
    """The innermost function whose body holds the region."""
    found = [node for node in ast.walk(ast.parse(region.path.read_text(encoding="utf-8")))
             if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
             and node.lineno - 1 < region.begin < node.end_lineno - 1 + 2]
    return max(found, key=lambda node: node.lineno)


def called_names(body: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(body)):
        if isinstance(node, ast.Call):
            func = node.func
            names.add(func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", ""))
    return {n for n in names if n and not hasattr(builtins, n) and not n[:1].isupper()}


def spelled_out(doc: str) -> set[str]:
    code = re.findall(r"``(.+?)``", doc, flags=re.S) + re.findall(r"([A-Za-z_][\w.]*)\(", doc)
    code = [re.sub(r"\"[^\"]*\"|'[^']*'", " ", c) for c in code]  # a quoted key is data, not a call
    return set(re.findall(r"[A-Za-z_]\w*", " ".join(code)))


def leakage() -> dict[str, tuple[float, list[str]]]:
    table = {}
    for region in regions.find(REPO):
        calls = called_names(regions.dedent_body(region))
        leaked = sorted(calls & spelled_out(ast.get_docstring(holder(region)) or ""))
        table[region.id] = (len(leaked) / len(calls) if calls else 0.0, leaked)
    return table


def test_region_docstrings_state_contracts_not_recipes():
    table = leakage()
    for exercise, (share, leaked) in sorted(table.items(), key=lambda kv: -kv[1][0]):
        print(f"{share:5.0%}  {exercise:28} {', '.join(leaked)}")
    median = statistics.median(share for share, _ in table.values())
    worst = {e: s for e, (s, _) in table.items() if s > MAX_GOAL}
    print(f"median {median:.0%} over {len(table)} regions")
    assert median <= MEDIAN_GOAL, f"median leakage {median:.0%} (goal {MEDIAN_GOAL:.0%})"
    assert not worst, f"docstrings that spell out most of their answer's calls: {worst}"


def test_the_measure_sees_a_recipe():
    doc = "Call ``self.scheduler.preempt(seq)`` then ``record.add()``; raise ``ValueError``."
    assert called_names("self.scheduler.preempt(seq)\nrecord.add(1)\nraise ValueError('x')") == {"preempt", "add"}
    assert {"preempt", "add"} <= spelled_out(doc)
    assert "first_divergence" not in spelled_out('the key ``"first_divergence"`` of the result')
