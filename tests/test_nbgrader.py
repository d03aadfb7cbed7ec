"""The real nbgrader pipeline on chapter 01, run the way an instructor runs it.

``scripts/release.py`` builds the student edition (nbgrader generate_assignment, the
judge's release of practice/, the library) and records the assignment in a throwaway
gradebook. Three submissions are autograded, each handed in as nbgrader's
``submitted/<student>/notebooks/`` beside the learner's ``submitted/<student>/course_lib/``:
the instructor's notebook and course_lib (full marks), the untouched student notebook with
the student edition's stubbed course_lib (zero on every graded cell), and a learner whose
answers pass every visible check but not the hidden ones (an engine part that copies where
it should view, and a warm-up answer that forgets the block size). Feedback is generated
and must show no hidden test's source. Each region's graded cell grades the submission's
own course_lib through the judge.
"""
from __future__ import annotations

import html
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("nbgrader")

REPO = Path(__file__).resolve().parents[1]
CHAPTER = "01_the_engine"
HIDDEN = REPO / "practice" / "hidden"


def load_release():
    spec = importlib.util.spec_from_file_location("course_release", REPO / "scripts" / "release.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


release = load_release()


def with_answers(notebook: Path, answers: dict[str, str]) -> dict:
    """The notebook with the source of the answer cells named by grade_id replaced."""
    nb = json.loads(notebook.read_text())
    for cell in nb["cells"]:
        grade_id = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")
        if grade_id in answers:
            cell["source"] = answers[grade_id]
    return nb


# Plausible answers that pass every visible check: the prediction forgets block_size
# (every visible example uses blocks of 4) ...
PARTLY_WRONG = {
    "predict_cached_tokens": (
        "def predict_cached_tokens(prompt, earlier_prompts, block_size):\n"
        "    best = 0\n"
        "    for e in earlier_prompts:\n"
        "        n = 0\n"
        "        while n < min(len(prompt), len(e)) and prompt[n] == e[n]:\n"
        "            n += 1\n"
        "        best = max(best, n)\n"
        "    return 4 * min(best // 4, (len(prompt) - 1) // 4)\n"),
}
# ... and a rank's slice that is right in every value but a copy, not a view (the public
# tests see the values; a hidden test sees the memory).
WRONG_REGION = ("ch01.tp_slice", REPO / "practice" / "hidden" / "chapters" / "ch01" / "wrong" / "tp_slice.copy.py")


def course_lib_with(dest: Path, exercise_id: str, body: str) -> None:
    """A copy of the instructor's course_lib at ``dest`` with region ``exercise_id``'s body replaced
    (built as ``judge.py check`` builds its wrong variants)."""
    sys.path.insert(0, str(REPO / "practice"))
    from judging.checks import variant_root

    root = variant_root(REPO, exercise_id, body)
    shutil.move(str(root / "course_lib"), dest)
    shutil.rmtree(root)


@pytest.fixture(scope="module")
def course(student_edition):
    # The edition and its gradebook come from tests/conftest.py's one release per run; the
    # submissions, autograded notebooks and feedback are written beside that gradebook.
    root, edition, no_judge = student_edition.course_root, student_edition.edition, student_edition.no_judge

    source = REPO / "notebooks" / f"{CHAPTER}.ipynb"
    student = edition / "notebooks" / f"{CHAPTER}.ipynb"
    submissions = {
        "reference": json.loads(source.read_text()),
        "untouched": json.loads(student.read_text()),
        "partly_wrong": with_answers(student, PARTLY_WRONG),
    }
    libraries = {"reference": REPO / "course_lib", "untouched": edition / "course_lib"}
    for name, nb in submissions.items():
        folder = root / "submitted" / name / release.ASSIGNMENT
        folder.mkdir(parents=True)
        (folder / f"{CHAPTER}.ipynb").write_text(json.dumps(nb))
        if name in libraries:
            shutil.copytree(libraries[name], root / "submitted" / name / "course_lib",
                            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    course_lib_with(root / "submitted" / "partly_wrong" / "course_lib", WRONG_REGION[0], WRONG_REGION[1].read_text())

    api = release.nbgrader_api(release.course_config(root, edition))
    # This course folder is outside the repository, so the graded cells are told where the judge is.
    saved = os.environ.get("COURSE_PRACTICE_DIR")
    os.environ["COURSE_PRACTICE_DIR"] = str(REPO / "practice")
    try:
        for name in submissions:
            result = api.autograde(release.ASSIGNMENT, name, force=True)
            assert result["success"], f"autograde {name}: {result['error']}\n{result['log']}"
    finally:
        os.environ.pop("COURSE_PRACTICE_DIR") if saved is None else os.environ.update(COURSE_PRACTICE_DIR=saved)
    result = api.generate_feedback(release.ASSIGNMENT, force=True)
    assert result["success"], result["error"]
    return SimpleNamespace(root=root, edition=edition, no_judge=no_judge, release_output=student_edition.output,
                           db_url=f"sqlite:///{root / 'gradebook.db'}")


def grades(course, student):
    from nbgrader.api import Gradebook

    with Gradebook(course.db_url) as gb:
        nb = gb.find_submission_notebook(CHAPTER, release.ASSIGNMENT, student)
        return {g.name: (g.score, g.max_score) for g in nb.grades}


def autograded_cells(course, student):
    path = course.root / "autograded" / student / release.ASSIGNMENT / f"{CHAPTER}.ipynb"
    return json.loads(path.read_text())["cells"]


def test_reference_submission_gets_full_marks(course):
    got = grades(course, "reference")
    assert got and all(score == top and top > 0 for score, top in got.values()), got


def graded_output(course, student, grade_id):
    cell = next(c for c in autograded_cells(course, student) if c["metadata"].get("nbgrader", {}).get("grade_id") == grade_id)
    return json.dumps(cell["outputs"])


def test_region_cell_grades_the_submissions_own_course_lib(course):
    """ch01.block_hash: full marks with the instructor's course_lib (hidden tests ran), zero with the
    student edition's stub, whose message the learner sees."""
    assert grades(course, "reference")["test_block_hash"] == (2, 2)
    assert grades(course, "untouched")["test_block_hash"] == (0, 2)
    ref = graded_output(course, "reference", "test_block_hash")
    assert str(course.root / "submitted" / "reference") in ref and "hidden tests too" in ref
    assert "every case ran and passed" in ref
    stub = graded_output(course, "untouched", "test_block_hash")
    assert str(course.root / "submitted" / "untouched") in stub
    assert "ch01.block_hash: write this part (chapter 01" in stub and "NotPassed" in stub


def test_untouched_student_notebook_gets_zero_and_fails_only_at_stubs(course):
    got = grades(course, "untouched")
    assert len(got) >= 5 and all(score == 0 for score, _ in got.values()), got
    cells = autograded_cells(course, "untouched")
    graded = {c["metadata"].get("nbgrader", {}).get("grade_id") for c in cells
              if c["metadata"].get("nbgrader", {}).get("grade")}
    errors = {c["metadata"].get("nbgrader", {}).get("grade_id"): o for c in cells
              for o in c.get("outputs", []) if o["output_type"] == "error"}
    assert graded <= set(errors), f"graded cells that did not fail: {graded - set(errors)}"
    # Before the learner writes a part, the engine stops at its stub, and a part's check cell
    # stops with PartNotDone naming it: any other cell that fails names one of the chapter's
    # exercises (or is the notebook's own unwritten answer).
    for grade_id, o in errors.items():
        if grade_id not in graded:
            assert o["ename"] in ("NotImplementedError", "PartNotDone"), (grade_id, o["ename"], o["evalue"][:300])
            if o["ename"] == "PartNotDone":
                assert re.match(r"ch\d\d\.\w+: ", o["evalue"]), o["evalue"][:300]


def test_hidden_tests_catch_what_the_visible_checks_miss(course):
    got = grades(course, "partly_wrong")
    assert got["test_tp_slice"] == (0, 1) and got["test_predict_cached_tokens"] == (0, 1), got
    assert all(score == top for gid, (score, top) in got.items()
               if gid not in ("test_tp_slice", "test_predict_cached_tokens")), got
    text = graded_output(course, "partly_wrong", "test_tp_slice")
    public = [line for line in text.split("\\n") if "test_public.py::" in line]
    assert public and all(line.endswith("... pass") for line in public), text  # every visible check passed
    assert "test_hidden.py::" in text and "FAIL: " in text
    text = graded_output(course, "partly_wrong", "test_predict_cached_tokens")
    assert "visible checks passed" in text and "AssertionError" in text and "block size 8" in text


def test_feedback_shows_no_hidden_test_source(course):
    secret = {line.strip() for py in (HIDDEN / "chapters").glob("*.py") for line in py.read_text().splitlines()}
    secret = {s for s in secret if len(s) >= 24 and not s.startswith(("#", '"""'))}
    assert len(secret) > 20, "the hidden tests were not found, so this check would prove nothing"
    for student in ["reference", "untouched", "partly_wrong"]:
        page = html.unescape((course.root / "feedback" / student / release.ASSIGNMENT / f"{CHAPTER}.html").read_text())
        assert "check_predict_cached_tokens" in page  # the one import line it may show
        shown = sorted(s for s in secret if s in page)
        assert not shown, f"{student}'s feedback shows hidden test source: {shown[:3]}"


def test_student_edition_holds_no_solution_or_hidden_test(course):
    assert release.leaks(course.edition) == []
    student = json.loads((course.edition / "notebooks" / f"{CHAPTER}.ipynb").read_text())
    answers = ["".join(c["source"]) for c in student["cells"] if c["metadata"].get("nbgrader", {}).get("solution")]
    assert answers and all("raise NotImplementedError()" in a for a in answers)
    assert not (course.edition / "practice" / "hidden").exists()
    assert (course.edition / "course_lib" / "__init__.py").is_file()


def test_leak_check_can_fail(course, tmp_path):
    fake = tmp_path / "edition"
    shutil.copytree(course.edition / "notebooks", fake / "notebooks")
    shutil.copy(REPO / "notebooks" / f"{CHAPTER}.ipynb", fake / "notebooks")  # the instructor's copy
    shutil.copytree(HIDDEN / "chapters", fake / "extra", ignore=shutil.ignore_patterns("__pycache__"))
    found = "\n".join(release.leaks(fake))
    assert "BEGIN SOLUTION" in found and "return block_size * min(longest // block_size" in found
    assert "extra/ch01_the_engine.py: contains a line" in found


def test_student_edition_holds_practice(course):
    if course.no_judge:
        pytest.skip(f"the judge's release step is unavailable: {course.no_judge}")
    assert (course.edition / "practice" / "judge.py").is_file()
    assert not list((course.edition / "practice").rglob("solution.py"))


def test_hidden_checks_pass_the_reference_and_catch_wrong_answers():
    sys.path.insert(0, str(HIDDEN))
    try:
        from chapters import ch01_the_engine as hidden
    finally:
        sys.path.remove(str(HIDDEN))
        for name in [m for m in sys.modules if m == "chapters" or m.startswith("chapters.")]:
            del sys.modules[name]
    ns: dict = {}
    exec(PARTLY_WRONG["predict_cached_tokens"], ns)
    reference = {}
    for cell in json.loads((REPO / "notebooks" / f"{CHAPTER}.ipynb").read_text())["cells"]:
        if cell["metadata"].get("nbgrader", {}).get("solution"):
            exec("".join(cell["source"]), reference)
    assert hidden.check_predict_cached_tokens(reference["predict_cached_tokens"]) == []
    assert hidden.check_predict_cached_tokens(ns["predict_cached_tokens"]), "ignoring block_size must fail"
    latest_only = lambda prompt, earlier, bs: reference["predict_cached_tokens"](prompt, earlier[-1:], bs)  # noqa: E731
    assert hidden.check_predict_cached_tokens(latest_only), "comparing with the latest prompt only must fail"


def test_hidden_cells_find_their_tests_through_course_hidden_dir(tmp_path):
    """Where grading runs outside this repository, $COURSE_HIDDEN_DIR points at the hidden tests."""
    stub = tmp_path / "hidden" / "chapters"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("")
    (stub / "ch01_the_engine.py").write_text(
        "def check_predict_cached_tokens(fn):\n    return ['stub from COURSE_HIDDEN_DIR called with ' + fn.__name__]\n")
    cell = next("".join(c["source"]) for c in json.loads((REPO / "notebooks" / f"{CHAPTER}.ipynb").read_text())["cells"]
                if c["metadata"].get("nbgrader", {}).get("grade_id") == "test_predict_cached_tokens")
    hidden_part = cell[cell.index("### BEGIN HIDDEN TESTS"):]
    program = "def predict_cached_tokens(prompt, earlier, block_size):\n    return 0\n" + hidden_part
    run = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "COURSE_HIDDEN_DIR": str(tmp_path / "hidden")}, cwd=tmp_path)
    assert run.returncode != 0 and "stub from COURSE_HIDDEN_DIR called with predict_cached_tokens" in run.stderr, \
        run.stderr


