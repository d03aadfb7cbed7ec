"""The engine's serving loop: continuous batching, prefix caching, preemption, and bad input."""
import os

import pytest
import torch

from course_lib import Engine, SamplingParams
from course_lib.testing import prompt_logits

GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
PROMPTS = ["a", "Hot weight updates", "The quick brown fox jumps over the lazy dog, twice over again",
           "0123456789" * 5, "short one"]


@pytest.fixture(scope="module")
def ckpt(make_ckpt):
    return make_ckpt("tiny", seed=11, num_hidden_layers=3)


def alone(ckpt, prompt, params=GREEDY, **kw):
    return Engine(ckpt, enable_prefix_caching=False, **kw).generate(prompt, params)[0]["output_ids"]


def test_batched_generation_equals_each_alone(ckpt):
    batched = Engine(ckpt).generate(PROMPTS, GREEDY)
    assert [o["output_ids"] for o in batched] == [alone(ckpt, p) for p in PROMPTS]


def test_seeded_sampling_is_independent_of_the_batch(ckpt):
    params = {"max_new_tokens": 10, "temperature": 0.9, "top_p": 0.9, "seed": 123, "ignore_eos": True}
    batched = Engine(ckpt).generate(PROMPTS, params)
    assert [o["output_ids"] for o in batched] == [alone(ckpt, p, params) for p in PROMPTS]
    other_seed = Engine(ckpt).generate(PROMPTS[2], {**params, "seed": 124})[0]["output_ids"]
    assert other_seed != batched[2]["output_ids"]


def test_continuous_batching_admits_requests_mid_flight(ckpt):
    engine = Engine(ckpt)
    first = engine.add_request(PROMPTS[2], GREEDY)
    engine.step()  # prefill of the first request
    engine.step()  # one decode step
    second = engine.add_request(PROMPTS[1], GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out["rid"]] = out["output_ids"]
    assert done[first] == alone(ckpt, PROMPTS[2]) and done[second] == alone(ckpt, PROMPTS[1])


def test_generate_waits_for_its_own_requests_while_another_is_in_flight(ckpt):
    # A request in flight that finishes first (here: 2 tokens left against 12) must neither
    # count as one of generate's nor make it return early.
    engine = Engine(ckpt, max_num_seqs=1)
    engine.add_request(PROMPTS[0], {**GREEDY, "max_new_tokens": 3})
    engine.step()
    got = engine.generate(PROMPTS[1:3], GREEDY)
    assert [o["output_ids"] for o in got] == [alone(ckpt, p) for p in PROMPTS[1:3]]


def test_prefix_cache_hits_are_counted_and_change_no_output(ckpt):
    shared = "A long shared system prompt that spans several KV blocks. "
    prompts = [shared + "Question one?", shared + "Question two, longer?"]
    engine = Engine(ckpt, block_size=16)
    first = engine.generate(prompts[0], GREEDY)[0]
    second = engine.generate(prompts[1], GREEDY)[0]
    assert first["meta_info"]["cached_tokens"] == 0
    hit = second["meta_info"]["cached_tokens"]
    common = len(os.path.commonprefix([p.encode() for p in prompts]))
    assert hit == (common // 16) * 16 and hit >= 48
    assert engine.prefix_cache_stats["hit_tokens"] == hit
    assert second["output_ids"] == alone(ckpt, prompts[1])


def test_whole_prompt_in_cache_still_computes_the_last_token(ckpt):
    engine = Engine(ckpt, block_size=8)
    prompt = "x" * 32  # exactly four blocks
    a = engine.generate(prompt, GREEDY)[0]
    b = engine.generate(prompt, GREEDY)[0]
    assert b["meta_info"]["cached_tokens"] == 24  # the last block is recomputed for its logits
    assert a["output_ids"] == b["output_ids"]


def test_preemption_when_blocks_run_out_gives_the_same_outputs(ckpt):
    params = {**GREEDY, "max_new_tokens": 40}
    engine = Engine(ckpt, block_size=8, num_kv_blocks=14, max_model_len=128)
    outs = engine.generate(PROMPTS, params)
    assert engine.scheduler.num_preemptions > 0
    assert [o["output_ids"] for o in outs] == [alone(ckpt, p, params) for p in PROMPTS]


def test_outputs_have_sglang_shape(ckpt):
    out = Engine(ckpt).generate(["hi"], {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True})[0]
    assert set(out) >= {"text", "output_ids", "meta_info"}
    m = out["meta_info"]
    assert m["finish_reason"] == {"type": "length", "length": 3}
    assert m["prompt_tokens"] == 2 and m["completion_tokens"] == 3
    assert m["weight_versions"] == [{"version": "default", "start": 0, "end": 3}]


def test_eos_stops_generation(ckpt):
    engine = Engine(ckpt)
    free = engine.generate("stop test", GREEDY)[0]["output_ids"]
    engine.model_config.eos_token_id = engine.scheduler.eos_token_id = free[3]
    out = engine.generate("stop test", {"max_new_tokens": 12, "temperature": 0})[0]
    assert out["output_ids"] == free[:free.index(free[3]) + 1]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_prompt_logits_match_generation(ckpt):
    engine = Engine(ckpt)
    ids = list(b"prompt logits")
    first = engine.generate(input_ids=[ids], sampling_params={**GREEDY, "max_new_tokens": 1})[0]["output_ids"][0]
    assert prompt_logits(engine, ids)[-1].argmax().item() == first


# ---- bad input: a clear error, nothing queued ----------------------------------------------

def test_prompt_longer_than_the_context(ckpt):
    engine = Engine(ckpt, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate("x" * 64, GREEDY)
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("params,message", [
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 3}, "unknown sampling_params"),
])
def test_bad_sampling_params(ckpt, params, message):
    engine = Engine(ckpt)
    with pytest.raises(ValueError, match=message):
        engine.generate(["ok", "fine"], [GREEDY, params])
    assert not engine.has_unfinished_requests()  # validated before anything was queued


def test_bad_prompts(ckpt):
    engine = Engine(ckpt)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request(input_ids=[1, 2, 9999])
    with pytest.raises(ValueError, match="exactly one"):
        engine.add_request()


def test_cuda_graph_needs_cuda(ckpt):
    with pytest.raises(ValueError, match="needs device='cuda'"):
        Engine(ckpt, enable_cuda_graph=True)


def test_default_dtypes(ckpt):
    assert Engine(ckpt).config.dtype == torch.float32
    assert Engine(ckpt, dtype="bfloat16").model.lm_head.weight.dtype == torch.bfloat16


def test_prefill_admits_up_to_max_num_seqs_in_one_step(ckpt):
    engine = Engine(ckpt, max_num_seqs=4)
    for p in PROMPTS:
        engine.add_request(p, GREEDY)
    seqs, is_prefill = engine.scheduler.schedule()
    assert is_prefill and len(seqs) == 4 and len(engine.scheduler.waiting) == 1


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_get_weights_by_name_reads_checkpoint_format_back(ckpt, quantization):
    from course_lib.weights.checkpoint import CheckpointReader
    engine = Engine(ckpt, quantization=quantization)
    tensors = dict(CheckpointReader(ckpt).iter_tensors())
    for name in ["model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight",
                 "model.norm.weight", "lm_head.weight"]:
        got = engine.get_weights_by_name(name, truncate_size=5)
        want = tensors[name][:5]
        if quantization and "proj" in name:
            assert torch.allclose(got, want, atol=want.abs().max().item() / 100)  # int8 rounding
        else:
            assert torch.equal(got, want), name
    with pytest.raises(KeyError):
        engine.get_weights_by_name("model.layers.0.nope.weight")
