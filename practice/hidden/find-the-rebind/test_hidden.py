"""Hidden tests for find-the-rebind: random shapes, tied and untied embeddings, random
partial updates, updates back and forth, a stand-in graph on the CPU and real CUDA graphs
on a GPU. The candidate's update always runs before any cold reference is built."""
import os
import random

import pytest
import torch

from course_lib import Engine
from course_lib.testing import assert_hot_equals_cold
from course_lib.weights.audit import AddressMovedError
from course_lib.weights.checkpoint import CheckpointReader, preset, random_state_dict, write_checkpoint
from replay import capture_decode, plugged_commit

SEED = int.from_bytes(os.urandom(4), "little")
RNG = random.Random(SEED)
WHY = f"(random seed {SEED})"
PROMPTS = ["hidden test prompt", "a longer prompt for the hidden tests of find-the-rebind"]


def config(tied=None, gpu=False):
    if gpu:
        return preset("small", num_hidden_layers=2, hidden_size=256, head_dim=64, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=512, torch_dtype="bfloat16")
    heads = RNG.choice([2, 4])
    return preset("tiny", hidden_size=RNG.choice([32, 48, 64]), intermediate_size=RNG.choice([64, 96, 160]),
                  num_attention_heads=heads, num_key_value_heads=RNG.choice([k for k in (1, 2) if heads % k == 0]),
                  num_hidden_layers=RNG.randint(1, 3),
                  tie_word_embeddings=RNG.random() < 0.5 if tied is None else tied)


def checkpoint(tmp_path, cfg, label, tensors=None):
    return write_checkpoint(tmp_path / label, cfg, tensors or random_state_dict(cfg, RNG.randrange(10_000)))


def run_update(candidate, engine, run, what):
    with plugged_commit(candidate.load_into):
        try:
            run()
        except AddressMovedError as exc:
            pytest.fail(f"{what}: every parameter keeps its storage, but the audit found: {str(exc)[:300]} {WHY}")
    assert engine.health()["healthy"], f"{what}: the engine is healthy afterwards {WHY}"


def check_hot_equals_cold(engine, path, what, **opts):
    try:
        assert_hot_equals_cold(engine, path, PROMPTS, max_new_tokens=6, cold=Engine(path, **opts))
    except AssertionError as exc:
        pytest.fail(f"{what}: the engine computes what a cold start on the new weights computes; {exc} {WHY}")


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_back_and_forth_with_a_captured_decode(candidate, tmp_path, tied):
    cfg = config(tied)
    a, b = checkpoint(tmp_path, cfg, "a"), checkpoint(tmp_path, cfg, "b")
    engine = capture_decode(Engine(a))
    for k, (target, staging) in enumerate([(b, "full"), (a, "layer"), (b, "full")]):
        what = f"update {k + 1} of 3 (tied embeddings: {tied}, {cfg.num_hidden_layers} layers)"
        run_update(candidate, engine, lambda: engine.update_weights_from_disk(target, staging=staging), what)
        check_hot_equals_cold(engine, target, what)


def test_random_partial_updates(candidate, tmp_path):
    cfg = config()
    a, b = checkpoint(tmp_path, cfg, "a"), checkpoint(tmp_path, cfg, "b")
    names = list(CheckpointReader(b).metadata())
    chosen = RNG.sample(names, k=RNG.randint(1, min(6, len(names))))
    new = dict(CheckpointReader(b).iter_tensors(chosen))
    engine = capture_decode(Engine(a))
    what = f"a partial update of {sorted(chosen)}"
    run_update(candidate, engine, lambda: engine.update_weights_from_tensor(list(new.items())), what)
    merged = checkpoint(tmp_path, cfg, "merged", dict(CheckpointReader(a).iter_tensors()) | new)
    check_hot_equals_cold(engine, merged, what)


def test_every_fused_shard_alone(candidate, tmp_path):
    cfg = config()
    a, b = checkpoint(tmp_path, cfg, "a"), checkpoint(tmp_path, cfg, "b")
    layer = RNG.randrange(cfg.num_hidden_layers)
    current = dict(CheckpointReader(a).iter_tensors())
    engine = capture_decode(Engine(a))
    for short in RNG.sample(["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"], 5):
        name = f"model.layers.{layer}.{short}.weight"
        new = dict(CheckpointReader(b).iter_tensors([name]))
        run_update(candidate, engine, lambda: engine.update_weights_from_tensor(list(new.items())), f"an update of {name} alone")
        current |= new
        got = engine.get_weights_by_name(name, truncate_size=10**9)
        assert torch.equal(got, new[name]), f"after an update of {name} alone, its rows of the fused parameter hold it {WHY}"
    check_hot_equals_cold(engine, checkpoint(tmp_path, cfg, "merged", current), "after five single-shard updates")


@pytest.mark.cuda
def test_real_cuda_graphs(candidate, tmp_path):
    cfg = config(gpu=True)
    a, b = checkpoint(tmp_path, cfg, "a"), checkpoint(tmp_path, cfg, "b")
    opts = dict(device="cuda", enable_cuda_graph=True, max_num_seqs=4, max_model_len=256)
    engine = Engine(a, **opts)
    assert engine.model_runner.graphs, "the engine captured CUDA graphs"
    run_update(candidate, engine, lambda: engine.update_weights_from_disk(b, staging="full"), "a GPU update")
    check_hot_equals_cold(engine, b, "a GPU update with CUDA graphs", **opts)
