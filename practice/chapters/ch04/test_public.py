"""Public tests for chapter 04's exercises (run them: python practice/judge.py test ch04).

ch04.copy_in_place: ``CopyPlan.apply`` in course_lib/weights/commit/copy_plan.py.
ch04.record_addresses: ``AddressAudit.__init__`` in course_lib/weights/commit/audit.py.
ch04.address_audit: ``AddressAudit.violations`` in course_lib/weights/commit/audit.py.
ch04.commit_tests: ``check_commit_step`` in course_lib/weights/commit/commit_checks.py (your
tests must pass on a right commit step and fail on wrong ones: two are below, the judge
holds more).
Each case reports what it expected in words.
"""
import pytest
import torch

from course_lib import Engine
from course_lib.models.qwen3 import Qwen3ForCausalLM
from course_lib.testing import assert_hot_equals_cold, plugged_commit, verdict
from course_lib.weights.commit.audit import AddressAudit, AddressMovedError
from course_lib.weights.checkpoint import make_random, preset, random_state_dict
from course_lib.weights.commit.commit_checks import check_commit_step
from course_lib.weights.commit.copy_plan import CopyPlan

CONFIG = preset("tiny", tie_word_embeddings=False)
COPY, RECORD, AUDIT, TESTS = (pytest.mark.exercise(f"ch04.{n}")
                              for n in ("copy_in_place", "record_addresses", "address_audit", "commit_tests"))


def model_with(seed):
    model = Qwen3ForCausalLM(CONFIG)
    model.load_weights(random_state_dict(CONFIG, seed).items())
    return model


def state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def pointers(model):
    return {k: p.data_ptr() for k, p in model.named_parameters()}


# ---- ch04.copy_in_place -------------------------------------------------------------------

@COPY
def test_copy_in_place__apply_writes_what_the_loaders_write_into_the_same_memory():
    new = random_state_dict(CONFIG, seed=2)
    by_plan, by_loaders = model_with(1), model_with(1)
    before = pointers(by_plan)
    CopyPlan.for_model(by_plan).apply(new.items())
    by_loaders.load_weights(new.items())
    for name, want in by_loaders.state_dict().items():
        assert torch.equal(by_plan.state_dict()[name], want), f"{name} does not hold the new values after apply"
    assert pointers(by_plan) == before, "storage address unchanged for every parameter (apply must copy, not rebind)"


@COPY
def test_copy_in_place__apply_a_partial_update_changes_only_its_rows():
    model = model_with(1)
    old = state(model)
    k = torch.randn(32, 64)
    CopyPlan.for_model(model).apply([("model.layers.1.self_attn.k_proj.weight", k)])
    qkv = model.state_dict()["model.layers.1.self_attn.qkv_proj.weight"]
    assert torch.equal(qkv[64:96], k), "the k rows of the fused qkv_proj hold the new k_proj tensor"
    assert torch.equal(qkv[:64], old["model.layers.1.self_attn.qkv_proj.weight"][:64]), "the q rows are unchanged"
    changed = [n for n, v in model.state_dict().items() if not torch.equal(v, old[n])]
    assert changed == ["model.layers.1.self_attn.qkv_proj.weight"], f"only qkv_proj of layer 1 changes, not {changed}"


@COPY
def test_copy_in_place__apply_converts_dtype_and_reads_a_generator_once():
    model = model_with(1)
    new = {n: t.to(torch.bfloat16) for n, t in random_state_dict(CONFIG, seed=3).items()}
    CopyPlan.for_model(model).apply((n, t) for n, t in new.items())
    norm = "model.layers.0.input_layernorm.weight"
    assert model.state_dict()[norm].dtype == torch.float32, "the parameter keeps its own dtype (float32)"
    assert torch.equal(model.state_dict()[norm], new[norm].float()), "bfloat16 values arrive converted to float32"


