"""Hidden tests for chapter 02: the learner's pause modes, retract, version spans and tags,
flush rules, the wait-mode drain inside the real engine, on fresh random loads each run (the seed is printed on failure).

Every figure a test grades is measured here, from the test's own view of the engine's
requests (tokens before the pause, outputs returned, blocks held), never taken from a
counter the learner's code writes, except where that counter is the exercise itself
(the pause record), and then it is compared with what the test measured.
"""
import itertools
import math
import random
import time

import pytest
import torch

from course_lib import Engine
from course_lib.engine.records import PauseRecord
from course_lib.testing import assert_addresses_unchanged, assert_hot_equals_cold
from course_lib.weights.checkpoint import make_random
from conftest import hidden_seed  # the judge's plugin: a fixed seed, so a grade repeats

SEED = hidden_seed()
MAX_STEPS = 500  # far more than any load here needs; a stuck engine fails instead of hanging


def greedy(n):
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def rng(request):
    """A fresh generator per test, from this run's seed (printed so a failure can be replayed)."""
    print(f"seed {SEED} ({request.node.name})")
    return random.Random(f"{SEED}-{request.node.name}")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    r = random.Random(SEED)
    d = tmp_path_factory.mktemp("ch02-hidden")
    return tuple(make_random(d / f"v{i}", "tiny", seed=r.randrange(10**6) * 3 + i) for i in range(3))


def where(what):
    return f"{what} (seed {SEED})"


class Load:
    """A random load driven into an engine: prompts and lengths all differ; some requests
    arrive late, some are still queued at the pause (max_num_seqs is small), some finished."""

    def __init__(self, rng, path, block_size=None, n=None):
        self.block_size = block_size or rng.choice([4, 8])
        n = n or rng.randint(4, 7)
        self.engine = Engine(path, block_size=self.block_size, max_num_seqs=rng.randint(2, n - 1))
        self.prompts = [[rng.randrange(256) for _ in range(rng.randint(3, 20))] for _ in range(n)]
        self.lengths = [rng.randint(8, 24) for _ in range(n)]
        self.lengths[0] = 3  # one request finishes before the pause
        self.arrivals = sorted(rng.randint(0, 4) for _ in range(n))
        self.arrivals[0] = 0
        self.pause_at = rng.randint(6, 8)
        self.rids, self.outputs = [], {}
        for step in range(self.pause_at):
            for i in range(n):
                if self.arrivals[i] == step:
                    self.rids.append(self.engine.add_request(input_ids=self.prompts[i],
                                                             sampling_params=greedy(self.lengths[i])))
            self.collect(self.engine.step())
        for _ in range(rng.randint(1, 2)):  # late arrivals: still queued at the pause
            self.prompts.append([rng.randrange(256) for _ in range(rng.randint(3, 20))])
            self.lengths.append(rng.randint(8, 24))
            self.rids.append(self.engine.add_request(input_ids=self.prompts[-1],
                                                     sampling_params=greedy(self.lengths[-1])))
        self.index = {rid: i for i, rid in enumerate(self.rids)}

    def collect(self, outs):
        for out in outs:
            assert out["rid"] not in self.outputs, where(f"request {out['rid']} returned twice")
            self.outputs[out["rid"]] = out

    def in_flight(self):
        """(running rids, queued rids, tokens of each unfinished request) as the test sees them now."""
        s = self.engine.scheduler
        tokens = {r: list(seq.token_ids) for r, seq in self.engine.requests.items()}
        return [q.rid for q in s.running], [q.rid for q in s.waiting], tokens

    def drain(self):
        for _ in range(MAX_STEPS):
            if not self.engine.has_unfinished_requests():
                return
            self.collect(self.engine.step())
        raise AssertionError(where(f"requests still unfinished after {MAX_STEPS} steps: the engine stopped making progress"))


def load_with_cached_blocks(rng, path):
    """A Load whose prefix cache holds entries at the pause: about one load in 2,000 (block size 8, two
    running requests with short prompts, the long prompts still queued) has filled no whole block yet."""
    for _ in range(20):  # bounded: an engine that never caches a block must fail here, not hang the grader
        load = Load(rng, path)
        if load.engine.block_manager.hash_to_block_id:
            return load
    raise AssertionError(where("premise: 20 loads in a row filled no prefix-cache block"))


