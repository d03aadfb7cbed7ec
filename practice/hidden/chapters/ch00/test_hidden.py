"""Hidden tests for chapter 00: the learner's cold-start timer and update estimate on fresh
random inputs each run, edge cases and a real checkpoint's bytes. No case compares with a
wall-clock measurement's size. No case starts the engine: it loads weights with chapter
01's parts, and chapter 00 is graded on its own parts alone."""
import math
import random

import pytest

from course_lib.bench.cold_start import phases_from_marks
from course_lib.sim.estimate import TRANSPORTS, estimate_update
from course_lib.weights.checkpoint import CheckpointReader, make_random, preset
from conftest import hidden_seed  # the judge's plugin: a fixed seed, so a grade repeats

phases_case = pytest.mark.exercise("ch00.cold_start_phases")
estimate_case = pytest.mark.exercise("ch00.estimate_update")
COLD_PHASES = ["process_start", "import_torch", "import_course_lib", "device_init", "load_weights",
               "kv_pool_and_graph_capture", "first_token", "total"]


@pytest.fixture
def rng():
    seed = hidden_seed()
    print(f"seed {seed}")
    return random.Random(seed), seed


def _close(a, b) -> bool:
    return isinstance(a, (int, float)) and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


# ch00.cold_start_phases --------------------------------------------------------------------

def _random_marks(r, n):
    start = r.uniform(1.6e9, 1.9e9)  # a time.time() of these years
    marks, t = [], start
    for i in range(n):
        t += r.choice([0.0, r.uniform(1e-6, 1e-3), r.uniform(0.01, 5.0)])
        marks.append((f"phase_{i}_{r.randrange(1000)}", t))
    return start, marks


@phases_case
def test_cold_start_phases_random_marks(rng):
    r, seed = rng
    for _ in range(50):
        start, marks = _random_marks(r, r.randint(1, 9))
        as_json = [list(m) for m in marks] if r.random() < 0.5 else list(marks)
        copy = [list(m) if isinstance(m, list) else m for m in as_json]
        got = phases_from_marks(start, as_json)
        assert as_json == copy, f"seed {seed}: the marks were changed"
        names = [n for n, _ in marks]
        assert list(got) == names + ["total"], f"seed {seed}: keys {list(got)}, expected {names + ['total']}"
        previous = start
        for name, at in marks:
            assert _close(got[name], at - previous), \
                f"seed {seed}: phase {name} should last {at - previous!r} s (from the mark before it), " \
                f"got {got[name]!r}"
            previous = at
        assert _close(got["total"], marks[-1][1] - start), \
            f"seed {seed}: total should run from the spawn to the last mark"
        summed = sum(v for k, v in got.items() if k != "total")
        assert math.isclose(summed, got["total"], rel_tol=1e-9, abs_tol=1e-9), \
            f"seed {seed}: the phases must add up to the total"


@phases_case
def test_cold_start_phases_empty_and_zero_length(rng):
    r, seed = rng
    start = r.uniform(1.6e9, 1.9e9)
    assert phases_from_marks(start, []) == {"total": 0.0}, "no marks: {'total': 0.0}"
    got = phases_from_marks(start, [("a", start), ("b", start)])
    assert got == {"a": 0.0, "b": 0.0, "total": 0.0}, f"seed {seed}: marks at the spawn time last 0 s, got {got}"


@phases_case
@pytest.mark.parametrize("case", ["repeat", "total", "backwards", "before_spawn", "nan", "inf", "nan_spawn"])
def test_cold_start_phases_refuses_bad_marks(rng, case):
    r, seed = rng
    start, marks = _random_marks(r, r.randint(3, 6))
    i = r.randrange(1, len(marks))
    name, at = marks[i]
    spawned = start
    if case == "repeat":
        marks[i] = (marks[r.randrange(i)][0], at)
    elif case == "total":
        marks[i] = ("total", at)
    elif case == "backwards":
        marks[i] = (name, marks[i - 1][1] - r.uniform(1e-3, 1.0))
    elif case == "before_spawn":
        marks[0] = (marks[0][0], start - r.uniform(1e-3, 1.0))
    elif case == "nan_spawn":
        spawned = float("nan")
    else:
        marks[i] = (name, float(case))
    before = list(marks)
    with pytest.raises(ValueError):
        phases_from_marks(spawned, marks)
        pytest.fail(f"seed {seed}: {case}: marks {marks} were accepted")
    assert marks == before, f"seed {seed}: refused marks must be left unchanged"




