"""Hidden tests for chapter 04: the commit step and the address audit inside the real engine.

Fresh random checkpoints, configs and choices each run (the seed is in every message).
Addresses are measured here, in the test's own dicts, as well as through the engine's
audit, so an audit that says "clean" about moved memory cannot pass the commit tests.
"""
import gc
import random

import pytest
import torch

from course_lib import Engine
from course_lib.testing import assert_hot_equals_cold, plugged_commit
from course_lib.weights.commit.audit import AddressAudit, AddressMovedError, TensorAddress, kernel_tensors
from course_lib.weights.checkpoint import CheckpointReader, preset, random_state_dict, write_checkpoint
from course_lib.weights.commit.copy_plan import CopyPlan
from conftest import hidden_seed  # the judge's plugin: a fixed seed, so a grade repeats

COPY, RECORD, AUDIT = (pytest.mark.exercise(f"ch04.{n}") for n in ("copy_in_place", "record_addresses", "address_audit"))
PROMPTS = ["graphs remember addresses", "a second, longer prompt for the decode path"]


@pytest.fixture
def rng():
    seed = hidden_seed()
    return random.Random(seed), f"seed {seed}"


def random_config(r, **kw):
    return preset("tiny", hidden_size=r.choice([48, 64]), intermediate_size=r.choice([96, 128]),
                  num_hidden_layers=r.choice([2, 3]), tie_word_embeddings=r.random() < 0.5, **kw)


def checkpoints(tmp_path, r, config, n=2):
    # Seeds below 10_000, all different: an update to the same weights would change nothing and prove nothing.
    return [write_checkpoint(tmp_path / f"v{i}", config, random_state_dict(config, seed))
            for i, seed in enumerate(r.sample(range(10_000), n))]


def new_state(r, config):
    """Weights other than any checkpoint's above (another seed range), so that writing them shows."""
    return random_state_dict(config, r.randrange(10_000, 20_000))


def addresses(engine):
    """data_ptr of every parameter and the KV pool, measured here (not by the audit)."""
    out = {n: p.data_ptr() for n, p in engine.model.named_parameters() if p.device.type != "meta"}
    out["kv_cache"] = engine.model_runner.kv_cache.data_ptr()
    return out


def model_state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def fused_and_plain(r, config, names):
    layer = r.randrange(config.num_hidden_layers)
    return [f"model.layers.{layer}.self_attn.{r.choice('qkv')}_proj.weight",
            f"model.layers.{layer}.mlp.{r.choice(['gate', 'up'])}_proj.weight",
            r.choice([n for n in names if n.endswith("norm.weight")]),
            r.choice([n for n in names if n.endswith(("o_proj.weight", "down_proj.weight"))])]


# ---- ch04.copy_in_place -------------------------------------------------------------------

@COPY
@pytest.mark.parametrize("staging", ["full", "layer"])
def test_updates_from_disk_are_hot_equal_cold_in_the_same_memory(tmp_path, rng, staging):
    r, seed = rng
    config = random_config(r)
    a, b = checkpoints(tmp_path, r, config)
    engine = Engine(a, max_model_len=128, max_num_seqs=4)
    before = addresses(engine)
    engine.update_weights_from_disk(b, staging=staging)
    assert addresses(engine) == before, f"{seed}: storage address unchanged after a {staging} update from disk"
    engine.verify_addresses()
    assert_hot_equals_cold(engine, b, PROMPTS, max_new_tokens=5)


@COPY
def test_updates_from_tensors_full_partial_and_bf16_are_hot_equal_cold(tmp_path, rng):
    r, seed = rng
    config = random_config(r)
    a, b, c = checkpoints(tmp_path, r, config, 3)
    engine = Engine(a, max_model_len=128, max_num_seqs=4)
    before = addresses(engine)
    engine.update_weights_from_tensor(list(CheckpointReader(b).iter_tensors()))
    assert_hot_equals_cold(engine, b, PROMPTS, max_new_tokens=5)
    names = list(CheckpointReader(c).metadata())
    chosen = fused_and_plain(r, config, names)
    new = dict(CheckpointReader(c).iter_tensors(chosen))
    merged = write_checkpoint(tmp_path / "merged", config, dict(CheckpointReader(b).iter_tensors()) | new)
    engine.update_weights_from_tensor(list(new.items()))
    assert addresses(engine) == before, f"{seed}: storage address unchanged after updates from tensors"
    assert_hot_equals_cold(engine, merged, PROMPTS, max_new_tokens=5)


