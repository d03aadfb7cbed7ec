"""The judge end to end: check, test (problems and chapters), grade, release, hidden tests, CUDA cases, time limits.

Each scenario runs the real command line (``python practice/judge.py ...``) in subprocesses,
as learners and instructors do. Every grading run imports torch in its own process, so
the scenarios are started together when the first test needs one and each test waits
only for its own. ``CUDA_VISIBLE_DEVICES=""`` makes every machine look GPU-less here, so
"not graded: needs CUDA" is checked on GPU machines too.
"""
from __future__ import annotations

import csv
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
PRACTICE = REPO / "practice"
SLUG = "inplace-requant"
PROBLEM = PRACTICE / "problems" / SLUG
CUDA_CASE = "test_hidden.py::test_cuda_graph_replay_sees_the_update"
NOT_PRESENT = "hidden tests: not present in this edition (public tests only)"

sys.path.insert(0, str(PRACTICE))
from judging import chapters, problems, regions, report  # noqa: E402
from judging.run import Case, RunResult  # noqa: E402


def judge(*args, judge_py=PRACTICE / "judge.py", env=None):
    e = {k: v for k, v in os.environ.items() if k != "COURSE_HIDDEN_DIR"}
    # The scenarios run side by side: one torch thread per process keeps their OpenMP
    # threads from spinning against each other (which slows each run many times over).
    # COURSE_SCENARIOS: the differential cases draw 10 random scenarios here, not 40, for the
    # suite's time (their explicit edge cases always run; the 2,000-scenario soaks of the
    # references are recorded in results/).
    e.update({"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "COURSE_SCENARIOS": "10"}, **(env or {}))
    return subprocess.run([sys.executable, str(judge_py), *map(str, args)], cwd=REPO, env=e,
                          capture_output=True, text=True, timeout=500)


def case_lines(out: str) -> dict[str, str]:
    """{case: verdict} from the judge's '  case ... verdict' lines."""
    return dict(m.groups() for m in re.finditer(r"^  (\S.*?) \.\.\. (.*)$", out, re.M))


# The full check (every problem, every chapter exercise, every wrong variant) takes longer
# than CI's budget on two cores; CI checks one problem and one exercise, and
# test_full_check_is_green (slow, and in scripts/gpu_check.sh) checks everything.
CHECKED = [SLUG, "ch01.block_hash"]


def scenario_check(tmp):
    return judge("check", "--json", "--jobs", "2", *CHECKED)


def scenario_starter(tmp):
    """The starter must fail on the public tests alone, as in the student edition."""
    (tmp / "no-hidden").mkdir()
    return judge("test", SLUG, "--file", PROBLEM / "starter.py", env={"COURSE_HIDDEN_DIR": str(tmp / "no-hidden")})


def scenario_solution(tmp):
    return judge("test", SLUG, "--file", PROBLEM / "solution.py")


def scenario_timeout(tmp):
    sleeper = tmp / "sleeper.py"
    sleeper.write_text("import time\ntime.sleep(600)\n")
    start = time.perf_counter()
    result = judge("test", SLUG, "--file", sleeper, "--timeout", 8, "-k", "test_quantize_returns")
    return result, time.perf_counter() - start


def scenario_grade(tmp):
    """aaron hands in a wrong answer that also overwrites zoe's submission on disk; zoe hands in the reference."""
    subs, log = tmp / "submissions", tmp / "spy.jsonl"
    for who in ("aaron", "zoe", "mia"):  # mia hands in nothing
        (subs / who).mkdir(parents=True)
    zoe_file = subs / "zoe" / f"{SLUG}.py"
    spy = ("\nimport hashlib as _h, json as _j, os as _o\n"
           f"with open({str(log)!r}, 'a') as _f:\n"
           "    _f.write(_j.dumps({'who': WHO, 'cwd': _o.getcwd(), 'files': sorted(_o.listdir('.')),\n"
           "                       'sha': _h.sha256(open(__file__, 'rb').read()).hexdigest()}) + '\\n')\n")
    attack = f"open({str(zoe_file)!r}, 'w').write('raise SystemExit(\"overwritten by aaron\")\\n')\n"
    sources = {
        "aaron": (PROBLEM / "wrong" / "rebind_data.py").read_text() + "\nWHO = 'aaron'" + spy + attack,
        "zoe": (PROBLEM / "solution.py").read_text() + "\nWHO = 'zoe'" + spy,
    }
    for who, text in sources.items():
        (subs / who / f"{SLUG}.py").write_text(text)
    # Chapters: zoe hands in the reference course_lib, aaron one whose block hash ignores the prefix.
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(REPO / "course_lib", subs / "zoe" / "course_lib", ignore=ignore)
    shutil.copytree(REPO / "course_lib", subs / "aaron" / "course_lib", ignore=ignore)
    target = subs / "aaron" / "course_lib" / "engine" / "block_manager.py"
    wrong = (PRACTICE / "hidden/chapters/ch01/wrong/block_hash.no_chain.py").read_text()
    target.write_text(regions.replace_bodies(target.read_text(), {"ch01.block_hash": wrong}))
    # Only chapter 01 and the problem: the other chapters' runs would add minutes and nothing here.
    result = judge("grade", subs, "--out", tmp / "out", "--only", "ch01", SLUG)
    return result, tmp / "out", log, {who: hashlib.sha256(t.encode()).hexdigest() for who, t in sources.items()}, zoe_file


def scenario_release(tmp):
    dest = tmp / "student" / "practice"
    released = dest / "judge.py"
    steps = {"release": judge("release", dest)}
    steps["test before start"] = judge("test", SLUG, judge_py=released)
    steps["start"] = judge("start", SLUG, judge_py=released)
    steps["start again"] = judge("start", SLUG, judge_py=released)
    steps["test"] = judge("test", SLUG, judge_py=released)
    steps["release again"] = judge("release", dest)
    return steps, dest


FAST = PRACTICE / "problems" / "fast-bucket-update"


def scenario_bench(tmp):
    """The speed problem's benchmark: the reference, a slow wrong answer, the student
    edition (no hidden reference) and a problem without a benchmark."""
    (tmp / "no-hidden").mkdir()
    fast = "fast-bucket-update"
    return {
        "solution": judge("bench", fast, "--file", FAST / "solution.py", "--json"),
        "slow": judge("bench", fast, "--file", FAST / "wrong" / "plans_every_tensor.py"),
        "student": judge("bench", fast, "--file", FAST / "solution.py", env={"COURSE_HIDDEN_DIR": str(tmp / "no-hidden")}),
        "not timed": judge("bench", SLUG, "--file", PROBLEM / "solution.py"),
    }


def _hidden_chapter(tmp, name, text):
    d = tmp / name / "chapters" / "ch01"
    d.mkdir(parents=True)
    (d / "test_hidden.py").write_text(text)
    return {"COURSE_HIDDEN_DIR": str(tmp / name)}


def scenario_chapter(tmp):
    """Chapter 01 on this checkout; with a GPU case (not run here); graded against a course_lib that
    hands the run another one; with a case marked with no exercise."""
    gpu = _hidden_chapter(tmp, "gpu", "import pytest\n"
                          "pytestmark = pytest.mark.exercise('ch01.block_hash')\n"
                          "def test_on_cpu():\n    pass\n"
                          "@pytest.mark.cuda\ndef test_on_the_gpu():\n    pass\n")
    unmarked = _hidden_chapter(tmp, "unmarked", "def test_no_exercise():\n    pass\n")
    shim = tmp / "shim" / "course_lib"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text(  # a course_lib that swaps in another one
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('course_lib', {str(REPO / 'course_lib' / '__init__.py')!r},\n"
        f"    submodule_search_locations=[{str(REPO / 'course_lib')!r}])\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['course_lib'] = m; spec.loader.exec_module(m)\n")
    return {
        "reference": judge("test", "ch01", "--json"),
        "gpu": judge("test", "ch01", env=gpu),
        "gpu json": judge("test", "ch01", "--json", env=gpu),
        "shim": judge("test", "ch01", "--root", tmp / "shim"),
        "unmarked": judge("test", "ch01", env=unmarked),
        "unknown exercise": judge("test", "ch01", "--exercise", "ch01.nope"),
        "problem with root": judge("test", SLUG, "--root", tmp),
    }


def _edition_with(tmp, bodies: dict[str, str]):
    """A copy of this checkout's course_lib with the regions in ``bodies`` replaced (as a learner's)."""
    root = tmp / "edition"
    shutil.copytree(REPO / "course_lib", root / "course_lib", ignore=shutil.ignore_patterns("__pycache__"))
    for region in regions.find(REPO):
        if region.id in bodies:
            target = root / region.path.relative_to(REPO)
            target.write_text(regions.replace_bodies(target.read_text(), {region.id: bodies[region.id]}, target))
    return root


def _wrong(exercise_id: str, variant: str) -> str:
    chapter, name = exercise_id.split(".")
    return (PRACTICE / "hidden" / "chapters" / chapter / "wrong" / f"{name}.{variant}.py").read_text()


# What a learner's own hidden-free run may fail with besides the public cases: a function
# handed back where a value was expected, in colour, and an error passed on with a traceback.
NOISY_CASES = ("import pytest\npytestmark = pytest.mark.exercise('ch01.block_hash')\n"
               "def helper_the_learner_returned():\n    pass\n"
               "def test_reports_a_function():\n    f = helper_the_learner_returned\n"
               "    assert f is None, f'\\x1b[31mgot {f}\\x1b[0m'\n"
               "def test_passes_an_error_on():\n    raise RuntimeError('the reference failed:\\nTraceback (most "
               "recent call last):\\n  File \"twin.py\", line 3, in run\\n    step()\\nValueError: bad shape')\n")


def scenario_voice(tmp):
    """Wrong answers graded as a learner sees them: the public tests (and two noisy cases),
    from a Jupyter kernel's environment, which asks every tool for colour."""
    noisy = _hidden_chapter(tmp, "noisy", NOISY_CASES)
    colour = {"FORCE_COLOR": "1", "CLICOLOR_FORCE": "1"}
    public, runs = {"COURSE_HIDDEN_DIR": str(tmp / "none")}, {}
    for exercise_id, variant, env in [("ch01.block_hash", "no_salt", noisy),
                                      ("ch01.gate_up_rows", "equal_halves", public),
                                      ("ch02.retract", "counts_every_preemption", public)]:
        root = _edition_with(tmp / exercise_id, {exercise_id: _wrong(exercise_id, variant)})
        runs[exercise_id] = judge("test", exercise_id.split(".")[0], "--root", root, "--exercise", exercise_id,
                                  env={**env, **colour})
    return runs


def scenario_waits(tmp):
    """Chapter 02 with its third part (the pause modes) still the stub: the first part's
    engine-level case waits for it, in the judge and in the notebook's check alike."""
    ch02 = chapters.load("ch02")
    root = _edition_with(tmp, {"ch02.pause_modes": ch02.stub(ch02.exercise("ch02.pause_modes")) + "\n"})
    public = {"COURSE_HIDDEN_DIR": str(tmp / "none")}
    program = ("import sys; sys.path.insert(0, sys.argv[1]); from judging.notebook import public_checks; "
               "public_checks('ch02.versions', root=sys.argv[2])")
    notebook = subprocess.run(
        [sys.executable, "-c", program, str(PRACTICE), str(root)],
        cwd=tmp, capture_output=True, text=True, timeout=500,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", **public})
    return {"part": judge("test", "ch02", "--root", root, "--exercise", "ch02.versions", env=public),
            "part json": judge("test", "ch02", "--root", root, "--exercise", "ch02.versions", "--json", env=public),
            "chapter": judge("test", "ch02", "--root", root, env=public),
            "notebook": notebook}


SCENARIOS = {name[len("scenario_"):]: fn for name, fn in globals().items() if name.startswith("scenario_")}


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """name -> future of the scenario's result; all start at once."""
    pool = ThreadPoolExecutor(max_workers=len(SCENARIOS))
    futures = {name: pool.submit(fn, tmp_path_factory.mktemp(name)) for name, fn in SCENARIOS.items()}
    yield {name: f.result for name, f in futures.items()}
    pool.shutdown(wait=True)


def test_check_is_green(ran):
    r = ran["check"]()
    assert r.returncode == 0, r.stdout + r.stderr
    files = {c["file"]: c for c in json.loads(r.stdout)["checks"] if c["problem"] == SLUG}
    for name in ["solution.py", "starter.py", "wrong/rebind_data.py", "wrong/copy_float.py", "wrong/no_zero_row.py",
                 "wrong/validate_after_write.py", "wrong/round_half_away.py", "wrong/abort_reprefill.py"]:
        assert files[name]["verdict"] == "ok", (name, files[name]["verdict"])
    assert files["solution.py"]["result"]["failed"] == 0 and files["solution.py"]["result"]["passed"] > 40
    assert all(c["result"]["failed"] > 0 for name, c in files.items() if name != "solution.py")


@pytest.mark.parametrize("wrong, case, words", [
    ("rebind_data.py", "test_public.py::test_hot_update_writes_in_place",
     "storage of layer.qweight unchanged (address, shape, dtype, device), but address 0x"),
    ("validate_after_write.py", "test_hidden.py::test_hot_update_rejects_wrong_shape_and_changes_nothing[torch-[1, cols]]",
     "layer.qweight bitwise unchanged after the rejected [1, "),
    ("abort_reprefill.py", "test_public.py::test_pause_costs_example[abort]",
     "pause_costs('abort', done=[4, 0, 2], left=[1, 3, 6], prompt=10, step_ms=20.0)['reprefill'] should be 30, got 36"),
])
def test_wrong_answers_fail_with_words(ran, wrong, case, words):
    checks = {c["file"]: c for c in json.loads(ran["check"]().stdout)["checks"]}
    cases = {c["case"]: c for c in checks[f"wrong/{wrong}"]["result"]["cases"]}
    assert cases[case]["outcome"] == "fail" and cases[case]["message"].startswith(words), cases[case]


def test_starter_fails_and_solution_passes(ran):
    starter, solution = ran["starter"](), ran["solution"]()
    assert starter.returncode == 1, starter.stdout + starter.stderr
    assert "FAIL: " in starter.stdout
    # Every case passed but the GPU case did not run here: incomplete, exit 3, never a plain pass.
    assert solution.returncode == 3, solution.stdout + solution.stderr
    assert "status: incomplete: 1 case(s) need a GPU" in solution.stdout
    verdicts = case_lines(solution.stdout)
    assert len(verdicts) > 40 and all(v == "pass" for c, v in verdicts.items() if c != CUDA_CASE)
    assert "hidden tests: from " in solution.stdout


def test_absent_hidden_tests_are_stated_plainly(ran):
    out = ran["starter"]().stdout  # run with COURSE_HIDDEN_DIR set to an empty directory
    assert NOT_PRESENT in out
    assert not [c for c in case_lines(out) if c.startswith("test_hidden.py")]


def test_cuda_case_is_not_graded_and_not_counted(ran):
    out = ran["solution"]().stdout
    verdicts = case_lines(out)
    assert verdicts[CUDA_CASE] == "not graded: needs CUDA"
    passed = sum(v == "pass" for v in verdicts.values())
    assert passed == len(verdicts) - 1
    assert f"score: {passed}/{passed} graded cases passed; 1 not graded" in out


def test_time_limit_fails_the_unfinished_case(ran):
    r, seconds = ran["timeout"]()
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAIL: did not finish within the time limit of 8 s" in r.stdout
    assert seconds < 120, "the judge did not stop the run at its time limit"


def test_grade_only_names_known_items(tmp_path):
    (tmp_path / "subs" / "zoe").mkdir(parents=True)
    (tmp_path / "subs" / "zoe" / f"{SLUG}.py").write_text("")
    r = judge("grade", tmp_path / "subs", "--out", tmp_path / "out", "--only", "ch01", "ch99", "no-such-problem")
    assert r.returncode == 2 and "--only: no chapter or problem ch99, no-such-problem" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists(), "a usage error writes no gradebook"


def test_grade_writes_the_gradebook_and_keeps_learners_apart(ran):
    r, out, log, shas, zoe_file = ran["grade"]()
    assert {row["item"] for row in csv.DictReader((out / "gradebook.csv").open())} == {"ch01", SLUG, "TOTAL"}
    # Every case ran except inplace-requant's GPU case: the gradebook is written and marked incomplete (3).
    assert r.returncode == 3, r.stdout + r.stderr
    with open(out / "cases.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    with open(out / "gradebook.csv", newline="") as f:
        scores = list(csv.DictReader(f))
    assert list(rows[0]) == ["learner", "item", "exercise", "case", "result", "message", "seconds"]
    book = json.loads((out / "gradebook.json").read_text())
    assert book["cases"] == [{**row, "seconds": float(row["seconds"])} for row in rows]
    # Every problem and exercise gets a row per learner; what a learner did not hand in is "not submitted".
    assert {row["status"] for row in scores if row["learner"] == "mia" and row["item"] != "TOTAL"} == {"not submitted"}
    items = {row["item"] for row in scores}
    assert {row["item"] for row in scores if row["learner"] == "mia"} == items and {"ch01", SLUG, "TOTAL"} <= items
    score = {(row["learner"], row["item"], row["exercise"]): row for row in scores}
    assert score[("zoe", "ch01", "ch01.block_hash")]["status"] == "pass"
    assert float(score[("zoe", "ch01", "ch01.block_hash")]["points"]) == 2
    assert score[("aaron", "ch01", "ch01.block_hash")]["status"] == "fail"
    assert float(score[("aaron", "ch01", "ch01.block_hash")]["points"]) == 0
    # zoe's inplace-requant: every case but the GPU one passed, so it is incomplete and earns 0.
    assert score[("zoe", SLUG, "")]["status"] == "incomplete" and float(score[("zoe", SLUG, "")]["points"]) == 0
    total = score[("zoe", "TOTAL", "")]
    assert total["status"] == "incomplete" and float(total["points"]) == book["totals"]["zoe"]["points"] >= 2
    assert float(total["max_points"]) == book["totals"]["mia"]["max_points"] > 2
    assert book["totals"]["mia"]["points"] == 0
    by = {who: [row for row in rows if row["learner"] == who and row["item"] == SLUG]
          for who in ("aaron", "zoe", "mia")}
    assert [row["result"] for row in by["mia"]] == ["not submitted"]
    zoe = {row["case"]: row["result"] for row in by["zoe"]}
    assert len(zoe) > 40 and zoe.pop(CUDA_CASE) == "not graded" and set(zoe.values()) == {"pass"}
    aaron_fails = [row["message"] for row in by["aaron"] if row["result"] == "fail"]
    assert any(m.startswith("storage of layer.qweight unchanged") for m in aaron_fails)
    # aaron's code really did overwrite zoe's file on disk; her grade used the file as handed in.
    assert zoe_file.read_text().startswith("raise SystemExit")
    records = {rec["who"]: rec for rec in map(json.loads, log.read_text().splitlines())}
    assert set(records) == {"aaron", "zoe"}
    assert records["aaron"]["cwd"] != records["zoe"]["cwd"]
    for who, rec in records.items():
        assert rec["sha"] == shas[who], f"{who} ran a file other than the one handed in"
        others = set(rec["files"]) - {"conftest.py", "pytest.ini", "layer.py", "test_public.py", "test_hidden.py",
                                     "test_differential.py", "solution_twin.py", "twin.py"}
        assert others == {f"{SLUG}.py"}, f"{who}'s directory held more than their own file: {rec['files']}"
        assert not os.path.exists(rec["cwd"]), "the run directory was left behind"


def test_release_holds_no_answers_and_its_starter_fails(ran):
    steps, dest = ran["release"]()
    assert steps["release"].returncode == 0, steps["release"].stderr
    files = {p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()}
    assert {"judge.py", "judging/plugin.py", f"problems/{SLUG}/problem.md", f"problems/{SLUG}/starter.py",
            f"problems/{SLUG}/test_public.py", f"problems/{SLUG}/layer.py"} <= files
    assert not [f for f in files if f.endswith("solution.py") or "/wrong/" in f or f.startswith("hidden/")]
    solution = (PROBLEM / "solution.py").read_text()
    quantize_body = solution[solution.index("def quantize"):solution.index("def hot_update")]
    assert not [f for f in files if quantize_body in (dest / f).read_text()]

    assert steps["test before start"].returncode == 2 and "start" in steps["test before start"].stderr
    assert steps["start"].returncode == 0 and (dest / "workspace" / f"{SLUG}.py").is_file()
    assert steps["start again"].returncode == 2 and "--force" in steps["start again"].stderr
    test = steps["test"]
    assert test.returncode == 1 and "FAIL: " in test.stdout, test.stdout + test.stderr
    assert NOT_PRESENT in test.stdout
    assert steps["release again"].returncode == 2 and "not empty" in steps["release again"].stderr


def test_bench_reports_yours_beside_the_reference_and_the_copy_limit(ran):
    runs = ran["bench"]()
    solution = runs["solution"]
    # Speed is graded on a GPU only: on this (GPU-less) run the figures are reported and
    # the verdict is "not graded" (exit 3), never a pass and never a fail.
    assert solution.returncode == 3, solution.stdout + solution.stderr
    result = json.loads(solution.stdout)
    assert result["graded"] is False and result["device"] == "cpu" and "fast enough" not in result
    assert set(result["GB/s"]) == {"yours", "reference", "engine loaders", "one flat copy"}
    assert all(v > 0 for v in result["GB/s"].values())
    # Hundreds of small copies never beat one large copy of the same bytes.
    assert result["GB/s"]["one flat copy"] > result["GB/s"]["yours"]

    slow = runs["slow"]
    assert slow.returncode == 3 and "speed: not graded on cpu" in slow.stdout, slow.stdout + slow.stderr
    assert "fast enough" not in slow.stdout
    student = runs["student"]
    assert student.returncode == 3 and "reference: not present in this edition" in student.stdout, student.stdout
    not_timed = runs["not timed"]
    assert not_timed.returncode == 2 and "not a speed problem" in not_timed.stderr, not_timed.stderr


def test_chapter_reference_passes_every_exercise(ran):
    r = ran["chapter"]()["reference"]
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(r.stdout)
    assert result["status"] == "pass" and result["hidden"] and result["points"] == result["max_points"] > 0
    ids = {ex.id for ex in next(ch for ch in chapters.all_chapters() if ch.id == "ch01").exercises}
    assert len(ids) >= 2 and {e["exercise"]: e["status"] for e in result["exercises"]} == dict.fromkeys(ids, "pass")
    assert {c["exercise"] for c in result["cases"]} == ids


def test_chapter_gpu_cases_not_run_make_it_incomplete_exit_3(ran):
    runs = ran["chapter"]()
    r = runs["gpu"]
    assert r.returncode == 3, r.stdout + r.stderr
    assert "test_hidden.py::test_on_the_gpu ... not graded: needs CUDA" in r.stdout
    assert "INCOMPLETE: 0/2 points" in r.stdout
    assert "status: incomplete: 1 case(s) need a GPU and were not graded" in r.stdout
    result = json.loads(runs["gpu json"].stdout)
    assert result["status"] == "incomplete" and result["not_graded"] == 1
    block_hash = {e["exercise"]: e for e in result["exercises"]}["ch01.block_hash"]
    # The exercise whose GPU case did not run scores 0; the chapter's other exercises keep theirs.
    assert block_hash["status"] == "incomplete" and block_hash["earned"] == 0 < block_hash["points"]
    assert result["points"] == sum(e["earned"] for e in result["exercises"]) < result["max_points"]


def test_chapter_run_that_imports_another_course_lib_fails_loudly(ran):
    r = ran["chapter"]()["shim"]
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"FAIL: the run imported course_lib from {os.path.realpath(REPO / 'course_lib')}, not " in r.stdout
    assert "score: 0/" in r.stdout


def test_chapter_cases_must_name_their_exercise_and_usage_errors_are_named(ran):
    runs = ran["chapter"]()
    r = runs["unmarked"]
    assert r.returncode == 1 and "test_no_exercise ... FAIL: the case is marked with 0 exercises" in r.stdout, r.stdout
    assert runs["unknown exercise"].returncode == 2 and "has no exercise 'ch01.nope'" in runs["unknown exercise"].stderr
    assert runs["problem with root"].returncode == 2 and "grade a chapter" in runs["problem with root"].stderr


# What a learner must never have to read: pytest's options and prefixes, colour codes,
# the judge's or pytest's frames, memory addresses.
NOISE = re.compile(r"Use -v|-vv|^\s*E   |\x1b\[|Traceback|File \"|\+ where|0x[0-9a-fA-F]{4,}|conftest|judging/",
                   re.M)


def test_failures_show_the_call_the_values_and_the_section_without_noise(ran):
    runs = ran["voice"]()
    for exercise_id, r in runs.items():
        assert r.returncode == 1, (exercise_id, r.stdout + r.stderr)
        noise = [m.group(0) for m in NOISE.finditer(r.stdout + r.stderr)]
        assert not noise, (exercise_id, noise, r.stdout)
        chapter = chapters.load(exercise_id.split(".")[0])
        section = chapter.exercise(exercise_id).section
        assert f"=> FAIL: 0/{chapter.exercise(exercise_id).points:g} points; read {chapter.notebook}, " \
               f"section “{section}”" in r.stdout, r.stdout
    block_hash = case_lines(runs["ch01.block_hash"].stdout)
    # the learner's call and the value it gave, beside what the case expected
    salt = block_hash["test_public.py::test_block_hash_includes_the_salt"]
    assert re.search(r"the check: assert (-?\d+) != \1 \| where \1 = compute_hash\(\[1, 2, 3, 4\], -1\)",
                     runs["ch01.block_hash"].stdout), salt
    assert block_hash["test_hidden.py::test_reports_a_function"] == "FAIL: got helper_the_learner_returned"
    assert block_hash["test_hidden.py::test_passes_an_error_on"] == "FAIL: RuntimeError: the reference failed:"
    assert "      ValueError: bad shape" in runs["ch01.block_hash"].stdout  # the error itself, under its case
    gate_up = runs["ch01.gate_up_rows"].stdout
    assert "the check: assert [(0, 5), (5, 5)] == [(0, 4), (4, 6)] | At index 0 diff: (0, 5) != (0, 4)\n" in gate_up


def test_a_case_waiting_for_a_later_part_says_WAITS_as_the_notebook_does_and_is_never_complete(ran):
    runs = ran["waits"]()
    part, notebook = runs["part"], runs["notebook"]
    case = "test_public.py::test_versions_tags_in_the_engine_across_an_update"
    why = ("it goes through ch02.pause_modes (section “Exercise 3 · The four pause modes”), which comes later "
           "and is not written yet")
    # The notebook's check cell lists the case as waiting and lets Run All go on.
    assert notebook.returncode == 0, notebook.stdout + notebook.stderr
    assert f"WAITS   tags_in_the_engine_across_an_update: {why}\n" in notebook.stdout, notebook.stdout
    # The judge prints the same verdict in the same words, and a wait is not a pass: exit 3, never "complete".
    assert case_lines(part.stdout)[case] == f"WAITS: {why}", part.stdout
    assert part.returncode == 3, part.stdout + part.stderr
    assert "=> WAITS: 0/3 points (2 case(s) wait for ch02.pause_modes" in part.stdout
    assert "status: incomplete: 2 case(s) wait for a later part not written yet" in part.stdout
    assert "complete (" not in part.stdout and "FAIL" not in part.stdout
    result = json.loads(runs["part json"].stdout)
    assert result["status"] == "incomplete" and result["waits"] == 2 and result["failed"] == 0
    assert {c["case"]: (c["outcome"], c["waits_for"]) for c in result["cases"]}[case] == ("waits", "ch02.pause_modes")
    assert [e["status"] for e in result["exercises"]] == ["waits"] and result["points"] == 0
    # The whole chapter: the unwritten part fails; the part before it still only waits.
    chapter = runs["chapter"]
    assert chapter.returncode == 1 and case_lines(chapter.stdout)[case] == f"WAITS: {why}", chapter.stdout
    assert "=> WAITS: 0/3 points" in chapter.stdout
    assert "status: FAIL (and 2 case(s) wait for a later part" in chapter.stdout


def test_check_covers_chapter_exercises(ran):
    checks = [c for c in json.loads(ran["check"]().stdout)["checks"] if c["problem"].startswith("ch01")]
    got = {(c["problem"], c["file"]): c["verdict"] for c in checks}
    assert got[("ch01", "reference (course_lib)")] == "ok" and got[("ch01.block_hash", "stub")] == "ok"
    wrong = [k for k in got if k[1].startswith("wrong/")]
    assert len(wrong) >= 3 and all(got[k] == "ok" for k in wrong), got
    stub = next(c for c in checks if c["file"] == "stub")
    assert stub["result"]["failed"] == len(stub["result"]["cases"]) > 0


def test_check_runs_only_what_it_is_asked_and_refuses_unknown_names(ran):
    checked = {c["problem"] for c in json.loads(ran["check"]().stdout)["checks"]}
    assert checked == {SLUG, "ch01", "ch01.block_hash"}, checked
    r = judge("check", "no-such-problem")
    assert r.returncode == 2 and "no problem, chapter or exercise named no-such-problem" in r.stderr, r.stderr


@pytest.mark.slow
def test_full_check_is_green():
    r = subprocess.run([sys.executable, str(PRACTICE / "judge.py"), "check", "--json"], cwd=REPO,
                       capture_output=True, text=True, timeout=3600,
                       env={k: v for k, v in os.environ.items() if k != "COURSE_HIDDEN_DIR"})
    result = json.loads(r.stdout)
    # Without a GPU, a wrong answer only a GPU case catches is "not graded here" (exit 3), never a pass.
    here = [c for c in result["checks"] if c["verdict"].startswith("not graded here")]
    bad = [(c["problem"], c["file"], c["verdict"]) for c in result["checks"] if c["verdict"] != "ok" and c not in here]
    expected = (0,) if torch.cuda.is_available() else ((3,) if here else (0,))
    assert r.returncode in expected and not bad and not result["rules"], (bad, result["rules"], r.stderr[-2000:])


def test_list_shows_the_problem():
    r = judge("list")
    assert r.returncode == 0, r.stderr
    assert re.search(r"^ch01 +The engine +ch01\.block_hash +A chained block hash +2$", r.stdout, re.M), r.stdout
    row = next(line for line in r.stdout.splitlines() if line.startswith(SLUG))
    assert row.split()[-1] == "no" and " 03 " in row and "medium" in row and "cuda-graphs" in row


def test_front_matter_parser():
    meta = problems.parse_front_matter(
        "---\ntitle: 'A: title'\nchapter: 03\ntags: [a, b]\nrequires:\n  - cuda\nempty: []\n---\nbody\n")
    assert meta == {"title": "A: title", "chapter": "03", "tags": ["a", "b"], "requires": ["cuda"], "empty": []}
    with pytest.raises(ValueError, match="closing"):
        problems.parse_front_matter("---\ntitle: x\n")
    with pytest.raises(ValueError, match="key: value"):
        problems.parse_front_matter("---\njust words\n---\n")
    assert problems.load(SLUG).requires == [] and not problems.load(SLUG).needs_cuda


def test_check_verdicts_say_what_is_wrong():
    def result(*outcomes, hidden=True):
        return RunResult(SLUG, "x.py", hidden, [Case(f"t{i}", o, "why") for i, o in enumerate(outcomes)])
    assert report.check_verdict(True, result("pass", "not graded")) == "ok"
    assert report.check_verdict(True, result("pass", "fail")).startswith("WRONG: the reference fails t1")
    assert report.check_verdict(True, result("not graded")).startswith("not graded here")
    assert report.check_verdict(True, result()) == "WRONG: nothing was graded"
    assert report.check_verdict(False, result("pass", "not graded")).startswith("not graded here")
    assert report.check_verdict(False, result("pass")) == "WRONG: passes every graded case"
    assert report.check_verdict(False, result("pass", "fail")) == "ok"
    assert report.check_verdict(True, result("pass", hidden=False)).startswith("WRONG: no hidden tests")
    assert not result("not graded").ok and not result().ok and result("pass", "not graded").ok
    assert [r.status for r in (result("pass"), result("pass", "not graded"), result("pass", "fail"),
                               result("not graded"), result())] == ["pass", "incomplete", "fail", "fail", "fail"]
    assert [result("pass").exit_code, result("pass", "not graded").exit_code, result("fail").exit_code] == [0, 3, 1]
    # A case that waits for a later part is not graded: never a pass, and a reference may not wait.
    assert [r.status for r in (result("pass", "waits"), result("waits"), result("waits", "fail"))] == [
        "incomplete", "fail", "fail"]
    assert result("pass", "waits").exit_code == 3 and result("pass", "waits").graded == 1
    assert report.check_verdict(True, result("pass", "waits")).startswith("WRONG: the reference fails t1")
    assert report.check_verdict(False, result("pass", "waits")) == "WRONG: passes every graded case"
    assert "1 wait for a later part" in report.score_line(result("pass", "waits"))


def test_a_test_writing_part_earns_the_share_of_buggy_variants_its_tests_catch(tmp_path):
    """chapter.json's "scoring": "share": the caught share of the points once the gates pass
    (the tests pass on a right component); a failing gate, or a variant not run, earns nothing."""
    from judging import chapter_run

    chapter = chapters.load("ch04")
    part = "ch04.commit_tests"

    def earned(gate, *catches):
        cases = [Case("t::test_commit_tests__pass_on_the_reference", gate, exercise=part)]
        cases += [Case(f"t::test_commit_tests_catches_a_buggy_step[{i}]", o, exercise=part) for i, o in enumerate(catches)]
        (row,) = chapter_run.exercise_results(chapter, RunResult("ch04", "", True, cases), only=[part])
        return row["status"], row["earned"], row["message"]

    assert earned("pass", "pass", "pass", "pass", "pass") == ("pass", 3, "")
    status, points, message = earned("pass", "pass", "fail", "pass", "fail")
    assert (status, points) == ("fail", 1.5) and "caught 2 of 4" in message
    assert earned("fail", "pass", "pass", "pass", "pass")[:2] == ("fail", 0)  # asks for more than the contract
    assert earned("pass", "pass", "not graded", "fail", "pass")[:2] == ("fail", 0)  # a variant that did not run
    assert earned("pass", "fail", "fail")[:2] == ("fail", 0)
    with pytest.raises(ValueError, match="share"):  # only a part whose id ends in _tests is scored by share
        bad = {"chapter": "ch04", "title": "t", "notebook": "n.ipynb", "exercises": [
            {"id": "ch04.copy_in_place", "title": "t", "section": "s", "points": 3, "scoring": "share"}]}
        (tmp_path / "ch04").mkdir()
        (tmp_path / "ch04" / "chapter.json").write_text(json.dumps(bad))
        chapters.load("ch04", tmp_path)


def test_a_notebook_grade_cell_of_a_test_writing_part_returns_its_share(capsys):
    """nbgrader takes a graded cell's numeric result as its partial credit: grade_exercise
    returns the share a test suite earned that catches some of the buggy variants, not all."""
    from judging.checks import variant_root
    from judging.notebook import grade_exercise
    from nbgrader.utils import determine_grade
    from nbformat.v4 import new_code_cell, new_output

    part = "ch04.commit_tests"
    body = (PRACTICE / "hidden" / "chapters" / "ch04" / "wrong" / "commit_tests.list_only.py").read_text()
    root = variant_root(REPO, part, body)
    try:
        earned = grade_exercise(part, root=root)
    finally:
        shutil.rmtree(root)
    assert 0 < earned < 3, earned
    assert "buggy variants" in capsys.readouterr().out
    cell = new_code_cell("grade_exercise('ch04.commit_tests')", metadata={"nbgrader": {
        "grade": True, "solution": False, "grade_id": "t", "points": 3}})
    cell.outputs = [new_output("execute_result", data={"text/plain": repr(earned)}, execution_count=1)]
    assert determine_grade(cell) == (earned, 3)


def test_the_gradebook_counts_an_exercise_that_waits_as_earning_nothing():
    from judging import gradebook
    row = dict(learner="ada", item="ch02", exercise="ch02.versions", status="waits", points=0, max_points=3)
    assert gradebook.totals([row]) == {"ada": {"points": 0, "max_points": 3, "complete": True, "pass": 0, "fail": 0,
                                               "waits": 1, "incomplete": 0, "not submitted": 0}}


def test_a_notebook_shows_a_verdict_as_its_words_alone():
    """IPython prints what ``_render_traceback_`` returns in place of a traceback: the
    notebook's check and graded cells show why, not the judge's frames."""
    from judging.notebook import NotPassed, PartNotDone
    for kind in (PartNotDone, NotPassed):
        error = kind("ch01.block_hash: 1 of 5 public cases did not pass")
        assert isinstance(error, AssertionError)
        assert error._render_traceback_() == [f"{kind.__name__}: ch01.block_hash: 1 of 5 public cases did not pass"]


def test_runs_side_by_side_get_a_share_of_the_cores(monkeypatch, tmp_path):
    from judging.run import _environment
    problem = problems.load(SLUG)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert _environment(tmp_path / "x.py", tmp_path / "r", problem, threads=3)["OMP_NUM_THREADS"] == "3"
    assert "OMP_NUM_THREADS" not in _environment(tmp_path / "x.py", tmp_path / "r", problem)
    monkeypatch.setenv("OMP_NUM_THREADS", "5")  # the user's own setting wins
    assert _environment(tmp_path / "x.py", tmp_path / "r", problem, threads=3)["OMP_NUM_THREADS"] == "5"


def test_every_notebook_warm_up_is_listed_and_named_by_the_judge():
    """A warm-up (an nbgrader solution cell outside course_lib) is listed in its chapter.json,
    so the judge and the student README can say it is not graded by the judge."""
    for ch in chapters.all_chapters():
        cells = json.loads((REPO / ch.notebook).read_text(encoding="utf-8"))["cells"]
        found = {c["metadata"]["nbgrader"]["grade_id"] for c in cells
                 if "BEGIN SOLUTION" in "".join(c["source"]) and c.get("metadata", {}).get("nbgrader")}
        assert found == set(ch.warmups), (ch.id, found, ch.warmups)
    r = judge("list")
    assert r.returncode == 0 and "notebook warm-ups" in r.stdout and "ch02 retract_bill" in r.stdout, r.stdout


def test_a_notebook_check_raises_naming_the_part_and_its_section(tmp_path, capsys):
    """The one check helper the notebooks share: a part whose public cases fail stops Run
    All with an error that names the part and the notebook section; a passing one prints."""
    from judging.notebook import PartNotDone, public_checks
    shutil.copytree(REPO / "course_lib", tmp_path / "course_lib", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(PRACTICE / "chapters", tmp_path / "practice" / "chapters", ignore=shutil.ignore_patterns("__pycache__"))
    public_checks("ch02.flush_rules", root=tmp_path)
    assert "all 5 public cases passed" in capsys.readouterr().out
    target = tmp_path / "course_lib" / "engine" / "pause.py"
    target.write_text(regions.replace_bodies(target.read_text(), {"ch02.flush_rules": "return True\n"}))
    with pytest.raises(PartNotDone, match=r"ch02.flush_rules: \d of 5 public cases did not pass.*"
                                          r"When the cache may be flushed"):
        public_checks("ch02.flush_rules", root=tmp_path)
    assert re.search(r"^FAILED +\S+: \S", capsys.readouterr().out, re.M), "each failing case shows its message"


def test_a_notebook_warns_when_python_imports_another_editions_course_lib(tmp_path, monkeypatch):
    from judging.notebook import edition_mismatch
    (tmp_path / "course_lib").mkdir()
    (tmp_path / "course_lib" / "__init__.py").write_text("")
    (tmp_path / "notebooks").mkdir()
    monkeypatch.chdir(tmp_path / "notebooks")
    assert "imports course_lib from" in edition_mismatch()
    monkeypatch.chdir(REPO / "notebooks")
    assert edition_mismatch() is None


def test_the_speed_tier_is_not_measured_without_a_gpu_and_scores_only_what_is_possible():
    """judge.py speed measures on a GPU only (exit 3 here, every part named); the scoring
    refuses a wrong output and a figure beyond the device copy, and ranks the rest."""
    from judging import speed
    r = judge("speed")
    assert r.returncode == 3, r.stderr[-500:]
    assert all(f"{ex} speed" in r.stdout and "not measured here" in r.stdout
               for ex in ("ch03.quantize_fp8", "ch04.copy_in_place", "ch05.ipc_sender")), r.stdout
    assert judge("speed", "ch02").returncode == 2

    def run(gbps, copy=100.0, correct=True):
        return {"gbps": gbps, "copy_gbps": copy, "bytes": 1 << 30, "correct": correct, "why": "x"}
    scored = speed.score([run(40), run(50)], [run(80), run(100)])
    assert scored["status"] == "measured" and scored["vs_reference"] == 0.5 and scored["vs_copy"] == 0.5
    assert speed.score([run(120)], [run(80)])["status"] == "refused"  # faster than copying the bytes
    assert speed.score([run(50, correct=False)], [run(80)])["status"] == "refused"
    records = [dict(scored, learner="ada", exercise="ch04.copy_in_place"),
               dict(speed.score([run(90)], [run(100)]), learner="bo", exercise="ch04.copy_in_place"),
               dict(status="not scored", why="fails its cases", learner="cy", exercise="ch04.copy_in_place")]
    board = speed.board(records).splitlines()
    assert board[0] == "ch04.copy_in_place"
    assert "bo" in board[1] and "ada" in board[2] and "cy" in board[3] and "not scored" in board[3], board


def test_board_reads_the_speed_records_of_gradebooks(tmp_path):
    (tmp_path / "week3").mkdir()
    book = {"totals": {}, "scores": [], "cases": [], "speed": [
        {"learner": "ada", "exercise": "ch05.ipc_sender", "status": "measured", "vs_reference": 1.1,
         "vs_copy": 0.4, "learner_gbps": 400.0}]}
    (tmp_path / "week3" / "gradebook.json").write_text(json.dumps(book))
    r = judge("board", tmp_path)
    assert r.returncode == 0 and "ch05.ipc_sender" in r.stdout and "1.10x reference" in r.stdout, r.stdout
    assert judge("board", tmp_path / "week3" / "nothing").returncode == 2
