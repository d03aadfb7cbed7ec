"""``judge.py mutate``: the operator set (cosmic-ray's and the judge's), how mutants are
told apart, the verdicts, and one small region's mutants graded through the judge."""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PRACTICE = REPO / "practice"
sys.path.insert(0, str(PRACTICE))
from judging import mutants, regions  # noqa: E402
from judging.run import Case, RunResult  # noqa: E402

pytest.importorskip("cosmic_ray", reason="cosmic-ray is in the [dev] extra: pip install -e '.[dev]'")

SAMPLE = """\
total = 0
for x in items:
    if x is None or x < limit and not flag:
        continue
    if x in seen:
        break
    total += x * 2
try:
    check(x, strict=True)
except ValueError:
    raise KeyError("bad")
label = "ok"
return total - 1
"""


def region(body: str, exercise: str = "ch99.sample", path: Path = Path("sample.py")) -> regions.Region:
    """A region holding ``body`` (written at column 0), its BEGIN marker on the file's line 10."""
    indented = "".join(("    " + ln if ln.strip() else "") + "\n" for ln in body.splitlines())
    return regions.Region(exercise, path, 9, 10 + len(body.splitlines()), "    ", indented)


@functools.lru_cache(maxsize=None)
def made(body: str) -> set[tuple[str, str, str]]:
    """(operator family, line before, line after) of every valid mutant, as tokens."""
    found, _ = mutants.mutants_of(region(body))
    return {(m.operator.split("_")[0], mutants.normal(m.before), mutants.normal(m.after)) for m in found if m.valid}


@pytest.mark.parametrize("operator, before, after", [
    # binary and comparison operators, each replaced by every other (a few of them here)
    ("ReplaceBinaryOperator", "total += x * 2", "total += x + 2"),
    ("ReplaceBinaryOperator", "total += x * 2", "total += x ** 2"),
    ("ReplaceBinaryOperator", "return total - 1", "return total // 1"),
    ("ReplaceComparisonOperator", "if x is None or x < limit and not flag:", "if x is None or x <= limit and not flag:"),
    ("ReplaceComparisonOperator", "if x is None or x < limit and not flag:", "if x is not None or x < limit and not flag:"),
    ("ReplaceMembership", "if x in seen:", "if x not in seen:"),
    # boolean operators swapped, and an operand dropped from a condition
    ("ReplaceOrWithAnd", "if x is None or x < limit and not flag:", "if x is None and x < limit and not flag:"),
    ("ReplaceAndWithOr", "if x is None or x < limit and not flag:", "if x is None or x < limit or not flag:"),
    ("DropOperand", "if x is None or x < limit and not flag:", "if x < limit and not flag:"),
    ("DropOperand", "if x is None or x < limit and not flag:", "if x is None:"),
    ("DropOperand", "if x is None or x < limit and not flag:", "if x is None or not flag:"),
    # unary operators removed and added
    ("ReplaceUnaryOperator", "if x is None or x < limit and not flag:", "if x is None or x < limit and flag:"),
    ("AddNot", "if x in seen:", "if not x in seen:"),
    # augmented assignment
    ("ReplaceAugmentedAssignment", "total += x * 2", "total = x * 2"),
    ("ReplaceAugmentedAssignment", "total += x * 2", "total -= x * 2"),
    # constants: numbers, strings, True / False, None
    ("NumberReplacer", "total = 0", "total = 1"),
    ("NumberReplacer", "return total - 1", "return total - 0"),
    ("ReplaceStringConstant", 'label = "ok"', 'label = "XXokXX"'),
    ("ReplaceStringConstant", 'label = "ok"', 'label = ""'),
    ("ReplaceTrueWithFalse", "check(x, strict=True)", "check(x, strict=False)"),
    ("ReplaceNone", "if x is None or x < limit and not flag:", "if x is True or x < limit and not flag:"),
    # break / continue, and a loop that never runs
    ("ReplaceContinueWithBreak", "continue", "break"),
    ("ReplaceBreakWithContinue", "break", "continue"),
    ("ZeroIterationForLoop", "for x in items:", "for x in []:"),
    # keyword arguments removed or given another value
    ("RemoveKeywordArgument", "check(x, strict=True)", "check(x)"),
    ("ReplaceKeywordArgumentValue", "check(x, strict=True)", "check(x, strict=None)"),
    # exceptions: a handler that catches nothing, another exception raised
    ("ExceptClauseReplacer", "except ValueError:", "except ():"),
    ("ReplaceRaisedException", 'raise KeyError("bad")', 'raise RuntimeError("bad")'),
    # return values, and a statement deleted
    ("ReplaceReturnValue", "return total - 1", "return None"),
    ("DeleteStatement", 'label = "ok"', "pass"),
    ("DeleteStatement", "continue", "pass"),
])
def test_the_operator_set_makes_each_kind_of_mutant(operator, before, after):
    assert (operator, mutants.normal(before), mutants.normal(after)) in made(SAMPLE)


