"""Hidden tests for partial-rollout-sync: fresh random prompts, lengths, overlap and weights.

The seed is in every message, so a failure can be replayed with ``run_case``.
"""
import os
import random

import pytest

from rollouts import failures, run_case

SEED = int.from_bytes(os.urandom(4), "little")


@pytest.mark.parametrize("mode", ["keep", "retract", "abort", "wait"])
def test_random_batches(candidate, mode):
    rng = random.Random(f"{SEED}-{mode}")
    for _ in range(2):
        seed, n, overlap = rng.randrange(10 ** 6), rng.randint(2, 6), rng.randint(1, 5)
        problems = failures(run_case(candidate, mode, seed, n=n, overlap=overlap))
        assert not problems, f"(random seed {seed}, {n} prompts, overlap {overlap})\n" + "\n".join(problems)
