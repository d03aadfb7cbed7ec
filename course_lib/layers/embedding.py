"""Token embedding and LM head, split over the vocabulary across tensor-parallel ranks."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib.layers.linear import divide, check_shape


class VocabParallelEmbedding(nn.Module):
    """Rank r holds vocabulary rows [r*V/tp, (r+1)*V/tp)."""

    tp_dim = 0  # the dimension split across ranks: vocabulary rows

    def __init__(self, vocab_size: int, hidden_size: int, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.vocab_size = vocab_size
        self.rows = divide(vocab_size, tp_size, "vocab_size")
        self.start = tp_rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.weight.local_loader = self.local_loader

    def weight_loader(self, param, loaded, shard_id=None):
        """Check the full [vocab, hidden] table, keep this rank's vocabulary rows."""
        check_shape(param.param_name, loaded, (self.vocab_size, param.shape[1]))
        self.local_loader(param, loaded.narrow(0, self.start, self.rows))

    def local_loader(self, param, local, shard_id=None):
        """Copy this rank's vocabulary rows (already cut) in place."""
        check_shape(f"{param.param_name} (rank {self.tp_rank}'s rows)", local, param.shape)
        param.data.copy_(local)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mine = (local >= 0) & (local < self.rows)
        y = F.embedding(local.clamp(0, self.rows - 1), self.weight) * mine.unsqueeze(-1)
        dist.all_reduce(y)
        return y


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for this rank's vocabulary slice, gathered into the full vocabulary."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        if self.tp_size > 1:
            parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
            dist.all_gather(parts, logits)
            logits = torch.cat(parts, dim=-1)
        return logits
