"""Wrong answer: the overlap steps are run for their side effect only, so a rollout that
finished before the sync is lost (its slot stays empty)."""
from __future__ import annotations


def overlap_and_sync(engine, prompts, params, new_weights, version, mode, overlap_steps):
    """Start one rollout per prompt, sync new weights after ``overlap_steps`` engine steps
    with pause mode ``mode``, finish every rollout; outputs in prompt order."""
    owner = {}  # rid -> index of its prompt
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        owner[engine.add_request(prompt, p)] = i
    finished = []
    for _ in range(overlap_steps):
        engine.step()  # outputs are collected after the sync
    engine.pause_generation(mode)
    engine.update_weights_from_tensor(new_weights, weight_version=version)
    engine.continue_generation()
    results = [None] * len(prompts)
    while engine.has_unfinished_requests():
        finished += engine.step()
        for out in finished:
            i = owner.pop(out["rid"])
            if out["meta_info"]["finish_reason"]["type"] == "abort":
                owner[engine.add_request(prompts[i], params[i])] = i  # generate it again, on the new weights
            else:
                results[i] = out
        finished = []
    return results
