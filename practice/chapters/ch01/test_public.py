"""Public tests for chapter 01's exercises (run them: python practice/judge.py test ch01).

ch01.block_hash: ``BlockManager.compute_hash(token_ids, prefix)`` in
course_lib/engine/block_manager.py. Each case reports what it expected in words.
"""
import pytest

from course_lib.engine.block_manager import BlockManager
from course_lib.engine.sequence import SamplingParams, Sequence

pytestmark = pytest.mark.exercise("ch01.block_hash")
GREEDY = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)


def test_block_hash_is_an_int_and_repeatable():
    bm = BlockManager(num_blocks=8, block_size=4)
    h = bm.compute_hash([1, 2, 3, 4], -1)
    assert isinstance(h, int), f"compute_hash must return an int, got {type(h).__name__}"
    assert h == bm.compute_hash([1, 2, 3, 4], -1), "the same tokens after the same prefix must hash the same"


def test_block_hash_depends_on_the_tokens_and_their_order():
    bm = BlockManager(num_blocks=8, block_size=4)
    h = bm.compute_hash([1, 2, 3, 4], -1)
    assert h != bm.compute_hash([1, 2, 3, 5], -1), "different tokens must hash differently"
    assert h != bm.compute_hash([4, 3, 2, 1], -1), "the same tokens in another order must hash differently"


def test_block_hash_chains_the_previous_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    after_x = bm.compute_hash([5, 6, 7, 8], bm.compute_hash([1, 2, 3, 4], -1))
    after_z = bm.compute_hash([5, 6, 7, 8], bm.compute_hash([9, 9, 9, 9], -1))
    assert after_x != after_z, ("the same tokens after a different prefix must hash differently: "
                                "their KV differs, so the cache must not reuse one for the other")


def test_block_hash_includes_the_salt():
    bm = BlockManager(num_blocks=8, block_size=4)
    before = bm.compute_hash([1, 2, 3, 4], -1)
    bm.salt = 1  # what a weight update does: old entries must never match again
    assert bm.compute_hash([1, 2, 3, 4], -1) != before, "changing BlockManager.salt must change every hash"


def test_prefix_cache_reuses_a_shared_prefix_and_nothing_else():
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