def cold_continuation(path, block_size, tokens, n):
    """What an engine cold-started on ``path`` generates after ``tokens`` (n tokens, greedy)."""
    if n <= 0:
        return []
    return Engine(path, block_size=block_size).generate(input_ids=[tokens], sampling_params=greedy(n))[0]["output_ids"]


def spans_of(versions):
    out, start = [], 0
    for v, run in itertools.groupby(versions):
        k = len(list(run))
        out.append({"version": v, "start": start, "end": start + k})
        start += k
    return out


# ---- ch02.retract ---------------------------------------------------------------------

@pytest.mark.exercise("ch02.retract")
def test_preempted_requests_are_reprefilled_on_the_new_weights(ckpts, rng):
    v1, v2, _ = ckpts
    load = Load(rng, v1)
    e = load.engine
    e.pause_generation("keep")  # keep moves nothing: the test sends them back itself
    running, queued, tokens = load.in_flight()
    for rid in reversed(running):
        e.scheduler.preempt(e.requests[rid], out_of_memory=False)
    assert [s.rid for s in e.scheduler.waiting] == running + queued, \
        where("requests sent back lead the queue in their running order, ahead of those queued")
    assert e.block_manager.used_block_ids == set(), where("requests sent back hold no KV blocks")
    assert e.scheduler.num_preemptions == 0, where("sending back for a pause is not an out-of-memory preemption")
    e.update_weights_from_disk(v2, weight_version="v2")
    assert_addresses_unchanged(e)
    e.continue_generation()
    load.drain()
    for rid in running:
        i, done = load.index[rid], len(tokens[rid]) - len(load.prompts[load.index[rid]])
        got = load.outputs[rid]["output_ids"]
        assert got[:done] == tokens[rid][len(load.prompts[i]):], \
            where("the tokens generated before the update are kept, not generated again")
        want = cold_continuation(v2, load.block_size, tokens[rid], load.lengths[i] - done)
        assert got[done:] == want, where(
            "after a retract the request is prefilled again (prompt plus generated tokens) on the new "
            "weights: its later tokens must equal a cold engine on the new weights continuing from there")
    assert e.live_kv_is_fresh(), where("no live KV from the old weights remains")
    assert_hot_equals_cold(e, v2, ["after the update", "x"], max_new_tokens=4)


