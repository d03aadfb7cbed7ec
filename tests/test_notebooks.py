"""Every chapter in notebooks/ runs top to bottom, headless, on the CPU, solutions in place
(the graded cells and the parts' check cells left out: see test_notebook_executes).

A failing cell fails the test. Each notebook's time is printed; more than three minutes
(on the 2-core CI machine) is a defect. Every chapter must show at least one plot, so the
executed notebook must hold an image/png output. The structure checks keep each chapter
a valid nbgrader source that follows the course's conventions (shared/COURSE.md).
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
LIMIT_S = 180
HIDDEN_CALL = re.compile(r"from chapters\.(\w+) import (check_\w+)")


def region_lines() -> dict[str, str]:
    """{line: exercise id} for every code line of an exercise region in course_lib that is
    long enough to identify an answer (as the release's leak check counts them)."""
    import sys

    sys.path.insert(0, str(REPO / "practice"))
    from judging import regions

    return {line.strip(): r.id for r in regions.find(REPO) for line in r.code_lines() if len(line.strip()) >= 24}


def functions_with_regions() -> dict[str, str]:
    """{function name: exercise id} for each function whose body holds an exercise region."""
    import sys

    sys.path.insert(0, str(REPO / "practice"))
    from judging import regions

    found = {}
    for r in regions.find(REPO):
        above = r.path.read_text().splitlines()[:r.begin]
        name = next(m.group(1) for line in reversed(above) if (m := re.match(r"\s*def (\w+)\(", line)))
        found[name] = r.id
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_never_shows_the_source_of_a_learners_part(path):
    """getsource / ?? / %psource of a function that holds a region would print its answer."""
    code = "\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code")
    shown = re.findall(r"getsource\(([\w.]+)\)|%psource\s+([\w.]+)|([\w.]+)\?\?", code)
    names = {next(n for n in groups if n).rsplit(".", 1)[-1] for groups in shown}
    parts = functions_with_regions()
    assert len(parts) >= 12
    assert not names & set(parts), {n: parts[n] for n in names & set(parts)}


def test_there_are_chapters():
    assert NOTEBOOKS, "notebooks/ holds no chapter (NN_name.ipynb)"


CHECK_CELL = re.compile(r'public_checks\("(\w+)"\)')


def is_check_cell(cell) -> bool:
    """A part's check cell: a code cell that holds nothing but ``public_checks("name")``."""
    return cell["cell_type"] == "code" and CHECK_CELL.fullmatch("".join(cell["source"]).strip()) is not None


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_each_part_has_one_check_cell(path):
    """Each exercise of the chapter has exactly one check cell, ``public_checks("name")`` for
    the exercise ``chNN.name``, after the exercise's section heading; no check cell names
    anything else (public_checks raises on a name that is not a part of the chapter)."""
    registry = REPO / "practice" / "chapters" / f"ch{path.name[:2]}" / "chapter.json"
    if not registry.is_file():
        pytest.skip(f"{path.name}: no practice/chapters/ch{path.name[:2]}/chapter.json")
    cells = json.loads(path.read_text())["cells"]
    chapter = json.loads(registry.read_text())
    checked = [(i, CHECK_CELL.fullmatch("".join(c["source"]).strip())[1]) for i, c in enumerate(cells)
               if is_check_cell(c)]
    calls = [m for c in cells if c["cell_type"] == "code" for m in CHECK_CELL.findall("".join(c["source"]))]
    assert len(calls) == len(checked), "a public_checks call outside a check cell of its own"
    assert sorted(f"{chapter['chapter']}.{name}" for _, name in checked) == sorted(e["id"] for e in chapter["exercises"])
    headings = {e["id"]: next(i for i, c in enumerate(cells) if c["cell_type"] == "markdown" and re.search(
        rf"^#+ {re.escape(e['section'])}$", "".join(c["source"]), re.M)) for e in chapter["exercises"]}
    for i, name in checked:
        assert headings[f"{chapter['chapter']}.{name}"] < i, f"{name}'s check cell comes before its section"


