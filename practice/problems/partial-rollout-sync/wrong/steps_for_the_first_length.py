"""Wrong answer: after the sync it runs as many steps as the first request asks tokens for
(enough for a rollout from scratch, it reasons), so longer requests are left unfinished."""
from __future__ import annotations


def overlap_and_sync(engine, prompts, params, new_weights, version, mode, overlap_steps):
    """Start one rollout per prompt, sync new weights after ``overlap_steps`` engine steps
    with pause mode ``mode``, finish every rollout; outputs in prompt order."""
    owner = {}  # rid -> index of its prompt
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        owner[engine.add_request(prompt, p)] = i
    finished = []
    for _ in range(overlap_steps):
        finished += engine.step()
    engine.pause_generation(mode)
    engine.update_weights_from_tensor(new_weights, weight_version=version)
    engine.continue_generation()
    results = [None] * len(prompts)
    for _ in range(params[0]["max_new_tokens"] if params else 0):
        finished += engine.step()
        for out in finished:
            i = owner.pop(out["rid"])
            if out["meta_info"]["finish_reason"]["type"] == "abort":
                owner[engine.add_request(prompts[i], params[i])] = i  # generate it again, on the new weights
            else:
                results[i] = out
        finished = []
    return results
