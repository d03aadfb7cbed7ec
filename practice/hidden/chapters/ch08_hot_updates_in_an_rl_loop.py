"""Hidden tests for notebooks/08_hot_updates_in_an_rl_loop.ipynb: the learner's code in the real RL loop.

``check_choose_pause_mode(choose)``: the loop runs once per pause mode on a fresh seed and
the properties a trainer may demand are *measured* (did the update wait, were tokens
thrown away, was every token sampled over KV of its own weights, does every rollout come
from one version). For every combination of demands, the answer must be the first of
keep, retract, wait, abort that meets them (ValueError when none does); the learner's
mode is also run in the loop and must meet the demands there.

``check_token_weights(token_weights)``: the learner's function is the loop's correction
in keep and retract runs on fresh seeds; every call is compared with the reference on the
same inputs, plus cases the loop rarely produces (a version the trainer no longer holds,
labels past step-9, weights above the clip).

Both return a list of failure messages (empty: passed); see ``__init__.py`` for why.
"""
from __future__ import annotations

import itertools
import os
import random
import tempfile

import torch

from course_lib import Engine
from course_lib.rl import LoopConfig, corrections, task, train
from course_lib.rl.loop import one_thread

DEMANDS = ("overlap", "no_wasted_tokens", "exact_behaviour", "one_version_per_rollout")
PREFERENCE = ("keep", "retract", "wait", "abort")


def _rng(seed) -> random.Random:
    return random.Random(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))


def _run(path, mode, seed, steps=2, correction="importance", overlap=3):
    engine = Engine(path, block_size=8, max_num_seqs=16)
    result = train(engine, LoopConfig(steps=steps, pause_mode=mode, seed=seed, overlap_tokens=overlap,
                                      correction=correction))
    return engine, result


def measure(engine, result) -> dict:
    """Which demands a run met, from what the engine and the loop recorded."""
    pauses = [p for p in engine.pause_stats if p["mode"] != "none"]
    return {"overlap": all(p["wait_s"] == 0 for p in pauses),
            "no_wasted_tokens": sum(len(o["output_ids"]) for o in result.aborted) == 0,
            "exact_behaviour": all(p["kv_fresh"] for p in pauses),
            "one_version_per_rollout": all(len(r.spans) == 1 for r in result.rollouts)}


def check_choose_pause_mode(choose, seed=None) -> list[str]:
    rng = _rng(seed)
    combos = [dict(zip(DEMANDS, bits)) for bits in itertools.product([False, True], repeat=len(DEMANDS))]
    rng.shuffle(combos)
    answers = []
    for demands in combos:  # the candidate first
        try:
            answers.append(("mode", choose(dict(demands))))
        except ValueError:
            answers.append(("ValueError", None))
        except Exception as exc:
            return [f"choose_pause_mode({demands}) raised {type(exc).__name__}: {exc}"]
    failures = []
    with tempfile.TemporaryDirectory() as tmp, one_thread():
        path = task.initial_checkpoint(tmp, seed=rng.randrange(1000))
        run_seed = rng.randrange(10_000)
        met = {mode: measure(*_run(path, mode, run_seed)) for mode in PREFERENCE}
        for demands, (kind, got) in zip(combos, answers):
            wanted = [k for k, v in demands.items() if v]
            fits = [m for m in PREFERENCE if all(met[m][k] for k in wanted)]
            if not fits:
                if kind != "ValueError":
                    failures.append(f"demands {wanted}: no pause mode meets them all (measured), so "
                                    f"ValueError was expected; you chose {got!r}")
            elif kind == "ValueError":
                failures.append(f"demands {wanted}: {fits[0]!r} meets them (measured), but you raised ValueError")
            elif got != fits[0]:
                unmet = [k for k in wanted if got in met and not met[got][k]]
                why = (f"in the loop {got!r} failed {unmet}" if unmet else
                       f"{fits[0]!r} meets them too and costs less" if got in met else "that is not a pause mode")
                failures.append(f"demands {wanted}: expected {fits[0]!r}, you chose {got!r} ({why})")
    return failures


