"""Sparse updates (only changed elements travel) and disk deltas (bytes against a base
snapshot). Each ends hot == cold against the new checkpoint, with the address audit clean;
bad payloads and mismatched bases are refused with the engine unchanged."""
import random

import pytest
import torch

from course_lib import Engine
from course_lib.layers.quant import kernel_tensors
from course_lib.testing import assert_addresses_unchanged, assert_hot_equals_cold
from course_lib.weights.checkpoint import CheckpointReader, write_checkpoint
from course_lib.weights.transports import delta, sparse
from course_lib.weights.commit.validate import UpdateError

PROMPTS = ["a few elements changed", "only the deltas travel"]
# q/k/v and gate/up land in fused parameters; the embedding and a norm are plain ones.
TOUCHED = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
           "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight",
           "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight",
           "model.layers.1.post_attention_layernorm.weight"]


def perturbed(tensors: dict, seed: int, per_tensor: int = 6) -> dict:
    """A copy of ``tensors`` with ``per_tensor`` random elements changed in each TOUCHED tensor."""
    gen = torch.Generator().manual_seed(seed)
    out = {k: v.clone() for k, v in tensors.items()}
    for name in TOUCHED:
        flat = out[name].view(-1)
        idx = torch.randperm(flat.numel(), generator=gen)[:per_tensor]
        flat[idx] += 0.5 + torch.rand(per_tensor, generator=gen)  # never zero: every pick really changes
    return out


@pytest.fixture(scope="module")
def perturbation_seed():
    return random.randrange(1 << 30)  # fresh elements every run


@pytest.fixture(autouse=True)
def _print_the_seed(request):
    """Each test that uses ``setup`` prints the seed, so its failure report shows it."""
    if "setup" in request.fixturenames:
        print(f"perturbation seed {request.getfixturevalue('perturbation_seed')}")


@pytest.fixture(scope="module")
def setup(make_ckpt, tmp_path_factory, perturbation_seed):
    """(A, B' = A with a few elements changed, the two state dicts, an unrelated checkpoint C)."""
    a = make_ckpt("tiny", seed=51)
    old = dict(CheckpointReader(a).iter_tensors())
    new = perturbed(old, perturbation_seed)
    b = write_checkpoint(tmp_path_factory.mktemp("b-prime"), CheckpointReader(a).config, new)
    return a, b, old, new, make_ckpt("tiny", seed=52)


def weights_of(engine) -> dict:
    return {k: v.clone() for k, v in kernel_tensors(engine.model).items()}


def assert_unchanged(engine, before: dict) -> None:
    now = kernel_tensors(engine.model)
    assert all(torch.equal(before[k], now[k]) for k in before), "a refused update changed the weights"
    assert engine.weight_update_count == 0 and engine.get_weight_version() == "default"


# ---- sparse -----------------------------------------------------------------------------------

def test_diff_holds_only_the_changed_elements(setup):
    _, _, old, new, _ = setup
    payload = sparse.diff(old, new)
    assert sorted(payload["names"]) == sorted(TOUCHED)  # untouched tensors are left out
    for name, shape, idx, values in zip(payload["names"], payload["shapes"], payload["indices"], payload["values"]):
        assert tuple(shape) == tuple(new[name].shape) and idx.dtype == torch.int64
        expected = torch.nonzero(old[name].reshape(-1) != new[name].reshape(-1)).reshape(-1)
        assert torch.equal(idx, expected)
        assert torch.equal(values, new[name].reshape(-1)[expected])
        assert torch.equal(sparse.scatter(old[name], idx, values), new[name])
    assert sparse.num_elements(payload) == 6 * len(TOUCHED)
    assert sparse.payload_nbytes(payload) == sparse.num_elements(payload) * (8 + 4)  # int64 index + fp32 value
    assert sparse.diff(old, old)["names"] == []


