"""The RL loop (course_lib/rl): the reward climbs, every token's version is right, stale
tokens are weighted or dropped, keep's real sampling distribution is reproduced, and after
every kind of sync the engine equals a cold start on the trainer's weights."""
import pytest
import torch

from course_lib import Engine
from course_lib.rl import LoopConfig, Policy, corrections, keep_logits, task, train
from course_lib.rl.loop import one_thread, version_label
from course_lib.testing import assert_hot_equals_cold, prompt_logits
from course_lib.weights.checkpoint import make_random, write_checkpoint

MODES = [None, "keep", "retract", "abort", "wait"]
T, OVERLAP = 8, 3


@pytest.fixture(autouse=True)
def single_thread():
    # Tiny matrices: a thread pool only adds hand-offs (and, on a shared machine, waiting).
    with one_thread():
        yield


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    return task.initial_checkpoint(tmp_path_factory.mktemp("rl-start"), seed=0)


def engine_for(path):
    return Engine(path, block_size=8, max_num_seqs=16)


def test_policy_logits_equal_the_engines(start):
    engine, policy = engine_for(start), Policy.from_checkpoint(start)
    ids = list(b"upper:ABCdef")
    with torch.no_grad():
        ours = policy(torch.tensor([ids]))[0]
    assert torch.equal(ours, prompt_logits(engine, ids)), "the trainer's copy must compute the engine's logits"


def test_reward_climbs(start):
    result = train(engine_for(start), LoopConfig(steps=20, seed=0))
    first, last = sum(result.rewards[:3]) / 3, sum(result.rewards[-3:]) / 3
    assert first < 0.15, f"a near-uniform start scores about 26/272, got {first:.2f}"
    assert last > first + 0.25, f"reward should climb by 0.25 in 20 steps: {first:.2f} -> {last:.2f}"


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m or "synchronous")
def test_every_token_has_the_version_of_its_step(start, mode):
    engine = engine_for(start)
    steps = 4
    result = train(engine, LoopConfig(steps=steps, pause_mode=mode, overlap_tokens=OVERLAP, seed=3))
    engine_steps = {}  # rid -> versions of the engine steps that produced its tokens
    for entry in engine.step_log:
        for rid in entry["rids"]:
            engine_steps.setdefault(rid, []).append(entry["version"])
    assert len(result.rollouts) == steps * 16
    for r in result.rollouts:
        assert len(r.versions) == len(r.output_ids) == T
        assert r.versions == engine_steps[r.rid], "a token's version is that of the engine step that produced it"
        s = r.started_at
        if mode is None or s == 0:
            want = [version_label(s)] * T
        elif mode in ("keep", "retract"):
            want = [version_label(s - 1)] * OVERLAP + [version_label(s)] * (T - OVERLAP)
        elif mode == "wait":
            want = [version_label(s - 1)] * T        # the update waited for them
        else:
            want = [version_label(s)] * T            # abort: sent again after the update
        assert r.versions == want, f"{mode}: rollout submitted in step {s} has versions {r.spans}"
        assert r.trained_at == s, "each batch is trained on in the step after the one that started it"
    if mode == "abort":
        assert len(result.aborted) == (steps - 1) * 16
        assert all(o["meta_info"]["weight_versions"] == [{"version": version_label(s), "start": 0, "end": OVERLAP}]
                   for o, s in zip(result.aborted, sorted(list(range(steps - 1)) * 16)))
    mixed = [r for r in result.rollouts if len(r.spans) > 1]
    assert len(mixed) == (16 * (steps - 1) if mode in ("keep", "retract") else 0)


def test_keep_mixed_tokens_get_importance_weights(start):
    cfg = LoopConfig(steps=4, pause_mode="keep", overlap_tokens=OVERLAP, seed=5, correction="importance", clip=2.0)
    result = train(engine_for(start), cfg)
    mixed = [r for r in result.rollouts if len(r.spans) > 1]
    assert mixed, "keep with overlapping generation must produce mixed-version rollouts"
    for r in result.rollouts:
        w = torch.tensor(r.weights)
        current = version_label(r.trained_at)
        assert torch.isfinite(w).all() and (w >= 0).all() and (w <= cfg.clip).all()
        fresh = torch.tensor([v == current for v in r.versions])
        assert torch.equal(w[fresh], torch.ones(int(fresh.sum()))), "tokens of the trainer's version weigh exactly 1"
        if len(r.spans) > 1:
            assert (w[~fresh] != 1).all(), "stale tokens carry pi_now / pi_then, not 1"


