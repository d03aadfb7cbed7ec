"""Differential cases for canary-rollback: your answer and the reference answer on the same
seeded random scenarios, everything observable compared.

``first_divergence``: random pairs of token lists (shared prefixes, cut short, run on,
empty), the result and its type, and the lists left as they were. ``guarded_update``: a
fresh engine per scenario (its checkpoint deleted, so nothing can be read back from disk)
given the right version, a corrupted one, another seed, one of the wrong shape or with a
NaN; expected answers of random lengths, some changed, cut or run on; ``min_agreement``
on the boundaries k/n. Compared: the decision or the error type, the calls made on the
engine (pause mode, update options, what was generated with which parameters, rollback),
whether it is paused, its version label, a digest of every weight its kernels read, and
what it generates afterwards. The reference answer runs in another process
(solution_twin.py). Scenarios are derandomized: the same answer meets the same ones on
every run; the edge cases are explicit examples.
"""
from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

from hypothesis import example, given
from hypothesis import strategies as st

import solution_twin
from solution_twin import DIFFERENTIAL

SLUG = "canary-rollback"
MODULE = "test_differential"
PROMPTS = ["the cat sat", "a, b. c", "hello hello", "jihgfedcba", "  ,. ab"]


reference = solution_twin.reference_fixture(SLUG)  # the reference answer's process, one per module


# -- first_divergence ----------------------------------------------------------------------------

def divergence(module, expected, got):
    """first_divergence on copies; the result, its type and the arguments afterwards."""
    a, b = list(expected), list(got)
    try:
        result = {"returned": module.first_divergence(a, b)}
    except Exception as exc:  # noqa: BLE001 - the error type is compared
        result = {"raised": type(exc).__name__}
    result["type"] = type(result.get("returned")).__name__
    result["arguments after"] = [a, b]
    return result


@st.composite
def token_pairs(draw):
    common = draw(st.lists(st.integers(0, 4), max_size=6))
    a = common + draw(st.lists(st.integers(0, 4), max_size=3))
    b = common + draw(st.lists(st.integers(0, 4), max_size=3))
    return a, b


@DIFFERENTIAL
@given(pair=token_pairs())
@example(pair=([], []))
@example(pair=([], [7]))
@example(pair=([7], []))
@example(pair=([1, 2, 3], [1, 2]))
@example(pair=([1, 2], [1, 2, 3]))
@example(pair=([1, 2, 3], [1, 2, 3]))
@example(pair=([1, 2, 3], [9, 2, 3]))
@example(pair=([1, 2, 3], [1, 2, 9]))
@example(pair=([0, 0], [0]))
def test_differential_first_divergence(candidate, reference, pair):
    expected, got = pair
    solution_twin.same_as_reference(candidate, reference, f"{MODULE}:divergence", f"first_divergence({expected}, {got})", "section `first_divergence`", expected=expected, got=got)


# -- guarded_update --------------------------------------------------------------------------------

_VERSIONS: dict = {}


def versions() -> dict:
    """The checkpoints and the right version's answers, made once per process (the same seeds
    in both processes, so the same bytes)."""
    if not _VERSIONS:
        import torch  # noqa: F401 - versions imports it anyway

        from versions import corrupted_copy, make_random, misshapen, with_nan
        root = Path(tempfile.mkdtemp(prefix="canary-diff-"))
        old = make_random(root / "old", "tiny", seed=101)
        new = make_random(root / "new", "tiny", seed=202)
        _VERSIONS.update(
            root=root, old=old, new=new, other=make_random(root / "other", "tiny", seed=303),
            bad=corrupted_copy(new, root / "bad", "model.layers.0.self_attn.o_proj.weight", seed=7),
            wrong_shape=misshapen(root / "shape", seed=5),
            nan=with_nan(new, root / "nan", "model.layers.1.mlp.up_proj.weight", seed=3))
    return _VERSIONS


