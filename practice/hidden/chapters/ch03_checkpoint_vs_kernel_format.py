"""Hidden tests for notebooks/03_checkpoint_vs_kernel_format.ipynb: the learner's code inside the engine.

``check_requantize_in_place(requantize)``: the learner's ``requantize(layer, w)`` becomes
the post-processing step of a live int8 engine (it runs once per linear layer, with the
layer's freshly loaded float weight). Hot updates go through the engine's real update
path; afterwards every ``qweight`` and ``weight_scale`` must equal a cold int8 engine's
bitwise, the outputs must match, and the address audit must find nothing moved. The new
checkpoints hold rows with exact rounding ties and all-zero rows. On a GPU the same runs
with CUDA graphs; on a CPU that case prints "not graded: needs CUDA".

``check_layerwise_peak(predict)``: the learner predicts ``peak_held_bytes`` of a
layer-by-layer reload for random configs, dtypes and quantizations; the engine measures it.

Both return a list of failure messages (empty: passed); see ``__init__.py`` for why.
"""
from __future__ import annotations

import contextlib
import os
import random
import tempfile
from dataclasses import replace

import torch

from course_lib import Engine
from course_lib.testing import assert_hot_equals_cold
from course_lib.weights.audit import AddressMovedError
from course_lib.weights.checkpoint import preset, random_state_dict, write_checkpoint

PROMPTS = ["int8 in place", "a second prompt, somewhat longer than the first"]
GPU_SHAPE = dict(hidden_size=256, head_dim=64, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=512)


def _rng(seed) -> random.Random:
    return random.Random(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))


@contextlib.contextmanager
def plugged_requantize(engine: Engine, requantize):
    """Make ``requantize(layer, w)`` the engine's post-processing step for its int8 layers.

    Every quantized linear layer shares one quant method object; its
    ``process_weights_after_loading(layer)`` is what the update path calls once a layer's
    float weight has been staged. The plug hands the learner that weight and clears the
    staging afterwards, as the engine's own method does.
    """
    method = engine.model.model.layers[0].mlp.down_proj.quant_method

    def process(layer):
        if layer.staging is None:
            return  # nothing arrived for this layer in this update
        try:
            requantize(layer, layer.staging)
        finally:
            layer.staging, layer.staged_shards = None, set()

    method.process_weights_after_loading = process  # shadows the class's method on this object only
    try:
        yield engine
    finally:
        del method.process_weights_after_loading


def _tricky_state(config, seed: int, rng: random.Random) -> dict[str, torch.Tensor]:
    """Random weights, plus in some linear weights rows with exact ties and all-zero rows."""
    state = random_state_dict(config, seed)
    linear = [n for n in state if n.endswith("proj.weight")]
    for name in rng.sample(linear, k=min(6, len(linear))):
        w = state[name]
        rows = rng.sample(range(w.shape[0]), k=min(3, w.shape[0]))
        zero, ties = rows[0], rows[1:]
        w[zero] = 0.0
        for r in ties:
            # Integers and halves times a power of two, one entry +-127: scale is that power
            # of two exactly, so w / scale lands on k + 0.5 and the rounding rule decides.
            step = 2.0 ** rng.randint(-9, -6)
            vals = torch.tensor([rng.randint(-126, 125) + (0.5 if rng.random() < 0.5 else 0.0)
                                 for _ in range(w.shape[1])])
            vals[rng.randrange(w.shape[1])] = rng.choice([-127.0, 127.0])
            w[r] = vals * step
    return state


def _config(rng: random.Random, gpu: bool):
    if gpu:
        return preset("small", num_hidden_layers=2, torch_dtype="bfloat16", **GPU_SHAPE)
    heads = rng.choice([2, 4])
    return preset("tiny", hidden_size=rng.choice([48, 64]), intermediate_size=rng.choice([96, 128]),
                  num_attention_heads=heads, num_key_value_heads=rng.choice([1, 2]) if heads == 4 else 1,
                  head_dim=16, num_hidden_layers=rng.choice([2, 3]), tie_word_embeddings=rng.random() < 0.5)


def _kernel_mismatch(hot: Engine, cold: Engine) -> str | None:
    """The first qweight / weight_scale that differs from the cold engine's, in words."""
    hot_buffers, cold_buffers = dict(hot.model.named_buffers()), dict(cold.model.named_buffers())
    for name, want in cold_buffers.items():
        if not name.endswith(("qweight", "weight_scale")):
            continue
        got = hot_buffers[name]
        if got.dtype != want.dtype or got.shape != want.shape:
            return f"{name} is {got.dtype} {list(got.shape)}, a cold int8 engine has {want.dtype} {list(want.shape)}"
        if torch.equal(got, want):
            continue
        bad = (got != want).nonzero()[0].tolist()
        row = bad[0]
        what = "scale" if name.endswith("weight_scale") else "int8 value"
        return (f"{name}: {int((got != want).sum())} of {want.numel()} entries differ from a cold int8 engine; "
                f"first at {bad}: {what} {got[tuple(bad)].item()!r}, expected {want[tuple(bad)].item()!r}"
                + (" (this row of the new weight is all zeros: its scale is 1)"
                   if name.endswith("weight_scale") and want[row].item() == 1.0 else ""))
    return None


