"""Tests of the canary comparison, from its contract alone: chapter 09's test-writing part.

``check_compare_outputs`` is handed a comparison (``compare(expected, got)``, called as the
canary calls ``compare_outputs``) and raises when it breaks a promise of
``compare_outputs``' docstring. It is graded by what it tells apart: it must pass on a right
comparison and fail on wrong ones the learner has not seen. The engine never calls it; an
engineer changing the comparison can run it against a new design before a rollout trusts
it: ``check_compare_outputs(production.compare_outputs)``.
"""
from __future__ import annotations

import copy
import math
from typing import Callable


def check_compare_outputs(compare: Callable[[list, list], dict]) -> None:
    """Raise (an AssertionError whose message names the promise) when ``compare`` breaks a
    promise of ``compare_outputs``; return None when it keeps them all.

    ``compare(expected, got)`` takes two lists of answers (each a list of token ids) for the
    same requests and returns the comparison's dict, as ``compare_outputs`` does.

    Promises: it passes on every right comparison (however it finds the divergences, counts
    and averages), fails on one that breaks any promise of the contract (each request's
    divergence, the agreement, the matched fraction, what is refused and with which error,
    inputs left as they were, plain Python types), runs on a CPU in well under a second,
    and gives the same verdict every run.
    """
    # BEGIN EXERCISE ch09.compare_tests
    def run(expected, got):  # the caller's lists must come back exactly as they went in
        before = copy.deepcopy((expected, got))
        out = compare(expected, got)
        assert (expected, got) == before, f"the comparison changed its inputs: {before} became {(expected, got)}"
        return out

    def share(value, want, what, where):
        assert isinstance(value, float), f"{where}: {what} must be a float, not {value!r}"
        assert math.isclose(value, want, rel_tol=1e-9, abs_tol=1e-12), f"{where}: {what} must be {want}, not {value}"

    # (expected, got, where they part, share of expected reproduced before that): every way to part.
    table = [([1, 2, 3, 4], [1, 2, 9, 4], 2, 0.5),  # a token differs, the same length, the tail matches again
             ([5, 6, 7], [8, 6, 7], 0, 0.0),  # differs at the first token
             ([1, 2, 3, 4], [1, 2, 3], 3, 0.75),  # cut short
             ([1, 2], [1, 2, 3, 4], 2, 1.0),  # ran on: all of expected reproduced, yet not identical
             ([3, 4, 5], [], 0, 0.0), ([], [7, 7], 0, 0.0),  # empty where tokens were expected, and the reverse
             ([], [], None, 1.0), ([9, 8, 7, 6, 5], [9, 8, 7, 6, 5], None, 1.0),  # identical, empty or not
             ([1, 2, 3], [3, 2, 1], 0, 0.0)]  # the same tokens in another order
    for e, g, part, reproduced in table:
        where = f"expected {e}, got {g}"
        out = run([list(e)], [list(g)])
        firsts = out["first_divergence"]
        assert firsts == [part] and all(f is None or type(f) is int for f in firsts), \
            f"{where}: first_divergence must be [{part}] (a plain int, or None when identical), not {firsts!r}"
        share(out["agreement"], float(part is None), "agreement (1.0 only when identical)", where)
        share(out["matched_fraction"], reproduced, "matched_fraction", where)
    out = run([list(e) for e, *_ in table], [list(g) for _, g, *_ in table])
    where = f"all {len(table)} requests together"
    assert out["first_divergence"] == [p for *_, p, _ in table], f"{where}: one divergence per request, in order"
    share(out["agreement"], 2 / len(table), "agreement (the share of identical answers)", where)
    share(out["matched_fraction"], sum(r for *_, r in table) / len(table), "matched_fraction (a mean over requests)",
          where)

    # Refusals: sets of different sizes (either one the longer) name both counts; an empty set is no agreement.
    for expected, got in (([[1], [2], [3]], [[1], [2], [3], [4], [5]]), ([[6], [7], [8], [9]], [[6], [7]]), ([], [])):
        what = f"{len(expected)} expected answers and {len(got)} given" if expected else "an empty request set"
        try:
            run(expected, got)
        except ValueError as error:
            named = all(str(n) in str(error) for n in (len(expected), len(got)))
            assert named or not expected, f"{what}: the ValueError must name both counts: {error}"
        except Exception as other:  # noqa: BLE001 - the wrong error is a broken promise, said as one
            raise AssertionError(f"{what}: the comparison must refuse with ValueError, not {other!r}") from other
        else:
            raise AssertionError(f"{what}: the comparison must refuse with ValueError, not compare")
    # END EXERCISE
