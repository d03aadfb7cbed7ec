"""Hidden tests for ch01.block_hash: the learner's hash inside the real engine, on fresh random prompts."""
import os
import random

import pytest

from course_lib import Engine
from course_lib.engine.block_manager import BlockManager
from course_lib.engine.sequence import SamplingParams, Sequence
from course_lib.weights.checkpoint import make_random

pytestmark = pytest.mark.exercise("ch01.block_hash")
GREEDY = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def rng():
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    return random.Random(seed)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, rng):
    return make_random(tmp_path_factory.mktemp("ckpt"), "tiny", seed=rng.randrange(10_000))


def _tokens(rng, n):
    return [rng.randrange(256) for _ in range(n)]


def _prompts(rng, bs):
    x, y = _tokens(rng, bs), _tokens(rng, bs)
    z = _tokens(rng, bs)
    while z == x:
        z = _tokens(rng, bs)
    system = _tokens(rng, bs * rng.randint(2, 3))

    def tail():
        return _tokens(rng, rng.randint(1, bs - 1))

    return [x + y + tail(), z + y + tail(), x + y + tail(), z + y + y + tail(),
            system + tail(), system + _tokens(rng, bs) + tail(), system[:bs] + tail()]


def _expected_cached(prompts, bs):
    """What a correct chained hash serves: whole blocks of the longest prefix an earlier prompt shares
    (never the block holding the last token, whose logits are needed)."""
    out = []
    for i, p in enumerate(prompts):
        best = 0
        for e in prompts[:i]:
            n = 0
            while n < min(len(p), len(e)) and p[n] == e[n]:
                n += 1
            best = max(best, n)
        out.append(min(best // bs, (len(p) - 1) // bs) * bs)
    return out


@pytest.mark.parametrize("bs", [4, 8])
def test_engine_outputs_equal_no_cache_and_cache_serves_exactly_the_shared_blocks(ckpt, rng, bs):
    prompts = _prompts(rng, bs)
    engine = Engine(ckpt, block_size=bs)
    cold = Engine(ckpt, block_size=bs, enable_prefix_caching=False)
    want = _expected_cached(prompts, bs)
    for i, p in enumerate(prompts):
        got = engine.generate(input_ids=[p], sampling_params=GREEDY)[0]
        ref = cold.generate(input_ids=[p], sampling_params=GREEDY)[0]
        where = f"block size {bs}, request {i + 1} of {len(prompts)} ({len(p)} tokens)"
        assert got["output_ids"] == ref["output_ids"], \
            f"{where}: the output differs from an engine with no prefix cache (a block's KV was reused wrongly)"
        assert got["meta_info"]["cached_tokens"] == want[i], \
            f"{where}: the cache served {got['meta_info']['cached_tokens']} tokens, a chained hash serves {want[i]}"


def test_hash_differs_for_blocks_after_different_prefixes(rng):
    bm = BlockManager(num_blocks=8, block_size=4)
    for _ in range(20):
        a, b, block = _tokens(rng, 4), _tokens(rng, 4), _tokens(rng, 4)
        if a == b:
            continue
        ha, hb = bm.compute_hash(a, -1), bm.compute_hash(b, -1)
        assert bm.compute_hash(block, ha) != bm.compute_hash(block, hb), \
            f"block {block} hashes the same after {a} and after {b}"


def test_hash_is_order_sensitive_and_salted(rng):
    bm = BlockManager(num_blocks=8, block_size=4)
    block = rng.sample(range(256), 4)
    assert bm.compute_hash(block, -1) != bm.compute_hash(block[::-1], -1), f"{block} and its reverse hash the same"
    h = bm.compute_hash(block, 7)
    bm.salt = rng.randrange(1, 1000)
    assert bm.compute_hash(block, 7) != h, f"salt {bm.salt} gives the same hash as salt 0"


def test_a_new_salt_makes_every_cached_block_unreachable(rng):
    bm = BlockManager(num_blocks=32, block_size=4)
    params = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
    prompt = _tokens(rng, 13)
    for salt, want in [(0, 0), (0, 12), (5, 0), (5, 12)]:
        bm.salt = salt
        seq = Sequence(prompt, params, block_size=4)
        bm.allocate(seq)
        served = seq.num_cached_tokens  # deallocate resets it
        bm.deallocate(seq)
        assert served == want, f"with salt {salt} the cache served {served} tokens, expected {want}"
