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
        """Copy this rank's slice of checkpoint shard ``shard_id`` (already cut for this
        rank) in place into its rows of ``param``; a wrong shape is refused before the copy."""
        offset, rows = self.shard_rows(shard_id)
        dest = param.data.narrow(0, offset, rows)
        name = getattr(param, "param_name", "weight")
        what = name if shard_id is None else f"{name}[{shard_id}]"
        if tuple(local.shape) != tuple(dest.shape):
            raise ValueError(f"{what}: this rank's shard has shape {tuple(local.shape)}, rows "
                             f"{offset}:{offset + rows} expect {tuple(dest.shape)}")
        dest.copy_(local)

    def _shard(self, loaded: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice of a full checkpoint tensor along ``dim``."""
        size = loaded.shape[dim] // self.tp_size
        return loaded.narrow(dim, self.tp_rank * size, size)

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
        """Output ``shard_id`` (0: gate, 1: up) sits after the earlier outputs' rows."""
        return sum(self.output_sizes[:shard_id]) // self.tp_size, self.output_sizes[shard_id] // self.tp_size

    def weight_loader(self, param, loaded, shard_id: int):
        """Check gate (0) or up (1) in full, keep this rank's rows, put them in their place."""
        check_shape(f"{param.param_name}[{shard_id}]", loaded, (self.output_sizes[shard_id], self.in_features))
        self.local_loader(param, self._shard(loaded, 0), shard_id)


class QKVParallelLinear(LinearBase):
    """q, k and v projections stacked into one weight; heads split across ranks."""

    shard_ids = ("q", "k", "v")

    def __init__(self, hidden_size, head_dim, num_heads, num_kv_heads, tp_rank=0, tp_size=1,
                 quant_method=None):
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp_size, "num_attention_heads")
        self.num_kv_heads = divide(num_kv_heads, tp_size, "num_key_value_heads")
        self.full_sizes = {"q": num_heads * head_dim, "k": num_kv_heads * head_dim, "v": num_kv_heads * head_dim}
        q, kv = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.offsets = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}
        super().__init__(hidden_size, q + 2 * kv, tp_rank, tp_size, 0, quant_method)

    def shard_rows(self, shard_id: str) -> tuple[int, int]:
        """This rank's q heads first, then its k heads, then its v heads."""
        return self.offsets[shard_id]

    def weight_loader(self, param, loaded, shard_id: str):
        """Check q, k or v in full, keep this rank's heads, put them in their place."""
        check_shape(f"{param.param_name}[{shard_id}]", loaded, (self.full_sizes[shard_id], self.in_features))
        self.local_loader(param, self._shard(loaded, 0), shard_id)
