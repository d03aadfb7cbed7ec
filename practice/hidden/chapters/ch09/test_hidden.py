"""Hidden tests for chapter 09: the canary comparison and promote-or-rollback in the real engine.

Fresh random checkpoints, prompts and edits each run (the seed is in every message). The
expected comparisons come from this file's own oracle, and weights, addresses and
versions are measured here, in the test's own dicts, never through anything the learner's
code returns.
"""
import copy
import random
import shutil

import pytest
import torch

from course_lib import Engine
from course_lib import production
from course_lib.testing import assert_hot_equals_cold
from course_lib.weights.commit.audit import kernel_tensors
from dataclasses import replace

from course_lib.weights.checkpoint import CheckpointReader, make_random, preset, write_checkpoint
from conftest import hidden_seed  # the judge's plugin: a fixed seed, so a grade repeats

FIRST, COMPARE, SNAPSHOT, ROLLBACK = (pytest.mark.exercise(f"ch09.{n}")
                                     for n in ("first_divergence", "compare_outputs", "host_snapshot", "rollback"))


@pytest.fixture
def rng():
    seed = hidden_seed()
    return random.Random(seed), f"seed {seed}"


def oracle_first(expected, got):
    for i in range(min(len(expected), len(got))):
        if expected[i] != got[i]:
            return i
    return None if len(expected) == len(got) else min(len(expected), len(got))


def oracle(expected, got):
    firsts = [oracle_first(e, g) for e, g in zip(expected, got)]
    matched = [1.0 if f is None else (f / len(e) if e else 0.0) for f, e in zip(firsts, expected)]
    return {"first_divergence": firsts, "agreement": sum(f is None for f in firsts) / len(firsts),
            "matched_fraction": sum(matched) / len(matched)}


def edited(r, out):
    """One edit of a real answer: a changed token (the tail may match again), cut short,
    run long, emptied, unchanged, or the same length with other tokens."""
    out = list(out)
    kind = r.choice(["change", "short", "long", "empty", "same", "shuffle"])
    if kind == "change" and out:
        k = r.randrange(len(out))
        out[k] = out[k] + r.randrange(1, 500)
    elif kind == "short" and out:
        out = out[: r.randrange(len(out))]
    elif kind == "long":
        out += [r.randrange(512) for _ in range(r.randint(1, 4))]
    elif kind == "empty":
        out = []
    elif kind == "shuffle" and len(set(out)) > 1:
        while True:
            other = r.sample(out, len(out))
            if other != out:
                out = other
                break
    return out


def prompts_for(r, n=5):
    return ["".join(r.choice("abcdefghijklmnop ,.") for _ in range(r.randint(3, 30))) for _ in range(n)]


def corrupted(r, src, dst):
    """``src`` with one decoder-layer tensor replaced by noise of its scale."""
    reader = CheckpointReader(src)
    tensors = dict(reader.iter_tensors())
    name = r.choice(sorted(n for n in tensors if n.startswith("model.layers.") and n.endswith("proj.weight")))
    gen = torch.Generator().manual_seed(r.randrange(1 << 30))
    tensors[name] = torch.randn(tensors[name].shape, generator=gen) * tensors[name].std()
    return write_checkpoint(dst, reader.config, tensors), name


def weights(engine):
    return {n: t.clone() for n, t in kernel_tensors(engine.model).items()}


def addresses(engine):
    out = {n: t.data_ptr() for n, t in kernel_tensors(engine.model).items()}
    out["kv_cache"] = engine.model_runner.kv_cache.data_ptr()
    return out


def assert_serving(engine, seed, prompt="still serving?"):
    assert not engine.paused, f"{seed}: the engine must be left serving (it is paused)"
    engine.generate(prompt, {"max_new_tokens": 2, "temperature": 0})
    assert engine.health()["healthy"], f"{seed}: the engine reports unhealthy: {engine.health()['reason']}"


# ---- ch09.first_divergence ----------------------------------------------------------------

@FIRST
def test_first_divergence_on_random_edits(rng):
    r, seed = rng
    for _ in range(300):
        expected = [r.randrange(50) for _ in range(r.randint(0, 12))]
        got = edited(r, expected) if r.random() < 0.8 else [r.randrange(50) for _ in range(r.randint(0, 12))]
        if r.random() < 0.5:
            expected, got = got, expected
        e_copy, g_copy = list(expected), list(got)
        answer = production.first_divergence(e_copy, g_copy)
        want = oracle_first(expected, got)
        assert e_copy == expected and g_copy == got, f"{seed}: first_divergence changed its inputs"
        assert answer == want and (answer is None or (type(answer) is int)), \
            f"{seed}: expected {expected}, got {got}: want {want!r}, you said {answer!r}"


