"""The copy plan writes exactly what the model's loaders write, into the same memory."""
import random

import pytest
import torch

from course_lib import Engine
from course_lib.models.qwen3 import Qwen3ForCausalLM
from course_lib.weights.checkpoint import CheckpointReader, make_random, preset, random_state_dict
from course_lib.weights.commit.copy_plan import CopyPlan, checkpoint_view


def model_of(config, seed=0, **kw):
    model = Qwen3ForCausalLM(config, **kw)
    model.load_weights(random_state_dict(config, seed).items())
    return model


CONFIGS = {
    "gqa-untied": preset("tiny", tie_word_embeddings=False),
    "gqa-tied": preset("tiny", tie_word_embeddings=True),
    "mha": preset("tiny", num_attention_heads=4, num_key_value_heads=4),
    "mqa": preset("small", num_key_value_heads=1),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_plan_equals_the_loaders_in_the_same_memory(name):
    config = CONFIGS[name]
    new = random_state_dict(config, seed=5)
    rng = random.Random(name)
    for subset in (list(new), rng.sample(list(new), 5)):  # a full update and a partial one
        by_loaders, by_plan = model_of(config), model_of(config)
        ptrs = {k: p.data_ptr() for k, p in by_plan.named_parameters()}
        by_loaders.load_weights((k, new[k]) for k in subset)
        CopyPlan.for_model(by_plan).apply((k, new[k]) for k in subset)
        for k, v in by_loaders.state_dict().items():
            assert torch.equal(v, by_plan.state_dict()[k]), k
        assert ptrs == {k: p.data_ptr() for k, p in by_plan.named_parameters()}


def test_views_are_contiguous_and_the_tied_head_has_none():
    model = model_of(CONFIGS["gqa-tied"])
    plan = CopyPlan.for_model(model)
    assert plan is CopyPlan.for_model(model)  # made once, then kept
    assert all(v is None or v.is_contiguous() for v in plan.views.values())
    assert "lm_head.weight" not in plan.views or plan.views["lm_head.weight"] is None
    assert checkpoint_view(model, "model.layers.0.self_attn.k_proj.weight").shape == (2 * 16, 64)


def test_bfloat16_tensors_into_a_float32_model():
    config = CONFIGS["gqa-untied"]
    new = random_state_dict(config, seed=3, dtype=torch.bfloat16)
    by_loaders, by_plan = model_of(config), model_of(config)
    by_loaders.load_weights(new.items())
    CopyPlan.for_model(by_plan).apply(new.items())
    assert all(torch.equal(v, by_plan.state_dict()[k]) for k, v in by_loaders.state_dict().items())


def test_bad_names_and_shapes_are_refused_before_any_write():
    config = CONFIGS["gqa-untied"]
    model = model_of(config)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    new = random_state_dict(config, seed=9)
    good = list(new.items())[:4]
    with pytest.raises(KeyError, match="model.layers.7.mlp.up_proj.weight"):
        CopyPlan.for_model(model).apply(good + [("model.layers.7.mlp.up_proj.weight", torch.zeros(1))])
    name, t = good[-1]
    with pytest.raises(ValueError, match=name):
        CopyPlan.for_model(model).apply(good[:-1] + [(name, t[:-1])])
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_quantized_models_and_tensor_parallel_ranks_use_the_loaders(tmp_path):
    config = CONFIGS["gqa-untied"]
    assert CopyPlan.for_model(Qwen3ForCausalLM(config, tp_rank=0, tp_size=2)) is None
    path = make_random(tmp_path / "c", config, seed=1)
    assert CopyPlan.for_model(Engine(path, quantization="int8").model) is None
    engine = Engine(path)
    assert CopyPlan.for_model(engine.model) is not None
    engine.update_weights_from_tensor(list(CheckpointReader(make_random(tmp_path / "d", config, seed=2)).iter_tensors()))
    engine.verify_addresses()


def test_the_environment_switch_falls_back_to_the_loaders(monkeypatch):
    monkeypatch.setenv("COURSE_LIB_COPY_PLAN", "0")
    assert CopyPlan.for_model(model_of(CONFIGS["gqa-untied"])) is None
