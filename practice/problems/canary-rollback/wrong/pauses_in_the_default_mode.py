"""Wrong answer: pauses with pause_generation() (the default mode, abort) instead of "retract"."""
from __future__ import annotations


def first_divergence(expected, got):
    """The first position where got differs from expected; None when they are equal."""
    for i, (a, b) in enumerate(zip(expected, got)):
        if a != b:
            return i
    # Equal over the shorter length: they differ only if one ran longer.
    return None if len(expected) == len(got) else min(len(expected), len(got))


def guarded_update(engine, new_path, prompts, expected, weight_version, min_agreement):
    """Update engine to new_path; keep it ("promoted") or go back ("rolled_back"); "rejected" if refused."""
    engine.pause_generation()
    try:
        engine.update_weights_from_disk(new_path, weight_version=weight_version, keep_snapshot=True)
    except ValueError:
        return "rejected"
    finally:
        engine.continue_generation()
    params = [{"max_new_tokens": len(e), "temperature": 0, "ignore_eos": True} for e in expected]
    outputs = engine.generate(list(prompts), params)
    agreeing = sum(first_divergence(e, o["output_ids"]) is None for e, o in zip(expected, outputs))
    if agreeing / len(expected) < min_agreement:
        engine.pause_generation()
        try:
            engine.rollback()
        finally:
            engine.continue_generation()
        return "rolled_back"
    return "promoted"
