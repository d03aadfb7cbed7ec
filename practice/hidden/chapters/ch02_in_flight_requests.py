"""Hidden tests for notebooks/02_in_flight_requests.ipynb: the learner's code against the real engine.

``check_retract_bill(retract_bill)``: the learner predicts, from the engine's unfinished
requests, which ones a pause in ``retract`` mode sends back and how many tokens their
re-prefill computes. The real engine then pauses, updates to another checkpoint,
continues and drains; its ``pause_stats`` and ``num_prefill_tokens`` are the truth.
Loads are random: groups of samples sharing a prompt (as RL rollouts send them), greedy
duplicates, requests still queued behind ``max_num_seqs``.

``check_choose_mode(choose_mode)``: the learner's choice is compared with the course's
rule on random loads (through ``course_lib.sim.pause_costs``), then a few chosen modes
are run in the real engine, whose outputs must keep the promises the constraints ask
for (one weight version per output, fresh KV, a bounded drain).

Both return a list of failure messages (empty: passed); see ``__init__.py`` for why.
"""
from __future__ import annotations

import copy
import os
import random
import tempfile

from course_lib import Engine
from course_lib.engine.sequence import SequenceStatus
from course_lib.sim.pause_costs import pause_costs
from course_lib.weights.checkpoint import make_random

PREFERENCE = ("keep", "retract", "wait", "abort")


def _rng(seed) -> random.Random:
    return random.Random(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))


def unfinished_requests(engine: Engine) -> list[dict]:
    """The engine's unfinished requests in arrival order, as the exercise describes them."""
    return [{"rid": seq.rid, "running": seq.status == SequenceStatus.RUNNING,
             "token_ids": list(seq.token_ids), "num_prompt_tokens": seq.num_prompt_tokens}
            for seq in engine.requests.values() if not seq.is_finished]