@pytest.mark.exercise("ch02.retract")
def test_out_of_memory_preemption_changes_no_token(ckpts, rng):
    v1, _, _ = ckpts
    prompts = [[rng.randrange(256) for _ in range(rng.randint(5, 14))] for _ in range(rng.randint(4, 6))]
    lengths = [rng.randint(10, 20) for _ in prompts]
    big = Engine(v1, block_size=4)
    want = [o["output_ids"] for o in big.generate(input_ids=prompts, sampling_params=[greedy(n) for n in lengths])]
    # A pool with room for the longest request alone forces preemptions mid-decode.
    need = max(-(-(len(p) + n) // 4) for p, n in zip(prompts, lengths))
    small = Engine(v1, block_size=4, num_kv_blocks=need + 2, enable_prefix_caching=False)
    rids = [small.add_request(input_ids=p, sampling_params=greedy(n)) for p, n in zip(prompts, lengths)]
    outs = {}
    for _ in range(MAX_STEPS):  # not generate(): a broken preempt must fail, not hang
        if not small.has_unfinished_requests():
            break
        outs.update({o["rid"]: o for o in small.step()})
    assert set(outs) == set(rids), where("every request finishes when the pool holds the longest one alone")
    got = [outs[r]["output_ids"] for r in rids]
    assert got == want, where("requests preempted for lack of KV blocks must end with the tokens they "
                              "would have made without preemption (same weights)")
    assert small.block_manager.used_block_ids == set(), where("every block is free once all requests finished")


@pytest.mark.exercise("ch02.retract")
def test_preempting_a_queued_request_lists_it_once(ckpts, rng):
    v1, _, _ = ckpts
    load = Load(rng, v1)
    e = load.engine
    e.pause_generation("keep")
    running, queued, _ = load.in_flight()
    assert queued, where("premise: the load has queued requests")
    last = queued[-1]
    e.scheduler.preempt(e.requests[last], out_of_memory=False)
    assert [s.rid for s in e.scheduler.waiting] == [last] + queued[:-1], \
        where("a queued request sent back moves to the head, listed once")


# ---- ch02.pause_modes -----------------------------------------------------------------

@pytest.mark.exercise("ch02.pause_modes")
def test_abort_discards_and_frees(ckpts, rng):
    v1, v2, _ = ckpts
    load = Load(rng, v1)
    e = load.engine
    running, queued, tokens = load.in_flight()
    discarded = sum(len(tokens[r]) - len(load.prompts[load.index[r]]) for r in running + queued)
    result = e.pause_generation("abort")
    assert result["num_aborted_requests"] == len(running + queued), where("abort aborts every running and queued request")
    assert not e.scheduler.running and not e.scheduler.waiting and not e.requests, where("nothing is left in flight")
    assert e.block_manager.used_block_ids == set(), where("aborted requests hold no KV blocks")
    load.collect(e.step())
    for rid in running + queued:
        out = load.outputs.get(rid)
        assert out is not None, where("the next step returns every aborted request's output")
        assert out["meta_info"]["finish_reason"]["type"] == "abort", where("finish_reason type 'abort'")
    rec = e.pause_stats[-1]
    assert (rec.aborted_requests, rec.discarded_tokens) == (len(running + queued), discarded), where(
        f"the record must count {len(running + queued)} aborted requests and {discarded} discarded tokens "
        f"(each request's own count: they all differ), got {rec.aborted_requests} and {rec.discarded_tokens}")
    assert rec.retracted_requests == 0, where("abort retracts nothing")
    e.update_weights_from_disk(v2, weight_version="v2")
    e.continue_generation()
    assert_hot_equals_cold(e, v2, ["once more", "abc"], max_new_tokens=4)


@pytest.mark.exercise("ch02.pause_modes")
def test_retract_in_order_with_its_bill(ckpts, rng):
    v1, v2, _ = ckpts
    load = Load(rng, v1)
    e = load.engine
    running, queued, tokens = load.in_flight()
    preemptions = e.scheduler.num_preemptions
    e.pause_generation("retract")
    assert e.scheduler.num_preemptions == preemptions, \
        where("a retract is no out-of-memory preemption: the scheduler's count of those stays as it was")
    assert [s.rid for s in e.scheduler.waiting] == running + queued, \
        where("retracted requests lead the queue in their running order, ahead of those queued")
    assert e.block_manager.used_block_ids == set(), where("retracted requests hold no KV")
    rec = e.pause_stats[-1]
    assert rec.retracted_requests == len(running), where(f"the record counts {len(running)} retracted requests")
    assert rec.aborted_requests == rec.discarded_tokens == 0, where("retract aborts and discards nothing")
    prefill_before = e.num_prefill_tokens
    e.update_weights_from_disk(v2, weight_version="v2")
    e.continue_generation()
    load.drain()
    reprefill = e.pause_stats[-1].reprefill_tokens
    # Prefix sharing can only lower it; the prefill counter the engine keeps outside the region bounds it.
    assert 0 < reprefill <= sum(len(tokens[r]) for r in running) and reprefill <= e.num_prefill_tokens - prefill_before, \
        where("the re-prefill of the retracted requests is counted in the record")
    for rid in running:
        i = load.index[rid]
        done = len(tokens[rid]) - len(load.prompts[i])
        want = cold_continuation(v2, load.block_size, tokens[rid], load.lengths[i] - done)
        assert load.outputs[rid]["output_ids"][done:] == want, \
            where("retracted requests continue exactly as a cold engine on the new weights would")


@pytest.mark.exercise("ch02.pause_modes")
def test_keep_tags_new_tokens_new_on_old_kv(ckpts, rng):
    v1, v2, _ = ckpts
    load = Load(rng, v1)
    e = load.engine
    running, queued, tokens = load.in_flight()
    tables = {r: list(e.requests[r].block_table) for r in running}
    e.pause_generation("keep")
    assert [s.rid for s in e.scheduler.running] == running and [s.rid for s in e.scheduler.waiting] == queued, \
        where("keep leaves running and queued requests where they are")
    assert {r: e.requests[r].block_table for r in running} == tables, where("keep leaves their KV in place")
    seqs = {r: e.requests[r] for r in running}  # the tags themselves, not the spans (exercise 3's part)
    e.update_weights_from_disk(v2, weight_version="v2")
    assert not e.live_kv_is_fresh(), where("keep continues on KV the old weights computed")
    e.continue_generation()
    load.drain()
    for rid in running:
        i = load.index[rid]
        done = len(tokens[rid]) - len(load.prompts[i])
        assert seqs[rid].token_versions == ["default"] * done + ["v2"] * (load.lengths[i] - done), \
            where("keep: tokens before the update are tagged 'default', every token after it 'v2'")
        assert load.outputs[rid]["output_ids"][:done] == tokens[rid][len(load.prompts[i]):], \
            where("keep: the tokens made before the update stay")
    rec = e.pause_stats[-1]
    assert rec.aborted_requests == rec.retracted_requests == rec.discarded_tokens == 0, \
        where("keep aborts, retracts and discards nothing")


@pytest.mark.exercise("ch02.pause_modes")
def test_wait_drains_on_the_old_weights(ckpts, rng):
    v1, v2, _ = ckpts
    load = Load(rng, v1)
    e = load.engine
    running, queued, _ = load.in_flight()
    e.pause_generation("wait")
    assert [s.rid for s in e.scheduler.running] == running, where("wait leaves the running requests running")
    e.update_weights_from_disk(v2, weight_version="v2")
    e.continue_generation()
    load.drain()
    for rid in running + queued:
        assert [s["version"] for s in load.outputs[rid]["meta_info"]["weight_versions"]] == ["default"], \
            where("wait: every request in flight finishes on the old weights")
    assert e.pause_stats[-1].discarded_tokens == 0, where("wait discards nothing")


@pytest.mark.exercise("ch02.pause_modes")
@pytest.mark.parametrize("mode", ["abort", "wait", "keep", "retract"])
def test_an_empty_engine_and_a_second_pause(ckpts, mode):
    v1, v2, _ = ckpts
    e = Engine(v1, block_size=4)
    assert e.pause_generation(mode) == {"paused": True, "mode": mode, "num_aborted_requests": 0}, \
        where(f"{mode} on an empty engine aborts nothing")
    assert e.pause_generation(mode)["num_aborted_requests"] == 0 and len(e.pause_stats) == 1, \
        where("a second pause in the same mode changes nothing")
    other = "keep" if mode != "keep" else "abort"
    with pytest.raises(ValueError):
        e.pause_generation(other)
    rec = e.pause_stats[-1]
    assert rec == PauseRecord(mode, wait_s=rec.wait_s), where(f"{mode} on an empty engine counts nothing")
    e.update_weights_from_disk(v2, weight_version="v2")
    e.continue_generation()
    assert_hot_equals_cold(e, v2, ["empty"], max_new_tokens=3)


@pytest.mark.exercise("ch02.pause_modes")
def test_an_unknown_mode_changes_nothing(ckpts, rng):
    v1, _, _ = ckpts
    load = Load(rng, v1)
    e = load.engine
    running, queued, _ = load.in_flight()
    record = PauseRecord("bogus")
    with pytest.raises(ValueError):
        e.pause.handle_in_flight("bogus", record, "no such mode")
    assert record == PauseRecord("bogus"), where("an unknown mode leaves the record untouched")
    assert ([s.rid for s in e.scheduler.running], [s.rid for s in e.scheduler.waiting]) == (running, queued), \
        where("an unknown mode moves no request")


@pytest.mark.exercise("ch02.pause_modes")
def test_an_update_that_aborts_uses_the_same_rules(ckpts, rng):
    v1, v2, _ = ckpts
    load = Load(rng, v1)
    e = load.engine
    running, queued, tokens = load.in_flight()
    discarded = sum(len(tokens[r]) - len(load.prompts[load.index[r]]) for r in running + queued)
    e.update_weights_from_disk(v2, weight_version="v2", abort_all_requests=True)
    rec = e.pause_stats[-1]
    assert (rec.aborted_requests, rec.discarded_tokens) == (len(running + queued), discarded), \
        where("abort_all_requests=True aborts and counts as a pause in abort mode does")
    load.collect(e.step())
    assert all(load.outputs[r]["meta_info"]["finish_reason"]["type"] == "abort" for r in running + queued), \
        where("every aborted request's output is returned")


# ---- ch02.versions (spans) -----------------------------------------------------------

@pytest.mark.exercise("ch02.versions")
def test_spans_of_random_version_runs(rng):
    from course_lib.engine.sequence import SamplingParams, Sequence
    for trial in range(200):
        versions = []
        for _ in range(rng.randint(0, 6)):
            versions += [rng.choice(["v1", "v2", "v3", "default"])] * rng.randint(1, 5)
        seq = Sequence([1, 2, 3], SamplingParams(), block_size=4)
        for i, v in enumerate(versions):
            seq.append_token(rng.randrange(256), v)
            if rng.random() < 0.3:
                mid = seq.version_spans()
                assert mid == spans_of(versions[:i + 1]), where(
                    f"after {i + 1} tokens {versions[:i + 1]}: expected spans {spans_of(versions[:i + 1])}, got {mid}")
        got = seq.version_spans()
        assert got == spans_of(versions), where(
            f"versions {versions}: expected spans {spans_of(versions)} (end exclusive, counted over "
            f"output tokens, one span per run of equal versions), got {got}")
        assert seq.token_versions == versions, where("version_spans must not change the tags")


@pytest.mark.exercise("ch02.versions")
def test_spans_across_two_updates(ckpts, rng):
    v1, v2, v3 = ckpts
    e = Engine(v1, block_size=rng.choice([4, 8]))
    n = rng.randint(14, 24)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(3, 12))] for _ in range(3)]
    rids = [e.add_request(input_ids=p, sampling_params=greedy(n)) for p in prompts]
    outs, cuts = {}, []
    for path, version in ((v2, "v2"), (v3, "v3")):
        for _ in range(rng.randint(2, 5)):
            outs.update({o["rid"]: o for o in e.step()})
        cuts.append(e.requests[rids[0]].num_completion_tokens)
        e.pause_generation("keep")
        e.update_weights_from_disk(path, weight_version=version)
        e.continue_generation()
    for _ in range(MAX_STEPS):
        if not e.has_unfinished_requests():
            break
        outs.update({o["rid"]: o for o in e.step()})
    a, b = cuts
    want = spans_of(["default"] * a + ["v2"] * (b - a) + ["v3"] * (n - b))
    for rid in rids:
        assert outs[rid]["meta_info"]["weight_versions"] == want, \
            where(f"two updates in keep mode after {a} and {b} tokens: expected {want}")