def test_every_mutant_compiles_differs_from_the_reference_and_stays_in_the_region():
    found, _ = mutants.mutants_of(region(SAMPLE))
    reference = mutants._tree_dump(mutants._wrap(SAMPLE))
    assert len(found) > 50
    for m in found:
        assert m.valid and mutants._tree_dump(mutants._wrap(m.body)) not in (None, reference), m.diff
        assert 11 <= m.line <= 10 + len(SAMPLE.splitlines()), (m.line, m.diff)  # the body's lines in the file
        assert m.diff.startswith("- ") and "\n+ " in m.diff


def test_an_invalid_mutant_is_listed_never_drawn_and_a_repeated_one_is_dropped():
    """Deleting the assignment a ``nonlocal`` needs does not compile; ``k=None`` made
    ``k=True`` comes from two operators and is graded once."""
    body = "count = 0\ndef bump():\n    nonlocal count\n    count += 1\nbump()\nreport(count, k=None)\n"
    found, dropped = mutants.mutants_of(region(body))
    invalid = [m for m in found if not m.valid]
    assert [(m.operator, m.before, m.after) for m in invalid] == [("DeleteStatement", "count = 0", "pass")]
    drawn = mutants.draw(found, 0, seed=0)
    assert invalid[0] not in drawn and len(drawn) == len(found) - 1
    to_true = [m for m in found if m.after == "report(count, k=True)"]
    assert len(to_true) == 1 and dropped >= 1


def test_a_mutant_keeps_its_name_when_the_rest_of_the_region_changes(tmp_path):
    """The registry of equivalent mutants names a mutant by its region and the code it
    changes (as tokens), never by a line number: lines added above it, other spacing or a
    comment leave it listed."""
    registry = tmp_path / "equivalent.json"
    registry.write_text(json.dumps([{"exercise": "ch99.sample", "before": "total += x * 2",
                                     "after": "total = x * 2", "why": "a reason long enough to be read"}]))
    edited = "log = []\n" + SAMPLE.replace("total += x * 2", "total  +=  x*2  # the sum")
    listed = mutants.equivalent_mutants(registry)
    for body in (SAMPLE, edited):
        found, _ = mutants.mutants_of(region(body))
        assert sum(m.key in listed for m in found) == 1, body
    assert mutants.normal("dsts[ -1].device  # note") == mutants.normal("dsts[-1].device")
    assert mutants.normal("x <= 1") != mutants.normal("x < 1")


def test_draw_is_seeded_and_all_takes_every_valid_mutant():
    found, _ = mutants.mutants_of(region(SAMPLE))
    assert mutants.draw(found, 5, seed=3) == mutants.draw(found, 5, seed=3)
    assert len(mutants.draw(found, 5, seed=3)) == 5 and mutants.draw(found, 0, seed=3) == found


def test_every_mutant_listed_as_equivalent_is_one_the_tool_makes_today():
    """Each entry of hidden/chapters/equivalent_mutants.json names a real mutant of today's
    reference (a region rewritten leaves no stale entry that could excuse another survivor),
    each with why."""
    listed = mutants.equivalent_mutants()
    assert listed, "hidden/chapters/equivalent_mutants.json lists no mutant"
    found = {r.id: r for r in regions.find(REPO)}
    keys = {}
    for exercise in {k[0] for k in listed}:
        assert exercise in found, f"{exercise} is not a region"
        keys[exercise] = {m.key for m in mutants.mutants_of(found[exercise])[0]}
    for k, why in listed.items():
        assert k in keys[k[0]], f"{k[0]}: no mutant turns {k[1]!r} into {k[2]!r}"
        assert len(why) > 30, f"{k[0]}: say why the mutant is equivalent"


def fake_run(outcomes: list[str], seconds: float = 2.0) -> RunResult:
    result = RunResult("ch99", "", True, seconds=seconds)
    result.cases = [Case(f"test_{i}", o, "" if o == "pass" else "needs CUDA" if o == "not graded" else "wrong",
                         exercise="ch99.sample") for i, o in enumerate(outcomes)]
    return result


