"""Public tests for chapter 01's exercises (run them: python practice/judge.py test ch01).

Each test's name starts with its exercise's name, so ``-k qkv_rows`` runs one exercise:

- ch01.qkv_rows: ``QKVParallelLinear.shard_rows`` in course_lib/layers/linear.py
- ch01.gate_up_rows: ``MergedColumnParallelLinear.shard_rows`` (same file)
- ch01.tp_slice: ``LinearBase._shard`` (same file)
- ch01.local_loader: ``LinearBase.local_loader`` (same file)
- ch01.block_hash: ``BlockManager.compute_hash`` in course_lib/engine/block_manager.py

Each case says what it expected in words.
"""
import pytest
import torch

from course_lib.engine.block_manager import BlockManager
from course_lib.engine.sequence import SamplingParams, Sequence
from course_lib.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                      RowParallelLinear)

GREEDY = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
qkv_rows = pytest.mark.exercise("ch01.qkv_rows")
gate_up_rows = pytest.mark.exercise("ch01.gate_up_rows")
tp_slice = pytest.mark.exercise("ch01.tp_slice")
local_loader = pytest.mark.exercise("ch01.local_loader")
block_hash = pytest.mark.exercise("ch01.block_hash")


# ---- ch01.qkv_rows ---------------------------------------------------------------------

@qkv_rows
def test_qkv_rows_one_rank_grouped_query():
    # 4 query heads, 2 key/value heads, 16 rows per head: q is 64 rows, k and v 32 each.
    layer = QKVParallelLinear(64, 16, 4, 2)
    got = {s: tuple(layer.shard_rows(s)) for s in "qkv"}
    assert got == {"q": (0, 64), "k": (64, 32), "v": (96, 32)}, \
        f"expected q at rows 0..64, k at 64..96, v at 96..128 (k and v have 2 heads, not 4); got {got}"


@qkv_rows
def test_qkv_rows_two_ranks_split_the_heads():
    # Per rank: 2 query heads and 1 key/value head of 16 rows; the same answer on both ranks.
    for rank in (0, 1):
        layer = QKVParallelLinear(64, 16, 4, 2, tp_rank=rank, tp_size=2)
        got = {s: tuple(layer.shard_rows(s)) for s in "qkv"}
        assert got == {"q": (0, 32), "k": (32, 16), "v": (48, 16)}, \
            f"rank {rank} of 2 holds half the heads: expected q 0..32, k 32..48, v 48..64; got {got}"


@qkv_rows
def test_qkv_rows_refuses_an_unknown_shard():
    with pytest.raises(ValueError):
        QKVParallelLinear(64, 16, 4, 2).shard_rows("o")


# ---- ch01.gate_up_rows -----------------------------------------------------------------

@gate_up_rows
def test_gate_up_rows_one_rank():
    layer = MergedColumnParallelLinear(64, [128, 128])
    got = [tuple(layer.shard_rows(i)) for i in (0, 1)]
    assert got == [(0, 128), (128, 128)], f"expected gate at rows 0..128 and up at 128..256; got {got}"


@gate_up_rows
def test_gate_up_rows_two_ranks_and_unequal_outputs():
    # Outputs of 8 and 12 rows over 2 ranks: each rank holds 4 + 6 rows.
    for rank in (0, 1):
        layer = MergedColumnParallelLinear(16, [8, 12], tp_rank=rank, tp_size=2)
        got = [tuple(layer.shard_rows(i)) for i in (0, 1)]
        assert got == [(0, 4), (4, 6)], f"rank {rank} of 2: expected output 0 at rows 0..4, output 1 at 4..10; got {got}"


@gate_up_rows
def test_gate_up_rows_refuses_an_unknown_shard():
    with pytest.raises(ValueError):
        MergedColumnParallelLinear(64, [128, 128]).shard_rows(2)


# ---- ch01.tp_slice ---------------------------------------------------------------------

@tp_slice
def test_tp_slice_keeps_this_ranks_rows_or_columns():
    full = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    for rank in (0, 1):
        rows = ColumnParallelLinear(6, 8, tp_rank=rank, tp_size=2)._shard(full, 0)
        assert torch.equal(rows, full[4 * rank:4 * rank + 4]), f"rank {rank} of 2 along dim 0: rows {4 * rank}..{4 * rank + 4}"
        cols = RowParallelLinear(6, 8, tp_rank=rank, tp_size=2)._shard(full, 1)
        assert torch.equal(cols, full[:, 3 * rank:3 * rank + 3]), \
            f"rank {rank} of 2 along dim 1: columns {3 * rank}..{3 * rank + 3}, every row"


