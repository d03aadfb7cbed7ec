"""The hidden checks of chapter 08 pass the notebook's answers and catch plausible wrong ones."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "practice" / "hidden"))

from chapters.ch08_hot_updates_in_an_rl_loop import check_choose_pause_mode, check_token_weights  # noqa: E402


def solution(name: str):
    nb = json.loads((REPO / "notebooks" / "08_hot_updates_in_an_rl_loop.ipynb").read_text())
    for cell in nb["cells"]:
        src = "".join(cell["source"])
        if cell.get("metadata", {}).get("nbgrader", {}).get("solution") and f"def {name}(" in src:
            namespace: dict = {"torch": torch}  # imported by an earlier cell of the chapter
            exec(compile(src, f"<{name}>", "exec"), namespace)
            return namespace[name]
    raise LookupError(f"chapter 08 has no solution cell defining {name}")


def test_choose_pause_mode():
    assert check_choose_pause_mode(solution("choose_pause_mode")) == []
    assert check_choose_pause_mode(lambda needs: "keep"), "always 'keep' must fail"


def test_token_weights():
    reference = solution("token_weights")
    assert check_token_weights(reference) == []

    def ignores_versions(spans, current, logp_now, logp_by_version, clip):
        return torch.ones_like(logp_now)  # treats stale tokens as fresh
    assert check_token_weights(ignores_versions), "weights that ignore versions must fail"