# ---- ch02.flush_rules -----------------------------------------------------------------

@pytest.mark.exercise("ch02.flush_rules")
def test_flush_refused_while_serving_allowed_idle(ckpts, rng):
    v1, _, _ = ckpts
    load = load_with_cached_blocks(rng, v1)
    e = load.engine
    before = dict(e.block_manager.hash_to_block_id)
    assert e.flush_cache() is False, where("requests in flight and not paused: the flush is refused")
    assert e.block_manager.hash_to_block_id == before, where("a refused flush changes nothing")
    load.drain()
    entries = len(e.block_manager.hash_to_block_id)
    assert e.flush_cache() is True, where("idle: the flush is allowed")
    assert e.block_manager.hash_to_block_id == {} and e.last_flush_entries == entries, \
        where(f"the flush dropped every entry and says how many ({entries})")


@pytest.mark.exercise("ch02.flush_rules")
@pytest.mark.parametrize("mode,allowed", [("abort", True), ("keep", True), ("retract", True), ("wait", False)])
def test_flush_while_paused(ckpts, rng, mode, allowed):
    v1, _, _ = ckpts
    load = load_with_cached_blocks(rng, v1)  # an empty cache would make "dropped" and "changes nothing" hollow
    e = load.engine
    e.pause_generation(mode)
    before = dict(e.block_manager.hash_to_block_id)
    assert e.flush_cache() is allowed, where(f"paused in {mode}: the flush is {'allowed' if allowed else 'refused'}")
    if allowed:
        assert e.block_manager.hash_to_block_id == {} and e.last_flush_entries == len(before), \
            where("the flush dropped every entry and says how many")
    else:
        assert e.block_manager.hash_to_block_id == before, where("a refused flush changes nothing")