@tp_slice
def test_tp_slice_is_a_view_not_a_copy():
    full = torch.randn(8, 6)
    part = ColumnParallelLinear(6, 8, tp_rank=1, tp_size=2)._shard(full, 0)
    assert part.untyped_storage().data_ptr() == full.untyped_storage().data_ptr(), \
        "the slice should share the checkpoint tensor's storage (narrow), not copy it"


@tp_slice
def test_tp_slice_refuses_an_uneven_split():
    with pytest.raises(ValueError):
        ColumnParallelLinear(6, 8, tp_rank=0, tp_size=2)._shard(torch.randn(7, 6), 0)


# ---- ch01.local_loader -----------------------------------------------------------------

def _qkv_param():
    layer = QKVParallelLinear(8, 2, 4, 2)  # q: rows 0..8, k: 8..12, v: 12..16
    layer.weight.data.zero_()
    layer.weight.param_name = "qkv_proj.weight"
    return layer, layer.weight


@local_loader
def test_local_loader_writes_only_its_rows_in_place():
    layer, param = _qkv_param()
    address = param.data_ptr()
    k = torch.randn(4, 8)
    layer.local_loader(param, k, "k")
    assert param.data_ptr() == address, "storage address changed: copy into the rows in place, never bind a new tensor"
    assert torch.equal(param[8:12], k), "k's rows (8..12) should hold the shard"
    assert not param[:8].any() and not param[12:].any(), "rows of q and v must not change when k is loaded"


@local_loader
def test_local_loader_refuses_a_wrong_shape_and_writes_nothing():
    layer, param = _qkv_param()
    for bad in (torch.randn(8, 4), torch.randn(1, 8), torch.randn(4, 9)):
        with pytest.raises(ValueError):
            layer.local_loader(param, bad, "k")
        assert not param.any(), f"a refused shard of shape {tuple(bad.shape)} wrote into the weight"


@local_loader
def test_local_loader_is_the_load_path_of_a_plain_layer():
    layer = ColumnParallelLinear(6, 8, tp_rank=1, tp_size=2)
    layer.weight.param_name = "proj.weight"
    address = layer.weight.data_ptr()
    full = torch.randn(8, 6)
    layer.weight_loader(layer.weight, full)  # checks the full tensor, slices it, then calls local_loader
    assert torch.equal(layer.weight, full[4:]), "rank 1 of 2 should hold rows 4..8 of the checkpoint tensor"
    assert layer.weight.data_ptr() == address, "storage address changed while loading"


# ---- ch01.block_hash -------------------------------------------------------------------

@block_hash
def test_block_hash_is_an_int_and_repeatable():
    bm = BlockManager(num_blocks=8, block_size=4)
    h = bm.compute_hash([1, 2, 3, 4], -1)
    assert isinstance(h, int), f"compute_hash must return an int, got {type(h).__name__}"
    assert h == bm.compute_hash([1, 2, 3, 4], -1), "the same tokens after the same prefix must hash the same"


@block_hash
def test_block_hash_depends_on_the_tokens_and_their_order():
    bm = BlockManager(num_blocks=8, block_size=4)
    h = bm.compute_hash([1, 2, 3, 4], -1)
    assert h != bm.compute_hash([1, 2, 3, 5], -1), "different tokens must hash differently"
    assert h != bm.compute_hash([4, 3, 2, 1], -1), "the same tokens in another order must hash differently"


@block_hash
def test_block_hash_chains_the_previous_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    after_x = bm.compute_hash([5, 6, 7, 8], bm.compute_hash([1, 2, 3, 4], -1))
    after_z = bm.compute_hash([5, 6, 7, 8], bm.compute_hash([9, 9, 9, 9], -1))
    assert after_x != after_z, ("the same tokens after a different prefix must hash differently: "
                                "their KV differs, so the cache must not reuse one for the other")


@block_hash
def test_block_hash_includes_the_salt():
    bm = BlockManager(num_blocks=8, block_size=4)
    before = bm.compute_hash([1, 2, 3, 4], -1)
    bm.salt = 1  # what a weight update does: old entries must never match again
    assert bm.compute_hash([1, 2, 3, 4], -1) != before, "changing BlockManager.salt must change every hash"


@block_hash
def test_block_hash_prefix_cache_reuses_a_shared_prefix_and_nothing_else():
    bm = BlockManager(num_blocks=32, block_size=4)
    x, y, z = [1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]

    def cached(tokens):
        seq = Sequence(tokens, GREEDY, block_size=4)
        bm.allocate(seq)
        served = seq.num_cached_tokens  # deallocate resets it
        bm.deallocate(seq)
        return served

    assert cached(x + y + [0]) == 0, "an empty cache serves nothing"
    assert cached(x + y + [7]) == 8, "x + y was cached by the first request: 8 tokens should be served"
    assert cached(z + y + [7]) == 0, "y after z is not y after x: nothing should be served"
