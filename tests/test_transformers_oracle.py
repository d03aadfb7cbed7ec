"""The outside oracle: our engine's logits and greedy tokens equal transformers' Qwen3ForCausalLM."""
import pytest
import torch

from course_lib import Engine
from course_lib.testing import prompt_logits

transformers = pytest.importorskip("transformers")

CONFIGS = {
    "gqa4-untied-3layers-sharded": dict(num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                                        tie_word_embeddings=False, max_shard_size=40_000),
    "gqa2-tied-3layers": dict(num_hidden_layers=3, tie_word_embeddings=True),
    "mha-untied-4layers": dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4),
}


def hf_model(path):
    return transformers.Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                         attn_implementation="eager").eval()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, make_ckpt):
    overrides = dict(CONFIGS[request.param])
    shard = overrides.pop("max_shard_size", None)
    path = make_ckpt("tiny", seed=7, max_shard_size=shard, **overrides)
    return Engine(path), hf_model(path)


def test_logits_match_transformers(pair):
    engine, hf = pair
    ids = torch.randint(0, 512, (45,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    ours = prompt_logits(engine, ids)
    rel = ((ours - ref).norm() / ref.norm()).item()
    assert rel < 1e-4, f"relative error {rel:.2e} against transformers"


def test_greedy_tokens_match_transformers_generate(pair):
    engine, hf = pair
    prompts = [[3, 77, 140, 9], list(range(100, 137))]
    for ids in prompts:
        ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=20, do_sample=False, min_new_tokens=20)[0, len(ids):].tolist()
        ours = engine.generate(input_ids=[ids], sampling_params={"max_new_tokens": 20, "temperature": 0,
                                                                 "ignore_eos": True})[0]["output_ids"]
        assert ours == ref
