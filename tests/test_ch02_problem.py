"""Chapter 02's hidden checks: they pass the notebook's reference answers and catch plausible
wrong ones (retract's bill without prefix sharing, without the last-block rule, counting
queued requests; a mode chooser that skips the cost model or misreads its units)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "02_in_flight_requests.ipynb"
HIDDEN = REPO / "practice" / "hidden"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model on a shared 2-core machine: extra threads only wait for each other
    (these checks ran 20x slower with two). Restored for the rest of the session."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def hidden():
    sys.path.insert(0, str(HIDDEN))
    try:
        from chapters import ch02_in_flight_requests as module
    finally:
        sys.path.remove(str(HIDDEN))
        for name in [m for m in sys.modules if m == "chapters" or m.startswith("chapters.")]:
            del sys.modules[name]
    return module


@pytest.fixture(scope="module")
def reference():
    """The answer cells of the source notebook (solutions in place), executed."""
    ns: dict = {"pause_costs": __import__("course_lib.sim.pause_costs", fromlist=["pause_costs"]).pause_costs}
    for cell in json.loads(NOTEBOOK.read_text())["cells"]:
        if cell["metadata"].get("nbgrader", {}).get("solution"):
            exec("".join(cell["source"]), ns)
    return ns


def test_reference_answers_pass(hidden, reference):
    assert hidden.check_retract_bill(reference["retract_bill"]) == []
    assert hidden.check_choose_mode(reference["choose_mode"]) == []


def test_retract_bill_mistakes_are_caught(hidden, reference):
    bill = reference["retract_bill"]

    def no_sharing(requests, block_size):
        running = [r for r in requests if r["running"]]
        return {"retracted": [r["rid"] for r in running], "reprefill_tokens": sum(len(r["token_ids"]) for r in running)}

    def everyone(requests, block_size):
        return bill([dict(r, running=True) for r in requests], block_size)

    def reuses_last_block(requests, block_size):
        running, cached, total = [r for r in requests if r["running"]], set(), 0
        for r in running:
            ids, hit = r["token_ids"], 0
            while hit < len(ids) // block_size and tuple(ids[:(hit + 1) * block_size]) in cached:
                hit += 1
            total += len(ids) - hit * block_size
            cached.update(tuple(ids[:(i + 1) * block_size]) for i in range(len(ids) // block_size))
        return {"retracted": [r["rid"] for r in running], "reprefill_tokens": total}

    def reversed_order(requests, block_size):
        out = bill(requests, block_size)
        return dict(out, retracted=out["retracted"][::-1])

    for wrong in (no_sharing, everyone, reuses_last_block, reversed_order):
        assert hidden.check_retract_bill(wrong), f"{wrong.__name__} must fail"


def test_choose_mode_mistakes_are_caught(hidden, reference):
    choose = reference["choose_mode"]

    def decision_tree(c):  # ignores the cost model: a trajectory that never started can mix nothing
        if c["single_version"]:
            return "wait" if max(c["left"]) * c["step_ms"] / 1000 <= c["max_wait_s"] else "abort"
        return "retract" if c["fresh_kv"] else "keep"

    def budget_in_ms(c):
        return choose(dict(c, max_wait_s=c["max_wait_s"] * 1000))

    def ignores_reprefill(c):
        return choose(dict(c, max_reprefill=float("inf")))

    for wrong in (decision_tree, budget_in_ms, ignores_reprefill):
        assert hidden.check_choose_mode(wrong), f"{wrong.__name__} must fail"
