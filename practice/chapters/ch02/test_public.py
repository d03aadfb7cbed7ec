"""Public tests for chapter 02's exercises (run them: python practice/judge.py test ch02).

- ch02.retract: ``Scheduler.preempt`` in course_lib/engine/scheduler.py;
- ch02.pause_modes: ``Pausing._handle_in_flight`` in course_lib/engine/pause.py;
- ch02.flush_rules: ``Pausing.flush_cache`` in course_lib/engine/pause.py;
- ch02.versions: ``Sequence.tag_token`` in course_lib/engine/sequence.py (tags, spans, logprobs);
- ch02.wait_drain: ``Pausing._drain`` in course_lib/engine/pause.py.

Each case runs the real engine on a tiny random checkpoint and says what it expected in words.
"""
import time

import pytest
import torch

from course_lib import Engine
from course_lib.engine.block_manager import BlockManager
from course_lib.engine.scheduler import Scheduler
from course_lib.engine.sequence import SamplingParams, Sequence, SequenceStatus
from course_lib.config import EngineConfig
from course_lib.weights.checkpoint import make_random

PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7, 6, 5, 4, 3], [42] * 9]


def greedy(n):
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model: extra threads on a small machine only wait
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("ch02")
    return make_random(d / "v1", "tiny", seed=1), make_random(d / "v2", "tiny", seed=2)


def mid_flight(path, steps=4, lengths=(12, 12, 12)):
    """An engine with three requests a few tokens into their answers."""
    engine = Engine(path, block_size=4)
    rids = [engine.add_request(input_ids=p, sampling_params=greedy(n)) for p, n in zip(PROMPTS, lengths)]
    for _ in range(steps):
        engine.step()
    return engine, rids


def drain(engine, max_steps=300):
    outs = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return outs
        for out in engine.step():
            outs[out["rid"]] = out
    raise AssertionError(f"requests still unfinished after {max_steps} steps: the engine stopped making progress")


# ---- ch02.retract ---------------------------------------------------------------------

@pytest.mark.exercise("ch02.retract")
def test_retract_frees_kv_and_queues_first():
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), bm, eos_token_id=-1)
    a, b, c = (Sequence(p, SamplingParams(**greedy(4)), 4) for p in PROMPTS)
    for s in (a, b):
        sched.add(s)
    sched.schedule()  # a and b are admitted
    sched.add(c)
    sched.preempt(b, out_of_memory=False)
    assert b.block_table == [], "a retracted request holds no KV blocks"
    assert b.status == SequenceStatus.WAITING, "a retracted request is WAITING"
    assert list(sched.running) == [a], "a retracted request is no longer running"
    assert list(sched.waiting) == [b, c], "a retracted request goes first in line, ahead of queued ones"
    assert bm.num_free_blocks == 16 - len(a.block_table), "its blocks went back to the free pool"
    assert b.token_ids == PROMPTS[1], "its tokens stay (they are prefilled again)"


@pytest.mark.exercise("ch02.retract")
def test_retract_is_not_an_out_of_memory_preemption():
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), bm, eos_token_id=-1)
    a, b = (Sequence(p, SamplingParams(**greedy(4)), 4) for p in PROMPTS[:2])
    sched.add(a), sched.add(b)
    sched.schedule()
    sched.preempt(a, out_of_memory=False)
    assert sched.num_preemptions == 0, "a retract (out_of_memory=False) is not counted as a preemption"
    sched.preempt(b)
    assert sched.num_preemptions == 1, "a preemption for lack of KV blocks is counted"


@pytest.mark.exercise("ch02.retract")
def test_retract_then_continue_exactly(ckpts):
    v1, _ = ckpts
    want = {tuple(p): o["output_ids"] for p, o in zip(PROMPTS, Engine(v1, block_size=4).generate(
        input_ids=PROMPTS, sampling_params=greedy(12)))}
    engine, rids = mid_flight(v1)
    seq = engine.requests[rids[1]]
    engine.scheduler.preempt(seq, out_of_memory=False)
    outs = drain(engine)
    for p, rid in zip(PROMPTS, rids):
        assert outs[rid]["output_ids"] == want[tuple(p)], (
            "same weights: a request sent back and prefilled again (prompt plus generated tokens) "
            "must end with the same tokens as one never interrupted")


# ---- ch02.pause_modes -----------------------------------------------------------------

@pytest.mark.exercise("ch02.pause_modes")
def test_pause_modes_abort_finishes_everything_and_counts_the_waste(ckpts):
    v1, _ = ckpts
    engine, rids = mid_flight(v1)
    queued = engine.add_request(input_ids=[7, 7, 7], sampling_params=greedy(5))
    made = {r: engine.requests[r].num_completion_tokens for r in rids}
    result = engine.pause_generation("abort")
    assert result["num_aborted_requests"] == 4, "abort aborts the 3 running requests and the queued one"
    assert not engine.scheduler.running and not engine.scheduler.waiting, "nothing is left in flight"
    assert engine.block_manager.used_block_ids == set(), "every KV block of the aborted requests is freed"
    outs = {o["rid"]: o for o in engine.step()}
    assert set(outs) == set(rids) | {queued}, "the next step returns every aborted request's output"
    assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outs.values()), \
        "finish_reason type 'abort'"
    rec = engine.pause_stats[-1]
    assert rec.aborted_requests == 4, "the record counts 4 aborted requests"
    assert rec.discarded_tokens == sum(made.values()), "the record counts every generated token discarded"