@FIRST
def test_first_divergence_empty_and_cut_short(rng):
    r, seed = rng
    answer = [r.randrange(1, 100) for _ in range(r.randint(2, 10))]
    cut = r.randrange(1, len(answer))
    assert production.first_divergence([], []) is None, f"{seed}: two empty answers agree: None"
    assert production.first_divergence(answer, []) == 0, f"{seed}: an empty answer diverges at 0"
    assert production.first_divergence([], answer) == 0, f"{seed}: tokens where none were expected: 0"
    assert production.first_divergence(answer, answer[:cut]) == cut, f"{seed}: cut short at {cut}: {cut}"
    assert production.first_divergence(answer[:cut], answer) == cut, f"{seed}: ran on after {cut}: {cut}"


# ---- ch09.compare_outputs -----------------------------------------------------------------

def check_against_oracle(seed, name, expected, got):
    e_copy, g_copy = copy.deepcopy(expected), copy.deepcopy(got)
    answer = production.compare_outputs(e_copy, g_copy)
    assert e_copy == expected and g_copy == got, f"{seed}: compare_outputs changed its inputs ({name})"
    want = oracle(expected, got)
    assert answer["first_divergence"] == want["first_divergence"], \
        f"{seed}, {name}: first divergences {want['first_divergence']}, you said {answer['first_divergence']}"
    assert isinstance(answer["agreement"], float) and answer["agreement"] == pytest.approx(want["agreement"]), \
        f"{seed}, {name}: agreement (share of identical answers) {want['agreement']:.4f}, you said {answer['agreement']!r}"
    assert answer["matched_fraction"] == pytest.approx(want["matched_fraction"]), \
        f"{seed}, {name}: matched_fraction {want['matched_fraction']:.4f}, you said {answer['matched_fraction']!r}"


@COMPARE
def test_compare_outputs_on_real_engines(tmp_path, rng):
    r, seed = rng
    prompts, n = prompts_for(r), r.randint(8, 14)
    new = make_random(tmp_path / "new", "tiny", seed=r.randrange(10_000))
    twin = shutil.copytree(new, tmp_path / "twin")
    other = make_random(tmp_path / "other", "tiny", seed=r.randrange(10_000, 20_000))
    bad, _ = corrupted(r, new, tmp_path / "bad")
    out = {k: production.greedy_outputs(Engine(p), prompts, n) for k, p in
           [("new", new), ("twin", twin), ("other", other), ("bad", bad)]}
    for k in ["twin", "other", "bad"]:
        check_against_oracle(seed, f"v2 against {k}", out["new"], out[k])
    cut = [o[: r.randrange(len(o) + 1)] for o in out["new"]]
    check_against_oracle(seed, "answers cut short (an early end-of-sequence)", out["new"], cut)
    same_length = [list(reversed(o)) for o in out["new"]]
    check_against_oracle(seed, "answers of the right length with other tokens", out["new"], same_length)


@COMPARE
def test_compare_outputs_on_random_edits_and_empty_answers(rng):
    r, seed = rng
    for _ in range(40):
        expected = [[r.randrange(50) for _ in range(r.randint(0, 10))] for _ in range(r.randint(1, 7))]
        got = [edited(r, e) for e in expected]
        check_against_oracle(seed, f"expected {expected}, got {got}", expected, got)
    check_against_oracle(seed, "every answer empty, as expected", [[], [], []], [[], [], []])
    check_against_oracle(seed, "every answer empty, tokens expected", [[1, 2], [3]], [[], []])


@COMPARE
def test_compare_outputs_refuses_mismatched_and_empty_sets(rng):
    r, seed = rng
    k = r.randint(2, 6)
    expected = [[r.randrange(50) for _ in range(4)] for _ in range(k)]
    for got in (expected[: r.randrange(k)], expected + [[1, 2]]):
        with pytest.raises(ValueError):
            production.compare_outputs(expected, copy.deepcopy(got))
            pytest.fail(f"{seed}: {k} expected answers and {len(got)} answers must raise ValueError")
    with pytest.raises(ValueError):
        production.compare_outputs([], [])
        pytest.fail(f"{seed}: an empty request set must raise ValueError (agreement of nothing is not 1.0)")


# ---- ch09.rollback ------------------------------------------------------------------------

