"""Hidden cases of chapter 04's test-writing part (ch04.commit_tests): the learner's tests of
the commit step pass on the reference step and fail on each buggy step below (suites.py says
how the share is scored). The buggy steps are plausible designs, each breaking one promise of
``CopyPlan.apply``; the learner has seen two others (the public cases), not these.
"""
import pytest
import torch

from course_lib.weights.commit import commit_checks
from course_lib.weights.commit.copy_plan import CopyPlan
from suites import as_function, reference_body, run_tests

TESTS = pytest.mark.exercise("ch04.commit_tests")


def _check(view, name, t):
    if view.shape != t.shape:
        raise ValueError(f"{name}: checkpoint tensor has shape {tuple(t.shape)}, expected {tuple(view.shape)}")


def _known(views, name):
    if name not in views:
        raise KeyError(f"checkpoint tensor {name!r} matches no parameter of this model")
    return views[name]


class FreshTensor(CopyPlan):
    """Copies into a clone of each view: the weights never see the values."""
    def apply(self, named_tensors):
        pairs = [(n, t) for n, t in named_tensors if _known(self.views, n) is not None]
        for n, t in pairs:
            _check(self.views[n], n, t)
        for n, t in pairs:
            self.views[n].clone().copy_(t)


class Rebinds(CopyPlan):
    """Points each view at a converted copy instead of writing into the memory it views."""
    def apply(self, named_tensors):
        pairs = [(n, t) for n, t in named_tensors if _known(self.views, n) is not None]
        for n, t in pairs:
            _check(self.views[n], n, t)
        for n, t in pairs:
            self.views[n].data = t.to(self.views[n].dtype)


class AdoptsSameDtype(CopyPlan):
    """Saves a copy where it can: a tensor already in its view's dtype is adopted (the view
    rebound to it, no copy); other tensors are copied in."""
    def apply(self, named_tensors):
        pairs = [(n, t) for n, t in named_tensors if _known(self.views, n) is not None]
        for n, t in pairs:
            _check(self.views[n], n, t)
        for n, t in pairs:
            if t.dtype == self.views[n].dtype:
                self.views[n].data = t
            else:
                self.views[n].copy_(t)


class TiedFails(CopyPlan):
    """Checks every shape first, skipping a tied name (None) only when copying."""
    def apply(self, named_tensors):
        pairs = list(named_tensors)
        for n, t in pairs:
            _check(_known(self.views, n), n, t)
        for n, t in pairs:
            if self.views[n] is not None:
                self.views[n].copy_(t)


class SkipsUnknown(CopyPlan):
    """Skips a name it does not know: a misspelt update 'succeeds'."""
    def apply(self, named_tensors):
        pairs = [(n, t) for n, t in named_tensors if self.views.get(n) is not None]
        for n, t in pairs:
            _check(self.views[n], n, t)
        for n, t in pairs:
            self.views[n].copy_(t)


class WritesWhileChecking(CopyPlan):
    """Checks and copies in one pass: a bad tensor late in the list leaves earlier ones written."""
    def apply(self, named_tensors):
        for n, t in named_tensors:
            view = _known(self.views, n)
            if view is not None:
                _check(view, n, t)
                view.copy_(t)


class Broadcasts(CopyPlan):
    """Leaves shapes to copy_: a broadcastable tensor is spread over its view."""
    def apply(self, named_tensors):
        pairs = [(n, t) for n, t in named_tensors if _known(self.views, n) is not None]
        for n, t in pairs:
            self.views[n].copy_(t)


class SameSizeReshaped(CopyPlan):
    """Checks sizes, not shapes: a transposed or flattened tensor of the same size is reshaped in."""
    def apply(self, named_tensors):
        pairs = [(n, t) for n, t in named_tensors if _known(self.views, n) is not None]
        for n, t in pairs:
            if self.views[n].numel() != t.numel():
                raise ValueError(f"{n}: {t.numel()} elements, expected {self.views[n].numel()}")
        for n, t in pairs:
            self.views[n].copy_(t.reshape(self.views[n].shape))


class ReadsTwice(CopyPlan):
    """Checks in one pass over the input and copies in a second: a generator is empty the second time."""
    def apply(self, named_tensors):
        for n, t in named_tensors:
            if _known(self.views, n) is not None:
                _check(self.views[n], n, t)
        for n, t in named_tensors:
            if self.views[n] is not None:
                self.views[n].copy_(t)


class StagesConverted(CopyPlan):
    """Converts each tensor to its view's dtype first, then copies: a staged copy of every tensor."""
    def apply(self, named_tensors):
        pairs = [(n, t) for n, t in named_tensors if _known(self.views, n) is not None]
        for n, t in pairs:
            _check(self.views[n], n, t)
        for n, t in pairs:
            self.views[n].copy_(t.to(self.views[n].dtype).contiguous().clone())


class WrongError(CopyPlan):
    """Refuses an unknown name with ValueError (the contract says KeyError, as a dict lookup does)."""
    def apply(self, named_tensors):
        pairs = list(named_tensors)
        for n, t in pairs:
            if n not in self.views:
                raise ValueError(f"checkpoint tensor {n!r} matches no parameter of this model")
            if self.views[n] is not None:
                _check(self.views[n], n, t)
        for n, t in pairs:
            if self.views[n] is not None:
                self.views[n].copy_(t)


BUGGY = [FreshTensor, Rebinds, AdoptsSameDtype, TiedFails, SkipsUnknown, WritesWhileChecking, Broadcasts, SameSizeReshaped,
         ReadsTwice, StagesConverted, WrongError]


@TESTS
def test_commit_tests__pass_on_the_reference_commit_step(reference_root):
    body = reference_body(reference_root, "weights/commit/copy_plan.py", "ch04.copy_in_place")
    plan = type("Reference", (CopyPlan,), {"apply": as_function(CopyPlan.apply, body)})
    failed = run_tests(commit_checks.check_commit_step, plan.from_views)
    assert failed is None, (f"your check_commit_step fails on the reference commit step, which keeps the whole "
                            f"contract: {failed}; a test must pass on every right design")


# Neutral case names: a learner's report says how many buggy steps passed, not which bug each has.
@TESTS
@pytest.mark.parametrize("buggy", BUGGY, ids=[f"hidden step {i + 1}" for i in range(len(BUGGY))])
def test_commit_tests_catches_a_buggy_step(buggy):
    failed = run_tests(commit_checks.check_commit_step, buggy.from_views)
    assert failed is not None, ("your check_commit_step passes on a commit step that breaks a promise of "
                                "CopyPlan.apply's contract: which promise does none of your checks test?")