def _spans(versions: list[str]) -> list[dict]:
    spans = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans


def _compare(got, want, what) -> str | None:
    try:
        got = torch.as_tensor(got, dtype=torch.float32).flatten()
    except Exception as exc:
        return f"{what}: the weights must be a tensor or list of numbers ({type(exc).__name__}: {exc})"
    if got.shape != want.shape:
        return f"{what}: expected {want.numel()} weights (one per token), got {got.numel()}"
    if not torch.isfinite(got).all():
        return f"{what}: every weight must be finite, got {got.tolist()}"
    if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
        i = int((got - want).abs().argmax())
        return f"{what}: token {i}: expected weight {want[i].item():.6g}, got {got[i].item():.6g}"
    return None


def _hand_cases(rng: random.Random) -> list[tuple]:
    cases = []
    for _ in range(6):
        t = rng.randint(3, 9)
        cur = rng.randint(9, 12)  # labels step-9 .. step-12: "step-10" < "step-9" as text
        cut = rng.randint(1, t - 1)
        versions = [f"step-{cur - 1}"] * cut + [f"step-{cur}"] * (t - cut)
        now = torch.log(torch.rand(t) * 0.9 + 0.05)
        then = torch.log(torch.rand(t) * 0.9 + 0.05)
        held = {f"step-{cur}": now.clone()}
        if rng.random() < 0.7:  # sometimes the trainer no longer holds the old version
            held[f"step-{cur - 1}"] = then
        cases.append((_spans(versions), f"step-{cur}", now, held, rng.choice([1.2, 2.0, 5.0])))
    # Three versions in one rollout, the oldest no longer held.
    now = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.6]))
    cases.append((_spans(["step-7", "step-8", "step-8", "step-9"]), "step-9", now,
                  {"step-9": now.clone(), "step-8": torch.log(torch.tensor([0.1, 0.1, 0.5, 0.5]))}, 2.0))
    return cases


def check_token_weights(token_weights, seed=None) -> list[str]:
    rng = _rng(seed)
    failures, calls = [], []

    def spy(spans, current, logp_now, by_version, clip):
        args = ([dict(s) for s in spans], current, logp_now.clone(), {k: v.clone() for k, v in by_version.items()}, clip)
        got = token_weights(spans, current, logp_now, by_version, clip)  # the candidate first
        calls.append((args, got))
        return corrections.importance(*args)  # the loop goes on with the reference

    with tempfile.TemporaryDirectory() as tmp, one_thread():
        path = task.initial_checkpoint(tmp, seed=rng.randrange(1000))
        for mode in ("keep", "retract"):
            calls.clear()
            try:
                _run(path, mode, rng.randrange(10_000), steps=3, correction=spy, overlap=rng.randint(1, 6))
            except Exception as exc:
                return [f"the loop ({mode}) failed while calling your token_weights: {type(exc).__name__}: {exc}"]
            bad = []
            for i, (args, got) in enumerate(calls):
                msg = _compare(got, corrections.importance(*args), f"{mode} run, rollout {i} "
                               f"(versions {[(s['version'], s['start'], s['end']) for s in args[0]]}, "
                               f"trainer at {args[1]!r})")
                if msg:
                    bad.append(msg)
            failures += bad[:3]
        for spans, cur, now, held, clip in _hand_cases(rng):
            what = (f"versions {[(s['version'], s['start'], s['end']) for s in spans]}, trainer at {cur!r}, "
                    f"holds {sorted(held)}, clip {clip}")
            try:
                got = token_weights([dict(s) for s in spans], cur, now.clone(), {k: v.clone() for k, v in held.items()},
                                    clip)
            except Exception as exc:
                failures.append(f"{what}: raised {type(exc).__name__}: {exc}")
                continue
            msg = _compare(got, corrections.importance(spans, cur, now, held, clip), what)
            if msg:
                failures.append(msg)
    return failures
