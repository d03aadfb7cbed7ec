"""Bounded history: everything the engine records per step, per update or per pause is a
ring buffer of documented size (history.py), so a server that runs for days keeps a
flat memory. The soak that measures it over a real server is test_memory_soak.py."""
import pytest
import torch

from course_lib import Engine
from course_lib.engine import engine as engine_module
from course_lib.engine import pause as pause_module
from course_lib.update import updater as updater_module
from course_lib.history import PAUSE_STATS_SIZE, STEP_LOG_SIZE, UPDATE_HISTORY_SIZE, History


def test_history_keeps_the_newest_and_counts_all():
    log = History(3)
    for k in range(5):
        log.append({"k": k})
    assert len(log) == 3 and log.total == 5 and log.maxlen == 3
    assert log[-1] == {"k": 4} and log[0] == {"k": 2} and log[-2:] == [{"k": 3}, {"k": 4}]
    assert log.since(3) == [{"k": 3}, {"k": 4}] and log.since(5) == [] and log.since(0) == log[:]
    with pytest.raises(ValueError, match="maxlen"):
        History(0)


def test_the_engine_logs_are_rings_of_the_documented_sizes(make_ckpt):
    engine = Engine(make_ckpt("tiny", seed=98))
    assert engine.step_log.maxlen == STEP_LOG_SIZE
    assert engine.update_history.maxlen == UPDATE_HISTORY_SIZE
    assert engine.pause_stats.maxlen == PAUSE_STATS_SIZE


def test_steps_updates_and_pauses_past_the_sizes_stay_bounded(make_ckpt, monkeypatch):
    """Small sizes, many more steps, updates and pauses: each log holds only the newest."""
    monkeypatch.setattr(engine_module, "STEP_LOG_SIZE", 8)
    monkeypatch.setattr(updater_module, "UPDATE_HISTORY_SIZE", 5)
    monkeypatch.setattr(pause_module, "PAUSE_STATS_SIZE", 6)
    engine = Engine(make_ckpt("tiny", seed=98))
    norm = engine.get_weights_by_name("model.norm.weight")
    for k in range(20):
        engine.generate("bounded", {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True})
        engine.pause_generation("abort")
        engine.update_weights_from_tensor([("model.norm.weight", norm + k)], weight_version=f"v{k}")
        engine.continue_generation()
    assert len(engine.step_log) == 8 and engine.step_log.total == engine.num_steps == 60
    assert len(engine.update_history) == 5 and engine.update_history.total == 20
    assert engine.update_history[-1].weight_version == "v19"
    assert len(engine.pause_stats) == 6 and engine.pause_stats.total == 20
    assert torch.equal(engine.get_weights_by_name("model.norm.weight"), norm + 19)