@pytest.mark.exercise("ch02.pause_modes")
def test_pause_modes_retract_sends_running_requests_to_the_head_in_order(ckpts):
    v1, v2 = ckpts
    engine, rids = mid_flight(v1)
    queued = engine.add_request(input_ids=[7, 7, 7], sampling_params=greedy(5))
    tokens = {r: engine.requests[r].num_tokens for r in rids}
    assert engine.pause_generation("retract")["num_aborted_requests"] == 0, "retract aborts nothing"
    assert [s.rid for s in engine.scheduler.waiting] == rids + [queued], \
        "retracted requests lead the queue, in their running order, ahead of the queued one"
    assert engine.block_manager.used_block_ids == set(), "retracted requests hold no KV"
    assert engine.pause_stats[-1].retracted_requests == 3, "the record counts 3 retracted requests"
    engine.update_weights_from_disk(v2, weight_version="v2")
    engine.continue_generation()
    drain(engine)
    assert engine.pause_stats[-1].reprefill_tokens == sum(tokens.values()), \
        "re-prefill of prompt plus generated tokens is counted in the record"


@pytest.mark.exercise("ch02.pause_modes")
@pytest.mark.parametrize("mode", ["keep", "wait"])
def test_pause_modes_keep_and_wait_leave_requests_alone(ckpts, mode):
    v1, _ = ckpts
    engine, rids = mid_flight(v1)
    tables = {r: list(engine.requests[r].block_table) for r in rids}
    engine.pause_generation(mode)
    assert [s.rid for s in engine.scheduler.running] == rids, f"{mode}: the requests keep running"
    assert {r: engine.requests[r].block_table for r in rids} == tables, f"{mode}: their KV stays"
    rec = engine.pause_stats[-1]
    assert rec.aborted_requests == rec.retracted_requests == rec.discarded_tokens == 0, \
        f"{mode}: nothing aborted, retracted or discarded"


# ---- ch02.versions (spans) -----------------------------------------------------------

def seq_with(versions):
    seq = Sequence([1, 2], SamplingParams(), block_size=4)
    for i, v in enumerate(versions):
        seq.append_token(i, v)
    return seq


@pytest.mark.exercise("ch02.versions")
def test_versions_spans_of_two_versions():
    assert seq_with(["a", "a", "b", "b", "b"]).version_spans() == [
        {"version": "a", "start": 0, "end": 2}, {"version": "b", "start": 2, "end": 5}], \
        "two runs: tokens 0-1 by a, tokens 2-4 by b (end is exclusive)"


@pytest.mark.exercise("ch02.versions")
def test_versions_spans_empty_and_returning_version():
    assert seq_with([]).version_spans() == [], "no output token yet: no span"
    assert seq_with(["x"]).version_spans() == [{"version": "x", "start": 0, "end": 1}], "one token: one span"
    assert [s["version"] for s in seq_with(["a", "b", "a"]).version_spans()] == ["a", "b", "a"], \
        "a version that comes back starts a new span"


@pytest.mark.exercise("ch02.versions")
def test_versions_spans_kept_as_tokens_come():
    seq = Sequence([1, 2, 3], SamplingParams(), block_size=4)
    seen = []
    for i, v in enumerate(["a", "a", "b", "a"]):
        seq.append_token(i, v)
        seen.append(seq.version_spans())
    assert seen == [
        [{"version": "a", "start": 0, "end": 1}],
        [{"version": "a", "start": 0, "end": 2}],
        [{"version": "a", "start": 0, "end": 2}, {"version": "b", "start": 2, "end": 3}],
        [{"version": "a", "start": 0, "end": 2}, {"version": "b", "start": 2, "end": 3},
         {"version": "a", "start": 3, "end": 4}]], \
        "after every token the spans cover exactly the output tokens so far (not the prompt; end exclusive)"


@pytest.mark.exercise("ch02.versions")
def test_versions_spans_in_the_engine_across_an_update(ckpts):
    v1, v2 = ckpts
    engine, rids = mid_flight(v1, steps=5)
    done = {r: engine.requests[r].num_completion_tokens for r in rids}
    engine.pause_generation("keep")
    engine.update_weights_from_disk(v2, weight_version="v2")
    engine.continue_generation()
    outs = drain(engine)
    for rid in rids:
        assert outs[rid]["meta_info"]["weight_versions"] == [
            {"version": "default", "start": 0, "end": done[rid]},
            {"version": "v2", "start": done[rid], "end": 12}], \
            "keep: the tokens before the update are 'default', every token after it 'v2'"


# ---- ch02.flush_rules -----------------------------------------------------------------

