"""Updates between steps with requests mid-decode: the four pause modes, their costs,
per-token versions, and the prefix cache never serving KV from other weights."""
import pytest
import torch

from course_lib import Engine
from course_lib.engine.engine import EngineBusyError, EnginePausedError

PROMPTS = ["first request", "a second, longer request", "third", "the fourth request is here"]
N_NEW, N_BEFORE = 12, 4  # tokens per request; tokens generated before the update


@pytest.fixture(scope="module")
def ckpts(make_ckpt):
    return make_ckpt("tiny", seed=1), make_ckpt("tiny", seed=2)


def greedy(n=N_NEW):
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}


def cold(path, prompts=PROMPTS, n=N_NEW, **kw):
    return [o["output_ids"] for o in Engine(path, **kw).generate(prompts, greedy(n))]


def run_until_done(engine, outs=None):
    outs = dict(outs or {})
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o["rid"]] = o
    return outs


def mid_flight(path):
    """An engine whose four requests have each generated N_BEFORE tokens."""
    engine = Engine(path)
    rids = [engine.add_request(p, greedy()) for p in PROMPTS]
    for _ in range(N_BEFORE):  # one prefill (first token) + N_BEFORE-1 decode steps
        assert engine.step() == []
    assert all(engine.requests[r].num_completion_tokens == N_BEFORE for r in rids)
    return engine, rids


def spans(n_before, n_total=N_NEW):
    return [{"version": "default", "start": 0, "end": n_before}, {"version": "v2", "start": n_before, "end": n_total}]


def test_abort(ckpts):
    a, b = ckpts
    engine, rids = mid_flight(a)
    assert engine.pause_generation("abort") == {"paused": True, "mode": "abort", "num_aborted_requests": 4}
    aborted = {o["rid"]: o for o in engine.step()}
    assert set(aborted) == set(rids)
    expected_first = [ids[:N_BEFORE] for ids in cold(a)]
    for rid, first in zip(rids, expected_first):
        m = aborted[rid]["meta_info"]
        assert m["finish_reason"]["type"] == "abort"
        assert aborted[rid]["output_ids"] == first
        assert m["weight_versions"] == [{"version": "default", "start": 0, "end": N_BEFORE}]
    engine.update_weights_from_disk(b, weight_version="v2")
    assert engine.live_kv_is_fresh()
    engine.continue_generation()
    assert not engine.has_unfinished_requests()
    stats = engine.pause_stats[-1]
    assert (stats.aborted_requests, stats.discarded_tokens, stats.mixed_requests) == (4, 4 * N_BEFORE, 0)
    assert stats.kv_fresh and stats.reprefill_tokens == 0
    assert [o["output_ids"] for o in engine.generate(PROMPTS, greedy())] == cold(b)


def test_wait(ckpts):
    a, b = ckpts
    engine, rids = mid_flight(a)
    engine.pause_generation("wait")
    with pytest.raises(EnginePausedError):
        engine.add_request("new work is refused while paused")
    result = engine.update_weights_from_disk(b, weight_version="v2")
    assert "wait" in result["timings_ms"]
    engine.continue_generation()
    outs = run_until_done(engine)
    assert [outs[r]["output_ids"] for r in rids] == cold(a)  # finished entirely on the old weights
    assert all(outs[r]["meta_info"]["weight_versions"] == [{"version": "default", "start": 0, "end": N_NEW}]
               for r in rids)
    stats = engine.pause_stats[-1]
    assert stats.wait_s > 0 and stats.mixed_requests == 0 and stats.discarded_tokens == 0
    assert stats.kv_fresh
    assert [o["output_ids"] for o in engine.generate(PROMPTS, greedy())] == cold(b)


def test_keep(ckpts):
    a, b = ckpts
    engine, rids = mid_flight(a)
    assert engine.pause_generation("in_place")["mode"] == "keep"  # SGLang's name
    assert engine.step() == []  # frozen
    assert all(engine.requests[r].num_completion_tokens == N_BEFORE for r in rids)
    engine.update_weights_from_disk(b, weight_version="v2")
    assert not engine.live_kv_is_fresh()  # frozen requests hold KV from the old weights
    engine.continue_generation()
    outs = run_until_done(engine)
    for rid, ref in zip(rids, cold(a)):
        assert outs[rid]["output_ids"][:N_BEFORE] == ref[:N_BEFORE]
        assert outs[rid]["meta_info"]["weight_versions"] == spans(N_BEFORE)
    stats = engine.pause_stats[-1]
    assert stats.mixed_requests == 4 and not stats.kv_fresh and stats.discarded_tokens == 0
    assert [o["output_ids"] for o in engine.generate(PROMPTS, greedy())] == cold(b)


