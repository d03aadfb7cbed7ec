"""RMSNorm, computed in float32 like Hugging Face's Qwen3RMSNorm (one fused kernel on a GPU:
``layers/fused.py``)."""
from __future__ import annotations

import torch
from torch import nn

from course_lib.layers import fused
from course_lib.layers.linear import default_weight_loader


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        self.weight.local_loader = default_weight_loader  # replicated: every rank's part is the whole

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused.enabled(x) and x.stride(-1) == 1:
            return fused.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
