"""Chapter 03's hidden scenarios are as wide as its regions: every boolean sub-condition of
every reference region takes both values under them (a maintainer's test: the hidden
scenarios are the instructor's).

Each region's function is rebuilt with every atomic condition wrapped in a recorder: the
tests of ``if``, ``while``, conditional expressions and comprehension filters, split
through ``and`` / ``or`` / ``not`` into their operands, and every comparison anywhere (a
tensor comparison, such as a mask handed to ``torch.where``, counts as True when some
element holds and False when some does not). The differential scenarios of
``practice/hidden/chapters/ch03`` then run on the rebuilt functions, in this process: each
test's explicit examples and as many drawn ones as a graded run draws. A condition that
never took one of its values names a scenario the hidden tests do not have. The recorder
itself is shown to report a condition that keeps one value.
"""
from __future__ import annotations

import __future__
import ast
import inspect
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
HIDDEN = REPO / "practice" / "hidden" / "chapters"
if not (HIDDEN / "ch03").is_dir():
    pytest.skip("the hidden tests are the instructor edition's", allow_module_level=True)
hypothesis = pytest.importorskip("hypothesis")
for folder in (REPO / "practice", HIDDEN / "shared", HIDDEN / "ch03"):
    sys.path.insert(0, str(folder))

from judging import regions  # noqa: E402
import scenarios_ch03  # noqa: E402
from engine_ops import EXAMPLES  # noqa: E402

with warnings.catch_warnings():  # its cases' marks are the judge's, registered by its plugin
    warnings.simplefilter("ignore", pytest.PytestUnknownMarkWarning)
    import test_differential as differential  # noqa: E402

from course_lib.layers import quant  # noqa: E402
from course_lib.weights.commit import layerwise  # noqa: E402


class Conditions(ast.NodeTransformer):
    """Wraps each atomic condition between lines ``lo`` and ``hi`` (1-based, of the parsed
    function) in ``_seen(id, value)``; ``ids`` lists them in order."""

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi, self.ids = lo, hi, []

    def wrap(self, node):
        if isinstance(node, ast.BoolOp):
            node.values = [self.wrap(v) for v in node.values]
            return node
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            node.operand = self.wrap(node.operand)
            return node
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_seen":
            return node
        if not self.lo <= node.lineno <= self.hi:
            return node
        cid = f"line {node.lineno - self.lo + 1}: {ast.unparse(node)}"
        self.ids.append(cid)
        return ast.copy_location(ast.Call(ast.Name("_seen", ast.Load()), [ast.Constant(cid), node], []), node)

    def _test(self, node):
        self.generic_visit(node)
        node.test = self.wrap(node.test)
        return node

    visit_If = visit_While = visit_IfExp = visit_Assert = _test

    def visit_comprehension(self, node):
        self.generic_visit(node)
        node.ifs = [self.wrap(c) for c in node.ifs]
        return node

    def visit_BoolOp(self, node):
        self.generic_visit(node)
        return self.wrap(node)

    def visit_Compare(self, node):
        self.generic_visit(node)
        return self.wrap(node)


class Recorder:
    def __init__(self):
        self.seen: dict[str, set[bool]] = {}

    def __call__(self, cid, value):
        got = self.seen.setdefault(cid, set())
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            if value.numel():
                got.update(({True} if bool(value.any()) else set()) | ({False} if not bool(value.all()) else set()))
        else:
            got.add(bool(value))
        return value


def instrumented(func, region, recorder: Recorder):
    """``func`` rebuilt with its region's conditions recorded; returns (function, ids)."""
    code = getattr(func, "__func__", func).__code__
    tree = ast.parse(textwrap.dedent(inspect.getsource(code)))
    first = code.co_firstlineno  # the file line of the parsed source's line 1 (the def, or a decorator)
    conditions = Conditions(region.begin + 3 - first, region.end + 1 - first)
    tree = ast.fix_missing_locations(conditions.visit(tree))
    namespace = dict(func.__globals__, _seen=recorder)
    # A file name outside the package: the engine's fast paths see a replaced part and stand aside.
    exec(compile(tree, f"<{region.id} with its conditions recorded>", "exec",
                 flags=__future__.annotations.compiler_flag, dont_inherit=True), namespace)
    return namespace[code.co_name], conditions.ids