@pytest.mark.exercise("ch02.flush_rules")
def test_flush_on_an_empty_paused_engine(ckpts):
    e = Engine(ckpts[0], block_size=4)
    e.pause_generation("wait")
    assert e.flush_cache() is True, where("paused in wait with nothing in flight: nothing is served, the flush is allowed")


# ---- ch02.versions (tags) -------------------------------------------------------------

@pytest.mark.exercise("ch02.versions")
def test_tags_and_logprobs_of_random_appends(rng):
    from course_lib.engine.sequence import SamplingParams, Sequence
    for trial in range(100):
        with_lp = rng.random() < 0.5
        prompt = [rng.randrange(256) for _ in range(rng.randint(1, 6))]
        seq = Sequence(prompt, SamplingParams(), block_size=4, return_logprob=with_lp)
        tokens, versions, lps = [], [], []
        for _ in range(rng.randint(0, 12)):
            tok, ver, lp = rng.randrange(256), rng.choice(["default", "v2", "v3"]), -rng.random() * 5
            seq.next_logprob = lp
            seq.append_token(tok, ver)
            tokens.append(tok), versions.append(ver), lps.append(lp)
        assert seq.token_ids == prompt + tokens, where("every token goes at the end of token_ids, in order")
        assert seq.token_versions == versions, where(f"each token keeps its own version: expected {versions}, "
                                                     f"got {seq.token_versions}")
        assert seq.output_logprobs == (lps if with_lp else []), where(
            "with return_logprob each token keeps the logprob the sampler left for it; without, none")
        if with_lp and tokens:
            assert seq.next_logprob is None, where("the logprob is taken: next_logprob goes back to None")


