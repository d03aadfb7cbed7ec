"""config.json changes in a hot update: the runtime fields (rope_theta, bos/eos token ids)
are applied so that the engine equals a cold start on the new directory; the numeric fields
that cannot be changed in place (rms_norm_eps, max_position_embeddings) are refused as
needing a restart, with nothing changed. None is silently ignored."""
from dataclasses import replace

import pytest
import torch

from course_lib import Engine
from course_lib.config import ModelConfig
from course_lib.layers.quant import kernel_tensors
from course_lib.testing import assert_addresses_unchanged, assert_hot_equals_cold, prompt_logits
from course_lib.weights.checkpoint import CheckpointReader, write_checkpoint
from course_lib.weights.commit.validate import UpdateError

PROMPTS = ["config fields", "applied or refused"]


@pytest.fixture(scope="module")
def ckpts(make_ckpt):
    return make_ckpt("tiny", seed=95), make_ckpt("tiny", seed=96)


def with_config(src, dst, **changes):
    reader = CheckpointReader(src)
    return write_checkpoint(dst, replace(reader.config, **changes), dict(reader.iter_tensors()))


def test_every_config_field_is_classified():
    """A new ModelConfig field must be given a rule here, never silently ignored by updates."""
    classified = (set(ModelConfig.structural_fields) | set(ModelConfig.restart_fields)
                  | set(ModelConfig.runtime_fields) | {"torch_dtype"})
    assert classified == set(ModelConfig.__dataclass_fields__)


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_new_rope_theta_is_applied_hot_equals_cold(ckpts, tmp_path, quantization):
    a, b = ckpts
    new = with_config(b, tmp_path / "rope", rope_theta=10_000.0)
    engine = Engine(a, quantization=quantization)
    result = engine.update_weights_from_disk(new)
    assert result["config_applied"] == {"rope_theta": [1_000_000.0, 10_000.0]}
    assert engine.model_config.rope_theta == 10_000.0
    assert_hot_equals_cold(engine, new, PROMPTS)
    assert_addresses_unchanged(engine)  # the rotary tables were rewritten in place


def test_rope_theta_alone_changes_the_logits(ckpts, tmp_path):
    """The field matters: without applying it, the engine would differ from a cold start."""
    a, _ = ckpts
    new = with_config(a, tmp_path / "rope", rope_theta=10_000.0)
    ids = Engine(a).tokenizer.encode(PROMPTS[1])
    assert not torch.equal(prompt_logits(Engine(a), ids), prompt_logits(Engine(new), ids))


def test_new_eos_token_id_stops_generation_like_a_cold_start(ckpts, tmp_path):
    a, b = ckpts
    greedy = {"max_new_tokens": 8, "temperature": 0}
    first = Engine(b).generate(PROMPTS[0], {**greedy, "ignore_eos": True})[0]["output_ids"][2]
    new = with_config(b, tmp_path / "eos", eos_token_id=first)
    engine = Engine(a)
    engine.update_weights_from_disk(new)
    hot, cold = engine.generate(PROMPTS, greedy), Engine(new).generate(PROMPTS, greedy)
    assert [o["output_ids"] for o in hot] == [o["output_ids"] for o in cold]
    assert hot[0]["meta_info"]["completion_tokens"] <= 3


def test_new_bos_token_id_is_used_by_the_tokenizer(ckpts, tmp_path):
    a, b = ckpts
    new = with_config(b, tmp_path / "bos", bos_token_id=300)
    engine = Engine(a)
    engine.update_weights_from_disk(new)
    assert engine.tokenizer.bos_token_id == engine.model_config.bos_token_id == 300
    assert engine.tokenizer.encode("x") == Engine(new).tokenizer.encode("x")
    assert_hot_equals_cold(engine, new, PROMPTS)


@pytest.mark.parametrize("changes", [{"rms_norm_eps": 1e-5}, {"max_position_embeddings": 4096},
                                     {"max_position_embeddings": 4096, "rope_theta": 5.0}],
                         ids=["rms_norm_eps", "max_position_embeddings", "with a runtime field"])
def test_fields_that_need_a_restart_are_refused_with_nothing_changed(ckpts, tmp_path, changes):
    a, b = ckpts
    new = with_config(b, tmp_path / "restart", **changes)
    engine = Engine(a)
    before = {k: v.clone() for k, v in kernel_tensors(engine.model).items()}
    with pytest.raises(UpdateError, match=f"{next(iter(changes))}.*restart"):
        engine.update_weights_from_disk(new)
    after = kernel_tensors(engine.model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert engine.model_config == CheckpointReader(a).config and engine.weight_update_count == 0
    assert_hot_equals_cold(engine, a, PROMPTS)


def test_rollback_restores_the_runtime_fields_too(ckpts, tmp_path):
    a, b = ckpts
    new = with_config(b, tmp_path / "both", rope_theta=10_000.0, eos_token_id=300)
    engine = Engine(a)
    engine.update_weights_from_disk(new, keep_snapshot=True)
    engine.rollback()
    assert engine.model_config == CheckpointReader(a).config
    assert engine.scheduler.eos_token_id == engine.tokenizer.eos_token_id == CheckpointReader(a).config.eos_token_id
    assert_hot_equals_cold(engine, a, PROMPTS)
