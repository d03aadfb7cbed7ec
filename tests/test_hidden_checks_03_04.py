"""The hidden checks of chapter 04 pass the notebooks' own answers and catch plausible
wrong ones (each wrong answer is the reference answer with one mistake the chapter warns about)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "practice" / "hidden"))

from chapters.ch04_cuda_graphs_remember_addresses import check_fixed_updater, check_keeps_address  # noqa: E402

CH04 = "04_cuda_graphs_remember_addresses.ipynb"


def cell_source(notebook: str, grade_id: str | None = None, contains: str | None = None) -> str:
    """The source of the cell with this nbgrader grade_id (or the first code cell containing ``contains``)."""
    nb = json.loads((REPO / "notebooks" / notebook).read_text())
    for cell in nb["cells"]:
        src = "".join(cell["source"])
        if grade_id and cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") == grade_id:
            return src
        if contains and cell["cell_type"] == "code" and contains in src:
            return src
    raise LookupError(f"{notebook} has no cell {grade_id or contains!r}")


def define(source: str, name: str, replace: tuple[str, str] | None = None, namespace: dict | None = None):
    """The function ``name`` from ``source``, optionally with one piece of text replaced."""
    if replace is not None:
        assert replace[0] in source, f"the reference answer no longer contains {replace[0]!r}"
        source = source.replace(*replace)
    namespace = {"torch": torch, **(namespace or {})}
    exec(compile(source, f"<{name}>", "exec"), namespace)
    return namespace[name]


FUSED_ROWS = cell_source(CH04, contains="def fused_rows")
LOAD_INTO = cell_source(CH04, "load_into")
LOAD_WRONG = {
    "the buggy original": None,
    "plain parameters still rebound": ("param.data.copy_(tensor)", "param.data = tensor"),
    "fused parameters still rebound": ("param.data.index_copy_(0, fused_rows(model, param_name, shard_id), tensor)",
                                       "param.data = param.data.index_copy(0, fused_rows(model, param_name, shard_id), tensor)"),
}


def load_into(mistake=None):
    helpers: dict = {}
    exec(compile(FUSED_ROWS, "<fused_rows>", "exec"), {"torch": torch, **helpers}, helpers)
    if mistake == "the buggy original":
        return helpers["buggy_load_into"]
    return define(LOAD_INTO, "load_into", LOAD_WRONG.get(mistake), {"fused_rows": helpers["fused_rows"]})


def test_fixed_updater_reference_passes():
    assert check_fixed_updater(load_into()) == []


@pytest.mark.parametrize("mistake", list(LOAD_WRONG))
def test_fixed_updater_wrong_answers_fail(mistake):
    assert any(check_fixed_updater(load_into(mistake), seed=s) for s in range(3)), mistake


KEEPS = cell_source(CH04, "keeps_address")


def test_keeps_address_reference_passes_and_each_flip_fails():
    answers = define(KEEPS, "keeps_address")()
    assert check_keeps_address(answers) == []
    for label in answers:
        flipped = {**answers, label: not answers[label]}
        assert check_keeps_address(flipped), f"flipping snippet {label} must fail"
    assert check_keeps_address({k: v for k, v in answers.items() if k != "E"}), "a missing answer must fail"
