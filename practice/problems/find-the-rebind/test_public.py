"""Public tests for find-the-rebind: your load_into as the commit step of a real engine.

Your file arrives as the ``candidate`` fixture. Every update goes through the engine's own
update path (``replay.plugged_commit``), so its address audit checks your writes.
"""
import pytest

from course_lib import Engine
from course_lib.testing import assert_hot_equals_cold
from course_lib.weights.audit import AddressMovedError
from course_lib.weights.checkpoint import CheckpointReader, make_random
from replay import capture_decode, plugged_commit

PROMPTS = ["find the rebind", "a graph reads addresses"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    return make_random(root / "a", "tiny", seed=1), make_random(root / "b", "tiny", seed=2)


def update(candidate, engine, run):
    with plugged_commit(candidate.load_into):
        try:
            run(engine)
        except AddressMovedError as exc:
            pytest.fail(f"every parameter keeps its storage during the update, but the audit found: {str(exc)[:300]}")


def test_full_update_keeps_every_address(candidate, ckpts):
    a, b = ckpts
    engine = Engine(a)
    update(candidate, engine, lambda e: e.update_weights_from_disk(b, staging="full"))
    engine.verify_addresses()


def test_captured_decode_sees_the_update(candidate, ckpts):
    a, b = ckpts
    engine = capture_decode(Engine(a))
    update(candidate, engine, lambda e: e.update_weights_from_disk(b, staging="full"))
    try:
        assert_hot_equals_cold(engine, b, PROMPTS)
    except AssertionError as exc:
        pytest.fail(f"a 'captured' decode after the update computes what a cold start on the new weights computes; {exc}")


def test_partial_update_of_one_fused_shard(candidate, ckpts):
    a, b = ckpts
    engine = capture_decode(Engine(a))
    k_b = dict(CheckpointReader(b).iter_tensors(["model.layers.1.self_attn.k_proj.weight"]))
    update(candidate, engine, lambda e: e.update_weights_from_tensor(list(k_b.items())))
    got = engine.get_weights_by_name("model.layers.1.self_attn.k_proj.weight")
    want = k_b["model.layers.1.self_attn.k_proj.weight"]
    assert (got == want).all(), "after a k_proj update, the k rows of qkv_proj hold the new k_proj"
    q_a = dict(CheckpointReader(a).iter_tensors(["model.layers.1.self_attn.q_proj.weight"]))
    assert (engine.get_weights_by_name("model.layers.1.self_attn.q_proj.weight") == q_a["model.layers.1.self_attn.q_proj.weight"]).all(), \
        "a k_proj update leaves the q rows of qkv_proj unchanged"
