"""Hidden tests for chapter 08: the per-step sync and the token weights inside the real RL loop.

Fresh random checkpoints, seeds, pause modes, overlaps, labels and log-probabilities each
run (the seed is in every message). What the sync did is read from the engine itself
(its version label, its pause records, its update history, whether it is paused) and from
the tokens it served, never from figures the learner's code returns alone; the weights
are compared with values worked out here, token by token. The sync's own figures ("pause"
and "continue", in ms) are checked against monotonic clocks this test moves by a known
amount inside each engine call (``SteppedClocks``): what a figure includes and its unit,
never how long anything really took.
"""
import math
import random
import time

import pytest
import torch

from course_lib import Engine
from course_lib.rl import LoopConfig, Policy, task, train
from course_lib.rl.corrections import importance
from course_lib.rl.loop import one_thread, version_label
from course_lib.rl.sync import InProcessSync, IpcSync
from course_lib.testing import assert_hot_equals_cold
from course_lib.weights.checkpoint import write_checkpoint
from conftest import hidden_seed  # the judge's plugin: a fixed seed, so a grade repeats

SYNC, WEIGHTS = (pytest.mark.exercise(f"ch08.{n}") for n in ("step_sync", "token_weights"))
MODES = ["keep", "retract", "abort", "wait"]


@pytest.fixture
def rng():
    seed = hidden_seed()
    return random.Random(seed), f"seed {seed}"


@pytest.fixture(autouse=True)
def single_thread():
    with one_thread():
        yield


def start_checkpoint(tmp_path, r):
    return task.initial_checkpoint(tmp_path / "start", seed=r.randrange(10_000))


def moved_policy(path, r):
    """A trainer's policy some way from ``path``'s weights, so that a sync changes tokens."""
    policy = Policy.from_checkpoint(path)
    g = torch.Generator().manual_seed(r.randrange(2 ** 31))
    with torch.no_grad():
        for _, t in policy.named_tensors():
            t.add_(0.05 * torch.randn(t.shape, generator=g))
    return policy


def in_flight(engine, r, n=None):
    """Submit a few requests and run some steps, so that a pause finds them mid-generation."""
    rids = [engine.add_request(r.choice(task.PROMPTS), {"max_new_tokens": r.randint(5, 8), "temperature": 1.0,
                                                        "seed": r.randrange(2 ** 31), "ignore_eos": True})
            for _ in range(n or r.randint(2, 5))]
    done = []
    for _ in range(r.randint(1, 3)):
        done += engine.step()
    return rids, done


def finish(engine, done):
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        done += engine.step()
    return {o["rid"]: o for o in done}


# ---- ch08.step_sync -----------------------------------------------------------------------

@SYNC
def test_the_loop_syncs_every_step_in_a_random_pause_mode(tmp_path, rng):
    r, seed = rng
    path = start_checkpoint(tmp_path, r)
    mode, steps, overlap = r.choice(MODES), r.randint(2, 3), r.randint(1, 5)
    engine, policy = Engine(path, block_size=8, max_num_seqs=16), Policy.from_checkpoint(path)
    cfg = LoopConfig(steps=steps, pause_mode=mode, overlap_tokens=overlap, seed=r.randrange(10_000), group_size=4)
    result = train(engine, cfg, policy=policy)
    what = f"{seed}: {mode}, {steps} steps, overlap {overlap}"
    assert not engine.paused, f"{what}: the engine is still paused after the loop"
    assert engine.weight_version == version_label(steps), f"{what}: the engine serves {engine.weight_version!r}"
    modes = [p.mode for p in engine.pause_stats if p.mode != "none"]
    assert modes == [mode] * (steps - 1), f"{what}: the engine recorded pauses {modes} (the last sync is idle)"
    history = list(engine.update_history)[-steps:]
    for step, (s, h) in enumerate(zip(result.syncs, history)):
        inside = {k: v for k, v in s["phases_ms"].items() if k not in ("pause", "continue", "step", "version")}
        assert inside == h.timings_ms, f"{what}: sync {step} reports {inside}, the engine measured {h.timings_ms}"
        assert s["bytes"] == h.bytes, f"{what}: sync {step} reports {s['bytes']} bytes, the engine took {h.bytes}"
        assert {"pause", "continue"} <= set(s["phases_ms"]), f"{what}: pause and continue are timed"
    for ro in result.rollouts:  # each token names the version the engine served it with
        assert set(ro.versions) <= {version_label(ro.started_at - 1), version_label(ro.started_at)}, \
            f"{what}: a rollout started at step {ro.started_at} holds versions {sorted(set(ro.versions))}"
    ckpt = write_checkpoint(tmp_path / "trainer", task.POLICY_CONFIG, policy.checkpoint_tensors())
    assert_hot_equals_cold(engine, ckpt, task.PROMPTS, max_new_tokens=4)