@pytest.mark.exercise("ch02.versions")
def test_tags_across_two_updates_with_logprobs(ckpts, rng):
    v1, v2, v3 = ckpts
    e = Engine(v1, block_size=rng.choice([4, 8]))
    n = rng.randint(14, 24)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(3, 12))] for _ in range(3)]
    flags = [True, False, rng.random() < 0.5]
    rids = [e.add_request(input_ids=p, sampling_params={"max_new_tokens": n, "temperature": 0.8,
                                                        "seed": rng.randrange(1000), "ignore_eos": True},
                          return_logprob=f) for p, f in zip(prompts, flags)]
    seqs = {r: e.requests[r] for r in rids}
    outs, cuts = {}, []
    for path, version in ((v2, "v2"), (v3, "v3")):
        for _ in range(rng.randint(2, 5)):
            outs.update({o["rid"]: o for o in e.step()})
        cuts.append(seqs[rids[0]].num_completion_tokens)
        e.pause_generation("keep")
        e.update_weights_from_disk(path, weight_version=version)
        e.continue_generation()
    for _ in range(MAX_STEPS):
        if not e.has_unfinished_requests():
            break
        outs.update({o["rid"]: o for o in e.step()})
    a, b = cuts
    want = ["default"] * a + ["v2"] * (b - a) + ["v3"] * (n - b)
    for rid, flag in zip(rids, flags):
        assert seqs[rid].token_versions == want, where(f"two updates in keep mode after {a} and {b} tokens: "
                                                       f"each token tagged with the version live when it was made")
        if flag:
            triples = outs[rid]["meta_info"]["output_token_logprobs"]
            assert [t for _, t, _ in triples] == outs[rid]["output_ids"], \
                where("return_logprob: one logprob per output token")
            assert all(math.isfinite(lp) and lp <= 0 for lp, _, _ in triples), \
                where("each logprob is the sampler's, a finite number <= 0")
        else:
            assert "output_token_logprobs" not in outs[rid]["meta_info"] and seqs[rid].output_logprobs == [], \
                where("no return_logprob: no logprob is kept")