@COPY
def test_apply_mixed_dtypes_and_a_generator(tmp_path, rng):
    r, seed = rng
    config = random_config(r)
    (a,) = checkpoints(tmp_path, r, config, 1)
    engine = Engine(a, max_model_len=64)
    new = new_state(r, config)
    names = r.sample(list(new), len(new) // 2)
    sent = {n: (new[n].to(torch.bfloat16) if r.random() < 0.5 else new[n]) for n in names}
    plan = CopyPlan.for_model(engine.model)
    plan.apply((n, t) for n, t in sent.items())
    for n, t in sent.items():
        view = plan.views[n]
        assert view.dtype == torch.float32 and torch.equal(view, t.float()), \
            f"{seed}: {n} ({t.dtype}) did not arrive converted into its float32 view"


@COPY
def test_apply_writes_views_of_every_size_in_their_own_memory(rng):
    """Weights of real models are megabytes each (these tests' models are tiny): views
    below, at and above a megabyte, from sources of the view's dtype and of another one."""
    r, seed = rng
    gen = torch.Generator().manual_seed(r.randrange(1 << 30))
    sizes = {"big": (512, 1024), "one_mib": (256, 1024), "just_under": (255, 1024), "odd": (37, 5), "small": (64,)}
    views = {name: torch.zeros(shape) for name, shape in sizes.items()}
    addresses = {name: v.data_ptr() for name, v in views.items()}
    plan = CopyPlan.from_views(views)
    names = list(sizes)
    r.shuffle(names)
    sources = [(n, torch.randn(sizes[n], generator=gen).to(r.choice([torch.float32, torch.bfloat16]))) for n in names]
    plan.apply(iter(sources))
    for name, src in sources:
        assert views[name].data_ptr() == addresses[name], f"{seed}: {name} moved"
        assert torch.equal(views[name], src.to(torch.float32)), (
            f"{seed}: view {name!r} {tuple(views[name].shape)} does not hold its tensor ({src.dtype}) after "
            f"apply (see the notebook's section on the commit step)")


@COPY
def test_an_empty_apply_changes_nothing(tmp_path, rng):
    r, seed = rng
    (a,) = checkpoints(tmp_path, r, random_config(r), 1)
    engine = Engine(a, max_model_len=64)
    old = model_state(engine.model)
    CopyPlan.for_model(engine.model).apply([])
    assert all(torch.equal(v, old[k]) for k, v in engine.model.state_dict().items()), f"{seed}: empty apply changed weights"


@COPY
def test_a_bad_tensor_anywhere_refuses_the_whole_apply(tmp_path, rng):
    r, seed = rng
    config = random_config(r)
    (a,) = checkpoints(tmp_path, r, config, 1)
    engine = Engine(a, max_model_len=64)
    new = list(new_state(r, config).items())
    r.shuffle(new)
    plan, old = CopyPlan.for_model(engine.model), model_state(engine.model)
    matrices = [i for i, (n, t) in enumerate(new) if t.dim() == 2 and t.shape[0] != t.shape[1]]
    i = r.choice(matrices[len(matrices) // 2:])  # late in the list: earlier tensors are good
    name, t = new[i]
    bad_shapes = {"same element count, another shape": t.reshape(t.shape[1], t.shape[0]),
                  "flattened": t.reshape(-1), "one broadcastable row": t[:1]}
    for label, bad in bad_shapes.items():
        with pytest.raises(ValueError, match=name.split(".")[-2]):
            plan.apply(new[:i] + [(name, bad)] + new[i + 1:])
        changed = [k for k, v in engine.model.state_dict().items() if not torch.equal(v, old[k])]
        assert not changed, f"{seed}: a refused apply ({label} {name}) still wrote {changed[:3]}"
    with pytest.raises(KeyError):
        plan.apply(new[:i] + [("model.layers.99.mlp.up_proj.weight", t)] + new[i:])
    changed = [k for k, v in engine.model.state_dict().items() if not torch.equal(v, old[k])]
    assert not changed, f"{seed}: an apply refused for an unknown name still wrote {changed[:3]}"


@COPY
@pytest.mark.cuda
def test_cuda_graphs_replay_new_weights_after_the_copy(tmp_path, rng):
    r, seed = rng
    config = preset("small", num_hidden_layers=2, torch_dtype="bfloat16", hidden_size=256, head_dim=64,
                    num_attention_heads=4, num_key_value_heads=2, intermediate_size=512)
    a, b, c = checkpoints(tmp_path, r, config, 3)
    opts = dict(device="cuda", enable_cuda_graph=True, max_num_seqs=4, max_model_len=256)
    engine = Engine(a, **opts)
    assert engine.model_runner.graph_outputs, "the engine captured CUDA graphs"
    before = addresses(engine)
    engine.update_weights_from_tensor(list(CheckpointReader(b).iter_tensors()))  # host tensors: across devices
    assert_hot_equals_cold(engine, b, PROMPTS, max_new_tokens=8, cold=Engine(b, **opts))
    on_gpu = [(n, t.cuda()) for n, t in CheckpointReader(c).iter_tensors()]  # same device: grouped copies
    engine.update_weights_from_tensor(on_gpu)
    assert addresses(engine) == before, f"{seed}: storage address unchanged on the GPU"
    engine.verify_addresses()
    assert_hot_equals_cold(engine, c, PROMPTS, max_new_tokens=8, cold=Engine(c, **opts))


# ---- ch04.record_addresses ----------------------------------------------------------------

def engine_without_other_holders(tmp_path, r):
    """A real engine whose recorded memory only the audit can keep alive (the copy plan,
    which also holds views of every parameter, is dropped)."""
    (a,) = checkpoints(tmp_path, r, random_config(r), 1)
    engine = Engine(a, max_model_len=64)
    engine.model.__dict__.pop("_copy_plan", None)
    gc.collect()
    return engine


@RECORD
def test_the_aba_case_rebinding_again_and_again_is_always_seen(tmp_path, rng):
    r, seed = rng
    engine = engine_without_other_holders(tmp_path, r)
    names = [n for n, _ in engine.model.named_parameters()]
    for name in r.sample(names, min(10, len(names))):
        p = engine.model.get_parameter(name)
        for round_ in range(3):  # a freed address is handed out again within a few rounds
            p.data = torch.randn_like(p)
            lines = engine.address_audit.violations(engine.model, engine.updater.audited_extras(), only={name})
            assert lines and lines[0].startswith(name), \
                (f"{seed}: rebind {round_ + 1} of {name} went unseen: its new memory sits at the recorded "
                 f"address, freed and reused (hold each recorded storage)")


@RECORD
def test_an_update_that_rebinds_once_per_fused_shard_is_caught(tmp_path, rng):
    r, seed = rng
    engine = engine_without_other_holders(tmp_path, r)
    config = engine.model_config
    b = write_checkpoint(tmp_path / "b", config, new_state(r, config))

    def rebind_each_shard(model, named_tensors):
        for name, t in named_tensors:
            target = model.map_checkpoint_name(name)
            if target is None:
                continue
            param_name, shard = target
            p = model.get_parameter(param_name)
            if shard is None:
                p.data.copy_(t)
            else:  # a new tensor per shard: the second frees the first, and so on
                start, size = model.get_submodule(param_name.rpartition(".")[0]).shard_rows(shard)
                fresh = p.data.clone()
                fresh[start:start + size] = t
                p.data = fresh

    with plugged_commit(engine, rebind_each_shard), pytest.raises(AddressMovedError, match="proj"):
        engine.update_weights_from_disk(b, staging="full")


@RECORD
def test_record_of_a_real_engine(tmp_path, rng):
    r, seed = rng
    (a,) = checkpoints(tmp_path, r, random_config(r), 1)
    engine = Engine(a, max_model_len=64, quantization=r.choice([None, "int8"]))
    rec = engine.address_audit.recorded
    want = kernel_tensors(engine.model, engine.updater.audited_extras())
    assert set(rec) == set(want), f"{seed}: recorded {sorted(set(rec) ^ set(want))[:4]} differently from what kernels read"
    for name, t in want.items():
        got = rec[name]
        assert (got.data_ptr, got.shape, got.dtype, got.device) == (t.data_ptr(), tuple(t.shape), t.dtype, str(t.device)), \
            f"{seed}: the record of {name} does not match the tensor"
        assert got.storage is not None and got.storage.data_ptr() == t.untyped_storage().data_ptr(), \
            f"{seed}: the record of {name} does not hold that tensor's own storage"


# ---- ch04.address_audit -------------------------------------------------------------------

@AUDIT
def test_an_injected_rebind_in_an_update_is_named(tmp_path, rng):
    r, seed = rng
    config = random_config(r)
    a, b = checkpoints(tmp_path, r, config)
    engine = Engine(a, max_model_len=64)
    victim = r.choice([n for n, _ in engine.model.named_parameters()])

    def commit_with_one_rebind(model, named_tensors):
        model.load_weights(named_tensors)
        p = model.get_parameter(victim)
        p.data = p.data.clone()  # the right values, in new memory

    with plugged_commit(engine, commit_with_one_rebind), pytest.raises(AddressMovedError) as caught:
        engine.update_weights_from_tensor(list(CheckpointReader(b).iter_tensors()))
    assert victim in str(caught.value), f"{seed}: the audit did not name {victim}: {caught.value}"
    assert not engine.health()["healthy"], f"{seed}: the engine still serves after its audit failed"


@AUDIT
def test_many_clean_updates_raise_no_false_alarm(tmp_path, rng):
    r, seed = rng
    config = random_config(r)
    quant = r.choice([None, "int8"])
    paths = checkpoints(tmp_path, r, config, 3)
    engine = Engine(paths[0], max_model_len=64, quantization=quant)
    for p in paths[1:]:
        engine.update_weights_from_disk(p, staging=r.choice(["full", "layer"]))
    lines = engine.address_audit.violations(engine.model, engine.updater.audited_extras())
    assert lines == [], f"{seed}: in-place updates (quantization {quant}) moved nothing, yet the audit said {lines[:3]}"


@AUDIT
def test_same_address_other_shape_or_dtype(tmp_path, rng):
    r, seed = rng
    (a,) = checkpoints(tmp_path, r, random_config(r), 1)
    engine = Engine(a, max_model_len=64)
    matrices = [n for n, p in engine.model.named_parameters() if p.dim() == 2]
    shrunk, retyped = r.sample(matrices, 2)
    p = engine.model.get_parameter(shrunk)
    p.data = p.data[: p.shape[0] // 2]
    q = engine.model.get_parameter(retyped)
    q.data = q.data.view(torch.int32)
    lines = engine.address_audit.violations(engine.model, engine.updater.audited_extras())
    assert any(l.startswith(f"{shrunk}: shape") for l in lines), f"{seed}: {shrunk} kept its address, not its shape: {lines}"
    assert any(l.startswith(f"{retyped}: dtype") for l in lines), f"{seed}: {retyped} kept its address, not its dtype: {lines}"
    assert not any(l.startswith(f"{shrunk}: data_ptr") for l in lines), f"{seed}: {shrunk} did not move: {lines}"


@AUDIT
def test_the_kv_pool_and_other_extras_are_audited(tmp_path, rng):
    r, seed = rng
    (a,) = checkpoints(tmp_path, r, random_config(r), 1)
    engine = Engine(a, max_model_len=64)
    runner = engine.model_runner
    runner.kv_cache = runner.kv_cache.clone()  # a new KV pool: kernels would write where nobody reads
    with pytest.raises(AddressMovedError, match="kv_cache"):
        engine.verify_addresses()
    out = torch.zeros(r.randint(2, 9), 4)
    audit = AddressAudit.record(engine.model, {"graph_logits": out, "other": torch.zeros(3)})
    lines = audit.violations(engine.model, {"graph_logits": out.clone()})
    assert any(l.startswith("graph_logits: data_ptr") for l in lines), f"{seed}: a replaced extra went unseen: {lines}"
    assert "other: no longer present" in lines, f"{seed}: a vanished extra went unseen: {lines}"


@AUDIT
def test_only_checks_the_parameters_named(tmp_path, rng):
    r, seed = rng
    (a,) = checkpoints(tmp_path, r, random_config(r), 1)
    engine = Engine(a, max_model_len=64)
    names = [n for n, _ in engine.model.named_parameters()]
    moved, kept = r.sample(names, 2)
    p = engine.model.get_parameter(moved)
    p.data = p.data.clone()
    audit = engine.address_audit
    assert audit.violations(engine.model, only={kept}) == [], f"{seed}: only={{{kept!r}}} reported other tensors"
    assert audit.violations(engine.model, only={kept, "no.such.parameter"}) == [], \
        f"{seed}: a name in only= that is no parameter is skipped"
    lines = audit.violations(engine.model, only={moved, kept})
    assert len(lines) == 1 and lines[0].startswith(f"{moved}: data_ptr"), f"{seed}: expected one line for {moved}: {lines}"


@AUDIT
@pytest.mark.cuda
def test_graph_outputs_are_audited_on_the_gpu(tmp_path, rng):
    r, seed = rng
    config = preset("tiny", torch_dtype="bfloat16")
    (a,) = checkpoints(tmp_path, r, config, 1)
    engine = Engine(a, device="cuda", enable_cuda_graph=True, max_model_len=128, max_num_seqs=4)
    outputs = engine.model_runner.graph_outputs
    bs = r.choice(list(outputs))
    outputs[bs] = outputs[bs].clone()
    with pytest.raises(AddressMovedError, match=rf"cuda_graph_logits\[{bs}\]"):
        engine.verify_addresses()


# ---- buffers and addresses (issue 26: mistakes that slipped past every case) ----------------

@RECORD
def test_record_takes_each_tensors_own_address_for_views_into_a_storage(rng):
    """``data_ptr`` is the tensor's own address (``TensorAddress.of``), which for a view further
    into a storage is not the storage's start; the record still holds the whole storage."""
    r, seed = rng
    big = torch.randn(r.randint(6, 12), r.randint(4, 9))
    k = r.randint(1, big.shape[0] - 2)
    tensors = {"whole": big, f"rows {k}:": big[k:], f"row {k}": big[k], "transposed": big.t(),
               "a column": big[:, r.randint(1, big.shape[1] - 1)], "a flat tail": big.view(-1)[r.randint(1, 20):]}
    names = list(tensors)
    r.shuffle(names)
    tensors = {n: tensors[n] for n in names}
    audit = AddressAudit(tensors)
    assert list(audit.recorded) == names, f"{seed}: recorded {list(audit.recorded)}, expected every entry in order {names}"
    for name, t in tensors.items():
        got, want = audit.recorded[name], TensorAddress.of(t)
        for field in ("data_ptr", "shape", "dtype", "device"):
            assert getattr(got, field) == getattr(want, field), (
                f"{seed}: {name} (a view at storage offset {t.storage_offset()}): recorded {field} "
                f"{getattr(got, field)!r}, the tensor's own is {getattr(want, field)!r}")
        assert got.storage is not None and got.storage.data_ptr() == t.untyped_storage().data_ptr(), \
            f"{seed}: the record of {name} does not hold that tensor's storage"


@COPY
@pytest.mark.cuda
def test_host_tensors_go_straight_into_the_device_weights_without_a_device_copy(tmp_path, rng):
    """No tensor is staged on the way: host tensors of the weights' own dtype are copied
    straight into the device views, so the commit step allocates no device memory at all
    (``torch.cuda.max_memory_allocated`` does not rise), and the weights hold the values."""
    r, seed = rng
    config = random_config(r)
    (a,) = checkpoints(tmp_path, r, config, 1)
    engine = Engine(a, device="cuda", max_model_len=64)
    plan = CopyPlan.for_model(engine.model)
    assert plan is not None, "an unquantized single-rank engine has a copy plan"
    new = list(new_state(r, config).items())
    r.shuffle(new)
    sent = [(n, t.to(plan.views[n].dtype)) for n, t in new if plan.views.get(n) is not None]  # on the host
    smallest = min(t.numel() * t.element_size() for _, t in sent)
    gc.collect()  # an earlier case's engine freed inside the window would hide allocations made in it
    gc.disable()
    try:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        plan.apply(iter(sent))
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
    finally:
        gc.enable()
    assert extra < smallest, (f"{seed}: applying {len(sent)} host tensors allocated {extra} bytes of device memory at "
                              f"its peak; each goes straight into its view (no staging copy on the device)")
    for n, t in sent:
        view = plan.views[n]
        assert view.is_cuda and torch.equal(view.cpu(), t), f"{seed}: {n} does not hold the host tensor's values"