def broken(named, r, kind):
    named = list(named)
    i = r.randrange(len(named))
    name, t = named[i]
    if kind == "shape":
        named[i] = (name, t.reshape(-1) if t.dim() > 1 else t[:-1])
    elif kind == "name":
        named.insert(i, ("model.layers.7.mlp.up_proj.weight", t))
    else:
        named[i] = (name, torch.zeros(t.shape, dtype=torch.int32))
    return named


@SYNC
@pytest.mark.parametrize("mode", MODES + [None])
def test_a_failed_update_still_continues_and_changes_nothing(tmp_path, rng, mode):
    r, seed = rng
    path = start_checkpoint(tmp_path, r)
    engine, policy = Engine(path, block_size=8, max_num_seqs=8), moved_policy(path, r)
    engine.update_weight_version("step-0")
    rids, done = in_flight(engine, r) if mode is not None else ([], [])
    kind = r.choice(["shape", "name", "dtype"])
    what = f"{seed}: pause {mode}, a bad tensor ({kind})"
    sync = InProcessSync(engine)
    with pytest.raises(Exception):
        sync.sync(broken(policy.named_tensors(), r, kind), "step-1", pause_mode=mode)
    assert not engine.paused, f"{what}: the failed sync left the engine paused"
    assert engine.weight_version == "step-0", f"{what}: a failed update changed the label to {engine.weight_version!r}"
    sync.sync(policy.named_tensors(), "step-1", pause_mode=mode)  # the next sync works
    assert not engine.paused and engine.weight_version == "step-1", f"{what}: the sync after it failed"
    recorded = [p.mode for p in engine.pause_stats]
    if mode is None:
        assert set(recorded) <= {"none"}, f"{what}: no pause mode was given, yet the engine recorded pauses {recorded}"
    else:
        assert recorded[-2:] == [mode, mode], f"{what}: the engine recorded pauses {recorded}, not two in {mode}"
    outs = finish(engine, done)
    assert set(rids) <= set(outs), f"{what}: requests in flight never finished"
    ckpt = write_checkpoint(tmp_path / "trainer", task.POLICY_CONFIG, policy.checkpoint_tensors())
    assert_hot_equals_cold(engine, ckpt, task.PROMPTS, max_new_tokens=4)


@SYNC
def test_a_bad_label_or_mode_is_refused_before_the_engine_is_touched(tmp_path, rng):
    r, seed = rng
    path = start_checkpoint(tmp_path, r)
    engine, policy = Engine(path, block_size=8), moved_policy(path, r)
    in_flight(engine, r)
    for label in r.sample(["", None, 5, b"step-1", ["step-1"]], 3):
        with pytest.raises(ValueError):
            InProcessSync(engine).sync(policy.named_tensors(), label, pause_mode=r.choice(MODES))
        assert not engine.paused and not engine.pause_stats, f"{seed}: label {label!r} refused after touching the engine"
    with pytest.raises(ValueError):
        InProcessSync(engine).sync(policy.named_tensors(), "step-1", pause_mode="freeze")
    assert not engine.paused and engine.weight_version == "default", f"{seed}: an unknown mode changed the engine"


@SYNC
def test_the_mode_decides_what_the_rollouts_in_flight_become(tmp_path, rng):
    r, seed = rng
    path = start_checkpoint(tmp_path, r)
    mode = r.choice(MODES)
    engine, policy = Engine(path, block_size=8), moved_policy(path, r)
    engine.update_weight_version("old")
    rids, done = in_flight(engine, r, n=3)
    InProcessSync(engine).sync(policy.named_tensors(), "new", pause_mode=mode)
    outs = finish(engine, done)
    for rid in rids:
        o = outs[rid]
        labels = [s["version"] for s in o["meta_info"]["weight_versions"]]
        if mode == "abort":
            assert o["meta_info"]["finish_reason"]["type"] == "abort" or labels == ["old"], \
                f"{seed}: abort: a request in flight ended with versions {labels}"
        elif mode == "wait":
            assert labels == ["old"], f"{seed}: wait: the update waits for requests in flight, got {labels}"
        else:
            assert labels in (["old", "new"], ["old"]), f"{seed}: {mode}: expected old then new tokens, got {labels}"
    assert engine.pause_stats[-1].mode == mode, f"{seed}: the engine recorded {engine.pause_stats[-1].mode}"


