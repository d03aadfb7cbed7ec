"""course_lib.production: rollback from the snapshot (bitwise, no disk read), the canary
(catches a corrupted layer and a wrong checkpoint, passes an identical one, through an
engine or a server), the promote-or-rollback policy, and monitoring across a change."""
import shutil

import pytest
import torch

from course_lib import Engine
from course_lib import production as prod
from course_lib.layers.quant import kernel_tensors
from course_lib.testing import assert_addresses_unchanged, assert_hot_equals_cold
from course_lib.weights.checkpoint import reader as checkpoint
from course_lib.weights.checkpoint import CheckpointReader, write_checkpoint

PROMPTS = ["canary one", "a second fixed request", "three", "the fourth request of the set"]
LAYER = "model.layers.1.mlp.down_proj.weight"


def corrupted_copy(src, dst, name=LAYER, seed=0):
    """``src`` with one tensor replaced by noise of the same scale (a bad shard, a bad merge)."""
    reader = CheckpointReader(src)
    tensors = dict(reader.iter_tensors())
    gen = torch.Generator().manual_seed(seed)
    tensors[name] = torch.randn(tensors[name].shape, generator=gen) * tensors[name].std()
    return write_checkpoint(dst, reader.config, tensors)


def weights(engine) -> dict:
    return {n: t.detach().clone() for n, t in kernel_tensors(engine.model).items()}


@pytest.fixture(scope="module")
def ckpts(make_ckpt, tmp_path_factory):
    old, new, other = make_ckpt("tiny", seed=71), make_ckpt("tiny", seed=72), make_ckpt("tiny", seed=73)
    bad = corrupted_copy(new, tmp_path_factory.mktemp("bad"))
    return {"old": old, "new": new, "other": other, "bad": bad}


# ---- comparison --------------------------------------------------------------------------
def test_first_divergence_and_compare_outputs():
    assert prod.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert prod.first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert prod.first_divergence([1, 2, 3], [1, 2]) == 2  # stopped early: diverges where it ended
    assert prod.first_divergence([], [5]) == 0
    got = prod.compare_outputs([[1, 2, 3, 4], [5, 6], [7]], [[1, 2, 0, 4], [5, 6], [8]])
    assert got["first_divergence"] == [2, None, 0]
    assert got["agreement"] == pytest.approx(1 / 3)
    assert got["matched_fraction"] == pytest.approx((0.5 + 1 + 0) / 3)
    with pytest.raises(ValueError):
        prod.compare_outputs([[1]], [])


def test_canary_passes_an_identical_copy(ckpts, tmp_path):
    copy = shutil.copytree(ckpts["new"], tmp_path / "copy")
    report = prod.canary_compare(Engine(ckpts["new"]), Engine(copy), PROMPTS, max_new_tokens=12)
    assert report.vs_old["agreement"] == 1.0 and report.vs_old["first_divergence"] == [None] * len(PROMPTS)
    assert all(len(o) == 12 for o in report.new)


@pytest.mark.parametrize("which", ["bad", "other"])
def test_canary_catches_a_corrupted_layer_and_a_wrong_checkpoint(ckpts, which):
    reference = prod.greedy_outputs(Engine(ckpts["new"]), PROMPTS, 12)
    report = prod.canary_compare(Engine(ckpts["old"]), Engine(ckpts[which]), PROMPTS, reference=reference,
                                 max_new_tokens=12)
    assert report.vs_reference["agreement"] < 0.5, report.lines()
    firsts = report.vs_reference["first_divergence"]
    assert all(f is None or 0 <= f < 12 for f in firsts) and any(f is not None for f in firsts)
    assert report.reference == reference and len(report.lines()) == len(PROMPTS)


def test_canary_through_a_running_server(ckpts):
    pytest.importorskip("fastapi")
    from course_lib.server.client import EngineClient
    from course_lib.server.runner import BackgroundServer

    with BackgroundServer(Engine(ckpts["old"]), allow_weight_update=True) as server, \
            EngineClient(server.url) as client:
        same = prod.canary_compare(Engine(ckpts["old"]), client, PROMPTS, max_new_tokens=10)
        assert same.vs_old["agreement"] == 1.0
        client.update_weights_from_disk(ckpts["bad"], weight_version="bad")
        changed = prod.canary_compare(same.old, client, PROMPTS, max_new_tokens=10)
        assert changed.vs_old["agreement"] < 0.5 and changed.old == same.old


# ---- rollback and the policy ---------------------------------------------------------------
def test_rollback_restores_bitwise_without_reading_disk(ckpts, tmp_path, monkeypatch):
    served_from = shutil.copytree(ckpts["old"], tmp_path / "old")  # the only copy the engine knows
    engine = Engine(served_from)
    before = weights(engine)
    engine.update_weights_from_disk(ckpts["new"], weight_version="v2", keep_snapshot=True)
    assert not torch.equal(before[next(iter(before))], kernel_tensors(engine.model)[next(iter(before))])
    shutil.rmtree(served_from)

    def no_disk(*args, **kwargs):
        raise AssertionError("rollback read a checkpoint")
    monkeypatch.setattr(checkpoint.CheckpointReader, "__init__", no_disk)
    monkeypatch.setattr(checkpoint, "safe_open", no_disk)
    result = engine.rollback()
    monkeypatch.undo()

    after = weights(engine)
    assert result["success"] and engine.weight_version == "default"
    assert all(torch.equal(before[n], after[n]) for n in before), "rollback is bitwise the old weights"
    assert_addresses_unchanged(engine)
    assert_hot_equals_cold(engine, ckpts["old"], PROMPTS)


