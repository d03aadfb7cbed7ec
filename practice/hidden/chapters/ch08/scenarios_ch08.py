"""Chapter 08's token weights called on JSON inputs, observed as JSON: run here on the
learner's ``course_lib`` and in the reference's process (``twin``), for the differential
cases. Log-probabilities arrive as lists and become tensors of the drawn dtype here."""
from __future__ import annotations

import math

import torch


def _float(x: float):
    """A float as JSON can carry it and compare it: NaN and infinities as names."""
    return x if math.isfinite(x) else repr(x)


def weights(spans, current, logp_now, logp_by_version, clip, dtype) -> dict:
    from course_lib.rl.corrections import importance
    dt = getattr(torch, dtype)
    now = torch.tensor(logp_now, dtype=dt)
    held = {v: torch.tensor(lp, dtype=dt) for v, lp in logp_by_version.items()}
    before = [now.clone(), {v: t.clone() for v, t in held.items()}, [dict(s) for s in spans]]
    try:
        out = importance(spans, current, now, held, clip)
        seen = {"returned": {"type": type(out).__name__, "dtype": str(getattr(out, "dtype", None)),
                             "shape": list(getattr(out, "shape", [])),
                             "values": [_float(x) for x in out.double().tolist()] if torch.is_tensor(out) else None,
                             "shares_storage_with_logp_now": torch.is_tensor(out) and out.numel() > 0
                             and out.untyped_storage().data_ptr() == now.untyped_storage().data_ptr()}}
    except Exception as exc:  # noqa: BLE001 - which error, compared with the reference's
        seen = {"raised": type(exc).__name__}
    seen["inputs_unchanged"] = (torch.equal(now, before[0]) or bool(torch.isnan(now).any()))  \
        and all(torch.equal(held[v], t) or bool(torch.isnan(t).any()) for v, t in before[1].items()) \
        and spans == before[2]
    return seen