TARGETS = {"ch03.quantize_int8": (quant, "quantize_int8_per_channel"),
           "ch03.quantize_fp8": (quant, "quantize_fp8_block"),
           "ch03.requantize_layers": (quant, "requantize_staged"),
           "ch03.layerwise_buffer": (layerwise.LayerwiseReload, "feed")}
CASES = {"ch03.quantize_int8": differential.test_quantize_int8_matches_the_reference,
         "ch03.quantize_fp8": differential.test_quantize_fp8_matches_the_reference,
         "ch03.requantize_layers": differential.test_requantize_layers_matches_the_reference,
         "ch03.layerwise_buffer": differential.test_layerwise_buffer_matches_the_reference}
SCENARIOS = {"ch03.quantize_int8": lambda kw: scenarios_ch03.quantize(**dict(kw["weight"], which="int8")),
             "ch03.quantize_fp8": lambda kw: scenarios_ch03.quantize(**dict(kw["weight"], which="fp8",
                                                                           block=kw["block"])),
             "ch03.requantize_layers": lambda kw: scenarios_ch03.requantize(**kw["case"]),
             "ch03.layerwise_buffer": lambda kw: scenarios_ch03.layerwise(**kw["case"])}


def ch03_regions():
    return {r.id: r for r in regions.find(REPO) if r.chapter == "ch03"}


def run_scenarios(exercise: str) -> None:
    """The exercise's differential scenarios, here: its explicit examples, then drawn ones."""
    test = CASES[exercise]
    for example in test.hypothesis_explicit_examples:
        SCENARIOS[exercise](example.kwargs)
    strategies = test.hypothesis._given_kwargs

    @hypothesis.settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(**strategies)
    def drawn(**kw):
        SCENARIOS[exercise](kw)
    drawn()


def never_both(exercise: str, recorder: Recorder, ids) -> list[str]:
    return [f"{exercise} {cid}: only {sorted(recorder.seen.get(cid, set()))}" for cid in ids
            if recorder.seen.get(cid, set()) != {True, False}]


def test_every_region_of_the_chapter_is_instrumented():
    assert set(ch03_regions()) == set(TARGETS) == set(CASES)


@pytest.mark.parametrize("exercise", sorted(TARGETS))
def test_every_condition_takes_both_values_under_the_hidden_scenarios(exercise, monkeypatch):
    recorder = Recorder()
    owner, name = TARGETS[exercise]
    func, ids = instrumented(getattr(owner, name), ch03_regions()[exercise], recorder)
    assert ids, f"{exercise}: no condition found in its region"
    monkeypatch.setattr(owner, name, func)
    run_scenarios(exercise)
    assert never_both(exercise, recorder, ids) == []


def test_the_recorder_reports_a_condition_that_keeps_one_value(monkeypatch):
    """Only the explicit examples of the int8 quantizer, none with NaN or a zero row: the
    finiteness test never fails and every row's maximum is positive, and both are named."""
    recorder = Recorder()
    exercise = "ch03.quantize_int8"
    func, ids = instrumented(quant.quantize_int8_per_channel, ch03_regions()[exercise], recorder)
    monkeypatch.setattr(quant, "quantize_int8_per_channel", func)
    for example in CASES[exercise].hypothesis_explicit_examples:
        if example.kwargs["weight"]["special"] not in ("nan", "inf", "-inf", "zero_row"):
            SCENARIOS[exercise](example.kwargs)
    missing = never_both(exercise, recorder, ids)
    assert any("isfinite" in m for m in missing) and any("amax > 0" in m for m in missing), missing
    assert not any("w.dim() != 2" in m for m in missing), missing