def test_policy_rolls_back_a_bad_version_and_promotes_a_good_one(ckpts):
    engine = Engine(ckpts["old"])
    before = weights(engine)
    reference = prod.greedy_outputs(Engine(ckpts["new"]), PROMPTS, 12)  # what v2 must answer

    bad = prod.promote_or_rollback(engine, ckpts["bad"], PROMPTS, reference, weight_version="v2", max_new_tokens=12)
    assert bad["decision"] == "rolled_back" and bad["agreement"] < 0.5 and bad["rollback"]["success"]
    assert engine.weight_version == "default" and not engine.paused
    assert all(torch.equal(before[n], t) for n, t in weights(engine).items())
    assert_hot_equals_cold(engine, ckpts["old"], PROMPTS)

    good = prod.promote_or_rollback(engine, ckpts["new"], PROMPTS, reference, weight_version="v2", max_new_tokens=12)
    assert good["decision"] == "promoted" and good["agreement"] == 1.0 and good["rollback"] is None
    assert engine.weight_version == "v2" and engine.snapshot is not None  # kept for a later rollback
    assert_hot_equals_cold(engine, ckpts["new"], PROMPTS)


def test_policy_rolls_back_on_quality_alone(ckpts):
    engine = Engine(ckpts["old"])
    reference = prod.greedy_outputs(Engine(ckpts["new"]), PROMPTS, 8)
    eval_set = [list(p.encode()) + r for p, r in zip(PROMPTS, reference)]
    right = prod.mean_nll(Engine(ckpts["new"]), eval_set)
    assert right < prod.mean_nll(Engine(ckpts["bad"]), eval_set)
    # The canary set agrees; the evaluation set must too, within 1% of the intended version.
    got = prod.promote_or_rollback(engine, ckpts["new"], PROMPTS, reference, weight_version="v2", max_new_tokens=8,
                                   quality=lambda e: -prod.mean_nll(e, eval_set), min_quality=-right * 1.01)
    assert got["decision"] == "promoted" and got["quality"] == pytest.approx(-right)
    strict = prod.promote_or_rollback(engine, ckpts["new"], PROMPTS, reference, weight_version="v3",
                                      max_new_tokens=8, quality=lambda e: -prod.mean_nll(e, eval_set),
                                      min_quality=-right * 0.5)
    assert strict["decision"] == "rolled_back" and strict["agreement"] == 1.0
    assert "quality" in strict["reasons"][0] and engine.weight_version == "v2"


def test_policy_rejects_a_checkpoint_that_does_not_fit(ckpts, make_ckpt):
    engine = Engine(ckpts["old"])
    before = weights(engine)
    wrong = make_ckpt("tiny", seed=74, hidden_size=32, head_dim=8)
    got = prod.promote_or_rollback(engine, wrong, PROMPTS, prod.greedy_outputs(engine, PROMPTS), "v2")
    assert got["decision"] == "rejected" and "refused" in got["reasons"][0] and got["update"] is None
    assert not engine.paused and engine.weight_version == "default"
    assert all(torch.equal(before[n], t) for n, t in weights(engine).items())


# ---- monitoring ----------------------------------------------------------------------------
def test_monitor_records_across_a_version_change(ckpts):
    engine = Engine(ckpts["old"])
    monitor = prod.Monitor()
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    for _ in range(3):
        monitor.run(engine, PROMPTS, params)
    monitor.mark("update to v2")
    engine.update_weights_from_disk(ckpts["new"], weight_version="v2")
    for _ in range(3):
        monitor.run(engine, PROMPTS, dict(params, max_new_tokens=2))  # a version that answers far shorter
    stats = monitor.by_version()
    assert list(stats) == ["default", "v2"] and stats["default"]["requests"] == 3 * len(PROMPTS)
    assert stats["default"]["mean_length"] == 6 and stats["v2"]["mean_length"] == 2
    assert all(s["latency_p50_ms"] > 0 and s["tokens_per_s"] > 0 for s in stats.values())
    assert [b["version"] for b in monitor.batches] == ["default"] * 3 + ["v2"] * 3
    assert monitor.anomalies("default", "default") == []
    reasons = monitor.anomalies("default", "v2", max_latency_ratio=1e9, min_throughput_ratio=0)
    assert len(reasons) == 1 and "output length" in reasons[0]
    with pytest.raises(KeyError):
        monitor.anomalies("default", "v9")
    fig = monitor.plot()
    assert len(fig.axes) == 3
    import matplotlib.pyplot as plt
    plt.close(fig)