def _run_requantize_case(requantize, rng: random.Random, device: str) -> list[str]:
    gpu = device == "cuda"
    config = _config(rng, gpu)
    seeds = rng.sample(range(10_000), 3)
    opts = dict(device=device, quantization="int8", enable_cuda_graph=gpu, max_num_seqs=4, max_model_len=256)
    where = "on the GPU with CUDA graphs" if gpu else "on the CPU"
    with tempfile.TemporaryDirectory() as tmp:
        paths = [write_checkpoint(f"{tmp}/{k}", config, _tricky_state(config, s, rng)) for k, s in enumerate(seeds)]
        hot = Engine(paths[0], **opts)
        # The candidate first: two full updates (layer by layer, then fully staged), then a partial one.
        steps = [("a layer-by-layer update from disk", lambda: hot.update_weights_from_disk(paths[1])),
                 ("a second update (staging='full')", lambda: hot.update_weights_from_disk(paths[2], staging="full"))]
        with plugged_requantize(hot, requantize):
            for label, run in steps:
                try:
                    run()
                except AddressMovedError as exc:
                    return [f"{where}, {label}: the address audit found kernel tensors in new memory, so a captured "
                            f"CUDA graph would keep reading the old ones. Write into layer.qweight and "
                            f"layer.weight_scale in place. The audit said: {exc}"]
                except Exception as exc:  # report, do not raise: see __init__.py
                    return [f"{where}, {label}: the update failed while using your function: "
                            f"{type(exc).__name__}: {exc}"]
        cold = Engine(paths[2], **{k: v for k, v in opts.items()})
        failures = []
        mismatch = _kernel_mismatch(hot, cold)
        if mismatch:
            failures.append(f"{where}, after two hot updates: {mismatch}")
        try:
            assert_hot_equals_cold(hot, paths[2], PROMPTS, max_new_tokens=6, cold=cold)
        except AssertionError as exc:
            failures.append(f"{where}, after two hot updates: the outputs differ from a cold int8 engine ({exc})")
        return failures


def check_requantize_in_place(requantize, seed=None) -> list[str]:
    """Failures of ``requantize(layer, w)`` as a live int8 engine's post-processing step."""
    rng = _rng(seed)
    failures = []
    for _ in range(2):
        failures += _run_requantize_case(requantize, rng, "cpu")
        if failures:
            return failures
    if torch.cuda.is_available():
        failures += _run_requantize_case(requantize, rng, "cuda")
    else:
        print("not graded: needs CUDA (the same update under captured CUDA graphs; run the grader on a GPU)")
    return failures


def _memory_cases(rng: random.Random) -> list[tuple]:
    cases = []
    for quantization in (None, "int8", "fp8", rng.choice([None, "int8", "fp8"])):
        heads = rng.choice([2, 4, 8])
        config = preset("tiny", vocab_size=rng.choice([300, 512, 2048, 6000]),
                        hidden_size=rng.choice([32, 64, 96]), intermediate_size=rng.choice([64, 160, 256]),
                        num_attention_heads=heads, num_key_value_heads=rng.choice([k for k in (1, 2, 4) if heads % k == 0]),
                        head_dim=rng.choice([8, 16, 32]), num_hidden_layers=rng.randint(1, 4),
                        tie_word_embeddings=rng.random() < 0.5,
                        torch_dtype=rng.choice(["float32", "bfloat16", "float16"]))
        cases.append((config, quantization))
    return cases


def check_layerwise_peak(predict, seed=None) -> list[str]:
    """Failures of ``predict(config, quantization) -> int`` against measured ``peak_held_bytes``."""
    rng = _rng(seed)
    cases = _memory_cases(rng)
    try:  # the candidate first; it gets copies of the configs
        guesses = [predict(replace(config), quantization) for config, quantization in cases]
    except Exception as exc:
        return [f"your function raised {type(exc).__name__}: {exc}"]
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        for k, ((config, quantization), guess) in enumerate(zip(cases, guesses)):
            a = write_checkpoint(f"{tmp}/{k}a", config, random_state_dict(config, rng.randrange(10_000)))
            b = write_checkpoint(f"{tmp}/{k}b", config, random_state_dict(config, rng.randrange(10_000)))
            engine = Engine(a, quantization=quantization, max_num_seqs=2, max_model_len=64)
            measured = engine.update_weights_from_disk(b)["memory"]["peak_held_bytes"]
            if not isinstance(guess, int) or isinstance(guess, bool) or guess != measured:
                shape = (f"vocab {config.vocab_size}, hidden {config.hidden_size}, intermediate "
                         f"{config.intermediate_size}, {config.num_attention_heads} heads / "
                         f"{config.num_key_value_heads} kv heads of {config.head_dim}, "
                         f"{config.num_hidden_layers} layers, tied embeddings {config.tie_word_embeddings}, "
                         f"{config.torch_dtype} checkpoint")
                failures.append(f"quantization {quantization!r} ({shape}): you predicted {guess!r} bytes, "
                                f"the engine held {measured} at its peak")
    return failures
