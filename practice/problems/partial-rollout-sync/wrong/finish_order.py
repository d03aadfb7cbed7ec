"""Wrong answer: returns the outputs in the order they finished, not in prompt order."""
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
    results = []
    while owner:
        finished += engine.step()
        for out in finished:
            i = owner.pop(out["rid"])
            if out["meta_info"]["finish_reason"]["type"] == "abort":
                owner[engine.add_request(prompts[i], params[i])] = i
            else:
                results.append(out)
        finished = []
    return results
