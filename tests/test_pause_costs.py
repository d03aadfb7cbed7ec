"""The pause-mode cost model and the handbook's illustration, derived from its parameters."""
import random

import numpy as np
import pytest
import torch

from course_lib.sim.pause_costs import MODES, handbook_load, handbook_scenario, pause_costs

DONE, LEFT = [10, 0, 30], [5, 7, 0]


def test_each_mode_on_a_small_load():
    assert pause_costs("abort", DONE, LEFT, 100, 20) == {"wait_s": 0.0, "redecode": 40, "reprefill": 300,
                                                        "mixed": 0, "kv_fresh": True}
    assert pause_costs("wait", DONE, LEFT, 100, 20) == {"wait_s": 0.14, "redecode": 0, "reprefill": 0,
                                                       "mixed": 0, "kv_fresh": True}
    # Only the first request has started and not finished.
    assert pause_costs("keep", DONE, LEFT, 100, 20)["mixed"] == 1
    assert pause_costs("keep", DONE, LEFT, 100, 20)["kv_fresh"] is False
    assert pause_costs("retract", DONE, LEFT, 100, 20) == {"wait_s": 0.0, "redecode": 0, "reprefill": 340,
                                                          "mixed": 1, "kv_fresh": True}


@pytest.mark.parametrize("convert", [list, np.array, torch.tensor])
def test_accepts_lists_numpy_and_torch(convert):
    assert pause_costs("retract", convert(DONE), convert(LEFT), 100, 20)["reprefill"] == 340


def test_bad_input():
    with pytest.raises(ValueError, match="unknown pause mode"):
        pause_costs("pause", DONE, LEFT, 100, 20)
    with pytest.raises(ValueError, match="requests"):
        pause_costs("wait", [1, 2], [1], 100, 20)


def test_handbook_scenario_follows_from_its_parameters():
    rng = random.Random(0)  # the stated draw order: all of done, then all of left
    done = [rng.randint(1, 4000) for _ in range(64)]
    left = [min(16000, int(rng.lognormvariate(6.5, 1.2))) for _ in range(64)]
    assert handbook_load(0) == (done, left)
    rows = {r["mode"]: r for r in handbook_scenario(0)}
    assert list(rows) == list(MODES)
    assert rows["wait"]["wait_s"] == pytest.approx(max(left) * 0.025)
    assert rows["abort"]["redecode"] == sum(done) and rows["abort"]["reprefill"] == 64 * 2048
    assert rows["retract"]["reprefill"] == 64 * 2048 + sum(done)
    assert rows["keep"]["mixed"] == rows["retract"]["mixed"] == 64
    # Retract re-prefills more tokens than abort re-decodes, but prefill is parallel: the
    # point of the chapter is that decoding them again costs far more time.
    assert handbook_scenario(1) != handbook_scenario(0)