@phases_case
@pytest.mark.parametrize("case", ["repeat", "total", "backwards", "before_spawn", "nan", "inf", "neg_inf"])
def test_cold_start_phases_refusals_name_the_mark(rng, case):
    """The contract: a refused mark raises ``ValueError`` naming it (the message must let an
    operator find the phase in the cold start's output)."""
    r, seed = rng
    start = r.uniform(1.6e9, 1.9e9)
    words = r.sample(["import_torch", "device_init", "load_weights", "kv_pool", "graph_capture", "first_token",
                      "tokenizer", "warmup", "audit"], r.randint(3, 6))
    t, marks = start, []
    for w in words:
        t += r.uniform(0.01, 3.0)
        marks.append((w, t))
    i = r.randrange(1, len(marks))
    name, at = marks[i]
    named = {name}
    if case == "repeat":
        marks[i] = (marks[r.randrange(i)][0], at)
        named = {marks[i][0]}
    elif case == "total":
        marks[i] = ("total", at)
        named = {"total"}
    elif case == "backwards":
        marks[i] = (name, marks[i - 1][1] - r.uniform(1e-3, 1.0))
        named = {name, marks[i - 1][0]}  # the mark that goes back, or the one it goes back from
    elif case == "before_spawn":
        marks[0] = (marks[0][0], start - r.uniform(1e-3, 1.0))
        named = {marks[0][0]}
    else:
        marks[i] = (name, {"nan": math.nan, "inf": math.inf, "neg_inf": -math.inf}[case])
    with pytest.raises(ValueError) as info:
        phases_from_marks(start, marks)
        pytest.fail(f"seed {seed}: {case}: marks {marks} were accepted")
    message = str(info.value)
    assert any(n in message for n in named), \
        f"seed {seed}: {case}: the ValueError names the mark ({' or '.join(sorted(named))}); got {message!r}"


# ch00.estimate_update ----------------------------------------------------------------------

def _formula(nbytes, bandwidths, phases, chunks, num_gpus):
    busy = {p: nbytes / num_gpus / (bandwidths[p] * 1e9) for p in phases}
    return busy, (sum(busy.values()) + (chunks - 1) * max(busy.values())) / chunks


def _random_case(r):
    names = ["read", "host_to_device", "copy", "network", "unpack"]
    phases = tuple(r.sample(names, r.randint(1, len(names))))
    bandwidths = {p: round(r.uniform(0.5, 3000.0), 3) for p in names}
    nbytes = r.choice([r.randint(1, 10**6), r.randint(10**8, 10**12), r.randint(10**6, 10**9) * 0.5])
    return nbytes, bandwidths, phases, r.randint(1, 64), r.choice([1, 2, 3, 4, 8])


@estimate_case
def test_estimate_update_random_sizes(rng):
    r, seed = rng
    for _ in range(200):
        nbytes, bandwidths, phases, chunks, gpus = _random_case(r)
        copy = dict(bandwidths)
        got = estimate_update(nbytes, bandwidths, phases, chunks=chunks, num_gpus=gpus)
        busy, total = _formula(nbytes, bandwidths, phases, chunks, gpus)
        where = (f"seed {seed}: {nbytes:,} bytes through {phases} at {[bandwidths[p] for p in phases]} GB/s, "
                 f"{chunks} chunks, {gpus} GPUs")
        assert bandwidths == copy, f"{where}: the bandwidths were changed"
        assert list(got) == list(phases) + ["total"], f"{where}: keys {list(got)}"
        for p in phases:
            assert _close(got[p], busy[p]), \
                f"{where}: phase {p} should be {busy[p]!r} s (1 GB = 1e9 bytes), got {got[p]!r}"
        assert _close(got["total"], total), \
            f"{where}: total should be {total!r} s ((sum + (chunks - 1) x slowest) / chunks), got {got['total']!r}"