@pytest.fixture
def world(tmp_path, rng):
    """An engine on v1 served from a copy that is deleted (a rollback cannot read it), v2,
    a corrupted v2, and v2's recorded answers."""
    r, seed = rng
    v1 = make_random(tmp_path / "v1", "tiny", seed=r.randrange(10_000))
    v2 = make_random(tmp_path / "v2", "tiny", seed=r.randrange(10_000, 20_000))
    served_from = shutil.copytree(v1, tmp_path / "served")
    engine = Engine(served_from)
    shutil.rmtree(served_from)
    engine.update_weight_version(f"v1-{r.randrange(1000)}")
    prompts, n = prompts_for(r, 4), r.randint(6, 10)
    reference = production.greedy_outputs(Engine(v2), prompts, n)
    for attempt in range(5):  # a corruption that changes no answer would prove nothing
        bad, layer = corrupted(r, v2, tmp_path / f"bad{attempt}")
        if production.greedy_outputs(Engine(bad), prompts, n) != reference:
            break
    return dict(r=r, seed=f"{seed} (corrupted {layer})", v1=v1, v2=v2, bad=bad, layer=layer, engine=engine,
                prompts=prompts, n=n, reference=reference, tmp=tmp_path)


def assert_old_version_serves(w, before, before_addr, version):
    engine, seed = w["engine"], w["seed"]
    assert all(torch.equal(before[n], t) for n, t in weights(engine).items()), \
        f"{seed}: after the rollback the weights must be bitwise the old ones"
    assert addresses(engine) == before_addr, f"{seed}: storage address unchanged (roll back by copying in place)"
    engine.verify_addresses()
    assert engine.weight_version == version, f"{seed}: the old version label {version!r} is back, not {engine.weight_version!r}"
    assert_serving(engine, seed)


@ROLLBACK
def test_a_bad_canary_is_rolled_back_from_host_memory(world):
    w = world
    engine, seed = w["engine"], w["seed"]
    before, before_addr, version = weights(engine), addresses(engine), engine.weight_version
    try:
        got = production.promote_or_rollback(engine, w["bad"], w["prompts"], w["reference"], "v2",
                                             max_new_tokens=w["n"])
    except Exception as exc:  # noqa: BLE001 - the old checkpoint is gone: a rollback reading disk fails here
        pytest.fail(f"{seed}: promote_or_rollback raised {type(exc).__name__}: {exc}")
    assert got["decision"] == "rolled_back", f"{seed}: a corrupted layer is rolled back, not {got['decision']!r}"
    assert got["agreement"] < 1.0 and got["reasons"], f"{seed}: the reasons say why ({got['reasons']})"
    assert isinstance(got["comparison"], dict) and got["comparison"].get("agreement") == got["agreement"], \
        f"{seed}: 'comparison' holds what compare returned ({got['comparison']!r})"
    assert_old_version_serves(w, before, before_addr, version)
    assert_hot_equals_cold(engine, w["v1"], w["prompts"][:2], max_new_tokens=4)


@ROLLBACK
def test_a_good_canary_is_promoted_against_a_reference_engine(world):
    w = world
    engine, seed = w["engine"], w["seed"]
    before_addr = addresses(engine)
    version = f"v2-{w['r'].randrange(1000)}"
    # A request in flight: the update must pause generation first (the engine refuses otherwise).
    engine.add_request(w["prompts"][0], {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True})
    engine.step()
    got = production.promote_or_rollback(engine, w["v2"], w["prompts"], Engine(w["v2"]), version,
                                         max_new_tokens=w["n"])
    assert got["decision"] == "promoted" and got["reasons"] == [], \
        f"{seed}: the intended version is promoted, not {got['decision']!r} ({got['reasons']})"
    assert got["agreement"] == 1.0 and got["rollback"] is None, f"{seed}: agreement 1.0, no rollback"
    assert engine.weight_version == version, f"{seed}: serving version {version!r}, not {engine.weight_version!r}"
    assert addresses(engine) == before_addr, f"{seed}: storage address unchanged"
    assert_serving(engine, seed)
    assert_hot_equals_cold(engine, w["v2"], w["prompts"][:2], max_new_tokens=4)


