"""Support for the partial-rollout-sync tests: a small engine, new weights, and the checks.

``run_case`` builds an engine on a random tiny checkpoint, calls the candidate, and
returns everything the checks need; ``failures`` says in words what went wrong.
"""
from __future__ import annotations

import random
import tempfile

import torch

from course_lib import Engine
from course_lib.testing import assert_hot_equals_cold
from course_lib.weights.checkpoint import make_random, random_state_dict, preset, write_checkpoint

OLD = "default"  # the label a fresh engine serves under


def run_case(candidate, mode, seed, n=4, overlap=3, lengths=None):
    """Run ``candidate.overlap_and_sync`` once; returns a dict for ``failures``.

    ``lengths``: the tokens each request asks for (default: ``n`` different lengths, all
    longer than the overlap); a length up to ``overlap`` finishes before the sync."""
    rng = random.Random(seed)
    tmp = tempfile.mkdtemp(prefix="partial-rollout-")
    config = preset("tiny")
    old_path = make_random(f"{tmp}/old", config, seed=rng.randrange(1000))
    new = random_state_dict(config, seed=rng.randrange(1000, 2000))
    new_path = write_checkpoint(f"{tmp}/new", config, new)
    engine = Engine(old_path, block_size=4)
    if lengths is None:
        lengths = rng.sample(range(overlap + 2, overlap + 12), n)  # all different: they finish out of order
    prompts = ["".join(rng.choice("abcdefgh ") for _ in range(rng.randint(3, 9))) for _ in range(len(lengths))]
    params = [{"max_new_tokens": k, "temperature": 1.0, "seed": rng.randrange(10 ** 6), "ignore_eos": True}
              for k in lengths]
    version = f"v{rng.randrange(100, 999)}"
    outs = candidate.overlap_and_sync(engine, list(prompts), [dict(p) for p in params], list(new.items()),
                                      version, mode, overlap)
    return dict(engine=engine, prompts=prompts, lengths=lengths, outs=outs, version=version, mode=mode,
                overlap=overlap, new_path=new_path)


def failures(case) -> list[str]:
    mode, outs, version, overlap = case["mode"], case["outs"], case["version"], case["overlap"]
    engine, lengths = case["engine"], case["lengths"]
    if not isinstance(outs, list) or len(outs) != len(lengths):
        return [f"{mode}: expected a list of {len(lengths)} outputs, one per prompt, got {type(outs).__name__} "
                f"of length {len(outs) if hasattr(outs, '__len__') else '?'}"]
    bad = []
    for i, (out, k) in enumerate(zip(outs, lengths)):
        where = f"{mode}, prompt {i} ({case['prompts'][i]!r}, {k} tokens asked)"
        if not isinstance(out, dict) or "meta_info" not in out:
            bad.append(f"{where}: expected the output dict that engine.step() returns")
            continue
        reason = out["meta_info"]["finish_reason"]["type"]
        if reason == "abort" or len(out["output_ids"]) != k:
            bad.append(f"{where}: expected a complete rollout of {k} tokens, got {len(out['output_ids'])} "
                       f"tokens finished by {reason!r} (an aborted rollout must be generated again)")
            continue
        versions = [s["version"] for s in out["meta_info"]["weight_versions"] for _ in range(s["start"], s["end"])]
        if k <= overlap:  # finished before the sync: every token is an old one, whatever the mode
            want = [OLD] * k
        elif mode in ("keep", "retract"):
            want = [OLD] * overlap + [version] * (k - overlap)
        elif mode == "abort":
            want = [version] * k
        else:
            want = [OLD] * k
        if versions != want:
            bad.append(f"{where}: token versions should be {compress(want)}, got {compress(versions)}")
    if not bad and [o["meta_info"]["completion_tokens"] for o in outs] != lengths:
        bad.append(f"{mode}: the outputs must come back in prompt order")
    recorded = engine.pause_stats[-1].mode if engine.pause_stats else None
    if recorded != mode:
        bad.append(f"{mode}: the engine's last pause record should say mode {mode!r}, it says "
                   f"{recorded!r} (pause with engine.pause_generation(mode) before the update)")
    if engine.paused:
        bad.append(f"{mode}: the engine is still paused at the end (continue_generation)")
    if engine.weight_version != version:
        bad.append(f"{mode}: the engine should serve version {version!r}, it serves {engine.weight_version!r}")
    if not bad:
        try:
            assert_hot_equals_cold(engine, case["new_path"], ["after the sync", "hot equals cold"], 4)
        except AssertionError as exc:
            bad.append(f"{mode}: after the sync the engine differs from a cold start on the new weights: {exc}")
    return bad


def compress(versions: list[str]) -> str:
    runs = []
    for v in versions:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return " + ".join(f"{n} x {v!r}" for v, n in runs)


torch.set_num_threads(1)  # a tiny model: threads only add hand-offs