def _digest(engine) -> str:
    from versions import kernel_weights
    h = hashlib.sha256()
    for name, t in sorted(kernel_weights(engine).items()):
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(t.contiguous().view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _recorder(engine, calls, roles):
    """Wrap the engine's methods the contract names: each call is recorded, then made."""
    def wrap(name, record):
        original = getattr(engine, name)

        def call(*args, **kwargs):
            calls.append(record(*args, **kwargs))
            return original(*args, **kwargs)
        setattr(engine, name, call)

    def generate(prompts=None, sampling_params=None, *rest, **kwargs):
        prompts = [prompts] if isinstance(prompts, str) else list(prompts or [])
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        return ["generate", [[p, dict(sorted((q or {}).items()))] for p, q in zip(prompts, params)]]

    wrap("pause_generation", lambda mode="abort", **kw: ["pause", mode])
    wrap("continue_generation", lambda *a, **kw: ["continue"])
    wrap("update_weights_from_disk", lambda path, *a, **kw: [
        "update_from_disk", roles.get(str(path), "another path"), [str(x) for x in a],
        {k: v for k, v in sorted(kw.items())}])
    wrap("rollback", lambda *a, **kw: ["rollback", list(a), dict(sorted(kw.items()))])
    wrap("generate", generate)


def _merge_generates(calls):
    """Consecutive generate calls as one (one call or one per prompt: the same requests)."""
    out = []
    for c in calls:
        if c[0] == "generate" and out and out[-1][0] == "generate":
            out[-1] = ["generate", out[-1][1] + c[1]]
        else:
            out.append(c)
    return out


def canary(module, version, n_prompts, lengths, changes, min_agreement, label):
    """One guarded update on a fresh engine; everything it observed."""
    from versions import Engine, expected_answers
    v = versions()
    prompts = PROMPTS[:n_prompts]
    expected = [list(e) for e in expected_answers(v["new"], prompts, lengths)]
    for i, change in enumerate(changes):
        if change == "last token":
            expected[i][-1] = (expected[i][-1] + 1) % 512
        elif change == "first token":
            expected[i][0] = (expected[i][0] + 1) % 512
        elif change == "cut short":
            expected[i] = expected[i][:-1]
        elif change == "ran on":
            expected[i] = expected[i] + [expected[i][-1]]
    served = Path(tempfile.mkdtemp(prefix="served-", dir=v["root"])) / "ckpt"
    shutil.copytree(v["old"], served)
    engine = Engine(served)
    shutil.rmtree(served)  # a rollback must not read it back
    calls: list = []
    roles = {str(v[k]): k for k in ("old", "new", "other", "bad", "wrong_shape", "nan")}
    _recorder(engine, calls, roles)
    try:
        result = {"returned": module.guarded_update(engine, v[version], list(prompts), [list(e) for e in expected],
                                                    label, min_agreement)}
    except Exception as exc:  # noqa: BLE001 - the error type is compared
        result = {"raised": type(exc).__name__}
    for name in ("pause_generation", "continue_generation", "update_weights_from_disk", "rollback", "generate"):
        delattr(engine, name)  # the engine's own methods again
    result.update(calls=_merge_generates(calls), paused=engine.paused, weight_version=engine.weight_version,
                  weights=_digest(engine))
    if not engine.paused:
        outs = engine.generate(PROMPTS[:2], {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
        result["generates after"] = [o["output_ids"] for o in outs]
    return result


CHANGES = ["none", "none", "last token", "first token", "cut short", "ran on"]


@st.composite
def canaries(draw):
    n = draw(st.integers(1, 5))
    version = draw(st.sampled_from(["new", "new", "new", "bad", "other", "wrong_shape", "nan"]))
    lengths = draw(st.lists(st.integers(1, 7), min_size=n, max_size=n))
    changes = draw(st.lists(st.sampled_from(CHANGES), min_size=n, max_size=n))
    k = draw(st.integers(0, n))
    min_agreement = draw(st.sampled_from([k / n, k / n, 0.0, 1.0, min(1.0, k / n + 1e-9), max(0.0, k / n - 1e-9)]))
    return dict(version=version, n_prompts=n, lengths=lengths, changes=changes, min_agreement=min_agreement,
                label=draw(st.sampled_from(["v2", "step-9", "canary"])))


@DIFFERENTIAL
@given(case=canaries())
# the boundaries: an agreement equal to min_agreement is not below it (3 of 5 and 0.6)
@example(case=dict(version="new", n_prompts=5, lengths=[3, 5, 2, 4, 6],
                   changes=["none", "none", "none", "last token", "first token"], min_agreement=0.6, label="v2"))
@example(case=dict(version="new", n_prompts=5, lengths=[2, 2, 2, 2, 2],
                   changes=["none", "last token", "none", "none", "last token"], min_agreement=0.6, label="v2"))
@example(case=dict(version="new", n_prompts=3, lengths=[4, 4, 4],
                   changes=["none", "none", "first token"], min_agreement=2 / 3, label="v2"))
@example(case=dict(version="new", n_prompts=5, lengths=[1, 6, 2, 7, 3], changes=["none"] * 5,
                   min_agreement=1.0, label="v3"))
@example(case=dict(version="bad", n_prompts=4, lengths=[6, 6, 6, 6], changes=["none"] * 4,
                   min_agreement=1.0, label="v2"))
@example(case=dict(version="other", n_prompts=2, lengths=[5, 5], changes=["none"] * 2,
                   min_agreement=0.0, label="v2"))
@example(case=dict(version="wrong_shape", n_prompts=2, lengths=[3, 3], changes=["none"] * 2,
                   min_agreement=1.0, label="v2"))
@example(case=dict(version="nan", n_prompts=2, lengths=[3, 3], changes=["none"] * 2,
                   min_agreement=1.0, label="v2"))
@example(case=dict(version="new", n_prompts=2, lengths=[4, 4], changes=["cut short", "ran on"],
                   min_agreement=0.5, label="v2"))
def test_differential_guarded_update(candidate, reference, case):
    call = (f"guarded_update(engine on the old version, <{case['version']} version>, {case['n_prompts']} prompts, "
            f"expected answers of {case['lengths']} tokens changed {case['changes']}, {case['label']!r}, "
            f"min_agreement={case['min_agreement']!r})")
    solution_twin.same_as_reference(candidate, reference, f"{MODULE}:canary", call, "section `guarded_update` (steps 1-3)", **case)
