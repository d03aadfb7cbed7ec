"""Linear layers whose parameters know how to load checkpoint tensors into themselves.

Each parameter gets two loaders, the second half of the first:

- ``weight_loader(param, loaded, shard_id=None)`` takes a full checkpoint tensor: it checks
  its shape, selects this tensor-parallel rank's slice, and hands it to
- ``local_loader(param, local, shard_id=None)``, which takes this rank's slice (a
  resharder delivers exactly that), checks its shape, and copies it *in place* into the
  rows ``shard_rows(shard_id)`` of the (possibly fused) parameter.

The in-place copy is the point: the load path at start-up is also the hot-update path,
and it never moves a tensor that a captured CUDA graph reads.

Layouts for ``tp_size`` ranks (rank ``r``):
- ColumnParallelLinear: output rows split; rank r holds rows [r*out/tp, (r+1)*out/tp).
- RowParallelLinear: input columns split; outputs are summed across ranks (all-reduce).
- MergedColumnParallelLinear: gate and up stacked; each is column-split, then stacked.
- QKVParallelLinear: q, k, v heads stacked; heads are split across ranks.

What a layer stores and how it multiplies is its ``quant_method``'s business (see
``quant.py``): unquantized, the loaders write straight into ``weight``; quantized,
``weight`` is a checkpoint-format shell whose loader stages the tensor for requantization.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from course_lib.layers.quant import UnquantizedLinearMethod


def check_shape(param_name: str, loaded: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"{param_name}: checkpoint tensor has shape {tuple(loaded.shape)}, "
                         f"expected {tuple(expected)}")


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    """Replicated parameter: same shape in the checkpoint and in the engine, so this is
    both its ``weight_loader`` and its ``local_loader``."""
    check_shape(getattr(param, "param_name", "parameter"), loaded, param.shape)
    param.data.copy_(loaded)


def divide(n: int, tp_size: int, what: str) -> int:
    """``n / tp_size``, refused (ValueError naming ``what``) when it does not divide."""
    if n % tp_size:
        raise ValueError(f"{what} ({n}) is not divisible by tensor_parallel_size ({tp_size})")
    return n // tp_size


class LinearBase(nn.Module):
    """A bias-free linear layer with a (checkpoint-format) weight of shape
    [out_per_rank, in_per_rank]; ``quant_method`` creates its tensors and computes it."""

    # The shard ids its weight_loader takes: a quantized layer is requantized only once
    # every one of them has arrived.
    shard_ids: tuple = (None,)

    def __init__(self, in_features: int, out_features: int, tp_rank: int = 0, tp_size: int = 1,
                 tp_dim: int | None = None, quant_method=None):
        super().__init__()
        self.tp_rank, self.tp_size, self.tp_dim = tp_rank, tp_size, tp_dim
        self.in_features, self.out_features = in_features, out_features
        self.quant_method = quant_method or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, in_features, out_features, torch.get_default_dtype())

    def shard_rows(self, shard_id=None) -> tuple[int, int]:
        """Where checkpoint shard ``shard_id`` lands in this rank's weight: (first row,
        number of rows). The one answer every loader, the copy plan, the resharder and
        ``get_weights_by_name`` ask for; a plain layer's single shard is all its rows."""
        return 0, self.out_features

    def local_loader(self, param, local: torch.Tensor, shard_id=None) -> None:
        """Copy this rank's part of checkpoint shard ``shard_id`` in place into its rows of ``param``.

        ``param``: this layer's weight (a Parameter, or the plain tensor a quantized layer
        stages into), shape [rows of all shards on this rank, in_per_rank]; it may carry a
        ``param_name`` attribute for messages. ``local``: the shard already cut for this
        rank. ``shard_id``: None for a plain layer, ``"q"``/``"k"``/``"v"`` or 0/1 for fused
        ones; the rows it owns are the ones exercises 1 and 2 of this chapter compute.

        Promises: those rows of ``param`` now equal ``local`` (its dtype converted to
        ``param``'s) and no other row changes; ``param``'s storage never moves (no new tensor
        is bound to it: captured CUDA graphs keep reading the same address).
        Errors: a ``local`` whose shape is not exactly the rows' shape (even one that would
        broadcast, or has the right number of elements) raises ValueError naming the
        parameter, the shard and both shapes, and nothing is written.
        """
        # BEGIN EXERCISE ch01.local_loader
        offset, rows = self.shard_rows(shard_id)
        dest = param.data.narrow(0, offset, rows)  # a view: writing it writes param's own memory
        name = getattr(param, "param_name", "weight")
        what = name if shard_id is None else f"{name}[{shard_id}]"
        if tuple(local.shape) != tuple(dest.shape):
            raise ValueError(f"{what}: this rank's shard has shape {tuple(local.shape)}, rows "
                             f"{offset}:{offset + rows} expect {tuple(dest.shape)}")
        dest.copy_(local)
        # END EXERCISE

    def _shard(self, loaded: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice of a full checkpoint tensor along ``dim``.

        ``loaded``: the whole tensor, as the checkpoint holds it; ``dim``: the dimension
        this layer splits (0: output rows, 1: input columns). Of ``self.tp_size`` equal,
        consecutive blocks along ``dim``, rank ``self.tp_rank`` keeps block number
        ``tp_rank``: indices [tp_rank * n / tp_size, (tp_rank + 1) * n / tp_size).

        Promises: a view of ``loaded`` (no copy: it shares ``loaded``'s storage), every
        other dimension whole. Errors: ValueError when ``loaded.shape[dim]`` is not
        divisible by ``tp_size``.
        """
        # BEGIN EXERCISE ch01.tp_slice
        n = loaded.shape[dim]
        if n % self.tp_size:
            raise ValueError(f"dimension {dim} of a tensor of shape {tuple(loaded.shape)} does not split "
                             f"into {self.tp_size} equal parts")
        size = n // self.tp_size
        return loaded.narrow(dim, self.tp_rank * size, size)
        # END EXERCISE

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x)


class ReplicatedLinear(LinearBase):
    def weight_loader(self, param, loaded, shard_id=None):
        """Every rank holds the whole tensor."""
        check_shape(getattr(param, "param_name", "parameter"), loaded, (self.out_features, self.in_features))
        self.local_loader(param, loaded)


class ColumnParallelLinear(LinearBase):
    def __init__(self, in_features, out_features, tp_rank=0, tp_size=1, quant_method=None):
        super().__init__(in_features, divide(out_features, tp_size, "output size"), tp_rank, tp_size, 0,
                         quant_method)
        self.full_out = out_features

    def weight_loader(self, param, loaded, shard_id=None):
        """Check the full [out, in] tensor, keep this rank's block of output rows."""
        check_shape(param.param_name, loaded, (self.full_out, self.in_features))
        self.local_loader(param, self._shard(loaded, 0))


class RowParallelLinear(LinearBase):
    def __init__(self, in_features, out_features, tp_rank=0, tp_size=1, quant_method=None):
        super().__init__(divide(in_features, tp_size, "input size"), out_features, tp_rank, tp_size, 1,
                         quant_method)
        self.full_in = in_features

    def weight_loader(self, param, loaded, shard_id=None):
        """Check the full [out, in] tensor, keep this rank's block of input columns."""
        check_shape(param.param_name, loaded, (self.out_features, self.full_in))
        self.local_loader(param, self._shard(loaded, 1))

    def forward(self, x):
        y = self.quant_method.apply(self, x)
        if self.tp_size > 1:
            dist.all_reduce(y)
        return y


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel outputs stacked into one weight (gate_proj and up_proj)."""

    def __init__(self, in_features, output_sizes: list[int], tp_rank=0, tp_size=1, quant_method=None):
        self.output_sizes = list(output_sizes)
        self.shard_ids = tuple(range(len(output_sizes)))
        for n in output_sizes:
            divide(n, tp_size, "output size")
        super().__init__(in_features, sum(output_sizes) // tp_size, tp_rank, tp_size, 0, quant_method)

    def shard_rows(self, shard_id: int) -> tuple[int, int]:
        """Where output ``shard_id`` lands in this rank's fused weight: (first row, rows).

        ``self.output_sizes`` holds each output's full (checkpoint) row count, in stacking
        order (for the MLP: [gate, up], so shard 0 is gate and 1 is up); each output is
        split evenly over ``self.tp_size`` ranks, and a rank stacks its part of every
        output in that order. So output ``shard_id`` starts after this rank's parts of
        the outputs before it. The answer is the same on every rank.
        Errors: a ``shard_id`` that is not an index into ``output_sizes`` raises ValueError.
        """
        # BEGIN EXERCISE ch01.gate_up_rows
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"this layer stacks {len(self.output_sizes)} outputs; "
                             f"shard id {shard_id!r} is not one of them")
        first = sum(size // self.tp_size for size in self.output_sizes[:shard_id])
        return first, self.output_sizes[shard_id] // self.tp_size
        # END EXERCISE

    def weight_loader(self, param, loaded, shard_id: int):
        """Check gate (0) or up (1) in full, keep this rank's rows, put them in their place."""
        check_shape(f"{param.param_name}[{shard_id}]", loaded, (self.output_sizes[shard_id], self.in_features))
        self.local_loader(param, self._shard(loaded, 0), shard_id)


class QKVParallelLinear(LinearBase):
    """q, k and v projections stacked into one weight; heads split across ranks."""

    shard_ids = ("q", "k", "v")

    def __init__(self, hidden_size, head_dim, num_heads, num_kv_heads, tp_rank=0, tp_size=1,
                 quant_method=None):
        # The checkpoint's totals; each rank holds num_heads / tp_size of them (see shard_rows).
        self.head_dim, self.total_num_heads, self.total_num_kv_heads = head_dim, num_heads, num_kv_heads
        divide(num_heads, tp_size, "num_attention_heads")
        divide(num_kv_heads, tp_size, "num_key_value_heads")
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim // tp_size, tp_rank, tp_size, 0,
                         quant_method)

    def shard_rows(self, shard_id: str) -> tuple[int, int]:
        """Where ``shard_id`` ("q", "k" or "v") lands in this rank's fused weight: (first row, rows).

        Inputs on the layer: ``self.total_num_heads`` query heads and
        ``self.total_num_kv_heads`` key/value heads in the checkpoint (fewer kv heads than
        q heads under grouped-query attention, one under multi-query), ``self.head_dim``
        rows per head, ``self.tp_size`` ranks that split the heads evenly. This rank's
        weight stacks its q heads first, then its k heads, then its v heads; k and v have
        one head_dim of rows per kv head. The answer is the same on every rank.
        Errors: any other ``shard_id`` raises ValueError.
        """
        # BEGIN EXERCISE ch01.qkv_rows
        q_rows = self.total_num_heads // self.tp_size * self.head_dim
        kv_rows = self.total_num_kv_heads // self.tp_size * self.head_dim
        if shard_id == "q":
            return 0, q_rows
        if shard_id == "k":
            return q_rows, kv_rows
        if shard_id == "v":
            return q_rows + kv_rows, kv_rows
        raise ValueError(f"qkv_proj stacks the shards 'q', 'k' and 'v'; {shard_id!r} is not one of them")
        # END EXERCISE

    def weight_loader(self, param, loaded, shard_id: str):
        """Check q, k or v in full, keep this rank's heads, put them in their place."""
        if shard_id not in self.shard_ids:
            raise ValueError(f"{param.param_name}: shard id {shard_id!r} is not one of {self.shard_ids}")
        heads = self.total_num_heads if shard_id == "q" else self.total_num_kv_heads
        check_shape(f"{param.param_name}[{shard_id}]", loaded, (heads * self.head_dim, self.in_features))
        self.local_loader(param, self._shard(loaded, 0), shard_id)
