"""Rotary position embeddings (the rotate-half form Qwen3 uses), from a cached cos/sin table."""
from __future__ import annotations

import torch
from torch import nn


def rope_tables(head_dim: int, max_position: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos and sin tables, [max_position, head_dim] in float32 (on ``device``, or the
    current default device)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    freqs = torch.outer(torch.arange(max_position, dtype=torch.int64, device=device).float(), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float):
        super().__init__()
        cos, sin = rope_tables(head_dim, max_position, theta)
        # Not weights: never in a checkpoint. Only a new rope_theta rewrites them (set_theta).
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.theta = theta

    def set_theta(self, theta: float) -> None:
        """Recompute the tables for ``theta`` into the existing buffers, in place (kernels
        and captured CUDA graphs keep reading the same memory), exactly as a model built
        with ``theta`` computes them."""
        cos, sin = rope_tables(self.cos.shape[1], self.cos.shape[0], theta, device=self.cos.device)
        self.cos.copy_(cos)
        self.sin.copy_(sin)
        self.theta = theta

    @staticmethod
    def _rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hkv, D]; positions: [T]."""
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + self._rotate_half(q) * sin, k * cos + self._rotate_half(k) * sin
