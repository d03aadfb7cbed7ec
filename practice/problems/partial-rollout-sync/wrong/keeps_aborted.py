"""Wrong answer: an aborted rollout is returned as if it had finished (a short, stale rollout)."""
from __future__ import annotations


def overlap_and_sync(engine, prompts, params, new_weights, version, mode, overlap_steps):
    owner = {}
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        owner[engine.add_request(prompt, p)] = i
    finished = []
    for _ in range(overlap_steps):
        finished += engine.step()
    engine.pause_generation(mode)
    engine.update_weights_from_tensor(new_weights, weight_version=version)
    engine.continue_generation()
    results = [None] * len(prompts)
    while owner:
        finished += engine.step()
        for out in finished:
            results[owner.pop(out["rid"])] = out
        finished = []
    return results
