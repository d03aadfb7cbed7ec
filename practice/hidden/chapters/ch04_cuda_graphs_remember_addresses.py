"""Hidden tests for notebooks/04_cuda_graphs_remember_addresses.ipynb: the learner's code inside the engine.

``check_fixed_updater(load_into)``: the learner's ``load_into(model, named_tensors)``
becomes the commit step of a live engine's update path (full and partial updates, tied
and untied embeddings). The address audit must stay clean, the engine healthy, and the
engine must compute exactly what a cold start on the new weights computes. On a GPU the
same runs with CUDA graphs; on a CPU that case prints "not graded: needs CUDA".

``check_keeps_address(answers)``: every update snippet of the exercise is run on a fresh
engine with random new values; the engine's own address audit says whether it moved a
tensor, and the learner's answer must agree.

Both return a list of failure messages (empty: passed); see ``__init__.py`` for why.
"""
from __future__ import annotations

import os
import random
import tempfile

import torch

from course_lib import Engine
from course_lib.testing import assert_hot_equals_cold, plugged_commit
from course_lib.weights.audit import AddressMovedError
from course_lib.weights.checkpoint import CheckpointReader, preset, random_state_dict, write_checkpoint

PROMPTS = ["graphs remember addresses", "the second prompt is a little longer than the first"]
GPU_SHAPE = dict(hidden_size=256, head_dim=64, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=512)


def _rng(seed) -> random.Random:
    return random.Random(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))


def _config(rng: random.Random, gpu: bool):
    if gpu:
        return preset("small", num_hidden_layers=2, torch_dtype="bfloat16", **GPU_SHAPE)
    return preset("tiny", hidden_size=rng.choice([48, 64]), intermediate_size=rng.choice([96, 128]),
                  num_hidden_layers=rng.choice([2, 3]), tie_word_embeddings=rng.random() < 0.5)


def _run_updater_case(load_into, rng: random.Random, device: str) -> list[str]:
    gpu = device == "cuda"
    config = _config(rng, gpu)
    where = "on the GPU with CUDA graphs" if gpu else f"on the CPU (tied embeddings: {config.tie_word_embeddings})"
    opts = dict(device=device, enable_cuda_graph=gpu, max_num_seqs=4, max_model_len=256)
    with tempfile.TemporaryDirectory() as tmp:
        a, b, c = (write_checkpoint(f"{tmp}/{k}", config, random_state_dict(config, rng.randrange(10_000)))
                   for k in "abc")
        # A partial update: a few of c's tensors on top of b (a fused shard, a plain weight, a norm).
        names = list(CheckpointReader(c).metadata())
        layer = rng.randrange(config.num_hidden_layers)
        chosen = [f"model.layers.{layer}.self_attn.{rng.choice('qkv')}_proj.weight",
                  f"model.layers.{layer}.mlp.{rng.choice(['gate', 'up'])}_proj.weight",
                  rng.choice([n for n in names if n.endswith("norm.weight")]),
                  rng.choice([n for n in names if n.endswith(("o_proj.weight", "down_proj.weight"))])]
        c_tensors = dict(CheckpointReader(c).iter_tensors(chosen))
        merged = dict(CheckpointReader(b).iter_tensors()) | c_tensors
        b_plus_c = write_checkpoint(f"{tmp}/bc", config, merged)

        hot = Engine(a, **opts)
        steps = [("a full update from disk", b, lambda: hot.update_weights_from_disk(b, staging="full")),
                 (f"a partial update of {len(chosen)} tensors ({', '.join(chosen)})", b_plus_c,
                  lambda: hot.update_weights_from_tensor(list(c_tensors.items())))]
        failures = []
        for label, target, run in steps:
            try:
                with plugged_commit(load_into):  # the candidate first
                    run()
            except AddressMovedError as exc:
                return failures + [f"{where}, {label}: the address audit found parameters in new memory, so a "
                                   f"captured CUDA graph would keep reading the old weights. The audit said: {exc}"]
            except Exception as exc:  # report, do not raise: see __init__.py
                return failures + [f"{where}, {label}: the update failed while using your function: "
                                   f"{type(exc).__name__}: {exc}"]
            if not hot.health()["healthy"]:
                return failures + [f"{where}, {label}: the engine is unhealthy afterwards: {hot.health()['reason']}"]
            try:
                assert_hot_equals_cold(hot, target, PROMPTS, max_new_tokens=6, cold=Engine(target, **opts))
            except AssertionError as exc:
                failures.append(f"{where}, after {label}: the outputs differ from a cold start on the new "
                                f"weights ({exc})")
        return failures