@ROLLBACK
def test_nan_weights_are_refused_and_the_old_version_serves(world):
    w = world
    engine, seed, r = w["engine"], w["seed"], w["r"]
    reader = CheckpointReader(w["v2"])
    tensors = {n: t.clone() for n, t in reader.iter_tensors()}
    last = reader.config.num_hidden_layers - 1  # streamed last: earlier layers are written, then put back
    name = r.choice(sorted(n for n in tensors if n.startswith(f"model.layers.{last}.") and n.endswith("proj.weight")))
    flat = tensors[name].view(-1)
    flat[r.randrange(flat.numel())] = float("nan")
    nan = write_checkpoint(w["tmp"] / "nan", reader.config, tensors)
    before, before_addr, version = weights(engine), addresses(engine), engine.weight_version
    try:
        got = production.promote_or_rollback(engine, nan, w["prompts"], w["reference"], "v2", max_new_tokens=w["n"])
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"{seed}: a NaN checkpoint must be reported, not raised: {type(exc).__name__}: {exc}")
    assert got["decision"] == "rejected" and got["update"] is None, \
        f"{seed}: NaN in {name} is refused by the update: 'rejected', not {got['decision']!r}"
    assert_old_version_serves(w, before, before_addr, version)
    assert_hot_equals_cold(engine, w["v1"], w["prompts"][:2], max_new_tokens=4)


@ROLLBACK
def test_a_partial_update_after_a_promotion_rolls_back_one_version(world):
    w = world
    engine, seed, r = w["engine"], w["seed"], w["r"]
    got = production.promote_or_rollback(engine, w["v2"], w["prompts"], w["reference"], "v2", max_new_tokens=w["n"])
    assert got["decision"] == "promoted", f"{seed}: v2 is promoted first, not {got['decision']!r}"
    before, before_addr = weights(engine), addresses(engine)
    # A partial checkpoint: the corrupted tensor (the one that changes answers) and a few others of v2.
    reader = CheckpointReader(w["bad"])
    keep = set(r.sample(sorted(reader.metadata()), 3)) | {w["layer"]}
    partial = write_checkpoint(w["tmp"] / "partial", reader.config,
                               {n: t for n, t in reader.iter_tensors() if n in keep})
    try:
        got = production.promote_or_rollback(engine, partial, w["prompts"], w["reference"], "v3",
                                             max_new_tokens=w["n"], partial=True)
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"{seed}: promote_or_rollback raised {type(exc).__name__}: {exc}")
    assert got["decision"] == "rolled_back", \
        f"{seed}: a partial update of {len(keep)} tensors corrupting one is rolled back, not {got['decision']!r}"
    assert_old_version_serves(w, before, before_addr, "v2")  # v2, the version before, not v1
    assert_hot_equals_cold(engine, w["v2"], w["prompts"][:2], max_new_tokens=4)


@ROLLBACK
def test_quality_alone_rolls_back_and_is_read_on_the_new_weights(world):
    w = world
    engine, seed, r = w["engine"], w["seed"], w["r"]
    before, before_addr, version = weights(engine), addresses(engine), engine.weight_version
    seen, score = [], r.uniform(-5, 5)

    def quality(e):
        seen.append((e is engine, e.weight_version))
        return score
    with pytest.raises(ValueError):
        production.promote_or_rollback(engine, w["v2"], w["prompts"], w["reference"], "v2", min_quality=0.0)
    assert all(torch.equal(before[n], t) for n, t in weights(engine).items()) and not engine.paused \
        and engine.weight_version == version, \
        f"{seed}: min_quality without quality raises before anything changes"
    got = production.promote_or_rollback(engine, w["v2"], w["prompts"], w["reference"], "v2", quality=quality,
                                         min_quality=score + 0.5, max_new_tokens=w["n"])
    assert seen == [(True, "v2")], f"{seed}: quality(engine) is read once on the updated engine, saw {seen}"
    assert got["decision"] == "rolled_back" and got["agreement"] == 1.0 and got["quality"] == score, \
        f"{seed}: the canary agrees but quality {score:.3f} < {score + 0.5:.3f}: rolled back ({got['decision']!r})"
    assert_old_version_serves(w, before, before_addr, version)
    got = production.promote_or_rollback(engine, w["v2"], w["prompts"], w["reference"], "v2", quality=quality,
                                         min_quality=score, max_new_tokens=w["n"])
    assert got["decision"] == "promoted", f"{seed}: quality equal to min_quality passes ({got['reasons']})"


# ---- ch09.host_snapshot: weights, addresses, version and runtime config measured here ----

def snapshot_world(tmp_path, r, quantization=None):
    config = preset("tiny", num_hidden_layers=r.choice([2, 3]), tie_word_embeddings=r.random() < 0.5)
    old = make_random(tmp_path / "old", config, seed=r.randrange(10_000))
    new = make_random(tmp_path / "new", config, seed=r.randrange(10_000, 20_000))  # never old's weights
    engine = Engine(old, quantization=quantization)
    state = {n: t.clone() for n, t in kernel_tensors(engine.model).items()}
    addresses = {n: t.data_ptr() for n, t in kernel_tensors(engine.model).items()}
    return old, new, engine, state, addresses