@estimate_case
def test_estimate_update_zero_bytes(rng):
    r, seed = rng
    _, bandwidths, phases, chunks, gpus = _random_case(r)
    got = estimate_update(0, bandwidths, phases, chunks=chunks, num_gpus=gpus)
    assert got == {**{p: 0.0 for p in phases}, "total": 0.0}, f"seed {seed}: no bytes take no time, got {got}"


@estimate_case
@pytest.mark.parametrize("case", ["negative", "nan_bytes", "inf_bytes", "no_phases", "repeat", "total_phase",
                                  "missing", "zero_bw", "negative_bw", "nan_bw", "chunks0", "gpus0", "chunks_float",
                                  "chunks_true", "gpus_true", "gpus_false"])
def test_estimate_update_refuses_bad_input(rng, case):
    r, seed = rng
    nbytes, bandwidths, phases, chunks, gpus = _random_case(r)
    p = r.choice(phases)
    if case == "negative":
        nbytes = -nbytes
    elif case in ("nan_bytes", "inf_bytes"):
        nbytes = float(case[:3])
    elif case == "no_phases":
        phases = ()
    elif case == "repeat":
        phases = phases + (p,)
    elif case == "total_phase":
        phases, bandwidths["total"] = phases + ("total",), 1.0
    elif case == "missing":
        del bandwidths[p]
    elif case in ("zero_bw", "negative_bw", "nan_bw"):
        bandwidths[p] = {"zero_bw": 0.0, "negative_bw": -bandwidths[p], "nan_bw": float("nan")}[case]
    elif case == "chunks0":
        chunks = 0
    elif case == "gpus0":
        gpus = 0
    elif case in ("chunks_true", "gpus_true", "gpus_false"):  # a bool is not a count ("a whole number >= 1")
        chunks, gpus = (True, gpus) if case == "chunks_true" else (chunks, case == "gpus_true")
    else:
        chunks = chunks + 0.5
    with pytest.raises(ValueError):
        estimate_update(nbytes, bandwidths, phases, chunks=chunks, num_gpus=gpus)
        pytest.fail(f"seed {seed}: {case} was accepted")


@estimate_case
def test_estimate_update_a_real_checkpoint(tmp_path, rng):
    """At 1 GB/s through one phase the estimate is a real checkpoint's byte count in ns (the
    bytes a hot update moves: tests/test_pause_modes.py checks the engine reports those)."""
    r, seed = rng
    config = preset("tiny", num_hidden_layers=r.randint(1, 3), intermediate_size=r.choice([64, 96, 128]))
    new = make_random(tmp_path / "new", config, seed=r.randrange(10_000, 20_000))
    nbytes = CheckpointReader(new).nbytes()
    got = estimate_update(nbytes, {"copy": 1.0}, TRANSPORTS["ipc"])
    assert _close(got["copy"] * 1e9, nbytes), \
        f"seed {seed}: at 1 GB/s your estimate implies {got['copy'] * 1e9:,.0f} bytes, the engine moved {nbytes:,}"
    gpus = r.choice([2, 4])
    bw = {"read": r.uniform(1, 20), "host_to_device": r.uniform(10, 60), "copy": r.uniform(500, 3000)}
    got = estimate_update(nbytes, bw, TRANSPORTS["disk"], chunks=config.num_hidden_layers, num_gpus=gpus)
    busy, total = _formula(nbytes, bw, TRANSPORTS["disk"], config.num_hidden_layers, gpus)
    assert _close(got["total"], total), f"seed {seed}: layer-by-layer disk update of {nbytes:,} bytes: " \
                                        f"expected {total!r} s, got {got['total']!r}"
