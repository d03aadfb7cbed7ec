"""Wrong answer: the longest wait is max(left), which fails when no request is in flight."""
from __future__ import annotations

import numpy as np
import torch

MODES = ("abort", "wait", "keep", "retract")


def quantize(w):
    """Per-row symmetric int8: (qweight int8 [rows, cols], scale float32 [rows])."""
    w = torch.as_tensor(w).to(torch.float32)
    if w.dim() != 2:
        raise ValueError(f"quantize expects a 2-D weight, got shape {list(w.shape)}")
    amax = w.abs().amax(dim=1)
    # An all-zero row would divide by zero; any scale works for it, and 1 is the rule.
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)  # torch.round: ties to even
    return q, scale


def hot_update(layer, new_w):
    """Requantize new_w and write it into layer.qweight and layer.scale without moving them."""
    w = torch.as_tensor(new_w)
    if tuple(w.shape) != tuple(layer.qweight.shape):
        # copy_ would broadcast a [1, cols] or [cols] weight over every row; refuse it before any write.
        raise ValueError(f"new weight has shape {list(w.shape)}, the layer holds {list(layer.qweight.shape)}")
    q, scale = quantize(w)  # everything that can fail happens before the first write
    layer.qweight.copy_(q)
    layer.scale.copy_(scale)


def pause_costs(mode, done, left, prompt, step_ms):
    """What pausing the in-flight requests for an update costs, under each pause mode."""
    done = [int(d) for d in np.asarray(done).reshape(-1)]
    left = [int(n) for n in np.asarray(left).reshape(-1)]
    if len(done) != len(left):
        raise ValueError(f"done has {len(done)} requests, left has {len(left)}")
    in_progress = sum(1 for d, n in zip(done, left) if d > 0 and n > 0)
    if mode == "abort":
        return dict(wait_s=0.0, redecode=sum(done), reprefill=prompt * len(done), mixed=0, kv_fresh=True)
    if mode == "wait":
        return dict(wait_s=max(left) * step_ms / 1000, redecode=0, reprefill=0, mixed=0, kv_fresh=True)
    if mode == "keep":
        return dict(wait_s=0.0, redecode=0, reprefill=0, mixed=in_progress, kv_fresh=False)
    if mode == "retract":
        return dict(wait_s=0.0, redecode=0, reprefill=sum(prompt + d for d in done), mixed=in_progress,
                    kv_fresh=True)
    raise ValueError(f"unknown pause mode {mode!r}; expected one of {', '.join(MODES)}")
