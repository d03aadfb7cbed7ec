"""return_logprob: each output token's logprob, as SGLang reports it, in the engine and over HTTP.

The oracle is the engine's own prefill over prompt + completion: the logits at the
position before each output token, log-softmaxed at the request's temperature."""
import pytest
import torch

from course_lib import Engine
from course_lib.testing import prompt_logits

PROMPT = "logprobs for the trainer"


@pytest.fixture(scope="module")
def ckpts(make_ckpt):
    return make_ckpt("tiny", seed=61), make_ckpt("tiny", seed=62)


def expected(engine, prompt_ids, output_ids, temperature):
    logits = prompt_logits(engine, prompt_ids + output_ids)
    rows = logits[len(prompt_ids) - 1:len(prompt_ids) - 1 + len(output_ids)] / (temperature or 1.0)
    return torch.log_softmax(rows, -1)[torch.arange(len(output_ids)), torch.tensor(output_ids)]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_output_token_logprobs_match_the_prefill_oracle(ckpts, temperature):
    engine = Engine(ckpts[0])
    params = {"max_new_tokens": 6, "temperature": temperature, "seed": 3, "ignore_eos": True}
    out = engine.generate(PROMPT, params, return_logprob=True)[0]
    triples = out["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in triples] == out["output_ids"] and all(text is None for *_, text in triples)
    got = torch.tensor([lp for lp, _, _ in triples])
    want = expected(engine, engine.tokenizer.encode(PROMPT), out["output_ids"], temperature)
    assert torch.allclose(got, want, atol=1e-4), (got, want)
    assert (got <= 0).all()


def test_only_requests_that_ask_get_logprobs(ckpts):
    engine = Engine(ckpts[0])
    outs = engine.generate([PROMPT, PROMPT], {"max_new_tokens": 3}, return_logprob=[True, False])
    assert len(outs[0]["meta_info"]["output_token_logprobs"]) == 3
    assert "output_token_logprobs" not in outs[1]["meta_info"]
    with pytest.raises(ValueError, match="2 return_logprob flags for 1 prompts"):
        engine.generate([PROMPT], {"max_new_tokens": 3}, return_logprob=[True, False])


@pytest.mark.parametrize("mode", ["keep", "retract"])
def test_logprobs_follow_the_weights_across_an_update(ckpts, mode):
    """The first tokens come from A, the rest from B; every token carries its logprob under
    the weights that produced it (what importance weights in chapter 08 need). After
    ``retract`` the request was re-prefilled on B, so its later logprobs are exactly a cold
    B engine's; after ``keep`` they were computed on B over A's KV, so they are not."""
    a, b = ckpts
    engine = Engine(a)
    rid = engine.add_request(PROMPT, {"max_new_tokens": 6, "ignore_eos": True}, return_logprob=True)
    for _ in range(3):
        engine.step()
    engine.pause_generation(mode)
    engine.update_weights_from_disk(b, weight_version="b")
    engine.continue_generation()
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    out = next(o for o in outs if o["rid"] == rid)
    triples = out["meta_info"]["output_token_logprobs"]
    assert len(triples) == 6 and all(isinstance(lp, float) for lp, _, _ in triples)
    spans = out["meta_info"]["weight_versions"]
    assert [s["version"] for s in spans] == ["default", "b"]
    # Tokens made after the update: their logprobs are B's (checked against a cold B engine).
    start = spans[1]["start"]
    prompt_ids = Engine(b).tokenizer.encode(PROMPT)
    ids = out["output_ids"]
    want = expected(Engine(b), prompt_ids + ids[:start], ids[start:], 0.0)
    got = torch.tensor([lp for lp, _, _ in triples[start:]])
    assert torch.allclose(got, want, atol=1e-4) == (mode == "retract"), (mode, got, want)


def test_over_http(ckpts):
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from course_lib.server.runner import BackgroundServer
    with BackgroundServer(Engine(ckpts[0])) as srv:
        body = {"text": [PROMPT, PROMPT], "sampling_params": {"max_new_tokens": 4}, "return_logprob": [True, False]}
        outs = httpx.post(f"{srv.url}/generate", json=body, timeout=60).json()
        triples = outs[0]["meta_info"]["output_token_logprobs"]
        assert [t for _, t, _ in triples] == outs[0]["output_ids"] and triples[0][2] is None
        assert "output_token_logprobs" not in outs[1]["meta_info"]
        bad = httpx.post(f"{srv.url}/generate", json={**body, "return_logprob": [True]}, timeout=60)
        assert bad.status_code == 400 and "return_logprob" in bad.text
