"""Hidden tests for notebooks/09_changing_versions_in_production.ipynb: the learner's canary comparison.

``check_compare_outputs(compare_outputs)``: the learner's ``compare_outputs(expected, got)
-> {"first_divergence": [...], "agreement": float}`` is run on greedy outputs of real
engines on fresh random checkpoints (an identical copy, a copy with one layer corrupted,
another seed), on outputs cut short or run long, and then plugged into
``course_lib.production.promote_or_rollback`` as its ``compare`` hook: a bad version
must be rolled back (bitwise the old weights, hot == cold) and a good one promoted.

Returns a list of failure messages (empty: passed); see ``__init__.py`` for why.
"""
from __future__ import annotations

import copy
import os
import random
import shutil
import tempfile

import torch

from course_lib import Engine
from course_lib import production
from course_lib.layers.quant import kernel_tensors
from course_lib.testing import assert_hot_equals_cold
from course_lib.weights.checkpoint import CheckpointReader, make_random, write_checkpoint


def _rng(seed) -> random.Random:
    return random.Random(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))


def corrupted_copy(src, dst, rng: random.Random):
    """``src`` with one decoder-layer tensor replaced by noise of the same scale."""
    reader = CheckpointReader(src)
    tensors = dict(reader.iter_tensors())
    name = rng.choice(sorted(n for n in tensors if n.startswith("model.layers.") and n.endswith("proj.weight")))
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    tensors[name] = torch.randn(tensors[name].shape, generator=gen) * tensors[name].std()
    return write_checkpoint(dst, reader.config, tensors)


def _synthetic(rng: random.Random, outputs: list[list[int]]) -> list[list[int]]:
    """Edits of real outputs: one token changed, cut short, run long, emptied, unchanged."""
    got = []
    for i, out in enumerate(outputs):
        out = list(out)
        kind = ["change", "short", "long", "empty", "same"][i % 5]
        if kind == "change":
            k = rng.randrange(len(out))
            out[k] = (out[k] + rng.randrange(1, 500)) % 512
        elif kind == "short":
            out = out[: rng.randrange(1, len(out))]
        elif kind == "long":
            out = out + [rng.randrange(512) for _ in range(rng.randint(1, 4))]
        elif kind == "empty":
            out = []
        got.append(out)
    return got


def _judge(name: str, answer, expected, got) -> list[str]:
    want = production.compare_outputs(expected, got)
    if not isinstance(answer, dict) or not {"first_divergence", "agreement"} <= set(answer):
        return [f"{name}: compare_outputs returns a dict with 'first_divergence' and 'agreement', got {answer!r}"]
    failures = []
    firsts = answer["first_divergence"]
    if not isinstance(firsts, list) or len(firsts) != len(expected):
        return [f"{name}: 'first_divergence' is a list with one entry per request ({len(expected)}), got {firsts!r}"]
    for i, (f, w) in enumerate(zip(firsts, want["first_divergence"])):
        if f is not None and (isinstance(f, bool) or not isinstance(f, int)):
            failures.append(f"{name}, request {i}: a first divergence is an int position or None, got {f!r}")
        elif f != w:
            what = "identical outputs: None" if w is None else f"the first differing position is {w}"
            failures.append(f"{name}, request {i} (expected {len(expected[i])} tokens, got {len(got[i])}): "
                            f"{what}; you said {f!r}")
        if len(failures) >= 3:
            break
    a = answer["agreement"]
    if isinstance(a, bool) or not isinstance(a, (int, float)) or abs(a - want["agreement"]) > 1e-9:
        failures.append(f"{name}: 'agreement' is the share of requests that are identical, "
                        f"{want['agreement']:.4f}; you said {a!r}")
    return failures


def check_compare_outputs(compare_outputs, seed=None) -> list[str]:
    """Failures of ``compare_outputs(expected, got) -> dict`` on real engines and inside the policy."""
    rng = _rng(seed)
    n_tokens = rng.randint(10, 16)
    prompts = ["".join(rng.choice("abcdefghijklmnop ") for _ in range(rng.randint(5, 30))) for _ in range(6)]
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        old = make_random(f"{tmp}/old", "tiny", seed=rng.randrange(10_000))
        new = make_random(f"{tmp}/new", "tiny", seed=rng.randrange(10_000, 20_000))
        twin = shutil.copytree(new, f"{tmp}/twin")
        other = make_random(f"{tmp}/other", "tiny", seed=rng.randrange(20_000, 30_000))
        outputs = {k: production.greedy_outputs(Engine(p), prompts, n_tokens)
                   for k, p in [("new", new), ("twin", twin), ("other", other)]}
        for attempt in range(5):  # a corruption that changes no output would prove nothing
            bad = corrupted_copy(new, f"{tmp}/bad{attempt}", rng)
            outputs["bad"] = production.greedy_outputs(Engine(bad), prompts, n_tokens)
            if outputs["bad"] != outputs["new"]:
                break
        cases = [("an identical copy", outputs["new"], outputs["twin"]),
                 ("a copy with one layer corrupted", outputs["new"], outputs["bad"]),
                 ("a checkpoint of another seed", outputs["new"], outputs["other"]),
                 ("outputs changed, cut short, run long or empty", outputs["new"], _synthetic(rng, outputs["new"]))]
        for name, expected, got in cases:
            e_copy, g_copy = copy.deepcopy(expected), copy.deepcopy(got)
            try:  # the candidate first, on copies
                answer = compare_outputs(e_copy, g_copy)
            except Exception as exc:  # report, do not raise: see __init__.py
                return [f"compare_outputs raised {type(exc).__name__}: {exc} (on {name})"]
            if e_copy != expected or g_copy != got:
                failures.append(f"{name}: compare_outputs changed its inputs; it must only read them")
            failures += _judge(name, answer, expected, got)
        if failures:
            return failures

        # Plugged into the policy: the learner's comparison decides.
        reference = outputs["new"]
        engine = Engine(old)
        before = {n: t.clone() for n, t in kernel_tensors(engine.model).items()}
        try:
            verdict_bad = production.promote_or_rollback(engine, bad, prompts, reference, weight_version="v2",
                                                         max_new_tokens=n_tokens, compare=compare_outputs)
        except Exception as exc:
            return [f"promote_or_rollback with your compare_outputs raised {type(exc).__name__}: {exc}"]
        if verdict_bad["decision"] != "rolled_back":
            failures.append(f"with your comparison the policy kept a version with a corrupted layer "
                            f"(decision {verdict_bad['decision']!r}, agreement {verdict_bad['agreement']})")
        elif not all(torch.equal(before[n], t) for n, t in kernel_tensors(engine.model).items()):
            failures.append("after the rollback the weights are not bitwise the old ones")
        else:
            try:
                assert_hot_equals_cold(engine, old, prompts[:2])
            except AssertionError as exc:
                failures.append(f"after the rollback: {exc}")
        try:
            verdict_good = production.promote_or_rollback(engine, twin, prompts, reference, weight_version="v2",
                                                          max_new_tokens=n_tokens, compare=compare_outputs)
        except Exception as exc:
            return failures + [f"promote_or_rollback with your compare_outputs raised {type(exc).__name__}: {exc}"]
        if verdict_good["decision"] != "promoted":
            failures.append(f"with your comparison the policy rolled back the right version "
                            f"(agreement {verdict_good['agreement']}, reasons {verdict_good['reasons']})")
    return failures
