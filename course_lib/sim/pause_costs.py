"""What each pause mode costs the requests in flight when an update arrives.

Given, per in-flight request, ``done`` tokens already generated and ``left`` still to
generate (all with ``prompt`` prompt tokens, ``step_ms`` per decode step):

- ``abort``: nothing waits; every generated token is thrown away and decoded again, and
  every prompt is prefilled again. Only new weights afterwards; all KV is fresh.
- ``wait``: the update waits for the longest request to finish. Nothing is redone and no
  request mixes versions, but the wait is ``max(left)`` decode steps.
- ``keep``: requests freeze and continue on the new weights with their old KV. Nothing
  waits or is redone, but every request that had started and not finished mixes versions,
  and the KV it keeps was computed by the old weights.
- ``retract``: requests go back to the queue with their KV freed and are prefilled again
  (prompt plus generated tokens) on the new weights. Prefill is parallel, so this is much
  cheaper than decoding again, but the tokens generated before the update came from the
  old weights: those requests still mix versions.

``handbook_scenario`` draws the illustration the chapter uses (64 requests, 2048-token
prompts, 25 ms per decode step, long-tailed remaining lengths) and costs every mode.
"""
from __future__ import annotations

import random

MODES = ("abort", "wait", "keep", "retract")


def _as_ints(values, name: str) -> list[int]:
    if hasattr(values, "tolist"):
        values = values.tolist()
    out = [int(v) for v in values]
    if any(v < 0 for v in out):
        raise ValueError(f"{name} must be non-negative token counts")
    return out


def pause_costs(mode: str, done, left, prompt: int, step_ms: float) -> dict:
    """{"wait_s", "redecode", "reprefill", "mixed", "kv_fresh"} for one pause mode."""
    done, left = _as_ints(done, "done"), _as_ints(left, "left")
    if len(done) != len(left):
        raise ValueError(f"done has {len(done)} requests but left has {len(left)}")
    started_unfinished = sum(1 for d, l in zip(done, left) if d > 0 and l > 0)
    if mode == "abort":
        return {"wait_s": 0.0, "redecode": sum(done), "reprefill": prompt * len(done), "mixed": 0, "kv_fresh": True}
    if mode == "wait":
        return {"wait_s": max(left, default=0) * step_ms / 1000, "redecode": 0, "reprefill": 0,
                "mixed": 0, "kv_fresh": True}
    if mode in ("keep", "in_place"):
        return {"wait_s": 0.0, "redecode": 0, "reprefill": 0, "mixed": started_unfinished, "kv_fresh": False}
    if mode == "retract":
        return {"wait_s": 0.0, "redecode": 0, "reprefill": sum(prompt + d for d in done),
                "mixed": started_unfinished, "kv_fresh": True}
    raise ValueError(f"unknown pause mode {mode!r}; expected one of {MODES}")


def handbook_load(seed: int = 0, n: int = 64) -> tuple[list[int], list[int]]:
    """The illustration's in-flight load: tokens done and tokens left per request."""
    rng = random.Random(seed)
    done = [rng.randint(1, 4000) for _ in range(n)]
    left = [min(16000, int(rng.lognormvariate(6.5, 1.2))) for _ in range(n)]
    return done, left


def handbook_scenario(seed: int = 0, prompt: int = 2048, step_ms: float = 25.0) -> list[dict]:
    """One row per mode for the illustration's load: {"mode", "wait_s", "redecode", ...}."""
    done, left = handbook_load(seed)
    return [{"mode": m, **pause_costs(m, done, left, prompt, step_ms)} for m in MODES]