@SYNC
def test_ipc_buckets_go_through_the_same_sync(tmp_path, rng):
    r, seed = rng
    path = start_checkpoint(tmp_path, r)
    engine, policy = Engine(path, block_size=8), moved_policy(path, r)
    in_flight(engine, r)
    out = IpcSync(engine, bucket_bytes=r.choice([4 << 10, 16 << 10])).sync(policy.named_tensors(), "step-1", "keep")
    assert not engine.paused and engine.weight_version == "step-1", f"{seed}: IPC sync did not finish"
    assert out["bytes"] == sum(t.numel() * t.element_size() for _, t in policy.named_tensors()), \
        f"{seed}: the IPC sync reports {out['bytes']} bytes"
    ckpt = write_checkpoint(tmp_path / "trainer", task.POLICY_CONFIG, policy.checkpoint_tensors())
    finish(engine, [])
    assert_hot_equals_cold(engine, ckpt, task.PROMPTS, max_new_tokens=4)


class SteppedClocks:
    """The time module's monotonic clocks (``perf_counter``, ``monotonic`` and their ``_ns``
    forms), each running as usual plus an offset that only this test moves forward. The
    wall clock (``time.time``) is left as it is. An engine call wrapped by ``spend`` moves
    the clocks by a known amount once it has done its work (its own timings are taken
    inside the call and stay as they were), so a figure the sync reports can be checked
    against what it must include and exclude, whatever the machine's speed."""

    NAMES = ("perf_counter", "monotonic", "perf_counter_ns", "monotonic_ns")

    def __init__(self, monkeypatch):
        self.offset = 0.0
        for name in self.NAMES:
            real = getattr(time, name)
            if name.endswith("_ns"):
                monkeypatch.setattr(time, name, lambda real=real: real() + int(self.offset * 1e9))
            else:
                monkeypatch.setattr(time, name, lambda real=real: real() + self.offset)

    def spend(self, engine, method: str, seconds: float, log: list):
        original = getattr(engine, method)

        def costs_a_known_time(*args, **kwargs):
            try:
                return original(*args, **kwargs)
            finally:
                self.offset += seconds
                log.append((method, seconds))
        setattr(engine, method, costs_a_known_time)  # the instance's attribute: the sync's calls go through it


# Seconds each engine call moves the monotonic clocks. Every one is far longer than anything this
# test really runs for (its time limit is minutes), so a figure that includes one call's seconds
# cannot be mistaken for one that does not, and a figure in seconds is 1000 times too small.
PAUSE_S, UPDATE_S, CONTINUE_S = 2.0e5, 7.0e5, 3.0e5
REAL_BOUND_S = 1.0e5  # what the real work of a phase adds stays far below this