def test_diff_compares_bits_not_values():
    old = torch.tensor([0.0, float("nan"), 1.0]).to(torch.bfloat16)
    new = torch.tensor([-0.0, float("nan"), 1.0]).to(torch.bfloat16)  # -0.0 == 0.0, but its bytes differ
    payload = sparse.diff({"w": old}, {"w": new})
    assert payload["indices"][0].tolist() == [0]


def test_sparse_update_is_hot_equals_cold(setup):
    a, b, old, new, _ = setup
    engine = Engine(a)
    payload = sparse.diff(old, new)
    result = engine.update_weights_sparse(payload, weight_version="v2")
    assert result["success"] and engine.get_weight_version() == "v2"
    assert result["bytes"] == sparse.payload_nbytes(payload)
    assert result["bytes"] * 100 < result["dense_bytes"], "sparse should move far fewer bytes than dense"
    assert_hot_equals_cold(engine, b, PROMPTS)
    assert_addresses_unchanged(engine)


def test_sparse_update_while_requests_are_kept(setup):
    """Same pause rules as any update: refused while serving, applied once paused."""
    a, b, old, new, _ = setup
    engine = Engine(a)
    engine.add_request("in flight", {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True})
    engine.step()
    payload = sparse.diff(old, new)
    with pytest.raises(RuntimeError, match="pause_generation"):
        engine.update_weights_sparse(payload)
    engine.pause_generation("keep")
    engine.update_weights_sparse(payload)
    engine.continue_generation()
    while engine.has_unfinished_requests():
        engine.step()
    assert_hot_equals_cold(engine, b, PROMPTS)


def bad_payloads(old, new) -> dict:
    good = sparse.diff(old, new)

    def edited(i=None, **fields):
        p = {k: list(v) for k, v in good.items()}
        for key, value in fields.items():
            p[key][-1 if i is None else i] = value
        return p
    idx, vals = good["indices"][-1], good["values"][-1]
    numel = torch.Size(good["shapes"][-1]).numel()
    return {
        "unknown name": edited(names="model.layers.0.not_a_weight"),
        "wrong shape": edited(shapes=[3, 3]),
        "index past the end": edited(indices=torch.cat([idx[:-1], torch.tensor([numel])])),
        "negative index": edited(indices=torch.cat([idx[:-1], torch.tensor([-1])])),
        "repeated index": edited(indices=torch.cat([idx[:-1], idx[:1]])),
        "int32 indices": edited(indices=idx.to(torch.int32)),
        "values of another dtype": edited(values=vals.to(torch.float16)),
        "fewer values than indices": edited(values=vals[:-1]),
        "integer dtype": edited(dtypes="int32"),
        "a name twice": dict(good, names=good["names"][:-1] + good["names"][:1]),
        "a field missing": {k: v for k, v in good.items() if k != "values"},
        "fields of different lengths": dict(good, names=good["names"][:-1]),
    }


@pytest.mark.parametrize("case", ["unknown name", "wrong shape", "index past the end", "negative index",
                                  "repeated index", "int32 indices", "values of another dtype",
                                  "fewer values than indices", "integer dtype", "a name twice",
                                  "a field missing", "fields of different lengths"])
def test_bad_sparse_payload_is_refused_with_nothing_changed(setup, case):
    """The fault sits in the last tensor, so earlier valid tensors would show if applied early."""
    a, _, old, new, _ = setup
    engine = Engine(a)
    before = weights_of(engine)
    with pytest.raises(UpdateError, match="bad sparse payload"):
        engine.update_weights_sparse(bad_payloads(old, new)[case], weight_version="v2")
    assert_unchanged(engine, before)


def test_quantized_engine_refuses_sparse_updates(setup):
    a, _, old, new, _ = setup
    engine = Engine(a, quantization="int8")
    before = weights_of(engine)
    with pytest.raises(UpdateError, match="quantized"):
        engine.update_weights_sparse(sparse.diff(old, new))
    assert_unchanged(engine, before)


