"""Differential cases for layerwise-memory: your answer and the reference answer on the
same seeded random model shapes, everything observable compared.

Each scenario is a config (vocabulary, widths, heads, layers, tied or not, checkpoint
dtype) and every quantization; compared: ``reload_groups``'s keys, values and their types,
``peak_held_bytes`` for None, "int8" and "fp8" (value and type), the error type where one
is raised, and that the config was left as it was. The reference answer runs in another
process (solution_twin.py); scenarios are derandomized, the edge shapes explicit examples.
"""
from __future__ import annotations

from hypothesis import example, given
from hypothesis import strategies as st

import solution_twin
from solution_twin import DIFFERENTIAL

SLUG = "layerwise-memory"
MODULE = "test_differential"


reference = solution_twin.reference_fixture(SLUG)  # the reference answer's process, one per module


def _call(function, *args):
    try:
        value = function(*args)
    except Exception as exc:  # noqa: BLE001 - the error type is compared
        return {"raised": type(exc).__name__}
    if isinstance(value, dict):
        return {"returned": {str(k): v for k, v in value.items()},
                "types": {str(k): type(v).__name__ for k, v in value.items()}, "type": "dict"}
    return {"returned": value, "type": type(value).__name__}


def answers(module, shape):
    """reload_groups and peak_held_bytes (three quantizations) on one config."""
    from course_lib.weights.checkpoint import preset
    config = preset("tiny", **shape)
    before = repr(config)
    out = {"reload_groups": _call(module.reload_groups, config)}
    for q in (None, "int8", "fp8"):
        out[f"peak_held_bytes(quantization={q!r})"] = _call(module.peak_held_bytes, config, q)
    out["config unchanged"] = repr(config) == before
    return out


@st.composite
def shapes(draw):
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    return dict(vocab_size=draw(st.sampled_from([258, 300, 512, 3000, 9000, 20000])),
                hidden_size=draw(st.sampled_from([8, 32, 64, 96, 128])),
                intermediate_size=draw(st.sampled_from([8, 48, 160, 320, 1024])),
                num_attention_heads=heads,
                num_key_value_heads=draw(st.sampled_from([k for k in (1, 2, 4, 8) if heads % k == 0])),
                head_dim=draw(st.sampled_from([4, 8, 16, 32, 64])),
                num_hidden_layers=draw(st.integers(1, 6)),
                tie_word_embeddings=draw(st.booleans()),
                torch_dtype=draw(st.sampled_from(["float32", "bfloat16", "float16"])))


def _shape(**kw):
    base = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_hidden_layers=2, tie_word_embeddings=False,
                torch_dtype="float32")
    return {**base, **kw}


@DIFFERENTIAL
@given(shape=shapes())
@example(shape=_shape(num_hidden_layers=1))
@example(shape=_shape(tie_word_embeddings=True))
@example(shape=_shape(tie_word_embeddings=True, torch_dtype="bfloat16", num_hidden_layers=1))
@example(shape=_shape(vocab_size=20000))                     # the embedding (and head) is the peak
@example(shape=_shape(vocab_size=258, intermediate_size=1024))  # a decoder layer is the peak
@example(shape=_shape(num_attention_heads=8, num_key_value_heads=8, head_dim=64, hidden_size=32))  # q wider than h
@example(shape=_shape(torch_dtype="float16", vocab_size=300, hidden_size=128))
@example(shape=_shape(num_key_value_heads=1))
def test_differential_reload_groups_and_peak(candidate, reference, shape):
    args = ", ".join(f"{k}={v!r}" for k, v in shape.items())
    solution_twin.same_as_reference(candidate, reference, f"{MODULE}:answers", f"reload_groups / peak_held_bytes on preset('tiny', {args})", "sections `reload_groups(config)` and `peak_held_bytes(config, quantization)`", shape=shape)