def test_the_verdicts_the_limit_and_a_region_no_case_can_run_here(tmp_path, monkeypatch):
    """Graded runs replaced by set outcomes: a failing case kills, all passing survives (or
    is equivalent when listed), GPU cases that did not run are "not graded here", an invalid
    mutant is never run; the limit follows the reference's time; a region whose every case
    needs a GPU is not run at all."""
    from judging import mutate
    lib = tmp_path / "course_lib"
    lib.mkdir()
    (lib / "__init__.py").write_text("")
    body = "count = 0\ndef bump():\n    nonlocal count\n    count += 1\nbump()\nreturn count\n"
    indented = "".join("    " + ln + "\n" for ln in body.splitlines())
    (lib / "sample.py").write_text("def f():\n    # BEGIN EXERCISE ch99.sample\n" + indented + "    # END EXERCISE\n")
    ran, gpu_only = [], []

    def graded(chapter, repo, exercise, body, timeout, threads):
        ran.append((body, timeout))
        if gpu_only:
            return fake_run(["not graded", "not graded"])
        if body == regions.dedent_body(regions.find(tmp_path)[0]):
            return fake_run(["pass", "pass"], seconds=20.0)
        if body.startswith("count = 1\n"):
            return fake_run(["pass", "not graded"])
        if "return None" in body or "count -= 1" in body:
            return fake_run(["pass", "pass"])
        return fake_run(["pass", "fail"])

    monkeypatch.setattr(mutate, "_graded", graded)
    chapter = type("Chapter", (), {"id": "ch99", "title": "Sample"})()
    listed = {mutants.key("ch99.sample", "count += 1", "count -= 1"): "a reason"}
    out = mutate.campaign([(chapter, ["ch99.sample"])], tmp_path, tool="cosmic-ray", per_region=0, seed=0,
                          timeout=120, jobs=2, listed=listed)
    records = {(r["before"], r["after"]): r for r in out["chapters"][0]["mutants"]}
    assert records[("count = 0", "pass")]["verdict"] == "invalid"
    assert not any(b.startswith("pass\ndef bump") for b, _ in ran), "the invalid mutant was run"
    assert records[("count = 0", "count = 1")]["verdict"] == "not graded here"
    assert records[("return count", "return None")]["verdict"] == "survived"
    assert records[("count += 1", "count -= 1")]["verdict"] == "equivalent-listed"
    assert records[("count += 1", "count = 1")]["verdict"] == "killed"
    assert records[("count += 1", "count = 1")]["first_failure"]["case"] == "test_1"
    assert {t for _, t in ran[1:]} == {80.0}, "the limit: LIMIT_FACTOR times the reference's 20 s"
    t = out["totals"]
    assert t["invalid"] == 1 and t["survived"] == 1 and t["not_graded_here"] == 1 and t["equivalent_listed"] == 1
    assert t["killed_share"] == round(t["killed"] / (t["killed"] + 2), 4)

    ran.clear()
    gpu_only.append(True)
    out = mutate.campaign([(chapter, ["ch99.sample"])], tmp_path, tool="cosmic-ray", per_region=0, seed=0,
                          timeout=120, jobs=2, listed=listed)
    assert len(ran) == 1, "only the reference ran"
    verdicts = {r["verdict"] for r in out["chapters"][0]["mutants"]}
    assert verdicts == {"not graded here", "equivalent-listed", "invalid"}


def test_mutate_grades_a_small_regions_mutants_through_the_judge():
    """A real trial: every mutant of ch01.block_hash graded like a learner's answer, each
    with its verdict; a killed mutant's run stopped at its first failing case."""
    env = {k: v for k, v in os.environ.items() if k != "COURSE_HIDDEN_DIR"}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", COURSE_SCENARIOS="10")
    r = subprocess.run([sys.executable, str(PRACTICE / "judge.py"), "mutate", "ch01.block_hash", "--per-region", "all",
                        "--jobs", "2", "--json"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)
    (chapter,) = report["chapters"]
    made_here, _ = mutants.mutants_of(next(g for g in regions.find(REPO) if g.id == "ch01.block_hash"))
    assert len(chapter["mutants"]) == len(made_here) >= 2
    for m in chapter["mutants"]:
        assert m["verdict"] == "killed" and m["operator"] and m["line"] > 0 and m["diff"].startswith("- "), m
        assert m["first_failure"]["case"] and m["cases_run"] < m["cases"], m
    assert chapter["totals"]["killed_share"] == 1.0 and report["totals"]["killed"] == len(made_here)
    assert chapter["regions"][0]["reference_s"] > 0 and not chapter["regions"][0]["every_case_needs_a_gpu_here"]


def test_a_mutants_run_reports_hypothesis_failures_without_shrinking_them(tmp_path):
    """The plugin every mutant's run loads: the tests' own settings inherit its profile, so
    a failing scenario stops the case as soon as it is found (and replayed), unshrunk."""
    pytest.importorskip("hypothesis")
    from judging import mutate
    (tmp_path / f"{mutate._FAST_PLUGIN}.py").write_text(mutate._FAST_PLUGIN_TEXT)
    (tmp_path / "test_sample.py").write_text(
        "from hypothesis import given, settings, strategies as st\n"
        "@settings(max_examples=200, derandomize=True, database=None, deadline=None)\n"
        "@given(st.lists(st.integers()))\n"
        "def test_short(xs):\n"
        "    open('calls', 'a').write('x')\n"
        "    assert len(xs) < 3\n")

    def calls(*plugin):
        (tmp_path / "calls").unlink(missing_ok=True)
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin, "test_sample.py"],
                       cwd=tmp_path, capture_output=True, timeout=120)
        return len((tmp_path / "calls").read_text())

    shrunk, unshrunk = calls(), calls("-p", mutate._FAST_PLUGIN)
    assert unshrunk < shrunk, (unshrunk, shrunk)