def test_a_tensor_parallel_rank_refuses_sparse_updates(setup):
    """A rank holds a shard of each tensor, so it cannot rebuild the checkpoint tensor."""
    a, _, old, new, _ = setup
    engine = Engine(a)
    engine.model.tp_size = 2  # what a TPEngine rank reports; the guard reads nothing else
    before = weights_of(engine)
    with pytest.raises(UpdateError, match="tensor-parallel"):
        engine.update_weights_sparse(sparse.diff(old, new))
    assert_unchanged(engine, before)


def test_empty_sparse_update_changes_only_the_version(setup):
    a, _, old, _, _ = setup
    engine = Engine(a)
    before = weights_of(engine)
    result = engine.update_weights_sparse(sparse.diff(old, old), weight_version="same-weights")
    assert result["bytes"] == 0 and engine.get_weight_version() == "same-weights"
    assert all(torch.equal(before[k], kernel_tensors(engine.model)[k]) for k in before)


# ---- delta ------------------------------------------------------------------------------------

@pytest.mark.parametrize("sharded", [False, True])
def test_delta_rebuilds_the_new_checkpoint_byte_for_byte(setup, tmp_path, sharded):
    a, b, _, new, _ = setup
    if sharded:  # the new checkpoint sharded, the base not: tensors are matched by name, not file
        b = write_checkpoint(tmp_path / "b-sharded", CheckpointReader(a).config, new, max_shard_size=150_000)
    summary = delta.make_delta(a, b, tmp_path / "d.delta", base_version="v1", new_version="v2")
    assert summary["changed_tensors"] == len(TOUCHED)
    assert summary["delta_bytes"] < summary["new_bytes"] / 20, summary  # few changed elements: a small file
    out = tmp_path / "rebuilt"
    index = delta.apply_delta(a, tmp_path / "d.delta", out)
    assert index["new"]["weight_version"] == "v2"
    files = sorted(p.name for p in b.iterdir())
    assert sorted(p.name for p in out.iterdir()) == files and (not sharded or len(files) > 3)
    for name in files:
        assert (out / name).read_bytes() == (b / name).read_bytes(), f"{name} differs"


def test_delta_against_a_mismatched_base_is_refused(setup, tmp_path):
    a, b, _, _, c = setup
    delta.make_delta(a, b, tmp_path / "d.delta", base_version="v1")
    with pytest.raises(delta.BaseMismatchError, match="not the base"):
        delta.apply_delta(c, tmp_path / "d.delta", tmp_path / "out")
    with pytest.raises(delta.BaseMismatchError, match="weight version"):
        delta.apply_delta(a, tmp_path / "d.delta", tmp_path / "out", base_version="v7")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["d.delta"]  # no half-written directory left behind
    engine = Engine(a)
    before = weights_of(engine)
    with pytest.raises(UpdateError, match="not the base"):
        engine.update_weights_from_delta(c, tmp_path / "d.delta")
    assert_unchanged(engine, before)


def test_corrupted_delta_is_refused(setup, tmp_path):
    a, b, _, _, _ = setup
    path = tmp_path / "d.delta"
    delta.make_delta(a, b, path)
    data = bytearray(path.read_bytes())
    data[len(delta.MAGIC) + 200] ^= 0xFF  # inside the first blobs
    path.write_bytes(bytes(data))
    with pytest.raises(delta.DeltaError):
        delta.apply_delta(a, path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_delta_update_is_hot_equals_cold(setup, tmp_path):
    a, b, _, _, _ = setup
    delta.make_delta(a, b, tmp_path / "d.delta", base_version="v1", new_version="v2")
    engine = Engine(a)
    result = engine.update_weights_from_delta(a, tmp_path / "d.delta", base_version="v1")
    assert result["success"] and engine.get_weight_version() == "v2"  # the version the delta recorded
    assert result["delta_bytes"] == (tmp_path / "d.delta").stat().st_size
    assert result["timings_ms"]["reconstruct"] > 0
    assert_hot_equals_cold(engine, b, PROMPTS)
    assert_addresses_unchanged(engine)
