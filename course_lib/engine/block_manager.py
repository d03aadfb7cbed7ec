"""Paged KV blocks with hash-chained prefix caching.

The KV pool is cut into fixed-size blocks; a sequence owns a list of them (its block
table). A full block's hash chains the previous block's hash with its tokens, so equal
hashes mean equal prefixes: a new request whose leading blocks hash the same reuses them
(ref-counted) instead of recomputing their KV. ``salt`` seeds the chain: changing it (for
example to the weight version) makes every old entry unreachable, as ``flush`` does.
"""
from __future__ import annotations

from collections import deque

from course_lib.engine.sequence import Sequence


class Block:
    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.token_ids: list[int] = []

    def update(self, h: int, token_ids: list[int]):
        self.hash, self.token_ids = h, list(token_ids)

    def reset(self):
        self.ref_count, self.hash, self.token_ids = 1, -1, []


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.used_block_ids: set[int] = set()
        self.salt: object = 0
        self.hit_tokens = 0      # prefix-cache tokens reused, since start
        self.queried_tokens = 0  # prompt tokens looked up, since start

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def compute_hash(self, token_ids: list[int], prefix: int) -> int:
        """The key of one full block: its tokens, chained to ``prefix`` (the previous block's
        hash, -1 for the first block) and to ``self.salt`` (the weights' cache epoch)."""
        # BEGIN EXERCISE ch01.block_hash
        return hash((self.salt, prefix, tuple(token_ids)))
        # END EXERCISE

    def _allocate_block(self, block_id: int) -> Block:
        block = self.blocks[block_id]
        assert block.ref_count == 0
        block.reset()
        self.free_block_ids.remove(block_id)
        self.used_block_ids.add(block_id)
        return block

    def _deallocate_block(self, block_id: int):
        self.used_block_ids.remove(block_id)
        self.free_block_ids.append(block_id)

    def can_allocate(self, seq: Sequence) -> bool:
        return self.num_free_blocks >= seq.num_blocks

    def allocate(self, seq: Sequence, use_cache: bool = True) -> None:
        """Give ``seq`` blocks for all its tokens, reusing cached prefix blocks where they hash equal."""
        assert not seq.block_table
        seq.kv_epoch = self.salt  # the weights this KV is computed with (see Engine.live_kv_is_fresh)
        use_cache = use_cache and self.enable_prefix_caching
        h, miss = -1, False
        for i in range(seq.num_blocks):
            tokens = seq.block(i)
            full = len(tokens) == self.block_size
            h = self.compute_hash(tokens, h) if full else -1
            # The block holding the last token is always computed: its logits are needed.
            may_hit = use_cache and full and (i + 1) * self.block_size < seq.num_tokens
            block_id = self.hash_to_block_id.get(h, -1) if may_hit else -1
            if block_id == -1 or self.blocks[block_id].hash != h or self.blocks[block_id].token_ids != tokens:
                miss = True
            if miss:
                block = self._allocate_block(self.free_block_ids[0])
            else:
                seq.num_cached_tokens += self.block_size
                if block_id in self.used_block_ids:
                    block = self.blocks[block_id]
                    block.ref_count += 1
                else:
                    block = self._allocate_block(block_id)
            if full and use_cache:
                block.update(h, tokens)
                self.hash_to_block_id[h] = block.block_id
            seq.block_table.append(block.block_id)
        if use_cache:
            self.queried_tokens += seq.num_tokens
            self.hit_tokens += seq.num_cached_tokens

    def deallocate(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._deallocate_block(block_id)
        seq.num_cached_tokens = 0
        seq.block_table.clear()

    def can_append(self, seq: Sequence) -> bool:
        """Room for the KV of ``seq``'s last token (a new block when it starts one)."""
        return self.num_free_blocks >= (len(seq) % self.block_size == 1)

    def may_append(self, seq: Sequence) -> None:
        """Before a decode step: give the last token a block, or register a block it fills."""
        table = seq.block_table
        if len(seq) % self.block_size == 1:
            table.append(self._allocate_block(self.free_block_ids[0]).block_id)
        elif len(seq) % self.block_size == 0 and self.enable_prefix_caching:
            last = self.blocks[table[-1]]
            prefix = self.blocks[table[-2]].hash if len(table) > 1 else -1
            if prefix != -1 or len(table) == 1:
                tokens = seq.block(seq.num_blocks - 1)
                h = self.compute_hash(tokens, prefix)
                last.update(h, tokens)
                self.hash_to_block_id[h] = last.block_id

    def flush(self) -> int:
        """Forget every cached prefix (blocks in use keep their KV); returns entries cleared."""
        cleared = len(self.hash_to_block_id)
        self.hash_to_block_id.clear()
        for block in self.blocks:
            block.hash, block.token_ids = -1, []
        return cleared