@COPY
def test_copy_in_place__apply_refuses_bad_input_before_writing_anything():
    model = model_with(1)
    old = state(model)
    good = list(random_state_dict(CONFIG, seed=4).items())
    with pytest.raises(KeyError, match="not_a_weight"):
        CopyPlan.for_model(model).apply(good + [("model.not_a_weight", torch.zeros(3))])
    o_proj = "model.layers.0.self_attn.o_proj.weight"
    for shape in [(1, 64), (64 * 64,)]:  # broadcastable, and the right element count
        with pytest.raises(ValueError, match="o_proj"):
            CopyPlan.for_model(model).apply(good + [(o_proj, torch.randn(shape))])
    for name, v in model.state_dict().items():
        assert torch.equal(v, old[name]), f"a refused apply changes nothing, but {name} changed"


@COPY
def test_copy_in_place__engine_update_through_the_plan_equals_a_cold_start(tmp_path):
    a, b = make_random(tmp_path / "a", "tiny", seed=1), make_random(tmp_path / "b", "tiny", seed=2)
    engine = Engine(a, max_model_len=128)
    engine.update_weights_from_disk(b, staging="full")
    assert_hot_equals_cold(engine, b, ["copy in place"], max_new_tokens=4)


# ---- ch04.record_addresses ----------------------------------------------------------------

@RECORD
def test_record_addresses__record_keeps_each_tensors_address():
    w, kv = torch.randn(8, 4), torch.zeros(2, 3, dtype=torch.bfloat16)
    audit = AddressAudit({"w": w, "kv": kv})
    assert set(audit.recorded) == {"w", "kv"}, "one record per name"
    rec = audit.recorded["kv"]
    assert (rec.data_ptr, rec.shape, rec.dtype, rec.device) == (kv.data_ptr(), (2, 3), torch.bfloat16, "cpu"), \
        "the record holds data_ptr, shape as a tuple, dtype and device as a string"


@RECORD
def test_record_addresses__record_holds_the_memory_so_its_address_is_never_reused():
    t = torch.randn(256, 64)
    address = t.data_ptr()
    audit = AddressAudit({"t": t})
    assert audit.recorded["t"].storage is not None, "the record holds the tensor's storage"
    del t
    fresh = [torch.randn(256, 64) for _ in range(8)]  # the allocator would reuse freed memory first
    assert address not in [f.data_ptr() for f in fresh], \
        "the recorded memory was freed and handed out again: the audit must hold each recorded storage"


@RECORD
def test_record_addresses__record_refuses_what_is_not_a_tensor():
    with pytest.raises(TypeError, match="scale"):
        AddressAudit({"w": torch.zeros(2), "scale": [1.0, 2.0]})
    with pytest.raises(TypeError):
        AddressAudit([("w", torch.zeros(2))])


# ---- ch04.address_audit -------------------------------------------------------------------

@AUDIT
def test_address_audit__audit_is_clean_after_in_place_writes():
    model = model_with(1)
    kv = torch.zeros(4, 8)
    audit = AddressAudit.record(model, {"kv_cache": kv})
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2)
        kv.add_(1)
    assert audit.violations(model, {"kv_cache": kv}) == [], "in-place writes move nothing"


@AUDIT
def test_address_audit__audit_names_a_rebound_parameter():
    model = model_with(1)
    audit = AddressAudit.record(model)
    name = "model.layers.0.mlp.down_proj.weight"
    p = model.get_parameter(name)
    p.data = p.data.clone()
    lines = audit.violations(model)
    assert len(lines) == 1 and lines[0].startswith(f"{name}: data_ptr changed"), \
        f"one line naming {name} and its data_ptr, got {lines}"


