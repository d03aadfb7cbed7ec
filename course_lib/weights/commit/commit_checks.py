"""Tests of the commit step, from its contract alone: chapter 04's test-writing part.

``check_commit_step`` is handed a way to build a commit step (``plan_for(views)`` returns an
object whose ``apply`` is the step under test, as ``CopyPlan.from_views`` does) and raises
when that step breaks a promise of ``CopyPlan.apply``'s docstring. It is graded by what it
tells apart: it must pass on a right commit step and fail on wrong ones the learner has not
seen. The engine never calls it; an engineer changing the commit step can run it against a
new design before the CUDA suite does: ``check_commit_step(CopyPlan.from_views)``.
"""
from __future__ import annotations

from typing import Callable

import torch

from course_lib.cost import AllocationWatch  # noqa: F401 - the chapter's tool, used here and by the learner


def check_commit_step(plan_for: Callable[[dict], object]) -> None:
    """Raise (an AssertionError whose message names the promise) when the commit step built
    by ``plan_for`` breaks a promise of ``CopyPlan.apply``; return None when it keeps them all.

    ``plan_for(views)`` takes ``{checkpoint name: the tensor to write, or None}`` and returns a
    fresh plan over those views (tensors you make: no model needed); its ``apply`` is under test.

    Promises: it passes on every right commit step (one copy per tensor or grouped, checks in
    any order), fails on a step that breaks any promise of the contract (values, dtype, memory,
    what is read, what is refused and with which error, what a refusal leaves behind, no
    staged copies), runs on a CPU in a few seconds, and gives the same verdict every run.
    """
    # BEGIN EXERCISE ch04.commit_tests
    def fresh():  # the views the engine hands a step: two dtypes, two row ranges of one fused tensor, a tied name
        fused = torch.zeros(6, 4)
        return fused, {"w": torch.zeros(3, 4), "norm": torch.zeros(5, dtype=torch.bfloat16),
                       "q": fused.narrow(0, 0, 2), "k": fused.narrow(0, 2, 4), "lm_head": None}

    g = torch.Generator().manual_seed(0)
    src = {"w": torch.randn(4, 3, generator=g, dtype=torch.float64).t(),  # another dtype, not contiguous
           "norm": torch.randn(5, generator=g), "q": torch.randn(2, 4, generator=g),
           "k": torch.randn(4, 4, generator=g), "lm_head": torch.randn(7, 7, generator=g)}

    # Values land in the views' memory in their dtype, from a generator, tied name skipped, nothing staged.
    fused, views = fresh()
    ptrs = {k: v.data_ptr() for k, v in views.items() if v is not None}
    with (watch := AllocationWatch()):
        plan_for(views).apply(pair for pair in src.items())
    for k, ptr in ptrs.items():
        assert views[k].data_ptr() == ptr, f"{k!r}: the view now points at other memory (rebound, not written)"
        assert torch.equal(views[k], src[k].to(views[k].dtype)), f"{k!r}: the view does not hold its tensor's values"
    assert torch.equal(fused, torch.cat([src["q"], src["k"]])), "the fused tensor does not hold both views' rows"
    staged = [(op, n) for op, n in watch.new if n >= min(src[k].numel() * views[k].element_size() for k in ptrs)]
    assert not staged, f"the step allocated tensors while copying (staged copies): {staged}"

    # Empty and partial updates: only the named views change.
    fused, views = fresh()
    (plan := plan_for(views)).apply([])
    assert not fused.any() and not views["w"].any() and not views["norm"].any(), "an empty update wrote something"
    plan.apply([("k", src["k"])])
    assert torch.equal(views["k"], src["k"]) and not views["q"].any() and not views["w"].any(), \
        "a partial update must write its own views and nothing else"

    # Refusals, wherever the bad entry sits: the error the contract names, and nothing written.
    refusals = [(f"a {label} tensor {tuple(bad.shape)} for the (3, 4) view", "w", bad, ValueError) for label, bad in
                {"broadcastable": torch.ones(1, 4), "same size": torch.ones(4, 3), "flat": torch.ones(12),
                 "one more dim": torch.ones(1, 3, 4)}.items()] + [("an unknown name", "nope", torch.ones(3, 4), KeyError)]
    for what, name, bad, error in refusals:
        for where in ("first", "last"):
            fused, views = fresh()
            good = [(k, v) for k, v in src.items() if k != name]
            before = {k: v.clone() for k, v in {"the fused tensor": fused, **views}.items() if v is not None}
            try:
                plan_for(views).apply(iter([(name, bad)] + good if where == "first" else good + [(name, bad)]))
            except error as e:
                assert name in str(e), f"the {error.__name__} for {what} must name {name!r}: {e}"
            else:
                raise AssertionError(f"{what}, {where} in the update, was not refused with {error.__name__}")
            written = [k for k, v in before.items() if not torch.equal(v, {"the fused tensor": fused, **views}[k])]
            assert not written, f"{what}, {where} in the update: {written} written although the update was refused"
    # END EXERCISE