def check_fixed_updater(load_into, seed=None) -> list[str]:
    """Failures of ``load_into(model, named_tensors)`` as a live engine's commit step."""
    rng = _rng(seed)
    failures = []
    for _ in range(2):
        failures += _run_updater_case(load_into, rng, "cpu")
        if failures:
            return failures
    if torch.cuda.is_available():
        failures += _run_updater_case(load_into, rng, "cuda")
    else:
        print("not graded: needs CUDA (the same updates under captured CUDA graphs; run the grader on a GPU)")
    return failures


# The snippets of exercise 2, by label: each puts ``new`` into parameter ``name`` of ``model``.
def _a(model, name, new):
    model.get_parameter(name).data = new


def _b(model, name, new):
    model.get_parameter(name).data.copy_(new)


def _c(model, name, new):
    p = model.get_parameter(name)
    p.data[...] = new


def _d(model, name, new):
    p = model.get_parameter(name)
    p.data = p.data * 0 + new


def _e(model, name, new):
    p = model.get_parameter(name)
    p.data = p.data.float()
    p.data.copy_(new)


def _f(model, name, new):
    state = model.state_dict()
    state[name] = new
    model.load_state_dict(state)


def _g(model, name, new):
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state[name] = new
    model.load_state_dict(state, assign=True)


def _h(model, name, new):
    p = model.get_parameter(name)
    torch.nn.init.zeros_(p)
    p.add_(new)


SNIPPETS = {"A": _a, "B": _b, "C": _c, "D": _d, "E": _e, "F": _f, "G": _g, "H": _h}


def check_keeps_address(answers, seed=None) -> list[str]:
    """Failures of ``answers`` ({label: True if the snippet keeps every address}) against the audit."""
    rng = _rng(seed)
    if not isinstance(answers, dict):
        return [f"keeps_address() should return a dict, got {type(answers).__name__}"]
    missing = sorted(set(SNIPPETS) - set(answers))
    if missing:
        return [f"no answer for snippets {missing}"]
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        config = preset("tiny", tie_word_embeddings=rng.random() < 0.5)
        path = write_checkpoint(f"{tmp}/a", config, random_state_dict(config, rng.randrange(10_000)))
        for label, snippet in SNIPPETS.items():
            engine = Engine(path, max_num_seqs=2, max_model_len=64)
            name = rng.choice([n for n, _ in engine.model.named_parameters()])
            p = engine.model.get_parameter(name)
            new = torch.randn(p.shape, dtype=p.dtype) * 0.1
            with torch.no_grad():
                snippet(engine.model, name, new)
            if not torch.equal(engine.model.get_parameter(name), new):
                failures.append(f"snippet {label}: the test itself went wrong (the new values did not arrive); "
                                f"tell the instructor")
                continue
            moved = engine.address_audit.violations(engine.model, engine._audited_extras())
            keeps, said = not moved, answers[label]
            if not isinstance(said, bool):
                failures.append(f"snippet {label}: answer True or False, got {said!r}")
            elif said != keeps:
                failures.append(f"snippet {label}: you said it {'keeps' if said else 'moves'} the address; run on "
                                f"parameter {name} it {'kept every address' if keeps else 'moved ' + moved[0]}")
    return failures