def test_check_scores_zero_when_gpu_cases_did_not_run(tmp_path, monkeypatch, capsys):
    """Exit 3 from the judge (nothing failed, a GPU case not run) is an AssertionError with that reason."""
    sys.path.insert(0, str(REPO / "practice"))
    from judging import notebook

    hidden = tmp_path / "hidden" / "chapters" / "ch01"
    hidden.mkdir(parents=True)
    (hidden / "test_hidden.py").write_text("import pytest\npytestmark = pytest.mark.exercise('ch01.block_hash')\n"
                                           "@pytest.mark.cuda\ndef test_on_the_gpu():\n    pass\n")
    monkeypatch.setenv("COURSE_HIDDEN_DIR", str(tmp_path / "hidden"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with pytest.raises(AssertionError, match=r"incomplete: 1 case\(s\) need a GPU .* scores 0"):
        notebook.grade_exercise("ch01.block_hash", root=REPO)
    assert "test_hidden.py::test_on_the_gpu ... not graded: needs CUDA" in capsys.readouterr().out


def test_course_root_finds_the_submission_beside_nbgrader_autograded(tmp_path, monkeypatch):
    sys.path.insert(0, str(REPO / "practice"))
    from judging import notebook

    monkeypatch.delenv("COURSE_SUBMISSION_ROOT", raising=False)
    nb_dir = tmp_path / "grading" / "autograded" / "ann" / "notebooks"
    nb_dir.mkdir(parents=True)
    (tmp_path / "grading" / "submitted" / "ann").mkdir(parents=True)
    with pytest.raises(AssertionError, match="no course_lib/ was handed in"):
        notebook.course_root(nb_dir)
    (tmp_path / "grading" / "submitted" / "ann" / "course_lib").mkdir()
    (tmp_path / "grading" / "submitted" / "ann" / "course_lib" / "__init__.py").write_text("")
    assert notebook.course_root(nb_dir) == tmp_path / "grading" / "submitted" / "ann"
    assert notebook.course_root(REPO / "notebooks") == REPO
