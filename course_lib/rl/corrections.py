"""What the trainer does with tokens an older policy sampled: per-token weights.

A correction is a function

    weigh(spans, current, logp_now, logp_by_version, clip) -> tensor [T]

``spans`` is the rollout's ``meta_info["weight_versions"]``; ``current`` the trainer's
version label; ``logp_now`` the current policy's log-probability of each token;
``logp_by_version`` maps each version the trainer still holds a copy of (the current one
included) to that version's log-probabilities of the same tokens; ``clip`` truncates
large weights. The loss multiplies each token's policy-gradient term by its weight
(0 drops the token).

- ``importance``: pi_now / pi_then for tokens of an older version, truncated at ``clip``
  (truncated importance sampling); exactly 1 for tokens of the current version; 0 for a
  version the trainer no longer holds (it cannot correct what it cannot evaluate).
- ``drop``: 1 for tokens of the current version, 0 for all others.
- ``none``: 1 everywhere: treats stale tokens as if the current policy sampled them (biased).
"""
from __future__ import annotations

import torch


def per_token_versions(spans: list[dict]) -> list[str]:
    return [s["version"] for s in spans for _ in range(s["start"], s["end"])]


def importance(spans, current, logp_now, logp_by_version, clip):
    weights = torch.ones_like(logp_now)
    for t, v in enumerate(per_token_versions(spans)):
        if v == current:
            continue
        if v not in logp_by_version:
            weights[t] = 0.0
        else:
            weights[t] = torch.exp(logp_now[t] - logp_by_version[v][t]).clamp(max=clip)
    return weights


def drop(spans, current, logp_now, logp_by_version, clip):
    return torch.tensor([1.0 if v == current else 0.0 for v in per_token_versions(spans)])


def none(spans, current, logp_now, logp_by_version, clip):
    return torch.ones_like(logp_now)


BUILT_IN = {"importance": importance, "drop": drop, "none": none}


def get(correction):
    """A built-in correction by name, or the callable itself."""
    if callable(correction):
        return correction
    if correction not in BUILT_IN:
        raise ValueError(f"unknown correction {correction!r}; expected one of {sorted(BUILT_IN)} or a function")
    return BUILT_IN[correction]
