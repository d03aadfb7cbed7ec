"""Public tests for chapter 08's exercises (run them: python practice/judge.py test ch08).

ch08.step_sync: ``InProcessSync.sync`` in course_lib/rl/sync.py.
ch08.token_weights: ``importance`` in course_lib/rl/corrections.py.
Each case reports what it expected in words.
"""
import math

import pytest
import torch

from course_lib import Engine
from course_lib.rl import Policy, task
from course_lib.rl.corrections import importance
from course_lib.rl.sync import InProcessSync
from course_lib.testing import assert_hot_equals_cold
from course_lib.weights.checkpoint import write_checkpoint

SYNC, WEIGHTS = (pytest.mark.exercise(f"ch08.{n}") for n in ("step_sync", "token_weights"))
PARAMS = {"max_new_tokens": 6, "temperature": 1.0, "seed": 7, "ignore_eos": True}


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    return task.initial_checkpoint(tmp_path_factory.mktemp("start"), seed=0)


def trained(path, seed):
    """The trainer's policy, moved away from the start so that a sync changes something."""
    policy = Policy.from_checkpoint(path)
    torch.manual_seed(seed)
    with torch.no_grad():
        for _, t in policy.named_tensors():
            t.add_(0.05 * torch.randn_like(t))
    return policy


def spans(*runs):
    """spans(("step-4", 2), ("step-5", 3)) -> weight_versions spans of 2 then 3 tokens."""
    out, at = [], 0
    for version, n in runs:
        out.append({"version": version, "start": at, "end": at + n})
        at += n
    return out


# ---- ch08.step_sync -----------------------------------------------------------------------

@SYNC
def test_step_sync__an_idle_engine_takes_the_weights_and_the_version(start, tmp_path):
    engine, policy = Engine(start, block_size=8), trained(start, 1)
    out = InProcessSync(engine).sync(policy.named_tensors(), "step-1")
    assert engine.weight_version == "step-1", "the engine serves the new version label after the sync"
    engine_phases = engine.update_history[-1].timings_ms
    assert set(out["phases_ms"]) == {"pause", *engine_phases, "continue"}, \
        f"phases are pause, the engine's own {sorted(engine_phases)}, continue; got {sorted(out['phases_ms'])}"
    assert out["bytes"] == engine.update_history[-1].bytes > 0, "bytes is what the engine took"
    assert not engine.pause_stats or engine.pause_stats[-1].mode == "none", "no pause_mode: no pause"
    ckpt = write_checkpoint(tmp_path / "trainer", task.POLICY_CONFIG, policy.checkpoint_tensors())
    assert_hot_equals_cold(engine, ckpt, ["upper:", "lower:"], max_new_tokens=4)


@SYNC
def test_step_sync__rollouts_in_flight_are_paused_then_go_on(start):
    engine, policy = Engine(start, block_size=8), trained(start, 2)
    engine.update_weight_version("step-0")
    rid = engine.add_request("upper:", PARAMS)
    done = []
    for _ in range(3):
        done += engine.step()
    InProcessSync(engine).sync(policy.named_tensors(), "step-1", pause_mode="keep")
    assert engine.pause_stats[-1].mode == "keep", "the sync paused the engine in the mode it was given"
    assert not engine.paused, "the engine runs again after the sync"
    while engine.has_unfinished_requests():
        done += engine.step()
    out = next(o for o in done if o["rid"] == rid)
    assert [s["version"] for s in out["meta_info"]["weight_versions"]] == ["step-0", "step-1"], \
        "the rollout's first tokens carry the old label, the rest the new one"


