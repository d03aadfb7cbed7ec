"""Public tests for partial-rollout-sync: one fixed case per pause mode.

The file under test arrives as the ``candidate`` fixture (the judge loads it).
"""
import pytest

from rollouts import failures, run_case


@pytest.mark.parametrize("mode", ["keep", "retract", "abort", "wait"])
def test_sync_in_the_middle_of_a_batch(candidate, mode):
    problems = failures(run_case(candidate, mode, seed=7))
    assert not problems, "\n".join(problems)