@pytest.mark.exercise("ch02.flush_rules")
def test_flush_rules_refused_while_serving(ckpts):
    v1, _ = ckpts
    engine, _ = mid_flight(v1)
    entries = engine.prefix_cache_stats["cached_blocks"]
    assert engine.flush_cache() is False, "requests are running and not paused: the flush is refused"
    assert engine.prefix_cache_stats["cached_blocks"] == entries, "a refused flush changes nothing"
    drain(engine)
    assert engine.flush_cache() is True, "idle: the flush is allowed"
    assert engine.prefix_cache_stats["cached_blocks"] == 0, "a flush forgets every entry"


@pytest.mark.exercise("ch02.flush_rules")
@pytest.mark.parametrize("mode,allowed", [("abort", True), ("keep", True), ("retract", True), ("wait", False)])
def test_flush_rules_while_paused(ckpts, mode, allowed):
    v1, _ = ckpts
    engine, _ = mid_flight(v1)
    engine.pause_generation(mode)
    assert engine.flush_cache() is allowed, (
        f"paused in {mode}: the flush is {'allowed' if allowed else 'refused (those requests still run)'}")


# ---- ch02.versions (tags) -------------------------------------------------------------

@pytest.mark.exercise("ch02.versions")
def test_versions_tags_one_per_token_in_order():
    seq = Sequence([1, 2], SamplingParams(), block_size=4)
    for token, version in [(7, "a"), (8, "a"), (9, "b")]:
        seq.append_token(token, version)
    assert seq.token_ids == [1, 2, 7, 8, 9], "each token goes at the end of token_ids"
    assert seq.token_versions == ["a", "a", "b"], "each token is tagged with the version that made it"
    assert seq.output_logprobs == [], "without return_logprob no logprob is kept"


@pytest.mark.exercise("ch02.versions")
def test_versions_tags_keep_the_logprob():
    seq = Sequence([1, 2], SamplingParams(), block_size=4, return_logprob=True)
    for token, lp in [(7, -0.5), (8, -1.25)]:
        seq.next_logprob = lp
        seq.append_token(token, "v")
        assert seq.next_logprob is None, "the logprob the sampler left is taken (next_logprob back to None)"
    assert seq.output_logprobs == [-0.5, -1.25], "one logprob per output token, in order"


@pytest.mark.exercise("ch02.versions")
def test_versions_tags_in_the_engine_across_an_update(ckpts):
    v1, v2 = ckpts
    engine, rids = mid_flight(v1, steps=5)
    seqs = {r: engine.requests[r] for r in rids}
    done = {r: s.num_completion_tokens for r, s in seqs.items()}
    engine.pause_generation("keep")
    engine.update_weights_from_disk(v2, weight_version="v2")
    engine.continue_generation()
    drain(engine)
    for rid, seq in seqs.items():
        assert seq.token_versions == ["default"] * done[rid] + ["v2"] * (12 - done[rid]), \
            "tokens made before the update are tagged 'default', every token after it 'v2'"


# ---- ch02.wait_drain ------------------------------------------------------------------

@pytest.mark.exercise("ch02.wait_drain")
def test_wait_drain_finishes_on_the_old_weights_and_returns_each_output_once(ckpts):
    v1, v2 = ckpts
    engine, rids = mid_flight(v1, lengths=(6, 10, 14))
    engine.pause_generation("wait")
    engine.update_weights_from_disk(v2, weight_version="v2")
    assert not engine.scheduler.running and not engine.scheduler.waiting, "the drain ran every request to its end"
    engine.continue_generation()
    outs = engine.step()
    assert sorted(o["rid"] for o in outs) == sorted(rids), \
        "the next step returns each request that finished during the drain, exactly once"
    assert engine.step() == [], "and the step after returns none of them again"
    for out in outs:
        assert [s["version"] for s in out["meta_info"]["weight_versions"]] == ["default"], \
            "wait: every token comes from the old weights"


@pytest.mark.exercise("ch02.wait_drain")
def test_wait_drain_records_the_wait(ckpts):
    v1, v2 = ckpts
    engine, _ = mid_flight(v1)
    engine.pause_generation("wait")
    t0 = time.perf_counter()
    engine.update_weights_from_disk(v2, weight_version="v2")
    elapsed = time.perf_counter() - t0
    wait_s = engine.pause_stats[-1].wait_s
    assert 0 < wait_s <= elapsed, f"record.wait_s holds the drain's seconds (got {wait_s}, the update took {elapsed})"


@pytest.mark.exercise("ch02.wait_drain")
def test_wait_drain_times_out_without_changing_the_weights(ckpts):
    v1, v2 = ckpts
    engine = Engine(v1, block_size=4)
    rid = engine.add_request(input_ids=PROMPTS[0], sampling_params=greedy(400))
    engine.step()
    engine.pause_generation("wait")
    with pytest.raises(TimeoutError, match="not changed"):
        engine.update_weights_from_disk(v2, weight_version="v2", wait_timeout_s=1e-6)
    assert engine.weight_version == "default" and engine.weight_update_count == 0, \
        "a drain that timed out leaves the weights as they were"
    assert rid in engine.requests and engine.has_unfinished_requests(), "the long request is still in flight"
    assert engine.pause_stats[-1].wait_s > 0, "the time waited is recorded even when the drain gives up"
