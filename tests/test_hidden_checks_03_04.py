"""The hidden checks of chapter 03 pass the notebook's own answers and catch plausible
wrong ones (each wrong answer is the reference answer with one mistake the chapter warns about).
Chapter 04's exercises are regions of course_lib, graded by practice/hidden/chapters/ch04/."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "practice" / "hidden"))

from chapters.ch03_checkpoint_vs_kernel_format import check_layerwise_peak, check_requantize_in_place  # noqa: E402

CH03 = "03_checkpoint_vs_kernel_format.ipynb"


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


REQUANT = cell_source(CH03, "requantize")
REQUANT_WRONG = {
    "rebinds the kernel tensors": ("layer.qweight.copy_(torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))",
                                   "layer.qweight = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)"),
    "copies floats into int8": ("layer.qweight.copy_(torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))",
                                "layer.qweight.copy_(w)"),
    "leaves the old scales": ("    layer.weight_scale.copy_(scale)\n", ""),
    "zero rows get scale 0": ("torch.where(amax > 0, amax / 127, torch.ones_like(amax))", "amax / 127"),
    "rounds halves away from zero": ("torch.round(w / scale[:, None])",
                                     "(torch.sign(w / scale[:, None]) * torch.floor((w / scale[:, None]).abs() + 0.5))"),
}


def test_requantize_reference_passes():
    assert check_requantize_in_place(define(REQUANT, "requantize")) == []


@pytest.mark.parametrize("mistake", list(REQUANT_WRONG))
def test_requantize_wrong_answers_fail(mistake):
    assert check_requantize_in_place(define(REQUANT, "requantize", REQUANT_WRONG[mistake])), mistake


PEAK = cell_source(CH03, "layerwise_peak_bytes")
PEAK_WRONG = {
    "forgets the staging buffers": ("    if quantization is not None:\n", "    if False:\n"),
    "forgets the embedding": ("return max(decoder, v * h * per_value)", "return decoder"),
    "stages in the checkpoint dtype": ("decoder += linear * 4", "decoder += linear * per_value"),
}


def test_layerwise_peak_reference_passes():
    assert check_layerwise_peak(define(PEAK, "layerwise_peak_bytes")) == []


@pytest.mark.parametrize("mistake", list(PEAK_WRONG))
def test_layerwise_peak_wrong_answers_fail(mistake):
    # Several random draws: a mistake may not show on every config (e.g. float32 checkpoints only).
    assert any(check_layerwise_peak(define(PEAK, "layerwise_peak_bytes", PEAK_WRONG[mistake]), seed=s)
               for s in range(4)), mistake
