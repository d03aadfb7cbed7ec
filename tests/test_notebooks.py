"""Every chapter in notebooks/ runs top to bottom, headless, on the CPU, solutions in place.

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


def test_there_are_chapters():
    assert NOTEBOOKS, "notebooks/ holds no chapter (NN_name.ipynb)"


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
    client = nbclient.NotebookClient(nb, timeout=LIMIT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
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
    assert not [o for o in outputs if o.output_type == "error"]
    pngs = sum("image/png" in o.get("data", {}) for o in outputs)
    assert pngs >= 1, f"{path.name} shows no plot (no image/png output)"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_an_nbgrader_source(path):
    nb = json.loads(path.read_text())
    cells = [(c, "".join(c["source"]), c.get("metadata", {}).get("nbgrader")) for c in nb["cells"]]
    markdown = "\n".join(src for c, src, _ in cells if c["cell_type"] == "markdown")
    assert re.search(r"^## Self-test", markdown, re.M), "a chapter opens with a self-test"
    assert re.search(r"^## Summary", markdown, re.M), "a chapter closes with a summary"
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    assert "%matplotlib inline" in "".join(src for _, src, _ in cells)

    graded = [(src, meta) for _, src, meta in cells if meta]
    ids = [meta["grade_id"] for _, meta in graded]
    assert len(ids) == len(set(ids)), f"grade_ids repeat: {ids}"
    answers = [src for src, meta in graded if meta.get("solution")]
    tests = [(src, meta) for src, meta in graded if meta.get("grade") and not meta.get("solution")]
    assert answers and tests, "a chapter ends with at least one graded exercise"
    for src in answers:
        assert "### BEGIN SOLUTION" in src and "### END SOLUTION" in src
    for src, meta in tests:
        assert meta["points"] > 0 and meta["locked"]
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
    # One source of truth: chapters show engine code with inspect.getsource, never a copy.
    code = "\n".join(src for c, src, _ in cells if c["cell_type"] == "code")
    assert not re.search(r"^class \w+\((nn\.Module|torch\.nn\.Module)\)", code, re.M), "engine code pasted"