def test_keep_stale_tokens_can_be_dropped(start):
    result = train(engine_for(start), LoopConfig(steps=3, pause_mode="keep", overlap_tokens=OVERLAP, seed=6,
                                                 correction="drop"))
    for r in result.rollouts:
        assert r.weights == [1.0 if v == version_label(r.trained_at) else 0.0 for v in r.versions]


def test_importance_weights_by_hand():
    spans = [{"version": "step-1", "start": 0, "end": 2}, {"version": "step-2", "start": 2, "end": 3}]
    now = torch.log(torch.tensor([0.5, 0.1, 0.3]))
    then = {"step-1": torch.log(torch.tensor([0.25, 0.2, 0.9])), "step-2": now}
    w = corrections.importance(spans, "step-2", now, then, clip=1.5)
    assert torch.allclose(w, torch.tensor([1.5, 0.5, 1.0]))  # 2.0 truncated to 1.5
    assert torch.equal(corrections.importance(spans, "step-2", now, {"step-2": now}, 1.5), torch.tensor([0.0, 0.0, 1.0]))
    with pytest.raises(ValueError, match="unknown correction"):
        corrections.get("ignore")


def test_loop_refuses_a_correction_that_returns_nan(start):
    def bad(spans, current, now, by_version, clip):
        return torch.full_like(now, float("nan"))
    with pytest.raises(ValueError, match="finite"):
        train(engine_for(start), LoopConfig(steps=1, correction=bad))


def test_keep_logits_reproduce_what_the_engine_served(tmp_path):
    """Greedy, so the served token is the argmax: under keep it is the argmax of new weights
    over old KV, which is neither policy's own distribution."""
    old_path, new_path = make_random(tmp_path / "a", "tiny", seed=1), make_random(tmp_path / "b", "tiny", seed=2)
    engine = Engine(old_path)
    prompts = ["keep me", "in place"]
    rids = [engine.add_request(p, {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}) for p in prompts]
    for _ in range(4):
        engine.step()
    engine.pause_generation("keep")
    engine.update_weights_from_disk(new_path, weight_version="new")
    engine.continue_generation()
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o["rid"]: o for o in engine.step()})
    old, new = Policy.from_checkpoint(old_path), Policy.from_checkpoint(new_path)
    for prompt, rid in zip(prompts, rids):
        out = outs[rid]
        assert out["meta_info"]["weight_versions"][0]["end"] == 4
        p, c = task.encode([prompt]), torch.tensor([out["output_ids"]])
        served = keep_logits(old, new, p, c, switch=4)[0]
        assert served.argmax(-1).tolist() == out["output_ids"], "keep_logits must reproduce the engine's choices"
        with torch.no_grad():
            recomputed = new(torch.cat([p, c], 1))[0, p.shape[1] - 1:-1]
        assert torch.allclose(served[:4], old(torch.cat([p, c], 1))[0, p.shape[1] - 1:p.shape[1] + 3].detach(),
                              atol=1e-5)
        assert (served[4:] - recomputed[4:]).abs().max() > 1e-3, "old KV must change what the new weights see"


@pytest.mark.parametrize("transport", ["inprocess", "ipc", "http"])
def test_engine_equals_a_cold_start_on_the_trainers_weights(start, tmp_path, transport):
    from course_lib.rl.sync import HttpSync, IpcSync

    engine = engine_for(start)
    policy = Policy.from_checkpoint(start)
    cfg = LoopConfig(steps=3, seed=2)
    if transport == "http":
        pytest.importorskip("httpx")
        from course_lib.server.runner import BackgroundServer
        with BackgroundServer(engine, allow_weight_update=True) as server:
            result = train(engine, cfg, policy=policy, server=server)
    else:
        sync = IpcSync(engine) if transport == "ipc" else None
        result = train(engine, cfg, policy=policy, sync=sync)
    assert engine.weight_version == version_label(3) == result.syncs[-1]["version"]
    assert all(s["bytes"] > 0 and s["phases_ms"] for s in result.syncs)
    ckpt = write_checkpoint(tmp_path / "trainer", task.POLICY_CONFIG, policy.checkpoint_tensors())
    assert_hot_equals_cold(engine, ckpt, ["upper:", "lower:", "upper:ABC"])
    # and the trainer's weights really moved away from the start
    assert not torch.equal(policy.w("lm_head.weight"), Policy.from_checkpoint(start).w("lm_head.weight"))