@SYNC
@pytest.mark.parametrize("transport,mode", [("inprocess", None), ("inprocess", "drawn"), ("ipc", "drawn")])
def test_pause_and_continue_are_milliseconds_of_their_own_calls_on_a_monotonic_clock(tmp_path, rng, monkeypatch,
                                                                                      transport, mode):
    """The contract: "pause" and "continue" are the milliseconds the pause and the resume took,
    on a monotonic clock; the update's time is the engine's phases, in neither of them."""
    r, seed = rng
    if mode == "drawn":
        mode = r.choice(MODES)
    path = start_checkpoint(tmp_path, r)
    engine, policy = Engine(path, block_size=8, max_num_seqs=8), moved_policy(path, r)
    rids, done = in_flight(engine, r) if mode is not None else ([], [])
    clocks, calls = SteppedClocks(monkeypatch), []
    clocks.spend(engine, "pause_generation", PAUSE_S, calls)
    clocks.spend(engine, "update_weights_from_tensor", UPDATE_S, calls)
    clocks.spend(engine, "continue_generation", CONTINUE_S, calls)
    sync = InProcessSync(engine) if transport == "inprocess" else IpcSync(engine, bucket_bytes=r.choice([4 << 10,
                                                                                                      16 << 10]))
    out = sync.sync(policy.named_tensors(), "step-1", pause_mode=mode)
    monkeypatch.undo()
    what = f"{seed}: {transport} sync, pause mode {mode}"
    assert engine.weight_version == "step-1" and not engine.paused, f"{what}: the sync did not finish"
    updates = sum(1 for m, _ in calls if m == "update_weights_from_tensor")
    assert updates >= 1, f"{what}: the update never reached the engine's update_weights_from_tensor"
    phases = out["phases_ms"]
    for phase, own in (("pause", PAUSE_S if mode is not None else 0.0),
                       ("continue", CONTINUE_S if mode is not None else 0.0)):
        assert phase in phases, f"{what}: no {phase!r} in phases_ms {sorted(phases)}"
        got = phases[phase]
        if own:
            told = (f"the engine's {phase} call took {own:.0f} s on the monotonic clocks (this test moved them; "
                    f"time.time was left alone), so {phase!r} must be {own * 1e3:.0f} ms plus the real time of "
                    f"the call, and include none of the {updates} update call(s) of {UPDATE_S:.0f} s each")
        else:
            told = (f"without a pause mode nothing is paused or resumed: {phase!r} is about 0 ms and includes "
                    f"none of the {updates} update call(s) of {UPDATE_S:.0f} s each (monotonic clocks)")
        assert isinstance(got, (int, float)) and own * 1e3 <= got < (own + REAL_BOUND_S) * 1e3, \
            f"{what}: {told}; got {got!r} ms"
    if transport == "inprocess":  # one engine call: its timings are the phases between pause and continue
        inside = {k: v for k, v in phases.items() if k not in ("pause", "continue")}
        assert inside == engine.update_history[-1].timings_ms, \
            f"{what}: the phases between pause and continue are the engine's own timings_ms " \
            f"{engine.update_history[-1].timings_ms}, got {inside}"
    if mode is not None:
        assert set(rids) <= set(finish(engine, done)), f"{what}: requests in flight never finished"


# ---- ch08.token_weights -------------------------------------------------------------------

def expected_weights(spans, current, now, held, clip):
    """Worked out token by token here, in float64."""
    out = []
    for s in spans:
        for t in range(s["start"], s["end"]):
            v = s["version"]
            if v == current:
                out.append(1.0)
            elif v not in held:
                out.append(0.0)
            else:
                ratio = math.exp(float(now[t]) - float(held[v][t])) if not (
                    math.isnan(float(now[t])) or math.isnan(float(held[v][t]))) else math.nan
                out.append(0.0 if math.isnan(ratio) else min(ratio, clip))
    return torch.tensor(out, dtype=torch.float64)


def check(got, want, what):
    got = torch.as_tensor(got).double().flatten()
    assert got.shape == want.shape, f"{what}: expected {want.numel()} weights (one per token), got {got.numel()}"
    assert torch.isfinite(got).all(), f"{what}: every weight is finite, got {got.tolist()}"
    bad = (got - want).abs() > 1e-5 * (1 + want.abs())
    if bad.any():
        i = int(bad.nonzero()[0])
        raise AssertionError(f"{what}: token {i}: expected weight {want[i].item():.6g}, got {got[i].item():.6g}")


def random_rollout(r, t, labels):
    """Spans over t tokens, cut at random points into runs of the given labels (in order)."""
    cuts = sorted(r.sample(range(1, t), len(labels) - 1)) if len(labels) > 1 else []
    bounds = [0, *cuts, t]
    return [{"version": v, "start": a, "end": b} for v, a, b in zip(labels, bounds, bounds[1:])]


def logps(r, t):
    return torch.log(torch.tensor([r.uniform(0.02, 0.98) for _ in range(t)]))


@WEIGHTS
def test_random_rollouts_crossing_version_boundaries(rng):
    r, seed = rng
    for case in range(40):
        cur = r.randint(8, 12)  # labels around step-9 / step-10: "step-10" < "step-9" as text
        t = r.randint(3, 10)
        labels = [f"step-{cur - k}" for k in sorted(r.sample(range(3), r.randint(1, min(3, t))), reverse=True)]
        spans = random_rollout(r, t, labels)
        now = logps(r, t)
        held = {f"step-{cur}": now.clone()}
        for k in (1, 2):
            if r.random() < 0.7:
                held[f"step-{cur - k}"] = logps(r, t)
        clip = r.choice([1.2, 2.0, 5.0])
        what = f"{seed}, case {case}: spans {[(s['version'], s['start'], s['end']) for s in spans]}, trainer at " \
               f"step-{cur}, holds {sorted(held)}, clip {clip}"
        args = ([dict(s) for s in spans], f"step-{cur}", now.clone(), {k: v.clone() for k, v in held.items()}, clip)
        check(importance(*args), expected_weights(spans, f"step-{cur}", now, held, clip), what)
        assert torch.equal(args[2], now), f"{what}: logp_now was changed in place"


