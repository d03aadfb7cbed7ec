"""Attention over a paged KV cache.

The cache of one layer is two tensors ``[num_blocks + 1, block_size, num_kv_heads,
head_dim]`` (the last block is scratch space that padded batch slots write to, so a
captured CUDA graph needs no branches). A sequence's tokens live in the blocks its block
table lists; token ``t`` of a sequence is at slot ``block_table[t // bs] * bs + t % bs``.

Prefill runs sequence by sequence (lengths differ, and it is never graph-captured); on a
GPU with Triton one kernel serves the whole batch (``fused.paged_prefill_attention``).
Decode runs the whole batch at once with static shapes, so it can be captured: keys are
gathered through padded block tables and positions past each context are masked.
On a GPU with Triton, decode instead reads the cache in place through the block tables, one
kernel for the whole batch (``fused.paged_decode_attention``: no gather, no masked work
past each context). The arithmetic follows transformers' eager attention (scores in the model's dtype,
softmax in float32), which is what the logits tests compare against.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from course_lib.layers import fused


@dataclass
class AttentionMetadata:
    is_prefill: bool
    slot_mapping: torch.Tensor          # [num_tokens] where each new token's K/V is written
    context_lens: torch.Tensor          # [batch] tokens in the cache after this step's writes
    block_tables: torch.Tensor          # [batch, width] block ids, padded
    query_lens: list[int] | None = None  # prefill: new tokens per sequence
    context_lens_list: list[int] | None = None
    query_starts: torch.Tensor | None = None  # prefill: [batch + 1] where each sequence's new tokens start


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.scale = head_dim ** -0.5
        self.k_cache = self.v_cache = torch.empty(0)  # views into the engine's KV pool

    def _store(self, k, v, slot_mapping):
        kv_shape = (-1, self.num_kv_heads, self.head_dim)
        self.k_cache.view(kv_shape).index_copy_(0, slot_mapping, k)
        self.v_cache.view(kv_shape).index_copy_(0, slot_mapping, v)

    def fused_fits(self, x: torch.Tensor) -> bool:
        """Whether the fused kernels serve this layer for ``x`` (``layers/fused.py``)."""
        return fused.enabled(x) and fused.decode_fits(self.group, self.head_dim, self.k_cache.shape[1])

    def forward(self, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, Hq, D], k and v: [T, Hkv, D] for this step's new tokens -> [T, Hq*D]."""
        self._store(k, v, meta.slot_mapping)
        return self.attend(q, meta)

    def attend(self, q, meta: AttentionMetadata) -> torch.Tensor:
        """Attention of this step's queries over the cache, which already holds this step's
        keys and values."""
        if meta.is_prefill:
            return self._prefill(q, meta)
        return self._decode(q, meta)

    def _gather(self, cache, block_ids):
        """[..., W] block ids -> [..., W * block_size, Hkv, D] keys or values."""
        g = cache[block_ids]
        return g.reshape(*block_ids.shape[:-1], -1, self.num_kv_heads, self.head_dim)

    def _prefill(self, q, meta):
        if self.fused_fits(q) and meta.query_starts is not None:
            return fused.paged_prefill_attention(q, self.k_cache, self.v_cache, meta.block_tables,
                                                 meta.context_lens, meta.query_starts, max(meta.query_lens),
                                                 self.scale)
        out = torch.empty(q.shape[0], self.num_heads * self.head_dim, dtype=q.dtype, device=q.device)
        bs = self.k_cache.shape[1]
        start = 0
        for i, (qlen, ctx) in enumerate(zip(meta.query_lens, meta.context_lens_list)):
            blocks = meta.block_tables[i, : (ctx + bs - 1) // bs]
            k = self._gather(self.k_cache, blocks)[:ctx]
            v = self._gather(self.v_cache, blocks)[:ctx]
            qq = q[start:start + qlen].view(qlen, self.num_kv_heads, self.group, self.head_dim)
            scores = torch.einsum("thgd,lhd->hgtl", qq, k) * self.scale
            # Query i sits at position ctx - qlen + i and may see keys at positions <= it.
            q_pos = torch.arange(ctx - qlen, ctx, device=q.device)
            future = torch.arange(ctx, device=q.device)[None, :] > q_pos[:, None]
            scores = scores.masked_fill(future, float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            o = torch.einsum("hgtl,lhd->thgd", probs, v)
            out[start:start + qlen] = o.reshape(qlen, -1)
            start += qlen
        return out

    def _decode(self, q, meta):
        if self.fused_fits(q):
            return fused.paged_decode_attention(q, self.k_cache, self.v_cache, meta.block_tables,
                                                meta.context_lens, self.scale)
        b = q.shape[0]
        k = self._gather(self.k_cache, meta.block_tables)  # [B, L, Hkv, D]
        v = self._gather(self.v_cache, meta.block_tables)
        qq = q.view(b, self.num_kv_heads, self.group, self.head_dim)
        scores = torch.einsum("bhgd,blhd->bhgl", qq, k) * self.scale
        past_end = torch.arange(k.shape[1], device=q.device)[None, :] >= meta.context_lens[:, None]
        scores = scores.masked_fill(past_end[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.einsum("bhgl,blhd->bhgd", probs, v).reshape(b, -1)