@pytest.fixture
def jupyter_env(tmp_path, monkeypatch):
    """Keep Jupyter's and matplotlib's files in a temp dir; keep the inline backend (PNGs)."""
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("MPLCONFIGDIR", str(tmp_path / "mpl"))
    monkeypatch.delenv("MPLBACKEND", raising=False)  # Agg would drop every image/png output
    monkeypatch.delenv("COURSE_HIDDEN_DIR", raising=False)  # find the hidden tests the default way


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, tmp_path, jupyter_env, capsys, record_property):
    nb = nbformat.read(path, as_version=4)
    # The graded cells run the judge once per exercise, each a fresh process with the chapter's
    # public and hidden tests, and each part's check cell (``public_checks("name")``) runs that
    # part's public tests in a fresh pytest process. Here the judge grades each chapter once
    # instead, public and hidden tests (tests/test_chapters.py; its check-cell test proves each
    # check cell's selection is exactly its part's public cases, and
    # test_each_part_has_one_check_cell below that each cell names a part of its chapter).
    # The learner's walk (tests/test_release.py, chapter 01 of the student edition) and the
    # browser test run both kinds of cell in a kernel; tests/test_nbgrader.py runs the graded
    # cells. Neither kind of cell leaves state that a later cell uses.
    nb.cells = [c for c in nb.cells if not (c.metadata.get("nbgrader", {}).get("grade")
                                            and "grade_exercise(" in c.source) and not is_check_cell(c)]
    # allow_errors: every failing cell is listed below at once, not only the first.
    # startup_timeout: on two busy cores (the whole suite side by side) a kernel once took
    # more than nbclient's default 60 s to answer its first message.
    client = nbclient.NotebookClient(nb, timeout=LIMIT_S, kernel_name="python3", allow_errors=True,
                                     startup_timeout=180, resources={"metadata": {"path": str(path.parent)}})
    start = time.perf_counter()
    try:
        client.execute()  # raises CellExecutionError, naming the cell, on the first error
    finally:
        seconds = time.perf_counter() - start
        nbformat.write(nb, tmp_path / path.name)
        record_property("seconds", round(seconds, 1))
        with capsys.disabled():
            print(f"\n[notebook] {path.name}: {seconds:.1f} s (executed copy: {tmp_path / path.name})")
    assert seconds < LIMIT_S, f"{path.name} took {seconds:.0f} s; a chapter must run in under {LIMIT_S} s on 2 cores"
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    errors = [(c, o) for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    unexpected = [f"{o.ename}: {o.evalue}"[:300] for c, o in errors]
    assert not unexpected, f"{path.name}: cells failed: {unexpected}"
    pngs = sum("image/png" in o.get("data", {}) for o in outputs)
    assert pngs >= 1, f"{path.name} shows no plot (no image/png output)"
    # The learner writes the regions: no output (a printed source, a traceback, help())
    # shows a line of a region's reference body.
    shown = "\n".join(o.get("text", "") + "\n".join(str(v) for v in o.get("data", {}).values()
                                                   if isinstance(v, str) and not v.startswith("iVBOR"))
                      for o in outputs)
    shown_lines = {line.strip() for line in shown.splitlines()}
    leaked = sorted({rid for line, rid in region_lines().items() if line in shown_lines})
    assert not leaked, f"{path.name} prints reference lines of the regions {leaked}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_an_nbgrader_source(path):
    nb = json.loads(path.read_text())
    cells = [(c, "".join(c["source"]), c.get("metadata", {}).get("nbgrader")) for c in nb["cells"]]
    markdown = "\n".join(src for c, src, _ in cells if c["cell_type"] == "markdown")
    assert re.search(r"^## Self-test", markdown, re.M), "a chapter opens with a self-test"
    assert re.search(r"^## Summary", markdown, re.M), "a chapter closes with a summary"
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    cell_ids = [c.get("id") for c in nb["cells"]]  # nbformat 4.5: every cell has an id, none repeated
    assert None not in cell_ids and len(cell_ids) == len(set(cell_ids)), "cell ids missing or repeated"
    assert "%matplotlib inline" in "".join(src for _, src, _ in cells)

    # One source of truth: chapters never paste a copy of engine code.
    code = "\n".join(src for c, src, _ in cells if c["cell_type"] == "code")
    assert not re.search(r"^class \w+\((nn\.Module|torch\.nn\.Module)\)", code, re.M), "engine code pasted"

    graded = [(src, meta) for _, src, meta in cells if meta]
    ids = [meta["grade_id"] for _, meta in graded]
    assert len(ids) == len(set(ids)), f"grade_ids repeat: {ids}"
    registry = REPO / "practice" / "chapters" / f"ch{path.name[:2]}" / "chapter.json"
    if registry.is_file():
        # A chapter whose exercises live in course_lib: one graded cell per exercise grades it
        # through the judge (practice/judging/notebook.py), for the points in chapter.json.
        # Warm-ups (a prediction in an answer cell) may stay, worth less than the engine's parts.
        region_points = 0
        for ex in json.loads(registry.read_text())["exercises"]:
            assert re.search(rf"^#+ {re.escape(ex['section'])}$", markdown, re.M), f"no section {ex['section']!r}"
            cells_for = [m for src, m in graded if m.get("grade") and f'grade_exercise("{ex["id"]}")' in src]
            assert len(cells_for) == 1, f"one graded cell must call grade_exercise({ex['id']!r})"
            assert cells_for[0]["points"] == ex["points"] and cells_for[0]["locked"], ex["id"]
            region_points += ex["points"]
        warm_up = sum(m.get("points", 0) for src, m in graded if m.get("grade") and "grade_exercise(" not in src)
        assert warm_up < region_points, "a chapter's graded weight is on the parts it runs in the engine"
        for src, meta in graded:
            if meta.get("solution"):
                assert "### BEGIN SOLUTION" in src and "### END SOLUTION" in src
        return
    answers = [src for src, meta in graded if meta.get("solution")]
    tests = [(src, meta) for src, meta in graded if meta.get("grade") and not meta.get("solution")]
    assert answers and tests, "a chapter ends with at least one graded exercise"
    for src in answers:
        assert "### BEGIN SOLUTION" in src and "### END SOLUTION" in src
    for src, meta in tests:
        assert meta["points"] > 0 and meta["locked"]
        region = re.search(r'^grade_exercise\("(ch\d\d\.\w+)"\)', src, re.M)
        if region:  # an exercise region's cell: the judge runs its public and hidden tests (practice/judging/notebook.py)
            chapter = json.loads((REPO / "practice" / "chapters" / region[1][:4] / "chapter.json").read_text())
            assert region[1] in {e["id"] for e in chapter["exercises"]}, f"{meta['grade_id']}: {region[1]} is not registered"
            continue
        visible, _, hidden = src.partition("### BEGIN HIDDEN TESTS")
        # nbgrader keeps what follows the hidden block: checks there are visible too.
        after_hidden = hidden.partition("### END HIDDEN TESTS")[2]
        assert "assert" in visible + after_hidden, f"{meta['grade_id']}: the learner sees some checks"
        calls = HIDDEN_CALL.findall(hidden)
        # A chapter whose exercises are regions of course_lib runs its hidden test file instead.
        runs_hidden_tests = "test_hidden.py" in hidden
        assert (calls or runs_hidden_tests) and "### END HIDDEN TESTS" in hidden, \
            f"{meta['grade_id']}: hidden part calls a check or runs the chapter's hidden tests"
        for module, function in calls:
            source = (REPO / "practice" / "hidden" / "chapters" / f"{module}.py").read_text()
            assert f"def {function}(" in source, f"practice/hidden/chapters/{module}.py lacks {function}"