def test_retract(ckpts):
    a, b = ckpts
    engine, rids = mid_flight(a)
    before = {r: list(engine.requests[r].token_ids) for r in rids}
    engine.pause_generation("retract")
    assert not engine.scheduler.running and len(engine.scheduler.waiting) == 4
    assert engine.block_manager.num_free_blocks == len(engine.block_manager.blocks)  # KV freed
    engine.update_weights_from_disk(b, weight_version="v2")
    engine.continue_generation()
    prefill_before = engine.num_prefill_tokens
    outs = run_until_done(engine)
    assert engine.live_kv_is_fresh()
    # Re-prefilled on the new weights: the rest equals a cold new-weights engine continuing
    # from prompt + the tokens generated before the update.
    for rid in rids:
        cont = Engine(b).generate(input_ids=[before[rid]], sampling_params=greedy(N_NEW - N_BEFORE))[0]
        assert outs[rid]["output_ids"] == before[rid][-N_BEFORE:] + cont["output_ids"]
        assert outs[rid]["meta_info"]["weight_versions"] == spans(N_BEFORE)
    stats = engine.pause_stats[-1]
    reprefill = sum(len(t) for t in before.values())
    assert stats.reprefill_tokens == reprefill == engine.num_prefill_tokens - prefill_before
    assert stats.mixed_requests == 4 and stats.kv_fresh and stats.discarded_tokens == 0


def test_update_with_requests_in_flight_needs_pause_or_abort(ckpts):
    a, b = ckpts
    engine, rids = mid_flight(a)
    weights = engine.model.lm_head.weight.clone()
    with pytest.raises(EngineBusyError, match="pause_generation"):
        engine.update_weights_from_disk(b)
    assert torch.equal(engine.model.lm_head.weight, weights) and engine.weight_update_count == 0
    engine.update_weights_from_disk(b, abort_all_requests=True)
    assert {o["meta_info"]["finish_reason"]["type"] for o in engine.step()} == {"abort"}
    assert engine.pause_stats[-1].discarded_tokens == 4 * N_BEFORE


def test_pause_mode_names(ckpts):
    engine = Engine(ckpts[0])
    with pytest.raises(ValueError, match="unknown pause mode"):
        engine.pause_generation("freeze")
    engine.pause_generation("retract")
    with pytest.raises(ValueError, match="already paused"):
        engine.pause_generation("abort")
    assert engine.continue_generation() == {"paused": False}


def test_versions_and_update_result(ckpts):
    a, b = ckpts
    engine = Engine(a)
    assert engine.get_weight_version() == "default"
    result = engine.update_weights_from_disk(b, weight_version="step-7")
    assert result["success"] and result["weight_version"] == "step-7" == engine.get_weight_version()
    assert set(result["timings_ms"]) >= {"validate", "transfer", "copy", "post_process", "audit", "flush"}
    assert result["bytes"] == sum(t.numel() * t.element_size() for t in
                                  __import__("safetensors.torch").torch.load_file(f"{b}/model.safetensors").values())
    assert engine.update_weight_version("step-8") == {"success": True, "new_version": "step-8"}
    out = engine.generate("x", greedy(2))[0]
    assert out["meta_info"]["weight_version"] == "step-8"


# ---- the prefix cache --------------------------------------------------------------------

SHARED = "A system prompt long enough to fill several KV blocks of sixteen tokens. "


def test_flush_cache_refuses_while_serving_and_succeeds_after(ckpts):
    engine = Engine(ckpts[0])
    engine.generate(SHARED + "warm the cache", greedy(2))
    rid = engine.add_request(SHARED + "in flight", greedy())
    engine.step()
    assert engine.flush_cache() is False
    assert engine.block_manager.hash_to_block_id  # nothing changed
    run_until_done(engine)
    assert engine.flush_cache() is True and not engine.block_manager.hash_to_block_id
    out = engine.generate(SHARED + "after the flush", greedy(2))[0]
    assert out["meta_info"]["cached_tokens"] == 0


def test_flush_cache_allowed_while_paused_with_retracted_requests(ckpts):
    """SGLang #22620: retract fills the waiting queue, and a flush that insists on an empty
    queue fails forever. Here queued requests hold no cache entries, so it succeeds."""
    engine, _ = mid_flight(ckpts[0])
    for i in range(3):
        engine.add_request(f"never scheduled {i}", greedy())
    engine.pause_generation("retract")
    assert engine.flush_cache() is True


@pytest.mark.parametrize("flush", [True, False])
def test_no_stale_prefix_cache_after_update(ckpts, flush):
    """A request that would hit KV the old weights computed recomputes it instead: by the
    flush, or (flush_cache=False, as RL trainers send per bucket) by version-salted keys."""
    a, b = ckpts
    engine = Engine(a)
    prompt = SHARED + "the same question"
    assert engine.generate(prompt, greedy())[0]["meta_info"]["cached_tokens"] == 0
    assert engine.generate(prompt, greedy())[0]["meta_info"]["cached_tokens"] > 0  # the cache works
    engine.update_weights_from_disk(b, flush_cache=flush)
    out = engine.generate(prompt, greedy())[0]
    assert out["meta_info"]["cached_tokens"] == 0
    assert out["output_ids"] == cold(b, [prompt])[0]


def test_wait_mode_returns_each_output_exactly_once(ckpts):
    a, b = ckpts
    engine = Engine(a)
    rids = [engine.add_request(p, greedy(n)) for p, n in zip(PROMPTS, (3, 6, 9, 12))]
    engine.step()
    engine.pause_generation("wait")
    engine.update_weights_from_disk(b)
    engine.continue_generation()
    seen = []
    while engine.has_unfinished_requests():
        seen += [o["rid"] for o in engine.step()]
    assert sorted(seen) == sorted(rids)