@SYNC
def test_step_sync__a_failed_update_leaves_the_engine_running_and_unchanged(start):
    engine = Engine(start, block_size=8)
    engine.update_weight_version("step-0")
    engine.add_request("lower:", PARAMS)
    engine.step()
    bad = [(n, t.reshape(-1) if n.endswith("o_proj.weight") else t) for n, t in trained(start, 3).named_tensors()]
    with pytest.raises(ValueError, match="o_proj"):
        InProcessSync(engine).sync(bad, "step-1", pause_mode="retract")
    assert not engine.paused, "after a failed update the sync still continues generation"
    assert engine.weight_version == "step-0", "a refused update keeps the old version label"


@SYNC
def test_step_sync__a_bad_version_label_is_refused_before_pausing(start):
    engine = Engine(start, block_size=8)
    engine.add_request("upper:", PARAMS)
    engine.step()
    for label in ["", 3, None]:
        with pytest.raises(ValueError):
            InProcessSync(engine).sync(trained(start, 4).named_tensors(), label, pause_mode="abort")
    assert not engine.paused and not engine.pause_stats, "a refused sync never touched the engine"


# ---- ch08.token_weights -------------------------------------------------------------------

@WEIGHTS
def test_token_weights__stale_tokens_get_truncated_ratios_fresh_ones_get_1():
    now = torch.log(torch.tensor([0.5, 0.1, 0.3, 0.3]))
    then = {"step-4": torch.log(torch.tensor([0.25, 0.2, 0.9, 0.9])), "step-5": now}
    w = torch.as_tensor(importance(spans(("step-4", 2), ("step-5", 2)), "step-5", now, then, 1.5))
    assert torch.allclose(w, torch.tensor([1.5, 0.5, 1.0, 1.0])), \
        f"expected [1.5 (2.0 truncated), 0.5 (below 1: unchanged), 1, 1], got {w.tolist()}"


@WEIGHTS
def test_token_weights__a_version_no_longer_held_weighs_0():
    now = torch.log(torch.tensor([0.5, 0.1, 0.3]))
    w = torch.as_tensor(importance(spans(("step-1", 1), ("step-2", 2)), "step-2", now, {"step-2": now}, 2.0))
    assert torch.equal(w, torch.tensor([0.0, 1.0, 1.0])), f"expected [0, 1, 1], got {w.tolist()}"


@WEIGHTS
def test_token_weights__labels_are_compared_for_equality_only():
    now = torch.log(torch.tensor([0.4, 0.4]))
    then = {"step-9": torch.log(torch.tensor([0.8, 0.8])), "step-10": now}
    w = torch.as_tensor(importance(spans(("step-9", 1), ("step-10", 1)), "step-10", now, then, 2.0))
    assert torch.allclose(w, torch.tensor([0.5, 1.0])), f"step-9 is stale at step-10: expected [0.5, 1], got {w.tolist()}"


@WEIGHTS
def test_token_weights__a_nan_log_prob_weighs_0_and_an_infinite_ratio_is_truncated():
    now = torch.log(torch.tensor([0.5, 0.5, 0.5]))
    then = torch.tensor([float("nan"), float("-inf"), math.log(0.25)])
    w = torch.as_tensor(importance(spans(("step-1", 3)), "step-2", now, {"step-1": then, "step-2": now}, 2.0))
    assert torch.equal(w, torch.tensor([0.0, 2.0, 2.0])), f"expected [0 (NaN), 2 (inf, truncated), 2], got {w.tolist()}"


@WEIGHTS
def test_token_weights__no_tokens_and_bad_spans():
    assert importance([], "step-1", torch.zeros(0), {}, 2.0).numel() == 0, "no spans, no tokens: no weights"
    now = torch.zeros(4)
    for bad in [spans(("step-1", 2), ("step-2", 1)),                                # covers 3 of 4 tokens
                [{"version": "step-1", "start": 0, "end": 2}, {"version": "step-2", "start": 3, "end": 4}]]:
        with pytest.raises(ValueError):
            importance(bad, "step-2", now, {"step-2": now}, 2.0)
    with pytest.raises(ValueError):
        importance(spans(("step-1", 4)), "step-1", now, {"step-1": now}, 0.0)