def _random_load(rng: random.Random, block_size: int, steps: int) -> list[tuple[int, list[int], dict]]:
    """(arrival step, prompt ids, sampling params): greedy twins, a rollout group, singles.

    The twins arrive first and their length at the pause is a whole number of blocks, so
    the second twin matches the first up to its last token: only the rule that the block
    holding the last token is always computed gives the right count."""
    def tokens(n):
        return [rng.randrange(256) for _ in range(n)]

    fewest = -(-(steps + 1) // block_size)  # blocks, so that the prompt has at least one token
    twin_len = block_size * rng.randint(fewest, fewest + 2)
    twin_prompt = tokens(twin_len - steps)  # generated: one token per step from step 0
    group_prompt = tokens(rng.randint(block_size + 1, 3 * block_size))
    load = [(0, twin_prompt, {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True})] * 2
    load += [(0, group_prompt, {"max_new_tokens": 40, "temperature": 1.0, "seed": rng.randrange(10**6),
                                "ignore_eos": True}) for _ in range(rng.randint(2, 4))]
    for _ in range(rng.randint(1, 3)):
        load.append((rng.randint(0, 4), tokens(rng.randint(3, 3 * block_size)),
                     {"max_new_tokens": rng.randint(20, 40), "temperature": 0, "ignore_eos": True}))
    return sorted(load, key=lambda item: item[0])  # stable: the twins stay first


def _drive(engine: Engine, load, steps: int) -> None:
    for step in range(steps):
        for at, prompt, params in load:
            if at == step:
                engine.add_request(input_ids=prompt, sampling_params=params)
        engine.step()


def _drain(engine: Engine) -> dict:
    outputs = {}
    while engine.has_unfinished_requests() or engine._pending:
        for out in engine.step():
            outputs[out["rid"]] = out
    return outputs


def check_retract_bill(retract_bill, seed=None) -> list[str]:
    """Failures of ``retract_bill(requests, block_size) -> {"retracted", "reprefill_tokens"}``."""
    rng = _rng(seed)
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        old = make_random(f"{tmp}/old", "tiny", seed=rng.randrange(10_000))
        new = make_random(f"{tmp}/new", "tiny", seed=rng.randrange(10_000, 20_000))
        for case, block_size in enumerate((4, 8, rng.choice((4, 8))), 1):
            # Case 2 has room for four: at least one request is still queued at the pause.
            engine = Engine(old, block_size=block_size, max_num_seqs=4 if case == 2 else rng.randint(4, 7))
            steps = rng.randint(3, 9)
            _drive(engine, _random_load(rng, block_size, steps), steps)
            view = unfinished_requests(engine)
            where = (f"case {case} (block size {block_size}, {len(view)} unfinished requests, "
                     f"{sum(r['running'] for r in view)} running)")
            try:  # the candidate first, on a copy it may change freely
                got = retract_bill(copy.deepcopy(view), block_size)
            except Exception as exc:  # report, do not raise: see __init__.py
                return [f"{where}: retract_bill raised {type(exc).__name__}: {exc}"]
            if not isinstance(got, dict) or set(got) != {"retracted", "reprefill_tokens"}:
                return [f"{where}: retract_bill must return a dict with keys 'retracted' and "
                        f"'reprefill_tokens', got {got!r}"]
            engine.pause_generation("retract")
            truth_order = [s.rid for s in engine.scheduler.waiting if s.retract_record is not None]
            prefill_before = engine.num_prefill_tokens
            engine.update_weights_from_disk(new, weight_version="v2")
            engine.continue_generation()
            _drain(engine)
            record = engine.pause_stats[-1]
            names = {r["rid"]: f"request {i}" for i, r in enumerate(view, 1)}
            retracted = list(got["retracted"]) if isinstance(got["retracted"], (list, tuple)) else got["retracted"]
            if retracted != truth_order:
                said = [names.get(r, repr(r)) for r in retracted] if isinstance(retracted, list) else retracted
                failures.append(f"{where}: you said {said} would be retracted (in that order); the engine retracted "
                                f"{[names[r] for r in truth_order]}, in the order they are re-prefilled")
            if record["retracted_requests"] != len(truth_order):  # the test's own premise
                failures.append(f"{where}: the engine's record disagrees with its queue; please report this")
            measured = record["reprefill_tokens"]
            if got["reprefill_tokens"] != measured:
                failures.append(f"{where}: you predicted {got['reprefill_tokens']!r} re-prefilled tokens; the engine "
                                f"computed {measured} (requests that share whole blocks reuse the KV the first of "
                                f"them computes again, and the block holding a request's last token is always "
                                f"computed)")
            if engine.num_prefill_tokens - prefill_before < measured:
                failures.append(f"{where}: the engine's prefill counter disagrees with its record; please report this")
    return failures


# ---- choose_mode ------------------------------------------------------------------------

def reference_choice(c: dict) -> str:
    """The rule the exercise states, through the course's cost model."""
    for mode in PREFERENCE:
        cost = pause_costs(mode, c["done"], c["left"], c["prompt"], c["step_ms"])
        if ((not c["single_version"] or cost["mixed"] == 0) and (not c["fresh_kv"] or cost["kv_fresh"])
                and cost["wait_s"] <= c["max_wait_s"] and cost["reprefill"] <= c["max_reprefill"]):
            return mode
    return "abort"


def _random_constraints(rng: random.Random) -> dict:
    n = rng.randint(1, 12)
    kind = rng.random()
    done = [0] * n if kind < 0.1 else [rng.choice([0, rng.randint(1, 500)]) for _ in range(n)]
    left = [rng.randint(1, 3000) if rng.random() < 0.8 else 0 for _ in range(n)]
    prompt, step_ms = rng.randint(1, 2048), round(rng.uniform(5, 50), 1)
    costs = {m: pause_costs(m, done, left, prompt, step_ms) for m in PREFERENCE}
    wait_s, reprefill = costs["wait"]["wait_s"], costs["retract"]["reprefill"]
    # Budgets near the costs they cut, so that each side of every threshold comes up.
    return {"done": done, "left": left, "prompt": prompt, "step_ms": step_ms,
            "single_version": rng.random() < 0.5, "fresh_kv": rng.random() < 0.5,
            # (never exactly wait_s: two correct formulas may round it differently)
            "max_wait_s": rng.choice([wait_s * rng.uniform(0.3, 0.99), wait_s * rng.uniform(1.01, 3), 0.0,
                                      float("inf")]),
            "max_reprefill": rng.choice([reprefill, int(reprefill * rng.uniform(0.3, 0.99)),
                                         prompt * n, prompt * n - 1, 10**9])}


def _describe(c: dict) -> str:
    return (f"done={c['done']}, left={c['left']}, prompt={c['prompt']}, step_ms={c['step_ms']}, "
            f"single_version={c['single_version']}, fresh_kv={c['fresh_kv']}, max_wait_s={c['max_wait_s']:.4g}, "
            f"max_reprefill={c['max_reprefill']}")


def _run_in_engine(engine: Engine, new, mode: str, c: dict) -> list[str]:
    """Run ``mode`` on ``engine``'s live load and check the promises ``c`` asks for, as measured."""
    engine.pause_generation(mode)
    log_before = len(engine.step_log)
    engine.update_weights_from_disk(new, weight_version="v2")
    drain_steps = len(engine.step_log) - log_before
    engine.continue_generation()
    outputs = _drain(engine)
    problems = []
    survivors = [o for o in outputs.values() if o["meta_info"]["finish_reason"]["type"] != "abort"]
    if c["single_version"]:
        mixed = [o for o in survivors if len(o["meta_info"]["weight_versions"]) > 1]
        if mixed:
            problems.append(f"{len(mixed)} outputs mix two weight versions, but single_version was required")
    if c["fresh_kv"] and not engine.pause_stats[-1]["kv_fresh"]:
        problems.append("requests continued on KV the old weights computed, but fresh_kv was required")
    if drain_steps * c["step_ms"] / 1000 > c["max_wait_s"] + 1e-9:
        problems.append(f"the update waited {drain_steps} steps of {c['step_ms']} ms, more than max_wait_s")
    return problems


def check_choose_mode(choose_mode, seed=None) -> list[str]:
    """Failures of ``choose_mode(constraints) -> mode`` on random loads, then in the engine."""
    rng = _rng(seed)
    cases = [_random_constraints(rng) for _ in range(300)]
    try:  # the candidate first, on copies
        answers = [choose_mode(copy.deepcopy(c)) for c in cases]
    except Exception as exc:
        return [f"choose_mode raised {type(exc).__name__}: {exc}"]
    failures = []
    for c, got in zip(cases, answers):
        want = reference_choice(c)
        if got != want:
            failures.append(f"for {_describe(c)} you chose {got!r}; the first mode in the order keep, retract, "
                            f"wait, abort that meets every constraint is {want!r}")
            if len(failures) >= 3:
                failures.append("(more cases disagree; the first three are shown)")
                return failures
    if failures:
        return failures
    # In the engine: build a live load, ask for a choice from its real done/left, run it.
    with tempfile.TemporaryDirectory() as tmp:
        old = make_random(f"{tmp}/old", "tiny", seed=rng.randrange(10_000))
        new = make_random(f"{tmp}/new", "tiny", seed=rng.randrange(10_000, 20_000))
        for trial in range(4):
            engine = Engine(old, block_size=8, max_num_seqs=8)
            lengths = [rng.randint(12, 40) for _ in range(rng.randint(2, 5))]
            for n in lengths:
                engine.add_request(input_ids=[rng.randrange(256) for _ in range(16)],
                                   sampling_params={"max_new_tokens": n, "temperature": 0, "ignore_eos": True})
            for _ in range(rng.randint(2, 10)):
                engine.step()
            seqs = [s for s in engine.requests.values() if not s.is_finished]
            done = [s.num_completion_tokens for s in seqs]
            left = [s.params.max_new_tokens - s.num_completion_tokens for s in seqs]
            step_ms = 20.0
            c = {"done": done, "left": left, "prompt": 16, "step_ms": step_ms,
                 "single_version": trial % 2 == 0, "fresh_kv": trial in (1, 2),
                 "max_wait_s": rng.choice([0.0, max(left) * step_ms / 1000, 10.0]), "max_reprefill": 10**9}
            try:
                mode = choose_mode(copy.deepcopy(c))
            except Exception as exc:
                return [f"choose_mode raised {type(exc).__name__}: {exc}"]
            if mode not in PREFERENCE:
                return [f"choose_mode returned {mode!r}; expected one of {list(PREFERENCE)}"]
            for problem in _run_in_engine(engine, new, mode, c):
                failures.append(f"in the engine, with {_describe(c)}, you chose {mode!r}: {problem}")
    return failures
