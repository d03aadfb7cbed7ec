"""Hidden tests for partial-rollout-sync: fresh random prompts, lengths, overlap and weights; a
request that finishes before the sync, lengths where the first request asks for the fewest
tokens, and an empty batch.

The seed is in every message, so a failure can be replayed with ``run_case``.
"""
import random

import pytest

from rollouts import failures, run_case
from conftest import hidden_seed  # the judge's plugin: a fixed seed, so a grade repeats

SEED = hidden_seed()


@pytest.mark.parametrize("mode", ["keep", "retract", "abort", "wait"])
def test_random_batches(candidate, mode):
    rng = random.Random(f"{SEED}-{mode}")
    for _ in range(2):
        seed, n, overlap = rng.randrange(10 ** 6), rng.randint(2, 6), rng.randint(1, 5)
        problems = failures(run_case(candidate, mode, seed, n=n, overlap=overlap))
        assert not problems, f"(random seed {seed}, {n} prompts, overlap {overlap})\n" + "\n".join(problems)


def _check(candidate, mode, seed, overlap, lengths, what):
    problems = failures(run_case(candidate, mode, seed, overlap=overlap, lengths=lengths))
    assert not problems, f"{what} (random seed {seed}, overlap {overlap}, lengths {lengths})\n" + "\n".join(problems)


@pytest.mark.parametrize("mode", ["keep", "retract", "abort", "wait"])
def test_a_request_that_finishes_before_the_sync(candidate, mode):
    # A rollout short enough to end during the overlap steps: what step() returned then counts.
    rng = random.Random(f"{SEED}-early-{mode}")
    overlap = rng.randint(2, 5)
    lengths = rng.sample(range(overlap + 2, overlap + 10), rng.randint(1, 4))
    lengths.insert(rng.randrange(len(lengths) + 1), rng.randint(1, overlap))
    _check(candidate, mode, rng.randrange(10 ** 6), overlap, lengths, "one request finishes before the sync")


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_every_request_runs_to_its_own_length(candidate, mode):
    # The first request asks for the fewest tokens and the others for more, each a different
    # number: one length for every request (the first's) leaves the others short or unfinished.
    rng = random.Random(f"{SEED}-lengths-{mode}")
    overlap = rng.randint(1, 3)
    rest = rng.sample(range(overlap + 3, overlap + 14), rng.randint(2, 5))
    lengths = [min(rest) - rng.randint(1, 2)] + rest
    _check(candidate, mode, rng.randrange(10 ** 6), overlap, lengths, "the first request asks for the fewest tokens")


@pytest.mark.parametrize("mode", ["keep", "retract", "abort", "wait"])
def test_an_empty_batch_still_syncs(candidate, mode):
    # No prompts this round: no outputs, but the trainer's weights still go in, under the mode asked.
    rng = random.Random(f"{SEED}-empty-{mode}")
    _check(candidate, mode, rng.randrange(10 ** 6), rng.randint(1, 3), [], "an empty batch of prompts")