@AUDIT
def test_address_audit__audit_sees_shape_and_dtype_at_the_same_address():
    model = model_with(1)
    audit = AddressAudit.record(model)
    a, b = "model.layers.1.mlp.down_proj.weight", "model.layers.1.self_attn.o_proj.weight"
    model.get_parameter(a).data = model.get_parameter(a).data[:32]           # same first byte, fewer rows
    model.get_parameter(b).data = model.get_parameter(b).data.view(torch.int32)  # same bytes, another dtype
    lines = audit.violations(model)
    assert any(l.startswith(f"{a}: shape changed") for l in lines), f"{a}'s shape change is reported: {lines}"
    assert any(l.startswith(f"{b}: dtype changed") for l in lines), f"{b}'s dtype change is reported: {lines}"


@AUDIT
def test_address_audit__audit_checks_the_extras_and_what_vanished():
    model = model_with(1)
    audit = AddressAudit.record(model, {"kv_cache": torch.zeros(4, 8), "graph_out": torch.zeros(2)})
    lines = audit.violations(model, {"kv_cache": torch.zeros(4, 8)})
    assert any(l.startswith("kv_cache: data_ptr changed") for l in lines), f"a new KV pool is reported: {lines}"
    assert "graph_out: no longer present" in lines, f"a vanished tensor is reported: {lines}"


@AUDIT
def test_address_audit__audit_only_checks_the_names_given():
    model = model_with(1)
    audit = AddressAudit.record(model)
    moved, kept = "model.layers.0.mlp.down_proj.weight", "model.norm.weight"
    model.get_parameter(moved).data = model.get_parameter(moved).data.clone()
    assert audit.violations(model, only={kept}) == [], "only= checks just those names"
    assert audit.violations(model, only={moved})[0].startswith(moved), "only= still reports what it checks"


@AUDIT
def test_address_audit__engine_refuses_an_update_that_rebinds(tmp_path):
    a, b = make_random(tmp_path / "a", "tiny", seed=1), make_random(tmp_path / "b", "tiny", seed=2)
    engine = Engine(a, max_model_len=128)

    def rebinding_commit(model, named_tensors):
        model.load_weights(named_tensors)
        p = model.get_parameter("model.norm.weight")
        p.data = p.data.clone()  # right values, new memory

    with plugged_commit(engine, rebinding_commit), pytest.raises(AddressMovedError, match="model.norm.weight"):
        engine.update_weights_from_disk(b, staging="full")
    assert not engine.health()["healthy"], "an engine whose audit failed stops serving"


# ---- ch04.commit_tests --------------------------------------------------------------------


class NeverWrites(CopyPlan):
    """Checks every name and shape, then writes nothing."""
    def apply(self, named_tensors):
        for name, t in named_tensors:
            view = self.views[name]
            if view is not None and view.shape != t.shape:
                raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {tuple(view.shape)}")


class RefusesOtherDtypes(CopyPlan):
    """Refuses a tensor whose dtype is not its view's, which the contract allows."""
    def apply(self, named_tensors):
        pairs = list(named_tensors)
        for name, t in pairs:
            view = self.views[name]
            if view is not None and (view.shape != t.shape or view.dtype != t.dtype):
                raise ValueError(f"{name}: {t.dtype} {tuple(t.shape)}, expected {view.dtype} {tuple(view.shape)}")
        for name, t in pairs:
            if self.views[name] is not None:
                self.views[name].copy_(t)


@TESTS
def test_commit_tests__pass_on_your_own_commit_step():
    # Your commit step passes its own public cases above; a right test passes on it.
    failed = verdict(check_commit_step, CopyPlan.from_views)
    assert failed is None, (f"check_commit_step fails on your own CopyPlan.apply: {type(failed).__name__}: {failed}. "
                            "If your step passes its cases above, the test is asking for more than the contract says")


@TESTS
@pytest.mark.parametrize("step", [NeverWrites, RefusesOtherDtypes], ids=["never writes", "refuses other dtypes"])
def test_commit_tests__catches_a_public_buggy_step(step):
    assert verdict(check_commit_step, step.from_views) is not None, \
        f"check_commit_step passes on a wrong step: {step.__doc__}"