@WEIGHTS
def test_clip_truncates_large_weights_and_leaves_small_ones(rng):
    r, seed = rng
    t = r.randint(4, 8)
    clip = r.uniform(1.1, 3.0)
    ratios = [r.uniform(clip + 0.5, 20) if i % 2 == 0 else r.uniform(0.01, 1 / clip - 0.005) for i in range(t)]
    then = torch.log(torch.tensor([r.uniform(0.01, 0.05) for _ in range(t)], dtype=torch.float64))
    now = (then + torch.log(torch.tensor(ratios, dtype=torch.float64))).float()
    then = then.float()
    spans = [{"version": "step-1", "start": 0, "end": t}]
    got = torch.as_tensor(importance(spans, "step-2", now, {"step-1": then, "step-2": now}, clip)).double()
    check(got, expected_weights(spans, "step-2", now, {"step-1": then}, clip), f"{seed}: ratios {ratios}, clip {clip:.3f}")


@WEIGHTS
def test_edge_cases_empty_one_token_and_non_finite_log_probs(rng):
    r, seed = rng
    got = importance([], "step-3", torch.zeros(0), {"step-3": torch.zeros(0)}, 2.0)
    assert torch.as_tensor(got).numel() == 0, f"{seed}: no spans, no tokens: expected no weights, got {got}"
    one = [{"version": "step-2", "start": 0, "end": 1}]
    now, then = logps(r, 1), logps(r, 1)
    check(importance(one, "step-3", now, {"step-2": then, "step-3": now}, 2.0),
          expected_weights(one, "step-3", now, {"step-2": then}, 2.0), f"{seed}: a one-token span")
    t = r.randint(6, 9)
    cut = r.randint(4, t - 1)  # at least 4 stale tokens: one of each non-finite kind
    spans = [{"version": "step-2", "start": 0, "end": cut}, {"version": "step-3", "start": cut, "end": t}]
    now, then = logps(r, t), logps(r, t)
    kinds = dict(zip(r.sample(range(cut), 4), ["nan_now", "nan_then", "inf_then", "neg_inf_now"]))
    for i, kind in kinds.items():  # NaN and infinities in the log-probs of stale tokens
        if kind == "nan_now":
            now[i] = math.nan
        elif kind == "nan_then":
            then[i] = math.nan
        elif kind == "inf_then":
            then[i] = -math.inf  # pi_then = 0: an infinite ratio, truncated at clip
        else:
            now[i] = -math.inf   # pi_now = 0: weight 0
    check(importance(spans, "step-3", now, {"step-2": then, "step-3": now}, 2.0),
          expected_weights(spans, "step-3", now, {"step-2": then}, 2.0), f"{seed}: non-finite log-probs {kinds}")


@WEIGHTS
def test_spans_that_do_not_tile_the_rollout_are_refused(rng):
    r, seed = rng
    t = r.randint(4, 9)
    now = logps(r, t)
    held = {"step-1": logps(r, t), "step-2": now}
    good = random_rollout(r, t, ["step-1", "step-2"])
    cut = good[0]["end"]
    wrong = {"a gap": [dict(good[0], end=cut - 1) if cut > 1 else dict(good[0], start=1), good[1]],
             "an overlap": [good[0], dict(good[1], start=cut - 1)],
             "too few tokens": [good[0], dict(good[1], end=t - 1)],
             "too many tokens": [good[0], dict(good[1], end=t + 1)],
             "out of order": [good[1], good[0]],
             "an empty span": [good[0], {"version": "step-2", "start": cut, "end": cut}, good[1]]}
    for label, spans in wrong.items():
        with pytest.raises(ValueError):
            importance(spans, "step-2", now, held, 2.0)
            pytest.fail(f"{seed}: spans with {label} {spans} over {t} tokens were accepted")
    for clip in [0.0, -1.0, math.nan]:
        with pytest.raises(ValueError):
            importance(good, "step-2", now, held, clip)
            pytest.fail(f"{seed}: clip {clip} was accepted")


