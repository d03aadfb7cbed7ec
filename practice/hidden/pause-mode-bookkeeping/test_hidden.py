"""Hidden tests for pause-mode-bookkeeping: fresh random loads in the real engine, every mode.

Each case builds a live engine on a random tiny checkpoint, lets a random load run a
random number of steps, calls the candidate on the engine's unfinished requests, and only
then pauses the real engine in that mode, updates it to another checkpoint, continues and
drains it; ``engine.pause_stats[-1]`` is the truth. The random seed is in every message.
"""
import random

import pytest

from engine_load import LEDGER_KEYS, greedy, live_engine, measured_ledger, unfinished_requests
from conftest import hidden_seed  # the judge's plugin: a fixed seed, so a grade repeats

SEED = hidden_seed()
RNG = random.Random(SEED)
WHY = f"(random seed {SEED})"
MODES = ["abort", "wait", "keep", "in_place", "retract"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from course_lib.weights.checkpoint import make_random
    root = tmp_path_factory.mktemp("ckpts")
    return (make_random(root / "old", "tiny", seed=RNG.randrange(10_000)),
            make_random(root / "new", "tiny", seed=RNG.randrange(10_000, 20_000)))


def tokens(n):
    return [RNG.randrange(256) for _ in range(n)]


def rollout_load(block_size, steps):
    """Greedy twins whose length at the pause is whole blocks, an RL group sharing a
    prompt, and single requests arriving later (some stay queued)."""
    fewest = -(-(steps + 1) // block_size)
    twin = tokens(block_size * RNG.randint(fewest, fewest + 2) - steps)
    group = tokens(RNG.randint(block_size + 1, 3 * block_size))
    load = [(0, twin, greedy(40))] * 2
    load += [(0, group, {"max_new_tokens": 40, "temperature": 1.0, "seed": RNG.randrange(10**6), "ignore_eos": True})
             for _ in range(RNG.randint(2, 4))]
    load += [(RNG.randint(0, 4), tokens(RNG.randint(3, 3 * block_size)), greedy(RNG.randint(20, 40)))
             for _ in range(RNG.randint(1, 3))]
    return sorted(load, key=lambda item: item[0])


def preempting_load():
    """Three requests that outgrow a small KV pool: the scheduler preempts one, which then
    waits in the queue holding generated tokens; a late one waits without any."""
    load = [(0, tokens(8), greedy(16)) for _ in range(3)]
    return load + [(3, tokens(5), greedy(8))]


def scenarios():
    """(name, load, steps, engine options)."""
    bs = RNG.choice([4, 8])
    steps = RNG.randint(3, 9)
    yield (f"rollout load, block size {bs}, {steps} steps", rollout_load(bs, steps), steps,
           dict(block_size=bs, max_num_seqs=RNG.randint(4, 7)))
    steps = RNG.randint(3, 9)
    yield (f"rollout load with room for four, block size 4, {steps} steps", rollout_load(4, steps), steps,
           dict(block_size=4, max_num_seqs=4))
    steps = RNG.randint(6, 11)
    yield (f"a small KV pool that forces a preemption, {steps} steps", preempting_load(), steps,
           dict(block_size=4, num_kv_blocks=10, max_num_seqs=4))


SCENARIOS = list(scenarios())


def describe(view):
    running = sum(r["running"] for r in view)
    preempted = sum(1 for r in view if not r["running"] and len(r["token_ids"]) > r["num_prompt_tokens"])
    return f"{len(view)} unfinished requests: {running} running, {len(view) - running} queued ({preempted} preempted)"


def check(candidate, checkpoints, mode, name, load, steps, options):
    old, new = checkpoints
    engine = live_engine(old, load, steps, **options)
    view = unfinished_requests(engine)
    got = candidate.pause_ledger(mode, [dict(r, token_ids=list(r["token_ids"])) for r in view],
                                 options["block_size"])
    want = measured_ledger(engine, mode, new)
    call = f"pause_ledger({mode!r}, ...) for {name} ({describe(view)})"
    assert isinstance(got, dict) and set(got) == set(LEDGER_KEYS), \
        f"{call} returns a dict with keys {sorted(LEDGER_KEYS)}, got {got!r} {WHY}"
    wrong = [f"{k}: engine {want[k]!r}, you {got[k]!r}" for k in LEDGER_KEYS
             if ((bool(got[k]) is not want[k]) if k == "kv_fresh" else got[k] != want[k])]
    assert not wrong, f"{call} disagrees with engine.pause_stats[-1]: {'; '.join(wrong)} {WHY}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("index", range(len(SCENARIOS)), ids=[s[0].split(",")[0] for s in SCENARIOS])
def test_random_load_in_the_engine(candidate, checkpoints, mode, index):
    check(candidate, checkpoints, mode, *SCENARIOS[index])


def test_retract_reuses_a_block_only_along_a_matching_prefix(candidate, checkpoints):
    """Blocks with the same tokens at the same place but a different block before them are
    not the same cached block: reuse follows the chain of whole blocks from the start."""
    p1, p2, p3, q1, q2, q3 = (tokens(4) for _ in range(6))
    load = [(0, p1 + p2 + p3 + tokens(1), greedy(20)),  # fills the cache first
            (0, q1 + q2 + q3 + tokens(1), greedy(20)),  # none of those blocks
            (0, p1 + q2 + p3 + tokens(1), greedy(20)),  # every block seen before, but only p1 as a prefix
            (0, p2 + p3 + tokens(5), greedy(20))]       # blocks seen before, at other places
    check(candidate, checkpoints, "retract", "four requests whose blocks repeat at the same places, 3 steps",
          load, 3, dict(block_size=4, max_num_seqs=4))


@pytest.mark.parametrize("mode", MODES)
def test_nothing_has_run_yet(candidate, checkpoints, mode):
    """Requests queued, none admitted: keep holds no stale KV, retract has nothing to send back."""
    old, new = checkpoints
    from course_lib import Engine
    engine = Engine(old, block_size=4)
    for _ in range(3):
        engine.add_request(input_ids=tokens(RNG.randint(3, 20)), sampling_params=greedy(10))
    view = unfinished_requests(engine)
    got = candidate.pause_ledger(mode, view, 4)
    want = measured_ledger(engine, mode, new)
    assert isinstance(got, dict) and set(got) == set(LEDGER_KEYS), f"returns the six keys, got {got!r} {WHY}"
    wrong = [f"{k}: engine {want[k]!r}, you {got[k]!r}" for k in LEDGER_KEYS
             if ((bool(got[k]) is not want[k]) if k == "kv_fresh" else got[k] != want[k])]
    assert not wrong, (f"pause_ledger({mode!r}, ...) with three queued requests and none running disagrees with "
                       f"engine.pause_stats[-1]: {'; '.join(wrong)} {WHY}")


@pytest.mark.parametrize("mode", ["Keep", "pause", "", "in-place", "restart"])
def test_other_modes_raise(candidate, mode):
    with pytest.raises(ValueError):
        candidate.pause_ledger(mode, [{"rid": "x", "running": True, "token_ids": [1, 2, 3], "num_prompt_tokens": 2}], 4)
