"""Hidden tests for notebooks/01_the_engine.ipynb: the learner's code inside the real engine.

``check_block_hash(block_hash)``: the learner's chained hash replaces the hash of a live
``BlockManager``; every output must equal an engine with no prefix cache, and the cache
must reuse exactly the tokens the engine's own hash reuses.

``check_predict_cached_tokens(predict)``: the learner predicts how many prompt tokens the
prefix cache will serve; the real engine serves the same prompts and reports the truth.

Both return a list of failure messages (empty: passed); see ``__init__.py`` for why.
"""
from __future__ import annotations

import os
import random
import tempfile

from course_lib import Engine
from course_lib.weights.checkpoint import make_random

GREEDY = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}


def plug_block_hash(engine: Engine, block_hash) -> Engine:
    """Make ``engine``'s block manager chain block hashes with ``block_hash(prev_hash, token_ids)``."""
    bm = engine.block_manager
    bm.compute_hash = lambda token_ids, prefix: hash((bm.salt, block_hash(prefix, list(token_ids))))
    return engine


def _rng(seed) -> random.Random:
    return random.Random(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))


def _serve_one_by_one(engine: Engine, prompts, params) -> list[dict]:
    """Each prompt alone, finished before the next arrives (so the cache state is well defined)."""
    return [engine.generate(input_ids=[list(p)], sampling_params=params)[0] for p in prompts]


def _block_hash_prompts(rng: random.Random, bs: int) -> list[list[int]]:
    def tokens(n):
        return [rng.randrange(256) for _ in range(n)]

    def tail():
        return tokens(rng.randint(1, bs - 1))

    x, y = tokens(bs), tokens(bs)
    z = tokens(bs)
    while z == x:
        z = tokens(bs)
    system = tokens(bs * rng.randint(2, 3))
    return [
        x + y + tail(),          # caches x, then y-after-x
        z + y + tail(),          # the same y block, after a different prefix
        x + y + tail(),          # may reuse x and y-after-x, never y-after-z
        z + y + y + tail(),      # the second y sits at another position: never the first y
        system + tail(),
        system + tokens(bs) + tail(),
        system[:bs] + tail(),
    ]


def check_block_hash(block_hash, seed=None) -> list[str]:
    """Failures of ``block_hash(prev_hash, token_ids) -> int`` plugged into a live engine."""
    rng = _rng(seed)
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        path = make_random(tmp, "tiny", seed=rng.randrange(10_000))
        for bs in (4, 8):
            prompts = _block_hash_prompts(rng, bs)
            try:  # the candidate first
                got = _serve_one_by_one(plug_block_hash(Engine(path, block_size=bs), block_hash), prompts, GREEDY)
            except Exception as exc:  # report, do not raise: see __init__.py
                return [f"the engine failed while using your block_hash: {type(exc).__name__}: {exc}"]
            ref = _serve_one_by_one(Engine(path, block_size=bs), prompts, GREEDY)
            cold = _serve_one_by_one(Engine(path, block_size=bs, enable_prefix_caching=False), prompts, GREEDY)
            for i, (p, g, r, c) in enumerate(zip(prompts, got, ref, cold), 1):
                where = f"block size {bs}, request {i} of {len(prompts)} ({len(p)} tokens)"
                if g["output_ids"] != c["output_ids"]:
                    failures.append(f"{where}: the output differs from an engine with no prefix cache, "
                                    f"so it reused KV that was computed after a different prefix")
                hit, want = g["meta_info"]["cached_tokens"], r["meta_info"]["cached_tokens"]
                if hit != want:
                    failures.append(f"{where}: the cache served {hit} prompt tokens with your hash; "
                                    f"it should serve {want}")
    return failures


def _prediction_prompts(rng: random.Random, bs: int) -> list[list[int]]:
    def tokens(n):
        return [rng.randrange(256) for _ in range(n)]

    system = tokens(rng.randint(2 * bs + 1, 3 * bs - 1))
    first = system + tokens(rng.randint(1, 2 * bs))
    other = tokens(rng.randint(2 * bs, 3 * bs))
    exact = tokens(3 * bs)  # a whole number of blocks
    cut = rng.randint(bs + 1, 2 * bs - 1)
    return [
        first,
        system + tokens(rng.randint(1, 2 * bs)),  # shares the system prompt
        other,
        list(first),                              # a repeat
        exact,
        list(exact),                              # a repeat that is a whole number of blocks
        other[:cut] + tokens(bs),                 # matches an older prompt, not the latest
        tokens(rng.randint(1, bs - 1)),           # shorter than one block
        system[: bs * 2],                         # a prefix of earlier prompts, whole blocks
    ]


def check_predict_cached_tokens(predict, seed=None) -> list[str]:
    """Failures of ``predict(prompt, earlier_prompts, block_size) -> int`` against the real engine."""
    rng = _rng(seed)
    cases = [(bs, _prediction_prompts(rng, bs)) for bs in (4, 8, 16)]
    try:  # the candidate first; it gets copies, so it cannot change the test's prompts
        predicted = [[predict(list(p), [list(e) for e in prompts[:i]], bs) for i, p in enumerate(prompts)]
                     for bs, prompts in cases]
    except Exception as exc:
        return [f"predict_cached_tokens raised {type(exc).__name__}: {exc}"]
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        path = make_random(tmp, "tiny", seed=rng.randrange(10_000))
        for (bs, prompts), guesses in zip(cases, predicted):
            served = _serve_one_by_one(Engine(path, block_size=bs), prompts, {"max_new_tokens": 1, "temperature": 0})
            for i, (p, guess, out) in enumerate(zip(prompts, guesses, served), 1):
                actual = out["meta_info"]["cached_tokens"]
                if guess != actual:
                    failures.append(f"block size {bs}, prompt {i} of {len(prompts)} ({len(p)} tokens, after "
                                    f"{i - 1} earlier prompts): you predicted {guess!r}, the engine reused {actual}")
    return failures