# ---- ch02.wait_drain ------------------------------------------------------------------

@pytest.mark.exercise("ch02.wait_drain")
def test_drain_returns_every_output_once_on_the_old_weights(ckpts, rng):
    v1, v2, _ = ckpts
    load = Load(rng, v1)
    e = load.engine
    running, queued, _ = load.in_flight()
    e.pause_generation("wait")
    t0 = time.perf_counter()
    e.update_weights_from_disk(v2, weight_version="v2")
    elapsed = time.perf_counter() - t0
    assert not e.scheduler.running and not e.scheduler.waiting, where("the drain ran every request to its end")
    wait_s = e.pause_stats[-1].wait_s
    assert 0 < wait_s <= elapsed, where(f"record.wait_s holds the drain's seconds: got {wait_s}, "
                                        f"the whole update took {elapsed}")
    e.continue_generation()
    load.drain()
    load.collect(e.step())  # collect() fails on an output returned twice
    assert set(load.outputs) == set(load.rids), where(
        f"every request returns its output: missing {sorted(set(load.rids) - set(load.outputs))}")
    for rid in running + queued:
        i = load.index[rid]
        out = load.outputs[rid]
        assert len(out["output_ids"]) == load.lengths[i], where("a drained request is complete")
        assert [s["version"] for s in out["meta_info"]["weight_versions"]] == ["default"], \
            where("wait: every token of a request in flight comes from the old weights")
    assert_hot_equals_cold(e, v2, ["after the drain"], max_new_tokens=3)


@pytest.mark.exercise("ch02.wait_drain")
def test_drain_times_out_then_a_later_update_finishes_it(ckpts, rng):
    v1, v2, _ = ckpts
    load = Load(rng, v1)
    e = load.engine
    long_prompt = [rng.randrange(256) for _ in range(rng.randint(3, 10))]
    load.rids.append(e.add_request(input_ids=long_prompt, sampling_params=greedy(rng.randint(150, 250))))
    load.prompts.append(long_prompt)
    load.index[load.rids[-1]] = len(load.rids) - 1
    e.pause_generation("wait")
    t0 = time.perf_counter()
    with pytest.raises(TimeoutError) as info:
        e.update_weights_from_disk(v2, weight_version="v2", wait_timeout_s=rng.choice([0.0, 1e-6, 1e-4]))
    elapsed = time.perf_counter() - t0
    assert "not changed" in str(info.value), where("the timeout says the weights were not changed")
    assert e.weight_version == "default" and e.weight_update_count == 0, where("a timed-out drain changes no weights")
    assert load.rids[-1] in e.requests, where("the long request is still in flight after the timeout")
    wait_s = e.pause_stats[-1].wait_s
    assert 0 < wait_s <= elapsed, where(f"the time waited is recorded when the drain gives up too: got {wait_s}")
    e.update_weights_from_disk(v2, weight_version="v2")
    assert e.pause_stats[-1].wait_s > wait_s, where("the second drain adds its own wait to the record")
    e.continue_generation()
    load.drain()
    load.collect(e.step())
    assert set(load.outputs) == set(load.rids), where(
        "outputs of requests that finished in either drain come back, each once: missing "
        f"{sorted(set(load.rids) - set(load.outputs))}")
    assert [s["version"] for s in load.outputs[load.rids[-1]]["meta_info"]["weight_versions"]] == ["default"], \
        where("the long request finished on the old weights")


@pytest.mark.exercise("ch02.wait_drain")
def test_drain_with_nothing_in_flight(ckpts):
    v1, v2, _ = ckpts
    e = Engine(v1, block_size=4)
    e.pause_generation("wait")
    e.update_weights_from_disk(v2, weight_version="v2", wait_timeout_s=0.0)
    assert e.weight_version == "v2", where("nothing in flight: the drain returns at once, even with no time allowed")
    assert e.step() == [], where("an empty drain leaves no output behind")
