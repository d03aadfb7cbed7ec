"""inplace-requant: your answer. Read problem.md, fill in the three functions, then run

    python practice/judge.py test inplace-requant
"""
from __future__ import annotations

import numpy as np
import torch


def quantize(w):
    """Per-row symmetric int8 of a 2-D weight (numpy or torch).

    Returns (qweight int8 [rows, cols], scale float32 [rows]) as torch tensors.
    """
    raise NotImplementedError("quantize: write it (problem.md says exactly what it returns)")


def hot_update(layer, new_w):
    """Requantize new_w and put it into layer (an Int8Layer with .qweight and .scale)."""
    q, scale = quantize(new_w)
    layer.qweight = q
    layer.scale = scale


def pause_costs(mode, done, left, prompt, step_ms):
    """{"wait_s", "redecode", "reprefill", "mixed", "kv_fresh"} for mode abort, wait, keep or retract."""
    raise NotImplementedError("pause_costs: write it (problem.md defines each number)")