@WEIGHTS
def test_the_loop_trains_with_these_weights_in_keep_mode(tmp_path, rng):
    r, seed = rng
    path = start_checkpoint(tmp_path, r)
    seen = []

    def spy(spans, current, now, by_version, clip):
        w = importance(spans, current, now, by_version, clip)
        seen.append((torch.as_tensor(w).double().flatten(), expected_weights(spans, current, now, by_version, clip)))
        return w

    cfg = LoopConfig(steps=3, pause_mode=r.choice(["keep", "retract"]), overlap_tokens=r.randint(1, 6),
                     seed=r.randrange(10_000), group_size=4, correction=spy)
    result = train(Engine(path, block_size=8, max_num_seqs=16), cfg)
    assert any(len(ro.spans) > 1 for ro in result.rollouts), f"{seed}: the run produced mixed rollouts"
    for i, (got, want) in enumerate(seen):
        check(got, want, f"{seed}: {cfg.pause_mode} loop, rollout {i}")


@WEIGHTS
def test_the_current_versions_tokens_weigh_exactly_one_whatever_the_trainer_holds_for_it(rng):
    """The current policy sampled those tokens: weight 1.0 exactly, even when the trainer's
    stored log-probs of the current version differ a little from ``logp_now`` (computed in
    another precision) or are not stored at all."""
    r, seed = rng
    n = r.randint(3, 9)
    cut = r.randint(1, n - 1)
    spans = [{"version": "old", "start": 0, "end": cut}, {"version": "now", "start": cut, "end": n}]
    gen = torch.Generator().manual_seed(r.randrange(1 << 30))
    now = -torch.rand(n, generator=gen) * 3
    for held in ({"old": now - 0.1, "now": now + 0.01 * torch.randn(n, generator=gen)}, {"old": now - 0.1}):
        got = importance(spans, "now", now.clone(), {k: v.clone() for k, v in held.items()}, clip=2.0)
        assert torch.equal(got[cut:], torch.ones(n - cut)), (
            f"{seed}: tokens {cut}..{n - 1} of the current version weigh {got[cut:].tolist()} with the trainer holding "
            f"{'a slightly different copy of' if 'now' in held else 'no entry for'} the current version's "
            f"log-probs; they must weigh exactly 1.0")


@WEIGHTS
def test_a_clip_below_one_is_a_valid_clip(rng):
    """Any clip > 0 is allowed (a clip below 1 caps every stale token's weight below 1)."""
    r, seed = rng
    n, clip = r.randint(2, 8), r.choice([0.25, 0.5, 0.9])
    spans = [{"version": "old", "start": 0, "end": n}]
    gen = torch.Generator().manual_seed(r.randrange(1 << 30))
    now, then = -torch.rand(n, generator=gen), -torch.rand(n, generator=gen)
    try:
        got = importance(spans, "now", now, {"old": then}, clip=clip)
    except ValueError as exc:
        pytest.fail(f"{seed}: clip={clip} is a number > 0 and must be accepted, but importance raised: {exc}")
    check(got, expected_weights(spans, "now", now, {"old": then}, clip), f"{seed}: clip={clip}")


@WEIGHTS
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_the_weights_are_a_new_float32_tensor_whatever_the_log_probs_dtype(rng, dtype):
    """The contract: "Returns a new float32 tensor [T]", whatever precision the trainer's
    log-probabilities come in (the loss multiplies float32 terms by it)."""
    r, seed = rng
    t = r.randint(3, 9)
    cut = r.randint(1, t - 1)
    spans = [{"version": "step-1", "start": 0, "end": cut}, {"version": "step-2", "start": cut, "end": t}]
    now, then = logps(r, t).to(dtype), logps(r, t).to(dtype)
    held = {"step-1": then, "step-2": now}
    got = importance(spans, "step-2", now, held, 2.0)
    what = f"{seed}: log-probs in {dtype}, spans {[(s['version'], s['start'], s['end']) for s in spans]}"
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32 and tuple(got.shape) == (t,), \
        f"{what}: expected a float32 tensor of shape ({t},), got " \
        f"{type(got).__name__} {getattr(got, 'dtype', '')} {tuple(getattr(got, 'shape', ()))}"
    for source in (now, then):
        assert got.data_ptr() != source.data_ptr(), f"{what}: the weights share memory with an input tensor"
    check(got, expected_weights(spans, "step-2", now.double(), {k: v.double() for k, v in held.items()}, 2.0), what)
