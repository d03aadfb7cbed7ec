"""The trainer's own copy of the policy: a differentiable Qwen3 with Hugging Face tensor names.

The engine's model is built for serving (paged KV, fused q/k/v, no autograd). A trainer
needs gradients, so it keeps its own copy of the same network, in float32, whose
parameters are named exactly as in an HF checkpoint (``model.layers.0.self_attn.q_proj.weight``).
``named_tensors()`` is therefore what a weight sync sends, unchanged, and
``from_checkpoint`` / ``state_dict()`` round-trip through the checkpoint format.

The arithmetic follows transformers' Qwen3 (RMSNorm in float32, rotate-half RoPE,
grouped-query attention with q/k norm, SwiGLU), so its logits agree with the engine's
to float32 rounding. ``forward`` also accepts the keys and values of a prefix computed
by *another* copy (``past``): that is how ``keep``'s partial rollouts are reproduced,
where new weights attend over KV the old weights wrote.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from course_lib.config import ModelConfig
from course_lib.weights.checkpoint import CheckpointReader, hf_tensor_shapes


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class Policy(nn.Module):
    """``Policy(config)``; parameters keyed by HF names (dots become ``/`` inside the ParameterDict)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        # A flat dict keyed by checkpoint name keeps the name mapping trivially exact.
        self.weights = nn.ParameterDict({name.replace(".", "/"): nn.Parameter(torch.zeros(shape))
                                         for name, shape in hf_tensor_shapes(config).items()})
        d = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        freqs = torch.outer(torch.arange(config.max_position_embeddings, dtype=torch.int64).float(), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    # ---- weights by checkpoint name ----------------------------------------------------
    def w(self, name: str) -> torch.Tensor:
        return self.weights[name.replace(".", "/")]

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(HF name, detached tensor) pairs: what a weight sync sends."""
        return [(k.replace("/", "."), p.detach()) for k, p in self.weights.items()]

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """A copy of every weight by HF name (for ``write_checkpoint`` or a version snapshot)."""
        return {name: t.clone() for name, t in self.named_tensors()}

    def load_tensors(self, tensors) -> None:
        with torch.no_grad():
            for name, t in dict(tensors).items():
                self.w(name).copy_(t)

    @classmethod
    def from_checkpoint(cls, path) -> "Policy":
        reader = CheckpointReader(path)
        policy = cls(reader.config)
        policy.load_tensors(reader.iter_tensors())
        return policy

    # ---- the network -------------------------------------------------------------------
    def forward(self, ids: torch.Tensor, past: list | None = None, return_kv: bool = False):
        """Logits [B, L, vocab] for token ids [B, L] that follow ``past`` (per layer (K, V)
        of the earlier positions, possibly from another policy). With ``return_kv`` also
        returns this call's per-layer (K, V), prefix included."""
        c = self.config
        b, n = ids.shape
        start = 0 if past is None else past[0][0].shape[2]
        pos = torch.arange(start, start + n)
        cos, sin = self.cos[pos], self.sin[pos]
        x = F.embedding(ids, self.w("model.embed_tokens.weight"))
        kvs = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            h = rms_norm(x, self.w(p + "input_layernorm.weight"), c.rms_norm_eps)
            q = (h @ self.w(p + "self_attn.q_proj.weight").T).view(b, n, c.num_attention_heads, c.head_dim)
            k = (h @ self.w(p + "self_attn.k_proj.weight").T).view(b, n, c.num_key_value_heads, c.head_dim)
            v = (h @ self.w(p + "self_attn.v_proj.weight").T).view(b, n, c.num_key_value_heads, c.head_dim)
            q = rms_norm(q, self.w(p + "self_attn.q_norm.weight"), c.rms_norm_eps).transpose(1, 2)
            k = rms_norm(k, self.w(p + "self_attn.k_norm.weight"), c.rms_norm_eps).transpose(1, 2)
            v = v.transpose(1, 2)
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
            if past is not None:
                k, v = torch.cat([past[i][0], k], dim=2), torch.cat([past[i][1], v], dim=2)
            kvs.append((k, v))
            group = c.num_attention_heads // c.num_key_value_heads
            kk, vv = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            scores = (q @ kk.transpose(-1, -2)) * c.head_dim ** -0.5
            future = torch.arange(start + n)[None, :] > pos[:, None]
            scores = scores.masked_fill(future, float("-inf"))
            attn = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ vv
            x = x + attn.transpose(1, 2).reshape(b, n, -1) @ self.w(p + "self_attn.o_proj.weight").T
            h = rms_norm(x, self.w(p + "post_attention_layernorm.weight"), c.rms_norm_eps)
            gate = h @ self.w(p + "mlp.gate_proj.weight").T
            up = h @ self.w(p + "mlp.up_proj.weight").T
            x = x + (F.silu(gate) * up) @ self.w(p + "mlp.down_proj.weight").T
        x = rms_norm(x, self.w("model.norm.weight"), c.rms_norm_eps)
        head = self.w("model.embed_tokens.weight") if c.tie_word_embeddings else self.w("lm_head.weight")
        logits = x @ head.T
        return (logits, kvs) if return_kv else logits

    def token_logprobs(self, prompts: torch.Tensor, completions: torch.Tensor,
                       temperature: float = 1.0) -> torch.Tensor:
        """log pi(completion token | everything before it), [B, T], for sampling at ``temperature``."""
        ids = torch.cat([prompts, completions], dim=1)
        logits = self(ids)[:, prompts.shape[1] - 1:-1] / temperature
        return torch.log_softmax(logits.float(), dim=-1).gather(-1, completions[..., None]).squeeze(-1)


def keep_logits(old: Policy, new: Policy, prompts: torch.Tensor, completions: torch.Tensor,
                switch: int) -> torch.Tensor:
    """The logits a ``keep`` pause really sampled from, [B, T, vocab]: the old weights wrote
    the KV of every position before the switch, and the new weights computed the rest over
    that KV.

    ``switch`` is the number of completion tokens generated before the update (the same
    for the whole batch). Token ``switch - 1`` was sampled but not yet fed back when the
    engine paused, so its KV is the first the new weights compute.
    """
    p = prompts.shape[1]
    ids = torch.cat([prompts, completions], dim=1)
    cut = p + switch - 1                       # positions [0, cut) hold old KV
    with torch.no_grad():
        old_logits, old_kv = old(ids[:, :cut], return_kv=True)
        new_logits = new(ids[:, cut:-1], past=old_kv)
    return torch.cat([old_logits[:, p - 1:], new_logits], dim=1)


def keep_logprobs(old: Policy, new: Policy, prompts: torch.Tensor, completions: torch.Tensor,
                  switch: int, temperature: float = 1.0) -> torch.Tensor:
    """log p of each completion token under what ``keep`` really sampled from, [B, T]."""
    logits = keep_logits(old, new, prompts, completions, switch) / temperature
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, completions[..., None]).squeeze(-1)
