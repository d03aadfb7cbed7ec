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
    """Truncated importance weights for one rollout, one weight per token.

    - ``spans``: the rollout's ``meta_info["weight_versions"]``, a list of
      ``{"version": str, "start": int, "end": int}`` (``end`` exclusive) in token order:
      the first starts at 0, each starts where the one before ended, none is empty
      (a one-token span has ``end == start + 1``); ``[]`` for a rollout of no tokens;
    - ``current``: the trainer's version label now;
    - ``logp_now``: float tensor ``[T]``, log pi_now of each token (``T`` = the tokens
      the spans cover);
    - ``logp_by_version``: ``{version: tensor [T]}`` for each version the trainer still
      holds (the current one included), log pi_then of the same tokens;
    - ``clip``: the largest weight, a number > 0.

    Returns a new float32 tensor ``[T]`` (the inputs are left as they are). Token ``t``
    of version ``v`` weighs:

    - exactly ``1.0`` when ``v == current`` (the policy being trained sampled it);
    - ``min(exp(logp_now[t] - logp_by_version[v][t]), clip)`` when the trainer holds
      ``v``: a ratio per token, never one figure for the whole sequence; only large
      weights are truncated (a weight below 1 stays as it is), so every weight is in
      ``[0, clip]``; a ratio that is NaN (a NaN log-probability) weighs ``0.0``, an
      infinite one ``clip``;
    - ``0.0`` when the trainer no longer holds ``v`` (it cannot evaluate pi_then).

    Version labels are names: compare them for equality only (as text "step-10" <
    "step-9"). Raises ``ValueError`` naming the problem when ``clip`` is not a number
    > 0, or when the spans do not cover tokens ``0 .. T-1`` exactly once, in order
    (a gap, an overlap, an empty span, or a total other than ``len(logp_now)``).
    """
    # BEGIN EXERCISE ch08.token_weights
    if not clip > 0:  # also refuses NaN
        raise ValueError(f"clip must be a number > 0, got {clip!r}")
    weights = torch.ones(logp_now.shape[0], dtype=torch.float32)
    expected = 0
    for span in spans:
        version, start, end = span["version"], span["start"], span["end"]
        if start != expected or end <= start:
            raise ValueError(f"span {span} does not start at token {expected}, where the spans before it "
                             f"ended, or holds no token")
        expected = end
        if version == current:
            continue
        if version not in logp_by_version:
            weights[start:end] = 0.0
            continue
        ratio = torch.exp(logp_now[start:end].float() - logp_by_version[version][start:end].float())
        weights[start:end] = torch.nan_to_num(ratio, nan=0.0).clamp(max=clip)
    if expected != logp_now.shape[0]:
        raise ValueError(f"the spans cover {expected} tokens but the rollout has {logp_now.shape[0]} log-probs")
    return weights
    # END EXERCISE


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
