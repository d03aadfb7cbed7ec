"""canary-rollback: your answer. Read problem.md, fill in the two functions, then run

    python practice/judge.py test canary-rollback
"""
from __future__ import annotations


def first_divergence(expected, got):
    """The first position where got differs from expected; None when they are equal."""
    for i, (a, b) in enumerate(zip(expected, got)):
        if a != b:
            return i
    return None


def guarded_update(engine, new_path, prompts, expected, weight_version, min_agreement):
    """Update engine to new_path; keep it ("promoted") or go back ("rolled_back"); "rejected" if refused."""
    old_path = engine.model_path
    engine.pause_generation("retract")
    engine.update_weights_from_disk(new_path, weight_version=weight_version)
    engine.continue_generation()
    raise NotImplementedError("compare the answers, then promote or roll back (problem.md)")