@SNAPSHOT
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_snapshot_then_two_updates_roll_back_to_the_snapshot(tmp_path, rng, quantization):
    """A snapshot taken by hand, then two updates without one: rollback restores the
    snapshot's weights (scales of a quantized engine included), addresses and version."""
    r, seed = rng
    old, new, engine, state, addresses = snapshot_world(tmp_path, r, quantization)
    engine.update_weight_version("v1")
    engine.take_snapshot()
    engine.update_weights_from_disk(new, weight_version="v2")
    engine.update_weights_from_disk(new, weight_version="v3", partial=True)
    engine.rollback()
    live = kernel_tensors(engine.model)
    moved = [n for n, t in live.items() if not torch.equal(state[n], t)]
    assert not moved, f"{seed}: after rollback {len(moved)} kernel tensors differ from the snapshot, e.g. {moved[:3]}"
    assert {n: t.data_ptr() for n, t in live.items()} == addresses, f"{seed}: a rollback copies in place"
    assert engine.weight_version == "v1", f"{seed}: the snapshot's label is back, not {engine.weight_version!r}"
    assert_hot_equals_cold(engine, old, ["a snapshot", "taken by hand"], max_new_tokens=4)


@SNAPSHOT
def test_the_snapshot_restores_the_runtime_config(tmp_path, rng):
    """An update that changes rope_theta and eos_token_id in config.json, rolled back: the
    engine's config equals the old one again (a snapshot holding the live config object
    would have followed the update)."""
    r, seed = rng
    old, new, engine, state, _ = snapshot_world(tmp_path, r)
    reader = CheckpointReader(new)
    changed = write_checkpoint(tmp_path / "changed", replace(reader.config, rope_theta=r.choice([5_000.0, 50_000.0]),
                                                            eos_token_id=r.randrange(200, 250)),
                               dict(reader.iter_tensors()))
    engine.update_weights_from_disk(changed, keep_snapshot=True)
    engine.rollback()
    assert engine.model_config == CheckpointReader(old).config, f"{seed}: the runtime fields are put back"
    assert engine.scheduler.eos_token_id == CheckpointReader(old).config.eos_token_id, seed
    assert_hot_equals_cold(engine, old, ["runtime fields", "rope and eos"], max_new_tokens=4)


@SNAPSHOT
def test_the_snapshot_is_a_copy_of_the_values(tmp_path, rng):
    """The values are copied when the snapshot is taken: writing the live tensors afterwards
    (here: an update in place) leaves the snapshot as it was."""
    r, seed = rng
    old, new, engine, state, _ = snapshot_world(tmp_path, r)
    snap = engine.take_snapshot()
    engine.update_weights_from_disk(new, weight_version="v2")
    followed = [n for n, t in snap.tensors.items() if not torch.equal(t, state[n])]
    assert not followed, f"{seed}: {len(followed)} snapshot tensors changed with the update, e.g. {followed[:3]}"


@SNAPSHOT
@pytest.mark.cuda
def test_the_snapshot_holds_its_values_when_it_returns_on_a_busy_gpu(tmp_path, rng):
    """The copies to host memory are queued behind other work on the stream: on return the
    snapshot must hold the values already (read at once, with no synchronization here)."""
    r, seed = rng
    v1 = make_random(tmp_path / "v1", "tiny", seed=r.randrange(10_000))
    v2 = make_random(tmp_path / "v2", "tiny", seed=r.randrange(10_000, 20_000))
    engine = Engine(v1, device="cuda")
    engine.take_snapshot()  # an earlier snapshot of other values: its freed pinned memory may come back
    engine.update_weights_from_disk(v2, weight_version="v2")
    want = {n: t.cpu() for n, t in kernel_tensors(engine.model).items()}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    end.synchronize()
    torch.cuda._sleep(int(1_000_000 * 300 / max(start.elapsed_time(end), 1e-3)))  # ~300 ms of queued work
    snap = engine.take_snapshot()
    wrong = [n for n, t in want.items() if not torch.equal(snap.tensors[n].view(torch.uint8).flatten(),
                                                            t.view(torch.uint8).flatten())]
    assert not wrong, (f"{seed}: right after take_snapshot() returned (the GPU busy with earlier work), "
                       f"{len(wrong)} of {len(want)} host tensors did not hold the live values yet (e.g. {wrong[0]}): "
                       f"the copies were still running; see the section on host snapshots (pinned, non-blocking copies)")
