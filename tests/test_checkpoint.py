"""Checkpoints: made from a seed, read back from every supported layout, bad ones refused."""
import json

import pytest
import torch

from course_lib.config import ConfigError, ModelConfig
from course_lib.weights.checkpoint import (CheckpointError, CheckpointReader, hf_tensor_shapes,
                                           make_random, preset, random_state_dict)


def read_all(path):
    return dict(CheckpointReader(path).iter_tensors())


def test_single_file_has_hf_names_shapes_and_config(tmp_path):
    cfg = preset("tiny")
    make_random(tmp_path, cfg, seed=3)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["model_type"] == "qwen3" and raw["architectures"] == ["Qwen3ForCausalLM"]
    tensors = read_all(tmp_path)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == hf_tensor_shapes(cfg)
    assert "model.layers.1.self_attn.q_proj.weight" in tensors


def test_sharded_equals_single_and_has_index(tmp_path):
    cfg = preset("tiny")
    make_random(tmp_path / "one", cfg, seed=5)
    make_random(tmp_path / "many", cfg, seed=5, max_shard_size=30_000)
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    a, b = read_all(tmp_path / "one"), read_all(tmp_path / "many")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_seed_changes_values_and_is_reproducible(tmp_path):
    cfg = preset("tiny")
    a, b, c = random_state_dict(cfg, 1), random_state_dict(cfg, 1), random_state_dict(cfg, 2)
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(a[name], b[name]) and not torch.equal(a[name], c[name])


def test_metadata_comes_from_headers(tmp_path):
    make_random(tmp_path, "tiny", dtype=torch.bfloat16)
    meta = CheckpointReader(tmp_path).metadata()
    assert meta["model.norm.weight"] == ((64,), torch.bfloat16)
    assert CheckpointReader(tmp_path).config.torch_dtype == "bfloat16"


@pytest.mark.parametrize("filename", ["pytorch_model.bin", "weights.pt"])
def test_torch_pickle_checkpoints_load(tmp_path, filename):
    cfg = preset("tiny")
    make_random(tmp_path / "st", cfg, seed=2)
    state = read_all(tmp_path / "st")
    (tmp_path / "pt").mkdir()
    (tmp_path / "pt" / "config.json").write_text((tmp_path / "st" / "config.json").read_text())
    torch.save(state, tmp_path / "pt" / filename)
    loaded = read_all(tmp_path / "pt")
    assert all(torch.equal(loaded[k], state[k]) for k in state)


def test_transformers_save_pretrained_checkpoint_loads(tmp_path):
    transformers = pytest.importorskip("transformers")
    from course_lib import Engine
    from course_lib.testing import prompt_logits
    cfg = transformers.Qwen3Config(**{k: v for k, v in preset("tiny").to_hf_dict().items()
                                      if k not in ("architectures", "torch_dtype", "model_type")})
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path)
    engine = Engine(tmp_path)
    ids = [5, 9, 300, 17, 2]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    assert torch.allclose(prompt_logits(engine, ids), ref, rtol=1e-4, atol=1e-5)


# ---- bad checkpoints: a clear error naming the fault ---------------------------------------

def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        CheckpointReader(tmp_path / "nope")


def test_no_config(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        CheckpointReader(tmp_path)


def test_malformed_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="malformed JSON"):
        CheckpointReader(tmp_path)


def test_no_weight_files(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(preset("tiny").to_hf_dict()))
    with pytest.raises(CheckpointError, match="no weights"):
        CheckpointReader(tmp_path)


def test_index_naming_a_missing_shard(tmp_path):
    make_random(tmp_path, "tiny", max_shard_size=30_000)
    next(tmp_path.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="missing"):
        CheckpointReader(tmp_path)


def test_corrupt_safetensors_header(tmp_path):
    make_random(tmp_path, "tiny")
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(CheckpointError, match="unreadable safetensors"):
        CheckpointReader(tmp_path).metadata()


@pytest.mark.parametrize("field,value,message", [
    ("num_attention_heads", 3, "multiple of"),
    ("model_type", "llama", "builds 'qwen3'"),
    ("hidden_size", 0, "positive integer"),
    ("torch_dtype", "float8", "torch_dtype"),
])
def test_config_the_model_cannot_build(tmp_path, field, value, message):
    make_random(tmp_path, "tiny")
    raw = json.loads((tmp_path / "config.json").read_text())
    raw[field] = value
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=message):
        CheckpointReader(tmp_path)


def test_transformers5_config_spelling():
    cfg = ModelConfig.from_dict({**preset("tiny").to_hf_dict(), "rope_theta": None, "torch_dtype": None,
                                 "dtype": "bfloat16", "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}})
    assert cfg.rope_theta == 5e5 and cfg.torch_dtype == "bfloat16"
    with pytest.raises(ConfigError, match="rope scaling"):
        ModelConfig.from_dict({**preset("tiny").to_hf_dict(), "rope_scaling": {"rope_type": "yarn"}})
